"""``torch.compile`` of attention, as PyTorch users compile it: the adapter the
``torch.compile.sdpa`` and ``torch.compile.textbook`` profiles call.

Two functions, each compiled once with ``torch.compile`` (inductor, the default backend):

- ``sdpa``: a call of ``torch.nn.functional.scaled_dot_product_attention``, the path of
  model code that calls PyTorch's fused attention (inductor lowers it to its CPU
  flash-attention template where it applies);
- ``textbook``: the four lines every course writes (scores, scale, mask, softmax, weighted
  sum; nanoGPT's causal ``masked_fill`` with -inf), which inductor's pattern matcher may
  rewrite into the fused op.

The compiled function is called as users call it, with torch tensors; dynamo compiles
each new signature (dtypes, ranks, which keywords are given, their values) and, from the
second shape on, a shape-generic program. Past dynamo's recompile limit (8 by default) a
compiled function silently runs eagerly, which would measure eager PyTorch under
torch.compile's name: the limit is lifted for these two functions' process.
"""

from __future__ import annotations

import functools
import math


@functools.cache
def _compile(func):
    import torch
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 1 << 20
    return torch.compile(func)


def _sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip


def _textbook(query, key, value, attn_mask=None, is_causal=False, scale=None):
    import torch

    T, S, D = query.shape[-2], key.shape[-2], query.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * scale  # (B, H, T, S)
    if is_causal:
        causal = torch.ones(T, S, dtype=torch.bool, device=query.device).tril()  # (T, S)
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    return scores.softmax(dim=-1) @ value  # (B, H, T, E)


def sdpa(query, key, value, **keywords):
    """``torch.compile(F.scaled_dot_product_attention)``'s call, keywords as SDPA's."""
    return _compile(_sdpa)(query, key, value, **keywords)


def textbook(query, key, value, **keywords):
    """``torch.compile`` of the textbook attention: scores, mask, softmax, weighted sum."""
    return _compile(_textbook)(query, key, value, **keywords)
