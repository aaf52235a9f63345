"""PyTorch's SDPA on CUDA, one fused backend at a time: the functions the ``gpu/torch.sdpa.*``
profiles call (SPEC §13.20).

``torch.nn.functional.scaled_dot_product_attention`` picks a kernel per call among its
backends; ``torch.nn.attention.sdpa_kernel`` restricts the choice to one, so that each
profile judges one kernel, as PyTorch's own tests do. A call the chosen backend cannot
run raises PyTorch's "No available kernel" error: a failure of that test, never a
silent fall back to another kernel. Everything else is SDPA's own call, its arguments as
they are.

``unavailable(name)`` measures, on a tiny float16 call on ``cuda``, whether the backend
runs here: None, or what PyTorch raised (no CUDA device, a GPU too old for the flash
kernel, a build without cuDNN's attention).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _with(backend: SDPBackend):
    def attention(q, k, v, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):  # fmt: skip
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa,
            )  # fmt: skip

    attention.__name__ = attention.__qualname__ = backend.name.lower()
    return attention


flash = _with(SDPBackend.FLASH_ATTENTION)
efficient = _with(SDPBackend.EFFICIENT_ATTENTION)
cudnn = _with(SDPBackend.CUDNN_ATTENTION)
math = _with(SDPBackend.MATH)


@functools.cache
def unavailable(name: str) -> str | None:
    """None where the backend ``name`` (flash, efficient, cudnn, math) runs on ``cuda``
    here; otherwise why, as measured on a tiny call."""
    if not torch.cuda.is_available():
        return (
            f"no CUDA device here (torch {torch.__version__}: torch.cuda.is_available() is False)"
        )
    x = torch.zeros(1, 1, 16, 64, dtype=torch.float16, device="cuda")  # (B, H, T, D)
    try:
        globals()[name](x, x, x)
        torch.cuda.synchronize()
    except Exception as err:  # whatever PyTorch raises is the measurement
        return f"measured here (torch {torch.__version__}): {type(err).__name__}: {err}"
    return None


def flash_unavailable() -> str | None:
    return unavailable("flash")


def efficient_unavailable() -> str | None:
    return unavailable("efficient")


def cudnn_unavailable() -> str | None:
    return unavailable("cudnn")


def math_unavailable() -> str | None:
    return unavailable("math")
