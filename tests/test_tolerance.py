"""SPEC §7.1: the tolerance rule is the one written in the spec, and its checks can fail."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.suite import tolerance as tol

pytestmark = pytest.mark.clause("7.1")


def test_rule_constants_match_the_spec():
    assert tol.FACTOR == 2.0
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
    with pytest.raises(AssertionError, match=r"NaN where the expected value is 1\.0"):
        tol.assert_within([np.nan, 2.0], [1.0, 2.0], 1.0, "ctx")
    tol.assert_within([1.0, 2.00001], [1.0, 2.0], 1e-4, "ctx")


def test_assert_identical_is_bitwise():
    with pytest.raises(AssertionError):
        tol.assert_identical(np.array([0.0]), np.array([-0.0]), "signed zero")
    with pytest.raises(AssertionError):
        tol.assert_identical(np.array([1.0], np.float32), np.array([1.0]), "dtype")
    tol.assert_identical(np.array([np.nan]), np.array([np.nan]), "nan")


@pytest.mark.clause("7.4")
@pytest.mark.parametrize(
    ("actual", "expected", "words"),
    [
        ([0.0, 2.0], [np.nan, 2.0], "NaN disappeared: got 0.0 where the expected value is NaN"),
        ([np.inf, 2.0], [np.nan, 2.0], "NaN disappeared: got inf"),
        ([np.nan, 2.0], [1.0, 2.0], "NaN where the expected value is 1.0"),
        ([np.nan, 2.0], [np.inf, 2.0], "NaN where the expected value is inf"),
        ([1.0, np.inf], [1.0, 2.0], "non-finite mismatch: got inf, expected 2.0"),
        ([1.0, 2.0], [1.0, -np.inf], "non-finite mismatch: got 2.0, expected -inf"),
        ([1.0, -np.inf], [1.0, np.inf], "non-finite mismatch: got -inf, expected inf"),
    ],
    ids=[
        "finite-for-NaN",
        "inf-for-NaN",
        "NaN-for-finite",
        "NaN-for-inf",
        "inf-for-finite",
        "finite-for-minus-inf",
        "wrong-sign-inf",
    ],
)
def test_comparator_fails_on_nonfinite_mismatch(actual, expected, words):
    """NaN against a finite number, either way round, and a wrong infinity fail whatever
    the tolerance, and the message says which it is (SPEC §7.4)."""
    with pytest.raises(AssertionError) as err:
        tol.assert_within(actual, expected, np.inf, "ctx")
    assert words in str(err.value)
    assert "1 of 2 entries differ in NaN or infinity" in str(err.value)
    with pytest.raises(AssertionError, match="not bit-for-bit"):
        tol.assert_identical(np.array(actual), np.array(expected), "ctx")


@pytest.mark.clause("7.4")
def test_comparator_accepts_matching_nonfinite_values():
    """NaN meets NaN and an infinity the same infinity; the finite entries are still held
    to the tolerance."""
    tol.assert_within([np.nan, np.inf, -np.inf, 1.0], [np.nan, np.inf, -np.inf, 1.0], 0.0, "c")
    with pytest.raises(AssertionError, match=r"max abs error 1\.000e-03 at index \(3,\)"):
        tol.assert_within(
            [np.nan, np.inf, -np.inf, 1.001], [np.nan, np.inf, -np.inf, 1.0], 1e-4, "c"
        )


@pytest.mark.clause("7.4")
def test_naive_error_ignores_matching_nan_and_refuses_a_broken_baseline():
    assert tol.finite_error([np.nan, 1.5], [np.nan, 1.0]) == 0.5
    with pytest.raises(ValueError, match="NaN disappeared"):
        tol.finite_error([0.0, 1.0], [np.nan, 1.0])
