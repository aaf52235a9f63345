"""Our attention contract mapped onto PyTorch's fused ``F.scaled_dot_product_attention``.

    out = softmax(mask(softcap(scale · q kᵀ))) v

Step by step, for one query row t:

    score[s]  = scale · Σ_d q[t, d] · k[s, d]          scale defaults to 1/√D
    score[s]  = c · tanh(score[s] / c)                  only with softcap=c
    score[s]  = score[s] - slope · |t + S - T - s|      only with ALiBi's slopes
    score[s]  = score[s] + mask[t, s]                   a float mask is added;
    score[s]  = -inf where the key s is blocked         a bool mask, causal, window or chunk blocks
    w[s]      = exp(score[s] - max) / Σ exp(score - max)
    out[t, e] = Σ_s w[s] · v[s, e]

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

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping (through ``flex_attention``, forward only on the CPU), grouped-query
and multi-query attention (K < H), dropout on the weights (seeded by ``torch.manual_seed``),
float64, float32, float16 and bfloat16, autograd (SDPA's own backward). A query row with
no key left to attend returns exactly 0.

Also here: packed variable-length sequences (``attention_packed``, SPEC §18), through
nested jagged tensors. Imports: the standard library, PyTorch and ``contract.py``, the input contract all impls
share (step 0); the band of causality, the window and the chunks, ``_band``, is this file's
own. What
this adapter hands to SDPA and what it builds itself, and SDPA's behaviour on the CPU that
it relies on: the Notes at the end of this file.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention through ``F.scaled_dot_product_attention``.

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
      softcap: scores become softcap · tanh(scores / softcap) before masking (through
        flex_attention; not with dropout_p > 0, nor with gradients on the CPU).
      dropout_p: probability of zeroing each attention weight; the mask is drawn from
        PyTorch's global generator.
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
    alibi_slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes)
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
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    H, K, T, S = call.H, call.K, call.T, call.S
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = mask.reshape(call.mask_shape).expand(b, h, T, S)  # (B|1, H|1, T, S)

    # A float mask is added at the precision the scores are computed in: float32 for
    # float16 and bfloat16 q (SDPA accepts a float32 mask for them), q's dtype otherwise.
    work = torch.float64 if q.dtype == torch.float64 else torch.float32

    # 1.-3. Scores, scale and softcap happen inside SDPA (or flex_attention, for softcap).

    # 4. Mask: a float mask is added; a bool mask, the causal triangle, the window and the
    # chunks decide which keys each query may see at all.
    sdpa_causal = (
        call.is_causal
        and mask is None
        and call.window is None
        and call.chunk_size is None
        and alibi_slopes is None
        and call.softcap is None
        and (call.causal_alignment == "top_left" or T == S)
    )
    allowed, additive = None, None
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask  # (B|1, H|1, T, S)
    elif mask is not None:
        additive = mask.to(work)  # (B|1, H|1, T, S)
    if alibi_slopes is not None:
        # ALiBi's bias joins the float mask SDPA adds (after its scale; flex_attention adds
        # it after the softcap), in the precision the scores are computed in.
        bias = _alibi_bias(alibi_slopes.to(work), T, S, H)  # (B|1, H, T, S)
        additive = bias if additive is None else additive + bias  # (B|1, H, T, S)
    chunked = call.chunk_size is not None
    if (call.is_causal and not sdpa_causal) or call.window is not None or chunked:
        band = _band(T, S, call, q.device)  # (1, 1, T, S)
        allowed = band if allowed is None else allowed & band  # (B|1, H|1, T, S)

    # A slot that no query of its key/value head may see (padding, a KV-cache slot not
    # yet written, a key after every query) must have no effect, whatever it holds; but
    # SDPA multiplies every value row by its weight (0 · NaN = NaN) and adds the mask to
    # every score (NaN + -inf = NaN). Such key and value rows are replaced by 0 first, by
    # selection, so that their gradients are exactly 0 as well; so is a query with no key
    # to see (every query when S = 0), whose row SDPA would otherwise compute from a NaN
    # in it.
    used, has_key = _seen(allowed, additive, sdpa_causal, H, K, T, S, q.device)
    if used is not None and not bool(used.all()):
        k = torch.where(used, k, 0.0)  # (B, K, S, D)
        v = torch.where(used, v, 0.0)  # (B, K, S, E)
    if has_key is not None and not bool(has_key.all()):
        q = torch.where(has_key, q, 0.0)  # (B, H, T, D)

    if call.softcap is not None and T > 0 and S > 0:
        out = _flex_attention(q, k, v, allowed, additive, call.scale, call.softcap, call.dropout_p)
        return out[0] if call.unbatched else out
    # With T = 0 or S = 0 there is no score to softcap: SDPA below gives §2.5's empty
    # output or rows of 0, where flex_attention raises IndexError (torch 2.13, CPU).

    # A float mask carries the blocked keys as -inf. SDPA on the CPU turns a row of -inf
    # into weights of exactly 0 (checked above for torch 2.13), so no fix-up is needed.
    attn_mask = allowed
    if additive is not None and allowed is not None:
        attn_mask = torch.where(allowed, additive, -math.inf)  # (B|1, H|1, T, S)
    elif additive is not None:
        attn_mask = additive  # (B|1, H|1, T, S)

    # 5.-7. Softmax, dropout and the weighted sum: SDPA, with K < H through enable_gqa.
    sdpa = {
        "attn_mask": attn_mask,
        "dropout_p": call.dropout_p,
        "is_causal": sdpa_causal,
        "scale": call.scale,
        "enable_gqa": K != H,
    }
    out = F.scaled_dot_product_attention(q, k, v, **sdpa)  # (B, H, T, E)

    # SDPA's CPU flash kernel returns 0 for a row whose every score is NaN; a NaN must
    # never become a number (§4.9), so such rows are computed again on the math backend.
    out = _nan_rows_again(out, q, k, v, sdpa)  # (B, H, T, E)
    return out[0] if call.unbatched else out


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
    """Attention over packed variable-length sequences, through PyTorch's nested jagged
    tensors where SDPA takes them.

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone: no query sees another document,
    and causality and windows are counted inside each document.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0: the
        ``offsets`` of ``torch.nested.nested_tensor_from_jagged``.
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
    H, G, E = call.H, call.G, call.E
    N = len(cu_q) - 1
    jagged = not call.is_causal and call.window is None and call.softcap is None and N > 0

    # 1.-7. Without causality, a window or a softcap, SDPA itself takes the documents as
    # nested jagged tensors (N, H, j, D), one ragged length per document (see Notes: packed
    # documents). Its nested path has no GQA, so the key/value heads are repeated first,
    # as enable_gqa would.
    if jagged:
        offsets_q = torch.tensor(cu_q, dtype=torch.int64)  # (N + 1,)
        offsets_k = torch.tensor(cu_k, dtype=torch.int64)  # (N + 1,)
        k = k.repeat_interleave(G, dim=0)  # (H, S, D)
        v = v.repeat_interleave(G, dim=0)  # (H, S, E)
        nested = [
            torch.nested.nested_tensor_from_jagged(x.transpose(0, 1).contiguous(), offsets=o)
            for x, o in ((q, offsets_q), (k, offsets_k), (v, offsets_k))
        ]  # (N, j, H, ·) each
        q_n, k_n, v_n = (x.transpose(1, 2) for x in nested)  # (N, H, j, ·)
        with warnings.catch_warnings():
            # Raised from inside SDPA's nested path (torch 2.13), which builds a strided
            # nested tensor of its own; nothing the caller can change.
            warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
            out = F.scaled_dot_product_attention(q_n, k_n, v_n, scale=call.scale)  # (N, H, j, E)
        return out.transpose(1, 2).values().transpose(0, 1)  # (H, T, E)

    # Otherwise each document goes to ``attention`` above alone: SDPA's nested path refuses
    # is_causal, an attn_mask and GQA, and one dense call with a block-diagonal mask would
    # let one document's NaN reach the others through P·V.
    rows = [q.new_zeros((H, 0, E))]  # (H, 0, E)
    for n in range(N):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        if t0 == t1:
            continue  # no queries, no rows
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

    # 3. Attention on the gathered keys under that mask: F.scaled_dot_product_attention
    # with the mask as its bool attn_mask (``attention`` above: PyTorch's real path, and
    # flex_attention's score_mod for a softcap). A slot no query may see (past a sequence's
    # length, or read through a clamped table entry) is replaced by 0 there before it is
    # used, so whatever it holds, NaN included, changes nothing.
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


def _seen(
    allowed: torch.Tensor | None,
    additive: torch.Tensor | None,
    sdpa_causal: bool,
    H: int,
    K: int,
    T: int,
    S: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Which key/value slots some query of their head group sees, (B|1, K|1, S, 1), and
    which queries see some key, (B|1, H|1, T, 1); None where every one does."""
    if S == 0:
        return None, torch.zeros((1, 1, T, 1), dtype=torch.bool, device=device)  # no key
    if sdpa_causal:
        # SDPA's own top-left causal mask: query t sees keys s <= t, so key s is seen
        # (from query s on) when s < T, and every query sees key 0.
        return (torch.arange(S, device=device) < T)[:, None], None  # (S, 1)
    visible = allowed
    if additive is not None:
        finite = additive != -math.inf  # (B|1, H|1, T, S)
        visible = finite if visible is None else visible & finite  # (B|1, H|1, T, S)
    if visible is None:
        return None, None
    b, h = visible.shape[:2]
    kv = K if h == H else 1
    groups = visible.reshape(b, kv, h // kv, T, S)  # (B|1, K|1, G|1, T, S)
    used = groups.any(dim=3).any(dim=2)[..., None]  # (B|1, K|1, S, 1)
    return used, visible.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)


def _nan_rows_again(
    out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sdpa: dict
) -> torch.Tensor:
    """``out`` with its all-0 rows computed again on SDPA's math backend, when q, k or the
    mask hold a NaN: (B, H, T, E).

    SDPA's CPU flash kernel returns 0 for a row whose every score is NaN (a NaN query, or
    a row whose keys all hold a NaN), as if the row had no key: measured with torch 2.13
    (the torch.sdpa profile fails test_nan_propagates). The math backend propagates the
    NaN. Without a NaN this costs one pass over q and k.
    """
    if not _has_nan(q, k, sdpa["attn_mask"]):
        return out
    zero_rows = (out == 0).all(dim=-1, keepdim=True)  # (B, H, T, 1)
    if not bool(zero_rows.any()):
        return out
    with sdpa_kernel(SDPBackend.MATH):
        again = F.scaled_dot_product_attention(q, k, v, **sdpa)  # (B, H, T, E)
    return torch.where(zero_rows, again, out)  # (B, H, T, E)


def _has_nan(*tensors: torch.Tensor | None) -> bool:
    """Whether any of the tensors may hold a NaN: its sum is NaN then (and also, harmlessly,
    when +inf meets -inf). A sum allocates nothing of the inputs' size."""
    return any(
        x is not None and x.is_floating_point() and bool(torch.isnan(x.sum())) for x in tensors
    )


def _flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    additive: torch.Tensor | None,
    scale: float,
    softcap: float,
    dropout_p: float,
) -> torch.Tensor:
    """Softcapped attention through flex_attention's score_mod: (B, H, T, E)."""
    from torch.nn.attention.flex_attention import flex_attention

    if dropout_p > 0:
        raise NotImplementedError(
            "softcap: SDPA has no softcap and flex_attention, which softcaps here, has no "
            f"dropout; softcap with dropout_p > 0 is not supported, got dropout_p={dropout_p!r}"
        )
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if needs_grad and q.device.type == "cpu":
        raise NotImplementedError(
            "softcap: SDPA has no softcap and flex_attention, which softcaps here, has no "
            "backward on the CPU; call under torch.no_grad() or on another device"
        )
    if not needs_grad:
        # flex_attention refuses CPU inputs that require grad even under no_grad.
        q, k, v = q.detach(), k.detach(), v.detach()
    B, H, T, _ = q.shape
    K, S = k.shape[1], k.shape[2]
    if allowed is not None:
        allowed = allowed.expand(B, H, T, S)  # (B, H, T, S)
    if additive is not None:
        additive = additive.expand(B, H, T, S)  # (B, H, T, S)

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        t: torch.Tensor,
        s: torch.Tensor,
    ) -> torch.Tensor:
        # flex_attention has already applied step 2 (the scale) to the score.
        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        score = softcap * torch.tanh(score / softcap)
        # 4. Mask: the float mask is added, then blocked keys get -inf.
        if additive is not None:
            score = score + additive[b, h, t, s]
        if allowed is not None:
            score = torch.where(allowed[b, h, t, s], score, -math.inf)
        return score

    with warnings.catch_warnings():
        # Eager (uncompiled) flex_attention is what we want here: a reference, not speed.
        warnings.filterwarnings("ignore", message="flex_attention called without")
        return flex_attention(
            q, k, v, score_mod=score_mod, scale=scale, enable_gqa=K != H
        )  # (B, H, T, E)


def _alibi_bias(slopes: torch.Tensor, T: int, S: int, H: int) -> torch.Tensor:
    """ALiBi's bias, (B|1, H, T, S): −slope · |t + S − T − s|, the distance from the
    bottom-right diagonal whatever the causal alignment, as FlashAttention defines it."""
    t = torch.arange(T, device=slopes.device)[:, None]  # (T, 1)
    s = torch.arange(S, device=slopes.device)[None, :]  # (1, S)
    distance = (t + S - T - s).abs().to(slopes.dtype)  # (T, S)
    return -slopes.reshape(-1, H, 1, 1) * distance  # (B|1, H, T, S)


def _band(T: int, S: int, call: contract.Checked, device: torch.device) -> torch.Tensor:
    """Which keys each query may see under causality, the window and the chunks:
    (1, 1, T, S) bool."""
    is_causal, window, chunk = call.is_causal, call.window, call.chunk_size
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if call.causal_alignment == "top_left" else S - T
    t = torch.arange(T, device=device)[:, None]  # (T, 1)
    s = torch.arange(S, device=device)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = torch.ones((T, S), dtype=torch.bool, device=device)  # (T, S)
    if is_causal:
        allowed &= distance <= 0
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    if chunk is not None:
        # Same chunk only; floor division puts a negative position in a chunk of no key.
        allowed &= (t + offset) // chunk == s // chunk
    return allowed[None, None]  # (1, 1, T, S)


# --- Notes -----------------------------------------------------------------------------------
#
# Why 1/√D (step 2, inside SDPA). If the entries of q and k have unit variance, q·k sums D
# such products and has variance D; dividing by √D keeps the scores near unit variance
# whatever the head size, so the softmax neither saturates (one-hot weights, vanishing
# gradients) nor flattens.
#
# What this adapter hands to SDPA, and what it builds itself:
#
#     our option                      SDPA (torch 2.13)
#     ------------------------------  ------------------------------------------------------
#     scale                           scale=, passed through (default 1/√D, as SDPA's)
#     mask, bool                      attn_mask=, bool (True = may attend), as given
#     mask, float                     attn_mask=, float, cast to the compute dtype (float32
#                                     for float16/bfloat16 q, which SDPA accepts), so it is
#                                     added at the precision the reference adds it
#     is_causal, top_left, no mask    is_causal=True
#       and no window
#     is_causal otherwise             built here: SDPA's is_causal is top-left only, and its
#       (bottom_right with T != S,    math backend refuses is_causal with an attn_mask
#       with a mask or a window)      ("Explicit attn_mask should not be set when
#                                     is_causal=True"), while its CPU flash backend accepts
#                                     the pair and ANDs them: the outcome would depend on the
#                                     backend chosen. The band is ANDed into a bool mask, or
#                                     written as -inf into a float mask.
#     window                          built here the same way; SDPA has no window
#     chunk_size                      built here the same way; SDPA has no chunks (Llama 4's
#                                     chunked attention is a mask in transformers too)
#     alibi_slopes                    attn_mask=, float: −slope · |t + S − T − s| built here
#                                     in the compute dtype and added to the float mask (or
#                                     given alone); the blocked keys then go in as -inf
#     K < H (GQA, MQA)                enable_gqa=True (repeat_interleave semantics)
#     dropout_p                       dropout_p=, passed through; the keep mask comes from
#                                     PyTorch's global generator (``torch.manual_seed``)
#     softcap                         SDPA has none: the call goes to
#                                     ``torch.nn.attention.flex_attention`` in eager mode,
#                                     with a score_mod that softcaps, adds the float mask
#                                     and blocks with -inf (scale, GQA passed through).
#                                     Eager flex runs on the CPU but has no backward there
#                                     and no dropout: softcap with inputs that need
#                                     gradients, or with dropout_p > 0, raises
#                                     NotImplementedError.
#     unbatched (H, T, D)             a batch axis of 1 added here, removed after
#
# Packed documents (attention_packed, SPEC §18). SDPA takes packed documents as nested
# jagged tensors: ``torch.nested.nested_tensor_from_jagged(values (T, H, D), offsets =
# cu_seqlens)``, transposed to (N, H, j, D). Measured with torch 2.13.0 on the CPU: it
# gives each document's attention (T_n != S_n, E != D, empty documents, rows of exactly 0
# for S_n = 0, float64 to bfloat16, gradients by autograd), and a NaN in one document
# stays there. It refuses the rest: is_causal=True raises "RuntimeError: No viable backend
# for scaled_dot_product_attention was found" (its log: "Nested tensors for query / key
# are not supported when is_causal=True"), enable_gqa=True with K < H a RuntimeError from
# matmul ("batch dimensions must have the same sizes"), an attn_mask "ValueError: Masks
# are not yet supported!". So GQA is the heads repeated before the nested call (what
# enable_gqa means), and causality, windows and softcap go to ``attention`` document by
# document: one dense call with a block-diagonal bool mask gives the right weights, but a
# NaN in one document's v made every row of the other documents NaN (measured, float64
# and float32), since SDPA multiplies whole rows of P by V.
#
# SDPA's behaviour on the CPU, observed with torch 2.13.0 (and relied on here):
#
# - A row whose keys are all blocked gives exactly 0, with a bool mask and with a float
#   mask whose row is all -inf, in every dtype, on both the math and the CPU flash backend,
#   and its gradients are 0, not NaN (the math backend uses ``_safe_softmax``). So the
#   adapter needs no fix-up for empty rows; eager flex_attention also uses
#   ``_safe_softmax`` and gives 0.
# - float16 and bfloat16: the math backend (taken with dropout, GQA or E != D) computes in
#   float32 and rounds once; the CPU flash backend (taken otherwise) accumulates in float32
#   but is not bit-identical to a single rounding (about 1 ulp of float16/bfloat16 apart).
#   Eager flex_attention scores in float32 but rounds the weights to q's dtype before
#   multiplying v.
# - is_causal=True with T != S is aligned top-left (s <= t): with T > S nothing is empty,
#   and bottom-right alignment is not available.
# - Dropout (math backend only: the CPU flash backend takes none) draws
#   ``bernoulli_(1 - p)`` over the (B, H, T, S) weights in the compute dtype and multiplies
#   by the mask divided by 1 - p (``at::dropout``), so ``torch_naive`` with the global
#   generator, and ``torch_module`` with an ``nn.Dropout``, drop the same positions after
#   the same ``torch.manual_seed``.
#
# Gradients come from SDPA's own backward through autograd, including the gradient of a
# float ``attn_mask`` (0 on -inf entries, and 0 for fully masked rows, not NaN). Softcap
# has none on the CPU: flex_attention raises NotImplementedError for inputs that require
# grad, so the conformance backend does not declare ``grad_softcap``.
