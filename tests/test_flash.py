"""The blockwise pages at their default tile sizes, forward and backward, and their two paths.

The conformance suite runs numpy-flash and jax-flash with tiny tiles, so that its small,
odd-sized cases cross many tiles (and numpy-flash's textbook path too, in the numpy tox
env). These tests cover what only shows at scale: the default tiles on a problem several
tiles long, forward and backward, against independent references; that no (T, S) array
is ever allocated, forward or backward; and that tiles a causal mask blocks entirely are
skipped, in the backward too; on NumPy, on both paths of ``flash.attention``. And what the
pages promise a reader: the one-row recurrence is the softmax; the textbook path stays on
``flash.py`` and the fast one enters ``flash_tiles.py`` once; JAX's textbook path gives
the stored fixtures' outputs.
"""

from __future__ import annotations

import functools
import sys
import tracemalloc

import jax
import numpy as np
import pytest
from conformance.fixtures.oracle import naive_vjp_same_precision
from conformance.impls.jax import flash as jax_flash
from conformance.impls.jax import flash_fast as jax_flash_fast
from conformance.impls.jax import flash_packed as jax_flash_packed
from conformance.impls.jax import flash_tiles as jax_flash_tiles
from conformance.impls.numpy import attention as numpy_attention
from conformance.impls.numpy import flash as numpy_flash
from conformance.impls.numpy import flash_tiles as numpy_flash_tiles
from conformance.impls.numpy import packed as numpy_packed
from conformance.impls.numpy import paged as numpy_paged

from conformance.suite.helpers import random_qkv, random_tolerance
from conformance.suite.tolerance import assert_identical, assert_within, tolerance

OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bottom-right-window": {
        "is_causal": True,
        "causal_alignment": "bottom_right",
        "window": (300, None),
    },
    # Chunks of 600 cut the default tiles (SPEC §16), with ALiBi's bias tile by tile (§17).
    "chunked-alibi": {
        "is_causal": True,
        "chunk_size": 600,
        "alibi_slopes": np.array([0.5, 0.0625, 0.25, 0.0078125], dtype=np.float32),
    },
}


#: The forward paths: NumPy's textbook and fast ones, and JAX's fast one (the backends').
FORWARDS = {
    "numpy-flash-textbook": numpy_flash.attention,
    "numpy-flash": functools.partial(numpy_flash.attention, fast=True),
    "jax-flash": functools.partial(jax_flash.attention, fast=True),
}
#: NumPy's two paths of ``flash.attention``, for the tests that count its work.
NUMPY_PATHS = pytest.mark.parametrize("fast", [False, True], ids=["textbook", "fast"])


@pytest.mark.parametrize("path", list(FORWARDS))
@pytest.mark.parametrize("setup", list(OPTIONS))
def test_default_tiles_match_the_reference(path, setup):
    """T = 1100 and S = 1300 span three default tiles, the last ones partial."""
    jax.config.update("jax_enable_x64", True)
    q, k, v = random_qkv(50, B=1, H=4, K=2, T=1100, S=1300, D=16, E=8, dtype="float32")
    options = OPTIONS[setup]
    out = np.asarray(FORWARDS[path](q, k, v, **options))
    ref = numpy_attention.attention(q, k, v, **options)
    tol = 2 * random_tolerance(q, k, v, "float32", **options)
    assert_within(out, ref, tol, f"{path} with default tiles ({setup})")


@NUMPY_PATHS
def test_numpy_flash_never_allocates_a_score_matrix(fast):
    """Peak allocation during a call stays far below one (T, S) float32 matrix: it is set
    by the tiles, not by T and S."""
    T = S = 4096
    q, k, v = random_qkv(51, B=1, H=1, T=T, S=S, D=16, dtype="float32")
    tracemalloc.start()
    try:
        numpy_flash.attention(q, k, v, is_causal=True, fast=fast)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one_matrix = T * S * 4
    assert peak < one_matrix / 8, (
        f"peak {peak / 2**20:.1f} MiB vs one (T, S) matrix {one_matrix / 2**20:.1f} MiB"
    )


@NUMPY_PATHS
def test_numpy_flash_skips_fully_masked_tiles(monkeypatch, fast):
    """Causal attention on n × n tiles computes the n(n+1)/2 tiles on or below the diagonal."""
    calls = []
    real = np.matmul

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    q, k, v = random_qkv(52, B=1, H=1, T=2048, S=2048, D=8, dtype="float32")
    monkeypatch.setattr(numpy_flash.np, "matmul", counting)
    numpy_flash.attention(q, k, v, block_q=512, block_k=512, fast=fast)
    full = len(calls)
    calls.clear()
    numpy_flash.attention(q, k, v, is_causal=True, block_q=512, block_k=512, fast=fast)
    n = 2048 // 512
    assert full == 2 * n * n, f"{full} matmuls without a mask, expected {2 * n * n}"
    assert len(calls) == 2 * n * (n + 1) // 2, (
        f"{len(calls)} matmuls under causal, expected {n * (n + 1)}"
    )


GRAD_OPTIONS = {
    **OPTIONS,
    "softcap-window": {"softcap": 2.0, "window": (200, 100)},
    "float-mask": {"mask": "float"},
}


def _float_mask(T: int, S: int) -> np.ndarray:
    """A (1, 1, T, S) float mask, broadcast over batch and heads: a few units of bias
    and a scattering of -inf, never a whole row."""
    rng = np.random.default_rng(53)
    mask = rng.standard_normal((1, 1, T, S)).astype(np.float32)
    mask[rng.random((1, 1, T, S)) < 0.2] = -np.inf
    mask[..., 0] = 0.0
    return mask


@pytest.mark.parametrize("impl", [numpy_flash, jax_flash], ids=["numpy-flash", "jax-flash"])
@pytest.mark.parametrize("setup", list(GRAD_OPTIONS))
def test_default_tiles_backward_matches_the_naive_backward(impl, setup):
    """Gradients at the default tiles, float32, against the textbook backward in float64
    (the fixtures' naive backward, independent of the impls), within SPEC §12.9's
    tolerance measured for these inputs (the same backward in float32 against float64)."""
    jax.config.update("jax_enable_x64", True)
    T, S = 1100, 1300
    q, k, v = random_qkv(54, B=1, H=4, K=2, T=T, S=S, D=16, E=8, dtype="float32")
    d_out = np.random.default_rng(55).standard_normal((1, 4, T, 8)).astype(np.float32)
    options = dict(GRAD_OPTIONS[setup])
    if options.get("mask") == "float":
        options["mask"] = _float_mask(T, S)
    got = [np.asarray(g) for g in impl.attention_vjp(q, k, v, d_out, **options)]
    ref = naive_vjp_same_precision(q, k, v, d_out, np.float64, **options)
    low = naive_vjp_same_precision(q, k, v, d_out, np.float32, **options)
    names = ["dq", "dk", "dv", "dmask"][: len(got)]
    assert set(names) == set(ref), f"returned {names}, expected {sorted(ref)}"
    for name, g in zip(names, got):
        naive_error = float(np.max(np.abs(low[name] - ref[name])))
        tol = tolerance("float32", naive_error, ref[name])
        assert g.dtype == np.float32, f"{name} dtype {g.dtype}"
        assert_within(g, ref[name], tol, f"{impl.__name__}.attention_vjp {name} ({setup})")


@pytest.mark.parametrize("impl", [numpy_flash, jax_flash], ids=["numpy-flash", "jax-flash"])
def test_backward_unused_slots_get_exactly_zero(impl):
    """A key/value slot no query attends (a bool mask's column, and keys past a causal
    band) gets dk = dv = 0 exactly, whatever it holds, and every other gradient is bit
    for bit that of the call with ordinary numbers there."""
    jax.config.update("jax_enable_x64", True)
    T, S = 600, 900
    q, k, v = random_qkv(56, B=1, H=2, T=T, S=S, D=8, dtype="float64")
    d_out = np.random.default_rng(57).standard_normal(q.shape)
    mask = np.ones((T, S), dtype=bool)
    mask[:, 300:340] = False  # a column block no query may see
    options = {"mask": mask, "is_causal": True, "causal_alignment": "bottom_right"}
    # Bottom-right with S > T: keys past S - T + t are unseen by row t; key S - 1 is seen
    # by the last row, so only the masked block is unused by every query.
    clean = [np.asarray(g) for g in impl.attention_vjp(q, k, v, d_out, **options)]
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 300:340] = np.nan
    v2[:, :, 300:340] = np.inf
    dirty = [np.asarray(g) for g in impl.attention_vjp(q, k2, v2, d_out, **options)]
    for name, g in zip(("dk", "dv"), dirty[1:]):
        assert (g[:, :, 300:340] == 0).all(), f"{name} of unused slots is not exactly 0"
    for name, a, b in zip(("dq", "dk", "dv"), dirty, clean):
        assert_identical(a, b, f"{impl.__name__} {name} with garbage in unused slots")


def test_numpy_flash_backward_never_allocates_a_score_matrix():
    """The backward's peak allocation beyond its outputs stays far below one (T, S)
    float32 matrix: it is set by the tiles, not by T and S."""
    T = S = 4096
    q, k, v = random_qkv(58, B=1, H=1, T=T, S=S, D=16, dtype="float32")
    d_out = np.random.default_rng(59).standard_normal(q.shape).astype(np.float32)
    outputs = q.nbytes + k.nbytes + v.nbytes
    tracemalloc.start()
    try:
        numpy_flash.attention_vjp(q, k, v, d_out, is_causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one_matrix = T * S * 4
    assert peak - outputs < one_matrix / 8, (
        f"peak beyond outputs {(peak - outputs) / 2**20:.1f} MiB vs one (T, S) matrix "
        f"{one_matrix / 2**20:.1f} MiB"
    )


def test_jax_flash_backward_memory_is_linear_in_t():
    """XLA's own account of the compiled backward at T = S = 16384, B = 1, H = 8, D = 64,
    float32 (compiled, not run): its temporaries beyond inputs and outputs stay below 96
    MiB, where one (T, S) score matrix alone would be 8 GiB."""
    shape = jax.ShapeDtypeStruct((1, 8, 16384, 64), jax.numpy.float32)
    lowered = jax_flash_fast._flash_vjp.lower(
        shape,
        shape,
        shape,
        None,
        None,
        shape,
        d_lse=jax.ShapeDtypeStruct((1, 8, 16384), jax.numpy.float32),  # (B, H, T)
        opts=jax_flash_fast._traced_options(_checked(16384, 16384, 64), np.float32, 16384),
        Tb=512,
        Sb=256,
    )
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp < 96 * 2**20, f"backward temporaries {temp / 2**20:.1f} MiB"


def _checked(T: int, S: int, D: int):
    """The checked call of a plain problem of these sizes (B = 1, H = K = 8), from the
    contract itself, whose traced options ``_flash_vjp`` is lowered with."""
    from conformance.impls import contract

    q = jax.ShapeDtypeStruct((1, 8, T, D), jax.numpy.float32)
    k = jax.ShapeDtypeStruct((1, 8, S, D), jax.numpy.float32)
    return contract.check(q, k, k)


def test_jax_flash_packed_backward_memory_is_linear_in_t():
    """The same account for the packed backward (SPEC §18.4) at T = S = 16384 in N = 8
    documents: the boundaries add a few (T,) vectors, never a (T, S) array."""
    shape = jax.ShapeDtypeStruct((8, 16384, 64), jax.numpy.float32)
    bounds = jax.ShapeDtypeStruct((9,), jax.numpy.int32)
    lowered = jax_flash_packed._flash_packed_vjp.lower(
        shape,
        shape,
        shape,
        bounds,
        bounds,
        shape,
        scale=0.125,
        is_causal=True,
        bottom_right=False,
        window=None,
        softcap=None,
        Tb=512,
        Sb=256,
    )
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    assert temp < 96 * 2**20, f"packed backward temporaries {temp / 2**20:.1f} MiB"


def test_numpy_flash_backward_skips_fully_masked_tiles(monkeypatch):
    """The backward visits the same tiles as the forward: under causal attention on
    n × n tiles, the n(n+1)/2 on or below the diagonal. Each visited tile costs 7
    products: 2 for the forward that gives the log-sum-exp and Δ (scores, P·V), and 5 in
    the backward (scores, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q)."""
    calls = []
    real = np.matmul

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    q, k, v = random_qkv(60, B=1, H=1, T=2048, S=2048, D=8, dtype="float32")
    d_out = np.random.default_rng(61).standard_normal(q.shape).astype(np.float32)
    monkeypatch.setattr(numpy_flash.np, "matmul", counting)
    numpy_flash.attention_vjp(q, k, v, d_out, block_q=512, block_k=512)
    full = len(calls)
    calls.clear()
    numpy_flash.attention_vjp(q, k, v, d_out, is_causal=True, block_q=512, block_k=512)
    n = 2048 // 512
    assert full == 7 * n * n, f"{full} matmuls without a mask, expected {7 * n * n}"
    assert len(calls) == 7 * n * (n + 1) // 2, (
        f"{len(calls)} matmuls under causal, expected {7 * n * (n + 1) // 2}"
    )


@NUMPY_PATHS
@pytest.mark.parametrize("chunk", [512, 1024, 768])
def test_numpy_flash_skips_tiles_outside_the_chunks(monkeypatch, chunk, fast):
    """Chunked attention (SPEC §16) on n × n tiles of 512 visits only the key tiles that
    share a chunk with some row of the query tile: with chunks of 512, the n diagonal
    tiles; of 1024, 2 × 2 per chunk; of 768, whose boundaries cut tiles, 8 key ranges of
    at most 512 (query rows 0-511 see keys 0-767, rows 512-1023 keys 0-1535, rows
    1024-1535 keys 768-1535, rows 1536-2047 keys 1536-2047). Forward: 2 products per
    tile; backward: 7."""
    calls = []
    real = np.matmul

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    q, k, v = random_qkv(62, B=1, H=1, T=2048, S=2048, D=8, dtype="float32")
    d_out = np.random.default_rng(63).standard_normal(q.shape).astype(np.float32)
    monkeypatch.setattr(numpy_flash.np, "matmul", counting)
    tiles = {512: 4, 1024: 8, 768: 8}[chunk]
    numpy_flash.attention(q, k, v, chunk_size=chunk, block_q=512, block_k=512, fast=fast)
    assert len(calls) == 2 * tiles, f"{len(calls)} matmuls, expected {2 * tiles}"
    calls.clear()
    numpy_flash.attention_vjp(q, k, v, d_out, chunk_size=chunk, block_q=512, block_k=512)
    assert len(calls) == 7 * tiles, f"{len(calls)} backward matmuls, expected {7 * tiles}"


@pytest.mark.clause("18.4")
@pytest.mark.parametrize(
    "cu_seqlens, tiles",
    [([0, 512, 1024, 1536, 2048], 4), ([0, 700, 2048], 4 + 9), ([0, 0, 2048, 2048], 16)],
    ids=["four-of-512", "700-and-1348", "one-document"],
)
def test_numpy_flash_skips_tiles_across_documents(monkeypatch, cu_seqlens, tiles):
    """Packed attention (SPEC §18.4) on tiles of 512 visits only the tiles inside each
    document: four documents of 512, one tile each (of the 16 of T = S = 2048); 700 and
    1348 tokens, 2 × 2 and 3 × 3 tiles; one document, all 16. Forward: 2 products per
    tile; backward: 7."""
    calls = []
    real = np.matmul

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    q, k, v = (x[0] for x in random_qkv(64, B=1, H=1, T=2048, S=2048, D=8, dtype="float32"))
    d_out = np.random.default_rng(65).standard_normal(q.shape).astype(np.float32)
    cu = np.array(cu_seqlens)
    monkeypatch.setattr(numpy_flash.np, "matmul", counting)
    numpy_packed.attention_packed_flash(q, k, v, cu, cu, is_causal=False, block_q=512, block_k=512)
    assert len(calls) == 2 * tiles, f"{len(calls)} matmuls, expected {2 * tiles}"
    calls.clear()
    numpy_packed.attention_packed_flash_vjp(q, k, v, cu, cu, d_out, block_q=512, block_k=512)
    assert len(calls) == 7 * tiles, f"{len(calls)} backward matmuls, expected {7 * tiles}"


@pytest.mark.clause("18.4")
@pytest.mark.parametrize(
    "cu_seqlens, tiles",
    [([0, 512, 1024, 1536, 2048], 4), ([0, 700, 2048], 4 + 9), ([0, 0, 2048, 2048], 16)],
    ids=["four-of-512", "700-and-1348", "one-document"],
)
def test_jax_flash_skips_tiles_across_documents(monkeypatch, cu_seqlens, tiles):
    """jax-flash's packed walk (SPEC §18.4) visits the tiles numpy-flash does, on tiles
    of 512, though its query blocks are not aligned to the documents: with 700 and 1348
    tokens, the query block of rows 512-1023 walks the first document's 2 key blocks and
    the second's 3 (2 + 5 + 3 + 3 = 13). Counted as calls of ``Tiles.scores`` with
    ``jax.disable_jit()``, where the loops run in Python: one per tile forward, two in
    the backward (its forward, then the gradients)."""
    calls = []
    real = jax_flash_tiles.Tiles.scores

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    q, k, v = (x[0] for x in random_qkv(64, B=1, H=1, T=2048, S=2048, D=8, dtype="float32"))
    d_out = np.random.default_rng(65).standard_normal(q.shape).astype(np.float32)
    cu = np.array(cu_seqlens)
    monkeypatch.setattr(jax_flash_tiles.Tiles, "scores", counting)
    with jax.disable_jit():
        jax_flash_packed.attention_packed(q, k, v, cu, cu, block_q=512, block_k=512)
        assert len(calls) == tiles, f"{len(calls)} tiles, expected {tiles}"
        calls.clear()
        jax_flash_packed.attention_packed_vjp(q, k, v, cu, cu, d_out, block_q=512, block_k=512)
    assert len(calls) == 2 * tiles, f"{len(calls)} backward tiles, expected {2 * tiles}"


@pytest.mark.parametrize(
    "window, pages", [(None, [6, 2, 5]), ((300, 0), [2, 5])], ids=["whole-length", "window-300"]
)
def test_numpy_flash_paged_reads_only_the_pages_it_needs(monkeypatch, window, pages):
    """A paged decode step (SPEC §19) with pages of 512 slots, a table 8 pages wide and
    lengths 1100 and 0: numpy-flash reads the 3 pages sequence 0 holds keys in (⌈1100 /
    512⌉: table entries 6, 2, 5), and with a window of 300 only the 2 that hold keys
    799-1099; none for the empty sequence (its table is all -1), none past a length.
    Forward and backward. Without a window each page is one tile: 2 products per page
    forward, 7 backward."""
    calls, read = [], []
    real, real_rows = np.matmul, numpy_paged.PageRows.__getitem__

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def reading(self, index):
        read.append(self.table[index[1].start // self.L])
        return real_rows(self, index)

    rng = np.random.default_rng(64)
    q = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    k_pages = rng.standard_normal((8, 1, 512, 8)).astype(np.float32)
    v_pages = rng.standard_normal((8, 1, 512, 8)).astype(np.float32)
    table = np.array([[6, 2, 5, 0, 1, 3, 4, 7], [-1] * 8])
    lens = np.array([1100, 0])
    d_out = rng.standard_normal(q.shape).astype(np.float32)
    monkeypatch.setattr(numpy_flash.np, "matmul", counting)
    monkeypatch.setattr(numpy_paged.PageRows, "__getitem__", reading)
    numpy_paged.attention_paged_flash(q, k_pages, v_pages, table, lens, window=window)
    assert sorted(set(read)) == sorted(pages), f"read pages {sorted(set(read))}, expected {pages}"
    if window is None:
        assert len(calls) == 2 * 3, f"{len(calls)} matmuls, expected {2 * 3}"
    calls.clear(), read.clear()
    numpy_paged.attention_paged_flash_vjp(q, k_pages, v_pages, table, lens, d_out, window=window)
    assert sorted(set(read)) == sorted(pages), (
        f"backward read {sorted(set(read))}, expected {pages}"
    )
    if window is None:
        assert len(calls) == 7 * 3, f"{len(calls)} backward matmuls, expected {7 * 3}"


@pytest.mark.parametrize("impl", [numpy_flash, jax_flash], ids=["numpy-flash", "jax-flash"])
@pytest.mark.parametrize(
    "wide, bounded",
    [
        ({"window": (2**31, 2**40)}, {}),
        ({"chunk_size": 2**40}, {}),
        ({"window": (3, 2**31)}, {"window": (3, None)}),
    ],
)
def test_sides_and_chunks_past_int32_are_unbounded(impl, wide, bounded):
    """A window side or chunk size of 2^31 and more reaches past every key, as None does:
    on tiles of 4 × 3 the block bounds it enters stay within int32 (before, jax-flash
    returned other rows' weights for them)."""
    jax.config.update("jax_enable_x64", True)
    q, k, v = random_qkv(5, B=2, H=4, K=2, T=9, S=11, D=3, E=2, dtype="float64")
    out = np.asarray(impl.attention(q, k, v, block_q=4, block_k=3, fast=True, **wide))
    expected = numpy_attention.attention(q, k, v, **bounded)
    assert_within(out, expected, tolerance("float64", 0.0, expected), f"{impl.__name__} {wide}")


def test_jax_flash_compiles_once_for_every_option_value():
    """The scale, softcap, window sides, chunk size and alignment are runtime values of
    jax-flash's program (``flash_fast._traced_options``): new values of them compile nothing.
    (A scale above 1 is one more program: its power of two multiplies the products.)"""
    jax.config.update("jax_enable_x64", True)
    q, k, v = random_qkv(6, B=1, H=2, K=1, T=6, S=7, D=3, E=2, dtype="float64")
    d_out = np.ones((1, 2, 6, 2))
    for vary in ("scale", "scale above 1", "softcap", "window", "chunk_size"):
        calls = {
            "scale": [{"scale": s} for s in (0.1, 0.5, 1.0)],
            "scale above 1": [{"scale": s} for s in (2.0, 3.0, 1e10)],
            "softcap": [{"softcap": c} for c in (0.5, 2.0, 30.0)],
            "window": [
                {"window": (1, 0), "is_causal": True},
                {"window": (4, 2), "is_causal": True},
            ],
            "chunk_size": [
                {"chunk_size": c, "causal_alignment": a}
                for c, a in ((2, "top_left"), (5, "bottom_right"))
            ],
        }[vary]
        jax_flash.attention(q, k, v, block_q=4, block_k=3, fast=True, **calls[0])
        jax_flash.attention_vjp(q, k, v, d_out, block_q=4, block_k=3, **calls[0])
        before = (jax_flash_fast._flash._cache_size(), jax_flash_fast._flash_vjp._cache_size())
        for options in calls[1:]:
            jax_flash.attention(q, k, v, block_q=4, block_k=3, fast=True, **options)
            jax_flash.attention_vjp(q, k, v, d_out, block_q=4, block_k=3, **options)
        after = (jax_flash_fast._flash._cache_size(), jax_flash_fast._flash_vjp._cache_size())
        assert after == before, f"{vary}: {before} programs became {after}"


def test_jax_flash_compiles_once_per_shape_bucket():
    """T and S are padded to their bucket (``flash_fast.bucket``) before the compiled program,
    their true values runtime values of it: every length of a bucket after the first
    compiles no program at all, neither the attention's nor a pad's or a cut's around it,
    forward and backward, and each answer is the oracle's."""
    jax.config.update("jax_enable_x64", True)
    from jax import monitoring

    compiled = []
    monitoring.register_event_listener(
        lambda event, **_: (
            compiled.append(event)
            if event == "/jax/compilation_cache/compile_requests_use_cache"
            else None
        )
    )
    assert [jax_flash_fast.bucket(n, 4) for n in (1, 3, 5, 8, 9, 17, 64, 65)] == [
        (1, 1), (4, 4), (4, 8), (4, 8), (4, 16), (4, 32), (4, 64), (4, 80),
    ]  # fmt: skip
    assert jax_flash_fast.bucket(4097, 256) == (256, 5120)  # past 16 tiles, a multiple of 4 tiles
    options = dict(block_q=4, block_k=8, is_causal=True, causal_alignment="bottom_right")
    for n, (T, S) in enumerate([(5, 9), (6, 16), (7, 11), (7, 13)]):
        q, k, v = random_qkv(n, B=2, H=4, K=2, T=T, S=S, D=3, E=2, dtype="float64")
        mask = np.random.default_rng(n).standard_normal((2, 1, T, S))
        d_out = np.random.default_rng(n + 9).standard_normal((2, 4, T, 2))
        before = len(compiled)
        out = jax_flash.attention(q, k, v, mask=mask, fast=True, **options)
        grads = jax_flash.attention_vjp(q, k, v, d_out, mask=mask, **options)
        if n > 0:
            assert len(compiled) == before, f"T={T}, S={S}: {len(compiled) - before} programs"
        causal = dict(mask=mask, is_causal=True, causal_alignment="bottom_right")
        expected = numpy_attention.attention(q, k, v, **causal)
        assert_within(np.asarray(out), expected, tolerance("float64", 0.0, expected), "out")
        expected = naive_vjp_same_precision(q, k, v, d_out, np.float64, **causal)
        for got, name in zip(grads, ("dq", "dk", "dv", "dmask")):
            want = expected[name]
            assert got.shape == want.shape, name
            assert_within(np.asarray(got), want, tolerance("float64", 0.0, want), name)


@pytest.mark.parametrize("page", [numpy_flash, jax_flash], ids=["numpy", "jax"])
@pytest.mark.parametrize("block", [1, 4, 13])
def test_the_one_row_recurrence_is_the_softmax(page, block):
    """``online_softmax_row``, key blocks of 1, 4 and all 13: the plain softmax's weighted
    sum of the values, in float64 (JAX's compiled whole: one program per block size)."""
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(66)
    x, v = 3 * rng.standard_normal(13), rng.standard_normal((13, 3))
    weights = np.exp(x - x.max()) / np.exp(x - x.max()).sum()  # (S,)
    row = page.online_softmax_row
    if page is jax_flash:
        row = jax.jit(row, static_argnums=2)
    got = np.asarray(row(x, v, block))
    assert_within(got, weights @ v, tolerance("float64", 0.0, weights @ v), "one row")


def test_numpy_textbook_path_stays_on_its_page_and_the_fast_one_enters_flash_tiles_once(
    monkeypatch,
):
    """Followed from ``attention``, the textbook path calls nothing on flash_tiles.py, with
    every option it has; the fast path makes one call there, and gives the same rows."""
    q, k, v = random_qkv(67, B=2, H=4, K=2, T=9, S=11, D=3, E=2, dtype="float32")
    mask = np.random.default_rng(68).standard_normal((2, 1, 9, 11)).astype(np.float32)
    options = dict(
        mask=mask,
        is_causal=True,
        causal_alignment="bottom_right",
        window=(5, None),
        softcap=3.0,
        sinks=np.zeros(4, dtype=np.float32),
        chunk_size=7,
        alibi_slopes=np.full(4, 0.25, dtype=np.float32),
        block_q=4,
        block_k=3,
    )
    calls = []
    for name, x in vars(numpy_flash_tiles).items():
        if callable(x) and getattr(x, "__module__", None) == numpy_flash_tiles.__name__:

            def recorded(*args, _real=x, _name=name, **kwargs):
                # Only the calls from flash.py: the fast path's own calls stay on its page.
                if sys._getframe(1).f_globals["__name__"] == numpy_flash.__name__:
                    calls.append(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(numpy_flash_tiles, name, recorded)
    textbook = numpy_flash.attention(q, k, v, **options)
    assert calls == [], f"the textbook path called flash_tiles.{calls}"
    fast = numpy_flash.attention(q, k, v, fast=True, **options)
    assert calls == ["attention"], f"the fast path entered flash_tiles.py as {calls}"
    expected = numpy_attention.attention(q, k, v, **{n: options[n] for n in list(options)[:-2]})
    tol = 2 * random_tolerance(q, k, v, "float32", **{n: options[n] for n in list(options)[:-2]})
    assert_within(textbook, expected, tol, "the textbook path")
    assert_within(fast, expected, tol, "the fast path")


def test_jax_textbook_path_gives_the_stored_fixtures():
    """JAX's textbook path (``attention`` without ``fast``) on every stored forward fixture
    it can run (no dropout), at the conformance run's tiles (4 × 8), within SPEC §7 of the
    oracle. It is not the backend's path: it runs the fixtures only, so that its programs
    (one ``online_softmax_step`` and one ``normalised`` per tile shape) stay few."""
    jax.config.update("jax_enable_x64", True)
    from conformance.backends import load_backend
    from conformance.suite.cases import case_entries, load_case

    flash = load_backend("jax-flash")
    ran = 0
    for entry in case_entries(("attention",)):
        case = load_case(entry["id"])
        if not set(case.requires) <= set(flash.capabilities) or case.dtype not in flash.dtypes:
            continue
        out = jax_flash.attention(
            *case.inputs(), mask=case.mask(), block_q=4, block_k=8, **case.options()
        )
        expected = case.expected
        tol = tolerance(case.dtype, case.naive_error, expected)
        assert_within(np.asarray(out), expected, tol, f"jax textbook path, fixture {case.id}")
        ran += 1
    programs = jax_flash.online_softmax_step._cache_size() + jax_flash.normalised._cache_size()
    assert ran > 150 and programs <= 40, f"{ran} fixtures, {programs} programs"


def test_backend_option_runs_numpy_flash_on_its_textbook_path(monkeypatch):
    """``--backend-option numpy-flash:textbook=True`` (the numpy tox env's second run)
    loads numpy-flash with the conformance tiles and its textbook path; without it, and
    for users, numpy-flash is the fast path. A malformed option is a usage error."""
    from conformance.backends import load_backend
    from conformance.suite import plugin

    assert plugin.backend_options(["numpy-flash:textbook=True", "numpy-flash:block_q=2"]) == {
        "numpy-flash": {"textbook": True, "block_q": 2}
    }
    for bad in ("numpy-flash textbook", "numpy-flash:textbook=yes please"):
        with pytest.raises(pytest.UsageError, match="NAME:KEY=VALUE"):
            plugin.backend_options([bad])
    assert plugin.conformance_backend("numpy-flash").fast
    monkeypatch.setitem(plugin._BACKEND_OPTIONS, "numpy-flash", {"textbook": True})
    textbook = plugin.conformance_backend("numpy-flash")
    assert textbook.options == {"block_q": 4, "block_k": 8, "textbook": True}
    assert not textbook.fast and load_backend("numpy-flash").fast


def test_the_numpy_page_reads_the_recurrence_first():
    """impls/numpy/flash.py as a reader meets it: a docstring of at most 50 lines, then the
    recurrence for one row in at most 15, then ``attention``, whose first running-maximum
    update stands within the page's first 120 lines; the names are the docstring's."""
    import ast
    import inspect

    source = inspect.getsource(numpy_flash)
    tree = ast.parse(source)
    doc = ast.get_docstring(tree, clean=False)
    assert doc.count("\n") + 1 <= 50, f"the docstring has {doc.count(chr(10)) + 1} lines"
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    row, first = functions[0], functions[1]
    assert (row.name, first.name) == ("online_softmax_row", "attention")
    assert row.end_lineno - row.lineno + 1 <= 15, "online_softmax_row is over 15 lines"
    lines = source.splitlines()
    update = next(i for i, line in enumerate(lines, 1) if "m_new = np.maximum(m, x" in line)
    assert first.lineno < update <= min(first.end_lineno, 120), f"first update at line {update}"
    for name in ("m_new", "alpha", "l = alpha * l", "a = alpha * a"):
        assert name in ast.get_source_segment(source, row), name
        assert name in ast.get_source_segment(source, first), name


@pytest.mark.parametrize("page", [numpy_flash_tiles, jax_flash_tiles], ids=["numpy", "jax"])
def test_a_row_with_no_key_has_lse_minus_inf_and_the_backward_alone_takes_plus_inf(page):
    """SPEC §21.2: a row with no key (l = 0) has lse = log 0 = −inf, and ``running_lse``,
    what ``return_lse`` gives, says so; the backward forms its weights against +inf there
    (exp(Z − inf) = 0, not exp(−inf + inf) = NaN) under a name of its own, ``backward_lse``,
    so that no function called a log-sum-exp gives +inf. Rows: no key, two keys of scores
    1 and 2 (m = 2, l = 1 + e⁻¹), a +inf score (l = +inf). JAX's: one program."""
    m = np.array([[-np.inf], [2.0], [np.inf]])  # (rows, 1)
    l = np.array([[0.0], [1.0 + np.exp(-1.0)], [np.inf]])  # (rows, 1)

    def both(m, l):
        return page.running_lse(m, l), page.backward_lse(m, l)

    if page is jax_flash_tiles:
        jax.config.update("jax_enable_x64", True)
        both = jax.jit(both)
    lse, shift = (np.ravel(np.asarray(x)) for x in both(m, l))
    true = np.log(np.exp(1.0) + np.exp(2.0))
    np.testing.assert_allclose(lse, [-np.inf, true, np.nan], rtol=1e-15)
    np.testing.assert_allclose(shift, [np.inf, true, np.nan], rtol=1e-15)
    assert not hasattr(page, "log_sum_exp"), "flash_tiles' log_sum_exp: one name, one sign"
