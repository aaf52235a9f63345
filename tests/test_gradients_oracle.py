"""The gradient oracle itself (SPEC §12.11): checked against central finite differences.

The oracle's gradients (``conformance.fixtures.oracle.attention_vjp``) are derived by hand from the
softmax Jacobian; here they are compared with central differences of the forward oracle,

    ∂L/∂x ≈ (L(x + h) − L(x − h)) / 2h,    L = Σ d_out · oracle.attention(...),

in float64. The error of a central difference is at most h²/6 · max|L'''| (truncation)
plus about eps · max|L| / h (the forward oracle's outputs are rounded to float64, each
within eps/2). With h = 1e-5 and |L|, |L'''| of order 10 on these inputs, that is about
2e-10 + 2e-11; the assertions allow 1e-8, fifty times more, and are still some seven
orders of magnitude below any real mistake (a wrong sign, a missing term, a dropped
group member).
"""

from __future__ import annotations

import numpy as np
import pytest
from conformance.fixtures import oracle

pytestmark = pytest.mark.clause("12.11")

H_STEP = 1e-5
FD_ATOL = 1e-8


def _central_difference(loss, arrays: list[np.ndarray], which: int) -> np.ndarray:
    """∂loss/∂arrays[which] by central differences, one entry at a time (-inf entries: 0)."""
    x = arrays[which]
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        if not np.isfinite(x[idx]):
            continue
        plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
        plus[which][idx] += H_STEP
        minus[which][idx] -= H_STEP
        grad[idx] = (loss(*plus) - loss(*minus)) / (2 * H_STEP)
    return grad


SETUPS = {
    "plain": ({}, None),
    "causal-gqa": ({"is_causal": True, "K": 1}, None),
    "bottom-right-window-softcap-float-mask": (
        {
            "is_causal": True,
            "causal_alignment": "bottom_right",
            "window": (2, None),
            "softcap": 1.5,
        },
        "float",
    ),
    "float-mask-broadcast-fully-masked-row": ({"scale": 0.7}, "float-row"),
    "bool-mask": ({}, "bool"),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_oracle_gradients_match_finite_differences(setup):
    options, mask_kind = SETUPS[setup]
    options = dict(options)
    rng = np.random.default_rng(7)
    B, H, K, T, S, D, E = 1, 2, options.pop("K", 2), 3, 4, 2, 3
    q = rng.standard_normal((B, H, T, D))
    k = rng.standard_normal((B, K, S, D))
    v = rng.standard_normal((B, K, S, E))
    d_out = rng.standard_normal((B, H, T, E))
    arrays = [q, k, v]
    if mask_kind == "bool":
        options["mask"] = rng.random((B, H, T, S)) < 0.7
    elif mask_kind == "float":
        arrays.append(
            np.where(rng.random((H, T, S)) < 0.2, -np.inf, rng.standard_normal((H, T, S)))
        )
    elif mask_kind == "float-row":
        mask = rng.standard_normal((T, S))
        mask[1] = -np.inf  # a fully masked row: its gradients are 0
        arrays.append(mask)

    def loss(q, k, v, mask=None):
        opts = options if mask is None else {**options, "mask": mask}
        return float(np.sum(d_out * oracle.attention(q, k, v, **opts)))

    grads = oracle.attention_vjp(
        q, k, v, d_out, **({**options, "mask": arrays[3]} if len(arrays) == 4 else options)
    )
    names = ["dq", "dk", "dv", "dmask"][: len(arrays)]
    assert sorted(grads) == sorted(names)
    for which, name in enumerate(names):
        fd = _central_difference(loss, arrays, which)
        err = np.max(np.abs(fd - grads[name]))
        assert err < FD_ATOL, f"{setup}: oracle {name} vs central differences: {err:.3e}"
        assert np.isfinite(grads[name]).all()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True, "causal_alignment": "bottom_right"},
        {"softcap": 2.0, "window": (2, 1)},
    ],
    ids=["plain", "bottom-right", "softcap-window"],
)
def test_naive_float64_backward_agrees_with_the_oracle(options):
    """Two independent derivations, 50-digit loops and float64 arrays, agree to ~1e-14."""
    rng = np.random.default_rng(8)
    q, k = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 7, 3))
    v, d_out = rng.standard_normal((2, 2, 7, 4)), rng.standard_normal((2, 4, 5, 4))
    mask = np.where(rng.random((5, 7)) < 0.2, -np.inf, rng.standard_normal((5, 7)))
    exact = oracle.attention_vjp(q, k, v, d_out, mask=mask, **options)
    naive = oracle.naive_vjp_same_precision(q, k, v, d_out, np.float64, mask=mask, **options)
    for name in ("dq", "dk", "dv", "dmask"):
        assert np.max(np.abs(exact[name] - naive[name])) < 1e-14, name


def test_naive_float32_backward_has_the_dtype_error():
    """The naive float32 backward is off by float32 rounding, not more and not less."""
    rng = np.random.default_rng(9)
    q, k, v, d_out = (
        rng.standard_normal((1, 2, 9, 8)).astype(np.float32).astype(np.float64) for _ in range(4)
    )
    exact = oracle.attention_vjp(q, k, v, d_out)
    naive = oracle.naive_vjp_same_precision(q, k, v, d_out, np.float32)
    for name in ("dq", "dk", "dv"):
        err = np.max(np.abs(naive[name] - exact[name]))
        assert 2**-28 < err < 2**-16, f"{name}: {err:.3e}"


def test_oracle_fully_masked_row_and_blocked_key_get_nothing():
    q, k, v = np.ones((1, 1, 2, 2)), np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2))
    d_out = np.ones((1, 1, 2, 2))
    mask = np.array([[True, False, True], [False, False, False]])
    grads = oracle.attention_vjp(q, k, v, d_out, mask=mask)
    assert grads["dq"][0, 0, 1].tolist() == [0.0, 0.0]
    assert grads["dk"][0, 0, 1].tolist() == [0.0, 0.0] and grads["dv"][0, 0, 1].tolist() == [
        0.0,
        0.0,
    ]
    # Keys 0 and 2 share the one live row equally: dV rows are half of d_out each.
    assert grads["dv"][0, 0, 0].tolist() == [0.5, 0.5]


@pytest.mark.parametrize("kind", ["mha", "gpt_block"])
def test_naive_module_backward_matches_finite_differences(kind):
    """The module baseline of SPEC §12.8: the textbook backward of the module against central
    differences of ``naive_module_same_precision`` in float64 (same error bound)."""
    rng = np.random.default_rng(10)
    B, T, C, H, F = 1, 3, 4, 2, 6

    def lin(n_out, n_in):
        return rng.uniform(-0.5, 0.5, (n_out, n_in)), rng.uniform(-0.5, 0.5, n_out)

    w, b = lin(3 * C, C)
    w2, b2 = lin(C, C)
    params = {"qkv.weight": w, "qkv.bias": b, "out_proj.weight": w2, "out_proj.bias": b2}
    if kind == "gpt_block":
        params = {f"attn.{n}": a for n, a in params.items()}
        for norm in ("norm1", "norm2"):
            params[f"{norm}.weight"] = rng.uniform(0.5, 1.5, C)
            params[f"{norm}.bias"] = rng.uniform(-0.5, 0.5, C)
        params["mlp.0.weight"], params["mlp.0.bias"] = lin(F, C)
        params["mlp.2.weight"], params["mlp.2.bias"] = lin(C, F)
    x = rng.standard_normal((B, T, C))
    d_out = rng.standard_normal((B, T, C))
    names = list(params)
    grads = oracle.naive_module_vjp_same_precision(
        kind, params, x, d_out, np.float64, n_heads=H, is_causal=True
    )
    assert sorted(grads) == sorted(names + ["x"])

    def loss(*arrays):
        p = dict(zip(names, arrays[:-1]))
        out = oracle.naive_module_same_precision(
            kind, p, arrays[-1], np.float64, n_heads=H, is_causal=True
        )
        return float(np.sum(d_out * out))

    arrays = [params[n] for n in names] + [x]
    for which, name in enumerate(names + ["x"]):
        fd = _central_difference(loss, arrays, which)
        err = np.max(np.abs(fd - grads[name]))
        assert err < FD_ATOL, f"{kind}: naive module gradient of {name} vs differences: {err:.3e}"


@pytest.mark.clause("15.5")
@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True},
        {"softcap": 1.5, "window": (1, None), "causal_alignment": "bottom_right"},
    ],
    ids=["causal-gqa-bool-mask", "softcap-window-float-mask"],
)
def test_oracle_sink_gradients_match_finite_differences(options):
    """dq, dk, dv, (dmask) and dsinks of the sinks' oracle against central differences, a
    fully masked row and a head without a sink (-inf) included."""
    rng = np.random.default_rng(11)
    B, H, K, T, S, D, E = 1, 4, 2, 3, 4, 2, 3
    q = rng.standard_normal((B, H, T, D))
    k = rng.standard_normal((B, K, S, D))
    v = rng.standard_normal((B, K, S, E))
    d_out = rng.standard_normal((B, H, T, E))
    sinks = rng.standard_normal(H)
    sinks[3] = -np.inf
    if "softcap" in options:
        mask = np.where(rng.random((H, T, S)) < 0.2, -np.inf, rng.standard_normal((H, T, S)))
        mask[0, 1] = -np.inf
    else:
        mask = rng.random((B, H, T, S)) < 0.7
        mask[0, 1, 2] = False
    float_mask = mask.dtype != np.bool_
    arrays = [q, k, v, mask, sinks] if float_mask else [q, k, v, sinks]

    def loss(*xs):
        m = xs[3] if float_mask else mask
        return float(np.sum(d_out * oracle.attention(*xs[:3], mask=m, sinks=xs[-1], **options)))

    grads = oracle.attention_vjp(q, k, v, d_out, mask=mask, sinks=sinks, **options)
    names = ["dq", "dk", "dv", "dmask", "dsinks"] if float_mask else ["dq", "dk", "dv", "dsinks"]
    assert list(grads) == names
    for which, name in enumerate(names):
        fd = _central_difference(loss, arrays, which)
        err = np.max(np.abs(fd - grads[name]))
        assert err < FD_ATOL, f"{options}: oracle {name} vs central differences: {err:.3e}"
        assert np.isfinite(grads[name]).all()
    naive = oracle.naive_vjp_same_precision(
        q, k, v, d_out, np.float64, mask=mask, sinks=sinks, **options
    )
    for name in names:
        assert np.max(np.abs(naive[name] - grads[name])) < 1e-13, name


@pytest.mark.clause("16.3", "17.3")
@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True, "causal_alignment": "bottom_right", "chunk_size": 2},
        {"softcap": 1.5, "alibi_slopes": np.array([0.5, 0.25, 0.125, 1.0])},
        {"chunk_size": 3, "alibi_slopes": np.array([[0.3, 0.6, 0.9, 0.2]])},
    ],
    ids=["chunked-bottom-right-bool-mask", "alibi-softcap-float-mask", "chunked-alibi-BH"],
)
def test_oracle_chunk_and_alibi_gradients_match_finite_differences(options):
    """dq, dk, dv (and dmask) of the oracle with chunks and ALiBi against central
    differences; the slopes get no gradient; the naive backward agrees."""
    rng = np.random.default_rng(12)
    B, H, K, T, S, D, E = 1, 4, 2, 3, 5, 2, 3
    q = rng.standard_normal((B, H, T, D))
    k = rng.standard_normal((B, K, S, D))
    v = rng.standard_normal((B, K, S, E))
    d_out = rng.standard_normal((B, H, T, E))
    if "softcap" in options:
        mask = np.where(rng.random((H, T, S)) < 0.2, -np.inf, rng.standard_normal((H, T, S)))
    else:
        mask = rng.random((B, H, T, S)) < 0.8
    float_mask = mask.dtype != np.bool_
    arrays = [q, k, v, mask] if float_mask else [q, k, v]

    def loss(*xs):
        m = xs[3] if float_mask else mask
        return float(np.sum(d_out * oracle.attention(*xs[:3], mask=m, **options)))

    grads = oracle.attention_vjp(q, k, v, d_out, mask=mask, **options)
    names = ["dq", "dk", "dv", "dmask"] if float_mask else ["dq", "dk", "dv"]
    assert list(grads) == names
    for which, name in enumerate(names):
        fd = _central_difference(loss, arrays, which)
        err = np.max(np.abs(fd - grads[name]))
        assert err < FD_ATOL, f"{options}: oracle {name} vs central differences: {err:.3e}"
    naive = oracle.naive_vjp_same_precision(q, k, v, d_out, np.float64, mask=mask, **options)
    for name in names:
        assert np.max(np.abs(naive[name] - grads[name])) < 1e-13, name


@pytest.mark.clause("18.5", "12.11")
@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True, "causal_alignment": "bottom_right"},
        {"softcap": 1.5, "window": (1, 0)},
    ],
    ids=["causal-bottom-right", "softcap-window"],
)
def test_oracle_packed_gradients_match_finite_differences(options):
    """dq, dk, dv of the packed oracle (each document's attention_vjp) against central
    differences of the packed forward: three documents, one with no key and one with no
    query, under GQA; the naive backward agrees."""
    rng = np.random.default_rng(13)
    cu_q, cu_k = np.array([0, 2, 2, 4]), np.array([0, 3, 5, 5])
    H, K, D, E = 4, 2, 2, 3
    q = rng.standard_normal((H, 4, D))
    k = rng.standard_normal((K, 5, D))
    v = rng.standard_normal((K, 5, E))
    d_out = rng.standard_normal((H, 4, E))

    def loss(*xs):
        return float(np.sum(d_out * oracle.attention_packed(*xs, cu_q, cu_k, **options)))

    grads = oracle.attention_packed_vjp(q, k, v, cu_q, cu_k, d_out, **options)
    for which, name in enumerate(["dq", "dk", "dv"]):
        fd = _central_difference(loss, [q, k, v], which)
        err = np.max(np.abs(fd - grads[name]))
        assert err < FD_ATOL, f"{options}: packed oracle {name} vs central differences: {err:.3e}"
    assert (grads["dk"][:, 3:5] == 0).all() and (grads["dq"][:, 2:4] == 0).all()
    naive = oracle.naive_packed_vjp_same_precision(
        q, k, v, cu_q, cu_k, d_out, np.float64, **options
    )
    for name in ("dq", "dk", "dv"):
        assert np.max(np.abs(naive[name] - grads[name])) < 1e-13, name


@pytest.mark.clause("21.1")
@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True},
        {"softcap": 1.5, "window": (1, None), "sinks": np.array([0.3, -0.7, 1.1, -np.inf])},
    ],
    ids=["causal-gqa-bool-mask", "softcap-window-sinks-float-mask"],
)
def test_oracle_lse_gradients_match_finite_differences(options):
    """With d_lse, the oracle's gradients are those of L = Σ d_out · out + Σ d_lse · lse
    (SPEC §21: ∂lse/∂score = the score's weight), against central differences; a row with
    no key (lse = -inf, its d_lse 0 in the loss) adds nothing."""
    rng = np.random.default_rng(12)
    B, H, K, T, S, D, E = 1, 4, 2, 3, 4, 2, 3
    q = rng.standard_normal((B, H, T, D))
    k = rng.standard_normal((B, K, S, D))
    v = rng.standard_normal((B, K, S, E))
    d_out = rng.standard_normal((B, H, T, E))
    d_lse = rng.standard_normal((B, H, T))
    if "softcap" in options:
        mask = np.where(rng.random((H, T, S)) < 0.2, -np.inf, rng.standard_normal((H, T, S)))
        mask[0, 1] = -np.inf
    else:
        mask = rng.random((B, H, T, S)) < 0.7
        mask[0, 1, 2] = False
    float_mask = mask.dtype != np.bool_
    sinks = options.pop("sinks", None)
    arrays = [q, k, v, *([mask] if float_mask else []), *([] if sinks is None else [sinks])]

    def loss(*xs):
        m = xs[3] if float_mask else mask
        given = {} if sinks is None else {"sinks": xs[-1]}
        out, lse = oracle.attention(*xs[:3], mask=m, return_lse=True, **given, **options)
        return float(np.sum(d_out * out) + np.sum(np.where(np.isfinite(lse), d_lse * lse, 0.0)))

    grads = oracle.attention_vjp(q, k, v, d_out, mask=mask, sinks=sinks, d_lse=d_lse, **options)
    names = ["dq", "dk", "dv", *(["dmask"] if float_mask else [])]
    names += [] if sinks is None else ["dsinks"]
    assert list(grads) == names
    plain = oracle.attention_vjp(q, k, v, d_out, mask=mask, sinks=sinks, **options)
    assert np.max(np.abs(grads["dq"] - plain["dq"])) > 1e-3  # d_lse moves the gradients
    for which, name in enumerate(names):
        fd = _central_difference(loss, arrays, which)
        err = np.max(np.abs(fd - grads[name]))
        assert err < FD_ATOL, (
            f"{options}: oracle {name} with d_lse vs central differences: {err:.3e}"
        )


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_naive_backward_with_d_lse_is_the_oracle_s_in_its_dtype(dtype):
    """naive_vjp_same_precision(..., d_lse=) (SPEC §21.7's tolerance baseline) is the
    oracle's gradient, to the float64 rounding in float64 and within float32's error in
    float32, with a float mask that leaves a row with no key, softcap and sinks; d_lse
    moves it (by more than that error), and the row with no key still gets dq = 0."""
    rng = np.random.default_rng(13)
    B, H, K, T, S, D, E = 1, 4, 2, 5, 7, 4, 3
    q, k = rng.standard_normal((B, H, T, D)), rng.standard_normal((B, K, S, D))
    v, d_out = rng.standard_normal((B, K, S, E)), rng.standard_normal((B, H, T, E))
    d_lse = rng.standard_normal((B, H, T))
    mask = np.where(rng.random((H, T, S)) < 0.3, -np.inf, rng.standard_normal((H, T, S)))
    mask[1, 2] = -np.inf
    options = {"mask": mask, "softcap": 2.0, "sinks": rng.standard_normal(H)}
    expected = oracle.attention_vjp(q, k, v, d_out, d_lse=d_lse, **options)
    naive = oracle.naive_vjp_same_precision(q, k, v, d_out, dtype, d_lse=d_lse, **options)
    plain = oracle.naive_vjp_same_precision(q, k, v, d_out, dtype, **options)
    bound = 1e-14 if dtype == np.float64 else 1e-5
    assert sorted(naive) == sorted(expected)
    for name in expected:
        err = np.max(np.abs(naive[name] - expected[name]))
        assert err < bound, f"naive {name} in {np.dtype(dtype)} with d_lse vs the oracle: {err:.3e}"
    assert np.max(np.abs(naive["dq"] - plain["dq"])) > 100 * bound
    assert np.max(np.abs(naive["dsinks"] - plain["dsinks"])) > 100 * bound
    assert not np.any(naive["dq"][0, 1, 2])
