"""The context-parallel backends' log-sum-exp (SPEC §21, §22.11): the rings merge their
blocks' partial states (o, m, l) with their framework's ``merge.py`` and give the merged
lse back with ``return_lse=True``; Ulysses takes it on the rank that holds the row's head,
as the core page does, and sends it back with the output. Held here against the oracle
with §21.3's rule (the naive log-sum-exp's error and the floor), in both layouts, on a
call that crosses every rank: sinks, GQA, causality and a bool mask with a row of no key
(lse -inf)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance import load_backend
from conformance.backends import numpy_dtype
from conformance.suite.helpers import random_qkv
from conformance.suite.lse import oracle_lse_and_tolerance
from conformance.suite.tolerance import assert_within

pytestmark = pytest.mark.clause("22.11")

TORCH = ["torch-ring", "torch-ulysses"]
JAX = ["jax-ring", "jax-ulysses"]
DTYPES = ["float64", "float32", "float16"]
LAYOUTS = ["zigzag", "contiguous"]


def check_lse(name: str, dtype: str, layout: str) -> None:
    """3 ranks, B=2, H=4, K=2, T=7, S=13: uneven slices, padding on the last rank."""
    q, k, v = random_qkv(97, B=2, H=4, K=2, T=7, S=13, D=5, dtype=dtype)
    mask = np.random.default_rng(98).random((7, 13)) < 0.6
    mask[2] = False
    sinks = np.array([0.5, -1.0, 2.0, 0.0]).astype(numpy_dtype(dtype))
    options = {"mask": mask, "sinks": sinks, "is_causal": True}
    backend = load_backend(name, shards=3, layout=layout)
    assert "lse" in backend.capabilities
    out, lse = backend.attention(q, k, v, return_lse=True, **options)
    _, expected, tol = oracle_lse_and_tolerance(q, k, v, dtype, **options)
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert lse.shape == (2, 4, 7) and out.shape == (2, 4, 7, 5)
    assert np.isneginf(lse[:, :, 2]).all()
    assert_within(lse, expected, tol, f"{name} lse ({dtype}, {layout})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", TORCH)
def test_the_torch_context_parallel_backends_give_the_lse(name, dtype, layout):
    check_lse(name, dtype, layout)


@pytest.mark.parametrize("name", JAX)
def test_the_jax_context_parallel_backends_give_the_lse(name):
    """The same, in a process of its own: JAX's host devices are set before it starts,
    which a test process where JAX already runs on one device cannot do."""
    pytest.importorskip("jax")
    code = (
        "import jax; jax.config.update('jax_num_cpu_devices', 8); "
        "jax.config.update('jax_enable_x64', True); "
        "from test_ring_lse import check_lse; "
        f"[check_lse({name!r}, d, lay) for d in {DTYPES!r} for lay in {LAYOUTS!r}]"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
