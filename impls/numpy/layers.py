"""The layers attention lives in, as functions of a PyTorch-style ``state_dict``: the
multi-head self-attention layer and a pre-LN GPT block, forward and backward.

    multi_head_attention(x) = out_proj(merge_heads(attention(split_heads(qkv(x)))))
    gpt_block(x)            = x1 + mlp(norm2(x1)),   x1 = x + multi_head_attention(norm1(x))

The parameters are those of the PyTorch modules the suite compares with (``qkv``,
``out_proj``, ``norm1``, ``norm2``, ``mlp.0``, ``mlp.2``), so one ``state_dict`` drives
both. The backward functions walk the same steps in reverse with the chain rule, and call
``backward.attention_backward`` for the attention in the middle; the gradients of the
small pieces (linear, layer norm, GELU) are derived where they are written.

Shape legend: the core page's (``attention.py``), and C model width (C = H·D), F the MLP's
hidden width. x (B, T, C); self-attention, so S = T and K = H.
"""

from __future__ import annotations

import math

import numpy as np

from .. import contract
from .attention import attention
from .backward import attention_backward


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


# --- The backward pass ----------------------------------------------------------------------


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
    qkv = linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
    q, k, v = (
        part.reshape(B, T, H, D).transpose(0, 2, 1, 3) for part in np.split(qkv, 3, axis=-1)
    )  # 3 × (B, H, T, D)
    context = attention(q, k, v, mask=mask, is_causal=is_causal)  # (B, H, T, D)
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
    h1 = layer_norm(x, params["norm1.weight"], params["norm1.bias"])  # (B, T, C)
    x1 = x + multi_head_attention(attn, h1, n_heads=n_heads, is_causal=True)  # (B, T, C)
    h2 = layer_norm(x1, params["norm2.weight"], params["norm2.bias"])  # (B, T, C)
    u = linear(h2, params["mlp.0.weight"], params["mlp.0.bias"])  # (B, T, F)
    g = gelu(u)  # (B, T, F)

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
