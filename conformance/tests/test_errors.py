"""SPEC §8: bad input raises ValueError or TypeError naming the argument, the expected
shape in letters and numbers, and what was given."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import DTYPES, numpy_dtype
from conformance.suite.helpers import random_qkv
from conformance.suite.requirements import SuiteError, requires, value_dims
from conformance.suite.tolerance import Departure, expect

B, H, T, S, D = 2, 4, 5, 6, 3
#: The value head dim of the valid call each case spoils, where the backend declares E ≠ D.
E_DISTINCT = 2


def _qkv(backend, dtype):
    _, E = value_dims(backend, D, E_DISTINCT)
    return random_qkv(0, B=B, H=H, T=T, S=S, D=D, E=E, dtype=dtype)


def _case(name, what, error, fragments, mutate, needs=()):
    """A bad call: ``what`` it is in words (for the behaviour a failure names), the spec's
    exception type, fragments its message must hold, and how it spoils a valid call."""
    marks = [requires(*needs)] if needs else []
    return pytest.param(what, error, fragments, mutate, id=name, marks=marks)


def _other_dtype(backend, dtype: str) -> str:
    """A second dtype for the mixed-dtypes case: one the backend declares if it has two."""
    declared = [d for d in backend.dtypes if d != dtype]
    return declared[0] if declared else next(d for d in DTYPES if d != dtype)


# Each case: the exception type, fragments the message must contain ({E}: v's head dim;
# {dtype}, {other}: q's dtype and the other one), and a function turning valid
# (q, k, v, options) into the bad call.
CASES = [
    _case(
        "q-rank-2",
        "a q of rank 2",
        ValueError,
        ["q", "(B, H, T, D)", "(5, 3)"],
        lambda q, k, v, o: (q[0, 0], k, v, o),
    ),
    _case(
        "q-rank-5",
        "a q of rank 5",
        ValueError,
        ["q", "(B, H, T, D)", "(1, 2, 4, 5, 3)"],
        lambda q, k, v, o: (q[None], k, v, o),
    ),
    _case(
        "k-rank",
        "a k of rank 3 beside a q of rank 4",
        ValueError,
        ["k", "(B, K, S, D)", "(4, 6, 3)"],
        lambda q, k, v, o: (q, k[0], v, o),
    ),
    _case(
        "v-rank",
        "a v of rank 3 beside a q of rank 4",
        ValueError,
        ["v", "(4, 6, {E})"],
        lambda q, k, v, o: (q, k, v[0], o),
    ),
    _case(
        "head-dim-differs",
        "a k whose head dim differs from q's",
        ValueError,
        ["k", "(B, K, S, D)", "(2, 4, 6, 3)", "(2, 4, 6, 4)"],
        lambda q, k, v, o: (q, np.concatenate([k, k[..., :1]], -1), v, o),
    ),
    _case(
        "kv-length-differs",
        "a v whose length differs from k's",
        ValueError,
        ["v", "(B, K, S, E)", "(2, 4, 6, {E})", "(2, 4, 5, {E})"],
        lambda q, k, v, o: (q, k, v[..., :5, :], o),
    ),
    _case(
        "k-length-differs",
        "a k whose length differs from v's",
        ValueError,
        ["k (2, 4, 5, 3) with S=5", "v (2, 4, 6, {E}) with S=6"],
        lambda q, k, v, o: (q, k[..., :5, :], v, o),
    ),
    _case(
        "batch-differs",
        "k and v with another batch size than q",
        ValueError,
        ["k", "(B, K, S, D)", "(1, 4, 6, 3)"],
        lambda q, k, v, o: (q, k[:1], v[:1], o),
    ),
    _case(
        "heads-not-dividing",
        "K key/value heads that do not divide H",
        ValueError,
        ["K=3", "H=4", "(2, 3, 6, 3)"],
        lambda q, k, v, o: (q, k[:, :3], v[:, :3], o),
    ),
    _case(
        "kv-heads-differ",
        "v with another head count than k",
        ValueError,
        ["v", "(B, K, S, E)", "(2, 2, 6, {E})"],
        lambda q, k, v, o: (q, k, v[:, :2], o),
    ),
    _case(
        "mask-not-broadcasting",
        "a mask that does not broadcast to (B, H, T, S)",
        ValueError,
        ["mask", "(B, H, T, S)", "(2, 4, 5, 6)", "(5, 5)"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((5, 5), bool)}),
    ),
    _case(
        "mask-rank-5",
        "a mask of rank 5",
        ValueError,
        ["mask", "(B, H, T, S)", "(1, 2, 4, 5, 6)"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((1, 2, 4, 5, 6), bool)}),
    ),
    _case(
        "integer-mask",
        "an int64 mask",
        TypeError,
        ["mask", "bool", "floating", "int64"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((T, S), np.int64)}),
    ),
    _case(
        "uint8-mask",
        "a uint8 mask",
        TypeError,
        ["mask", "bool", "uint8"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((T, S), np.uint8)}),
    ),
    _case(
        "scale-zero",
        "scale = 0",
        ValueError,
        ["scale", "positive", "0.0"],
        lambda q, k, v, o: (q, k, v, {**o, "scale": 0.0}),
        ["scale"],
    ),
    _case(
        "scale-negative",
        "a negative scale",
        ValueError,
        ["scale", "positive", "-1.0"],
        lambda q, k, v, o: (q, k, v, {**o, "scale": -1.0}),
        ["scale"],
    ),
    _case(
        "scale-nan",
        "scale = NaN",
        ValueError,
        ["scale", "positive", "nan"],
        lambda q, k, v, o: (q, k, v, {**o, "scale": float("nan")}),
        ["scale"],
    ),
    _case(
        "integer-inputs",
        "integer q",
        TypeError,
        ["q", "floating", "int64"],
        lambda q, k, v, o: (q.astype(np.int64), k, v, o),
    ),
    _case(
        "mixed-dtypes",
        "q and k of different dtypes",
        TypeError,
        ["k", "{dtype}", "{other}"],
        lambda q, k, v, o: (q, k.astype(o.pop("other")), v, o),
    ),
    _case(
        "bad-alignment",
        "an unknown causal_alignment",
        ValueError,
        ["causal_alignment", "top_left", "'middle'"],
        lambda q, k, v, o: (q, k, v, {**o, "is_causal": True, "causal_alignment": "middle"}),
        ["causal_bottom_right", "causal"],
    ),
    _case(
        "window-negative",
        "a negative window side",
        ValueError,
        ["window", "(left, right)", "(-1, 2)"],
        lambda q, k, v, o: (q, k, v, {**o, "window": (-1, 2)}),
        ["window"],
    ),
    _case(
        "window-not-pair",
        "a window that is not a pair",
        ValueError,
        ["window", "(left, right)", "3"],
        lambda q, k, v, o: (q, k, v, {**o, "window": 3}),
        ["window"],
    ),
    _case(
        "softcap-zero",
        "softcap = 0",
        ValueError,
        ["softcap", "positive", "0.0"],
        lambda q, k, v, o: (q, k, v, {**o, "softcap": 0.0}),
        ["softcap"],
    ),
    _case(
        "dropout-one",
        "dropout_p = 1",
        ValueError,
        ["dropout_p", "[0, 1)", "1.0"],
        lambda q, k, v, o: (q, k, v, {**o, "dropout_p": 1.0, "seed": 0}),
        ["dropout"],
    ),
]


def _refusal(backend, what, error, mutate, dtype) -> str:
    q, k, v = _qkv(backend, dtype)
    q, k, v, options = mutate(q, k, v, {"other": numpy_dtype(_other_dtype(backend, dtype))})
    options.pop("other", None)
    try:
        backend.attention(q, k, v, **options)
    except SuiteError:
        raise
    except Exception as err:
        expect(
            isinstance(err, error),
            f"raises {type(err).__name__}, not {error.__name__}, for {what}",
            f"{backend.name}: raised {type(err).__name__}, expected {error.__name__}: {err}",
        )
        return str(err)
    raise Departure(
        f"{backend.name}: accepted {what}; SPEC §8.1 wants {error.__name__}",
        f"accepts {what} (no error)",
    )


@pytest.mark.clause("8.1", "3.3")
@pytest.mark.parametrize("what, error, fragments, mutate", CASES)
def test_bad_input(backend, what, error, fragments, mutate, dtype):
    """The backend refuses the input with the spec's exception type (the contract)."""
    _refusal(backend, what, error, mutate, dtype)


@pytest.mark.clause("8.3")
@pytest.mark.parametrize("what, error, fragments, mutate", CASES)
@requires("error_messages")
def test_bad_input_message(backend, what, error, fragments, mutate, dtype):
    """The message names the argument, the expected shape and what was given."""
    message = _refusal(backend, what, error, mutate, dtype)
    _, E = value_dims(backend, D, E_DISTINCT)
    other = _other_dtype(backend, dtype)
    wanted = [f.format(E=E, dtype=dtype, other=other) for f in fragments]
    missing = [f for f in wanted if f not in message]
    expect(
        not missing,
        f"its error for {what} does not name the argument, the expected shape and what was given",
        f"{backend.name}: error message lacks {missing}: {message!r}",
    )


def _module_width_error(backend, n_heads: int, dtype: str, C: int = 12) -> str:
    dt = numpy_dtype(dtype)
    params = {
        "qkv.weight": np.zeros((3 * C, C), dtype=dt),
        "qkv.bias": np.zeros(3 * C, dtype=dt),
        "out_proj.weight": np.zeros((C, C), dtype=dt),
        "out_proj.bias": np.zeros(C, dtype=dt),
    }
    try:
        backend.multi_head_attention(params, np.zeros((1, 4, C), dtype=dt), n_heads=n_heads)
    except ValueError as err:
        return str(err)
    raise Departure(
        f"{backend.name}: n_heads={n_heads} with C={C} was accepted; SPEC §8.2 wants ValueError",
        "the multi-head layer accepts a head count that does not divide the width",
    )


@pytest.mark.clause("8.2")
@pytest.mark.parametrize("n_heads", [5, 0], ids=["C%H!=0", "H=0"])
@requires("module")
def test_module_heads_must_divide_width(backend, n_heads, dtype):
    """The multi-head layer with C % H != 0 (or H <= 0) is a ValueError."""
    _module_width_error(backend, n_heads, dtype)


@pytest.mark.clause("8.2", "8.3")
@pytest.mark.parametrize("n_heads", [5, 0], ids=["C%H!=0", "H=0"])
@requires("module", "error_messages")
def test_module_width_message(backend, n_heads, dtype):
    """... whose message names n_heads, H and C."""
    message = _module_width_error(backend, n_heads, dtype)
    missing = [f for f in ("n_heads", f"H={n_heads}", "C=12") if f not in message]
    expect(
        not missing,
        "the multi-head layer's width error does not name n_heads, H and C",
        f"{backend.name}: error message lacks {missing}: {message!r}",
    )
