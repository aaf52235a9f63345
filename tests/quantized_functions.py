"""Quantized attention functions as libraries write them, for the kit's tests of SPEC §20
(tests/test_quantized.py, tests/test_quantized_kit.py). NumPy in and out, (B, H, T, D).

``per_tensor_bottom_right`` is a correct FP8 function with per-tensor scalar scales and
FlashAttention's causal alignment (the last query sees the last key).
"""

from __future__ import annotations

import numpy as np


def _attend(q, k, v, scale, is_causal):
    """Attention in float64 on dequantised operands, causal bottom-right; a row with no
    key is 0."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # (B, H, S, D), (B, H, S, E)
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    T, S = s.shape[-2:]
    if is_causal:
        seen = np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T  # (T, S)
        s = np.where(seen, s, -np.inf)  # (B, H, T, S)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(s - m)  # (B, H, T, S)
    total = w.sum(-1, keepdims=True)
    return w @ v / np.where(total > 0, total, 1.0)  # (B, H, T, E)


def per_tensor_bottom_right(q, k, v, *, q_scale, k_scale, v_scale, causal=False, sm_scale=None):
    """FlashInfer's scalar scales per tensor, causality bottom-right: the operands
    dequantised (codes × scale), then attention in float64."""
    q, k, v = (x.astype(np.float64) * s for x, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
    return _attend(q, k, v, sm_scale, causal).astype(np.float32)
