"""An FP8 attention kernel's forward, written the way FlashAttention-3 runs it, checked
against SPEC §20 through a profile.

The call is FlashAttention-3's: q, k, v in float8_e4m3fn and the (B, T, H, D) layout,
float32 descales of shape (B, K) under ``q_descale``, ``k_descale``, ``v_descale``,
``causal`` and ``softmax_scale``. The body is the kernel's algorithm in plain torch on
the CPU: key tiles of 64, the online softmax with a running maximum m, P = exp(s − m) · 2⁸
rounded to e4m3 at each tile's running maximum, the row sum from the float32 P, and v's
descale at the end. ``examples/fp8_attention.toml`` describes it to the suite (formats,
granularity, descale keywords, P pipeline); the suite makes the codes and descales
itself. Run from the repository root:

    pytest --pyargs conformance --impl-profile examples/fp8_attention.toml

Shapes: q (B, T, H, D), k (B, S, K, D), v (B, S, K, E); descales (B, K); out (B, T, H, E).
"""

from __future__ import annotations

import math

import torch

TILE = 64


def fp8_attention(q, k, v, *, q_descale, k_descale, v_descale, causal=False, softmax_scale=None):
    """FlashAttention-3's FP8 forward on the CPU: out (B, T, H, E) float32."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    scale = 1 / math.sqrt(D) if softmax_scale is None else softmax_scale
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # (B, H|K, T|S, D|E), exact
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    head_descale = (q_descale * k_descale).repeat_interleave(G, dim=1)[..., None, None]
    m = torch.full((B, H, T, 1), -torch.inf)
    row_sum = torch.zeros((B, H, T, 1))
    acc = torch.zeros((B, H, T, v.shape[-1]))
    for start in range(0, S, TILE):
        s = (q @ k[:, :, start : start + TILE].transpose(-1, -2)) * (scale * head_descale)
        if causal:  # bottom-right, as FlashAttention's causal is
            t = torch.arange(T)[:, None] + S - T
            s = s.masked_fill(torch.arange(start, start + s.shape[-1])[None, :] > t, -torch.inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        alpha = torch.exp(torch.where(torch.isfinite(m), m - safe, -torch.inf))
        p = torch.exp(s - safe)
        row_sum = row_sum * alpha + p.sum(-1, keepdim=True)
        p8 = (p * 256).to(torch.float8_e4m3fn).float()
        acc = acc * alpha + p8 @ v[:, :, start : start + TILE]
        m = m_new
    v_scale = v_descale.repeat_interleave(G, dim=1)[..., None, None]
    out = acc / 256 / torch.where(row_sum > 0, row_sum, 1.0) * v_scale
    return out.transpose(1, 2)
