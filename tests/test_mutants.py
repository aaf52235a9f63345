"""The suite bites: every deliberately broken backend in tests/mutants.py fails it.

Each mutant is registered as a built-in backend and the whole conformance suite is run
on it in-process; the run must fail, and at least one failing test must carry the
clause that describes the bug. A gradient mutant's forward is the unbroken one, so every
test it fails must be a gradient test (SPEC §12). The unbroken control, which declares
the gradient capabilities too, must pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mutants import GRADIENT_MUTANTS, MUTANTS, Control

import conformance

SUITE = Path(conformance.__file__).resolve().parent / "tests"


class _Failures:
    """A pytest plugin that records each failing test's node id and clauses; given
    ``enough`` (a test that fails with what it must show), it ends the run there."""

    def __init__(self, enough=None) -> None:
        self.failed: list[tuple[str, set[str]]] = []
        self.enough = enough

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        if rep.failed:
            clauses = {str(a) for m in item.iter_markers("clause") for a in m.args}
            self.failed.append((item.nodeid, clauses))
            if self.enough is not None and self.enough(item.nodeid, clauses):
                item.session.shouldstop = "the mutant is killed"


def _run_suite(registry, name, cls, repro, enough=None):
    """The suite on one backend; a failure's replay goes to ``repro`` (a test's tmp_path),
    not to a fresh directory in the system's temp dir. With ``enough``, the run ends at
    the first failing test it accepts."""
    registry.register(name, cls)
    failures = _Failures(enough)
    code = pytest.main(
        [str(SUITE), "--backend", name, "-q", "--tb=no", "-p", "no:cacheprovider"]
        + ["--repro-dir", str(repro)],
        plugins=[failures],
    )
    return int(code), failures.failed


def test_control_passes(registry, tmp_path):
    """The unbroken steps pass the suite, so a mutant's failure is its bug's doing."""
    assert {"grad", "grad_mask", "grad_softcap"} <= Control.capabilities
    code, failed = _run_suite(registry, Control.name, Control, tmp_path)
    assert code == 0 and not failed, failed


def _params():
    for name in MUTANTS:
        yield pytest.param(name, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_mutant_is_killed(registry, name, tmp_path):
    cls, clauses, node_part = MUTANTS[name]

    def shows_the_bug(node, marks):
        return bool(marks & clauses) and node_part in node

    # A forward mutant is killed by its first failure that shows the bug; a gradient
    # mutant runs the whole suite, since every test it fails must be a gradient test.
    enough = None if name in GRADIENT_MUTANTS else shows_the_bug
    code, failed = _run_suite(registry, name, cls, tmp_path, enough)
    # A run ended early exits as interrupted (2), with the failure that ended it recorded.
    ended = enough is not None and code == pytest.ExitCode.INTERRUPTED
    assert failed and (code == 1 or ended), f"{name} survived the suite (exit code {code})"
    hits = [node for node, marks in failed if shows_the_bug(node, marks)]
    assert hits, (
        f"{name} failed, but no failing test carries clause {sorted(clauses)}"
        f"{f' with {node_part!r} in its id' if node_part else ''}; failures: {failed}"
    )
    if name in GRADIENT_MUTANTS:
        forward = [node for node, marks in failed if not any(m.startswith("12.") for m in marks)]
        assert not forward, f"{name} breaks only the backward, yet fails forward tests: {forward}"


def test_enough_mutants():
    assert len(MUTANTS) >= 22
    assert len(GRADIENT_MUTANTS) >= 6


@pytest.mark.parametrize(
    "name", ["mutant-tiles-sum-not-rescaled", "mutant-tiles-accumulator-not-rescaled"]
)
def test_the_mla_cases_catch_the_long_row_mutants(registry, name, tmp_path):
    """SPEC §4.12: a blockwise softmax whose running sum (tiles of 512) or accumulator
    (tiles of 1,024) is not rescaled fails every dense MLA case, the masked ones included;
    the unbroken control passes them."""
    failures = _Failures()
    registry.register(name, MUTANTS[name][0])
    registry.register(Control.name, Control)
    args = [str(SUITE / "test_mla.py"), "-q", "--tb=no", "-p", "no:cacheprovider"]
    args += ["--repro-dir", str(tmp_path), "-k", "not paged"]
    code = pytest.main([*args, "--backend", name, "--backend", Control.name], plugins=[failures])
    assert code == 1
    failed = {node.partition(f"[{name}-")[2].removesuffix("]") for node, _ in failures.failed}
    assert all(f"[{name}-" in node for node, _ in failures.failed), failures.failed
    assert len(failed) == 8 and {"mla-decode-S4096-bool-mask-float32"} <= failed, failed
