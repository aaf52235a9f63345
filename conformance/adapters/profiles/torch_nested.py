"""Packed documents through PyTorch's nested jagged tensors: the function the
``torch.sdpa`` profile calls for ``attention_packed`` (SPEC §18).

PyTorch's answer to documents of unequal length is the jagged layout: the packed tokens
stay as they are, and ``torch.nested.nested_tensor_from_jagged(values, offsets)`` marks
where each document ends, the ``offsets`` being exactly the spec's cumulative lengths.
``F.scaled_dot_product_attention`` takes such tensors, (N, H, j, D) after the transpose
that puts the heads before the ragged axis, as PyTorch's nested-tensor tutorial writes
it. This file does only that: the boundaries go in as the offsets, the keywords
(``is_causal``, ``scale``, the profile's ``enable_gqa``) are SDPA's own, and the output's
values come back as they are. What SDPA refuses on nested tensors (causality, GQA) it
refuses here.

Layout: the profile's, heads first: q (H, T, D), k (K, S, D), v (K, S, E).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **keywords):
    """out (H, T, E) for q (H, T, D), k (K, S, D), v (K, S, E) holding the documents
    cu_seqlens_q and cu_seqlens_k (N + 1,) delimit, by SDPA on nested jagged tensors."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return F.scaled_dot_product_attention(q, k, v, **keywords)
    # The values token-major, (T, H, D), and contiguous: SDPA refuses nested inputs that
    # are not contiguous after the transpose ("No viable backend").
    nested = [
        torch.nested.nested_tensor_from_jagged(
            x.transpose(0, 1).contiguous(), offsets=offsets
        ).transpose(1, 2)
        for x, offsets in ((q, cu_seqlens_q), (k, cu_seqlens_k), (v, cu_seqlens_k))
    ]  # (N, H, j, D), (N, K, j, D), (N, K, j, E)
    out = F.scaled_dot_product_attention(*nested, **keywords)  # (N, H, j, E)
    return out.transpose(1, 2).values().transpose(0, 1)  # (H, T, E)
