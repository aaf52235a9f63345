"""The tiles of blockwise attention in JAX: what ``flash.py``'s loops do to one tile.

``Tiles`` holds one call's padded inputs, its band (causality, the window, the chunks) and
its sizes, and does a tile's work: which key blocks a query block visits (``walk``), steps
1, 3 and 4 on one (query block, key block) tile (``scores``), and the online softmax of
one query block over its key blocks (``online_softmax``). ``backward_tile`` is one tile of
FlashAttention-2's backward; ``add_sink`` and ``running_lse`` finish a query block's rows,
and ``backward_lse`` gives the backward what it forms the weights against.
The packed and paged pages (``flash_packed.py``, ``flash_paged.py``) walk the same tiles.

The grouped layout. Query head h = k·G + g shares key/value head k (PyTorch's
repeat_interleave order), so the G query heads of a key/value head are stacked as G·Tb
rows of one tile: (B, K, G·Tb, ·). Each key tile is then read and multiplied once for
its G query heads, not G times, and no input is repeated or copied, which the
memory-efficient impls must avoid (the teaching reference repeats k and v instead).

Huge scales. Step 2's scale is folded into the query tile, Tb·D multiplies instead of
Tb·S, but q · scale can overflow where the score q·k · scale does not (q = 2, k = 0.68 at
scale 1e308: the score is 1.36e308, the scaled q inf). A scale above 1 is therefore split
as scale = f · 2^e with f < 1 (``scale_split``): the tile takes q · f, and its product is
multiplied by 2^e. Multiplying by a power of two is exact, so the scores are the very
numbers q · scale gave wherever that did not overflow (or fall below the normal numbers);
a scale of at most 1 folds whole, as before.

Huge softcaps. c · tanh(x / c) is x itself, to far below rounding, once |x / c| < 2^-27
(float64; 2^-12 in float32), as tanh(y) = y − y³/3 + …. For a softcap near the largest
float (1e308; 1e38 in float32) the ratio falls below the smallest normal number, and XLA
on a CPU flushes such subnormals to 0: every score became c · tanh(0) = 0 and the weights
uniform (SPEC §4.2). Where the ratio is below that smallest normal number the score is kept
as it is, the correctly rounded value of c · tanh(x / c) there; elsewhere nothing changes.
The backward's 1 − tanh² is then exactly 1 there, the right derivative.

Head size 1. With D = 1 XLA rewrites the tile's product q·kᵀ as an elementwise multiply
and, the multiply being cheap, recomputes it inside both of its consumers: the row
maximum m and exp(x − m). In the second, LLVM contracts the multiply and the subtraction
into one fused multiply-add, which subtracts m from the exact product, not from the
rounded score the maximum saw: exp() got the product's rounding error, up to half an ulp
of the score, where it should get 0. That is nothing for ordinary scores, but at large
ones (3e10 in float32: an exponent of −1024) the row's largest weight became 0 and its
output 0, or its exponent went positive and the output NaN (SPEC §4.1). A zero column
appended to q and k keeps the product a dot, computed once, whose rounded result both
consumers read; for D > 1 nothing changes.

Shape legend: ``flash.py``'s (Tb, Sb the query and key block, Tp, Sp the padded lengths).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .attention import visible

HIGHEST = lax.Precision.HIGHEST


class Tiles:
    """The padded inputs, the band, and what a tile needs: which key blocks a query
    block visits (``walk``), steps 1, 3 and 4 on one tile (``scores``), and the online
    softmax of one query block (``online_softmax``). Built inside the jitted functions:
    the arrays are traced and the sizes static; the options may be plain numbers or traced
    values (``flash.py`` traces them, so that one program serves every value), None where
    absent. ``window`` is (left, right) with causality already in its right side;
    ``scale`` is a number or its two parts (folded, post), as ``scale_split`` gives them.
    ``lengths`` (T, S): the true lengths as traced values, each None where it is the
    array's own, for inputs padded to a shape bucket (``flash.py``: one program per
    bucket)."""

    def __init__(
        self, q, k, v, mask, offset, window, softcap, chunk, Tb, Sb, alibi, scale, lengths=None
    ) -> None:
        B, H, T, D = q.shape
        _, K, S, _ = k.shape
        self.Tb, self.Sb, self.offset, self.softcap = Tb, Sb, offset, softcap
        self.nT, self.nS = -(-T // Tb), -(-S // Sb)  # blocks of queries and of keys
        self.Tp, self.Sp = self.nT * Tb, self.nS * Sb
        self.B, self.K, self.G = B, K, H // K

        # Low precision inputs are computed in float32: exp() of a float16 score
        # overflows past 11.09, and summing many weights in float16 loses the small ones.
        self.work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        # Step 2's scale: the part folded into the queries, and the power of two the
        # products are multiplied by (None for a scale <= 1; module docstring: huge scales).
        split = scale if isinstance(scale, tuple) else scale_split(scale, self.work)
        self.folded, self.post = split

        # Pad T and S to whole blocks (a no-op when they already are). Tiles are sliced
        # from the inputs as they are, and cast to the working precision tile by tile, so
        # that no whole copy of an input is made.
        self.q = jnp.pad(q, ((0, 0), (0, 0), (0, self.Tp - T), (0, 0)))  # (B, H, Tp, D)
        self.k = jnp.pad(k, ((0, 0), (0, 0), (0, self.Sp - S), (0, 0)))  # (B, K, Sp, D)
        self.v = jnp.pad(v, ((0, 0), (0, 0), (0, self.Sp - S), (0, 0)))  # (B, K, Sp, E)
        if mask is not None:
            # Pad the mask's T and S axes where it has them (not where it broadcasts);
            # padded keys are blocked below anyway, and padded query rows are dropped.
            pad_t = self.Tp - T if mask.shape[2] == T else 0
            pad_s = self.Sp - S if mask.shape[3] == S else 0
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)))
            # mask: (B|1, H|1, Tp|1, Sp|1)
        self.mask = mask
        # The true lengths: the arrays' own, or runtime values where the caller padded the
        # arrays to a bucket. Either way the rows and keys past them are padding, masked
        # in ``scores``; query blocks and key blocks wholly past them are not visited.
        real_T, real_S = lengths if lengths is not None else (None, None)
        self.rows_padded = self.Tp != T or real_T is not None
        self.keys_padded = self.Sp != S or real_S is not None
        self.T = T if real_T is None else real_T
        self.S = S if real_S is None else real_S
        self.nT_real = self.nT if real_T is None else -(-real_T // Tb)  # query blocks visited

        # Which keys query t may see under causality and the window: lo <= s - t' <= hi,
        # where t' = t + offset is its aligned diagonal (offset = S - T for bottom-right);
        # None is an unbounded side.
        left, right = window if window is not None else (None, None)
        self.window = window
        self.lo = None if left is None else -left
        self.hi = right
        self.banded = self.lo is not None or self.hi is not None
        # Chunked local attention: t' // chunk == s // chunk as well.
        self.chunk = chunk
        # ALiBi's slopes in the grouped layout of the score tiles, or None.
        self.alibi = None
        if alibi is not None:
            self.alibi = alibi.astype(self.work).reshape(-1, K, H // K, 1, 1)  # (B|1, K, G, 1, 1)

    def queries(self, i: jax.Array) -> jax.Array:
        """Query block i of every head, scaled (by the folded part of the scale), stacked
        by key/value head: query head h = k·G + g shares key/value head k, so a kv head's
        tile serves its G query heads, stacked as G·Tb rows. (B, K, G·Tb, D)."""
        qi = lax.dynamic_slice_in_dim(self.q, i * self.Tb, self.Tb, axis=2)  # (B, H, Tb, D)
        qi = qi.astype(self.work) * jnp.asarray(self.folded, self.work)  # (B, H, Tb, D)
        return qi.reshape(self.B, self.K, self.G * self.Tb, -1)  # (B, K, G·Tb, D)

    def key_blocks(self, i: jax.Array) -> tuple[jax.Array, ...]:
        """For query block i: the key blocks [first, last) that can hold a visible key, and
        within them [inner_first, inner_last), the blocks where every query of the block
        sees every key (no masking needed). Traced int32 scalars."""
        Tb, Sb, nS, lo, hi = self.Tb, self.Sb, self.nS, self.lo, self.hi
        t0 = i * Tb + self.offset  # diagonal of the block's first query
        first, inner_first, inner_last, last = 0, 0, nS, nS
        if lo is not None:
            first = (t0 + lo) // Sb
            # Inside from the first block whose first key is >= lo past the last query's
            # diagonal: a ceiling division.
            inner_first = -(-(t0 + Tb - 1 + lo) // Sb)
        if hi is not None:
            last = (t0 + Tb - 1 + hi) // Sb + 1
            # Inside up to the last block whose last key is <= hi past the first query's.
            inner_last = (t0 + hi + 1) // Sb
        if self.chunk is not None:
            # The block's rows lie in chunks t0 // c … (t0 + Tb - 1) // c: key blocks outside
            # keys [lo_key, hi_key) of those chunks are skipped, and only a block within one
            # chunk has tiles that need no masking.
            c = self.chunk
            chunk_first, chunk_last = t0 // c, (t0 + Tb - 1) // c
            lo_key, hi_key = chunk_first * c, (chunk_last + 1) * c
            first = jnp.maximum(first, lo_key // Sb)
            last = jnp.minimum(last, -(-hi_key // Sb))
            inner_first = jnp.maximum(inner_first, -(-lo_key // Sb))
            single = chunk_first == chunk_last
            inner_last = jnp.where(single, jnp.minimum(inner_last, hi_key // Sb), 0)
        if self.keys_padded:
            # Blocks wholly past the last key are padding, not visited; the one the last
            # key ends in is masked.
            last = jnp.minimum(last, -(-self.S // Sb))
            inner_last = jnp.minimum(inner_last, self.S // Sb)
        first = jnp.clip(first, 0, nS).astype(jnp.int32)
        last = jnp.clip(last, first, nS).astype(jnp.int32)
        inner_last = jnp.clip(inner_last, first, last).astype(jnp.int32)
        inner_first = jnp.clip(inner_first, first, inner_last).astype(jnp.int32)
        return first, inner_first, inner_last, last

    def walk(self, i: jax.Array, body, carry, span: tuple | None = None):
        """``carry = body(j, carry, banded_tile)`` for the key blocks j query block i can
        see, in order: those the band cuts on the left (a window), those wholly inside
        it, and those it cuts on the right (the causal diagonal), so that only the cut
        ones (``banded_tile``) pay for the masking. The others are skipped. ``span``, the
        four bounds of ``key_blocks``, is given by packed calls (``Documents.span``)."""
        first, inner_first, inner_last, last = self.key_blocks(i) if span is None else span
        edge = functools.partial(body, banded_tile=True)
        inside = functools.partial(body, banded_tile=False)
        carry = lax.fori_loop(first, inner_first, edge, carry)
        carry = lax.fori_loop(inner_first, inner_last, inside, carry)
        return lax.fori_loop(inner_last, last, edge, carry)

    def scores(
        self, qi: jax.Array, i: jax.Array, j: jax.Array, banded_tile: bool, rows=None
    ) -> tuple:
        """Steps 1, 3 and 4 on tile (i, j): the masked scores (B, K, G·Tb, Sb); the
        softcap's tanh(R/c) (same shape, for its derivative) or None; and which keys of
        the tile some real query of the block may see, (B, K, Sb), or None when every
        query sees every key. The band (and the padding) is masked only on a
        ``banded_tile``; the others lie inside it. ``rows``, for packed documents: each
        row's keys [lo, hi) as two (Tb,) arrays (``Documents.rows``)."""
        B, K, G, Tb, Sb, work = self.B, self.K, self.G, self.Tb, self.Sb, self.work
        # 1. Scores: every query of the block against every key of the block.
        kj = lax.dynamic_slice_in_dim(self.k, j * Sb, Sb, axis=2).astype(work)  # (B, K, Sb, D)
        x = score_product("bkrd,bksd->bkrs", qi, kj)  # (B, K, G·Tb, Sb)
        # 2. Scale: the rest of it, a power of two (module docstring: huge scales).
        if self.post is not None:
            x = x * jnp.asarray(self.post, work)  # (B, K, G·Tb, Sb)

        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        tanh = None
        if self.softcap is not None:
            # A subnormal x / softcap keeps the score (module docstring: huge softcaps).
            ratio = x / self.softcap  # (B, K, G·Tb, Sb)
            tanh = jnp.tanh(ratio)  # (B, K, G·Tb, Sb)
            x = jnp.where(
                jnp.abs(ratio) < jnp.finfo(work).tiny, x, self.softcap * tanh
            )  # (B, K, G·Tb, Sb)

        # 4. Mask: ALiBi's linear bias and a float mask are added; a bool mask, the causal
        # triangle, the window and the chunks decide which keys each query may see at all,
        # and so does a float mask's -inf: blocked scores are replaced, not only pushed
        # down by adding -inf, since NaN + -inf is NaN.
        x = x.reshape(B, K, G, Tb, Sb)  # (B, K, G, Tb, Sb)
        if self.alibi is not None:
            x = x + self.alibi_bias(i, j)  # (B, K, G, Tb, Sb)
        allowed = None
        if self.mask is not None:
            m = grouped(mask_tile(self.mask, i, j, Tb, Sb), K, G)  # (B|1, K|1, G|1, Tb|1, Sb|1)
            if self.mask.dtype == jnp.bool_:
                allowed = m
            else:
                x = x + m.astype(work)  # (B, K, G, Tb, Sb)
                allowed = m != -jnp.inf  # (B|1, K|1, G|1, Tb|1, Sb|1)
        if banded_tile:
            s = j * Sb + jnp.arange(Sb, dtype=jnp.int32)[None, :]  # (1, Sb)
            if self.banded or self.chunk is not None:
                t = i * Tb + jnp.arange(Tb, dtype=jnp.int32)[:, None]  # (Tb, 1)
                t = t + self.offset  # (Tb, 1): each query's diagonal
                # The core page's ``visible``; causality is already the window's right side.
                band = jnp.ones((Tb, Sb), dtype=bool)  # (Tb, Sb)
                band = visible(band, t, s, False, self.window, self.chunk)  # (Tb, Sb)
                allowed = band if allowed is None else allowed & band
            if rows is not None:
                # Packed documents: each row sees the keys [lo, hi) of its own document
                # that its causality and window leave; a row outside the document walked
                # has none.
                lo, hi = rows  # (Tb,), (Tb,)
                inside = (lo[:, None] <= s) & (s < hi[:, None])  # (Tb, Sb)
                allowed = inside if allowed is None else allowed & inside
            if self.keys_padded:
                allowed = s < self.S if allowed is None else allowed & (s < self.S)  # padding
        if self.rows_padded:
            # The padded query rows see no key: their q is 0, but a key holding NaN would
            # still make their scores NaN, and the backward sums over the rows.
            real = (i * Tb + jnp.arange(Tb, dtype=jnp.int32) < self.T)[:, None]  # (Tb, 1)
            allowed = real if allowed is None else allowed & real
        if allowed is None:
            return x.reshape(B, K, G * Tb, Sb), tanh, None
        x = jnp.where(allowed, x, -jnp.inf)  # (B, K, G, Tb, Sb)
        # A key that no query of the block may see (padding, a KV-cache slot not yet
        # written) must have no effect whatever it holds.
        used = jnp.broadcast_to(allowed, x.shape).any(axis=(2, 3))  # (B, K, Sb)
        return x.reshape(B, K, G * Tb, Sb), tanh, used

    def alibi_bias(self, i: jax.Array, j: jax.Array) -> jax.Array:
        """ALiBi's bias on tile (i, j), (B|1, K, G, Tb, Sb): −slope · |t + S − T − s| with
        the real (unpadded) T and S, the distance from the bottom-right diagonal whatever
        the causal alignment; computed from the tile's indices, no (T, S) array."""
        t = i * self.Tb + jnp.arange(self.Tb, dtype=jnp.int32)[:, None]  # (Tb, 1)
        s = j * self.Sb + jnp.arange(self.Sb, dtype=jnp.int32)[None, :]  # (1, Sb)
        distance = jnp.abs(t + self.S - self.T - s).astype(self.work)  # (Tb, Sb)
        return -self.alibi * distance  # (B|1, K, G, Tb, Sb)

    def keys(self, j: jax.Array, used: jax.Array | None) -> jax.Array:
        """Key block j in the working precision, (B, K, Sb, D); a key no query of the
        block may see replaced by 0, so that whatever it holds has no effect (0 · NaN
        and 0 · inf are NaN)."""
        kj = lax.dynamic_slice_in_dim(self.k, j * self.Sb, self.Sb, axis=2).astype(self.work)
        return kj if used is None else jnp.where(used[..., None], kj, 0.0)  # (B, K, Sb, D)

    def values(self, j: jax.Array, used: jax.Array | None) -> jax.Array:
        """Value block j in the working precision, (B, K, Sb, E); unused ones 0."""
        vj = lax.dynamic_slice_in_dim(self.v, j * self.Sb, self.Sb, axis=2).astype(self.work)
        return vj if used is None else jnp.where(used[..., None], vj, 0.0)  # (B, K, Sb, E)

    def online_softmax(
        self, qi: jax.Array, i: jax.Array, rows=None, span=None
    ) -> tuple[jax.Array, ...]:
        """Steps 3-5 and 7 of query block i over its key blocks, ``flash.py``'s recurrence
        on the grouped tiles: the running max m, the running sum l (B, K, G·Tb) and the
        unnormalised output a (B, K, G·Tb, E). ``rows`` and ``span``: one packed
        document's (``scores``, ``walk``)."""

        def key_block(j: jax.Array, carry: tuple, banded_tile: bool) -> tuple:
            m, l, a = carry  # (B, K, G·Tb), (B, K, G·Tb), (B, K, G·Tb, E)
            x, _, used = self.scores(qi, i, j, banded_tile, rows)  # (B, K, G·Tb, Sb), 1, 3, 4

            # 5. Softmax, online: the new running maximum, and α to move l and a onto it.
            # A row that has seen only blocked keys takes its exponents against 0.
            m_new = jnp.maximum(m, x.max(axis=-1))  # (B, K, G·Tb)
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, K, G·Tb)
            alpha = jnp.exp(m - m_safe)  # (B, K, G·Tb)
            p = jnp.exp(x - m_safe[..., None])  # (B, K, G·Tb, Sb)
            l = alpha * l + p.sum(axis=-1)  # (B, K, G·Tb)

            # 7. Weighted sum of the values, accumulated unnormalised.
            pv = jnp.einsum(
                "bkrs,bkse->bkre", p, self.values(j, used), precision=HIGHEST
            )  # (B, K, G·Tb, E)
            return m_new, l, alpha[..., None] * a + pv

        B, K, R, E = self.B, self.K, self.G * self.Tb, self.v.shape[-1]
        carry = (
            jnp.full((B, K, R), -jnp.inf, dtype=self.work),  # m: (B, K, G·Tb)
            jnp.zeros((B, K, R), dtype=self.work),  # l: (B, K, G·Tb)
            jnp.zeros((B, K, R, E), dtype=self.work),  # a: (B, K, G·Tb, E)
        )
        return self.walk(i, key_block, carry, span)

    def sink_rows(self, sinks: jax.Array) -> jax.Array:
        """Each row's sink logit in the grouped layout, (B, K, G·Tb): row g·Tb + t of
        key/value head k belongs to query head h = k·G + g."""
        rows = sinks.astype(self.work).reshape(1, self.K, self.G, 1)  # (1, K, G, 1)
        rows = jnp.broadcast_to(rows, (self.B, self.K, self.G, self.Tb))  # (B, K, G, Tb)
        return rows.reshape(self.B, self.K, self.G * self.Tb)  # (B, K, G·Tb)

    def add_mask_grad(self, dm: jax.Array, dz: jax.Array, i: jax.Array, j: jax.Array):
        """4'. dmask += dZ on tile (i, j), summed over the axes along which one mask entry
        served many scores (broadcasting). dm: (B|1, H|1, Tp|1, Sp|1)."""
        b, h, tm, sm = dm.shape
        d = dz.reshape(self.B, self.K * self.G, self.Tb, self.Sb)  # (B, H, Tb, Sb)
        axes = tuple(a for a, n in enumerate((b, h, tm, sm)) if n == 1)
        d = d.sum(axis=axes, keepdims=True)  # (B|1, H|1, Tb|1, Sb|1)
        start = (0, 0, 0 if tm == 1 else i * self.Tb, 0 if sm == 1 else j * self.Sb)
        start = tuple(jnp.asarray(x, dtype=jnp.int32) for x in start)
        old = lax.dynamic_slice(dm, start, d.shape)  # (B|1, H|1, Tb|1, Sb|1)
        return lax.dynamic_update_slice(dm, old + d, start)  # (B|1, H|1, Tp|1, Sp|1)


def running_lse(m: jax.Array, l: jax.Array) -> jax.Array:
    """Each row's log-sum-exp for the forward's ``return_lse`` (SPEC §21), from the pair
    the walk ends with: l = Σ exp(x − m) with m taken as 0 where it is not finite, so
    log Σ exp(x) = m + log l. A row with no key (l = 0) gets -inf, a row that read +inf
    (l = +inf) or NaN gets NaN, as its output."""
    lse = jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(l)
    return jnp.where(l == jnp.inf, jnp.nan, lse)


def backward_lse(m: jax.Array, l: jax.Array) -> jax.Array:
    """What the backward forms each row's weights exp(Z − lse) against: the row's
    log-sum-exp m + log l (``running_lse``), except for a row with no key (l = 0), whose
    log-sum-exp is log 0 = −inf (SPEC §21.2) and which gets +inf here, so that its weights
    are all 0, not exp(−inf + inf) = NaN; NaN for a row that read a +inf score (l = +inf),
    so that every weight of it is NaN, as its output is (SPEC §4.1), not only its +inf
    ones. Not a log-sum-exp to return: ``running_lse`` is."""
    some = l > 0
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.where(some, m_safe + jnp.log(jnp.where(some, l, 1.0)), jnp.inf)
    return jnp.where(l == jnp.inf, jnp.nan, lse)


def add_sink(
    m: jax.Array, l: jax.Array, acc: jax.Array, sink: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold each row's sink into its (m, l, acc) after the last key block, as one more
    block of one key whose value row is 0 (``flash.py``'s docstring: sinks): a row with no
    key (l = 0) is left alone, and a NaN or +inf sink makes a row with a key NaN (SPEC
    §15.4)."""
    some = l > 0  # (B, K, G·Tb)
    sink = jnp.where(some, sink, -jnp.inf)  # (B, K, G·Tb)
    m_new = jnp.maximum(m, sink)  # (B, K, G·Tb)
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, K, G·Tb)
    alpha = jnp.exp(m - m_safe)  # (B, K, G·Tb)
    l = alpha * l + jnp.exp(sink - m_safe)  # (B, K, G·Tb)
    bad = jnp.isnan(sink) | (sink == jnp.inf)  # (B, K, G·Tb)
    acc = jnp.where(bad[..., None], jnp.nan, alpha[..., None] * acc)  # (B, K, G·Tb, E)
    return m_new, jnp.where(bad, jnp.nan, l), acc


def backward_tile(tiles, i, qi, do, lse, delta, j, grads, banded_tile, rows=None):
    """The backward of query block i against key block j (``attention_vjp``): adds to
    the block's dq / scale (B, K, G·Tb, D), to dk (B, K, Sp, D), dv (B, K, Sp, E) and,
    for a float mask, dm (B|1, H|1, Tp|1, Sp|1). ``rows``: one packed document's
    (``Tiles.scores``)."""
    dq_i, dk, dv, dm = grads
    # Forward steps 1, 3 and 4 again: the tile's masked scores Z.
    z, tanh, used = tiles.scores(qi, i, j, banded_tile, rows)  # (B, K, G·Tb, Sb)
    # 5. The weights, recomputed from the row's log-sum-exp: P = exp(Z − lse).
    p = jnp.exp(z - lse[..., None])  # (B, K, G·Tb, Sb)
    kj = tiles.keys(j, used)  # (B, K, Sb, D)
    vj = tiles.values(j, used)  # (B, K, Sb, E)

    # 7'. Weighted sum, O = P·V: dV = Pᵀ·dO, and dP = dO·Vᵀ.
    dv_j = jnp.einsum("bkrs,bkre->bkse", p, do, precision=HIGHEST)  # (B, K, Sb, E)
    dp = jnp.einsum("bkre,bkse->bkrs", do, vj, precision=HIGHEST)  # (B, K, G·Tb, Sb)

    # 5'. Softmax: dZ = P ⊙ (dP − Δ).
    dz = p * (dp - delta[..., None])  # (B, K, G·Tb, Sb)
    if rows is not None and banded_tile:
        # A row outside the packed document has P = 0, but dP = 0 · V is NaN where this
        # document's values are: selected away, so that dK gets nothing from it.
        lo, hi = rows  # (Tb,), (Tb,)
        dz = jnp.where(jnp.tile(lo < hi, tiles.G)[:, None], dz, 0.0)  # (B, K, G·Tb, Sb)

    # 4'. Mask: a float mask was added to the scores, so its gradient is dZ.
    if dm is not None:
        dm = tiles.add_mask_grad(dm, dz, i, j)

    # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c), which fades where the cap bites.
    if tanh is not None:
        dz = dz * (1.0 - tanh * tanh)  # (B, K, G·Tb, Sb)

    # 2'-1'. Scores, R = scale · q·kᵀ: the scale is in qi and ``post`` (so dk has it
    # then); dq gets it once, at the end of the query block.
    dq_i = dq_i + jnp.einsum("bkrs,bksd->bkrd", dz, kj, precision=HIGHEST)  # (B, K, G·Tb, D)
    dk_j = jnp.einsum("bkrs,bkrd->bksd", dz, qi, precision=HIGHEST)  # (B, K, Sb, D)
    if tiles.post is not None:
        dk_j = dk_j * jnp.asarray(tiles.post, tiles.work)  # (B, K, Sb, D)

    # The slots replaced by 0 get nothing back: a selection passes the gradient only to
    # the branch it took.
    if used is not None:
        dk_j = jnp.where(used[..., None], dk_j, 0.0)  # (B, K, Sb, D)
        dv_j = jnp.where(used[..., None], dv_j, 0.0)  # (B, K, Sb, E)
    dk = add_block(dk, dk_j, j * tiles.Sb)  # (B, K, Sp, D)
    dv = add_block(dv, dv_j, j * tiles.Sb)  # (B, K, Sp, E)
    return dq_i, dk, dv, dm


def score_product(spec: str, qi: jax.Array, kj: jax.Array) -> jax.Array:
    """Step 1's q·kᵀ of one tile, ``spec`` naming the axes, D last. With D = 1 the
    product gets a zero column (module docstring: head size 1), so that XLA keeps it a dot."""
    if qi.shape[-1] == 1:
        pad = [(0, 0)] * (qi.ndim - 1) + [(0, 1)]
        qi, kj = jnp.pad(qi, pad), jnp.pad(kj, pad)  # (..., 2): q·k + 0·0, the same sum
    return jnp.einsum(spec, qi, kj, precision=HIGHEST)


def mask_tile(mask: jax.Array, i: jax.Array, j: jax.Array, Tb: int, Sb: int):
    """Tile (i, j) of a (B|1, H|1, Tp|1, Sp|1) mask: (B|1, H|1, Tb|1, Sb|1)."""
    b, h, t, s = mask.shape
    start = (0, 0, 0 if t == 1 else i * Tb, 0 if s == 1 else j * Sb)
    start = tuple(jnp.asarray(x, dtype=jnp.int32) for x in start)
    size = (b, h, 1 if t == 1 else Tb, 1 if s == 1 else Sb)
    return lax.dynamic_slice(mask, start, size)  # (B|1, H|1, Tb|1, Sb|1)


def add_block(x: jax.Array, update: jax.Array, s0: jax.Array) -> jax.Array:
    """x[:, :, s0:s0 + Sb] += update, in place: (B, K, Sp, ·)."""
    old = lax.dynamic_slice_in_dim(x, s0, update.shape[2], axis=2)  # (B, K, Sb, ·)
    return lax.dynamic_update_slice_in_dim(x, old + update, s0, axis=2)  # (B, K, Sp, ·)


def bucket_count(n: int) -> int:
    """n (a count of tiles or rows) rounded up to a power of two, past 16 to a multiple of
    4: the shape buckets of ``flash.py`` and of the context-parallel pages' chunks, at most
    twice n up to 16 and under 4 more past it."""
    return 1 << (n - 1).bit_length() if n <= 16 else -(-n // 4) * 4


def grouped(x: jax.Array, K: int, G: int) -> jax.Array:
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)  # (B|1, 1, 1, T, S)
    return x.reshape(b, K, G, t, s)  # (B|1, K, G, T, S)


def scale_split(scale: float, work) -> tuple[float, float | None]:
    """scale = folded · post (module docstring: huge scales): a scale of at most 1 is all
    folded (post None: nothing to multiply); a larger one is folded in [0.5, 1) times post = 2^e, a power of two
    still finite in the working precision."""
    if scale <= 1.0:
        return scale, None
    _, e = math.frexp(scale)  # scale = m · 2^e, 0.5 <= m < 1
    e = min(e, int(jnp.finfo(work).maxexp) - 1)
    return math.ldexp(scale, -e), math.ldexp(1.0, e)
