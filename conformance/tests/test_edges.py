"""SPEC §2.5, §3.8, §4.7-§4.9 and §12.12: behaviour at the edges.

Empty sequences, key/value slots that no query may attend (whatever they hold), NaN in
the inputs, and NaN or +inf in a float mask. The oracle's fixtures for these cases run in
``test_fixtures.py`` / ``test_gradients.py``; the tests here check the properties that
make the edges safe to rely on, on random inputs: an unused slot changes no output bit,
a NaN reaches exactly the rows that read it and never turns into a finite number.

Which keys a row attends comes from ``fixtures/oracle.py:allowed_keys`` (and the float
mask's -inf entries), never from the backend under test.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import numpy_dtype
from conformance.suite import edges
from conformance.suite.gradients import random_d_out
from conformance.suite.helpers import (
    as64,
    causal_param,
    causal_where_taken,
    oracle_attention,
    pool_qkv,
    random_qkv,
    random_tolerance,
)
from conformance.suite.oracle_store import oracle
from conformance.suite.requirements import requires, uses_dtype, value_dims
from conformance.suite.tolerance import (
    assert_identical,
    assert_rows_zero,
    assert_within,
    dtype_note,
    expect,
    expect_seen,
    finite_error,
    tolerance,
)

DTYPES = ["float64", "float32", "float16", "bfloat16"]
dtypes = pytest.mark.parametrize("dtype", DTYPES)
GRADS = ("dq", "dk", "dv", "dmask")


# --- §2.5 and §12.12: empty sequences -----------------------------------------------------

#: T = 0 against 5 keys and 5 queries against S = 0: the stored fixtures' empty-T0 and
#: empty-S0 lengths at their B = H = 2, D = 4, E = 3, so that a framework that compiles
#: per shape meets these calls once (SPEC §13.21).
EMPTY_LENGTHS = [(0, 5), (5, 0), (0, 0)]
EMPTY = [
    "plain",
    pytest.param("causal", marks=requires("causal", "causal_top_left"), id="causal"),
    "bool-mask",
    "float-mask",
]
#: The ways an empty sequence meets an option a backend may lack: the option's capability
#: forward, and what its gradient needs besides "grad" (§12.2).
EMPTY_NEEDS = {"softcap": ("softcap", "grad_softcap")}
# A softcap with no score to squash still gives §2.5's result: measured, torch-sdpa's
# flex_attention path raised IndexError for S = 0 (torch 2.13, CPU).
EMPTY_FORWARD = EMPTY + [
    pytest.param(how, marks=requires(forward), id=how) for how, (forward, _) in EMPTY_NEEDS.items()
]
EMPTY_BACKWARD = [
    pytest.param(h, marks=requires("grad_mask")) if h == "float-mask" else h for h in EMPTY
] + [pytest.param(how, marks=requires(grad), id=how) for how, (_, grad) in EMPTY_NEEDS.items()]


@pytest.mark.clause("2.5")
@pytest.mark.parametrize("how", EMPTY_FORWARD)
@pytest.mark.parametrize("T,S", EMPTY_LENGTHS, ids=["T0", "S0", "T0-S0"])
@dtypes
def test_empty_sequences(backend, how, T, S, dtype):
    """T = 0 gives an empty (B, H, 0, E) output; S = 0 leaves every query without a key,
    so every output entry is exactly 0 (§4.3), whatever q holds."""
    D, E = value_dims(backend, 4, 3)
    q, k, v = random_qkv(70, B=2, H=2, T=T, S=S, D=D, E=E, dtype=dtype)
    q[..., :1, :] = np.nan  # a row with no key returns 0 even from a NaN query
    out = backend.attention(q, k, v, **edges.empty_options(how, T, S, dtype))
    # The zeros are judged in whatever dtype they come: the dtype is §2.4's, judged once.
    expect(
        out.shape == (2, 2, T, E),
        "returns the wrong shape for an empty sequence",
        f"{backend.name}: T={T}, S={S} ({how}) gave {out.shape}, expected (2, 2, {T}, {E})",
    )
    assert_rows_zero(out, True, f"{backend.name}: T={T}, S={S} ({how}){dtype_note(out, q.dtype)}")


@pytest.mark.clause("2.5")
@requires("unbatched")
def test_empty_sequences_unbatched(backend, dtype):
    """Unbatched, S = 0 gives (H, T, E) of zeros and T = S = 0 an empty (H, 0, E)."""
    D, E = value_dims(backend, 3, 2)
    q, k, v = random_qkv(71, B=1, H=2, T=4, S=0, D=D, E=E, dtype=dtype)
    out = backend.attention(q[0], k[0], v[0], **causal_where_taken(backend, 4, 0))
    expect(
        out.shape == (2, 4, E),
        "returns the wrong shape for an empty sequence",
        f"{backend.name}: unbatched S=0 gave {out.shape}",
    )
    assert_rows_zero(out, True, f"{backend.name}: unbatched S=0")
    out = backend.attention(q[0, :, :0], k[0, :, :0], v[0, :, :0])
    expect(
        out.shape == (2, 0, E),
        "returns the wrong shape for an empty sequence",
        f"{backend.name}: T=0, S=0 unbatched gave {out.shape}",
    )


@pytest.mark.clause("12.12")
@pytest.mark.parametrize("how", EMPTY_BACKWARD)
@pytest.mark.parametrize("T,S", EMPTY_LENGTHS, ids=["T0", "S0", "T0-S0"])
@dtypes
@requires("grad")
def test_empty_sequence_gradients(backend, how, T, S, dtype):
    """With nothing to attend or nobody attending, every gradient is exactly 0, shaped and
    typed like its input (dmask like the mask)."""
    D, E = value_dims(backend, 4, 3)
    q, k, v = random_qkv(72, B=2, H=2, T=T, S=S, D=D, E=E, dtype=dtype)
    options = edges.empty_options(how, T, S, dtype)
    d_out = np.ones((2, 2, T, E), dtype=q.dtype)
    grads = dict(zip(GRADS, backend.attention_vjp(q, k, v, d_out, **options)))
    likes = {"dq": q, "dk": k, "dv": v, "dmask": options.get("mask")}
    want = ["dq", "dk", "dv"] + (["dmask"] if how == "float-mask" else [])
    expect(
        list(grads) == want,
        "returns another set of gradients than the spec (dmask for a float mask)",
        f"{backend.name}: got gradients {list(grads)}, expected {want}",
    )
    for name, g in grads.items():
        like = likes[name]
        expect(
            g.shape == like.shape and g.dtype == like.dtype,
            "returns gradients of the wrong shape or dtype for an empty sequence",
            f"{backend.name}: {name} is {g.dtype} {g.shape}, expected {like.dtype} {like.shape}",
        )
        expect(
            (as64(g) == 0).all(),
            "a gradient with nothing attended (T = 0 or S = 0) is not exactly 0",
            f"{backend.name}: {name} should be exactly 0 (T={T}, S={S})",
        )


# --- §4.7 and §12.12: slots no query attends are inert ------------------------------------

#: Ways a slot ends up attended by no query row of its batch element and key/value head.
INERT = {
    "padding": ([], "a batch of unequal lengths, padding masked by a (B, 1, 1, S) bool mask"),
    "bool-column": ([], "mask columns all False"),
    "float-column": ([], "float mask columns all -inf"),
    "causal-T<S": (
        ["causal", "causal_top_left"],
        "top-left causal with T < S: keys after every query",
    ),
    "window": (["window", "causal_bottom_right"], "keys before a bottom-right window"),
    "gqa-group": (["gqa"], "a key blocked in every query head of its group, not others"),
}


INERT_PARAMS = [pytest.param(how, marks=requires(*needs)) for how, (needs, _) in INERT.items()]


def clean_call(backend, q, k, v, options: dict, dtype: str, context: str) -> np.ndarray:
    """The call with ordinary numbers in every slot, checked against the oracle before a
    test plants garbage: a function that attends keys it should not (causality ignored,
    the wrong alignment, a window off by one, GQA heads tiled) fails here, where the
    finding names that misreading, not at the garbage."""
    out = backend.attention(q, k, v, **options)
    mask = options.get("mask")
    if mask is not None and mask.dtype != np.bool_:
        mask = as64(mask)
    rest = {n: x for n, x in options.items() if n != "mask"}
    expected = oracle_attention(as64(q), as64(k), as64(v), mask=mask, **rest)
    assert_within(
        out,
        expected,
        random_tolerance(q, k, v, dtype, **options),
        f"{context}: the call with ordinary numbers in every slot, against the oracle",
        behaviour="departs from the oracle on ordinary inputs, before any garbage is planted",
    )
    return out


@pytest.mark.clause("4.7")
@pytest.mark.parametrize("garbage", ["nan", "inf", "max", "mixed"])
@pytest.mark.parametrize("how", INERT_PARAMS)
@dtypes
def test_unused_slots_hold_anything(backend, how, garbage, dtype, request):
    """An unused slot may hold NaN, ±inf or the largest finite number: the output is bit for
    bit what it is with ordinary numbers there."""
    q, k, v, options, unused = edges.inert_problem(backend, how, dtype, node=request.node)
    clean = clean_call(backend, q, k, v, options, dtype, f"{backend.name}: {INERT[how][1]}")
    k2, v2 = edges.with_garbage(k, v, unused, garbage, dtype)
    dirty = backend.attention(q, k2, v2, **options)
    assert_identical(
        dirty,
        clean,
        f"{backend.name}: {INERT[how][1]}, unused slots holding {garbage} ({dtype}), "
        f"against the same call with ordinary numbers there",
        behaviour="garbage (NaN, ±inf, the largest number) in key slots no query attends reaches the output",
    )


@pytest.mark.clause("4.7")
@pytest.mark.parametrize("how", INERT_PARAMS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_unused_slots_are_deleted_keys(backend, how, dtype, request):
    """The output with garbage in the unused slots equals, within the tolerance, the output
    for each batch element and key/value head with those keys removed (the causal band or
    window then given as the equivalent bool mask, since removing keys moves the diagonal)."""
    q, k, v, options, unused = edges.inert_problem(backend, how, dtype, node=request.node)
    clean_call(backend, q, k, v, options, dtype, f"{backend.name}: {INERT[how][1]}")
    k2, v2 = edges.with_garbage(k, v, unused, "mixed", dtype)
    out = as64(backend.attention(q, k2, v2, **options))
    attended = edges.attended(q, k, options.get("mask"), options)
    K = k.shape[1]
    G = q.shape[1] // K
    for b in range(q.shape[0]):
        for kv in range(K):
            keys = np.flatnonzero(~unused[b, kv])
            heads = slice(kv * G, (kv + 1) * G)
            qs = q[b : b + 1, heads]
            ks, vs = k[b : b + 1, kv : kv + 1, keys], v[b : b + 1, kv : kv + 1, keys]
            mask = attended[b : b + 1, heads][..., keys]  # (1, G, T, S')
            if "mask" in options and options["mask"].dtype != np.bool_:
                full = np.broadcast_to(options["mask"], attended.shape)
                mask = full[b : b + 1, heads][..., keys]  # the float values, -inf and all
            removed = as64(backend.attention(qs, ks, vs, mask=mask))
            tol = 2 * random_tolerance(qs, ks, vs, dtype, mask=mask)
            assert_within(
                out[b, heads],
                removed[0],
                tol,
                f"{backend.name}: {INERT[how][1]} ({dtype}), batch {b}, key/value head "
                f"{kv}: against the same call with keys {np.flatnonzero(unused[b, kv])} removed",
                behaviour="key slots no query attends do not act as deleted keys",
            )


@pytest.mark.clause("12.12")
@pytest.mark.parametrize("garbage", ["nan", "inf", "max", "mixed"])
@pytest.mark.parametrize(
    "how",
    [
        pytest.param(how, marks=requires(*needs, *(["grad_mask"] if how == "float-column" else [])))
        for how, (needs, _) in INERT.items()
    ],
)
@dtypes
@requires("grad")
def test_unused_slot_gradients(backend, how, garbage, dtype, request):
    """Garbage in unused slots changes no gradient bit; the slots' own dk and dv are exactly
    0, and so is dmask wherever the float mask is -inf."""
    q, k, v, options, unused = edges.inert_problem(
        backend, how, dtype, seed=81, method="attention_vjp", node=request.node
    )
    float_mask = "mask" in options and options["mask"].dtype != np.bool_
    d_out = np.random.default_rng(82).standard_normal((*q.shape[:-1], v.shape[-1]))
    d_out = d_out.astype(q.dtype)
    clean = dict(zip(GRADS, backend.attention_vjp(q, k, v, d_out, **options)))
    for name, g in clean.items():
        expect(
            np.isfinite(as64(g)).all(),
            "returns a non-finite gradient on ordinary inputs",
            f"{backend.name}: non-finite {name} on clean inputs",
        )
    k2, v2 = edges.with_garbage(k, v, unused, garbage, dtype)
    dirty = dict(zip(GRADS, backend.attention_vjp(q, k2, v2, d_out, **options)))
    context = f"{backend.name}: {INERT[how][1]}, unused slots holding {garbage} ({dtype})"
    expect(
        list(dirty) == list(clean),
        "returns another set of gradients when unused slots hold garbage",
        f"{context}: gradients {list(dirty)} vs {list(clean)}",
    )
    for name in clean:
        assert_identical(
            dirty[name],
            clean[name],
            f"{context}: {name}",
            behaviour="garbage in key slots no query attends reaches the gradients",
        )
    for name in ("dk", "dv"):
        at_slots = as64(dirty[name])[unused]
        expect(
            (at_slots == 0).all(),
            "a key slot no query attends gets a gradient that is not 0",
            f"{context}: {name} of unused slots should be exactly 0",
        )
    if float_mask:
        blocked = np.broadcast_to(as64(options["mask"]) == -np.inf, dirty["dmask"].shape)
        expect(
            (as64(dirty["dmask"])[blocked] == 0).all(),
            "dmask is not 0 where the float mask is -inf",
            f"{context}: dmask should be exactly 0 on -inf entries",
        )


# --- §4.8: keys that some rows attend -----------------------------------------------------

SHARED = {
    "causal": (["causal", "causal_top_left"], "causal"),
    "bool-mask": ([], "a bool mask"),
    "float-mask": ([], "a float mask (-inf)"),
    "window": (["window", "causal_top_left", "window_right"], "a window"),
}


@pytest.mark.clause("4.8")
@pytest.mark.parametrize("garbage", ["nan", "inf", "max"])
@pytest.mark.parametrize("slot", ["k", "v"])
@pytest.mark.parametrize(
    "how", [pytest.param(how, marks=requires(*needs)) for how, (needs, _) in SHARED.items()]
)
@dtypes
def test_keys_some_rows_attend(backend, how, slot, garbage, dtype):
    """Key 3 is attended by some rows of its head and blocked for others. With a non-finite
    (or the largest finite) value in its k or v row, every output entry of a row that blocks
    it is either bit for bit what it is with ordinary numbers there, or NaN: never another
    finite number, never an infinity. At §3.8's B, H, T = S = 6 below, so that a framework
    that compiles per shape meets one problem for both (SPEC §13.21)."""
    B, H, T, S = 2, 2, 6, 6
    D, E = value_dims(backend, 4, 3)
    q, k, v = random_qkv(90, B=B, H=H, T=T, S=S, D=D, E=E, dtype=dtype)
    options = edges.shared_key_options(how, T, S, q.dtype)
    attended = edges.attended(q, k, options.get("mask"), options)
    blocking = ~attended[1, 0, :, 3]  # rows of batch 1, head 0 that block key 3
    assert blocking.any() and not blocking.all()
    clean = as64(clean_call(backend, q, k, v, options, dtype, f"{backend.name}: {SHARED[how][1]}"))
    x = {"k": k, "v": v}[slot].copy()
    x[1, 0, 3] = edges.garbage_values(garbage, x.shape[-1], dtype).astype(x.dtype)
    dirty_inputs = {"k": k, "v": v, slot: x}
    dirty = as64(backend.attention(q, dirty_inputs["k"], dirty_inputs["v"], **options))
    rows_dirty, rows_clean = dirty[1, 0][blocking], clean[1, 0][blocking]
    same = (rows_dirty == rows_clean) | np.isnan(rows_dirty)
    expect(
        same.all(),
        "a non-finite key or value reaches a row that blocks it as a number other than NaN",
        f"{backend.name}: {slot}[1, 0, 3] holding {garbage} ({dtype}, {SHARED[how][1]}); "
        f"rows {np.flatnonzero(blocking).tolist()} block key 3, so each entry must be "
        f"unchanged or NaN; got {rows_dirty[~same][:4]} where the clean run has "
        f"{rows_clean[~same][:4]}",
    )
    others = np.ones((B, H), dtype=bool)
    others[1, 0] = False
    assert_identical(
        dirty[others],
        clean[others],
        f"{backend.name}: the heads that do not read the key",
        behaviour="a non-finite key or value changes heads that do not read it",
    )


# --- §4.9: NaN propagates and never disappears --------------------------------------------

NAN_AT = ["q", "k-first", "k-middle", "k-all", "v"]
STRUCTURES = {
    "plain": ([], {}),
    "causal": (["causal"], {"is_causal": True}),
    "float-mask": ([], {"mask": "float"}),
    "gqa-causal": (["gqa", "causal"], {"is_causal": True}),
    "softcap-causal": (["softcap", "causal"], {"is_causal": True, "softcap": 2.0}),
}


@pytest.mark.clause("4.9")
@pytest.mark.parametrize("at", NAN_AT)
@pytest.mark.parametrize(
    "structure",
    [pytest.param(name, marks=requires(*needs)) for name, (needs, _) in STRUCTURES.items()],
)
@dtypes
def test_nan_propagates(backend, structure, at, dtype):
    """A NaN reaches exactly the outputs that read it (SPEC §4.9, the oracle's rows), and
    never becomes a finite number: NaN in q row t makes row t NaN; NaN in k at a key row t
    attends makes row t NaN; NaN in v[s, e] makes channel e NaN in the rows attending s.
    Other batch elements and heads are finite and equal to the NaN-free run; rows of the
    same head that block the key follow §4.8."""
    opts = STRUCTURES[structure][1]
    B, H, K, T, S = 2, 4, 4, 6, 6
    if structure == "gqa-causal":
        K = 2
    # E = D: PyTorch SDPA then takes its CPU flash kernel, which reads NaN rows as empty.
    q, k, v = random_qkv(100, B=B, H=H, K=K, T=T, S=S, D=4, E=4, dtype=dtype)
    options = dict(opts)
    if options.get("mask") == "float":
        mask = np.random.default_rng(101).standard_normal((B, 1, T, S))
        mask[np.random.default_rng(102).random(mask.shape) < 0.25] = -np.inf
        mask[..., 0] = 0.0  # key 0 stays attended by every row
        options["mask"] = mask.astype(q.dtype)
    clean = as64(backend.attention(q, k, v, **options))
    q2, k2, v2, reading = edges.with_nan(q, k, v, at)
    out = as64(backend.attention(q2, k2, v2, **options))
    mask = options.get("mask")
    rest = {n: x for n, x in options.items() if n != "mask"}
    expected = oracle_attention(
        as64(q2), as64(k2), as64(v2), mask=None if mask is None else as64(mask), **rest
    )
    context = f"{backend.name}: NaN in {at} ({structure}, {dtype})"
    must_nan = np.isnan(expected)
    expect(
        must_nan.any(),
        "the suite's NaN test reads no NaN (a bug in the suite)",
        f"{context}: the oracle reads no NaN: a broken test",
    )
    lost = must_nan & ~np.isnan(out)
    tol = 2 * random_tolerance(q, k, v, dtype, mask=mask, **rest)
    expect_seen(
        not lost.any(),
        "a NaN in the inputs becomes a number in the output",
        f"{context}: NaN disappeared at {np.argwhere(lost)[:3].tolist()} (got "
        f"{out[lost][:3]}): the oracle's output is NaN there",
        out,
        tol,
    )
    assert_within(
        out[~reading],
        clean[~reading],
        tol,
        f"{context}: batch elements and heads that do not read the NaN, against the NaN-free run",
        behaviour="a NaN in the inputs changes batch elements or heads that do not read it",
    )
    # In the heads that read it: a row the NaN reaches is NaN exactly where the oracle says
    # (checked above) and the NaN-free run's elsewhere, e.g. the other channels of a NaN in
    # v. A row it does not reach is the NaN-free run's; where the NaN sits in a key that the
    # row blocks, it may also be NaN (§4.8).
    inside, inside_clean, want = out[reading], clean[reading], expected[reading]
    reached = np.isnan(want).any(axis=-1, keepdims=True)  # (rows, 1)
    finite = ~np.isnan(want)
    close = np.abs(np.where(finite, inside - inside_clean, 0.0)) <= tol
    ok = close | (np.isnan(inside) & ~reached & (at != "q"))
    expect(
        ok[finite].all(),
        "a NaN in the inputs changes entries it does not reach",
        f"{context}: entries the NaN does not reach changed: got "
        f"{inside[finite & ~ok][:4]}, NaN-free run {inside_clean[finite & ~ok][:4]}",
    )


# --- §3.8: NaN and +inf in a float mask ---------------------------------------------------


@pytest.mark.clause("3.8")
@pytest.mark.parametrize("causal", [pytest.param(False, id="plain"), causal_param()])
@dtypes
def test_float_mask_nan_and_inf(backend, causal, dtype):
    """NaN or +inf in a float mask, at a key the row may attend, makes that row NaN in every
    channel (IEEE arithmetic, no exception); other rows are untouched. At a key causality
    blocks, the same entries change no output bit."""
    B, H, T, S = 2, 2, 6, 6
    D, E = value_dims(backend, 4, 3)
    q, k, v = random_qkv(110, B=B, H=H, T=T, S=S, D=D, E=E, dtype=dtype)
    base = np.random.default_rng(111).standard_normal((T, S))
    base[2, 4] = -np.inf
    base = base.astype(q.dtype)
    options = {"is_causal": causal}
    clean = as64(backend.attention(q, k, v, mask=base, **options))
    mask = base.copy()
    mask[1, 0] = np.nan  # key 0: every row may attend it
    mask[4, 1] = np.inf
    mask[2, 5] = np.nan  # key 5 of row 2: attended without causality, blocked with it
    mask[3, 5] = np.inf
    out = as64(backend.attention(q, k, v, mask=mask, **options))
    nan_rows = [1, 4] if causal else [1, 2, 3, 4]
    context = (
        f"{backend.name}: NaN/+inf in a float mask ({'causal' if causal else 'plain'}, {dtype})"
    )
    expect(
        np.isnan(out[:, :, nan_rows]).all(),
        "NaN or +inf in a float mask does not make its row NaN",
        f"{context}: rows {nan_rows} must be NaN in every channel, got "
        f"{out[:, :, nan_rows][~np.isnan(out[:, :, nan_rows])][:4]}",
    )
    others = [t for t in range(T) if t not in nan_rows]
    if causal:
        assert_identical(
            out[:, :, others],
            clean[:, :, others],
            f"{context}: rows the entries do not reach",
            behaviour="NaN or +inf in a float mask changes rows it does not reach",
        )
    else:
        tol = 2 * random_tolerance(q, k, v, dtype, mask=base)
        assert_within(
            out[:, :, others],
            clean[:, :, others],
            tol,
            f"{context}: rows the entries do not reach",
            behaviour="NaN or +inf in a float mask changes rows it does not reach",
        )


# --- §4.2 and §12.2: a softcap so large that score / softcap is subnormal -------------------


def _huge_softcap(dtype: str) -> float:
    """A softcap near the largest number of the working precision (float64 for float64
    inputs, float32 for the others, SPEC §4.5): an ordinary score over it is subnormal."""
    return 1e308 if dtype == "float64" else 3e38


@pytest.mark.clause("4.2")
@dtypes
@requires("softcap")
def test_huge_softcap_is_no_softcap(backend, dtype):
    """softcap · tanh(score / softcap) is the score itself for a softcap of 1e308 (3e38 in
    float32): the output is the oracle's, within §7, not the uniform weights that a ratio
    flushed to 0 (XLA on a CPU) would give."""
    cap = _huge_softcap(dtype)
    q, k, v = random_qkv(140, B=1, H=2, T=5, S=7, D=4, E=value_dims(backend, 4, 3)[1], dtype=dtype)
    out = backend.attention(q, k, v, softcap=cap)
    assert_within(
        out,
        oracle_attention(as64(q), as64(k), as64(v), softcap=cap),
        random_tolerance(q, k, v, dtype, softcap=cap),
        f"{backend.name}: softcap={cap:g} ({dtype}) against the oracle",
        behaviour="a softcap so large that score / softcap is subnormal changes the output",
    )


@pytest.mark.clause("4.2", "12.2")
@dtypes
@requires("grad_softcap")
def test_huge_softcap_gradients(backend, dtype):
    """dq, dk, dv with a softcap of 1e308 (3e38 in float32) against the 50-digit oracle,
    within §12.9: the softcap's derivative 1 − tanh²(score / softcap) is 1 there."""
    cap = _huge_softcap(dtype)
    q, k, v = random_qkv(141, B=1, H=2, T=5, S=7, D=4, E=value_dims(backend, 4, 3)[1], dtype=dtype)
    d_out = random_d_out(142, q, v)
    got = dict(zip(GRADS, backend.attention_vjp(q, k, v, d_out, softcap=cap)))
    args = (as64(q), as64(k), as64(v), as64(d_out))
    expected = oracle.attention_vjp(*args, softcap=cap)
    naive = oracle.naive_vjp_same_precision(*args, numpy_dtype(dtype), softcap=cap)
    for name, want in expected.items():
        assert_within(
            got[name],
            want,
            tolerance(dtype, finite_error(naive[name], want), want),
            f"{backend.name}: {name} with softcap={cap:g} ({dtype}) against the oracle",
            behaviour="a softcap so large that score / softcap is subnormal changes the gradients",
        )


# --- §4.1: scores large but finite -----------------------------------------------------------

#: A scale that makes ordinary scores huge but finite: |q·k| · scale < 1e302 (float64),
#: < 1e32 (float32), far below the largest numbers.
_HUGE_SCALE = {"float64": 1e300, "float32": 1e30}


@pytest.mark.clause("4.1")
@pytest.mark.parametrize("D", [1, 4], ids=["D1", "D4"])
@pytest.mark.parametrize("causal", [pytest.param(False, id="plain"), causal_param()])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@requires("scale")
def test_large_finite_scores(backend, causal, D, dtype):
    """A scale of 1e300 (1e30 in float32) makes the scores huge but finite: the softmax
    puts all the weight on each row's largest score, and the output is the oracle's
    (that key's value row), within §7. Measured: with D = 1, jax-flash's weights were
    0 (output 0) or the row NaN, as exp() saw the product's rounding error instead of 0.
    At the size pool's D1 and H1-E3 (SPEC §13.21), whose programs the other tests compile."""
    scale = _HUGE_SCALE[dtype]
    q, k, v = pool_qkv(150, {1: "D1", 4: "H1-E3"}[D], backend, dtype)
    options = {"scale": scale, "is_causal": causal}
    out = backend.attention(q, k, v, **options)
    assert_within(
        out,
        oracle_attention(as64(q), as64(k), as64(v), **options),
        random_tolerance(q, k, v, dtype, **options),
        f"{backend.name}: scale={scale:g}, D={D} ({dtype}, {'causal' if causal else 'plain'}) "
        f"against the oracle",
        behaviour="huge but finite scores (a huge scale) give a wrong output",
    )


@pytest.mark.clause("4.1")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@requires("causal", "causal_top_left")
def test_causal_blocks_keys_scored_far_above(backend, dtype):
    """Causality blocks a key whatever its score: with q = 1 and keys scored 0, 0, 20000,
    5000, 30000, 10000, 25000, 15000 (D = 1, the default scale 1, every number exact in
    float32), row 2 attends keys 0 to 2 and puts all its weight on key 2, though key 4
    scores 10000 more. At the size pool's D1 (SPEC §13.21), whose programs the other tests
    compile. Measured: PaddlePaddle's CPU path adds -10000 to a blocked key's score, not
    -inf, so rows 0 and 1 took key 4's value and row 2 split its weight evenly between
    keys 2 and 4 (paddlepaddle 3.3.1)."""
    q, k, v = pool_qkv(151, "D1", backend, dtype)
    q[...] = 1.0
    k[...] = 0.0
    k[..., 0] = [0.0, 0.0, 20000.0, 5000.0, 30000.0, 10000.0, 25000.0, 15000.0]  # (B, K, S)
    out = backend.attention(q, k, v, is_causal=True)
    assert_within(
        out,
        oracle_attention(as64(q), as64(k), as64(v), is_causal=True),
        random_tolerance(q, k, v, dtype, is_causal=True),
        f"{backend.name}: causal, a blocked key scored 10000 above the row's allowed ones "
        f"({dtype}) against the oracle",
        behaviour="a key that causality blocks is attended where its score is far above the "
        "row's allowed ones",
    )


# --- §4.1: scores that overflow ----------------------------------------------------------------


def _overflow_problem(backend, dtype: str):
    """Inputs whose scores, at scale 1e308 (1e38 in float32), either overflow by a wide
    margin (|q·k| >= 10) or stay finite by one (|q·k| <= 0.1, or 0): the rows' fates do
    not depend on rounding. D = 1; E = 2 where the backend declares ``value_dim``.

    Batch 0 (keys 10, 0, -10): row 0 scores [+inf, 0, -inf] and row 3 [-inf, 0, +inf]
    are NaN; rows 1 and 2 are finite, all weight on key 0 and key 2. Batch 1 (keys 10,
    20, 30): row 0 scores all -inf, so it is 0; rows 1-3 finite, on keys 2, 0 and 2.
    Returns q, k, v, scale, the expected output and which rows are NaN, (B, 1, T)."""
    scale = 1e308 if dtype == "float64" else 1e38
    _, E = value_dims(backend, 1, 2)
    q = np.array([[1.0, 0.01, -0.01, -1.0], [-1.0, 0.001, -0.001, 0.002]])  # (B, T)
    k = np.array([[10.0, 0.0, -10.0], [10.0, 20.0, 30.0]])  # (B, S)
    v = np.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[1.0, -2.0], [3.0, 4.0], [-5.0, 6.0]]])
    v = v[..., :E]  # (B, S, E)
    nan_rows = np.array([[True, False, False, True], [False] * 4])  # (B, T)
    expected = np.stack([v[0, [0, 0, 2, 0]], v[1, [0, 2, 0, 2]]])  # (B, T, E)
    expected[1, 0] = 0.0  # every score -inf: weights 0, not a masked row
    expected[nan_rows] = np.nan
    t = numpy_dtype(dtype)
    q, k, v = q[:, None, :, None].astype(t), k[:, None, :, None].astype(t), v[:, None].astype(t)
    return q, k, v, scale, expected[:, None], nan_rows[:, None]


def _rows_equal(out, want, tol) -> np.ndarray:
    """(B, H, T) bool: the rows of ``out`` equal to ``want``'s, NaN where it is NaN and
    within ``tol`` elsewhere."""
    same_nan = (np.isnan(out) == np.isnan(want)).all(axis=-1)
    with np.errstate(invalid="ignore"):
        close = (np.abs(np.where(np.isnan(want), 0.0, out - want)) <= tol).all(axis=-1)
    return same_nan & close


@pytest.mark.clause("4.1")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@requires("scale")
def test_overflowing_scores(backend, dtype):
    """A score that overflows is ±inf: a row that attends a +inf score is NaN in every
    channel, a -inf score has weight 0, and a row whose scores are all -inf is 0; the
    finite rows put all their weight on their largest score. A row may instead hold the
    oracle's exact answer, which a function computing in a wider precision returns: the
    value of its largest key."""
    q, k, v, scale, expected, _ = _overflow_problem(backend, dtype)
    out = as64(backend.attention(q, k, v, scale=scale))
    tol = tolerance(dtype, 0.0, np.nan_to_num(expected))
    exact = oracle_attention(as64(q), as64(k), as64(v), scale=scale)
    # Each row is judged against its exact answer where it holds it, else against IEEE's.
    target = np.where(_rows_equal(out, exact, tol)[..., None], exact, expected)
    # This row first: the comparison below would take its 0 for a row with no key (§4.3),
    # and name that finding instead of §4.1's.
    expect(
        (out[1, 0, 0] == target[1, 0, 0]).all(),
        "a row whose scores all overflowed to -inf is not exactly 0",
        f"{backend.name}: scale={scale:g} ({dtype}): batch 1, row 0 gave {out[1, 0, 0]}, "
        f"neither 0 nor the exact answer {exact[1, 0, 0]}",
    )
    assert_within(
        out,
        target,
        tol,
        f"{backend.name}: scale={scale:g} ({dtype}), rows NaN where a score is +inf, 0 "
        f"where all are -inf, or the exact answer",
        behaviour="scores that overflow give another NaN / 0 / finite pattern than IEEE's",
    )


@pytest.mark.clause("4.1")
@requires("scale")
@uses_dtype("float64")
def test_scores_near_the_largest_float64(backend):
    """Scores up to 1.36e308 (scale 1e308, float64) are finite, however close to the largest
    float64 (1.8e308): each row puts all its weight on its largest score, the value row of
    that key (the oracle's answer). A kernel that multiplies q by the scale before the
    product overflows there, as q · scale = 2.72e308 does not fit (measured: numpy-flash
    and jax-flash returned NaN)."""
    _, E = value_dims(backend, 1, 2)
    # No row's scores lie further apart than the largest float64: exp(score - max) of
    # every key is an ordinary number, and the reference computes it without a warning.
    q = np.array([2.72, 2.0, 1.0])[None, None, :, None]  # (B, H, T, D)
    k = np.array([0.5, 0.25, -0.1, 0.0])[None, None, :, None]  # (B, K, S, D)
    v = np.arange(1.0, 9.0).reshape(1, 1, 4, 2)[..., :E]  # (B, K, S, E)
    expected = oracle_attention(q, k, v, scale=1e308)
    out = backend.attention(q, k, v, scale=1e308)
    assert_within(
        out,
        expected,
        tolerance("float64", 0.0, expected),
        f"{backend.name}: scale=1e308 (float64), row maxima 1.36e308, 1e308 and 0.5e308, against "
        f"the oracle",
        behaviour="huge but finite scores (a huge scale) give a wrong output",
    )


@pytest.mark.clause("4.1", "4.2")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@requires("softcap", "scale")
def test_overflowing_scores_with_softcap(backend, dtype):
    """Under a softcap an overflowed score becomes ±softcap and its row is ordinary: the
    oracle's output, within §7 (the oracle's scores never overflow; capped, they agree)."""
    q, k, v, scale, _, _ = _overflow_problem(backend, dtype)
    options = {"scale": scale, "softcap": 5.0}
    out = backend.attention(q, k, v, **options)
    assert_within(
        out,
        oracle_attention(as64(q), as64(k), as64(v), **options),
        random_tolerance(q, k, v, dtype, **options),
        f"{backend.name}: scale={scale:g}, softcap 5 ({dtype}) against the oracle",
        behaviour="a softcap does not turn overflowed scores into ordinary ones",
    )


@pytest.mark.clause("4.1", "12.2")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@requires("grad", "scale")
def test_overflowing_score_gradients(backend, dtype):
    """A NaN row (it attends a +inf score) makes its dq row NaN and the dk and dv rows of
    every key it attends with a score above -inf NaN; every other gradient row is finite
    (batch 1 has no NaN row; its row of -inf scores contributes nothing). A gradient row
    that is the oracle's exact one (no overflow, as a function computing in a wider
    precision gives it) is right too (SPEC §12.2)."""
    q, k, v, scale, _, nan_rows = _overflow_problem(backend, dtype)
    d_out = np.ones((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
    dq, dk, dv = (as64(g) for g in backend.attention_vjp(q, k, v, d_out, scale=scale)[:3])
    exact = oracle.attention_vjp(as64(q), as64(k), as64(v), as64(d_out), scale=scale)
    context = f"{backend.name}: scale={scale:g} ({dtype})"
    # Batch 0: each key has a score of 0 or +inf in one of the NaN rows 0 and 3.
    want = {
        "dq": nan_rows[..., None] & np.ones_like(dq, dtype=bool),
        "dk": np.zeros(dk.shape, dtype=bool),
        "dv": np.zeros(dv.shape, dtype=bool),
    }
    want["dk"][0], want["dv"][0] = True, True
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        nan, ok = np.isnan(g), np.isfinite(g)
        ieee = ((nan == want[name]) & (ok == ~want[name])).all(axis=-1)  # per row
        y = exact[name]
        close = (np.abs(g - y) <= tolerance(dtype, 0.0, y)).all(axis=-1)  # NaN: not close
        expect(
            (ieee | close).all(),
            "scores that overflow give another NaN pattern in the gradients than the spec's",
            f"{context}: {name} should be NaN exactly at {np.argwhere(want[name]).tolist()} "
            f"and finite elsewhere (or each row the oracle's exact one); NaN at {np.argwhere(nan).tolist()}, non-finite "
            f"{np.argwhere(~ok).tolist()}",
        )
