"""PyTorch's CPU flash operator as a function: the one the ``torch.flash_attention_cpu``
profile calls.

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p,
is_causal, *, attn_mask=None, scale=None)`` is the operator that
``F.scaled_dot_product_attention`` dispatches to on the CPU, and, unlike SDPA, it returns
``(out, logsumexp)``: the log-sum-exp that split-KV decoding and ring attention merge by.
It is reached through ``torch.ops``, not a module attribute, so a profile's
``module:function`` target names this file; the call is the operator's own, its
arguments passed as they are (dropout_p and is_causal positionally, as its schema has
them), its result returned as it is.

Layout: the profile's, heads first: q (B, H, T, D), k (B, K, S, D), v (B, K, S, D) give
out (B, H, T, D) and logsumexp (B, H, T).
"""

from __future__ import annotations

import torch


def attention(q, k, v, *, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    """(out, logsumexp) from the CPU flash operator, as it returns them."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
