"""torch-ring's log-sum-exp (SPEC §21, §22): the ring merges its blocks' partial states with
``impls/torch/merge.py`` and gives the merged lse back with ``return_lse=True``. Held here
against the oracle with §7's rule (the naive log-sum-exp's error, and the floor) until the
lse's own clauses run on it; the output beside it is the one the whole spec judges."""

from __future__ import annotations

import numpy as np
import pytest
from conformance.fixtures import oracle
from conformance.fixtures.oracle import naive_lse_same_precision

from conformance import load_backend
from conformance.backends import numpy_dtype
from conformance.suite.helpers import random_qkv
from conformance.suite.tolerance import assert_within, finite_error, tolerance

pytestmark = pytest.mark.clause("22.11")


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_torch_ring_gives_the_lse(dtype, layout):
    """Sinks, GQA and a bool mask with a row of no key (lse -inf), on 3 ranks."""
    q, k, v = random_qkv(97, B=2, H=4, K=2, T=7, S=13, D=5, dtype=dtype)
    mask = np.random.default_rng(98).random((7, 13)) < 0.6
    mask[2] = False
    sinks = np.array([0.5, -1.0, 2.0, 0.0]).astype(numpy_dtype(dtype))
    options = {"mask": mask, "sinks": sinks, "is_causal": True}
    out, lse = load_backend("torch-ring", shards=3, layout=layout).attention(
        q, k, v, return_lse=True, **options
    )
    wide = {**options, "sinks": sinks.astype(np.float64)}
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    expected, expected_lse = oracle.attention(q64, k64, v64, return_lse=True, **wide)
    naive = naive_lse_same_precision(q64, k64, v64, numpy_dtype(dtype), **wide)
    assert lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert lse.shape == (2, 4, 7) and out.shape == (2, 4, 7, 5)
    lse_dtype = "float64" if dtype == "float64" else "float32"
    tol = tolerance(lse_dtype, finite_error(naive, expected_lse), expected_lse)
    assert_within(lse, expected_lse, tol, f"torch-ring lse ({dtype}, {layout})")


def test_torch_ulysses_does_not_declare_the_lse():
    """Ulysses' ranks do not give the lse back: refused by name (SPEC §8.5)."""
    backend = load_backend("torch-ulysses", shards=2)
    assert "lse" not in backend.capabilities
    q, k, v = random_qkv(99, B=1, H=2, T=3, S=3, D=2)
    with pytest.raises(NotImplementedError, match="lse"):
        backend.attention(q, k, v, return_lse=True)
