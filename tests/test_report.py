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

    # Pairwise tests (SPEC §7.3, §12.10) count in both backends' columns and in the pair's
    # own table, and once in the totals.
    rows = data["tests"]
    assert sum(data["summary"].values()) == len(rows)
    for clause in ("7.3", "12.10"):
        pair_rows = [r for r in rows if r["clause"] == clause]
        assert pair_rows and all(r["backend"] == "numpy~torch-naive" for r in pair_rows)
        n = sum(r["outcome"] == "passed" for r in pair_rows)
        assert n > 0
        for column in ("numpy", "torch-naive", "numpy~torch-naive"):
            assert data["clauses"][column][clause]["passed"] == n, (column, clause)
    n = data["clauses"]["numpy~torch-naive"]["7.3"]["passed"]
    assert f"| §7.3 Backends agree pairwise | ✅ {n}/{n} | ✅ {n}/{n} |" in md
    assert "| §12.10 Backends agree pairwise | ✅" in md
    assert "| numpy~torch-naive |" in md.split("## Every pair on random inputs")[1]

    # Gradients (SPEC §12): each backend against the oracle on the gradient fixtures, every
    # pair, a table and a heatmap per dtype, after the forward agreement.
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        block = data["gradients"][dtype]
        assert set(block["vs_oracle"]) == {"numpy", "torch-naive"}
        assert all(0 < e["max_fraction_of_tolerance"] <= 1 for e in block["vs_oracle"].values())
        assert "numpy~torch-naive" in block["pairs"] and "numpy~torch-naive" in block["pairs_eps"]
        assert f"### {dtype} gradients" in md
    section = md.index("## Gradients: cross-framework agreement on the gradient fixtures")
    assert md.index("## Cross-framework agreement on the fixtures") < section
    assert section < md.index("## Every pair on random inputs")

    # JUnit XML for CI, one testcase per test.
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    cases = suite.findall(".//testcase")
    assert len(cases) == data["summary"]["passed"] + data["summary"]["skipped"]

    # Pictures, each linked from the Markdown.
    for name in (
        "masks.png",
        "worked-example-weights.png",
        "agreement-float32.png",
        "gradient-agreement-float32.png",
        "gradient-agreement-bfloat16.png",
    ):
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


@pytest.mark.clause("13.7")
def test_a_pairwise_test_counts_for_both_backends_and_once_in_total():
    from conformance import report

    def row(backend, clause, outcome, reason=""):
        return {"backend": backend, "clause": clause, "outcome": outcome, "reason": reason}

    rows = [
        row("a", "4.1", "passed"),
        row("b", "4.1", "passed"),
        row("a~b", "7.3", "passed"),
        row("a~b", "7.3", "failed", "a vs b: too far"),
        row("a~c", "12.10", "skipped", "c lacks capability 'grad'"),
    ]
    table = report.clause_table(rows)
    assert table["a"]["7.3"]["passed"] == table["b"]["7.3"]["passed"] == 1
    assert table["a"]["7.3"]["failed"] == table["b"]["7.3"]["failed"] == 1
    assert table["a~b"]["7.3"]["failed"] == 1 and "7.3" not in table["c"]
    assert table["c"]["12.10"]["skipped"] == table["a"]["12.10"]["skipped"] == 1
    assert table["b"]["7.3"]["reasons"]["failed"] == ["a vs b: too far"]
    assert table["a"]["4.1"]["passed"] == 1
