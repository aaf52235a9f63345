"""The tolerance rule of SPEC §7, and assertions that explain their failures.

    max |impl - oracle|  <=  K · max |naive - oracle|  +  FLOOR[dtype] · eps(dtype) · max(1, max |oracle|)

``naive`` is the textbook algorithm run in the case's dtype (``conformance.fixtures.oracle``); its
error is what that dtype makes unavoidable for these very inputs. K = 2 is the factor
FlashAttention's tests use. The floor covers what the naive run can get right by luck
(an exact sum, a one-hot softmax) while another correct order of operations rounds.
"""

from __future__ import annotations

import numpy as np

K = 2.0
#: Floor in units of the dtype's machine epsilon, scaled by the output's magnitude.
#: float64/float32: sums of up to S and D terms in another association order differ by a
#: few ulps. float16/bfloat16: computed in float32, so only the final rounding (half an
#: ulp) is left, allowed twice.
FLOOR = {"float64": 8.0, "float32": 8.0, "float16": 2.0, "bfloat16": 2.0}
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def tolerance(dtype: str, naive_error: float, expected: np.ndarray) -> float:
    """The largest absolute error SPEC §7 allows against the oracle."""
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    return K * float(naive_error) + FLOOR[dtype] * EPS[dtype] * scale


def describe_error(actual: np.ndarray, expected: np.ndarray) -> str:
    """Max absolute and relative error, and where, for a failure message."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    diff = np.abs(actual - expected)
    bad = ~np.isfinite(actual) & np.isfinite(expected)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        return f"non-finite output {actual[where]} at index {where} (expected {expected[where]})"
    where = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
    where = tuple(int(i) for i in where)
    rel = diff / np.maximum(np.abs(expected), np.finfo(np.float64).tiny)
    return (
        f"max abs error {diff.max(initial=0.0):.3e} at index {where} "
        f"(got {actual[where] if diff.size else None!r}, expected {expected[where] if diff.size else None!r}); "
        f"max rel error {rel.max(initial=0.0):.3e}"
    )


def assert_within(actual, expected, tol: float, context: str) -> None:
    """Assert max |actual - expected| <= tol, with diagnostics and the case in the message."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    ok = actual.shape == expected.shape and np.all(np.isfinite(actual) == np.isfinite(expected))
    if ok:
        diff = np.abs(np.where(np.isfinite(expected), actual - expected, 0.0))
        ok = bool(diff.max(initial=0.0) <= tol)
    if not ok:
        raise AssertionError(
            f"{context}\n  {describe_error(actual, expected)}; tolerance {tol:.3e}"
        )


def assert_identical(actual, expected, context: str) -> None:
    """Assert bit-for-bit equality (NaN equal to NaN), with diagnostics."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    same = actual.shape == expected.shape and actual.dtype == expected.dtype
    if same:
        a = actual.view(np.uint8) if actual.dtype.itemsize else actual
        b = expected.view(np.uint8) if expected.dtype.itemsize else expected
        same = np.array_equal(a, b)
    if not same:
        raise AssertionError(
            f"{context}: not bit-for-bit identical\n  {describe_error(actual, expected)}"
        )
