"""The distribution as a user installs it: a wheel in a fresh virtual environment, the kit
run from a directory outside the repository (SPEC §13.9).

Slow-ish (a venv and a pip install), so it runs once per session and every check below
shares it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.suite.cases import manifest

ROOT = Path(__file__).resolve().parent.parent
#: What a checkout holds beside its sources: build outputs, caches, environments.
NOT_SOURCES = (
    ".git",
    ".tox",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*cache",
    ".hypothesis",
    "venv",
    ".venv",
)
#: Outputs of runs in the checkout's root (not the package conformance/report).
TOP_LEVEL_OUTPUTS = {"report", "bench-results"}


def _not_sources(directory: str, names: list[str]) -> set[str]:
    ignored = set(shutil.ignore_patterns(*NOT_SOURCES)(directory, names))
    if Path(directory) == ROOT:
        ignored |= TOP_LEVEL_OUTPUTS & set(names)
    return ignored


pytestmark = pytest.mark.clause("13.9")

#: A user's own package: a correct attention, and one whose causal mask lets each query
#: see one key too far (the off-by-one every causal kernel has met once).
USER_PACKAGE = """
import numpy as np


def _attention(q, k, v, *, mask=None, is_causal=False, scale=None, reach=0):
    T, S, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / np.sqrt(D) if scale is None else scale
    scores = q @ np.swapaxes(k, -1, -2) * scale  # (B, H, T, S)
    allowed = np.ones(scores.shape, bool)
    if mask is not None and mask.dtype == np.bool_:
        allowed = allowed & mask
    elif mask is not None:
        allowed = allowed & (mask != -np.inf)
        scores = scores + mask
    if is_causal:
        allowed = allowed & np.tri(T, S, reach, dtype=bool)
    scores = np.where(allowed, scores, -np.inf)
    v = np.where(allowed.any(axis=-2)[..., None], v, 0)
    top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0)
    p = np.exp(scores - top)
    total = p.sum(axis=-1, keepdims=True)
    return (p / np.where(total > 0, total, 1)) @ v


def _check(q, k, v, mask, scale):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} should have 4 dimensions, got {x.shape}")
        if x.dtype.kind != "f":
            raise TypeError(f"{name} should be floating, got {x.dtype}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError("q, k and v should have one dtype")
    if k.shape[:2] != v.shape[:2] or k.shape[2] != v.shape[2] or q.shape[-1] != k.shape[-1]:
        raise ValueError("k and v do not match q")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError("batch or heads differ")
    if mask is not None:
        if mask.dtype != np.bool_ and mask.dtype.kind != "f":
            raise TypeError(f"mask should be bool or floating, got {mask.dtype}")
        try:
            np.broadcast_shapes(mask.shape, q.shape[:2] + (q.shape[2], k.shape[2]))
        except ValueError:
            raise ValueError(f"mask shape {mask.shape} does not broadcast") from None
        if mask.ndim > 4:
            raise ValueError("mask has too many dimensions")
    if scale is not None and not (isinstance(scale, float) and np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale should be a positive float, got {scale!r}")


def attention(q, k, v, *, mask=None, is_causal=False, scale=None):
    _check(q, k, v, mask, scale)
    return _attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale).astype(q.dtype)


def broken(q, k, v, *, mask=None, is_causal=False, scale=None):
    _check(q, k, v, mask, scale)
    return _attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale, reach=1).astype(q.dtype)
"""

#: A pytest plugin of the user's directory that writes down the clauses of failed tests.
#: The tests are collected where they run: in the pytest-xdist worker of an isolated run
#: (SPEC §13.13), while the controller sees the reports too; the process that collected a
#: test writes it down, once.
CLAUSE_LOG = """
import json, os

CLAUSES = {}


def pytest_collection_modifyitems(items):
    CLAUSES.update(
        {i.nodeid: [str(a) for m in i.iter_markers("clause") for a in m.args] for i in items}
    )


def pytest_runtest_logreport(report):
    if report.when == "call" and report.failed and report.nodeid in CLAUSES:
        with open(os.environ["CLAUSE_LOG"], "a") as f:
            f.write(json.dumps([report.nodeid, CLAUSES.get(report.nodeid, [])]) + "\\n")
"""


@pytest.fixture(scope="session")
def installed(once):
    """A fresh venv with the wheel built from this checkout; and a user's directory. Built
    once per test run, whichever pytest-xdist worker needs it first."""
    work = once("installed", _build)
    return work / "venv" / "bin" / "python", work / "user"


def _build(work: Path) -> None:
    wheels = work / "wheels"
    # setuptools builds in the source tree's build/, which tox's own editable build (or a
    # stale one) may hold at the same moment; a private copy of the sources cannot clash.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_not_sources)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
    )
    (wheel,) = wheels.glob("attention_conformance-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
        check=True,
    )
    user = work / "user"
    (user / "mypkg").mkdir(parents=True)
    (user / "mypkg" / "__init__.py").write_text("")
    (user / "mypkg" / "attn.py").write_text(textwrap.dedent(USER_PACKAGE))
    (user / "clause_log.py").write_text(textwrap.dedent(CLAUSE_LOG))


def _run(installed, *args, env=None, cwd=None):
    python, user = installed
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    environment.update(env or {})
    return subprocess.run(
        [str(python), *args], cwd=cwd or user, capture_output=True, text=True, env=environment
    )


def test_only_conformance_at_the_top_level(installed):
    """One import name: no `fixtures`, `impls` or `bench` beside other distributions'."""
    run = _run(
        installed,
        "-c",
        "import importlib.metadata as m, json; "
        "print(json.dumps(sorted({str(f).split('/')[0] for f in "
        "m.distribution('attention-conformance').files})))",
    )
    assert run.returncode == 0, run.stderr
    top = {name for name in json.loads(run.stdout) if not name.endswith(".dist-info")}
    assert top == {"conformance"}, top


def test_kit_passes_a_correct_function_from_any_directory(installed):
    run = _run(
        installed,
        "-m",
        "pytest",
        "--pyargs",
        "conformance",
        "--impl",
        "mypkg.attn:attention",
        "-q",
        "-p",
        "no:cacheprovider",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_kit_fails_a_broken_function_on_the_right_clause(installed, tmp_path):
    log = tmp_path / "clauses.jsonl"
    run = _run(
        installed,
        "-m",
        "pytest",
        "--pyargs",
        "conformance",
        "--impl",
        "mypkg.attn:broken",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "clause_log",
        "--repro-dir",
        str(tmp_path / "repro"),
        env={"CLAUSE_LOG": str(log)},
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    failed = [json.loads(line) for line in log.read_text().splitlines()]
    clauses = {c for _, marks in failed for c in marks}
    # Top-left causality and no future leakage fail; nothing without a causal mask does
    # (the property tests draw causal calls among others).
    assert {"3.4", "6.3"} <= clauses, clauses
    causal_cases = {e["id"] for e in manifest()["cases"] if e.get("options", {}).get("is_causal")}

    def causal(test: str, marks: list) -> bool:
        case = test.partition("[attn.broken-")[2].rstrip("]")
        words = ("causal", "future_leakage", "test_properties")
        # A test of causality's own clauses (§3.4 top-left, §6.3 no future leakage).
        own = {"3.4", "6.3"} & set(marks)
        return bool(own) or case in causal_cases or any(word in test for word in words)

    unrelated = [test for test, marks in failed if not causal(test, marks)]
    assert not unrelated, unrelated
    # SPEC §13.18: the rerun command each failure ends with reruns exactly that test, from
    # the directory the run started in, the suite installed in site-packages.
    reruns = [line for line in run.stdout.splitlines() if line.startswith("rerun: pytest ")]
    assert reruns, run.stdout[-3000:]
    test = reruns[0].split("::", 1)[1].split("'", 1)[0]
    python, user = installed
    words = shlex.split(reruns[0].removeprefix("rerun: "))
    again = subprocess.run(
        [str(python.parent / words[0]), *words[1:], "-p", "no:cacheprovider"],
        cwd=user,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-2000:]
    assert re.search(r"=+ 1 failed[ ,]", again.stdout), again.stdout[-3000:]
    assert test in again.stdout


def test_report_runs_anywhere(installed, tmp_path):
    run = _run(
        installed,
        "-m",
        "conformance",
        "report",
        "--impl",
        "mypkg.attn:attention",
        "--out",
        str(tmp_path / "report"),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert (tmp_path / "report" / "report.md").exists()


def test_plugin_stays_quiet_in_other_projects(installed, tmp_path):
    """In another project's test run the plugin adds options and does nothing else."""
    (tmp_path / "test_other.py").write_text("def test_other():\n    assert 1 + 1 == 2\n")
    run = _run(
        installed, "-m", "pytest", "test_other.py", "-q", "-p", "no:cacheprovider", cwd=tmp_path
    )
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_kit_runs_from_the_checkouts_root(installed, tmp_path):
    """The README's steps 1 and 3, where it says to run them: in the repository's root,
    after a non-editable install, where ``conformance`` is also the checkout's folder."""
    python, user = installed
    source = user.parent / "source"
    kit = (
        "--pyargs conformance --impl examples.my_attention:attention "
        "--impl-capabilities value_dim,causal_bottom_right,window,gqa -q"
    ).split()
    # The `pytest` script, as the README runs it (`python -m pytest` would put the checkout
    # on sys.path, ahead of the installed package).
    pytest_script = python.parent / "pytest"
    step1 = subprocess.run(
        [str(pytest_script), *kit, "--repro-dir", str(tmp_path / "repro")],
        cwd=source,
        capture_output=True,
        text=True,
    )
    assert step1.returncode == 1, step1.stdout[-3000:] + step1.stderr[-2000:]
    failed = [line for line in step1.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2 and all("test_bad_input" in line for line in failed), failed
    step3 = subprocess.run(
        [str(pytest_script), *kit, "--known-failures", "examples/known_failures.txt"],
        cwd=source,
        capture_output=True,
        text=True,
    )
    assert step3.returncode == 0, step3.stdout[-3000:] + step3.stderr[-2000:]
    assert "2 xfailed" in step3.stdout, step3.stdout[-2000:]
