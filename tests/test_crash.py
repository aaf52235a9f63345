"""SPEC §13.13: a function under test that kills its process fails one test, and the run
goes on to its verdict and its JUnit file.

A plain ``pytest --impl ...`` run, as a user starts it (a subprocess, no ``-n``), on a
function that calls ``os.abort()`` for one case and is the NumPy reference otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from conformance.suite import isolation

pytestmark = pytest.mark.clause("13.13")

ABORTING = """
    import os

    from conformance import load_backend

    _REFERENCE = load_backend("numpy")


    def attention(q, k, v, *, mask=None, is_causal=False, scale=None):
        if q.shape[-2] == 0 and k.shape[-2] == 5 and mask is None and not is_causal:
            os.abort()  # T = 0, S = 5, no mask: one case of test_empty_sequences per dtype
        return _REFERENCE.attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale)
"""


def test_an_abort_fails_one_test_and_the_run_goes_on(tmp_path):
    (tmp_path / "aborting.py").write_text(textwrap.dedent(ABORTING))
    junit = tmp_path / "junit.xml"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TMPDIR": str(scratch)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_CURRENT_TEST", None)  # a worker per core, as a user's run starts
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "conformance.tests.test_edges"]
        + ["--impl", "aborting:attention", "-k", "test_empty_sequences and float64"]
        + ["-p", "no:cacheprovider", "-q", f"--junitxml={junit}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed" in out and " passed" in out, out  # the verdict
    crashed = "test_empty_sequences[aborting.attention-float64-T0-plain]"
    assert "SIGABRT" in out and crashed in out, out
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    failed = {n: c for n, c in cases.items() if c.find("failure") is not None}
    assert list(failed) == [crashed], out
    message = failed[crashed].find("failure").get("message")
    assert "SIGABRT" in message and crashed in message, message
    assert "aborting.py" in message, message  # the function's own frame
    # The crash is named with the case's shape it happened on (T = 0 here), and the call;
    # its JUnit entry carries a behaviour section, as every failure's does.
    found = "kills its process with SIGABRT on a call with T = 0"
    assert "its last call: attention(float64[" in message, message
    text = failed[crashed].find("failure").text
    assert re.search(r"-+ behaviour -+\n" + re.escape(found), text), text
    assert found in out and "verdict aborting.attention — " in out, out[-3000:]
    # The crashing test's parametrizations share its worker's unit (scheduling.py): the
    # others of its unit still ran, and the crashing one only once.
    passed = [n for n, c in cases.items() if n not in failed and c.find("skipped") is None]
    assert len(passed) >= 3, out
    assert out.count("node down") == 1, out
    # The workers' crash files are removed when the run ends.
    assert not list(scratch.glob("attention-conformance-crash-*")), list(scratch.iterdir())


@pytest.mark.parametrize(
    "profile, device",
    [
        ("device = 'cuda'\n", True),
        ("device = 'cuda:1'\n", True),
        ("device = 'gpu'\n", True),
        ("device = 'cpu'\n", False),
        ("", False),
    ],
)
def test_a_run_on_a_device_keeps_one_worker(tmp_path, profile, device):
    """An isolated run starts a worker per core, up to MAX_WORKERS, but one where a
    profile or --impl-device puts the function on a device (JAX's process takes most of
    its memory)."""
    path = tmp_path / "mine.toml"
    path.write_text(
        "name = 'mine'\ntarget = 'mine:attention'\nframework = 'torch'\n" + profile
    )  # fmt: skip
    config = SimpleNamespace(option=SimpleNamespace(impl_device=None, impl_profile=[str(path)]))
    assert isolation.names_a_device(config) is device
    config.option.impl_profile = []
    config.option.impl_device = "cuda" if device else None
    assert isolation.names_a_device(config) is device


def test_the_shipped_device_profiles_keep_one_worker():
    """A device profile named as shipped, or all of them, is read as its loading reads it."""
    config = SimpleNamespace(option=SimpleNamespace(impl_device=None, impl_profile=["all-gpu"]))
    assert isolation.names_a_device(config)
    config.option.impl_profile = ["gpu/torch.sdpa.cuda.flash"]
    assert isolation.names_a_device(config)
    config.option.impl_profile = ["all", "jax.nn.dot_product_attention"]
    assert not isolation.names_a_device(config)


def test_a_run_started_inside_a_test_keeps_one_worker():
    """This test runs inside pytest (PYTEST_CURRENT_TEST): its processes hold the cores."""
    assert isolation.workers() == 1


def test_a_run_gets_a_worker_per_core_up_to_the_most(monkeypatch):
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    cores = len(os.sched_getaffinity(0))
    assert isolation.workers() == min(cores, isolation.MAX_WORKERS)
