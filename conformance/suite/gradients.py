"""What the gradient tests (``conformance/tests/test_gradients.py``, SPEC §12) share: the
backward call by gradient name, a random upstream gradient, and the §12.9 tolerances
for inputs without a fixture (the naive backward in float64 standing in for the oracle)."""

from __future__ import annotations

import numpy as np

from conformance.suite.tolerance import tolerance
from conformance.vocabulary import numpy_dtype

GRADS = ("dq", "dk", "dv", "dmask")


def vjp(backend, q, k, v, d_out, **options) -> dict[str, np.ndarray]:
    grads = list(backend.attention_vjp(q, k, v, d_out, **options))
    # With sinks, dsinks comes last, after dmask if there is one (SPEC §15.5).
    last = {"dsinks": grads.pop()} if options.get("sinks") is not None else {}
    return {**dict(zip(GRADS, grads)), **last}


def random_d_out(seed: int, q: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A standard-normal upstream gradient shaped like the output (B, H, T, E)."""
    shape = (*q.shape[:-1], v.shape[-1])
    return np.random.default_rng(seed).standard_normal(shape).astype(q.dtype)


def grad_tolerances(q, k, v, d_out, dtype: str, **options) -> dict[str, float]:
    """SPEC §12.9 for inputs without a fixture: the naive backward in ``dtype`` against the
    same naive backward in float64, standing in for the oracle (as SPEC §7.2)."""
    from conformance.fixtures.oracle import naive_vjp_same_precision

    ref = naive_vjp_same_precision(q, k, v, d_out, np.float64, **options)
    low = naive_vjp_same_precision(q, k, v, d_out, numpy_dtype(dtype), **options)
    return {
        n: tolerance(dtype, float(np.max(np.abs(low[n] - ref[n]), initial=0.0)), ref[n])
        for n in ref
    }


def module_grads(backend, case, d_out):
    H = case.meta["shape"]["H"]
    x = case.arrays["x"].astype(case.dtype)
    return backend.module_param_grads(
        case.meta["kind"], case.params(), x, d_out, n_heads=H, is_causal=case.meta["is_causal"]
    )


def module_reference(case, d_out):
    """The naive float64 backward (standing in for the oracle) and SPEC §12.9 tolerances."""
    from conformance.fixtures.oracle import naive_module_vjp_same_precision

    H = case.meta["shape"]["H"]
    x = case.arrays["x"].astype(case.dtype)
    args = (case.meta["kind"], case.params(), x, d_out)
    opts = {"n_heads": H, "is_causal": case.meta["is_causal"]}
    ref = naive_module_vjp_same_precision(*args, np.float64, **opts)
    low = naive_module_vjp_same_precision(*args, case.dtype, **opts)
    tols = {n: tolerance(case.dtype, float(np.max(np.abs(low[n] - ref[n]))), ref[n]) for n in ref}
    return ref, tols


#: The setups of §12.7's sums (test_gradient_sums): options, and the capabilities they need.
SUM_SETUPS = {
    "plain": ({}, ()),
    "causal-mqa": ({"is_causal": True, "K": 1}, ("gqa",)),
    "bool-mask-empty-rows": ({"mask": "bool"}, ()),
    "gqa-bottom-right-T>S": (
        {"is_causal": True, "causal_alignment": "bottom_right", "K": 1},
        ("gqa", "causal_bottom_right"),
    ),
}


#: The setups on which pairs of backends compare their gradients: options, capabilities.
PAIR_SETUPS = {
    "plain": ({}, ()),
    "causal-T7-S13": ({"is_causal": True}, ()),
    "bool-mask": ({"mask": "bool"}, ()),
    "float-mask": ({"mask": "float", "scale": 0.4}, ()),
    "gqa-bottom-right-window": (
        {"is_causal": True, "causal_alignment": "bottom_right", "window": (3, None), "K": 2},
        ("gqa", "causal_bottom_right", "window"),
    ),
    "gqa-softcap": ({"softcap": 3.0, "K": 1}, ("gqa", "softcap", "grad_softcap")),
    "sinks-gqa-causal": ({"is_causal": True, "K": 2, "sinks": "random"}, ("gqa", "sinks")),
    "chunked-gqa-causal-bottom-right": (
        {"is_causal": True, "causal_alignment": "bottom_right", "chunk_size": 5, "K": 2},
        ("gqa", "causal_bottom_right", "chunked"),
    ),
    "alibi-BH-gqa-causal": (
        {"is_causal": True, "K": 2, "alibi_slopes": "random"},
        ("gqa", "alibi"),
    ),
}
