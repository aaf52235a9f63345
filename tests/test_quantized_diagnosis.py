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

import functools

import ml_dtypes
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


def tiled_fp8(q, k, v, *, q_descale, k_descale, v_descale, scale=None, stale=False):
    """FlashAttention-3's forward in NumPy, key tiles of 32; with ``stale``, P of each tile
    is taken at the maximum of the tiles before it (FlashAttention #2577's bug), so a
    growing score pushes P · 2⁸ past 448, which ml_dtypes' cast makes NaN."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    f32 = np.float32
    q, k, v = (x.astype(f32) for x in (q, k, v))
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    head = np.repeat(q_descale * k_descale, G, axis=1)[..., None, None].astype(f32)
    m = np.full((B, H, T, 1), -np.inf, f32)
    row_sum = np.zeros((B, H, T, 1), f32)
    acc = np.zeros((B, H, T, v.shape[-1]), f32)
    for j in range(0, k.shape[2], 32):
        s = q @ np.swapaxes(k[:, :, j : j + 32], -1, -2) * f32(scale) * head
        m_new = np.maximum(m, s.max(-1, keepdims=True))
        at = m if stale and np.isfinite(m).all() else m_new
        alpha = np.exp(np.where(np.isfinite(m), m - at, -np.inf)).astype(f32)
        p = np.exp(s - at).astype(f32)
        row_sum = row_sum * alpha + p.sum(-1, keepdims=True)
        p8 = (p * 256).astype(ml_dtypes.float8_e4m3fn).astype(f32)
        acc = acc * alpha + p8 @ v[:, :, j : j + 32]
        m = at
    return acc / 256 / row_sum * np.repeat(v_descale, G, axis=1)[..., None, None]


@pytest.mark.parametrize("stale", [False, True], ids=["running-max", "stale-max"])
def test_a_stale_row_maximum_fails_the_growing_scores_test(request, stale):
    """The suite's test of growing row maxima passes a tiled kernel that rounds P at its
    running maximum and fails one that rounds it at the maximum before the tile."""
    from conformance.adapters.quantized import QuantizedFunctionBackend
    from conformance.tests.test_quantized import test_growing_row_maxima_stay_finite

    backend = QuantizedFunctionBackend(
        functools.partial(tiled_fp8, stale=stale),
        name="tiled-" + ("stale" if stale else "running"),
        framework="numpy",
        layout="BHTD",
        caps=["gqa"],
        table={
            "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
            "granularities": {r: ["head"] for r in "qkv"},
            "descales": {r: f"{r}_descale" for r in "qkv"},
            "options": {"scale": "scale"},
        },
    )
    if not stale:
        test_growing_row_maxima_stay_finite(request, backend)
        return
    with pytest.raises(Departure):
        test_growing_row_maxima_stay_finite(request, backend)
