"""Scaled dot-product attention in NumPy: the reference every other impl mirrors.

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

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       C model width (module only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores), broadcastable to
    (B, H, T, S). Unbatched q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).
    sinks (H,): one logit per query head.

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks, grouped-query and
multi-query attention (K < H), dropout (with an explicit ``numpy.random.Generator``), float64, float32, float16 and bfloat16
(``ml_dtypes``). A query row with no key left to attend returns exactly 0.

Imports: the standard library, NumPy and ``contract.py``, the input contract all impls
share (step 0); the math, ``_band`` included, is this file's own. Also here: a KV cache,
attention over packed variable-length sequences (``attention_packed``, SPEC §18) and over
a paged KV cache (``attention_paged``, §19), and the multi-head layer and pre-LN GPT block
as functions of a PyTorch-style ``state_dict``. The backward pass is its own page,
``numpy_attention_backward.py``. Why each step is written as it is: the Notes at the end
of this file.
"""

from __future__ import annotations

import math

import numpy as np

from . import contract


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    rng: np.random.Generator | None = None,
    sinks: np.ndarray | None = None,
    chunk_size: int | None = None,
    alibi_slopes: np.ndarray | None = None,
) -> np.ndarray:
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
      dropout_p: probability of zeroing each attention weight (needs ``rng``).
      rng: the random generator that draws the dropout mask.
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
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    sinks = None if sinks is None else np.asarray(sinks)
    alibi_slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
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
        random=("rng", rng, isinstance(rng, np.random.Generator), "a numpy.random.Generator"),
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
    work = np.float64 if out_dtype == np.float64 else np.float32
    q, k, v = q.astype(work), k.astype(work), v.astype(work)

    # Grouped-query attention: query head h uses key/value head h // G (see Notes).
    k = np.repeat(k, G, axis=1)  # (B, H, S, D)
    v = np.repeat(v, G, axis=1)  # (B, H, S, E)

    # Which keys each query may see; a key/value slot that no query sees is replaced by 0,
    # so that whatever it holds has no effect (see Notes: blocked keys).
    allowed = _allowed(mask, call)  # (B|1, H|1, T, S)
    used = allowed.any(axis=2)[..., None]  # (B|1, H|1, S, 1)
    k = np.where(used, k, 0.0)  # (B, H, S, D)
    v = np.where(used, v, 0.0)  # (B, H, S, E)

    # 1. Scores: every query against every key of its head.
    scores = np.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)

    # 2. Scale, so that the scores' spread does not grow with the head size D. A score
    # that overflows is ±inf, as SPEC §4.1 defines: the answer, not an error.
    with np.errstate(over="ignore"):
        scores = scores * work(call.scale)  # (B, H, T, S)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if call.softcap is not None:
        # A score far above the softcap overflows to ±inf here, whose tanh is exactly ±1.
        with np.errstate(over="ignore"):
            scores = call.softcap * np.tanh(scores / call.softcap)  # (B, H, T, S)

    # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query may
    # not see gets -inf.
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes.astype(work), T, S, H)  # (B, H, T, S)
    if mask is not None and not call.mask_is_bool:
        scores = scores + mask.astype(work)  # (B, H, T, S)
    scores = np.where(allowed, scores, -np.inf)  # (B, H, T, S)

    # 5. Softmax over the keys, less the row maximum so that exp() <= 1. A row with no key
    # left has maximum -inf and gets weights of exactly 0 (see Notes: empty rows).
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, H, T, 1)
    if sinks is not None:
        # A sink joins the maximum of every row that has a key (see Notes: sinks).
        sink = _sink_logits(sinks.astype(work), row_max, H)  # (B, H, T, 1)
        row_max = np.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = np.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    if sinks is not None:
        # The sink takes its share of the sum, and has no value row to give anything back.
        with np.errstate(over="ignore", invalid="ignore"):
            row_sum = row_sum + np.exp(sink - row_max)  # (B, H, T, 1)
    # A row that reads +inf or NaN becomes NaN here (inf / inf), as SPEC §3.8 and §4.9
    # define: the answer, not an error, so NumPy is not to warn about it.
    with np.errstate(invalid="ignore"):
        weights = p / np.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, S)
    if sinks is not None:
        # A NaN or +inf sink makes its row NaN, as +inf - +inf does in the softmax (SPEC
        # §15.4); the shift by a finite row maximum above cannot show it, so it is selected.
        weights = np.where(np.isnan(sink) | (sink == np.inf), np.nan, weights)  # (B, H, T, S)

    # 6. Dropout: zero each weight with probability dropout_p and rescale the survivors
    # by 1 / (1 - dropout_p), so the expected output is unchanged.
    if call.dropout_p > 0:
        keep = rng.random((B, H, T, S)) >= call.dropout_p  # (B, H, T, S)
        weights = weights * keep / (1.0 - call.dropout_p)  # (B, H, T, S)

    # 7. Weighted sum of the values.
    out = np.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    out = out.astype(out_dtype)  # (B, H, T, E)
    return out[0] if call.unbatched else out


def _alibi_bias(slopes: np.ndarray, T: int, S: int, H: int) -> np.ndarray:
    """ALiBi's bias, (B|1, H, T, S): −slope · |t + S − T − s|, so that a key weighs less
    the farther it lies from the query. The distance is from the bottom-right diagonal
    whatever the causal alignment: the last query sits at the last key (see Notes: ALiBi)."""
    t = np.arange(T)[:, None]  # (T, 1)
    s = np.arange(S)[None, :]  # (1, S)
    distance = np.abs(t + S - T - s).astype(slopes.dtype)  # (T, S)
    return -slopes.reshape(-1, H, 1, 1) * distance  # (B|1, H, T, S)


def _sink_logits(sinks: np.ndarray, row_max: np.ndarray, H: int) -> np.ndarray:
    """Each row's sink logit, (B, H, T, 1): sinks[h] in the rows of head h that have a key,
    and -inf (no sink) in a row with none, which stays exactly 0 whatever its sink holds."""
    has_key = row_max != -np.inf  # (B, H, T, 1); NaN != -inf: a NaN row has keys
    return np.where(has_key, sinks.reshape(1, H, 1, 1), -np.inf)  # (B, H, T, 1)


def _allowed(mask: np.ndarray | None, call: contract.Checked) -> np.ndarray:
    """Which keys each query may see, (B|1, H|1, T, S) bool: those that a bool mask, the
    causal triangle, the window and the chunk allow and a float mask does not set to -inf."""
    T, S, window, chunk = call.T, call.S, call.window, call.chunk_size
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if call.causal_alignment == "top_left" else S - T
    t = np.arange(T)[:, None]  # (T, 1)
    s = np.arange(S)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = np.ones((1, 1, T, S), dtype=bool)  # (1, 1, T, S)
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
        allowed = allowed & (mask != -np.inf)  # (B|1, H|1, T, S)
    return allowed


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
        self.k: np.ndarray | None = None  # (B, K, S, D)
        self.v: np.ndarray | None = None  # (B, K, S, E)

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, **options) -> np.ndarray:
        """Append k, v to the cache, then attend the new queries to everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = np.concatenate([self.k, k], axis=-2)  # (B, K, S, D)
            self.v = np.concatenate([self.v, v], axis=-2)  # (B, K, S, E)
        return attention(
            q,
            self.k,
            self.v,
            is_causal=True,
            causal_alignment="bottom_right",
            **options,
        )  # (B, H, T, E)


def attention_packed(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> np.ndarray:
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
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    call, cu_q, cu_k = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    H, T, E = call.H, call.T, call.E

    # 1. Each document alone: its queries against its own keys only, so nothing another
    # document holds (not even a NaN) is ever read (see Notes: packed documents).
    out = np.zeros((H, T, E), dtype=q.dtype)  # (H, T, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        out[:, t0:t1] = attention(q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], **options)  # (H, T_n, E)
    return out


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
    # 0. Validate with the input contract all impls share (contract.py): an error names the
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
    k_pages: np.ndarray, v_pages: np.ndarray, block_table: np.ndarray, call: contract.PagedChecked
) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's key s = j·L + i from slot i of page block_table[b, j]: (B, K, M·L, D)
    and (B, K, M·L, E). Table entries a sequence does not read may hold anything, -1 or
    N + 5 included: they are clamped into [0, N) first, so the gather never indexes out of
    range, and what they point at is masked away."""
    B, K, L, M, D, E = call.B, call.K, call.L, call.M, call.D, call.E
    if call.N == 0:  # no pages at all: every sequence is empty (the contract checked it)
        return np.zeros((B, K, M * L, D), k_pages.dtype), np.zeros((B, K, M * L, E), v_pages.dtype)
    pages = np.clip(block_table.astype(np.int64), 0, call.N - 1)  # (B, M)
    k = k_pages[pages]  # (B, M, K, L, D)
    v = v_pages[pages]  # (B, M, K, L, E)
    k = k.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, D)  # (B, K, S, D), S = M·L
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, E)  # (B, K, S, E)
    return k, v


def _paged_allowed(seq_lens: np.ndarray, call: contract.PagedChecked) -> np.ndarray:
    """Which gathered keys each query may see, (B, 1, T, S) bool: key s of sequence b if
    s < seq_lens[b], and causality and the window allow it from query t's diagonal t +
    seq_lens[b] - T (the queries are the sequence's last T positions)."""
    T, S, window = call.T, call.M * call.L, call.window
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


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """y = x Wᵀ + b with PyTorch's layout: weight (out, in), bias (out)."""
    return x @ weight.T + bias


def layer_norm(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5
) -> np.ndarray:
    """Normalise the last axis to zero mean and unit (biased) variance, then scale and shift."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, x · Φ(x), as ``nn.GELU()`` computes it (not the tanh approximation)."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return (x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype)


def multi_head_attention(
    params: dict[str, np.ndarray],
    x: np.ndarray,
    *,
    n_heads: int,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """The multi-head self-attention layer, as a function of its parameters.

    Args:
      params: "qkv.weight" (3C, C), "qkv.bias" (3C,), "out_proj.weight" (C, C),
        "out_proj.bias" (C,): the PyTorch module's ``state_dict``.
      x: (B, T, C).
      n_heads: H, which must divide C.
      mask, is_causal, dropout_p, rng: as for ``attention``, with S = T.

    Returns:
      (B, T, C)
    """
    x = np.asarray(x)
    B, T, C, H, D = contract.check_module_input(x, n_heads)

    # 1. Project to queries, keys and values with one fused matrix, then split them.
    qkv = linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
    q, k, v = np.split(qkv, 3, axis=-1)  # 3 × (B, T, C)

    # 2. Split the width into H heads of D channels: head h owns channels [h·D, (h+1)·D).
    q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    k = k.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    v = v.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)

    # 3. Attention in every head at once.
    context = attention(
        q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, rng=rng
    )  # (B, H, T, D)

    # 4. Merge the heads back into the width, head-major, then mix them.
    context = context.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
    return linear(context, params["out_proj.weight"], params["out_proj.bias"])


def gpt_block(params: dict[str, np.ndarray], x: np.ndarray, *, n_heads: int) -> np.ndarray:
    """One pre-LN decoder block: x + attn(norm1(x)), then + mlp(norm2(x)).

    Args:
      params: the ``state_dict`` of the PyTorch block: "norm1.*", "attn.*", "norm2.*",
        "mlp.0.*" (Linear C -> F), "mlp.2.*" (Linear F -> C).
      x: (B, T, C).
      n_heads: H, which must divide C.

    Returns:
      (B, T, C)
    """
    attn = {name[5:]: p for name, p in params.items() if name.startswith("attn.")}
    h = layer_norm(x, params["norm1.weight"], params["norm1.bias"])  # (B, T, C)
    x = x + multi_head_attention(attn, h, n_heads=n_heads, is_causal=True)  # (B, T, C)
    h = layer_norm(x, params["norm2.weight"], params["norm2.bias"])  # (B, T, C)
    h = gelu(linear(h, params["mlp.0.weight"], params["mlp.0.bias"]))  # (B, T, F)
    return x + linear(h, params["mlp.2.weight"], params["mlp.2.bias"])  # (B, T, C)


# --- Notes -----------------------------------------------------------------------------------
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
# Packed documents (attention_packed). Packing N documents into one array saves the padding
# a batch of unequal lengths would need; the price is that every query must be kept away
# from the other documents' keys. Here each document is sliced out and attended alone, the
# literal meaning of SPEC §18. A block-diagonal mask would compute the same weights, but the
# product P·V would still multiply a weight of 0 by every other document's values, and
# 0 · NaN = NaN: one document's NaN would reach the rest.
#
# NumPy's warnings (step 5). A row that reads +inf (a +inf float mask entry, a score that
# overflowed) or NaN has a row sum of inf or NaN, and its weights come out NaN: the answer
# SPEC §3.8 and §4.9 define for it. np.errstate silences NumPy's "invalid value" warning for
# that one division, and only there; every other step stays loud.
