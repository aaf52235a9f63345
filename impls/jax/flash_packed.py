"""Packed variable-length documents (FlashAttention's varlen API, SPEC §18) on the tiles
of ``flash.py``: every key block that shares no document with the query block is skipped.

``attention_packed`` takes N documents one after another (cu_seqlens_q and cu_seqlens_k)
and attends each alone. The boundaries are traced, so one program serves every packing of
the same T, S and N; the query blocks stay where they are, and a block may hold rows of
several documents. Each row's visible keys are one interval [lower, upper) of packed
positions: its document's keys, narrowed by causality and the window counted from the
document's own diagonal. A query block walks the documents its rows lie in, one at a
time, and for each only the key blocks that document's rows see (loop bounds from the
intervals, as for the band), so a key tile that shares no document with the query tile
is never computed: the work grows with Σ T_n·S_n, not T·S. Each row keeps (m, l, acc)
from its own document's walk, selected with ``where``: within a tile another document's
row has weights 0, but 0 · NaN is NaN, so a NaN in one document would otherwise reach
the others through the products.

Shape legend: ``flash.py``'s, unbatched: q (H, T, D), k (K, S, D), v (K, S, E), out
(H, T, E), with T = cu_seqlens_q[-1] and S = cu_seqlens_k[-1]; N documents. Inside, the
arrays are batched as B = 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import contract
from .flash_tiles import Tiles, backward_lse, backward_tile


def attention_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 512,
    block_k: int = 256,
) -> jax.Array:
    """Attention over packed variable-length sequences (FlashAttention's varlen API),
    blockwise, skipping every key block that shares no document with the query block.

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone (the module docstring). The
    boundaries are traced: one compiled program serves every packing of the same T, S
    and N.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``attention``, applied
        within each document (bottom-right puts document n's diagonal at S_n - T_n).
      block_q, block_k: Tb and Sb, as for ``attention``.

    Returns:
      out: (H, T, E), same dtype as q.
    """
    # 0. Validate with the input contract all impls share (the contract package), eagerly, so the
    # boundaries' values are checked before they become tracers.
    q, k, v, bounds, static = _prepare_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_q, block_k, **_packed_options(locals())
    )
    H, T, _ = q.shape
    if T == 0 or k.shape[1] == 0:
        # Nothing to tile: no query, or no key in any document, so every row is 0.
        return jnp.zeros((H, T, v.shape[-1]), dtype=q.dtype)  # (H, T, E)
    return _flash_packed(q, k, v, *bounds, **static)  # (H, T, E)


def attention_packed_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    d_out: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 512,
    block_k: int = 256,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``attention_packed`` by the blockwise backward, on the same key
    blocks as the forward: (dq, dk, dv) shaped and typed like q, k, v, for the loss
    L = Σ d_out · attention_packed(...), d_out (H, T, E) in q's dtype. The boundaries
    are integers, traced and not differentiated."""
    # 0. Validate as the forward does, and d_out against the output's shape and dtype.
    d_out = jnp.asarray(d_out)
    q, k, v, bounds, static = _prepare_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_q, block_k, d_out, **_packed_options(locals())
    )
    if q.shape[1] == 0 or k.shape[1] == 0:
        # Nothing attends anything: every gradient is exactly 0.
        return tuple(jnp.zeros_like(x) for x in (q, k, v))
    return _flash_packed_vjp(q, k, v, *bounds, d_out, **static)


def _packed_options(given: dict) -> dict:
    """The options of an ``attention_packed(_vjp)`` call, from its ``locals()``."""
    names = ("is_causal", "scale", "causal_alignment", "window", "softcap")
    return {name: given[name] for name in names}


def _prepare_packed(q, k, v, cu_q, cu_k, block_q, block_k, d_out=None, **options):
    """Step 0 of a packed call: q, k, v and the boundaries as JAX arrays, and the static
    arguments of ``_flash_packed``."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    tiles = {"block_q": block_q, "block_k": block_k}
    call, _, _ = contract.check_packed(q, k, v, cu_q, cu_k, tiles=tiles, d_out=d_out, **options)
    # A window wider than T + S keys reaches past every document: cut to that, so that
    # the positions it adds stay within int32.
    window = call.window
    if window is not None:
        window = tuple(None if w is None else min(w, call.T + call.S) for w in window)
    static = dict(
        scale=call.scale,
        is_causal=call.is_causal,
        bottom_right=call.causal_alignment == "bottom_right",
        window=window,
        softcap=call.softcap,
        Tb=max(1, min(block_q, call.T)),
        Sb=max(1, min(block_k, call.S)),
    )
    return q, k, v, (cu_q, cu_k), static


_PACKED_STATIC = ("scale", "is_causal", "bottom_right", "window", "softcap", "Tb", "Sb")


@functools.partial(jax.jit, static_argnames=_PACKED_STATIC)
def _flash_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q: jax.Array,
    cu_k: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    bottom_right: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    Tb: int,
    Sb: int,
) -> jax.Array:
    """Steps 1-7 on checked packed inputs, (H, T, D) and so on, batched here as B = 1;
    compiled once per T, S, N, dtype and options, whatever the boundaries hold."""
    q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    B, H, T, _ = q.shape
    E = v.shape[-1]
    tiles = Tiles(q, k, v, None, 0, None, softcap, None, Tb, Sb, None, scale)
    docs = _Documents(cu_q, cu_k, tiles, is_causal, bottom_right, window)

    def query_block(i: jax.Array, out: jax.Array) -> jax.Array:
        qi = tiles.queries(i)  # (B, K, G·Tb, D), steps 1-2
        _, l, acc = docs.online_softmax(qi, i)  # steps 3-5 and 7, document by document
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        acc = acc.reshape(B, H, Tb, E).astype(q.dtype)  # (B, H, Tb, E)
        return lax.dynamic_update_slice_in_dim(out, acc, i * Tb, axis=2)  # (B, H, Tp, E)

    out = jnp.zeros((B, H, tiles.Tp, E), dtype=q.dtype)  # (B, H, Tp, E)
    out = lax.fori_loop(0, tiles.nT, query_block, out)  # (B, H, Tp, E)
    return out[0, :, :T]  # (H, T, E), the padded rows cut off


@functools.partial(jax.jit, static_argnames=_PACKED_STATIC)
def _flash_packed_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q: jax.Array,
    cu_k: jax.Array,
    d_out: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    bottom_right: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    Tb: int,
    Sb: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward on checked packed inputs, batched here as B = 1: (dq, dk, dv);
    compiled once per T, S, N, dtype and options."""
    q, k, v, d_out = q[None], k[None], v[None], d_out[None]  # (1, ·, ·, ·) each
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    tiles = Tiles(q, k, v, None, 0, None, softcap, None, Tb, Sb, None, scale)
    docs = _Documents(cu_q, cu_k, tiles, is_causal, bottom_right, window)
    work, G = tiles.work, tiles.G
    d_out = jnp.pad(d_out, ((0, 0), (0, 0), (0, tiles.Tp - T), (0, 0)))  # (B, H, Tp, E)

    def query_block(i: jax.Array, grads: tuple) -> tuple:
        dq, dk, dv = grads
        # Forward steps 1-5 and 7 for this block: its rows' O and log-sum-exp.
        qi = tiles.queries(i)  # (B, K, G·Tb, D)
        m, l, acc = docs.online_softmax(qi, i)
        some = l > 0  # (B, K, G·Tb)
        o = acc / jnp.where(some, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        lse = backward_lse(m, l)  # (B, K, G·Tb)

        # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O).
        do = lax.dynamic_slice_in_dim(d_out, i * Tb, Tb, axis=2).astype(work)
        do = do.reshape(B, K, G * Tb, E)  # (B, K, G·Tb, E)
        delta = (do * o).sum(axis=-1)  # (B, K, G·Tb)

        def document(n: jax.Array, carry: tuple) -> tuple:
            # The backward of document n's rows over its key blocks. Its rows alone carry
            # q, dO and lse into the products: another document's row (NaN in its q or
            # d_out, or in its lse through its values) must add nothing, and a product
            # with a weight of 0 would still carry its NaN.
            dq_i, dk, dv = carry
            rows, sel = docs.rows(i, n)  # (Tb,) twice, (G·Tb,)
            q_n = jnp.where(sel[:, None], qi, 0.0)  # (B, K, G·Tb, D)
            do_n = jnp.where(sel[:, None], do, 0.0)  # (B, K, G·Tb, E)
            lse_n = jnp.where(sel, lse, jnp.inf)  # (B, K, G·Tb)
            body = functools.partial(backward_tile, tiles, i, q_n, do_n, lse_n, delta, rows=rows)
            dq_n = jnp.zeros((B, K, G * Tb, D), dtype=work)  # (B, K, G·Tb, D)
            dq_n, dk, dv, _ = tiles.walk(i, body, (dq_n, dk, dv, None), docs.span(rows))
            return jnp.where(sel[:, None], dq_n, dq_i), dk, dv

        dq_i = jnp.zeros((B, K, G * Tb, D), dtype=work)  # (B, K, G·Tb, D)
        dq_i, dk, dv = lax.fori_loop(*docs.touched(i), document, (dq_i, dk, dv))
        dq_i = (dq_i * scale).reshape(B, H, Tb, D).astype(q.dtype)  # (B, H, Tb, D)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * Tb, axis=2)  # (B, H, Tp, D)
        return dq, dk, dv

    grads = (
        jnp.zeros((B, H, tiles.Tp, D), dtype=q.dtype),  # dq: (B, H, Tp, D)
        jnp.zeros((B, K, tiles.Sp, D), dtype=work),  # dk: (B, K, Sp, D)
        jnp.zeros((B, K, tiles.Sp, E), dtype=work),  # dv: (B, K, Sp, E)
    )
    dq, dk, dv = lax.fori_loop(0, tiles.nT, query_block, grads)
    return (
        dq[0, :, :T],  # (H, T, D)
        dk[0, :, :S].astype(q.dtype),  # (K, S, D)
        dv[0, :, :S].astype(q.dtype),  # (K, S, E)
    )


class _Documents:
    """Packed documents on the tiles of ``Tiles``: each query row's document and the
    keys [lower, upper) it may see (its document's keys, narrowed by causality and the
    window, in packed positions: one interval per row), the documents a query block
    touches, and the key blocks each of them needs. Traced: built from the boundaries
    inside the jitted functions."""

    def __init__(self, cu_q, cu_k, tiles: Tiles, is_causal, bottom_right, window) -> None:
        self.tiles = tiles
        cu_q, cu_k = cu_q.astype(jnp.int32), cu_k.astype(jnp.int32)  # (N + 1,), (N + 1,)
        N = cu_q.shape[0] - 1
        t = jnp.arange(tiles.Tp, dtype=jnp.int32)  # (Tp,)
        # Token t lies in the last document n with cu_q[n] <= t (so empty documents are
        # passed over); the padded rows t >= T in none (-1).
        real = t < tiles.T  # (Tp,)
        doc = jnp.searchsorted(cu_q, t, side="right").astype(jnp.int32) - 1  # (Tp,)
        n = jnp.clip(doc, 0, N - 1)  # (Tp,), in range to index with
        first_key, end_key = cu_k[n], cu_k[n + 1]  # (Tp,), (Tp,)
        # The row's diagonal key in packed positions: its place in its document, shifted
        # by S_n - T_n under bottom-right alignment, from the document's first key.
        diagonal = t - cu_q[n] + first_key  # (Tp,)
        if bottom_right:
            diagonal = diagonal + (end_key - first_key) - (cu_q[n + 1] - cu_q[n])  # (Tp,)
        lower, upper = first_key, end_key  # (Tp,), (Tp,)
        left, right = window if window is not None else (None, None)
        if is_causal:
            right = 0 if right is None else min(right, 0)
        if left is not None:
            lower = jnp.maximum(lower, diagonal - left)  # (Tp,)
        if right is not None:
            upper = jnp.minimum(upper, diagonal + right + 1)  # (Tp,)
        self.doc = jnp.where(real, doc, -1)  # (Tp,)
        self.lower, self.upper = lower, upper  # (Tp,), (Tp,)

    def touched(self, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The documents [first, last) query block i holds rows of (with the empty ones
        between them, which have none), as loop bounds."""
        doc = lax.dynamic_slice_in_dim(self.doc, i * self.tiles.Tb, self.tiles.Tb)  # (Tb,)
        return doc[0], doc.max() + 1  # the block's first row is real (i·Tb < T)

    def rows(self, i: jax.Array, n: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """Query block i's rows in document n: ((lo, hi), sel). A row of document n with
        some key sees keys [lo, hi); every other row gets the empty [Sp, 0). sel (G·Tb,):
        the rows with some key, in the grouped layout (row g·Tb + t is query t)."""
        Tb, Sp = self.tiles.Tb, self.tiles.Sp
        doc, lower, upper = (
            lax.dynamic_slice_in_dim(x, i * Tb, Tb) for x in (self.doc, self.lower, self.upper)
        )  # (Tb,) each
        mine = (doc == n) & (lower < upper)  # (Tb,)
        lo = jnp.where(mine, lower, Sp)  # (Tb,)
        hi = jnp.where(mine, upper, 0)  # (Tb,)
        return (lo, hi), jnp.tile(mine, self.tiles.G)  # (Tb,), (Tb,), (G·Tb,)

    def span(self, rows: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        """The key blocks [first, last) some row sees, and within them [inner_first,
        inner_last), those every row of the block sees whole (none when a row lies in
        another document): ``Tiles.key_blocks`` for one document's rows."""
        lo, hi = rows  # (Tb,), (Tb,)
        Sb, nS = self.tiles.Sb, self.tiles.nS
        first = jnp.clip(lo.min() // Sb, 0, nS)
        last = jnp.clip(-(-hi.max() // Sb), first, nS)
        inner_last = jnp.clip(hi.min() // Sb, first, last)
        inner_first = jnp.clip(-(-lo.max() // Sb), first, inner_last)
        return tuple(x.astype(jnp.int32) for x in (first, inner_first, inner_last, last))

    def online_softmax(self, qi: jax.Array, i: jax.Array) -> tuple[jax.Array, ...]:
        """``Tiles.online_softmax`` of query block i, one document at a time: each row
        takes (m, l, acc) from the walk of its own document, so that nothing another
        document holds reaches it, not even through a weight of 0 times a NaN value."""
        tiles = self.tiles

        def document(n: jax.Array, carry: tuple) -> tuple:
            rows, sel = self.rows(i, n)  # (Tb,) twice, (G·Tb,)
            new = tiles.online_softmax(qi, i, rows, self.span(rows))
            m, l, acc = (
                jnp.where(sel if x.ndim == 3 else sel[:, None], y, x) for x, y in zip(carry, new)
            )
            return m, l, acc

        B, K, R, E = tiles.B, tiles.K, tiles.G * tiles.Tb, tiles.v.shape[-1]
        carry = (
            jnp.full((B, K, R), -jnp.inf, dtype=tiles.work),  # m: (B, K, G·Tb)
            jnp.zeros((B, K, R), dtype=tiles.work),  # l: (B, K, G·Tb)
            jnp.zeros((B, K, R, E), dtype=tiles.work),  # acc: (B, K, G·Tb, E)
        )
        return lax.fori_loop(*self.touched(i), document, carry)
