"""SPEC §6: properties every correct attention has, checked on outputs alone.

Each property holds for the exact mathematics; where a floating-point result may
legitimately move, the comparison uses SPEC §7's tolerance for those inputs, and where it
may not (leakage, determinism) the comparison is bit-for-bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import numpy_dtype
from conformance.suite.diagnosis import output_dtype
from conformance.suite.domain import domain_of, positions
from conformance.suite.helpers import (
    SIZES,
    as64,
    causal_param,
    causal_where_taken,
    expect_no_weight_on_future_keys,
    random_qkv,
    random_tolerance,
)
from conformance.suite.requirements import requires, value_dims
from conformance.suite.sizes import SHAPES
from conformance.suite.tolerance import (
    assert_identical,
    assert_rows_zero,
    assert_within,
    dtype_note,
    expect,
    expect_seen,
)

DTYPES = ["float64", "float32"]
sizes = pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
dtypes = pytest.mark.parametrize("dtype", DTYPES)


@pytest.mark.clause("6.1", "2.3")
@sizes
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_shapes_and_dtypes(backend, size, dtype):
    """out is (B, H, T, E), also with T != S (and E != D where declared), in every dtype
    (its dtype is ``test_output_dtype``'s)."""
    D, E = value_dims(backend, 5, 3)
    q, k, v = random_qkv(1, **size, D=D, E=E, dtype=dtype)
    out = backend.attention(q, k, v)
    expect(
        out.shape == (2, 3, size["T"], E),
        "returns an output of the wrong shape",
        f"{backend.name}: shape {out.shape}, expected (B, H, T, E) = (2, 3, {size['T']}, {E})"
        + dtype_note(out, q.dtype),
    )


@pytest.mark.clause("2.4", "6.1")
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_output_dtype(backend, dtype):
    """The output has the inputs' dtype: judged here, once per dtype, and only here (every
    other test judges the values in whatever dtype they come, SPEC §2.4), at T7-S13, or
    the pool's decode row T1-S9 for a kernel that takes fewer queries."""
    D, E = value_dims(backend, 5, 3)
    max_t = domain_of(backend).of("attention").max_t
    decode = SHAPES["T1-S9"][0]
    size = SIZES["T7-S13"] if max_t is None or max_t >= 7 else {"T": decode.T, "S": decode.S}
    q, k, v = random_qkv(1, **size, D=D, E=E, dtype=dtype)
    out = backend.attention(q, k, v)
    expect(
        np.asarray(out).dtype == numpy_dtype(dtype),
        output_dtype(numpy_dtype(dtype), np.asarray(out).dtype),
        f"{backend.name}: dtype {np.asarray(out).dtype}, expected {dtype}",
    )


@pytest.mark.clause("2.2", "6.1")
@requires("unbatched")
def test_unbatched_shape(backend, dtype):
    """(H, T, D) inputs give (H, T, E), equal to the batched call on one batch."""
    D, E = value_dims(backend, 5, 3)
    q, k, v = random_qkv(2, B=1, T=7, S=13, D=D, E=E, dtype=dtype)
    causal = causal_where_taken(backend, 7, 13)
    out = backend.attention(q[0], k[0], v[0], **causal)
    expect(
        out.shape == (3, 7, E),
        "returns the wrong shape for unbatched inputs",
        f"{backend.name}: unbatched shape {out.shape}, expected (H, T, E) = (3, 7, {E})",
    )
    assert_identical(
        out,
        backend.attention(q, k, v, **causal)[0],
        f"{backend.name}: unbatched vs batched",
        behaviour="unbatched inputs give another result than the same call with a batch of one",
    )


@pytest.mark.clause("6.2")
@sizes
@dtypes
@pytest.mark.parametrize("causal", [pytest.param(False, id="full"), causal_param()])
def test_weight_rows_sum_to_one(backend, size, dtype, causal):
    """With V = identity (E = S) the output is the weight matrix: rows >= 0 summing to 1,
    and exactly 0 on keys a causal mask blocks. (Where E ≠ D is not declared, D = S too.)"""
    T, S = size["T"], size["S"]
    D, _ = value_dims(backend, 5, S, keep="E")
    q, k, _ = random_qkv(3, T=T, S=S, D=D, dtype=dtype)
    v = np.broadcast_to(np.eye(S, dtype=numpy_dtype(dtype)), (2, 3, S, S)).copy()
    w = as64(backend.attention(q, k, v, is_causal=causal))
    tol = random_tolerance(q, k, v, dtype, is_causal=causal)
    # A NaN weight is no negative one: held against the misreadings first (keys read past S).
    expect_seen(
        not np.isnan(w).any(),
        "gives a key a NaN attention weight",
        f"{backend.name}: NaN weights at {np.argwhere(np.isnan(w))[:3].tolist()}",
        w,
        tol,
    )
    expect(
        (w >= 0).all(),
        "gives a key a negative attention weight",
        f"{backend.name}: negative weight {w.min()}",
    )
    assert_within(
        w.sum(-1),
        np.ones(w.shape[:-1]),
        S * tol,
        f"{backend.name}: weight rows should sum to 1",
        behaviour="attention weights do not sum to 1",
    )
    if causal:
        expect_no_weight_on_future_keys(backend.name, w, T, S)


@pytest.mark.clause("6.3")
@sizes
@dtypes
@requires("causal", "causal_top_left")
def test_no_future_leakage(backend, size, dtype):
    """Under causal masking, changing keys and values after position i leaves outputs at
    positions <= i bit-for-bit unchanged (top-left: query t sees keys s <= t)."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(4, T=T, S=S, dtype=dtype)
    base = backend.attention(q, k, v, is_causal=True)
    for i in positions(backend, min(T, S) - 1):
        k2, v2 = k.copy(), v.copy()
        k2[..., i + 1 :, :] = (k2[..., i + 1 :, :].astype(np.float64) * -7 + 50).astype(k.dtype)
        v2[..., i + 1 :, :] = (v2[..., i + 1 :, :].astype(np.float64) * 9 - 30).astype(v.dtype)
        out = backend.attention(q, k2, v2, is_causal=True)
        assert_identical(
            out[..., : i + 1, :],
            base[..., : i + 1, :],
            f"{backend.name}: outputs <= {i} after changing keys > {i}",
            behaviour="under a causal mask, changing later keys and values changes earlier outputs",
        )


@pytest.mark.clause("6.4")
@sizes
@dtypes
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_masked_key_equals_deleted_key(backend, size, dtype, mask_kind):
    """Blocking key j with the mask gives the output of the same call without key j."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(5, T=T, S=S, dtype=dtype)
    for j in (0, S // 2, S - 1):
        keep = np.arange(S) != j
        if mask_kind == "bool":
            mask = np.broadcast_to(keep, (T, S))
        else:
            mask = np.where(np.broadcast_to(keep, (T, S)), 0.0, -np.inf).astype(q.dtype)
        masked = backend.attention(q, k, v, mask=mask)
        deleted = backend.attention(q, k[..., keep, :], v[..., keep, :])
        tol = 2 * random_tolerance(q, k[..., keep, :], v[..., keep, :], dtype)
        assert_within(
            masked,
            deleted,
            tol,
            f"{backend.name}: key {j} masked ({mask_kind}) vs deleted",
            behaviour="a masked key does not act as a deleted one",
        )


@pytest.mark.clause("6.5")
@sizes
@dtypes
def test_permutation(backend, size, dtype):
    """Permuting keys and values together changes nothing; permuting queries permutes outputs."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(6, T=T, S=S, dtype=dtype)
    base = backend.attention(q, k, v)
    tol = 2 * random_tolerance(q, k, v, dtype)
    perm_s = np.random.default_rng(0).permutation(S)
    out = backend.attention(q, k[..., perm_s, :], v[..., perm_s, :])
    assert_within(
        out,
        base,
        tol,
        f"{backend.name}: keys/values permuted by {perm_s.tolist()}",
        behaviour="permuting the keys and values changes the output",
    )
    perm_t = np.random.default_rng(1).permutation(T)
    out = backend.attention(q[..., perm_t, :], k, v)
    assert_within(
        out,
        base[..., perm_t, :],
        tol,
        f"{backend.name}: queries permuted by {perm_t.tolist()}",
        behaviour="permuting the queries does not permute the output",
    )


@pytest.mark.clause("6.6")
@sizes
@dtypes
@pytest.mark.parametrize("causal", [pytest.param(False, id="full"), causal_param()])
def test_convex_hull(backend, size, dtype, causal):
    """Each output is a convex combination of the value rows it may see, so every channel
    lies within [min, max] of those values (allowing SPEC §7's rounding)."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(7, T=T, S=S, dtype=dtype)
    out = as64(backend.attention(q, k, v, is_causal=causal))
    tol = random_tolerance(q, k, v, dtype, is_causal=causal)
    vv = as64(v)
    for t in range(T):
        seen = vv[..., : t + 1, :] if causal else vv
        lo, hi = seen.min(axis=-2), seen.max(axis=-2)
        row = out[..., t, :]
        worst = max(float((lo - row).max()), float((row - hi).max()))
        expect(
            worst <= tol,
            "an output leaves the range of the value rows it averages",
            f"{backend.name}: output row {t} leaves the values' hull by {worst:.3e} (tolerance {tol:.3e})",
        )


@pytest.mark.clause("6.7")
@sizes
@dtypes
@pytest.mark.parametrize("shift", [3.0, 1e4], ids=["small-shift", "huge-shift"])
def test_key_shift_invariance(backend, size, dtype, shift):
    """Adding one vector c to every key adds q·c to a whole row of scores, which softmax
    ignores: the output is unchanged, also for a huge shift that only a max-subtracting
    softmax survives."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(8, T=T, S=S, dtype=dtype)
    if shift > 100:
        # A huge shift only along a direction where q is tiny keeps the score spread
        # representable, so the comparison tests overflow handling, not rounding.
        q[..., 0] = np.asarray(1e-3, dtype=q.dtype)
        c = np.zeros(q.shape[-1])
        c[0] = shift
    else:
        c = np.random.default_rng(2).standard_normal(q.shape[-1]) * shift
    k2 = (as64(k) + c).astype(k.dtype)
    base = backend.attention(q, k, v)
    out = backend.attention(q, k2, v)
    tol = random_tolerance(q, k, v, dtype) + random_tolerance(q, k2, v, dtype)
    expect(
        np.isfinite(as64(out)).all(),
        "a large shift common to every key gives a non-finite output",
        f"{backend.name}: non-finite output after shifting keys by {shift}",
    )
    assert_within(
        out,
        base,
        tol,
        f"{backend.name}: keys shifted by a common vector of size {shift}",
        behaviour="a shift common to every key changes the output",
    )


@pytest.mark.clause("6.8")
@sizes
@dtypes
@pytest.mark.parametrize("c", [2.0, 0.25, 3.0])
@requires("scale")
def test_scale_homogeneity(backend, size, dtype, c):
    """attention(c·q, scale=s) == attention(q, scale=c·s)."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(9, T=T, S=S, dtype=dtype)
    s = 0.7
    cq = (as64(q) * c).astype(q.dtype)
    a = backend.attention(cq, k, v, scale=s)
    b = backend.attention(q, k, v, scale=c * s)
    tol = random_tolerance(cq, k, v, dtype, scale=s) + random_tolerance(q, k, v, dtype, scale=c * s)
    assert_within(
        a,
        b,
        tol,
        f"{backend.name}: attention({c}·q, scale={s}) vs attention(q, scale={c * s})",
        behaviour="scaling q is not the same as scaling the scale",
    )


@pytest.mark.clause("6.9")
@sizes
@dtypes
def test_batch_and_head_independence(backend, size, dtype):
    """Each (batch, head) slice computed alone equals its slice of the full call, and
    changing another batch or head does not change it. At the pool's B = 2, H = 3
    (SPEC §13.21): B ≠ H, so swapped batch and head axes show, and the full call is the
    other invariants' program."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(10, B=2, H=3, T=T, S=S, dtype=dtype)
    causal = causal_where_taken(backend, T, S)
    full = backend.attention(q, k, v, **causal)
    tol = 2 * random_tolerance(q, k, v, dtype, **causal)
    for b, h in ((0, 0), (1, 2), (0, 1)):
        alone = backend.attention(
            q[b : b + 1, h : h + 1],
            k[b : b + 1, h : h + 1],
            v[b : b + 1, h : h + 1],
            **causal,
        )
        assert_within(
            alone[0, 0],
            full[b, h],
            tol,
            f"{backend.name}: batch {b} head {h} alone vs in the full call",
            behaviour="a batch element or head computed alone differs from its slice of the whole call",
        )
    q2 = q.copy()
    q2[1:] = q2[1:] * np.asarray(-3, dtype=q.dtype)
    q2[0, 1:] = q2[0, 1:] * np.asarray(5, dtype=q.dtype)
    out = backend.attention(q2, k, v, **causal)
    assert_within(
        out[0, 0],
        full[0, 0],
        tol,
        f"{backend.name}: batch 0 head 0 after changing the other batches and heads",
        behaviour="changing one batch element or head changes another",
    )


@pytest.mark.clause("6.10")
@dtypes
def test_determinism(backend, dtype):
    """The same call, repeated, gives bit-for-bit the same output."""
    q, k, v = random_qkv(11, T=7, S=13, dtype=dtype)
    mask = np.random.default_rng(3).random((7, 13)) < 0.8
    causal = causal_where_taken(backend, 7, 13)
    first = backend.attention(q, k, v, mask=mask, **causal)
    for _ in range(3):
        assert_identical(
            backend.attention(q, k, v, mask=mask, **causal),
            first,
            f"{backend.name}: repeated call",
            behaviour="the same call, repeated, gives different bits",
        )


@pytest.mark.clause("4.3")
@pytest.mark.parametrize(
    "how",
    [
        "bool-mask",
        "float-mask",
        pytest.param("bottom-right-T>S", marks=requires("causal_bottom_right", "causal")),
        pytest.param("window", marks=requires("window", "causal_top_left")),
    ],
)
@dtypes
def test_fully_masked_rows_are_zero(backend, how, dtype):
    """A query with no key left to attend returns exactly 0 (not NaN, not the mean of V).
    At the pool's T13-S7 (SPEC §13.21): T > S leaves rows past the keys for causality
    and the window to empty."""
    T, S = SIZES["T13-S7"]["T"], SIZES["T13-S7"]["S"]
    q, k, v = random_qkv(12, T=T, S=S, dtype=dtype)
    options: dict = {}
    blocked = np.zeros(T, dtype=bool)
    if how == "bool-mask":
        mask = np.ones((T, S), dtype=bool)
        mask[[0, 3]] = False
        blocked[[0, 3]] = True
        options["mask"] = mask
    elif how == "float-mask":
        mask = np.zeros((T, S), dtype=q.dtype)
        mask[[1, 6]] = -np.inf
        blocked[[1, 6]] = True
        options["mask"] = mask
    elif how == "bottom-right-T>S":
        options.update(is_causal=True, causal_alignment="bottom_right")
        blocked[: T - S] = True
    else:
        # Window (0, 0) around a diagonal that has left the keys for the last T - S rows.
        options["window"] = (0, 0)
        blocked[S:] = True
    out = backend.attention(q, k, v, **options)
    assert_rows_zero(out, blocked, f"{backend.name} ({how})", v=v)
    expect(
        np.isfinite(as64(out)).all(),
        "returns a non-finite output for queries that have keys to attend",
        f"{backend.name}: non-finite output ({how})",
    )
    expect(
        (np.abs(as64(out)[..., ~blocked, :]).sum(-1) > 0).all(),
        "returns 0 for a query that has keys to attend",
        f"{backend.name}: a row with keys to attend came out 0 ({how})",
    )
