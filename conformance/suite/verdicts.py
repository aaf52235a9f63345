"""A conformance run that reads like the report (SPEC §13.18): short failures that say
their finding first and how to rerun them, and at the end one line per behaviour and a
verdict per backend and layer (math, edges, contract).

Where a test runs, ``label`` says what it ran on (its backend, clause, layer) and the
command that reruns it, as a user property of its report, so that the lines survive
pytest-xdist's trip from worker to controller (a run isolated for crashes, SPEC §13.13).
Where the reports arrive, ``Summary`` gathers them and prints the lines after everything
else pytest and the other plugins print at the end of a run (its ``pytest_terminal_summary``
is the outermost wrapper), before pytest's own last line of counts.
"""

from __future__ import annotations

import json
import linecache
import re
import shlex
from collections import defaultdict
from pathlib import Path

import pytest

from conformance.adapters.interpreters import limitation_named
from conformance.suite import behaviours, diagnosis
from conformance.suite.clauses import LAYERS, clause_key, clause_titles, layer_of
from conformance.suite.options import IMPL_FLAGS

#: The user property that labels a conformance test's report (JSON): {"backend",
#: "clause", "layer", "rerun"}.
LABEL = "conformance-test"
#: The most lines a failure prints with pytest's default traceback style.
MAX_FAILURE_LINES = 15
#: The behaviours (SPEC §13.15) that are an edge's whatever the clause of the test that
#: shows them: a row with no key to attend, a NaN the output lost. A fixture of §3.7 with
#: a fully masked row shows the first; it counts in the edges layer, so that "math:
#: conforms" says what it means.
EDGE_CAUSES = re.compile(
    r"^(a query with no key to attend|a gradient that nothing attended|"
    r"a NaN in the inputs becomes a number)"
)


def layer_of_failure(clause: str | None, behaviour: str) -> str | None:
    """The layer a failure counts in: its clause's, but for a behaviour that is an edge's
    (``EDGE_CAUSES``) or a refusal of bad input (``behaviours.FAMILIES``: "raises
    RuntimeError, not ValueError, for ...", "accepts ... (no error)"), which count in the
    edges and the contract layer whatever test shows them (a bad ``cu_seqlens`` is a
    test of §18.1)."""
    if EDGE_CAUSES.match(behaviour):
        return "edges"
    if any(pattern.match(behaviour) for pattern, _ in behaviours.FAMILIES):
        return "contract"
    return layer_of(clause)


#: The plugin's options a rerun repeats, as ``config.getoption`` names them.
RERUN_OPTIONS = (
    "--backend",
    "--impl",
    *IMPL_FLAGS,
    "--impl-profile",
    "--known-failures",
)


def rerun_target(module: str, nodeid: str) -> str:
    """``conformance.tests.test_x::test_y[id]``: the test by its module's import name,
    which ``pytest --pyargs`` finds wherever the suite is installed, unlike a node id,
    which embeds the path pytest collected it from (a venv's site-packages, say)."""
    return f"{module}::{nodeid.split('::', 1)[1]}" if "::" in nodeid else module


def module_of(nodeid: str) -> str:
    """The import name of the suite's test module a node id names
    (``.../conformance/tests/test_edges.py::...`` is ``conformance.tests.test_edges``)."""
    return "conformance.tests." + Path(nodeid.split("::", 1)[0]).stem


def rerun_command(config: pytest.Config, target: str) -> str:
    """The command that reruns the test ``target`` (``rerun_target``) from the directory
    the run started in, with the run's own plugin options."""
    words = ["pytest", "--pyargs", target]
    for option in RERUN_OPTIONS:
        value = config.getoption(option, None)
        for one in value if isinstance(value, list) else [value]:
            if one is not None:
                words += [option, str(one)]
    if config.getoption("--ignore-known-failures", False):
        words.append("--ignore-known-failures")
    profile = config.getoption("hypothesis_profile", None)
    if profile:
        words += ["--hypothesis-profile", profile]
    return shlex.join(words)


def label(item: pytest.Item, rerun: bool = True) -> dict:
    """What ``item`` runs on: its backend ("a~b" for a pair), first clause, layer, and the
    command that reruns it (unless ``rerun`` is False: a test that passed or was skipped
    needs none, and an isolated run carries every report back)."""
    marker = item.get_closest_marker("clause")
    clause = marker.args[0] if marker else None
    params = getattr(item, "callspec", None)
    backend = params.params.get("backend") if params else None
    pair = params.params.get("backend_pair") if params else None
    if isinstance(pair, (tuple, list)):
        backend = "~".join(pair)
    backend = getattr(backend, "name", backend)
    module = getattr(getattr(item, "module", None), "__name__", None) or module_of(item.nodeid)
    return {
        "backend": backend if isinstance(backend, str) else None,
        "clause": clause,
        "layer": layer_of(clause),
        "rerun": rerun_command(item.config, rerun_target(module, item.nodeid)) if rerun else "",
    }


def label_of(report) -> dict | None:
    for name, value in getattr(report, "user_properties", ()):
        if name == LABEL:
            return json.loads(value)
    return None


def short_failure(
    item: pytest.Item, excinfo, found: str, calls: list[str], path: str, rerun: str
) -> str:
    """A failure in at most ``MAX_FAILURE_LINES`` lines with pytest's header: its finding
    (the behaviour), the exception's message, the test's own line (and the function's,
    where the function raised), the calls it made (``calls``, the last one also as the
    function received it), how to replay them from ``path``, and ``rerun:``. The suite's
    own frames are left out."""
    marker = item.get_closest_marker("clause")
    clause = marker.args[0] if marker else None
    layer = layer_of_failure(clause, found)
    where = f" (§{clause} {clause_titles().get(clause, '')}; layer {layer})"
    lines = [f"finding: {found}" + (where if clause else "")]
    if excinfo is not None:
        message = str(excinfo.value).strip().splitlines() or [""]
        notes = [str(n) for n in getattr(excinfo.value, "__notes__", ())]
        lines.append(_cut(f"{excinfo.typename}: {message[0]}"))
        lines += [_cut("  " + m) for m in [*message[1:3], *notes[:2]]]
        lines += _frames(excinfo)
    replay = [_cut(line, 400) for line in calls]
    if path:
        replay.append(
            f"replay: backend, method, args, kwargs = load_call({path!r})  "
            "# from conformance.suite.replay import load_call; "
            "then getattr(backend, method)(*args, **kwargs)"
        )
    budget = MAX_FAILURE_LINES - 2 - len(lines) - 1  # pytest's header and xdist's line
    if len(replay) > budget:
        replay = replay[-budget:] if budget > 0 else []
    return "\n".join([*lines, *replay, f"rerun: {rerun}"])


def _cut(line: str, width: int = 240) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


_OURS = re.compile(r"[/\\]conformance[/\\](?!tests[/\\])")


def _frames(excinfo) -> list[str]:
    """The test's own line, and where the error came from the function under test, the
    first frame of the function's (the first outside the suite after the suite's last)."""
    entries = list(excinfo.traceback)
    shown = []
    tests = [e for e in entries if re.search(r"[/\\]conformance[/\\]tests[/\\]", str(e.path))]
    if tests:
        shown.append(tests[-1])
    ours = [i for i, e in enumerate(entries) if _OURS.search(str(e.path))]
    if (
        ours
        and ours[-1] + 1 < len(entries)
        and getattr(excinfo.value, "_conformance_raised_by", None)
    ):
        shown.append(entries[ours[-1] + 1])
    lines = []
    for entry in shown:
        source = linecache.getline(str(entry.path), entry.lineno + 1).strip()
        # The suite's test by its place in the package (wherever that is installed);
        # the function's by its full path.
        path = re.sub(r"^.*[/\\](conformance[/\\]tests[/\\])", r"\1", str(entry.path))
        lines.append(_cut(f"  at {path}:{entry.lineno + 1}: {source}"))
    return lines


class Summary:
    """Gathers the conformance tests' reports where they arrive; at the end of the run,
    prints one line per behaviour and then the verdict per backend and layer."""

    def __init__(self, config: pytest.Config, backends: list[str], layers: list[str]) -> None:
        self.config = config
        self.backends = backends
        self.layers = layers
        self.rows: list[dict] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        found = label_of(report)
        if found is None:
            return
        if report.when != "call" and not (report.failed or report.skipped):
            return
        if hasattr(report, "wasxfail"):
            outcome = "passed" if report.passed else "xfailed"
        else:
            outcome = report.outcome
        properties = dict(report.user_properties)
        behaviour = properties.get(behaviours.PROPERTY, "")
        self.rows.append(
            {
                **found,
                "test": report.nodeid,
                "outcome": outcome,
                "behaviour": behaviour,
                "misreadings": json.loads(properties.get(behaviours.MISREADINGS, "[]")),
            }
        )

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter):
        result = yield
        rows = named_by_run(self.rows)
        for row in _departing(rows):
            row["layer"] = layer_of_failure(row["clause"], row["behaviour"])
        lines = behaviour_lines(rows) + verdict_lines(rows, self.backends, self.layers)
        maxfail = self.config.getoption("maxfail", 0)
        failed = sum(r["outcome"] == "failed" for r in self.rows)
        if lines and maxfail and failed >= maxfail:
            lines.insert(
                len(lines) - sum(x.startswith("verdict ") for x in lines),
                f"(the run stopped after {failed} failures: the verdicts cover the tests that ran)",
            )
        if lines:
            terminalreporter.section("conformance", sep="=")
            for line in lines:
                terminalreporter.line(line)
        return result


def named_by_run(rows: list[dict]) -> list[dict]:
    """The rows with each departure named as the run as a whole names it (SPEC §13.16):
    per backend, by the misreading that explains the most of its departures
    (``diagnosis.explaining_causes``), so that a cause two readings share on one case is
    named by the one that explains every failure of the run."""
    rows = [dict(row) for row in rows]
    by_backend = defaultdict(list)
    for row in _departing(rows):
        by_backend[row["backend"]].append(row)
    for members in by_backend.values():
        named = diagnosis.explaining_causes(
            [(row["behaviour"], row.get("misreadings") or []) for row in members]
        )
        for row, behaviour in zip(members, named):
            row["behaviour"] = behaviour
    return rows


def _departing(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["outcome"] in ("failed", "xfailed")]


def _clauses(rows: list[dict]) -> list[str]:
    return sorted({r["clause"] for r in rows if r["clause"]}, key=clause_key)


def _sections(clauses: list[str]) -> str:
    return ", ".join(f"§{c}" for c in clauses)


def grouped(rows: list[dict]) -> list[dict]:
    """The departing rows by backend and behaviour (a family's behaviours as one):
    [{"backend", "behaviour", "rows"}], the behaviour touching most tests first."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in _departing(rows):
        text = row["behaviour"] or "fails"
        groups[(row["backend"], behaviours.family(text)[0])].append(row)
    result = []
    for (backend, line), members in groups.items():
        details = sorted({behaviours.family(r["behaviour"] or "")[1] for r in members} - {""})
        result.append(
            {
                "backend": backend,
                "behaviour": f"{line} {'; '.join(details)}" if details else line,
                "rows": sorted(members, key=lambda r: r["test"]),
            }
        )
    return sorted(result, key=lambda g: (str(g["backend"]), -len(g["rows"]), g["behaviour"]))


def behaviour_lines(rows: list[dict]) -> list[str]:
    """One line per behaviour: how many tests show it (known failures among them), its
    clauses, the behaviour, and the command that reruns its first test."""
    lines = []
    for group in grouped(rows):
        members = group["rows"]
        known = sum(r["outcome"] == "xfailed" for r in members)
        count = f"{len(members)} test{'s' if len(members) != 1 else ''}"
        count += f" ({known} known)" if known else ""
        who = f"{group['backend']}: " if group["backend"] else ""
        lines.append(
            f"{count} · {_sections(_clauses(members))} · {who}{_cut(group['behaviour'], 160)}"
            f" · rerun: {members[0]['rerun']}"
        )
    return lines


def _what(groups: list[dict]) -> str:
    """The departures of one layer in a few words: the behaviour where there is one, the
    refusals' types side by side where every behaviour is one ("RuntimeError where
    ValueError"), else how many behaviours."""
    texts = [r["behaviour"] or "" for g in groups for r in g["rows"]]
    swaps = [re.match(r"^raises (\w+), not (\w+), for ", text) for text in texts]
    if all(swaps):
        return "; ".join(dict.fromkeys(f"{s[1]} where {s[2]}" for s in swaps))
    if len(groups) == 1:
        kinds = len({behaviours.family(text)[1] for text in texts} - {""})
        if kinds > 1:
            return f"{groups[0]['behaviour'].split(',')[0]} {kinds} kinds of bad input"
        return _cut(groups[0]["behaviour"], 100)
    return f"{len(groups)} behaviours"


def layer_verdict(rows: list[dict], layer: str, selected: list[str]) -> str:
    """The verdict of one layer over ``rows`` (one backend's): conforms, departs on, or
    not run; the failures a known limitation of its interpreter explains are no departure
    of the kernel's, and are counted apart: "conforms (12 tests), except 3 tests its
    interpreter cannot run right: tl.dot on bfloat16, triton 3.9.0" ("not judged (...)"
    where every test that ran is one)."""
    mine = [r for r in rows if r["layer"] == layer]
    ran = [r for r in mine if r["outcome"] in ("passed", "failed", "xfailed")]
    if not ran:
        if selected and layer not in selected:
            return f"{layer}: not run (--layer {','.join(selected)})"
        return f"{layer}: not run (every test skipped)" if mine else f"{layer}: not run"
    spoiled = _spoiled(ran)
    judged = [r for r in ran if all(r is not s for s in spoiled)]
    departing = _departing(judged)
    if not judged:
        verdict = "not judged"
    elif not departing:
        verdict = f"conforms ({_tests(len(judged))})"
    else:
        verdict = f"departs on {_sections(_clauses(departing))} ({_what(grouped(departing))})"
    if spoiled:
        verdict += ", except " if judged else " ("
        verdict += f"{_tests(len(spoiled))} its interpreter cannot run right: "
        verdict += "; ".join(dict.fromkeys(limitation_named(r["behaviour"]) for r in spoiled))
        verdict += "" if judged else ")"
    return f"{layer}: {verdict}"


def _tests(count: int) -> str:
    return f"{count} test{'s' if count != 1 else ''}"


def _spoiled(rows: list[dict]) -> list[dict]:
    """The departing rows whose behaviour names a known limitation of the interpreter the
    function runs under (SPEC §13.19): the interpreter's, so no verdict on the kernel."""
    return [r for r in _departing(rows) if limitation_named(r["behaviour"] or "")]


def verdict_lines(rows: list[dict], backends: list[str], selected: list[str]) -> list[str]:
    """One verdict line per backend (and per pair that a pairwise test found apart), its
    layers in SPEC §13.18's order."""
    names = [b for b in backends if any(r["backend"] == b for r in rows)]
    pairs = sorted({r["backend"] for r in _departing(rows) if r["backend"] and "~" in r["backend"]})
    lines = []
    for name in names + pairs:
        mine = [r for r in rows if r["backend"] == name]
        verdicts = " · ".join(layer_verdict(mine, layer, selected) for layer in LAYERS)
        lines.append(f"verdict {name} — {verdicts}")
    return lines
