"""Attention over a paged KV cache (vLLM, FlashInfer, FlashAttention's
``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``; SPEC §19), on the
core page's steps.

A server decoding many sequences keeps their keys and values in one pool of pages of L
slots each; sequence b's key s lives in page block_table[b, s // L], slot s % L, and
sequence b has seq_lens[b] keys. Its T queries are its last T positions (a decode step,
or a chunk of prefill), so causality and the window are counted from the bottom-right
diagonal of its own length: query t sees key s <= t + seq_lens[b] - T.

Here each sequence's pages are gathered in table order into (B, K, M·L, ·) keys and
values, and the core page's steps 1-7 run on them under a bool mask of which slots each
query may see. The table and the lengths are traced, not static, so one compiled program
serves every table of the same shapes. The gather's transpose is a scatter-add: a page
two sequences share collects both gradients, and a slot no sequence reads gets exactly 0.

Shape legend: the core page's letters, and N pages, L slots per page, M table entries per
sequence (so a sequence holds at most M·L keys).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import contract
from .attention import as_arrays, compiled


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
) -> jax.Array:
    """Attention over a paged KV cache.

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

    Returns:
      out: (B, H, T, E), same dtype as q; a sequence with no key gives rows of 0.
    """
    # 0. Validate with the input contract every page shares, eagerly, on the table's
    # values; the table and the lengths are then traced.
    arrays = as_arrays(q, k_pages, v_pages, block_table, seq_lens)
    options = dict(is_causal=is_causal, scale=scale, window=window, softcap=softcap)
    call = contract.check_paged(*arrays, **options)
    return attend_paged(*arrays, **_static(call))  # (B, H, T, E)


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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``attention_paged`` by ``jax.vjp``: (dq, dk_pages, dv_pages).

    Args:
      q, k_pages, v_pages, block_table, seq_lens, is_causal, scale, window, softcap: as
        for ``attention_paged``.
      d_out: ∂L/∂out, (B, H, T, E), in q's dtype.
    """
    # 0. Validate as the forward does (eagerly), and d_out against the output's shape.
    arrays = as_arrays(q, k_pages, v_pages, block_table, seq_lens)
    (d_out,) = as_arrays(d_out)
    options = dict(is_causal=is_causal, scale=scale, window=window, softcap=softcap)
    call = contract.check_paged(*arrays, **options, d_out=d_out)
    return _pullback(*arrays, d_out, **_static(call))


def _static(call: contract.PagedChecked) -> dict:
    """The checked options as ``attend_paged`` takes them: the scale traced."""
    return dict(
        scale=call.scale, is_causal=call.is_causal, window=call.window, softcap=call.softcap
    )


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "softcap"))
def attend_paged(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
) -> jax.Array:
    """Steps 1-3 of ``attention_paged`` on checked inputs; compiled once per shape, dtype
    and options, whatever the table and the lengths hold."""
    # 1. Gather each sequence's keys and values from its pages, in table order.
    k, v = gather_pages(k_pages, v_pages, block_table)  # (B, K, S, D), (B, K, S, E)

    # 2. Which keys each query may see: its sequence's first seq_lens[b] keys, and the
    # causal triangle and the window from the bottom-right diagonal of that length.
    T, S = q.shape[2], k.shape[2]
    allowed = paged_allowed(seq_lens, T, S, is_causal, window)  # (B, 1, T, S)

    # 3. The core page's attention on the gathered keys under that mask. A slot no query
    # may see (past a sequence's length, or read through a clamped table entry) is
    # replaced by 0 there before it is used, so whatever it holds, NaN included, changes
    # nothing.
    call = contract.check(q, k, v, mask=allowed, softcap=softcap)
    call = dataclasses.replace(call, scale=None)  # the scale traced
    return compiled(q, k, v, allowed, None, None, None, scale, call=call)  # (B, H, T, E)


def gather_pages(
    k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Sequence b's key s = j·L + i from slot i of page block_table[b, j]: (B, K, M·L, D)
    and (B, K, M·L, E). Table entries a sequence does not read may hold anything, -1 or
    N + 5 included: they are clamped into [0, N) first, so the gather never indexes out of
    range, and what they point at is masked away."""
    N, K, L, D = k_pages.shape
    E = v_pages.shape[-1]
    B, M = block_table.shape
    if N == 0:  # no pages at all: every sequence is empty (the contract checked it)
        k = jnp.zeros((B, K, M * L, D), k_pages.dtype)  # (B, K, S, D)
        return k, jnp.zeros((B, K, M * L, E), v_pages.dtype)  # (B, K, S, E)
    pages = jnp.clip(block_table, 0, N - 1)  # (B, M)
    k = k_pages[pages]  # (B, M, K, L, D)
    v = v_pages[pages]  # (B, M, K, L, E)
    k = k.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, D)  # (B, K, S, D), S = M·L
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, E)  # (B, K, S, E)
    return k, v


def paged_allowed(
    seq_lens: jax.Array,
    T: int,
    S: int,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
) -> jax.Array:
    """Which gathered keys each query may see, (B, 1, T, S) bool: key s of sequence b if
    s < seq_lens[b], and causality and the window allow it from query t's diagonal t +
    seq_lens[b] - T (the queries are the sequence's last T positions)."""
    n = seq_lens.reshape(-1, 1, 1, 1)  # (B, 1, 1, 1)
    t = jnp.arange(T)[:, None]  # (T, 1)
    s = jnp.arange(S)[None, :]  # (1, S)
    distance = s - (t + n - T)  # (B, 1, T, S)
    allowed = s < n  # (B, 1, 1, S)
    if is_causal:
        allowed = allowed & (distance <= 0)  # (B, 1, T, S)
    if window is not None and window[0] is not None:
        allowed = allowed & (distance >= -window[0])  # (B, 1, T, S)
    if window is not None and window[1] is not None:
        allowed = allowed & (distance <= window[1])  # (B, 1, T, S)
    return jnp.broadcast_to(allowed, (n.shape[0], 1, T, S))  # (B, 1, T, S)


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "softcap"))
def _pullback(q, k_pages, v_pages, block_table, seq_lens, d_out, **options):
    """jax.vjp of steps 1-3 with respect to q and the pages (the table and the lengths are
    integers, traced but not differentiated), compiled once per shape and options."""

    def forward(q, k_pages, v_pages):
        return attend_paged(q, k_pages, v_pages, block_table, seq_lens, **options)

    _, pull = jax.vjp(forward, q, k_pages, v_pages)
    return pull(d_out)
