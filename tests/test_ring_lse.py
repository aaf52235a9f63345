"""The context-parallel backends' log-sum-exp (SPEC §21, §22.11): the rings merge their
blocks' partial states (o, m, l) with their framework's ``merge.py`` and give the merged
lse back with ``return_lse=True``; Ulysses takes it on the rank that holds the row's head,
as the core page does, and sends it back with the output. Held here against the oracle
with §21.3's rule (the naive log-sum-exp's error and the floor), in both layouts, on a
call that crosses every rank: sinks, GQA, causality and a bool mask with a row of no key
(lse -inf)."""

from __future__ import annotations

import numpy as np
import pytest

from conformance import load_backend
from conformance.backends import numpy_dtype
from conformance.suite.helpers import random_qkv
from conformance.suite.lse import oracle_lse_and_tolerance
from conformance.suite.tolerance import assert_within

pytestmark = pytest.mark.clause("22.11")

CONTEXT_PARALLEL = ["torch-ring", "torch-ulysses", "jax-ring", "jax-ulysses"]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("name", CONTEXT_PARALLEL)
def test_the_context_parallel_backends_give_the_lse(name, dtype, layout):
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
