"""The oracle itself: checked against closed forms and an independent float64 computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conformance.fixtures import oracle


@pytest.mark.clause("11.1")
def test_worked_example_closed_form():
    """Causal row 1 of the seeds' example: keys 0 and 1, scores 0 and 1/√2."""
    q = np.array([[[[1.0, 0], [0, 1], [1, 1]]]])
    k = np.array([[[[1.0, 0], [0, 1], [1, 0]]]])
    v = np.array([[[[1.0, 2], [3, 4], [5, 6]]]])
    out = oracle.attention(q, k, v, is_causal=True)[0, 0]
    a = math.exp(1 / math.sqrt(2))
    row1 = (1 * 1 + a * 3) / (1 + a)
    assert abs(out[1, 0] - row1) < 1e-15 and abs(out[1, 1] - (row1 + 1)) < 1e-15
    assert out[0].tolist() == [1.0, 2.0]
    # Row 2 sees keys 0 and 2 with equal scores, and key 1 in between: the mean is (3, 4).
    assert np.allclose(out[2], [3.0, 4.0], atol=1e-15)


@pytest.mark.clause("7.2")
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"softcap": 2.0, "window": (2, 1)},
        {"is_causal": True, "causal_alignment": "bottom_right"},
    ],
)
def test_oracle_agrees_with_float64_naive(options):
    """Two independent computations, 50-digit loops and float64 arrays, agree to ~1e-15."""
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((2, 4, 5, 3)),
        rng.standard_normal((2, 2, 7, 3)),
        rng.standard_normal((2, 2, 7, 4)),
    )
    exact = oracle.attention(q, k, v, **options)
    naive = oracle.naive_same_precision(q, k, v, np.float64, **options)
    assert np.max(np.abs(exact - naive)) < 1e-14


@pytest.mark.clause("7.2")
def test_naive_run_has_the_dtype_error():
    """The naive float32 run is off by float32 rounding, not more and not less."""
    rng = np.random.default_rng(1)
    q, k, v = (
        rng.standard_normal((1, 2, 9, 8)),
        rng.standard_normal((1, 2, 9, 8)),
        rng.standard_normal((1, 2, 9, 8)),
    )
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in (q, k, v))
    err = np.max(
        np.abs(oracle.naive_same_precision(q, k, v, np.float32) - oracle.attention(q, k, v))
    )
    assert 2**-26 < err < 2**-18


@pytest.mark.clause("4.3")
def test_oracle_fully_masked_row_is_zero():
    q, k, v = np.ones((1, 1, 2, 2)), np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2))
    mask = np.array([[True, False, True], [False, False, False]])
    out = oracle.attention(q, k, v, mask=mask)
    assert out[0, 0, 1].tolist() == [0.0, 0.0] and out[0, 0, 0].tolist() == [1.0, 1.0]
