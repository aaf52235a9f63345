"""Causality through the mask, and a function judged on the forms it takes (SPEC §13.17).

Model code rarely has an ``is_causal``: it builds causality into the mask it hands the
attention function. A profile (or ``--impl-causal mask``) says so, and the suite hands
such a function SPEC §1's visibility as its mask; its causal clauses then run and judge
what it does. A function that takes no causality at all has its causal tests skipped by
name, and the forms a profile leaves out (top-left alignment, a window's right side, a
scale) are never passed to it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conformance.adapters import forms, profiles
from conformance.adapters.impl import FunctionBackend, resolve_impl
from conformance.adapters.native import OptionMap
from conformance.suite.requirements import lacking, undeclared

ROOT = Path(__file__).resolve().parent.parent

#: A model's attention: NumPy, a bool ``attention_mask`` (True = attend) and nothing else
#: of the spec's options but a scale. ``IGNORE_CAUSAL`` plants the bug: only the keys
#: some query may see are kept (the padding), the mask's causal triangle is lost.
MODEL = '''
"""A model's attention function, causality in the mask it is handed."""
import numpy as np

IGNORE_CAUSAL = {ignore}


def attend(q, k, v, attention_mask=None, scaling=None):
    scale = 1 / np.sqrt(q.shape[-1]) if scaling is None else scaling
    scores = (q @ np.swapaxes(k, -1, -2)) * scale
    if attention_mask is not None:
        keep = np.broadcast_to(attention_mask, scores.shape)
        if IGNORE_CAUSAL:
            keep = np.broadcast_to(keep.any(axis=-2, keepdims=True), scores.shape)
        scores = np.where(keep, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(scores - top)
    total = e.sum(axis=-1, keepdims=True)
    w = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)
    return (w @ v).astype(q.dtype)
'''

PROFILE = """
name = "model.attend"
description = "a model's attention, causality in its mask"
target = "model:attend"
requires = ["numpy"]
capabilities = ["causal_bottom_right", "window"]

[options]
scale = "scaling"

[mask]
bool = "attention_mask"

[forms]
causal = "mask"
"""

#: The causal clauses: top-left and bottom-right causality and windows, none of which the
#: function has a keyword for.
CAUSAL_TESTS = (
    "test_no_future_leakage or test_weight_rows_sum_to_one or test_convex_hull"
    " or test_top_left_single_query or test_kv_cache_decode or test_window_identities"
)


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "-q", "-p", "no:cacheprovider"]
        + ["-p", "no:randomly", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )


def _model(tmp_path: Path, *, ignore_causal: bool, profile: str = PROFILE) -> Path:
    (tmp_path / "model.py").write_text(MODEL.format(ignore=ignore_causal))
    path = tmp_path / "model.toml"
    path.write_text(profile)
    return path


@pytest.mark.clause("13.17")
def test_a_function_with_causality_in_its_mask_passes_the_causal_clauses(tmp_path):
    path = _model(tmp_path, ignore_causal=False)
    run = _pytest(tmp_path, f"--impl-profile={path}", "-k", CAUSAL_TESTS, "-rs")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert " passed" in out and " failed" not in out and "skipped" not in out, out[-2000:]


@pytest.mark.clause("13.17")
def test_ignoring_the_causal_part_of_the_mask_fails_the_causal_clauses(tmp_path):
    path = _model(tmp_path, ignore_causal=True)
    run = _pytest(tmp_path, f"--impl-profile={path}", "-k", CAUSAL_TESTS)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-4000:]
    for test in ("test_no_future_leakage", "test_convex_hull", "test_kv_cache_decode"):
        assert "FAILED " in out and test in out, f"{test} did not fail: {out[-3000:]}"
    assert "SuiteError" not in out and "NotImplementedError" not in out, out[-3000:]


@pytest.mark.clause("13.17")
def test_an_additive_mask_as_models_build_it(tmp_path):
    """``--impl-causal mask --impl-mask additive-min``: a function that adds its mask gets
    0 and finfo(dtype).min, and its causal tests judge it."""
    (tmp_path / "adding.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            def attention(q, k, v, *, mask=None, scale=None):
                scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
                scores = (q @ np.swapaxes(k, -1, -2)) * scale
                if mask is not None:
                    assert mask.dtype == q.dtype, mask.dtype
                    scores = scores + mask
                scores = scores - scores.max(axis=-1, keepdims=True)
                e = np.exp(scores)
                return ((e / e.sum(axis=-1, keepdims=True)) @ v).astype(q.dtype)
            """
        )
    )
    args = ["--impl=adding:attention", "--impl-causal=mask", "--impl-mask=additive-min"]
    run = _pytest(tmp_path, *args, "-k", "test_no_future_leakage or test_top_left_single")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert " passed" in out and " failed" not in out, out[-2000:]


@pytest.mark.clause("13.17")
def test_no_causality_at_all_skips_the_causal_tests_by_name(tmp_path):
    """No is_causal keyword and no mask: the causal tests are skipped, naming the form;
    the tests whose clause is not about causality still run, unmasked."""
    profile = PROFILE.replace('causal = "mask"', 'causal = "none"').replace(
        'bool = "attention_mask"', "bool = false"
    )
    profile = profile.replace('capabilities = ["causal_bottom_right", "window"]', "")
    path = _model(tmp_path, ignore_causal=False, profile=profile)
    selected = "test_no_future_leakage or test_batch_and_head_independence or test_weight_rows_sum"
    run = _pytest(tmp_path, f"--impl-profile={path}", "-k", selected, "-rs")
    out = run.stdout + run.stderr
    assert "model.attend lacks form 'causal'" in out, out[-3000:]
    assert "test_batch_and_head_independence" not in out.split("short test summary")[-1]
    assert run.returncode == 0 and " passed" in out, out[-3000:]
    assert "SuiteError" not in out, out[-3000:]


# --- The conversion itself --------------------------------------------------------------------


def test_the_mask_holds_the_visibility_combined_with_the_case_mask():
    seen = {}

    def attend(q, k, v, attention_mask=None):
        seen["mask"] = attention_mask
        return np.zeros((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)

    call = OptionMap(options={}, mask_bool="attention_mask", mask_float=None, causal="mask")
    backend = FunctionBackend(
        attend, name="m", capabilities=["window", "causal_bottom_right"], call=call
    )
    q = np.zeros((1, 1, 3, 2))  # (B, H, T, D)
    k = v = np.zeros((1, 1, 5, 2))  # (B, K, S, D)
    padding = np.array([True, True, True, True, False])  # (S,)
    backend.attention(q, k, v, mask=padding, is_causal=True)
    assert (seen["mask"] == np.tril(np.ones((3, 5), bool)) & padding).all()
    backend.attention(q, k, v, is_causal=True, causal_alignment="bottom_right", window=(1, 0))
    want = np.array([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], bool)  # (T, S)
    assert (seen["mask"] == want).all()
    backend.attention(q, k, v)
    assert seen["mask"] is None


def test_an_additive_mask_fills_blocked_keys_with_the_profile_value():
    call = OptionMap(options={}, mask_bool=None, mask_float="bias", causal="mask", blocked="min")
    rest, mask = forms.through_the_mask({"is_causal": True}, None, 2, 2, call.options, "min")
    assert rest == {} and mask.dtype == np.bool_
    converted = call.mask("f", mask, np.dtype("float32"))["bias"]
    assert converted.dtype == np.float32
    assert converted[0, 1] == np.finfo(np.float32).min and converted[1, 0] == 0
    float_mask = np.array([[0.5, np.nan], [np.inf, -1.0]], np.float32)  # (T, S)
    _, combined = forms.through_the_mask({"is_causal": True}, float_mask, 2, 2, {}, "-inf")
    # The blocked key's NaN is replaced, as model code fills it; the others are added.
    assert combined[0, 1] == -np.inf and np.isinf(combined[1, 0]) and combined[1, 1] == -1


def test_bad_options_are_refused_in_the_contracts_words():
    with pytest.raises(TypeError, match="is_causal should be a bool"):
        forms.visibility(2, 2, {"is_causal": 1})
    with pytest.raises(ValueError, match="causal_alignment should be one of"):
        forms.visibility(2, 2, {"is_causal": True, "causal_alignment": "middle"})
    with pytest.raises(ValueError, match="window should be a pair"):
        forms.visibility(2, 2, {"window": (-1, 0)})


# --- Forms held against what a backend takes -----------------------------------------------------


@pytest.mark.parametrize(
    "options, T, S, used",
    [
        ({"is_causal": True}, 4, 4, ["causal"]),
        ({"is_causal": True}, 3, 4, ["causal", "causal_top_left"]),
        ({"is_causal": True, "causal_alignment": "bottom_right"}, 3, 4, ["causal"]),
        ({"window": (2, 1)}, 3, 4, ["non_causal", "causal_top_left", "window_right"]),
        ({"window": (2, None), "is_causal": True}, 4, 4, ["causal"]),
        ({"window": (None, None)}, 3, 4, ["non_causal"]),
        ({"scale": 0.5}, 3, 4, ["non_causal", "scale"]),
        ({"scale": None, "is_causal": False}, 3, 4, ["non_causal"]),
        (
            {"mask": np.ones((3, 4), bool), "is_causal": True},
            3,
            4,
            ["causal", "mask_bool", "causal_top_left"],
        ),
        ({"mask": np.zeros((3, 4), np.float32)}, 3, 4, ["non_causal", "mask_float"]),
        ({"mask": np.zeros((3, 4), np.int64)}, 3, 4, ["non_causal", "mask_bool"]),
    ],
)
def test_the_forms_a_call_uses(options, T, S, used):
    assert forms.forms_used(options, T, S) == used


def test_a_form_not_taken_is_the_suites_error_and_a_skip_by_name():
    gqa = profiles.read_profile("onnxruntime.GroupQueryAttention")
    flax = profiles.read_profile("flax.nnx.dot_product_attention")
    assert gqa.forms == {"causal", "scale", *forms.CALL_FORMS} and "scale" not in flax.forms

    class Taker:
        name, capabilities, dtypes = "taker", frozenset({"window"}), ("float64",)
        forms = frozenset({"causal"})

    q, k, v = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2))  # T3, S4
    found = undeclared(Taker(), "attention", (q, k, v), {"is_causal": True, "scale": 0.5})
    assert [f.split(" (")[0] for f in found] == ["form 'causal_top_left'", "form 'scale'"]
    square = undeclared(Taker(), "attention", (q, k[:, :, :3], v[:, :, :3]), {"is_causal": True})
    assert square == []
    assert lacking(Taker(), ["causal", "window_right"], []) == (
        f"taker lacks form 'window_right': {forms.FORMS['window_right']}"
    )


def test_impl_causal_mask_builds_windows_and_chunks_into_the_mask():
    backend = resolve_impl(
        "conformance.impls.numpy.attention:attention",
        capabilities="causal_bottom_right,window",
        causal="mask",
    )
    assert backend.call.causal == "mask" and "window" not in backend.call.options
    assert backend.forms == forms.ALL_FORMS
    none = resolve_impl("conformance.impls.numpy.attention:attention", causal="none")
    assert "causal" not in none.forms
    with pytest.raises(ValueError, match="--impl-causal 'sometimes' is unknown"):
        resolve_impl("conformance.impls.numpy.attention:attention", causal="sometimes")
