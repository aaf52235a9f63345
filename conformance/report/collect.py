"""The report's test run: pytest once, and every test's backend, clause, outcome and numbers.

``run_tests`` runs the conformance suite with pytest, in this process or, with
``workers > 1``, in pytest-xdist worker processes. Either way this module is loaded as a
pytest plugin in every process (``-p conformance.report.collect``): where a test runs,
``pytest_runtest_makereport`` labels its report with the backend and the SPEC clause, and
where the results arrive, ``Collector`` turns each report into a row and gathers the
measurements the tests published (``conformance/suite/measure.py``). Labels and measurements are
plain data on the report, so they survive xdist's trip from worker to controller.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conformance.suite import behaviours
from conformance.suite.measure import published, published_pipeline_costs

#: The conformance package: the tests the report runs are its own.
HERE = Path(__file__).resolve().parent.parent
#: The outcomes a row can have; "xfailed" is a known failure (``--known-failures``).
OUTCOMES = ("passed", "failed", "skipped", "xfailed")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Label the report with what the test ran on: its backend ("a~b" for a pair) and clause."""
    outcome = yield
    rep = outcome.get_result()
    marker = item.get_closest_marker("clause")
    params = getattr(item, "callspec", None)
    backend = params.params.get("backend") if params else None
    pair = params.params.get("backend_pair") if params else None
    if isinstance(pair, (tuple, list)):
        backend = "~".join(pair)
    rep.conformance = {"backend": backend, "clause": marker.args[0] if marker else None}


class Collector:
    """Gathers, where the reports arrive, one row per test and the published measurements
    (the quantized tests' P pipeline costs apart)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.measurements: list[dict] = []
        #: The quantized comparisons' bounds under every P pipeline (SPEC §20.6).
        self.pipeline_costs: list[dict] = []
        #: What each function with a declared domain was judged on (SPEC §13.19), from the
        #: suite's ``conformance-domain`` plugin at the end of the run.
        self.domains: dict[str, dict] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        summary = config.pluginmanager.get_plugin("conformance-domain")
        if summary is not None:
            self.domains = summary.judged()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.measurements += published(report.user_properties)
            self.pipeline_costs += published_pipeline_costs(report.user_properties)
        if report.when != "call" and report.outcome == "passed":
            return
        label = getattr(report, "conformance", None) or {"backend": None, "clause": None}
        result = report.outcome
        reason = message = ""
        if hasattr(report, "wasxfail") and report.passed:
            # A non-strict xfail that passed: the test passed here (on some processors).
            result, reason = "passed", report.wasxfail
        elif hasattr(report, "wasxfail"):
            result, reason = "xfailed", report.wasxfail
            # The known failure's stored reason, and what the test said this time.
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash else ""
        elif report.skipped and isinstance(report.longrepr, tuple):
            reason = report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash else str(report.longrepr)
            if report.when != "call":
                message = f"error in {report.when}: {message}"
            reason = " ".join(message.strip().splitlines()[:2])[:300]
        properties = dict(report.user_properties)
        self.rows.append(
            {
                "test": report.nodeid,
                "backend": label["backend"],
                "clause": label["clause"],
                "outcome": result,
                "reason": reason,
                "message": message,
                "behaviour": properties.get(behaviours.PROPERTY, ""),
                "misreadings": json.loads(properties.get(behaviours.MISREADINGS, "[]")),
                "call": json.loads(properties.get(behaviours.FEATURES, "[]")),
                "reproduce": properties.get("reproduce", ""),
            }
        )


def xdist_installed() -> bool:
    return importlib.util.find_spec("xdist") is not None


def run_tests(
    backends: list[str], extra: list[str], out: Path | None = None, workers: int = 1
) -> tuple[int, Collector]:
    """Run the suite on ``backends`` (plus pytest options ``extra``): the exit code, and
    the collector holding the rows and the measurements.

    With ``workers > 1`` (pytest-xdist), the tests are spread over that many processes,
    one test function on one backend at a time (``--dist loadscope``, see
    ``conformance.suite.scheduling``), so that the programs a JAX backend compiles for a
    function's parametrizations are compiled once; programs compiled in one process are
    found by the other in JAX's persistent compilation cache, when it is on (the plugin
    turns it on: ``conformance.suite.compiles``).
    """
    collector = Collector()
    # The report imported Hypothesis before pytest starts: nothing of it needs rewriting,
    # so pytest's warning about that is noise.
    args = [
        str(HERE),
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "conformance.report.collect",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    for name in backends:
        args += ["--backend", name]
    if out is not None:
        args += [f"--junitxml={out / 'junit.xml'}", "--repro-dir", str(out / "repro")]
    if workers > 1:
        args += ["-n", str(workers), "--dist", "loadscope"]
    code = pytest.main(args + extra, plugins=[collector])
    return int(code), collector
