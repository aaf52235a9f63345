"""The blockwise backends at their default tile sizes.

The conformance suite runs numpy-flash and jax-flash with tiny tiles, so that its small,
odd-sized cases cross many tiles. These tests cover what only shows at scale: the default
tiles on a problem several tiles long, that no (T, S) array is ever allocated, and that
tiles a causal mask blocks entirely are skipped.
"""

from __future__ import annotations

import tracemalloc

import jax
import numpy as np
import pytest
from conformance.impls import jax_flash, numpy_attention, numpy_flash

from conformance.helpers import random_qkv, random_tolerance
from conformance.tolerance import assert_within

OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bottom-right-window": {
        "is_causal": True,
        "causal_alignment": "bottom_right",
        "window": (300, None),
    },
}


@pytest.mark.parametrize("impl", [numpy_flash, jax_flash], ids=["numpy-flash", "jax-flash"])
@pytest.mark.parametrize("setup", list(OPTIONS))
def test_default_tiles_match_the_reference(impl, setup):
    """T = 1100 and S = 1300 span three default tiles, the last ones partial."""
    jax.config.update("jax_enable_x64", True)
    q, k, v = random_qkv(50, B=1, H=4, K=2, T=1100, S=1300, D=16, E=8, dtype="float32")
    options = OPTIONS[setup]
    out = np.asarray(impl.attention(q, k, v, **options))
    ref = numpy_attention.attention(q, k, v, **options)
    tol = 2 * random_tolerance(q, k, v, "float32", **options)
    assert_within(out, ref, tol, f"{impl.__name__} with default tiles ({setup})")


def test_numpy_flash_never_allocates_a_score_matrix():
    """Peak allocation during a call stays far below one (T, S) float32 matrix: it is set
    by the tiles, not by T and S."""
    T = S = 4096
    q, k, v = random_qkv(51, B=1, H=1, T=T, S=S, D=16, dtype="float32")
    tracemalloc.start()
    try:
        numpy_flash.attention(q, k, v, is_causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one_matrix = T * S * 4
    assert peak < one_matrix / 8, (
        f"peak {peak / 2**20:.1f} MiB vs one (T, S) matrix {one_matrix / 2**20:.1f} MiB"
    )


def test_numpy_flash_skips_fully_masked_tiles(monkeypatch):
    """Causal attention on n × n tiles computes the n(n+1)/2 tiles on or below the diagonal."""
    calls = []
    real = np.matmul

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    q, k, v = random_qkv(52, B=1, H=1, T=2048, S=2048, D=8, dtype="float32")
    monkeypatch.setattr(numpy_flash.np, "matmul", counting)
    numpy_flash.attention(q, k, v, block_q=512, block_k=512)
    full = len(calls)
    calls.clear()
    numpy_flash.attention(q, k, v, is_causal=True, block_q=512, block_k=512)
    n = 2048 // 512
    assert full == 2 * n * n, f"{full} matmuls without a mask, expected {2 * n * n}"
    assert len(calls) == 2 * n * (n + 1) // 2, (
        f"{len(calls)} matmuls under causal, expected {n * (n + 1)}"
    )
