"""Native calls and profiles (SPEC §13.10-§13.14): the machinery that runs the spec on other
libraries' own functions. The shipped profiles themselves run in ``tox -e frameworks``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conformance.impls.numpy.attention import attention as reference

from conformance.adapters import impl, native, profiles
from conformance.backends import numpy_dtype, unregister_backend

ROOT = Path(__file__).resolve().parent.parent
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")


def _pytest(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "-q", "-p", "no:cacheprovider"]
        + list(args),
        cwd=cwd,
        capture_output=True,
        text=True,
    )


def _qkv(dtype="float64", B=2, H=4, K=2, T=5, S=6, D=3, E=2, seed=0):
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    return (
        rng.standard_normal((B, H, T, D)).astype(dt),
        rng.standard_normal((B, K, S, D)).astype(dt),
        rng.standard_normal((B, K, S, E)).astype(dt),
    )


# --- Conversion --------------------------------------------------------------------------------

FRAMEWORKS = [
    "numpy",
    pytest.param("torch", marks=needs_torch),
    pytest.param("jax", marks=pytest.mark.skipif(not HAS_JAX, reason="jax not installed")),
    *(
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not importlib.util.find_spec(package), reason=f"{package} not installed"
            ),
        )
        for name, package in (("mlx", "mlx"), ("tinygrad", "tinygrad"), ("paddle", "paddle"))
    ),
]


@pytest.mark.clause("13.10")
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16", "bool", "int64"])
def test_round_trip_keeps_dtype_and_bits(framework, dtype):
    arrays = native.make_framework(framework)
    x = np.random.default_rng(1).standard_normal((2, 3, 4)) * 1e3
    x = (x > 0) if dtype == "bool" else x.astype(numpy_dtype(dtype))
    back = arrays.to_numpy(arrays.from_numpy(x))
    assert back.dtype == x.dtype and back.shape == x.shape
    assert np.array_equal(back.view(np.uint8), np.ascontiguousarray(x).view(np.uint8))


@pytest.mark.clause("13.10")
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_layout_swap_is_heads_and_time(framework):
    arrays = native.make_framework(framework)
    x = np.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    swapped = arrays.to_numpy(arrays.swap_heads_and_time(arrays.from_numpy(x)))
    assert np.array_equal(swapped, x.transpose(0, 2, 1, 3))
    unbatched = arrays.to_numpy(arrays.swap_heads_and_time(arrays.from_numpy(x[0])))
    assert np.array_equal(unbatched, x[0].transpose(1, 0, 2))


@pytest.mark.clause("13.10")
@pytest.mark.skipif(not HAS_JAX, reason="jax not installed")
def test_jax_layout_swap_on_the_host_compiles_nothing():
    """A BTHD profile's swap of a concrete host array is NumPy's, where jnp.swapaxes would
    trace and compile a program for each shape and dtype; inside a gradient, where the
    array is traced, it is JAX's and differentiates."""
    from jax import monitoring

    arrays = native.make_framework("jax")
    traced, listening = [], [True]

    def heard(event: str, duration_secs: float, **_) -> None:
        if listening[0] and event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(duration_secs)

    monitoring.register_event_duration_secs_listener(heard)
    # A shape and dtype no other test swaps, so that JAX's own swap would have to trace.
    x = np.arange(3 * 7 * 11 * 2, dtype=np.float32).reshape(3, 7, 11, 2)
    try:
        swapped = arrays.swap_heads_and_time(arrays.from_numpy(x))
    finally:
        listening[0] = False
    assert traced == [] and arrays.is_array(swapped)
    assert np.array_equal(arrays.to_numpy(swapped), x.transpose(0, 2, 1, 3))
    d = np.arange(3 * 11 * 7 * 2, dtype=np.float32).reshape(3, 11, 7, 2)
    (grad,) = arrays.vjp(lambda a: 2 * arrays.swap_heads_and_time(a), [arrays.from_numpy(x)],
                         arrays.from_numpy(d))  # fmt: skip
    assert np.array_equal(arrays.to_numpy(grad), 2 * d.transpose(0, 2, 1, 3))


@pytest.mark.clause("13.10")
@pytest.mark.parametrize("framework", FRAMEWORKS[1:])
def test_vjp_is_the_frameworks_own_differentiation(framework):
    """Each framework's ``vjp`` differentiates the call in the framework: for x · y + x,
    the gradients d · (y + 1) and d · x."""
    arrays = native.make_framework(framework)
    rng = np.random.default_rng(2)
    x, y, d = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3))
    grads = arrays.vjp(lambda a, b: a * b + a, [arrays.from_numpy(v) for v in (x, y)],
                       arrays.from_numpy(d))  # fmt: skip
    dx, dy = (arrays.to_numpy(g) for g in grads)
    assert np.allclose(dx, d * (y + 1), rtol=1e-6) and np.allclose(dy, d * x, rtol=1e-6)


@pytest.mark.clause("13.10")
def test_auto_framework_from_the_module():
    assert native.framework_of(reference) == "numpy"
    if HAS_TORCH:
        import torch

        assert native.framework_of(torch.nn.functional.scaled_dot_product_attention) == "torch"
        assert native.framework_of(native.TorchFramework.vjp) == "numpy"  # imports no torch


def bthd_attention(q, k, v, *, mask=None, is_causal=False, scale=None):
    """The reference, taking and returning (B, T, H, D): a function in another layout."""
    q, k, v = (np.swapaxes(x, -3, -2) for x in (q, k, v))
    out = reference(q, k, v, mask=mask, is_causal=is_causal, scale=scale)
    return np.swapaxes(out, -3, -2)


def blocked_mask_attention(q, k, v, *, blocked=None, bias=None, is_causal=False, scale=None):
    """The reference with a bool mask that means True = blocked, and a separate bias."""
    mask = bias if blocked is None else ~blocked
    return reference(q, k, v, mask=mask, is_causal=is_causal, scale=scale)


@pytest.mark.clause("13.10")
def test_bthd_function_gives_the_reference():
    backend = impl.FunctionBackend(
        bthd_attention, name="bthd", capabilities=["gqa"], call=native.OptionMap(layout="BTHD")
    )
    q, k, v = _qkv()
    mask = np.random.default_rng(2).random((5, 6)) > 0.3
    for options in ({}, {"is_causal": True}, {"mask": mask, "scale": 0.3}):
        np.testing.assert_array_equal(
            backend.attention(q, k, v, **options), reference(q, k, v, **options)
        )


@pytest.mark.clause("13.11")
def test_mask_conventions_are_converted_visibly():
    call = native.OptionMap(
        options={"is_causal": "is_causal", "scale": "scale"},
        mask_bool="blocked",
        bool_true="blocked",
        mask_float="bias",
    )
    backend = impl.FunctionBackend(blocked_mask_attention, name="blocked", call=call)
    q, k, v = _qkv(K=4)
    mask = np.random.default_rng(3).random((5, 6)) > 0.3
    np.testing.assert_array_equal(
        backend.attention(q, k, v, mask=mask), reference(q, k, v, mask=mask)
    )
    assert call.mask("f", mask, q.dtype)["blocked"].tolist() == (~mask).tolist()
    additive = native.OptionMap(mask_bool=None, mask_float="bias").mask("f", mask, q.dtype)
    assert additive["bias"].dtype == q.dtype
    assert np.array_equal(additive["bias"] == 0, mask) and np.all(
        np.isneginf(additive["bias"][~mask])
    )
    # A mask the spec refuses (integer) reaches the library unchanged: refusing is its job.
    ints = np.ones((5, 6), np.int64)
    assert call.mask("f", ints, q.dtype)["blocked"] is not None
    assert call.mask("f", ints, q.dtype)["blocked"].dtype == np.int64


@pytest.mark.clause("13.11")
def test_an_option_without_a_keyword_is_never_dropped():
    call = native.OptionMap(options={"is_causal": "is_causal"})
    backend = impl.FunctionBackend(reference, name="no-scale", call=call)
    q, k, v = _qkv(K=4)
    backend.attention(q, k, v)  # scale left at its default: nothing to pass
    with pytest.raises(NotImplementedError, match=r"no keyword for the spec's scale=0\.5"):
        backend.attention(q, k, v, scale=0.5)


@pytest.mark.clause("13.13")
def test_a_result_that_is_not_an_array_fails_as_an_assertion():
    backend = impl.FunctionBackend(lambda q, k, v, **o: [1, 2], name="lister")
    q, k, v = _qkv(K=4)
    # Never a ValueError or TypeError, which a bad-input test would take for a refusal.
    with pytest.raises(AssertionError, match="returned a list, not a numpy array"):
        backend.attention(q, k, v)


@needs_torch
@pytest.mark.clause("13.10")
def test_torch_function_gradients_by_autograd():
    import torch

    def sdpa(q, k, v, **options):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)

    call = native.OptionMap(
        options={"is_causal": "is_causal", "scale": "scale"},
        mask_bool="attn_mask",
        mask_float="attn_mask",
    )
    backend = impl.FunctionBackend(
        sdpa, name="sdpa-fn", framework="torch", call=call, capabilities=["grad", "grad_mask"]
    )
    q, k, v = _qkv(K=4)
    mask = np.random.default_rng(4).standard_normal((5, 6))
    d_out = np.random.default_rng(5).standard_normal((2, 4, 5, 2))
    grads = backend.attention_vjp(q, k, v, d_out, mask=mask)
    numpy_backend = __import__("conformance.backends", fromlist=["load_backend"]).load_backend(
        "numpy"
    )
    expected = numpy_backend.attention_vjp(q, k, v, d_out, mask=mask)
    assert len(grads) == 4
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def _load(name):
    return __import__("conformance.backends", fromlist=["load_backend"]).load_backend(name)


@needs_torch
@pytest.mark.clause("13.10", "15.5", "17.1")
def test_per_head_arrays_reach_a_torch_function_as_tensors_and_sinks_get_a_gradient():
    """sinks and alibi_slopes go to a torch function as torch tensors, and attention_vjp
    returns dsinks after dq, dk, dv, as SPEC §15.5 orders them (the numpy backend is the
    reference)."""
    import torch

    seen = []

    def naive(q, k, v, *, is_causal=False, scale=None, sinks=None, alibi_slopes=None):
        seen.extend(type(x).__name__ for x in (sinks, alibi_slopes) if x is not None)
        T, S = q.shape[-2], k.shape[-2]
        scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)  # (B, H, T, S)
        if alibi_slopes is not None:
            distance = (torch.arange(T)[:, None] + S - T - torch.arange(S)[None, :]).abs()
            scores = scores - alibi_slopes[..., None, None].to(scores.dtype) * distance
        sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :S]  # (B, H, T, S)
        return weights @ v

    backend = impl.FunctionBackend(
        naive, name="naive-sinks", framework="torch", capabilities=["sinks", "alibi", "grad"]
    )
    q, k, v = _qkv(K=4)
    rng = np.random.default_rng(6)
    options = {"sinks": rng.standard_normal(4), "alibi_slopes": rng.uniform(0, 1, 4)}
    d_out = rng.standard_normal((2, 4, 5, 2))
    reference_backend = _load("numpy")
    np.testing.assert_allclose(
        backend.attention(q, k, v, **options),
        reference_backend.attention(q, k, v, **options),
        rtol=1e-10,
        atol=1e-12,
    )
    grads = backend.attention_vjp(q, k, v, d_out, **options)
    expected = reference_backend.attention_vjp(q, k, v, d_out, **options)
    assert (
        [g.shape for g in grads]
        == [g.shape for g in expected]
        == [
            q.shape,
            k.shape,
            v.shape,
            (4,),
        ]
    )
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert set(seen) == {"Tensor"}, seen


@pytest.mark.skipif(not HAS_JAX, reason="jax not installed")
@pytest.mark.clause("13.12", "17.1")
def test_per_head_arrays_are_traced_under_jit():
    """Under ``jit`` the slopes are an array argument, not a static one (an array is not
    hashable): one compiled function serves every value."""
    import jax.numpy as jnp

    def alibi(q, k, v, *, alibi_slopes=None):
        T, S = q.shape[-2], k.shape[-2]
        scores = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(q.shape[-1])  # (B, H, T, S)
        distance = jnp.abs(jnp.arange(T)[:, None] + S - T - jnp.arange(S)[None, :])
        scores = scores - alibi_slopes[..., None, None] * distance
        return jax.nn.softmax(scores, axis=-1) @ v

    import jax

    backend = impl.FunctionBackend(
        alibi, name="alibi-jit", framework="jax", capabilities=["alibi", "value_dim"], jit=True
    )
    q, k, v = _qkv(K=4)
    for seed in (7, 8):
        slopes = np.random.default_rng(seed).uniform(0, 1, (2, 4))
        np.testing.assert_allclose(
            backend.attention(q, k, v, alibi_slopes=slopes),
            _load("numpy").attention(q, k, v, alibi_slopes=slopes),
            rtol=1e-6,
            atol=1e-6,
        )


@needs_torch
@pytest.mark.clause("13.12", "18.1", "18.5")
def test_a_packed_function_is_called_with_the_boundaries(tmp_path):
    """A profile's ``packed`` function gets q, k, v in its layout, the boundaries as its
    framework's arrays and its own keywords; its gradient comes by autograd."""
    module = tmp_path / "packed_sdpa.py"
    module.write_text(
        textwrap.dedent(
            """
            import torch

            def packed(q, k, v, cu_q, cu_k, *, causal=False):
                assert isinstance(cu_q, torch.Tensor) and q.shape[0] == cu_q[-1]  # (T, H, D)
                rows = [
                    torch.nn.functional.scaled_dot_product_attention(
                        q[a:b].transpose(0, 1), k[c:d].transpose(0, 1),
                        v[c:d].transpose(0, 1), is_causal=causal,
                    ).transpose(0, 1)
                    for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])
                ]
                return torch.cat(rows)
            """
        )
    )
    path = _write_profile(
        tmp_path,
        """
        name = "packed-sdpa"
        target = "torch.nn.functional:scaled_dot_product_attention"
        framework = "torch"
        layout = "BTHD"
        capabilities = ["value_dim", "packed", "grad"]
        packed = "packed_sdpa:packed"
        [options]
        is_causal = "causal"
        """,
    )
    sys.path.insert(0, str(tmp_path))
    try:
        backend = profiles.load_profile(str(path))
        q, k, v = (x[0] for x in _qkv(H=2, K=2, T=7, S=7))
        cu = np.array([0, 3, 7])
        d_out = np.random.default_rng(9).standard_normal((2, 7, 2))
        reference_backend = _load("numpy")
        np.testing.assert_allclose(
            backend.attention_packed(q, k, v, cu, cu, is_causal=True),
            reference_backend.attention_packed(q, k, v, cu, cu, is_causal=True),
            rtol=1e-10,
            atol=1e-12,
        )
        grads = backend.attention_packed_vjp(q, k, v, cu, cu, d_out, is_causal=True)
        expected = reference_backend.attention_packed_vjp(q, k, v, cu, cu, d_out, is_causal=True)
        for got, want in zip(grads, expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    finally:
        sys.path.remove(str(tmp_path))
        unregister_backend("packed-sdpa")


@pytest.mark.clause("13.10", "13.14")
def test_what_the_gqa_adapter_works_around_is_refused_by_the_installed_operator(monkeypatch):
    """The onnxruntime.GroupQueryAttention adapter pads head sizes to a multiple of 8 and
    runs a step with a past one batch entry at a time because the operator refuses both
    (onnx_gqa.py): measured here, so the profile's words stay true of the installed
    version; and with the workarounds the call is the oracle's."""
    pytest.importorskip("onnxruntime")
    from conformance.adapters.profiles import onnx_gqa

    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((2, n, 2, 4)).astype(np.float32) for n in (3, 5, 5))
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    with_workarounds = onnx_gqa.group_query_attention(q, k, v, **options)
    expected = _load("numpy").attention(
        *(x.swapaxes(1, 2).astype(np.float64) for x in (q, k, v)), **options
    )
    np.testing.assert_allclose(with_workarounds.swapaxes(1, 2), expected, atol=1e-5)
    monkeypatch.setattr(onnx_gqa, "ONE_ENTRY_AT_A_TIME", False)
    with pytest.raises(Exception, match="batch_size must be 1 when sequence_length > 1"):
        onnx_gqa.group_query_attention(q, k, v, **options)
    monkeypatch.setattr(onnx_gqa, "HEAD_MULTIPLE", 1)
    with pytest.raises(Exception, match="head_size must be a multiple of 8"):
        onnx_gqa.group_query_attention(q[:1], k[:1], v[:1], **options)


@pytest.mark.clause("13.14", "20.7")
def test_the_gqa_operator_keeps_an_int8_kv_cache_but_no_float8_one_on_the_cpu():
    """The words of the onnxruntime.GroupQueryAttention.int8 profile, measured on the
    installed version: its int8 cache with per-tensor scales gives the oracle's answer on
    codes × scale (and a k_scale off by 2 does not), and a float8_e4m3fn cache, which the
    operator's type constraint lists, has no CPU kernel."""
    pytest.importorskip("onnxruntime")
    import ml_dtypes
    import onnxruntime

    from conformance.adapters.profiles import onnx_gqa
    from conformance.suite import quantized as sq

    o = sq.operands(11, formats=("int8",) * 3, granularities=("tensor",) * 3)
    codes = {r: np.swapaxes(o[r], 1, 2) for r in "qkv"}  # BTHD, as the profile's layout
    scales = {"q_descale": o["q_descale"], "k_scale": o["k_descale"], "v_scale": o["v_descale"]}
    options = {"is_causal": True}
    out = onnx_gqa.int8_kv_cache_attention(*codes.values(), **scales, **options)
    expected = sq.expected(o, is_causal=True, causal_alignment="bottom_right")
    got = np.swapaxes(out, 1, 2).astype(np.float64)
    assert np.abs(got - expected).max() < 1e-5
    scales["k_scale"] = scales["k_scale"] * 2
    off = np.swapaxes(onnx_gqa.int8_kv_cache_attention(*codes.values(), **scales, **options), 1, 2)
    assert np.abs(off - expected).max() > 1e-2

    e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
    dtypes = tuple((n, "float32") for n in ("query", "key", "value"))
    dtypes += (("past_key", e4m3), ("past_value", e4m3))
    dtypes += (("seqlens_k", "int32"), ("total_sequence_length", "int32"))
    dtypes += (("k_scale", "float32"), ("v_scale", "float32"))
    attributes = {"num_heads": 2, "kv_num_heads": 1, "kv_cache_bit_width": 8}
    attributes |= {"k_quant_type": "PER_TENSOR", "v_quant_type": "PER_TENSOR"}
    model = onnx_gqa._model(dtypes, tuple(attributes.items())).SerializeToString()
    with pytest.raises(Exception, match="NOT_IMPLEMENTED : Could not find an implementation"):
        onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])


@pytest.mark.clause("15.6")
def test_the_onnx_attention_operator_has_no_sink_input():
    """SPEC §15.6: the newest ONNX Attention the installed onnx defines takes no sinks, so
    the ONNX profiles declare none; GroupQueryAttention's head_sink is ONNX Runtime's."""
    defs = pytest.importorskip("onnx.defs")
    schema = defs.get_schema("Attention", defs.onnx_opset_version())
    names = [i.name for i in schema.inputs]
    assert "Q" in names and not any("sink" in n.lower() for n in names), names


# --- Usage errors ------------------------------------------------------------------------------


@pytest.mark.clause("13.12")
@pytest.mark.parametrize(
    "args, message",
    [
        (["--impl-profile", "no-such-profile"], "no profile 'no-such-profile'"),
        (["--impl-profile", "no-such-profile"], "shipped: "),
        (["--impl-framework", "torch"], "--impl-framework describes an --impl"),
        (
            [
                "--impl",
                "examples.my_attention:attention",
                "--impl-layout",
                "BTHD",
                "--impl-name",
                "x",
            ]
            + ["--impl-framework", "numpy", "--impl-profile", "torch.sdpa", "--backend", "nope"],
            "unknown backend 'nope'",
        ),
    ],
)
def test_naming_something_missing_is_a_usage_error(args, message):
    run = _pytest(*args)
    out = run.stdout + run.stderr
    assert run.returncode == 4, out[-3000:]
    assert message in out, out[-3000:]


def _write_profile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.clause("13.12")
@pytest.mark.parametrize(
    "body, message",
    [
        ('name = "x"\ntarget = "no_such_module_xyz:f"\n', "No module named 'no_such_module_xyz'"),
        ('name = "x"\ntarget = "numpy:no_such_function"\n', "has no attribute 'no_such_function'"),
        ('name = "x"\ntarget = "numpy:add"\nframework = "tensorflow"\n', "known: auto, numpy"),
        ('name = "x"\ntarget = "numpy:add"\nrequires = ["no_such_dist_xyz"]\n', "not installed"),
        ('name = "x"\ntarget = "numpy:add"\nlayuot = "BTHD"\n', "unknown keys ['layuot']"),
        ('name = "x"\ntarget = "numpy:add"\n[options]\nwindows = "w"\n', "unknown spec options"),
        ('name = "x"\ntarget = "numpy:add"\n[mask]\nbool_true = "yes"\n', "attend, blocked"),
        ('name = "x"\ntarget = "numpy:add"\ncapabilities = ["window"]\n', "maps no keyword"),
        ('target = "numpy:add"\n', "'name' is required"),
        (
            'name = "x"\ntarget = "numpy:add"\n[processor_dependent]\n"t" = "r"\n'
            '[known_failures]\n"t" = "r"\n',
            "listed both as known failures and as processor-dependent",
        ),
        ('name = "x"\ntarget = "numpy:add"\n[processor_dependent]\n"t" = ""\n', "needs a reason"),
        (
            'name = "x"\ntarget = "numpy:add"\n[processor_dependent]\n"t" = "r"\n'
            '[varies_between_runs]\n"t" = "r"\n',
            "listed both as processor-dependent and as varying between runs",
        ),
        ('name = "x"\ntarget = "numpy:add"\n[varies_between_runs]\n"t" = " "\n', "needs a reason"),
        ('name = "x"\ntarget = "numpy:add"\ncapabilities = ["packed"]\n', "go together"),
        ('name = "x"\ntarget = "numpy:add"\n[forms]\ncausality = "mask"\n', "[forms] has unknown"),
        ('name = "x"\ntarget = "numpy:add"\n[forms]\ncausal = "sometimes"\n', "keyword, mask"),
        ('name = "x"\ntarget = "numpy:add"\n[forms]\nscale = true\n', "maps no scale keyword"),
        ('name = "x"\ntarget = "numpy:add"\n[forms]\nalignments = []\n', "non-empty list"),
        ('name = "x"\ntarget = "numpy:add"\n[mask]\nblocked = "-1e9"\n', "blocked should be"),
        (
            'name = "x"\ntarget = "numpy:add"\n[mask]\nbool = false\n[forms]\ncausal = "mask"\n',
            "needs a mask keyword",
        ),
        ('name = "x"\ntarget = "numpy:add"\npacked = "numpy:add"\n', "go together"),
        ('name = "x"\ntarget = "numpy:add"\n[call]\nscale = "sometimes"\n', "when_set, always"),
        ('name = "x"\ntarget = "numpy:add"\n[call]\nscales = "always"\n', "[call] has unknown"),
        (
            'name = "x"\ntarget = "numpy:add"\n[options]\nis_causal = "c"\n[call]\n'
            'scale = "always"\n',
            "maps none",
        ),
        (
            'name = "x"\ntarget = "numpy:add"\ncapabilities = ["packed"]\npacked = "add"\n',
            "'module:function' of attention_packed",
        ),
        ('name = "x"\ntarget = "numpy:add"\n[run]\ntests = "test_a"\n', "[run] takes tests"),
        ('name = "x"\ntarget = "numpy:add"\n[run]\ntests = ["fixture"]\n', "ids (test_..."),
        ('name = "x"\ntarget = "numpy:add"\n[run]\nlayers = ["math"]\n', "[run] takes tests"),
    ],
)
def test_a_broken_profile_says_what_is_missing(tmp_path, body, message):
    path = _write_profile(tmp_path, body)
    with pytest.raises(profiles.ProfileError) as info:
        profiles.read_profile(path).resolve()
    assert message in str(info.value)


@pytest.mark.clause("13.12")
def test_unavailable_library_is_skipped_by_name_under_all(tmp_path, monkeypatch):
    (tmp_path / "ghost.toml").write_text(
        'name = "ghost"\ntarget = "ghost_lib:attention"\nrequires = ["ghost_lib_xyz"]\n'
    )
    monkeypatch.setattr(profiles, "HERE", tmp_path)
    try:
        loaded, unavailable = profiles.load_profiles(["all"])
        assert loaded == [] and [p.name for p in unavailable] == ["ghost"]
        assert "ghost_lib_xyz not installed" in profiles.skip_reason(unavailable[0])
        with pytest.raises(profiles.ProfileError, match="ghost_lib_xyz"):
            profiles.load_profiles(["ghost"])  # named explicitly: an error, not a skip
    finally:
        unregister_backend("ghost")


@pytest.mark.clause("13.12")
@pytest.mark.parametrize("every_test", [False, True])
def test_a_profiles_default_run_skips_the_other_tests_by_name(tmp_path, every_test):
    """A profile's [run] tests are its default run: its other tests are skipped, naming the
    option that runs them (every test, with ``every_test``); other backends' tests run."""
    from conformance.suite import known_failures

    path = _write_profile(
        tmp_path, 'name = "compiled"\ntarget = "numpy:add"\n[run]\ntests = ["test_chosen[*-f32]"]\n'
    )
    profile = profiles.read_profile(path)
    assert profile.tests == ("test_chosen[*-f32]",)

    class Item:
        def __init__(self, name, backend, dtype="f32"):
            self.originalname, self.marks = name, []
            self.nodeid = f"conformance/tests/test_x.py::{name}[{backend}-{dtype}]"
            self.callspec = type("Callspec", (), {"params": {"backend": backend}})()

        def add_marker(self, mark):
            self.marks.append(mark)

    items = [Item("test_chosen", "compiled"), Item("test_chosen", "compiled", "f64"),
             Item("test_other", "compiled"), Item("test_other", "numpy")]  # fmt: skip
    known_failures.mark_profiles(items, [profile], [], every_test=every_test)
    skipped = [i.nodeid.rpartition("::")[2] for i in items if i.marks]
    expected = ["test_chosen[compiled-f64]", "test_other[compiled-f32]"]
    assert skipped == ([] if every_test else expected)
    if not every_test:
        reason = items[2].marks[0].kwargs["reason"]
        assert reason.startswith(known_failures.NOT_IN_DEFAULT_RUN) and "--every-test" in reason


@pytest.mark.clause("13.12")
def test_missing_hardware_is_skipped_with_what_the_probe_measured(tmp_path, monkeypatch):
    (tmp_path / "gpu_lib.py").write_text(
        "def attention(q, k, v):\n    return q\n\n"
        "def probe():\n    return 'measured here: RuntimeError: no GPU'\n"
    )
    (tmp_path / "gpu.toml").write_text(
        'name = "gpu"\ntarget = "gpu_lib:attention"\nneeds = ["cuda"]\nprobe = "gpu_lib:probe"\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(profiles, "HERE", tmp_path)
    try:
        loaded, unavailable = profiles.load_profiles(["all"])
        assert loaded == [] and [p.name for p in unavailable] == ["gpu"]
        reason = profiles.skip_reason(unavailable[0])
        assert reason == "profile gpu: needs cuda: measured here: RuntimeError: no GPU"
        with pytest.raises(profiles.ProfileError, match="cannot run here: needs cuda"):
            profiles.load_profiles(["gpu"])
    finally:
        unregister_backend("gpu")


@pytest.mark.parametrize(
    "body, message",
    [
        ('needs = ["tpu"]\nprobe = "m:f"\n', "'needs' should be a list of ['cuda']"),
        ('needs = ["cuda"]\n', "'needs' requires 'probe'"),
    ],
)
def test_needs_is_checked(tmp_path, body, message):
    path = _write_profile(tmp_path, f'name = "x"\ntarget = "m:f"\n{body}')
    with pytest.raises(profiles.ProfileError, match=re.escape(message)):
        profiles.read_profile(path)


def test_context_parallel_says_what_pytorch_raised_without_cuda():
    """The torch.context_parallel profile's probe, run: on a CPU, PyTorch's sharded SDPA
    has no strategy for the CPU kernel (torch 2.13.0); with CUDA it runs."""
    torch = pytest.importorskip("torch")
    why = profiles.read_profile("torch.context_parallel").unavailable()
    if torch.cuda.is_available():
        assert why is None
    else:
        assert why.startswith("needs cuda: measured here (torch ")
        assert "does not have a sharding strategy registered" in why, why


# --- Shipped profiles --------------------------------------------------------------------------


@pytest.mark.clause("13.14")
@pytest.mark.parametrize("name", profiles.shipped_profiles())
def test_shipped_profile_is_well_formed(name):
    profile = profiles.read_profile(name)
    assert profile.name == name and profile.requires
    assert profile.description
    for pattern, reason in profile.known_failures.items():
        assert name in pattern, f"{pattern}: a known failure names its backend"
        # A reason is a behaviour (SPEC §13.15): one line, no error size, no pytest dump.
        assert reason == " ".join(reason.split()), f"{pattern}: one line: {reason!r}"
        assert not re.search(r"\d\.\d+e[-+]\d+|max abs error|^assert |\+  where ", reason), (
            f"{pattern}: the reason is a behaviour, not a measurement or a dump: {reason}"
        )
    if not profile.unavailable():
        backend = profile.resolve()
        assert backend.name == name and set(backend.dtypes) == set(profile.dtypes)


# --- A profile written from the documentation alone ----------------------------------------------

MY_LIBRARY = '''
"""Somebody's attention library: torch tensors, (B, T, H, D), True = padding."""
import math

import torch


def attend(query, key, value, *, padding=None, causal=False, softmax_scale=None):
    q, k, v = (x.transpose(-3, -2) for x in (query, key, value))
    scores = q @ k.transpose(-1, -2) * (softmax_scale or 1 / math.sqrt(q.shape[-1]))
    T, S = scores.shape[-2:]
    blocked = torch.zeros(T, S, dtype=torch.bool)
    if causal:
        blocked = torch.ones(T, S, dtype=torch.bool).triu(1)
    if padding is not None:
        blocked = blocked | padding
    scores = scores.masked_fill(blocked, -math.inf)
    weights = torch.softmax(scores, dim=-1)
    return (weights @ v).transpose(-3, -2)
'''

MY_PROFILE = """
name = "mylib.attend"
description = "mylib.attend, from its docstring"
target = "mylib:attend"
framework = "torch"
layout = "BTHD"
requires = ["torch"]
dtypes = ["float64", "float32"]

[options]
is_causal = "causal"
scale = "softmax_scale"

[mask]
bool = "padding"
bool_true = "blocked"

[processor_dependent]
"test_fixture_case[mylib.attend-fully-masked-rows-float32]" = "a fully masked row is NaN"
"test_fixture_case[mylib.attend-T7-S7-float32]" = "passes on this processor"

[known_failures]
"test_fixture_case[mylib.attend-fully-masked-rows-float64]" = "SPEC §4.3: a fully masked row is NaN, not 0"
"test_never_matches[mylib.attend]" = "SPEC §0: an entry that matches nothing"
"""


@needs_torch
@pytest.mark.clause("13.10", "13.14")
def test_profile_written_from_the_docs_runs(tmp_path):
    (tmp_path / "mylib.py").write_text(MY_LIBRARY)
    (tmp_path / "mylib.toml").write_text(MY_PROFILE)
    run = _pytest(
        "--impl-profile",
        str(tmp_path / "mylib.toml"),
        "-k",
        "fixture_case and (T7-S7 or causal-T7 or fully-masked-rows)",
        "-p",
        "no:randomly",
        "-W",
        "default",
        cwd=tmp_path,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert " passed" in out and "xfailed" in out and " failed" not in out
    assert "StaleKnownFailure" in out and "test_never_matches[mylib.attend]" in out
    # A processor-dependent entry may fail (xfailed) or pass (xpassed, not a failure).
    assert re.search(r"\b2 xfailed\b", out) and re.search(r"\b1 xpassed\b", out), out[-2000:]


@needs_torch
@pytest.mark.clause("13.13")
def test_a_library_error_fails_one_test_and_replays(tmp_path):
    (tmp_path / "fragile.py").write_text(
        textwrap.dedent(
            """
            import torch

            def attend(q, k, v, *, is_causal=False, scale=None):
                if q.shape[-2] == 1:
                    raise RuntimeError("fragile: T = 1 is not supported")
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=is_causal, scale=scale
                )
            """
        )
    )
    run = _pytest(
        "--impl",
        "fragile:attend",
        "--impl-framework",
        "auto",
        "-k",
        "fixture_case and float64 and (T1-S1 or T7-S7)",
        "--repro-dir",
        str(tmp_path / "repro"),
        cwd=tmp_path,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-4000:]
    assert "RuntimeError: fragile" in out and " passed" in out
    assert "load_call(" in out
    saved = sorted((tmp_path / "repro").glob("*.npz"))
    assert saved
    from conformance.suite.replay import load_call

    sys.path.insert(0, str(tmp_path))
    try:
        backend, method, args, kwargs = load_call(saved[0])
        assert backend.framework == "torch"
        with pytest.raises(RuntimeError, match="fragile"):
            getattr(backend, method)(*args, **kwargs)
    finally:
        sys.path.remove(str(tmp_path))
        # load_call registered the function: later tests of this process list the backends.
        from conformance.backends import registered_backends, unregister_backend

        if "fragile.attend" in registered_backends():
            unregister_backend("fragile.attend")
