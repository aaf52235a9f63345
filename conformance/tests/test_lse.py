"""SPEC §21: the log-sum-exp, each row's log Σ exp(score) beside the output
(``attention(..., return_lse=True)``). Expected values come from the oracle
(``oracle.attention(..., return_lse=True)``), the tolerance from §21.3. The shapes are few
and reused: every ``return_lse=True`` call is a program of its own under JAX."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import numpy_dtype
from conformance.suite.helpers import (
    as64,
    causal_where_taken,
    oracle_and_tolerance,
    random_qkv,
    setup_params,
)
from conformance.suite.lse import oracle_lse_and_tolerance, working_dtype
from conformance.suite.requirements import refuses, requires, uses_dtype
from conformance.suite.tolerance import Departure, Seen, assert_within, expect

T, S = 7, 13

#: Random setups (options, capabilities): the lse with each option it meets (SPEC §21.5).
SETUPS = {
    "plain": ({}, ()),
    "bool-mask-scale": ({"mask": "bool", "scale": 0.4}, ()),
    "float-mask": ({"mask": "float"}, ()),
    "causal": ({"is_causal": True}, ()),
    "bottom-right-window": (
        {"is_causal": True, "causal_alignment": "bottom_right", "window": (3, 1)},
        ("causal_bottom_right", "window"),
    ),
    "softcap": ({"softcap": 2.0}, ("softcap",)),
    "sinks-causal": ({"sinks": True, "is_causal": True}, ("sinks",)),
    "alibi": ({"alibi": True}, ("alibi",)),
    "chunked": ({"chunk_size": 4, "is_causal": True}, ("chunked",)),
    "gqa": ({"K": 1}, ("gqa",)),
    "value-dim": ({"E": 3}, ("value_dim",)),
    "unbatched": ({"unbatched": True}, ("unbatched",)),
}


def _setup(name: str, dtype: str, seed: int):
    """q, k, v and the options of setup ``name``, in ``dtype``, at T = 7, S = 13."""
    options = dict(SETUPS[name][0])
    K, E = options.pop("K", None), options.pop("E", None)
    unbatched = options.pop("unbatched", False)
    q, k, v = random_qkv(seed, T=T, S=S, K=K, E=E, dtype=dtype)
    B, H = q.shape[:2]
    rng = np.random.default_rng(seed + 1)
    dt = numpy_dtype(dtype)
    if options.get("mask") == "bool":
        options["mask"] = rng.random((B, H, T, S)) < 0.7
    elif options.get("mask") == "float":
        mask = np.where(rng.random((H, T, S)) < 0.3, -np.inf, rng.standard_normal((H, T, S)))
        options["mask"] = mask.astype(dt)
    if options.pop("sinks", False):
        options["sinks"] = rng.uniform(-1.0, 2.0, H).astype(dt)
    if options.pop("alibi", False):
        options["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)
    if unbatched:
        q, k, v = q[0], k[0], v[0]
    return q, k, v, options


def _check(backend, q, k, v, dtype: str, context: str, **options):
    """Call with ``return_lse=True``; the out and the lse against the oracle (§7, §21.3),
    the lse's shape and dtype (§21.1, §21.4). Returns (out, lse)."""
    out, lse = backend.attention(q, k, v, return_lse=True, **options)
    # The oracle takes batched inputs: an unbatched call is its batch of one.
    lead = (None,) if q.ndim == 3 else ()
    q, k, v = q[lead], k[lead], v[lead]
    expected_out, expected_lse, tol = oracle_lse_and_tolerance(q, k, v, dtype, **options)
    expected_out, expected_lse = expected_out[(0,) * len(lead)], expected_lse[(0,) * len(lead)]
    if np.shape(lse) != expected_lse.shape:
        # What it returned goes with the finding, for the diagnosis to name (the layout).
        raise Departure(
            f"{backend.name}: lse shape {np.shape(lse)}, expected {expected_lse.shape} ({context})",
            "returns an lse of the wrong shape",
            Seen(actual=as64(lse), tolerance=tol),
        )
    want = working_dtype(dtype)
    expect(
        np.asarray(lse).dtype == np.dtype(want),
        "returns the lse in the wrong dtype",
        f"{backend.name}: lse dtype {np.asarray(lse).dtype}, expected {want} ({context})",
    )
    assert_within(
        lse, expected_lse, tol, f"{backend.name}: lse, {context}",
        behaviour="returns an lse that differs from the oracle",
    )  # fmt: skip
    _, out_tol = oracle_and_tolerance(q, k, v, dtype, **options)
    assert_within(
        out, expected_out, out_tol, f"{backend.name}: out beside the lse, {context}",
        behaviour="returns an output beside the lse that differs from the oracle",
    )  # fmt: skip
    return out, lse


@requires("lse")
@pytest.mark.clause("21.1", "21.3", "21.4", "21.5")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("setup", setup_params(SETUPS))
def test_lse_matches_the_oracle(backend, setup, dtype):
    """Each option the backend declares, with return_lse=True: the lse is the oracle's
    within §21.3, (B, H, T) ((H, T) unbatched) in the working precision, and the output
    beside it is the oracle's within §7."""
    q, k, v, options = _setup(setup, dtype, 210)
    _check(backend, q, k, v, dtype, f"{setup}, T={T} S={S} {dtype}", **options)


@requires("lse", "dropout")
@pytest.mark.clause("21.1")
def test_dropout_leaves_the_lse(backend):
    """Dropout acts on the weights after the softmax: with dropout_p = 0.5 and a seed the
    lse is the oracle's without dropout, within §21.3 (the output is random; §5 judges it)."""
    q, k, v = random_qkv(224, T=T, S=S, dtype="float32")
    _, lse = backend.attention(q, k, v, dropout_p=0.5, seed=3, return_lse=True)
    _, expected, tol = oracle_lse_and_tolerance(q, k, v, "float32")
    assert_within(
        lse, expected, tol, f"{backend.name}: lse with dropout_p = 0.5",
        behaviour="returns an lse that dropout changed",
    )  # fmt: skip


@requires("lse")
@pytest.mark.clause("21.1")
@pytest.mark.parametrize("setup", ["plain", "float-mask"])
def test_out_beside_the_lse_is_the_plain_out(backend, setup):
    """The output returned beside the lse is the output of the same call without
    return_lse, within §7's tolerance."""
    q, k, v, options = _setup(setup, "float32", 211)
    out, _ = backend.attention(q, k, v, return_lse=True, **options)
    plain = backend.attention(q, k, v, **options)
    _, tol = oracle_and_tolerance(q, k, v, "float32", **options)
    assert_within(
        out, plain, tol, f"{backend.name}: out with and without return_lse, {setup}",
        behaviour="returns another output when asked for the lse",
    )  # fmt: skip


def _no_key_mask(kind: str, dtype: str) -> np.ndarray:
    """A mask (B, H, T, S) = (2, 3, 7, 13) whose rows [0, 1, 2] and [1, 0, 6] see no key:
    bool (False) or float (-inf)."""
    rng = np.random.default_rng(212)
    allowed = rng.random((2, 3, T, S)) < 0.7
    allowed[0, 1, 2] = False
    allowed[1, 0, 6] = False
    if kind == "bool":
        return allowed
    values = rng.standard_normal((2, 3, T, S))
    return np.where(allowed, values, -np.inf).astype(numpy_dtype(dtype))


@requires("lse")
@pytest.mark.clause("21.2")
@pytest.mark.parametrize(
    "kind, with_sinks",
    [
        pytest.param("bool", False, id="bool"),
        pytest.param("float", False, id="float"),
        pytest.param("bool", True, marks=requires("sinks"), id="bool-sinks"),
    ],
)
def test_row_with_no_key_has_lse_minus_inf(backend, kind, with_sinks):
    """A row whose keys are all blocked has lse exactly -inf, with sinks too (the sink does
    not join a row with no key, §15.3); the other rows are the oracle's."""
    q, k, v = random_qkv(213, T=T, S=S, dtype="float32")
    options = {"mask": _no_key_mask(kind, "float32")}
    if with_sinks:
        options["sinks"] = np.array([0.5, -1.0, 1.5], dtype=np.float32)
    _, lse = _check(backend, q, k, v, "float32", f"{kind} mask, rows with no key", **options)
    empty = np.asarray(lse)[[0, 1], [1, 0], [2, 6]]
    expect(
        bool(np.all(empty == -np.inf)),
        "gives an lse other than -inf for a row with no key",
        f"{backend.name}: rows with no key have lse {empty}, expected -inf",
    )


@requires("lse")
@pytest.mark.clause("21.2")
def test_no_keys_at_all_give_lse_minus_inf(backend):
    """S = 0: every row has no key, so every lse is -inf (and every output row 0)."""
    q, k, v = random_qkv(214, T=T, S=0, dtype="float32")
    _, lse = backend.attention(q, k, v, return_lse=True)
    expect(
        np.shape(lse) == (2, 3, T),
        "returns an lse of the wrong shape",
        f"{backend.name}: S = 0 gives lse of shape {np.shape(lse)}, expected (2, 3, {T})",
    )
    # A comparison, so that what it returned is named by its misreading (+inf, a number).
    assert_within(
        lse, np.full((2, 3, T), -np.inf), 0.0, f"{backend.name}: S = 0, lse expected -inf",
        behaviour="gives an lse other than -inf for a row with no key",
    )  # fmt: skip


@requires("lse")
@pytest.mark.clause("21.2")
def test_nan_row_has_lse_nan(backend):
    """A query row holding a NaN has lse NaN (its output row is NaN, §4.9); every other row
    is the oracle's."""
    q, k, v = random_qkv(215, T=T, S=S, dtype="float32")
    q[1, 2, 3, 0] = np.nan
    options = causal_where_taken(backend, T, S)
    _, lse = _check(backend, q, k, v, "float32", "a NaN in q[1, 2, 3]", **options)
    expect(
        bool(np.isnan(np.asarray(lse)[1, 2, 3])),
        "gives a number for the lse of a NaN row",
        f"{backend.name}: the NaN row has lse {np.asarray(lse)[1, 2, 3]}, expected NaN",
    )


@requires("lse")
@pytest.mark.clause("21.3")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lse_of_large_scores(backend, dtype):
    """Scores near ±1e4: the lse is near 1e4 and must not overflow (no exp() of a score
    unshifted); it is the oracle's within §21.3, whose floor grows with the scores."""
    q, k, v = random_qkv(216, T=T, S=S, dtype=dtype)
    q = (q * 3000.0).astype(q.dtype)
    _, lse = _check(backend, q, k, v, dtype, f"scores near 1e4, {dtype}")
    expect(
        float(np.max(np.abs(as64(lse)))) > 1e3,
        "returns an lse that differs from the oracle",
        f"{backend.name}: the scores of this case are near 1e4, the lse is not",
    )


@requires("lse")
@pytest.mark.clause("21.4")
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param("float16", marks=uses_dtype("float16")),
        pytest.param("bfloat16", marks=uses_dtype("bfloat16")),
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_lse_of_16_bit_inputs_is_float32(backend, dtype, causal):
    """float16 and bfloat16 inputs: the lse is float32 (the working precision, §4.5) and
    the oracle's, on the 16-bit values, within §21.3."""
    q, k, v = random_qkv(217, T=T, S=S, dtype=dtype)
    options = causal_where_taken(backend, T, S) if causal else {}
    _check(backend, q, k, v, dtype, f"{dtype}, causal={causal}", **options)


@requires("lse")
@pytest.mark.clause("21.2")
@pytest.mark.parametrize(
    "where",
    [
        pytest.param("mask", id="plus-inf-mask"),
        pytest.param("sink", marks=requires("sinks"), id="nan-sink"),
        pytest.param("value", id="nan-value"),
    ],
)
def test_lse_of_rows_whose_output_is_nan(backend, where):
    """A +inf score (a float mask's +inf) or a NaN sink makes its rows' lse NaN, as their
    output (§4.1, §15.4); a NaN value leaves the scores, and so the lse, as they were
    (§4.9). Every lse is the oracle's."""
    q, k, v = random_qkv(218, T=T, S=S, dtype="float32")
    options = {}
    if where == "mask":
        mask = np.zeros((T, S), dtype=np.float32)
        mask[2, 5] = np.inf
        options["mask"] = mask
    elif where == "sink":
        options["sinks"] = np.array([0.5, np.nan, 1.5], dtype=np.float32)
    else:
        v[0, 1, 4, 0] = np.nan
    _check(backend, q, k, v, "float32", f"rows whose output is NaN ({where})", **options)


@pytest.mark.clause("21.6", "8.5")
@refuses("lse")
def test_undeclared_lse_is_refused(backend, dtype):
    """A backend without 'lse' refuses return_lse=True with NotImplementedError naming it."""
    q, k, v = random_qkv(219, T=5, S=6, dtype=dtype)
    try:
        backend.attention(q, k, v, return_lse=True)
    except NotImplementedError as err:
        expect(
            "return_lse" in str(err),
            "refuses return_lse without naming it",
            f"{backend.name}: the refusal should name return_lse: {err}",
        )
        return
    raise Departure(
        f"{backend.name}: accepted return_lse=True without declaring 'lse'",
        "accepts return_lse though it does not declare 'lse'",
    )
