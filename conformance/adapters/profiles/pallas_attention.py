"""Pallas' attention kernels, as their users call them: the adapter the profiles
``pallas.gpu.mha`` and ``pallas.tpu.flash_attention`` call.

Both kernels are written for a device (a GPU through Triton or Mosaic GPU, a TPU through
Mosaic). On any other machine they run under Pallas' interpreter, which executes the
kernel's program grid point by grid point with the same block shapes: ``interpret=True``
for the GPU kernel, TPU interpret mode (``pltpu.force_tpu_interpret_mode()``, around its
forward and its backward) for the TPU one. On the device
they were written for, the same call runs compiled: nothing here needs one.

What the adapter supplies is what every caller of these kernels writes:

- the block sizes, fixed, so that the kernel's domain is the profile's: 16 × 16 tiles for
  the GPU kernel (T and S multiples of 16), query blocks of 16 and key blocks of 128 for
  the TPU kernel (its key blocks must be multiples of 128);
- nothing for the scale: both kernels' ``sm_scale`` defaults to 1.0, not the spec's
  1/sqrt(D), so their profiles say ``[call] scale = "always"`` and every call comes with
  one (1/sqrt(D) where the test sets none);
- the TPU kernel's bias ``ab`` of shape (B, H, T, S), broadcast from the spec's mask.

Nothing else is converted: no NaN is cleaned, no dtype raised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

#: The tile of the GPU kernel: T and S must be multiples of it (``mha`` checks).
GPU_BLOCK = 16
#: The TPU kernel's query block and key block (the latter a multiple of 128 there).
TPU_BLOCK_Q, TPU_BLOCK_K = 16, 128

_GPU_BLOCKS = gpu_attention.BlockSizes(
    block_q=GPU_BLOCK,
    block_k=GPU_BLOCK,
    block_q_dkv=GPU_BLOCK,
    block_kv_dkv=GPU_BLOCK,
    block_q_dq=GPU_BLOCK,
    block_kv_dq=GPU_BLOCK,
)
_TPU_BLOCKS = tpu_attention.BlockSizes(
    block_q=TPU_BLOCK_Q,
    block_k_major=TPU_BLOCK_K,
    block_k=TPU_BLOCK_K,
    block_b=1,
    block_q_major_dkv=TPU_BLOCK_Q,
    block_k_major_dkv=TPU_BLOCK_K,
    block_k_dkv=TPU_BLOCK_K,
    block_q_dkv=TPU_BLOCK_Q,
    block_k_major_dq=TPU_BLOCK_K,
    block_k_dq=TPU_BLOCK_K,
    block_q_dq=TPU_BLOCK_Q,
)


def gpu_mha(q, k, v, *, scale: float, is_causal: bool = False):
    """out (B, T, H, E) of ``pallas.ops.gpu.attention.mha`` for q (B, T, H, D), k and v
    (B, S, H, D): interpreted unless a GPU runs it."""
    return gpu_attention.mha(
        q,
        k,
        v,
        None,  # segment_ids
        sm_scale=scale,
        causal=is_causal,
        block_sizes=_GPU_BLOCKS,
        interpret=jax.default_backend() != "gpu",
    )


def gpu_mha_compiled(q, k, v, *, scale: float, is_causal: bool = False):
    """``pallas.ops.gpu.attention.mha`` as ``gpu_mha``, compiled for the GPU
    (``interpret=False``): the ``gpu/pallas.gpu.mha.compiled`` profile, where it fails rather
    than fall back to the interpreter on a machine without one."""
    return gpu_attention.mha(
        q,
        k,
        v,
        None,  # segment_ids
        sm_scale=scale,
        causal=is_causal,
        block_sizes=_GPU_BLOCKS,
        interpret=False,
    )


def tpu_flash_attention(q, k, v, *, scale: float, ab=None, is_causal: bool = False):
    """out (B, H, T, E) of ``pallas.ops.tpu.flash_attention.flash_attention`` for q
    (B, H, T, D), k and v (B, H, S, D), an additive mask ``ab`` broadcast to (B, H, T, S):
    in TPU interpret mode unless a TPU runs it."""
    if ab is not None and q.ndim == 4 and k.ndim == 4:
        ab = jnp.broadcast_to(ab, (*q.shape[:2], q.shape[2], k.shape[2]))  # (B, H, T, S)
    if jax.default_backend() == "tpu":
        return _flash(q, k, v, ab, is_causal, scale)
    return _interpreted(q, k, v, ab, is_causal, scale)


def _flash(q, k, v, ab, causal: bool, sm_scale: float):
    return tpu_attention.flash_attention(
        q, k, v, ab, causal=causal, sm_scale=sm_scale, block_sizes=_TPU_BLOCKS
    )


# TPU interpret mode is a context: the kernel's forward and its own backward (traced when
# the pullback runs, after the call has returned) are both run inside it, so that no
# setting of the process changes.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _interpreted(q, k, v, ab, causal, sm_scale):
    with pltpu.force_tpu_interpret_mode():
        return _flash(q, k, v, ab, causal, sm_scale)


def _interpreted_forward(q, k, v, ab, causal, sm_scale):
    with pltpu.force_tpu_interpret_mode():
        return jax.vjp(lambda *x: _flash(*x, causal, sm_scale), q, k, v, ab)


def _interpreted_backward(causal, sm_scale, pullback, d_out):
    with pltpu.force_tpu_interpret_mode():
        return pullback(d_out)


_interpreted.defvjp(_interpreted_forward, _interpreted_backward)
