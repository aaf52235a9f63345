"""Attention over a paged KV cache in PyTorch (vLLM, FlashInfer, FlashAttention's
``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``; SPEC §19).

A server decoding many sequences keeps their keys and values in one pool of pages of L
slots each; sequence b's key s lives in page block_table[b, s // L], slot s % L, and
sequence b has seq_lens[b] keys. Its T queries are its last T positions (a decode step, or
a chunk of prefill), so causality and the window are counted from the bottom-right
diagonal of its own length: query t sees key s <= t + seq_lens[b] - T.

The keys and values are gathered from the pages, and a core page's ``attention``
(``naive.attention`` unless another is given: the torch-module backend gives
``module.attention``, torch-sdpa ``sdpa.attention``) attends to them under the mask of
what each query may see.

Shape legend: the spec's letters (B batch · H query heads · K key/value heads · T queries
per sequence · D q/k head dim · E v head dim), and N pages, L slots per page, M table
entries per sequence (so a sequence holds at most M·L keys, and S = M·L gathered).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import contract
from . import naive


def attention_paged(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    attend: Callable[..., torch.Tensor] = naive.attention,
) -> torch.Tensor:
    """Attention over a paged KV cache.

    Args:
      q: queries, (B, H, T, D).
      k_pages: (N, K, L, D), the pool of key pages; K must divide H.
      v_pages: (N, K, L, E), the value pages, laid out alike.
      block_table: (B, M) integer: the pages of sequence b, in order. Entries past
        ⌈seq_lens[b] / L⌉ are never read and may hold anything (-1 is common).
      seq_lens: (B,) integer: the number of keys of each sequence, 0 to M·L.
      is_causal: query t attends only keys s <= t + seq_lens[b] - T (T <= seq_lens[b]).
      scale, window, softcap: as for ``naive.attention``, the window's diagonal placed
        bottom-right as causality's.
      attend: the attention the gathered keys go to: a core page's ``attention``.

    Returns:
      out: (B, H, T, E), same dtype as q; a sequence with no key gives rows of 0.
    """
    # 0. Validate with the input contract every page shares: an error names the argument,
    # what was expected and what was given.
    call = contract.check_paged(
        q,
        k_pages,
        v_pages,
        block_table,
        seq_lens,
        is_causal=is_causal,
        scale=scale,
        window=window,
        softcap=softcap,
    )

    # 1. Gather each sequence's keys and values from its pages, in table order.
    k, v = gather_pages(k_pages, v_pages, block_table, call)  # (B, K, S, D), (B, K, S, E)

    # 2. Which keys each query may see: its sequence's first seq_lens[b] keys, and the
    # causal triangle and the window from the bottom-right diagonal of that length.
    allowed = paged_allowed(seq_lens, call)  # (B, 1, T, S)

    # 3. Attention on the gathered keys under that mask (for sdpa.attention, SDPA's bool
    # attn_mask). A slot no query may see (past a sequence's length, or read through a
    # clamped table entry) is replaced by 0 there before it is used, so whatever it holds,
    # NaN included, changes nothing.
    return attend(q, k, v, mask=allowed, scale=call.scale, softcap=call.softcap)


def gather_pages(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    call: contract.PagedChecked,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's key s = j·L + i from slot i of page block_table[b, j]: (B, K, M·L, D)
    and (B, K, M·L, E). Table entries a sequence does not read may hold anything, -1 or
    N + 5 included: they are clamped into [0, N) first, so the gather never indexes out of
    range, and what they point at is masked away. Autograd's backward of the gather adds
    each read slot's gradient into its page, so a shared page sums its readers (§19.4)."""
    B, K, L, M, D, E = call.B, call.K, call.L, call.M, call.D, call.E
    if call.N == 0:  # no pages at all: every sequence is empty (the contract checked it)
        return k_pages.new_zeros((B, K, M * L, D)), v_pages.new_zeros((B, K, M * L, E))
    pages = block_table.long().clamp(0, call.N - 1)  # (B, M)
    k = k_pages[pages]  # (B, M, K, L, D)
    v = v_pages[pages]  # (B, M, K, L, E)
    k = k.permute(0, 2, 1, 3, 4).reshape(B, K, M * L, D)  # (B, K, S, D), S = M·L
    v = v.permute(0, 2, 1, 3, 4).reshape(B, K, M * L, E)  # (B, K, S, E)
    return k, v


def paged_allowed(seq_lens: torch.Tensor, call: contract.PagedChecked) -> torch.Tensor:
    """Which gathered keys each query may see, (B, 1, T, S) bool: key s of sequence b if
    s < seq_lens[b], and causality and the window allow it from query t's diagonal t +
    seq_lens[b] - T (the queries are the sequence's last T positions)."""
    T, S, window = call.T, call.M * call.L, call.window
    n = seq_lens.long().reshape(-1, 1, 1, 1)  # (B, 1, 1, 1)
    t = torch.arange(T, device=seq_lens.device)[:, None]  # (T, 1)
    s = torch.arange(S, device=seq_lens.device)[None, :]  # (1, S)
    distance = s - (t + n - T)  # (B, 1, T, S)
    allowed = s < n  # (B, 1, 1, S)
    if call.is_causal:
        allowed = allowed & (distance <= 0)  # (B, 1, T, S)
    if window is not None and window[0] is not None:
        allowed = allowed & (distance >= -window[0])  # (B, 1, T, S)
    if window is not None and window[1] is not None:
        allowed = allowed & (distance <= window[1])  # (B, 1, T, S)
    return allowed.expand(call.B, 1, T, S)  # (B, 1, T, S)
