"""SPEC §17: ALiBi, a linear bias −slope · |t + S − T − s| on every score, one slope per
query head (Press et al.; FlashAttention's ``alibi_slopes``). Expected values come from
the oracle (or, for the worked example, from the hand computation in
``fixtures/worked_example.json``); the fixtures ``alibi-*`` and ``grad-alibi-*`` run in
test_fixtures.py and test_gradients.py."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import numpy_dtype
from conformance.suite.cases import worked_example
from conformance.suite.gradients import random_d_out
from conformance.suite.helpers import (
    DTYPE_AXIS,
    SIZES,
    as64,
    causal_param,
    causal_where_taken,
    oracle_and_tolerance,
    pairwise_params,
    random_qkv,
    setup_params,
    worked_qkv,
)
from conformance.suite.oracle_store import oracle
from conformance.suite.requirements import SuiteError, requires
from conformance.suite.tolerance import (
    Departure,
    assert_rows_zero,
    assert_within,
    expect,
    finite_error,
    tolerance,
)

pytestmark = requires("alibi")

sizes = pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
dtypes = pytest.mark.parametrize("dtype", ["float64", "float32"])
GRADS = ("dq", "dk", "dv", "dmask", "dsinks")


def _slopes(H: int, B: int | None = None, seed: int = 0) -> np.ndarray:
    """The usual geometric slopes 2^(-8 (h + 1) / H), (H,), or random ones in [0, 1],
    (B, H); float32, as FlashAttention takes them."""
    if B is None:
        return (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)  # (H,)
    return np.random.default_rng(seed).uniform(0.0, 1.0, (B, H)).astype(np.float32)  # (B, H)


def _bias(slopes: np.ndarray, T: int, S: int) -> np.ndarray:
    """ALiBi's bias as a float mask, built by hand from SPEC §17.1: (B|1, H, T, S)."""
    H = slopes.shape[-1]
    distance = np.abs(np.arange(T)[:, None] + S - T - np.arange(S)[None, :])  # (T, S)
    return -slopes.astype(np.float64).reshape(-1, H, 1, 1) * distance  # (B|1, H, T, S)


#: Random setups (options, capabilities): ALiBi with each thing it meets (SPEC §17.2).
SETUPS = {
    "plain": ({}, ()),
    "causal": ({"is_causal": True}, ()),
    "per-batch-slopes": ({"slopes": "BH"}, ()),
    "causal-bottom-right": (
        {"is_causal": True, "causal_alignment": "bottom_right"},
        ("causal_bottom_right",),
    ),
    "gqa-causal": ({"is_causal": True, "K": 1}, ("gqa",)),
    "bool-mask": ({"mask": "bool"}, ()),
    "float-mask-scale": ({"mask": "float", "scale": 0.4, "slopes": "BH"}, ()),
    "window-softcap": ({"window": (3, 1), "softcap": 2.0}, ("window", "softcap")),
    "sinks": ({"sinks": "random"}, ("sinks",)),
    "chunked": ({"chunk_size": 3, "is_causal": True}, ("chunked",)),
}


def _setup(name: str, size: dict, dtype: str, seed: int):
    """q, k, v and the options (ALiBi's slopes included) of setup ``name``, in ``dtype``."""
    options, _ = SETUPS[name]
    options = dict(options)
    K = options.pop("K", None)
    q, k, v = random_qkv(seed, T=size["T"], S=size["S"], K=K, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    per_batch = options.pop("slopes", None) == "BH"
    options["alibi_slopes"] = _slopes(H, B if per_batch else None, seed + 2)
    if options.get("mask") == "bool":
        mask = rng.random((B, H, T, S)) < 0.7
        mask[0, 1, 2] = False  # a row with no key: exactly 0 (SPEC §17.2)
        options["mask"] = mask
    elif options.get("mask") == "float":
        mask = np.where(rng.random((H, T, S)) < 0.3, -np.inf, rng.standard_normal((H, T, S)))
        options["mask"] = mask.astype(numpy_dtype(dtype))
    if options.get("sinks") == "random":
        options["sinks"] = rng.uniform(-1.0, 2.0, H).astype(numpy_dtype(dtype))  # (H,)
    return q, k, v, options


@pytest.mark.clause("17.1", "11.1")
@pytest.mark.parametrize(
    "key",
    ["non_causal", causal_param("causal"), "one_query_top_left"],
)
def test_alibi_worked_example(backend, key, dtype):
    """The hand-checked example (fixtures/worked_example.json, "alibi"): every score 0 and
    the slope ln 2, so each key weighs 2^(-distance); one top-left query is still measured
    from the bottom-right diagonal."""
    ex = worked_example()["alibi"]
    dt = numpy_dtype(dtype)
    q, k, v = worked_qkv(ex, backend, dtype, lead=2)
    slopes = np.array(ex["alibi_slopes"], dtype=dt)  # ln 2 in q's dtype
    if key == "one_query_top_left":
        q = q[:, :, 1:]
    out = backend.attention(q, k, v, is_causal=key == "causal", alibi_slopes=slopes)[0, 0]
    hand = np.array(ex[key]["hand"])
    assert_within(
        out,
        hand,
        tolerance(dtype, 0.0, hand),
        f"{backend.name}: the ALiBi worked example ({key}, {dtype})",
        behaviour="gets the ALiBi worked example wrong",
    )


@pytest.mark.clause("17.1", "17.2")
@pytest.mark.parametrize(
    ("setup", "size", "dtype"), pairwise_params(setup_params(SETUPS), size=SIZES, dtype=DTYPE_AXIS)
)
def test_alibi_matches_the_oracle(backend, setup, size, dtype):
    """ALiBi alone, with (B, H) slopes, causality in both alignments, GQA, masks, a scale,
    a window and a softcap, sinks and chunks: the output is the oracle's within SPEC §7.
    Every setup runs at every size and in both dtypes (all pairs, not their product)."""
    q, k, v, options = _setup(setup, size, dtype, 110)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, **options)
    out = backend.attention(q, k, v, **options)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: alibi_slopes, {setup}, T={size['T']} S={size['S']} ({dtype})",
        behaviour="attention with ALiBi differs from the oracle",
    )


@pytest.mark.clause("17.1")
@sizes
@pytest.mark.parametrize(
    "alignment",
    [
        pytest.param("top_left", marks=requires("causal", "causal_top_left")),
        pytest.param("bottom_right", marks=requires("causal_bottom_right", "causal")),
    ],
)
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
def test_alibi_is_its_float_mask(backend, size, alignment, per_batch, dtype):
    """alibi_slopes gives the output of the same call with −slope · |t + S − T − s| given
    as a float mask: the distance is from the bottom-right diagonal in either alignment."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(111, T=T, S=S, dtype=dtype)
    slopes = _slopes(q.shape[1], q.shape[0] if per_batch else None, 112)
    mask = _bias(slopes, T, S).astype(q.dtype)  # (B|1, H, T, S)
    options = {"is_causal": True}
    if alignment == "bottom_right":
        options["causal_alignment"] = alignment
    alibi = backend.attention(q, k, v, alibi_slopes=slopes, **options)
    masked = backend.attention(q, k, v, mask=mask, **options)
    _, tol = oracle_and_tolerance(q, k, v, dtype, alibi_slopes=slopes, **options)
    assert_within(
        alibi,
        masked,
        2 * tol,
        f"{backend.name}: alibi_slopes against its float mask ({alignment}, {dtype})",
        behaviour="alibi_slopes is not its bias -slope·|t + S - T - s| as a float mask",
    )


@pytest.mark.clause("17.1")
def test_zero_slopes_are_no_alibi(backend, dtype):
    """Slopes of 0 give attention without ALiBi."""
    q, k, v = random_qkv(113, T=7, S=13, dtype=dtype)
    causal = causal_where_taken(backend, 7, 13)
    plain = backend.attention(q, k, v, **causal)
    out = backend.attention(q, k, v, alibi_slopes=np.zeros(3, np.float32), **causal)
    _, tol = oracle_and_tolerance(q, k, v, dtype, **causal)
    assert_within(
        out,
        plain,
        2 * tol,
        f"{backend.name}: zero slopes against no ALiBi ({dtype})",
        behaviour="slopes of 0 change the output",
    )


@pytest.mark.clause("17.1", "4.5")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("slope_dtype", ["float32", "q"])
def test_low_precision_alibi(backend, dtype, slope_dtype):
    """float16 and bfloat16 inputs take float32 slopes or slopes in their own dtype; the
    bias is computed in float32 (a distance of 300 times a slope near 1 is beyond what
    bfloat16 resolves) and the output is the oracle's within SPEC §7."""
    q, k, v = random_qkv(114, T=5, S=300, D=4, dtype=dtype)
    slopes = np.array([0.75, 0.0625, 1.0], dtype=np.float32)
    if slope_dtype == "q":
        slopes = slopes.astype(q.dtype)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, alibi_slopes=slopes)
    out = backend.attention(q, k, v, alibi_slopes=slopes)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: ALiBi with {slope_dtype} slopes on {dtype} inputs, S=300",
        behaviour="ALiBi on float16/bfloat16 inputs differs from the oracle",
    )


@pytest.mark.clause("17.2", "4.6")
@requires("gqa")
def test_slopes_are_per_query_head_under_gqa(backend, dtype):
    """Under GQA each query head keeps its own slope: the call with K = 1 equals the call
    with the key/value head repeated over the H query heads."""
    q, k, v = random_qkv(115, H=4, K=1, T=6, S=9, dtype=dtype)
    slopes = _slopes(4)
    grouped = backend.attention(q, k, v, alibi_slopes=slopes)
    repeated = backend.attention(
        q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), alibi_slopes=slopes
    )
    _, tol = oracle_and_tolerance(q, k, v, dtype, alibi_slopes=slopes)
    assert_within(
        grouped,
        repeated,
        2 * tol,
        f"{backend.name}: ALiBi under GQA against the repeated key/value heads ({dtype})",
        behaviour="ALiBi's slopes are not per query head under GQA",
    )


@pytest.mark.clause("17.2", "4.3")
def test_row_with_no_key_is_zero(backend, dtype):
    """A row the mask empties returns exactly 0 with ALiBi."""
    q, k, v = random_qkv(116, T=6, S=7, dtype=dtype)
    mask = np.ones((6, 7), dtype=bool)
    mask[[1, 4]] = False
    out = backend.attention(q, k, v, mask=mask, alibi_slopes=_slopes(3))
    empty = np.zeros(6, dtype=bool)
    empty[[1, 4]] = True
    assert_rows_zero(
        out, np.broadcast_to(empty, out.shape[:-1]), f"{backend.name}: ALiBi ({dtype})", v
    )


# --- The gradient (SPEC §17.3) ---------------------------------------------------------------


def _vjp(backend, q, k, v, d_out, **options) -> dict[str, np.ndarray]:
    mask = options.get("mask")
    names = [
        n
        for n in GRADS
        if (n != "dmask" or (mask is not None and mask.dtype != np.bool_))
        and (n != "dsinks" or options.get("sinks") is not None)
    ]
    got = backend.attention_vjp(q, k, v, d_out, **options)
    expect(
        len(got) == len(names),
        "returns another set of gradients than the spec with alibi_slopes",
        f"{backend.name}: got {len(got)} gradients, expected {names} (no slope gradient)",
    )
    return dict(zip(names, got))


@pytest.mark.clause("17.3", "12.9")
@dtypes
@pytest.mark.parametrize("setup", setup_params(SETUPS, grad=True))
def test_alibi_gradients_match_the_oracle(backend, dtype, setup):
    """dq, dk, dv (dmask, dsinks) with ALiBi against the 50-digit oracle, within SPEC §12.9
    (the naive backward in the dtype against the oracle); no gradient for the slopes."""
    q, k, v, options = _setup(setup, {"T": 7, "S": 9}, dtype, 117)
    d_out = random_d_out(118, q, v)
    got = _vjp(backend, q, k, v, d_out, **options)
    wide = {
        n: as64(x) if isinstance(x, np.ndarray) and x.dtype != bool else x
        for n, x in options.items()
    }
    args = (as64(q), as64(k), as64(v), as64(d_out))
    expected = oracle.attention_vjp(*args, **wide)
    naive = oracle.naive_vjp_same_precision(*args, numpy_dtype(dtype), **wide)
    likes = {"dq": q, "dk": k, "dv": v, "dmask": options.get("mask")}
    likes["dsinks"] = options.get("sinks")
    for name, want in expected.items():
        g = got[name]
        expect(
            g.shape == likes[name].shape and g.dtype == likes[name].dtype,
            "returns gradients of the wrong shape or dtype",
            f"{backend.name}: {name} is {g.dtype} {g.shape}, expected "
            f"{likes[name].dtype} {likes[name].shape}",
        )
        assert_within(
            g,
            want,
            tolerance(dtype, finite_error(naive[name], want), want),
            f"{backend.name}: {name} with alibi_slopes, {setup} ({dtype})",
            behaviour="the gradients with ALiBi differ from the oracle",
        )


# --- Errors (SPEC §17.1) ---------------------------------------------------------------------


@pytest.mark.clause("17.1", "8.1")
def test_bad_alibi_slopes_are_refused(backend, dtype):
    """Slopes not shaped (H,) or (B, H) raise ValueError; slopes of another dtype than
    float32 or q's TypeError."""
    q, k, v = random_qkv(119, T=5, S=6, dtype=dtype)
    other = "float16" if dtype != "float16" else "float64"
    bad = {
        "shape (H + 1,)": (np.zeros(4, dtype=np.float32), ValueError),
        "shape (B, H, 1)": (np.zeros((2, 3, 1), dtype=np.float32), ValueError),
        "shape (H, B)": (np.zeros((3, 2), dtype=np.float32), ValueError),
        "int64": (np.zeros(3, dtype=np.int64), TypeError),
        other: (np.zeros(3, dtype=numpy_dtype(other)), TypeError),
    }
    for what, (slopes, error) in bad.items():
        _expect_error(backend, error, what, q, k, v, slopes)


def _expect_error(backend, error: type, what: str, q, k, v, slopes) -> None:
    try:
        backend.attention(q, k, v, alibi_slopes=slopes)
    except error as err:
        if "error_messages" in backend.capabilities:
            expect(
                "alibi_slopes" in str(err),
                "refuses bad alibi_slopes without naming them",
                f"{backend.name}: the error for alibi_slopes of {what} should name "
                f"alibi_slopes: {err}",
            )
        return
    except SuiteError:
        raise
    except Exception as err:
        raise Departure(
            f"{backend.name}: raised {type(err).__name__} for alibi_slopes of {what}: {err}",
            f"raises {type(err).__name__}, not {error.__name__}, for alibi_slopes of {what}",
        ) from err
    raise Departure(
        f"{backend.name}: accepted alibi_slopes of {what}", f"accepts alibi_slopes of {what}"
    )
