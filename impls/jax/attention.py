"""Scaled dot-product attention in JAX: the textbook formula first, then every option.

    out = softmax(mask(softcap(scale · q kᵀ))) v        scale = 1/√D unless given

For one query row t of one head: score[s] = scale · Σ_d q[t, d] · k[s, d], then
w[s] = exp(score[s] - max score) / Σ exp(score - max score), then out[t] = Σ_s w[s] · v[s].

Why 1/√D: if q's and k's entries are independent with mean 0 and variance 1, q·k sums D
such products and has variance D; divided by √D, the scores keep variance 1 at any D, so
the softmax neither saturates (one-hot weights, vanishing gradients) nor flattens.

Shapes, heads-first as in PyTorch: B batch, H query heads, K key/value heads (H % K == 0),
G = H // K, T query length, S key/value length, D q/k head dim, E v head dim; "B|1" is an
axis of size B or 1 (it broadcasts). q (B, H, T, D), k (B, K, S, D), v (B, K, S, E) give
out (B, H, T, E); without B (unbatched) q (H, T, D) gives out (H, T, E).
jax.nn.dot_product_attention is sequence-first, (B, T, N, H): N for H, H for D and E.

Read from the top: ``textbook_attention`` is the formula as every course writes it, causal
triangle included (a row with no key is NaN there, 0 in ``attention``); ``attention`` runs
the same lines with every option as one named step (masks, causality, windows, chunks,
ALiBi, softcap, sinks, grouped heads, dropout, float16 and bfloat16), its helpers below it,
then Notes. The guards that floating point's edges need (a row with no key, NaN in a slot
no query sees, overflow) come last, under "Edge cases". The JAX and PyTorch pages mirror
the NumPy page, the reference, line for line. The package's
other pages: gradients, flash, layers, kv_cache, packed, paged, ring and ulysses.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from .. import contract


def textbook_attention(q, k, v, mask=None, is_causal=False, scale=None):
    """Attention as every course writes it, whole on one screen: q (B, H, T, D), k and v
    (B, H, S, D|E) give out (B, H, T, E); a bool mask (True = may attend) broadcasts to
    (B, H, T, S); is_causal lets query t see keys s <= t (the lower triangle).

    Unlike ``attention``, a row with every key masked is NaN, the formula's exp(-inf + inf);
    ``attention`` gives it 0 (a query with nothing to see takes nothing, as PyTorch's SDPA
    and FlashAttention do, and its gradients stay finite: see "Edge cases")."""
    T, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) * scale  # (B, H, T, S)
    if is_causal:
        causal = jnp.tril(jnp.ones((T, S), dtype=bool))  # (T, S): s <= t
        scores = jnp.where(causal, scores, -jnp.inf)  # (B, H, T, S): the future weighs 0
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)  # (B, H, T, S): a blocked key weighs 0
    p = jnp.exp(scores - scores.max(axis=-1, keepdims=True))  # (B, H, T, S): exp() <= 1
    weights = p / p.sum(axis=-1, keepdims=True)  # (B, H, T, S)
    return jnp.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)


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
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention with every option: ``textbook_attention``'s lines as
    steps 1, 2, 4, 5 and 7, each option a step of its own between them.

    Args, the inputs and the core options:
      q, k, v: (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B.
      mask: bool (True = may attend) or floating (added), broadcastable to (B, H, T, S).
      is_causal: query t attends only keys on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      dropout_p, key: drop each weight with probability dropout_p, drawn from key.

    Args, the variants (each off by default):
      causal_alignment: "top_left" (key s <= t) or "bottom_right" (s <= t + S - T, the
        last query sees the last key, as in a KV cache); also places windows and chunks.
      window: (left, right): keys within left before and right after the diagonal.
      chunk_size: attend only within the same chunk of chunk_size positions.
      alibi_slopes: (H,) or (B, H): add -slope · |t + S - T - s| to the scores.
      softcap: scores become softcap · tanh(scores / softcap).
      sinks: (H,), one logit per query head that joins the softmax and has no value.

    Args, what it returns:
      return_lse: return each row's log-sum-exp beside the output (step 8).

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; q's dtype.
      lse: with return_lse, (B, H, T), or (H, T) unbatched; in the working precision.
    """
    # 0. Check the inputs: an error names the argument, the expected shape and what was
    # given. ``call`` holds the checked options and the sizes (call.T, call.G, ...).
    q, k, v, mask, sinks, alibi_slopes = as_arrays(q, k, v, mask, sinks, alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes, random=random_source(key),
        flags={"return_lse": return_lse},
    )  # fmt: skip
    static = dataclasses.replace(call, scale=None)  # the rest compiled (see Notes: jit)
    arrays = (q, k, v, mask, sinks, alibi_slopes, key, call.scale)
    return compiled(*arrays, call=static, return_lse=return_lse)


@functools.partial(jax.jit, static_argnames=("call", "return_lse"))
def compiled(
    q, k, v, mask, sinks, alibi_slopes, key, scale, *, call: contract.Checked, return_lse=False
):
    # Prepare the batch axis: unbatched inputs get one, and the mask takes the scores' rank.
    dtype = q.dtype
    q, k, v, mask = batched(q, k, v, mask, call)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)

    # Prepare the heads: with K < H, each key/value head serves G query heads, so it is
    # repeated G times in place, as torch's repeat_interleave does (not tiled).
    k, v = repeat_heads(k, call.G), repeat_heads(v, call.G)  # (B, H, S, D), (B, H, S, E)

    # Prepare the visibility: which keys each query may see (causality, window, chunk, mask).
    allowed = allowed_keys(mask, call)  # (B|1, H|1, T, S)
    k, v = unseen_slots_zeroed(k, v, allowed)  # (B, H, S, D), (B, H, S, E); Edge cases

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
    if return_lse:
        # 8. The log-sum-exp of each row's scores, what merges results over parts of the keys.
        return as_given(out, dtype, call), log_sum_exp(scores, sinks, call)
    return as_given(out, dtype, call)  # (B, H, T, E), or (H, T, E) unbatched


#: The name the seed tutorials give this function, for a reader who comes from them.
scaled_dot_product_attention = attention


# --- Step 0 and the preparation: the inputs -------------------------------------------------


def as_arrays(*xs):
    """The arrays in the framework's own type, None left as it is."""
    return tuple(None if x is None else jnp.asarray(x) for x in xs)


def random_source(key):
    """What the contract checks dropout's random source against (see the Args): a typed key
    (``jax.random.key``) or a legacy uint32 (2,) one (``jax.random.PRNGKey``)."""
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
    head is repeated for its G query heads, as torch's repeat_interleave does, not tiled
    (see Notes: grouped-query attention)."""
    return jnp.repeat(x, G, axis=1)  # (B, H, S, D|E)


def allowed_keys(mask: jax.Array | None, call: contract.Checked) -> jax.Array:
    """Which keys each query may see, (B|1, H|1, T, S) bool: those that a bool mask, the
    causal triangle, the window and the chunk allow and a float mask does not set to -inf."""
    T, S = call.T, call.S
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if call.causal_alignment == "top_left" else S - T
    t = jnp.arange(T)[:, None] + offset  # (T, 1): each query's diagonal
    s = jnp.arange(S)[None, :]  # (1, S)
    allowed = jnp.ones((1, 1, T, S), dtype=bool)  # (1, 1, T, S)
    allowed = visible(allowed, t, s, call.is_causal, call.window, call.chunk_size)  # (1, 1, T, S)
    if mask is not None and call.mask_is_bool:
        allowed = allowed & mask  # (B|1, H|1, T, S)
    elif mask is not None:
        allowed = allowed & (mask != -jnp.inf)  # (B|1, H|1, T, S)
    return allowed


def visible(
    allowed: jax.Array,
    t: jax.Array,
    s: jax.Array,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    chunk_size: int | None,
) -> jax.Array:
    """``allowed`` (..., T, S) narrowed to the keys each query may see by position: t (T, 1)
    holds each query's diagonal, s (1, S) the keys' positions. The package's one spelling
    of the causal triangle, the window and the chunks: the pages that walk the keys tile
    by tile or chunk by chunk ask it for each one's positions."""
    if is_causal:
        # The causal triangle: no key right of the diagonal, none from the future.
        allowed = allowed & (s <= t)  # (..., T, S)
    left, right = window if window is not None else (None, None)
    if left is not None:
        allowed = allowed & (s >= t - left)  # (..., T, S)
    if right is not None:
        allowed = allowed & (s <= t + right)  # (..., T, S)
    if chunk_size is not None:
        # Same chunk only; floor division puts a negative position in a chunk of no key.
        allowed = allowed & (t // chunk_size == s // chunk_size)  # (..., T, S)
    return allowed


# --- Steps 3 and 4: the variants of the scores ----------------------------------------------


def softcapped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's softcap, softcap · tanh(scores / softcap)."""
    if softcap is None:
        return scores
    return _subnormal_ratio_kept(scores, softcap)  # (B, H, T, S); Edge cases


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


def softmax(scores: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """The softmax over the keys, exp(score - row max) / Σ exp(score - row max): taking the
    row maximum off first keeps every exp() <= 1, so that no score overflows."""
    if sinks is not None:
        return softmax_with_sinks(scores, sinks)
    shifted = scores - finite_or_0(row_max(scores))  # (B, H, T, S)
    p = jnp.exp(shifted - finite_or_0(row_max(shifted)))  # (B, H, T, S); Edge cases: FMA
    return p / divisor(p.sum(axis=-1, keepdims=True))  # (B, H, T, S)


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array) -> jax.Array:
    """The softmax with one sink logit per head: it joins the row maximum and the sum, but
    has no value row, so the keys' weights add up to less than 1 (see Notes: sinks)."""
    H = scores.shape[1]
    highest = row_max(scores)  # (B, H, T, 1)
    sink = sink_logits(sinks, highest, H)  # (B, H, T, 1)
    highest = finite_or_0(jnp.maximum(highest, sink))  # (B, H, T, 1)
    shifted = scores - highest  # (B, H, T, S)
    shift = finite_or_0(jnp.maximum(row_max(shifted), sink - highest))  # Edge cases: FMA
    p = jnp.exp(shifted - shift)  # (B, H, T, S)
    weights = p / divisor(p.sum(axis=-1, keepdims=True) + jnp.exp(sink - highest - shift))
    return nan_where_sink_is(weights, sink)  # (B, H, T, S); Edge cases


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


def as_given(out: jax.Array, dtype: jnp.dtype, call: contract.Checked) -> jax.Array:
    """The output rounded once to the inputs' dtype, without the batch axis it was given
    for unbatched inputs."""
    out = out.astype(dtype)  # (B, H, T, E)
    return out[0] if call.unbatched else out  # (B, H, T, E) or (H, T, E)


# --- Step 8: the log-sum-exp ---------------------------------------------------------------


def log_sum_exp(scores: jax.Array, sinks: jax.Array | None, call: contract.Checked):
    """Each row's log Σ_s exp(score[s]), (B, H, T): the log of the softmax's denominator, so
    that weight[s] = exp(score[s] - lse), the sink's term included (see Notes: the
    log-sum-exp). Taken as the row maximum plus the log of the shifted sum, so that no
    exp() overflows; in the working precision, not rounded to q's dtype."""
    highest = row_max(scores)  # (B, H, T, 1)
    if sinks is not None:
        sink = sink_logits(sinks, highest, call.H)  # (B, H, T, 1)
        highest = jnp.maximum(highest, sink)  # (B, H, T, 1)
    shift = lse_shift(highest)  # (B, H, T, 1); Edge cases
    total = jnp.exp(scores - shift).sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    if sinks is not None:
        total = total + jnp.exp(sink - shift)  # (B, H, T, 1)
    lse = (shift + jnp.log(total))[..., 0]  # (B, H, T)
    return lse[0] if call.unbatched else lse  # (B, H, T) or (H, T)


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
# Sinks (step 5). An attention sink (gpt-oss; StreamingLLM's sink tokens in masking form) is
# one more logit per query head in every row's softmax, with no value row: its weight goes
# "nowhere", so a head can attend to nothing in particular. It joins the row maximum, so
# exp() stays <= 1 even for a sink of 1e4, and the sum, not the numerator: the keys' weights
# then add up to 1 - p_sink. It is not scaled, softcapped, masked or dropped.
#
# ALiBi (step 4). Press et al.'s attention with linear biases replaces position embeddings
# by a penalty −slope · distance on every score, one slope per query head (the usual slopes
# are 2^(-8 (h + 1) / H)). The distance is |t + S − T − s|, from the bottom-right diagonal,
# as FlashAttention's alibi_slopes define it: with a KV cache the T queries are the last T
# of the S positions, so that is where each query really sits. It is computed in the
# working precision and added like a float mask, after the softcap; the slopes are
# constants, with no gradient.
#
# Chunked local attention (the visibility). Llama 4's chunks: query t sees key s only if
# both lie in the same chunk of chunk_size positions, (t + offset) // c == s // c, the
# offset placed by causal_alignment as for causality.
#
# The log-sum-exp (step 8). lse = log Σ_s exp(score[s]) over the keys a row attends, natural
# log, with the sink's term where there are sinks. The weights are exp(score - lse), so a
# result over one part of the keys, out_a with lse_a, and one over the rest, out_b with
# lse_b, make the whole: lse = log(exp(lse_a) + exp(lse_b)), and out is out_a and out_b
# weighted by exp(lse_a - lse) and exp(lse_b - lse). That is how split-KV decoding and ring
# attention put pieces together, and what the backward pass needs of the forward. A row
# with no key has lse = log 0 = -inf: it weighs nothing in such a merge.
#
# Framework spelling. The NumPy, JAX and PyTorch pages are the same lines, and differ only
# where a framework asks it: JAX compiles the steps (its Notes: jit) and draws dropout with a
# jax.random key; PyTorch makes its tensors on q's device, can return the weights, and draws
# dropout as SDPA's math backend does (with no generator given, after torch.manual_seed(s)
# the same positions are dropped as in SDPA); NumPy silences its overflow warnings; a row
# that reads +inf and each framework's own guards are under Edge cases. The list of these
# differences is held by tests/test_pages.py.
#
# Jit (JAX only). The preparation and steps 1-7 are one XLA program, ``compiled`` once per
# shape, dtype and option. Step 0 reads the options' values, which a traced argument has
# not, so it stays in Python; the scale enters traced, so a new scale reuses the program.


# --- Edge cases -----------------------------------------------------------------------------
#
# What the lesson above leaves out: the guards that the spec's edges need, each with why
# and the SPEC clause it meets. A reader who stops above has learnt attention.
#
# Overflow (SPEC §4.1, §3.8). A score that overflows is ±inf: +inf makes its row NaN
# (inf / inf), -inf gives weight 0. Those are the answers, not errors: JAX and PyTorch do
# not warn, and NumPy's warnings are silenced for the NumPy page's ``attention``.
#
# Blocked keys (SPEC §3.8, §4.7). Blocked scores are replaced by -inf in step 4, not only
# pushed down by adding -inf, since NaN + -inf is NaN.
#
# Gradients through the guards (JAX's and PyTorch's autograd; NumPy's backward is its own
# page). Every guard below is a where on the value that would be bad: the branch not taken
# gets a zero gradient, so a row with no key has gradients 0, not NaN (SPEC §12.4).
#
# Fused multiply-add (JAX only; SPEC §4.1). XLA may fuse step 2's multiply into step 5's
# subtraction, unrounded, where the maximum saw it rounded: past scores of ~1e18 a row was
# NaN. The softmax's second shift, by the largest difference itself, makes that one 0.


def unseen_slots_zeroed(k: jax.Array, v: jax.Array, allowed: jax.Array):
    """NaN in a slot no query sees (SPEC §4.7): k and v with every slot that no query of its
    head may see (padding, a KV-cache slot not yet written) replaced by 0, by selection, so
    that whatever it holds has no effect: a weight of 0 does not cancel it, 0 · NaN is NaN."""
    used = allowed.any(axis=2)[..., None]  # (B|1, H|1, S, 1)
    return jnp.where(used, k, 0.0), jnp.where(used, v, 0.0)  # (B, H, S, D), (B, H, S, E)


def row_max(scores: jax.Array) -> jax.Array:
    """Each row's maximum, (B, H, T, 1), and -inf for a row of no key at all (S = 0), where
    the frameworks' maximum refuses an empty axis (SPEC §4.3)."""
    if scores.shape[-1] == 0:
        return jnp.full((*scores.shape[:-1], 1), -jnp.inf, dtype=scores.dtype)  # (B, H, T, 1)
    return scores.max(axis=-1, keepdims=True)  # (B, H, T, 1)


def finite_or_0(row_max: jax.Array) -> jax.Array:
    """Rows with no key (SPEC §4.3): the row maximum, 0 where it is not finite. A row with
    every key blocked has maximum -inf, and exp(-inf - -inf) would be NaN; shifted by 0, its
    -inf scores give exp(-inf) = 0 (as PyTorch SDPA and FlashAttention do)."""
    return jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)


def divisor(row_sum: jax.Array) -> jax.Array:
    """What divides a row (SPEC §4.3): its sum, and 1 for a row with no key, whose weights
    then stay exactly 0 instead of 0 / 0 = NaN. A row that reads +inf is NaN through inf / inf
    (SPEC §4.1); where autograd differentiates the page (JAX, PyTorch) its divisor is NaN
    too, so that the gradients reach every key that row attends."""
    return jnp.where(row_sum == jnp.inf, jnp.nan, jnp.where(row_sum > 0, row_sum, 1.0))


def lse_shift(row_max: jax.Array) -> jax.Array:
    """The shift of a row's log-sum-exp (SPEC §21.2): its maximum, and 0 for a row with no
    key, whose sum of exp(-inf) = 0 then gives log 0 = -inf. Unlike ``finite_or_0``, +inf
    stays: a row that reads +inf gets inf - inf = NaN, as its output does (SPEC §4.1)."""
    return jnp.where(row_max == -jnp.inf, 0.0, row_max)  # (B, H, T, 1)


def nan_where_sink_is(weights: jax.Array, sink: jax.Array) -> jax.Array:
    """A NaN or +inf sink makes its row NaN (SPEC §15.4), as +inf - +inf does in the
    softmax; the shift by a finite row maximum cannot show it, so it is selected. A row
    with no key has no softmax at all and stays 0 (SPEC §15.3): its sink is -inf."""
    return jnp.where(jnp.isnan(sink) | (sink == jnp.inf), jnp.nan, weights)  # (B, H, T, S)


def _subnormal_ratio_kept(scores: jax.Array, softcap: float) -> jax.Array:
    """Huge softcaps (SPEC §4.2; JAX only): where scores / softcap is subnormal, XLA on a CPU
    flushes it to 0, so the score itself, the correctly rounded answer, is kept."""
    ratio = scores / softcap  # (B, H, T, S)
    tiny = jnp.abs(ratio) < jnp.finfo(scores.dtype).tiny  # (B, H, T, S)
    return jnp.where(tiny, scores, softcap * jnp.tanh(ratio))  # (B, H, T, S)
