"""The tolerance rule of SPEC §7, and assertions that explain their failures.

    max |impl - oracle|  <=  FACTOR · max |naive - oracle|  +  FLOOR[dtype] · eps(dtype) · max(1, max |oracle|)

``naive`` is the textbook algorithm run in the case's dtype (``conformance.fixtures.oracle``); its
error is what that dtype makes unavoidable for these very inputs. FACTOR = 2 is the factor
FlashAttention's tests use. The floor covers what the naive run can get right by luck
(an exact sum, a one-hot softmax) while another correct order of operations rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: The factor on the naive run's error (SPEC §7.1's k; not the shape letter K).
FACTOR = 2.0
#: Floor in units of the dtype's machine epsilon, scaled by the output's magnitude.
#: float64/float32: sums of up to S and D terms in another association order differ by a
#: few ulps. float16/bfloat16: computed in float32, so only the final rounding (half an
#: ulp) is left, allowed twice.
FLOOR = {"float64": 8.0, "float32": 8.0, "float16": 2.0, "bfloat16": 2.0}
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


@dataclass
class Seen:
    """What a failed comparison saw, for ``conformance.suite.behaviours`` to name the cause."""

    error: float = 0.0
    tolerance: float = 0.0
    scale: float = 1.0
    #: NaN in the result where the expected value is a number.
    nan_where_number: bool = False
    #: A number in the result where the expected value is NaN.
    number_where_nan: bool = False
    #: Some wrong entry lies in a row the expected result has all 0 (a row with no key).
    empty_rows_wrong: bool = False
    #: Whether one of those rows holds NaN.
    nan_in_empty_rows: bool = False
    #: Some of those rows: (index of the row, the values it holds), a few at most.
    empty_rows: list = field(default_factory=list)
    #: The output compared, float64, for ``conformance.suite.diagnosis`` to hold against
    #: the misreadings of the call that made it.
    actual: np.ndarray | None = field(default=None, repr=False)


class Departure(AssertionError):
    """A test's finding: the function does something other than what the spec says.

    ``behaviour`` is the test's sentence for it (None: the clause names it); ``seen`` what
    a comparison measured, when the finding comes from one. The message (``str``) has the
    details: errors, where, the case.
    """

    def __init__(self, message: str, behaviour: str | None = None, seen: Seen | None = None):
        super().__init__(message)
        self.behaviour = behaviour
        self.seen = seen


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
    with np.errstate(over="ignore"):  # an error beside an expected 0 is infinitely relative
        rel = diff / np.maximum(np.abs(np.where(both, expected, 1.0)), np.finfo(np.float64).tiny)
    if not diff.size:
        return "max abs error 0.000e+00 (no entries)"
    got, want = (f"{float(x[where]):.17g}" for x in (actual, expected))
    # Relative to an expected 0 an error is infinite or absurd (1.8e307): said in words.
    relative = rel[np.abs(np.where(both, expected, 0.0)) > 0]
    return (
        f"max abs error {diff.max(initial=0.0):.3e} at index {where}: returned {got} where "
        f"the answer is {want}"
        + (
            f"; max rel error {relative.max():.3e} where the answer is not 0"
            if relative.size
            else ""
        )
    )


def _seen(actual: np.ndarray, expected: np.ndarray, tol: float) -> Seen:
    """What is wrong between ``actual`` and ``expected`` (same shape), for naming a cause."""
    bad = nonfinite_mismatch(actual, expected)
    both = np.isfinite(actual) & np.isfinite(expected)
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(both, actual - expected, 0.0))
    bad |= diff > tol
    seen = Seen(
        error=float(diff.max(initial=0.0)),
        tolerance=float(tol),
        scale=max(1.0, float(np.max(np.abs(np.where(both, expected, 0.0)), initial=0.0))),
        nan_where_number=bool((np.isnan(actual) & ~np.isnan(expected)).any()),
        number_where_nan=bool((~np.isnan(actual) & np.isnan(expected)).any()),
        actual=actual,
    )
    if actual.ndim >= 1 and actual.size:
        empty = (expected == 0).all(axis=-1)  # rows with no key to attend
        wrong_empty = bad.any(axis=-1) & empty
        if wrong_empty.any():
            seen.empty_rows_wrong = True
            seen.nan_in_empty_rows = bool(np.isnan(actual[wrong_empty]).any())
            seen.empty_rows = [
                (tuple(int(i) for i in index), actual[tuple(index)])
                for index in np.argwhere(wrong_empty)[:4]
            ]
    return seen


def assert_within(
    actual, expected, tol: float, context: str, *, behaviour: str | None = None
) -> None:
    """Assert max |actual - expected| <= tol, with diagnostics and the case in the message.

    Non-finite entries must match exactly (SPEC §7.4): NaN where the expected value is NaN,
    the same infinity where it is infinite, and a finite number everywhere else. A failure
    is a ``Departure`` carrying ``behaviour`` (the test's words for what it checks) and
    what the comparison saw.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise Departure(
            f"{context}\n  {describe_error(actual, expected)}",
            "returns an output of the wrong shape",
        )
    ok = not nonfinite_mismatch(actual, expected).any()
    if ok:
        both = np.isfinite(actual) & np.isfinite(expected)
        with np.errstate(invalid="ignore"):
            diff = np.abs(np.where(both, actual - expected, 0.0))
        ok = bool(diff.max(initial=0.0) <= tol)
    if not ok:
        raise Departure(
            f"{context}\n  {describe_error(actual, expected)}; tolerance {tol:.3e}",
            behaviour,
            _seen(actual, expected, tol),
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


def assert_identical(actual, expected, context: str, *, behaviour: str | None = None) -> None:
    """Assert bit-for-bit equality (NaN equal to NaN), with diagnostics; a failure is a
    ``Departure`` carrying ``behaviour``."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    same = actual.shape == expected.shape and actual.dtype == expected.dtype
    if same:
        a = actual.view(np.uint8) if actual.dtype.itemsize else actual
        b = expected.view(np.uint8) if expected.dtype.itemsize else expected
        same = np.array_equal(a, b)
    if not same:
        raise Departure(
            f"{context}: not bit-for-bit identical\n  {describe_error(actual, expected)}",
            behaviour,
        )


def expect(ok: bool, behaviour: str, message: str) -> None:
    """Fail with a ``Departure`` (``behaviour``, details in ``message``) unless ``ok``."""
    if not ok:
        raise Departure(message, behaviour)


def expect_seen(ok: bool, behaviour: str, message: str, actual, tol: float) -> None:
    """``expect``, for a check on the output of the test's last call: a failure carries that
    output, so that the diagnosis holds it against the misreadings of attention before the
    test's ``behaviour`` names it (a NaN that a tiled GQA head lost is that tiling)."""
    if not ok:
        seen = Seen(tolerance=float(tol), actual=np.asarray(actual, dtype=np.float64))
        raise Departure(message, behaviour, seen)


def assert_rows_zero(out, rows, context: str, v=None) -> None:
    """Assert that the rows ``rows`` (a bool array over out's leading axes) of ``out`` are
    exactly 0 in every channel: the queries that have no key to attend (SPEC §4.3). With
    ``v`` (B, K, S, E), a failure says when those rows hold the mean of V instead."""
    out = np.asarray(out, dtype=np.float64)
    rows = np.broadcast_to(np.asarray(rows, dtype=bool), out.shape[:-1])
    got = out[rows]  # (n, E)
    if (got == 0).all():
        return
    where = np.argwhere(rows)[np.flatnonzero((got != 0).any(axis=-1))[:2]].tolist()
    message = f"{context}: rows {where} have no key to attend and must be exactly 0, got {got[(got != 0).any(axis=-1)][:2]}"
    if np.isnan(got).any():
        raise Departure(message, "a query with no key to attend returns NaN, not 0")
    if v is not None and _holds_mean_of_v(out, rows, np.asarray(v, dtype=np.float64)):
        raise Departure(message, "a query with no key to attend returns the mean of V, not 0")
    raise Departure(message, "a query with no key to attend returns a row that is not 0")


def _holds_mean_of_v(out: np.ndarray, rows: np.ndarray, v: np.ndarray) -> bool:
    """Whether every row in ``rows`` of ``out`` (B, H, T, E) is the mean of its value rows."""
    if out.ndim != 4 or v.ndim != 4 or v.shape[2] == 0 or out.shape[1] % v.shape[1]:
        return False
    G = out.shape[1] // v.shape[1]
    mean = np.repeat(v.mean(axis=2), G, axis=1)[:, :, None, :]  # (B, H, 1, E)
    mean = np.broadcast_to(mean, out.shape)
    return bool(np.allclose(out[rows], mean[rows], rtol=1e-2, atol=1e-2))


def dtype_note(out, dtype) -> str:
    """What a value comparison's message says where ``out`` is not in ``dtype`` (SPEC §2.4),
    else "". The comparison goes on: the values are judged whatever their dtype, and the
    dtype is judged once, by §2.4's own test (``test_output_dtype``), so that one cause
    is one finding, not a failure of every clause whose test looks at the output."""
    got, want = np.asarray(out).dtype, np.dtype(dtype)
    if got == want:
        return ""
    return f" (its output is {got.name} for {want.name} inputs: §2.4's departure, judged by its own test)"
