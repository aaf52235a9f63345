"""A model library's attention function, checked against the spec through a profile.

Model code rarely calls ``scaled_dot_product_attention(q, k, v, is_causal=True)``. Its
attention layers call a function like ``eager_attention_forward`` below, written the way
widely used model libraries write their "eager" path: the layer object comes first, the
causal and padding masks arrive as one additive float mask (0 where a key may be seen,
the dtype's most negative number where not), the scale is ``scaling``, and the output is
returned in the (B, T, H, E) layout, together with the weights.

``examples/model_attention.toml`` describes it to the suite: causality through the mask
(``[forms] causal = "mask"``), the mask's blocked value, the scale's keyword. The one thing
TOML cannot say is the calling convention (a module first, a tuple back, another layout),
so ``attend`` adapts it: four lines, and nothing of the math. Run from the repository root:

    pytest --pyargs conformance --impl-profile examples/model_attention.toml

Shapes: query (B, H, T, D), key (B, K, S, D), value (B, K, S, E); H = K · G.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def eager_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """The eager attention of a decoder layer: (out (B, T, H, E), weights (B, H, T, S))."""
    G = module.num_key_value_groups
    key = key.repeat_interleave(G, dim=1)  # (B, H, S, D)
    value = value.repeat_interleave(G, dim=1)  # (B, H, S, E)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        weights = weights + attention_mask  # (B, H, T, S)
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)  # (B, H, T, S)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value)  # (B, H, T, E)
    return out.transpose(1, 2).contiguous(), weights  # (B, T, H, E), (B, H, T, S)


def attend(q, k, v, attention_mask=None, scaling=None):
    """The adapter: the call a decoder layer makes, and its output back in (B, H, T, E)."""
    layer = SimpleNamespace(num_key_value_groups=q.shape[-3] // k.shape[-3], training=False)
    out, _ = eager_attention_forward(layer, q, k, v, attention_mask, scaling=scaling)
    return out.transpose(1, 2)  # (B, H, T, E)
