"""SPEC §3.5-§3.6, §4.2, §4.6, §5, §6.11-§6.13: the variants real models use."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.suite.helpers import (
    SIZES,
    as64,
    causal_where_taken,
    pool_qkv,
    random_qkv,
    random_tolerance,
)
from conformance.suite.requirements import requires, value_dims
from conformance.suite.tolerance import assert_identical, assert_within, expect, tolerance

sizes = pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
dtypes = pytest.mark.parametrize("dtype", ["float64", "float32"])


@pytest.mark.clause("6.11", "3.5")
@dtypes
@pytest.mark.parametrize(
    "chunks", [[1] * 9, [4, 1, 3, 1]], ids=["token-by-token", "continued-prefill"]
)
@requires("causal_bottom_right", "causal")
def test_kv_cache_decode_matches_full_causal(backend, dtype, chunks):
    """Feeding the sequence in chunks, each attending to every key so far with bottom-right
    causal alignment (a KV-cache decode loop), reproduces the full causal output."""
    T = sum(chunks)
    q, k, v = random_qkv(20, T=T, S=T, dtype=dtype)
    full = backend.attention(q, k, v, is_causal=True)
    tol = 2 * random_tolerance(q, k, v, dtype, is_causal=True)
    start = 0
    for n in chunks:
        end = start + n
        step = backend.attention(
            q[..., start:end, :],
            k[..., :end, :],
            v[..., :end, :],
            is_causal=True,
            causal_alignment="bottom_right",
        )
        assert_within(
            step,
            full[..., start:end, :],
            tol,
            f"{backend.name}: decode chunk of queries {start}..{end - 1} against {end} cached keys",
            behaviour="a KV-cache decode step (bottom-right causal over the keys so far) differs from the full causal call",
        )
        start = end


@pytest.mark.clause("3.5")
@dtypes
@requires("causal_bottom_right", "causal")
def test_bottom_right_equals_top_left_when_square(backend, dtype):
    """With T == S both alignments put the diagonal in the same place."""
    q, k, v = random_qkv(21, T=8, S=8, dtype=dtype)
    a = backend.attention(q, k, v, is_causal=True)
    b = backend.attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert_within(
        a,
        b,
        2 * random_tolerance(q, k, v, dtype, is_causal=True),
        f"{backend.name}: square causal, both alignments",
        behaviour="bottom-right and top-left causal differ when T = S",
    )


@pytest.mark.clause("3.5")
@dtypes
@requires("causal_bottom_right", "causal")
def test_bottom_right_single_query_sees_every_key(backend, dtype):
    """A decode step (T = 1) under bottom-right causal attends every key."""
    q, k, v = pool_qkv(22, "T1-S9", backend, dtype)
    full = backend.attention(q, k, v)
    tol = 2 * random_tolerance(q, k, v, dtype)
    assert_within(
        backend.attention(q, k, v, is_causal=True, causal_alignment="bottom_right"),
        full,
        tol,
        f"{backend.name}: T=1 bottom-right",
        behaviour="a single query under bottom-right causal does not see every key",
    )


@pytest.mark.clause("3.4")
@dtypes
@requires("causal", "causal_top_left")
def test_top_left_single_query_sees_key_zero(backend, dtype):
    """A single query (T = 1, S > 1) under top-left causal sees key 0 only: its output is
    v's first row, for every backend that takes is_causal, whatever alignments it has."""
    q, k, v = pool_qkv(22, "T1-S9", backend, dtype)
    tol = 2 * random_tolerance(q, k, v, dtype)
    assert_within(
        backend.attention(q, k, v, is_causal=True),
        v[..., :1, :],
        tol,
        f"{backend.name}: T=1 top-left sees only key 0",
        behaviour="a single query under top-left causal sees more than key 0",
    )


@pytest.mark.clause("6.12", "4.6")
@sizes
@dtypes
@pytest.mark.parametrize("K", [1, 2], ids=["mqa-K1", "gqa-K2"])
@requires("gqa")
def test_gqa_equals_repeat_interleave(backend, size, dtype, K):
    """K key/value heads shared by H = 4 query heads equal ordinary attention on the K heads
    repeated with repeat_interleave: query head h uses key/value head h // (H // K)."""
    H = 4
    q, k, v = random_qkv(23, H=H, K=K, **size, dtype=dtype)
    causal = causal_where_taken(backend, size["T"], size["S"])
    grouped = backend.attention(q, k, v, **causal)
    k_rep, v_rep = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    expanded = backend.attention(q, k_rep, v_rep, **causal)
    assert_within(
        grouped,
        expanded,
        2 * random_tolerance(q, k_rep, v_rep, dtype, **causal),
        f"{backend.name}: H={H} K={K} vs repeat_interleave",
        behaviour="grouped-query attention differs from repeating each key/value head for its query heads (repeat_interleave)",
    )


@pytest.mark.clause("6.13", "3.6")
@sizes
@dtypes
@requires("window", "causal_top_left", "causal")
def test_window_identities(backend, size, dtype):
    """window (None, None) is no window; window (left, 0) equals window (left, None) with
    causal; window (0, 0) on a square problem returns each query's own value row."""
    q, k, v = random_qkv(24, **size, dtype=dtype)
    tol = 2 * random_tolerance(q, k, v, dtype, window=(2, 0))
    assert_within(
        backend.attention(q, k, v, window=(None, None)),
        backend.attention(q, k, v),
        tol,
        f"{backend.name}: window (None, None)",
        behaviour="window (None, None) is not the same as no window",
    )
    assert_within(
        backend.attention(q, k, v, window=(2, 0)),
        backend.attention(q, k, v, window=(2, None), is_causal=True),
        tol,
        f"{backend.name}: window (2, 0) vs window (2, None) + causal",
        behaviour="window (left, 0) differs from window (left, None) with causal",
    )
    n = min(size["T"], size["S"])
    diag = backend.attention(q[..., :n, :], k[..., :n, :], v[..., :n, :], window=(0, 0))
    assert_within(
        diag,
        v[..., :n, :],
        tol,
        f"{backend.name}: window (0, 0) attends only the diagonal",
        behaviour="window (0, 0) does not return each query's own value row",
    )


@pytest.mark.clause("4.2")
@dtypes
@requires("softcap")
def test_softcap_limits(backend, dtype):
    """A softcap far above every score changes nothing measurable (c·tanh(x/c) - x ≈ x³/3c²);
    a softcap c keeps every score in (-c, c), so with V = identity every weight lies in
    [exp(-2c) / S, exp(2c) / S], however large the raw scores are. (Where E ≠ D is not
    declared, D = S, so that V can be the identity.)"""
    D, _ = value_dims(backend, 5, 13, keep="E")
    q, k, v = random_qkv(25, T=7, S=13, D=D, dtype=dtype)
    tol = 2 * random_tolerance(q, k, v, dtype)
    assert_within(
        backend.attention(q, k, v, softcap=1e9),
        backend.attention(q, k, v),
        tol,
        f"{backend.name}: softcap 1e9",
        behaviour="a softcap far above every score changes the output",
    )
    S, c = 13, 0.5
    eye = np.broadcast_to(np.eye(S, dtype=q.dtype), (2, 3, S, S)).copy()
    q_big = (as64(q) * 4).astype(q.dtype)
    w = as64(backend.attention(q_big, k, eye, softcap=c))
    lo, hi = np.exp(-2 * c) / S - tol, np.exp(2 * c) / S + tol
    expect(
        lo <= w.min() and w.max() <= hi,
        "softcap does not bound the scores to (-softcap, softcap)",
        f"{backend.name}: softcap {c}: weights in [{w.min():.4f}, {w.max():.4f}], expected within [{lo:.4f}, {hi:.4f}]",
    )


@pytest.mark.clause("5.1")
@dtypes
@requires("dropout")
def test_dropout_zero_is_identity(backend, dtype):
    """dropout_p = 0 is exactly no dropout."""
    q, k, v = random_qkv(26, dtype=dtype)
    assert_identical(
        backend.attention(q, k, v, dropout_p=0.0, seed=1),
        backend.attention(q, k, v),
        f"{backend.name}: dropout_p=0",
        behaviour="dropout_p = 0 is not exactly no dropout",
    )


@pytest.mark.clause("5.2")
@pytest.mark.parametrize("p", [0.1, 0.5])
@requires("dropout")
def test_dropout_statistics(backend, p, dtype):
    """With V = identity the output is the dropped weight matrix: each positive weight is
    zeroed with probability p (within 5 standard deviations) and the survivors are scaled
    by 1 / (1 - p) (to 1e-12, or the dtype's rounding where that is larger); the same seed
    repeats the draw."""
    S = 32
    D, _ = value_dims(backend, 5, S, keep="E")
    q, k, _ = random_qkv(27, B=2, H=4, T=24, S=S, D=D, dtype=dtype)
    v = np.broadcast_to(np.eye(S, dtype=q.dtype), (2, 4, S, S)).copy()
    w = as64(backend.attention(q, k, v))
    first = backend.attention(q, k, v, dropout_p=p, seed=3)
    dropped = as64(first)
    assert_identical(
        backend.attention(q, k, v, dropout_p=p, seed=3),
        first,
        f"{backend.name}: same seed",
        behaviour="the same seed draws another dropout mask",
    )
    n = w.size
    zero = dropped == 0
    frac = zero.mean()
    bound = 5 * np.sqrt(p * (1 - p) / n)
    expect(
        abs(frac - p) <= bound,
        "dropout zeroes a fraction of the weights other than dropout_p",
        f"{backend.name}: zeroed fraction {frac:.4f}, expected {p} ± {bound:.4f}",
    )
    kept = ~zero
    scaled = w[kept] / (1 - p)
    assert_within(
        dropped[kept],
        scaled,
        max(1e-12, tolerance(dtype, 0.0, scaled)),
        f"{backend.name}: kept weights should be scaled by 1/(1-p)",
        behaviour="dropout does not scale the kept weights by 1 / (1 - dropout_p)",
    )
    other = as64(backend.attention(q, k, v, dropout_p=p, seed=4))
    expect(
        not np.array_equal(other, dropped),
        "two seeds draw the same dropout mask",
        f"{backend.name}: seeds 3 and 4 drew the same dropout mask",
    )


@pytest.mark.clause("5.2")
@requires("dropout")
def test_dropout_mean_approaches_output(backend, dtype):
    """Averaged over many seeds, the dropped output approaches the undropped one within
    five standard errors (dropout is unbiased), allowing 1e-12 or, where larger, twice
    the dtype's rounding (SPEC §7)."""
    q, k, v = random_qkv(28, B=1, H=2, T=5, S=6, dtype=dtype)
    slack = max(1e-12, 2 * random_tolerance(q, k, v, dtype))
    ref = as64(backend.attention(q, k, v))
    draws = np.stack([as64(backend.attention(q, k, v, dropout_p=0.3, seed=s)) for s in range(300)])
    mean, sem = draws.mean(0), draws.std(0) / np.sqrt(len(draws))
    worst = float((np.abs(mean - ref) - 5 * sem).max())
    expect(
        worst <= slack,
        "dropout is biased: the mean over many seeds is not the output",
        f"{backend.name}: mean of 300 dropout draws is {worst:.3e} beyond 5 standard errors from the output",
    )
