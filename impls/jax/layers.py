"""The multi-head self-attention layer and a pre-LN GPT block, as functions of a
PyTorch-style ``state_dict``, on the core page's ``attention``; and their gradients by
``jax.vjp``.

    x (B, T, C) --qkv--> q, k, v (B, H, T, D) --attention--> (B, H, T, D) --out_proj--> (B, T, C)

Shape legend: the core page's, and C = H·D the model width, F the MLP's hidden width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import contract
from .attention import attention


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
