"""Departures diagnosed by name: the known misreadings of attention, each computed by the
oracle from the inputs of the call that departed.

When a comparison fails (a ``Departure`` that saw the function's output), the suite asks
whether that output equals, within the comparison's tolerance, attention computed with one
known misreading planted: ``is_causal`` ignored, the other causal alignment, the scale
1/√E, a bool mask added as 0/1, GQA heads tiled, and so on (``MISREADINGS``). The first
that matches names the failure, in one sentence that holds no number, so one cause is one
finding across dtypes and sizes (SPEC §13.15).

Each misreading is computed by ``conformance.fixtures.oracle``: its float64 textbook run
(``naive_same_precision`` in float64, the fast path; the 50-digit ``attention`` costs
milliseconds a row) on the inputs with the misreading planted in them, or, for the three
that no input can express (a slot that is read though blocked, a softcap after the mask, a
sink in the numerator), a float64 textbook on the oracle's ``allowed_keys``
(``conformance/suite/planted.py``).
A misreading counts only where it changes the answer: the correct output must depart from
it beyond the tolerance, or the sentence could name a bug the inputs cannot show.

The pass is cheap and runs only on departures: a few float64 runs of the failing call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conformance.suite import quantized_diagnosis
from conformance.suite.planted import Call, allowed, call_of, expanded, oracle_run, textbook
from conformance.suite.tolerance import nonfinite_mismatch


@dataclass(frozen=True)
class Misreading:
    """One way to misread the spec: when it ``applies`` to a call, what attention with it
    planted returns (``compute``: the call's output shape, or None where it cannot be
    computed), and the sentence that names it; ``name`` is its short handle."""

    name: str
    sentence: str
    applies: Callable[[Call], bool]
    compute: Callable[[Call], np.ndarray | None]


def _empty_rows(call: Call) -> np.ndarray:
    return ~allowed(call).any(axis=-1)  # (B, H, T)


def _rows_as(call: Call, fill: str) -> np.ndarray | None:
    """The right answer, but the rows with no key to attend hold ``fill``: "nan", or
    "mean" (the mean of their value rows, as uniform weights over every key give)."""
    empty = _empty_rows(call)
    if not empty.any() or call.k.shape[2] == 0:
        return None
    out = oracle_run(call)
    if fill == "nan":
        out[empty] = np.nan
    else:
        _, v = expanded(call)
        out[empty] = np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape)[empty]
    return out


def _blocked_slot_holds_nonfinite(call: Call) -> bool:
    k, v = expanded(call)
    bad = ~(np.isfinite(k).all(axis=-1) & np.isfinite(v).all(axis=-1))  # (B, H, S)
    return bool((bad[:, :, None, :] & ~allowed(call)).any())


def _other_alignment(call: Call) -> str:
    return "bottom_right" if call.options["causal_alignment"] == "top_left" else "top_left"


def _aligned(which: str) -> Callable[[Call], bool]:
    def applies(call: Call) -> bool:
        T, S = call.q.shape[2], call.k.shape[2]
        banded = call.is_causal or call.options.get("window") is not None
        return banded and T != S and call.options["causal_alignment"] == which

    return applies


def _window_shifted(side: int, step: int) -> Callable[[Call], np.ndarray | None]:
    def compute(call: Call) -> np.ndarray | None:
        window = list(call.options["window"])
        if window[side] is None or window[side] + step < 0:
            return None
        window[side] += step
        return oracle_run(call, window=tuple(window))

    return compute


def _has_window(call: Call) -> bool:
    return call.options.get("window") is not None


def _diagonal_shifted(step: int) -> Callable[[Call], np.ndarray | None]:
    """Causality with its diagonal ``step`` keys off, as a window's right side."""

    def compute(call: Call) -> np.ndarray | None:
        left, right = call.options.get("window") or (None, None)
        right = step if right is None else min(right, 0) + step
        return oracle_run(call, is_causal=False, window=(left, right))

    return compute


def _gqa_tiled(call: Call) -> np.ndarray:
    H, K = call.q.shape[1], call.k.shape[1]
    heads = [h % K for h in range(H)]
    return oracle_run(call, k=call.k[:, heads], v=call.v[:, heads])  # k, v (B, H, S, ·)


def _scale_is(value: Callable[[Call], float]) -> Callable[[Call], np.ndarray]:
    return lambda call: oracle_run(call, scale=value(call))


def _prescaled(call: Call) -> np.ndarray:
    with np.errstate(over="ignore"):
        return call.q * call.scale  # (B, H, T, D)


def _default_scale(call: Call) -> bool:
    return call.options.get("scale") is None


MISREADINGS: tuple[Misreading, ...] = (
    # First: with garbage in the blocked slots, ignoring the mask gives the same NaN rows,
    # and the slots read are the finding a slot-garbage test is after.
    Misreading(
        "blocked-slot-read",
        "a key slot the row may not attend is still read: the NaN or inf it holds reaches "
        "the output (NaN + -inf in the scores)",
        _blocked_slot_holds_nonfinite,
        lambda c: textbook(c, read_blocked="add"),
    ),
    Misreading(
        "blocked-slot-multiplied",
        "a key slot the row may not attend is still read: the NaN or inf it holds reaches "
        "the output (0 · NaN in the product with V)",
        _blocked_slot_holds_nonfinite,
        lambda c: textbook(c, read_blocked="select"),
    ),
    Misreading(
        "causal-ignored-with-mask",
        "is_causal is ignored when a mask is given: the output equals attention with the mask alone",
        lambda c: c.is_causal and c.mask is not None,
        lambda c: oracle_run(c, is_causal=None),
    ),
    Misreading(
        "causal-ignored",
        "is_causal is ignored: the output equals attention without causality",
        lambda c: c.is_causal and c.mask is None,
        lambda c: oracle_run(c, is_causal=None),
    ),
    Misreading(
        "mask-ignored",
        "the mask is ignored: the output equals attention without it",
        lambda c: c.mask is not None,
        lambda c: oracle_run(c, mask=None),
    ),
    Misreading(
        "bottom-right-for-top-left",
        "causality is aligned bottom-right where top-left is asked: the output equals "
        "bottom-right causal attention",
        _aligned("top_left"),
        lambda c: oracle_run(c, causal_alignment=_other_alignment(c)),
    ),
    Misreading(
        "top-left-for-bottom-right",
        "causality is aligned top-left where bottom-right is asked: the output equals "
        "top-left causal attention",
        _aligned("bottom_right"),
        lambda c: oracle_run(c, causal_alignment=_other_alignment(c)),
    ),
    Misreading(
        "diagonal-without-own-key",
        "the causal diagonal is one key off: each row's own key is blocked",
        lambda c: c.is_causal,
        _diagonal_shifted(-1),
    ),
    Misreading(
        "diagonal-with-next-key",
        "the causal diagonal is one key off: each row also attends the next key",
        lambda c: c.is_causal,
        _diagonal_shifted(1),
    ),
    Misreading(
        "window-left-wider",
        "the window is off by one: one key more on its left side",
        _has_window,
        _window_shifted(0, 1),
    ),
    Misreading(
        "window-left-narrower",
        "the window is off by one: one key fewer on its left side",
        _has_window,
        _window_shifted(0, -1),
    ),
    Misreading(
        "window-right-wider",
        "the window is off by one: one key more on its right side",
        _has_window,
        _window_shifted(1, 1),
    ),
    Misreading(
        "window-right-narrower",
        "the window is off by one: one key fewer on its right side",
        _has_window,
        _window_shifted(1, -1),
    ),
    Misreading(
        "scale-1-over-sqrt-e",
        "the default scale is 1/√E (the value head size), not 1/√D",
        lambda c: _default_scale(c) and c.v.shape[-1] != c.q.shape[-1],
        _scale_is(lambda c: 1.0 / math.sqrt(c.v.shape[-1])),
    ),
    Misreading(
        "scale-1-over-d",
        "the default scale is 1/D, not 1/√D",
        lambda c: _default_scale(c) and c.q.shape[-1] > 1,
        _scale_is(lambda c: 1.0 / c.q.shape[-1]),
    ),
    Misreading(
        "scale-ignored",
        "the scale is ignored: the output equals attention with 1/√D",
        lambda c: not _default_scale(c),
        lambda c: oracle_run(c, scale=None),
    ),
    Misreading(
        "scale-1",
        "the scores are not scaled: the output equals attention with scale 1",
        lambda c: c.scale != 1.0,
        _scale_is(lambda c: 1.0),
    ),
    Misreading(
        "scale-before-product",
        "q is multiplied by the scale before the product, so q · scale overflows where the "
        "score does not",
        lambda c: bool(np.isinf(_prescaled(c)).any()),
        lambda c: oracle_run(c, q=_prescaled(c), scale=1.0),
    ),
    Misreading(
        "scale-twice",
        "the scale is applied twice",
        lambda c: c.scale != 1.0,
        _scale_is(lambda c: c.scale * c.scale),
    ),
    Misreading(
        "float-mask-as-bool",
        "a float mask is read as a bool mask: its nonzero entries attend, its zeros block",
        lambda c: c.float_mask,
        lambda c: oracle_run(c, mask=c.mask != 0),
    ),
    Misreading(
        "bool-mask-added",
        "a bool mask is added to the scores as 1 and 0, not read as attend and block",
        lambda c: c.bool_mask,
        lambda c: oracle_run(c, mask=c.mask.astype(np.float64)),
    ),
    Misreading(
        "bool-mask-flipped",
        "a bool mask is read the other way round: True blocks",
        lambda c: c.bool_mask,
        lambda c: oracle_run(c, mask=~c.mask),
    ),
    Misreading(
        "empty-rows-mean-of-v",
        "a query with no key to attend returns the mean of V, not 0",
        lambda c: True,
        lambda c: _rows_as(c, "mean"),
    ),
    Misreading(
        "empty-rows-nan",
        "a query with no key to attend returns NaN, not 0",
        lambda c: True,
        lambda c: _rows_as(c, "nan"),
    ),
    Misreading(
        "softcap-after-mask",
        "the softcap is applied after the mask: a blocked key gets the score -softcap, "
        "not -inf, and is attended",
        lambda c: c.options.get("softcap") is not None and not _empty_rows(c).all(),
        lambda c: textbook(c, cap_after_mask=True),
    ),
    Misreading(
        "gqa-tiled",
        "GQA heads are grouped the wrong way: query head h uses key/value head h % K, not h // G",
        lambda c: 1 < c.k.shape[1] < c.q.shape[1],
        _gqa_tiled,
    ),
    Misreading(
        "sink-scaled",
        "the sink is multiplied by the scale: the output equals attention with sinks · scale",
        lambda c: c.options.get("sinks") is not None and c.scale != 1.0,
        lambda c: oracle_run(c, sinks=c.options["sinks"] * c.scale),
    ),
    Misreading(
        "sink-carries-value",
        "the sink carries a value: its weight is added to every attended key's weight",
        lambda c: c.options.get("sinks") is not None,
        lambda c: textbook(c, sink_in_numerator=True),
    ),
)


#: The misreadings by name.
BY_NAME = {m.name: m for m in MISREADINGS}


def matches(actual: np.ndarray, want: np.ndarray, tol: float) -> bool:
    """Whether ``actual`` equals ``want`` as SPEC §7 compares: the same shape, NaN and
    infinities where ``want`` has them, the finite entries within ``tol``."""
    if actual.shape != want.shape or nonfinite_mismatch(actual, want).any():
        return False
    both = np.isfinite(actual) & np.isfinite(want)
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(both, actual - want, 0.0))
    return bool(diff.max(initial=0.0) <= tol)


def _magnitude(x: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(np.where(np.isfinite(x), x, 0.0)), initial=0.0)))


def diagnose(actual, calls: list, tol: float) -> str | None:
    """The sentence of the first misreading whose output ``actual`` (the last call's
    output) equals within ``tol``, or None: where the last call is no plain ``attention``
    call, where ``actual`` is right for it, or where no misreading fits."""
    if calls and calls[-1][2] == "attention_quantized":
        return quantized_diagnosis.diagnose(actual, calls, tol)  # SPEC §20
    if not calls or calls[-1][2] != "attention":
        return None
    call = call_of(calls[-1][3], calls[-1][4])
    if call is None:
        return None
    actual = np.asarray(actual, dtype=np.float64)
    if actual.ndim == 3:
        actual = actual[None]  # (1, H, T, E)
    right = oracle_run(call)
    if actual.shape != right.shape or matches(actual, right, tol):
        return None
    for misreading in MISREADINGS:
        if not misreading.applies(call):
            continue
        planted = misreading.compute(call)
        if planted is None:
            continue
        # The tolerance was set for the right answer's magnitude (SPEC §7).
        allowed_error = tol * _magnitude(planted) / _magnitude(right)
        if matches(planted, right, allowed_error):
            continue
        if not _finite_evidence(misreading, planted, right, allowed_error):
            continue
        if matches(actual, planted, max(tol, allowed_error)):
            return misreading.sentence
    return None


#: The misreadings whose very mark is a NaN or an infinity in the output.
_NONFINITE_BY_NATURE = {
    "blocked-slot-read",
    "blocked-slot-multiplied",
    "empty-rows-nan",
    "scale-before-product",
}


def _finite_evidence(misreading: Misreading, planted, right, tol: float) -> bool:
    """Whether the planted output departs from the right one somewhere it is finite. Where it
    departs only by NaN or infinity (a scale applied twice to scores near the largest float
    overflows), an output that overflowed for another reason would match it by its
    non-finite entries alone, and the sentence would name a cause the inputs cannot tell
    apart; a misreading that shows as NaN by nature is exempt."""
    if misreading.name in _NONFINITE_BY_NATURE:
        return True
    finite = np.isfinite(planted) & np.isfinite(right)
    with np.errstate(invalid="ignore"):
        departs = finite & (np.abs(np.where(finite, planted - right, 0.0)) > tol)
    return bool(departs.any())
