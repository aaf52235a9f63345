"""Attention over a paged KV cache (SPEC §19) a page at a time, on the tiles of
``flash.py``: each page a sequence reads is one key tile, read in place.

Sequence b's key s lives in page block_table[b, s // L], slot s % L, and sequence b has
seq_lens[b] keys; its T queries are its last T positions, so causality and the window are
counted from the bottom-right diagonal t + seq_lens[b] - T. For each sequence and query
block (``_PageWalk``), the online softmax runs over the pages from the first the block's
rows may see to the last, at most ⌈seq_lens[b] / L⌉: a ``lax.fori_loop`` with traced
bounds (a while loop), so the table and the lengths stay traced, one program serves every
table of the same shapes, and the cost follows the lengths, not the table's width M·L.
The backward (FlashAttention-2's, as ``flash.py``'s) walks the same pages again and adds
each page's dK and dV into the page read.

Shape legend: ``flash.py``'s letters, and N pages, L slots per page (the key tile), M table
entries per sequence; R = G·Tb rows of a query block (its G query heads per key/value head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import contract
from .flash_tiles import HIGHEST, backward_lse, scale_split, score_product


def attention_paged(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> jax.Array:
    """Attention over a paged KV cache (vLLM, FlashInfer, FlashAttention's
    ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``), a page at a
    time: each page a sequence reads is one key tile, read in place.

    Sequence b's key s lives in page block_table[b, s // L], slot s % L, and sequence b has
    seq_lens[b] keys; its T queries are its last T positions, so causality and the window
    are counted from the bottom-right diagonal t + seq_lens[b] - T. For each sequence and
    query block, the online softmax runs over the pages from the first the block's rows may
    see to the last, at most ⌈seq_lens[b] / L⌉: a ``lax.fori_loop`` with traced bounds (a
    while loop), so the table and the lengths stay traced, one program serves every table
    of the same shapes, and the cost follows the lengths, not the table's width M·L.

    Args:
      q: queries, (B, H, T, D).
      k_pages: (N, K, L, D), the pool of key pages; K must divide H.
      v_pages: (N, K, L, E), the value pages, laid out alike.
      block_table: (B, M) integer: the pages of sequence b, in order. Entries past
        ⌈seq_lens[b] / L⌉ are never read and may hold anything (-1 is common).
      seq_lens: (B,) integer: the number of keys of each sequence, 0 to M·L.
      is_causal: query t attends only keys s <= t + seq_lens[b] - T (T <= seq_lens[b]).
      scale, window, softcap: as for ``attention``, the window's diagonal placed
        bottom-right as causality's.
      block_q: Tb, queries per tile (per query head).

    Returns:
      out: (B, H, T, E), same dtype as q; a sequence with no key gives rows of 0.
    """
    # 0. Validate with the input contract every page shares (the contract package), eagerly.
    arrays = tuple(jnp.asarray(x) for x in (q, k_pages, v_pages, block_table, seq_lens))
    call = _check_paged(arrays, block_q, is_causal, scale, window, softcap)
    return _flash_paged(*arrays, None, **_paged_statics(call, block_q))[0]  # (B, H, T, E)


def attention_paged_vjp(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    d_out: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``attention_paged``, FlashAttention-2's way (``attention_vjp``), over
    each sequence's pages: (dq, dk_pages, dv_pages). Each page's dK and dV are added into
    the page read (``.at[page].add``), so a page two sequences share collects both, and a
    slot no sequence reads stays exactly 0."""
    arrays = tuple(jnp.asarray(x) for x in (q, k_pages, v_pages, block_table, seq_lens))
    d_out = jnp.asarray(d_out)
    call = _check_paged(arrays, block_q, is_causal, scale, window, softcap, d_out)
    return _flash_paged(*arrays, d_out, **_paged_statics(call, block_q))[1:]


def _check_paged(arrays, block_q, is_causal, scale, window, softcap, d_out=None):
    options = dict(is_causal=is_causal, scale=scale, window=window, softcap=softcap)
    call = contract.check_paged(*arrays, **options, d_out=d_out)
    if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q <= 0:
        raise ValueError(f"block_q should be a positive int, got {block_q!r}")
    return call


def _paged_statics(call: contract.PagedChecked, block_q: int) -> dict:
    return dict(
        scale=call.scale,
        is_causal=call.is_causal,
        window=call.window,
        softcap=call.softcap,
        Tb=min(block_q, max(call.T, 1)),
    )


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "window", "softcap", "Tb"))
def _flash_paged(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    d_out: jax.Array | None,
    *,
    scale: float,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    Tb: int,
) -> tuple[jax.Array, ...]:
    """The forward, and with ``d_out`` the backward, sequence by sequence and query block by
    query block over the pages; compiled once per shape, dtype and options: (out, dq,
    dk_pages, dv_pages), the gradients None without ``d_out``."""
    B, H, T, D = q.shape
    N, K, L, _ = k_pages.shape
    E = v_pages.shape[-1]
    work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    grad = d_out is not None
    pages = (k_pages, v_pages, block_table, seq_lens)
    options = dict(scale=scale, is_causal=is_causal, window=window, softcap=softcap)

    def sequence(b: jax.Array, carry: tuple) -> tuple:
        for t0 in range(0, T, Tb):  # query blocks: T and Tb are static
            walk = _PageWalk(q, *pages, b, t0, min(t0 + Tb, T), **options)
            carry = _query_block(walk, d_out, carry)
        return carry

    carry = (
        jnp.zeros((B, H, T, E), dtype=q.dtype),  # out
        jnp.zeros((B, H, T, D), dtype=q.dtype) if grad else None,  # dq
        jnp.zeros((N, K, L, D), dtype=work) if grad else None,  # dk_pages
        jnp.zeros((N, K, L, E), dtype=work) if grad else None,  # dv_pages
    )
    if N == 0:  # no pages at all: every sequence is empty (the contract checked it)
        return carry[:2] + tuple(None if g is None else g.astype(q.dtype) for g in carry[2:])
    out, dq, dk_pages, dv_pages = lax.fori_loop(0, B, sequence, carry)
    if not grad:
        return out, None, None, None
    return out, dq, dk_pages.astype(q.dtype), dv_pages.astype(q.dtype)


def _query_block(walk: _PageWalk, d_out: jax.Array | None, carry: tuple) -> tuple:
    """One query block of one sequence: its output rows, and with ``d_out`` its dq rows
    and what its pages' dK and dV get back."""
    out, dq, dk_pages, dv_pages = carry
    b, t0, t1, H, K, R = walk.b, walk.t0, walk.t1, walk.H, walk.K, walk.R
    work = walk.work
    state = (
        jnp.full((K, R), -jnp.inf, dtype=work),  # m: (K, G·Tb)
        jnp.zeros((K, R), dtype=work),  # l: (K, G·Tb)
        jnp.zeros((K, R, walk.E), dtype=work),  # acc: (K, G·Tb, E)
    )
    m, l, acc = lax.fori_loop(walk.first, walk.last, walk.online, state)
    some = l > 0  # (K, G·Tb)
    o = acc / jnp.where(some, l, 1.0)[..., None]  # (K, G·Tb, E)
    rows = o.reshape(H, t1 - t0, walk.E).astype(out.dtype)  # (H, Tb, E)
    out = out.at[b, :, t0:t1].set(rows)  # (B, H, T, E)
    if d_out is None:
        return out, dq, dk_pages, dv_pages

    # The backward of this block (``flash.attention_vjp``): P = exp(Z − lse) and
    # Δ = rowsum(dO ⊙ O), then page by page dV, dK into the pages, dQ here.
    lse = backward_lse(m, l)  # (K, G·Tb)
    do = d_out[b, :, t0:t1].astype(work).reshape(K, R, walk.E)  # (K, G·Tb, E)
    delta = (do * o).sum(axis=-1)  # (K, G·Tb)
    backward = functools.partial(walk.backward, lse, do, delta)
    dq_i = jnp.zeros((K, R, walk.D), dtype=work)  # (K, G·Tb, D)
    dq_i, dk_pages, dv_pages = lax.fori_loop(
        walk.first, walk.last, backward, (dq_i, dk_pages, dv_pages)
    )
    dq_i = (dq_i * walk.scale).reshape(H, t1 - t0, walk.D).astype(dq.dtype)  # (H, Tb, D)
    dq = dq.at[b, :, t0:t1].set(dq_i)  # (B, H, T, D)
    return out, dq, dk_pages, dv_pages


class _PageWalk:
    """Query block [t0, t1) of sequence b against the pages it may see: the block's rows
    (scaled queries, diagonals), the pages [first, last) to walk, and one page's work
    (``tile``, ``online``, ``backward``). Built inside ``_flash_paged``: b and the
    bounds are traced, the sizes and options static."""

    def __init__(self, q, k_pages, v_pages, block_table, seq_lens, b, t0, t1, **options):
        B, H, T, D = q.shape
        N, K, L, _ = k_pages.shape
        self.k_pages, self.v_pages, self.block_table = k_pages, v_pages, block_table
        self.b, self.t0, self.t1, self.H, self.K, self.D = b, t0, t1, H, K, D
        self.N, self.L, self.E = N, L, v_pages.shape[-1]
        G = H // K
        self.work = work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        self.scale, self.softcap = options["scale"], options["softcap"]
        # Step 2's scale, folded into the queries (flash_tiles.py: huge scales).
        folded, self.post = scale_split(self.scale, work)
        left, right = options["window"] if options["window"] is not None else (None, None)
        hi = 0 if options["is_causal"] else right  # the last key a row sees, past its diagonal
        if options["is_causal"] and right is not None:
            hi = min(hi, right)
        self.left, self.hi = left, hi
        self.n = n = seq_lens[b]
        n_pages = (n + L - 1) // L
        self.R = G * (t1 - t0)  # rows: query head g·Tb + t of each key/value head
        qi = q[b, :, t0:t1].astype(work) * folded  # (H, Tb, D)
        self.qi = qi.reshape(K, self.R, D)  # (K, G·Tb, D)
        t = jnp.tile(jnp.arange(t0, t1), G)  # (G·Tb,): each row's query
        self.diagonal = t + n - T  # (G·Tb,): its bottom-right diagonal
        # The pages the block's rows may see: from the first row's first key to the
        # last row's last key, and never past the sequence's length.
        self.first, self.last = jnp.asarray(0), n_pages
        if left is not None:
            self.first = jnp.maximum(0, (t0 + n - T - left) // L)
        if hi is not None:
            self.last = jnp.clip((t1 - 1 + n - T + hi) // L + 1, 0, n_pages)

    def tile(self, j):
        """Steps 1, 3 and 4 on page j of sequence b: its (K, G·Tb, L) scores."""
        work, L, softcap = self.work, self.L, self.softcap
        page = jnp.clip(self.block_table[self.b, j], 0, self.N - 1)
        s = j * L + jnp.arange(L)  # (L,): the keys in the page
        allowed = s[None, :] < self.n  # (1, L)
        distance = s[None, :] - self.diagonal[:, None]  # (G·Tb, L)
        if self.hi is not None:
            allowed = allowed & (distance <= self.hi)  # (G·Tb, L)
        if self.left is not None:
            allowed = allowed & (distance >= -self.left)  # (G·Tb, L)
        allowed = jnp.broadcast_to(allowed, (self.R, L))  # (G·Tb, L)
        used = allowed.any(axis=0)[None, :, None]  # (1, L, 1)
        kj = jnp.where(used, self.k_pages[page].astype(work), 0.0)  # (K, L, D)
        vj = jnp.where(used, self.v_pages[page].astype(work), 0.0)  # (K, L, E)
        x = score_product("krd,kld->krl", self.qi, kj)  # (K, G·Tb, L)
        if self.post is not None:
            x = x * work(self.post)  # (K, G·Tb, L): the rest of the scale
        tanh = None
        if softcap is not None:
            # A subnormal x / softcap keeps the score (flash_tiles.py: huge softcaps).
            ratio = x / softcap  # (K, G·Tb, L)
            tanh = jnp.tanh(ratio)  # (K, G·Tb, L)
            x = jnp.where(jnp.abs(ratio) < jnp.finfo(work).tiny, x, softcap * tanh)
        x = jnp.where(allowed, x, -jnp.inf)  # (K, G·Tb, L)
        return page, x, tanh, kj, vj, used

    def online(self, j, state):
        """5 and 7: the online softmax (``flash.py``'s docstring) after page j."""
        m, l, acc = state
        _, x, _, _, vj, _ = self.tile(j)
        m_new = jnp.maximum(m, x.max(axis=-1))  # (K, G·Tb)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (K, G·Tb)
        alpha = jnp.exp(m - m_safe)  # (K, G·Tb)
        p = jnp.exp(x - m_safe[..., None])  # (K, G·Tb, L)
        l = alpha * l + p.sum(axis=-1)  # (K, G·Tb)
        pv = jnp.einsum("krl,kle->kre", p, vj, precision=HIGHEST)  # (K, G·Tb, E)
        return m_new, l, alpha[..., None] * acc + pv

    def backward(self, lse, do, delta, j, grads):
        """The backward of page j: dq's rows, and dK, dV added into the page read."""
        dq_i, dk_pages, dv_pages = grads
        page, z, tanh, kj, vj, used = self.tile(j)
        p = jnp.exp(z - lse[..., None])  # (K, G·Tb, L)
        dv_j = jnp.einsum("krl,kre->kle", p, do, precision=HIGHEST)  # (K, L, E)
        dp = jnp.einsum("kre,kle->krl", do, vj, precision=HIGHEST)  # (K, G·Tb, L)
        dz = p * (dp - delta[..., None])  # (K, G·Tb, L)
        if tanh is not None:
            dz = dz * (1.0 - tanh * tanh)  # (K, G·Tb, L)
        dq_i = dq_i + jnp.einsum("krl,kld->krd", dz, kj, precision=HIGHEST)
        dk_j = jnp.einsum("krl,krd->kld", dz, self.qi, precision=HIGHEST)  # (K, L, D)
        if self.post is not None:
            dk_j = dk_j * self.work(self.post)  # (K, L, D)
        # Unused slots get nothing back; what was read goes back to its page.
        dk_pages = dk_pages.at[page].add(jnp.where(used, dk_j, 0.0))  # (N, K, L, D)
        dv_pages = dv_pages.at[page].add(jnp.where(used, dv_j, 0.0))  # (N, K, L, E)
        return dq_i, dk_pages, dv_pages
