"""The function under test on a device (SPEC §13.20), tested on the CPU: torch's ``cpu``
named explicitly, and JAX's second host device, so that an input left on the first fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conformance.fixtures import oracle

from conformance.adapters.function import FunctionBackend
from conformance.adapters.impl import ImplUnavailable, resolve_impl
from conformance.adapters.native import OptionMap
from conformance.adapters.profiles import ProfileError, parse_profile

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


def test_jax_inputs_are_placed_on_the_device_named():
    """On JAX's second host device the planted function (which asserts where its inputs,
    and in the backward d_out, are) returns the oracle's output and gradients; without the
    device, its inputs stay on device 0 and it fails, forward and backward."""
    pytest.importorskip("jax")
    q, k, v, d_out = _inputs()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", JAX_RUN],
        input=json.dumps([x.tolist() for x in (q, k, v, d_out)]),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    q64, k64, v64, d64 = (x.astype(np.float64) for x in (q, k, v, d_out))
    want = oracle.naive_same_precision(q64, k64, v64, np.float64)
    np.testing.assert_allclose(np.array(found["cpu:1-attention"][0]), want, atol=1e-5)
    grads = oracle.attention_vjp(q64, k64, v64, d64)
    for got, expected in zip(found["cpu:1-attention_vjp"], (grads[g] for g in ("dq", "dk", "dv"))):
        np.testing.assert_allclose(np.array(got), expected, atol=1e-5)
    assert found["None-attention"] == "AssertionError: call: an array on ['cpu:0'], not cpu:1"
    assert found["None-attention_vjp"].startswith("AssertionError: forward: an array on ['cpu:0']")


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
