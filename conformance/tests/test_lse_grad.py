"""SPEC §21.7: the log-sum-exp's gradient. A backend that declares ``grad_lse`` takes the
lse's cotangent in ``attention_vjp(..., d_lse=)`` and returns the gradients of
L = Σ d_out · out + Σ d_lse · lse. Expected values come from the oracle
(``oracle.attention_vjp(..., d_lse=)``, checked against central differences), the
tolerance from §12.9 with the naive backward in the dtype (``naive_vjp_same_precision(...,
d_lse=)``) as the baseline. The inputs are test_gradients' pairwise ones (H = 4, T = 7,
S = 13), so that a compiled backward that always takes d_lse is the one already compiled."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapters.forms import forms_used
from conformance.suite import gradients
from conformance.suite.helpers import as64, random_qkv
from conformance.suite.requirements import requires, value_dims
from conformance.suite.tolerance import assert_identical, assert_within, expect, tolerance

T = 7

#: The setups (options, capabilities), each of them §12.10's pairwise setup of that name
#: with a row that attends no key where there is a mask; "sinks-bool-mask" is
#: test_sinks.py's gradient setup of a bool mask (H = 3, S = 9, D = E = 5), where a row
#: with no key has its sink's weight too (§15.3), and must not pass its d_lse to dsinks.
SETUPS = {
    "bool-mask": ({"mask": "bool"}, ()),
    "float-mask": ({"mask": "float", "scale": 0.4}, ()),
    "gqa-softcap": ({"softcap": 3.0, "K": 1}, ("gqa", "softcap", "grad_softcap")),
    "sinks-gqa-causal": ({"is_causal": True, "K": 2, "sinks": "random"}, ("gqa", "sinks")),
    "sinks-bool-mask": ({"mask": "bool", "sinks": "random", "H": 3, "S": 9}, ("sinks",)),
}
#: The queries whose mask row blocks every key: their lse is -inf, a constant.
EMPTY_ROWS = [2, 5]


def _setup(backend, name: str, dtype: str):
    """q, k, v, the options of setup ``name`` (test_gradients' or test_sinks' inputs), d_out
    and d_lse, standard normal, d_lse in the lse's dtype (§21.4)."""
    options = dict(SETUPS[name][0])
    H, S = options.pop("H", 4), options.pop("S", 13)
    D, E = value_dims(backend, 6, 5) if H == 4 else (5, 5)
    q, k, v = random_qkv(54, H=H, K=options.pop("K", None), T=T, S=S, D=D, E=E, dtype=dtype)
    rng = np.random.default_rng(55)
    if options.get("mask") == "bool":
        mask = rng.random((2, 1 if H == 4 else H, T, S)) < 0.7
        mask[:, :, EMPTY_ROWS] = False
        options["mask"] = mask
    elif options.get("mask") == "float":
        mask = np.where(rng.random((T, S)) < 0.2, -np.inf, rng.standard_normal((T, S)))
        mask[EMPTY_ROWS] = -np.inf
        options["mask"] = mask.astype(q.dtype)
    if options.get("sinks") == "random":
        options["sinks"] = rng.uniform(-1.0, 2.0, H).astype(q.dtype)  # (H,)
    d_out = gradients.random_d_out(56, q, v)
    d_lse = np.random.default_rng(57).standard_normal(q.shape[:3]).astype(dtype)  # (B, H, T)
    return q, k, v, options, d_out, d_lse


def _expected(q, k, v, d_out, d_lse, dtype: str, **options):
    """The oracle's gradients with d_lse and §12.9's tolerance for each: k times the naive
    backward's error in ``dtype`` against the oracle, plus the floor."""
    from conformance.fixtures.oracle import naive_vjp_same_precision
    from conformance.suite.oracle_store import oracle

    wide = {n: as64(x) if isinstance(x, np.ndarray) and x.dtype != np.bool_ else x
            for n, x in options.items()}  # fmt: skip
    expected = oracle.attention_vjp(
        as64(q), as64(k), as64(v), as64(d_out), d_lse=as64(d_lse), **wide
    )
    naive = naive_vjp_same_precision(q, k, v, d_out, np.dtype(dtype), d_lse=d_lse, **options)
    tols = {
        n: tolerance(dtype, float(np.max(np.abs(naive[n] - y), initial=0.0)), y)
        for n, y in expected.items()
    }
    return expected, tols


@pytest.mark.clause("21.7")
@pytest.mark.parametrize("upstream", ["d_out-and-d_lse", "d_lse-alone"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(name, marks=requires(*needs, *forms_used(options)))
        for name, (options, needs) in SETUPS.items()
    ],
)
@requires("grad", "grad_lse")
def test_lse_gradient_matches_the_oracle(backend, setup, dtype, upstream):
    """dq, dk, dv (and dmask, dsinks where returned) for L = Σ d_out · out + Σ d_lse · lse
    are the oracle's within §12.9, with d_out and d_lse both non-zero and with d_out = 0
    (the lse's gradient alone)."""
    q, k, v, options, d_out, d_lse = _setup(backend, setup, dtype)
    if upstream == "d_lse-alone":
        d_out = np.zeros_like(d_out)
    grads = gradients.vjp(backend, q, k, v, d_out, d_lse=d_lse, **options)
    expected, tols = _expected(q, k, v, d_out, d_lse, dtype, **options)
    for name, got in grads.items():
        assert_within(
            got,
            expected[name],
            tols[name],
            f"{backend.name}: {name} with d_lse ({setup}, {dtype}, {upstream})",
            behaviour="the gradient through the lse differs from the oracle",
        )


@pytest.mark.clause("21.7")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(name, marks=requires(*needs, *forms_used(options)))
        for name, (options, needs) in SETUPS.items()
        if "mask" in options
    ],
)
@requires("grad", "grad_lse")
def test_lse_gradient_of_a_row_with_no_key_reaches_nothing(backend, setup, dtype):
    """A row with no key has lse = -inf, a constant: every gradient is finite, its dq is
    exactly 0, and changing its d_lse changes no gradient bit."""
    q, k, v, options, d_out, d_lse = _setup(backend, setup, dtype)
    grads = gradients.vjp(backend, q, k, v, d_out, d_lse=d_lse, **options)
    for name, g in grads.items():
        expect(
            np.isfinite(as64(g)).all(),
            "a row with no key to attend gets non-finite gradients through the lse",
            f"{backend.name}: non-finite {name} with d_lse ({setup}, {dtype})",
        )
    expect(
        (as64(grads["dq"])[..., EMPTY_ROWS, :] == 0).all(),
        "a row with no key to attend gets a dq that is not 0 through the lse",
        f"{backend.name}: dq of rows {EMPTY_ROWS}, which attend no key, should be exactly 0 "
        f"({setup}, {dtype})",
    )
    changed = d_lse.copy()
    changed[..., EMPTY_ROWS] = np.asarray(1e3, dtype=d_lse.dtype)
    again = gradients.vjp(backend, q, k, v, d_out, d_lse=changed, **options)
    for name in grads:
        assert_identical(
            again[name],
            grads[name],
            f"{backend.name}: {name} after changing d_lse on rows with no key ({setup}, {dtype})",
            behaviour="the lse's gradient on a row with no key to attend reaches the gradients",
        )
