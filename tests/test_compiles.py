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


def _counter(tmp_path, by_module: dict[str, int], rewrite=False):
    from conformance.suite.compiles import ProgramCounter

    counter = ProgramCounter("jax", tmp_path / "programs.toml", rewrite)
    # Module "a" and "b" share their first programs: the env's total counts them once.
    for module, count in by_module.items():
        counter.by_module[module] = {f"program {i}" for i in range(count)}
    return counter


def test_the_guard_allows_ten_percent_and_names_the_modules_that_grew(tmp_path):
    from conformance.suite.compiles import read_records, write_records

    write_records(
        tmp_path / "programs.toml",
        {"jax": {"total": 100, "modules": {"a.py": 100, "b.py": 40, "c.py": 10}}},
    )
    lines, over = _counter(tmp_path, {"a.py": 110, "b.py": 40})._judge()
    assert not over and "110, recorded 100 (at most 110" in lines[0], lines
    lines, over = _counter(tmp_path, {"a.py": 105, "b.py": 111, "new.py": 2})._judge()
    assert over, lines
    grown = [line.strip() for line in lines if line.startswith("  ")]
    # Largest growth first; a module the record does not know grew from 0; "c.py", whose
    # tests did not run, is not named.
    assert grown == ["b.py: 40 -> 111 (+71)", "a.py: 100 -> 105 (+5)", "new.py: 0 -> 2 (+2)"]
    assert "jax compiles 11 more programs" in lines[1], lines
    # --record-programs writes the run's counts as the record, and the run passes.
    lines, over = _counter(tmp_path, {"a.py": 105, "b.py": 111}, rewrite=True)._judge()
    assert not over and "written" in lines[0]
    assert read_records(tmp_path / "programs.toml") == {
        "jax": {"total": 111, "modules": {"a.py": 105, "b.py": 111}}
    }


def test_an_env_without_a_record_prints_the_record_to_paste(tmp_path):
    from conformance.suite.compiles import read_records

    lines, over = _counter(tmp_path, {"a.py": 3, "b.py": 2})._judge()
    assert not over and "tox -e jax -- --record-programs" in lines[0], lines
    (tmp_path / "pasted.toml").write_text("\n".join(lines[1:]))
    assert read_records(tmp_path / "pasted.toml") == {
        "jax": {"total": 3, "modules": {"a.py": 3, "b.py": 2}}
    }


def test_a_broken_record_is_refused_by_name(tmp_path):
    (tmp_path / "programs.toml").write_text('[jax]\ntotal = "many"\n')
    with pytest.raises(pytest.UsageError, match=r"\[jax\].*integer 'total'.*'many'"):
        _counter(tmp_path, {"a.py": 3})._judge()


def test_a_run_over_its_record_fails(tmp_path):
    pytest.importorskip("jax")
    record = tmp_path / "programs.toml"
    guard = ["--backend", "jax", "-k", "full and float64", f"--programs-record={record}"]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "conformance/tests/test_invariants.py",
            "-q",
            *guard,
            "--check-programs",
            "jax",
            "--record-programs",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0 and "written to" in run.stdout, run.stdout[-2000:]
    written = record.read_text()
    module = '"conformance/tests/test_invariants.py"'
    count = int(re.search(rf"^{module} = (\d+)$", written, re.M).group(1))
    total = int(re.search(r"^total = (\d+)$", written, re.M).group(1))
    assert count == total >= 10, written
    # A record a fifth below the run: the run is over its 10 %.
    lower = total * 8 // 10
    record.write_text(written.replace(f"= {total}", f"= {lower}"))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "conformance/tests/test_invariants.py",
            "-q",
            *guard,
            "--check-programs",
            "jax",
            "-n",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 1, run.stdout[-2000:]
    assert "passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
    assert f"  conformance/tests/test_invariants.py: {lower} -> {total}" in run.stdout
