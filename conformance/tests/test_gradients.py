"""SPEC §12: the backward pass. Gradients match the oracle, and obey what the math says.

``backend.attention_vjp(q, k, v, d_out, ...)`` returns the gradients of
L = Σ d_out · attention(q, k, v, ...). Fixtures hold the 50-digit oracle's gradients;
the invariants below hold for the exact mathematics and are checked bit-for-bit where
floating point cannot move them (a gradient that must be exactly zero) and within
SPEC §12.9's tolerance elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.adapters.forms import forms_used
from conformance.backends import numpy_dtype
from conformance.suite import gradients
from conformance.suite.cases import case_entries, load_case
from conformance.suite.domain import positions
from conformance.suite.helpers import SIZES, as64, fixture_marks, random_qkv
from conformance.suite.measure import publish
from conformance.suite.rebuilt import case_inside
from conformance.suite.requirements import SuiteError, requires, uses_dtype, value_dims
from conformance.suite.tolerance import (
    Departure,
    assert_identical,
    assert_within,
    expect,
    tolerance,
)

GRADS = ("dq", "dk", "dv", "dmask")
DTYPES = ["float64", "float32"]
sizes = pytest.mark.parametrize("size", list(SIZES.values()), ids=list(SIZES))
dtypes = pytest.mark.parametrize("dtype", DTYPES)


#: What a gradient fixture's failure says, for the clauses whose fixtures test one thing.
GRADIENT_FIXTURE_BEHAVIOURS = {
    "12.4": "a query with no key to attend sends gradient to q, k or v",
    "12.12": "garbage in key slots no query attends reaches the gradients",
}


def _grad_case_params():
    return [
        pytest.param(e["id"], marks=fixture_marks(e, "12.9"), id=e["id"])
        for e in case_entries(("attention_grad",))
    ]


@pytest.mark.parametrize("case_id", _grad_case_params())
def test_gradient_fixture(backend, case_id, request):
    """dq, dk, dv (and dmask, and dsinks) match the 50-digit oracle within the gradient
    tolerance (for a kernel with a declared domain, on the case built again inside it where
    its call cannot be carried there: SPEC §13.19)."""
    case = case_inside(backend, load_case(case_id), request.node)
    q, k, v = case.inputs()
    mask = case.mask()
    grads = backend.attention_vjp(q, k, v, case.d_out(), mask=mask, **case.options())
    expected = case.expected_grads
    context = f"{backend.name} on gradient fixture {case.id} {case.meta['shape']} {case.options()}"
    expect(
        len(grads) == len(expected),
        "returns another set of gradients than the spec (dmask for a float mask)",
        f"{context}: got {len(grads)} gradients, expected {len(expected)} ({', '.join(expected)})",
    )
    likes = {"dq": q, "dk": k, "dv": v, "dmask": mask, "dsinks": case.options().get("sinks")}
    # In the order attention_vjp returns them: dq, dk, dv, then dmask and dsinks if any.
    for name, got in zip(expected, grads):
        like = likes[name]
        expect(
            got.shape == like.shape and got.dtype == like.dtype,
            "returns gradients of the wrong shape or dtype",
            f"{context}: {name} is {got.dtype} {got.shape}, expected {like.dtype} {like.shape}",
        )
        tol = tolerance(case.dtype, case.grad_naive_error(name), expected[name])
        publish(
            request.node,
            backend=backend.name,
            case=case.id,
            dtype=case.dtype,
            actual=got,
            expected=expected[name],
            tolerance=tol,
            quantity=name,
        )
        assert_within(
            got,
            expected[name],
            tol,
            f"{context}: {name}\n  reproduce: {case.call_vjp(backend)}",
            behaviour=GRADIENT_FIXTURE_BEHAVIOURS.get(case.clause),
        )


@pytest.mark.clause("12.1")
@requires("grad")
def test_d_out_of_the_wrong_shape_is_refused(backend, dtype):
    """d_out must be shaped like the output; anything else is a ValueError naming d_out."""
    D, E = value_dims(backend, 4, 3)
    q, k, v = random_qkv(40, T=5, S=6, D=D, E=E, dtype=dtype)
    wrong = np.zeros((2, 3, 5, E + 1), dtype=q.dtype)
    try:
        backend.attention_vjp(q, k, v, wrong)
    except ValueError as err:
        expect(
            "d_out" in str(err),
            "refuses a d_out of the wrong shape without naming d_out",
            f"{backend.name}: the error should name d_out: {err}",
        )
        return
    except SuiteError:
        raise
    except Exception as err:
        raise Departure(
            f"{backend.name}: raised {type(err).__name__} for a d_out of the wrong shape: {err}",
            f"raises {type(err).__name__}, not ValueError, for a d_out of the wrong shape",
        ) from err
    raise Departure(
        f"{backend.name}: accepted a d_out of the wrong shape", "accepts a d_out of the wrong shape"
    )


@pytest.mark.clause("12.4")
@pytest.mark.parametrize(
    "how",
    [
        "bool-mask",
        pytest.param("float-mask", marks=requires("grad_mask")),
        pytest.param("bottom-right-T>S", marks=requires("causal_bottom_right", "causal")),
        pytest.param("window", marks=requires("window", "causal_top_left")),
    ],
)
@dtypes
@requires("grad")
def test_fully_masked_rows_have_zero_gradients(backend, how, dtype):
    """A query with no key to attend has dq exactly 0, every gradient is finite, and its
    upstream gradient reaches nothing: changing it changes no gradient bit."""
    T, S = 7, 5
    q, k, v = random_qkv(41, T=T, S=S, dtype=dtype)
    options: dict = {}
    blocked = np.zeros(T, dtype=bool)
    if how == "bool-mask":
        mask = np.ones((T, S), dtype=bool)
        mask[[0, 3]] = False
        blocked[[0, 3]] = True
        options["mask"] = mask
    elif how == "float-mask":
        mask = np.random.default_rng(42).standard_normal((T, S)).astype(q.dtype)
        mask[[1, 6]] = -np.inf
        blocked[[1, 6]] = True
        options["mask"] = mask
    elif how == "bottom-right-T>S":
        options.update(is_causal=True, causal_alignment="bottom_right")
        blocked[: T - S] = True
    else:
        options["window"] = (0, 0)
        blocked[S:] = True
    d_out = gradients.random_d_out(43, q, v)
    grads = gradients.vjp(backend, q, k, v, d_out, **options)
    for name, g in grads.items():
        expect(
            np.isfinite(as64(g)).all(),
            "a query with no key to attend gets non-finite gradients",
            f"{backend.name}: non-finite {name} ({how})",
        )
    expect(
        (as64(grads["dq"])[..., blocked, :] == 0).all(),
        "a query with no key to attend gets a dq that is not 0",
        f"{backend.name}: dq of fully masked rows {np.flatnonzero(blocked).tolist()} "
        f"should be exactly 0 ({how})",
    )
    if "dmask" in grads:
        expect(
            (as64(grads["dmask"])[blocked] == 0).all(),
            "dmask of a query with no key to attend is not 0",
            f"{backend.name}: dmask of fully masked rows should be exactly 0 ({how})",
        )
    d_out2 = d_out.copy()
    d_out2[..., blocked, :] = np.asarray(1e3, dtype=q.dtype)
    again = gradients.vjp(backend, q, k, v, d_out2, **options)
    for name in grads:
        assert_identical(
            again[name],
            grads[name],
            f"{backend.name}: {name} after changing d_out on fully masked rows ({how})",
            behaviour="the upstream gradient of a query with no key to attend reaches the gradients",
        )


@pytest.mark.clause("12.5")
@sizes
@dtypes
@requires("grad", "causal", "causal_top_left")
def test_no_gradient_from_the_future(backend, size, dtype):
    """Causal (top-left): for a loss on outputs <= i only, keys and values after i get a
    gradient of exactly 0, and so do the queries after i."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(44, T=T, S=S, dtype=dtype)
    d_out = gradients.random_d_out(45, q, v)
    for i in positions(backend, min(T, S) - 1, "attention_vjp"):
        d_i = d_out.copy()
        d_i[..., i + 1 :, :] = 0
        grads = gradients.vjp(backend, q, k, v, d_i, is_causal=True)
        for name, g in (("dk", grads["dk"]), ("dv", grads["dv"]), ("dq", grads["dq"])):
            later = as64(g)[..., i + 1 :, :]
            expect(
                (later == 0).all(),
                "under a causal mask, gradient flows from later outputs to earlier positions",
                f"{backend.name}: {name} after position {i} is {np.abs(later).max():.3e}, "
                f"not 0, for a loss on outputs <= {i} (T={T}, S={S}, {dtype})",
            )


@pytest.mark.clause("12.6")
@sizes
@dtypes
@pytest.mark.parametrize("mask_kind", ["bool", pytest.param("float", marks=requires("grad_mask"))])
@requires("grad")
def test_blocked_key_gets_no_gradient(backend, size, dtype, mask_kind):
    """A key blocked for every query gets dk = dv = 0 exactly (and dmask = 0 on it), and
    the other gradients equal those of the same call with the key deleted."""
    T, S = size["T"], size["S"]
    q, k, v = random_qkv(46, T=T, S=S, dtype=dtype)
    d_out = gradients.random_d_out(47, q, v)
    for j in (0, S // 2, S - 1):
        keep = np.arange(S) != j
        if mask_kind == "bool":
            mask = np.broadcast_to(keep, (T, S))
        else:
            mask = np.where(np.broadcast_to(keep, (T, S)), 0.0, -np.inf).astype(q.dtype)
        masked = gradients.vjp(backend, q, k, v, d_out, mask=mask)
        for name in ("dk", "dv"):
            expect(
                (as64(masked[name])[..., j, :] == 0).all(),
                "a key blocked for every query gets a gradient that is not 0",
                f"{backend.name}: {name} of key {j}, blocked ({mask_kind} mask), should be 0",
            )
        if "dmask" in masked:
            expect(
                (as64(masked["dmask"])[:, j] == 0).all(),
                "dmask on a key blocked for every query is not 0",
                f"{backend.name}: dmask on blocked key {j} should be 0",
            )
        kk, vv = k[..., keep, :], v[..., keep, :]
        deleted = gradients.vjp(backend, q, kk, vv, d_out)
        tols = gradients.grad_tolerances(q, kk, vv, d_out, dtype)
        for name, got in (
            ("dq", masked["dq"]),
            ("dk", masked["dk"][..., keep, :]),
            ("dv", masked["dv"][..., keep, :]),
        ):
            assert_within(
                got,
                deleted[name],
                2 * tols[name],
                f"{backend.name}: {name} with key {j} masked ({mask_kind}) vs deleted",
                behaviour="the gradients with a masked key differ from those with the key deleted",
            )


@pytest.mark.clause("12.6")
@dtypes
@requires("grad", "window", "causal_top_left", "window_right")
def test_keys_outside_every_window_get_no_gradient(backend, dtype):
    """Keys no query's window reaches (window (1, 1) on T = 4, S = 9: keys 5-8) get
    dk = dv = 0 exactly."""
    q, k, v = random_qkv(48, T=4, S=9, dtype=dtype)
    grads = gradients.vjp(backend, q, k, v, gradients.random_d_out(49, q, v), window=(1, 1))
    for name in ("dk", "dv"):
        unreached = as64(grads[name])[..., 5:, :]
        expect(
            (unreached == 0).all(),
            "a key outside every window gets a gradient that is not 0",
            f"{backend.name}: {name} of keys outside every window is "
            f"{np.abs(unreached).max():.3e}, not 0",
        )


@pytest.mark.clause("12.7")
@dtypes
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(name, marks=requires(*needs, *forms_used(options)))
        for name, (options, needs) in gradients.SUM_SETUPS.items()
    ],
)
@requires("grad")
def test_gradient_sums(backend, dtype, setup):
    """Each weight row sums to 1, so Σ_s dV[s] = Σ dO[t] over the queries (of the whole
    query group, with GQA) that attend some key; and the output ignores a shift of every
    key, so Σ_s dK[s] = 0."""
    options = dict(gradients.SUM_SETUPS[setup][0])
    T, S = (9, 6) if setup.endswith("T>S") else (7, 9)
    q, k, v = random_qkv(50, H=4, K=options.pop("K", None), T=T, S=S, dtype=dtype)
    B, H, K = q.shape[0], q.shape[1], k.shape[1]
    attends = np.ones((B, H, T), dtype=bool)
    if options.get("mask") == "bool":
        mask = np.random.default_rng(51).random((B, 1, T, S)) < 0.6
        mask[:, :, [2, 5]] = False
        options["mask"] = mask
        attends = np.broadcast_to(mask.any(-1), (B, H, T))
    if options.get("causal_alignment") == "bottom_right":
        attends = attends & (np.arange(T) >= T - S)
    d_out = gradients.random_d_out(52, q, v)
    grads = gradients.vjp(backend, q, k, v, d_out, **options)
    tols = gradients.grad_tolerances(q, k, v, d_out, dtype, **options)
    d_live = np.where(attends[..., None], as64(d_out), 0.0)  # (B, H, T, E)
    want = d_live.reshape(B, K, H // K, T, -1).sum(axis=(2, 3))  # (B, K, E)
    assert_within(
        as64(grads["dv"]).sum(axis=2),
        want,
        S * tols["dv"],
        f"{backend.name}: Σ_s dV[s] vs Σ_t dO[t] over attending queries ({setup}, {dtype})",
        behaviour="Σ dV over the keys is not Σ dO over the attending queries",
    )
    assert_within(
        as64(grads["dk"]).sum(axis=2),
        np.zeros_like(want[..., :1].repeat(k.shape[-1], axis=-1)),
        S * tols["dk"],
        f"{backend.name}: Σ_s dK[s] should be 0 ({setup}, {dtype})",
        behaviour="Σ dK over the keys is not 0",
    )


MODULE_CASES = [
    "mha-float64",
    "mha-causal-float64",
    "gpt-block-float64",
    "mha-causal-float32",
    "gpt-block-float32",
]


@pytest.mark.clause("12.8")
@pytest.mark.parametrize(
    "case_id", [pytest.param(c, marks=uses_dtype(c.rsplit("-", 1)[1])) for c in MODULE_CASES]
)
@requires("module", "module_grad")
def test_module_parameter_gradients(backend, case_id):
    """Every parameter's gradient (and the input's) of the multi-head layer and the GPT
    block, from the shared weights, matches the textbook backward within SPEC §12.9."""
    case = load_case(case_id)
    x = case.arrays["x"]
    d_out = np.random.default_rng(53).standard_normal(x.shape).astype(case.dtype)
    grads = gradients.module_grads(backend, case, d_out)
    ref, tols = gradients.module_reference(case, d_out)
    expect(
        set(grads) == set(ref),
        "returns gradients for other parameters than the module's",
        f"{backend.name} {case.id}: gradients for {sorted(grads)}, expected {sorted(ref)}",
    )
    for name, want in ref.items():
        expect(
            grads[name].dtype == numpy_dtype(case.dtype),
            "returns a parameter gradient in another dtype than the parameters",
            f"{backend.name} {case.id}: {name} gradient is {grads[name].dtype}, expected {case.dtype}",
        )
        assert_within(
            grads[name], want, tols[name], f"{backend.name} {case.id}: gradient of {name}"
        )


@pytest.mark.clause("12.10")
@pytest.mark.pairwise
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(name, marks=requires(*needs, *forms_used(options)))
        for name, (options, needs) in gradients.PAIR_SETUPS.items()
    ],
)
@requires("grad")
def test_backends_agree_on_gradients(backend_pair, dtype, setup, request):
    """Every pair of backends gives gradients within twice SPEC §12.9's tolerance."""
    a, b = backend_pair
    options = dict(gradients.PAIR_SETUPS[setup][0])
    D, E = value_dims(backend_pair, 6, 5)
    q, k, v = random_qkv(54, H=4, K=options.pop("K", None), T=7, S=13, D=D, E=E, dtype=dtype)
    rng = np.random.default_rng(55)
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
    d_out = gradients.random_d_out(56, q, v)
    grads_a = gradients.vjp(a, q, k, v, d_out, **options)
    grads_b = gradients.vjp(b, q, k, v, d_out, **options)
    tols = gradients.grad_tolerances(q, k, v, d_out, dtype, **options)
    for name in sorted(set(grads_a) & set(grads_b)):
        publish(
            request.node,
            backend=f"{a.name}~{b.name}",
            case=setup,
            dtype=dtype,
            actual=grads_a[name],
            expected=grads_b[name],
            tolerance=2 * tols[name],
            quantity=name,
        )
        assert_within(
            grads_a[name],
            grads_b[name],
            2 * tols[name],
            f"{a.name} vs {b.name}: {name} ({setup}, {dtype})",
            behaviour="two backends' gradients disagree on the same random inputs",
        )


@pytest.mark.clause("12.10")
@pytest.mark.pairwise
@pytest.mark.parametrize(
    "case_id",
    [
        pytest.param(c, marks=uses_dtype(c.rsplit("-", 1)[1]))
        for c in ("mha-causal-float64", "gpt-block-float32")
    ],
)
@requires("module", "module_grad")
def test_backends_agree_on_module_gradients(backend_pair, case_id, request):
    """Every pair of backends gives the same parameter gradients within twice SPEC §12.9."""
    a, b = backend_pair
    case = load_case(case_id)
    d_out = np.random.default_rng(57).standard_normal(case.arrays["x"].shape).astype(case.dtype)
    grads_a = gradients.module_grads(a, case, d_out)
    grads_b = gradients.module_grads(b, case, d_out)
    _, tols = gradients.module_reference(case, d_out)
    for name, tol in tols.items():
        publish(
            request.node,
            backend=f"{a.name}~{b.name}",
            case=case_id,
            dtype=case.dtype,
            actual=grads_a[name],
            expected=grads_b[name],
            tolerance=2 * tol,
            quantity=name,
        )
        assert_within(
            grads_a[name],
            grads_b[name],
            2 * tol,
            f"{a.name} vs {b.name}: {case.id} {name}",
            behaviour="two backends' parameter gradients disagree",
        )
