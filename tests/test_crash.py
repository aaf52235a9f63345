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

import pytest

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
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
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
    passed = [n for n, c in cases.items() if n not in failed and c.find("skipped") is None]
    assert len(passed) >= 3, out
