"""Scaled dot-product attention in PyTorch, written out step by step (no fused kernel).

    out = softmax(mask(softcap(scale · q kᵀ))) v

Step by step, for one query row t:

    score[s]  = scale · Σ_d q[t, d] · k[s, d]          scale defaults to 1/√D
    score[s]  = c · tanh(score[s] / c)                  only with softcap=c
    score[s]  = score[s] - slope · |t + S - T - s|      only with ALiBi's slopes
    score[s]  = score[s] + mask[t, s]                   a float mask is added;
    score[s]  = -inf where the key s is blocked         a bool mask, causal, window or chunk blocks
    w[s]      = exp(score[s] - max) / Σ exp(score - max)
    out[t, e] = Σ_s w[s] · v[s, e]

With attention sinks (one logit sink[h] per query head), the sink joins the row's max and
its sum, but has no value row: w[s] = exp(score[s] - max) / (exp(sink - max) + Σ exp(score
- max)), so a row's weights sum to less than 1.

With chunked local attention (Llama 4, ``chunk_size=c``), query t sees key s only if both
lie in the same chunk of c positions: (t + offset) // c == s // c, offset as for causality.

With ALiBi (``alibi_slopes``, one slope per query head), a key is penalised linearly in its
distance from the query, always measured from the bottom-right diagonal (as FlashAttention).

Shape legend (heads-first, as in PyTorch; PyTorch's own docs call T "L" and E "Ev"):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       C model width (module only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores), broadcastable to
    (B, H, T, S). Unbatched q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).
    sinks (H,): one logit per query head.

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks, grouped-query and multi-query attention (K < H), dropout (drawn as
SDPA draws it, from an optional ``torch.Generator``), float64, float32, float16 and
bfloat16, autograd. A query row with no key left to attend returns exactly 0, and its
gradients are 0, not NaN.

This is the seed tutorials' ``scaled_dot_product_attention(Q, K, V, mask)`` grown to the
full contract: with ``return_weights=True`` it returns ``(out, weights)`` like the first
seed, and the seeds' name is kept as an alias of ``attention``. Imports: the standard
library, PyTorch and ``contract.py``, the input contract all impls share (step 0); the
math, ``_allowed`` included, is this file's own. Also here: packed variable-length sequences
(``attention_packed``, SPEC §18) and a KV cache. Why each step is
written as it is: the Notes at the end of this file.
"""

from __future__ import annotations

import math

import torch

from . import contract


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention.

    Args:
      q: queries, (B, H, T, D) or unbatched (H, T, D).
      k: keys, (B, K, S, D) or (K, S, D); K must divide H.
      v: values, (B, K, S, E) or (K, S, E).
      mask: bool (True = may attend) or floating (added to the scores, -inf blocks),
        broadcastable to (B, H, T, S).
      is_causal: query t attends only keys s on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      causal_alignment: where the diagonal sits when T != S. "top_left": s <= t.
        "bottom_right": s <= t + S - T (the last query sees the last key, as in a KV cache).
        Also places the window's diagonal.
      window: (left, right): query t attends keys in [t' - left, t' + right] where t' is
        its aligned diagonal; None on a side is unbounded.
      softcap: scores become softcap · tanh(scores / softcap) before masking.
      dropout_p: probability of zeroing each attention weight.
      generator: the random generator that draws the dropout mask; None uses PyTorch's
        global generator (seeded by ``torch.manual_seed``), as SDPA does.
      return_weights: also return the attention weights.
      sinks: (H,), same dtype as q: one logit per query head that joins every row's
        softmax and carries no value (gpt-oss); None for none.
      chunk_size: query t attends only keys s in its own chunk, (t + offset) // chunk_size
        == s // chunk_size, offset placed by causal_alignment (Llama 4); None for none.
      alibi_slopes: (H,) or (B, H), float32 or q's dtype: ALiBi adds -slope · |t + S - T -
        s| to the scores after the softcap, whatever causal_alignment says; None for none.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
      weights (only with return_weights): (B, H, T, S), or (H, T, S); the weights that
        multiplied v (after dropout, as SDPA's math backend returns them); same dtype as q.
    """
    # 0. Validate with the input contract all impls share (contract.py): an error names the
    # argument, the expected shape and what was given.
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    mask = None if mask is None else torch.as_tensor(mask)
    sinks = None if sinks is None else torch.as_tensor(sinks)
    alibi_slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes)
    ok = generator is None or isinstance(generator, torch.Generator)
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
        dropout_p=dropout_p,
        random=("generator", generator, ok, "a torch.Generator or None"),
        sinks=sinks,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    B, H, T, S, G = call.B, call.H, call.T, call.S, call.G
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)

    # Float16 and bfloat16 are computed in float32 and rounded once (see Notes).
    out_dtype = q.dtype
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    q, k, v = q.to(work), k.to(work), v.to(work)

    # Grouped-query attention: query head h uses key/value head h // G (see Notes).
    k = k.repeat_interleave(G, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(G, dim=1)  # (B, H, S, E)

    # Which keys each query may see; a key/value slot that no query sees is replaced by 0,
    # so that whatever it holds has no effect (see Notes: blocked keys).
    allowed = _allowed(mask, call, q.device)  # (B|1, H|1, T, S)
    used = allowed.any(dim=2)[..., None]  # (B|1, H|1, S, 1)
    k = torch.where(used, k, 0.0)  # (B, H, S, D)
    v = torch.where(used, v, 0.0)  # (B, H, S, E)

    # 1. Scores: every query against every key of its head.
    scores = torch.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)

    # 2. Scale, so that the scores' spread does not grow with the head size D.
    scores = scores * call.scale  # (B, H, T, S)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if call.softcap is not None:
        scores = _Softcap.apply(scores, call.softcap)  # (B, H, T, S)

    # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query may
    # not see gets -inf.
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes.to(work), T, S, H)  # (B, H, T, S)
    if mask is not None and not call.mask_is_bool:
        scores = scores + mask.to(work)  # (B, H, T, S)
    scores = torch.where(allowed, scores, -math.inf)  # (B, H, T, S)

    # 5. Softmax over the keys, less the row maximum so that exp() <= 1. A row with no key
    # left has maximum -inf and gets weights of exactly 0 (see Notes: empty rows).
    row_max = (
        scores.amax(dim=-1, keepdim=True)
        if S
        else scores.new_full((*scores.shape[:-1], 1), -math.inf)
    )  # (B, H, T, 1)
    if sinks is not None:
        # A sink joins the maximum of every row that has a key (see Notes: sinks).
        sink = _sink_logits(sinks.to(work), row_max, H)  # (B, H, T, 1)
        row_max = torch.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = torch.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    if sinks is not None:
        # The sink takes its share of the sum, and has no value row to give anything back.
        row_sum = row_sum + torch.exp(sink - row_max)  # (B, H, T, 1)
    # A row that reads +inf has row sum +inf: every weight of it is NaN, not only those of
    # its +inf scores (SPEC §4.1), so that its gradients reach every key it attends.
    divisor = torch.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, 1)
    divisor = torch.where(row_sum == math.inf, math.nan, divisor)  # (B, H, T, 1)
    weights = p / divisor  # (B, H, T, S)
    if sinks is not None:
        # A NaN or +inf sink makes its row NaN, as +inf - +inf does in the softmax (SPEC
        # §15.4); the shift by a finite row maximum above cannot show it, so it is selected.
        bad = torch.isnan(sink) | (sink == math.inf)  # (B, H, T, 1)
        weights = torch.where(bad, math.nan, weights)  # (B, H, T, S)

    # 6. Dropout: zero each weight with probability dropout_p and rescale the survivors
    # by 1 / (1 - dropout_p), so the expected output is unchanged.
    if call.dropout_p > 0:
        # Drawn and applied as SDPA's math backend does, bit for bit (see Notes: dropout).
        keep = torch.empty((B, H, T, S), dtype=work, device=q.device)  # (B, H, T, S)
        keep = keep.bernoulli_(1.0 - call.dropout_p, generator=generator)  # (B, H, T, S)
        keep = keep.div_(1.0 - call.dropout_p)  # (B, H, T, S)
        weights = weights * keep  # (B, H, T, S)

    # 7. Weighted sum of the values.
    out = torch.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    out = out.to(out_dtype)  # (B, H, T, E)
    if not return_weights:
        return out[0] if call.unbatched else out
    weights = weights.to(out_dtype)  # (B, H, T, S)
    return (out[0], weights[0]) if call.unbatched else (out, weights)


#: The seeds' name: both seed tutorials define ``scaled_dot_product_attention(Q, K, V,
#: mask)``, so a reader coming from them finds it here. The same function as ``attention``
#: (its options keyword-only, its mask True = may attend, or added to the scores).
scaled_dot_product_attention = attention


class _Softcap(torch.autograd.Function):
    """softcap · tanh(scores / softcap), whose derivative 1 − tanh²(scores / softcap) is
    taken as it is (see Notes: huge softcaps)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, softcap: float) -> torch.Tensor:
        tanh = torch.tanh(scores / softcap)  # (B, H, T, S)
        ctx.save_for_backward(tanh)
        return softcap * tanh  # (B, H, T, S)

    @staticmethod
    def backward(ctx, d_capped: torch.Tensor) -> tuple[torch.Tensor, None]:
        (tanh,) = ctx.saved_tensors
        return d_capped * (1.0 - tanh * tanh), None  # (B, H, T, S)


def _alibi_bias(slopes: torch.Tensor, T: int, S: int, H: int) -> torch.Tensor:
    """ALiBi's bias, (B|1, H, T, S): −slope · |t + S − T − s|, so that a key weighs less
    the farther it lies from the query. The distance is from the bottom-right diagonal
    whatever the causal alignment: the last query sits at the last key (see Notes: ALiBi)."""
    t = torch.arange(T, device=slopes.device)[:, None]  # (T, 1)
    s = torch.arange(S, device=slopes.device)[None, :]  # (1, S)
    distance = (t + S - T - s).abs().to(slopes.dtype)  # (T, S)
    return -slopes.reshape(-1, H, 1, 1) * distance  # (B|1, H, T, S)


def _sink_logits(sinks: torch.Tensor, row_max: torch.Tensor, H: int) -> torch.Tensor:
    """Each row's sink logit, (B, H, T, 1): sinks[h] in the rows of head h that have a key,
    and -inf (no sink) in a row with none, which stays exactly 0 whatever its sink holds."""
    has_key = row_max != -math.inf  # (B, H, T, 1); NaN != -inf: a NaN row has keys
    return torch.where(has_key, sinks.reshape(1, H, 1, 1), -math.inf)  # (B, H, T, 1)


def _allowed(
    mask: torch.Tensor | None, call: contract.Checked, device: torch.device
) -> torch.Tensor:
    """Which keys each query may see, (B|1, H|1, T, S) bool: those that a bool mask, the
    causal triangle, the window and the chunk allow and a float mask does not set to -inf."""
    T, S, window, chunk = call.T, call.S, call.window, call.chunk_size
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if call.causal_alignment == "top_left" else S - T
    t = torch.arange(T, device=device)[:, None]  # (T, 1)
    s = torch.arange(S, device=device)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = torch.ones((1, 1, T, S), dtype=torch.bool, device=device)  # (1, 1, T, S)
    if call.is_causal:
        allowed = allowed & (distance <= 0)  # (1, 1, T, S)
    if window is not None and window[0] is not None:
        allowed = allowed & (distance >= -window[0])  # (1, 1, T, S)
    if window is not None and window[1] is not None:
        allowed = allowed & (distance <= window[1])  # (1, 1, T, S)
    if chunk is not None:
        # Same chunk only; floor division puts a negative position in a chunk of no key.
        allowed = allowed & ((t + offset) // chunk == s // chunk)  # (1, 1, T, S)
    if mask is not None and call.mask_is_bool:
        allowed = allowed & mask  # (B|1, H|1, T, S)
    elif mask is not None:
        allowed = allowed & (mask != -math.inf)  # (B|1, H|1, T, S)
    return allowed


def attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention over packed variable-length sequences (FlashAttention's varlen API).

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone: no query sees another document,
    and causality and windows are counted inside each document.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``attention``, applied
        within each document (bottom-right puts document n's diagonal at S_n - T_n).

    Returns:
      out: (H, T, E), same dtype as q.
    """
    # 0. Validate with the input contract all impls share (contract.py): an error names the
    # argument, the expected shape and what was given.
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    call, cu_q, cu_k = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    H, E = call.H, call.E

    # 1. Each document alone: its queries against its own keys only, so nothing another
    # document holds (not even a NaN) is ever read (see Notes: packed documents).
    rows = [q.new_zeros((H, 0, E))]  # (H, 0, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        rows.append(attention(q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], **options))  # (H, T_n, E)
    return torch.cat(rows, dim=1)  # (H, T, E)


class KVCache:
    """Keys and values of the tokens decoded so far, for one sequence batch.

    Decoding feeds a few new tokens at a time. Their queries must see every cached key
    and, among themselves, only earlier ones: that is causal attention aligned
    bottom-right, because the new queries are the *last* T of the S positions.

        cache = KVCache()
        for q_t, k_t, v_t in chunks:            # (B, H, T, D), (B, K, T, D), (B, K, T, E)
            out_t = cache.attend(q_t, k_t, v_t)  # (B, H, T, E)
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, K, S, D)
        self.v: torch.Tensor | None = None  # (B, K, S, E)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        """Append k, v to the cache, then attend the new queries to everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=-2)  # (B, K, S, D)
            self.v = torch.cat([self.v, v], dim=-2)  # (B, K, S, E)
        return attention(
            q,
            self.k,
            self.v,
            is_causal=True,
            causal_alignment="bottom_right",
            **options,
        )  # (B, H, T, E)


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
) -> torch.Tensor:
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
    # 0. Validate with the input contract all impls share (contract.py): an error names the
    # argument, what was expected and what was given.
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
    k, v = _gather_pages(k_pages, v_pages, block_table, call)  # (B, K, S, D), (B, K, S, E)

    # 2. Which keys each query may see: its sequence's first seq_lens[b] keys, and the
    # causal triangle and the window from the bottom-right diagonal of that length.
    allowed = _paged_allowed(seq_lens, call)  # (B, 1, T, S)

    # 3. Attention on the gathered keys under that mask. A slot no query may see (past a
    # sequence's length, or read through a clamped table entry) is replaced by 0 there
    # before it is used, so whatever it holds, NaN included, changes nothing.
    return attention(q, k, v, mask=allowed, scale=call.scale, softcap=call.softcap)


def _gather_pages(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    call: contract.PagedChecked,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's key s = j·L + i from slot i of page block_table[b, j]: (B, K, M·L, D)
    and (B, K, M·L, E). Table entries a sequence does not read may hold anything, -1 or
    N + 5 included: they are clamped into [0, N) first, so the gather never indexes out of
    range, and what they point at is masked away."""
    B, K, L, M, D, E = call.B, call.K, call.L, call.M, call.D, call.E
    if call.N == 0:  # no pages at all: every sequence is empty (the contract checked it)
        return k_pages.new_zeros((B, K, M * L, D)), v_pages.new_zeros((B, K, M * L, E))
    pages = block_table.long().clamp(0, call.N - 1)  # (B, M)
    k = k_pages[pages]  # (B, M, K, L, D)
    v = v_pages[pages]  # (B, M, K, L, E)
    k = k.permute(0, 2, 1, 3, 4).reshape(B, K, M * L, D)  # (B, K, S, D), S = M·L
    v = v.permute(0, 2, 1, 3, 4).reshape(B, K, M * L, E)  # (B, K, S, E)
    return k, v


def _paged_allowed(seq_lens: torch.Tensor, call: contract.PagedChecked) -> torch.Tensor:
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


# --- Notes -----------------------------------------------------------------------------------
#
# Packed documents (attention_packed). Packing N documents into one array saves the padding
# a batch of unequal lengths would need; the price is that every query must be kept away
# from the other documents' keys. Here each document is sliced out and attended alone, the
# literal meaning of SPEC §18; autograd differentiates through the slices and the
# concatenation. A block-diagonal mask would compute the same weights, but the product
# P·V would still multiply a weight of 0 by every other document's values, and
# 0 · NaN = NaN: one document's NaN would reach the rest.
#
# Why 1/√D (step 2). If the entries of q and k have unit variance, q·k sums D such products
# and has variance D; dividing by √D keeps the scores near unit variance whatever the head
# size, so the softmax neither saturates (one-hot weights, vanishing gradients) nor flattens.
#
# Working precision. Float16 and bfloat16 inputs are computed in float32 and the result is
# rounded once: exp() of a float16 score overflows past 11.09, and summing many weights in
# float16 loses the small ones.
#
# Grouped-query attention (K < H). Each key/value head serves G = H // K consecutive query
# heads, so query head h uses key/value head h // G (PyTorch's repeat_interleave, not
# tiling). Repeating every key/value head G times turns it into plain multi-head attention;
# with K = H (G = 1) nothing changes.
#
# Blocked keys. Blocked scores are replaced by -inf in step 4, not only pushed down by
# adding -inf, since NaN + -inf is NaN. A key that no query of its head may see (padding, a
# KV-cache slot not yet written) must have no effect, whatever it holds: a weight of 0 does
# not cancel it, because 0 · NaN and 0 · inf are NaN. Its key and value rows are replaced by
# 0 before they are used, by selection, so that their gradients are exactly 0 as well.
#
# Empty rows (step 5). A row with every key blocked has max -inf; it is given weights of
# exactly 0 (as PyTorch SDPA and FlashAttention do) instead of the NaN that exp(-inf - -inf)
# would give. With S = 0 every row is such a row: the maximum starts from -inf, since an
# empty axis has no maximum of its own.
#
# Sinks (step 5). An attention sink (gpt-oss; StreamingLLM's sink tokens in masking form) is
# one more logit per query head in every row's softmax, with no value row: its weight goes
# "nowhere", so a head can attend to nothing in particular. It joins the row maximum, so
# exp() stays <= 1 even for a sink of 1e4, and the sum, not the numerator: the keys' weights
# then add up to 1 - p_sink. It is not scaled, softcapped, masked or dropped. A row with no
# key has no softmax at all and stays 0 (SPEC §15.3), so its sink is left out.
#
# ALiBi (step 4). Press et al.'s attention with linear biases replaces position embeddings
# by a penalty −slope · distance on every score, one slope per query head (the usual slopes
# are 2^(-8 (h + 1) / H)). The distance is |t + S − T − s|, from the bottom-right diagonal,
# as FlashAttention's alibi_slopes define it: with a KV cache the T queries are the last T
# of the S positions, so that is where each query really sits. It is computed in the
# working precision and added like a float mask, after the softcap; the slopes are
# constants, with no gradient.
#
# An empty key axis (step 5). torch's amax refuses an axis of length 0, so with S = 0 the
# row maximum is made -inf explicitly, as NumPy's max(initial=-inf) makes it.
#
# Dropout (step 6). The keep mask is drawn and applied exactly as at::dropout inside
# F.scaled_dot_product_attention's math backend on the CPU: one bernoulli_(1 - p) over a
# (B, H, T, S) tensor in the compute dtype, divided by 1 - p before it multiplies the
# weights (the order matters to the last bit). So after torch.manual_seed(s), with the
# global generator, the same positions are dropped as in SDPA called with the same seed.
#
# Huge softcaps (step 3). Autograd would differentiate softcap · tanh(scores / softcap) as
# ((d · softcap) · (1 − tanh²)) / softcap, and d · softcap overflows for a softcap near the
# largest float (3e38 in float32, 1e308 in float64): the gradient became ±inf (SPEC §4.2).
# The derivative 1 − tanh²(scores / softcap) is therefore applied as it is, as the
# hand-written backward passes of the other impls do; the forward is unchanged.
