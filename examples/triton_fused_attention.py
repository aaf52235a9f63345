"""The forward kernel of Triton's tutorial "Fused Attention", small, for the kit.

Written after ``python/tutorials/06-fused-attention.py`` of Triton
(https://github.com/triton-lang/triton, MIT licence: Copyright 2018-2020 Philippe Tillet,
Copyright 2020-2022 OpenAI; the tutorial credits the OpenAI kernel team, after Tri Dao's
FlashAttention-2, https://tridao.me/publications/flash2/flash2.pdf). It keeps what decides
the tutorial's numbers and drops what decides its speed:

- one length, ``N_CTX = q.shape[2]``, for the queries and the keys, and q's strides for
  k and v as well: the tutorial's kernel is written for T = S;
- the scale folded into base 2 (``sm_scale * log2(e)``, then ``exp2``), the running max
  and sum of FlashAttention-2, one division at the end;
- causality added to the scaled scores as ``where(mask, 0, -1e6)``, on every key block;
- the probabilities cast to float16 before their product with V;
- ``BLOCK_N <= HEAD_DIM``, and no bounds checks: T must be a multiple of both blocks.

Dropped: autotuning (one configuration here, the tutorial's smallest), the tensor
descriptors (TMA) and warp specialisation of Hopper and Blackwell, FP8, the log-sum-exp
it stores for its backward, and the backward. Run it on the CPU with ``TRITON_INTERPRET=1``
set before ``triton`` is imported (docs/test-a-gpu-kernel.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 32


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    sm_scale,
    stride_z,
    stride_h,
    stride_m,
    H,
    N_CTX,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    tl.static_assert(BLOCK_N <= HEAD_DIM)
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    # q's strides for k and v too, as in the tutorial: right only where S = T.
    offset = (off_hz // H).to(tl.int64) * stride_z + (off_hz % H).to(tl.int64) * stride_h
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, HEAD_DIM)  # (D,)
    q = tl.load(Q + offset + offs_m[:, None] * stride_m + offs_d[None, :])  # (BLOCK_M, D)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")  # (BLOCK_M,)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0  # (BLOCK_M,)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # (BLOCK_M, D)
    qk_scale = sm_scale * 1.44269504  # log2(e): exp2 in place of exp
    for start_n in range(0, N_CTX, BLOCK_N):
        keys = start_n + offs_n  # (BLOCK_N,)
        k = tl.load(K + offset + keys[None, :] * stride_m + offs_d[:, None])  # (D, BLOCK_N)
        qk = tl.dot(q, k)  # (BLOCK_M, BLOCK_N)
        if CAUSAL:
            mask = offs_m[:, None] >= keys[None, :]  # (BLOCK_M, BLOCK_N)
            qk = qk * qk_scale + tl.where(mask, 0, -1.0e6)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))  # (BLOCK_M,)
            qk -= m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # (BLOCK_M,)
            qk = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(qk)  # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_ij)  # (BLOCK_M,)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offset + keys[:, None] * stride_m + offs_d[None, :])  # (BLOCK_N, D)
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])  # (BLOCK_M, D)
        m_i = m_ij
    acc = acc / l_i[:, None]
    out = acc.to(Out.type.element_ty)  # (BLOCK_M, D)
    tl.store(Out + offset + offs_m[:, None] * stride_m + offs_d[None, :], out)


def attention(q, k, v, causal=False, sm_scale=None):
    """The tutorial's entry point, forward only: ``attention(q, k, v, causal, sm_scale)``,
    (B, H, T, D) tensors. ``causal`` defaults to False here (the kit passes it only where a
    test sets it); the scale has no default, as in the tutorial."""
    assert sm_scale is not None
    head_dim = q.shape[-1]
    assert head_dim == k.shape[-1] == v.shape[-1]
    assert head_dim in {16, 32, 64, 128, 256}
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)  # (B, H, T, D)
    grid = (triton.cdiv(q.shape[2], BLOCK_M), q.shape[0] * q.shape[1])
    _attn_fwd[grid](
        q,
        k,
        v,
        out,
        sm_scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        q.shape[1],
        q.shape[2],
        HEAD_DIM=head_dim,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        CAUSAL=causal,
    )
    return out
