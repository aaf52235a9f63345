"""The fast path of blockwise attention in NumPy: ``flash.py``'s algorithm, made fast.

``flash.py`` teaches the online softmax on plain tiles; ``flash.attention(..., fast=True)``
(what the numpy-flash backend runs) hands the whole call to ``attention`` below, which
gives the same rows, up to rounding, faster. Each thing on this page is an optimisation,
none a new idea:

- Optimisation 1, the grouped layout (``prepare``). Query head h = k·G + g shares
  key/value head k (PyTorch's repeat_interleave order), so the G query heads of a
  key/value head are stacked as G·Tb rows of one tile, (B·K, G·Tb, ·), as views: each key
  tile is read and multiplied once for its G query heads, and no input is repeated or
  copied (the textbook path repeats each key tile G times).
- Optimisation 2, the scale on the query tile (``query_tile``). Every tile's product
  starts from the same query tile, so the scale is applied to it once, (scale·q)·kᵀ:
  Tb·D multiplies instead of Tb·Sb per tile. Under a huge scale that order can overflow
  where (q·kᵀ)·scale does not (scale 1e308, q·k = 1.36: a finite score of 1.36e308), so
  where the scale could make that happen at all (``may_overflow``), an entry of the
  product that is not finite is computed again in the textbook order
  (``KeyTiles.rescored``); elsewhere nothing is checked.
- Optimisation 3, a reused score buffer (``KeyTiles.scores``): one (B·K, G·Tb, Sb) tile
  is allocated once and written in place from tile to tile, as are the softcap and the
  exponentials; the 5-D view (B, K, G, Tb, Sb) of it takes the masks without a copy.
- Optimisation 4, tiles skipped by ranges (``Band``). Causal and window masks are bands
  around the diagonal: for a query block, the keys split into ranges no row may see
  (never visited), ranges every row sees (no mask computed) and the two diagonal strips
  between them, masked key by key. Chunks cut those ranges to the block's chunks.
- Optimisation 5, the maximum deferred (``deferred_max_softmax``, at the end, with why
  it is exact and what it saves): no maximum, no rescaling in the common case.

Memory: beyond inputs and output, one call holds a score tile, a (B·K, G·Tb, E)
accumulator and a (B·K, G·Tb, D) query tile: with the default tiles and B=1, H=8, about
6 MiB in float32, whatever T and S are. The backward (``flash.attention_vjp``) walks the
same tiles.

Shape legend: the core page's (``attention.py``), and Tb query block, Sb key block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from .. import contract
from .attention import visible


def prepare(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    options: dict,
    block_q: int,
    block_k: int,
    d_out: np.ndarray | None = None,
) -> tuple[contract.Checked, np.ndarray, KeyTiles]:
    """Step 0 and the layout: the checked call, q as (B·K, G, T, D) and the key tiles."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    if options["alibi_slopes"] is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        **options,
        unsupported={"dropout_p": "numpy-flash is blockwise attention without dropout"},
        tiles={"block_q": block_q, "block_k": block_k},
        d_out=d_out,
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    B, K, G, T, S, D, E = call.B, call.K, call.G, call.T, call.S, call.D, call.E
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = np.broadcast_to(mask.reshape(call.mask_shape), (b, h, T, S))  # (B|1, H|1, T, S)

    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    work = np.float64 if q.dtype == np.float64 else np.float32
    offset = 0 if call.causal_alignment == "top_left" else S - T
    slopes = options["alibi_slopes"]
    if slopes is not None:
        # One slope per query head, in the grouped layout the score tiles have.
        slopes = slopes.astype(work).reshape(-1, K, G, 1, 1)  # (B|1, K, G, 1, 1)
    # Optimisation 1, the grouped layout: a view, no copy of an input.
    q = q.reshape(B * K, G, T, D)  # (B·K, G, T, D)
    tiles = KeyTiles(
        k.reshape(B * K, S, D),  # (B·K, S, D)
        v.reshape(B * K, S, E),  # (B·K, S, E)
        mask,
        Band(offset, call.is_causal, call.window, call.chunk_size),
        call.softcap,
        slopes,
        T,
        K,
        G,
        block_k,
        work,
        queries=q if may_overflow(q, k, call.scale, work) else None,
        scale=call.scale,
    )
    return call, q, tiles  # (B·K, G, T, D)


def query_tile(q: np.ndarray, t0: int, t1: int, scale: float, work: type) -> np.ndarray:
    """Query rows [t0, t1) of every head, scaled, as G·Tb rows per key/value head."""
    BK, G, _, D = q.shape
    # Under a huge scale scale·q may overflow: the key tiles then compute the scores it
    # spoils again (KeyTiles.rescored), so the inf is expected here.
    with np.errstate(over="ignore"):
        qs = q[:, :, t0:t1].astype(work) * work(scale)  # (B·K, G, Tb, D), a copy
    return qs.reshape(BK, G * (t1 - t0), D)  # (B·K, G·Tb, D)


def may_overflow(q: np.ndarray, k: np.ndarray, scale: float, work: type) -> bool:
    """Whether the prescaled product (scale·q)·kᵀ could overflow anywhere (optimisation
    2): its terms and partial sums are at most D · scale · max|q| · max|k| in size. A NaN or an inf in q or k (garbage in a slot no query sees) counts as could."""
    if q.size == 0 or k.size == 0:
        return False
    largest = _largest_magnitude(q) * _largest_magnitude(k)
    return not q.shape[-1] * scale * largest < float(np.finfo(work).max) / 2


def _largest_magnitude(x: np.ndarray) -> float:
    """max |x|, NaN if x holds one; max and -min read x twice but copy nothing."""
    return max(float(x.max()), -float(x.min()))


class KeyTiles:
    """The keys and values, the mask and the band: which key tiles a query block visits,
    and steps 1, 3 and 4 on one tile."""

    def __init__(
        self,
        k: np.ndarray,
        v: np.ndarray,
        mask: np.ndarray | None,
        band: Band,
        softcap: float | None,
        alibi: np.ndarray | None,
        T: int,
        K: int,
        G: int,
        block_k: int,
        work: type,
        queries: np.ndarray | None = None,
        scale: float = 1.0,
    ) -> None:
        self.k, self.v = k, v  # (B·K, S, D), (B·K, S, E)
        self.S = k.shape[1]
        self.float_mask = mask if mask is not None and mask.dtype != np.bool_ else None
        self.bool_mask = mask if mask is not None and mask.dtype == np.bool_ else None
        self.band, self.softcap = band, softcap
        self.alibi, self.T = alibi, T  # ALiBi's slopes (B|1, K, G, 1, 1), or None
        self.K, self.G, self.block_k, self.work = K, G, block_k, work
        self.ones = np.ones(block_k, dtype=work)  # (Sb,): row sums as a matrix-vector product
        self.buffer = np.empty(0, dtype=work)  # the score tile, reused
        self.tanh = np.empty(0, dtype=work)  # the last tile's tanh(R/c), for the backward
        # The unscaled queries (B·K, G, T, D) where the prescaled product may overflow
        # (``may_overflow``), to compute such scores again; None where it cannot.
        self.queries, self.scale = queries, scale

    def ranges(self, t0: int, t1: int) -> Iterator[tuple[int, int, bool]]:
        """(s0, s1, whole) for each key tile query rows [t0, t1) visit, in key order.

        ``whole``: every row of the block may see every key of the tile (as far as the
        band goes), so the band needs no masking there.
        """
        for a, b, whole in self.band.ranges(t0, t1, self.S):
            for s0 in range(a, b, self.block_k):
                yield s0, min(s0 + self.block_k, b), whole

    def scores(
        self,
        qs: np.ndarray,
        t0: int,
        t1: int,
        s0: int,
        s1: int,
        whole: bool,
        keep_tanh: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Steps 1, 3 and 4 on tile (t0:t1, s0:s1): (B·K, G·Tb, Sb), in the reused buffer,
        and which keys of the tile some query of the block may see, (B·K, Sb, 1) bool, or
        None when every query may see every key. ``keep_tanh``: keep the softcap's
        tanh(R/c) in ``self.tanh``, for its derivative."""
        BK, R, _ = qs.shape  # R = G·Tb rows
        Tb, Sb = t1 - t0, s1 - s0
        if self.buffer.size < BK * R * Sb:
            self.buffer = np.empty(BK * R * self.block_k, dtype=self.work)

        # 1. Scores: every query of the block against every key of the tile. A key
        # holding inf or NaN, or one whose product overflows, gives inf or NaN scores
        # here: step 4 replaces them where the key is blocked (SPEC §4.7), and where it
        # is not they make the row NaN (§4.8, §4.9), so the invalid operation is meant.
        kb = self.k[:, s0:s1].astype(self.work, copy=False)  # (B·K, Sb, D)
        x = self.buffer[: BK * R * Sb].reshape(BK, R, Sb)  # (B·K, G·Tb, Sb)
        with np.errstate(invalid="ignore", over="ignore"):
            np.matmul(qs, kb.transpose(0, 2, 1), out=x)  # (B·K, G·Tb, Sb)
        if self.queries is not None:
            self.rescored(x, kb, t0, t1)

        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        if self.softcap is not None:
            # A score far above the softcap overflows to ±inf here, whose tanh is exactly ±1.
            with np.errstate(over="ignore"):
                np.tanh(x / self.softcap, out=x)  # (B·K, G·Tb, Sb)
            if keep_tanh:
                self.tanh = x.copy()  # (B·K, G·Tb, Sb)
            x *= self.work(self.softcap)  # (B·K, G·Tb, Sb)

        # 4. Mask: ALiBi's linear bias and a float mask are added; a bool mask, the causal
        # triangle, the window and the chunks decide which keys each query may see at all,
        # and so does a float mask's -inf: blocked scores are replaced, not only pushed
        # down by adding -inf, since NaN + -inf is NaN.
        x5 = x.reshape(BK // self.K, self.K, self.G, Tb, Sb)  # (B, K, G, Tb, Sb), a view
        if self.alibi is not None:
            with np.errstate(invalid="ignore"):
                x5 += self.alibi_bias(t0, t1, s0, s1)  # (B, K, G, Tb, Sb)
        allowed = True
        if self.float_mask is not None:
            tile = self.float_mask[:, :, t0:t1, s0:s1]  # (B|1, H|1, Tb, Sb)
            # +inf + -inf is NaN, which the -inf entry's replacement below undoes.
            with np.errstate(invalid="ignore"):
                x5 += grouped(tile, self.K, self.G)  # (B, K, G, Tb, Sb)
            allowed = grouped(tile != -np.inf, self.K, self.G)  # (B|1, K|1, G|1, Tb, Sb)
        if self.bool_mask is not None:
            tile = self.bool_mask[:, :, t0:t1, s0:s1]  # (B|1, H|1, Tb, Sb)
            allowed = grouped(tile, self.K, self.G)  # (B|1, K|1, G|1, Tb, Sb)
        if not whole:
            allowed = allowed & self.band.allowed(t0, t1, s0, s1)  # (.., Tb, Sb)
        if allowed is True:
            return x, None
        np.copyto(x5, -np.inf, where=~allowed)  # (B, K, G, Tb, Sb)
        allowed = np.reshape(allowed, (1,) * (5 - np.ndim(allowed)) + np.shape(allowed))
        used = allowed.any(axis=(2, 3))  # (B|1, K|1, Sb)
        used = np.broadcast_to(used, (BK // self.K, self.K, Sb))  # (B, K, Sb)
        return x, used.reshape(BK, Sb, 1)  # (B·K, Sb, 1)

    def rescored(self, x: np.ndarray, kb: np.ndarray, t0: int, t1: int) -> None:
        """Step 1 again, in place, for the entries of the tile x (B·K, G·Tb, Sb) that the
        prescaled product left inf or NaN: (q·kᵀ)·scale, as the core page orders it, is
        ±inf where the score overflows and finite where it does not (optimisation 2). A
        NaN from a NaN in q or k stays NaN."""
        bad = ~np.isfinite(x)  # (B·K, G·Tb, Sb)
        if not bad.any():
            return
        BK, R, _ = x.shape  # R = G·Tb rows
        q = self.queries[:, :, t0:t1].astype(self.work)  # (B·K, G, Tb, D)
        with np.errstate(invalid="ignore", over="ignore"):
            exact = np.matmul(q.reshape(BK, R, -1), kb.transpose(0, 2, 1))  # (B·K, G·Tb, Sb)
            exact *= self.work(self.scale)  # (B·K, G·Tb, Sb)
        np.copyto(x, exact, where=bad)  # (B·K, G·Tb, Sb)

    def rescored_key_grads(self, dk: np.ndarray, dz: np.ndarray, t0: int, t1: int) -> None:
        """1'. The tile's dk (B·K, Sb, D) again, in place, where the prescaled queries left
        it inf or NaN: dZᵀ·(scale·q) is 0 · inf where scale·q overflowed and dZ is 0, but
        (dZᵀ·q)·scale is the gradient (``rescored``, for the backward)."""
        bad = ~np.isfinite(dk)  # (B·K, Sb, D)
        if not bad.any():
            return
        BK, R, _ = dz.shape  # R = G·Tb rows
        q = self.queries[:, :, t0:t1].astype(self.work)  # (B·K, G, Tb, D)
        with np.errstate(invalid="ignore", over="ignore"):
            exact = np.matmul(dz.transpose(0, 2, 1), q.reshape(BK, R, -1))  # (B·K, Sb, D)
            exact *= self.work(self.scale)  # (B·K, Sb, D)
        np.copyto(dk, exact, where=bad)  # (B·K, Sb, D)

    def alibi_bias(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """ALiBi's bias on tile (t0:t1, s0:s1), (B|1, K, G, Tb, Sb): −slope · |t + S − T −
        s|, the distance from the bottom-right diagonal whatever the causal alignment."""
        t = np.arange(t0, t1)[:, None]  # (Tb, 1)
        s = np.arange(s0, s1)[None, :]  # (1, Sb)
        distance = np.abs(t + self.S - self.T - s).astype(self.work)  # (Tb, Sb)
        return -self.alibi * distance  # (B|1, K, G, Tb, Sb)

    def keys(self, s0: int, s1: int, used: np.ndarray | None) -> np.ndarray:
        """Key rows [s0, s1) in the working precision, (B·K, Sb, D); a key that no query
        of the block may see (padding, a KV-cache slot not yet written) replaced by 0, so
        that whatever it holds has no effect (0 · NaN and 0 · inf are NaN)."""
        kb = self.k[:, s0:s1].astype(self.work, copy=False)  # (B·K, Sb, D)
        return kb if used is None else np.where(used, kb, 0.0)  # (B·K, Sb, D)

    def values(self, s0: int, s1: int, used: np.ndarray | None) -> np.ndarray:
        """Value rows [s0, s1) in the working precision, (B·K, Sb, E); unused ones 0."""
        vb = self.v[:, s0:s1].astype(self.work, copy=False)  # (B·K, Sb, E)
        return vb if used is None else np.where(used, vb, 0.0)  # (B·K, Sb, E)

    def add_mask_grad(
        self, dm: np.ndarray, dz: np.ndarray, t0: int, t1: int, s0: int, s1: int
    ) -> None:
        """4'. dmask += dZ on tile (t0:t1, s0:s1), summed over the axes along which one
        mask entry served many scores (broadcasting)."""
        b, h, tm, sm = dm.shape  # (B|1, H|1, T|1, S|1)
        Tb, Sb = t1 - t0, s1 - s0
        d = dz.reshape(-1, self.K * self.G, Tb, Sb)  # (B, H, Tb, Sb): h = k·G + g
        axes = tuple(i for i, n in enumerate((b, h, tm, sm)) if n == 1)
        d = d.sum(axis=axes, keepdims=True)  # (B|1, H|1, Tb|1, Sb|1)
        rows = slice(None) if tm == 1 else slice(t0, t1)
        cols = slice(None) if sm == 1 else slice(s0, s1)
        dm[:, :, rows, cols] += d  # (B|1, H|1, Tb|1, Sb|1)


class Band:
    """The causal/window band: which keys s query t may see, as s - (t + offset); and the
    chunks, (t + offset) // chunk == s // chunk."""

    def __init__(
        self,
        offset: int,
        is_causal: bool,
        window: tuple[int | None, int | None] | None,
        chunk: int | None = None,
    ) -> None:
        # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that
        # the last query lines up with the last key). Allowed: lo <= s - (t + offset) <= hi.
        left, right = window if window is not None else (None, None)
        self.offset = offset
        self.lo = -math.inf if left is None else -left
        self.hi = math.inf if right is None else right
        if is_causal:
            self.hi = min(self.hi, 0)
        self.active = is_causal or window is not None
        self.is_causal, self.window, self.chunk = is_causal, window, chunk

    def ranges(self, t0: int, t1: int, S: int) -> list[tuple[int, int, bool]]:
        """Key ranges (s0, s1, whole) that query rows [t0, t1) can see, in key order.

        Row t sees keys t + offset + lo … t + offset + hi. Moving down the block's Tb rows
        shifts that range by Tb - 1, so the keys the block can see are: a strip Tb wide
        that only the lower rows see, the keys every row sees (``whole``: no masking), and
        a strip Tb wide that only the upper rows see. Keys outside are never visited.
        """
        Tb = t1 - t0
        first = t0 + self.offset + self.lo  # row t0's first key (-inf: key 0)
        last = t0 + self.offset + self.hi  # row t0's last key (inf: key S - 1)
        if not self.active:
            edges = [(0, S, True)]
        elif first + Tb >= last:
            # A band narrower than the block: all of it is a diagonal strip.
            edges = [(first, last + Tb, False)]
        else:
            edges = [(first, first + Tb, False), (first + Tb, last, True), (last, last + Tb, False)]
        lo, hi, single = 0, S, True
        if self.chunk is not None:
            # The rows' chunks run from that of row t0 to that of row t1 - 1: keys outside
            # them are skipped, and a block in more than one chunk is masked key by key.
            first_chunk = (t0 + self.offset) // self.chunk
            last_chunk = (t1 - 1 + self.offset) // self.chunk
            lo, hi = first_chunk * self.chunk, (last_chunk + 1) * self.chunk
            single = first_chunk == last_chunk
        clipped = [(max(a, lo, 0), min(b, hi, S), whole and single) for a, b, whole in edges]
        return [(int(a), int(b), whole) for a, b, whole in clipped if a < b]

    def allowed(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """Which keys each query of the tile may see: (Tb, Sb) bool, the core page's
        ``visible`` on the tile's positions."""
        t = np.arange(t0, t1)[:, None] + self.offset  # (Tb, 1): each query's diagonal
        s = np.arange(s0, s1)[None, :]  # (1, Sb)
        allowed = np.ones((t1 - t0, s1 - s0), dtype=bool)  # (Tb, Sb)
        return visible(allowed, t, s, self.is_causal, self.window, self.chunk)  # (Tb, Sb)


def grouped(x: np.ndarray, K: int, G: int) -> np.ndarray:
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)  # (B|1, 1, 1, T, S)
    return x.reshape(b, K, G, t, s)  # (B|1, K, G, T, S)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    options: dict,
    block_q: int,
    block_k: int,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """``flash.attention(..., fast=True)``: the same output, through optimisations 1-5;
    with ``return_lse``, (out, lse) as on ``flash.attention``."""
    call, q, tiles = prepare(q, k, v, mask, options, block_q, block_k)
    B, H, K, G, T, E = call.B, call.H, call.K, call.G, call.T, call.E
    out = np.empty((B * K, G, T, E), dtype=q.dtype)  # (B·K, G, T, E)
    lse = np.empty((B * K, G, T), dtype=tiles.work)  # (B·K, G, T)

    for t0 in range(0, T, block_q):
        t1 = min(t0 + block_q, T)
        Tb = t1 - t0
        # Steps 1 and 2 start here: the query tile, scaled once (optimisation 2).
        qs = query_tile(q, t0, t1, call.scale, tiles.work)  # (B·K, G·Tb, D)
        # Steps 3-5 and 7, key tile by key tile, the maximum deferred (optimisation 5).
        acc, l, m = fast_online_softmax(qs, t0, t1, tiles)
        if options["sinks"] is not None:
            sink = sink_rows(options["sinks"], call, Tb, tiles.work)  # (B·K, G·Tb, 1)
            acc, l, m = add_sink(acc, l, m, sink)
        lse[:, :, t0:t1] = running_lse(m, l).reshape(B * K, G, Tb)  # (B·K, G, Tb)

        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        # Assigning into out rounds to the output dtype once.
        acc = normalise(acc, l)  # (B·K, G·Tb, E)
        out[:, :, t0:t1] = acc.reshape(B * K, G, Tb, E)  # (B·K, G, Tb, E)

    # The query heads back in order h = k·G + g.
    out = out.reshape(B, H, T, E)  # (B, H, T, E)
    lse = lse.reshape(B, H, T)  # (B, H, T)
    if call.unbatched:
        out, lse = out[0], lse[0]  # (H, T, E), (H, T)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------
# Optimisation 5: the maximum deferred. ``fast_online_softmax`` runs the online softmax
# through ``deferred_max_softmax`` first, which gives the same rows faster where it is
# exact, and takes the others from the recurrence with the maximum, ``online_softmax``.
#
# Deferring the max. Since any constant m gives the same answer, m = 0 does too, as long
# as nothing leaves the floating-point range: then there is no max to find, nothing to
# subtract and nothing to rescale, only exp(x), and l and a are plain sums. That is the
# common case (scores of a few units), and it saves two of the four passes over every
# tile, the max and the subtraction (exp and the sum remain). Whether it held is checked for each row after its last key tile: its sum l finite
# and at least √tiny (about 1e-19 in float32, where tiny is the smallest normal number),
# and its output sums a finite. An overflow shows as inf or NaN in l or a; a weight small
# enough to underflow is below tiny, so with l >= √tiny all such weights together weigh
# less than S · √tiny of the row, far below rounding. A row that fails the check (huge or
# very negative scores, no key at all, a NaN) is taken from ``online_softmax`` over its
# block instead; the choice is made row by row, so a row's result never depends on
# another row's values. The backward's log-sum-exp is then log l (m = 0) or m + log l.
#
# Why passes are what to save. The two products per tile are ``np.matmul`` on float32
# arrays, which BLAS runs on all cores, and so is the row sum, a matrix-vector product
# with a vector of ones; the rest is elementwise passes over the tile, done in place, on
# one core (NumPy's ufuncs are single-threaded). With the max deferred a tile needs one
# elementwise pass (exp) instead of three (max, subtract, exp), beside the sum, a BLAS
# product either way, and only the diagonal strips a second (the mask). The block sizes trade Python overhead and BLAS efficiency (larger
# tiles) against cache residency and causal skipping (smaller ones): a query block of Tb
# rows wastes about Tb²/2 masked scores on the diagonal. 256 × 512 was fastest on 2
# cores, causal and not (T = 4096, float32). (Running query blocks on Python threads
# would parallelise the elementwise passes, but OpenBLAS's own threads then fight them
# for the cores and every matmul stalls.)


def deferred_max_softmax(
    qs: np.ndarray, t0: int, t1: int, tiles: KeyTiles
) -> tuple[np.ndarray, np.ndarray]:
    """``online_softmax``'s (acc, l) for one query block with the max deferred
    (m = 0): exact for the rows ``in_range`` passes, and for those only."""
    BK, R, _ = qs.shape  # R = G·Tb rows
    work = qs.dtype
    l = np.zeros((BK, R, 1), dtype=work)  # (B·K, G·Tb, 1)
    acc = np.zeros((BK, R, tiles.v.shape[-1]), dtype=work)  # (B·K, G·Tb, E)
    pv = np.empty_like(acc)  # (B·K, G·Tb, E)
    for s0, s1, whole in tiles.ranges(t0, t1):
        x, used = tiles.scores(qs, t0, t1, s0, s1, whole)  # (B·K, G·Tb, Sb), steps 1, 3, 4
        Sb = s1 - s0
        # A score above about 88 (float32) overflows exp() to inf, and an inf weight or
        # value makes inf or NaN in the sums: the check after the loop catches both and
        # takes the row from online_softmax, so these are expected, not faults.
        with np.errstate(over="ignore", invalid="ignore"):
            # 5. Softmax over the keys, with the exponent taken against 0.
            p = np.exp(x, out=x)  # (B·K, G·Tb, Sb)
            # The row sums as a matrix-vector product: BLAS runs it on every core.
            l += np.dot(p.reshape(BK * R, Sb), tiles.ones[:Sb]).reshape(BK, R, 1)
            # 7. Weighted sum of the values, accumulated unnormalised.
            acc += np.matmul(p, tiles.values(s0, s1, used), out=pv)  # (B·K, G·Tb, E)
    return acc, l


def in_range(acc: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Which rows' sums are exact with the max deferred: (B·K, G·Tb, 1) bool. Not where
    something overflowed (inf or NaN in l or acc), nor where the row sum is so small that
    an underflowed weight could matter."""
    floor = math.sqrt(np.finfo(l.dtype).tiny)
    finite = np.isfinite(acc).all(axis=-1, keepdims=True)  # (B·K, G·Tb, 1)
    return (l >= floor) & np.isfinite(l) & finite  # (B·K, G·Tb, 1)


def fast_online_softmax(
    qs: np.ndarray, t0: int, t1: int, tiles: KeyTiles
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The online softmax's (acc, l, m) for one query block: from ``deferred_max_softmax``
    (m = 0) for the rows where that is exact, and from ``online_softmax`` for the others,
    row by row."""
    acc, l = deferred_max_softmax(qs, t0, t1, tiles)
    m = np.zeros_like(l)  # (B·K, G·Tb, 1)
    exact = in_range(acc, l)  # (B·K, G·Tb, 1)
    if not exact.all():
        acc_m, l_m, m_m = online_softmax(qs, t0, t1, tiles)
        acc = np.where(exact, acc, acc_m)  # (B·K, G·Tb, E)
        l = np.where(exact, l, l_m)  # (B·K, G·Tb, 1)
        m = np.where(exact, m, m_m)  # (B·K, G·Tb, 1)
    return acc, l, m


def online_softmax(
    qs: np.ndarray, t0: int, t1: int, tiles: KeyTiles
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 3-5 and 7 of one query block over its key tiles, with the running max:
    ``flash.py``'s recurrence on the grouped tiles, for the rows the deferred maximum
    cannot take. The unnormalised output acc (B·K, G·Tb, E), the row sums l and the
    constant m they are taken against, (B·K, G·Tb, 1) each."""
    BK, R, _ = qs.shape  # R = G·Tb rows
    work = qs.dtype
    m = np.full((BK, R, 1), -np.inf, dtype=work)  # (B·K, G·Tb, 1)
    l = np.zeros((BK, R, 1), dtype=work)  # (B·K, G·Tb, 1)
    acc = np.zeros((BK, R, tiles.v.shape[-1]), dtype=work)  # (B·K, G·Tb, E)
    for s0, s1, whole in tiles.ranges(t0, t1):
        x, used = tiles.scores(qs, t0, t1, s0, s1, whole)  # (B·K, G·Tb, Sb), steps 1, 3, 4

        # 5. Softmax over the keys, online: rescale what was accumulated against the
        # old running max onto the new one (flash.py's docstring). A row that has
        # seen only blocked keys keeps max -inf; its exponent is taken against 0, so
        # its weights are exactly 0 instead of exp(-inf - -inf) = NaN.
        m_new = np.maximum(m, x.max(axis=-1, keepdims=True))  # (B·K, G·Tb, 1)
        m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # (B·K, G·Tb, 1)
        # A score of +inf (q·k overflowed) makes its row NaN, and so does an inf value
        # or one whose weighted sum overflows, as the spec defines (§3.8, §4.8, §4.9):
        # inf − inf and inf · 0 are that NaN, not a fault.
        with np.errstate(over="ignore", invalid="ignore"):
            alpha = np.exp(m - m_safe)  # (B·K, G·Tb, 1)
            p = np.exp(x - m_safe)  # (B·K, G·Tb, Sb)
            l = alpha * l + p.sum(axis=-1, keepdims=True)  # (B·K, G·Tb, 1)

            # 7. Weighted sum of the values, accumulated unnormalised.
            acc = alpha * acc + p @ tiles.values(s0, s1, used)  # (B·K, G·Tb, E)
        m = m_new
    return acc, l, np.where(np.isfinite(m), m, 0.0)


def sink_rows(sinks: np.ndarray, call: contract.Checked, Tb: int, work: type) -> np.ndarray:
    """Each row's sink logit in the grouped layout, (B·K, G·Tb, 1): row g·Tb + t of key/value
    head k belongs to query head h = k·G + g."""
    B, K, G = call.B, call.K, call.G
    rows = np.asarray(sinks).astype(work).reshape(1, K, G, 1)  # (1, K, G, 1)
    return np.broadcast_to(rows, (B, K, G, Tb)).reshape(B * K, G * Tb, 1)  # (B·K, G·Tb, 1)


def add_sink(
    acc: np.ndarray, l: np.ndarray, m: np.ndarray, sink: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold each row's sink into its (acc, l, m) after the last key tile, as one more block
    of one key whose value row is 0 (as ``flash.attention`` does): a row with no key (l =
    0) is left alone, and a NaN or +inf sink makes a row with a key NaN (SPEC §15.4)."""
    some = l > 0  # (B·K, G·Tb, 1)
    sink = np.where(some, sink, -np.inf)  # (B·K, G·Tb, 1)
    m_new = np.maximum(m, sink)  # (B·K, G·Tb, 1)
    m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # (B·K, G·Tb, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        alpha = np.exp(m - m_safe)  # (B·K, G·Tb, 1)
        l = alpha * l + np.exp(sink - m_safe)  # (B·K, G·Tb, 1)
    bad = np.isnan(sink) | (sink == np.inf)  # (B·K, G·Tb, 1)
    acc = np.where(bad, np.nan, alpha * acc)  # (B·K, G·Tb, E)
    return acc, np.where(bad, np.nan, l), m_safe


def normalise(acc: np.ndarray, l: np.ndarray) -> np.ndarray:
    """out = acc / l, in place; a row that saw no key has l = 0 and acc = 0 and gives 0."""
    # A row whose sums overflowed (a +inf score) is NaN, as the spec defines (§3.8):
    # inf / inf is that NaN.
    with np.errstate(invalid="ignore"):
        acc /= np.where(l > 0, l, 1.0)  # (B·K, G·Tb, E)
    return acc


def running_lse(m: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp for the forward's ``return_lse`` (SPEC §21), from the pair
    the walk ends with: l = Σ exp(x − m) with m taken as 0 where it is not finite, so
    log Σ exp(x) = m + log l. A row with no key (l = 0) gets -inf, a row that read +inf
    (l = +inf) or NaN gets NaN, as its output."""
    m = np.where(np.isfinite(m), m, 0.0)  # (..., 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m + np.log(l)  # (..., 1)
    return np.where(l == np.inf, np.nan, lse)[..., 0]  # (...)


def backward_lse(m: np.ndarray, l: np.ndarray) -> np.ndarray:
    """What the backward forms each row's weights exp(Z − lse) against: the row's
    log-sum-exp m + log l (``running_lse``), except for a row with no key (l = 0), whose
    log-sum-exp is log 0 = −inf (SPEC §21.2) and which gets +inf here, so that its weights
    are all 0, not exp(−inf + inf) = NaN; NaN for a row that read a +inf score (l = +inf;
    see backward_block). Not a log-sum-exp to return: ``running_lse`` is."""
    some = l > 0
    lse = np.where(some, m + np.log(np.where(some, l, 1.0)), np.inf)
    return np.where(l == np.inf, np.nan, lse)
