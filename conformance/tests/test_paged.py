"""SPEC §19: paged KV caches, ``attention_paged`` and ``attention_paged_vjp``: keys and
values in a pool of pages of L slots, each sequence's pages named by its row of the block
table, its length by seq_lens (vLLM, FlashInfer, FlashAttention's flash_attn_with_kvcache).
Expected values come from the oracle (``fixtures/oracle.py:attention_paged``, which gathers
each sequence's keys slot by slot and calls the dense oracle) or, for the worked example,
from the hand computation in ``fixtures/worked_example.json``; the fixtures ``paged-*``
and ``grad-paged-*`` run here too.

One shape set serves every test (B = 3 sequences, H = 2, T = 3 or 1, N = 9 pages of L = 3
slots, M = 4 table entries): the tables and lengths change from test to test, and since a
JAX backend traces them, that costs no new program."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import numpy_dtype
from conformance.suite.cases import case_entries, case_marks, load_case, worked_example
from conformance.suite.helpers import as64
from conformance.suite.oracle_store import oracle
from conformance.suite.requirements import SuiteError, requires
from conformance.suite.tolerance import (
    Departure,
    assert_identical,
    assert_rows_zero,
    assert_within,
    expect,
    finite_error,
    tolerance,
)

pytestmark = requires("paged")

B, H, D, N, L, M = 3, 2, 3, 9, 3, 4
GRADS = ("dq", "dk_pages", "dv_pages")

#: Tables (B, M) and lengths (B,): pages shuffled; a prefix shared by all three sequences
#: (pages 5 and 2); a length that ends mid-page, an empty sequence and table tails of -1
#: and N + 5, which must never be read (SPEC §19.3).
TABLES = {
    "shuffled": ([[5, 2, 7, -1], [0, 8, 3, 1], [4, 6, -1, -1]], [8, 12, 4]),
    "shared-prefix": ([[5, 2, 7, -1], [5, 2, 0, 1], [5, 2, 6, -1]], [9, 11, 7]),
    "mid-page-and-empty": ([[1, 3, -1, -1], [-1, -1, -1, -1], [8, 0, 2, N + 5]], [5, 0, 7]),
}

#: Options (and K, E) with the capabilities they use (SPEC §19.2).
SETUPS = {
    "plain": ({}, ()),
    "causal": ({"is_causal": True}, ()),
    "window": ({"window": (2, 1)}, ("window",)),
    "causal-window-softcap-scale": (
        {"is_causal": True, "window": (4, 0), "softcap": 2.0, "scale": 0.4},
        ("window", "softcap"),
    ),
    "gqa-causal": ({"is_causal": True, "K": 1}, ("gqa",)),
    "value-dim": ({"E": 5}, ("value_dim",)),
}


def _inputs(seed: int, table: str, dtype: str, *, T: int = 3, K: int = 2, E: int = D):
    """q (B, H, T, D), k_pages (N, K, L, D), v_pages (N, K, L, E) in ``dtype``, standard
    normal, and the table and lengths named ``table``."""
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((B, H, T, D)).astype(dt)
    k_pages = rng.standard_normal((N, K, L, D)).astype(dt)
    v_pages = rng.standard_normal((N, K, L, E)).astype(dt)
    block_table, seq_lens = (np.array(x, dtype=np.int64) for x in TABLES[table])
    return q, k_pages, v_pages, block_table, seq_lens


def _setup(name: str, table: str, dtype: str, seed: int, T: int = 3):
    options, _ = SETUPS[name]
    options = dict(options)
    shape = {"K": options.pop("K", 2), "E": options.pop("E", D)}
    return _inputs(seed, table, dtype, T=T, **shape), options


def _read(block_table: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Which page slots some sequence reads, (N, L) bool."""
    read = np.zeros((N, L), dtype=bool)
    for b, n in enumerate(seq_lens):
        for s in range(n):
            read[block_table[b, s // L], s % L] = True
    return read


def _oracle(arrays, dtype: str, **options) -> tuple[np.ndarray, float]:
    """The paged oracle's output, and SPEC §7's tolerance: the naive run in ``dtype`` on the
    same gathered inputs against the oracle."""
    q, k_pages, v_pages, table, lens = arrays
    wide = (as64(q), as64(k_pages), as64(v_pages), table, lens)
    expected = oracle.attention_paged(*wide, **options)
    naive = oracle.attention_paged(*wide, naive_dtype=numpy_dtype(dtype), **options)
    return expected, tolerance(dtype, finite_error(naive, expected), expected)


def _params(T: int, grad: bool = False, setups=SETUPS):
    """(setup, table) pairs, marked with what they use; a causal setup only with tables
    whose every sequence holds at least T keys (SPEC §19.1)."""
    params = []
    for name in setups:
        options, caps = SETUPS[name]
        needs = list(caps)
        if grad:
            needs.append("grad")
            if "softcap" in options:
                needs.append("grad_softcap")
        for table, (_, lens) in TABLES.items():
            if options.get("is_causal") and min(lens) < T:
                continue
            params.append(pytest.param(name, table, marks=requires(*needs), id=f"{name}-{table}"))
    return params


# --- The forward (SPEC §19.1, §19.2) ---------------------------------------------------------


@pytest.mark.clause("19.1", "11.1")
@pytest.mark.parametrize("key", ["decode", "causal_last_two"])
def test_paged_worked_example(backend, key, dtype):
    """The hand-checked example (fixtures/worked_example.json, "paged"): one sequence of 3
    keys in pages [1, 0] of 2 slots, every score 0: a row is the mean of the values it sees,
    read in table order; the slot past the length is not read."""
    ex = worked_example()["paged"]
    dt = numpy_dtype(dtype)
    q = np.array(ex["q"], dtype=dt)[None, None]
    k_pages, v_pages = (np.array(ex[n], dtype=dt) for n in ("k_pages", "v_pages"))
    table, lens = np.array(ex["block_table"]), np.array(ex["seq_lens"])
    if key == "decode":
        q = q[:, :, 1:]
    out = backend.attention_paged(
        q, k_pages, v_pages, table, lens, is_causal=key == "causal_last_two"
    )
    hand = np.array(ex[key]["hand"])
    assert_within(
        out[0, 0],
        hand,
        tolerance(dtype, 0.0, hand),
        f"{backend.name}: the paged worked example ({key}, {dtype})",
        behaviour="gets the paged worked example wrong",
    )


@pytest.mark.clause("19.1", "19.2")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("T", [3, 1], ids=["prefill-T3", "decode-T1"])
@pytest.mark.parametrize("setup, table", _params(T=3))
def test_paged_matches_the_oracle(backend, setup, table, T, dtype):
    """Shuffled pages, a shared prefix, a length ending mid-page and an empty sequence, with
    causality, a window, softcap and scale, GQA and E ≠ D, for a decode step (T = 1) and a
    chunk of prefill (T = 3): the oracle's output within SPEC §7; a sequence with no key
    gives rows of exactly 0."""
    arrays, options = _setup(setup, table, dtype, 100, T=T)
    expected, tol = _oracle(arrays, dtype, **options)
    out = backend.attention_paged(*arrays, **options)
    expect(
        out.shape == expected.shape and out.dtype == arrays[0].dtype,
        "returns a paged output of the wrong shape or dtype",
        f"{backend.name}: got {out.dtype} {out.shape}, expected {arrays[0].dtype} {expected.shape}",
    )
    empty = (arrays[4] == 0)[:, None, None]  # (B, 1, 1): sequences with no key
    assert_rows_zero(out, np.broadcast_to(empty, out.shape[:-1]), f"{backend.name}: {table}")
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: attention_paged, {setup}, {table}, T={T} ({dtype})",
        behaviour="paged attention differs from the oracle",
    )


@pytest.mark.clause("19.2", "4.5")
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param("float16", marks=requires("softcap")),
        pytest.param("bfloat16", marks=requires("softcap")),
    ],
)
def test_paged_low_precision(backend, dtype):
    """float16 and bfloat16 pages, computed in float32 (SPEC §4.5): the oracle's output
    within SPEC §7, shared prefix pages, causal with a softcap."""
    arrays = _inputs(101, "shared-prefix", dtype)
    options = {"is_causal": True, "softcap": 2.0}
    expected, tol = _oracle(arrays, dtype, **options)
    out = backend.attention_paged(*arrays, **options)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: attention_paged, shared prefix, causal, softcap ({dtype})",
        behaviour="paged attention differs from the oracle",
    )


@pytest.mark.clause("19.1")
@requires("causal_bottom_right", "window")
@pytest.mark.parametrize("causal", [False, True], ids=["not-causal", "causal"])
def test_paged_is_attention_on_the_gathered_keys(backend, causal, dtype):
    """Each sequence's rows equal the backend's own ``attention`` on its keys gathered by
    hand from its pages, aligned bottom-right, within twice SPEC §7 (§19.1's definition)."""
    arrays = _inputs(102, "shuffled", dtype)
    q, k_pages, v_pages, table, lens = arrays
    options = {"is_causal": causal, "window": (5, None)}
    out = backend.attention_paged(*arrays, **options)
    _, tol = _oracle(arrays, dtype, **options)
    for b, n in enumerate(lens):
        pages = [table[b, s // L] for s in range(n)]
        k = np.stack([k_pages[p, :, s % L] for s, p in enumerate(pages)], axis=1)[None]
        v = np.stack([v_pages[p, :, s % L] for s, p in enumerate(pages)], axis=1)[None]
        dense = backend.attention(q[b : b + 1], k, v, causal_alignment="bottom_right", **options)
        assert_within(
            out[b : b + 1],
            dense,
            2 * tol,
            f"{backend.name}: sequence {b} of attention_paged against attention on its "
            f"{n} gathered keys (causal={causal})",
            behaviour="paged attention is not attention on the gathered keys",
        )


# --- What a sequence does not read (SPEC §19.3) ----------------------------------------------


def _garbage(arrays, fill: str):
    """The same call with every slot no sequence reads, and every table entry past a
    sequence's pages, overwritten: ``"nan"`` with NaN, ±inf and the dtype's largest
    value and tails -1 and N + 5; ``"calm"`` with 0.5 and tails 0."""
    q, k_pages, v_pages, table, lens = (x.copy() for x in arrays)
    unread = ~_read(table, lens)  # (N, L)
    for pages in (k_pages, v_pages):
        if fill == "nan":
            big = np.finfo(pages.dtype).max
            junk = np.array([np.nan, np.inf, -np.inf, big], dtype=pages.dtype)
            pages[:] = np.where(
                unread[:, None, :, None], np.resize(junk, pages.shape), pages
            )  # (N, K, L, ·)
        else:
            pages[:] = np.where(unread[:, None, :, None], pages.dtype.type(0.5), pages)
    for b, n in enumerate(lens):
        tail = table[b, -(-n // L) :]
        tail[:] = np.resize([-1, N + 5], tail.shape) if fill == "nan" else 0
    return q, k_pages, v_pages, table, lens


@pytest.mark.clause("19.3", "4.7")
@pytest.mark.parametrize("table", ["shuffled", "mid-page-and-empty"])
@pytest.mark.parametrize("causal", [False, True], ids=["not-causal", "causal"])
def test_unread_pages_slots_and_table_tails_are_inert(backend, table, causal, dtype):
    """NaN, ±inf and the largest finite value in every slot no sequence reads (other pages,
    slots past a length), and -1 and N + 5 in the table past each sequence's pages: the
    output is bit for bit that with calm values there, and finite."""
    if causal and table == "mid-page-and-empty":
        table = "shared-prefix"  # causality needs every sequence to hold T keys
    arrays = _inputs(103, table, dtype)
    options = {"is_causal": causal}
    wild = backend.attention_paged(*_garbage(arrays, "nan"), **options)
    calm = backend.attention_paged(*_garbage(arrays, "calm"), **options)
    expect(
        np.isfinite(wild).all(),
        "a page slot that no sequence reads reaches the output",
        f"{backend.name}: NaN/inf in unread slots made the output non-finite ({table})",
    )
    assert_identical(
        wild,
        calm,
        f"{backend.name}: attention_paged with garbage in unread slots and table tails "
        f"({table}, causal={causal})",
        behaviour="a page slot that no sequence reads changes the output",
    )


# --- The gradient (SPEC §19.4) ---------------------------------------------------------------


def _grads(backend, arrays, d_out, **options) -> dict[str, np.ndarray]:
    return dict(zip(GRADS, backend.attention_paged_vjp(*arrays, d_out, **options)))


@pytest.mark.clause("19.4", "12.9")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "setup, table",
    _params(T=3, grad=True, setups=("plain", "causal-window-softcap-scale", "gqa-causal")),
)
def test_paged_gradients_match_the_oracle(backend, setup, table, dtype):
    """dq, dk_pages, dv_pages against the 50-digit oracle within SPEC §12.9: a page shared
    by the three sequences sums their contributions, and a slot no sequence reads gets
    exactly 0."""
    arrays, options = _setup(setup, table, dtype, 104)
    q, k_pages, v_pages, table_, lens = arrays
    d_out = np.random.default_rng(105).standard_normal((B, H, 3, v_pages.shape[-1]))
    d_out = d_out.astype(q.dtype)
    got = backend.attention_paged_vjp(*arrays, d_out, **options)
    expect(
        len(got) == 3,
        "returns another set of gradients than (dq, dk_pages, dv_pages)",
        f"{backend.name}: got {len(got)} gradients, expected 3",
    )
    wide = (as64(q), as64(k_pages), as64(v_pages), table_, lens, as64(d_out))
    expected = oracle.attention_paged_vjp(*wide, **options)
    naive = oracle.attention_paged_vjp(*wide, naive_dtype=numpy_dtype(dtype), **options)
    unread = ~_read(table_, lens)  # (N, L)
    for name, g, like in zip(GRADS, got, (q, k_pages, v_pages)):
        expect(
            g.shape == like.shape and g.dtype == like.dtype,
            "returns gradients of the wrong shape or dtype",
            f"{backend.name}: {name} is {g.dtype} {g.shape}, expected {like.dtype} {like.shape}",
        )
        if name != "dq":
            expect(
                (g.transpose(0, 2, 1, 3)[unread] == 0).all(),
                "a page slot that no sequence reads gets a gradient",
                f"{backend.name}: {name} is not 0 on the slots no sequence reads ({table})",
            )
        want = expected[name]
        assert_within(
            g,
            want,
            tolerance(dtype, finite_error(naive[name], want), want),
            f"{backend.name}: {name} of attention_paged, {setup}, {table} ({dtype})",
            behaviour="the paged gradients differ from the oracle",
        )


@pytest.mark.clause("19.4", "19.3", "12.12")
@requires("grad")
def test_paged_gradients_ignore_unread_slots(backend, dtype):
    """With NaN, ±inf and the largest value in the slots no sequence reads and -1, N + 5 in
    the table tails, every gradient is bit for bit that with calm values there; the unread
    slots get exactly 0 and a sequence with no key has dq exactly 0."""
    arrays = _inputs(106, "mid-page-and-empty", dtype)
    d_out = np.random.default_rng(107).standard_normal((B, H, 3, D)).astype(arrays[0].dtype)
    wild = _grads(backend, _garbage(arrays, "nan"), d_out)
    calm = _grads(backend, _garbage(arrays, "calm"), d_out)
    unread = ~_read(arrays[3], arrays[4])  # (N, L)
    for name in GRADS:
        assert_identical(
            wild[name],
            calm[name],
            f"{backend.name}: {name} of attention_paged_vjp with garbage in unread slots",
            behaviour="a page slot that no sequence reads changes a gradient",
        )
        if name != "dq":
            expect(
                (wild[name].transpose(0, 2, 1, 3)[unread] == 0).all(),
                "a page slot that no sequence reads gets a gradient",
                f"{backend.name}: {name} is not 0 on the slots no sequence reads",
            )
    expect(
        (wild["dq"][1] == 0).all(),
        "a sequence with no key gets a query gradient",
        f"{backend.name}: dq of the empty sequence 1 is not 0",
    )


# --- The fixtures paged-* and grad-paged-* ---------------------------------------------------


def _fixture_params(kind: str):
    return [pytest.param(e["id"], marks=case_marks(e), id=e["id"]) for e in case_entries((kind,))]


def _fixture_arrays(case):
    dt = numpy_dtype(case.dtype)
    a = case.arrays
    floats = (a[n].astype(dt) for n in ("q", "k_pages", "v_pages"))
    return (*floats, a["block_table"], a["seq_lens"])


@pytest.mark.parametrize("case_id", _fixture_params("attention_paged"))
def test_paged_fixture(backend, case_id):
    """A stored case (inputs, the oracle's output): within SPEC §7 of it, the naive run in
    the case's dtype measured here."""
    case = load_case(case_id)
    arrays = _fixture_arrays(case)
    options = case.meta["options"]
    naive = oracle.attention_paged(
        *(as64(x) for x in arrays[:3]),
        *arrays[3:],
        naive_dtype=numpy_dtype(case.dtype),
        **options,
    )
    out = backend.attention_paged(*arrays, **options)
    want = case.arrays["expected"]
    assert_within(
        out,
        want,
        tolerance(case.dtype, finite_error(naive, want), want),
        f"{backend.name}: fixture {case_id}",
        behaviour="paged attention differs from the oracle",
    )


@pytest.mark.parametrize("case_id", _fixture_params("attention_paged_grad"))
def test_paged_grad_fixture(backend, case_id):
    """A stored gradient case: dq, dk_pages, dv_pages within SPEC §12.9 of the oracle's."""
    case = load_case(case_id)
    arrays = _fixture_arrays(case)
    d_out = case.arrays["d_out"].astype(numpy_dtype(case.dtype))
    options = case.meta["options"]
    naive = oracle.attention_paged_vjp(
        *(as64(x) for x in arrays[:3]),
        *arrays[3:],
        as64(d_out),
        naive_dtype=numpy_dtype(case.dtype),
        **options,
    )
    got = _grads(backend, arrays, d_out, **options)
    for name in GRADS:
        want = case.arrays[name]
        assert_within(
            got[name],
            want,
            tolerance(case.dtype, finite_error(naive[name], want), want),
            f"{backend.name}: {name} of fixture {case_id}",
            behaviour="the paged gradients differ from the oracle",
        )


# --- Bad input (SPEC §19.5) ------------------------------------------------------------------


def _bad_inputs(dtype: str) -> dict:
    """{what: (arrays, options, exception, the argument the message must name)}."""
    arrays = _inputs(108, "shuffled", dtype)
    q, k_pages, v_pages, table, lens = arrays

    def changed(i, x):
        new = list(arrays)
        new[i] = x
        return tuple(new)

    bad_entry = table.copy()
    bad_entry[1, 3] = N  # sequence 1 reads all 4 of its pages
    negative_entry = table.copy()
    negative_entry[0, 0] = -1
    return {
        "float-table": (changed(3, table.astype(np.float32)), {}, TypeError, "block_table"),
        "bool-lengths": (changed(4, lens > 0), {}, TypeError, "seq_lens"),
        "table-not-B-M": (changed(3, table[0]), {}, ValueError, "block_table"),
        "lengths-not-B": (changed(4, lens[:, None]), {}, ValueError, "seq_lens"),
        "length-above-M-L": (changed(4, lens + [0, 1, 0]), {}, ValueError, "seq_lens"),
        "negative-length": (changed(4, lens - [0, 0, 5]), {}, ValueError, "seq_lens"),
        "entry-N-read": (changed(3, bad_entry), {}, ValueError, "block_table"),
        "entry-minus-1-read": (changed(3, negative_entry), {}, ValueError, "block_table"),
        "causal-length-below-T": (
            changed(4, np.array([8, 12, 2])),
            {"is_causal": True},
            ValueError,
            "seq_lens",
        ),
        "k-pages-wrong-D": (changed(1, k_pages[..., :2]), {}, ValueError, "k_pages"),
        "v-pages-wrong-N": (changed(2, v_pages[:-1]), {}, ValueError, "v_pages"),
    }


@pytest.mark.clause("19.5", "8.1")
def test_bad_paged_input_is_refused(backend, dtype):
    """Integer tables and lengths of the right shapes, lengths in [0, M·L], the table
    entries a sequence reads in [0, N), T keys per sequence under causality, pages that
    match q and each other: anything else is refused with the stated type, naming the
    argument."""
    for what, (arrays, options, error, name) in _bad_inputs(dtype).items():
        try:
            backend.attention_paged(*arrays, **options)
        except error as err:
            if "error_messages" in backend.capabilities:
                expect(
                    name in str(err),
                    "refuses bad paged input without naming the argument",
                    f"{backend.name}: the error for {what} should name {name}: {err}",
                )
            continue
        except SuiteError:
            raise
        except Exception as err:
            raise Departure(
                f"{backend.name}: raised {type(err).__name__} for {what}: {err}",
                f"raises {type(err).__name__}, not {error.__name__}, for bad paged input",
            ) from err
        raise Departure(f"{backend.name}: accepted {what}", "accepts bad paged input")
