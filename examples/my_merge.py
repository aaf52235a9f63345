"""Your merge of partial states, checked against the spec (SPEC §22): copy this file and
replace the function. Its profile is ``examples/my_merge.toml``, a merge alone:

    pytest --pyargs conformance.tests.test_merge --impl-profile examples/my_merge.toml

A partial state is (o, lse): o (B, H, T, E) the attention output over some of a row's
keys, lse (B, H, T) the natural log-sum-exp of their scores; a row that saw no key is
(0, -inf). Two states over disjoint key sets merge into attention over their union.
"""

from __future__ import annotations

import numpy as np


def merge_states(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets, from each set's state.

    Args:
      o_a, o_b: (B, H, T, E) outputs over each key set.
      lse_a, lse_b: (B, H, T) their natural log-sum-exps (-inf: no key seen).

    Returns:
      (o, lse): (B, H, T, E) in o_a's dtype and (B, H, T) in lse_a's.
    """
    work = np.float64 if o_a.dtype == np.float64 else np.float32
    # The larger lse taken off first: every exp() is at most 1, nothing overflows.
    m = np.maximum(lse_a, lse_b).astype(work)  # (B, H, T)
    # Two empty states: -inf - (-inf) would be NaN; with m = 0 both weights are 0.
    m = np.where(m == -np.inf, work(0), m)
    # Pieces at opposite ends of the range: lse - m passes the largest float to -inf,
    # whose weight is 0, as it should be.
    with np.errstate(over="ignore"):
        w_a = np.exp(lse_a.astype(work) - m)  # (B, H, T)
        w_b = np.exp(lse_b.astype(work) - m)
    total = w_a + w_b
    safe = np.where(total == 0, work(1), total)
    o = (w_a[..., None] * o_a.astype(work) + w_b[..., None] * o_b.astype(work)) / safe[..., None]
    with np.errstate(divide="ignore"):  # log(0) = -inf: the empty state stays empty
        lse = m + np.log(total)  # (B, H, T)
    return o.astype(o_a.dtype), lse.astype(lse_a.dtype)
