"""The benchmark command runs end to end and writes its tables and plots (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_quick_run(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--sizes",
        "64",
        "--repeats",
        "1",
        "--backends",
        "numpy-flash",
        "torch-sdpa",
    ]
    cmd += ["--no-progress", "--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for name in ("results.csv", "results.json", "results.md", "time_vs_T.png", "memory_vs_T.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = json.loads((tmp_path / "results.json").read_text())
    text = json.dumps(rows)
    assert "numpy-flash" in text and "torch-sdpa" in text
    assert "| numpy-flash |" in (tmp_path / "results.md").read_text()
