"""What a kernel with a declared domain was judged on, for the run's summary and the report
(SPEC §13.19): its dtypes, the forms it does not take, its shapes and interpreter, the sizes
moved inside its domain, the fixtures built again there, and the clauses left untested
because no call of theirs fits what it takes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conformance.adapters.forms import FORMS, forms_of
from conformance.adapters.interpreters import INTERPRETERS, interpreter_words, measured
from conformance.suite.domain import LACKS_FORM, OUTSIDE, domain_of, inside, restricted


def domain_words(backend: Any) -> list[str]:
    """What ``backend`` is judged on, in lines: its dtypes, the forms it does not take,
    its domain (and the interpreter it runs under)."""
    lines = [f"dtypes {', '.join(backend.dtypes)}"]
    # A merge alone (SPEC §22) attends nothing: no form of attention is its to take.
    missing = sorted(set(FORMS) - forms_of(backend)) if getattr(backend, "attends", True) else []
    if missing:
        lines.append("forms it does not take: " + "; ".join(FORMS[f] for f in missing))
    domain = domain_of(backend)
    if not domain.everything:
        lines.append(f"shapes {domain.words()}")
    interpreter = getattr(backend, "interpreter", "")
    if interpreter:
        lines.append(f"runs under {interpreter_words(interpreter)}")
        known = INTERPRETERS.get(interpreter)
        spoils = {d for lim in (known.limitations if known else ()) for d in lim.dtypes}
        if spoils & set(backend.dtypes):
            for limitation, found in measured(interpreter):
                lines.append(
                    f"its interpreter's known limitation, measured here ({found}): "
                    f"{', '.join(limitation.dtypes)} failures are named as the interpreter's"
                )
    return lines


#: The property a test's report carries (for a backend with a domain) to name its clause.
CLAUSE_PROPERTY = "domain_clause"
#: The property of a test that ran on a fixture built again inside the domain
#: (``conformance.suite.rebuilt``): [backend, case id, its shape there].
REBUILT_PROPERTY = "domain_rebuilt"
#: The property of a test whose size was drawn inside the domain: [backend, the move].
MOVED_PROPERTY = "domain_moved"
#: The property of a test that handed a quantized backend codes: [backend, [what it
#: handed, in the words of ``conformance.suite.quantized.exercised``]].
EXERCISED_PROPERTY = "quantized_exercised"


class DomainSummary:
    """The run's summary lines on the domain each restricted backend was judged on, the
    clauses left untested because no call of theirs fits it, and the global settings the
    suite changed for the run (JAX's float64). A plugin of its own, beside the suite's."""

    def __init__(self, backends: list[Any]) -> None:
        # Beside the restricted ones: a quantized function of a profile (it hands its
        # declared forms to nothing else), whose summary says which no call exercised, and
        # a plain --impl whose forms came from its signature (``FunctionBackend.assumed``),
        # whose summary says what was assumed.
        self.backends = {
            b.name: b
            for b in backends
            if restricted(b) or getattr(b, "descales", None) or getattr(b, "assumed", ())
        }
        #: backend name -> what the run's quantized calls handed it
        self.exercised: dict[str, set[str]] = {}
        #: JAX functions that declare no float64: their calls run with JAX's default x64.
        self.x64_off = [
            b.name
            for b in backends
            if getattr(b, "framework", None) == "jax"
            and "float64" not in b.dtypes
            and hasattr(b, "arrays")
        ]
        #: backend name -> clause -> [tests run, tests skipped for a form or the domain]
        self.clauses: dict[str, dict[str, list[int]]] = {}
        #: backend name -> the sizes its tests were drawn at instead, "T7-S13 -> T16-S32"
        self.moved: dict[str, set[str]] = {}
        #: backend name -> the fixtures built again inside its domain, "T7-S7-float32"
        self.rebuilt: dict[str, set[str]] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """The sizes tests draw their inputs at (a ``size`` parameter, ``helpers.SIZES``),
        moved into the domain of a backend that declares one: the same T < S, T > S or
        T = S, at lengths it takes. The test, its oracle and its checks all see the moved
        size; the test's id keeps the usual one, and the summary lists the move."""
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            backend = self.backends.get(params.get("backend"))
            size = params.get("size")
            if backend is None or not isinstance(size, dict) or not {"T", "S"} <= set(size):
                continue
            dtype = params.get("dtype")
            domain = domain_of(backend).for_dtype(dtype if isinstance(dtype, str) else "")
            moved = inside(domain, size["T"], size["S"])
            if moved != (size["T"], size["S"]):
                item.callspec.params["size"] = {**size, "T": moved[0], "S": moved[1]}
                text = f"T{size['T']}-S{size['S']} -> T{moved[0]}-S{moved[1]}"
                # On the item's reports too: the run's end may be another process's (xdist).
                item.user_properties.append((MOVED_PROPERTY, json.dumps([backend.name, text])))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        outcome = yield
        rep = outcome.get_result()
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend") not in self.backends or rep.when not in ("setup", "call"):
            return
        marker = item.get_closest_marker("clause")
        if marker is not None:
            rep.user_properties.append(
                (CLAUSE_PROPERTY, json.dumps([params["backend"], marker.args[0]]))
            )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for n, v in report.user_properties:
            if n == REBUILT_PROPERTY and report.when == "call":
                name, case_id, _ = json.loads(v)
                self.rebuilt.setdefault(name, set()).add(case_id)
            elif n == MOVED_PROPERTY:
                name, text = json.loads(v)
                self.moved.setdefault(name, set()).add(text)
            elif n == EXERCISED_PROPERTY:
                name, words = json.loads(v)
                self.exercised.setdefault(name, set()).update(words)
        found = [json.loads(v) for n, v in report.user_properties if n == CLAUSE_PROPERTY]
        if not found or (report.when == "setup" and not report.skipped):
            return
        name, clause = found[0]
        counts = self.clauses.setdefault(name, {}).setdefault(clause, [0, 0])
        if report.skipped and _domain_skip(report):
            counts[1] += 1
        elif report.when == "call":
            counts[0] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        from conformance.backends.arrays import GLOBAL_SETTINGS

        for setting, why in GLOBAL_SETTINGS.items():
            terminalreporter.write_line(f"the suite set {setting} for this run: {why}")
            if setting.startswith("jax_enable_x64") and self.x64_off:
                terminalreporter.write_line(
                    f"  but not for the calls of {', '.join(self.x64_off)} (no float64 "
                    "declared): they run with JAX's default, x64 off"
                )
        for name, judged in self.judged().items():
            terminalreporter.write_line(f"{name} judged on: " + "; ".join(judged["on"]))
            for words in judged["assumed"]:
                terminalreporter.write_line(f"{name}: {words}")
            if judged["moved"]:
                terminalreporter.write_line(
                    f"{name}: sizes drawn inside its domain: {', '.join(judged['moved'])}"
                )
            if judged["rebuilt"]:
                terminalreporter.write_line(
                    f"{name}: fixtures built again inside its domain with the oracle: "
                    + ", ".join(judged["rebuilt"])
                )
            if judged["untested"]:
                terminalreporter.write_line(
                    f"{name}: untested, no call of theirs fits what it takes: SPEC §"
                    + ", §".join(judged["untested"])
                )

    def judged(self) -> dict[str, dict[str, list[str]]]:
        """Per restricted backend (or one whose forms came from its signature), what it was
        judged on: ``on``, its dtypes, forms, shapes and interpreter (``domain_words``);
        ``assumed``, the forms taken from its signature, in words; ``moved``, the sizes
        drawn inside its domain; ``rebuilt``, the fixtures built again there;
        ``untested``, the clauses whose every test was skipped for a form or the domain.
        The summary's lines and the report's."""
        return {
            name: {
                "on": domain_words(backend) + self._unexercised(name, backend),
                "assumed": list(getattr(backend, "assumed", ())),
                "moved": sorted(self.moved.get(name, ())),
                "rebuilt": sorted(self.rebuilt.get(name, ())),
                "untested": sorted(
                    (
                        c
                        for c, (ran, skipped) in self.clauses.get(name, {}).items()
                        if skipped and not ran
                    ),
                    key=_clause_key,
                ),
            }
            for name, backend in self.backends.items()
        }

    def _unexercised(self, name: str, backend: Any) -> list[str]:
        """The line naming what ``backend`` declares and no quantized call handed it (a
        function that quantizes its own inputs is handed no codes: none)."""
        from conformance.suite.quantized import unexercised

        if getattr(backend, "quantized", None) is None or getattr(backend, "quantizes", False):
            return []
        missing = unexercised(backend, self.exercised.get(name, set()))
        return ["declared, handed by no call: " + ", ".join(missing)] if missing else []


def _domain_skip(report: pytest.TestReport) -> bool:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return OUTSIDE in reason or LACKS_FORM in reason


def _clause_key(clause: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in clause.split("."))
