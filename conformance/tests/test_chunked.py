"""SPEC §16: chunked local attention, query and key attend only within one chunk of
``chunk_size`` positions (Llama 4). Expected values come from the oracle (or, for the
worked example, from the hand computation in ``fixtures/worked_example.json``); the
fixtures ``chunked-*`` and ``grad-chunked-*`` run in test_fixtures.py and
test_gradients.py."""

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
    assert_identical,
    assert_rows_zero,
    assert_within,
    expect,
    finite_error,
    tolerance,
)

pytestmark = requires("chunked")

sizes = pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
dtypes = pytest.mark.parametrize("dtype", ["float64", "float32"])
GRADS = ("dq", "dk", "dv", "dmask")


def _chunk_mask(T: int, S: int, chunk: int, alignment: str = "top_left") -> np.ndarray:
    """The chunks as a dense bool mask (T, S), built by hand from SPEC §16.1."""
    offset = 0 if alignment == "top_left" else S - T
    position = np.arange(T)[:, None] + offset  # (T, 1)
    return position // chunk == np.arange(S)[None, :] // chunk  # (T, S)


#: Random setups (options, capabilities): chunks with each thing they meet (SPEC §16.2).
SETUPS = {
    "plain": ({}, ()),
    "causal": ({"is_causal": True}, ()),
    "causal-bottom-right": (
        {"is_causal": True, "causal_alignment": "bottom_right"},
        ("causal_bottom_right",),
    ),
    "window": ({"window": (2, 1)}, ("window",)),
    "gqa-causal": ({"is_causal": True, "K": 1}, ("gqa",)),
    "bool-mask": ({"mask": "bool"}, ()),
    "float-mask-scale": ({"mask": "float", "scale": 0.4}, ()),
    "bottom-right-window-softcap": (
        {"causal_alignment": "bottom_right", "window": (1, 2), "softcap": 2.0},
        ("causal_bottom_right", "window", "softcap"),
    ),
}


def _setup(name: str, size: dict, dtype: str, seed: int):
    """q, k, v and the options of setup ``name``, in ``dtype``."""
    options, _ = SETUPS[name]
    options = dict(options)
    K = options.pop("K", None)
    q, k, v = random_qkv(seed, T=size["T"], S=size["S"], K=K, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    if options.get("mask") == "bool":
        mask = rng.random((B, H, T, S)) < 0.7
        mask[0, 1, 2] = False  # a row with no key: exactly 0 (SPEC §16.3)
        options["mask"] = mask
    elif options.get("mask") == "float":
        mask = np.where(rng.random((H, T, S)) < 0.3, -np.inf, rng.standard_normal((H, T, S)))
        options["mask"] = mask.astype(numpy_dtype(dtype))
    return q, k, v, options


@pytest.mark.clause("16.1", "11.1")
@pytest.mark.parametrize(
    "key",
    [
        "non_causal",
        pytest.param("causal", marks=requires("causal"), id="causal"),
        pytest.param("bottom_right_last_two", marks=requires("causal_bottom_right", "causal")),
    ],
)
def test_chunked_worked_example(backend, key, dtype):
    """The hand-checked example (fixtures/worked_example.json, "chunked"): four tokens,
    every score 0, chunks {0, 1} and {2, 3}: each row averages the values of its chunk
    that it may see."""
    ex = worked_example()["chunked"]
    q, k, v = worked_qkv(ex, backend, dtype, lead=2)
    options = {"is_causal": key != "non_causal"}
    if key == "bottom_right_last_two":
        q = q[:, :, 2:]
        options["causal_alignment"] = "bottom_right"
    out = backend.attention(q, k, v, chunk_size=ex["chunk_size"], **options)[0, 0]
    hand = np.array(ex[key]["hand"])
    assert_within(
        out,
        hand,
        tolerance(dtype, 0.0, hand),
        f"{backend.name}: the chunked worked example ({key}, {dtype})",
        behaviour="gets the chunked worked example wrong",
    )


@pytest.mark.clause("16.1", "16.2")
@pytest.mark.parametrize(
    ("setup", "size", "dtype", "chunk"),
    pairwise_params(
        setup_params(SETUPS, uses={"chunk_size": 1}),
        size=SIZES,
        dtype=DTYPE_AXIS,
        chunk={f"chunk{c}": c for c in (1, 3, 5)},
    ),
)
def test_chunked_matches_the_oracle(backend, setup, size, dtype, chunk):
    """Chunks alone and with causality in both alignments, a window, GQA, masks, a scale
    and a softcap: the output is the oracle's within SPEC §7. Every setup runs at every
    size, and meets every chunk length and dtype (all pairs, not their full product)."""
    q, k, v, options = _setup(setup, size, dtype, 90)
    expected, tol = oracle_and_tolerance(q, k, v, dtype, chunk_size=chunk, **options)
    out = backend.attention(q, k, v, chunk_size=chunk, **options)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: chunk_size={chunk}, {setup}, T={size['T']} S={size['S']} ({dtype})",
        behaviour="chunked attention differs from the oracle",
    )


@pytest.mark.clause("16.1", "16.2")
@sizes
@pytest.mark.parametrize(
    "alignment",
    [
        pytest.param("top_left", marks=requires("causal", "causal_top_left")),
        pytest.param("bottom_right", marks=requires("causal_bottom_right", "causal")),
    ],
)
def test_chunks_are_the_dense_mask(backend, size, alignment, dtype):
    """chunk_size gives the output of the same call with the chunks written out as a bool
    mask by hand, causal and not (§16.1: a chunk is a mask, ANDed with the rest, §16.2)."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(91, T=T, S=S, dtype=dtype)
    mask = _chunk_mask(T, S, 4, alignment)
    for causal in (False, True):
        options = {"is_causal": causal, "causal_alignment": alignment}
        if alignment == "top_left":
            options.pop("causal_alignment")
        chunked = backend.attention(q, k, v, chunk_size=4, **options)
        masked = backend.attention(q, k, v, mask=mask, **options)
        _, tol = oracle_and_tolerance(q, k, v, dtype, mask=mask, **options)
        assert_within(
            chunked,
            masked,
            2 * tol,
            f"{backend.name}: chunk_size=4 against its dense mask ({alignment}, causal={causal})",
            behaviour="chunk_size is not the same as its chunks given as a mask",
        )


@pytest.mark.clause("16.1")
@sizes
@requires("causal_top_left")
def test_no_leakage_across_chunks(backend, size, dtype):
    """Changing the keys and values of one chunk leaves the rows of every other chunk bit
    for bit unchanged."""
    T, S = size["T"], size["S"]
    chunk = 3
    q, k, v = random_qkv(92, T=T, S=S, dtype=dtype)
    base = backend.attention(q, k, v, chunk_size=chunk)
    rows = np.arange(T) // chunk  # (T,): each query's chunk (top-left)
    for c in range((S + chunk - 1) // chunk):
        keys = slice(c * chunk, min((c + 1) * chunk, S))
        k2, v2 = k.copy(), v.copy()
        k2[..., keys, :] = (k2[..., keys, :].astype(np.float64) * -7 + 50).astype(k.dtype)
        v2[..., keys, :] = (v2[..., keys, :].astype(np.float64) * 9 - 30).astype(v.dtype)
        out = backend.attention(q, k2, v2, chunk_size=chunk)
        other = rows != c
        assert_identical(
            out[..., other, :],
            base[..., other, :],
            f"{backend.name}: rows outside chunk {c} after changing keys {keys.start}-"
            f"{keys.stop - 1} (chunk_size={chunk})",
            behaviour="changing the keys of one chunk changes the rows of another",
        )


@pytest.mark.clause("16.2")
@requires("causal_top_left")
def test_chunk_above_every_position_is_no_chunk(backend, dtype):
    """A chunk_size above every key index and query position puts all in chunk 0:
    attention without chunks, bit for bit in the reference's terms (within §7)."""
    q, k, v = random_qkv(93, T=7, S=13, dtype=dtype)
    causal = causal_where_taken(backend, 7, 13)
    plain = backend.attention(q, k, v, **causal)
    out = backend.attention(q, k, v, chunk_size=13, **causal)
    _, tol = oracle_and_tolerance(q, k, v, dtype, **causal)
    assert_within(
        out,
        plain,
        2 * tol,
        f"{backend.name}: chunk_size=13 on T=7, S=13 against no chunks ({dtype})",
        behaviour="a chunk larger than the sequence changes the output",
    )


@pytest.mark.clause("16.3", "4.3")
@dtypes
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param("bool-mask", id="bool-mask"),
        pytest.param(
            "bottom-right-T>S", marks=requires("causal_bottom_right"), id="bottom-right-T>S"
        ),
    ],
)
def test_row_with_no_key_is_zero(backend, dtype, setup):
    """A query whose chunk holds no key it may attend returns exactly 0: a row the mask
    empties, and the queries at negative positions of bottom-right alignment with T > S."""
    if setup == "bool-mask":
        q, k, v = random_qkv(94, T=9, S=9, dtype=dtype)
        # Row 5's chunk is keys 4-7 (chunk_size 4): the mask blocks exactly those.
        mask = np.ones((9, 9), dtype=bool)
        mask[5, 4:8] = False
        options = {"mask": mask}
        empty = np.zeros(9, dtype=bool)
        empty[5] = True
    else:
        q, k, v = random_qkv(94, T=9, S=4, dtype=dtype)
        options = {"causal_alignment": "bottom_right"}
        empty = np.arange(9) - 5 < 0  # positions t + S - T below 0: chunk -1, no key
    out = backend.attention(q, k, v, chunk_size=4, **options)
    assert_rows_zero(
        out, np.broadcast_to(empty, out.shape[:-1]), f"{backend.name}: {setup} ({dtype})", v
    )
    expected, tol = oracle_and_tolerance(q, k, v, dtype, chunk_size=4, **options)
    assert_within(
        out,
        expected,
        tol,
        f"{backend.name}: chunk_size=4, {setup} ({dtype})",
        behaviour="chunked attention differs from the oracle",
    )


# --- The gradient (SPEC §16.3) ---------------------------------------------------------------


def _vjp(backend, q, k, v, d_out, **options) -> dict[str, np.ndarray]:
    mask = options.get("mask")
    names = [n for n in GRADS if n != "dmask" or (mask is not None and mask.dtype != np.bool_)]
    return dict(zip(names, backend.attention_vjp(q, k, v, d_out, **options)))


@pytest.mark.clause("16.3", "12.9")
@dtypes
@pytest.mark.parametrize("setup", setup_params(SETUPS, grad=True, uses={"chunk_size": 1}))
def test_chunked_gradients_match_the_oracle(backend, dtype, setup):
    """dq, dk, dv (dmask) with chunks against the 50-digit oracle, within SPEC §12.9 (the
    naive backward in the dtype against the oracle); the same tuple as without chunks."""
    q, k, v, options = _setup(setup, {"T": 7, "S": 9}, dtype, 95)
    d_out = random_d_out(96, q, v)
    got = _vjp(backend, q, k, v, d_out, chunk_size=3, **options)
    wide = {
        n: as64(x) if isinstance(x, np.ndarray) and x.dtype != bool else x
        for n, x in options.items()
    }
    args = (as64(q), as64(k), as64(v), as64(d_out))
    expected = oracle.attention_vjp(*args, chunk_size=3, **wide)
    naive = oracle.naive_vjp_same_precision(*args, numpy_dtype(dtype), chunk_size=3, **wide)
    n_given = len(backend.attention_vjp(q, k, v, d_out, chunk_size=3, **options))
    expect(
        n_given == len(expected),
        "returns another set of gradients than the spec with chunk_size",
        f"{backend.name}: got {n_given} gradients, expected {list(expected)}",
    )
    likes = {"dq": q, "dk": k, "dv": v, "dmask": options.get("mask")}
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
            f"{backend.name}: {name} with chunk_size=3, {setup} ({dtype})",
            behaviour="the gradients with chunks differ from the oracle",
        )


@pytest.mark.clause("16.3", "12.6")
@requires("grad", "causal_bottom_right")
def test_keys_of_no_query_chunk_get_no_gradient(backend, dtype):
    """Bottom-right with T = 3, S = 12 and chunk_size 4: the queries sit at positions 9-11,
    in chunk 2, so keys 0-7 are attended by none and get dk = dv = 0 exactly; every
    gradient stays finite."""
    q, k, v = random_qkv(97, T=3, S=12, dtype=dtype)
    d_out = random_d_out(98, q, v)
    got = _vjp(backend, q, k, v, d_out, chunk_size=4, causal_alignment="bottom_right")
    for name in ("dq", "dk", "dv"):
        expect(
            np.isfinite(got[name]).all(),
            "a gradient with chunks is not finite",
            f"{backend.name}: {name} has non-finite entries",
        )
    for name in ("dk", "dv"):
        expect(
            (got[name][..., :8, :] == 0).all(),
            "keys outside every query's chunk receive gradient",
            f"{backend.name}: {name} of keys 0-7 (no query's chunk) is not 0",
        )


# --- Errors (SPEC §16.1) ---------------------------------------------------------------------


@pytest.mark.clause("16.1", "8.1", "8.4")
def test_bad_chunk_size_is_refused(backend, dtype):
    """chunk_size 0 or below raises ValueError; a bool, a float or a string TypeError."""
    q, k, v = random_qkv(99, T=5, S=6, dtype=dtype)
    bad = {
        "0": (0, ValueError),
        "-2": (-2, ValueError),
        "True": (True, TypeError),
        "2.0": (2.0, TypeError),
        "'4'": ("4", TypeError),
    }
    for what, (value, error) in bad.items():
        _expect_error(backend, error, what, q, k, v, value)


def _expect_error(backend, error: type, what: str, q, k, v, value) -> None:
    try:
        backend.attention(q, k, v, chunk_size=value)
    except error as err:
        if "error_messages" in backend.capabilities:
            expect(
                "chunk_size" in str(err),
                "refuses a bad chunk_size without naming it",
                f"{backend.name}: the error for chunk_size={what} should name chunk_size: {err}",
            )
        return
    except SuiteError:
        raise
    except Exception as err:
        raise Departure(
            f"{backend.name}: raised {type(err).__name__} for chunk_size={what}: {err}",
            f"raises {type(err).__name__}, not {error.__name__}, for chunk_size={what}",
        ) from err
    raise Departure(f"{backend.name}: accepted chunk_size={what}", f"accepts chunk_size={what}")
