"""Attention in pieces (SPEC §22): partial states from the oracle and the merge's tolerance.

A piece is the oracle's (o, lse) over a subset of the keys (a bool mask on top of the
call's own), rounded to the dtype under test (o) and to the log-sum-exp's dtype (float64
beside float64, float32 otherwise: FlashAttention's convention); the expected union is
the oracle over every key. The tolerance is §7's rule with the naive same-precision
merge (``fixtures/oracle_merge.py``) in place of the naive attention run.
"""

from __future__ import annotations

import collections

import numpy as np

from conformance.backends import numpy_dtype
from conformance.suite.tolerance import finite_error, tolerance


def lse_dtype(dtype: str) -> str:
    """The log-sum-exp's dtype beside outputs in ``dtype``."""
    return "float64" if dtype == "float64" else "float32"


def oracle_state(q, k, v, **options) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's (o, lse) in float64, kept for the process (the most recent 512)."""
    from conformance.fixtures import oracle

    key = tuple(
        (n, (x.dtype.str, x.shape, x.tobytes()) if isinstance(x, np.ndarray) else x)
        for n, x in sorted({"q": q, "k": k, "v": v, **options}.items())
    )
    if key in _CACHE:
        _CACHE.move_to_end(key)
    else:
        _CACHE[key] = oracle.attention(q, k, v, return_lse=True, **options)
        if len(_CACHE) > 512:
            _CACHE.popitem(last=False)
    o, lse = _CACHE[key]
    return o.copy(), lse.copy()


_CACHE: collections.OrderedDict = collections.OrderedDict()


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


def merge_tolerances(orders: list[list[tuple]], expected: tuple, dtype: str) -> tuple:
    """SPEC §22.1's tolerances for o and for lse: k times the naive merge's largest error
    over ``orders`` (each a list of pieces, merged left to right) plus §7's floor."""
    from conformance.fixtures.oracle_merge import naive_merge_same_precision

    runs = [naive_merge_same_precision(pieces) for pieces in orders]
    o_err = max(finite_error(o, expected[0]) for o, _ in runs)
    lse_err = max(finite_error(lse, expected[1]) for _, lse in runs)
    return (
        tolerance(dtype, o_err, expected[0]),
        tolerance(lse_dtype(dtype), lse_err, expected[1]),
    )
