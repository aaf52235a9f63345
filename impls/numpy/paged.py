"""Attention over a paged KV cache in NumPy (SPEC §19): vLLM's PagedAttention, FlashInfer,
FlashAttention's ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``.

A server decoding many sequences keeps their keys and values in one pool of pages of L
slots each, and gives each sequence a table of the pages it owns, in order: sequence b's
key s lives in page block_table[b, s // L], slot s % L, and sequence b has seq_lens[b]
keys. Its T queries are its last T positions (a decode step, or a chunk of prefill), so
causality and the window are counted from the bottom-right diagonal of its own length:
query t sees key s <= t + seq_lens[b] - T.

Two ways to compute it, each with its backward:

- ``attention_paged`` (the numpy backend): gather each sequence's keys and values from its
  pages into ordinary (B, K, M·L, ·) arrays, and call the core page's ``attention`` under
  a mask of each sequence's length. ``attention_paged_backward`` runs
  ``backward.attention_backward`` on the gathered keys and scatters each gradient back to
  the slot it was read from: the transpose of a gather (a copy) is a sum.
- ``attention_paged_flash`` (numpy-flash): the blockwise walk of ``flash.py`` with each
  page a key tile, read in place: nothing is gathered, and only the pages a sequence
  reads are visited. ``attention_paged_flash_vjp`` is its FlashAttention-2 backward.

Shape legend: the core page's (``attention.py``), and N pages, L slots per page, M table
entries per sequence (so a sequence holds at most M·L keys).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .. import contract
from .attention import attention
from .backward import attention_backward
from .flash import backward_block, backward_lse, fast_online_softmax, normalise
from .flash_tiles import Band, KeyTiles, may_overflow, query_tile


def attention_paged(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """Attention over a paged KV cache (vLLM, FlashInfer, FlashAttention's
    ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``).

    A server decoding many sequences keeps their keys and values in one pool of pages of
    L slots each; sequence b's key s lives in page block_table[b, s // L], slot s % L, and
    sequence b has seq_lens[b] keys. Its T queries are its last T positions (a decode step,
    or a chunk of prefill), so causality and the window are counted from the bottom-right
    diagonal of its own length: query t sees key s <= t + seq_lens[b] - T.

    Shape legend: the spec's letters, and N pages, L slots per page, M table entries per
    sequence (so a sequence holds at most M·L keys).

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
    # 0. Validate with the input contract all impls share (the contract package): an error names the
    # argument, what was expected and what was given.
    q, k_pages, v_pages = np.asarray(q), np.asarray(k_pages), np.asarray(v_pages)
    block_table, seq_lens = np.asarray(block_table), np.asarray(seq_lens)
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

    # --8<-- [start:step-1-gather]
    # 1. Gather each sequence's keys and values from its pages, in table order.
    k, v = gather_pages(k_pages, v_pages, block_table, call)  # (B, K, S, D), (B, K, S, E)
    # --8<-- [end:step-1-gather]

    # --8<-- [start:step-2-allowed]
    # 2. Which keys each query may see: its sequence's first seq_lens[b] keys, and the
    # causal triangle and the window from the bottom-right diagonal of that length.
    allowed = paged_allowed(seq_lens, call)  # (B, 1, T, S)
    # --8<-- [end:step-2-allowed]

    # --8<-- [start:step-3-attention]
    # 3. Attention on the gathered keys under that mask. A slot no query may see (past a
    # sequence's length, or read through a clamped table entry) is replaced by 0 there
    # before it is used, so whatever it holds, NaN included, changes nothing.
    return attention(q, k, v, mask=allowed, scale=call.scale, softcap=call.softcap)
    # --8<-- [end:step-3-attention]


def gather_pages(
    k_pages: np.ndarray, v_pages: np.ndarray, block_table: np.ndarray, call: contract.PagedChecked
) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's key s = j·L + i from slot i of page block_table[b, j]: (B, K, M·L, D)
    and (B, K, M·L, E). Table entries a sequence does not read may hold anything, -1 or
    N + 5 included: they are clamped into [0, N) first, so the gather never indexes out of
    range, and what they point at is masked away."""
    B, K, L, M, D, E = call.B, call.K, call.L, call.M, call.D, call.E
    if call.N == 0:  # no pages at all: every sequence is empty (the contract checked it)
        return np.zeros((B, K, M * L, D), k_pages.dtype), np.zeros((B, K, M * L, E), v_pages.dtype)
    # --8<-- [start:gather-pages]
    pages = np.clip(block_table.astype(np.int64), 0, call.N - 1)  # (B, M)
    k = k_pages[pages]  # (B, M, K, L, D)
    v = v_pages[pages]  # (B, M, K, L, E)
    k = k.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, D)  # (B, K, S, D), S = M·L
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, E)  # (B, K, S, E)
    return k, v
    # --8<-- [end:gather-pages]


def paged_allowed(seq_lens: np.ndarray, call: contract.PagedChecked) -> np.ndarray:
    """Which gathered keys each query may see, (B, 1, T, S) bool: key s of sequence b if
    s < seq_lens[b], and causality and the window allow it from query t's diagonal t +
    seq_lens[b] - T (the queries are the sequence's last T positions)."""
    T, S, window = call.T, call.M * call.L, call.window
    # --8<-- [start:paged-allowed]
    n = seq_lens.astype(np.int64).reshape(-1, 1, 1, 1)  # (B, 1, 1, 1)
    t = np.arange(T)[:, None]  # (T, 1)
    s = np.arange(S)[None, :]  # (1, S)
    distance = s - (t + n - T)  # (B, 1, T, S)
    allowed = s < n  # (B, 1, 1, S)
    if call.is_causal:
        allowed = allowed & (distance <= 0)  # (B, 1, T, S)
    if window is not None and window[0] is not None:
        allowed = allowed & (distance >= -window[0])  # (B, 1, T, S)
    if window is not None and window[1] is not None:
        allowed = allowed & (distance <= window[1])  # (B, 1, T, S)
    return np.broadcast_to(allowed, (call.B, 1, T, S))  # (B, 1, T, S)
    # --8<-- [end:paged-allowed]


def attention_paged_backward(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_paged`` with respect to q and the pages (SPEC §19.4).

    The forward gathers each sequence's keys from its pages and attends them; so the
    backward attends back (``attention_backward`` on the gathered keys, under the same
    mask), and scatters each gathered key's gradient to the slot it was read from. A gather
    is a copy, and the transpose of a copy is a sum: a page that two sequences share (a
    common prefix) collects both gradients, and a slot no sequence reads gets exactly 0.

    Args:
      q, k_pages, v_pages, block_table, seq_lens, is_causal, scale, window, softcap: as
        for ``attention_paged``.
      d_out: ∂L/∂out, (B, H, T, E), same dtype as q.

    Returns:
      (dq, dk_pages, dv_pages): (B, H, T, D), (N, K, L, D), (N, K, L, E), same dtype as q.
    """
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k_pages, v_pages = np.asarray(q), np.asarray(k_pages), np.asarray(v_pages)
    block_table, seq_lens, d_out = np.asarray(block_table), np.asarray(seq_lens), np.asarray(d_out)
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
        d_out=d_out,
    )
    L, M = call.L, call.M

    # 1'-3'. The forward's gather and mask, and the backward of attention under them.
    k, v = gather_pages(k_pages, v_pages, block_table, call)  # (B, K, S, ·)
    allowed = paged_allowed(seq_lens, call)  # (B, 1, T, S)
    dq, dk, dv = attention_backward(
        q, k, v, d_out, mask=allowed, scale=call.scale, softcap=call.softcap
    )  # (B, H, T, D), (B, K, S, D), (B, K, S, E)

    # 1'. The gather's transpose: each read slot's gradient added to the slot it came
    # from, in the working precision and rounded once; slots no sequence reads stay 0.
    work = np.float64 if q.dtype == np.float64 else np.float32
    s = np.arange(M * L)  # (S,)
    read = s[None, :] < seq_lens.astype(np.int64)[:, None]  # (B, S)
    b_idx, s_idx = np.nonzero(read)  # (R,), (R,): every slot some sequence reads
    page = block_table.astype(np.int64)[b_idx, s_idx // L]  # (R,)
    slot = s_idx % L  # (R,)
    grads = [dq]
    for pages, d in ((k_pages, dk), (v_pages, dv)):
        total = np.zeros(pages.shape, dtype=work)  # (N, K, L, ·)
        rows = d.transpose(0, 2, 1, 3)[b_idx, s_idx].astype(work)  # (R, K, ·)
        np.add.at(total, (page, slice(None), slot), rows)  # (N, K, L, ·)
        grads.append(total.astype(q.dtype))
    return tuple(grads)


# --- Blockwise: each page a key tile, read in place -----------------------------------------


def attention_paged_flash(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> np.ndarray:
    """``attention_paged``, a page at a time: each page a sequence reads is one key tile
    of ``flash.py``'s walk, read in place.

    The online softmax runs over the sequence's pages as it runs over key tiles, and
    visits only the ⌈seq_lens[b] / L⌉ pages the sequence reads (fewer, where the band
    skips some): the cost follows the lengths, not the table's width M·L, and nothing is
    gathered.

    Args:
      q, k_pages, v_pages, block_table, seq_lens, is_causal, scale, window, softcap: as
        for ``attention_paged``.
      block_q: Tb, queries per tile (per query head); the key tile is the page.

    Returns:
      out: (B, H, T, E), same dtype as q; a sequence with no key gives rows of 0.
    """
    # 0. Validate with the input contract every page shares (the contract package).
    call, q, queries = prepare_paged(q, k_pages, v_pages, block_table, seq_lens, block_q, locals())
    B, H, K, G, T, E = call.B, call.H, call.K, call.G, call.T, call.E
    out = np.empty((B, K, G, T, E), dtype=q.dtype)  # (B, K, G, T, E)

    for b in range(B):
        # Sequence b's pages as its key tiles (PageTiles).
        tiles = page_tiles(k_pages, v_pages, call, b, queries)
        for t0 in range(0, T, block_q):
            t1 = min(t0 + block_q, T)
            # Steps 1-5 and 7 as in ``flash.attention``, over the pages the block's rows may see.
            qs = query_tile(q[b], t0, t1, call.scale, tiles.work)  # (K, G·Tb, D)
            acc, l, _ = fast_online_softmax(qs, t0, t1, tiles)
            acc = normalise(acc, l)  # (K, G·Tb, E)
            out[b, :, :, t0:t1] = acc.reshape(K, G, t1 - t0, E)  # (K, G, Tb, E)

    return out.reshape(B, H, T, E)  # (B, H, T, E)


def attention_paged_flash_vjp(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_paged_flash``, FlashAttention-2's way (``flash.attention_vjp``'s
    derivation), over each sequence's pages: (dq, dk_pages, dv_pages).

    Each sequence's backward adds into a dK and dV of its own length, page by page; they
    are then added into the pages they were read from, so a page two sequences share
    collects both, and a slot no sequence reads stays exactly 0.

    Args:
      q, k_pages, v_pages, block_table, seq_lens, is_causal, scale, window, softcap,
        block_q: as for ``attention_paged_flash``.
      d_out: ∂L/∂out, (B, H, T, E), in q's dtype.
    """
    # 0. Validate as the forward does, and d_out against the output's shape and dtype.
    d_out = np.asarray(d_out)
    call, q, queries = prepare_paged(q, k_pages, v_pages, block_table, seq_lens, block_q, locals())
    B, H, K, G, T, D, E, L = call.B, call.H, call.K, call.G, call.T, call.D, call.E, call.L
    d_out = d_out.reshape(B, K, G, T, E)  # (B, K, G, T, E), a view
    dq = np.empty((B, K, G, T, D), dtype=q.dtype)  # (B, K, G, T, D)
    work = np.float64 if q.dtype == np.float64 else np.float32
    dk_pages = np.zeros(np.shape(k_pages), dtype=work)  # (N, K, L, D)
    dv_pages = np.zeros(np.shape(v_pages), dtype=work)  # (N, K, L, E)

    for b in range(B):
        tiles = page_tiles(k_pages, v_pages, call, b, queries)
        n = call.seq_lens[b]
        dk = np.zeros((K, n, D), dtype=work)  # (K, n, D): sequence b's keys
        dv = np.zeros((K, n, E), dtype=work)  # (K, n, E)
        for t0 in range(0, T, block_q):
            t1 = min(t0 + block_q, T)
            Tb = t1 - t0
            # Forward steps 1-5 and 7 for this block: O and the log-sum-exp.
            qs = query_tile(q[b], t0, t1, call.scale, work)  # (K, G·Tb, D)
            acc, l, m = fast_online_softmax(qs, t0, t1, tiles)
            o = normalise(acc, l)  # (K, G·Tb, E)
            lse = backward_lse(m, l)  # (K, G·Tb, 1)

            # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O).
            do = d_out[b, :, :, t0:t1].astype(work).reshape(K, G * Tb, E)  # (K, G·Tb, E)
            delta = np.sum(do * o, axis=-1, keepdims=True)  # (K, G·Tb, 1)

            # The backward over the block's pages; dq gets the scale once, here.
            dq_b = backward_block(qs, do, lse, delta, t0, t1, tiles, dk, dv, None)
            dq_b *= work(call.scale)  # (K, G·Tb, D)
            dq[b, :, :, t0:t1] = dq_b.reshape(K, G, Tb, D)  # (K, G, Tb, D)

        # 1'. Each key's gradient back to the page slot it was read from.
        for j, page in enumerate(call.pages[b]):
            rows = slice(j * L, min((j + 1) * L, n))
            dk_pages[page, :, : rows.stop - rows.start] += dk[:, rows]  # (K, ≤L, D)
            dv_pages[page, :, : rows.stop - rows.start] += dv[:, rows]  # (K, ≤L, E)

    return (
        dq.reshape(B, H, T, D),  # (B, H, T, D)
        dk_pages.astype(q.dtype),  # (N, K, L, D)
        dv_pages.astype(q.dtype),  # (N, K, L, E)
    )


def prepare_paged(q, k_pages, v_pages, block_table, seq_lens, block_q, given: dict):
    """Step 0 of a paged call: the checked call, q as (B, K, G, T, D), a view, and the
    same q where the prescaled product may overflow (``flash_tiles.may_overflow``), else
    None: the queries the key tiles compute such scores again from."""
    q = np.asarray(q)
    options = {n: given[n] for n in ("is_causal", "scale", "window", "softcap")}
    if "d_out" in given:
        options["d_out"] = given["d_out"]
    arrays = (np.asarray(x) for x in (k_pages, v_pages, block_table, seq_lens))
    call = contract.check_paged(q, *arrays, **options)
    if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q <= 0:
        raise ValueError(f"block_q should be a positive int, got {block_q!r}")
    q = q.reshape(call.B, call.K, call.G, call.T, call.D)  # (B, K, G, T, D)
    work = np.float64 if q.dtype == np.float64 else np.float32
    return call, q, q if may_overflow(q, np.asarray(k_pages), call.scale, work) else None


def page_tiles(
    k_pages, v_pages, call: contract.PagedChecked, b: int, queries: np.ndarray | None
) -> PageTiles:
    """Sequence b's keys and values as key tiles of whole pages, with its band: causality
    and the window from the bottom-right diagonal of its own length. ``queries``: those of
    ``prepare_paged``, or None."""
    n, dtype = call.seq_lens[b], np.asarray(k_pages).dtype
    work = np.float64 if dtype == np.float64 else np.float32
    band = Band(n - call.T, call.is_causal, call.window)
    pages = call.pages[b]  # the ⌈n / L⌉ pages sequence b reads
    k = PageRows(np.asarray(k_pages), pages, n)  # (K, n, D), read through the pages
    v = PageRows(np.asarray(v_pages), pages, n)  # (K, n, E)
    rows = None if queries is None else queries[b]  # (K, G, T, D)
    return PageTiles(
        k, v, None, band, call.softcap, None, call.T, call.K, call.G, call.L, work,
        queries=rows, scale=call.scale,
    )  # fmt: skip


class PageRows:
    """One sequence's key (or value) rows, read through its pages: ``rows[:, s0:s1]`` is
    slots s0 % L … of page pages[s0 // L], a view, for a range [s0, s1) within one page
    (``PageTiles.ranges`` cuts every tile at the page boundaries)."""

    def __init__(self, pages: np.ndarray, table: tuple[int, ...], n: int) -> None:
        self.pages, self.table, self.L = pages, table, pages.shape[2]  # (N, K, L, X)
        self.shape = (pages.shape[1], n, pages.shape[3])  # (K, n, X)

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        rows = index[1]
        j, i0 = divmod(rows.start, self.L)
        return self.pages[self.table[j], :, i0 : i0 + rows.stop - rows.start]  # (K, Sb, X)


class PageTiles(KeyTiles):
    """``KeyTiles`` over one sequence's pages: the key tiles are its pages (L keys each,
    ``block_k`` = L), cut where the band starts or ends inside one; pages past its length
    are never visited, and neither is any slot past it."""

    def ranges(self, t0: int, t1: int) -> Iterator[tuple[int, int, bool]]:
        L = self.block_k
        for a, b, whole in self.band.ranges(t0, t1, self.S):
            s0 = a
            while s0 < b:
                s1 = min((s0 // L + 1) * L, b)  # the end of s0's page, or of the range
                yield s0, s1, whole
                s0 = s1
