"""SPEC §7.1: the tolerance rule is the one written in the spec, and its checks can fail."""

from __future__ import annotations

import numpy as np
import pytest

from conformance import tolerance as tol

pytestmark = pytest.mark.clause("7.1")


def test_rule_constants_match_the_spec():
    assert tol.K == 2.0
    assert tol.FLOOR == {"float64": 8.0, "float32": 8.0, "float16": 2.0, "bfloat16": 2.0}
    assert (
        tol.EPS["float32"] == np.finfo(np.float32).eps
        and tol.EPS["float16"] == np.finfo(np.float16).eps
    )


def test_tolerance_formula():
    expected = np.array([3.0, -4.0])
    assert tol.tolerance("float32", 1e-6, expected) == 2e-6 + 8 * 2.0**-23 * 4.0
    assert tol.tolerance("float64", 0.0, np.zeros(3)) == 8 * 2.0**-52


def test_assert_within_fails_with_diagnostics():
    with pytest.raises(AssertionError, match=r"max abs error 1\.000e-03 at index \(1,\)"):
        tol.assert_within([1.0, 2.001], [1.0, 2.0], 1e-4, "ctx")
    with pytest.raises(AssertionError, match="non-finite"):
        tol.assert_within([np.nan, 2.0], [1.0, 2.0], 1.0, "ctx")
    tol.assert_within([1.0, 2.00001], [1.0, 2.0], 1e-4, "ctx")


def test_assert_identical_is_bitwise():
    with pytest.raises(AssertionError):
        tol.assert_identical(np.array([0.0]), np.array([-0.0]), "signed zero")
    with pytest.raises(AssertionError):
        tol.assert_identical(np.array([1.0], np.float32), np.array([1.0]), "dtype")
    tol.assert_identical(np.array([np.nan]), np.array([np.nan]), "nan")
