"""SPEC §9: the multi-head layer and the GPT block, from one set of PyTorch-layout weights."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.suite.cases import case_entries, case_marks, load_case
from conformance.suite.measure import publish
from conformance.suite.requirements import requires, uses_dtype
from conformance.suite.tolerance import assert_identical, assert_within, expect, tolerance

pytestmark = requires("module")


def _module_params():
    return [
        pytest.param(e["id"], marks=case_marks(e), id=e["id"])
        for e in case_entries(("mha", "gpt_block"))
    ]


def _run(backend, case, x, **kwargs):
    H = case.meta["shape"]["H"]
    if case.meta["kind"] == "mha":
        return backend.multi_head_attention(
            case.params(), x, n_heads=H, is_causal=case.meta["is_causal"], **kwargs
        )
    return backend.gpt_block(case.params(), x, n_heads=H)


@pytest.mark.parametrize("case_id", _module_params())
def test_module_fixture(backend, case_id, request):
    """The layer's output from the shared weights matches the oracle within SPEC §7."""
    case = load_case(case_id)
    x = case.arrays["x"].astype(case.dtype)
    out = _run(backend, case, x)
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
    expect(
        out.dtype == x.dtype,
        "the module returns an output in another dtype than its input",
        f"{backend.name}: dtype {out.dtype}, expected {x.dtype}",
    )
    assert_within(
        out, case.expected, tol, f"{backend.name} on module fixture {case.id} {case.meta['shape']}"
    )


@pytest.mark.clause("9.3")
@pytest.mark.parametrize(
    "case_id",
    [
        pytest.param(c, marks=uses_dtype(c.rsplit("-", 1)[1]))
        for c in ("mha-causal-float64", "gpt-block-float64", "gpt-block-float32")
    ],
)
def test_causal_module_ignores_the_future(backend, case_id):
    """With causal attention, output position i does not change when inputs after i do."""
    case = load_case(case_id)
    x = case.arrays["x"].astype(case.dtype)
    base = _run(backend, case, x)
    T = x.shape[1]
    for i in range(T - 1):
        x2 = x.copy()
        x2[:, i + 1 :] = x2[:, i + 1 :] * np.asarray(-3, dtype=x.dtype) + np.asarray(
            1, dtype=x.dtype
        )
        out = _run(backend, case, x2)
        assert_identical(
            out[:, : i + 1],
            base[:, : i + 1],
            f"{backend.name} {case.id}: outputs <= {i} after changing inputs > {i}",
            behaviour="a causal module's output depends on later inputs",
        )


@pytest.mark.clause("9.1")
@uses_dtype("float64")
def test_module_float_mask_matches_is_causal(backend):
    """The seeds' additive causal mask (0 allowed, -inf blocked) equals is_causal=True."""
    case = load_case("mha-causal-float64")
    x = case.arrays["x"]
    T = x.shape[1]
    mask = np.triu(np.full((T, T), -np.inf), k=1)
    with_mask = backend.multi_head_attention(
        case.params(), x, n_heads=case.meta["shape"]["H"], mask=mask
    )
    tol = 2 * tolerance("float64", case.naive_error, case.expected)
    assert_within(
        with_mask,
        case.expected,
        tol,
        f"{backend.name}: module with the seeds' float causal mask",
        behaviour="the module's additive causal mask (0 and -inf) differs from is_causal",
    )
