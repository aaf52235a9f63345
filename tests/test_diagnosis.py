"""SPEC §13.16: a departure is named by the misreading of attention it shows.

Each misreading of ``conformance/suite/misreadings.py`` is planted in a correct function (the
NumPy reference, ``load_backend("numpy")``, called with the misread inputs, or one of
``tests/mutants.py`` where no input can express it); its output is compared with the
50-digit oracle as a test compares it, and the failure's behaviour must name the
misreading. A right answer, and a wrong one no misreading explains, are named by nothing.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from mutants import MUTANTS, online_softmax
from mutants import _mutant as _mutant_class

from conformance import load_backend
from conformance.suite.behaviours import behaviour
from conformance.suite.diagnosis import diagnose
from conformance.suite.helpers import oracle_attention, random_qkv, random_tolerance
from conformance.suite.misreadings import ATTENTION
from conformance.suite.tolerance import Departure, assert_within

pytestmark = pytest.mark.clause("13.16")
#: The misreadings of attention whole (the other areas' are planted in
#: ``tests/test_frontier_diagnosis.py``).
BY_NAME = {m.name: m for m in ATTENTION}
_CLOCK = itertools.count()
REFERENCE = load_backend("numpy")


def _without(options: dict, *names: str) -> dict:
    return {n: x for n, x in options.items() if n not in names}


def _reference(**changes):
    """The reference with ``changes`` planted: each a function of (q, k, v, options)
    returning the new (q, k, v, options)."""

    def run(q, k, v, **options):
        for change in changes.values():
            q, k, v, options = change(q, k, v, options)
        return REFERENCE.attention(q, k, v, **options)

    return run


def _set(**values):
    return lambda q, k, v, o: (q, k, v, {**o, **values})


def _drop(*names):
    return lambda q, k, v, o: (q, k, v, _without(o, *names))


def _mask(fn):
    return lambda q, k, v, o: (q, k, v, {**o, "mask": fn(o["mask"], q)})


def _band(offset):
    """Causality as a bool mask whose diagonal is ``offset`` keys off."""

    def change(q, k, v, o):
        T, S = q.shape[2], k.shape[2]
        return q, k, v, {**_without(o, "is_causal"), "mask": np.tri(T, S, offset, dtype=bool)}

    return change


def _tiled(q, k, v, o):
    H, K = q.shape[1], k.shape[1]
    heads = [h % K for h in range(H)]
    return q, k[:, heads], v[:, heads], o  # (B, H, S, ·)


def _mutant(name):
    return MUTANTS[name][0]().attention


def _empty_rows_as(fill):
    def run(q, k, v, **options):
        out = REFERENCE.attention(q, k, v, **options)
        empty = np.broadcast_to(~options["mask"].any(axis=-1), out.shape[:-1])  # (B, H, T)
        mean = np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape)  # (B, H, T, E)
        out[empty] = np.nan if fill == "nan" else mean[empty]
        return out

    return run


def _softcap_after_mask(q, k, v, *, mask, softcap):
    scores = np.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = softcap * np.tanh((scores + np.where(mask, 0.0, -np.inf)) / softcap)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("bhts,bhse->bhte", weights / weights.sum(axis=-1, keepdims=True), v)


def _problem(name: str, seed: int = 5):
    """The inputs (q, k, v, options) a misreading is planted in, and the planted function."""
    rng = np.random.default_rng(seed)
    T, S, D, E, H, K = 5, 5, 4, 4, 2, 2
    if name in ("bottom-right-for-top-left", "top-left-for-bottom-right"):
        T, S = 3, 6
    if name == "scale-1-over-sqrt-e":
        E = 9
    if name == "gqa-tiled":
        H, K = 4, 2
    if name == "scale-1-over-d-or-model-width":
        H, K = 4, 4  # H = D: 1/D and 1/√(H·D) are the same number
    if name in ("keys-as-if-s-is-t", "keys-in-q-layout"):
        T, S = 3, 6
    if name == "keys-past-s":
        T, S = 6, 3
    if name.startswith("tiles-"):
        return _tiles_problem(name)
    if name == "mla-v-from-last-columns":
        # V is the first E columns of the latent K (SPEC §4.11); read from the last E.
        q, k, _ = random_qkv(seed, B=2, H=4, K=1, T=1, S=9, D=6, E=4)
        return q, k, k[..., :4], {}, _reference(change=lambda q, k, v, o: (q, k, k[..., 2:], o))
    q, k, v = random_qkv(seed, B=2, H=H, K=K, T=T, S=S, D=D, E=E)
    bool_mask = rng.random((2, 1, T, S)) < 0.7
    bool_mask[..., 0] = True
    padding = np.arange(S) < np.array([[3], [5]])  # (B, S)
    padding = padding[:, None, None, :]  # (B, 1, 1, S)
    # Zeros among the entries, as in the usual 0 / -inf mask, and other numbers.
    float_mask = np.where(
        rng.random(bool_mask.shape) < 0.5, 0.0, rng.standard_normal(bool_mask.shape)
    )
    float_mask = np.where(bool_mask, float_mask, -np.inf)  # (B, 1, T, S)
    empty = bool_mask.copy()
    empty[0, 0, 1] = False  # (B, 1, T, S): batch 0's row 1 attends nothing
    sinks = rng.standard_normal(H)
    # The last key of row 0 is blocked by causality, and its mask entry is +inf.
    blocked_inf = np.where(np.isinf(float_mask), 0.5, float_mask)
    blocked_inf[0, 0, 0, S - 1] = np.inf
    plans = {
        "causal-ignored-with-mask": ({"mask": bool_mask, "is_causal": True}, _drop("is_causal")),
        "causal-ignored": ({"is_causal": True}, _drop("is_causal")),
        "mask-ignored": ({"mask": bool_mask}, _drop("mask")),
        "bottom-right-for-top-left": (
            {"is_causal": True},
            _set(causal_alignment="bottom_right"),
        ),
        # A window that reaches past key T - 1: keys read as if S = T would not give it.
        "top-left-for-bottom-right": (
            {"window": (2, 2), "causal_alignment": "bottom_right"},
            _set(causal_alignment="top_left"),
        ),
        "diagonal-without-own-key": ({"is_causal": True}, _band(-1)),
        "diagonal-with-next-key": ({"is_causal": True}, _band(1)),
        "window-left-wider": ({"window": (1, 1)}, _set(window=(2, 1))),
        "window-left-narrower": ({"window": (2, 1)}, _set(window=(1, 1))),
        "window-right-wider": ({"window": (1, 1)}, _set(window=(1, 2))),
        "window-right-narrower": ({"window": (1, 2)}, _set(window=(1, 1))),
        "scale-1-over-sqrt-e": ({}, _set(scale=1 / 3)),
        "scale-1-over-d": ({}, _set(scale=1 / D)),
        "scale-ignored": ({"scale": 0.7}, _drop("scale")),
        "scale-1": ({"scale": 0.7}, _set(scale=1.0)),
        "scale-twice": ({"scale": 0.7}, _set(scale=0.49)),
        "float-mask-as-bool": ({"mask": float_mask}, _mask(lambda m, q: m != 0)),
        "bool-mask-added": ({"mask": bool_mask}, _mask(lambda m, q: m.astype(q.dtype))),
        "bool-mask-flipped": ({"mask": bool_mask}, _mask(lambda m, q: ~m)),
        "gqa-tiled": ({"is_causal": True}, _tiled),
        "sink-scaled": ({"sinks": sinks}, _set(sinks=sinks / 2)),
        "window-ignored-without-mask": ({"window": (1, 1)}, _drop("window")),
        "scale-1-over-sqrt-model-width": ({}, _set(scale=1 / math.sqrt(H * D))),
        "scale-1-over-d-or-model-width": ({}, _set(scale=1 / D)),
        "scale-sqrt-d": ({}, _set(scale=math.sqrt(D))),
        "float-mask-scaled": ({"mask": float_mask}, _mask(lambda m, q: m / math.sqrt(D))),
        "mask-batch-repeated": ({"mask": bool_mask}, _repeated_over_heads),
        "softcap-ignored": ({"softcap": 1.0}, _drop("softcap")),
        "sinks-dropped": ({"sinks": sinks}, _drop("sinks")),
        "keys-as-if-s-is-t": ({}, lambda q, k, v, o: (q, k[:, :, :T], v[:, :, :T], o)),
        "keys-in-q-layout": ({}, _in_q_layout),
        "keys-past-s": ({"is_causal": True}, _keys_past_s),
        "causal-added": ({"mask": blocked_inf, "is_causal": True}, _causal_added),
    }
    if name == "causal-penalty-finite":
        return _penalty_problem()
    if name == "scale-before-product":
        # Scores up to 1.36e308 are finite; q · scale = 2.72e308 is not (SPEC §4.1).
        q = np.array([2.72, 2.0, 1.0])[None, None, :, None]  # (B, H, T, D)
        k = np.array([0.5, 0.25, -0.1, 0.0])[None, None, :, None]  # (B, K, S, D)
        v = np.arange(1.0, 9.0).reshape(1, 1, 4, 2)  # (B, K, S, E)
        return q, k, v, {"scale": 1e308}, _reference(change=_prescaled)
    if name in plans:
        options, change = plans[name]
        return q, k, v, options, _reference(change=change)
    if name.startswith("empty-rows-"):
        return q, k, v, {"mask": empty}, _empty_rows_as(name.rsplit("-", 1)[-1])
    if name.startswith("blocked-slot-"):
        k, v = k.copy(), v.copy()
        k[0, :, 4, 1] = np.nan  # batch 0's keys 3 and 4 are padding
        v[0, :, 3, 0] = np.inf
        mutant = "mutant-unused-slots-read"
        if name == "blocked-slot-read":
            return q, k, v, {"mask": np.where(padding, 0.0, -np.inf)}, _additive_padding
        return q, k, v, {"mask": padding}, _mutant(mutant)
    if name == "softcap-after-mask":
        return q, k, v, {"mask": padding, "softcap": 2.0}, _softcap_after_mask
    return q, k, v, {"sinks": sinks}, _mutant("mutant-sink-in-numerator")


def _in_q_layout(q, k, v, o):
    """k and v read through q's strides: head h of batch b takes T rows of the flat key
    buffer from element (b·H + h)·T on, as a kernel that reuses q's strides does."""
    B, H, T = q.shape[:3]
    k = k.reshape(-1)[: B * H * T * k.shape[-1]].reshape(B, H, T, -1)  # (B, H, T, D)
    v = v.reshape(-1)[: B * H * T * v.shape[-1]].reshape(B, H, T, -1)  # (B, H, T, E)
    return q, k, v, o


def _repeated_over_heads(q, k, v, o):
    """A (B, 1, T, S) mask spread over the heads as ``mask.repeat(H, 1, 1)`` on (B, T, S)
    does for q reshaped to (B·H, T, D)."""
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    flat = np.tile(o["mask"][:, 0], (H, 1, 1))  # (H·B, T, S): torch's repeat
    return q, k, v, {**o, "mask": flat.reshape(B, H, T, S)}


def _keys_past_s(q, k, v, o):
    """Key slots S .. T - 1 read as if they existed: they hold NaN."""
    B, K, S, T = k.shape[0], k.shape[1], k.shape[2], q.shape[2]
    k = np.concatenate([k, np.full((B, K, T - S, k.shape[-1]), np.nan)], axis=2)  # (B, K, T, D)
    v = np.concatenate([v, np.full((B, K, T - S, v.shape[-1]), np.nan)], axis=2)  # (B, K, T, E)
    return q, k, v, o


def _causal_added(q, k, v, o):
    """Causality added to the float mask as 0 / -inf, not selected."""
    T, S = q.shape[2], k.shape[2]
    with np.errstate(invalid="ignore"):
        mask = o["mask"] + np.where(np.tri(T, S, 0, dtype=bool), 0.0, -np.inf)  # (B, 1, T, S)
    return q, k, v, {**_without(o, "is_causal"), "mask": mask}


def _penalty_problem():
    """Row 1's blocked key 2 scores 20000, 9998 above its allowed key 1 after the penalty:
    weight e^-2 of key 1's, where -inf gives it none and no causality all of it."""
    q = np.ones((1, 1, 3, 1))  # (B, H, T, D)
    k = np.array([0.0, 10002.0, 20000.0])[None, None, :, None]  # (B, K, S, D)
    v = np.arange(1.0, 7.0).reshape(1, 1, 3, 2)  # (B, K, S, E)
    return q, k, v, {"is_causal": True, "scale": 1.0}, _reference(change=_penalised)


def _penalised(q, k, v, o):
    """Causality as an additive bias of -10000 above the diagonal (PaddlePaddle's CPU
    path), not -inf."""
    T, S = q.shape[2], k.shape[2]
    mask = np.where(np.tri(T, S, 0, dtype=bool), 0.0, -1e4)  # (T, S)
    return q, k, v, {**_without(o, "is_causal"), "mask": mask}


def _tiles_problem(name: str):
    """Rows longer than two key tiles whose scores grow from key to key, so that the second
    tile raises the row's maximum; planted: ``tests/mutants.py``'s online softmax over
    those tiles with the named rescale left out."""
    which, tile = name.split("-")[1], int(name.rsplit("-", 1)[-1])
    S = tile + 52
    q, k, v = random_qkv(9, B=1, H=1, T=2, S=S, D=4)
    q[..., 0] = 1.0
    k[..., 0] = 16.0 * np.arange(S) / S  # scores grow by 8 from the first key to the last
    rescale = {"rescale_sum" if which == "sum" else "rescale_acc": False}

    def broken(scores, dtype):
        return online_softmax(scores, tile, **rescale)

    return q, k, v, {}, _mutant_class(name, "softmax", broken)().attention


def _prescaled(q, k, v, options):
    """q multiplied by the scale before the product, as a blockwise kernel may."""
    return q * options["scale"], k, v, {**options, "scale": 1.0}


def _additive_padding(q, k, v, *, mask):
    """Blocking by adding the float mask to scores computed from every slot."""
    scores = np.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1]) + mask  # (B, H, T, S)
    top = np.nanmax(np.where(np.isnan(scores), -np.inf, scores), axis=-1, keepdims=True)
    weights = np.exp(scores - top)
    return np.einsum("bhts,bhse->bhte", weights / weights.sum(axis=-1, keepdims=True), v)


def _named(out, q, k, v, options):
    """The behaviour a test comparing ``out`` with the oracle would name."""
    expected = oracle_attention(q, k, v, **options)
    tol = random_tolerance(q, k, v, "float64", **options)
    calls = [(next(_CLOCK), REFERENCE, "attention", (q, k, v), options)]
    with pytest.raises(Departure) as info:
        assert_within(out, expected, tol, "the test's comparison", behaviour="the test's words")
    return behaviour(info.value, calls, "7.1", "Tolerance")


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_a_planted_misreading_is_named(name):
    with np.errstate(all="ignore"):
        q, k, v, options, planted = _problem(name)
        out = np.asarray(planted(q, k, v, **options), dtype=np.float64)
    assert _named(out, q, k, v, options) == BY_NAME[name].sentence


def test_every_misreading_of_the_issue_is_listed():
    assert len(ATTENTION) == len(BY_NAME) >= 20


def test_a_right_or_unexplained_output_is_named_by_nothing():
    q, k, v = random_qkv(6, B=1, H=2, T=4, S=6, D=3)
    options = {"is_causal": True}
    calls = [(0, REFERENCE, "attention", (q, k, v), options)]
    right = oracle_attention(q, k, v, **options)
    assert diagnose(right, calls, 1e-12) is None
    assert _named(right + 0.3, q, k, v, options) == "the test's words"


def test_a_misreading_the_inputs_cannot_show_is_not_named():
    """With every score equal, a missing scale changes nothing: the unscaled output is the
    right one, and a wrong output is not blamed on the scale."""
    q = np.zeros((1, 1, 3, 2))
    k, v = random_qkv(7, B=1, H=1, T=3, S=4, D=2)[1:]
    options = {"scale": 0.5}
    wrong = oracle_attention(q, k, v, **options) + 1.0
    assert _named(wrong, q, k, v, options) == "the test's words"
