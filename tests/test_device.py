"""The function under test on a device (SPEC §13.20), tested on the CPU: torch's ``cpu``
named explicitly, and JAX's second host device, so that an input left on the first fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from conformance.fixtures import oracle

from conformance.adapters import profiles
from conformance.adapters.function import FunctionBackend
from conformance.adapters.impl import ImplUnavailable, resolve_impl
from conformance.adapters.native import OptionMap
from conformance.adapters.profiles import ProfileError, parse_profile
from conformance.suite import device_summary

pytestmark = pytest.mark.clause("13.20")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: The planted function's call: q, k, v only.
BARE = OptionMap(options={}, mask_bool=None, mask_float=None, causal="none")


def _inputs(dtype=np.float32):
    rng = np.random.default_rng(0)
    shapes = ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 3, 4))  # q, k, v, d_out
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


#: The JAX test's own process: JAX with two host devices, the planted function run with
#: its inputs placed on device 1 ("cpu:1") and without a device (left on device 0).
JAX_RUN = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from conformance.adapters.function import FunctionBackend
    from conformance.adapters.native import OptionMap
    import device_functions

    q, k, v, d_out = (np.asarray(x, dtype=np.float32) for x in json.loads(sys.stdin.read()))
    call = OptionMap(options={}, mask_bool=None, mask_float=None, causal="none")
    found = {}
    for device in ("cpu:1", None):
        backend = FunctionBackend(device_functions.jax_on_device, "planted", ("grad",),
                                  ("float32",), framework="jax", call=call, device=device)
        for method in ("attention", "attention_vjp"):
            try:
                if method == "attention":
                    result = [backend.attention(q, k, v)]
                else:
                    result = list(backend.attention_vjp(q, k, v, d_out))
                found[f"{device}-{method}"] = [x.tolist() for x in result]
            except AssertionError as err:
                found[f"{device}-{method}"] = f"AssertionError: {err}"
    print(json.dumps(found))
    """
)


def _on_two_devices(script: str, stdin: str = "") -> dict:
    """What ``script`` prints last, as JSON, run in a process whose JAX has two host
    devices and which imports the planted functions of tests/."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", script], input=stdin, capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_jax_inputs_are_placed_on_the_device_named():
    """On JAX's second host device the planted function (which asserts where its inputs,
    and in the backward d_out, are) returns the oracle's output and gradients; without the
    device, its inputs stay on device 0 and it fails, forward and backward."""
    pytest.importorskip("jax")
    q, k, v, d_out = _inputs()
    found = _on_two_devices(JAX_RUN, json.dumps([x.tolist() for x in (q, k, v, d_out)]))
    q64, k64, v64, d64 = (x.astype(np.float64) for x in (q, k, v, d_out))
    want = oracle.naive_same_precision(q64, k64, v64, np.float64)
    np.testing.assert_allclose(np.array(found["cpu:1-attention"][0]), want, atol=1e-5)
    grads = oracle.attention_vjp(q64, k64, v64, d64)
    for got, expected in zip(found["cpu:1-attention_vjp"], (grads[g] for g in ("dq", "dk", "dv"))):
        np.testing.assert_allclose(np.array(got), expected, atol=1e-5)
    assert found["None-attention"] == "AssertionError: call: an array on ['cpu:0'], not cpu:1"
    assert found["None-attention_vjp"].startswith("AssertionError: forward: an array on ['cpu:0']")


#: A [quantized] profile's function (SPEC §20.7) in the same two-device process: its codes
#: and descales placed on device 1 ("cpu:1"), then left on device 0.
JAX_QUANTIZED_RUN = textwrap.dedent(
    """
    import json
    import numpy as np
    from conformance.adapters.quantized import QuantizedFunctionBackend
    from conformance.suite import quantized as sq
    import device_functions

    table = {
        "formats": {r: ["float8_e4m3fn"] for r in "qkv"},
        "granularities": {r: ["tensor"] for r in "qkv"},
        "pipeline": "float32",
        "descales": {"q": "q_scale", "k": "k_scale", "v": "v_scale"},
        "options": {"scale": "sm_scale"},
    }
    found = {}
    for device in ("cpu:1", None):
        backend = QuantizedFunctionBackend(
            device_functions.quantized_on_device, name="planted-fp8", framework="jax",
            layout="BHTD", caps=["gqa"], table=table, device=device,
        )
        o = sq.operands_for(backend, 41)
        try:
            expected, bound = sq.expected_and_bound(backend, o)
            error = float(np.abs(sq.call(backend, o) - expected).max())
            found[str(device)] = {"error": error, "bound": float(bound)}
        except AssertionError as err:
            found[str(device)] = f"AssertionError: {err}"
    print(json.dumps(found))
    """
)


def test_a_quantized_functions_inputs_are_placed_on_the_device_named():
    """A [quantized] profile's ``device`` places its codes and descales there too (float8
    codes included): on JAX's second host device the planted function, which asserts
    where they are, is within §20.6's bound; without the device they stay on device 0 and
    it fails."""
    pytest.importorskip("jax")
    found = _on_two_devices(JAX_QUANTIZED_RUN)
    assert found["cpu:1"]["error"] <= found["cpu:1"]["bound"], found
    assert found["None"] == "AssertionError: quantized: an array on ['cpu:0'], not cpu:1"


def test_a_quantized_profiles_device_is_checked_by_name(tmp_path):
    """A [quantized] profile whose ``device`` this machine lacks cannot run, naming the
    device; a spelling the framework does not know is a ValueError naming it."""
    from conformance.adapters.profiles import ProfileError, read_profile

    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    text = (ROOT / "examples" / "fp8_attention.toml").read_text()
    text = text.replace('target = "examples.fp8_attention:fp8_attention"', (
        'target = "examples.fp8_attention:fp8_attention"\ndevice = "{device}"'
    ))  # fmt: skip
    for device, words in (
        ("cuda:7", r"cannot run here: device 'cuda:7' is not on this machine"),
        ("gpu-0", r"device should be"),
    ):
        path = tmp_path / f"{device}.toml"
        path.write_text(text.replace("{device}", device))
        with pytest.raises(ProfileError if device == "cuda:7" else ValueError, match=words):
            read_profile(path).resolve()


def _torch_on_cpu(q, k, v):
    import torch

    for x in (q, k, v):
        assert x.device == torch.device("cpu"), f"an input on {x.device}, not cpu"
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_torch_cpu_named_explicitly():
    """torch's ``cpu``, named: the inputs go there, the output and the gradients (autograd
    where the forward ran) come back to NumPy as the oracle has them."""
    torch = pytest.importorskip("torch")
    backend = FunctionBackend(
        _torch_on_cpu, "planted", ("grad",), ("float64",), framework="torch", call=BARE,
        device="cpu",
    )  # fmt: skip
    assert backend.arrays.device == torch.device("cpu")
    q, k, v, d_out = _inputs(np.float64)
    np.testing.assert_allclose(
        backend.attention(q, k, v), oracle.naive_same_precision(q, k, v, np.float64), atol=1e-12
    )
    grads = oracle.attention_vjp(q, k, v, d_out)
    for got, name in zip(backend.attention_vjp(q, k, v, d_out), ("dq", "dk", "dv")):
        np.testing.assert_allclose(got, grads[name], atol=1e-12)


@pytest.mark.parametrize(
    ("framework", "device"),
    [("torch", "cuda:x"), ("torch", "warp-drive"), ("jax", "gpu:x"), ("jax", "npu"),
     ("numpy", "cuda")],
)  # fmt: skip
def test_a_bad_device_string_is_a_value_error_naming_the_argument(framework, device):
    pytest.importorskip(framework)
    with pytest.raises(ValueError, match=rf"--impl-device: device should be .*got {device!r}"):
        resolve_impl(
            "tests.device_functions:_forward" if framework == "jax" else "numpy:add",
            framework=framework, dtypes="float32", device=device,
        )  # fmt: skip


def test_a_device_this_machine_lacks_is_unavailable_by_name():
    """torch's ``cuda:7`` is a valid spelling; on a machine without it the function is
    unavailable, the device named (a CPU machine here, or one with fewer GPUs)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ImplUnavailable, match=r"device 'cuda:7' is not on this machine"):
        resolve_impl("numpy:add", framework="torch", device="cuda:7")


def test_a_profile_whose_device_is_missing_says_so():
    """A profile's ``device``: missing here, ``unavailable`` says why (its tests are then
    skipped by name under ``all``), and resolving it is a ProfileError naming the device."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    data = {
        "name": "sdpa-on-cuda-7",
        "target": "torch.nn.functional:scaled_dot_product_attention",
        "framework": "torch",
        "device": "cuda:7",
        "requires": ["torch"],
    }
    profile = parse_profile(data, ROOT / "sdpa-on-cuda-7.toml")
    assert "device 'cuda:7' is not on this machine" in profile.unavailable()
    with pytest.raises(ProfileError, match=r"cannot run here: device 'cuda:7'"):
        profile.resolve()
    with pytest.raises(ProfileError, match=r"'device' should be where the function runs"):
        parse_profile({**data, "device": 7}, ROOT / "bad.toml")


def _torch_backend(func):
    pytest.importorskip("torch")
    return resolve_impl(f"tests.device_torch_functions:{func}", framework="torch", device="cpu")


def test_a_repeated_call_says_whether_it_is_bitwise_reproducible():
    """A function whose last bit changes from call to call is named not reproducible, with
    how many calls differed; the same function without the change is reproducible."""
    found = device_summary.reproducible(_torch_backend("nondeterministic"))
    assert found.startswith("not bitwise reproducible: 5 of 9 repeated calls"), found
    found = device_summary.reproducible(_torch_backend("deterministic"))
    assert found.startswith("bitwise reproducible: 10 calls of attention at B=2"), found


def test_the_summary_says_which_reduced_precision_settings_are_on():
    """The summary names torch's TF32 setting as it is in the process, and what the
    function declares."""
    torch = pytest.importorskip("torch")
    backend = _torch_backend("deterministic")
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for value in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = value
            words = device_summary.device_words(backend)
            assert words[0].startswith("runs on cpu with "), words
            assert f"torch.backends.cuda.matmul.allow_tf32 = {value}" in words[0], words
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert words[1] == "declares float32 matmuls in float32"
    with pytest.raises(ValueError, match="float32_matmul should be one of float32, tf32"):
        FunctionBackend(lambda q, k, v: q, "x", float32_matmul="tf16")


def test_a_cuda_error_fails_one_test_and_the_next_run_in_a_fresh_process(tmp_path):
    """A function that fails as CUDA does after an illegal memory access (the error is
    sticky: every later call of the process raises it too) fails the one test that made
    it; the next test runs in a new worker process and passes. The run's summary says
    where the function ran, under which settings, and whether a repeated call is bitwise
    reproducible."""
    pytest.importorskip("torch")
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance.tests.test_invariants"]
        + ["--impl", "device_torch_functions:illegal_access", "--impl-framework", "torch"]
        + ["--impl-device", "cpu"]
        + ["-k", "test_convex_hull and causal and float64", "-p", "no:cacheprovider"]
        + ["-q", f"--junitxml={junit}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    name = "device_torch_functions.illegal_access"
    crashed = f"test_convex_hull[{name}-causal-float64-T13-S7]"
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    failed = [n for n, c in cases.items() if c.find("failure") is not None]
    assert failed == [crashed], out
    passed = [n for n, c in cases.items() if n not in failed and c.find("skipped") is None]
    assert sorted(passed) == [
        f"test_convex_hull[{name}-causal-float64-T7-S13]",
        f"test_convex_hull[{name}-causal-float64-T8-S8]",  # after the error, a new process
    ], out
    message = cases[crashed].find("failure").get("message")
    assert "raises RuntimeError: CUDA error: an illegal memory access" in message, message
    assert "device state is lost" in message, message
    assert f"{name}: runs on cpu with torch.backends.cuda.matmul.allow_tf32 = " in out, out
    assert f"{name}: bitwise reproducible: 10 calls of attention" in out, out


def test_every_device_profile_is_skipped_by_name_without_its_device(monkeypatch):
    """The shipped device profiles (``--impl-profile all-gpu``) and the Triton tutorial's on
    CUDA parse, and, where their device or package is absent, are registered unavailable
    with the reason in words, never left out in silence."""
    pytest.importorskip("torch")
    names = profiles.gpu_profiles()
    assert {n.split("/", 1)[1] for n in names} == {
        "torch.sdpa.cuda.flash",
        "torch.sdpa.cuda.efficient",
        "torch.sdpa.cuda.cudnn",
        "torch.sdpa.cuda.math",
        "pallas.gpu.mha.compiled",
        "flashinfer.single_prefill",
        "flashinfer.single_decode",
    }
    every = [profiles.read_profile(n) for n in names]
    every.append(profiles.read_profile(ROOT / "examples" / "triton_fused_attention.cuda.toml"))
    assert all(p.device for p in every)
    here = [p for p in every if p.unavailable() is None]
    if here:
        pytest.skip(f"this machine runs {[p.name for p in here]}: the skips are not seen here")
    for profile in every:
        why = profiles.skip_reason(profile)
        assert why.startswith(f"profile {profile.name}: "), why
        assert any(w in why for w in ("not installed here", "not on this machine", "CUDA")), why
    registered = {}  # kept out of this process's registry
    monkeypatch.setattr(profiles, "register_backend", lambda n, f, **_: registered.setdefault(n, f))
    loaded, unavailable = profiles.load_profiles(["all-gpu"])
    assert set(registered) == {p.name for p in unavailable}
    assert loaded == [] and {p.name for p in unavailable} == {p.name for p in every[:-1]}
