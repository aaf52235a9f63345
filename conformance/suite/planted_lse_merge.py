"""The log-sum-exp and the merges of partial states with a misreading planted (SPEC §21,
§22), for ``conformance/suite/misreadings_lse_merge.py``: the departing lse (``LseCall``)
against the float64 textbook lse, and the merge formula on a departing merge's own pieces
(``MergeCall``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from conformance.suite.planted import Call

# --- The log-sum-exp (SPEC §21) -------------------------------------------------------------


class LseCall(NamedTuple):
    """A departing lse: the call, its right lse (B, H, T) and the lse returned."""

    call: Call
    right: np.ndarray
    actual: np.ndarray


def lse_of(call: Call, **changes) -> np.ndarray:
    """The float64 textbook lse (B, H, T) of ``call`` with ``changes`` to its options (a
    value of None removes the option)."""
    from conformance.fixtures import oracle

    options = {n: x for n, x in {**call.options, **changes}.items() if x is not None}
    with np.errstate(all="ignore"):
        return oracle.naive_lse_same_precision(
            call.q, call.k, call.v, np.float64, mask=call.mask, **options
        )


def lse_without(name: str) -> Callable[[LseCall], np.ndarray]:
    return lambda c: lse_of(c.call, **{name: None})


def lse_where_no_key(finite: bool) -> Callable[[LseCall], np.ndarray | None]:
    """The right lse, but what was returned in the rows with no key: a finite number
    (whichever: 0, -49994) with ``finite``, +inf without."""

    def compute(c: LseCall) -> np.ndarray | None:
        empty = c.right == -np.inf
        if not empty.any() or c.actual.shape != c.right.shape:
            return None
        got = c.actual[empty]
        if not (np.isfinite(got).all() if finite else (got == np.inf).all()):
            return None
        return np.where(empty, c.actual, c.right)

    return compute


# --- Merges of partial states (SPEC §22) ----------------------------------------------------


class MergeCall(NamedTuple):
    """A departing merge: the two pieces, float64, and which part of the answer was
    compared (0: o (..., E), 1: lse)."""

    o_a: np.ndarray
    lse_a: np.ndarray
    o_b: np.ndarray
    lse_b: np.ndarray
    part: int


def merged(c: MergeCall, *, weights=None, lse_a=None, lse_b=None, exp=np.exp, log=np.log):
    """The merge formula in float64 on the call's pieces (with ``lse_a``, ``lse_b`` in
    their place): each piece weighted by exp(lse - m), m the larger lse, two empty pieces
    guarded; ``weights`` (m, lse_a, lse_b) -> (w_a, w_b) replaces the weights, ``exp`` and
    ``log`` the base. Returns the part compared."""
    a = c.lse_a if lse_a is None else lse_a
    b = c.lse_b if lse_b is None else lse_b
    with np.errstate(all="ignore"):
        m = np.maximum(a, b)  # (B, H, T)
        m = np.where(m == -np.inf, 0.0, m)
        w_a, w_b = (exp(a - m), exp(b - m)) if weights is None else weights(m, a, b)
        total = w_a + w_b
        safe = np.where(total == 0, 1.0, total)
        o = (w_a[..., None] * c.o_a + w_b[..., None] * c.o_b) / safe[..., None]
        lse = np.where(total == 0, -np.inf, m + log(safe))
    return (o, lse)[c.part]


def merge_averaged(c: MergeCall) -> np.ndarray:
    both = np.isfinite(c.lse_a) & np.isfinite(c.lse_b)  # (B, H, T)
    one = np.where(np.isfinite(c.lse_a)[..., None], c.o_a, c.o_b)
    o = np.where(both[..., None], (c.o_a + c.o_b) / 2, one)
    with np.errstate(over="ignore", invalid="ignore"):
        return (o, np.logaddexp(c.lse_a, c.lse_b))[c.part]


def merge_unguarded(c: MergeCall) -> np.ndarray:
    with np.errstate(all="ignore"):
        m = np.maximum(c.lse_a, c.lse_b)  # (B, H, T): -inf for two empty pieces
        w_a, w_b = np.exp(c.lse_a - m), np.exp(c.lse_b - m)  # NaN there: -inf - (-inf)
        o = (w_a[..., None] * c.o_a + w_b[..., None] * c.o_b) / (w_a + w_b)[..., None]
        return (o, m + np.log(w_a + w_b))[c.part]


def merge_without_maximum(c: MergeCall) -> np.ndarray:
    """exp(lse) taken as it is: an lse past about 709 overflows to inf, and inf / inf is
    NaN."""
    with np.errstate(all="ignore"):
        w_a, w_b = np.exp(c.lse_a), np.exp(c.lse_b)
        total = w_a + w_b
        o = (w_a[..., None] * c.o_a + w_b[..., None] * c.o_b) / total[..., None]
        return (o, np.log(total))[c.part]
