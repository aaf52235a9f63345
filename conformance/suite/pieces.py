"""Attention in pieces (SPEC §22): partial states from the oracle and the merge's tolerance.

A piece is the oracle's (o, lse) over a subset of the keys (a bool mask on top of the
call's own), rounded to the dtype under test (o) and to the log-sum-exp's dtype (float64
beside float64, float32 otherwise: FlashAttention's convention); the expected union is
the oracle over every key. The tolerance is §7's rule with the naive same-precision
merge (``fixtures/oracle_merge.py``) in place of the naive attention run.
"""

from __future__ import annotations

import numpy as np

from conformance.backends import numpy_dtype
from conformance.suite.tolerance import finite_error, tolerance


def lse_dtype(dtype: str) -> str:
    """The log-sum-exp's dtype beside outputs in ``dtype``."""
    return "float64" if dtype == "float64" else "float32"


def oracle_state(q, k, v, **options) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's (o, lse) in float64, asked once per distinct input
    (``conformance.suite.oracle_store``)."""
    from conformance.suite.oracle_store import oracle

    return oracle.attention(q, k, v, return_lse=True, **options)


def key_parts(S: int, n: int, seed: int) -> list[np.ndarray]:
    """``n`` disjoint bool sets (S,) that cover the S keys, drawn at random (a set may be
    empty, and a row may see no key of one)."""
    owner = np.random.default_rng(seed).integers(0, n, S)  # (S,)
    return [owner == i for i in range(n)]


def pieces_of(q, k, v, parts, dtype: str, *, mask=None, **options) -> list[tuple]:
    """The oracle's state over each key set of ``parts`` (on top of ``mask`` and the
    options), o rounded to ``dtype`` and lse to its dtype."""
    found = []
    for part in parts:
        keys = part[None, None, None, :] if mask is None else (mask & part)  # (B|1, H|1, T, S)
        o, lse = oracle_state(q, k, v, mask=keys, **options)
        found.append(rounded(o, lse, dtype))
    return found


def rounded(o: np.ndarray, lse: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A float64 state as a backend would hold it in ``dtype``."""
    return o.astype(numpy_dtype(dtype)), lse.astype(numpy_dtype(lse_dtype(dtype)))


def merge_tolerances(
    orders: list[list[tuple]], expected: tuple, dtype: str, conversion=None
) -> tuple:
    """SPEC §22.1's tolerances for o and for lse: k times the naive merge's largest error
    over ``orders`` (each a list of pieces, merged left to right) plus §7's floor, plus,
    for a merge that takes its lse in another base (``conversion``: the backend's
    ``merge_conversion``), what the kit's conversion can move (SPEC §22.12)."""
    from conformance.fixtures.oracle_merge import naive_merge_same_precision

    runs = [naive_merge_same_precision(pieces) for pieces in orders]
    o_err = max(finite_error(o, expected[0]) for o, _ in runs)
    lse_err = max(finite_error(lse, expected[1]) for _, lse in runs)
    o_tol = tolerance(dtype, o_err, expected[0])
    lse_tol = tolerance(lse_dtype(dtype), lse_err, expected[1])
    if conversion is None:
        return o_tol, lse_tol
    o_more, lse_more = conversion_share(orders[0], expected, conversion)
    return o_tol + o_more, lse_tol + lse_more


def conversion_share(pieces: list[tuple], expected: tuple, conversion) -> tuple[float, float]:
    """SPEC §22.12: the largest change of the merged o and lse, over the rows, that the
    kit's rounding of each lse handed to the function (``a``, natural units) and of each
    lse read back (``b``) can make, for ``pieces`` merged in any order and grouping.

    ``conversion(L, dtype)`` gives (a, b) for lse of magnitude at most L held in
    ``dtype`` (per row: the largest of its pieces' and of the union's, which bounds every
    partial merge's)."""
    n = len(pieces)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.stack([np.asarray(p[1], dtype=np.float64) for p in pieces])  # (n, B, H, T)
        o = np.stack([np.asarray(p[0], dtype=np.float64) for p in pieces])  # (n, B, H, T, E)
        union = np.asarray(expected[1], dtype=np.float64)  # (B, H, T)
        seen = np.isfinite(lse)  # (n, B, H, T): a -inf piece weighs exp(-inf) = 0 however moved
        magnitude = np.max(np.where(seen, np.abs(lse), 0.0), axis=0)  # (B, H, T)
        magnitude = np.maximum(magnitude, np.where(np.isfinite(union), np.abs(union), 0.0))
        a, b = conversion(magnitude, np.asarray(pieces[0][1]).dtype)  # (B, H, T) each
        d = a + b
        top = np.max(np.where(seen, lse, -np.inf), axis=0)  # (B, H, T)
        low = np.min(np.where(seen, lse, np.inf), axis=0)  # (B, H, T)
        # Equal lse convert to equal values: a shift common to every piece moves no weight.
        moved = seen.sum(axis=0) >= 2
        moved &= top > low
        # Every weight but the largest one's, at its largest under the perturbation.
        first_top = np.argmax(np.where(seen, lse, -np.inf), axis=0)  # (B, H, T)
        others = seen & (np.arange(n)[:, None, None, None] != first_top)  # (n, B, H, T)
        lifted = np.where(others, np.exp(np.minimum(lse - top + 2 * n * d, 0.0)), 0.0)
        share = np.minimum(1.0, 2.0 * lifted.sum(axis=0))  # (B, H, T)
        hi = np.max(np.where(seen[..., None], o, -np.inf), axis=0)  # (B, H, T, E)
        lo = np.min(np.where(seen[..., None], o, np.inf), axis=0)  # (B, H, T, E)
        spread = np.max(np.where(seen.any(axis=0)[..., None], hi - lo, 0.0), axis=-1)
        inputs = (n - 1) * a + (n - 1) * (n - 2) / 2 * d  # (B, H, T)
        o_more = np.where(moved & np.isfinite(spread), inputs * share * spread, 0.0)
        lse_more = np.where(np.isfinite(union), (n - 1) * d, 0.0)
    return float(np.max(o_more, initial=0.0)), float(np.max(lse_more, initial=0.0))
