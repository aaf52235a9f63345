"""SPEC §20: a quantized departure is named by the misreading it shows.

Each misreading of ``conformance/suite/quantized_diagnosis.py`` is planted in a correct
function, the NumPy quantized page (``conformance.impls.numpy.quantized``), by calling it
with the misread descales (or, for q's descale indexed by the query head, once per query
head); its output is held to SPEC §20.6's bound against the oracle on the dequantised
operands, as ``conformance/tests/test_quantized.py`` holds it, and the failure's
behaviour (through ``diagnosis.diagnose``, the suite's one entry) must name it. The right
answer is named by nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from conformance.fixtures import quantized as fq
from conformance.impls.numpy import quantized as page

from conformance import load_backend
from conformance.backends.numpy_backends import NumpyFp8Backend
from conformance.suite import quantized as sq
from conformance.suite.diagnosis import diagnose
from conformance.suite.quantized_diagnosis import BY_NAME, MISREADINGS, other_cast_rule
from conformance.suite.tolerance import Departure, assert_within

pytestmark = pytest.mark.clause("20.6")


def _descale(o, role):
    return np.asarray(o[f"{role}_descale"])


def _ones(o, role):
    return np.ones_like(_descale(o, role))


def _with(**changes):
    """A plant: the page called with descales (and a pipeline) changed."""

    def plant(o, options):
        o = dict(o)
        pipeline = changes.get("pipeline")
        for role in "qkv":
            if role in changes:
                o[f"{role}_descale"] = changes[role](o).astype(np.float32)
        return _page(o, options, pipeline)

    return plant


def _page(o, options, pipeline=None):
    return page.attention_quantized(
        o["q"], o["k"], o["v"], q_descale=o["q_descale"], k_descale=o["k_descale"],
        v_descale=o["v_descale"], block_size=o.get("block_size"),
        p_pipeline=pipeline or "e4m3_unnormalized", **options,
    )  # fmt: skip


def _by_query_head(o, options):
    """Query head h with q_descale[b, h % K]: the page run once per query head."""
    B, H = np.shape(o["q"])[:2]
    K = np.shape(o["k"])[1]
    G = H // K
    rows = []
    for h in range(H):
        kv = [h // G]
        one = {
            "q": np.asarray(o["q"])[:, [h]],
            "k": np.asarray(o["k"])[:, kv],
            "v": np.asarray(o["v"])[:, kv],
            "q_descale": _descale(o, "q")[:, [h % K]],
            "k_descale": _descale(o, "k")[:, kv],
            "v_descale": _descale(o, "v")[:, kv],
        }
        rows.append(_page(one, options))
    return np.concatenate(rows, axis=1)


#: How each misreading is planted in the page.
PLANTS = {
    "all-descales-one": _with(
        q=lambda o: _ones(o, "q"), k=lambda o: _ones(o, "k"), v=lambda o: _ones(o, "v")
    ),
    **{f"{r}-descale-dropped": _with(**{r: (lambda o, r=r: _ones(o, r))}) for r in "qkv"},
    **{f"{r}-descale-twice": _with(**{r: (lambda o, r=r: _descale(o, r) ** 2)}) for r in "qkv"},
    "q-descale-by-query-head": _by_query_head,
    "per-tensor-for-per-head": _with(
        **{r: (lambda o, r=r: np.full_like(_descale(o, r), _descale(o, r).flat[0])) for r in "qkv"}
    ),
    "v-descale-before-softmax": _with(
        q=lambda o: _descale(o, "q") * _descale(o, "v"), v=lambda o: _ones(o, "v")
    ),
    "normalised-p-underflow": _with(pipeline="e4m3_normalized"),
}


def _operands(name: str) -> tuple[dict, dict]:
    """Operands and options that show the misreading alone. Descales near 1 (q's about
    0.3, k's about 3) under a small scale keep the scores moderate with a descale dropped,
    so that dropping q's is not dropping k's (both would make the softmax one-hot)."""
    if name == "normalised-p-underflow":  # long diffuse rows of v = c: weights near 1/S
        o = sq.operands(51, B=1, H=2, K=1, T=3, S=4096, q_spread=0.05)
        o["v"] = np.full(np.shape(o["v"]), 1.5).astype(np.asarray(o["v"]).dtype)
        o["v_descale"] = np.full(np.shape(o["k_descale"]), 0.37, np.float32)
        return o, {}
    o = sq.operands(50, q_spread=100.0, k_spread=1000.0)
    return o, {"is_causal": True, "scale": 2e-5}


def test_every_misreading_has_a_plant():
    assert set(PLANTS) == {m.name for m in MISREADINGS}


@pytest.mark.parametrize("name", list(PLANTS))
def test_planted_misreading_is_named(name):
    backend = load_backend("numpy-fp8")
    o, options = _operands(name)
    expected, bound = sq.expected_and_bound(backend, o, **options)
    actual = np.asarray(PLANTS[name](o, options), dtype=np.float64)
    with pytest.raises(Departure):
        assert_within(actual, expected, bound, f"planted {name}")
    kwargs = {
        **{f"{r}_descale": o[f"{r}_descale"] for r in "qkv"},
        "block_size": None,
        **options,
    }
    calls = [(0, backend, "attention_quantized", (o["q"], o["k"], o["v"]), kwargs)]
    assert diagnose(actual, calls, bound) == BY_NAME[name].sentence


def test_the_right_answer_is_named_by_nothing():
    backend = load_backend("numpy-fp8")
    o = sq.operands(50)
    kwargs = {**{f"{r}_descale": o[f"{r}_descale"] for r in "qkv"}, "is_causal": True}
    _, bound = sq.expected_and_bound(backend, o, is_causal=True)
    actual = sq.call(backend, o, is_causal=True)
    calls = [(0, backend, "attention_quantized", (o["q"], o["k"], o["v"]), kwargs)]
    assert diagnose(actual, calls, bound) is None


@pytest.mark.parametrize("declared", ["overflow", "saturate"])
def test_the_other_cast_rule_is_named(declared):
    """An FP8 output cast with the rule other than the declared one: past the largest
    value its codes are the other rule's, and ``other_cast_rule`` says so; the declared
    rule's own codes are named by nothing."""
    o = sq.operands(52)
    y = sq.expected(o, is_causal=True)
    out_descale = np.float32(np.abs(y).max() / 448 * 0.75)
    other = "saturate" if declared == "overflow" else "overflow"
    out = _page(o, {"is_causal": True})
    planted = page.cast(out.astype(np.float64) / float(out_descale), "float8_e4m3fn", other)
    right = page.cast(out.astype(np.float64) / float(out_descale), "float8_e4m3fn", declared)
    sentence = other_cast_rule(planted, y, out_descale, "float8_e4m3fn", declared)
    assert sentence == (
        f"casts past the largest value with the {other} rule, where {declared} is declared"
    )
    assert other_cast_rule(right, y, out_descale, "float8_e4m3fn", declared) is None


def test_the_fp8_backends_declare_their_cast_rules():
    """numpy-fp8 casts through ml_dtypes (NaN past 448), the torch and JAX pages clamp."""
    assert NumpyFp8Backend.cast_rule == "overflow"
    got = fq.cast(np.array([465.0]), "float8_e4m3fn", "overflow").astype(np.float64)
    assert np.isnan(got).all()
