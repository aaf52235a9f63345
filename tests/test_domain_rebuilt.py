"""Fixtures built again inside a kernel's domain with the oracle (SPEC §13.19).

A kernel with no mask and S a multiple of 16 cannot be handed the fixture T7-S7 exactly (the
nine keys S grows by cannot be hidden): the fixture is drawn again at its shapes, with the
same construction, and judged against the oracle there.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_domain import ALL, TILED, _Kernel, _kernel, _run

from conformance.adapters.domain import Domain
from conformance.suite.cases import load_case
from conformance.suite.rebuilt import case_inside, rebuilt_case

#: The tiled kernel of test_domain with a softmax that takes exp() of the raw scores: right
#: on ordinary scores, inf / inf = NaN on large ones (SPEC §4.4).
OVERFLOWS = """

def overflows(q, k, v, is_causal=False, scale=None):
    assert q.shape[-1] in (16, 32) and k.shape[-2] % 16 == 0, (q.shape, k.shape)
    s = q @ np.swapaxes(k, -1, -2) * (scale or 1 / np.sqrt(q.shape[-1]))  # (B, H, T, S)
    if is_causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    e = np.exp(s)  # (B, H, T, S)
    return (e / e.sum(-1, keepdims=True)) @ v  # (B, H, T, E)
"""


def _no_mask_kernel(**domain) -> _Kernel:
    return _Kernel(Domain(**domain), ALL - {"mask_bool", "mask_float"})


@pytest.mark.clause("13.19")
def test_a_fixture_with_no_exact_carry_is_built_again_inside_the_domain():
    kernel = _no_mask_kernel(head_dims=(16,), t_multiple=16, s_multiple=16)
    case = case_inside(kernel, load_case("cross-T7-S13-float32"))
    assert [case.meta["shape"][x] for x in "TSDE"] == [16, 32, 16, 16]
    assert case.inputs()[0].shape == (1, 2, 16, 16) and case.expected.shape == (1, 2, 16, 16)
    assert case.inputs()[0].dtype == np.float32
    assert case.naive_error > 0  # SPEC §7's naive run on the new inputs
    assert "rebuilt_case('cross-T7-S13-float32', 16, 32, 16, 16)" in case.loader
    # Where the carry is exact, the fixture itself is kept.
    causal = load_case("causal-T7-float32")
    assert case_inside(kernel, causal) is causal


@pytest.mark.clause("13.19")
def test_a_rebuilt_fixture_keeps_its_construction():
    """The NaN, the keys after every query, the large scores: each is where its clause
    needs it at the new shapes, and the oracle's output shows it."""
    nan_q = rebuilt_case("nan-q-plain-float32", 16, 16, 16, 16)
    rows = np.isnan(nan_q.expected).any(-1)  # (B, H, T)
    assert rows[0, 1, 2] and rows.sum() == 1
    # Under top-left causality, keys 4..8 of T = 4 lie after every query; at T = 16 the
    # same garbage lies at keys 16..20, still after every query, and reaches no output.
    inert = rebuilt_case("inert-causal-T4-S9-float32", 16, 32, 16, 16)
    k = inert.inputs()[1]
    assert not np.isfinite(k[0, :, 16]).all() and np.isfinite(k[0, :, :16]).all()
    assert np.isfinite(inert.expected).all()
    # Scores stay as large: magnitude² / sqrt(D) at D = 3 and at D = 16.
    q, k, _ = load_case("large-logits-1e4-float32").inputs()
    before = float(q[0, 0, 0] @ k[0, 0, 0]) / np.sqrt(3)
    q, k, _ = rebuilt_case("large-logits-1e4-float32", 16, 16, 16, 16).inputs()
    after = float(q[0, 0, 0] @ k[0, 0, 0]) / 4.0
    assert before > 5000 and abs(after / before - 1) < 0.01, (before, after)


def test_what_has_no_counterpart_stays_skipped_by_name():
    kernel = _no_mask_kernel(head_dims=(16,), s_multiple=16)
    with pytest.raises(pytest.skip.Exception, match="an empty sequence has no counterpart"):
        case_inside(kernel, load_case("empty-S0-float32"))
    small = _no_mask_kernel(head_dims=(2,), s_multiple=16)
    with pytest.raises(pytest.skip.Exception, match="no head dim of the domain is at least 4"):
        case_inside(small, load_case("T7-S7-float32"))


@pytest.mark.clause("4.4", "13.19")
def test_a_clause_outside_the_usual_shapes_is_judged_inside_the_domain(tmp_path):
    """The large-scores fixtures (D = 3 and 8, S = 6 and 7) reach a kernel of D = 16,
    S % 16 = 0 only built again: there an overflowing softmax fails them, and the correct
    kernel passes."""
    path = _kernel(tmp_path, TILED)
    code, out, calls = _run(
        tmp_path, path, "test_fixtures.py", args=["-k", "test_fixture_case and large-logits"]
    )
    assert code == 0 and "3 passed" in out, out[-3000:]
    assert "kern.tiled: fixtures built again inside its domain with the oracle: " in out
    assert "large-logits-1e4-float32" in out and calls
    (tmp_path / "kern.py").write_text((tmp_path / "kern.py").read_text() + OVERFLOWS)
    path.write_text(TILED.replace('"kern:tiled"', '"kern:overflows"'))
    code, out, _ = _run(
        tmp_path, path, "test_fixtures.py", args=["-k", "test_fixture_case and large-logits"]
    )
    assert code == 1 and "3 failed" in out, out[-3000:]
    assert "large scores (about 1e4) lose accuracy" in out, out[-3000:]


#: A kernel that takes bool masks, D = E = 8, T a multiple of 8 and S of 16, and reads its
#: keys as if S = T.
SQUARE = """
from conformance.impls.numpy.attention import attention as reference


def square(q, k, v, mask=None, is_causal=False, scale=None):
    assert k.shape[-2] % 16 == 0 and q.shape[-2] % 8 == 0 and q.shape[-1] == 8, q.shape
    T = q.shape[-2]
    if T < k.shape[-2]:
        k, v = k[..., :T, :], v[..., :T, :]
        mask = None if mask is None else mask[..., :T]
    return reference(q, k, v, mask=mask, is_causal=is_causal, scale=scale)
"""

SQUARE_PROFILE = """
name = "kern.square"
target = "kern_square:square"
dtypes = ["float64", "float32"]

[options]
is_causal = "is_causal"
scale = "scale"

[mask]
bool = "mask"
float = false

[domain]
head_dims = [8]
t_multiple = 8
s_multiple = 16
"""


@pytest.mark.clause("13.15", "13.19")
def test_a_carried_call_names_the_misreading_it_shows(tmp_path):
    """cross-T7-S13 (D = 4) is carried to T = 8, S = 16, D = 8 (a query, three keys blocked
    by a bool mask, zero columns): the kernel's output, mapped back, is held against the
    misreadings of the call it received, mapped back the same way, and the keys read as if
    S = T name it (not "departs from §2.1", the fixture's clause)."""
    (tmp_path / "kern_square.py").write_text(SQUARE)
    path = tmp_path / "kern.toml"
    path.write_text(SQUARE_PROFILE)
    code, out, _ = _run(tmp_path, path, "test_fixtures.py", args=["-k", "cross-T7-S13-float64"])
    assert code == 1 and "1 failed" in out, out[-3000:]
    assert "kern.square: the keys are read as if S = T" in out, out[-3000:]
    assert "departs from §2.1" not in out and "built again" not in out


@pytest.mark.clause("12.9", "13.19")
def test_a_gradient_fixture_is_built_again_with_the_oracles_gradients():
    """grad-T5-S7-E4 at a backward domain of T = S = 16 and D = 16: its upstream gradient
    drawn at the new shape, the oracle's gradients beside it; the reference's backward on
    the new inputs is within SPEC §7 of them, and one that drops the scale is not."""
    from conformance.backends import load_backend
    from conformance.suite.tolerance import tolerance

    case = rebuilt_case("grad-T5-S7-E4-float32", 16, 16, 16, 16)
    q, k, v = case.inputs()
    assert q.shape[-2:] == (16, 16) and case.d_out().shape == (*q.shape[:-1], 16)
    assert list(case.expected_grads) == ["dq", "dk", "dv"]
    reference = load_backend("numpy")
    grads = reference.attention_vjp(q, k, v, case.d_out(), **case.options())
    wrong = reference.attention_vjp(q, k, v, case.d_out(), **{**case.options(), "scale": 1.0})
    for (name, want), got, bad in zip(case.expected_grads.items(), grads, wrong):
        tol = tolerance(case.dtype, case.grad_naive_error(name), want)
        assert np.abs(got - want).max() <= tol, name
        assert np.abs(bad - want).max() > tol, name


#: The tiled kernel of test_domain (D in {16, 32}, S % 16 = 0, no mask), which under
#: causality with more queries than keys reads key slots past S as a square problem would
#: (what they hold there is no number): a blockwise kernel's bug.
PAST_S = """

def past_s(q, k, v, is_causal=False, scale=None):
    assert q.shape[-1] in (16, 32) and k.shape[-2] % 16 == 0, (q.shape, k.shape)
    T, S = q.shape[-2], k.shape[-2]
    if is_causal and T > S:
        nan = np.full((*k.shape[:-2], T - S, k.shape[-1]), np.nan, dtype=k.dtype)
        k, v = np.concatenate([k, nan], -2), np.concatenate([v, nan], -2)  # (B, H, T, D)
    return reference(q, k, v, is_causal=is_causal, scale=scale)
"""


@pytest.mark.clause("3.4", "13.19")
def test_causal_with_more_queries_than_keys_is_built_again_inside_the_domain(tmp_path):
    """causal-T13-S7 (float32) reaches a kernel with S % 16 = 0 built again at T = 32,
    S = 16 (more queries than keys still): a kernel that reads keys past S fails it with
    that cause named by the oracle's diagnosis, and the correct kernel passes."""
    kernel = _no_mask_kernel(head_dims=(16,), t_multiple=16, s_multiple=16)
    case = case_inside(kernel, load_case("causal-T13-S7-float32"))
    assert [case.meta["shape"][x] for x in "TS"] == [32, 16]
    path = _kernel(tmp_path, TILED)
    selection = ["-k", "test_fixture_case and causal-T13-S7-float32"]
    code, out, _ = _run(tmp_path, path, "test_fixtures.py", args=selection)
    assert code == 0 and "1 passed" in out, out[-3000:]
    (tmp_path / "kern.py").write_text((tmp_path / "kern.py").read_text() + PAST_S)
    path.write_text(TILED.replace('"kern:tiled"', '"kern:past_s"'))
    code, out, _ = _run(tmp_path, path, "test_fixtures.py", args=selection)
    assert code == 1 and "1 failed" in out, out[-3000:]
    assert "keys are read past S" in out, out[-3000:]
