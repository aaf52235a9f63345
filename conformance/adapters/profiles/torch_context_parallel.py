"""PyTorch's own context parallelism as the spec's options: the adapter the
``torch.context_parallel`` profile calls.

``torch.distributed.tensor.experimental.context_parallel`` shards the buffers it is given
along the sequence over a ``DeviceMesh`` and, inside its context, sends
``scaled_dot_product_attention`` to a ring implementation on DTensors. This file does what
PyTorch's documentation shows, and nothing else: a one-dimensional mesh over the default
process group, q, k and v as the buffers (sequence dimension 2), SDPA with ``is_causal``
and ``scale`` inside the context, and ``context_parallel_unshard`` to gather the output.

Where it runs. PyTorch implements the sharded SDPA only for its CUDA kernels. On a CPU,
with gloo, the call fails; measured here (torch 2.13.0): ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered``. ``unavailable()`` makes that measurement on a tiny call, so the
profile is skipped by name on a machine without CUDA, with what PyTorch raised there.

With CUDA, a process without a process group creates one of a single rank (nccl), so the
ring has one device; under ``torchrun --nproc-per-node N`` the mesh spans the N ranks,
each running the same tests on the same inputs. This project's machines have no CUDA:
neither has been run here.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False, scale=None
) -> torch.Tensor:
    """out (B, H, T, E) for q (B, H, T, D), k, v (B, H, S, ·), by context_parallel's SDPA."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    mesh = _mesh()
    device = mesh.device_type
    # context_parallel shards its buffers in place: hand it copies on the mesh's device.
    q, k, v = (x.to(device).clone() for x in (q, k, v))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    (out,) = context_parallel_unshard(mesh, [out], [2])
    return out.cpu()


@functools.cache
def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    return init_device_mesh(device, (dist.get_world_size(),))


@functools.cache
def unavailable() -> str | None:
    """None where context_parallel's SDPA runs here; otherwise what it raised on a tiny
    causal call (measured, not assumed)."""
    x = torch.zeros(1, 1, 4, 2)
    ours = not dist.is_initialized()
    try:
        attention(x, x, x, is_causal=True)
    except Exception as err:  # whatever PyTorch raises is the measurement
        if ours and dist.is_initialized():
            dist.destroy_process_group()  # the group made for the probe serves nothing now
            _mesh.cache_clear()
        where = "CUDA" if torch.cuda.is_available() else "CPU, gloo"
        return f"measured here (torch {torch.__version__}, {where}): {type(err).__name__}: {err}"
    return None
