"""Scaled dot-product attention in JAX: the NumPy reference's steps, line for line, compiled.

    out = softmax(scale · q kᵀ + mask) v

For one query row t of one head, with the scale 1/√D by default:

    score[s]  = scale · Σ_d q[t, d] · k[s, d]
    w[s]      = exp(score[s] - max_s score) / Σ_s exp(score[s] - max_s score)
    out[t, e] = Σ_s w[s] · v[s, e]

Why 1/√D: if q's and k's entries have unit variance, q·k sums D such products and has
variance D. Dividing by √D keeps the scores near unit variance at any head size, so the
softmax neither saturates (one-hot weights, vanishing gradients) nor flattens.

Shape legend (heads-first, as in PyTorch; ``jax.nn`` writes N for H and H for D and E):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores), broadcastable to
    (B, H, T, S). Unbatched q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

Supports what the NumPy page does, with a ``jax.random`` key for dropout, float64 after
``jax_enable_x64``, and ``jax.grad``. The Notes say why steps 1-7 alone are jitted, and why
``softcapped`` and ``softmax`` have JAX-only lines.

Imports: the standard library, JAX and the ``contract`` package. The rest, in this package: gradients
(``jax.vjp``), flash (blockwise), kv_cache, packed, paged, layers, ring and ulysses.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import contract


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
      q, k, v: (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B.
      mask: bool (True = may attend) or floating (added), broadcastable to (B, H, T, S).
      is_causal: query t attends only keys on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      causal_alignment: "top_left" (key s <= t) or "bottom_right" (s <= t + S - T, the
        last query sees the last key, as in a KV cache); also places windows and chunks.
      window: (left, right): keys within left before and right after the diagonal.
      softcap: scores become softcap · tanh(scores / softcap).
      dropout_p, key: drop each weight with probability dropout_p, drawn with key.
      sinks: (H,), one logit per query head that joins the softmax and has no value.
      chunk_size: attend only within the same chunk of chunk_size positions.
      alibi_slopes: (H,) or (B, H): add -slope · |t + S - T - s| to the scores.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; q's dtype.
    """
    # 0. Validate with the input contract every page shares: an error names the argument,
    # the expected shape and what was given.
    q, k, v, mask, sinks, alibi_slopes = as_arrays(q, k, v, mask, sinks, alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes, random=random_source(key),
    )  # fmt: skip
    static = dataclasses.replace(call, scale=None)  # steps 1-7 compiled (see Notes: jit)
    return compiled(q, k, v, mask, sinks, alibi_slopes, key, call.scale, call=static)


@functools.partial(jax.jit, static_argnames=("call",))
def compiled(q, k, v, mask, sinks, alibi_slopes, key, scale, *, call: contract.Checked):
    dtype = q.dtype
    q, k, v, mask = batched(q, k, v, mask, call)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)
    k, v = repeat_heads(k, call.G), repeat_heads(v, call.G)  # (B, H, S, D), (B, H, S, E)
    allowed = allowed_keys(mask, call)  # (B|1, H|1, T, S)
    k, v = unseen_slots_zeroed(k, v, allowed)  # (B, H, S, D), (B, H, S, E)

    # 1. Scores: every query against every key of its head.
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)

    # 2. Scale, so that the scores' spread does not grow with the head size D.
    scores = scores * jnp.asarray(scale, scores.dtype)  # (B, H, T, S)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    scores = softcapped(scores, call.softcap)  # (B, H, T, S)

    # 4. Mask: ALiBi's bias and a float mask are added; every key a query may not see
    # gets -inf.
    scores = add_alibi_bias(scores, alibi_slopes, call)  # (B, H, T, S)
    scores = add_float_mask(scores, mask, call)  # (B, H, T, S)
    scores = jnp.where(allowed, scores, -jnp.inf)  # (B, H, T, S)

    # 5. Softmax over the keys; a row with no key left gets weights of exactly 0.
    weights = softmax(scores, sinks)  # (B, H, T, S)

    # 6. Dropout: zero each weight with probability dropout_p, rescale the rest.
    weights = dropped_out(weights, call.dropout_p, key)  # (B, H, T, S)

    # 7. Weighted sum of the values.
    out = jnp.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    return as_given(out, dtype, call)  # (B, H, T, E), or (H, T, E) unbatched


# --- Step 0: the inputs ---------------------------------------------------------------------


def as_arrays(*xs):
    """The arrays as JAX arrays, None left as it is."""
    return tuple(None if x is None else jnp.asarray(x) for x in xs)


def random_source(key):
    """What the contract checks dropout's random source against: a jax.random key, typed
    (``jax.random.key``) or a legacy uint32 (2,) (``jax.random.PRNGKey``)."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    legacy = isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape == (2,)
    return ("key", key, (typed and key.ndim == 0) or legacy, "a jax.random key")


def batched(q, k, v, mask, call: contract.Checked):
    """q, k, v with a batch axis, in the working precision; the mask reshaped to broadcast
    against the (B, H, T, S) scores. Float16 and bfloat16 are computed in float32 and
    rounded once at the end (see Notes: working precision)."""
    work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
    return q.astype(work), k.astype(work), v.astype(work), mask


def repeat_heads(x: jax.Array, G: int) -> jax.Array:
    """Grouped-query attention: query head h uses key/value head h // G, so each key/value
    head is repeated for its G query heads (see Notes: grouped-query attention)."""
    return jnp.repeat(x, G, axis=1)  # (B, H, S, D|E)


def allowed_keys(mask: jax.Array | None, call: contract.Checked) -> jax.Array:
    """Which keys each query may see, (B|1, H|1, T, S) bool: those that a bool mask, the
    causal triangle, the window and the chunk allow and a float mask does not set to -inf."""
    T, S, window, chunk = call.T, call.S, call.window, call.chunk_size
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if call.causal_alignment == "top_left" else S - T
    t = jnp.arange(T)[:, None]  # (T, 1)
    s = jnp.arange(S)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = jnp.ones((1, 1, T, S), dtype=bool)  # (1, 1, T, S)
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
        allowed = allowed & (mask != -jnp.inf)  # (B|1, H|1, T, S)
    return allowed


def unseen_slots_zeroed(k: jax.Array, v: jax.Array, allowed: jax.Array):
    """k and v with every slot that no query of its head may see replaced by 0, so that
    whatever it holds (NaN, inf) has no effect (see Notes: blocked keys)."""
    used = allowed.any(axis=2)[..., None]  # (B|1, H|1, S, 1)
    return jnp.where(used, k, 0.0), jnp.where(used, v, 0.0)  # (B, H, S, D), (B, H, S, E)


# --- Steps 3 and 4: the variants of the scores ----------------------------------------------


def softcapped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's softcap, softcap · tanh(scores / softcap); a score far above the softcap
    overflows to ±inf in the division, whose tanh is exactly ±1. Where scores / softcap is
    subnormal the score is kept: XLA may flush it to 0 (see Notes: huge softcaps)."""
    if softcap is None:
        return scores
    ratio = scores / softcap  # (B, H, T, S)
    tiny = jnp.abs(ratio) < jnp.finfo(scores.dtype).tiny  # (B, H, T, S)
    return jnp.where(tiny, scores, softcap * jnp.tanh(ratio))  # (B, H, T, S)


def add_alibi_bias(scores: jax.Array, slopes: jax.Array | None, call: contract.Checked):
    """The scores plus ALiBi's bias −slope · |t + S − T − s|, so that a key weighs less the
    farther it lies from the query. The distance is from the bottom-right diagonal whatever
    the causal alignment: the last query sits at the last key (see Notes: ALiBi)."""
    if slopes is None:
        return scores
    T, S, H = call.T, call.S, call.H
    t = jnp.arange(T)[:, None]  # (T, 1)
    s = jnp.arange(S)[None, :]  # (1, S)
    distance = jnp.abs(t + S - T - s).astype(scores.dtype)  # (T, S)
    return scores - slopes.astype(scores.dtype).reshape(-1, H, 1, 1) * distance  # (B, H, T, S)


def add_float_mask(scores: jax.Array, mask: jax.Array | None, call: contract.Checked):
    """The scores plus a float mask; a bool mask (or none) adds nothing, it only blocks (in
    ``allowed_keys``)."""
    if mask is None or call.mask_is_bool:
        return scores
    return scores + mask.astype(scores.dtype)  # (B, H, T, S)


# --- Steps 5 and 6: the weights -------------------------------------------------------------


def softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """The softmax over the keys, less the row maximum so that exp() <= 1. A row with no key
    left has maximum -inf and gets weights of exactly 0 (see Notes: empty rows)."""
    if sinks is not None:
        return softmax_with_sinks(scores, sinks)
    row_max = scores.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, H, T, 1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    # Shifted once more by the largest difference itself, so that it is exactly 0 even where
    # XLA fuses step 2's multiply into the subtraction (see Notes: fused multiply-add).
    shifted = scores - row_max  # (B, H, T, S)
    shift = shifted.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, H, T, 1)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)  # (B, H, T, 1)
    p = jnp.exp(shifted - shift)  # (B, H, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    return p / _divisor(row_sum)  # (B, H, T, S)


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
    """The softmax with one sink logit per head: it joins the row maximum and the sum, but
    has no value row, so the keys' weights add up to less than 1 (see Notes: sinks)."""
    H = scores.shape[1]
    row_max = scores.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, H, T, 1)
    sink = sink_logits(sinks, row_max, H)  # (B, H, T, 1)
    row_max = jnp.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    shifted = scores - row_max  # (B, H, T, S)
    shift = jnp.maximum(shifted.max(axis=-1, keepdims=True, initial=-jnp.inf), sink - row_max)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)  # (B, H, T, 1)
    p = jnp.exp(shifted - shift)  # (B, H, T, S)
    row_sum = p.sum(axis=-1, keepdims=True) + jnp.exp(sink - row_max - shift)  # (B, H, T, 1)
    weights = p / _divisor(row_sum)  # (B, H, T, S)
    # A NaN or +inf sink makes its row NaN, as +inf - +inf does in the softmax (SPEC §15.4);
    # the shift by a finite row maximum above cannot show it, so it is selected.
    return jnp.where(jnp.isnan(sink) | (sink == jnp.inf), jnp.nan, weights)  # (B, H, T, S)


def _divisor(row_sum: jax.Array) -> jax.Array:
    """What divides a row: its sum, 1 for a row with no key (its weights stay 0), and NaN for
    a row that reads +inf, which is NaN whole, not only at its +inf scores (SPEC §4.1), so
    that its gradients reach every key it attends."""
    return jnp.where(row_sum == jnp.inf, jnp.nan, jnp.where(row_sum > 0, row_sum, 1.0))


def sink_logits(sinks: jax.Array, row_max: jax.Array, H: int) -> jax.Array:
    """Each row's sink logit, (B, H, T, 1): sinks[h] in the rows of head h that have a key,
    and -inf (no sink: exp(-inf) = 0) in a row with none, which stays exactly 0."""
    has_key = row_max != -jnp.inf  # (B, H, T, 1); NaN != -inf: a NaN row has keys
    logits = sinks.astype(row_max.dtype).reshape(1, H, 1, 1)  # (1, H, 1, 1)
    return jnp.where(has_key, logits, -jnp.inf)  # (B, H, T, 1)


def dropped_out(weights: jax.Array, dropout_p: float, key) -> jax.Array:
    """Zero each weight with probability dropout_p and rescale the survivors by
    1 / (1 - dropout_p), so that the expected output is unchanged."""
    if dropout_p == 0:
        return weights
    keep = jax.random.uniform(key, weights.shape) >= dropout_p  # (B, H, T, S)
    return weights * keep / (1.0 - dropout_p)  # (B, H, T, S)


# --- Step 7: the output ---------------------------------------------------------------------


def as_given(out: jax.Array, dtype, call: contract.Checked) -> jax.Array:
    """The output rounded once to the inputs' dtype, without the batch axis it was given
    for unbatched inputs."""
    out = out.astype(dtype)  # (B, H, T, E)
    return out[0] if call.unbatched else out  # (B, H, T, E) or (H, T, E)


# --- Notes ----------------------------------------------------------------------------------
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
# empty axis has no maximum of its own. Both guards are jnp.where on the value that would be
# bad (the "double where"): the branch not taken gets a zero cotangent, so jax.grad through
# a row with no key is 0, not NaN.
#
# Overflow (steps 2, 5). A score that overflows is ±inf, as SPEC §4.1 defines: +inf makes
# its row NaN (inf / inf), -inf gives weight 0. Those are the answers; XLA does not warn.
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
# Chunked local attention (step 0, ``allowed_keys``). Llama 4's chunks: query t sees key s only
# if both lie in the same chunk of chunk_size positions, (t + offset) // c == s // c, the
# offset placed by causal_alignment as for causality.
#
# Jit (JAX only). Steps 1-7 are one XLA program, compiled once per shape, dtype and option
# (``compiled``, its ``call`` static) and reused for every call like it. Step 0 stays in
# Python, outside it: the contract reads the options' values (0 or NaN for a scale is an
# error, a 0-d array is a number), which a traced argument does not have and a static one
# must be hashable for (np.array(2.0) is not). The scale then enters traced, not static,
# so that a new scale reuses the program.
#
# Fused multiply-add (step 5; JAX only). On a CPU or GPU with FMA, XLA may fuse step 2's
# multiply into step 5's subtraction, which skips the product's rounding, while the maximum
# was taken of rounded products: past scores of ~1e18 the two differ by more than exp() can
# take, and the row becomes inf / inf = NaN. Shifting once more by the maximum of the very
# differences exp() receives makes the largest exactly 0; without such fusion that second
# shift is 0 and changes nothing. Whether XLA fuses depends on the processor, so a machine
# without FMA passes either way: the test that catches it (SPEC §8.4, scale 1e30) needs one.
#
# Rows that read +inf (step 5; JAX only). A row with a +inf score has row sum +inf. The
# NumPy page divides by it as it is: that key's weight is inf / inf = NaN, the others
# finite / inf = 0, and the output row is NaN either way (SPEC §4.1). Under jax.grad those
# zeros would pass the row's other keys a gradient where the row has none to give, so the
# divisor is NaN for such a row: every weight of it, and every gradient through it, is NaN.
#
# Huge softcaps (step 3; JAX only). softcap · tanh(score / softcap) is the score itself, to
# far below rounding, once |score / softcap| < 2^-27 (float64; 2^-12 in float32). For a
# softcap near the largest float (1e308, or 1e38 in float32) the ratio falls below the
# smallest normal number, and XLA on a CPU flushes such subnormals to 0: every score became
# softcap · tanh(0) = 0, and the weights uniform (SPEC §4.2). There the score is kept as it
# is, the correctly rounded value of softcap · tanh(score / softcap); elsewhere nothing
# changes. The selection also gives jax.grad the exact derivative 1 there.
