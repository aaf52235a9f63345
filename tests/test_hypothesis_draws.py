"""The examples a derandomized property test draws depend on the test alone.

Hypothesis mixes into its draws literal constants it parses from the source of the local
modules a process has loaded, within a time limit, so the same derandomized test drew
other examples under ``python -m conformance report`` than under ``pytest``, and
``onnxruntime.Attention``'s §1.2 property run passed in one and failed in the other. A
conformance run turns that pool off (``conformance.suite.plugin``); these tests look at
the pool Hypothesis' generator reads, in a run with a local module full of constants.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis.internal.conjecture.providers")

ROOT = Path(__file__).resolve().parent.parent

CONSTANTS = "LOTS = [3, 5, 7, 11, 13, 17, 119, 500, 4096, 65535]\n"

# A plugin that reports, after the run, how many local constants Hypothesis would draw
# from: the pool its generator reads for each example.
PROBE = """
from hypothesis.internal.conjecture import providers

def pytest_sessionfinish(session):
    print("local constants:", len(providers._get_local_constants().integers))
"""

A_TEST = """
from hypothesis import given, strategies as st

@given(st.integers(0, 10))
def test_draws(x):
    assert 0 <= x <= 10
"""


def _run(tmp_path: Path, *args: str) -> str:
    (tmp_path / "many_constants.py").write_text(CONSTANTS)
    (tmp_path / "pool_probe.py").write_text(PROBE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
        + ["-p", "many_constants", "-p", "pool_probe", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    return out


def test_a_plain_hypothesis_run_draws_from_local_constants(tmp_path):
    """Without a conformance run Hypothesis' pool holds the local module's constants: the
    feature this guards against exists in the installed Hypothesis."""
    (tmp_path / "test_plain.py").write_text(A_TEST)
    out = _run(tmp_path, "test_plain.py")
    count = int(out.split("local constants:")[1].split()[0])
    assert count > 0, out[-2000:]


def test_a_conformance_run_draws_from_no_local_constants(tmp_path):
    out = _run(
        tmp_path,
        str(ROOT / "conformance" / "tests" / "test_properties.py"),
        "--backend",
        "numpy",
        "-k",
        "test_matches_the_reference",
    )
    assert "local constants: 0" in out, out[-2000:]


def test_draws_use_only_the_forms_a_backend_takes():
    """SPEC §13.17, §13.19: a backend without causality, a scale, top-left alignment, a
    window's right side, a mask form or non-causal calls is never handed one by the property
    tests' strategies; one taking every form still draws them all."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from conformance.adapters.forms import ALL_FORMS, forms_used
    from conformance.tests import test_properties

    class Drawn:
        name, dtypes = "drawn", ("float64",)
        capabilities = frozenset({"window", "gqa"})

        def __init__(self, forms):
            self.forms = frozenset(forms)

    def used(backend) -> set:
        seen: set = set()

        @settings(
            max_examples=60,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def draw(data):
            for strategy in (test_properties.problems, test_properties.packings):
                p = data.draw(strategy(backend))
                T, S = p.q.shape[-2], p.k.shape[-2]
                packed = strategy is test_properties.packings
                seen.update(forms_used(p.options, *(() if packed else (T, S))))

        draw()
        return seen

    assert used(Drawn(ALL_FORMS)) == set(ALL_FORMS)
    # The least a backend takes: non-causal calls with no mask, scale or alignment.
    assert used(Drawn({"non_causal"})) == {"non_causal"}
    # A causal-only kernel with a bool mask is never handed a non-causal call or a float mask.
    taken = {"causal", "causal_top_left", "mask_bool"}
    assert used(Drawn(taken)) == taken


def test_a_run_draws_under_its_own_profile_whenever_the_module_was_imported(monkeypatch):
    """Hypothesis fixes a test's settings when its module is imported. A process that
    imported the property tests under Hypothesis' default profile (as the test above
    does) and then starts a conformance run in-process must still draw under the run's
    profile: under the default one, the backend fixture fails a health check and no
    example reaches the backend."""
    from hypothesis import settings

    from conformance.tests import test_properties

    test = test_properties.test_matches_the_reference
    monkeypatch.setattr(test, "_hypothesis_internal_use_settings", settings.get_profile("default"))
    code = pytest.main(
        [str(ROOT / "conformance" / "tests" / "test_properties.py"), "--backend", "numpy"]
        + ["-k", "test_matches_the_reference", "-q", "-p", "no:cacheprovider"]
    )
    assert code == 0
