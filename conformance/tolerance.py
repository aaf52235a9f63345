"""The tolerance rule of SPEC §7, and assertions that explain their failures.

    max |impl - oracle|  <=  FACTOR · max |naive - oracle|  +  FLOOR[dtype] · eps(dtype) · max(1, max |oracle|)

``naive`` is the textbook algorithm run in the case's dtype (``conformance.fixtures.oracle``); its
error is what that dtype makes unavoidable for these very inputs. FACTOR = 2 is the factor
FlashAttention's tests use. The floor covers what the naive run can get right by luck
(an exact sum, a one-hot softmax) while another correct order of operations rounds.
"""

from __future__ import annotations

import numpy as np

#: The factor on the naive run's error (SPEC §7.1's k; not the shape letter K).
FACTOR = 2.0
#: Floor in units of the dtype's machine epsilon, scaled by the output's magnitude.
#: float64/float32: sums of up to S and D terms in another association order differ by a
#: few ulps. float16/bfloat16: computed in float32, so only the final rounding (half an
#: ulp) is left, allowed twice.
FLOOR = {"float64": 8.0, "float32": 8.0, "float16": 2.0, "bfloat16": 2.0}
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def tolerance(dtype: str, naive_error: float, expected: np.ndarray) -> float:
    """The largest absolute error SPEC §7 allows against the oracle.

    The magnitude is that of the finite expected values: NaN and infinities are compared
    exactly (SPEC §7.4), not within a tolerance.
    """
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(1.0, float(np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0)))
    return FACTOR * float(naive_error) + FLOOR[dtype] * EPS[dtype] * scale


def nonfinite_mismatch(actual, expected) -> np.ndarray:
    """Where NaN and the infinities of ``actual`` and ``expected`` differ (SPEC §7.4).

    NaN must meet NaN and +inf must meet +inf (-inf, -inf): a NaN that became a finite
    number, a finite number that became NaN, and an infinity of the wrong sign are all
    mismatches, whichever side holds the non-finite value.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    a_nan, e_nan = np.isnan(actual), np.isnan(expected)
    with np.errstate(invalid="ignore"):
        inf_differs = (np.isinf(actual) | np.isinf(expected)) & (actual != expected)
    return (a_nan != e_nan) | (inf_differs & ~a_nan & ~e_nan)


def _words(x: float) -> str:
    return "NaN" if np.isnan(x) else repr(float(x))


def describe_error(actual: np.ndarray, expected: np.ndarray) -> str:
    """Max absolute and relative error, and where, for a failure message.

    NaN and infinities are compared first (SPEC §7.4): NaN against a finite number, either
    way round, and an infinity against anything but the same infinity are reported as
    such, with how many entries differ, never folded into an error of NaN.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    bad = nonfinite_mismatch(actual, expected)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        got, want = actual[where], expected[where]
        if np.isnan(want):
            what = f"NaN disappeared: got {_words(got)} where the expected value is NaN"
        elif np.isnan(got):
            what = f"NaN where the expected value is {_words(want)}"
        else:
            what = f"non-finite mismatch: got {_words(got)}, expected {_words(want)}"
        return (
            f"{what} at index {where}; {int(bad.sum())} of {bad.size} entries differ in "
            "NaN or infinity"
        )
    both = np.isfinite(actual) & np.isfinite(expected)
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(both, actual - expected, 0.0))
    where = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
    where = tuple(int(i) for i in where)
    rel = diff / np.maximum(np.abs(np.where(both, expected, 1.0)), np.finfo(np.float64).tiny)
    got, want = (f"{float(x[where]):.17g}" if diff.size else "none" for x in (actual, expected))
    return (
        f"max abs error {diff.max(initial=0.0):.3e} at index {where} "
        f"(got {got}, expected {want}); max rel error {rel.max(initial=0.0):.3e}"
    )


def assert_within(actual, expected, tol: float, context: str) -> None:
    """Assert max |actual - expected| <= tol, with diagnostics and the case in the message.

    Non-finite entries must match exactly (SPEC §7.4): NaN where the expected value is NaN,
    the same infinity where it is infinite, and a finite number everywhere else.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    ok = actual.shape == expected.shape and not nonfinite_mismatch(actual, expected).any()
    if ok:
        both = np.isfinite(actual) & np.isfinite(expected)
        with np.errstate(invalid="ignore"):
            diff = np.abs(np.where(both, actual - expected, 0.0))
        ok = bool(diff.max(initial=0.0) <= tol)
    if not ok:
        raise AssertionError(
            f"{context}\n  {describe_error(actual, expected)}; tolerance {tol:.3e}"
        )


def finite_error(naive, expected) -> float:
    """max |naive - expected| over the finite entries, for SPEC §7's naive error.

    Where the expected value is NaN or infinite (SPEC §4.9, §3.8), the naive run must hold
    the same non-finite value: a naive run that disagrees there is a broken baseline, and
    a tolerance computed from it would mean nothing, so that raises.
    """
    naive = np.asarray(naive, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    bad = nonfinite_mismatch(naive, expected)
    if bad.any():
        raise ValueError(
            "the naive run and the oracle disagree on NaN/infinity: "
            + describe_error(naive, expected)
        )
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(np.isfinite(expected), naive - expected, 0.0))
    return float(np.max(diff, initial=0.0))


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
