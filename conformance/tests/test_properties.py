"""SPEC §1.2, §4.3, §7: properties on problems Hypothesis draws, for every backend.

Each example draws a whole problem: a shape from SPEC §13.21's size pool
(``conformance.suite.sizes``: B ≤ 2, H ≤ 4, T and S up to 13, D and E up to 5, the shapes
the other tests use, so that a compiling backend reuses their programs), a mask (none,
bool, or float with -inf holes, in a shape that broadcasts), a scale, causality, and
only the variants the backend declares (K < H for "gqa", E ≠ D for "value_dim",
bottom-right alignment, a window, a softcap, unbatched inputs, sinks, chunks, ALiBi). The
values come from a drawn seed, so a failing example shrinks to the pool's first shapes and
few options, and replays exactly.

The reference is independent of every implementation (``fixtures/oracle.py``): for
float64 the 50-digit oracle with SPEC §7.1's rule; for the other dtypes the textbook
algorithm in float64 stands in for it (SPEC §7.2).

Packed documents (SPEC §18) are drawn by a strategy of their own, ``packings``, for
backends declaring "packed" only, so ``problems`` draws what it drew before: N = 4
documents of random lengths (0 included) summing to one of two fixed totals, so that a
backend that compiles builds a program per option set, not per packing.

Paged KV caches (SPEC §19) have theirs too, ``paged_caches``, for backends declaring
"paged": B = 2 sequences over N = 5 pages of L = 4 slots with M = 3 table entries each,
T = 1 (a decode step) or 3, tables of shuffled and shared pages, lengths from 0 to M·L
(mid-page included), garbage (NaN, ±inf) in every slot no sequence reads and junk table
entries past each sequence's pages.

Profiles (``conformance/conftest.py``): "quick", the default, 25 derandomized examples per
test; ``--hypothesis-profile deep`` for 500 random ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from conformance.adapters.forms import forms_of, forms_used
from conformance.backends import DTYPES, numpy_dtype
from conformance.suite.helpers import as64, oracle_attention, random_tolerance
from conformance.suite.oracle_store import oracle
from conformance.suite.requirements import requires
from conformance.suite.sizes import SHAPES, pooled_shape
from conformance.suite.tolerance import (
    assert_rows_zero,
    assert_within,
    dtype_note,
    expect,
    finite_error,
    tolerance,
)


@dataclass
class Problem:
    """One drawn call: batched inputs, and whether the backend gets them unbatched."""

    q: np.ndarray  # (B, H, T, D)
    k: np.ndarray  # (B, K, S, D)
    v: np.ndarray  # (B, K, S, E)
    dtype: str
    unbatched: bool
    options: dict = field(default_factory=dict)

    def call(self, backend) -> np.ndarray:
        """The backend's output, batched (B, H, T, E) whatever layout it was given."""
        if self.unbatched:
            return backend.attention(self.q[0], self.k[0], self.v[0], **self.options)[None]
        return backend.attention(self.q, self.k, self.v, **self.options)

    def allowed(self) -> np.ndarray:
        """(B, H, T, S) bool: which keys each query may attend (SPEC §1.2's A(t))."""
        B, H, T, _ = self.q.shape
        S = self.k.shape[2]
        ok = np.ones((B, H, T, S), dtype=bool)
        mask = self.options.get("mask")
        if mask is not None:
            ok &= np.broadcast_to(
                mask if mask.dtype == np.bool_ else as64(mask) > -np.inf, ok.shape
            )
        for t in range(T):
            keys = oracle.allowed_keys(
                t,
                T,
                S,
                bool_row=None,
                is_causal=self.options.get("is_causal", False),
                causal_alignment=self.options.get("causal_alignment", "top_left"),
                window=self.options.get("window"),
                chunk_size=self.options.get("chunk_size"),
            )
            row = np.zeros(S, dtype=bool)
            row[keys] = True
            ok[:, :, t] &= row
        return ok


@st.composite
def problems(draw, backend) -> Problem:
    """A problem using only what ``backend`` declares: its dtypes, capabilities and forms
    (SPEC §13.17; a backend taking every form draws what it drew before forms existed)."""
    caps, forms = backend.capabilities, forms_of(backend)
    dtype = draw(st.sampled_from([d for d in DTYPES if d in backend.dtypes]))
    # Only the shape is pooled (SPEC §13.21): values, masks and options are drawn freely.
    shape = draw(st.sampled_from([shape for shape, _ in SHAPES.values()]), label="shape")
    unbatched = "unbatched" in caps and draw(st.booleans())
    B, H, K, T, S, D, E = pooled_shape(
        shape, gqa="gqa" in caps, value_dim="value_dim" in caps, unbatched=unbatched
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((B, H, T, D)).astype(dt)
    k = rng.standard_normal((B, K, S, D)).astype(dt)
    v = rng.standard_normal((B, K, S, E)).astype(dt)

    options: dict = {}
    kinds = ["none"] + [kind for kind in ("bool", "float") if f"mask_{kind}" in forms]
    kind = draw(st.sampled_from(kinds), label="mask")
    if kind != "none":
        shapes = [(T, S), (H, T, S)] if unbatched else [(T, S), (B, 1, 1, S), (B, H, T, S)]
        shape = draw(st.sampled_from(shapes), label="mask shape")
        keep = rng.random(shape) < draw(st.sampled_from([1.0, 0.8, 0.4, 0.1, 0.0]), label="kept")
        if kind == "bool":
            options["mask"] = keep
        else:
            options["mask"] = np.where(keep, rng.standard_normal(shape), -np.inf).astype(dt)
    # A causal-only kernel draws only causal calls (SPEC §13.19).
    if "causal" in forms and ("non_causal" not in forms or draw(st.booleans(), label="is_causal")):
        options["is_causal"] = True
    if "causal_bottom_right" in caps and draw(st.booleans(), label="bottom_right"):
        options["causal_alignment"] = "bottom_right"
    if "window" in caps and draw(st.booleans(), label="window"):
        side = st.none() | st.integers(0, max(T, S))
        left = draw(side, label="left")
        options["window"] = (left, draw(side, label="right") if "window_right" in forms else 0)
    if "softcap" in caps and draw(st.booleans(), label="softcap"):
        options["softcap"] = draw(st.sampled_from([0.5, 2.0, 20.0]), label="softcap value")
    scale = None
    if "scale" in forms:
        scale = draw(st.none() | st.sampled_from([0.25, 1.0, 2.0]), label="scale / default")
    if scale is not None:
        options["scale"] = scale / np.sqrt(D)
    # Drawn last, so that a backend without "sinks" draws exactly what it drew before.
    if "sinks" in caps and draw(st.booleans(), label="sinks"):
        options["sinks"] = rng.uniform(-2.0, 3.0, H).astype(dt)  # (H,)
    # After sinks, for the same reason: a backend without "chunked" draws what it drew.
    if "chunked" in caps and draw(st.booleans(), label="chunked"):
        options["chunk_size"] = draw(st.integers(1, 8), label="chunk_size")
    # And ALiBi after that.
    if "alibi" in caps and draw(st.booleans(), label="alibi"):
        options["alibi_slopes"] = rng.uniform(0.0, 1.0, H).astype(np.float32)  # (H,)
    _align_as_taken(options, caps, forms, T, S)
    problem = Problem(q, k, v, dtype, unbatched, options)
    note(
        f"B={B} H={H} K={K} T={T} S={S} D={D} E={E} {dtype}"
        f"{' unbatched' if unbatched else ''}; "
        + ", ".join(
            f"{name}={'mask ' + str(value.dtype) + str(list(value.shape)) if name == 'mask' else value}"
            for name, value in options.items()
        )
    )
    return problem


def _align_as_taken(options: dict, caps, forms: frozenset, T: int, S: int) -> None:
    """For a backend without top-left alignment at T ≠ S (a KV-cache operator): a drawn
    causality, window or chunk goes bottom-right where it may, and is dropped otherwise."""
    if "causal_top_left" in forms or T == S:
        return
    if "causal_top_left" in forms_used(options, T, S):
        if "causal_bottom_right" in caps:
            options["causal_alignment"] = "bottom_right"
        else:
            for name in ("is_causal", "window", "chunk_size"):
                options.pop(name, None)


@pytest.mark.clause("1.2", "7.1")
@given(data=st.data())
def test_matches_the_reference(backend, data):
    """On any drawn problem the output is within SPEC §7's tolerance of the reference."""
    p = data.draw(problems(backend), label="problem")
    out = p.call(backend)
    want = (*p.q.shape[:3], p.v.shape[-1])
    expect(
        out.shape == want,
        "returns an output of the wrong shape",
        f"{backend.name}: shape {out.shape}, expected (B, H, T, E) = {want}",
    )
    # The values are judged in whatever dtype they come: the dtype is §2.4's, judged once.
    if p.dtype == "float64":
        expected = oracle_attention(p.q, p.k, p.v, **p.options)
        naive = oracle.naive_same_precision(p.q, p.k, p.v, np.float64, **p.options)
        tol = tolerance("float64", float(np.max(np.abs(naive - expected), initial=0.0)), expected)
        reference = "the 50-digit oracle"
    else:
        expected = oracle.naive_same_precision(p.q, p.k, p.v, np.float64, **p.options)
        tol = random_tolerance(p.q, p.k, p.v, p.dtype, **p.options)
        reference = "the float64 textbook run"
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name} vs {reference} on the drawn problem{dtype_note(out, p.q.dtype)}",
        behaviour="differs from the reference on problems Hypothesis draws",
    )


@pytest.mark.clause("4.3", "4.4")
@given(data=st.data())
def test_outputs_are_finite_and_empty_rows_zero(backend, data):
    """Every output is finite, and a query with no key to attend returns exactly 0."""
    p = data.draw(problems(backend), label="problem")
    out = as64(p.call(backend))
    empty = ~p.allowed().any(axis=-1)  # (B, H, T)
    assert_rows_zero(out, empty, f"{backend.name} on the drawn problem (SPEC §4.3)", v=p.v)
    expect(
        np.isfinite(out).all(),
        "returns a non-finite output on a drawn problem",
        f"{backend.name}: non-finite output at {np.argwhere(~np.isfinite(out))[:1].tolist()}",
    )


#: (T, S) of a drawn packing: two fixed totals, so that a compiling backend, which traces
#: the boundaries (§18.4), compiles one program per option set and total.
PACKED_TOTALS = [(9, 11), (16, 12)]
PACKED_DOCUMENTS = 4


@dataclass
class Packing:
    """One drawn packed call: q (H, T, D), k (K, S, D), v (K, S, E) and the boundaries."""

    q: np.ndarray  # (H, T, D)
    k: np.ndarray  # (K, S, D)
    v: np.ndarray  # (K, S, E)
    cu_q: np.ndarray  # (N + 1,)
    cu_k: np.ndarray  # (N + 1,)
    dtype: str
    options: dict = field(default_factory=dict)

    def keyless(self) -> np.ndarray:
        """(T,) bool: the queries with no key in their document to attend, from the
        oracle's ``allowed_keys`` on each document alone (SPEC §18.2)."""
        rows = np.zeros(self.q.shape[1], dtype=bool)
        for n in range(len(self.cu_q) - 1):
            t0, t1 = int(self.cu_q[n]), int(self.cu_q[n + 1])
            S_n = int(self.cu_k[n + 1] - self.cu_k[n])
            for i in range(t1 - t0):
                keys = oracle.allowed_keys(
                    i,
                    t1 - t0,
                    S_n,
                    bool_row=None,
                    is_causal=self.options.get("is_causal", False),
                    causal_alignment=self.options.get("causal_alignment", "top_left"),
                    window=self.options.get("window"),
                )
                rows[t0 + i] = len(keys) == 0
        return rows


def _boundaries(draw, total: int, label: str) -> np.ndarray:
    """(N + 1,) int32 cumulative lengths from 0 to ``total``: N - 1 drawn cuts, so that
    documents of length 0 (equal cuts) come up as often as any other."""
    cuts = draw(
        st.lists(
            st.integers(0, total), min_size=PACKED_DOCUMENTS - 1, max_size=PACKED_DOCUMENTS - 1
        ),
        label=label,
    )
    return np.array([0, *sorted(cuts), total], dtype=np.int32)


@st.composite
def packings(draw, backend) -> Packing:
    """A packed problem using only what ``backend`` declares, on few shapes: H = 2, D = 4,
    K and E drawn only from two values each, T and S one of ``PACKED_TOTALS``."""
    caps = backend.capabilities
    dtype = draw(st.sampled_from([d for d in DTYPES if d in backend.dtypes]))
    H, D = 2, 4
    K = draw(st.sampled_from([1, 2]), label="K") if "gqa" in caps else H
    E = draw(st.sampled_from([3, 4]), label="E") if "value_dim" in caps else D
    T, S = draw(st.sampled_from(PACKED_TOTALS), label="T, S")
    cu_q = _boundaries(draw, T, "cu_seqlens_q")
    cu_k = _boundaries(draw, S, "cu_seqlens_k")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((H, T, D)).astype(dt)
    k = rng.standard_normal((K, S, D)).astype(dt)
    v = rng.standard_normal((K, S, E)).astype(dt)

    options: dict = {}
    forms = forms_of(backend)
    # A causal-only kernel draws only causal calls (SPEC §13.19).
    if "causal" in forms and ("non_causal" not in forms or draw(st.booleans(), label="is_causal")):
        options["is_causal"] = True
    if "causal_bottom_right" in caps and draw(st.booleans(), label="bottom_right"):
        options["causal_alignment"] = "bottom_right"
    if "window" in caps and draw(st.booleans(), label="window"):
        side = st.sampled_from([None, 0, 2])
        left = draw(side, label="left")
        options["window"] = (left, draw(side, label="right") if "window_right" in forms else 0)
    if "softcap" in caps and draw(st.booleans(), label="softcap"):
        options["softcap"] = 2.0
    if "scale" in forms and draw(st.booleans(), label="scale"):
        options["scale"] = 0.5
    # Documents' T and S differ whatever the totals: alignment as the backend takes it.
    _align_as_taken(options, caps, forms, 0, 1)
    note(
        f"H={H} K={K} T={T} S={S} D={D} E={E} {dtype}; cu_seqlens_q={cu_q.tolist()} "
        f"cu_seqlens_k={cu_k.tolist()}; "
        + ", ".join(f"{name}={value}" for name, value in options.items())
    )
    return Packing(q, k, v, cu_q, cu_k, dtype, options)


@pytest.mark.clause("18.1", "18.2", "7.1")
@requires("packed")
@given(data=st.data())
def test_packings_match_the_oracle(backend, data):
    """On any drawn packing, ``attention_packed`` is the oracle's document by document
    within SPEC §7, shaped (H, T, E) in q's dtype, and a query with no key in its
    document returns exactly 0."""
    p = data.draw(packings(backend), label="packing")
    out = backend.attention_packed(p.q, p.k, p.v, p.cu_q, p.cu_k, **p.options)
    args = (as64(p.q), as64(p.k), as64(p.v), p.cu_q, p.cu_k)
    expected = oracle.attention_packed(*args, **p.options)
    naive = oracle.naive_packed_same_precision(*args, numpy_dtype(p.dtype), **p.options)
    tol = tolerance(p.dtype, finite_error(naive, expected), expected)
    expect(
        out.shape == expected.shape and out.dtype == p.q.dtype,
        "attention_packed returns the wrong shape or dtype",
        f"{backend.name}: got {out.dtype} {out.shape}, expected {p.q.dtype} {expected.shape}",
    )
    context = f"{backend.name}: attention_packed on the drawn packing"
    assert_rows_zero(out, p.keyless()[None, :], context)
    assert_within(
        out,
        expected,
        tol,
        context,
        behaviour="packed attention differs from the oracle on packings Hypothesis draws",
    )


#: The fixed sizes of a drawn paged cache: N pages of L slots, M table entries per
#: sequence, B sequences, and T = 1 (a decode step) or a few queries, so that a compiling
#: backend, which traces the table and the lengths (§19.2), compiles few programs.
PAGED_N, PAGED_L, PAGED_M, PAGED_B = 5, 4, 3, 2
PAGED_T = [1, 3]


@dataclass
class PagedCache:
    """One drawn paged call: q (B, H, T, D), pages (N, K, L, D) and (N, K, L, E), the block
    table (B, M) and the lengths (B,)."""

    q: np.ndarray  # (B, H, T, D)
    k_pages: np.ndarray  # (N, K, L, D)
    v_pages: np.ndarray  # (N, K, L, E)
    block_table: np.ndarray  # (B, M)
    seq_lens: np.ndarray  # (B,)
    dtype: str
    options: dict = field(default_factory=dict)

    def keyless(self) -> np.ndarray:
        """(B, 1, T) bool: the queries with no key to attend, from the oracle's
        ``allowed_keys`` on each sequence's own length, bottom-right (SPEC §19.1)."""
        T = self.q.shape[2]
        rows = np.zeros((len(self.seq_lens), 1, T), dtype=bool)
        for b, n in enumerate(self.seq_lens.tolist()):
            for t in range(T):
                keys = oracle.allowed_keys(
                    t,
                    T,
                    n,
                    bool_row=None,
                    is_causal=self.options.get("is_causal", False),
                    causal_alignment="bottom_right",
                    window=self.options.get("window"),
                )
                rows[b, 0, t] = len(keys) == 0
        return rows


@st.composite
def paged_caches(draw, backend) -> PagedCache:
    """A paged problem using only what ``backend`` declares, on few shapes: H = 2, D = 4,
    K and E drawn from two values each, T one of ``PAGED_T``. Each sequence's pages are a
    drawn permutation of the pool (so pages come in any order, and two sequences may share
    one); its length is drawn from 0 to M·L (at least T with causality, §19.1)."""
    caps = backend.capabilities
    dtype = draw(st.sampled_from([d for d in DTYPES if d in backend.dtypes]))
    N, L, M, B, H, D = PAGED_N, PAGED_L, PAGED_M, PAGED_B, 2, 4
    K = draw(st.sampled_from([1, 2]), label="K") if "gqa" in caps else H
    E = draw(st.sampled_from([3, 4]), label="E") if "value_dim" in caps else D
    T = draw(st.sampled_from(PAGED_T), label="T")
    options: dict = {}
    if draw(st.booleans(), label="is_causal"):
        options["is_causal"] = True
    shortest = T if options.get("is_causal") else 0
    seq_lens = np.array(
        [draw(st.integers(shortest, M * L), label=f"seq_lens[{b}]") for b in range(B)],
        dtype=np.int32,
    )  # (B,)
    table = np.zeros((B, M), dtype=np.int32)  # (B, M)
    for b in range(B):
        pages = draw(st.permutations(range(N)), label=f"pages of sequence {b}")[:M]
        read = -(-int(seq_lens[b]) // L)  # ⌈seq_lens[b] / L⌉ entries are read
        junk = st.sampled_from([-1, N + 5, 0])
        table[b] = [
            p if j < read else draw(junk, label="unread entry") for j, p in enumerate(pages)
        ]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((B, H, T, D)).astype(dt)
    k_pages = rng.standard_normal((N, K, L, D)).astype(dt)
    v_pages = rng.standard_normal((N, K, L, E)).astype(dt)
    # Every slot no sequence reads holds garbage (SPEC §19.3): it must change nothing.
    unread = np.ones((N, L), dtype=bool)  # (N, L)
    for b, n in enumerate(seq_lens.tolist()):
        for s in range(n):
            unread[table[b, s // L], s % L] = False
    garbage = draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="garbage")
    pages, slots = np.nonzero(unread)
    k_pages[pages, :, slots] = garbage  # (N, K, L, D) at every unread (page, slot)
    v_pages[pages, :, slots] = garbage  # (N, K, L, E)
    if "window" in caps and draw(st.booleans(), label="window"):
        side = st.sampled_from([None, 0, 2])
        options["window"] = (draw(side, label="left"), draw(side, label="right"))
    if "softcap" in caps and draw(st.booleans(), label="softcap"):
        options["softcap"] = 2.0
    if draw(st.booleans(), label="scale"):
        options["scale"] = 0.5
    note(
        f"H={H} K={K} T={T} D={D} E={E} N={N} L={L} M={M} {dtype}; block_table="
        f"{table.tolist()} seq_lens={seq_lens.tolist()} garbage={garbage}; "
        + ", ".join(f"{name}={value}" for name, value in options.items())
    )
    return PagedCache(q, k_pages, v_pages, table, seq_lens, dtype, options)


@pytest.mark.clause("19.1", "19.2", "19.3", "7.1")
@requires("paged")
@given(data=st.data())
def test_paged_caches_match_the_oracle(backend, data):
    """On any drawn paged cache, ``attention_paged`` is the oracle's sequence by sequence
    within SPEC §7, shaped (B, H, T, E) in q's dtype and finite whatever the unread slots
    hold, and a query with no key (a sequence of length 0, or a window leaving none)
    returns exactly 0."""
    c = data.draw(paged_caches(backend), label="paged cache")
    args = (c.q, c.k_pages, c.v_pages, c.block_table, c.seq_lens)
    out = backend.attention_paged(*args, **c.options)
    wide = (as64(c.q), as64(c.k_pages), as64(c.v_pages), c.block_table, c.seq_lens)
    expected = oracle.attention_paged(*wide, **c.options)
    naive = oracle.attention_paged(*wide, naive_dtype=numpy_dtype(c.dtype), **c.options)
    tol = tolerance(c.dtype, finite_error(naive, expected), expected)
    expect(
        out.shape == expected.shape and out.dtype == c.q.dtype,
        "attention_paged returns the wrong shape or dtype",
        f"{backend.name}: got {out.dtype} {out.shape}, expected {c.q.dtype} {expected.shape}",
    )
    context = f"{backend.name}: attention_paged on the drawn cache"
    expect(
        bool(np.isfinite(as64(out)).all()),
        "a page slot that no sequence reads reaches the output",
        f"{context}: non-finite output at {np.argwhere(~np.isfinite(as64(out)))[:1].tolist()}",
    )
    assert_rows_zero(out, c.keyless(), context)
    assert_within(
        out,
        expected,
        tol,
        context,
        behaviour="paged attention differs from the oracle on caches Hypothesis draws",
    )
