"""SPEC §2-§4 and §11: every backend reproduces the oracle's fixtures within SPEC §7."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.cases import case_entries, load_case, worked_example
from conformance.helpers import require
from conformance.measure import publish
from conformance.tolerance import assert_within, tolerance


def _case_params():
    return [
        pytest.param(e["id"], marks=pytest.mark.clause(e["clause"], "7.1"), id=e["id"])
        for e in case_entries()
    ]


@pytest.mark.parametrize("case_id", _case_params())
def test_fixture_case(backend, case_id, request):
    """The output matches the 50-digit oracle within the tolerance of the case's dtype."""
    case = load_case(case_id)
    require(backend, *case.requires, dtype=case.dtype)
    if case.meta["unbatched"]:
        require(backend, "unbatched")
    out = backend.attention(*case.inputs(), mask=case.mask(), **case.options())
    assert out.shape == case.expected.shape, (
        f"{case.id}: shape {out.shape}, expected {case.expected.shape}"
    )
    tol = tolerance(case.dtype, case.naive_error, case.expected)
    publish(
        request.node,
        backend=backend.name,
        case=case.id,
        dtype=case.dtype,
        actual=out,
        expected=case.expected,
        tolerance=tol,
    )
    assert out.dtype == case.inputs()[0].dtype, (
        f"{case.id}: dtype {out.dtype}, expected {case.dtype} (SPEC §2.4)"
    )
    assert_within(
        out,
        case.expected,
        tol,
        f"{backend.name} on fixture {case.id} {case.meta['shape']} {case.options()}\n  reproduce: {case.call(backend)}",
    )


@pytest.mark.clause("11.1")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_worked_example(backend, causal):
    """The seed notes' 3x3 example: exact to 1e-12, and the printed two-decimal values."""
    ex = worked_example()
    key = "causal" if causal else "non_causal"
    q, k, v = (np.array(ex[n], dtype=np.float64)[None, None] for n in "qkv")
    out = backend.attention(q, k, v, is_causal=causal)[0, 0]
    assert_within(
        out, ex[key]["exact"], ex[key]["exact_atol"], f"{backend.name}: worked example ({key})"
    )
    half_unit = 0.5 * 10.0 ** -ex[key]["seed_decimals"]
    assert_within(
        out,
        ex[key]["seed_values"],
        half_unit,
        f"{backend.name}: seed notes' printed values ({key})",
    )
