"""Planted torch functions for the device tests (SPEC §13.20): one whose output changes in
its last bit from call to call, as a kernel that adds in a different order each time does,
and one that fails as CUDA does after an illegal memory access."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

_CALLS = itertools.count()


def nondeterministic(q, k, v, *, is_causal=False, scale=None):
    """SDPA, with one ulp added to every output entry on every other call."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    if next(_CALLS) % 2:
        return torch.nextafter(out, torch.full_like(out, float("inf")))
    return out


def deterministic(q, k, v, *, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


#: Whether this process's "device" has seen an illegal memory access: CUDA's error is
#: sticky, so every later call in the same process fails too, as on a GPU.
_LOST = {"state": False}
CUDA_ERROR = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect."
)


def illegal_access(q, k, v, *, is_causal=False, scale=None):
    """SDPA, except that a causal call with T = 13 makes an illegal memory access: it and
    every call after it in the same process raise CUDA's RuntimeError."""
    if is_causal and q.shape[-2] == 13:
        _LOST["state"] = True
    if _LOST["state"]:
        raise RuntimeError(CUDA_ERROR)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
