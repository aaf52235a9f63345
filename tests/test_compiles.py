"""The run's summary line counts the programs a JAX backend compiled (issue: cold speed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _summary(*args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance/tests/test_invariants.py", "-q", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_jax_run_counts_its_compiled_programs(workers):
    pytest.importorskip("jax")
    line = _summary("--backend", "jax", "-k", "rows_sum_to_one", *workers)
    found = re.search(r"(\d+) programs compiled \(jax\)", line)
    assert found and int(found.group(1)) > 0, line


def test_a_run_without_jax_shows_no_count():
    line = _summary("--backend", "numpy", "-k", "rows_sum_to_one")
    assert "passed" in line and "compiled" not in line, line
