"""The sequence laid out over P ranks, for ``ring.py`` and ``ulysses.py`` alike.

Both split the T queries and S keys over P ranks in one of two layouts. Contiguous: rank
r holds slice r of P. Zigzag (balances causal work): the sequence is cut into 2P chunks
and rank r holds chunks r and 2P − 1 − r:

    chunks          0    1    2    3    4    5    6    7          (P = 4)
    contiguous      r0   r0   r1   r1   r2   r2   r3   r3
    zigzag          r0   r1   r2   r3   r3   r2   r1   r0

A length that is no multiple of the chunk count is padded; padding is never attended.
Every slot keeps its original position (``tpos``, ``spos``), which travels with it, so
every mask decision (causality, the window, chunks, ALiBi's distance, padding) is taken on
the original positions whatever the layout. A packed call (SPEC §18) also gives every slot
its document (-1 for padding, which belongs to none) and, as its position, the one inside
its document, so that the same tests are counted within documents.

``Layout`` does this once on the caller's side, in NumPy: the arrays permuted into the
layout's order in the working precision, the positions, the options every rank needs, and
the way back (``rows_back``, ``cols_back``). Each page cuts its own shards from it.

Shape legend: B batch · H query heads · K key/value heads · T query length · S key/value
length · D q/k head dim · E v head dim · P ranks · Tl, Sl the per-rank slice lengths ·
Tp = P·Tl, Sp = P·Sl the padded lengths.
"""

from __future__ import annotations

import math

import numpy as np

from .. import contract

LAYOUTS = ("contiguous", "zigzag")
FAR = 2**30  # "unbounded" for a window side


class Layout:
    """The sequence laid out over P ranks: q (B, H, Tp, D), k (B, K, Sp, D), v (B, K, Sp,
    E), d_out (B, H, Tp, E) or None, mask (B|1, H|1, Tp|1, Sp|1) or None, in the layout's
    order and the working dtype; tpos (Tp,), spos (Sp,) the slots' positions, tdoc, sdoc
    their documents (packed) or None; sinks (H,), slopes (B, H) or None; ``opts``, the
    options every rank gets; ``pieces`` per rank (zigzag: 2).

    With ``documents`` = (cu_seqlens_q, cu_seqlens_k), a packed call (SPEC §18): a query's
    position is counted from its document's first query, a key's from its document's first
    key, and bottom-right alignment shifts document n's queries by its own S_n − T_n, so
    that ``opts["offset"]`` is 0.
    """

    def __init__(
        self, call: contract.Checked, q, k, v, mask, d_out, P: int, layout: str, sinks=None,
        slopes=None, documents=None,
    ) -> None:  # fmt: skip
        if layout not in LAYOUTS:
            raise ValueError(f"layout should be one of {LAYOUTS}, got {layout!r}")
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"world_size should be a positive int (P ranks), got {P!r}")
        if call.unbatched:
            q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
            d_out = None if d_out is None else d_out[None]  # (1, H, T, E)
        # Low precision is computed in float32 (inputs are exact there) and rounded once.
        work = np.float64 if q.dtype == np.float64 else np.float32
        self.P, self.T, self.S = P, call.T, call.S
        self.pieces = 2 if layout == "zigzag" else 1
        self.perm_t = _perm(call.T, P, self.pieces, layout)  # (Tp,)
        self.perm_s = _perm(call.S, P, self.pieces, layout)  # (Sp,)
        self.Tl, self.Sl = len(self.perm_t) // P, len(self.perm_s) // P
        self.q = _permute(q.astype(work), 2, self.perm_t)  # (B, H, Tp, D)
        self.k = _permute(k.astype(work), 2, self.perm_s)  # (B, K, Sp, D)
        self.v = _permute(v.astype(work), 2, self.perm_s)  # (B, K, Sp, E)
        self.d_out = None
        if d_out is not None:
            self.d_out = _permute(d_out.astype(work), 2, self.perm_t)  # (B, H, Tp, E)
        self.mask = None
        if mask is not None:
            mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
            mask = mask if mask.dtype == np.bool_ else mask.astype(work)
            if mask.shape[2] != 1:
                mask = _permute(mask, 2, self.perm_t)  # (B|1, H|1, Tp, S|1)
            if mask.shape[3] != 1:
                mask = _permute(mask, 3, self.perm_s)  # (B|1, H|1, Tp|1, Sp)
            self.mask = mask
        offset = 0 if call.causal_alignment == "top_left" else call.S - call.T
        self.tpos, self.spos, self.tdoc, self.sdoc = self.perm_t, self.perm_s, None, None
        if documents is not None:
            cu_q, cu_k = (np.asarray(cu, dtype=np.int64) for cu in documents)
            bottom_right = call.causal_alignment == "bottom_right"
            shift = np.diff(cu_k) - np.diff(cu_q) if bottom_right else 0  # (N,): S_n − T_n
            self.tdoc, self.tpos = _in_documents(cu_q, self.perm_t, shift)  # (Tp,), (Tp,)
            self.sdoc, self.spos = _in_documents(cu_k, self.perm_s, 0)  # (Sp,), (Sp,)
            offset = 0
        self.opts = _options(call, offset)
        # Sinks (H,) and slopes (B, H), in the working dtype.
        self.sinks = None if sinks is None else sinks.astype(work)  # (H,)
        self.slopes = None
        if slopes is not None:
            slopes = slopes.astype(work).reshape(-1, call.H)  # (B|1, H)
            self.slopes = np.broadcast_to(slopes, (call.B, call.H))  # (B, H)

    def rows_back(self, x: np.ndarray) -> np.ndarray:
        """Axis 2 from the layout's order back to the original one, padding cut off."""
        back = np.empty_like(x)
        back[:, :, self.perm_t] = x
        return back[:, :, : self.T]

    def cols_back(self, x: np.ndarray, axis: int) -> np.ndarray:
        """The key axis from the layout's order back to the original one, padding cut off."""
        back = np.empty_like(x)
        index = [slice(None)] * x.ndim
        index[axis] = self.perm_s
        back[tuple(index)] = x
        index[axis] = slice(0, self.S)
        return back[tuple(index)]

    def outputs(self, outs: list, dtype, return_lse: bool):
        """out (B, H, T, E) in ``dtype``, and with ``return_lse`` (out, lse (B, H, T)), from
        the ranks' results ``outs``, each its rows' out or (out, lse), in rank order."""
        if not return_lse:
            return self.rows_back(np.concatenate(outs, axis=2)).astype(dtype)  # (B, H, T, E)
        out = self.rows_back(np.concatenate([o for o, _ in outs], axis=2))  # (B, H, T, E)
        lse = self.rows_back(np.concatenate([x for _, x in outs], axis=2))  # (B, H, T)
        return out.astype(dtype), lse

    def qkv_grads(self, parts: list, dtype) -> list[np.ndarray]:
        """dq (B, H, T, D), dk (B, K, S, D), dv (B, K, S, E) in ``dtype``, from the ranks'
        results ``parts``, each (dq, dk, dv, ...) of its own slices, in rank order."""
        dq = self.rows_back(np.concatenate([g[0] for g in parts], axis=2))  # (B, H, T, D)
        dk = self.cols_back(np.concatenate([g[1] for g in parts], axis=2), 2)  # (B, K, S, D)
        dv = self.cols_back(np.concatenate([g[2] for g in parts], axis=2), 2)  # (B, K, S, E)
        return [g.astype(dtype) for g in (dq, dk, dv)]


def sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Undo broadcasting: sum x over the axes along which an array of ``shape`` was broadcast."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))  # drop the leading axes
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def scale_split(scale: float, largest: float) -> tuple[float, float | None]:
    """(folded, post), scale = folded · post: the part folded into the queries and the rest,
    multiplied into the products (None: nothing). q · scale can overflow where the score
    q·k·scale does not (scale 1e308), so a scale above 1 is folded only in [0.5, 1) and
    post = 2^e, a power of two still finite in a working precision whose largest number is
    ``largest``; multiplying by it is exact, so the scores differ from q·(scale)·k only
    by the rounding of one product. A scale of at most 1 is all folded, as before."""
    if scale <= 1.0:
        return scale, None
    _, e = math.frexp(scale)  # scale = m · 2^e, 0.5 <= m < 1
    e = min(e, math.frexp(largest)[1] - 1)
    return math.ldexp(scale, -e), math.ldexp(1.0, e)


def _options(call: contract.Checked, offset: int) -> dict:
    """What every rank needs to know of the call: the scale, the softcap, the diagonal's
    offset, the window as distances [lo, hi] from it (causality caps hi at 0), T and S
    (padding is at >= T, >= S), G query heads per key/value head, the chunk size."""
    left, right = call.window if call.window is not None else (None, None)
    hi = FAR if right is None else right
    return dict(
        scale=call.scale,
        softcap=call.softcap,
        offset=offset,
        lo=-FAR if left is None else -left,
        hi=min(hi, 0) if call.is_causal else hi,
        T=call.T,
        S=call.S,
        G=call.H // call.K,
        chunk=None if call.chunk_size is None else min(call.chunk_size, FAR),
    )


def _perm(n: int, P: int, pieces: int, layout: str) -> np.ndarray:
    """perm[slot] = original position (>= n: padding); slots are rank-major."""
    chunks = P * pieces
    c = max(1, -(-n // chunks))
    if layout == "contiguous":
        return np.arange(chunks * c)
    order = [i for r in range(P) for i in (r, 2 * P - 1 - r)]
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in order])


def _permute(x: np.ndarray, axis: int, perm: np.ndarray) -> np.ndarray:
    """x padded with 0 along ``axis`` to len(perm), then taken in the order ``perm``."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, len(perm) - x.shape[axis])
    return np.take(np.pad(x, pad), perm, axis=axis)


def _in_documents(cu: np.ndarray, perm: np.ndarray, shift) -> tuple[np.ndarray, np.ndarray]:
    """Each slot's document (-1 for padding, which belongs to none) and its position
    inside it plus its document's ``shift``; cu (N + 1,) the cumulative lengths, perm the
    layout's slot -> original position, (Lp,) with Lp = Tp for queries, Sp for keys."""
    real = perm < cu[-1]  # (Lp,)
    doc = np.full(len(perm), -1, dtype=np.int64)  # (Lp,)
    # A position t is in document n when cu[n] <= t < cu[n + 1]: empty documents skipped.
    doc[real] = np.searchsorted(cu, perm[real], side="right") - 1
    pos = perm.astype(np.int64)  # (Lp,): padding keeps its slot's own, never looked at
    pos[real] = perm[real] - cu[doc[real]] + np.broadcast_to(shift, (len(cu) - 1,))[doc[real]]
    return doc, pos
