"""Under ``--dist loadscope`` a conformance run keeps each test function's tests on one
backend in one process (``conformance.suite.scheduling``), so that a JAX backend compiles
the programs its parametrizations share once, not once per process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from conformance.suite.scheduling import work_unit

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parent.parent

# A plugin that prints, in the controller (where a report knows its worker), each test's
# id and the worker that ran it.
WHO_RAN = """
def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)
    if report.when == "call" and node is not None:
        print("ran", report.nodeid, node.gateway.id)
"""


@pytest.mark.parametrize(
    "nodeid, unit",
    [
        ("m.py::test_a[jax-flash-float32-T7]", "m.py::test_a[jax-flash"),
        ("m.py::test_a[jax-float32-T7]", "m.py::test_a[jax"),
        ("m.py::test_a[jax]", "m.py::test_a[jax"),
        ("m.py::test_a[numpy~jax-flash-scale-int]", "m.py::test_a[numpy~jax-flash"),
        ("m.py::test_a[jaxx-float32]", "m.py::test_a"),
        ("m.py::test_b", "m.py::test_b"),
    ],
)
def test_work_unit(nodeid, unit):
    assert work_unit(nodeid, ["numpy", "jax", "jax-flash"]) == unit


def test_a_function_on_a_backend_runs_in_one_process(tmp_path):
    (tmp_path / "who_ran.py").write_text(WHO_RAN)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance/tests/test_edges.py", "-k", "nan"]
        + ["--backend", "numpy", "--backend", "numpy-flash", "-n", "2", "--dist", "loadscope"]
        + ["-p", "who_ran", "-p", "no:cacheprovider", "-s", "-q"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers_of = defaultdict(set)
    # pytest's progress dots share the lines.
    for nodeid, worker in re.findall(r"ran (\S+) (gw\d+)", run.stdout):
        workers_of[work_unit(nodeid, ["numpy", "numpy-flash"])].add(worker)
    assert len(workers_of) >= 4, run.stdout[-3000:]
    split = {unit: ws for unit, ws in workers_of.items() if len(ws) > 1}
    assert not split, split
    # Both processes got work: the units are spread, not all sent to one.
    assert len(set().union(*workers_of.values())) == 2
