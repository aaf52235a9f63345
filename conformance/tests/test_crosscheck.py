"""SPEC §7.3: every pair of backends agrees on the same random inputs.

Each backend is within SPEC §7's tolerance of the exact result, so two backends are
within twice that of each other. Only what both declare is compared: the harness skips the rest by name.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapters.forms import forms_used
from conformance.suite.helpers import random_qkv, random_tolerance
from conformance.suite.measure import publish
from conformance.suite.requirements import requires, value_dims
from conformance.suite.tolerance import assert_within

SETUPS = {
    "plain": ({}, ()),
    "causal-T7-S13": ({"is_causal": True}, ()),
    "bool-mask": ({"mask": "bool"}, ()),
    "float-mask": ({"mask": "float", "scale": 0.4}, ()),
    "gqa-bottom-right-window-softcap": (
        {
            "is_causal": True,
            "causal_alignment": "bottom_right",
            "window": (3, None),
            "softcap": 3.0,
            "K": 1,
        },
        ("gqa", "causal_bottom_right", "window", "softcap"),
    ),
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


@pytest.mark.clause("7.3")
@pytest.mark.pairwise
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(name, marks=requires(*needs, *forms_used(options)))
        for name, (options, needs) in SETUPS.items()
    ],
)
def test_backends_agree(backend_pair, dtype, setup, request):
    a, b = backend_pair
    options = dict(SETUPS[setup][0])
    D, E = value_dims(backend_pair, 6, 5)
    q, k, v = random_qkv(30, H=4, K=options.pop("K", None), T=7, S=13, D=D, E=E, dtype=dtype)
    rng = np.random.default_rng(31)
    if options.get("mask") == "bool":
        options["mask"] = rng.random((2, 1, 7, 13)) < 0.7
    elif options.get("mask") == "float":
        options["mask"] = np.where(
            rng.random((7, 13)) < 0.2, -np.inf, rng.standard_normal((7, 13))
        ).astype(q.dtype)
    if options.get("sinks") == "random":
        options["sinks"] = rng.uniform(-1.0, 2.0, 4).astype(q.dtype)  # (H,)
    if options.get("alibi_slopes") == "random":
        options["alibi_slopes"] = rng.uniform(0.0, 1.0, (2, 4)).astype(np.float32)  # (B, H)
    out_a = a.attention(q, k, v, **options)
    out_b = b.attention(q, k, v, **options)
    tol = 2 * random_tolerance(q, k, v, dtype, **options)
    publish(
        request.node,
        backend=f"{a.name}~{b.name}",
        case=setup,
        dtype=dtype,
        actual=out_a,
        expected=out_b,
        tolerance=tol,
    )
    assert_within(
        out_a,
        out_b,
        tol,
        f"{a.name} vs {b.name} ({setup}, {dtype})",
        behaviour="two backends disagree on the same random inputs",
    )
