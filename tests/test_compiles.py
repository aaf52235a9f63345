"""The run's summary line counts the programs a JAX backend compiled, and a line above it
says how long compiling them took (issue: cold speed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _output(*args: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance/tests/test_invariants.py", "-q", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout.strip().splitlines()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_jax_run_counts_its_compiled_programs(workers):
    pytest.importorskip("jax")
    lines = _output("--backend", "jax", "-k", "rows_sum_to_one", *workers)
    found = re.search(r"(\d+) programs compiled \(jax\)", lines[-1])
    assert found and int(found.group(1)) > 0, lines[-1]
    # The seconds come from JAX's own duration events, summed over every process: a
    # program compiled in a worker is counted in the controller's line.
    spent = [line for line in lines if line.startswith("JAX compiling")]
    assert len(spent) == 1, lines[-5:]
    seconds = re.search(r"\bjax ([0-9.]+) s\b", spent[0])
    assert seconds and float(seconds.group(1)) > 0, spent[0]


def test_a_run_without_jax_shows_no_count():
    lines = _output("--backend", "numpy", "-k", "rows_sum_to_one")
    assert "passed" in lines[-1] and "compiled" not in lines[-1], lines[-1]
    assert not any(line.startswith("JAX compiling") for line in lines), lines[-5:]
