"""SPEC §20 on the project's side: the dequantised operand is exact, the quantized forms
are declared and checked, and a backend without the capability refuses the entry point."""

from __future__ import annotations

import functools
from pathlib import Path

import mpmath
import numpy as np
import pytest
import quantized_functions
from conformance.fixtures import quantized as fq
from conformance.impls.numpy import quantized as page

from conformance import load_backend
from conformance.backends.registry import BUILTIN
from conformance.suite import quantized as sq
from conformance.vocabulary import QuantizedForm

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.clause("20.7")
def test_the_suite_hands_a_function_only_the_form_it_declares(request):
    """A function of FlashInfer's form in e5m2 (scalar scales per tensor) is handed e5m2
    codes and scalar descales by the tests that need no particular form (the long rows,
    the growing scores, the FP8 output's operands), and passes them; it is never handed
    FlashAttention-3's per-head e4m3, which its scalar keywords would refuse."""
    from conformance.adapters.quantized import QuantizedFunctionBackend
    from conformance.tests import test_quantized as spec

    backend = QuantizedFunctionBackend(
        flashinfer_style,
        name="flashinfer-e5m2",
        framework="numpy",
        layout="BHTD",
        caps=["gqa"],
        table={
            "formats": {r: ["float8_e5m2"] for r in "qkv"},
            "granularities": {r: ["tensor"] for r in "qkv"},
            "pipeline": "float32",
            "descales": {"q": "q_scale", "k": "k_scale", "v": "v_scale"},
            "descale_form": "scalar",
            "options": {"scale": "sm_scale"},
        },
    )
    assert sq.declared_form(backend) == (("float8_e5m2",) * 3, ("tensor",) * 3, None)
    o = sq.operands_for(backend, 39)
    assert all(np.asarray(o[r]).dtype.name == "float8_e5m2" for r in "qkv")
    assert all(np.shape(o[f"{r}_descale"]) == () for r in "qkv")
    spec.test_growing_row_maxima_stay_finite(request, backend)
    with pytest.raises(ValueError, match="scalar q descale"):
        sq.call(backend, sq.growing_scores(36))  # FlashAttention-3's form: refused


@pytest.mark.clause("20.1")
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_codes_times_descale_is_exact_in_float64(fmt):
    """Every code of the format times random float32 descales: the float64 product is the
    exact product (50 digits), in the oracle's dequantise and in the NumPy page's."""
    if fmt == "int8":
        codes = np.arange(-127, 128).astype(np.int8)
    else:
        codes = np.arange(256, dtype=np.uint8).view(fq.code_dtype(fmt))
        codes = codes[np.isfinite(codes.astype(np.float64))]
    rng = np.random.default_rng(0)
    descale = rng.uniform(1e-4, 10, 4).astype(np.float32)
    for d in descale:
        x = codes.reshape(1, 1, -1, 1)
        got = fq.dequantize(x, d).ravel()
        ctx = mpmath.MPContext()
        ctx.dps = 50
        exact = [ctx.mpf(float(c)) * ctx.mpf(float(d)) for c in codes.astype(np.float64)]
        assert all(ctx.mpf(float(g)) == e for g, e in zip(got, exact))
        assert np.array_equal(page.dequantize(x, d).ravel(), got)


@pytest.mark.clause("20.5")
def test_the_cast_rules():
    """465 in e4m3: 448 saturating, NaN overflowing; 61,440 in e5m2: 57,344 or inf; the
    round-to-nearest-even of 464 is 448 under both."""
    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    cast = lambda x, f, r: float(fq.cast(np.array([x]), f, r).astype(np.float64)[0])  # noqa: E731
    assert cast(465, e4, "saturate") == 448 and np.isnan(cast(465, e4, "overflow"))
    assert cast(464, e4, "overflow") == 448
    assert cast(61440, e5, "saturate") == 57344 and cast(61440, e5, "overflow") == np.inf
    assert cast(-61440, e5, "overflow") == -np.inf


@pytest.mark.clause("20.7")
def test_the_quantized_backends_declare_their_form():
    """Each shipped backend with "quantized" declares a QuantizedForm and runs §20 alone;
    a form with a format or granularity the spec does not know is refused by name."""
    quantized = [n for n, cls in BUILTIN.items() if "quantized" in cls.capabilities]
    assert set(quantized) == {"numpy-fp8", "torch-fp8", "jax-fp8"}
    backend = load_backend("numpy-fp8", pipeline="e4m3_normalized")
    assert isinstance(backend.quantized, QuantizedForm)
    assert backend.quantized.pipeline == "e4m3_normalized" and backend.sections == ("20",)
    with pytest.raises(ValueError, match="granularities"):
        QuantizedForm(
            formats={"q": ("int8",), "k": ("int8",), "v": ("float8_e4m3fn",)},
            granularities={"q": ("token",), "k": ("head",), "v": ("head",)},
            pipeline="float32",
        )
    with pytest.raises(ValueError, match="formats"):
        QuantizedForm(
            formats={"q": ("int4",), "k": ("int8",), "v": ("int8",)},
            granularities={"q": ("head",), "k": ("head",), "v": ("head",)},
            pipeline="float32",
        )


@pytest.mark.clause("20.8")
def test_without_the_capability_attention_quantized_is_refused():
    o = sq.operands(41)
    with pytest.raises(NotImplementedError, match="quantized"):
        sq.call(load_backend("numpy"), o)


@pytest.mark.clause("20.7")
def test_a_profile_declares_its_quantized_form(tmp_path):
    """examples/fp8_attention.toml gives a backend of SPEC §20 alone, in the declared form;
    its output on the suite's operands is within §20.6's bound; a [quantized] table with an
    unknown key, or without the descales' keywords, is refused by name."""
    from conformance.adapters.profiles import ProfileError, read_profile

    backend = read_profile(ROOT / "examples" / "fp8_attention.toml").resolve()
    assert backend.sections == ("20",) and backend.quantized.pipeline == "e4m3_unnormalized"
    # It has a causal keyword: it takes causal calls (bottom-right only) and non-causal ones.
    assert "causal_top_left" not in backend.forms
    assert {"causal", "non_causal"} <= backend.forms
    o = sq.operands(42)
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    expected, bound = sq.expected_and_bound(backend, o, **options)
    assert np.abs(sq.call(backend, o, **options) - expected).max() <= bound
    text = (ROOT / "examples" / "fp8_attention.toml").read_text()
    for bad, words in (
        ('pipeline = "e4m3_unnormalized"', "pipeline should be one of"),
        ('descales = { q = "q_descale", k = "k_descale", v = "v_descale" }', "descales"),
    ):
        path = tmp_path / "bad.toml"
        broken = text.replace(bad, 'pipeline = "fp4"' if "pipeline" in bad else "")
        path.write_text(broken)
        with pytest.raises(ProfileError, match=words):
            read_profile(path).resolve()


def flashinfer_style(q, k, v, *, q_scale, k_scale, v_scale, sm_scale=None):
    """A NumPy function with FlashInfer's scalar scales: the operands dequantised, then the
    textbook (for the kit's test of descale_form = "scalar")."""
    q, k, v = (x.astype(np.float64) * s for x, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * (sm_scale or 1 / np.sqrt(q.shape[-1]))
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True) @ v).astype(np.float32)


@pytest.mark.clause("20.7")
def test_scalar_descales_reach_the_function_as_floats():
    from conformance.adapters.quantized import QuantizedFunctionBackend

    backend = QuantizedFunctionBackend(
        flashinfer_style,
        name="flashinfer-style",
        framework="numpy",
        layout="BHTD",
        caps=["gqa"],
        table={
            "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
            "granularities": {r: ["tensor"] for r in "qkv"},
            "pipeline": "float32",
            "descales": {"q": "q_scale", "k": "k_scale", "v": "v_scale"},
            "descale_form": "scalar",
            "options": {"scale": "sm_scale"},
        },
    )
    o = sq.operands(43, granularities=("tensor",) * 3)
    expected, bound = sq.expected_and_bound(backend, o)
    assert np.abs(sq.call(backend, o) - expected).max() <= bound
    with pytest.raises(ValueError, match="scalar q descale"):
        sq.call(backend, sq.operands(43))


@pytest.mark.clause("20.1")
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_the_pages_quantise_within_half_a_code(fmt):
    """The pages' first lesson: per (batch, head), amax lands on the largest code, and
    codes × descale is within half a code's spacing of x (ties to even, no saturation)."""
    torch = pytest.importorskip("torch")
    from conformance.impls.torch import quantized as torch_page

    x = np.random.default_rng(7).standard_normal((2, 3, 5, 4)) * 3
    codes, descale = page.quantize(x, fmt, axes=(0, 1))
    values = page.dequantize(codes, descale)
    spacing = {"float8_e4m3fn": 2.0**-3, "float8_e5m2": 2.0**-2, "int8": None}[fmt]
    amax = np.abs(x).max(axis=(2, 3), keepdims=True)
    if spacing is None:  # int8: integer codes, spacing one descale
        assert (np.abs(values - x) <= descale[..., None, None] / 2 + 1e-12).all()
    else:  # floats: half a spacing relative to the value, or of the smallest normal
        assert (np.abs(values - x) <= np.maximum(np.abs(x), amax * 2.0**-14) * spacing).all()
    assert np.abs(codes.astype(np.float64)).max() == fq.LARGEST[fmt]
    t_codes, t_descale = torch_page.quantize(torch.from_numpy(x), fmt, axes=(0, 1))
    assert np.array_equal(t_descale.numpy(), descale)
    assert np.array_equal(t_codes.to(torch.float64).numpy(), codes.astype(np.float64))


@pytest.mark.clause("20.7")
def test_torch_has_no_float8_attention_on_the_cpu():
    """What docs/test-your-quantized-attention.md says of the installed torch: its
    scaled_dot_product_attention and its float8 matmul refuse float8_e4m3fn on the CPU
    (torch._scaled_mm runs there, a matrix product, not attention), so torch has no FP8
    attention of its own to judge on this machine."""
    torch = pytest.importorskip("torch")
    q = torch.ones(1, 2, 4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float8_e4m3fn'"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float8_e4m3fn'"):
        q @ q.transpose(-1, -2)
    a = q[0, 0]
    one = torch.tensor(1.0)
    product = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    assert torch.equal(product, a.float() @ a.float().t())


@pytest.mark.clause("20.7")
def test_jax_has_no_float8_attention_on_the_cpu():
    """What docs/test-your-quantized-attention.md says of the installed JAX:
    jax.nn.dot_product_attention refuses float8_e4m3fn inputs on the CPU, with the XLA
    implementation and the default one (it promotes q to float32, which 8-bit floats do
    not allow). Under jax.jit, so the refusal comes while tracing and nothing is compiled
    (called eagerly, its reshape of q is compiled first)."""
    jax = pytest.importorskip("jax")
    import ml_dtypes

    q = jax.device_put(np.ones((1, 4, 2, 8), ml_dtypes.float8_e4m3fn))
    for implementation in ("xla", None):
        attend = jax.jit(
            lambda x, i=implementation: jax.nn.dot_product_attention(x, x, x, implementation=i)
        )
        with pytest.raises(jax.dtypes.TypePromotionError, match="8-bit floats"):
            attend(q)


def self_quantizing(
    q, k, v, *, is_causal=False, block_size=None, granularity="tensor", q_granularity="tensor"
):
    """A NumPy function that quantizes its own float inputs to e4m3 with scales from the
    data (amax / 448): q at ``q_granularity``, k and v at ``granularity``, over the whole
    tensor (Transformer Engine's tensorwise current scaling), over blocks of
    ``block_size`` tokens (MXFP8's sequence blocks of V) or per token; then it attends in
    float64, causal bottom-right."""
    import ml_dtypes

    def quantized(x, granularity=granularity):
        n = x.shape[2]
        if granularity == "tensor":
            groups = np.abs(x).max(keepdims=True)
        elif granularity == "block":
            blocks = [np.abs(x[:, :, i : i + block_size]) for i in range(0, n, block_size)]
            amax = [np.broadcast_to(b.max(axis=(2, 3), keepdims=True), b.shape) for b in blocks]
            groups = np.concatenate(amax, axis=2)
        else:
            groups = np.abs(x).max(axis=3, keepdims=True)
        scale = groups.astype(np.float64) / 448
        return (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale

    q, k, v = quantized(q, q_granularity), quantized(k), quantized(v)
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    T, S = s.shape[-2:]
    if is_causal:
        s = np.where(np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True) @ v).astype(np.float32)


@pytest.mark.clause("20.4")
def test_a_self_quantizing_function_may_quantize_q_per_token(tmp_path):
    """``quantizes = true`` with SageAttention's granularities, q per token too: the
    profile is read, and the function, scales per token, leaks no future. Without
    ``formats`` and ``granularities`` the profile is refused, naming them."""
    from conformance.adapters.profiles import ProfileError, read_profile
    from conformance.tests import test_quantized as spec

    path = tmp_path / "self.toml"
    table = (
        'name = "self-token"\ntarget = "test_quantized:self_quantizing"\n'
        'capabilities = ["gqa", "causal_bottom_right"]\n[quantized]\nquantizes = true\n'
        'options = { is_causal = "is_causal" }\nalignment = "bottom_right"\n'
    )
    forms = (
        'formats = { q = ["int8"], k = ["float8_e4m3fn"], v = ["float8_e4m3fn"] }\n'
        'granularities = { q = ["token"], k = ["token"], v = ["token"] }\n'
    )
    path.write_text(table + forms)
    backend = read_profile(path).resolve()
    assert backend.quantized.granularities["q"] == ("token",)
    backend.func = functools.partial(self_quantizing, granularity="token", q_granularity="token")
    spec.test_a_self_quantizing_function_leaks_no_future(backend)
    path.write_text(table)
    with pytest.raises(ProfileError, match="'formats' of q, k and v is required"):
        read_profile(path).resolve()


@pytest.mark.clause("20.4")
@pytest.mark.parametrize(
    ("granularity", "leaks"), [("tensor", True), ("block", True), ("token", False)]
)
def test_the_leakage_test_fails_a_function_whose_scales_read_the_future(granularity, leaks):
    """A function that quantizes itself is held to no future leakage (``quantizes =
    true``): scales per tensor, or per block of 4 tokens spanning a row's diagonal, read the
    future and fail the test (TransformerEngine #3248); scales per token pass it. Such a
    function is handed no codes: every other test of §20 skips it by name."""
    import functools

    from conformance.adapters.quantized import QuantizedFunctionBackend
    from conformance.suite.tolerance import Departure
    from conformance.tests import test_quantized as spec

    backend = QuantizedFunctionBackend(
        functools.partial(self_quantizing, granularity=granularity),
        name=f"self-quantizing-{granularity}",
        framework="numpy",
        layout="BHTD",
        caps=["gqa", "causal_bottom_right"],
        table={
            "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
            "granularities": {"q": ["tensor"], "k": [granularity], "v": [granularity]},
            "quantizes": True,
            "options": {"is_causal": "is_causal"},
            "alignment": "bottom_right",
        },
    )
    if leaks:
        with pytest.raises(Departure, match="rows 0-5 after key 10"):
            spec.test_a_self_quantizing_function_leaks_no_future(backend)
    else:
        spec.test_a_self_quantizing_function_leaks_no_future(backend)
    with pytest.raises(pytest.skip.Exception, match="quantizes its own inputs"):
        sq.call(backend, sq.operands_for(backend, 30))


@pytest.mark.clause("20.7")
def test_a_bottom_right_function_runs_the_cases_where_the_alignments_coincide(request):
    """A correct per-tensor FP8 function whose causality is bottom-right only passes the
    worked example, causal at T = S = 3, where top-left and bottom-right are the same call;
    only a causal call with T ≠ S is refused as top-left (the form the run names untested)."""
    from conformance.adapters.quantized import QuantizedFunctionBackend
    from conformance.tests import test_quantized as spec

    backend = QuantizedFunctionBackend(
        quantized_functions.per_tensor_bottom_right,
        name="per-tensor-bottom-right",
        framework="numpy",
        layout="BHTD",
        caps=["gqa", "causal_bottom_right"],
        table={
            "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
            "granularities": {r: ["tensor"] for r in "qkv"},
            "pipeline": "float32",
            "descales": {"q": "q_scale", "k": "k_scale", "v": "v_scale"},
            "descale_form": "scalar",
            "options": {"is_causal": "causal", "scale": "sm_scale"},
            "alignment": "bottom_right",
        },
    )
    spec.test_quantized_fixture(request, backend, "quantized-worked-example")
    o = sq.operands(44, granularities=("tensor",) * 3)
    with pytest.raises(NotImplementedError, match="causal bottom_right only"):
        sq.call(backend, o, is_causal=True)  # T = 7, S = 11: top-left differs


def _lifted_backend(name: str, table: dict | None = None, **kernel):
    """``quantized_functions.lifted`` with ``kernel``'s pipeline, declaring ``table``'s
    parameters (lift, tile, accumulator) in FlashAttention-3's per-head e4m3 form."""
    import functools

    from conformance.adapters.quantized import QuantizedFunctionBackend

    return QuantizedFunctionBackend(
        functools.partial(quantized_functions.lifted, **kernel),
        name=name,
        framework="numpy",
        layout="BHTD",
        caps=["gqa", "causal", "causal_bottom_right"],
        table={
            "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
            "granularities": {r: ["head"] for r in "qkv"},
            "pipeline": "e4m3_unnormalized",
            "descales": {"q": "q_descale", "k": "k_descale", "v": "v_descale"},
            "options": {"is_causal": "causal", "scale": "sm_scale"},
            "alignment": "bottom_right",
            **(table or {}),
        },
    )


@pytest.mark.clause("20.9")
@pytest.mark.parametrize("S", [129, 4096])
@pytest.mark.parametrize("lift", [448, 384, 192, 28, 7])
def test_a_kernel_that_declares_its_lift_conforms_on_rows_of_equal_weights(request, S, lift):
    """v = c on long diffuse rows, where every weight is nearly the same number and the
    roundings of P add up instead of cancelling: a correct kernel lifting P by 448
    (SageAttention), 384, 192, 28 or 7 conforms when it declares its lift, since the bound
    runs the very pipeline it computes (SPEC §20.9); held to FlashAttention-3's 2⁸, each
    fails at S = 129, by 1.2 to 1.3 times the bound (384 and 192 by 3.1 at S = 4,096)."""
    from conformance.tests import test_quantized as spec

    backend = _lifted_backend(f"lift-{lift}", {"lift": lift}, lift=float(lift))
    spec.test_constant_v_gives_the_constant_on_long_diffuse_rows(request, backend, S)


@pytest.mark.clause("20.9")
def test_a_tiled_kernel_declares_its_tile(request):
    """A kernel that rounds P at each tile of 64 keys' running maximum, declaring its tile:
    the run rounds the same numbers, and its error is the run's (SPEC §20.9's table)."""
    from conformance.tests import test_quantized as spec

    tiled = _lifted_backend("tiled-448", {"lift": 448, "tile": 64}, lift=448.0, tile=64)
    spec.test_constant_v_gives_the_constant_on_long_diffuse_rows(request, tiled, 4096)
    spec.test_growing_row_maxima_stay_finite(request, tiled)


@pytest.mark.clause("20.9")
@pytest.mark.parametrize(
    ("kernel", "declared"),
    [
        ({"p_format": "float8_e5m2"}, {}),
        ({"accumulator": "bfloat16"}, {}),
        ({"accumulator": "float16"}, {}),
        ({"accumulator": "bfloat16"}, {"accumulator": "float16"}),
    ],
    ids=["P-in-e5m2", "bfloat16-sums", "float16-sums", "bfloat16-declared-float16"],
)
def test_rounding_worse_than_the_declared_pipeline_fails(request, kernel, declared):
    """A kernel whose rounding is worse than the pipeline it declares fails, its lift
    declared: P rounded to e5m2 (2 fraction bits) declared as e4m3, P·V summed in bfloat16
    or float16 declared as float32, bfloat16 sums declared as float16 (SPEC §20.9)."""
    import ml_dtypes

    from conformance.suite.tolerance import Departure
    from conformance.tests import test_quantized as spec

    if "accumulator" in kernel:
        dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[kernel["accumulator"]]
        kernel = {**kernel, "accumulator": dtype}
    worse = _lifted_backend("worse", {"lift": 448, **declared}, lift=448.0, **kernel)
    with pytest.raises(Departure, match="everywhere, S = 129"):
        spec.test_constant_v_gives_the_constant_on_long_diffuse_rows(request, worse, 129)


@pytest.mark.clause("20.9")
def test_a_kernel_that_declares_its_16_bit_accumulator_conforms(request):
    """P·V summed in bfloat16, declared: held to the bfloat16 sums of its own pipeline."""
    import ml_dtypes

    from conformance.tests import test_quantized as spec

    backend = _lifted_backend(
        "bf16-sums", {"lift": 448, "accumulator": "bfloat16"},
        lift=448.0, accumulator=ml_dtypes.bfloat16,
    )  # fmt: skip
    spec.test_constant_v_gives_the_constant_on_long_diffuse_rows(request, backend, 129)


def _fp8_output_backend(name: str, **kernel):
    """``quantized_functions.fp8_output`` declared as its profile would: e4m3 output,
    saturating, its output descale under the keyword ``o_scale``."""
    from conformance.adapters.quantized import QuantizedFunctionBackend

    return QuantizedFunctionBackend(
        functools.partial(quantized_functions.fp8_output, **kernel),
        name=name,
        framework="numpy",
        layout="BHTD",
        caps=["gqa"],
        table={
            "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
            "granularities": {r: ["tensor"] for r in "qkv"},
            "pipeline": "float32",
            "descales": {"q": "q_scale", "k": "k_scale", "v": "v_scale"},
            "descale_form": "scalar",
            "options": {"scale": "sm_scale", "out_descale": "o_scale"},
            "out_formats": ["float8_e4m3fn"],
            "cast_rule": "saturate",
        },
    )


@pytest.mark.clause("20.5")
def test_an_fp8_output_declared_in_a_profile_is_tested():
    """A function declaring an e4m3 output, its cast rule and its output descale's keyword
    is handed out_descale and judged (SPEC §20.5): the correct one passes, one whose cast
    does not saturate (NaN past 448) and one that multiplies by the descale fail."""
    from conformance.suite.tolerance import Departure
    from conformance.tests import test_quantized as spec

    spec.test_fp8_output_is_the_oracles_output_quantised(
        _fp8_output_backend("fp8-out"), "float8_e4m3fn"
    )
    for name, kernel in (("no-saturation", {"saturates": False}), ("inverted", {"inverted": True})):
        with pytest.raises(Departure):
            spec.test_fp8_output_is_the_oracles_output_quantised(
                _fp8_output_backend(name, **kernel), "float8_e4m3fn"
            )
    with pytest.raises(pytest.skip.Exception, match="float8_e5m2 output"):
        spec.test_fp8_output_is_the_oracles_output_quantised(
            _fp8_output_backend("fp8-out"), "float8_e5m2"
        )


@pytest.mark.clause("20.5")
def test_out_formats_need_the_output_descales_keyword():
    """out_formats without the keyword of out_descale is refused, naming it."""
    from conformance.adapters.quantized import QuantizedFunctionBackend

    with pytest.raises(ValueError, match="out_formats needs the keyword"):
        QuantizedFunctionBackend(
            quantized_functions.fp8_output,
            name="no-keyword",
            framework="numpy",
            layout="BHTD",
            caps=[],
            table={
                "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
                "granularities": {r: ["tensor"] for r in "qkv"},
                "descales": {"q": "q_scale", "k": "k_scale", "v": "v_scale"},
                "options": {"scale": "sm_scale"},
                "out_formats": ["float8_e4m3fn"],
            },
        )


@pytest.mark.clause("20.4")
def test_a_normalised_p_fails_on_a_row_with_one_dominant_key(request):
    """A function that normalises P before rounding it to e4m3 with no lift, declaring
    FlashAttention-3's pipeline, fails the stored case whose every row has one dominant key
    and no sink (``quantized-e4m3-head-dominant-key``): its other weights, near e⁻⁸,
    underflow to 0. Before that case, only a function declaring sinks met such a row."""
    from conformance.adapters.quantized import QuantizedFunctionBackend
    from conformance.suite.tolerance import Departure
    from conformance.tests import test_quantized as spec

    backend = QuantizedFunctionBackend(
        quantized_functions.normalised_p,
        name="normalised-p",
        framework="numpy",
        layout="BHTD",
        caps=["gqa"],
        table={
            "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
            "granularities": {r: ["head"] for r in "qkv"},
            "pipeline": "e4m3_unnormalized",
            "descales": {"q": "q_descale", "k": "k_descale", "v": "v_descale"},
            "options": {"scale": "sm_scale"},
        },
    )
    with pytest.raises(Departure, match="dominant-key"):
        spec.test_quantized_fixture(request, backend, "quantized-e4m3-head-dominant-key")


@pytest.mark.clause("20.7")
def test_the_summary_names_declared_forms_no_call_exercised(tmp_path):
    """A profile declaring int8 q and k and e5m2 v beside e4m3, all per tensor: no test of
    the run hands it those (every case pairs them with a form it does not declare), and the
    run's "judged on" line says so, operand by operand; what the calls did hand it is not
    listed."""
    import os
    import subprocess
    import sys

    path = tmp_path / "multi.toml"
    path.write_text(
        'name = "multi"\ntarget = "quantized_functions:per_tensor_bottom_right"\n'
        'capabilities = ["gqa", "causal_bottom_right"]\n[quantized]\n'
        'formats = { q = ["float8_e4m3fn", "int8"], k = ["float8_e4m3fn", "int8"], '
        'v = ["float8_e4m3fn", "float8_e5m2"] }\n'
        'granularities = { q = ["tensor"], k = ["tensor"], v = ["tensor"] }\n'
        'pipeline = "float32"\ndescales = { q = "q_scale", k = "k_scale", v = "v_scale" }\n'
        'descale_form = "scalar"\noptions = { is_causal = "causal", scale = "sm_scale" }\n'
        'alignment = "bottom_right"\n'
    )
    tests = Path(__file__).resolve().parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance.tests.test_quantized",
         "--impl-profile", str(path), "-q", "-p", "no:cacheprovider", "-n", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": f"{tests}:{ROOT}"},
    )  # fmt: skip
    line = next((x for x in run.stdout.splitlines() if x.startswith("multi judged on")), "")
    assert line.endswith(
        "declared, handed by no call: q in int8 per tensor, k in int8 per tensor, "
        "v in float8_e5m2 per tensor"
    ), run.stdout[-3000:]
