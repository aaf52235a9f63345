"""SPEC §4.10: rows of more than 1,024 and 2,048 keys, past the key tiles of blockwise
kernels at the sizes CPUs use, against the oracle's stored outputs."""

from __future__ import annotations

import pytest

from conformance.fixtures.oracle import naive_same_precision
from conformance.suite.cases import case_entries, load_case
from conformance.suite.helpers import fixture_marks
from conformance.suite.tolerance import assert_within, finite_error, tolerance
from conformance.vocabulary import numpy_dtype


def _long_params():
    return [
        pytest.param(e["id"], marks=fixture_marks(e, "7.1"), id=e["id"])
        for e in case_entries(("attention_long",))
    ]


@pytest.mark.parametrize("case_id", _long_params())
def test_long_rows(backend, case_id):
    """Rows of 1,100 keys (one decode query) and of 2,100 keys (four queries), in three
    batch elements: one whose last key tiles are padding, one whose first tiles are, one
    with every key. The scores grow by 8 from the first key to the last, so that each
    row's maximum grows from tile to tile, and are ordinary or all about -1e4. The output
    is the 50-digit oracle's within SPEC §7."""
    case = load_case(case_id)
    q, k, v = case.inputs()
    mask = case.mask()
    out = backend.attention(q, k, v, mask=mask, **case.options())
    # The naive run's error against the oracle, as for a fixture (computed here: it goes
    # through BLAS, whose summation order depends on the machine).
    naive = naive_same_precision(q, k, v, numpy_dtype(case.dtype), mask=mask, **case.options())
    assert_within(
        out,
        case.expected,
        tolerance(case.dtype, finite_error(naive, case.expected), case.expected),
        f"{backend.name} on fixture {case.id} {case.meta['shape']}\n"
        f"  reproduce: {case.call(backend)}",
        behaviour="rows longer than the key tiles of blockwise kernels give a wrong output",
    )
