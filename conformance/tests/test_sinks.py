"""SPEC §15: attention sinks, one learned logit per query head that takes weight and
carries no value (gpt-oss). Expected values come from the oracle (or, for the worked
example, from the hand computation in ``fixtures/worked_example.json``); the fixtures
``sinks-*`` and ``grad-sinks-*`` run in test_fixtures.py and test_gradients.py."""

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
    expect_no_weight_on_future_keys,
    oracle_and_tolerance,
    pairwise_params,
    random_qkv,
    setup_params,
    worked_qkv,
)
from conformance.suite.oracle_store import oracle
from conformance.suite.requirements import SuiteError, requires, value_dims
from conformance.suite.tolerance import (
    Departure,
    assert_identical,
    assert_rows_zero,
    assert_within,
    expect,
    finite_error,
    tolerance,
)

pytestmark = requires("sinks")

sizes = pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
dtypes = pytest.mark.parametrize("dtype", ["float64", "float32"])
GRADS = ("dq", "dk", "dv", "dmask", "dsinks")


def _sinks(seed: int, H: int, dtype: str) -> np.ndarray:
    """Sink logits (H,) in [-1, 2]: comparable to the scores, so that both weigh."""
    return np.random.default_rng(seed).uniform(-1.0, 2.0, H).astype(numpy_dtype(dtype))


#: Random setups (options, capabilities): sinks with each thing they meet (SPEC §15.2).
SETUPS = {
    "plain": ({}, ()),
    "causal": ({"is_causal": True}, ()),
    "bool-mask": ({"mask": "bool"}, ()),
    "float-mask-scale": ({"mask": "float", "scale": 0.4}, ()),
    "gqa-causal": ({"is_causal": True, "K": 1}, ("gqa",)),
    "bottom-right-window-softcap": (
        {"is_causal": True, "causal_alignment": "bottom_right", "window": (3, 1), "softcap": 2.0},
        ("causal_bottom_right", "window", "softcap"),
    ),
}


def _setup(name: str, size: dict, dtype: str, seed: int):
    """q, k, v, sinks and the options of setup ``name``, in ``dtype``."""
    options, _ = SETUPS[name]
    options = dict(options)
    K = options.pop("K", None)
    q, k, v = random_qkv(seed, T=size["T"], S=size["S"], K=K, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if options.get("mask") == "bool":
        mask = rng.random((B, H, T, S)) < 0.7
        mask[0, 1, 2] = False  # a row with no key: exactly 0 (SPEC §15.3)
        options["mask"] = mask
    elif options.get("mask") == "float":
        mask = np.where(rng.random((H, T, S)) < 0.3, -np.inf, rng.standard_normal((H, T, S)))
        options["mask"] = mask.astype(numpy_dtype(dtype))
    return q, k, v, _sinks(seed + 2, H, dtype), options


@pytest.mark.clause("15.1", "11.1")
@pytest.mark.parametrize(
    "causal",
    [
        pytest.param(True, marks=requires("causal"), id="causal"),
        pytest.param(False, id="non-causal"),
    ],
)
def test_sinks_worked_example(backend, causal, dtype):
    """The hand-checked example (fixtures/worked_example.json, "sinks"): all scores and the
    sink 0, so each attended key and the sink weigh alike: causal rows v0/2 and (v0+v1)/3."""
    ex = worked_example()["sinks"]
    key = "causal" if causal else "non_causal"
    dt = numpy_dtype(dtype)
    q, k, v = worked_qkv(ex, backend, dtype, lead=2)
    sinks = np.array(ex["sinks"], dtype=dt)
    out = backend.attention(q, k, v, is_causal=causal, sinks=sinks)[0, 0]
    assert_within(
        out,
        np.array(ex[key]["hand"]),
        tolerance(dtype, 0.0, np.array(ex[key]["hand"])),
        f"{backend.name}: the sinks worked example ({key}, {dtype})",
        behaviour="gets the sinks worked example wrong",
    )


@pytest.mark.clause("15.1", "15.2")
@pytest.mark.parametrize(
    ("setup", "size", "dtype"), pairwise_params(setup_params(SETUPS), size=SIZES, dtype=DTYPE_AXIS)
)
def test_sinks_match_the_oracle(backend, setup, size, dtype):
    """Sinks alone and with causality, masks, a scale, GQA, bottom-right alignment, a
    window and a softcap: the output is the oracle's within SPEC §7. Every setup runs at
    every size and in both dtypes (all pairs, not their product)."""
    q, k, v, sinks, options = _setup(setup, size, dtype, 60)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, sinks=sinks, **options)
    out = backend.attention(q, k, v, sinks=sinks, **options)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: sinks, {setup}, T={size['T']} S={size['S']} {dtype}",
        behaviour="attention with sinks differs from the oracle",
    )


@pytest.mark.clause("15.1")
@dtypes
def test_minus_inf_sink_is_no_sink(backend, dtype):
    """A head whose sink is -inf is that head without a sink; the others keep theirs."""
    q, k, v = random_qkv(61, T=7, S=13, H=3, dtype=dtype)
    sinks = _sinks(62, 3, dtype)
    sinks[1] = -np.inf
    causal = causal_where_taken(backend, 7, 13)
    plain = backend.attention(q, k, v, **causal)
    out = backend.attention(q, k, v, sinks=sinks, **causal)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, sinks=sinks, **causal)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: sinks with head 1 at -inf ({dtype})",
        behaviour="attention with sinks differs from the oracle",
    )
    assert_within(
        out[:, 1],
        plain[:, 1],
        2 * tol,
        f"{backend.name}: the head with sink -inf against the call without sinks ({dtype})",
        behaviour="a sink of -inf is not the same as no sink",
    )
    all_off = backend.attention(q, k, v, sinks=np.full(3, -np.inf, q.dtype), **causal)
    assert_within(
        all_off,
        plain,
        2 * tol,
        f"{backend.name}: every sink -inf against the call without sinks ({dtype})",
        behaviour="a sink of -inf is not the same as no sink",
    )


@pytest.mark.clause("15.1")
@sizes
@dtypes
@pytest.mark.parametrize("causal", [pytest.param(False, id="full"), causal_param()])
def test_sink_takes_weight(backend, size, dtype, causal):
    """With V = identity (E = S) the output is the key weights: entries >= 0, each row
    summing to 1 - p_sink < 1 (the oracle's weights), 0 on keys a causal mask blocks."""
    T, S = size["T"], size["S"]
    D, _ = value_dims(backend, 5, S, keep="E")
    q, k, _ = random_qkv(63, T=T, S=S, D=D, dtype=dtype)
    v = np.broadcast_to(np.eye(S, dtype=numpy_dtype(dtype)), (2, 3, S, S)).copy()
    sinks = _sinks(64, 3, dtype)
    w = as64(backend.attention(q, k, v, is_causal=causal, sinks=sinks))
    expected, tol = oracle_and_tolerance(q, k, v, dtype, is_causal=causal, sinks=sinks)
    expect(
        (w >= 0).all(),
        "gives a key a negative attention weight",
        f"{backend.name}: negative weight {w.min()}",
    )
    assert_within(
        w,
        expected,
        tol,
        f"{backend.name}: key weights with sinks (V = identity)",
        behaviour="attention with sinks differs from the oracle",
    )
    assert_within(
        w.sum(-1),
        expected.sum(-1),
        S * tol,
        f"{backend.name}: each row's key weights should sum to 1 - p_sink",
        behaviour="the key weights with a sink do not sum to 1 - p_sink",
    )
    expect(
        (expected.sum(-1) < 1 - 1e-3).all(),
        "the suite's sinks take no weight",
        "the sinks of this test should take a visible share of every row",
    )
    if causal:
        expect_no_weight_on_future_keys(backend.name, w, T, S)


@pytest.mark.clause("15.3")
@dtypes
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param("bool-mask", id="bool-mask"),
        pytest.param("S0", id="S0"),
        pytest.param(
            "bottom-right-T>S",
            marks=requires("causal_bottom_right", "causal"),
            id="bottom-right-T>S",
        ),
    ],
)
def test_row_with_no_key_is_zero(backend, dtype, setup):
    """A row with no key puts all its weight on the sink and returns exactly 0, whatever
    the sink (large ones, NaN) holds."""
    options: dict = {}
    if setup == "S0":
        q, k, v = random_qkv(65, T=5, S=0, dtype=dtype)
        rows = np.ones((2, 3, 5), dtype=bool)
    elif setup == "bool-mask":
        q, k, v = random_qkv(65, T=6, S=5, dtype=dtype)
        mask = np.ones((2, 3, 6, 5), dtype=bool)
        mask[:, :, [0, 4]] = False
        options["mask"] = mask
        rows = ~mask.any(-1)
    else:
        q, k, v = random_qkv(65, T=9, S=5, dtype=dtype)
        options.update(is_causal=True, causal_alignment="bottom_right")
        rows = np.zeros((2, 3, 9), dtype=bool)
        rows[:, :, :4] = True
    for sinks in (_sinks(66, 3, dtype), np.array([1e4, np.nan, -np.inf], dtype=q.dtype)):
        out = backend.attention(q, k, v, sinks=sinks, **options)
        assert_rows_zero(out, rows, f"{backend.name}: sinks {sinks.tolist()}, {setup}", v=v)


@pytest.mark.clause("15.2", "4.6")
@dtypes
@requires("gqa")
def test_sinks_are_per_query_head_under_gqa(backend, dtype):
    """Under GQA each query head has its own sink (H of them, not K): the grouped call is
    the oracle's, and changing sinks[h] changes head h alone, bit for bit, though head h
    shares its keys and values with another."""
    q, k, v = random_qkv(67, H=4, K=2, T=7, S=9, dtype=dtype)
    sinks = _sinks(68, 4, dtype)
    causal = causal_where_taken(backend, 7, 9)
    grouped = backend.attention(q, k, v, sinks=sinks, **causal)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, sinks=sinks, **causal)
    assert_within(
        grouped,
        expected,
        tol,
        f"{backend.name}: GQA H=4 K=2 with sinks ({dtype})",
        behaviour="attention with sinks differs from the oracle",
    )
    changed = sinks.copy()
    changed[1] = changed[1] + 3
    other = backend.attention(q, k, v, sinks=changed, **causal)
    assert_identical(
        other[:, [0, 2, 3]],
        grouped[:, [0, 2, 3]],
        f"{backend.name}: changing sinks[1] changed another head ({dtype})",
        behaviour="a sink reaches other query heads than its own",
    )
    expect(
        not np.array_equal(other[:, 1], grouped[:, 1]),
        "ignores a query head's own sink",
        f"{backend.name}: changing sinks[1] left head 1 unchanged",
    )


@pytest.mark.clause("15.2", "4.7")
@dtypes
def test_unused_slots_stay_inert_with_sinks(backend, dtype):
    """Key slots no query attends (padding) change nothing, whatever they hold, with sinks
    as without: the output is bit for bit the same with NaN, inf or 0 there."""
    q, k, v = random_qkv(80, T=5, S=7, dtype=dtype)
    mask = np.arange(7)[None, None, None, :] < np.array([5, 3])[:, None, None, None]
    sinks = _sinks(81, 3, dtype)
    outs = []
    for garbage in (0.0, np.nan, np.inf):
        k2, v2 = k.copy(), v.copy()
        for b, n in enumerate((5, 3)):
            k2[b, :, n:], v2[b, :, n:] = garbage, -garbage
        outs.append(backend.attention(q, k2, v2, mask=mask, sinks=sinks))
    expected, tol = oracle_and_tolerance(q, k, v, dtype, mask=mask, sinks=sinks)
    assert_within(
        outs[0],
        expected,
        tol,
        f"{backend.name}: padded keys with sinks ({dtype})",
        behaviour="attention with sinks differs from the oracle",
    )
    for out, garbage in zip(outs[1:], ("NaN", "inf")):
        assert_identical(
            out,
            outs[0],
            f"{backend.name}: {garbage} in padded key slots with sinks ({dtype})",
            behaviour="garbage (NaN, ±inf, the largest number) in key slots no query attends "
            "reaches the output",
        )


@pytest.mark.clause("15.1", "4.4")
@dtypes
def test_large_sink_drives_the_output_to_zero(backend, dtype):
    """A sink of 1e4 takes all the weight without overflowing: the output is the oracle's
    (0 to the last bit of float64), finite."""
    q, k, v = random_qkv(69, T=7, S=13, dtype=dtype)
    sinks = np.array([1e4, 1e4, 0.5], dtype=q.dtype)
    out = backend.attention(q, k, v, sinks=sinks)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, sinks=sinks)
    expect(
        np.isfinite(out).all(),
        "a large sink overflows",
        f"{backend.name}: sinks of 1e4 gave non-finite outputs",
    )
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: sinks of 1e4 ({dtype})",
        behaviour="a large sink does not drive the output to 0",
    )


@pytest.mark.clause("15.4")
@dtypes
def test_non_finite_sink_makes_its_head_nan(backend, dtype):
    """A NaN or +inf sink makes every row of its head that has a key NaN, and no other row;
    a row with no key is 0."""
    q, k, v = random_qkv(70, H=4, T=6, S=5, dtype=dtype)
    mask = np.ones((6, 5), dtype=bool)
    mask[3] = False
    sinks = _sinks(71, 4, dtype)
    clean = backend.attention(q, k, v, mask=mask, sinks=sinks)
    sinks[1], sinks[2] = np.nan, np.inf
    out = backend.attention(q, k, v, mask=mask, sinks=sinks)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, mask=mask, sinks=sinks)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: sinks with NaN and +inf ({dtype})",
        behaviour="a NaN or +inf sink does not make its head's rows NaN",
    )
    assert_identical(
        out[:, [0, 3]],
        clean[:, [0, 3]],
        f"{backend.name}: a NaN sink changed other heads ({dtype})",
        behaviour="a NaN sink reaches other heads",
    )


@pytest.mark.clause("15.2", "5.2")
@requires("dropout")
def test_dropout_leaves_the_sink_alone(backend, dtype):
    """Dropout zeroes key weights only: with V = identity each weight is either 0 or the
    undropped weight over 1 - p, and the sink's share is never handed back to the keys."""
    T, S = 7, 13
    D, _ = value_dims(backend, 5, S, keep="E")
    q, k, _ = random_qkv(72, T=T, S=S, D=D, dtype=dtype)
    v = np.broadcast_to(np.eye(S, dtype=numpy_dtype(dtype)), (2, 3, S, S)).copy()
    sinks = _sinks(73, 3, dtype)
    p = 0.5
    plain = as64(backend.attention(q, k, v, sinks=sinks))
    dropped = as64(backend.attention(q, k, v, sinks=sinks, dropout_p=p, seed=5))
    _, tol = oracle_and_tolerance(q, k, v, dtype, sinks=sinks)
    kept = dropped != 0
    expect(
        0 < kept.mean() < 1,
        "dropout with sinks drops nothing or everything",
        f"{backend.name}: kept fraction {kept.mean()} at p = {p}",
    )
    assert_within(
        dropped[kept],
        plain[kept] / (1 - p),
        2 * tol / (1 - p),
        f"{backend.name}: kept weights with sinks should be scaled by 1/(1 - p)",
        behaviour="dropout with sinks rescales the kept weights otherwise than by 1/(1 - p)",
    )


# --- Gradients (SPEC §15.5) ------------------------------------------------------------------


def _vjp(backend, q, k, v, d_out, **options) -> dict[str, np.ndarray]:
    names = [n for n in GRADS if n != "dmask" or _float_mask(options)]
    return dict(zip(names, backend.attention_vjp(q, k, v, d_out, **options)))


def _float_mask(options: dict) -> bool:
    mask = options.get("mask")
    return mask is not None and mask.dtype != np.bool_


@pytest.mark.clause("15.5", "12.9")
@dtypes
@pytest.mark.parametrize("setup", setup_params(SETUPS, grad=True))
def test_sink_gradients_match_the_oracle(backend, dtype, setup):
    """dq, dk, dv (dmask) and dsinks = −Σ p_sink · (dO · O) against the 50-digit oracle,
    within SPEC §12.9 (the naive backward in the dtype against the oracle)."""
    q, k, v, sinks, options = _setup(setup, {"T": 7, "S": 9}, dtype, 74)
    d_out = random_d_out(75, q, v)
    got = _vjp(backend, q, k, v, d_out, sinks=sinks, **options)
    wide = {
        n: as64(x) if isinstance(x, np.ndarray) and x.dtype != bool else x
        for n, x in options.items()
    }
    args = (as64(q), as64(k), as64(v), as64(d_out))
    expected = oracle.attention_vjp(*args, sinks=as64(sinks), **wide)
    naive = oracle.naive_vjp_same_precision(*args, numpy_dtype(dtype), sinks=as64(sinks), **wide)
    expect(
        list(got) == list(expected) and len(got) == len(expected),
        "returns another set of gradients than the spec (dsinks last)",
        f"{backend.name}: got {list(got)}, expected {list(expected)}",
    )
    likes = {"dq": q, "dk": k, "dv": v, "dmask": options.get("mask"), "dsinks": sinks}
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
            f"{backend.name}: {name} with sinks, {setup} ({dtype})",
            behaviour="the gradients with sinks differ from the oracle",
        )


@pytest.mark.clause("15.5", "12.4")
@requires("grad")
def test_sink_gradient_ignores_rows_with_no_key(backend, dtype):
    """A row with no key adds exactly 0 to dsinks and its d_out reaches no gradient: changing
    d_out there changes no gradient bit."""
    q, k, v = random_qkv(76, T=6, S=5, dtype=dtype)
    mask = np.ones((2, 3, 6, 5), dtype=bool)
    mask[:, :, [1, 4]] = False
    sinks = _sinks(77, 3, dtype)
    d_out = random_d_out(78, q, v)
    base = _vjp(backend, q, k, v, d_out, mask=mask, sinks=sinks)
    d_out2 = d_out.copy()
    d_out2[:, :, [1, 4]] = (d_out2[:, :, [1, 4]].astype(np.float64) * 5 + 3).astype(q.dtype)
    other = _vjp(backend, q, k, v, d_out2, mask=mask, sinks=sinks)
    for name in base:
        expect(
            np.isfinite(base[name]).all(),
            "a gradient that nothing attended must make exactly 0 is NaN",
            f"{backend.name}: {name} has non-finite entries",
        )
        assert_identical(
            other[name],
            base[name],
            f"{backend.name}: {name} changed with d_out on rows with no key",
            behaviour="a query with no key to attend sends gradient through its sink",
        )
    expect(
        (base["dq"][:, :, [1, 4]] == 0).all(),
        "a query with no key to attend sends gradient to q, k or v",
        f"{backend.name}: dq on rows with no key is not 0",
    )


# --- Errors (SPEC §15.1, §15.6) --------------------------------------------------------------


@pytest.mark.clause("15.1", "8.1")
def test_bad_sinks_are_refused(backend, dtype):
    """sinks not shaped (H,) raise ValueError; sinks in another dtype than q TypeError."""
    q, k, v = random_qkv(79, T=5, S=6, dtype=dtype)
    bad = {
        "shape (H + 1,)": (np.zeros(4, dtype=q.dtype), ValueError),
        "shape (1, H)": (np.zeros((1, 3), dtype=q.dtype), ValueError),
        "int64": (np.zeros(3, dtype=np.int64), TypeError),
    }
    for what, (sinks, error) in bad.items():
        _expect_error(backend, error, what, q, k, v, sinks)


def _expect_error(backend, error: type, what: str, q, k, v, sinks) -> None:
    try:
        backend.attention(q, k, v, sinks=sinks)
    except error as err:
        if "error_messages" in backend.capabilities:
            expect(
                "sinks" in str(err),
                "refuses bad sinks without naming them",
                f"{backend.name}: the error for sinks of {what} should name sinks: {err}",
            )
        return
    except SuiteError:
        raise
    except Exception as err:
        raise Departure(
            f"{backend.name}: raised {type(err).__name__} for sinks of {what}: {err}",
            f"raises {type(err).__name__}, not {error.__name__}, for sinks of {what}",
        ) from err
    raise Departure(f"{backend.name}: accepted sinks of {what}", f"accepts sinks of {what}")
