"""The main job's report: clause table, error matrix, pictures, the frameworks' own
functions, in Markdown, JSON and JUnit XML, from one command."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance", "report", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


@pytest.mark.clause("13.7", "13.8")
def test_report_on_two_backends(tmp_path):
    run = _report(
        "--backend",
        "numpy",
        "--backend",
        "torch-naive",
        "--out",
        str(tmp_path),
        "-k",
        "fixture or worked or pair or bad_input",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["backends"] == ["numpy", "torch-naive"]
    assert data["summary"]["failed"] == 0 and data["summary"]["passed"] > 100
    assert data["clauses"]["numpy"]["11.1"]["passed"] == 2
    assert set(data["errors"]["float64"]["vs_oracle"]) == {"numpy", "torch-naive"}
    assert "numpy~torch-naive" in data["errors"]["float32"]["pairs"]
    assert "numpy~torch-naive" in data["errors"]["float32"]["pairs_eps"]
    assert data["versions"]["torch"].startswith("2.13.0")
    assert data["machine"] and data["date"]
    md = (tmp_path / "report.md").read_text()
    assert "| §11.1 The worked example | ✅ 2/2 | ✅ 2/2 |" in md
    assert "### bfloat16" in md and "numpy~torch-naive" in md

    # JUnit XML for CI, one testcase per test.
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    cases = suite.findall(".//testcase")
    assert len(cases) == data["summary"]["passed"] + data["summary"]["skipped"]

    # Pictures, each linked from the Markdown.
    for name in ("masks.png", "worked-example-weights.png", "agreement-float32.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in md

    # The frameworks' own functions on the edge cases: information, never a failure.
    profile = data["builtin_profile"]
    assert set(profile["functions"]) >= {"torch SDPA", "-inf masked softmax"}
    rows = {row["case"]: row["results"] for row in profile["cases"]}
    masked = rows["fully masked rows (bool mask)"]
    assert masked["torch SDPA"]["conforms"] and "as the spec" in masked["torch SDPA"]["observed"]
    assert masked["-inf masked softmax"]["observed"].startswith("NaN")
    assert "## The frameworks' own functions, as they are" in md


@pytest.mark.clause("13.5", "13.7")
def test_report_on_a_users_function_says_what_is_wrong(tmp_path):
    """The worked example without its known-failures file: the two failures, each with its
    message and a replay of the call on saved inputs."""
    run = _report(
        "--impl",
        "examples.my_attention:attention",
        "--impl-capabilities",
        "causal_bottom_right,window,gqa",
        "--out",
        str(tmp_path),
        "--no-builtin-profile",
        "-k",
        "bad_input or worked",
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["backends"] == ["my_attention.attention"]
    assert data["summary"]["failed"] == 2
    md = (tmp_path / "report.md").read_text()
    assert "## What failed, and how to reproduce it" in md
    assert "test_bad_input[my_attention.attention-integer-mask]" in md
    assert "mask=int64[5, 6]" in md and "load_call(" in md
    saved = sorted(p.name for p in (tmp_path / "repro").iterdir())
    assert len(saved) == 2 and all(name.endswith(".npz") for name in saved)
    failures = ET.parse(tmp_path / "junit.xml").getroot().findall(".//failure")
    assert len(failures) == 2


@pytest.mark.clause("13.4", "13.7")
def test_report_with_known_failures_passes(tmp_path):
    run = _report(
        "--impl",
        "examples.my_attention:attention",
        "--impl-capabilities",
        "causal_bottom_right,window,gqa",
        "--known-failures",
        "examples/known_failures.txt",
        "--out",
        str(tmp_path),
        "--no-builtin-profile",
        "-k",
        "bad_input",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["summary"]["xfailed"] == 2 and data["summary"]["failed"] == 0
    md = (tmp_path / "report.md").read_text()
    assert "| §8.1 Bad input raises a clear error | ⚠️" in md
    assert "known failure (§8.1): integer masks are read as bool" in md


@pytest.mark.clause("13.3")
def test_report_with_an_unknown_impl_is_an_error(tmp_path):
    run = _report("--impl", "no_such_module_xyz:f", "--out", str(tmp_path))
    assert run.returncode == 2 and "registered backends are" in run.stderr


@pytest.mark.clause("13.7")
def test_without_matplotlib_the_report_says_so(monkeypatch, tmp_path):
    from conformance import report

    def no_matplotlib():
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "_pyplot", no_matplotlib)
    pictures = report.draw_pictures(tmp_path, {})
    assert "matplotlib is not installed" in pictures["error"]
    data = {
        "date": "today",
        "machine": "here",
        "command": "python -m conformance report",
        "versions": {},
        "summary": dict.fromkeys(report.OUTCOMES, 0),
        "exit_code": 0,
        "backends": [],
        "clauses": {},
        "tests": [],
        "errors": {},
        "pictures": pictures,
    }
    assert "no pictures: matplotlib is not installed" in report.render_markdown(data)
    assert not list(tmp_path.iterdir())
