"""SPEC §20: quantized operands. The expected output is the oracle on the dequantised q, k
and v (codes × descale, exact in float64), held to §20.6's bound: twice the error of the
backend's declared P pipeline run plainly on the same operands, plus float32's floor.
The checks of §20.4 need no bound: a swap of two heads' descales leaves every other
head's output bit for bit as it was, a power of two moved between codes and descale
leaves the output bit for bit as it was, and a causal row is bit for bit the same
whatever the future tokens of its block hold, or, for a function that quantizes its own
float inputs, whatever its future tokens hold.

One shape serves nearly every test (B=2, H=4, K=2, T=7, S=11, D=E=8); the long rows of
§20.4's mass conservation add S = 127, 128, 129 and 4,096 with T=3."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conformance.fixtures import quantized as fq
from conformance.suite import quantized as sq
from conformance.suite.cases import case_entries, case_marks, load_case
from conformance.suite.diagnosis import other_cast_rule
from conformance.suite.measure import publish_pipeline_costs
from conformance.suite.requirements import requires
from conformance.suite.tolerance import assert_identical, assert_within, expect, expect_seen

pytestmark = requires("quantized", "gqa")

E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"

#: (formats of q, k, v; granularities of q, k, v; block length): FlashAttention-3's
#: per-head e4m3, cuDNN's and Transformer Engine's per tensor, a KV cache's per token, per
#: block of 4 tokens, e5m2, SageAttention's int8 q and k, and int8 q, k and v per tensor
#: (ONNX Runtime's int8 KV cache).
FORMS = {
    "e4m3-head": ((E4M3,) * 3, ("head",) * 3, None),
    "e4m3-tensor": ((E4M3,) * 3, ("tensor",) * 3, None),
    "e4m3-token": ((E4M3,) * 3, ("head", "token", "token"), None),
    "e4m3-block4": ((E4M3,) * 3, ("head", "block", "block"), 4),
    "e5m2-head": ((E5M2,) * 3, ("head",) * 3, None),
    "int8-qk-e4m3-v": (("int8", "int8", E4M3), ("head", "head", "token"), None),
    "int8-tensor": (("int8",) * 3, ("tensor",) * 3, None),
}
#: The last T queries of a sequence of S keys (a KV cache's, FlashAttention's causal).
DECODE = {"is_causal": True, "causal_alignment": "bottom_right"}
#: The options of attention that quantization meets (SPEC §20.3), with what they need.
SETUPS = {
    "plain": ({}, ()),
    "causal": ({"is_causal": True}, ("causal", "causal_top_left")),
    "decode": ({"is_causal": True, "causal_alignment": "bottom_right"}, ("causal_bottom_right",)),
    "bottom-right-window-softcap": (
        {"is_causal": True, "causal_alignment": "bottom_right", "window": (3, 1), "softcap": 2.0},
        ("causal_bottom_right", "window", "window_right", "softcap"),
    ),
    "sinks": ({"sinks": np.array([0.5, -1.0, 2.0, 0.0], np.float32)}, ("sinks",)),
    "bool-mask": ({"mask": "bool"}, ()),
}


def _form(backend, name: str) -> dict:
    """The operands of form ``name``, or a skip naming what the backend does not declare."""
    formats, granularities, L = FORMS[name]
    for role, fmt, gran in zip("qkv", formats, granularities):
        if not sq.supported(backend, role, fmt, gran):
            pytest.skip(f"{backend.name} does not declare {role} in {fmt} per {gran} (§20.7)")
    return sq.operands(30, formats=formats, granularities=granularities, block_size=L)


def _options(name: str) -> dict:
    options = dict(SETUPS[name][0])
    if options.get("mask") == "bool":
        mask = np.random.default_rng(31).random((2, 4, 7, 11)) < 0.7
        mask[0, 1, 2] = False  # a row with no key: exactly 0
        options["mask"] = mask
    return options


def _check(request, backend, o: dict, what: str, behaviour: str, **options) -> np.ndarray:
    """The backend's output on ``o``, held to §20.6's bound; the bounds of every P pipeline
    on the same operands are published for the report (what the declared one costs)."""
    expected = sq.expected(o, **options)
    bounds = sq.pipeline_bounds(o, expected, backend, **options)
    bound = bounds[backend.quantized.pipeline]
    out = sq.call(backend, o, **options)
    publish_pipeline_costs(
        request.node,
        backend=backend.name,
        case=what,
        pipeline=backend.quantized.pipeline,
        actual=out,
        expected=expected,
        bounds=bounds,
    )
    assert_within(
        out,
        expected,
        bound,
        f"{backend.name}: {what} (P pipeline {backend.quantized.pipeline}); SPEC §20.6's bound "
        "is 2 · the pipeline's error + float32's floor",
        behaviour=behaviour,
    )
    return out


#: Every form once with each setup in turn, and FlashAttention-3's form and the int8 KV
#: cache's with every setup: all forms and all setups, without their product (each pair a
#: backend declares is a JAX program; jax-fp8 declares no int8 v).
PAIRS = list(
    dict.fromkeys(
        [
            *zip(FORMS, itertools.cycle(SETUPS)),
            *((form, setup) for form in ("e4m3-head", "int8-tensor") for setup in SETUPS),
        ]
    )
)


@pytest.mark.clause("20.3", "20.1", "20.2", "20.6")
@pytest.mark.parametrize(
    ("form", "setup"),
    [
        pytest.param(form, setup, marks=requires(*SETUPS[setup][1]), id=f"{form}-{setup}")
        for form, setup in PAIRS
    ],
)
def test_quantized_matches_the_oracle_on_dequantised_operands(request, backend, form, setup):
    """Every format and granularity, and every option attention meets: the oracle's answer
    on codes × descale, within twice the declared pipeline's own error."""
    o = _form(backend, form)
    _check(
        request,
        backend,
        o,
        f"{form}, {setup}",
        "quantized attention differs from the oracle on the dequantised operands",
        **_options(setup),
    )


@pytest.mark.clause("20.4")
@pytest.mark.parametrize("role", ["q", "k", "v"])
@requires("causal", "causal_bottom_right")
def test_swapped_descales_change_exactly_those_heads(request, backend, role):
    """Descales per (batch, key/value head), drawn apart and never 1: swapping those of two
    key/value heads of batch 0 leaves every other (batch, head)'s rows bit for bit as they
    were and gives the two heads what the oracle says for the swapped descales."""
    if sq.declared_form(backend)[1]["qkv".index(role)] != "head":
        pytest.skip(f"{backend.name} does not declare {role}'s descale per head (§20.7)")
    o = sq.operands_for(backend, 32)
    before = sq.call(backend, o, **DECODE)
    swapped = dict(o)
    d = np.array(o[f"{role}_descale"])
    expect(
        d[0, 0] != d[0, 1] and (d != 1).all(),
        "the suite drew equal descales",
        f"{role}_descale {d}: the test needs two distinct descales, none 1",
    )
    d[0, [0, 1]] = d[0, [1, 0]]
    swapped[f"{role}_descale"] = d
    after = _check(
        request,
        backend,
        swapped,
        f"{role}'s descales of heads 0 and 1 swapped",
        f"{role}'s descale is not the one of its own (batch, key/value head)",
        **DECODE,
    )
    assert_identical(
        after[1],
        before[1],
        f"{backend.name}: batch 1's rows after batch 0's {role} descales were swapped",
        behaviour=f"{role}'s descales of one batch change another batch's output",
    )
    expect(
        not np.array_equal(after[0], before[0]),
        f"{role}'s descale is not used",
        f"{backend.name}: swapping {role}'s descales of two heads left their output as it was",
    )


@pytest.mark.clause("20.4")
@pytest.mark.parametrize("role", ["q", "k", "v"])
@pytest.mark.parametrize("form", ["e4m3-head", "e4m3-token"])
@requires("causal", "causal_bottom_right")
def test_power_of_two_moved_into_the_codes_changes_nothing(backend, role, form):
    """codes × 2 with descale / 2 is the same operand, exactly (both stay representable:
    the codes leave a factor 2 of room): the output is bit for bit the same."""
    formats, granularities, L = FORMS[form]
    if not all(sq.supported(backend, r, f, g) for r, f, g in zip("qkv", formats, granularities)):
        pytest.skip(f"{backend.name} does not declare {form} (§20.7)")
    o = sq.operands(33, formats=formats, granularities=granularities, block_size=L, room=2.0)
    moved = dict(o)
    doubled = np.asarray(o[role]).astype(np.float64) * 2
    moved[role] = fq.cast(doubled, formats["qkv".index(role)], "overflow")
    expect(
        np.array_equal(np.asarray(moved[role]).astype(np.float64), doubled),
        "the suite's doubled codes are not exact",
        f"{role}: a doubled code is not representable",
    )
    moved[f"{role}_descale"] = (np.asarray(o[f"{role}_descale"]) / 2).astype(np.float32)
    after = np.asarray(sq.call(backend, moved, **DECODE))
    before = np.asarray(sq.call(backend, o, **DECODE))
    # Bit for bit; the last call's output goes with the finding, so that a function wrong
    # on these operands already is named by its misreading (§13.15), not by this check.
    _, bound = sq.expected_and_bound(backend, o, **DECODE)
    expect_seen(
        after.dtype == before.dtype and np.array_equal(after, before, equal_nan=True),
        "a power of two moved between codes and descale changes the output",
        f"{backend.name}: {role}'s codes doubled and its descale halved ({form}): the output "
        "is not bit for bit the same",
        before,
        bound,
    )


def _constant_v(o: dict, descale: float = 0.37) -> tuple[dict, float]:
    """o with every value code 1.5 (3 in int8) and every entry of v's descale ``descale``:
    v = c."""
    o = dict(o)
    dtype = np.asarray(o["v"]).dtype
    code = 3.0 if dtype == np.int8 else 1.5
    o["v"] = np.full(np.shape(o["v"]), code).astype(dtype)
    o["v_descale"] = np.full(np.shape(o["v_descale"]), descale, np.float32)
    return o, code * float(np.float32(descale))


@pytest.mark.clause("20.4")
@pytest.mark.parametrize("S", [127, 128, 129, 4096])
@requires("causal", "causal_bottom_right")
def test_constant_v_gives_the_constant_on_long_diffuse_rows(request, backend, S):
    """v = c everywhere: every row with a key returns c, within §20.6's bound. The rows are
    diffuse (q small: every weight near 1/S; causal bottom-right, so the last T queries
    see nearly every key), where a normalised P in e4m3 falls below 2⁻⁹ and underflows
    once S passes about 1,000."""
    o = sq.operands_for(backend, 34, B=1, H=2, K=1, T=3, S=S, D=8, E=8, q_spread=0.05)
    o, c = _constant_v(o)
    expected = sq.expected(o, **DECODE)
    expect(
        np.allclose(expected, c, rtol=1e-15, atol=0),
        "the oracle does not conserve mass",
        f"oracle: {expected.ravel()[:4]}, expected {c}",
    )
    _check(
        request,
        backend,
        o,
        f"v = {c:.4g} everywhere, S = {S}",
        "v = c everywhere does not give c on a long diffuse row",
        **DECODE,
    )


@pytest.mark.clause("20.4")
def test_constant_v_under_a_dominant_sink(request, backend):
    """v = c with a sink 6 above every score: each row returns c · (1 − p_sink), as the
    oracle says; a normalised P, near e⁻⁶/S per key, underflows in e4m3."""
    if "sinks" not in backend.capabilities:
        pytest.skip(f"{backend.name} lacks capability 'sinks'")
    o = sq.operands_for(backend, 35, B=1, H=2, K=1, T=3, S=128, D=8, E=8, q_spread=0.05)
    o, _ = _constant_v(o)
    _check(
        request,
        backend,
        o,
        "v = c with a dominant sink",
        "v = c under a dominant sink differs from the oracle (a normalised P underflows)",
        sinks=np.array([6.0, 8.0], np.float32),
    )


@pytest.mark.clause("20.4")
def test_growing_row_maxima_stay_finite(request, backend):
    """Scores that grow key after key, up to about 60 (every tile's maximum above the last
    one's): P never passes the format's largest value, so the output is finite, and
    within the bound."""
    o = sq.growing_scores(36, backend)
    out = _check(
        request,
        backend,
        o,
        "scores growing along the keys",
        "scores that grow key after key make the output non-finite or wrong",
        scale=1.0,
    )
    expect(
        np.isfinite(out).all(),
        "growing row maxima make the output non-finite",
        f"{backend.name}: NaN or inf in {np.argwhere(~np.isfinite(out))[:4].tolist()}",
    )


@pytest.mark.clause("20.4")
@requires("causal", "causal_bottom_right")
def test_block_descales_leak_no_future(backend):
    """Causal (bottom-right, T = 7, S = 11: row t sees keys up to t + 4) with k and v
    descaled per block of 4 tokens: changing the codes of keys 10 and 11, the future of
    every row but the last, inside block 2 (keys 8-11, whose descale is kept), leaves rows
    0-5 bit for bit as they were."""
    formats, granularities, L = FORMS["e4m3-block4"]
    if not all(sq.supported(backend, r, f, g) for r, f, g in zip("qkv", formats, granularities)):
        pytest.skip(f"{backend.name} does not declare k and v per block (§20.7)")
    o = sq.operands(38, formats=formats, granularities=granularities, block_size=L)
    before = sq.call(backend, o, **DECODE)
    changed = dict(o)
    for role in ("k", "v"):
        codes = np.asarray(o[role]).astype(np.float64)
        codes[:, :, 10:] = -codes[:, :, 10:] * 0.5
        changed[role] = fq.cast(codes, E4M3, "saturate")
    after = sq.call(backend, changed, **DECODE)
    assert_identical(
        after[:, :, :6],
        before[:, :, :6],
        f"{backend.name}: rows 0-5 after the codes of keys 10 and 11 changed",
        behaviour="a per-block descale leaks future tokens into earlier causal rows",
    )


@pytest.mark.clause("20.4")
@requires("causal", "causal_bottom_right")
def test_a_self_quantizing_function_leaks_no_future(backend):
    """A function that quantizes its own float inputs (its profile's ``quantizes = true``),
    causal bottom-right (T = 7, S = 11: row t sees keys up to t + 4): key 10, the future of
    rows 0-5, made 100 times larger in k and v, leaves rows 0-5 bit for bit as they were,
    whatever scales the function computes (per tensor, per block of 4 tokens where it takes
    ``block_size``, per token); row 6, which sees key 10, changes. A scale computed over
    tokens a row must not see leaks them into it: TransformerEngine #3248."""
    if not getattr(backend, "quantizes", False):
        pytest.skip(
            f"{backend.name} takes codes and descales: its rows are held to no future "
            "leakage by test_block_descales_leak_no_future"
        )
    rng = np.random.default_rng(44)
    q = rng.standard_normal((2, 4, 7, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 11, 8)).astype(np.float32) for _ in range(2))
    L = sq.BLOCK if "block" in backend.quantized.granularities["k"] else None
    before = backend.attention_self_quantized(q, k, v, block_size=L, **DECODE)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 10] *= 100
    v2[:, :, 10] *= 100
    after = backend.attention_self_quantized(q, k2, v2, block_size=L, **DECODE)
    expect(
        not np.array_equal(after[:, :, 6], before[:, :, 6]),
        "the function does not read key 10",
        f"{backend.name}: row 6 sees key 10, made 100 times larger, and did not change",
    )
    assert_identical(
        after[:, :, :6],
        before[:, :, :6],
        f"{backend.name}: rows 0-5 after key 10 (their future) was made 100 times larger",
        behaviour="a scale computed over future tokens leaks them into earlier causal rows",
    )


@pytest.mark.clause("20.5")
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_fp8_output_is_the_oracles_output_quantised(backend, fmt):
    """With ``out_descale``, the codes returned are those of some output within §20.6's
    bound, cast under the backend's declared rule; an out_descale small enough that some
    outputs pass the format's largest value shows the rule: the largest code when it
    saturates, the format's overflow value (NaN in e4m3, ±inf in e5m2) when it does not."""
    form = backend.quantized
    if fmt not in form.out_formats:
        pytest.skip(f"{backend.name} does not declare {fmt} output (§20.7)")
    o = sq.operands_for(backend, 39)
    expected, bound = sq.expected_and_bound(backend, o)
    top = fq.LARGEST[fmt]
    out_descale = np.float32(np.abs(expected).max() / top * 0.75)
    got = sq.call(backend, o, out_descale=out_descale, out_format=fmt)
    rule = form.cast_rule
    low, high = (expected - bound) / float(out_descale), (expected + bound) / float(out_descale)
    lo = fq.cast(low, fmt, rule).astype(np.float64)
    hi = fq.cast(high, fmt, rule).astype(np.float64)
    # The cast is monotone up to the largest code: where an end of the interval overflows,
    # every code between the other end and the largest one is some y′'s cast too.
    lo_code = np.where(np.isfinite(lo), lo, np.where(low > 0, np.inf, -top))
    hi_code = np.where(np.isfinite(hi), hi, np.where(high < 0, -np.inf, top))
    with np.errstate(invalid="ignore"):
        inside = (lo_code <= got) & (got <= hi_code)
    either = ~np.isfinite(lo) | ~np.isfinite(hi)
    ok = inside | (
        either & ((got == lo) | (got == hi) | np.isnan(got) & (np.isnan(lo) | np.isnan(hi)))
    )
    where = np.argwhere(~ok)[:3].tolist()
    expect(
        bool(ok.all()),
        other_cast_rule(got, expected, out_descale, fmt, rule)
        or f"an FP8 output is not the oracle's output cast under the declared rule ({rule})",
        f"{backend.name}: out codes in {fmt} with out_descale {out_descale}, cast rule {rule}: "
        f"at {where} got {[got[tuple(i)] for i in where]}, allowed "
        f"{[(lo[tuple(i)], hi[tuple(i)]) for i in where]}",
    )
    past = np.abs(expected) - bound > top * float(out_descale) * (1 + 2**-3)
    expect(
        past.any(),
        "the suite's out_descale puts no output past the format",
        "no output lies past the largest code: the rule is not shown",
    )


@pytest.mark.clause("20.2")
@requires("error_messages")
@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("k_descale", np.ones((2, 2, 12), np.float32), ValueError),
        ("q_descale", np.ones((2, 4), np.float32), ValueError),
        ("v_descale", None, TypeError),
    ],
    ids=["k-per-token-wrong-S", "q-per-query-head", "v-float64"],
)
def test_a_descale_of_no_granularity_is_refused(backend, name, value, error):
    """A descale whose shape is none of §20.2's (k per token with S + 1 entries; q per query
    head, (B, H)) raises ValueError, one not float32 (v's own, in float64) TypeError,
    naming the argument."""
    o = dict(sq.operands_for(backend, 40))
    o[name] = np.asarray(o[name], np.float64) if value is None else value
    with pytest.raises(error, match=name):
        sq.call(backend, o)


@pytest.mark.parametrize(
    "case_id",
    [
        pytest.param(e["id"], marks=case_marks(e, "11.1"), id=e["id"])
        for e in case_entries(("attention_quantized",))
    ],
)
def test_quantized_fixture(request, backend, case_id):
    """The stored quantized cases (fixtures/manifest.json, kind "attention_quantized"): the
    codes from their bytes, the stored descales, the stored oracle output (50 digits), the
    bound from the declared pipeline on this machine (as §7.2's naive run). The first is the
    worked example quantised: its answer is the seed's."""
    case = load_case(case_id)
    entry = case.meta
    for role, fmt, gran in zip("qkv", entry["formats"], entry["granularities"]):
        if not sq.supported(backend, role, fmt, gran):
            pytest.skip(f"{backend.name} does not declare {role} in {fmt} per {gran} (§20.7)")
    o = {
        role: case.arrays[f"{role}_codes"].view(fq.code_dtype(fmt))
        for role, fmt in zip("qkv", entry["formats"])
    }
    o |= {f"{r}_descale": case.arrays[f"{r}_descale"] for r in "qkv"}
    o["block_size"] = entry["block_size"]
    options = dict(entry["options"])
    if options.get("window") is not None:
        options["window"] = tuple(options["window"])
    expected = case.arrays["expected"]
    bounds = sq.pipeline_bounds(o, expected, backend, **options)
    out = sq.call(backend, o, **options)
    publish_pipeline_costs(
        request.node,
        backend=backend.name,
        case=case_id,
        pipeline=backend.quantized.pipeline,
        actual=out,
        expected=expected,
        bounds=bounds,
    )
    assert_within(
        out,
        expected,
        bounds[backend.quantized.pipeline],
        f"{backend.name}: fixture {case_id} (P pipeline {backend.quantized.pipeline})",
        behaviour="quantized attention differs from the stored oracle output",
    )
