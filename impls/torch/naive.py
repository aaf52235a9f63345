"""Scaled dot-product attention in PyTorch, by hand: the NumPy reference's steps in torch.

    out = softmax(scale · q kᵀ + mask) v

For one query row t of one head, with the scale 1/√D by default:

    score[s]  = scale · Σ_d q[t, d] · k[s, d]
    w[s]      = exp(score[s] - max_s score) / Σ_s exp(score[s] - max_s score)
    out[t, e] = Σ_s w[s] · v[s, e]

Why 1/√D: if q's and k's entries have unit variance, q·k sums D such products and has
variance D. Dividing by √D keeps the scores near unit variance at any head size, so the
softmax neither saturates (one-hot weights, vanishing gradients) nor flattens.

Shape legend (heads-first, as in PyTorch, whose docs call T "L" and E "Ev"):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores), broadcastable to
    (B, H, T, S). Unbatched q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

Supports: bool and float masks; causal masks aligned top-left or bottom-right; sliding
windows; chunked local attention (Llama 4); ALiBi; softcapping (Gemma 2); attention sinks
(gpt-oss); grouped- and multi-query attention (K < H); dropout drawn as SDPA draws it;
float64, float32, float16 and bfloat16; autograd. A query row with no key left returns
exactly 0, with gradients 0. ``return_weights=True`` also returns the weights.

Imports: the standard library, PyTorch and the ``contract`` package. The rest of this package:
``module.py`` and ``sdpa.py`` (the other core pages), ``layers.py``, ``kv_cache.py``,
``packed.py`` (SPEC §18), ``paged.py`` (§19), ``ring.py`` and ``ulysses.py``.
"""

from __future__ import annotations

import math

import torch

from .. import contract


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
      q, k, v: (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B.
      mask: bool (True = may attend) or floating (added), broadcastable to (B, H, T, S).
      is_causal: query t attends only keys on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      causal_alignment: "top_left" (key s <= t) or "bottom_right" (s <= t + S - T, the
        last query sees the last key, as in a KV cache); also places windows and chunks.
      window: (left, right): keys within left before and right after the diagonal.
      softcap: scores become softcap · tanh(scores / softcap).
      dropout_p, generator: drop each weight with probability dropout_p, drawn from the
        generator (None: PyTorch's global one, seeded by ``torch.manual_seed``, as SDPA's).
      return_weights: also return the weights that multiplied v (after dropout).
      sinks: (H,), one logit per query head that joins the softmax and has no value.
      chunk_size: attend only within the same chunk of chunk_size positions.
      alibi_slopes: (H,) or (B, H): add -slope · |t + S - T - s| to the scores.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; q's dtype. With return_weights,
        (out, weights), weights (B, H, T, S) or (H, T, S).
    """
    # 0. Validate with the input contract every page shares: an error names the argument,
    # the expected shape and what was given.
    q, k, v, mask, sinks, alibi_slopes = as_arrays(q, k, v, mask, sinks, alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes, random=random_source(generator),
    )  # fmt: skip
    dtype = q.dtype
    q, k, v, mask = batched(q, k, v, mask, call)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)
    k, v = repeat_heads(k, call.G), repeat_heads(v, call.G)  # (B, H, S, D), (B, H, S, E)
    allowed = allowed_keys(mask, call, q.device)  # (B|1, H|1, T, S)
    k, v = unseen_slots_zeroed(k, v, allowed)  # (B, H, S, D), (B, H, S, E)

    # 1. Scores: every query against every key of its head.
    scores = torch.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)

    # 2. Scale, so that the scores' spread does not grow with the head size D.
    scores = scores * call.scale  # (B, H, T, S)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    scores = softcapped(scores, call.softcap)  # (B, H, T, S)

    # 4. Mask: ALiBi's bias and a float mask are added; every key a query may not see
    # gets -inf.
    scores = add_alibi_bias(scores, alibi_slopes, call)  # (B, H, T, S)
    scores = add_float_mask(scores, mask, call)  # (B, H, T, S)
    scores = torch.where(allowed, scores, -math.inf)  # (B, H, T, S)

    # 5. Softmax over the keys; a row with no key left gets weights of exactly 0.
    weights = softmax(scores, sinks)  # (B, H, T, S)

    # 6. Dropout: zero each weight with probability dropout_p, rescale the rest.
    weights = dropped_out(weights, call.dropout_p, generator)  # (B, H, T, S)

    # 7. Weighted sum of the values.
    out = torch.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    return as_given(out, dtype, call, weights if return_weights else None)


#: The seeds' name: both seed tutorials define ``scaled_dot_product_attention(Q, K, V,
#: mask)``, so a reader coming from them finds it here. The same function as ``attention``.
scaled_dot_product_attention = attention


# --- Step 0: the inputs ---------------------------------------------------------------------


def as_arrays(*xs):
    """The arrays as torch tensors, None left as it is."""
    return tuple(None if x is None else torch.as_tensor(x) for x in xs)


def random_source(generator):
    """What the contract checks dropout's random source against: a torch Generator or None."""
    ok = generator is None or isinstance(generator, torch.Generator)
    return ("generator", generator, ok, "a torch.Generator or None")


def batched(q, k, v, mask, call: contract.Checked):
    """q, k, v with a batch axis, in the working precision; the mask reshaped to broadcast
    against the (B, H, T, S) scores. Float16 and bfloat16 are computed in float32 and
    rounded once at the end (see Notes: working precision)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
    return q.to(work), k.to(work), v.to(work), mask


def repeat_heads(x: torch.Tensor, G: int) -> torch.Tensor:
    """Grouped-query attention: query head h uses key/value head h // G, so each key/value
    head is repeated for its G query heads (see Notes: grouped-query attention)."""
    return x.repeat_interleave(G, dim=1)  # (B, H, S, D|E)


def allowed_keys(mask: torch.Tensor | None, call: contract.Checked, device) -> torch.Tensor:
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


def unseen_slots_zeroed(k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor):
    """k and v with every slot that no query of its head may see replaced by 0, so that
    whatever it holds (NaN, inf) has no effect (see Notes: blocked keys)."""
    used = allowed.any(dim=2)[..., None]  # (B|1, H|1, S, 1)
    return torch.where(used, k, 0.0), torch.where(used, v, 0.0)  # (B, H, S, D), (B, H, S, E)


# --- Steps 3 and 4: the variants of the scores ----------------------------------------------


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's softcap, softcap · tanh(scores / softcap); a score far above the softcap
    overflows to ±inf in the division, whose tanh is exactly ±1. Its derivative is taken
    as it is (see Notes: huge softcaps)."""
    if softcap is None:
        return scores
    return _Softcap.apply(scores, softcap)  # (B, H, T, S)


class _Softcap(torch.autograd.Function):
    """softcap · tanh(scores / softcap), with the derivative 1 − tanh²(scores / softcap)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, softcap: float) -> torch.Tensor:
        tanh = torch.tanh(scores / softcap)  # (B, H, T, S)
        ctx.save_for_backward(tanh)
        return softcap * tanh  # (B, H, T, S)

    @staticmethod
    def backward(ctx, d_capped: torch.Tensor) -> tuple[torch.Tensor, None]:
        (tanh,) = ctx.saved_tensors
        return d_capped * (1.0 - tanh * tanh), None  # (B, H, T, S)


def add_alibi_bias(scores: torch.Tensor, slopes: torch.Tensor | None, call: contract.Checked):
    """The scores plus ALiBi's bias −slope · |t + S − T − s|, so that a key weighs less the
    farther it lies from the query. The distance is from the bottom-right diagonal whatever
    the causal alignment: the last query sits at the last key (see Notes: ALiBi)."""
    if slopes is None:
        return scores
    T, S, H = call.T, call.S, call.H
    t = torch.arange(T, device=slopes.device)[:, None]  # (T, 1)
    s = torch.arange(S, device=slopes.device)[None, :]  # (1, S)
    distance = (t + S - T - s).abs().to(scores.dtype)  # (T, S)
    return scores - slopes.to(scores.dtype).reshape(-1, H, 1, 1) * distance  # (B, H, T, S)


def add_float_mask(scores: torch.Tensor, mask: torch.Tensor | None, call: contract.Checked):
    """The scores plus a float mask; a bool mask (or none) adds nothing, it only blocks (in
    ``allowed_keys``)."""
    if mask is None or call.mask_is_bool:
        return scores
    return scores + mask.to(scores.dtype)  # (B, H, T, S)


# --- Steps 5 and 6: the weights -------------------------------------------------------------


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the keys, less the row maximum so that exp() <= 1. A row with no key
    left has maximum -inf and gets weights of exactly 0 (see Notes: empty rows)."""
    if sinks is not None:
        return softmax_with_sinks(scores, sinks)
    row_max = _row_max(scores)  # (B, H, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = torch.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    return p / _divisor(row_sum)  # (B, H, T, S)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax with one sink logit per head: it joins the row maximum and the sum, but
    has no value row, so the keys' weights add up to less than 1 (see Notes: sinks)."""
    H = scores.shape[1]
    row_max = _row_max(scores)  # (B, H, T, 1)
    sink = sink_logits(sinks, row_max, H)  # (B, H, T, 1)
    row_max = torch.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = torch.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(dim=-1, keepdim=True) + torch.exp(sink - row_max)  # (B, H, T, 1)
    weights = p / _divisor(row_sum)  # (B, H, T, S)
    # A NaN or +inf sink makes its row NaN, as +inf - +inf does in the softmax (SPEC §15.4);
    # the shift by a finite row maximum above cannot show it, so it is selected.
    return torch.where(torch.isnan(sink) | (sink == math.inf), math.nan, weights)  # (B, H, T, S)


def _row_max(scores: torch.Tensor) -> torch.Tensor:
    """Each row's maximum, (B, H, T, 1); torch's amax refuses a key axis of length 0
    (S = 0), whose rows' maximum is -inf."""
    if scores.shape[-1] == 0:
        return scores.new_full((*scores.shape[:-1], 1), -math.inf)  # (B, H, T, 1)
    return scores.amax(dim=-1, keepdim=True)  # (B, H, T, 1)


def _divisor(row_sum: torch.Tensor) -> torch.Tensor:
    """What divides a row: its sum, 1 for a row with no key (its weights stay 0), and NaN for
    a row that reads +inf, which is NaN whole, not only at its +inf scores, so that autograd
    reaches every key it attends (see Notes: overflow)."""
    divisor = torch.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, 1)
    return torch.where(row_sum == math.inf, math.nan, divisor)  # (B, H, T, 1)


def sink_logits(sinks: torch.Tensor, row_max: torch.Tensor, H: int) -> torch.Tensor:
    """Each row's sink logit, (B, H, T, 1): sinks[h] in the rows of head h that have a key,
    and -inf (no sink: exp(-inf) = 0) in a row with none, which stays exactly 0."""
    has_key = row_max != -math.inf  # (B, H, T, 1); NaN != -inf: a NaN row has keys
    logits = sinks.to(row_max.dtype).reshape(1, H, 1, 1)  # (1, H, 1, 1)
    return torch.where(has_key, logits, -math.inf)  # (B, H, T, 1)


def dropped_out(weights: torch.Tensor, dropout_p: float, generator) -> torch.Tensor:
    """Zero each weight with probability dropout_p and rescale the survivors by
    1 / (1 - dropout_p), so that the expected output is unchanged; drawn and applied as
    SDPA's math backend does, bit for bit (see Notes: dropout)."""
    if dropout_p == 0:
        return weights
    keep = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)  # (B, H, T, S)
    keep = keep.bernoulli_(1.0 - dropout_p, generator=generator)  # (B, H, T, S)
    return weights * keep.div_(1.0 - dropout_p)  # (B, H, T, S)


# --- Step 7: the output ---------------------------------------------------------------------


def as_given(out: torch.Tensor, dtype: torch.dtype, call: contract.Checked, weights=None):
    """The output rounded once to the inputs' dtype, without the batch axis it was given
    for unbatched inputs; with ``weights`` (return_weights), (out, weights) alike."""
    out = out.to(dtype)  # (B, H, T, E)
    if weights is None:
        return out[0] if call.unbatched else out  # (B, H, T, E) or (H, T, E)
    weights = weights.to(dtype)  # (B, H, T, S)
    return (out[0], weights[0]) if call.unbatched else (out, weights)


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
# empty axis has no maximum of its own.
#
# Overflow (steps 2, 5). A score that overflows is ±inf, as SPEC §4.1 defines: +inf makes
# its row NaN, -inf gives weight 0. The row sum of a row that reads +inf is +inf, and p / inf
# would make only its +inf weights NaN (inf / inf) and the others 0; the output row is NaN
# either way, but autograd would then send no gradient to the keys of weight 0. So such a
# row's divisor is NaN, and every weight of it is NaN, as its gradients are.
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
