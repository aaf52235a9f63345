"""The suite runs only what a backend declares (SPEC §10.3): requirements by construction.

A correct function that declares float32 alone, and not a value head dim E ≠ D, runs the
whole spec: nothing in it may fail (it is the reference), and no call it receives may use
a dtype, a shape form or an option it did not declare. A misspelt capability in a test's
requirements stops the collection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.suite.requirements import requires, undeclared, uses_dtype

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.clause("10.3")


def _run_spec(tmp_path: Path, *options: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log = tmp_path / "calls.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(ROOT / "conformance"),
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "--impl",
            "tests.limited_attention:attention",
            "--impl-name",
            "limited",
            "--repro-dir",
            str(tmp_path / "repro"),
            *options,
        ],
        cwd=ROOT,
        env={**os.environ, "LIMITED_ATTENTION_LOG": str(log)},
        capture_output=True,
        text=True,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return run, calls


def _floating(x: dict | None) -> bool:
    return x is not None and x["dtype"] in ("float64", "float32", "float16", "bfloat16")


def test_float32_only_without_value_dim_runs_only_what_it_declares(tmp_path):
    run, calls = _run_spec(tmp_path, "--impl-dtypes", "float32")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "suite error" not in run.stdout
    assert len(calls) > 300, f"only {len(calls)} calls reached the function"
    for call in calls:
        q, k, v = call["q"], call["k"], call["v"]
        if _floating(q):
            assert q["dtype"] == "float32", f"an undeclared dtype reached the function: {call}"
        if _floating(call["mask"]):
            assert call["mask"]["dtype"] == "float32", f"an undeclared mask dtype: {call}"
        if len(q["shape"]) == len(k["shape"]) == len(v["shape"]) == 4:
            if q["shape"][-1] == k["shape"][-1]:
                assert v["shape"][-1] == q["shape"][-1], f"E ≠ D reached the function: {call}"
            H, K = q["shape"][1], k["shape"][1]
            assert not (K < H and K > 0 and H % K == 0 and v["shape"][1] == K), (
                f"grouped heads (K < H) reached a function without 'gqa': {call}"
            )
        assert len(q["shape"]) != 3 or len(k["shape"]) != 3, f"unbatched inputs: {call}"
        assert set(call["options"]) <= {"is_causal", "scale"}, f"an undeclared option: {call}"
    # Skips name what is missing: the dtypes and capabilities not declared.
    for missing in ("dtype 'float64'", "capability 'value_dim'", "capability 'gqa'"):
        assert f"limited lacks {missing}" in run.stdout, f"no skip names {missing}"


def test_every_capability_but_value_dim_runs_e_equal_d_everywhere(tmp_path):
    capabilities = "unbatched,causal_bottom_right,window,softcap,gqa,dropout,error_messages"
    run, calls = _run_spec(tmp_path, "--impl-dtypes", "all", "--impl-capabilities", capabilities)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    seen_dtypes = {c["q"]["dtype"] for c in calls if _floating(c["q"])}
    assert seen_dtypes == {"float64", "float32", "float16", "bfloat16"}
    for call in calls:
        q, k, v = call["q"], call["k"], call["v"]
        if len(q["shape"]) == len(v["shape"]) >= 3 and q["shape"][-1] == k["shape"][-1]:
            assert v["shape"][-1] == q["shape"][-1], f"E ≠ D reached the function: {call}"
    assert "limited lacks capability 'value_dim'" in run.stdout


def test_a_misspelt_capability_is_a_collection_error(tmp_path):
    (tmp_path / "test_misspelt.py").write_text(
        "from conformance.suite.requirements import requires\n\n"
        "@requires('windw')\n"
        "def test_x():\n"
        "    pass\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == pytest.ExitCode.INTERRUPTED, run.stdout[-2000:]
    assert "error" in run.stdout.lower() and "windw" in run.stdout


def test_the_vocabulary_is_checked_where_requirements_are_written():
    with pytest.raises(ValueError, match="windw"):
        requires("windw")
    with pytest.raises(ValueError, match="float8"):
        uses_dtype("float8")


class _Declared:
    name = "declared"
    capabilities = frozenset({"gqa"})
    dtypes = ("float32",)


def test_the_guard_names_what_a_call_uses_undeclared():
    import numpy as np

    q = np.zeros((1, 4, 3, 5), np.float64)
    k = np.zeros((1, 2, 6, 5), np.float64)
    v = np.zeros((1, 2, 6, 3), np.float64)
    found = undeclared(_Declared(), "attention", (q, k, v), {"window": (1, 1)})
    assert found == [
        "dtype 'float64'",
        "E = 3 ≠ D = 5 (capability 'value_dim')",
        "window=(1, 1) (capability 'window')",
    ]
    found = undeclared(_Declared(), "attention_vjp", (q.astype(np.float32),) * 3, {})
    assert found == ["attention_vjp (capability 'grad')"]
