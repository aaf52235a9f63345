"""The backward pass of scaled dot-product attention in NumPy, written by hand.

    out = softmax(mask(softcap(scale · q kᵀ))) v

Given the gradient dO = ∂L/∂out of some loss L, the backward pass returns ∂L/∂q, ∂L/∂k,
∂L/∂v (and ∂L/∂mask for a float mask). It walks the core page's steps (``attention.py``)
in reverse, each step turning the gradient of its output into the gradient of its input
by the chain rule. Writing P for the weights, O for the output and Z for the scores fed to
the softmax (after softcap and the mask), for one query row t:

    O[t]  = Σ_s P[t,s] · v[s]        →  dv[s]   = Σ_t P[t,s] · dO[t]              dV = Pᵀ·dO
                                      →  dP[t,s] = dO[t] · v[s]                     dP = dO·Vᵀ
    P[t]  = softmax(Z[t])             →  dZ[t,s] = P[t,s] · (dP[t,s] − Σ_s' P[t,s'] dP[t,s'])
                                                 = P[t,s] · (dP[t,s] − dO[t]·O[t])
    Z     = C + mask                  →  dmask = dZ,  dC = dZ
    C     = c · tanh(R / c)           →  dR = dC · (1 − tanh²(R / c))
    R     = scale · q kᵀ              →  dq = scale · dR · k,   dk = scale · dRᵀ · q

Why the softmax line: ∂P[s]/∂Z[s'] = P[s] (δ(s, s') − P[s']), so
dZ[s] = Σ_s' dP[s'] P[s'] (δ(s', s) − P[s]) = P[s] (dP[s] − Σ_s' P[s'] dP[s']), and the
sum Σ_s' P[s'] dP[s'] = Σ_s' P[s'] (dO · v[s']) = dO · O: one dot product per row, from
the output the forward already made (FlashAttention's "D" term), not a (T, S) reduction.

An attention sink is one more logit in each row's softmax whose value row is 0: its dP is
0, so the lines above hold as written (P the weights with the sink in their sum, O the
output), and ∂P[s']/∂sink = −P[s'] · p_sink gives its own gradient, summed over the
batch and the queries of its head:

    dsink = − Σ_t p_sink[t] · Σ_s' P[t,s'] dP[t,s'] = − Σ_t p_sink[t] · Δ[t]

The log-sum-exp's gradient. A caller that keeps each row's lse = log Σ_s exp(Z[t,s]) (the
forward's ``return_lse``, SPEC §21) may send a gradient d_lse back through it too. Its
derivative by a score is that score's weight, ∂lse/∂Z[s] = P[s], so it adds
d_lse · P[s] to dZ[s], which is one more term in the row's constant:

    dZ[t,s] = P[t,s] · (dP[t,s] − Δ[t]),      Δ[t] = dO[t]·O[t] − d_lse[t]

and the sink's line below takes it up as written (its weight is in the lse too). A row
with no key has lse = −inf, a constant: its weights and its sink's are all 0, so its d_lse
reaches nothing.

ALiBi's bias is added to the scores like a float mask, but it is a constant: its slopes
get no gradient, and dZ flows on to the softcap and the scores unchanged.

Blocked keys need no step of their own: their weight P is exactly 0, so dZ = 0 there and
nothing flows to their keys, values or mask entries. A row with no key at all has P = 0
and O = 0 and so gets zero gradients, never NaN.

Grouped-query attention: the forward repeats each key/value head G times; the gradient of
a repeat is the sum over its copies, so a shared head collects its whole group's gradient.

Shape legend: the core page's (``attention.py``); d_out and out are (B, H, T, E).

Supports every option of the forward but dropout (its gradient needs the forward's random
draw): masks, both causal alignments, windows, chunks, ALiBi, softcap, sinks, GQA,
unbatched inputs, float64, float32, float16 and bfloat16 (computed in float32, each
gradient rounded once).

Imports: NumPy, the ``contract`` package and the core page's step helpers, by their public names:
the forward is recomputed with the very lines that made it. The gradients of the packed
and paged entry points are on their pages (``packed.py``, ``paged.py``), beside their
forwards; those of the multi-head layer and the GPT block in ``layers.py``.
"""

from __future__ import annotations

import numpy as np

from .. import contract
from .attention import (
    add_alibi_bias,
    add_float_mask,
    allowed_keys,
    as_arrays,
    as_given,
    batched,
    repeat_heads,
    sink_logits,
    softcapped,
    unseen_slots_zeroed,
)


# As in the forward: a score that overflows is ±inf and a row that reads +inf or NaN is
# NaN, answers the SPEC defines (§4.1, §3.8), so NumPy is not to warn about them.
@np.errstate(over="ignore", invalid="ignore")
def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: np.ndarray | None = None,
    chunk_size: int | None = None,
    alibi_slopes: np.ndarray | None = None,
    d_lse: np.ndarray | None = None,
) -> tuple[np.ndarray, ...]:
    """Gradients of ``attention`` with respect to q, k, v (and a float mask, and sinks).

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes: as for ``attention`` (no dropout: the backward of a
        random draw needs the draw itself).
      d_out: ∂L/∂out, the gradient arriving from above, shaped like the output:
        (B, H, T, E) or unbatched (H, T, E), same dtype as q.
      dropout_p: must be 0.
      d_lse: ∂L/∂lse for the loss L = Σ d_out · out + Σ d_lse · lse, shaped like the lse,
        (B, H, T) or unbatched (H, T), in its dtype (float64 for float64, else float32);
        None: 0.

    Returns:
      (dq, dk, dv): (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B;
      same dtype as q. With a floating mask, (dq, dk, dv, dmask) with dmask shaped and
      typed like the mask: ∂L/∂mask, summed over the axes the mask was broadcast along.
      With sinks, dsinks (H,) typed like sinks comes last: (dq, dk, dv[, dmask], dsinks).
    """
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k, v, d_out, mask, sinks, alibi_slopes = as_arrays(q, k, v, d_out, mask, sinks, alibi_slopes)
    d_lse = None if d_lse is None else np.asarray(d_lse)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes, d_out=d_out, d_lse=d_lse,
        unsupported={"dropout_p": "the backward pass would need the forward's random draw"},
    )  # fmt: skip
    dtype, given_mask = q.dtype, mask
    B, K, G, S, D, E = call.B, call.K, call.G, call.S, call.D, call.E
    q, k, v, mask = batched(q, k, v, mask, call)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)
    d_out = (d_out[None] if call.unbatched else d_out).astype(q.dtype)  # (B, H, T, E)
    k, v = repeat_heads(k, G), repeat_heads(v, G)  # (B, H, S, D), (B, H, S, E)

    # Forward steps 1-5 and 7 again, keeping the raw scores R, the weights P, the sinks'
    # weights and the output O, with the key and value rows that no query of their head
    # sees replaced by 0.
    saved = saved_forward(q, k, v, mask, sinks, alibi_slopes, call)
    allowed, k, v, raw, weights, sink_weights, out = saved

    # 7'. Weighted sum, out = P·V. Each value row s was used by every query t with weight
    # P[t, s], so dV = Pᵀ·dO ...
    d_v = np.einsum("bhts,bhte->bhse", weights, d_out)  # (B, H, S, E)
    # ... and each weight P[t, s] multiplied value row s, so dP = dO·Vᵀ.
    d_weights = np.einsum("bhte,bhse->bhts", d_out, v)  # (B, H, T, S)

    # 5'. Softmax: dZ = P ⊙ (dP − rowsum(dO ⊙ O)). The row sum is where the weights'
    # coupling shows: raising one score lowers every other weight of its row.
    d_row = np.sum(d_out * out, axis=-1, keepdims=True)  # (B, H, T, 1)
    # 8'. The log-sum-exp, where its gradient is given: ∂lse/∂Z = P, so d_lse joins the
    # row's constant with the opposite sign (d_lse · P added to dZ).
    if d_lse is not None:
        d_row = d_row - (d_lse[None] if call.unbatched else d_lse)[..., None]  # (B, H, T, 1)
    d_scores = weights * (d_weights - d_row)  # (B, H, T, S)

    # 5'. Sinks: the sink's value row is 0, so its dZ is p_sink · (0 − Δ), summed over the
    # batch and the queries that share the head's sink.
    d_sinks = None
    if sinks is not None:
        d_sinks = -np.sum(sink_weights * d_row, axis=(0, 2, 3))  # (H,)

    # 4'. Mask: a float mask was added to the scores, so its gradient is dZ itself, summed
    # over every axis along which one mask entry served many scores (broadcasting). A
    # blocked key has P = 0 and so dZ = 0: no gradient reaches it.
    d_mask = None
    if mask is not None and not call.mask_is_bool:
        d_full = d_scores[0] if call.unbatched else d_scores  # (B, H, T, S) or (H, T, S)
        d_mask = sum_to(d_full, given_mask.shape).astype(given_mask.dtype)  # mask's shape

    # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c), which fades where the cap bites.
    d_scores = softcap_backward(d_scores, raw, call.softcap)  # (B, H, T, S)

    # 2'. Scale: R = scale · q·k, so the scale multiplies the gradient on the way back.
    d_scores = d_scores * call.scale  # (B, H, T, S)

    # 1'. Scores, R = q·kᵀ: dq = dR·k (a query moves towards the keys it should weigh
    # more), dk = dRᵀ·q.
    d_q = np.einsum("bhts,bhsd->bhtd", d_scores, k)  # (B, H, T, D)
    d_k = np.einsum("bhts,bhtd->bhsd", d_scores, q)  # (B, H, S, D)

    # The slots replaced by 0 in the forward get nothing back: a selection passes the
    # gradient only to the branch it took.
    d_k, d_v = unseen_slots_zeroed(d_k, d_v, allowed)  # (B, H, S, D), (B, H, S, E)

    # The repeat of the key/value heads, backwards: each of the G copies of a head sends
    # its gradient back to that head, so the group's gradients add up.
    d_k = d_k.reshape(B, K, G, S, D).sum(axis=2)  # (B, K, S, D)
    d_v = d_v.reshape(B, K, G, S, E).sum(axis=2)  # (B, K, S, E)

    grads = [as_given(d, dtype, call) for d in (d_q, d_k, d_v)]
    if d_mask is not None:
        grads.append(d_mask)
    if d_sinks is not None:
        grads.append(d_sinks.astype(dtype))
    return tuple(grads)


def saved_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    sinks: np.ndarray | None,
    alibi_slopes: np.ndarray | None,
    call: contract.Checked,
) -> tuple[np.ndarray, ...]:
    """The core page's steps 1-5 and 7 on batched, repeated inputs in the working
    precision, with its own helpers, keeping what the backward pass reads: which keys
    each query may see, k and v with their unused rows zeroed, the raw scores R, the
    weights P, the sinks' weights p_sink (B, H, T, 1) and the output O."""
    allowed = allowed_keys(mask, call)  # (B|1, H|1, T, S)
    k, v = unseen_slots_zeroed(k, v, allowed)  # (B, H, S, D), (B, H, S, E)
    raw = np.einsum("bhtd,bhsd->bhts", q, k) * call.scale  # (B, H, T, S)
    scores = softcapped(raw, call.softcap)  # (B, H, T, S)
    scores = add_alibi_bias(scores, alibi_slopes, call)  # (B, H, T, S)
    scores = add_float_mask(scores, mask, call)  # (B, H, T, S)
    scores = np.where(allowed, scores, -np.inf)  # (B, H, T, S)
    weights, sink_weights = softmax_with_sink(scores, sinks)  # (B, H, T, S), (B, H, T, 1)
    out = np.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    return allowed, k, v, raw, weights, sink_weights, out


def softmax_with_sink(scores: np.ndarray, sinks: np.ndarray | None):
    """The core page's ``softmax``, returning the sinks' weights p_sink (B, H, T, 1) too
    (0 without sinks), and with every weight of a row that read a +inf score NaN, as
    SPEC §4.1 asks of the gradients: the forward's p / inf leaves that row's finite scores
    a weight of 0, which would give their keys finite gradients."""
    H = scores.shape[1]
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, H, T, 1)
    no_sink = np.full_like(row_max, -np.inf)  # (B, H, T, 1): exp(-inf) = 0
    sink = no_sink if sinks is None else sink_logits(sinks, row_max, H)  # (B, H, T, 1)
    row_max = np.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = np.exp(scores - row_max)  # (B, H, T, S)
    p_sink = np.exp(sink - row_max)  # (B, H, T, 1)
    row_sum = p.sum(axis=-1, keepdims=True) + p_sink  # (B, H, T, 1)
    divisor = np.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, 1)
    divisor = np.where(row_sum == np.inf, np.nan, divisor)  # (B, H, T, 1)
    bad = np.isnan(sink) | (sink == np.inf)  # (B, H, T, 1): NaN rows, as in the forward
    weights = np.where(bad, np.nan, p / divisor)  # (B, H, T, S)
    return weights, np.where(bad, np.nan, p_sink / divisor)  # (B, H, T, S), (B, H, T, 1)


def softcap_backward(d_scores: np.ndarray, raw: np.ndarray, softcap: float | None) -> np.ndarray:
    """3'. The softcap's derivative, 1 − tanh²(R/c), applied to dC; without a softcap the
    gradient passes unchanged."""
    if softcap is None:
        return d_scores
    return d_scores * (1.0 - np.tanh(raw / softcap) ** 2)  # (B, H, T, S)


def sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Undo broadcasting: sum x over the axes along which an array of ``shape`` was broadcast."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))  # drop the leading axes
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)
