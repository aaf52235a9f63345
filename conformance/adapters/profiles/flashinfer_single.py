"""FlashInfer's single-request attention as the spec's batched call: the functions the
``gpu/flashinfer.single_*`` profiles call (SPEC §13.20).

``flashinfer.single_prefill_with_kv_cache(q, k, v, causal=, sm_scale=)`` takes one
request, q (T, H, D), k and v (S, K, D) (``kv_layout="NHD"``, its default) and returns
(T, H, D); ``flashinfer.single_decode_with_kv_cache(q, k, v, sm_scale=)`` takes one query
per head, q (H, D), and returns (H, D). The spec's batch is a loop of single requests
here, the library's call itself unchanged: q (B, T, H, D) in the profile's BTHD layout.
FlashInfer's causal mask is aligned bottom-right (a query sees the keys up to its place
from the end), as a KV cache's is.
"""

from __future__ import annotations

import flashinfer
import torch


def prefill(q, k, v, *, is_causal: bool = False, scale: float | None = None):
    """out (B, T, H, E): one ``single_prefill_with_kv_cache`` per batch element."""
    outs = [
        flashinfer.single_prefill_with_kv_cache(q[b], k[b], v[b], causal=is_causal, sm_scale=scale)
        for b in range(q.shape[0])
    ]  # each (T, H, E)
    return torch.stack(outs)  # (B, T, H, E)


def decode(q, k, v, *, scale: float | None = None):
    """out (B, 1, H, E): one ``single_decode_with_kv_cache`` per batch element, T = 1."""
    outs = [
        flashinfer.single_decode_with_kv_cache(q[b, 0], k[b], v[b], sm_scale=scale)
        for b in range(q.shape[0])
    ]  # each (H, E)
    return torch.stack(outs)[:, None]  # (B, 1, H, E)
