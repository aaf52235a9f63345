"""The backward pass of scaled dot-product attention in NumPy, written by hand.

    out = softmax(mask(softcap(scale · q kᵀ))) v

Given the gradient dO = ∂L/∂out of some loss L, the backward pass returns ∂L/∂q, ∂L/∂k,
∂L/∂v (and ∂L/∂mask for a float mask). It walks the forward's steps
(``numpy_attention.py``) in reverse, each step turning the gradient of its output into the
gradient of its input by the chain rule. Writing P for the weights, O for the output and
Z for the scores fed to the softmax (after softcap and the mask), for one query row t:

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

    dsink = − Σ_t p_sink[t] · Σ_s' P[t,s'] dP[t,s'] = − Σ_t p_sink[t] · (dO[t]·O[t])

ALiBi's bias is added to the scores like a float mask, but it is a constant: its slopes
get no gradient, and dZ flows on to the softcap and the scores unchanged.

Blocked keys need no step of their own: their weight P is exactly 0, so dZ = 0 there and
nothing flows to their keys, values or mask entries. A row with no key at all has P = 0
and O = 0 and so gets zero gradients, never NaN.

Grouped-query attention: the forward repeats each key/value head G times; the gradient of
a repeat is the sum over its copies, so a shared head collects its whole group's gradient.

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       C model width (module only)
    F MLP hidden width (block only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    d_out, out (B, H, T, E)

Supports every option of the forward but dropout (its gradient needs the forward's random
draw): masks, both causal alignments, windows, chunks, ALiBi, softcap, sinks, GQA, unbatched inputs, float64,
float32, float16 and bfloat16 (computed in float32, each gradient rounded once). Also
here: the gradients of packed variable-length sequences (``attention_packed_backward``,
SPEC §18), and the parameter gradients of the multi-head layer and the pre-LN GPT block.

Imports: the standard library, NumPy, ``contract.py`` (the input contract all impls share,
step 0) and ``numpy_attention.py``, the page this one differentiates (its forward
functions and ``_allowed``).
"""

from __future__ import annotations

import math

import numpy as np

from . import contract
from . import numpy_attention as forward


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
) -> tuple[np.ndarray, ...]:
    """Gradients of ``attention`` with respect to q, k, v (and a float mask, and sinks).

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes: as for ``attention`` (no dropout: the backward of a
        random draw needs the draw itself).
      d_out: ∂L/∂out, the gradient arriving from above, shaped like the output:
        (B, H, T, E) or unbatched (H, T, E), same dtype as q.
      dropout_p: must be 0.

    Returns:
      (dq, dk, dv): (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B;
      same dtype as q. With a floating mask, (dq, dk, dv, dmask) with dmask shaped and
      typed like the mask: ∂L/∂mask, summed over the axes the mask was broadcast along.
      With sinks, dsinks (H,) typed like sinks comes last: (dq, dk, dv[, dmask], dsinks).
    """
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
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
        unsupported={"dropout_p": "the backward pass would need the forward's random draw"},
        d_out=d_out,
        sinks=sinks,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    B, K, G, S, D, E = call.B, call.K, call.G, call.S, call.D, call.E
    if call.unbatched:
        q, k, v, d_out = q[None], k[None], v[None], d_out[None]  # batched, B = 1
    given_mask = mask
    if mask is not None:
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)

    out_dtype = q.dtype
    work = np.float64 if out_dtype == np.float64 else np.float32
    q, k, v, d_out = q.astype(work), k.astype(work), v.astype(work), d_out.astype(work)
    k = np.repeat(k, G, axis=1)  # (B, H, S, D)
    v = np.repeat(v, G, axis=1)  # (B, H, S, E)

    # Forward steps 1-5 and 7 again, keeping the raw scores R, the weights P, the sinks'
    # weights and the output O, with the key and value rows that no query of their head
    # sees replaced by 0.
    k, v, used, raw, weights, sink_weights, out = _forward(
        q, k, v, mask, sinks, alibi_slopes, call, work
    )

    # 7'. Weighted sum, out = P·V. Each value row s was used by every query t with weight
    # P[t, s], so dV = Pᵀ·dO ...
    d_v = np.einsum("bhts,bhte->bhse", weights, d_out)  # (B, H, S, E)
    # ... and each weight P[t, s] multiplied value row s, so dP = dO·Vᵀ.
    d_weights = np.einsum("bhte,bhse->bhts", d_out, v)  # (B, H, T, S)

    # 5'. Softmax: dZ = P ⊙ (dP − rowsum(dO ⊙ O)). The row sum is where the weights'
    # coupling shows: raising one score lowers every other weight of its row.
    d_row = np.sum(d_out * out, axis=-1, keepdims=True)  # (B, H, T, 1)
    d_scores = weights * (d_weights - d_row)  # (B, H, T, S)

    # 5'. Sinks: the sink's value row is 0, so its dZ is p_sink · (0 − rowsum(dO ⊙ O)),
    # summed over the batch and the queries that share the head's sink.
    d_sinks = None
    if sinks is not None:
        d_sinks = -np.sum(sink_weights * d_row, axis=(0, 2, 3))  # (H,)

    # 4'. Mask: a float mask was added to the scores, so its gradient is dZ itself, summed
    # over every axis along which one mask entry served many scores (broadcasting). A
    # blocked key has P = 0 and so dZ = 0: no gradient reaches it.
    d_mask = None
    if mask is not None and not call.mask_is_bool:
        d_full = d_scores[0] if call.unbatched else d_scores  # (B, H, T, S) or (H, T, S)
        d_mask = _sum_to(d_full, given_mask.shape).astype(given_mask.dtype)  # mask's shape

    # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c), which fades where the cap bites.
    if call.softcap is not None:
        with np.errstate(over="ignore"):
            d_scores = d_scores * (1.0 - np.tanh(raw / call.softcap) ** 2)  # (B, H, T, S)

    # 2'. Scale: R = scale · q·k, so the scale multiplies the gradient on the way back.
    d_scores = d_scores * work(call.scale)  # (B, H, T, S)

    # 1'. Scores, R = q·kᵀ: dq = dR·k (a query moves towards the keys it should weigh
    # more), dk = dRᵀ·q.
    d_q = np.einsum("bhts,bhsd->bhtd", d_scores, k)  # (B, H, T, D)
    d_k = np.einsum("bhts,bhtd->bhsd", d_scores, q)  # (B, H, S, D)

    # The slots replaced by 0 in the forward get nothing back: a selection passes the
    # gradient only to the branch it took.
    d_k = np.where(used, d_k, 0.0)  # (B, H, S, D)
    d_v = np.where(used, d_v, 0.0)  # (B, H, S, E)

    # The repeat of the key/value heads, backwards: each of the G copies of a head sends
    # its gradient back to that head, so the group's gradients add up.
    d_k = d_k.reshape(B, K, G, S, D).sum(axis=2)  # (B, K, S, D)
    d_v = d_v.reshape(B, K, G, S, E).sum(axis=2)  # (B, K, S, E)

    grads = [d_q.astype(out_dtype), d_k.astype(out_dtype), d_v.astype(out_dtype)]
    if call.unbatched:
        grads = [g[0] for g in grads]
    if d_mask is not None:
        grads.append(d_mask)
    if d_sinks is not None:
        grads.append(d_sinks.astype(out_dtype))
    return tuple(grads)


def attention_packed_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_packed`` with respect to q, k, v (SPEC §18.5).

    Args:
      q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale, causal_alignment, window,
        softcap: as for ``attention_packed``.
      d_out: ∂L/∂out, (H, T, E), same dtype as q.

    Returns:
      (dq, dk, dv): (H, T, D), (K, S, D), (K, S, E), same dtype as q. The boundaries are
      integers and get no gradient.
    """
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    _, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, d_out=d_out, **options
    )

    # 1'. Each document alone, as in the forward: a document's loss reaches only its own
    # queries, keys and values, and a key of a document with no query gets 0.
    d_q = np.zeros(q.shape, dtype=q.dtype)  # (H, T, D)
    d_k = np.zeros(k.shape, dtype=q.dtype)  # (K, S, D)
    d_v = np.zeros(v.shape, dtype=q.dtype)  # (K, S, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        d_q[:, t0:t1], d_k[:, s0:s1], d_v[:, s0:s1] = attention_backward(
            q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], d_out[:, t0:t1], **options
        )  # (H, T_n, D), (K, S_n, D), (K, S_n, E)
    return d_q, d_k, d_v


def _forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    sinks: np.ndarray | None,
    alibi_slopes: np.ndarray | None,
    call: contract.Checked,
    work: type,
) -> tuple[np.ndarray, ...]:
    """``numpy_attention.attention``'s steps 1-5 and 7 on batched, repeated inputs in the
    working precision, keeping what the backward pass reads: k and v with their unused
    rows zeroed, which slots are used, the raw scores R, the weights P, the sinks' weights
    p_sink (B, H, T, 1) (None without sinks) and the output O."""
    allowed = forward._allowed(mask, call)  # (B|1, H|1, T, S)
    used = allowed.any(axis=2)[..., None]  # (B|1, H|1, S, 1)
    k = np.where(used, k, 0.0)  # (B, H, S, D)
    v = np.where(used, v, 0.0)  # (B, H, S, E)
    with np.errstate(over="ignore"):  # a score that overflows is ±inf (SPEC §4.1)
        raw = np.einsum("bhtd,bhsd->bhts", q, k) * work(call.scale)  # (B, H, T, S)
    scores = raw  # (B, H, T, S)
    if call.softcap is not None:
        # A score far above the softcap overflows to ±inf here, whose tanh is exactly ±1.
        with np.errstate(over="ignore"):
            scores = call.softcap * np.tanh(raw / call.softcap)  # (B, H, T, S)
    if alibi_slopes is not None:
        alibi = forward._alibi_bias(alibi_slopes.astype(work), call.T, call.S, call.H)
        scores = scores + alibi  # (B, H, T, S)
    if mask is not None and not call.mask_is_bool:
        scores = scores + mask.astype(work)  # (B, H, T, S)
    scores = np.where(allowed, scores, -np.inf)  # (B, H, T, S)
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, H, T, 1)
    if sinks is not None:
        sink = forward._sink_logits(sinks.astype(work), row_max, call.H)  # (B, H, T, 1)
        row_max = np.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = np.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    sink_weights = None
    if sinks is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            p_sink = np.exp(sink - row_max)  # (B, H, T, 1)
        row_sum = row_sum + p_sink  # (B, H, T, 1)
    # A row that reads +inf or NaN becomes NaN here (inf / inf), as in the forward; one
    # that reads +inf, every weight of it (SPEC §4.1).
    divisor = np.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, 1)
    divisor = np.where(row_sum == np.inf, np.nan, divisor)  # (B, H, T, 1)
    with np.errstate(invalid="ignore"):
        weights = p / divisor  # (B, H, T, S)
        if sinks is not None:
            sink_weights = p_sink / divisor  # (B, H, T, 1)
    if sinks is not None:
        bad = np.isnan(sink) | (sink == np.inf)  # (B, H, T, 1): NaN rows, as in the forward
        weights = np.where(bad, np.nan, weights)  # (B, H, T, S)
        sink_weights = np.where(bad, np.nan, sink_weights)  # (B, H, T, 1)
    out = np.einsum("bhts,bhse->bhte", weights, v)  # (B, H, T, E)
    return k, v, used, raw, weights, sink_weights, out


def _sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Undo broadcasting: sum x over the axes along which an array of ``shape`` was broadcast."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))  # drop the leading axes
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def linear_backward(
    x: np.ndarray, weight: np.ndarray, d_y: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of y = x Wᵀ + b: (dx, dW, db) for x (..., in), W (out, in), dy (..., out)."""
    d_x = d_y @ weight  # (..., in)
    d_weight = d_y.reshape(-1, d_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, in)
    d_bias = d_y.reshape(-1, d_y.shape[-1]).sum(axis=0)  # (out,)
    return d_x, d_weight, d_bias


def layer_norm_backward(
    x: np.ndarray, weight: np.ndarray, d_y: np.ndarray, eps: float = 1e-5
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``layer_norm``: (dx, dweight, dbias) for x, dy (..., C).

    With x̂ = (x − mean) / σ, y = x̂·w + b: the gradient reaching x̂ is dx̂ = dy·w, and
    because the mean and σ depend on every x of the row, dx = (dx̂ − mean(dx̂) −
    x̂·mean(dx̂·x̂)) / σ: the part of dx̂ that would shift or stretch the row is removed.
    """
    mean = x.mean(axis=-1, keepdims=True)  # (..., 1)
    sigma = np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    x_hat = (x - mean) / sigma  # (..., C)
    d_x_hat = d_y * weight  # (..., C)
    d_x = (
        d_x_hat
        - d_x_hat.mean(axis=-1, keepdims=True)
        - x_hat * (d_x_hat * x_hat).mean(axis=-1, keepdims=True)
    ) / sigma  # (..., C)
    rows = d_y.reshape(-1, d_y.shape[-1])  # (N, C)
    d_weight = (rows * x_hat.reshape(rows.shape)).sum(axis=0)  # (C,)
    return d_x, d_weight, rows.sum(axis=0)


def gelu_backward(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """Gradient of the exact GELU, x·Φ(x): dy · (Φ(x) + x·φ(x))."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))  # Φ(x)
    pdf = np.exp(-0.5 * x.astype(np.float64) ** 2) / math.sqrt(2.0 * math.pi)  # φ(x)
    return (d_y * (cdf + x * pdf)).astype(x.dtype)


def multi_head_attention_backward(
    params: dict[str, np.ndarray],
    x: np.ndarray,
    d_out: np.ndarray,
    *,
    n_heads: int,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Gradients of ``multi_head_attention``: (dx, {parameter name: gradient}).

    The forward's four steps in reverse: out_proj, merge heads, attention, split heads and
    the fused projection. A float mask's gradient is not returned (it is no parameter).
    """
    x = np.asarray(x)
    B, T, C, H, D = contract.check_module_input(x, n_heads)

    # Forward steps 1-3 again, keeping their inputs.
    qkv = forward.linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
    q, k, v = (
        part.reshape(B, T, H, D).transpose(0, 2, 1, 3) for part in np.split(qkv, 3, axis=-1)
    )  # 3 × (B, H, T, D)
    context = forward.attention(q, k, v, mask=mask, is_causal=is_causal)  # (B, H, T, D)
    context = context.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)

    # 4'. out_proj, then un-merge the heads: the merge was a reshape, so is its gradient.
    d_context, d_w_out, d_b_out = linear_backward(context, params["out_proj.weight"], d_out)
    d_context = d_context.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)

    # 3'. Attention in every head at once.
    grads = attention_backward(q, k, v, d_context, mask=mask, is_causal=is_causal)
    d_q, d_k, d_v = grads[:3]  # 3 × (B, H, T, D)

    # 2'. and 1'. Heads back into the width, q, k, v side by side, then the projection.
    d_qkv = np.concatenate(
        [g.transpose(0, 2, 1, 3).reshape(B, T, C) for g in (d_q, d_k, d_v)], axis=-1
    )  # (B, T, 3C)
    d_x, d_w_qkv, d_b_qkv = linear_backward(x, params["qkv.weight"], d_qkv)
    return d_x, {
        "qkv.weight": d_w_qkv,
        "qkv.bias": d_b_qkv,
        "out_proj.weight": d_w_out,
        "out_proj.bias": d_b_out,
    }


def gpt_block_backward(
    params: dict[str, np.ndarray], x: np.ndarray, d_out: np.ndarray, *, n_heads: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Gradients of ``gpt_block``: (dx, {parameter name: gradient}).

    Each residual connection x + f(x) passes the gradient straight through and adds f's
    backward, which is why deep pre-LN stacks keep their gradients alive.
    """
    attn = {name[5:]: p for name, p in params.items() if name.startswith("attn.")}
    # Forward again, keeping every sublayer's input.
    h1 = forward.layer_norm(x, params["norm1.weight"], params["norm1.bias"])  # (B, T, C)
    x1 = x + forward.multi_head_attention(attn, h1, n_heads=n_heads, is_causal=True)  # (B, T, C)
    h2 = forward.layer_norm(x1, params["norm2.weight"], params["norm2.bias"])  # (B, T, C)
    u = forward.linear(h2, params["mlp.0.weight"], params["mlp.0.bias"])  # (B, T, F)
    g = forward.gelu(u)  # (B, T, F)

    # MLP sublayer: out = x1 + mlp(norm2(x1)).
    d_g, d_w2, d_b2 = linear_backward(g, params["mlp.2.weight"], d_out)  # d_g (B, T, F)
    d_u = gelu_backward(u, d_g)  # (B, T, F)
    d_h2, d_w1, d_b1 = linear_backward(h2, params["mlp.0.weight"], d_u)  # d_h2 (B, T, C)
    d_x1, d_n2w, d_n2b = layer_norm_backward(x1, params["norm2.weight"], d_h2)
    d_x1 = d_out + d_x1  # (B, T, C)

    # Attention sublayer: x1 = x + mha(norm1(x)).
    d_h1, d_attn = multi_head_attention_backward(attn, h1, d_x1, n_heads=n_heads, is_causal=True)
    d_x, d_n1w, d_n1b = layer_norm_backward(x, params["norm1.weight"], d_h1)
    d_x = d_x1 + d_x  # (B, T, C)
    return d_x, {
        **{f"attn.{name}": grad for name, grad in d_attn.items()},
        "norm1.weight": d_n1w,
        "norm1.bias": d_n1b,
        "norm2.weight": d_n2w,
        "norm2.bias": d_n2b,
        "mlp.0.weight": d_w1,
        "mlp.0.bias": d_b1,
        "mlp.2.weight": d_w2,
        "mlp.2.bias": d_b2,
    }


def attention_paged_backward(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_paged`` with respect to q and the pages (SPEC §19.4).

    The forward gathers each sequence's keys from its pages and attends them; so the
    backward attends back (``attention_backward`` on the gathered keys, under the same
    mask), and scatters each gathered key's gradient to the slot it was read from. A gather
    is a copy, and the transpose of a copy is a sum: a page that two sequences share (a
    common prefix) collects both gradients, and a slot no sequence reads gets exactly 0.

    Args:
      q, k_pages, v_pages, block_table, seq_lens, is_causal, scale, window, softcap: as
        for ``attention_paged``.
      d_out: ∂L/∂out, (B, H, T, E), same dtype as q.

    Returns:
      (dq, dk_pages, dv_pages): (B, H, T, D), (N, K, L, D), (N, K, L, E), same dtype as q.
    """
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k_pages, v_pages = np.asarray(q), np.asarray(k_pages), np.asarray(v_pages)
    block_table, seq_lens, d_out = np.asarray(block_table), np.asarray(seq_lens), np.asarray(d_out)
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
    L, M = call.L, call.M

    # 1'-3'. The forward's gather and mask, and the backward of attention under them.
    k, v = forward._gather_pages(k_pages, v_pages, block_table, call)  # (B, K, S, ·)
    allowed = forward._paged_allowed(seq_lens, call)  # (B, 1, T, S)
    dq, dk, dv = attention_backward(
        q, k, v, d_out, mask=allowed, scale=call.scale, softcap=call.softcap
    )  # (B, H, T, D), (B, K, S, D), (B, K, S, E)

    # 1'. The gather's transpose: each read slot's gradient added to the slot it came
    # from, in the working precision and rounded once; slots no sequence reads stay 0.
    work = np.float64 if q.dtype == np.float64 else np.float32
    s = np.arange(M * L)  # (S,)
    read = s[None, :] < seq_lens.astype(np.int64)[:, None]  # (B, S)
    b_idx, s_idx = np.nonzero(read)  # (R,), (R,): every slot some sequence reads
    page = block_table.astype(np.int64)[b_idx, s_idx // L]  # (R,)
    slot = s_idx % L  # (R,)
    grads = [dq]
    for pages, d in ((k_pages, dk), (v_pages, dv)):
        total = np.zeros(pages.shape, dtype=work)  # (N, K, L, ·)
        rows = d.transpose(0, 2, 1, 3)[b_idx, s_idx].astype(work)  # (R, K, ·)
        np.add.at(total, (page, slice(None), slot), rows)  # (N, K, L, ·)
        grads.append(total.astype(q.dtype))
    return tuple(grads)
