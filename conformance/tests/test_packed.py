"""SPEC §18: packed variable-length sequences, ``attention_packed(q, k, v, cu_seqlens_q,
cu_seqlens_k)``: documents one after another, each attended alone. Expected values come
from the oracle, which slices the documents and runs the 50-digit oracle on each (or, for
the worked example, from the hand computation in ``fixtures/worked_example.json``).

The packings share one shape, T = 9 and S = 11 in N = 4 documents, and differ only in
their boundaries: a backend that compiles traces the boundaries (§18.4), so they cost no
new program."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import numpy_dtype
from conformance.suite.cases import case_entries, case_marks, load_case, worked_example
from conformance.suite.helpers import as64, setup_params, worked_qkv
from conformance.suite.oracle_store import oracle
from conformance.suite.requirements import SuiteError, requires, uses_dtype
from conformance.suite.tolerance import (
    Departure,
    assert_identical,
    assert_rows_zero,
    assert_within,
    expect,
    finite_error,
    tolerance,
)

pytestmark = requires("packed")

dtypes = pytest.mark.parametrize("dtype", ["float64", "float32"])
GRADS = ("dq", "dk", "dv")
T, S, N = 9, 11, 4

#: Boundaries (cu_seqlens_q, cu_seqlens_k) of the packings, all with T = 9, S = 11, N = 4.
PACKINGS = {
    # An empty document (T_n = S_n = 0), one with queries and no key (T_n = 2, S_n = 0),
    # and two with T_n != S_n.
    "empty-and-keyless": ([0, 3, 3, 5, 9], [0, 4, 4, 4, 11]),
    # A document with keys and no query (T_n = 0, S_n = 4) and one with T_n > S_n.
    "queryless-T-above-S": ([0, 1, 1, 6, 9], [0, 2, 6, 8, 11]),
    # Everything in one document: attention on the whole sequence.
    "one-document": ([0, 0, 9, 9, 9], [0, 0, 11, 11, 11]),
}

#: Options and their capabilities: what packing meets (SPEC §18.2). "K" and "E" are
#: sizes, the rest options of attention_packed.
SETUPS = {
    "plain": ({}, ()),
    "causal": ({"is_causal": True}, ()),
    "causal-bottom-right": (
        {"is_causal": True, "causal_alignment": "bottom_right"},
        ("causal_bottom_right",),
    ),
    "bottom-right-window": (
        {"causal_alignment": "bottom_right", "window": (2, 1)},
        ("causal_bottom_right", "window"),
    ),
    "softcap-scale": ({"softcap": 1.5, "scale": 0.7}, ("softcap",)),
    "gqa-causal": ({"is_causal": True, "K": 1}, ("gqa",)),
    "value-dim": ({"E": 3}, ("value_dim",)),
}


def _inputs(seed: int, dtype: str, H: int = 2, K: int | None = None, D: int = 4, E=None):
    """Standard-normal packed q (H, T, D), k (K, S, D), v (K, S, E) in ``dtype``."""
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((H, T, D)).astype(dt)
    k = rng.standard_normal((K or H, S, D)).astype(dt)
    v = rng.standard_normal((K or H, S, E or D)).astype(dt)
    return q, k, v


def _setup(name: str, dtype: str, seed: int):
    options, _ = SETUPS[name]
    options = dict(options)
    q, k, v = _inputs(seed, dtype, K=options.pop("K", None), E=options.pop("E", None))
    return q, k, v, options


def _bounds(packing: str) -> tuple[np.ndarray, np.ndarray]:
    cu_q, cu_k = PACKINGS[packing]
    return np.array(cu_q, dtype=np.int32), np.array(cu_k, dtype=np.int32)


def _oracle(q, k, v, cu_q, cu_k, dtype: str, **options) -> tuple[np.ndarray, float]:
    """The packed oracle's output, and SPEC §7's tolerance: the naive run in ``dtype``,
    document by document, against it."""
    args = (as64(q), as64(k), as64(v), cu_q, cu_k)
    expected = oracle.attention_packed(*args, **options)
    naive = oracle.naive_packed_same_precision(*args, numpy_dtype(dtype), **options)
    return expected, tolerance(dtype, finite_error(naive, expected), expected)


def _keyless_rows(cu_q, cu_k, options) -> np.ndarray:
    """(T,) bool: the queries that attend no key, from SPEC §18.2 by hand: query i of
    document n sits at i (top-left) or i + S_n - T_n (bottom-right) and attends its
    document's keys j with j <= that (causal) and within the window."""
    rows = np.zeros(T, dtype=bool)
    left, right = options.get("window") or (None, None)
    if options.get("is_causal"):
        right = 0 if right is None else min(right, 0)
    for n in range(len(cu_q) - 1):
        Tn, Sn = int(cu_q[n + 1] - cu_q[n]), int(cu_k[n + 1] - cu_k[n])
        shift = Sn - Tn if options.get("causal_alignment") == "bottom_right" else 0
        for i in range(Tn):
            lo = 0 if left is None else max(0, i + shift - left)
            hi = Sn - 1 if right is None else min(Sn - 1, i + shift + right)
            rows[cu_q[n] + i] = lo > hi
    return rows


@pytest.mark.clause("18.1", "11.1")
@pytest.mark.parametrize(
    "key",
    [
        "non_causal",
        pytest.param("causal", marks=requires("causal", "causal_top_left"), id="causal"),
        pytest.param(
            "unequal_top_left", marks=requires("causal", "causal_top_left"), id="unequal_top_left"
        ),
        pytest.param("unequal_bottom_right", marks=requires("causal_bottom_right", "causal")),
    ],
)
def test_packed_worked_example(backend, key, dtype):
    """The hand-checked example (fixtures/worked_example.json, "packed"): every score 0, so
    each row averages the values of its own document that it may see, and never another's."""
    ex = worked_example()["packed"]
    q, k, v = worked_qkv(ex, backend, dtype, lead=1)
    cu_q = cu_k = np.array(ex["cu_seqlens"])
    options = {"is_causal": key != "non_causal"}
    if key.startswith("unequal"):
        cu_q, cu_k = (np.array(ex["unequal"][n]) for n in ("cu_seqlens_q", "cu_seqlens_k"))
        q = q[:, :2]
        if key == "unequal_bottom_right":
            options["causal_alignment"] = "bottom_right"
    out = backend.attention_packed(q, k, v, cu_q, cu_k, **options)[0]
    hand = np.array(ex[key]["hand"])
    assert_within(
        out,
        hand,
        tolerance(dtype, 0.0, hand),
        f"{backend.name}: the packed worked example ({key}, {dtype})",
        behaviour="gets the packed worked example wrong",
    )


@pytest.mark.clause("18.1", "18.2", "18.4")
@dtypes
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("setup", setup_params(SETUPS))
def test_packed_matches_the_oracle(backend, dtype, packing, setup):
    """Each packing with causality in both alignments, a window, softcap and a scale, GQA
    and E != D: the output is the oracle's within SPEC §7, shaped (H, T, E) in q's dtype,
    and a query with no key in its document returns exactly 0."""
    q, k, v, options = _setup(setup, dtype, 180)
    cu_q, cu_k = _bounds(packing)
    expected, tol = _oracle(q, k, v, cu_q, cu_k, dtype, **options)
    out = backend.attention_packed(q, k, v, cu_q, cu_k, **options)
    expect(
        out.shape == expected.shape and out.dtype == q.dtype,
        "attention_packed returns the wrong shape or dtype",
        f"{backend.name}: got {out.dtype} {out.shape}, expected {q.dtype} {expected.shape}",
    )
    context = f"{backend.name}: attention_packed, {packing}, {setup} ({dtype})"
    assert_rows_zero(out, _keyless_rows(cu_q, cu_k, options)[None, :], context)
    assert_within(out, expected, tol, context, behaviour="packed attention differs from the oracle")


@pytest.mark.clause("18.1", "4.5")
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param("float16", marks=uses_dtype("float16")),
        pytest.param("bfloat16", marks=uses_dtype("bfloat16")),
    ],
)
@requires("causal", "causal_top_left")
def test_packed_low_precision(backend, dtype):
    """float16 and bfloat16, causal, on the packing with an empty and a keyless document:
    within SPEC §7 of the oracle (computed in float32, §4.5)."""
    q, k, v = _inputs(181, dtype)
    cu_q, cu_k = _bounds("empty-and-keyless")
    expected, tol = _oracle(q, k, v, cu_q, cu_k, dtype, is_causal=True)
    out = backend.attention_packed(q, k, v, cu_q, cu_k, is_causal=True)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: attention_packed, causal ({dtype})",
        behaviour="packed attention differs from the oracle",
    )


@pytest.mark.clause("18.1")
@requires("causal_bottom_right", "causal")
def test_packed_is_attention_per_document(backend, dtype):
    """Each document's rows are ``attention`` on that document alone, (1, H, T_n, D), with
    the same options (bottom-right causal, so each document's diagonal is its own
    S_n - T_n): within twice SPEC §7."""
    q, k, v = _inputs(182, dtype)
    cu_q, cu_k = _bounds("queryless-T-above-S")
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    out = backend.attention_packed(q, k, v, cu_q, cu_k, **options)
    _, tol = _oracle(q, k, v, cu_q, cu_k, dtype, **options)
    for n in range(N):
        tq, sk = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        if tq.stop == tq.start or sk.stop == sk.start:
            continue  # nothing to compare, or rows of 0 (test_packed_matches_the_oracle)
        alone = backend.attention(q[None, :, tq], k[None, :, sk], v[None, :, sk], **options)
        assert_within(
            out[:, tq],
            alone[0],
            2 * tol,
            f"{backend.name}: document {n} of attention_packed against attention on it alone",
            behaviour="a packed document differs from attention on that document alone",
        )


#: What is written into one document's keys and values to test isolation (SPEC §18.3).
POISONS = {"changed": None, "nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@pytest.mark.clause("18.3")
@pytest.mark.parametrize("poison", list(POISONS))
@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
def test_documents_are_isolated(backend, dtype, poison, causal):
    """Changing one document's keys and values (to other numbers, or to NaN, +inf or -inf
    throughout) leaves the rows of every other document bit for bit unchanged, and a NaN
    in one document's queries reaches no other document."""
    q, k, v = _inputs(183, dtype)
    cu_q, cu_k = _bounds("empty-and-keyless")
    base = backend.attention_packed(q, k, v, cu_q, cu_k, is_causal=causal)
    doc = np.repeat(np.arange(N), np.diff(cu_q))  # (T,): each query's document
    for m in (0, 3):
        keys = slice(cu_k[m], cu_k[m + 1])
        k2, v2, q2 = k.copy(), v.copy(), q.copy()
        if POISONS[poison] is None:
            k2[:, keys] = (k2[:, keys].astype(np.float64) * -7 + 5).astype(k.dtype)
            v2[:, keys] = (v2[:, keys].astype(np.float64) * 9 - 3).astype(v.dtype)
        else:
            k2[:, keys] = POISONS[poison]
            v2[:, keys] = POISONS[poison]
            q2[:, doc == m] = POISONS[poison]
        out = backend.attention_packed(q2, k2, v2, cu_q, cu_k, is_causal=causal)
        assert_identical(
            out[:, doc != m],
            base[:, doc != m],
            f"{backend.name}: rows outside document {m} after writing {poison} into its "
            f"keys {keys.start}-{keys.stop - 1}{'' if POISONS[poison] is None else ' and queries'}",
            behaviour=f"{poison} keys and values of one packed document change another's rows",
        )


# --- The fixtures (SPEC §18.1, §18.5) ----------------------------------------------------------


def _fixture_params(kind: str):
    return [pytest.param(e["id"], marks=case_marks(e), id=e["id"]) for e in case_entries((kind,))]


def _case_args(case):
    a = case.arrays
    return a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"]


def _case_options(case) -> dict:
    """The options of a packed case, those at their defaults left out."""
    defaults = {"causal_alignment": "top_left", "window": None, "softcap": None}
    opts = dict(case.meta["options"])
    if opts.get("window") is not None:
        opts["window"] = tuple(opts["window"])
    return {n: x for n, x in opts.items() if n not in defaults or x != defaults[n]}


@pytest.mark.parametrize("case_id", _fixture_params("attention_packed"))
def test_packed_fixture(backend, case_id):
    """The packed fixtures against the oracle's stored output, within SPEC §7 (the naive
    run document by document, on this machine, against it)."""
    case = load_case(case_id)
    dt = numpy_dtype(case.dtype)
    q, k, v, cu_q, cu_k = _case_args(case)
    options = _case_options(case)
    expected = case.arrays["expected"]
    naive = oracle.naive_packed_same_precision(q, k, v, cu_q, cu_k, dt, **options)
    out = backend.attention_packed(q.astype(dt), k.astype(dt), v.astype(dt), cu_q, cu_k, **options)
    assert_within(
        out,
        expected,
        tolerance(case.dtype, finite_error(naive, expected), expected),
        f"{backend.name}: fixture {case_id}",
        behaviour="packed attention differs from the oracle",
    )


@pytest.mark.parametrize("case_id", _fixture_params("attention_packed_grad"))
def test_packed_gradient_fixture(backend, case_id):
    """The packed gradient fixtures against the oracle's stored gradients, within SPEC
    §12.9."""
    case = load_case(case_id)
    dt = numpy_dtype(case.dtype)
    q, k, v, cu_q, cu_k = _case_args(case)
    d_out = case.arrays["d_out"]
    options = _case_options(case)
    naive = oracle.naive_packed_vjp_same_precision(q, k, v, cu_q, cu_k, d_out, dt, **options)
    got = backend.attention_packed_vjp(
        q.astype(dt), k.astype(dt), v.astype(dt), cu_q, cu_k, d_out.astype(dt), **options
    )
    for name, g in zip(GRADS, got):
        want = case.arrays[f"expected.{name}"]
        assert_within(
            g,
            want,
            tolerance(case.dtype, finite_error(naive[name], want), want),
            f"{backend.name}: {name} of fixture {case_id}",
            behaviour="the packed gradients differ from the oracle",
        )


# --- The gradient (SPEC §18.5) ---------------------------------------------------------------


@pytest.mark.clause("18.5", "12.9")
@dtypes
@pytest.mark.parametrize("packing", ["empty-and-keyless", "queryless-T-above-S"])
@pytest.mark.parametrize("setup", setup_params(SETUPS, grad=True))
def test_packed_gradients_match_the_oracle(backend, dtype, packing, setup):
    """dq, dk, dv of attention_packed against the oracle (each document's gradients),
    within SPEC §12.9, shaped and typed like q, k, v; a key of a document with no query
    and a query of a document with no key get exactly 0."""
    q, k, v, options = _setup(setup, dtype, 184)
    cu_q, cu_k = _bounds(packing)
    d_out = np.random.default_rng(185).standard_normal((q.shape[0], T, v.shape[-1]))
    d_out = d_out.astype(q.dtype)
    got = backend.attention_packed_vjp(q, k, v, cu_q, cu_k, d_out, **options)
    expect(
        len(got) == 3,
        "attention_packed_vjp returns another set of gradients than (dq, dk, dv)",
        f"{backend.name}: got {len(got)} gradients",
    )
    args = (as64(q), as64(k), as64(v), cu_q, cu_k, as64(d_out))
    expected = oracle.attention_packed_vjp(*args, **options)
    naive = oracle.naive_packed_vjp_same_precision(*args, numpy_dtype(dtype), **options)
    for name, like, g in zip(GRADS, (q, k, v), got):
        expect(
            g.shape == like.shape and g.dtype == like.dtype,
            "returns gradients of the wrong shape or dtype",
            f"{backend.name}: {name} is {g.dtype} {g.shape}, expected {like.dtype} {like.shape}",
        )
        want = expected[name]
        assert_within(
            g,
            want,
            tolerance(dtype, finite_error(naive[name], want), want),
            f"{backend.name}: {name} of attention_packed, {packing}, {setup} ({dtype})",
            behaviour="the packed gradients differ from the oracle",
        )
    nothing = {"dq": np.zeros(T, dtype=bool), "dk": np.zeros(S, dtype=bool)}
    for n in range(N):
        if cu_k[n + 1] == cu_k[n]:
            nothing["dq"][cu_q[n] : cu_q[n + 1]] = True
        if cu_q[n + 1] == cu_q[n]:
            nothing["dk"][cu_k[n] : cu_k[n + 1]] = True
    for name, g in (("dq", got[0]), ("dk", got[1]), ("dv", got[2])):
        rows = nothing["dq" if name == "dq" else "dk"]
        expect(
            (g[:, rows] == 0).all(),
            "a packed document with no query (or no key) gets a gradient",
            f"{backend.name}: {name} is not exactly 0 where its document has no "
            f"{'key' if name == 'dq' else 'query'} ({packing}, {setup})",
        )


@pytest.mark.clause("18.5", "18.3")
@requires("grad", "causal", "causal_top_left")
def test_packed_gradients_are_isolated(backend, dtype):
    """NaN in one document's q, k, v and d_out leaves every other document's gradients
    bit for bit unchanged, causal."""
    q, k, v = _inputs(186, dtype)
    cu_q, cu_k = _bounds("empty-and-keyless")
    d_out = np.random.default_rng(187).standard_normal((2, T, 4)).astype(q.dtype)
    base = backend.attention_packed_vjp(q, k, v, cu_q, cu_k, d_out, is_causal=True)
    q2, k2, v2, d2 = q.copy(), k.copy(), v.copy(), d_out.copy()
    q2[:, 5:9], k2[:, 4:11], v2[:, 4:11], d2[:, 5:9] = np.nan, np.nan, np.nan, np.nan
    got = backend.attention_packed_vjp(q2, k2, v2, cu_q, cu_k, d2, is_causal=True)
    for name, g, b, part in zip(GRADS, got, base, (slice(0, 5), slice(0, 4), slice(0, 4))):
        assert_identical(
            g[:, part],
            b[:, part],
            f"{backend.name}: {name} of documents 0-2 after NaN in document 3",
            behaviour="NaN in one packed document changes another's gradients",
        )


# --- Errors (SPEC §18.1) ---------------------------------------------------------------------


#: Bad boundaries: (cu_seqlens_q, cu_seqlens_k, the argument at fault, the exception).
BAD = {
    "float-dtype": ([0.0, 4.0, 9.0], [0, 5, 11], "cu_seqlens_q", TypeError),
    "bool-dtype": ([0, 4, 9], [False, True, True], "cu_seqlens_k", TypeError),
    "2-d": ([[0, 4, 9]], [0, 5, 11], "cu_seqlens_q", ValueError),
    "start-not-0": ([1, 4, 9], [0, 5, 11], "cu_seqlens_q", ValueError),
    "decreasing": ([0, 4, 9], [0, 6, 5, 11], "cu_seqlens_k", ValueError),
    "end-not-T": ([0, 4, 8], [0, 5, 11], "cu_seqlens_q", ValueError),
    "end-not-S": ([0, 4, 9], [0, 5, 12], "cu_seqlens_k", ValueError),
    "different-N": ([0, 4, 9], [0, 5, 7, 11], "cu_seqlens_k", ValueError),
}


@pytest.mark.clause("18.1", "8.1")
@pytest.mark.parametrize("what", list(BAD))
def test_bad_cu_seqlens_are_refused(backend, dtype, what):
    """Boundaries of the wrong dtype (TypeError), rank, start, order, end or count
    (ValueError) are refused, naming the argument."""
    q, k, v = _inputs(188, dtype)
    cu_q, cu_k, name, error = BAD[what]
    cu_q, cu_k = np.array(cu_q), np.array(cu_k)
    try:
        backend.attention_packed(q, k, v, cu_q, cu_k)
    except error as err:
        if "error_messages" in backend.capabilities:
            expect(
                name in str(err),
                "refuses bad cu_seqlens without naming them",
                f"{backend.name}: the error for {what} should name {name}: {err}",
            )
        return
    except SuiteError:
        raise
    except Exception as err:
        raise Departure(
            f"{backend.name}: raised {type(err).__name__} for {what} boundaries: {err}",
            f"raises {type(err).__name__}, not {error.__name__}, for {what} cu_seqlens",
        ) from err
    raise Departure(f"{backend.name}: accepted {what} boundaries", f"accepts {what} cu_seqlens")
