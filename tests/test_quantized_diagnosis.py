"""SPEC §20: a quantized departure is named by the misreading it shows.

Each misreading of ``QUANTIZED`` in ``conformance/suite/misreadings.py`` is planted in a correct
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
from conformance.suite.diagnosis import diagnose, find, other_cast_rule
from conformance.suite.misreadings import QUANTIZED as MISREADINGS
from conformance.suite.tolerance import Departure, assert_within

pytestmark = pytest.mark.clause("20.6")
BY_NAME = {m.name: m for m in MISREADINGS}


def _descale(o, role):
    return np.asarray(o[f"{role}_descale"])


def _ones(o, role):
    return np.ones_like(_descale(o, role))


def _with(**changes):
    """A plant: the page called with descales (and a pipeline) changed."""

    def plant(o, options):
        pipeline = changes.get("pipeline")
        # Each descale from the call's own (a swap reads the other's original).
        o = {
            **o,
            **{f"{r}_descale": changes[r](o).astype(np.float32) for r in "qkv" if r in changes},
        }
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


def _transposed(o, role):
    """A (B, K) descale read as (K, B): [b, κ] from memory offset κ·B + b."""
    d = _descale(o, role)
    return d.reshape(-1).reshape(d.shape[1], d.shape[0]).T


def _codes(role, fn):
    """A plant: the page called with ``role``'s codes changed."""

    def plant(o, options):
        return _page({**o, role: fn(np.asarray(o[role]))}, options)

    return plant


def _scale_twice(o, options):
    return _page(o, {**options, "scale": options["scale"] ** 2})


def _zero_point_dropped(o, options):
    """An int8 v read with a zero point of 8 left in: every value of a (batch, head)
    off by 8 · its descale, so every output row by the same."""
    G = np.shape(o["q"])[1] // np.shape(o["k"])[1]
    offset = 8 * np.repeat(_descale(o, "v"), G, axis=1)[..., None, None]  # (B, H, 1, 1)
    return _page(o, options).astype(np.float64) + offset


def _tiled(**how):
    def plant(o, options):
        G = np.shape(o["q"])[1] // np.shape(o["k"])[1]
        return tiled_fp8(
            *(np.asarray(o[r]) for r in "qkv"),
            **{f"{r}_descale": _descale(o, r).astype(np.float32) for r in "qkv"},
            scale=options.get("scale", 1 / np.sqrt(np.shape(o["q"])[-1])),
            causal=options.get("is_causal", False),
            groups=G,
            **how,
        )

    return plant


#: How each misreading is planted in the page (one of each family of tiles).
PLANTS = {
    "all-descales-one": _with(
        q=lambda o: _ones(o, "q"), k=lambda o: _ones(o, "k"), v=lambda o: _ones(o, "v")
    ),
    **{f"{r}-descale-dropped": _with(**{r: (lambda o, r=r: _ones(o, r))}) for r in "qkv"},
    **{
        f"{'-'.join(rs)}-descale-dropped": _with(**{r: (lambda o, r=r: _ones(o, r)) for r in rs})
        for rs in ("kv", "qk", "qv")
    },
    "q-and-v-descales-swapped": _with(q=lambda o: _descale(o, "v"), v=lambda o: _descale(o, "q")),
    **{f"{r}-descale-twice": _with(**{r: (lambda o, r=r: _descale(o, r) ** 2)}) for r in "qkv"},
    "softmax-scale-twice": _scale_twice,
    "descale-batch-head-transposed": _with(
        **{r: (lambda o, r=r: _transposed(o, r)) for r in "qkv"}
    ),
    "q-descale-by-query-head": _by_query_head,
    "per-tensor-for-per-head": _with(
        **{r: (lambda o, r=r: np.full_like(_descale(o, r), _descale(o, r).flat[0])) for r in "qkv"}
    ),
    "v-descale-before-softmax": _with(
        q=lambda o: _descale(o, "q") * _descale(o, "v"), v=lambda o: _ones(o, "v")
    ),
    "v-e4m3-read-as-e5m2": _codes("v", lambda c: c.view(ml_dtypes.float8_e5m2)),
    "v-rounded-to-e5m2": _codes("v", lambda c: c.astype(np.float32).astype(ml_dtypes.float8_e5m2)),
    "v-zero-point-dropped": _zero_point_dropped,
    "normalised-p-underflow": _with(pipeline="e4m3_normalized"),
    "p-rounded-to-e5m2-row": _tiled(p_format=ml_dtypes.float8_e5m2, tile=None),
    "p-at-stale-maximum-overflow-32": _tiled(stale=True),
    "pv-accumulated-in-bfloat16": _tiled(accumulate=ml_dtypes.bfloat16, tile=None),
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
    if name.startswith("p-at-stale"):  # scores that grow from key tile to key tile
        return sq.growing_scores(53), {"scale": 1.0}
    if name in ("p-rounded-to-e5m2-row", "pv-accumulated-in-bfloat16"):
        return _p_at_240(), {"scale": 0.0645}
    if name == "v-zero-point-dropped":
        formats = ("float8_e4m3fn", "float8_e4m3fn", "int8")
        o = sq.operands(55, formats=formats, q_spread=100.0, k_spread=1000.0)
        return o, {"is_causal": True, "scale": 2e-5}
    o = sq.operands(50, q_spread=100.0, k_spread=1000.0)
    return o, {"is_causal": True, "scale": 2e-5}


def _p_at_240() -> dict:
    """One row of 64 keys: key 0 scores 0, the others -0.0645 at the scale given, so that
    P · 2⁸ is 256 for key 0 and 240.01 for the others: float8_e4m3fn holds 240, e5m2
    rounds it to 256 (an error of 1/15 in every weight, all of one sign); v is 1.5
    everywhere, so that a sum accumulated in bfloat16 (8 bits) loses each term's low bits
    as it grows."""
    e4m3 = ml_dtypes.float8_e4m3fn
    k = np.full((1, 1, 64, 1), -1.0)
    k[0, 0, 0] = 0.0
    ones = np.ones((1, 1), np.float32)
    return {
        "q": np.ones((1, 1, 1, 1)).astype(e4m3),
        "k": k.astype(e4m3),
        "v": np.full((1, 1, 64, 4), 1.5).astype(e4m3),
        "q_descale": ones,
        "k_descale": ones,
        "v_descale": ones,
        "block_size": None,
    }


def test_every_misreading_has_a_plant():
    """Each sentence is planted once (a family of tiles by one of its members)."""
    assert set(PLANTS) <= set(BY_NAME)
    assert {BY_NAME[n].sentence for n in PLANTS} == {m.sentence for m in MISREADINGS}


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


def tiled_fp8(
    q,
    k,
    v,
    *,
    q_descale,
    k_descale,
    v_descale,
    scale=None,
    stale=False,
    causal=False,
    groups=None,
    tile=32,
    p_format=ml_dtypes.float8_e4m3fn,
    accumulate=np.float32,
):
    """FlashAttention-3's forward in NumPy, key tiles of ``tile`` (None: one tile); with
    ``stale``, P of each tile is taken at the maximum of the tiles before it
    (FlashAttention #2577's bug), so a growing score pushes P · 2⁸ past 448, which
    ml_dtypes' cast makes NaN; ``p_format``, P · 2⁸ rounded to it; ``accumulate``, P·V
    summed key by key in that dtype."""
    B, H, T, D = q.shape
    S = k.shape[2]
    G = groups or H // k.shape[1]
    f32 = np.float32
    q, k, v = (x.astype(f32) for x in (q, k, v))
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    head = np.repeat(q_descale * k_descale, G, axis=1)[..., None, None].astype(f32)
    blocked = np.triu(np.ones((T, S), dtype=bool), 1) if causal else np.zeros((T, S), bool)
    m = np.full((B, H, T, 1), -np.inf, f32)
    row_sum = np.zeros((B, H, T, 1), f32)
    acc = np.zeros((B, H, T, v.shape[-1]), f32)
    tile = tile or S
    for j in range(0, S, tile):
        s = q @ np.swapaxes(k[:, :, j : j + tile], -1, -2) * f32(scale) * head
        s = np.where(blocked[:, j : j + tile], -np.inf, s).astype(f32)
        m_new = np.maximum(m, s.max(-1, keepdims=True))
        at = m if stale and np.isfinite(m).all() else m_new
        alpha = np.exp(np.where(np.isfinite(m), m - at, -np.inf)).astype(f32)
        p = np.exp(s - at).astype(f32)
        row_sum = row_sum * alpha + p.sum(-1, keepdims=True)
        p8 = (p * 256).astype(p_format).astype(f32)
        if accumulate is np.float32:
            pv = p8 @ v[:, :, j : j + tile]
        else:
            pv = np.zeros_like(acc)
            for s_ in range(p8.shape[-1]):
                term = p8[..., s_, None] * v[:, :, j + s_, None, :]
                pv = (pv + term).astype(accumulate).astype(f32)
        acc = acc * alpha + pv
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


def _named(o, options, actual):
    backend = load_backend("numpy-fp8")
    expected, bound = sq.expected_and_bound(backend, o, **options)
    with pytest.raises(Departure):
        assert_within(actual, expected, bound, "the planted function")
    kwargs = {**{f"{r}_descale": o[f"{r}_descale"] for r in "qkv"}, "block_size": None, **options}
    calls = [(0, backend, "attention_quantized", (o["q"], o["k"], o["v"]), kwargs)]
    return diagnose(actual, calls, bound)


def test_zeros_are_named_zeros_not_a_descale_applied_twice():
    """An output of zeros, where v's descale applied twice gives a number near 0: the
    zeros are named as such (issue 49: it was "v's descale is applied twice")."""
    o, options = _operands("v-descale-twice")
    zeros = np.zeros(np.shape(PLANTS["v-descale-twice"](o, options)))
    assert _named(o, options, zeros) == "returns zeros: no key's value reaches the output"


def test_swapped_descales_on_long_rows_are_named_swapped():
    """q's and v's descales swapped on rows of 4,096 keys, where P normalised before its
    rounding was named (issue 49): the swap is named."""
    o = sq.operands(56, B=1, H=2, K=1, T=3, S=4096, q_spread=0.05)
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    actual = np.asarray(PLANTS["q-and-v-descales-swapped"](o, options), dtype=np.float64)
    assert _named(o, options, actual) == BY_NAME["q-and-v-descales-swapped"].sentence


def test_an_unexplained_departure_says_where_it_lies_and_what_moves_it():
    """q's descale dropped and then one head's output moved by more than the bound: no
    misreading explains it, and the finding says which heads and rows hold the error and
    that the pipeline with q's descale taken as 1 is nearer."""
    backend = load_backend("numpy-fp8")
    o, options = _operands("q-descale-dropped")
    _, bound = sq.expected_and_bound(backend, o, **options)
    actual = np.asarray(PLANTS["q-descale-dropped"](o, options), dtype=np.float64)
    actual[1, 2] += 1.5 * bound
    kwargs = {**{f"{r}_descale": o[f"{r}_descale"] for r in "qkv"}, "block_size": None, **options}
    calls = [(0, backend, "attention_quantized", (o["q"], o["k"], o["v"]), kwargs)]
    found = find(actual, calls, bound)
    assert found.sentence is None
    assert found.where.startswith("the error lies in every batch element (2), every head (4)")
    assert found.where.endswith("nearer to the declared pipeline without q's descale taken as 1")
