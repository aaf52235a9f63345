"""Merge departures diagnosed by name (SPEC §22): the known misreadings of merging partial
states, each computed from the pieces of the call that departed.

The public record's merge bugs: outputs averaged as if every piece held as many keys
(the weights exp(lse) left out), and two empty pieces merged into NaN, -inf - (-inf)
(FlashInfer #4051). Each is computed here on the call's own pieces; a merge with that bug
returns it up to its rounding. As in ``diagnosis.py``, a misreading counts only where it
changes the right answer (the 50-digit merge) beyond the comparison's tolerance, and the
output it is compared with is whichever of o and lse the test held (o: (..., E), lse:
o's shape without E).

``diagnosis.find`` hands a ``merge_states`` call here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conformance.fixtures import oracle_merge
from conformance.suite.tolerance import nonfinite_mismatch


def _averaged(o_a, lse_a, o_b, lse_b):
    both = np.isfinite(lse_a) & np.isfinite(lse_b)  # (B, H, T)
    o = np.where(
        both[..., None], (o_a + o_b) / 2, np.where(np.isfinite(lse_a)[..., None], o_a, o_b)
    )
    with np.errstate(over="ignore", invalid="ignore"):  # its overflow is not the user's run's
        return o, np.logaddexp(lse_a, lse_b)


def _unguarded(o_a, lse_a, o_b, lse_b):
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.maximum(lse_a, lse_b)  # (B, H, T): -inf for two empty pieces
        w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)  # NaN there: -inf - (-inf)
        o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None]
        return o, m + np.log(w_a + w_b)


@dataclass(frozen=True)
class MergeMisreading:
    name: str
    sentence: str
    compute: Callable[..., tuple[np.ndarray, np.ndarray]]


MISREADINGS = (
    MergeMisreading(
        "merge-averaged",
        "averages the pieces' outputs instead of weighting each by exp(lse), its share of "
        "the union's denominator",
        _averaged,
    ),
    MergeMisreading(
        "merge-empty-nan",
        "merges two empty pieces (lse = -inf) into NaN: -inf - (-inf) is NaN where the "
        "larger lse is taken off unguarded",
        _unguarded,
    ),
)


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    if a.shape != b.shape or nonfinite_mismatch(a, b).any():
        return False
    both = np.isfinite(a) & np.isfinite(b)
    return bool(np.max(np.abs(np.where(both, a - b, 0.0)), initial=0.0) <= tol)


def diagnose(actual, calls: list, tol: float) -> str | None:
    """The sentence of the first misreading whose output ``actual`` (o or lse of the last
    ``merge_states`` call) equals within ``tol``, where it departs from the right merge."""
    args = calls[-1][3]
    if len(args) != 4:
        return None
    o_a, lse_a, o_b, lse_b = (np.asarray(x, dtype=np.float64) for x in args)
    actual = np.asarray(actual, dtype=np.float64)
    part = 0 if actual.shape == o_a.shape else 1 if actual.shape == lse_a.shape else None
    if part is None:
        return None
    right = oracle_merge.merge_states([(o_a, lse_a), (o_b, lse_b)])[part]
    for misreading in MISREADINGS:
        planted = misreading.compute(o_a, lse_a, o_b, lse_b)[part]
        if not _close(planted, right, tol) and _close(actual, planted, tol):
            return misreading.sentence
    return None
