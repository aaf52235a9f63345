"""The main job's report: per-backend clause table and error matrix, in Markdown and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_report_on_two_backends(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance",
            "report",
            "--backend",
            "numpy",
            "--backend",
            "torch-naive",
            "--out",
            str(tmp_path),
            "-k",
            "fixture or worked or pair or bad_input",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["backends"] == ["numpy", "torch-naive"]
    assert data["summary"]["failed"] == 0 and data["summary"]["passed"] > 100
    assert data["clauses"]["numpy"]["11.1"]["passed"] == 2
    assert set(data["errors"]["float64"]["vs_oracle"]) == {"numpy", "torch-naive"}
    assert "numpy~torch-naive" in data["errors"]["float32"]["pairs"]
    assert data["versions"]["torch"].startswith("2.13.0")
    md = (tmp_path / "report.md").read_text()
    assert "| §11.1 The worked example | ✅ 2/2 | ✅ 2/2 |" in md
    assert "### bfloat16" in md and "numpy~torch-naive" in md
