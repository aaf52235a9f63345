"""SPEC §14: sharded (context-parallel) attention, held to the same oracle at every P.

Each test runs on the chosen backends that declare the capability "sharded" and loads them
at the device counts and layouts it needs with ``load_backend(name, shards=P,
layout=...)``. Expected values come from the naive float64 run standing in for the oracle
(SPEC §7.2), never from a sharded backend; the tolerance is §7's, the same at every P.
The inputs share a few shapes, so that a compiling backend compiles each once.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import load_backend
from conformance.report.agreement import VS_ONE_SHARD
from conformance.suite.helpers import as64, random_qkv, random_tolerance
from conformance.suite.measure import publish
from conformance.suite.requirements import requires, uses_dtype, value_dims
from conformance.suite.tolerance import assert_identical, assert_within, tolerance

pytestmark = requires("sharded")

SHARDS = [1, 2, 3, 4]
#: §14.2's difference from P = 1 is measured up to 8 devices (the host devices JAX gets).
ALL_SHARDS = [1, 2, 3, 4, 5, 6, 7, 8]
LAYOUTS = ["contiguous", "zigzag"]
#: One shape for most tests: T and S not multiples of 2, 3 or 4; grouped heads (K < H);
#: H = 12 splits evenly over P = 1-4 and 6 and unevenly over 5, 7 and 8.
SHAPE = {"B": 2, "H": 12, "K": 1, "T": 7, "S": 13, "D": 5, "E": 3}
VARIANTS = {
    "plain": ((), {}),
    "causal": ((), {"is_causal": True}),
    "all": (
        ("gqa", "causal_bottom_right", "window", "softcap"),
        {"is_causal": True, "causal_alignment": "bottom_right", "window": (3, 0), "softcap": 2.5},
    ),
}


def _shape(backend, **changes) -> dict:
    """SHAPE with ``changes``, and E = D where the backend does not declare "value_dim"."""
    shape = {**SHAPE, **changes}
    shape["D"], shape["E"] = value_dims(backend, shape["D"], shape["E"])
    return shape


def _sharded(backend, P: int, layout: str = "contiguous"):
    at = load_backend(backend.name, shards=P, layout=layout)
    assert (at.shards, at.layout) == (P, layout), (
        f"load_backend({backend.name!r}, shards={P}, layout={layout!r}) reports "
        f"shards={at.shards}, layout={at.layout!r}"
    )
    return at


def _d_out(seed: int, q: np.ndarray, v: np.ndarray) -> np.ndarray:
    shape = (*q.shape[:-1], v.shape[-1])
    return np.random.default_rng(seed).standard_normal(shape).astype(q.dtype)


def _grad_reference(q, k, v, d_out, dtype: str, **options):
    """§12.9 for inputs without a fixture: the naive float64 backward, and per gradient
    the tolerance from the naive backward in ``dtype``."""
    from conformance.backends import numpy_dtype
    from conformance.fixtures.oracle import naive_vjp_same_precision

    ref = naive_vjp_same_precision(q, k, v, d_out, np.float64, **options)
    low = naive_vjp_same_precision(q, k, v, d_out, numpy_dtype(dtype), **options)
    tols = {
        n: tolerance(dtype, float(np.max(np.abs(low[n] - ref[n]), initial=0.0)), ref[n])
        for n in ref
    }
    return ref, tols


def _check_grads(grads, ref, tols, context: str, names=("dq", "dk", "dv", "dmask")) -> None:
    for name, got in zip(names, grads):
        assert np.all(np.isfinite(as64(got))), f"{context}: {name} is not finite"
        assert_within(as64(got), ref[name], tols[name], f"{context}: {name}")


@pytest.mark.clause("14.1")
def test_unknown_layout_raises(backend):
    with pytest.raises(ValueError, match="layout"):
        load_backend(backend.name, shards=2, layout="striped-nonsense")


@pytest.mark.clause("14.1")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [8], ids=["P8"])
@requires(*VARIANTS["all"][0])
@uses_dtype("float64")
def test_eight_shards(backend, P, layout):
    """P = 8, every declared variant at once, forward and (with "grad") backward: sinks,
    chunks and ALiBi (§14.9) too where declared, dsinks included."""
    at = _sharded(backend, P, layout)
    options = dict(VARIANTS["all"][1])
    q, k, v = random_qkv(80, **_shape(backend, H=8, K=2, T=13, S=11))
    mask = np.random.default_rng(81).random((1, 1, 13, 11)) > 0.2  # (1, 1, T, S)
    options.update(_positional_variants(backend, 83, B=2, H=8, chunk_size=4))
    out = at.attention(q, k, v, mask=mask, **options)
    ref = naive(q, k, v, mask=mask, **options)
    tol = random_tolerance(q, k, v, "float64", mask=mask, **options)
    assert_within(as64(out), ref, tol, f"{at.name} P={P} {layout} {options}")
    if "grad" in backend.capabilities:
        d_out = _d_out(82, q, v)
        ref_g, tols = _grad_reference(q, k, v, d_out, "float64", mask=mask, **options)
        grads = at.attention_vjp(q, k, v, d_out, mask=mask, **options)
        names = ("dq", "dk", "dv") + ("dsinks",) * ("sinks" in options)
        assert len(grads) == len(names), f"{at.name} P={P}: {len(grads)} gradients, not {names}"
        _check_grads(grads, ref_g, tols, f"{at.name} P={P} {layout} {list(options)}", names)


def _positional_variants(backend, seed: int, *, B: int, H: int, chunk_size: int) -> dict:
    """Of sinks (H,), ALiBi's slopes (B, H) and chunks, those the backend declares (§14.9):
    sinks and slopes comparable to the scores, so that they weigh."""
    rng = np.random.default_rng(seed)
    options = {}
    if "sinks" in backend.capabilities:
        options["sinks"] = rng.uniform(-1.0, 2.0, H)  # (H,)
    if "alibi" in backend.capabilities:
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, H)).astype(np.float32)  # (B, H)
    if "chunked" in backend.capabilities:
        options["chunk_size"] = chunk_size
    return options


def naive(q, k, v, **options):
    from conformance.fixtures.oracle import naive_same_precision

    return naive_same_precision(q, k, v, np.float64, **options)


@pytest.mark.clause("14.2")
@pytest.mark.parametrize(
    "variant",
    [pytest.param(name, marks=requires("gqa", *needs)) for name, (needs, _) in VARIANTS.items()],
)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("P", ALL_SHARDS, ids=[f"P{P}" for P in ALL_SHARDS])
def test_shard_count_invariance(backend, P, dtype, variant, request):
    """Within §7's tolerance of the oracle at every P (so of P = 1), and deterministic. The
    difference from P = 1 is published for the report."""
    options = VARIANTS[variant][1]
    at = _sharded(backend, P)
    one = _sharded(backend, 1)
    # H = 12 does not split evenly over P = 5, 7 or 8: a head-sharding backend splits it
    # unevenly there (§14.8).
    q, k, v = random_qkv(140, **_shape(backend), dtype=dtype)
    ref = naive(q, k, v, **options)
    tol = random_tolerance(q, k, v, dtype, **options)
    out = at.attention(q, k, v, **options)
    context = f"{at.name} P={P} {dtype} {variant}"
    assert_within(as64(out), ref, tol, context)
    at_one = as64(one.attention(q, k, v, **options))
    publish(
        request.node, backend=backend.name, case=f"P={P} {variant}", dtype=dtype,
        actual=as64(out), expected=at_one, tolerance=2 * tol, quantity=VS_ONE_SHARD,
    )  # fmt: skip
    assert_within(as64(out), at_one, 2 * tol, f"{context} vs P=1")
    assert_identical(at.attention(q, k, v, **options), out, f"{context}, repeated")


@pytest.mark.clause("14.9", "15.1", "17.1")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [2, 3, 4], ids=lambda P: f"P{P}")
@requires("sinks", "alibi", "gqa", "causal_bottom_right")
@uses_dtype("float64")
def test_sinks_and_alibi_at_every_shard_count(backend, P, layout):
    """Sinks and per-batch ALiBi slopes (and chunks of 16, where declared), causal
    bottom-right with T < S, on sequences long enough that every device holds real tokens
    in both layouts (zigzag's second chunks included): the oracle's output within §7's
    tolerance, and P = 1's within twice that. A sink merged on every device counts P
    times; a bias or a chunk from local slots is wrong off device 0."""
    shape = _shape(backend, H=6, K=2, T=37, S=67)
    q, k, v = random_qkv(158, **shape)
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    options.update(_positional_variants(backend, 159, B=shape["B"], H=shape["H"], chunk_size=16))
    ref = naive(q, k, v, **options)
    tol = random_tolerance(q, k, v, "float64", **options)
    out = _sharded(backend, P, layout).attention(q, k, v, **options)
    context = f"{backend.name} P={P} {layout}: sinks and ALiBi"
    assert_within(as64(out), ref, tol, context)
    at_one = _sharded(backend, 1).attention(q, k, v, **options)
    assert_within(as64(out), as64(at_one), 2 * tol, f"{context} vs P=1")


#: Packed documents across devices (§14.1, §18), T = 37 and S = 67 in N = 5: (T_n, S_n) = (11, 20), (3, 0),
#: (14, 30), (0, 12), (9, 5): a document without keys (rows of 0), one without queries, one
#: with T_n > S_n (bottom-right: its first 4 queries see nothing). At P = 2, 3 and 4 the
#: boundaries fall inside devices' slices (and zigzag's chunks), and documents run across
#: them.
PACKING = ([0, 11, 14, 28, 28, 37], [0, 20, 20, 50, 62, 67])


@pytest.mark.clause("14.1", "18.1", "18.5")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [2, 3, 4], ids=lambda P: f"P{P}")
@requires("packed", "gqa", "causal_bottom_right")
@uses_dtype("float64")
def test_packed_at_every_shard_count(backend, P, layout):
    """Packed documents (SPEC §18) split over the devices, causal bottom-right, GQA: each
    document's rows are attention on it alone, the oracle's output within §7's tolerance
    and P = 1's within twice that; the rows of the document without keys exactly 0; at
    P = 3 the gradients within §12.9's. A ring that lets a query see another document's
    keys where they share a device, or a step that loses a document's keys on another
    device, is wrong here."""
    from conformance.fixtures import oracle

    shape = _shape(backend, B=1, H=6, K=2, T=37, S=67)
    q, k, v = (x[0] for x in random_qkv(160, **shape))  # (H, T, D), (K, S, D), (K, S, E)
    cu_q, cu_k = (np.array(x, dtype=np.int32) for x in PACKING)
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    args = (q, k, v, cu_q, cu_k)
    # The naive float64 run, document by document, stands in for the oracle (§7.2); in
    # float64 the naive run's own error against it is 0, so §7's tolerance is its floor.
    ref = oracle.naive_packed_same_precision(*args, np.float64, **options)
    tol = tolerance("float64", 0.0, ref)
    at = _sharded(backend, P, layout)
    out = at.attention_packed(*args, **options)
    context = f"{backend.name} P={P} {layout}: packed documents"
    assert_within(as64(out), ref, tol, context)
    assert np.all(out[:, cu_q[1] : cu_q[2]] == 0), f"{context}: the rows without keys are not 0"
    at_one = _sharded(backend, 1).attention_packed(*args, **options)
    assert_within(as64(out), as64(at_one), 2 * tol, f"{context} vs P=1")
    if P != 3 or "grad" not in backend.capabilities:
        return
    d_out = _d_out(161, q, v)  # (H, T, E)
    grads = at.attention_packed_vjp(*args, d_out, **options)
    ref_g = oracle.naive_packed_vjp_same_precision(*args, d_out, np.float64, **options)
    tols = {n: tolerance("float64", 0.0, g) for n, g in ref_g.items()}
    _check_grads(grads, ref_g, tols, f"{context}, gradients", names=("dq", "dk", "dv"))


@pytest.mark.clause("14.3")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T,S", [(1, 1), (3, 2), (9, 3), (5, 17)], ids=lambda x: str(x))
@pytest.mark.parametrize("P", [2, 3, 4], ids=lambda P: f"P{P}")
@requires("gqa")
@uses_dtype("float64")
def test_lengths_not_multiples(backend, P, T, S, layout):
    """T, S not multiples of P, S < P, T < P, T != S: padding is never attended."""
    at = _sharded(backend, P, layout)
    q, k, v = random_qkv(143, **_shape(backend, T=T, S=S))
    # Keys far from the origin: a padded (zero) key or value attended would show.
    v = v + 5.0
    for options in ({}, {"is_causal": True, "causal_alignment": "bottom_right"}):
        if options and "causal_bottom_right" not in backend.capabilities:
            continue
        out = at.attention(q, k, v, **options)
        ref = naive(q, k, v, **options)
        tol = random_tolerance(q, k, v, "float64", **options)
        assert out.shape == ref.shape, f"{at.name} P={P}: shape {out.shape}, expected {ref.shape}"
        assert_within(as64(out), ref, tol, f"{at.name} P={P} {layout} T={T} S={S} {options}")


@pytest.mark.clause("14.4")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [2, 3, 4], ids=lambda P: f"P{P}")
@requires("gqa")
@uses_dtype("float64")
def test_keys_elsewhere_and_nowhere(backend, P, layout):
    """Row 0 attends only the last keys (another device's); row 1 attends none."""
    at = _sharded(backend, P, layout)
    T = S = 24  # whole slices and zigzag chunks for P = 2, 3, 4
    q, k, v = random_qkv(144, **_shape(backend, T=T, S=S))
    mask = np.ones((T, S), dtype=bool)  # (T, S)
    mask[0] = False
    # Query 0 sits on device 0 in both layouts; keys S/P and S/P + 1 never do (contiguous:
    # device 1; zigzag: chunk 2 of 2P, on device 2, or 1 when P = 2).
    mask[0, S // P : S // P + 2] = True
    mask[1] = False  # query 1: no key anywhere
    out = at.attention(q, k, v, mask=mask)
    context = f"{at.name} P={P} {layout}"
    assert_within(
        as64(out),
        naive(q, k, v, mask=mask),
        random_tolerance(q, k, v, "float64", mask=mask),
        context,
    )
    assert np.all(out[:, :, 1] == 0), (
        f"{context}: the row with no key is {out[:, :, 1]}, not exactly 0"
    )
    if "grad" not in backend.capabilities:
        return
    d_out = _d_out(145, q, v)
    grads = at.attention_vjp(q, k, v, d_out, mask=mask)
    ref, tols = _grad_reference(q, k, v, d_out, "float64", mask=mask)
    _check_grads(grads, ref, tols, context)
    assert np.all(grads[0][:, :, 1] == 0), f"{context}: dq of the row with no key is not exactly 0"
    d_out2 = d_out.copy()
    d_out2[:, :, 1] += 3.0
    again = at.attention_vjp(q, k, v, d_out2, mask=mask)
    for name, a, b in zip(("dq", "dk", "dv"), grads, again):
        assert_identical(b, a, f"{context}: {name} after changing d_out on the row with no key")


@pytest.mark.clause("14.5")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [2, 3, 4], ids=lambda P: f"P{P}")
@requires("gqa")
@uses_dtype("float32")
def test_large_logits_across_shards(backend, P, layout):
    """Scores ≈ 1e4 in float32: each row's max on the last device, its mass on the others."""
    at = _sharded(backend, P, layout)
    T = S = 24
    q, k, v = random_qkv(146, **_shape(backend, T=T, S=S), dtype="float32")
    rng = np.random.default_rng(147)
    q = np.zeros_like(q)
    q[..., 0] = 100.0  # score = 100 · k[..., 0] / √D
    k = np.zeros_like(k)
    # Every key scores about 1e4 (small spread); the last scores 1 more: each row's max
    # sits alone at the end of the sequence, most of its mass on the other devices.
    k[..., 0] = (1e4 * np.sqrt(SHAPE["D"]) / 100.0) + rng.standard_normal(k.shape[:-1]) * 0.02
    k[..., -1, 0] += 1.0 * np.sqrt(SHAPE["D"]) / 100.0
    q, k = q.astype(np.float32), k.astype(np.float32)
    out = at.attention(q, k, v)
    context = f"{at.name} P={P} {layout} large logits"
    assert np.all(np.isfinite(as64(out))), f"{context}: non-finite output"
    assert_within(as64(out), naive(q, k, v), random_tolerance(q, k, v, "float32"), context)


@pytest.mark.clause("14.6")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("P", [2, 3, 4], ids=lambda P: f"P{P}")
@requires("grad", "gqa")
@uses_dtype("float64")
def test_backward_uses_each_block(backend, P, is_causal):
    """Every device's keys and values distinct: a stale block cannot pass."""
    at = _sharded(backend, P)
    T = S = 24
    q, k, v = random_qkv(148, **_shape(backend, T=T, S=S))
    offset = (np.arange(S) // (S // P))[None, None, :, None]  # (1, 1, S, 1): the slice index
    k = k + 0.5 * offset
    v = v + 2.0 * offset
    d_out = _d_out(149, q, v)
    options = {"is_causal": is_causal}
    grads = at.attention_vjp(q, k, v, d_out, **options)
    ref, tols = _grad_reference(q, k, v, d_out, "float64", **options)
    _check_grads(grads, ref, tols, f"{at.name} P={P} {options}")


@pytest.mark.clause("14.7")
@pytest.mark.parametrize("variant", ["plain", "causal"])
@pytest.mark.parametrize("P", [2, 3, 4], ids=lambda P: f"P{P}")
@requires("gqa")
@uses_dtype("float64")
def test_zigzag_equals_contiguous(backend, P, variant):
    """The zigzag layout gives the contiguous layout's output within twice §7's tolerance."""
    options = VARIANTS[variant][1]
    q, k, v = random_qkv(150, **_shape(backend))
    contiguous = _sharded(backend, P, "contiguous").attention(q, k, v, **options)
    zigzag = _sharded(backend, P, "zigzag").attention(q, k, v, **options)
    tol = random_tolerance(q, k, v, "float64", **options)
    assert_within(
        as64(zigzag),
        as64(contiguous),
        2 * tol,
        f"{backend.name} P={P} {variant}: zigzag vs contiguous",
    )


@pytest.mark.clause("14.8")
@pytest.mark.parametrize(
    "H,K,P",
    [(7, 7, 4), (7, 1, 4), (3, 3, 2), (1, 1, 3), (4, 2, 3), (6, 3, 4), (20, 4, 8), (20, 10, 8)],
    ids=lambda x: str(x),
)
@pytest.mark.parametrize("layout", LAYOUTS)
@requires("sharded_heads", "gqa")
@uses_dtype("float64")
def test_uneven_heads(backend, H, K, P, layout):
    """Head counts P does not split (7 on 4 and 20 on 8, as DeepSpeed PR #6392 tests; fewer
    heads than devices) and K that does not divide P (K = 2 on 3, 3 on 4, 10 on 8): the
    §1.2 result, and with "grad" §12.9's gradients, a float mask per head included."""
    at = _sharded(backend, P, layout)
    q, k, v = random_qkv(155, B=2, H=H, K=K, T=7, S=9, D=4, E=4)
    mask = np.random.default_rng(156).standard_normal((2, H, 7, 9))  # (B, H, T, S)
    mask[:, :, 2] = -np.inf  # a row with no key, on every head
    options = {"mask": mask, "is_causal": True}
    context = f"{at.name} P={P} {layout} H={H} K={K}"
    out = at.attention(q, k, v, **options)
    assert out.shape == q.shape[:3] + (v.shape[-1],), f"{context}: shape {out.shape}"
    assert_within(
        as64(out),
        naive(q, k, v, **options),
        random_tolerance(q, k, v, "float64", **options),
        context,
    )
    if "grad" in backend.capabilities:
        d_out = _d_out(157, q, v)
        ref, tols = _grad_reference(q, k, v, d_out, "float64", **options)
        grads = at.attention_vjp(q, k, v, d_out, **options)
        wanted = 4 if "grad_mask" in backend.capabilities else 3
        assert len(grads) == wanted, f"{context}: {len(grads)} gradients, expected {wanted}"
        _check_grads(grads, ref, tols, context)


@pytest.mark.clause("14.8")
@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("P", [4], ids=["P4"])
@requires("sharded_heads", "gqa")
@uses_dtype("float64")
def test_heads_batch_and_few_kv_heads(backend, P, K):
    """B = 3 distinct batch elements, H = 8 on P = 4 devices, K from 1 (< P) to 8."""
    at = load_backend(backend.name, shards=P)
    q, k, v = random_qkv(152, B=3, H=8, K=K, T=7, S=13)
    mask = np.random.default_rng(153).random((3, 1, 7, 13)) > 0.3  # (B, 1, T, S)
    options = {"mask": mask, "is_causal": True, "causal_alignment": "bottom_right"}
    out = at.attention(q, k, v, **options)
    context = f"{at.name} P={P} B=3 H=8 K={K}"
    assert_within(
        as64(out),
        naive(q, k, v, **options),
        random_tolerance(q, k, v, "float64", **options),
        context,
    )
    if "grad" in backend.capabilities:
        d_out = _d_out(154, q, v)
        ref, tols = _grad_reference(q, k, v, d_out, "float64", **options)
        _check_grads(at.attention_vjp(q, k, v, d_out, **options), ref, tols, context)
