"""SPEC §8: bad input raises ValueError or TypeError naming the argument, the expected
shape in letters and numbers, and what was given."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.helpers import random_qkv, require

B, H, T, S, D, E = 2, 4, 5, 6, 3, 2


def _qkv():
    return random_qkv(0, B=B, H=H, T=T, S=S, D=D, E=E)


def _case(name, error, fragments, mutate, requires=()):
    return pytest.param(error, fragments, mutate, requires, id=name)


# Each case: the exception type, fragments the message must contain, and a function
# turning valid (q, k, v, options) into the bad call.
CASES = [
    _case(
        "q-rank-2",
        ValueError,
        ["q", "(B, H, T, D)", "(5, 3)"],
        lambda q, k, v, o: (q[0, 0], k, v, o),
    ),
    _case(
        "q-rank-5",
        ValueError,
        ["q", "(B, H, T, D)", "(1, 2, 4, 5, 3)"],
        lambda q, k, v, o: (q[None], k, v, o),
    ),
    _case(
        "k-rank", ValueError, ["k", "(B, K, S, D)", "(4, 6, 3)"], lambda q, k, v, o: (q, k[0], v, o)
    ),
    _case("v-rank", ValueError, ["v", "(4, 6, 2)"], lambda q, k, v, o: (q, k, v[0], o)),
    _case(
        "head-dim-differs",
        ValueError,
        ["k", "(B, K, S, D)", "(2, 4, 6, 3)", "(2, 4, 6, 4)"],
        lambda q, k, v, o: (q, np.concatenate([k, k[..., :1]], -1), v, o),
    ),
    _case(
        "kv-length-differs",
        ValueError,
        ["v", "(B, K, S, E)", "(2, 4, 6, 2)", "(2, 4, 5, 2)"],
        lambda q, k, v, o: (q, k, v[..., :5, :], o),
    ),
    _case(
        "k-length-differs",
        ValueError,
        ["k (2, 4, 5, 3) with S=5", "v (2, 4, 6, 2) with S=6"],
        lambda q, k, v, o: (q, k[..., :5, :], v, o),
    ),
    _case(
        "batch-differs",
        ValueError,
        ["k", "(B, K, S, D)", "(1, 4, 6, 3)"],
        lambda q, k, v, o: (q, k[:1], v[:1], o),
    ),
    _case(
        "heads-not-dividing",
        ValueError,
        ["K=3", "H=4", "(2, 3, 6, 3)"],
        lambda q, k, v, o: (q, k[:, :3], v[:, :3], o),
    ),
    _case(
        "kv-heads-differ",
        ValueError,
        ["v", "(B, K, S, E)", "(2, 2, 6, 2)"],
        lambda q, k, v, o: (q, k, v[:, :2], o),
    ),
    _case(
        "mask-not-broadcasting",
        ValueError,
        ["mask", "(B, H, T, S)", "(2, 4, 5, 6)", "(5, 5)"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((5, 5), bool)}),
    ),
    _case(
        "mask-rank-5",
        ValueError,
        ["mask", "(B, H, T, S)", "(1, 2, 4, 5, 6)"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((1, 2, 4, 5, 6), bool)}),
    ),
    _case(
        "integer-mask",
        TypeError,
        ["mask", "bool", "floating", "int64"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((T, S), np.int64)}),
    ),
    _case(
        "uint8-mask",
        TypeError,
        ["mask", "bool", "uint8"],
        lambda q, k, v, o: (q, k, v, {**o, "mask": np.ones((T, S), np.uint8)}),
    ),
    _case(
        "scale-zero",
        ValueError,
        ["scale", "positive", "0.0"],
        lambda q, k, v, o: (q, k, v, {**o, "scale": 0.0}),
    ),
    _case(
        "scale-negative",
        ValueError,
        ["scale", "positive", "-1.0"],
        lambda q, k, v, o: (q, k, v, {**o, "scale": -1.0}),
    ),
    _case(
        "scale-nan",
        ValueError,
        ["scale", "positive", "nan"],
        lambda q, k, v, o: (q, k, v, {**o, "scale": float("nan")}),
    ),
    _case(
        "integer-inputs",
        TypeError,
        ["q", "floating", "int64"],
        lambda q, k, v, o: (q.astype(np.int64), k, v, o),
    ),
    _case(
        "mixed-dtypes",
        TypeError,
        ["k", "float64", "float32"],
        lambda q, k, v, o: (q, k.astype(np.float32), v, o),
    ),
    _case(
        "bad-alignment",
        ValueError,
        ["causal_alignment", "top_left", "'middle'"],
        lambda q, k, v, o: (q, k, v, {**o, "is_causal": True, "causal_alignment": "middle"}),
        ("causal_bottom_right",),
    ),
    _case(
        "window-negative",
        ValueError,
        ["window", "(left, right)", "(-1, 2)"],
        lambda q, k, v, o: (q, k, v, {**o, "window": (-1, 2)}),
        ("window",),
    ),
    _case(
        "window-not-pair",
        ValueError,
        ["window", "(left, right)", "3"],
        lambda q, k, v, o: (q, k, v, {**o, "window": 3}),
        ("window",),
    ),
    _case(
        "softcap-zero",
        ValueError,
        ["softcap", "positive", "0.0"],
        lambda q, k, v, o: (q, k, v, {**o, "softcap": 0.0}),
        ("softcap",),
    ),
    _case(
        "dropout-one",
        ValueError,
        ["dropout_p", "[0, 1)", "1.0"],
        lambda q, k, v, o: (q, k, v, {**o, "dropout_p": 1.0, "seed": 0}),
        ("dropout",),
    ),
]


def _refusal(backend, error, mutate, requires) -> str:
    require(backend, *requires)
    q, k, v, options = mutate(*_qkv(), {})
    with pytest.raises((ValueError, TypeError)) as info:
        backend.attention(q, k, v, **options)
    message = str(info.value)
    assert isinstance(info.value, error), (
        f"{backend.name}: raised {type(info.value).__name__}, expected {error.__name__}: {message}"
    )
    return message


@pytest.mark.clause("8.1", "3.3")
@pytest.mark.parametrize("error, fragments, mutate, requires", CASES)
def test_bad_input(backend, error, fragments, mutate, requires):
    """The backend refuses the input with the spec's exception type (the contract)."""
    _refusal(backend, error, mutate, requires)


@pytest.mark.clause("8.3")
@pytest.mark.parametrize("error, fragments, mutate, requires", CASES)
def test_bad_input_message(backend, error, fragments, mutate, requires):
    """The message names the argument, the expected shape and what was given."""
    require(backend, "error_messages")
    message = _refusal(backend, error, mutate, requires)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{backend.name}: error message lacks {missing}: {message!r}"


def _module_width_error(backend, n_heads: int, C: int = 12) -> str:
    require(backend, "module")
    params = {
        "qkv.weight": np.zeros((3 * C, C)),
        "qkv.bias": np.zeros(3 * C),
        "out_proj.weight": np.zeros((C, C)),
        "out_proj.bias": np.zeros(C),
    }
    with pytest.raises(ValueError) as info:
        backend.multi_head_attention(params, np.zeros((1, 4, C)), n_heads=n_heads)
    return str(info.value)


@pytest.mark.clause("8.2")
@pytest.mark.parametrize("n_heads", [5, 0], ids=["C%H!=0", "H=0"])
def test_module_heads_must_divide_width(backend, n_heads):
    """The multi-head layer with C % H != 0 (or H <= 0) is a ValueError."""
    _module_width_error(backend, n_heads)


@pytest.mark.clause("8.2", "8.3")
@pytest.mark.parametrize("n_heads", [5, 0], ids=["C%H!=0", "H=0"])
def test_module_width_message(backend, n_heads):
    """... whose message names n_heads, H and C."""
    require(backend, "error_messages")
    message = _module_width_error(backend, n_heads)
    for fragment in ("n_heads", f"H={n_heads}", "C=12"):
        assert fragment in message, f"{backend.name}: error message lacks {fragment!r}: {message!r}"
