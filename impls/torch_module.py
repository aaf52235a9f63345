"""Multi-head attention and a pre-LN GPT block as PyTorch modules, with their own core.

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
    F MLP hidden width (block only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores), broadcastable to
    (B, H, T, S). Unbatched q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).
    sinks (H,): one logit per query head.

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks (in ``attention``; the modules have none),
grouped-query and multi-query attention (K < H), dropout (through a
callable such as ``nn.Dropout``, so that ``module.eval()`` turns it off), float64,
float32, float16 and bfloat16, autograd. A query row with no key left to attend returns
exactly 0, and its gradients are 0, not NaN.

The modules are the seed tutorial's ``MultiHeadAttention`` (one fused ``qkv`` Linear,
``out_proj``, ``dropout``) and pre-LN ``SelfAttentionBlock``; their ``state_dict`` names
are the parameter names of the NumPy reference's ``multi_head_attention`` and
``gpt_block``. Their core, ``attention``, comes first, then packed variable-length
sequences (``attention_packed``, SPEC §18). Imports: the standard library,
PyTorch and ``contract.py``, the input contract all impls share (step 0); the math,
``_allowed`` included, is this file's own, not ``torch_naive``'s, so that the suite checks
two independent copies of the steps. Why each step is written as it is: the Notes at the
end of this file.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

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
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention: the core of ``MultiHeadAttention``.

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
      dropout: applied to the (B, H, T, S) weights, e.g. ``nn.Dropout(p)``: zeroes each
        weight with probability p in training mode, does nothing in eval mode.
      sinks: (H,), same dtype as q: one logit per query head that joins every row's
        softmax and carries no value (gpt-oss); None for none.
      chunk_size: query t attends only keys s in its own chunk, (t + offset) // chunk_size
        == s // chunk_size, offset placed by causal_alignment (Llama 4); None for none.
      alibi_slopes: (H,) or (B, H), float32 or q's dtype: ALiBi adds -slope · |t + S - T -
        s| to the scores after the softcap, whatever causal_alignment says; None for none.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate with the input contract all impls share (contract.py): an error names the
    # argument, the expected shape and what was given.
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    mask = None if mask is None else torch.as_tensor(mask)
    sinks = None if sinks is None else torch.as_tensor(sinks)
    alibi_slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes)
    ok = dropout is None or callable(dropout)
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
        # nn.Dropout accepts p = 1 (every weight dropped); the contract, like SDPA's
        # rescale by 1 / (1 - p), needs p < 1.
        dropout_p=getattr(dropout, "p", 0.0),
        random=("dropout", dropout, ok, "a callable such as nn.Dropout, or None"),
        sinks=sinks,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    H, T, S, G = call.H, call.T, call.S, call.G
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
    if dropout is not None:
        # An nn.Dropout draws its mask as SDPA's math backend does (see Notes: dropout).
        weights = dropout(weights)  # (B, H, T, S)

    # 7. Weighted sum of the values.
    out = torch.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    out = out.to(out_dtype)  # (B, H, T, E)
    return out[0] if call.unbatched else out


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


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention: one fused q/k/v projection, H heads, an output mix.

    Args:
      d_model: C, the model width.
      n_heads: H, which must divide C; each head has D = C // H channels.
      dropout: probability of zeroing each attention weight in training mode.

    Shapes: x (B, T, C) -> (B, T, C).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        C = d_model
        D = contract.check_heads(n_heads, C)
        self.d_model = C
        self.n_heads = C // D
        self.head_dim = D
        self.qkv = nn.Linear(C, 3 * C)
        self.out_proj = nn.Linear(C, C)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Attend every position of x to the others (mask, is_causal as ``attention``)."""
        B, T, C, H, D = contract.check_module_input(x, self.n_heads, self.d_model)

        # 1. Project to queries, keys and values with one fused matrix, then split them.
        qkv = self.qkv(x)  # (B, T, 3C)
        q, k, v = qkv.split(C, dim=-1)  # 3 × (B, T, C)

        # 2. Split the width into H heads of D channels: head h owns channels [h·D, (h+1)·D).
        q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)

        # 3. Attention in every head at once; the dropout module is off in eval mode.
        context = attention(
            q, k, v, mask=mask, is_causal=is_causal, dropout=self.dropout
        )  # (B, H, T, D)

        # 4. Merge the heads back into the width, head-major, then mix them.
        context = context.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out_proj(context)  # (B, T, C)


class SelfAttentionBlock(nn.Module):
    """One pre-LN decoder block: x + attn(norm1(x)), then + mlp(norm2(x)).

    Args:
      d_model: C, the model width.
      n_heads: H, which must divide C.
      d_ff: F, the MLP's hidden width.

    Shapes: x (B, T, C) -> (B, T, C). The attention is causal (top-left, T = S).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_ff),
            nn.GELU(),
            nn.Linear(d_ff, d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN: each sublayer sees a normalised input, and the residual path stays an
        # identity, which keeps deep stacks trainable without warm-up tricks.
        x = x + self.attn(self.norm1(x), is_causal=True)  # (B, T, C)
        return x + self.mlp(self.norm2(x))  # (B, T, C)


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
# Dropout (step 6). The dropout callable receives the (B, H, T, S) weights in the compute
# dtype, the tensor SDPA's math backend hands to at::dropout. An nn.Dropout in training
# mode runs at::dropout itself, so after torch.manual_seed(s) it drops the same positions
# as F.scaled_dot_product_attention(..., dropout_p=p) with the same seed.
#
# Huge softcaps (step 3). Autograd would differentiate softcap · tanh(scores / softcap) as
# ((d · softcap) · (1 − tanh²)) / softcap, and d · softcap overflows for a softcap near the
# largest float (3e38 in float32, 1e308 in float64): the gradient became ±inf (SPEC §4.2).
# The derivative 1 − tanh²(scores / softcap) is therefore applied as it is, as the
# hand-written backward passes of the other impls do; the forward is unchanged.
