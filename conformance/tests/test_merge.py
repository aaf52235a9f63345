"""SPEC §22: merging partial states, on every backend that declares "merge".

The pieces are the oracle's (o, lse) over disjoint key sets (``oracle.attention(...,
return_lse=True)`` with a bool mask per set), rounded to the dtype under test; the
expected union is the oracle over every key, or, for the constructed pieces of §22.5,
the 50-digit merge of ``fixtures/oracle_merge.py``. Every merge here has o of shape
(2, 3, 7, 5): one program per dtype on a compiling backend."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import DTYPES, numpy_dtype
from conformance.fixtures import oracle_merge
from conformance.suite.helpers import random_qkv
from conformance.suite.pieces import (
    key_parts,
    lse_dtype,
    merge_tolerances,
    oracle_state,
    pieces_of,
    rounded,
)
from conformance.suite.requirements import refuses, requires
from conformance.suite.tolerance import assert_within, expect, expect_seen

B, H, T, E = 2, 3, 7, 5
dtypes = pytest.mark.parametrize("dtype", DTYPES)
#: The calls whose keys are cut into pieces: every key, causal (early rows see no key of
#: a late piece), and a bool mask with a row that sees no key at all.
SETUPS = ("plain", "causal", "bool-mask")


def _setup(name: str, S: int, seed: int):
    q, k, v = random_qkv(seed, B=B, H=H, T=T, S=S, D=E)
    options = {}
    if name == "causal":
        options["is_causal"] = True
    elif name == "bool-mask":
        mask = np.random.default_rng(seed + 1).random((B, H, T, S)) < 0.6
        mask[1, 2, 3] = False  # a row with no key: (0, -inf) in every piece
        options["mask"] = mask
    return q, k, v, options


def _merge(backend, a, b):
    return backend.merge_states(a[0], a[1], b[0], b[1])


def _check(got, expected, tols, context: str, behaviour: str) -> None:
    assert_within(got[0], expected[0], tols[0], f"{context}: o", behaviour=behaviour)
    assert_within(got[1], expected[1], tols[1], f"{context}: lse", behaviour=behaviour)


@pytest.mark.clause("22.1")
@requires("merge")
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("S", [13, 8])
@dtypes
def test_merge_is_attention_over_the_union(backend, setup, S, dtype):
    """Two pieces cut at random from the keys merge into the oracle's attention over all
    of them, o and lse, within §22.1's tolerance."""
    q, k, v, options = _setup(setup, S, 70 + S)
    a, b = pieces_of(q, k, v, key_parts(S, 2, 71 + S), dtype, **options)
    expected = oracle_state(q, k, v, **options)
    got = _merge(backend, a, b)
    expect(
        got[0].dtype == a[0].dtype and got[1].dtype == a[1].dtype,
        "returns the merge in another dtype",
        f"{backend.name}: merge_states gave o {got[0].dtype}, lse {got[1].dtype}; "
        f"expected o_a's {a[0].dtype} and lse_a's {a[1].dtype}",
    )
    tols = merge_tolerances([[a, b]], expected, dtype, backend.merge_conversion)
    _check(
        got, expected, tols, f"{backend.name}: merge of two pieces ({setup}, S={S}, {dtype})",
        "merges two pieces into something other than attention over their union",
    )  # fmt: skip


@pytest.mark.clause("22.2")
@requires("merge")
@dtypes
def test_the_empty_state_is_the_identity(backend, dtype):
    """Merging a state with the empty state (0, -inf), on either side, returns the state
    bit for bit."""
    q, k, v, options = _setup("bool-mask", 13, 72)
    state = rounded(*oracle_state(q, k, v, **options), dtype)
    empty = (np.zeros_like(state[0]), np.full_like(state[1], -np.inf))
    tols = merge_tolerances([[state, empty]], state, dtype)
    for name, pieces in (("state ⊕ empty", (state, empty)), ("empty ⊕ state", (empty, state))):
        got = _merge(backend, *pieces)
        for part, x, y, tol in zip(("o", "lse"), got, state, tols):
            # Bit for bit; what it returned goes with the finding, for the diagnosis.
            x, y = np.asarray(x), np.asarray(y)
            expect_seen(
                x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True),
                "changes a state merged with the empty state",
                f"{backend.name}: {name}, {part} ({dtype}): not bit-for-bit the state",
                x, tol,
            )  # fmt: skip


@pytest.mark.clause("22.3")
@requires("merge")
@dtypes
def test_two_empty_states_give_the_empty_state(backend, dtype):
    """Two empty states merge into (0, -inf) exactly, never NaN (-inf - -inf)."""
    o = np.zeros((B, H, T, E), dtype=numpy_dtype(dtype))
    lse = np.full((B, H, T), -np.inf, dtype=numpy_dtype(lse_dtype(dtype)))
    got = backend.merge_states(o, lse, o.copy(), lse.copy())
    # Exactly: a tolerance of 0, NaN and -inf compared as they are (SPEC §7.4).
    for part, x, y in (("o", got[0], o), ("lse", got[1], lse)):
        assert_within(
            x, y, 0.0, f"{backend.name}: empty ⊕ empty, {part} ({dtype})",
            behaviour="merges two empty pieces into NaN or a non-empty state",
        )  # fmt: skip


#: Four pieces a, b, c, d merged in several orders and groupings.
ORDERS = {
    "((ab)c)d": lambda m, a, b, c, d: m(m(m(a, b), c), d),
    "a(b(cd))": lambda m, a, b, c, d: m(a, m(b, m(c, d))),
    "(dc)(ba)": lambda m, a, b, c, d: m(m(d, c), m(b, a)),
    "((ca)d)b": lambda m, a, b, c, d: m(m(m(c, a), d), b),
}


@pytest.mark.clause("22.4")
@requires("merge")
@pytest.mark.parametrize("setup", ["plain", "causal"])
@dtypes
def test_any_order_and_grouping_agree(backend, setup, dtype):
    """Four pieces merged in four orders and groupings all give the union within
    tolerance (the naive merge's largest error over left-to-right orders, times k)."""
    q, k, v, options = _setup(setup, 13, 73)
    pieces = pieces_of(q, k, v, key_parts(13, 4, 74), dtype, **options)
    expected = oracle_state(q, k, v, **options)
    a, b, c, d = pieces
    orders = [[a, b, c, d], [d, c, b, a], [c, a, d, b], [b, a, d, c]]
    tols = merge_tolerances(orders, expected, dtype, backend.merge_conversion)
    # Another grouping adds at most one more rounding of o per level: k covers it.
    for name, run in ORDERS.items():
        got = run(lambda x, y: _merge(backend, x, y), *pieces)
        _check(
            got, expected, tols, f"{backend.name}: pieces merged as {name} ({setup}, {dtype})",
            "gives another answer when the pieces are merged in another order",
        )  # fmt: skip


def _far_apart(dtype: str):
    """Constructed pieces whose lse lie 1e4 apart, at the ends of the range and near the
    largest float of lse's dtype, one pair per row (the rows cycle through them)."""
    # 0.6 of the largest float: lse_a + lse_b and exp(lse) overflow, and the same lse in
    # base 2 (a function declaring lse_base = "2" gets lse · log₂e) is still finite.
    big = 0.6 * float(np.finfo(numpy_dtype(lse_dtype(dtype))).max)
    pairs = [
        (0.0, 1e4), (1e4, 0.0), (-1e4, 1e4), (1e4, 1e4 + 1.0), (big, big), (big, -big),
        (-big, big), (0.5 * big, big), (-big, -big), (big, 0.0), (-1e4, -1e4 - 2.0),
    ]  # fmt: skip
    rows = np.array([pairs[i % len(pairs)] for i in range(B * H * T)])  # (B·H·T, 2)
    lse_a, lse_b = (rows[:, i].reshape(B, H, T) for i in (0, 1))  # (B, H, T)
    rng = np.random.default_rng(75)
    o_a, o_b = rng.uniform(-1, 1, (2, B, H, T, E))  # (B, H, T, E) each
    return rounded(o_a, lse_a, dtype), rounded(o_b, lse_b, dtype)


@pytest.mark.clause("22.5")
@requires("merge")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_merge_does_not_overflow(backend, dtype):
    """Pieces whose lse differ by 1e4, or lie near the largest float, merge into the
    50-digit merge of the same pieces: finite, within tolerance."""
    a, b = _far_apart(dtype)
    expected = oracle_merge.merge_states([a, b])
    tols = merge_tolerances([[a, b]], expected, dtype, backend.merge_conversion)
    _check(
        _merge(backend, a, b), expected, tols, f"{backend.name}: lse far apart ({dtype})",
        "overflows when merging pieces whose log-sum-exps are far apart or huge",
    )  # fmt: skip


@pytest.mark.clause("22.6")
@requires("merge")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_sink_is_a_piece_of_its_own(backend, dtype):
    """A row's sink merged as one more piece, (0, sink) for a row that sees a key and the
    empty state for one that sees none, gives the oracle's attention with sinks."""
    q, k, v, options = _setup("bool-mask", 13, 76)
    sinks = np.random.default_rng(77).uniform(-1.0, 2.0, H)  # (H,)
    a, b = pieces_of(q, k, v, key_parts(13, 2, 78), dtype, **options)
    expected = oracle_state(q, k, v, sinks=sinks, **options)
    _, union_lse = oracle_state(q, k, v, **options)
    sink_lse = np.where(union_lse > -np.inf, sinks[None, :, None], -np.inf)  # (B, H, T)
    sink = rounded(np.zeros_like(expected[0]), sink_lse, dtype)
    tols = merge_tolerances([[a, b, sink], [sink, b, a]], expected, dtype, backend.merge_conversion)
    # Each merged and checked in turn: a failure's last call is the merge it checks.
    for name, run in (
        ("(a b) sink", lambda: _merge(backend, _merge(backend, a, b), sink)),
        ("sink (b a)", lambda: _merge(backend, sink, _merge(backend, b, a))),
    ):
        got = run()
        _check(
            got, expected, tols, f"{backend.name}: {name} ({dtype})",
            "merges a sink piece into something other than attention with the sink",
        )  # fmt: skip


@pytest.mark.clause("22.7")
@requires("merge")
def test_a_nan_piece_makes_its_row_nan(backend, dtype):
    """A piece whose row is NaN (lse NaN) makes that row of the merge NaN, o and lse; the
    other rows are untouched by it."""
    q, k, v, options = _setup("plain", 13, 79)
    a, b = pieces_of(q, k, v, key_parts(13, 2, 80), dtype, **options)
    a = (a[0].copy(), a[1].copy())
    a[0][0, 1, 2] = np.nan
    a[1][0, 1, 2] = np.nan
    o, lse = _merge(backend, a, b)
    expect(
        bool(np.isnan(o[0, 1, 2]).all() and np.isnan(lse[0, 1, 2])),
        "loses a NaN piece in the merge",
        f"{backend.name}: row (0, 1, 2) has lse NaN in piece a; the merge gave o "
        f"{o[0, 1, 2]}, lse {lse[0, 1, 2]}",
    )
    rest = np.ones((B, H, T), dtype=bool)  # (B, H, T)
    rest[0, 1, 2] = False
    expect(
        bool(np.isfinite(o[rest]).all() and np.isfinite(lse[rest]).all()),
        "spreads a NaN piece into other rows",
        f"{backend.name}: rows without NaN came out non-finite",
    )


@pytest.mark.clause("22.9")
@requires("merge")
@requires("error_messages")
@pytest.mark.parametrize(
    ("which", "shape"), [("o_b", (B, H, T, E + 1)), ("lse_b", (B, H, T + 1)), ("lse_a", (B, H))]
)
def test_merge_refuses_states_of_other_rows(backend, which, shape, dtype):
    """Two states of different rows are refused with ValueError naming the argument."""
    o = np.zeros((B, H, T, E), dtype=numpy_dtype(dtype))
    lse = np.zeros((B, H, T), dtype=numpy_dtype(lse_dtype(dtype)))
    given = {"o_a": o, "lse_a": lse, "o_b": o, "lse_b": lse}
    given[which] = np.zeros(shape, dtype=given[which].dtype)
    with pytest.raises(ValueError, match=which):
        backend.merge_states(given["o_a"], given["lse_a"], given["o_b"], given["lse_b"])


@pytest.mark.clause("22.9")
@refuses("merge")
def test_merge_states_is_refused_where_not_declared(backend, dtype):
    """A backend that does not declare "merge" refuses merge_states by name (SPEC §8.5)."""
    o = np.zeros((B, H, T, E), dtype=numpy_dtype(dtype))
    lse = np.zeros((B, H, T), dtype=numpy_dtype(lse_dtype(dtype)))
    with pytest.raises(NotImplementedError, match="merge"):
        backend.merge_states(o, lse, o, lse)
