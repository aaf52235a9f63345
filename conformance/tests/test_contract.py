"""SPEC §8.4-8.6: one input contract. Odd values get one answer on every backend, and an
option a backend does not declare is refused with NotImplementedError.

Each case of the battery states the answer the spec gives (an output, or an exception
type), and every pair of backends must give that answer, and the same output within
twice SPEC §7's tolerance where there is one. The expectations come from the spec's
rules (§8.1, §8.4), not from any backend's behaviour.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conformance.adapters.forms import forms_used
from conformance.backends import numpy_dtype
from conformance.fixtures.oracle import naive_same_precision
from conformance.suite.helpers import random_qkv, random_tolerance
from conformance.suite.requirements import refuses, requires, uses_dtype, value_dims
from conformance.suite.tolerance import Departure, assert_within, expect

B, H, T, S, D = 2, 4, 5, 6, 3
OUT = "output"


def _qkv(backends, dtype: str):
    D_, E = value_dims(backends, D, 2)
    return random_qkv(40, B=B, H=H, T=T, S=S, D=D_, E=E, dtype=dtype)


def _case(name, expected, options=None, inputs=None, needs=(), normal=None, dtypes=()):
    """A battery case: the options (or a function of q, k, v giving new q, k, v), the
    spec's answer, the capabilities and dtypes it needs beyond the test's own, and the
    options in their normal form for the tolerance's naive run (default: the options
    themselves). The forms of the core the options use are needed too (SPEC §13.17)."""
    try:
        needs = (*needs, *forms_used({**(options or {}), **(normal or {})}, T, S))
    except (TypeError, ValueError):  # a malformed window: no form can be read from it
        pass
    marks = [requires(*needs)] if needs else []
    if dtypes:
        marks.append(uses_dtype(*dtypes))
    return pytest.param(name, expected, options or {}, inputs, normal, id=name, marks=marks)


# --- Numbers (§8.4): Python and NumPy scalars alike, 0-d arrays, bool is not a number -------

NUMBERS = [
    _case("scale-np-float32", OUT, {"scale": np.float32(0.5)}, normal={"scale": 0.5}),
    _case("scale-np-float64", OUT, {"scale": np.float64(0.5)}, normal={"scale": 0.5}),
    _case("scale-int", OUT, {"scale": 1}, normal={"scale": 1.0}),
    _case("scale-np-int64", OUT, {"scale": np.int64(2)}, normal={"scale": 2.0}),
    _case("scale-0d-array", OUT, {"scale": np.array(0.5)}, normal={"scale": 0.5}),
    _case("scale-huge", OUT, {"scale": 1e30}),
    _case("scale-tiny", OUT, {"scale": 5e-324}),
    _case("scale-bool", TypeError, {"scale": True}),
    _case("scale-np-bool", TypeError, {"scale": np.bool_(True)}),
    _case("scale-string", TypeError, {"scale": "0.5"}),
    _case("scale-complex", TypeError, {"scale": 0.5 + 0j}),
    _case("scale-1-element-array", TypeError, {"scale": np.array([0.5])}),
    _case("scale-minus-zero", ValueError, {"scale": -0.0}),
    _case("scale-inf", ValueError, {"scale": math.inf}),
    _case("scale-np-nan", ValueError, {"scale": np.float32("nan")}),
    _case(
        "softcap-np-float32",
        OUT,
        {"softcap": np.float32(2.0)},
        needs=("softcap",),
        normal={"softcap": 2.0},
    ),
    _case(
        "softcap-0d-array",
        OUT,
        {"softcap": np.array(2.0)},
        needs=("softcap",),
        normal={"softcap": 2.0},
    ),
    _case("softcap-int", OUT, {"softcap": 2}, needs=("softcap",), normal={"softcap": 2.0}),
    _case("softcap-huge", OUT, {"softcap": 1e300}, needs=("softcap",)),
    _case("softcap-smallest-normal", OUT, {"softcap": 2.0**-1022}, needs=("softcap",)),
    _case("softcap-subnormal", ValueError, {"softcap": 5e-324}, needs=("softcap",)),
    _case(
        "softcap-subnormal-float32",
        ValueError,
        {"softcap": 1e-40},
        inputs=lambda q, k, v: (x.astype(np.float32) for x in (q, k, v)),
        needs=("softcap",),
        dtypes=("float32",),
    ),
    _case(
        "softcap-smallest-normal-float32",
        OUT,
        {"softcap": 2.0**-126},
        # q = 0: every score is 0, and 0 / softcap is where a flushed softcap gives NaN.
        inputs=lambda q, k, v: (
            np.zeros_like(x, dtype=np.float32) if x is q else x.astype(np.float32)
            for x in (q, k, v)
        ),
        needs=("softcap",),
        dtypes=("float32",),
    ),
    _case("softcap-bool", TypeError, {"softcap": True}, needs=("softcap",)),
    _case("softcap-np-bool", TypeError, {"softcap": np.bool_(True)}, needs=("softcap",)),
    _case("softcap-string", TypeError, {"softcap": "2"}, needs=("softcap",)),
    _case("softcap-minus-zero", ValueError, {"softcap": -0.0}, needs=("softcap",)),
    _case("softcap-inf", ValueError, {"softcap": math.inf}, needs=("softcap",)),
    _case("dropout-bool", TypeError, {"dropout_p": True, "seed": 0}, needs=("dropout",)),
    _case("dropout-string", TypeError, {"dropout_p": "0.1", "seed": 0}, needs=("dropout",)),
    _case("dropout-none", TypeError, {"dropout_p": None, "seed": 0}, needs=("dropout",)),
    _case(
        "dropout-np-one",
        ValueError,
        {"dropout_p": np.float32(1.0), "seed": 0},
        needs=("dropout",),
    ),
    _case("dropout-nan", ValueError, {"dropout_p": math.nan, "seed": 0}, needs=("dropout",)),
    _case("dropout-negative", ValueError, {"dropout_p": -0.5, "seed": 0}, needs=("dropout",)),
    _case("is-causal-np-bool", OUT, {"is_causal": np.bool_(True)}, normal={"is_causal": True}),
    _case("is-causal-0d-array", OUT, {"is_causal": np.array(True)}, normal={"is_causal": True}),
    _case("is-causal-int", TypeError, {"is_causal": 1}),
    _case("is-causal-np-int", TypeError, {"is_causal": np.int64(1)}),
    _case("is-causal-string", TypeError, {"is_causal": "yes"}),
    _case("is-causal-none", TypeError, {"is_causal": None}),
    _case(
        "window-np-ints",
        OUT,
        {"window": (np.int64(2), None)},
        needs=("window",),
        normal={"window": (2, None)},
    ),
    _case("window-list", OUT, {"window": [2, 1]}, needs=("window",), normal={"window": (2, 1)}),
    _case(
        "window-0d-array",
        OUT,
        {"window": (np.array(2), 0)},
        needs=("window",),
        normal={"window": (2, 0)},
    ),
    _case("window-float-side", TypeError, {"window": (2.0, 1)}, needs=("window",)),
    _case("window-bool-side", TypeError, {"window": (True, 1)}, needs=("window",)),
    _case("window-string-side", TypeError, {"window": ("2", 1)}, needs=("window",)),
    _case("window-negative", ValueError, {"window": (-1, 0)}, needs=("window",)),
    _case("window-int", ValueError, {"window": 3}, needs=("window",)),
    _case("window-triple", ValueError, {"window": (1, 2, 3)}, needs=("window",)),
    _case(
        "alignment-np-str",
        OUT,
        {"is_causal": True, "causal_alignment": np.str_("bottom_right")},
        needs=("causal_bottom_right",),
        normal={"is_causal": True, "causal_alignment": "bottom_right"},
    ),
    _case(
        "alignment-upper-case",
        ValueError,
        {"is_causal": True, "causal_alignment": "BOTTOM_RIGHT"},
        needs=("causal_bottom_right",),
    ),
]


# --- Masks of every dtype and rank (§3.1-3.3, §8.1) ----------------------------------------


def _mask(shape, dtype):
    rng = np.random.default_rng(41)
    if dtype == "bool":
        return rng.random(shape) < 0.7
    return rng.integers(0, 2, shape).astype(numpy_dtype(dtype))


MASK_DTYPES = [
    _case(
        f"mask-{dtype}",
        OUT,
        {"mask": _mask((T, S), dtype)},
        dtypes=() if dtype == "bool" else (dtype,),
    )
    for dtype in ("bool", "float16", "float32", "float64", "bfloat16")
] + [
    _case(f"mask-{dtype}", TypeError, {"mask": _mask((T, S), dtype)})
    for dtype in (
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "complex64",
    )
]
MASK_SHAPES = [
    _case("mask-0d", OUT, {"mask": np.array(True)}),
    _case("mask-S", OUT, {"mask": _mask((S,), "bool")}),
    _case("mask-T1", OUT, {"mask": _mask((T, 1), "bool")}),
    _case("mask-HTS", OUT, {"mask": _mask((H, T, S), "bool")}),
    _case("mask-B1TS", OUT, {"mask": _mask((B, 1, T, S), "float32")}, dtypes=("float32",)),
    _case("mask-1H1S", OUT, {"mask": _mask((1, H, 1, S), "bool")}),
    _case("mask-list", OUT, {"mask": _mask((T, S), "bool").tolist()}),
    _case("mask-rank-5", ValueError, {"mask": _mask((1, B, H, T, S), "bool")}),
    _case("mask-too-long", ValueError, {"mask": _mask((T, S + 1), "bool")}),
    _case("mask-H-for-B", ValueError, {"mask": _mask((H, 1, T, S), "bool")}),
]


# --- Inputs that are not plain C-ordered writable arrays -----------------------------------


def _read_only(q, k, v):
    for x in (q, k, v):
        x.setflags(write=False)
    return q, k, v


INPUTS = [
    _case("inputs-lists", OUT, inputs=lambda q, k, v: (q.tolist(), k.tolist(), v.tolist())),
    _case(
        "inputs-non-contiguous",
        OUT,
        inputs=lambda q, k, v: tuple(np.repeat(x, 2, axis=-1)[..., ::2] for x in (q, k, v)),
    ),
    _case(
        "inputs-transposed-views",
        OUT,
        inputs=lambda q, k, v: tuple(
            np.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2) for x in (q, k, v)
        ),
    ),
    _case(
        "inputs-fortran-order", OUT, inputs=lambda q, k, v: tuple(map(np.asfortranarray, (q, k, v)))
    ),
    _case("inputs-read-only", OUT, inputs=_read_only),
]


def _outcome(backend, q, k, v, options):
    """(what the call gave: an exception type's name or "output", the output or None)."""
    try:
        return OUT, backend.attention(q, k, v, **options)
    except Exception as err:  # any exception at all is an answer to compare
        return type(err).__name__, None


@pytest.mark.clause("8.4")
@pytest.mark.pairwise
@pytest.mark.parametrize(
    "name, expected, options, inputs, normal", NUMBERS + MASK_DTYPES + MASK_SHAPES + INPUTS
)
def test_odd_values_get_one_answer(backend_pair, name, expected, options, inputs, normal, dtype):
    """Both backends give the spec's answer: the same exception type, or outputs that agree."""
    a, b = backend_pair
    q, k, v = _qkv(backend_pair, dtype)
    if inputs is not None:
        q, k, v = inputs(q, k, v)
    want = expected if expected == OUT else expected.__name__
    (got_a, out_a), (got_b, out_b) = (_outcome(x, q, k, v, dict(options)) for x in (a, b))
    expect(
        (got_a, got_b) == (want, want),
        f"answers the odd value {name} otherwise than the spec's {want}",
        f"options {options!r}: the spec's answer is {want}; {a.name} gave {got_a}, "
        f"{b.name} gave {got_b}",
    )
    if want == OUT:
        plain = {n: o for n, o in {**options, **(normal or {})}.items() if n != "seed"}
        if "mask" in plain:
            plain["mask"] = np.asarray(plain["mask"])
        q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        tol = random_tolerance(q64, k64, v64, np.asarray(q).dtype.name, **plain)
        # Each within the tolerance of the float64 naive run, so that two backends that
        # agree on a wrong answer (NaN where both read a flushed softcap) still fail.
        ref = naive_same_precision(q64, k64, v64, np.float64, **plain)
        for who, out in ((a.name, out_a), (b.name, out_b)):
            assert_within(
                out,
                ref,
                tol,
                f"{who} with {options!r}",
                behaviour=f"gets the odd value {name} wrong",
            )
        assert_within(
            out_a,
            out_b,
            2 * tol,
            f"{a.name} vs {b.name} with {options!r}",
            behaviour="two backends disagree on the same random inputs",
        )


# --- Options a backend does not declare (§8.5) ---------------------------------------------

UNDECLARED = {
    "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "window": {"window": (2, 1)},
    "softcap": {"softcap": 2.0},
    "dropout": {"dropout_p": 0.5, "seed": 0},
}


@pytest.mark.clause("8.5")
@pytest.mark.parametrize(
    "capability", [pytest.param(cap, marks=refuses(cap)) for cap in UNDECLARED]
)
def test_undeclared_option_is_refused(backend, capability, dtype):
    """An option whose capability the backend lacks raises NotImplementedError naming it."""
    options = UNDECLARED[capability]
    option = next(name for name in options if name not in ("is_causal", "seed"))
    try:
        backend.attention(*_qkv(backend, dtype), **options)
    except NotImplementedError as err:
        expect(
            option in str(err),
            f"refuses {option} without naming it",
            f"{backend.name}: the refusal should name {option!r}: {err}",
        )
        return
    raise Departure(
        f"{backend.name}: accepted {options!r} without declaring {capability!r}",
        f"accepts {option} though it does not declare {capability!r}",
    )


@pytest.mark.clause("8.5")
@pytest.mark.refusal
def test_undeclared_backward_is_refused(backend, dtype):
    """A backend without the 'grad' capability refuses attention_vjp with
    NotImplementedError; one without 'grad_softcap' refuses softcap in it."""
    q, k, v = _qkv(backend, dtype)
    d_out = np.ones((B, H, T, v.shape[-1]), dtype=q.dtype)
    if "grad" not in backend.capabilities:
        _expect_refusal(backend, "attention_vjp", "'grad'", q, k, v, d_out)
    elif "softcap" in backend.capabilities and "grad_softcap" not in backend.capabilities:
        _expect_refusal(
            backend, "softcap in attention_vjp", "'grad_softcap'", q, k, v, d_out, softcap=2.0
        )
    else:
        pytest.skip(f"{backend.name} declares every gradient option it has: nothing to refuse")


def _expect_refusal(backend, what: str, capability: str, *args, **options) -> None:
    try:
        backend.attention_vjp(*args, **options)
    except NotImplementedError:
        return
    raise Departure(
        f"{backend.name}: {what} ran without declaring {capability}",
        f"accepts {what} though it does not declare {capability}",
    )


@pytest.mark.clause("15.6", "8.5")
@refuses("sinks")
def test_undeclared_sinks_are_refused(backend, dtype):
    """A backend without 'sinks' refuses a sinks array with NotImplementedError naming it."""
    q, k, v = _qkv(backend, dtype)
    try:
        backend.attention(q, k, v, sinks=np.zeros(H, dtype=q.dtype))
    except NotImplementedError as err:
        expect(
            "sinks" in str(err),
            "refuses sinks without naming them",
            f"{backend.name}: the refusal should name sinks: {err}",
        )
        return
    raise Departure(
        f"{backend.name}: accepted sinks without declaring 'sinks'",
        "accepts sinks though it does not declare 'sinks'",
    )


@pytest.mark.clause("16.4", "8.5")
@refuses("chunked")
def test_undeclared_chunk_size_is_refused(backend, dtype):
    """A backend without 'chunked' refuses a chunk_size with NotImplementedError naming it,
    in attention and, where it has one, in attention_vjp."""
    q, k, v = _qkv(backend, dtype)
    calls = {"attention": lambda: backend.attention(q, k, v, chunk_size=2)}
    if "grad" in backend.capabilities:
        d_out = np.ones((B, H, T, v.shape[-1]), dtype=q.dtype)
        calls["attention_vjp"] = lambda: backend.attention_vjp(q, k, v, d_out, chunk_size=2)
    for method, call in calls.items():
        try:
            call()
        except NotImplementedError as err:
            expect(
                "chunk_size" in str(err),
                "refuses chunk_size without naming it",
                f"{backend.name}: the refusal in {method} should name chunk_size: {err}",
            )
            continue
        raise Departure(
            f"{backend.name}: {method} accepted chunk_size without declaring 'chunked'",
            "accepts chunk_size though it does not declare 'chunked'",
        )


@pytest.mark.clause("17.4", "8.5")
@refuses("alibi")
def test_undeclared_alibi_slopes_are_refused(backend, dtype):
    """A backend without 'alibi' refuses alibi_slopes with NotImplementedError naming them,
    in attention and, where it has one, in attention_vjp."""
    q, k, v = _qkv(backend, dtype)
    slopes = np.full(H, 0.5, dtype=np.float32)
    calls = {"attention": lambda: backend.attention(q, k, v, alibi_slopes=slopes)}
    if "grad" in backend.capabilities:
        d_out = np.ones((B, H, T, v.shape[-1]), dtype=q.dtype)
        calls["attention_vjp"] = lambda: backend.attention_vjp(q, k, v, d_out, alibi_slopes=slopes)
    for method, call in calls.items():
        try:
            call()
        except NotImplementedError as err:
            expect(
                "alibi_slopes" in str(err),
                "refuses alibi_slopes without naming them",
                f"{backend.name}: the refusal in {method} should name alibi_slopes: {err}",
            )
            continue
        raise Departure(
            f"{backend.name}: {method} accepted alibi_slopes without declaring 'alibi'",
            "accepts alibi_slopes though it does not declare 'alibi'",
        )


@pytest.mark.clause("18.6", "8.5")
@refuses("packed")
def test_undeclared_packed_is_refused(backend, dtype):
    """A backend without 'packed' refuses attention_packed (and attention_packed_vjp) with
    NotImplementedError naming it."""
    q, k, v = (x[0] for x in _qkv(backend, dtype))  # unbatched: (H, T, D), (H, S, D), ...
    cu_q, cu_k = np.array([0, 2, T]), np.array([0, 3, S])
    d_out = np.ones((H, T, v.shape[-1]), dtype=q.dtype)
    calls = {
        "attention_packed": lambda: backend.attention_packed(q, k, v, cu_q, cu_k),
        "attention_packed_vjp": lambda: backend.attention_packed_vjp(q, k, v, cu_q, cu_k, d_out),
    }
    for method, call in calls.items():
        try:
            call()
        except NotImplementedError as err:
            expect(
                "attention_packed" in str(err),
                "refuses attention_packed without naming it",
                f"{backend.name}: the refusal of {method} should name attention_packed: {err}",
            )
            continue
        raise Departure(
            f"{backend.name}: {method} ran without declaring 'packed'",
            "accepts attention_packed though it does not declare 'packed'",
        )


@pytest.mark.clause("19.6", "8.5")
@refuses("paged")
def test_undeclared_paged_attention_is_refused(backend, dtype):
    """A backend without 'paged' refuses attention_paged (and attention_paged_vjp) with
    NotImplementedError naming attention_paged, once the call is a valid one (§19.5)."""
    dt = numpy_dtype(dtype)
    rng = np.random.default_rng(41)
    q = rng.standard_normal((B, H, T, D)).astype(dt)
    k_pages = rng.standard_normal((4, H, 3, D)).astype(dt)
    v_pages = rng.standard_normal((4, H, 3, D)).astype(dt)
    table, lens = np.array([[2, 0], [1, -1]]), np.array([6, 3])
    d_out = np.ones((B, H, T, D), dtype=dt)
    calls = {
        "attention_paged": lambda: backend.attention_paged(q, k_pages, v_pages, table, lens),
        "attention_paged_vjp": lambda: backend.attention_paged_vjp(
            q, k_pages, v_pages, table, lens, d_out
        ),
    }
    for method, call in calls.items():
        try:
            call()
        except NotImplementedError as err:
            expect(
                "attention_paged" in str(err),
                "refuses attention_paged without naming it",
                f"{backend.name}: the refusal in {method} should name attention_paged: {err}",
            )
            continue
        raise Departure(
            f"{backend.name}: {method} ran without declaring 'paged'",
            "runs attention_paged though it does not declare 'paged'",
        )
