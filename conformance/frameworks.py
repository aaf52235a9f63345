"""Other libraries' own attention functions against the whole spec: every shipped profile
(``conformance/profiles``) run through the suite, the documentation's lists and table made
from that run (the page docs/other-libraries.md), and the profiles' known failures measured
by it.

    python -m conformance frameworks                                # run, report, print the table
    python -m conformance frameworks --page docs/other-libraries.md   # and rewrite the page's part
    python -m conformance frameworks --check docs/other-libraries.md  # fail if the page's is not this
    python -m conformance frameworks --update-profiles              # re-measure the known failures
                                                                    # (then --page, in a run of its own)
    python -m conformance frameworks --profiles gpu --page docs/other-libraries-gpu.md
                                                                    # the device profiles, on a GPU
    python -m conformance frameworks --every-test                   # the whole spec on the profiles
                                                                    # whose [run] tests are fewer

The run is ``python -m conformance report --impl-profile all -m "not pairwise"``: the
report (``--out``) holds every test, the clause × function matrix, the versions and the
agreement tables. First comes, per function, the list of its departures: each distinct
behaviour its failing tests show (``conformance/suite/behaviours.py``), with the clauses and the
number of tests. Then the table, a row per SPEC clause where some function departs from
the spec and a cell per function: ✅ every test of the clause passes, ❌ how many fail and
which of the function's departures they show (by number), — the function does not declare
what the clause needs, or no call of the clause fits its domain (untested, and said so). Behaviours hold no error size, so the page means the same on any
machine with the same versions. ``--page`` (or its older name ``--readme``) replaces only the
text between ``START`` and ``END`` of the file it names; ``--check`` compares the behaviours and the marks (✅ ❌ —).

``--update-profiles`` runs with ``--ignore-known-failures`` and rewrites each profile's
``[known_failures]`` from what failed, each test's reason its behaviour: a test function
whose every run fails with one behaviour gets one ``name[profile-*]`` entry, the others
one entry per test. A profile's ``[processor_dependent]`` tests (they fail on some
processors, pass on others) and ``[varies_between_runs]`` ones (they vary from run to run)
are in no cell and no entry: a line of their own under the function's departures says
which, the same whatever they did here."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from conformance.report.markdown import departure_line
from conformance.suite.behaviours import SUITE_BUG, as_text
from conformance.suite.clauses import clause_key, clause_titles
from conformance.suite.domain import OUTSIDE
from conformance.suite.known_failures import (
    FROM_RUN_TO_RUN,
    NOT_IN_DEFAULT_RUN,
    ON_SOME_PROCESSORS,
    pattern,
)

START = "<!-- frameworks-table:start -->"
END = "<!-- frameworks-table:end -->"
#: The lines under a function's departures for what fails on some processors only and
#: for what fails in some runs only; their profile tables, (line, the tests' reason).
VARIES = "On some processors only (not in the table): "
BY_RUN = "From run to run (not in the table): "
VARYING = {
    "processor_dependent": (VARIES, ON_SOME_PROCESSORS),
    "varies_between_runs": (BY_RUN, FROM_RUN_TO_RUN),
}
PASS, FAIL, NONE = "✅", "❌", "—"


def run(
    out: Path, workers: str, remeasure: bool, extra: list[str], profiles: str = "all"
) -> tuple[int, dict]:
    """The suite on every shipped profile (``profiles``: "all", or "gpu", the device
    profiles), through the report: (exit code, report data)."""
    from conformance.report import command as report

    chosen = "all-gpu" if profiles == "gpu" else "all"
    argv = ["--impl-profile", chosen, "--out", str(out), "--workers", workers]
    argv += ["-m", "not pairwise", "--timeout", "120", *extra]
    if remeasure:
        argv.append("--ignore-known-failures")
    code = report.main(argv)
    return code, json.loads((out / "report.json").read_text())


def matrix(data: dict) -> dict:
    """{"functions": {name: heading}, "clauses": {clause: {name: (mark, words)}},
    "departures": {name: [entry]}, "elsewhere": {name: why}}: a profile that needs hardware
    this machine lacks is no column (it would be all skips), but a line saying why it did
    not run. A cell's words are the numbers of the function's departures (its list in
    "departures", ``report_outcomes.departures``) that the clause's failures show."""
    from conformance.adapters.profiles import read_profile, shipped_profiles
    from conformance.report.outcomes import departures

    functions, elsewhere = {}, {}
    for name in shipped_profiles():
        profile = read_profile(name)
        why = profile.unavailable() if profile.needs else None
        if why:
            elsewhere[name] = why  # hardware this machine lacks
            continue
        library = profile.requires[0] if profile.requires else profile.framework
        version = data["versions"].get(library)
        functions[name] = f"`{name}` ({library} {version})" if version else f"`{name}`"
    rows = [r for r in data["tests"] if r["backend"] in functions]
    # A processor-dependent or run-to-run test fails here and passes there: it is listed
    # on its own, from the profile, so that the table reads the same in every run.
    varies = [r for r in rows if _varies(r)]
    rows = [r for r in rows if not _varies(r)]
    found = departures(rows)
    tests: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["clause"]:
            tests[row["clause"]][row["backend"]].append(row)
    clauses = {}
    for clause, by_function in tests.items():
        clauses[clause] = {
            name: _cell(by_function.get(name, []), found.get(name, [])) for name in functions
        }
    return {
        "functions": functions,
        "clauses": clauses,
        "departures": {name: found.get(name, []) for name in functions},
        **{
            key: {name: _varying(varies, name, prefix) for name in functions}
            for key, (_, prefix) in VARYING.items()
        },
        "elsewhere": elsewhere,
    }


def _varies(row: dict) -> bool:
    return row["reason"].startswith((ON_SOME_PROCESSORS, FROM_RUN_TO_RUN))


def _varying(rows: list[dict], name: str, prefix: str) -> list[dict]:
    """``name``'s tests whose reason starts with ``prefix`` (``VARYING``), one entry per
    behaviour: its clauses and how many tests (whether they failed or passed here)."""
    by_reason: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["backend"] == name and row["outcome"] != "skipped":
            if row["reason"].startswith(prefix):
                by_reason[row["reason"].removeprefix(prefix)].append(row)
    return [
        {
            "behaviour": reason,
            "clauses": sorted({r["clause"] for r in members if r["clause"]}, key=clause_key),
            "tests": len(members),
        }
        for reason, members in sorted(by_reason.items())
    ]


def _cell(rows: list[dict], listed: list[dict]) -> tuple[str, str]:
    ran = [r for r in rows if r["outcome"] != "skipped"]
    if not ran:
        if any(OUTSIDE in r["reason"] for r in rows):
            return NONE, "untested: no call of it fits the domain"
        if any(r["reason"].startswith(NOT_IN_DEFAULT_RUN) for r in rows):
            return NONE, "not in its default run"
        return NONE, "not declared" if rows else "not run"
    bad = [r for r in ran if r["outcome"] in ("failed", "xfailed")]
    if not bad:
        return PASS, ""
    numbers = {text: i for i, e in enumerate(listed, start=1) for text in e["covers"]}
    seen = Counter(numbers.get(r.get("behaviour") or r["reason"], 0) for r in bad)
    refs = ", ".join(f"#{n}" for n in sorted(seen) if n)
    return FAIL, f"{len(bad)}/{len(ran)}" + (f" ({refs})" if refs else "")


def table(found: dict) -> str:
    """Each function's departures, numbered, then the Markdown table: a row per clause
    where some function departs from the spec, its cells naming the departures by number."""
    titles = clause_titles()
    names = list(found["functions"])
    lines = []
    for name in names:
        entries = found.get("departures", {}).get(name, [])
        lines.append(
            f"{found['functions'][name]}: "
            + (f"{len(entries)} departures" if entries else "conforms")
        )
        lines.append("")
        lines += [f"{i}. {departure_line(e)}" for i, e in enumerate(entries, start=1)]
        if entries:
            lines.append("")
        for key, (label, _) in VARYING.items():
            for entry in found.get(key, {}).get(name, []):
                clauses = ", ".join(f"§{c}" for c in entry["clauses"])
                lines += [f"{label}{_said(entry, label)}: {clauses} ({entry['tests']} tests)", ""]
    lines += [
        "| clause | " + " | ".join(found["functions"][n] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    conforming = []
    for clause in sorted(found["clauses"], key=clause_key):
        cells = found["clauses"][clause]
        if all(cells[n][0] != FAIL for n in names):
            conforming.append(clause)
            continue
        row = [f"{mark} {words}".strip() for mark, words in (cells[n] for n in names)]
        title = titles.get(clause, "")
        lines.append(
            f"| §{clause} {title} | " + " | ".join(r.replace("|", "\\|") for r in row) + " |"
        )
    lines.append("")
    lines.append(
        "No function departs from "
        + ", ".join(f"§{c}" for c in conforming)
        + f" ({NONE} where it does not declare what the clause needs, or where no call of "
        "the clause fits the shapes it takes: untested, not passed)."
    )
    for name, why in found.get("elsewhere", {}).items():
        lines.append("")
        lines.append(f"Not run here: `{name}`, {why}")
    return "\n".join(lines) + "\n"


def _said(entry: dict, label: str) -> str:
    cause, _, shown = entry["behaviour"].partition("; ")  # a run-to-run one: cause; seen
    return f"{cause} (seen: {shown})" if label == BY_RUN and shown else entry["behaviour"]


def block(found: dict) -> str:
    """What goes between the page's markers: the lists, the table and the command."""
    return (
        f"{START}\n"
        f"{table(found)}\n"
        "Measured on the versions in the headings (CPU) by `python -m conformance frameworks "
        "--page docs/other-libraries.md`, which runs the whole spec on each shipped profile "
        "(`--impl-profile all`) and writes these lists and this table; each line is one "
        "behaviour, with the clauses it breaks and the tests that show it, and each ❌ cell "
        "names the behaviours its failures show. The run's report has every test, message "
        "and replay.\n"
        f"{END}"
    )


def departure_lines(text: str) -> set[tuple[str, str]]:
    """The (function, behaviour) pairs the lists in ``text`` give, for ``--check``."""
    if START in text:
        text = text.split(START, 1)[1].split(END, 1)[0]
    found, function = set(), None
    for line in text.splitlines():
        heading = re.match(r"^`([^`]+)`.*: (\d+ departures|conforms)$", line)
        if heading:
            function = heading.group(1)
            continue
        item = re.match(r"^\d+\. (.*): §", line)
        if item and function:
            found.add((function, item.group(1)))
        for label, prefix in VARYING.values():
            varies = re.match(rf"^{re.escape(label)}(.*): §", line)
            if varies and function:
                found.add((function, prefix + varies.group(1)))
    return found


def marks(text: str) -> dict[tuple[str, str], str]:
    """The marks (✅ ❌ —) of the table in ``text``, keyed by (clause, column heading's
    function name); the versions and the words do not count."""
    if START in text:
        text = text.split(START, 1)[1].split(END, 1)[0]
    rows = [_split_row(line) for line in text.splitlines() if line.startswith("|")]
    if len(rows) < 2:
        return {}
    heads = [re.sub(r"`([^`]*)`.*", r"\1", h.strip()) for h in rows[0][1:]]
    found = {}
    for row in rows[2:]:
        clause = row[0].split()[0]
        for head, cell in zip(heads, row[1:]):
            found[clause, head] = cell.strip()[:1]
    return found


def _split_row(line: str) -> list[str]:
    """A Markdown table row's cells, honouring ``\\|`` inside a cell."""
    parts, cell, escaped = [], "", False
    for ch in line.strip()[1:-1]:
        if ch == "|" and not escaped:
            parts.append(cell)
            cell = ""
        else:
            cell += ch
        escaped = ch == "\\"
    return [*parts, cell]


def rewrite_page(path: Path, found: dict) -> bool:
    """Replace the table between the markers in ``path``; whether anything changed."""
    text = path.read_text(encoding="utf-8")
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"{path}: expected one {START} and one {END}")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    new = before + block(found) + after
    path.write_text(new, encoding="utf-8")
    return new != text


def known_failures(data: dict, profile: str, varies: Iterable[str] = ()) -> dict[str, str]:
    """What failed on ``profile`` in a run without known failures, as profile entries:
    {test id: the behaviour it shows}. A test function whose every run fails with one
    behaviour is one ``name[profile-*]`` entry. Tests the patterns ``varies`` match (the
    profile's ``VARYING`` entries, kept by hand) are left out."""
    apart = [pattern(text) for text in varies]
    runs: dict[str, list[dict]] = defaultdict(list)
    for row in data["tests"]:
        if row["backend"] == profile and row["outcome"] != "skipped":
            name = row["test"].rpartition("::")[2]
            if any(regex.match(name) for regex in apart):
                continue
            runs[name.partition("[")[0]].append({**row, "name": name})
    entries = {}
    for function, rows in sorted(runs.items()):
        bad = [r for r in rows if r["outcome"] == "failed"]
        if not bad:
            continue
        suite_bugs = [r["name"] for r in bad if _reason(r) == SUITE_BUG]
        if suite_bugs:
            raise SystemExit(
                f"not recorded as {profile}'s known failures: {SUITE_BUG}: {suite_bugs}"
            )
        said = {_reason(r) for r in bad}
        if len(bad) == len(rows) > 1 and len(said) == 1:
            entries[f"{function}[{profile}-*]"] = said.pop()
            continue
        for row in bad:
            entries[row["name"]] = _reason(row)
    return entries


def _reason(row: dict) -> str:
    return as_text(row.get("behaviour") or row["reason"] or row["message"])


def stale_reasons(data: dict) -> list[str]:
    """Known failures that still fail, but with another behaviour than the one listed."""
    stale = []
    for row in data["tests"]:
        if row["outcome"] == "xfailed" and row.get("behaviour"):
            listed = row["reason"].removeprefix("known failure: ")
            listed = listed.removeprefix(ON_SOME_PROCESSORS).removeprefix(FROM_RUN_TO_RUN)
            if row["behaviour"] not in listed.split("; "):
                stale.append(f"{row['test']}: listed {listed!r}, shows {row['behaviour']!r}")
    return stale


def write_known_failures(path: Path, entries: dict[str, str]) -> None:
    """Replace the ``[known_failures]`` table, the profile's last, with ``entries``."""
    text = path.read_text(encoding="utf-8")
    head = text.split("\n[known_failures]\n", 1)[0]
    body = "".join(
        f"{json.dumps(test)} = {json.dumps(reason)}\n" for test, reason in entries.items()
    )
    path.write_text(f"{head}\n[known_failures]\n{body}", encoding="utf-8")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance frameworks",
        description=__doc__.splitlines()[0],
        epilog="Any other options are passed to pytest.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("frameworks-report"), help="report here")
    parser.add_argument("--workers", default="auto", help="test processes, as for the report")
    parser.add_argument(
        "--page",
        "--readme",
        dest="page",
        type=Path,
        help=f"rewrite the table between {START} and {END} of this file",
    )
    parser.add_argument("--check", type=Path, help="fail if this file's table has other marks")
    parser.add_argument(
        "--profiles",
        choices=["all", "gpu"],
        default="all",
        help="which shipped profiles: all (the CPU's table, docs/other-libraries.md) or gpu "
        "(the device profiles, docs/other-libraries-gpu.md, SPEC §13.20)",
    )
    parser.add_argument(
        "--update-profiles",
        action="store_true",
        help="run without the profiles' known failures and rewrite them from what fails",
    )
    args, extra = parser.parse_known_args(argv)
    if args.update_profiles and (args.page or args.check):
        # That run ignores the known failures: its counts would include them and its
        # processor-dependent tests would show as ordinary failures, not the page's lines.
        parser.error(
            "--update-profiles ignores the known failures, so its table is not the page's: "
            "rewrite or check the page in a run of its own afterwards "
            "(--page docs/other-libraries.md)"
        )
    code, data = run(args.out, args.workers, args.update_profiles, extra, args.profiles)
    found = matrix(data)
    (args.out / "frameworks.json").write_text(json.dumps(found, indent=1, ensure_ascii=False))
    (args.out / "frameworks.md").write_text(block(found), encoding="utf-8")
    print(table(found), end="")
    if args.update_profiles:
        from conformance.adapters.profiles import read_profile

        for name in found["functions"]:
            if any(r["backend"] == name and r["outcome"] != "skipped" for r in data["tests"]):
                profile = read_profile(name)
                kept = {**profile.processor_dependent, **profile.varies_between_runs}
                entries = known_failures(data, name, kept)
                write_known_failures(profile.path, entries)
                print(f"rewrote the known failures of {profile.path}")
        # Without its known failures the run fails by design; what counts is what it wrote.
        code = 0
    if args.page:
        changed = rewrite_page(args.page, found)
        print(f"{'rewrote' if changed else 'unchanged:'} the table in {args.page}")
    if args.check:
        return check(args.check, found, data) or code
    return code


def check(path: Path, found: dict, data: dict) -> int:
    """1, with what differs, when ``path``'s lists and table are not what this run measured
    (the behaviours, and the marks ✅ ❌ —), or a known failure now shows another behaviour
    than its listed reason; else 0."""
    text = path.read_text(encoding="utf-8")
    problems = []
    committed, fresh = marks(text), marks(block(found))
    differ = {k: (committed.get(k), fresh.get(k)) for k in committed.keys() | fresh.keys()}
    differ = {k: v for k, v in differ.items() if v[0] != v[1]}
    if differ:
        problems.append(f"marks ((clause, function): (committed, measured)): {differ}")
    listed, measured = departure_lines(text), departure_lines(block(found))
    if listed != measured:
        problems.append(
            f"behaviours listed but not measured: {sorted(listed - measured)}; measured but "
            f"not listed: {sorted(measured - listed)}"
        )
    stale = stale_reasons(data)
    if stale:
        problems.append(
            f"known failures whose behaviour changed (rerun --update-profiles): {stale[:10]}"
        )
    for problem in problems:
        print(
            f"{path}: not what this run measured: {problem}; rerun python -m conformance "
            f"frameworks --page {path}",
            file=sys.stderr,
        )
    return 1 if problems else 0
