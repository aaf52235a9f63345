"""Ring attention in your own torchrun script: each rank holds one slice of the sequence.

    torchrun --nproc-per-node 4 examples/torch_ring_torchrun.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/torch_ring_torchrun.py

Every rank builds the same full inputs from one seed (only to check the result here: in a
real model each rank would hold only its own slice), keeps its contiguous slice of the
queries, keys and values, and calls ``ring_attention``, the per-rank function the
``impls/torch/ring.py`` page runs in its worker pool. Rank 0 then gathers the slices and compares
them with plain attention on the whole sequence.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist
from conformance.impls.torch.ring import ring_attention


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    P, rank = dist.get_world_size(), dist.get_rank()
    B, H, K, T, D, E = 2, 8, 2, 64 * P, 32, 32  # T a multiple of P: no padding needed here
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, K, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, K, T, E, generator=g, dtype=torch.float64)

    Tl = T // P
    mine = slice(rank * Tl, (rank + 1) * Tl)  # this rank's contiguous slice
    positions = torch.arange(T)
    opts = dict(
        scale=1 / math.sqrt(D), softcap=None, offset=0, lo=-(2**30), hi=0, T=T, S=T, chunk=None
    )
    out = ring_attention(
        q[:, :, mine], k[:, :, mine], v[:, :, mine], positions[mine], positions[mine], None,
        opts=opts, pieces=1,
    )  # fmt: skip  # (B, H, Tl, E), causal

    gathered = [torch.empty_like(out) for _ in range(P)] if rank == 0 else None
    dist.gather(out, gathered, dst=0)
    if rank == 0:
        full = torch.cat(gathered, dim=2)  # (B, H, T, E)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        err = (full - ref).abs().max().item()
        print(f"ring attention on {P} ranks ({backend}): max |ring - SDPA| = {err:.2e}")
        assert err < 1e-12, err
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
