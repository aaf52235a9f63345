"""Scaled dot-product attention in JAX: the NumPy reference's steps, line for line, plus
one guard against XLA's fused multiply-add (step 5; see Notes).

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

Shape legend (heads-first, as in PyTorch; ``jax.nn`` writes N for H and H for D, E):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       C model width (module only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores), broadcastable to
    (B, H, T, S). Unbatched q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).
    sinks (H,): one logit per query head.

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks, grouped-query and multi-query attention (K < H), dropout (with an
explicit ``jax.random`` key), float64 (after ``jax.config.update("jax_enable_x64", True)``
by the caller), float32, float16 and bfloat16, ``jax.grad``. A query row with no key left
to attend returns exactly 0, and its gradient is 0, not NaN.

Imports: the standard library, JAX and ``contract.py``, the input contract all impls
share (step 0, checked in Python); the math, ``_allowed`` included, is this file's own.
Steps 1-7 run under ``jax.jit`` in ``_attend``, with the options as static arguments. Also
here: a KV cache, packed variable-length sequences (``attention_packed``, SPEC §18, the
boundaries traced), the multi-head layer and pre-LN GPT block as functions of a
PyTorch-style ``state_dict``, and their gradients by ``jax.vjp``. Why each step is
written as it is: the Notes at the end of this file.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import contract


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    key: jax.Array | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
) -> jax.Array:
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
      dropout_p: probability of zeroing each attention weight (needs ``key``).
      key: the ``jax.random`` key that draws the dropout mask.
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
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask = None if mask is None else jnp.asarray(mask)
    sinks = None if sinks is None else jnp.asarray(sinks)
    alibi_slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes)
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
        random=("key", key, _is_key(key), "a jax.random key"),
        sinks=sinks,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
    out = _attend(
        q,
        k,
        v,
        mask,
        key if call.dropout_p > 0 else None,
        sinks,
        scale=call.scale,
        is_causal=call.is_causal,
        causal_alignment=call.causal_alignment,
        window=call.window,
        softcap=call.softcap,
        dropout_p=call.dropout_p,
        chunk_size=call.chunk_size,
        alibi_slopes=alibi_slopes,
    )  # (B, H, T, E)
    return out[0] if call.unbatched else out


@functools.partial(
    jax.jit,
    static_argnames=(
        "is_causal",
        "causal_alignment",
        "window",
        "softcap",
        "dropout_p",
        "chunk_size",
    ),
)
def _attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    key: jax.Array | None,
    sinks: jax.Array | None,
    *,
    scale: float,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    dropout_p: float,
    chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
) -> jax.Array:
    """Steps 1-7 on checked, batched inputs; compiled once per shape, dtype and options."""
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    G = H // K

    # Float16 and bfloat16 are computed in float32 and rounded once (see Notes).
    out_dtype = q.dtype
    work = jnp.float64 if out_dtype == jnp.float64 else jnp.float32
    q, k, v = q.astype(work), k.astype(work), v.astype(work)

    # Grouped-query attention: query head h uses key/value head h // G (see Notes).
    k = jnp.repeat(k, G, axis=1)  # (B, H, S, D)
    v = jnp.repeat(v, G, axis=1)  # (B, H, S, E)

    # Which keys each query may see; a key/value slot that no query sees is replaced by 0,
    # so that whatever it holds has no effect (see Notes: blocked keys).
    band = (is_causal, causal_alignment, window, chunk_size)
    allowed = _allowed(mask, T, S, *band)  # (B|1, H|1, T, S)
    used = allowed.any(axis=2)[..., None]  # (B|1, H|1, S, 1)
    k = jnp.where(used, k, 0.0)  # (B, H, S, D)
    v = jnp.where(used, v, 0.0)  # (B, H, S, E)

    # 1. Scores: every query against every key of its head.
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)

    # 2. Scale, so that the scores' spread does not grow with the head size D.
    scores = scores * jnp.asarray(scale, work)  # (B, H, T, S)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if softcap is not None:
        # Where score / softcap is subnormal, XLA may flush it to 0, and the score with it;
        # tanh(x) = x there far below rounding, so the score is kept (see Notes: huge softcaps).
        ratio = scores / softcap  # (B, H, T, S)
        capped = softcap * jnp.tanh(ratio)  # (B, H, T, S)
        scores = jnp.where(jnp.abs(ratio) < jnp.finfo(work).tiny, scores, capped)  # (B, H, T, S)

    # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query may
    # not see gets -inf.
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes.astype(work), T, S, H)  # (B, H, T, S)
    if mask is not None and mask.dtype != jnp.bool_:
        scores = scores + mask.astype(work)  # (B, H, T, S)
    scores = jnp.where(allowed, scores, -jnp.inf)  # (B, H, T, S)

    # 5. Softmax over the keys, less the row maximum so that exp() <= 1. A row with no key
    # left has maximum -inf and gets weights of exactly 0 (see Notes: empty rows).
    row_max = scores.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, H, T, 1)
    if sinks is not None:
        # A sink joins the maximum of every row that has a key (see Notes: sinks).
        sink = _sink_logits(sinks.astype(work), row_max, H)  # (B, H, T, 1)
        row_max = jnp.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    shifted = scores - row_max  # (B, H, T, S)
    # Shifted once more by the largest difference itself, so that it is exactly 0 even where
    # XLA fuses step 2's multiply into the subtraction (see Notes: fused multiply-add).
    shift = shifted.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, H, T, 1)
    if sinks is not None:
        shift = jnp.maximum(shift, sink - row_max)  # (B, H, T, 1)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)  # (B, H, T, 1)
    shifted = shifted - shift  # (B, H, T, S)
    p = jnp.exp(shifted)  # (B, H, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    if sinks is not None:
        # The sink takes its share of the sum, and has no value row to give anything back.
        row_sum = row_sum + jnp.exp(sink - row_max - shift)  # (B, H, T, 1)
    # A row that reads +inf has row sum +inf: every weight of it is NaN, not only those of
    # its +inf scores (SPEC §4.1), so that its gradients reach every key it attends.
    divisor = jnp.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, 1)
    divisor = jnp.where(row_sum == jnp.inf, jnp.nan, divisor)  # (B, H, T, 1)
    weights = p / divisor  # (B, H, T, S)
    if sinks is not None:
        # A NaN or +inf sink makes its row NaN, as +inf - +inf does in the softmax (SPEC
        # §15.4); the shift by a finite row maximum above cannot show it, so it is selected.
        bad = jnp.isnan(sink) | (sink == jnp.inf)  # (B, H, T, 1)
        weights = jnp.where(bad, jnp.nan, weights)  # (B, H, T, S)

    # 6. Dropout: zero each weight with probability dropout_p and rescale the survivors
    # by 1 / (1 - dropout_p), so the expected output is unchanged.
    if dropout_p > 0:
        keep = jax.random.uniform(key, (B, H, T, S)) >= dropout_p  # (B, H, T, S)
        weights = weights * keep / (1.0 - dropout_p)  # (B, H, T, S)

    # 7. Weighted sum of the values.
    out = jnp.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    out = out.astype(out_dtype)  # (B, H, T, E)
    return out


def _alibi_bias(slopes: jax.Array, T: int, S: int, H: int) -> jax.Array:
    """ALiBi's bias, (B|1, H, T, S): −slope · |t + S − T − s|, so that a key weighs less
    the farther it lies from the query. The distance is from the bottom-right diagonal
    whatever the causal alignment: the last query sits at the last key (see Notes: ALiBi)."""
    t = jnp.arange(T)[:, None]  # (T, 1)
    s = jnp.arange(S)[None, :]  # (1, S)
    distance = jnp.abs(t + S - T - s).astype(slopes.dtype)  # (T, S)
    return -slopes.reshape(-1, H, 1, 1) * distance  # (B|1, H, T, S)


def _sink_logits(sinks: jax.Array, row_max: jax.Array, H: int) -> jax.Array:
    """Each row's sink logit, (B, H, T, 1): sinks[h] in the rows of head h that have a key,
    and -inf (no sink) in a row with none, which stays exactly 0 whatever its sink holds."""
    has_key = row_max != -jnp.inf  # (B, H, T, 1); NaN != -inf: a NaN row has keys
    return jnp.where(has_key, sinks.reshape(1, H, 1, 1), -jnp.inf)  # (B, H, T, 1)


def _allowed(
    mask: jax.Array | None,
    T: int,
    S: int,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    chunk: int | None,
) -> jax.Array:
    """Which keys each query may see, (B|1, H|1, T, S) bool: those that a bool mask, the
    causal triangle, the window and the chunk allow and a float mask does not set to -inf."""
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if causal_alignment == "top_left" else S - T
    t = jnp.arange(T)[:, None]  # (T, 1)
    s = jnp.arange(S)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = jnp.ones((1, 1, T, S), dtype=bool)  # (1, 1, T, S)
    if is_causal:
        allowed = allowed & (distance <= 0)  # (1, 1, T, S)
    if window is not None and window[0] is not None:
        allowed = allowed & (distance >= -window[0])  # (1, 1, T, S)
    if window is not None and window[1] is not None:
        allowed = allowed & (distance <= window[1])  # (1, 1, T, S)
    if chunk is not None:
        # Same chunk only; floor division puts a negative position in a chunk of no key.
        allowed = allowed & ((t + offset) // chunk == s // chunk)  # (1, 1, T, S)
    if mask is not None and mask.dtype == jnp.bool_:
        allowed = allowed & mask  # (B|1, H|1, T, S)
    elif mask is not None:
        allowed = allowed & (mask != -jnp.inf)  # (B|1, H|1, T, S)
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
        self.k: jax.Array | None = None  # (B, K, S, D)
        self.v: jax.Array | None = None  # (B, K, S, E)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, **options) -> jax.Array:
        """Append k, v to the cache, then attend the new queries to everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = jnp.concatenate([self.k, k], axis=-2)  # (B, K, S, D)
            self.v = jnp.concatenate([self.v, v], axis=-2)  # (B, K, S, E)
        return attention(
            q,
            self.k,
            self.v,
            is_causal=True,
            causal_alignment="bottom_right",
            **options,
        )  # (B, H, T, E)


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
) -> jax.Array:
    """Attention over packed variable-length sequences (FlashAttention's varlen API).

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone: no query sees another document,
    and causality and windows are counted inside each document. The boundaries are traced
    under ``jax.jit``: one compiled program serves every packing of the same T, S and N.

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
    # 0. Validate with the input contract all impls share (contract.py), eagerly, so the
    # boundaries' values are checked before they become tracers.
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cu_seqlens_q, cu_seqlens_k = jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    call, _, _ = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    return _attend_packed(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        scale=call.scale,
        is_causal=call.is_causal,
        causal_alignment=call.causal_alignment,
        window=call.window,
        softcap=call.softcap,
    )  # (H, T, E)


@functools.partial(jax.jit, static_argnames=("is_causal", "causal_alignment", "window", "softcap"))
def _attend_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
) -> jax.Array:
    """Steps 1-7 of ``_attend``, once per document, on the packed inputs; the boundaries
    are traced, so the program depends on T, S and N only."""
    H, T, _ = q.shape
    S, E = v.shape[1], v.shape[2]
    N = cu_seqlens_q.shape[0] - 1

    # Each token's document and its position within it, from the boundaries: token t
    # lies in the last document n with cu_seqlens[n] <= t (empty documents are skipped).
    doc_q = jnp.searchsorted(cu_seqlens_q, jnp.arange(T), side="right") - 1  # (T,)
    doc_k = jnp.searchsorted(cu_seqlens_k, jnp.arange(S), side="right") - 1  # (S,)
    pos_q = jnp.arange(T) - cu_seqlens_q[doc_q]  # (T,)
    pos_k = jnp.arange(S) - cu_seqlens_k[doc_k]  # (S,)

    # Query t's diagonal is key t of its document (top-left), or key t + S_n - T_n
    # (bottom-right: the document's last query lines up with its last key).
    lengths_q = jnp.diff(cu_seqlens_q)[doc_q]  # (T,)
    lengths_k = jnp.diff(cu_seqlens_k)[doc_q]  # (T,): the keys of query t's document
    offset = 0 if causal_alignment == "top_left" else lengths_k - lengths_q  # (T,)
    distance = pos_k[None, :] - (pos_q + offset)[:, None]  # (T, S)
    allowed = doc_q[:, None] == doc_k[None, :]  # (T, S)
    if is_causal:
        allowed = allowed & (distance <= 0)  # (T, S)
    if window is not None and window[0] is not None:
        allowed = allowed & (distance >= -window[0])  # (T, S)
    if window is not None and window[1] is not None:
        allowed = allowed & (distance <= window[1])  # (T, S)

    # 1.-7. Each document alone (see Notes: packed documents): its queries, keys and values
    # selected, every other token replaced by 0, so that nothing another document holds
    # (not even a NaN) reaches its rows or its gradients; its rows kept.
    def document(n, out):
        rows, keys = doc_q == n, doc_k == n  # (T,), (S,)
        q_n = jnp.where(rows[None, :, None], q, 0.0)  # (H, T, D)
        k_n = jnp.where(keys[None, :, None], k, 0.0)  # (K, S, D)
        v_n = jnp.where(keys[None, :, None], v, 0.0)  # (K, S, E)
        mask_n = (allowed & rows[:, None])[None, None]  # (1, 1, T, S)
        out_n = _attend(
            q_n[None],
            k_n[None],
            v_n[None],
            mask_n,
            None,
            None,
            scale=scale,
            is_causal=False,
            causal_alignment="top_left",
            window=None,
            softcap=softcap,
            dropout_p=0.0,
        )[0]  # (H, T, E)
        return jnp.where(rows[None, :, None], out_n, out)  # (H, T, E)

    out = jnp.zeros((H, T, E), dtype=q.dtype)  # (H, T, E)
    return jax.lax.fori_loop(0, N, document, out)  # (H, T, E)


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
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``attention_packed`` by ``jax.vjp``: (dq, dk, dv) shaped like q, k, v,
    for the loss L = Σ d_out · attention_packed(...), d_out (H, T, E) in q's dtype. The
    boundaries are integers, traced and not differentiated."""
    q, k, v, d_out = (jnp.asarray(x) for x in (q, k, v, d_out))
    cu_seqlens_q, cu_seqlens_k = jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    call, _, _ = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out=d_out, **options)
    return _attend_packed_vjp(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        d_out,
        scale=call.scale,
        is_causal=call.is_causal,
        causal_alignment=call.causal_alignment,
        window=call.window,
        softcap=call.softcap,
    )


@functools.partial(jax.jit, static_argnames=("is_causal", "causal_alignment", "window", "softcap"))
def _attend_packed_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
    """jax.vjp of ``_attend_packed`` in q, k and v, compiled once per shape and options."""

    def forward(q, k, v):
        return _attend_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

    _, pullback = jax.vjp(forward, q, k, v)
    return pullback(d_out)


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
    # argument, what was expected and what was given. Eagerly, on the table's values; the
    # table and the lengths are then traced, not static, so one compiled program serves
    # every table of the same shapes.
    q, k_pages, v_pages = jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages)
    block_table, seq_lens = jnp.asarray(block_table), jnp.asarray(seq_lens)
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
    return _attend_paged(
        q,
        k_pages,
        v_pages,
        block_table,
        seq_lens,
        scale=call.scale,
        is_causal=call.is_causal,
        window=call.window,
        softcap=call.softcap,
    )  # (B, H, T, E)


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "softcap"))
def _attend_paged(
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
    k, v = _gather_pages(k_pages, v_pages, block_table)  # (B, K, S, D), (B, K, S, E)

    # 2. Which keys each query may see: its sequence's first seq_lens[b] keys, and the
    # causal triangle and the window from the bottom-right diagonal of that length.
    T, S = q.shape[2], k.shape[2]
    allowed = _paged_allowed(seq_lens, T, S, is_causal, window)  # (B, 1, T, S)

    # 3. Attention on the gathered keys under that mask. A slot no query may see (past a
    # sequence's length, or read through a clamped table entry) is replaced by 0 there
    # before it is used, so whatever it holds, NaN included, changes nothing.
    band = {"is_causal": False, "causal_alignment": "top_left", "window": None}
    return _attend(
        q, k, v, allowed, None, None, scale=scale, softcap=softcap, dropout_p=0.0, **band
    )  # (B, H, T, E)


def _gather_pages(
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
        return jnp.zeros((B, K, M * L, D), k_pages.dtype), jnp.zeros(
            (B, K, M * L, E), v_pages.dtype
        )
    pages = jnp.clip(block_table, 0, N - 1)  # (B, M)
    k = k_pages[pages]  # (B, M, K, L, D)
    v = v_pages[pages]  # (B, M, K, L, E)
    k = k.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, D)  # (B, K, S, D), S = M·L
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, K, M * L, E)  # (B, K, S, E)
    return k, v


def _paged_allowed(
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
    """Gradients of ``attention_paged`` by ``jax.vjp``: (dq, dk_pages, dv_pages). The
    gather's transpose is a scatter-add, so a page two sequences share collects both
    gradients, and a slot no sequence reads gets exactly 0.

    Args:
      q, k_pages, v_pages, block_table, seq_lens, is_causal, scale, window, softcap: as
        for ``attention_paged``.
      d_out: ∂L/∂out, (B, H, T, E), in q's dtype.
    """
    # 0. Validate as the forward does (eagerly), and d_out against the output's shape.
    q, k_pages, v_pages, d_out = (jnp.asarray(x) for x in (q, k_pages, v_pages, d_out))
    block_table, seq_lens = jnp.asarray(block_table), jnp.asarray(seq_lens)
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
    return _attend_paged_vjp(
        q,
        k_pages,
        v_pages,
        block_table,
        seq_lens,
        d_out,
        scale=call.scale,
        is_causal=call.is_causal,
        window=call.window,
        softcap=call.softcap,
    )


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "softcap"))
def _attend_paged_vjp(q, k_pages, v_pages, block_table, seq_lens, d_out, **options):
    """jax.vjp of steps 1-3 with respect to q and the pages (the table and the lengths are
    integers, traced but not differentiated), compiled once per shape and options."""

    def forward(q, k_pages, v_pages):
        return _attend_paged(q, k_pages, v_pages, block_table, seq_lens, **options)

    _, pullback = jax.vjp(forward, q, k_pages, v_pages)
    return pullback(d_out)


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """y = x Wᵀ + b with PyTorch's layout: weight (out, in), bias (out)."""
    return x @ weight.T + bias


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """Normalise the last axis to zero mean and unit (biased) variance, then scale and shift."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * weight + bias


def gelu(x: jax.Array) -> jax.Array:
    """The exact GELU, x · Φ(x), as ``nn.GELU()`` computes it (not the tanh approximation)."""
    erf = jax.lax.erf
    return (x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype)


# Under jit the layer is one compiled program per shape, not a dozen small ones.
@functools.partial(jax.jit, static_argnames=("n_heads", "is_causal", "dropout_p"))
def multi_head_attention(
    params: dict[str, jax.Array],
    x: jax.Array,
    *,
    n_heads: int,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    key: jax.Array | None = None,
) -> jax.Array:
    """The multi-head self-attention layer, as a function of its parameters.

    Args:
      params: "qkv.weight" (3C, C), "qkv.bias" (3C,), "out_proj.weight" (C, C),
        "out_proj.bias" (C,): the PyTorch module's ``state_dict``.
      x: (B, T, C).
      n_heads: H, which must divide C.
      mask, is_causal, dropout_p, key: as for ``attention``, with S = T.

    Returns:
      (B, T, C)
    """
    x = jnp.asarray(x)
    B, T, C, H, D = contract.check_module_input(x, n_heads)

    # 1. Project to queries, keys and values with one fused matrix, then split them.
    qkv = linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # 3 × (B, T, C)

    # 2. Split the width into H heads of D channels: head h owns channels [h·D, (h+1)·D).
    q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    k = k.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    v = v.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)

    # 3. Attention in every head at once.
    context = attention(
        q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, key=key
    )  # (B, H, T, D)

    # 4. Merge the heads back into the width, head-major, then mix them.
    context = context.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
    return linear(context, params["out_proj.weight"], params["out_proj.bias"])


@functools.partial(jax.jit, static_argnames=("n_heads",))
def gpt_block(params: dict[str, jax.Array], x: jax.Array, *, n_heads: int) -> jax.Array:
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


def attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    d_out: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Gradients of ``attention`` by ``jax.vjp``: JAX differentiates the jitted steps 1-7.

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes: as for ``attention`` (no dropout: its gradient needs
        the forward's random draw).
      d_out: ∂L/∂out, shaped like the output, (B, H, T, E) or (H, T, E), in q's dtype.

    Returns:
      (dq, dk, dv) shaped like q, k, v, for the loss L = Σ d_out · attention(q, k, v, ...);
      with a floating mask, (dq, dk, dv, dmask), dmask shaped like the mask (JAX's
      transpose of the broadcast sums the axes it was broadcast along). A bool mask has
      no gradient. With sinks, dsinks (H,) comes last.
    """
    # 0. Validate as the forward does (eagerly, so errors are ours, not a tracer's), and
    # d_out against the output's shape.
    q, k, v, d_out = (jnp.asarray(x) for x in (q, k, v, d_out))
    mask = None if mask is None else jnp.asarray(mask)
    sinks = None if sinks is None else jnp.asarray(sinks)
    alibi_slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes)
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
        unsupported={"dropout_p": "the backward pass would need the forward's random draw"},
        d_out=d_out,
        sinks=sinks,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    return _attend_vjp(
        q,
        k,
        v,
        mask,
        sinks,
        d_out,
        mask_shape=call.mask_shape,
        unbatched=call.unbatched,
        scale=call.scale,
        is_causal=call.is_causal,
        causal_alignment=call.causal_alignment,
        window=call.window,
        softcap=call.softcap,
        chunk_size=call.chunk_size,
        alibi_slopes=alibi_slopes,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "mask_shape",
        "unbatched",
        "is_causal",
        "causal_alignment",
        "window",
        "softcap",
        "chunk_size",
    ),
)
def _attend_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array | None,
    d_out: jax.Array,
    *,
    mask_shape: tuple[int, int, int, int] | None,
    unbatched: bool,
    **options,
) -> tuple[jax.Array, ...]:
    """jax.vjp of the mask's reshape and steps 1-7, compiled once per shape and options;
    the sinks, when given, are differentiated last; ALiBi's slopes, in ``options``, are
    traced but not differentiated."""

    def forward(q, k, v, mask, sinks):
        if unbatched:
            q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
        if mask is not None:
            mask = mask.reshape(mask_shape)  # (B|1, H|1, T|1, S|1)
        out = _attend(q, k, v, mask, None, sinks, dropout_p=0.0, **options)  # (B, H, T, E)
        return out[0] if unbatched else out

    float_mask = mask is not None and mask.dtype != jnp.bool_
    primals = [q, k, v] + ([mask] if float_mask else []) + ([sinks] if sinks is not None else [])

    def differentiated(q, k, v, *rest):
        rest = list(rest)
        given_sinks = rest.pop() if sinks is not None else None
        given_mask = rest.pop() if float_mask else mask
        return forward(q, k, v, given_mask, given_sinks)

    _, pullback = jax.vjp(differentiated, *primals)
    return pullback(d_out)


@functools.partial(jax.jit, static_argnames=("kind", "n_heads", "is_causal"))
def module_vjp(
    params: dict[str, jax.Array],
    x: jax.Array,
    d_out: jax.Array,
    *,
    kind: str,
    n_heads: int,
    is_causal: bool = False,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """Gradients of L = Σ d_out · module(x) by ``jax.vjp``: ({parameter: gradient}, dx).

    ``kind`` is "mha" (``multi_head_attention`` with ``is_causal``) or "gpt_block".
    """

    def module(params, x):
        if kind == "mha":
            return multi_head_attention(params, x, n_heads=n_heads, is_causal=is_causal)
        return gpt_block(params, x, n_heads=n_heads)

    _, pullback = jax.vjp(module, params, x)
    return pullback(d_out)


def _is_key(key: object) -> bool:
    # A typed key from jax.random.key, or a legacy uint32 (2,) from jax.random.PRNGKey.
    if not isinstance(key, jax.Array):
        return False
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.ndim == 0
    return key.dtype == jnp.uint32 and key.shape == (2,)


# --- Notes -----------------------------------------------------------------------------------
#
# Packed documents (attention_packed). Packing N documents into one array saves the padding
# a batch of unequal lengths would need; the price is that every query must be kept away
# from the other documents' keys. Under jax.jit the boundaries are traced, so documents
# cannot be sliced out by their lengths; each token's document comes from the boundaries
# (searchsorted), and steps 1-7 run once per document (a fori_loop over the N
# documents) on that document's tokens selected by `where`, every other token 0. A
# block-diagonal mask alone would compute the same weights, but the product P·V would
# still multiply a weight of 0 by every other document's values, and 0 · NaN = NaN: one
# document's NaN would reach the rest (and through dS·K and dSᵀ·Q, their gradients).
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
# Fused multiply-add (step 5). On a CPU or GPU with FMA, XLA may fuse step 2's multiply into
# step 5's subtraction, which skips the product's rounding, while the maximum was taken of
# rounded products: past scores of ~1e18 the two differ by more than exp() can take, and the
# row becomes inf / inf = NaN. Shifting once more by the maximum of the very differences
# exp() receives makes the largest exactly 0; without such fusion that second shift is 0 and
# changes nothing. Whether XLA fuses depends on the processor, so a machine without FMA
# passes either way: the test that catches it (SPEC §8.4, scale 1e30) needs one that has it.

# Huge softcaps (step 3). softcap · tanh(score / softcap) is the score itself, to far below
# rounding, once |score / softcap| < 2^-27 (float64; 2^-12 in float32): tanh(x) = x − x³/3 + …
# But for a softcap near the largest float (1e308, or 1e38 in float32) the ratio falls below
# the smallest normal number, and XLA on a CPU flushes such subnormals to 0: every score
# became softcap · tanh(0) = 0, and the weights uniform (SPEC §4.2). Where the ratio is below
# that smallest normal number the score is therefore kept as it is, the correctly rounded
# value of softcap · tanh(score / softcap) there; elsewhere nothing changes. The selection
# also gives jax.grad the exact derivative 1 there, which 1 − tanh²(ratio) rounds to anyway.

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
# Gradients through empty rows (step 5). Both guards of step 5 are jnp.where on the value
# that would be bad (the "double where"): the branch not taken gets a zero cotangent, so
# jax.grad through a row with no key is 0, not NaN.
#
# Jit. A bool and a float mask differ in dtype, which jax.jit traces separately, so the
# mask branches are ordinary Python ifs. The scale is a traced value, not a static one: a
# new scale reuses the compiled program.
