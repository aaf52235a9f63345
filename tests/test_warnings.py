"""The project's own NumPy code does not warn on inputs the spec defines.

The edge-case tests feed the impls NaN, ±inf, the largest float, fully masked rows and
empty sequences on purpose; the spec says what each returns (SPEC §3.8, §4.3, §4.7-§4.9),
so a RuntimeWarning ("overflow encountered in exp", "invalid value encountered in
divide") from them carries no news and buries the warnings that do. Here a RuntimeWarning
raised in one of those modules is an error (``-W error::RuntimeWarning:MODULE``): the
tests that feed them such inputs must still pass. Warnings from elsewhere (a framework,
pytest) are left alone.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The modules held to it, by the name their warnings carry.
IMPLS = tuple(
    f"conformance.impls.numpy.{page}"
    for page in ("attention", "backward", "flash", "flash_tiles", "packed", "paged")
)
#: The conformance tests that feed the edge cases (fixtures: the nan-*, inert-*,
#: large-logits-* ones among others).
EDGE_TESTS = ("test_edges.py", "test_fixtures.py", "test_invariants.py", "test_contract.py")


def _pytest(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
    )


def _errors(modules) -> list[str]:
    return [arg for name in modules for arg in ("-W", f"error::RuntimeWarning:{name}")]


@pytest.mark.clause("4.9")
def test_the_numpy_impls_do_not_warn_on_the_edge_cases(tmp_path):
    missing = [name for name in IMPLS if importlib.util.find_spec(name) is None]
    assert not missing, f"no such module (renamed?): {missing}"
    tests = [f"conformance/tests/{name}" for name in EDGE_TESTS]
    run = _pytest(
        [*tests, "--backend", "numpy", "--backend", "numpy-flash", *_errors(IMPLS)]
        + ["--repro-dir", str(tmp_path)],
        ROOT,
    )
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert run.returncode == 0, "\n".join(failed[:30]) + "\n" + run.stdout[-1500:]


@pytest.mark.clause("4.9")
def test_the_worked_example_does_not_warn(tmp_path):
    """The kit's example (README, step 1) on the whole suite: its two known gaps fail,
    and nothing it computes warns."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    run = _pytest(
        [
            "--pyargs",
            "conformance",
            "--impl",
            "examples.my_attention:attention",
            "--impl-capabilities",
            "value_dim,causal_bottom_right,window,gqa",
            "--known-failures",
            "examples/known_failures.txt",
            *_errors(["examples.my_attention"]),
        ],
        tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "warning" not in run.stdout.splitlines()[-1], run.stdout[-3000:]
