"""SPEC §3.5 in every float dtype: a float32 (or 16-bit) function that declares the
bottom-right alignment meets §3.5's fixtures in its own dtype, so one that aligns causal
masks top-left whatever it is told fails them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.suite import cases

pytestmark = pytest.mark.clause("3.5")

ROOT = Path(__file__).resolve().parent.parent

TOP_LEFT_ONLY = """
from conformance.impls.numpy.attention import attention as reference


def attention(q, k, v, *, mask=None, is_causal=False, scale=None, causal_alignment="top_left"):
    # The planted bug: the alignment it is given is ignored.
    return reference(q, k, v, mask=mask, is_causal=is_causal, scale=scale)


def right(q, k, v, *, mask=None, is_causal=False, scale=None, causal_alignment="top_left"):
    return reference(q, k, v, mask=mask, is_causal=is_causal, scale=scale,
                     causal_alignment=causal_alignment)
"""


def test_every_float_dtype_has_the_bottom_right_fixtures():
    found = {
        (e["shape"]["T"], e["shape"]["S"], e["dtype"])
        for e in cases.manifest()["cases"]
        if e["clause"] == "3.5"
    }
    for T, S in ((7, 13), (13, 7), (1, 9)):
        for dtype in ("float64", "float32", "float16", "bfloat16"):
            assert (T, S, dtype) in found, (T, S, dtype)


@pytest.mark.parametrize("function", ["attention", "right"])
def test_a_float32_function_is_judged_on_bottom_right(tmp_path, function):
    (tmp_path / "aligned.py").write_text(textwrap.dedent(TOP_LEFT_ONLY))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance/tests/test_fixtures.py")]
        + [
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-k",
            "test_fixture_case and bottom-right-T and float32",
        ]
        + [f"--impl=aligned:{function}", "--impl-capabilities=causal_bottom_right"]
        + ["--impl-dtypes=float32"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    if function == "right":
        assert run.returncode == 0 and "3 passed" in out, out[-3000:]
    else:
        # Each of the three shapes tells the alignments apart.
        assert run.returncode == 1 and "3 failed" in out, out[-3000:]
        assert "causality is aligned top-left where bottom-right is asked" in out, out[-3000:]
