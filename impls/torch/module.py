"""Scaled dot-product attention for PyTorch modules: the steps, with dropout as a module.

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
PyTorch's docs call B "N", T "L", D "E" and E "Ev".

Read from the top: ``attention`` runs ``naive.textbook_attention``'s lines with every option
as one named step (masks, causality, windows, chunks, ALiBi, softcap, sinks, grouped heads,
dropout by dropout_p or a callable such as nn.Dropout, float16 and bfloat16), its helpers
below it, then Notes; the guards for floating point's edges (a row with no key, overflow)
last, under "Edge cases". The math is this page's own, not naive.py's, so that the suite
checks two copies of the steps; MultiHeadAttention and a GPT block on it are ``layers.py``.
"""

from __future__ import annotations

from collections.abc import Callable

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
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, the core of ``MultiHeadAttention``: the textbook lines
    as steps 1, 2, 4, 5 and 7, each option a step of its own between them.

    Args, the inputs and the core options:
      q, k, v: (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B.
      mask: bool (True = may attend) or floating (added), broadcastable to (B, H, T, S).
      is_causal: query t attends only keys on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      dropout_p: drop each weight with this probability, as SDPA's math backend does.
      dropout: or a callable for the weights, e.g. nn.Dropout(p); not with dropout_p > 0.

    Args, the variants (each off by default):
      causal_alignment: "top_left" (key s <= t) or "bottom_right" (s <= t + S - T, the
        last query sees the last key, as in a KV cache); also places windows and chunks.
      window: (left, right): keys within left before and right after the diagonal.
      chunk_size: attend only within the same chunk of chunk_size positions.
      alibi_slopes: (H,) or (B, H): add -slope · |t + S - T - s| to the scores.
      softcap: scores become softcap · tanh(scores / softcap).
      sinks: (H,), one logit per query head that joins the softmax and has no value.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; q's dtype.
      With return_lse, (out, lse): lse (B, H, T) or (H, T), each row's log-sum-exp (step 8).
    """
    # 0. Check the inputs: an error names the argument, the expected shape and what was
    # given. ``call`` holds the checked options and the sizes (call.T, call.G, ...).
    q, k, v, mask, sinks, alibi_slopes = as_arrays(q, k, v, mask, sinks, alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p_of(dropout_p, dropout), sinks=sinks,
        chunk_size=chunk_size, alibi_slopes=alibi_slopes, random=random_source(dropout),
        flags={"return_lse": return_lse},
    )  # fmt: skip

    # Prepare the batch axis: unbatched inputs get one, and the mask takes the scores' rank.
    dtype = q.dtype
    q, k, v, mask = batched(q, k, v, mask, call)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)

    # Prepare the heads: with K < H, each key/value head serves G query heads, so it is
    # repeated G times in place, as torch's repeat_interleave does (not tiled).
    k, v = repeat_heads(k, call.G), repeat_heads(v, call.G)  # (B, H, S, D), (B, H, S, E)

    # Prepare the visibility: which keys each query may see (causality, window, chunk, mask).
    allowed = allowed_keys(mask, call, q.device)  # (B|1, H|1, T, S)
    k, v = unseen_slots_zeroed(k, v, allowed)  # (B, H, S, D), (B, H, S, E); Edge cases

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
    scores = torch.where(allowed, scores, -torch.inf)  # (B, H, T, S)

    # 5. Softmax over the keys; a row with no key left gets weights of exactly 0.
    weights = softmax(scores, sinks)  # (B, H, T, S)

    # 6. Dropout: zero each weight with probability dropout_p, rescale the rest.
    weights = dropped_out(weights, call.dropout_p, dropout)  # (B, H, T, S)

    # 7. Weighted sum of the values.
    out = torch.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    if return_lse:
        # 8. The log-sum-exp of each row's scores, what merges results over parts of the keys.
        return as_given(out, dtype, call), log_sum_exp(scores, sinks, call)
    return as_given(out, dtype, call)  # (B, H, T, E), or (H, T, E) unbatched


# --- Step 0 and the preparation: the inputs -------------------------------------------------


def as_arrays(*xs):
    """The arrays in the framework's own type, None left as it is."""
    return tuple(None if x is None else torch.as_tensor(x) for x in xs)


def dropout_p_of(dropout_p: float, dropout) -> float:
    """Step 6's probability, for the contract to check: dropout_p, or the dropout callable's
    own p (an ``nn.Dropout``'s; 0 for a callable without one). Given both, which one
    holds is not clear, so that is refused (see Notes: dropout)."""
    if dropout is not None and dropout_p != 0:
        raise ValueError(
            "dropout_p and dropout: give one of the two, got "
            f"dropout_p={dropout_p!r} and dropout={dropout!r}"
        )
    return dropout_p if dropout is None else getattr(dropout, "p", 0.0)


def random_source(dropout):
    """What the contract checks dropout's random source against: a callable or None. Its
    ``p``, given to the contract as dropout_p, is checked too (see Notes: dropout)."""
    ok = dropout is None or callable(dropout)
    return ("dropout", dropout, ok, "a callable such as nn.Dropout, or None")


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
    head is repeated for its G query heads, as torch's repeat_interleave does, not tiled
    (see Notes: grouped-query attention)."""
    return torch.repeat_interleave(x, G, dim=1)  # (B, H, S, D|E)


def allowed_keys(mask: torch.Tensor | None, call: contract.Checked, device) -> torch.Tensor:
    """Which keys each query may see, (B|1, H|1, T, S) bool: those that a bool mask, the
    causal triangle, the window and the chunk allow and a float mask does not set to -inf."""
    T, S = call.T, call.S
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if call.causal_alignment == "top_left" else S - T
    t = torch.arange(T, device=device)[:, None] + offset  # (T, 1): each query's diagonal
    s = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = torch.ones((1, 1, T, S), dtype=torch.bool, device=device)  # (1, 1, T, S)
    allowed = visible(allowed, t, s, call.is_causal, call.window, call.chunk_size)  # (1, 1, T, S)
    if mask is not None and call.mask_is_bool:
        allowed = allowed & mask  # (B|1, H|1, T, S)
    elif mask is not None:
        allowed = allowed & (mask != -torch.inf)  # (B|1, H|1, T, S)
    return allowed


def visible(
    allowed: torch.Tensor,
    t: torch.Tensor,
    s: torch.Tensor,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    chunk_size: int | None,
) -> torch.Tensor:
    """``allowed`` (..., T, S) narrowed to the keys each query may see by position: t (T, 1)
    holds each query's diagonal, s (1, S) the keys' positions. The causal triangle, the
    window and the chunks, spelled as on naive.py (this page stands alone, and split_kv
    asks naive.py's)."""
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


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's softcap, softcap · tanh(scores / softcap)."""
    if softcap is None:
        return scores
    return _Softcap.apply(scores, softcap)  # (B, H, T, S); Edge cases


def add_alibi_bias(scores: torch.Tensor, slopes: torch.Tensor | None, call: contract.Checked):
    """The scores plus ALiBi's bias −slope · |t + S − T − s|, so that a key weighs less the
    farther it lies from the query. The distance is from the bottom-right diagonal whatever
    the causal alignment: the last query sits at the last key (see Notes: ALiBi)."""
    if slopes is None:
        return scores
    T, S, H = call.T, call.S, call.H
    t = torch.arange(T, device=scores.device)[:, None]  # (T, 1)
    s = torch.arange(S, device=scores.device)[None, :]  # (1, S)
    distance = torch.abs(t + S - T - s).to(scores.dtype)  # (T, S)
    return scores - slopes.to(scores.dtype).reshape(-1, H, 1, 1) * distance  # (B, H, T, S)


def add_float_mask(scores: torch.Tensor, mask: torch.Tensor | None, call: contract.Checked):
    """The scores plus a float mask; a bool mask (or none) adds nothing, it only blocks (in
    ``allowed_keys``)."""
    if mask is None or call.mask_is_bool:
        return scores
    return scores + mask.to(scores.dtype)  # (B, H, T, S)


# --- Steps 5 and 6: the weights -------------------------------------------------------------


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The softmax over the keys, exp(score - row max) / Σ exp(score - row max): taking the
    row maximum off first keeps every exp() <= 1, so that no score overflows."""
    if sinks is not None:
        return softmax_with_sinks(scores, sinks)
    shifted = scores - finite_or_0(row_max(scores))  # (B, H, T, S)
    p = torch.exp(shifted)  # (B, H, T, S)
    return p / divisor(p.sum(dim=-1, keepdim=True))  # (B, H, T, S)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax with one sink logit per head: it joins the row maximum and the sum, but
    has no value row, so the keys' weights add up to less than 1 (see Notes: sinks)."""
    H = scores.shape[1]
    highest = row_max(scores)  # (B, H, T, 1)
    sink = sink_logits(sinks, highest, H)  # (B, H, T, 1)
    highest = finite_or_0(torch.maximum(highest, sink))  # (B, H, T, 1)
    shifted = scores - highest  # (B, H, T, S)
    p = torch.exp(shifted)  # (B, H, T, S)
    weights = p / divisor(p.sum(dim=-1, keepdim=True) + torch.exp(sink - highest))  # (B, H, T, S)
    return nan_where_sink_is(weights, sink)  # (B, H, T, S); Edge cases


def sink_logits(sinks: torch.Tensor, row_max: torch.Tensor, H: int) -> torch.Tensor:
    """Each row's sink logit, (B, H, T, 1): sinks[h] in the rows of head h that have a key,
    and -inf (no sink: exp(-inf) = 0) in a row with none, which stays exactly 0."""
    has_key = row_max != -torch.inf  # (B, H, T, 1); NaN != -inf: a NaN row has keys
    logits = sinks.to(row_max.dtype).reshape(1, H, 1, 1)  # (1, H, 1, 1)
    return torch.where(has_key, logits, -torch.inf)  # (B, H, T, 1)


def dropped_out(weights: torch.Tensor, dropout_p: float, dropout) -> torch.Tensor:
    """Zero each weight with probability dropout_p and rescale the survivors by
    1 / (1 - dropout_p), so that the expected output is unchanged; or the weights through
    the dropout callable, e.g. an ``nn.Dropout``, which does that with its own p in
    training mode and nothing in eval mode (see Notes: dropout)."""
    if dropout is not None:
        return dropout(weights)  # (B, H, T, S)
    if dropout_p == 0:
        return weights
    return torch.nn.functional.dropout(weights, dropout_p)  # (B, H, T, S)


# --- Step 7: the output ---------------------------------------------------------------------


def as_given(out: torch.Tensor, dtype: torch.dtype, call: contract.Checked) -> torch.Tensor:
    """The output rounded once to the inputs' dtype, without the batch axis it was given
    for unbatched inputs."""
    out = out.to(dtype)  # (B, H, T, E)
    return out[0] if call.unbatched else out  # (B, H, T, E) or (H, T, E)


# --- Step 8: the log-sum-exp ---------------------------------------------------------------


def log_sum_exp(scores: torch.Tensor, sinks: torch.Tensor | None, call: contract.Checked):
    """Each row's log Σ_s exp(score[s]), (B, H, T): the log of the softmax's denominator, so
    that weight[s] = exp(score[s] - lse), the sink's term included (see Notes: the
    log-sum-exp). Taken as the row maximum plus the log of the shifted sum, so that no
    exp() overflows; in the working precision, not rounded to q's dtype."""
    highest = row_max(scores)  # (B, H, T, 1)
    if sinks is not None:
        sink = sink_logits(sinks, highest, call.H)  # (B, H, T, 1)
        highest = torch.maximum(highest, sink)  # (B, H, T, 1)
    shift = lse_shift(highest)  # (B, H, T, 1); Edge cases
    total = torch.exp(scores - shift).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    if sinks is not None:
        total = total + torch.exp(sink - shift)  # (B, H, T, 1)
    lse = (shift + torch.log(total))[..., 0]  # (B, H, T)
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
# Dropout (step 6). dropout_p, or the dropout callable, acts on the (B, H, T, S) weights in
# the compute dtype, the tensor SDPA's math backend hands to at::dropout. F.dropout and an
# nn.Dropout in training mode run at::dropout, so after torch.manual_seed(s) they drop the
# same positions as F.scaled_dot_product_attention(..., dropout_p=p) with the same seed. A
# callable's p goes to the contract as dropout_p: nn.Dropout accepts p = 1 (every weight
# dropped), but the rescale by 1 / (1 - p), SDPA's too, needs p < 1, and the contract says
# so by name. A layer passes its nn.Dropout, so that eval mode turns dropout off.
#
# The log-sum-exp (step 8). lse = log Σ_s exp(score[s]) over the keys a row attends, natural
# log, with the sink's term where there are sinks. The weights are exp(score - lse), so a
# result over one part of the keys, out_a with lse_a, and one over the rest, out_b with
# lse_b, make the whole: lse = log(exp(lse_a) + exp(lse_b)), and out is out_a and out_b
# weighted by exp(lse_a - lse) and exp(lse_b - lse). That is how split-KV decoding and ring
# attention put pieces together, and what the backward pass needs of the forward. A row
# with no key has lse = log 0 = -inf: it weighs nothing in such a merge.
#
# PyTorch. The tensors this page makes are made on q's device.


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


def unseen_slots_zeroed(k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor):
    """NaN in a slot no query sees (SPEC §4.7): k and v with every slot that no query of its
    head may see (padding, a KV-cache slot not yet written) replaced by 0, by selection, so
    that whatever it holds has no effect: a weight of 0 does not cancel it, 0 · NaN is NaN."""
    used = allowed.any(dim=2)[..., None]  # (B|1, H|1, S, 1)
    return torch.where(used, k, 0.0), torch.where(used, v, 0.0)  # (B, H, S, D), (B, H, S, E)


def row_max(scores: torch.Tensor) -> torch.Tensor:
    """Each row's maximum, (B, H, T, 1), and -inf for a row of no key at all (S = 0), where
    the frameworks' maximum refuses an empty axis (SPEC §4.3)."""
    if scores.shape[-1] == 0:
        return scores.new_full((*scores.shape[:-1], 1), -torch.inf)  # (B, H, T, 1)
    return scores.amax(dim=-1, keepdim=True)  # (B, H, T, 1)


def finite_or_0(row_max: torch.Tensor) -> torch.Tensor:
    """Rows with no key (SPEC §4.3): the row maximum, 0 where it is not finite. A row with
    every key blocked has maximum -inf, and exp(-inf - -inf) would be NaN; shifted by 0, its
    -inf scores give exp(-inf) = 0 (as PyTorch SDPA and FlashAttention do)."""
    return torch.where(torch.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)


def divisor(row_sum: torch.Tensor) -> torch.Tensor:
    """What divides a row (SPEC §4.3): its sum, and 1 for a row with no key, whose weights
    then stay exactly 0 instead of 0 / 0 = NaN. A row that reads +inf is NaN through inf / inf
    (SPEC §4.1); where autograd differentiates the page (JAX, PyTorch) its divisor is NaN
    too, so that the gradients reach every key that row attends."""
    return torch.where(row_sum == torch.inf, torch.nan, torch.where(row_sum > 0, row_sum, 1.0))


def lse_shift(row_max: torch.Tensor) -> torch.Tensor:
    """The shift of a row's log-sum-exp (SPEC §21.2): its maximum, and 0 for a row with no
    key, whose sum of exp(-inf) = 0 then gives log 0 = -inf. Unlike ``finite_or_0``, +inf
    stays: a row that reads +inf gets inf - inf = NaN, as its output does (SPEC §4.1)."""
    return torch.where(row_max == -torch.inf, 0.0, row_max)  # (B, H, T, 1)


def nan_where_sink_is(weights: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """A NaN or +inf sink makes its row NaN (SPEC §15.4), as +inf - +inf does in the
    softmax; the shift by a finite row maximum cannot show it, so it is selected. A row
    with no key has no softmax at all and stays 0 (SPEC §15.3): its sink is -inf."""
    return torch.where(torch.isnan(sink) | (sink == torch.inf), torch.nan, weights)  # (B, H, T, S)


class _Softcap(torch.autograd.Function):
    """Huge softcaps (SPEC §4.2; PyTorch only): the derivative 1 − tanh² as it is, since
    autograd's d · softcap overflowed near the largest float (3e38 in float32)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, softcap: float) -> torch.Tensor:
        ctx.save_for_backward(tanh := torch.tanh(scores / softcap))  # (B, H, T, S)
        return softcap * tanh  # (B, H, T, S)

    @staticmethod
    def backward(ctx, d_capped: torch.Tensor) -> tuple[torch.Tensor, None]:
        (tanh,) = ctx.saved_tensors
        return d_capped * (1.0 - tanh * tanh), None  # (B, H, T, S)
