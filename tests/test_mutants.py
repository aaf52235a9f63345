"""The suite bites: every deliberately broken backend in tests/mutants.py fails it.

Each mutant is registered as a built-in backend and the whole conformance suite is run
on it in-process; the run must fail, and at least one failing test must carry the
clause that describes the bug. The unbroken control must pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mutants import MUTANTS, Control

import conformance.backends as backends

SUITE = Path(backends.__file__).resolve().parent / "tests"


class _Failures:
    """A pytest plugin that records each failing test's node id and clauses."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, set[str]]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        if rep.failed:
            clauses = {str(a) for m in item.iter_markers("clause") for a in m.args}
            self.failed.append((item.nodeid, clauses))


def _run_suite(monkeypatch, name, cls):
    monkeypatch.setitem(backends.BUILTIN, name, cls)
    monkeypatch.setattr(backends, "_LOADED", {})
    failures = _Failures()
    code = pytest.main(
        [str(SUITE), "--backend", name, "-q", "--tb=no", "-p", "no:cacheprovider"],
        plugins=[failures],
    )
    return int(code), failures.failed


def test_control_passes(monkeypatch):
    """The unbroken steps pass the suite, so a mutant's failure is its bug's doing."""
    code, failed = _run_suite(monkeypatch, Control.name, Control)
    assert code == 0 and not failed, failed


def _params():
    for name in MUTANTS:
        yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_mutant_is_killed(monkeypatch, name):
    cls, clauses, node_part = MUTANTS[name]
    code, failed = _run_suite(monkeypatch, name, cls)
    assert code == 1, f"{name} survived the suite (exit code {code})"
    hits = [node for node, marks in failed if marks & clauses and node_part in node]
    assert hits, (
        f"{name} failed, but no failing test carries clause {sorted(clauses)}"
        f"{f' with {node_part!r} in its id' if node_part else ''}; failures: {failed}"
    )


def test_enough_mutants():
    assert len(MUTANTS) >= 16
