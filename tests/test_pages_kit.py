"""Every page function a student may adopt, judged as it is called: the kit runs it through
its own signature and conforms on what it declares.

The backends call the pages their own way (``numpy-flash`` with tiny tiles and the fast
path, ``numpy-split`` with three chunks); a student calls ``attention(q, k, v, ...)`` with
the page's defaults and keywords. Here each page's ``attention`` (the core pages, the
module page, flash, split-KV) and each framework's ``merge_states`` (in its core page's
profile, SPEC §22.10) runs through the kit from a profile in ``tests/page_profiles/``: the
spec's options by the page's own keywords, its lse where ``return_lse=True`` puts it
(§21), its dropout's seed as the page takes one. Every test the run holds must pass.

In CI the NumPy and PyTorch pages run the whole spec. A JAX page compiles a program for
each new shape and option set (a whole run, cold, about a thousand programs and 80 s), so
CI runs the modules in ``JAX_MODULES`` on them, in float64: the errors and the merge
(nothing or little to compile) and the fixtures. The whole spec on any page is
one command, the profile's:

    pytest conformance --impl-profile tests/page_profiles/jax.flash.toml
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import conformance
from conformance.adapters.profiles import read_profile

SUITE = Path(conformance.__file__).resolve().parent / "tests"
PROFILES = Path(__file__).resolve().parent / "page_profiles"
#: What CI runs of a JAX page (see the module docstring): modules, and a -k selection.
JAX_MODULES = (
    ["test_errors.py", "test_merge.py", "test_fixtures.py"],
    "not float32 and not float16 and not bfloat16",
)
#: Each declared variant's own test module: a run of the whole spec must have passed tests
#: in it, so that a capability declared and never exercised cannot pass unseen.
VARIANT_MODULES = {
    "lse": "test_lse.py",
    "merge": "test_merge.py",
    "sinks": "test_sinks.py",
    "chunked": "test_chunked.py",
    "alibi": "test_alibi.py",
    "grad": "test_gradients.py",
}


class _Outcomes:
    """A pytest plugin that keeps each test's outcome, by node id."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid)
        elif report.passed and report.when == "call":
            self.passed.append(report.nodeid)


def _pages():
    for path in sorted(PROFILES.glob("*.toml")):
        framework = path.stem.split(".")[0]
        missing = importlib.util.find_spec(framework) is None
        skip = pytest.mark.skipif(missing, reason=f"{framework} is not installed")
        yield pytest.param(path, id=path.stem, marks=[skip])


@pytest.mark.clause("13.12")
@pytest.mark.parametrize("profile", list(_pages()))
def test_the_page_function_conforms_as_it_is_called(profile, tmp_path):
    declared = set(read_profile(profile).capabilities)
    jax_page = profile.stem.startswith("jax.")
    modules, selection = JAX_MODULES if jax_page else ([], "")
    outcomes = _Outcomes()
    code = pytest.main(
        [*([str(SUITE / m) for m in modules] or [str(SUITE)]), "--impl-profile", str(profile)]
        + (["-k", selection] if selection else [])
        + ["-q", "--tb=short", "-p", "no:cacheprovider", "--repro-dir", str(tmp_path)],
        plugins=[outcomes],
    )
    assert code == 0 and not outcomes.failed, f"{profile.stem} fails: {outcomes.failed}"
    assert outcomes.passed, f"{profile.stem}: no test ran"
    ran = {node.split("::")[0].rsplit("/", 1)[-1] for node in outcomes.passed}
    variants = declared & VARIANT_MODULES.keys()
    expected = modules if jax_page else [VARIANT_MODULES[c] for c in variants]
    missing = sorted(set(expected) - ran)
    assert not missing, f"{profile.stem}: no test passed in {missing}"
