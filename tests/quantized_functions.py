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


def _per_head(codes, descale):
    """codes (B, N, S, D) × a (B, K) descale, K dividing N, in float32 (exact: see §20.1)."""
    B, N = codes.shape[:2]
    d = np.repeat(np.asarray(descale, np.float64), N // descale.shape[1], axis=1)  # (B, N)
    return (codes.astype(np.float64) * d[:, :, None, None]).astype(np.float32)


def lifted(
    q, k, v, *, q_descale, k_descale, v_descale, causal=False, sm_scale=None,
    lift=448.0, tile=None, p_format="float8_e4m3fn", accumulator=np.float32,
):  # fmt: skip
    """An FP8 forward with FlashAttention-3's descales per (batch, key/value head), written
    as kernels are: the keys ``tile`` at a time (all at once for None), the online softmax
    in float32, P = exp(s − m_j) at the tile's running maximum m_j lifted by ``lift``
    (SageAttention's 448, FlashAttention-3's 2⁸) and rounded to ``p_format`` before P·V,
    the row sum from the unrounded P, P·V kept in ``accumulator``. Causal bottom-right."""
    import ml_dtypes

    f32 = np.float32
    rounded = getattr(ml_dtypes, p_format)
    qd, kd, vd = _per_head(q, q_descale), _per_head(k, k_descale), _per_head(v, v_descale)
    G = qd.shape[1] // kd.shape[1]
    kd, vd = np.repeat(kd, G, axis=1), np.repeat(vd, G, axis=1)  # (B, H, S, D), (B, H, S, E)
    scale = f32(1 / np.sqrt(qd.shape[-1]) if sm_scale is None else sm_scale)
    s = (qd @ np.swapaxes(kd, -1, -2)) * scale  # (B, H, T, S)
    T, S = s.shape[-2:]
    if causal:
        seen = np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T  # (T, S)
        s = np.where(seen, s, -np.inf).astype(f32)
    L = tile or S
    m = np.full(s.shape[:-1] + (1,), -np.inf, f32)  # (B, H, T, 1)
    total = np.zeros_like(m)
    acc = np.zeros(s.shape[:-1] + (vd.shape[-1],), accumulator)  # (B, H, T, E)
    for j in range(0, S, L):
        m_j = np.maximum(m, s[..., j : j + L].max(-1, keepdims=True))
        base = np.where(np.isfinite(m_j), m_j, f32(0))
        with np.errstate(invalid="ignore"):
            alpha = np.where(np.isfinite(m), np.exp(m - base), f32(0)).astype(f32)
        p = np.exp(s[..., j : j + L] - base).astype(f32)  # (B, H, T, L)
        total = total * alpha + p.sum(-1, keepdims=True, dtype=f32)
        p8 = (p * f32(lift)).astype(rounded).astype(f32)
        acc = (acc * alpha).astype(accumulator)
        if accumulator == np.float32:  # the tile's product in one matmul, as an MMA
            acc = acc + p8 @ vd[..., j : j + L, :]
        for i in range(p8.shape[-1] if accumulator != np.float32 else 0):
            acc = (acc + (p8[..., i : i + 1] * vd[..., j + i : j + i + 1, :])).astype(accumulator)
        m = m_j
    return (acc.astype(f32) / f32(lift) / np.where(total > 0, total, f32(1))).astype(f32)


def fp8_output(
    q, k, v, *, q_scale, k_scale, v_scale, causal=False, sm_scale=None, o_scale,
    saturates=True, inverted=False,
):  # fmt: skip
    """Per-tensor scalar scales in, float8_e4m3fn codes out: attention on the dequantised
    operands, divided by the output's descale ``o_scale`` (multiplied, ``inverted``: the
    descale read as a scale) and cast to e4m3, clipped to ±448 first where it
    ``saturates`` (ml_dtypes' cast alone makes NaN past 448)."""
    import ml_dtypes

    q, k, v = (x.astype(np.float64) * s for x, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
    out = _attend(q, k, v, sm_scale, causal)  # (B, H, T, E)
    y = out * o_scale if inverted else out / o_scale
    if saturates:
        y = np.clip(y, -448.0, 448.0)
    return y.astype(ml_dtypes.float8_e4m3fn)


def normalised_p(q, k, v, *, q_descale, k_descale, v_descale, sm_scale=None):
    """P normalised by the row sum, then rounded to float8_e4m3fn with no lift, before
    P·V: every weight below 2⁻¹⁰ rounds to 0 (FlashInfer #5020). FlashAttention-3's
    per-head descales."""
    import ml_dtypes

    f32 = np.float32
    qd, kd, vd = _per_head(q, q_descale), _per_head(k, k_descale), _per_head(v, v_descale)
    G = qd.shape[1] // kd.shape[1]
    kd, vd = np.repeat(kd, G, axis=1), np.repeat(vd, G, axis=1)  # (B, H, S, D), (B, H, S, E)
    scale = f32(1 / np.sqrt(qd.shape[-1]) if sm_scale is None else sm_scale)
    s = (qd @ np.swapaxes(kd, -1, -2)) * scale  # (B, H, T, S)
    p = np.exp(s - s.max(-1, keepdims=True))
    p8 = (p / p.sum(-1, keepdims=True)).astype(ml_dtypes.float8_e4m3fn).astype(f32)
    return p8 @ vd  # (B, H, T, E)
