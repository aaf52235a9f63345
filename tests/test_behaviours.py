"""SPEC §13.15: a failure is named by the behaviour it shows, in words that hold on any
machine: the cross-cutting causes first (a refusal, rows with no key, a lower precision,
a NaN that vanished), then the test's own sentence, then the clause."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conformance.suite.behaviours import (
    behaviour,
    call_features,
    describe_common,
    mark_raised,
    raised,
)
from conformance.suite.requirements import SuiteError
from conformance.suite.tolerance import Departure, Seen, assert_rows_zero, assert_within

pytestmark = pytest.mark.clause("13.15")
_CLOCK = itertools.count()


class _Backend:
    name = "b"


def _calls(q, k, v, method="attention", **kwargs):
    return [(next(_CLOCK), _Backend(), method, (q, k, v), kwargs)]


def _inputs(dtype=np.float64, B=1, H=2, T=3, S=4, D=2, E=2):
    rng = np.random.default_rng(0)
    return tuple(
        rng.standard_normal(shape).astype(dtype)
        for shape in ((B, H, T, D), (B, H, S, D), (B, H, S, E))
    )


def _departure(actual, expected, tol, name="the test's words"):
    with pytest.raises(Departure) as info:
        assert_within(actual, expected, tol, "context", behaviour=name)
    return info.value


def test_float64_at_float32_precision_is_one_behaviour():
    q, k, v = _inputs()
    expected = np.linspace(-1, 1, 12).reshape(1, 2, 3, 2)
    err = _departure(expected + 3e-7, expected, 1e-15)
    assert behaviour(err, _calls(q, k, v), "6.5", "Permutations") == (
        "computes float64 at float32 precision"
    )
    # The same error on float32 inputs is not a precision finding: the test's words stand.
    calls = _calls(*(x.astype(np.float32) for x in (q, k, v)))
    assert behaviour(err, calls, "6.5", "Permutations") == "the test's words"
    # A large error is a wrong answer, whatever the dtype.
    err = _departure(expected + 0.3, expected, 1e-15)
    assert behaviour(err, _calls(q, k, v), "6.5", "Permutations") == "the test's words"


class _OnDevice(_Backend):
    device = "cuda"


def test_float32_in_tf32_is_one_behaviour_on_a_device():
    """SPEC §13.20: float32 inputs with an error of TF32's size, from a function that runs
    on a device, are "computes float32 in TF32"; on the host the test's words stand."""
    q, k, v = (x.astype(np.float32) for x in _inputs())
    expected = np.linspace(-1, 1, 12).reshape(1, 2, 3, 2)
    err = _departure(expected + 2e-3, expected, 1e-6)
    on_device = [(next(_CLOCK), _OnDevice(), "attention", (q, k, v), {})]
    assert behaviour(err, on_device, "6.5", "Permutations") == "computes float32 in TF32"
    assert behaviour(err, _calls(q, k, v), "6.5", "Permutations") == "the test's words"
    # A large error is a wrong answer, on a device too.
    err = _departure(expected + 0.3, expected, 1e-6)
    assert behaviour(err, on_device, "6.5", "Permutations") == "the test's words"


def test_rows_with_no_key_are_named_by_what_they_hold():
    q, k, v = _inputs()
    expected = np.ones((1, 2, 3, 2))
    expected[0, :, 1] = 0  # query 1 attends nothing
    nan = expected.copy()
    nan[0, :, 1] = np.nan
    mean = expected.copy()
    mean[0, :, 1] = v[0].mean(axis=1)
    other = expected.copy()
    other[0, :, 1] = 7.0
    words = {
        "a query with no key to attend returns NaN, not 0": nan,
        "a query with no key to attend returns the mean of V, not 0": mean,
        "a query with no key to attend returns a row that is not 0": other,
    }
    for sentence, actual in words.items():
        err = _departure(actual, expected, 1e-12)
        assert behaviour(err, _calls(q, k, v), "4.3", "Fully masked rows are 0") == sentence
        with pytest.raises(Departure) as info:
            assert_rows_zero(actual, expected[..., 0] == 0, "context", v=v)
        assert info.value.behaviour == sentence
    err = _departure(nan, expected, 1e-12)
    assert "gradient" in behaviour(err, _calls(q, k, v, method="attention_vjp"), "12.4", "")


def test_a_vanished_nan_is_named():
    expected = np.array([[np.nan, 1.0]])
    err = _departure(np.array([[0.0, 1.0]]), expected, 1e-12)
    assert behaviour(err, _calls(*_inputs()), "4.9", "NaN") == (
        "a NaN in the inputs becomes a number in the output"
    )


def test_a_refusal_is_its_type_and_first_line_without_numbers_or_addresses():
    err = ValueError("value shape should be [2, 6, 4, 3]: but got (2, 6, 4, 2)\nmore text")
    assert (
        raised(err) == "raises ValueError: value shape should be [N, N, N, N]: but got (N, N, N, N)"
    )
    err = RuntimeError("The precision 'F16_F16_F32' is not supported at 0x7f3a2b1c")
    assert raised(err) == (
        "raises RuntimeError: The precision 'F16_F16_F32' is not supported at 0x…"
    )
    # ONNX Runtime's wrapper, the same for every refusal, gives way to the kernel's message.
    err = RuntimeError(
        "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while "
        "running GroupQueryAttention node. Name:'' Status Message: head_size must be a "
        "multiple of 8. Got head_size % 8 == 4"
    )
    assert raised(err) == (
        "raises RuntimeError: head_size must be a multiple of 8. Got head_size % N == N"
    )
    err = RuntimeError("The precision 'F16_F16_F32' is not supported at 0x7f3a2b1c")
    mark_raised(err, "b", "attention")
    assert behaviour(err, [], "4.1", "Scale") == raised(err)
    # The same exception raised by the test's own code is not the function's behaviour.
    assert behaviour(RuntimeError("x"), [], "4.1", "Scale") == "departs from §4.1 (Scale)"


def test_a_check_that_saw_no_output_says_so():
    """A departure with an output that no cause explains is its clause's; one that carried
    no output says that it saw none, not that the function departs from the clause."""
    seen = Seen(tolerance=1e-6, actual=np.zeros((1, 1, 2, 2)))
    assert behaviour(Departure("m", None, seen), [], "2.1", "Batched layout") == (
        "departs from §2.1 (Batched layout)"
    )
    assert behaviour(Departure("m"), [], "2.1", "Batched layout") == (
        "fails a check of §2.1 (Batched layout) that saw no output to name a cause by"
    )
    assert behaviour(Departure("m", "its own words"), [], "2.1", "Batched layout") == (
        "its own words"
    )


def test_a_suite_error_is_the_suites():
    text = behaviour(SuiteError("the test would call"), [], "2.1", "Batched layout")
    assert "bug in the suite" in text


def test_what_every_call_shares_is_said():
    q, k, v = _inputs(np.float32, S=0)
    features = call_features(_calls(q, k, v, mask=np.ones((3, 0), bool), is_causal=True))
    assert features == ["float32", "S = 0", "bool mask", "is_causal"]
    assert describe_common([features, ["float32", "is_causal"]]) == (
        "every call: float32, is_causal"
    )
    assert describe_common([["float64"], ["float32"]]) == ""
