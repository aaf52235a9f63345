"""Log-sum-exp departures diagnosed by name (SPEC §21): the known misreadings of the lse,
each computed from the inputs of the call that departed.

The public record of serving engines shows where a returned lse goes wrong: one API gave
base-2 or base-e depending on the kernel it picked (FlashInfer #4485), and merges that
mixed the two gave garbage (vLLM #28840, SGLang #35045); a fully masked row returned a
finite lse of −49994 instead of −inf (FlashInfer #4452); and an lse read in the other
layout, (B, T, H) for (B, H, T), or of the scores before the scale. Each is here the
float64 textbook lse (``oracle.naive_lse_same_precision``) with the misreading planted.
As in ``diagnosis.py``, a misreading counts only where it changes the answer beyond the
tolerance.

``diagnosis.find`` hands an ``attention(..., return_lse=True)`` call here when the output
that departed is the lse, (B, H, T) or (H, T) (or its other layout).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conformance.suite.planted import Call, call_of
from conformance.suite.tolerance import nonfinite_mismatch


def lse_of(call: Call, **changes) -> np.ndarray:
    """The float64 textbook lse (B, H, T) of ``call`` with ``changes`` to its options."""
    from conformance.fixtures import oracle

    options = {n: x for n, x in {**call.options, **changes}.items() if x is not None}
    with np.errstate(all="ignore"):
        return oracle.naive_lse_same_precision(
            call.q, call.k, call.v, np.float64, mask=call.mask, **options
        )


def _matches(actual: np.ndarray, want: np.ndarray, tol: float) -> bool:
    if actual.shape != want.shape or nonfinite_mismatch(actual, want).any():
        return False
    both = np.isfinite(actual) & np.isfinite(want)
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(both, actual - want, 0.0))
    return bool(diff.max(initial=0.0) <= tol)


@dataclass(frozen=True)
class LseMisreading:
    name: str
    sentence: str
    #: The planted lse from (the call, the right lse, the departing lse), or None where
    #: the misreading cannot show on this call.
    compute: Callable[[Call, np.ndarray, np.ndarray], np.ndarray | None]


def _base_2(call: Call, right: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """log₂ Σ exp(score) = lse · log₂ e."""
    return right / math.log(2.0)


def _unscaled(call: Call, right: np.ndarray, actual: np.ndarray) -> np.ndarray:
    return lse_of(call, scale=1.0)


def _finite_where_no_key(call: Call, right: np.ndarray, actual: np.ndarray):
    """The right lse, but a finite number (whichever: 0, −49994) in the rows with no key."""
    empty = right == -np.inf
    if not empty.any() or actual.shape != right.shape or not np.isfinite(actual[empty]).all():
        return None
    return np.where(empty, actual, right)


def _other_layout(call: Call, right: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """(B, T, H) where (B, H, T) is declared: the same numbers, the last two axes swapped."""
    return np.swapaxes(right, -1, -2)


MISREADINGS: tuple[LseMisreading, ...] = (
    LseMisreading(
        "lse-base-2",
        "returns the log-sum-exp in base 2 where base e is declared (a factor log₂ e off)",
        _base_2,
    ),
    LseMisreading(
        "lse-unscaled",
        "returns the log-sum-exp of the scores before the scale",
        _unscaled,
    ),
    LseMisreading(
        "lse-finite-no-key",
        "gives a finite log-sum-exp for a row with no key, not -inf",
        _finite_where_no_key,
    ),
    LseMisreading(
        "lse-other-layout",
        "returns the log-sum-exp in the other layout, (B, T, H) for (B, H, T)",
        _other_layout,
    ),
)
BY_NAME = {m.name: m for m in MISREADINGS}


def diagnose(actual, logged: tuple, tol: float) -> str | None:
    """The sentence of the first misreading whose lse ``actual`` equals within ``tol`` on
    the ``logged`` call (a replay entry: name, method, args, kwargs), or None (the
    output compared is not the lse, or nothing explains it)."""
    kwargs = {n: x for n, x in logged[4].items() if n != "return_lse"}
    call = call_of(logged[3], kwargs)
    if call is None:
        return None
    actual = np.asarray(actual, dtype=np.float64)
    unbatched = np.ndim(logged[3][0]) == 3
    if unbatched:
        actual = actual[None]
    right = lse_of(call)  # (B, H, T)
    if actual.ndim != 3 or sorted(actual.shape[1:]) != sorted(right.shape[1:]):
        return None  # the output beside the lse, not the lse
    if _matches(actual, right, tol):
        return None
    for misreading in MISREADINGS:
        planted = misreading.compute(call, right, actual)
        if planted is None or _matches(planted, right, tol):
            continue
        scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(planted), planted, 0)))))
        within = (
            tol * scale / max(1.0, float(np.max(np.abs(np.where(np.isfinite(right), right, 0)))))
        )
        if _matches(actual, planted, max(tol, within)):
            return misreading.sentence
    return None
