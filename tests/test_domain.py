"""A kernel judged on its own domain: the masks it takes, causal only, its shapes (SPEC §13.19).

Small NumPy kernels of our own declare what real kernels declare (no mask, causal only,
D in {16, 32}, S % 16 == 0) and assert, inside the function, that they are never handed
anything else; the runs below show which tests run, which are skipped by name, and that a
bug inside the domain still fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conformance.adapters import profiles
from conformance.adapters.domain import Domain, parse_domain
from conformance.adapters.impl import FunctionBackend, resolve_impl
from conformance.adapters.interpreters import interpreter_words
from conformance.adapters.native import OptionMap
from conformance.backends import load_backend
from conformance.suite import domain as carrying
from conformance.suite.helpers import oracle_attention, random_qkv
from conformance.vocabulary import numpy_dtype

ROOT = Path(__file__).resolve().parent.parent

KERNELS = '''
"""Kernels that refuse, by assertion, anything outside what their profiles declare."""
import json, os

import numpy as np
from conformance.impls.numpy.attention import attention as reference

DROP_SCALE = {drop_scale}
LEAK = {leak}


def _log(**call):
    with open(os.environ["KERNEL_LOG"], "a") as f:
        f.write(json.dumps(call) + "\\n")


def tiled(q, k, v, is_causal=False, scale=None):
    """D in {{16, 32}}, S a multiple of 16, no mask."""
    _log(q=list(q.shape), k=list(k.shape), v=list(v.shape), causal=is_causal)
    assert q.shape[-1] in (16, 32) and v.shape[-1] in (16, 32), (q.shape, v.shape)
    assert k.shape[-2] % 16 == 0, k.shape
    return reference(q, k, v, is_causal=is_causal, scale=None if DROP_SCALE else scale)


def tiled_masked(q, k, v, mask=None, is_causal=False, scale=None):
    """D in {{16}}, T a multiple of 4, S a multiple of 16, a bool mask; with LEAK, a mask
    applied as a large negative number added to the scores (the bug of §4.7)."""
    _log(q=list(q.shape), k=list(k.shape), v=list(v.shape), causal=is_causal)
    assert q.shape[-1] == 16 and v.shape[-1] == 16, (q.shape, v.shape)
    assert q.shape[-2] % 4 == 0 and k.shape[-2] % 16 == 0, (q.shape, k.shape)
    if not LEAK or mask is None:
        return reference(q, k, v, mask=mask, is_causal=is_causal, scale=scale)
    bias = np.where(mask, 0.0, -1e9).astype(q.dtype)
    return reference(q, k, v, mask=bias, is_causal=is_causal, scale=scale)


def decode(q, k, v, scale=None):
    """One query (T = 1), no mask, no causality: a decode kernel."""
    _log(q=list(q.shape), k=list(k.shape), v=list(v.shape), causal=False)
    assert q.shape[-2] == 1, q.shape
    return reference(q, k, v, scale=scale)


def causal_only(q, k, v, scale=None):
    """Causal (top-left) and nothing else: no is_causal keyword, no mask."""
    _log(q=list(q.shape), k=list(k.shape), v=list(v.shape), causal=True)
    return reference(q, k, v, is_causal=True, scale=scale)
'''

TILED = """
name = "kern.tiled"
target = "kern:tiled"
dtypes = ["float64", "float32"]

[options]
is_causal = "is_causal"
scale = "scale"

[mask]
bool = false
float = false

[domain]
head_dims = [16, 32]
s_multiple = 16
"""

TILED_MASKED = """
name = "kern.tiled_masked"
target = "kern:tiled_masked"
dtypes = ["float64", "float32"]

[options]
is_causal = "is_causal"
scale = "scale"

[mask]
bool = "mask"
float = false

[domain]
head_dims = [16]
t_multiple = 4
s_multiple = 16
"""

DECODE = """
name = "kern.decode"
target = "kern:decode"
dtypes = ["float64", "float32"]

[options]
scale = "scale"

[mask]
bool = false
float = false

[domain]
max_t = 1
"""

CAUSAL_ONLY = """
name = "kern.causal_only"
target = "kern:causal_only"
dtypes = ["float64", "float32"]

[options]
scale = "scale"

[mask]
bool = false
float = false

[forms]
causal = "only"
"""


def _kernel(tmp_path: Path, profile: str, *, drop_scale: bool = False, leak=False) -> Path:
    (tmp_path / "kern.py").write_text(KERNELS.format(drop_scale=drop_scale, leak=leak))
    path = tmp_path / "kern.toml"
    path.write_text(profile)
    return path


def _run(tmp_path: Path, profile: Path, *modules: str, args=()) -> tuple[int, str, list[dict]]:
    log = tmp_path / "calls.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *(str(ROOT / "conformance/tests" / m) for m in modules)]
        + ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0", "-rs"]
        + [f"--impl-profile={profile}", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "KERNEL_LOG": str(log)},
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return run.returncode, run.stdout + run.stderr, calls


@pytest.mark.clause("13.19")
def test_a_tiled_kernel_without_masks_is_judged_inside_its_domain(tmp_path):
    path = _kernel(tmp_path, TILED)
    code, out, calls = _run(tmp_path, path, "test_invariants.py", "test_fixtures.py")
    assert code == 0, out[-4000:]
    assert " passed" in out and " failed" not in out, out[-3000:]
    # The mask tests are skipped by name, never handed to it; so is what has no carry.
    assert "kern.tiled lacks form 'mask_bool': a bool mask" in out, out[-3000:]
    assert "kern.tiled lacks form 'mask_float'" in out, out[-3000:]
    assert "outside the domain of kern.tiled" in out, out[-3000:]
    # Every call it got lay inside its domain (the kernel asserts it too).
    assert calls and all(c["q"][-1] in (16, 32) and c["k"][-2] % 16 == 0 for c in calls)
    # The summary says what it was judged on, and what no call of reached.
    assert "kern.tiled judged on: dtypes float64, float32; forms it does not take:" in out
    assert "shapes D, E in {16, 32}; S a multiple of 16" in out
    assert "kern.tiled: sizes drawn inside its domain: T13-S7 -> T17-S16" in out
    untested = next(line for line in out.splitlines() if "untested, no call" in line)
    assert "§6.4" in untested and "§6.2" not in untested, untested


@pytest.mark.clause("13.19")
def test_a_bug_inside_the_domain_still_fails(tmp_path):
    """A kernel that drops the scale it is passed: the carried calls (D = 4 or 5 padded to
    16, the scale 1/sqrt(D) passed) show it, as real calls of other scales would."""
    path = _kernel(tmp_path, TILED, drop_scale=True)
    code, out, _ = _run(tmp_path, path, "test_fixtures.py", args=["-k", "test_fixture_case"])
    assert code == 1 and " failed" in out, out[-3000:]


@pytest.mark.clause("4.7", "13.19")
@pytest.mark.parametrize("leak", [False, True], ids=["right", "adds-a-large-negative"])
def test_unused_slots_are_built_inside_the_domain(tmp_path, leak):
    """§4.7's problems (T = 5, S = 9, D = 4) are drawn at the domain's T = 8, S = 16,
    D = 16 rather than carried (carrying would add queries that read the garbage): the
    kernel is judged on them, every call inside its domain, the move in the summary, and a
    kernel whose mask adds -1e9 lets the garbage through and fails."""
    path = _kernel(tmp_path, TILED_MASKED, leak=leak)
    code, out, calls = _run(
        tmp_path, path, "test_edges.py", args=["-k", "unused_slots_hold_anything"]
    )
    assert calls and all(c["q"][-1] == 16 and c["k"][-2] % 16 == 0 for c in calls)
    assert all(c["q"][-2] % 4 == 0 for c in calls)
    assert "T5-S9-D4-E4 -> T8-S16-D16-E16 (unused slots)" in out, out[-3000:]
    assert " passed" in out, out[-3000:]
    if not leak:
        assert code == 0 and " failed" not in out, out[-4000:]
        assert "would attend keys that no query of it attends" not in out, out[-3000:]
    else:
        assert code == 1, out[-3000:]
        assert "garbage (NaN, ±inf, the largest number) in key slots" in out, out[-3000:]


def test_per_position_tests_take_every_position_or_the_tile_edges():
    """Every i where there are at most 32 (the suite's own sizes), the tile edges of the
    domain's multiples beyond that (SPEC §13.19)."""
    tiled = _Kernel(Domain(t_multiple=16, s_multiple=128), ALL)
    assert carrying.positions(tiled, 12) == list(range(12))
    assert carrying.positions(tiled, 32) == list(range(32))
    taken = carrying.positions(tiled, 127)
    assert taken[:5] == [0, 1, 15, 16, 17] and taken[-4:] == [111, 112, 113, 126]
    assert len(taken) == 24
    backward = _Kernel(Domain(backward=Domain(s_multiple=64)), ALL)
    assert carrying.positions(backward, 127, "attention_vjp") == [0, 1, 63, 64, 65, 126]


@pytest.mark.clause("13.17", "13.19")
def test_a_causal_only_kernel_gets_causal_calls_only(tmp_path):
    path = _kernel(tmp_path, CAUSAL_ONLY)
    code, out, calls = _run(tmp_path, path, "test_invariants.py")
    assert code == 0, out[-4000:]
    assert " passed" in out and " failed" not in out, out[-3000:]
    assert "kern.causal_only lacks form 'non_causal'" in out, out[-3000:]
    assert calls
    # Non-causal clauses it could not be judged on are listed, not passed in silence.
    assert "kern.causal_only: untested, no call of theirs fits" in out, out[-3000:]


def test_a_causal_only_function_refuses_other_calls():
    def causal(q, k, v, scale=None):
        return q

    call = OptionMap(options={"scale": "scale"}, mask_bool=None, mask_float=None, causal="only")
    backend = FunctionBackend(causal, name="c", call=call)
    assert "non_causal" not in backend.forms and "causal" in backend.forms
    assert not {"mask_bool", "mask_float"} & backend.forms
    q = np.zeros((1, 1, 2, 2))  # (B, H, T, D)
    with pytest.raises(NotImplementedError, match="causal only"):
        backend.attention(q, q, q)
    backend.attention(q, q, q, is_causal=True)
    impl = resolve_impl("conformance.impls.numpy.attention:attention", causal="only", mask="none")
    assert "non_causal" not in impl.forms and "mask_bool" not in impl.forms
    bools = resolve_impl("conformance.impls.numpy.attention:attention", mask="bool")
    assert "mask_bool" in bools.forms and "mask_float" not in bools.forms


class _Kernel:
    """A backend with a domain, recording what it is handed."""

    name = "k"
    dtypes = ("float64",)

    def __init__(self, domain: Domain, forms, capabilities=()):
        self.domain = domain
        self.forms = frozenset(forms)
        self.capabilities = frozenset(capabilities)


ALL = {
    "causal",
    "causal_top_left",
    "window_right",
    "scale",
    "non_causal",
    "mask_bool",
    "mask_float",
}


@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True},
        {"is_causal": True, "causal_alignment": "bottom_right"},
        {"window": (2, 1), "causal_alignment": "bottom_right"},
        {"mask": "bool", "is_causal": True},
        {},
    ],
    ids=["top-left", "bottom-right", "window-bottom-right", "mask", "plain"],
)
def test_a_carried_call_gives_the_oracles_output(options):
    """T = 5, S = 3, D = 3 carried to T = 8, S = 8, D = 8: the rows the test sees are the
    oracle's for the test's own inputs. (Every key is attended by some query: the added
    queries read no key that the call leaves unused.)"""
    kernel = _Kernel(Domain(head_dims=(8,), t_multiple=4, s_multiple=8), ALL)
    q, k, v = random_qkv(3, B=1, H=2, T=5, S=3, D=3)
    options = dict(options)
    if options.get("mask") == "bool":
        options["mask"] = np.random.default_rng(0).random((5, 3)) > 0.3  # (T, S)
        assert options["mask"].any(axis=0).all()
    args, kwargs, back = carrying.carry(kernel, "attention", (q, k, v), options)
    assert args[0].shape == (1, 2, 8, 8) and args[1].shape == (1, 2, 8, 8)
    assert kwargs["scale"] == pytest.approx(1 / np.sqrt(3))
    from conformance.impls.numpy.attention import attention

    out = back(attention(*args, **kwargs))
    want = oracle_attention(q, k, v, **options)
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-13)


def test_a_carried_backward_gives_the_gradients_of_the_test_inputs():
    reference = load_backend("numpy")
    kernel = _Kernel(Domain(head_dims=(8,), s_multiple=8), ALL, ["grad"])
    q, k, v = random_qkv(4, B=1, H=2, T=3, S=5, D=3)
    d_out = np.random.default_rng(1).standard_normal((1, 2, 3, 3))  # (B, H, T, E)
    args, kwargs, back = carrying.carry(kernel, "attention_vjp", (q, k, v, d_out), {})
    grads = back(reference.attention_vjp(*args, **kwargs))
    want = reference.attention_vjp(q, k, v, d_out)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-13)


def test_what_has_no_exact_carry_is_skipped_by_name():
    kernel = _Kernel(Domain(head_dims=(8,), s_multiple=8), ALL - {"mask_bool", "mask_float"})
    q, k, v = random_qkv(5, B=1, H=1, T=3, S=5, D=3)
    with pytest.raises(pytest.skip.Exception, match="takes no mask to block the keys"):
        carrying.carry(kernel, "attention", (q, k, v), {})
    no_scale = _Kernel(Domain(head_dims=(8,)), ALL - {"scale"})
    with pytest.raises(pytest.skip.Exception, match="takes no scale keyword"):
        carrying.carry(no_scale, "attention", (q, k, v), {})
    with pytest.raises(pytest.skip.Exception, match="lacks form 'mask_float'"):
        carrying.carry(kernel, "attention", (q, k, v), {"mask": np.zeros((3, 5))})
    # Keys 3 and 4 of a top-left causal T = 3, S = 5 are attended by no query: queries
    # added to reach T = 4 would attend key 3, and what it holds would reach them.
    tiled = _Kernel(Domain(head_dims=(8,), t_multiple=4, s_multiple=8), ALL)
    with pytest.raises(pytest.skip.Exception, match="would attend keys that no query of it"):
        carrying.carry(tiled, "attention", (q, k, v), {"is_causal": True})
    column = np.ones((3, 5), dtype=bool)  # (T, S)
    column[:, 4] = False
    with pytest.raises(pytest.skip.Exception, match="would attend keys that no query of it"):
        carrying.carry(tiled, "attention", (q, k, v), {"mask": column})
    carrying.carry(tiled, "attention", (q, k, v), {"mask": np.ones((3, 5), dtype=bool)})


def test_sizes_move_inside_the_domain_keeping_their_order():
    domain = Domain(s_multiple=16, t_multiple=1)
    assert carrying.inside(domain, 7, 13) == (7, 16)
    assert carrying.inside(domain, 13, 7) == (17, 16)
    assert carrying.inside(domain, 8, 8) == (16, 16)
    assert carrying.inside(domain, 0, 6) == (0, 6)
    assert carrying.inside(Domain(s_multiple=16, t_multiple=16, square=True), 7, 13) == (16, 16)


def test_a_decode_kernel_takes_one_query_and_is_never_handed_more():
    """``max_t = 1`` (a decode kernel): a size at T = 1 moves only along S, a size with more
    queries stays as it is (its tests are skipped by name), and a carried call with more
    queries is skipped by name, never split or moved to T = 32."""
    domain = parse_domain({"max_t": 1, "s_multiple": 32}, "d")
    assert domain.why_not(2, 32, 8, 8) == "T = 2 is above its most 1"
    assert domain.why_not(1, 32, 8, 8) is None
    assert "T <= 1" in domain.words()
    assert carrying.inside(domain, 1, 1) == (1, 1)  # not T32-S32: T = S has no room here
    assert carrying.inside(domain, 1, 9) == (1, 32)
    assert carrying.inside(domain, 7, 13) == (7, 13)
    kernel = _Kernel(domain, ALL)
    q, k, v = random_qkv(5, B=1, H=1, T=3, S=5, D=3)
    with pytest.raises(pytest.skip.Exception, match="T = 3 is above its most 1"):
        carrying.carry(kernel, "attention", (q, k, v), {})
    q1 = q[..., :1, :]  # (B, H, 1, D)
    (carried, *_), options, back = carrying.carry(kernel, "attention", (q1, k, v), {})
    assert carried.shape[-2] == 1 and options["mask"].shape[-2:] == (1, 32)
    with pytest.raises(ValueError, match="max_t should be a positive integer"):
        parse_domain({"max_t": 0}, "d")


def test_a_decode_kernel_is_judged_at_one_query(tmp_path):
    """A run of the fixtures on a decode kernel: the T = 1 fixtures run at T = 1, those
    with more queries are skipped by name, and the kernel (which asserts T = 1) never
    sees another T."""
    code, out, calls = _run(
        tmp_path, _kernel(tmp_path, DECODE), "test_fixtures.py", args=["-k", "T1-S or T7-S7"]
    )
    assert code == 0, out[-3000:]
    assert calls and {c["q"][-2] for c in calls} == {1}, calls
    assert "T = 7 is above its most 1" in out, out[-3000:]
    assert " passed" in out and " skipped" in out, out[-3000:]


def test_head_dims_can_be_a_list_of_ranges():
    """ "D <= 128, or a multiple of 128" (a TPU kernel's): a list of ranges."""
    domain = parse_domain(
        {"head_dims": [{"max": 128}, {"min": 128, "max": 512, "multiple": 128}]}, "d"
    )
    assert all(domain.head_dim_ok(d) for d in (1, 5, 64, 128, 256, 512))
    assert not any(domain.head_dim_ok(d) for d in (129, 200, 640))
    assert domain.next_head_dim(129) == 256 and domain.next_head_dim(600) is None
    assert (
        domain.why_not(8, 8, 200, 200)
        == "D = 200 is not a head dim of 1..128 or 128..512 in steps of 128"
    )
    mixed = parse_domain({"head_dims": [16, {"min": 64, "max": 256, "multiple": 64}]}, "d")
    assert mixed.next_head_dim(17) == 64 and mixed.head_dim_ok(16) and not mixed.head_dim_ok(32)
    with pytest.raises(ValueError, match="or a list of both"):
        parse_domain({"head_dims": [16, "x"]}, "d")


def test_a_query_tile_that_depends_on_the_dtype():
    """``t_multiple = {float32 = 8, bfloat16 = 16}``: a float32 call at T = 8 is inside the
    domain as it is; the same call in bfloat16 is carried to T = 16."""
    domain = parse_domain({"t_multiple": {"float32": 8, "bfloat16": 16}}, "d")
    assert domain.for_dtype("float32").t_multiple == 8
    assert domain.for_dtype("bfloat16").t_multiple == 16
    assert domain.t_multiple == 16  # where the dtype is not known: the larger tile
    assert "T a multiple of 16 in bfloat16, 8 in float32" in domain.words()
    kernel = _Kernel(domain, ALL)
    q, k, v = random_qkv(5, B=1, H=1, T=8, S=8, D=4)
    (q32, *_), _, _ = carrying.carry(kernel, "attention", (q.astype(np.float32), k, v), {})
    assert q32.shape[-2] == 8
    bf16 = numpy_dtype("bfloat16")
    (q16, *_), _, _ = carrying.carry(kernel, "attention", (q.astype(bf16), k, v), {})
    assert q16.shape[-2] == 16
    with pytest.raises(ValueError, match="t_multiple per dtype"):
        parse_domain({"t_multiple": {"float32": 0}}, "d")


def test_a_profile_declares_its_domain(tmp_path):
    table = {"head_dims": {"min": 16, "max": 256, "multiple": 16}, "s_multiple": 16}
    domain = parse_domain({**table, "backward": {"s_multiple": 128}}, "d")
    assert domain.head_dim_ok(64) and not domain.head_dim_ok(8) and domain.next_head_dim(5) == 16
    assert domain.of("attention_vjp").s_multiple == 128 and domain.of("attention").s_multiple == 16
    assert domain.why_not(16, 24, 16, 16) == "S = 24 is not a multiple of 16"
    assert "backward: D, E in 16..256 in steps of 16; S a multiple of 128" in domain.words()
    with pytest.raises(ValueError, match="unknown keys"):
        parse_domain({"tile": 16}, "d")
    with pytest.raises(ValueError, match="head_dims should be"):
        parse_domain({"head_dims": [0]}, "d")
    path = tmp_path / "p.toml"
    path.write_text(TILED.replace("[mask]", '[forms]\nmasks = ["float"]\n\n[mask]'))
    with pytest.raises(profiles.ProfileError, match="masks"):
        profiles.read_profile(path)


def test_jax_float64_only_where_declared():
    """A JAX function that declares no float64 leaves JAX's default; one that does turns
    x64 on, and the run's settings say who asked."""
    script = textwrap.dedent(
        """
        import jax
        from conformance.adapters.impl import resolve_impl
        from conformance.backends import arrays

        resolve_impl("jax.nn:dot_product_attention", framework="jax", dtypes="float32")
        print(jax.config.jax_enable_x64, dict(arrays.GLOBAL_SETTINGS))
        resolve_impl("jax.nn:dot_product_attention", framework="jax", dtypes="float64")
        print(jax.config.jax_enable_x64, dict(arrays.GLOBAL_SETTINGS))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    first, second = run.stdout.splitlines()[-2:]
    assert first == "False {}"
    assert second.startswith("True {'jax_enable_x64 = True': ") and "declares float64" in second


def test_the_pallas_profiles_declare_their_domains():
    gpu = profiles.read_profile("pallas.gpu.mha")
    assert not {"mask_bool", "mask_float"} & gpu.forms and "non_causal" in gpu.forms
    assert gpu.domain.words() == (
        "D, E in {16, 32, 64, 128}; T a multiple of 16; S a multiple of 16 "
        "(backward: D, E in {16, 32, 64, 128}; T a multiple of 16; S a multiple of 16; T = S)"
    )
    assert gpu.interpreter == "pallas"
    assert interpreter_words(gpu.interpreter).startswith(
        "Pallas' interpreter (interpret=True), jax "
    )
    tpu = profiles.read_profile("pallas.tpu.flash_attention")
    assert "mask_float" in tpu.forms and tpu.domain.s_multiple == 128
    assert "float64" not in gpu.dtypes + tpu.dtypes  # neither switches JAX's x64 on


def test_the_triton_tutorial_example_declares_its_domain():
    """examples/triton_fused_attention.toml (not run in CI: docs/test-a-gpu-kernel.md)
    parses to the tutorial's domain: no mask, both causal forms, float16, its head dims and
    tiles, under Triton's interpreter."""
    tutorial = profiles.read_profile(ROOT / "examples" / "triton_fused_attention.toml")
    assert not {"mask_bool", "mask_float"} & tutorial.forms
    assert {"causal", "non_causal"} <= tutorial.forms
    assert tuple(tutorial.dtypes) == ("float16",) and tutorial.interpreter == "triton"
    assert tutorial.domain.words() == (
        "D, E in {32, 64, 128, 256}; T a multiple of 64; S a multiple of 64"
    )
