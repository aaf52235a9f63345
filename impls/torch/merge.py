"""Merging two partial attention states by their log-sum-exp, in PyTorch.

A partial state is what attention over *some* of a row's keys returns: its output o and
the natural log-sum-exp of those keys' scores, lse = log Σ_s exp(score[s]). Two states
over disjoint key sets A and B give attention over A ∪ B:

    m   = max(lse_a, lse_b)                  the larger log-sum-exp
    w_a = exp(lse_a − m)                     each piece's share, relative to the larger
    w_b = exp(lse_b − m)                     (one of them is 1, the other <= 1)
    o   = (w_a · o_a + w_b · o_b) / (w_a + w_b)
    lse = m + log(w_a + w_b)

Why it is exact: o_a = Σ_{s∈A} exp(x_s) v_s / exp(lse_a), so exp(lse_a) · o_a is A's
unnormalised sum, and the union's output is the two unnormalised sums over the two
denominators, exp(lse_a) + exp(lse_b). Dividing numerator and denominator by exp(m)
changes nothing and keeps every exp() <= 1. It is the online softmax of ``flash.py``
with whole pieces in place of key blocks, and what split-KV decoding (``split_kv.py``),
ring attention and cascade attention use to put their pieces together. The merge is
associative and commutative up to rounding, so pieces may be merged in any order.

The second step: why a ring carries m and l, not the lse. A piece's lse is m + log l,
its largest score m plus the log of its shifted sum l = Σ exp(score − m), 1 <= l <= S.
Rounded to float32, an lse near 1e4 is off by up to half an ulp there, 2⁻¹¹ ≈ 4.9e-4, and
so, relatively, is the piece's weight exp(lse − max); the rounding is the lse's size's,
not the row's. Kept apart, m is a score as it was computed (no rounding added) and l, a
small number however large |m| is, is rounded at 6e-8 of itself, so the weight
exp(m_a − m) · l_a is off by a few eps
at any |m|: ``merge_partials`` merges states carried as (o, m, l), the form a ring or a
blockwise loop keeps, and is what ``merge_states`` runs, with m = lse and l = 1 (exact:
a weight times 1 is the weight). A state (o, m, l) stands for (o, m + log l).

Shapes: o (B, H, T, E) and lse (B, H, T), or any leading axes, (..., E) and (...).
The working precision is float64 for float64 outputs and float32 otherwise; o is
returned in o_a's dtype and lse in lse_a's.
"""

from __future__ import annotations

import torch

from .. import contract


def textbook_merge(o_a, lse_a, o_b, lse_b):
    """The merge as the formula writes it, for two pieces that each saw a key."""
    m = torch.maximum(lse_a, lse_b)  # (B, H, T)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # (B, H, T), (B, H, T)
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None]  # (B, H, T, E)
    return o, m + torch.log(w_a + w_b)  # (B, H, T, E), (B, H, T)


def merge_states(o_a, lse_a, o_b, lse_b):
    """Attention over the union of two disjoint key sets, from each set's (o, lse).

    Args:
      o_a, o_b: (B, H, T, E), the outputs over key sets A and B (0 where a row saw none).
      lse_a, lse_b: (B, H, T), their log-sum-exps (-inf where a row saw no key).

    Returns:
      (o, lse): (B, H, T, E) in o_a's dtype and (B, H, T) in lse_a's dtype.
    """
    # 0. Check the inputs: two states of the same rows.
    contract.check_merge(o_a, lse_a, o_b, lse_b)
    o_dtype, lse_dtype = o_a.dtype, lse_a.dtype
    o_a, lse_a, o_b, lse_b = working(o_a, lse_a, o_b, lse_b)

    # 1-4. The merge of (o, m, l) states, each piece's lse standing as its m with l = 1.
    o, m, l = merge_partials(o_a, lse_a, 1.0, o_b, lse_b, 1.0)  # (B, H, T, E), (B, H, T), ...

    # 5. The union's log-sum-exp.
    lse = union_lse(m, l)  # (B, H, T)
    return o.to(o_dtype), lse.to(lse_dtype)


def merge_partials(o_a, m_a, l_a, o_b, m_b, l_b):
    """Attention over the union of two disjoint key sets, from each set's (o, m, l): o its
    output, m its largest score, l its sum of exp(score − m) (l = 0 and m = -inf: no key;
    an m of 0 there would outweigh the other piece's scores far below 0). Returns the
    union's (o, m, l), in the arrays' precision; its lse is ``union_lse(m, l)``.

    Shapes: o_a, o_b (B, H, T, E); m_a, m_b, l_a, l_b (B, H, T) (or numbers).
    """
    # 1. The larger maximum; a row that neither piece saw a key of has none (-inf), and
    # is shifted by 0 instead.
    m = torch.maximum(m_a, m_b)  # (B, H, T)
    shift = empty_as_0(m)  # (B, H, T)

    # 2. Each piece's sum, moved onto it: exp() of a number <= 0, so <= 1, times l.
    w_a = torch.exp(m_a - shift) * l_a  # (B, H, T)
    w_b = torch.exp(m_b - shift) * l_b  # (B, H, T)

    # 3. The union's sum, relative to exp(m).
    l = w_a + w_b  # (B, H, T)

    # 4. The outputs, weighted by their pieces' shares of the union.
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / divisor(l)[..., None]  # (B, H, T, E)
    return o, m, l


def working(o_a, lse_a, o_b, lse_b):
    """The four arrays in the working precision: float64 for float64 outputs, float32 for
    the others (16-bit outputs are merged in float32 and rounded once)."""
    work = torch.float64 if o_a.dtype == torch.float64 else torch.float32
    return tuple(x.to(work) for x in (o_a, lse_a, o_b, lse_b))


# --- Edge cases -----------------------------------------------------------------------------
#
# Empty pieces (SPEC §22.2, §22.3). A piece whose rows saw no key is the empty state
# (0, -inf): exp(-inf - m) = 0, so it adds nothing and the merge returns the other piece
# exactly (weight 1, divisor 1). Two empty pieces would give m = -inf and
# -inf - (-inf) = NaN: m is taken as 0 there (``empty_as_0``), both weights are then
# exp(-inf) = 0, the divisor 1 (``divisor``), and the row stays (0, -inf) (``union_lse``).
#
# Overflow (SPEC §22.5). Nothing is exponentiated above 0: lse values of 1e4, or near the
# largest float, never meet exp() themselves. lse_b - m may overflow to -inf when the two
# lie at opposite ends of the range; its weight is then exp(-inf) = 0, which is its true
# value rounded. m + log(l) adds at most log 2 to m in ``merge_states`` (l = w_a + w_b <= 2)
# and log S in ``merge_partials`` (l <= the S keys of both pieces), far below an ulp of an
# m near the largest float, so it cannot overflow either.
#
# NaN (SPEC §22.7). A NaN log-sum-exp (a NaN row) makes m, both weights and the row NaN;
# so does a log-sum-exp of +inf (a piece whose sum overflowed, or a +inf sink, §22.6):
# exp(inf - inf) is NaN, and NaN stays NaN through ``divisor`` and ``union_lse``.


def empty_as_0(m):
    """The larger log-sum-exp, 0 where both pieces are empty (m = -inf), so that no
    -inf - (-inf) = NaN is formed; a NaN stays NaN."""
    return torch.where(m == -torch.inf, 0.0, m)  # (B, H, T)


def divisor(l):
    """What divides the row: l, and 1 where both pieces are empty (l = 0), so the row is
    0, not 0 / 0 = NaN; a NaN l stays NaN."""
    return torch.where(l == 0, 1.0, l)  # (B, H, T)


def union_lse(m, l):
    """m + log(l), and -inf where both pieces are empty (l = 0: no key at all)."""
    return torch.where(l == 0, -torch.inf, m + torch.log(divisor(l)))  # (B, H, T)
