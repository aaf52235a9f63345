"""Other libraries' own attention functions against the whole spec: every shipped profile
(``conformance/profiles``) run through the suite, the README's table made from that run,
and the profiles' known failures measured by it.

    python -m conformance frameworks                          # run, report, print the table
    python -m conformance frameworks --readme README.md       # and rewrite the README's table
    python -m conformance frameworks --check README.md        # fail if the README's is not this
    python -m conformance frameworks --update-profiles        # re-measure the known failures

The run is ``python -m conformance report --impl-profile all -m "not pairwise"``: the
report (``--out``) holds every test, the clause × function matrix, the versions and the
agreement tables. The table has a row per SPEC clause where some function departs from the
spec, and a cell per function: ✅ every test of the clause passes, ❌ how many fail and how
(words, never an error size, so a cell means the same on any machine with the same
versions), — the function does not declare what the clause needs. ``--readme`` replaces only
the text between ``START`` and ``END``; ``--check`` compares the marks (✅ ❌ —) only.

``--update-profiles`` runs with ``--ignore-known-failures`` and rewrites each profile's
``[known_failures]`` from what failed: a test function whose every run fails gets one
``name[profile-*]`` entry, the others one entry per test, each with the clause and the
test's message.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

START = "<!-- frameworks-table:start -->"
END = "<!-- frameworks-table:end -->"
PASS, FAIL, NONE = "✅", "❌", "—"

#: A failure message, in words: the first pattern that matches names it.
KINDS = [
    (r"DID NOT RAISE", "accepts it (no error)"),
    (r"raised (\w+), expected", r"raises \1"),
    (r"Regex pattern did not match", "error message without the argument"),
    (r"Timeout", "hangs"),
    (r"Hypothesis found", "fails on drawn problems"),
    # An exception from the library itself (the test's own verdicts are AssertionError).
    (r"^(?:[\w.]+\.)?((?!AssertionError|Failed)[A-Z]\w*):", r"raises \1"),
    (r"NaN disappeared|becomes a number", "a NaN becomes a number"),
    (r"exactly 0|should be 0|must be 0", "not zero where nothing is attended"),
    (r"non-finite|NaN|nan", "NaN or inf where the spec has a number"),
    (r"not bit-for-bit identical", "changes bits it must not"),
    (r"dtype \S+, expected", "returns another dtype"),
    (r"shape \S+, expected", "returns another shape"),
    (r"max abs error|tolerance|within|oracle", "outside the tolerance"),
]


def describe(message: str) -> str:
    """A failure message as a few words (see ``KINDS``); no numbers, so it is stable."""
    for pattern, words in KINDS:
        found = re.search(pattern, message)
        if found:
            return found.expand(words)
    return "fails"


def run(out: Path, workers: str, remeasure: bool, extra: list[str]) -> tuple[int, dict]:
    """The suite on every shipped profile, through the report: (exit code, report data)."""
    from conformance import report

    argv = ["--impl-profile", "all", "--out", str(out), "--workers", workers]
    argv += ["-m", "not pairwise", "--timeout", "120", *extra]
    if remeasure:
        argv.append("--ignore-known-failures")
    code = report.main(argv)
    return code, json.loads((out / "report.json").read_text())


def matrix(data: dict) -> dict:
    """{"functions": {name: heading}, "clauses": {clause: {name: (mark, words)}},
    "elsewhere": {name: why}}: a profile that needs hardware this machine lacks is no
    column (it would be all skips), but a line saying why it did not run."""
    from conformance.profiles import read_profile, shipped_profiles

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
    tests: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in data["tests"]:
        if row["backend"] in functions and row["clause"]:
            tests[row["clause"]][row["backend"]].append(row)
    clauses = {}
    for clause, by_function in tests.items():
        clauses[clause] = {name: _cell(by_function.get(name, [])) for name in functions}
    return {"functions": functions, "clauses": clauses, "elsewhere": elsewhere}


def _cell(rows: list[dict]) -> tuple[str, str]:
    ran = [r for r in rows if r["outcome"] != "skipped"]
    if not ran:
        return NONE, "not declared" if rows else "not run"
    bad = [r for r in ran if r["outcome"] in ("failed", "xfailed")]
    if not bad:
        return PASS, ""
    kinds = Counter(describe(r["message"] or r["reason"]) for r in bad)
    # The two commonest kinds; ties in name order, so that test order cannot reorder them.
    common = sorted(kinds.items(), key=lambda item: (-item[1], item[0]))[:2]
    words = "; ".join(kind for kind, _ in common)
    return FAIL, f"{len(bad)}/{len(ran)}: {words}"


def table(found: dict) -> str:
    """The Markdown table: a row per clause where some function departs from the spec."""
    from conformance.report_markdown import clause_titles
    from conformance.report_outcomes import clause_key

    titles = clause_titles()
    names = list(found["functions"])
    lines = [
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
        + f" ({NONE} where it does not declare what the clause needs)."
    )
    for name, why in found.get("elsewhere", {}).items():
        lines.append("")
        lines.append(f"Not run here: `{name}`, {why}")
    return "\n".join(lines) + "\n"


def block(found: dict) -> str:
    """What goes between the README's markers: the table and the command that made it."""
    return (
        f"{START}\n"
        f"{table(found)}\n"
        "Measured on the versions in the header (CPU) by `python -m conformance frameworks "
        "--readme README.md`, which runs the whole spec on each shipped profile "
        "(`--impl-profile all`) and writes this table; its report has every test, message "
        "and replay.\n"
        f"{END}"
    )


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


def rewrite_readme(path: Path, found: dict) -> bool:
    """Replace the table between the markers in ``path``; whether anything changed."""
    text = path.read_text(encoding="utf-8")
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"{path}: expected one {START} and one {END}")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    new = before + block(found) + after
    path.write_text(new, encoding="utf-8")
    return new != text


def known_failures(data: dict, profile: str) -> dict[str, str]:
    """What failed on ``profile`` in a run without known failures, as profile entries."""
    from conformance.report_markdown import clause_titles

    titles = clause_titles()
    runs: dict[str, list[dict]] = defaultdict(list)
    for row in data["tests"]:
        if row["backend"] == profile and row["outcome"] != "skipped":
            name = row["test"].rpartition("::")[2]
            runs[name.partition("[")[0]].append({**row, "name": name})
    entries = {}
    for function, rows in sorted(runs.items()):
        bad = [r for r in rows if r["outcome"] == "failed"]
        if not bad:
            continue
        if len(bad) == len(rows) > 1:
            first = bad[0]
            entries[f"{function}[{profile}-*]"] = (
                _reason(first, titles) + f" (and {len(bad) - 1} more like it)"
            )
            continue
        for row in bad:
            entries[row["name"]] = _reason(row, titles)
    return entries


def _reason(row: dict, titles: dict[str, str]) -> str:
    message = " ".join((row["message"] or row["reason"]).split())[:240]
    return f"SPEC §{row['clause']} {titles.get(row['clause'], '')}: {message}"


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
    parser.add_argument("--readme", type=Path, help=f"rewrite the table between {START} and {END}")
    parser.add_argument("--check", type=Path, help="fail if this file's table has other marks")
    parser.add_argument(
        "--update-profiles",
        action="store_true",
        help="run without the profiles' known failures and rewrite them from what fails",
    )
    args, extra = parser.parse_known_args(argv)
    code, data = run(args.out, args.workers, args.update_profiles, extra)
    found = matrix(data)
    (args.out / "frameworks.json").write_text(json.dumps(found, indent=1, ensure_ascii=False))
    (args.out / "frameworks.md").write_text(block(found), encoding="utf-8")
    print(table(found), end="")
    if args.update_profiles:
        from conformance.profiles import read_profile

        for name in found["functions"]:
            if any(r["backend"] == name and r["outcome"] != "skipped" for r in data["tests"]):
                profile = read_profile(name)
                write_known_failures(profile.path, known_failures(data, name))
                print(f"rewrote the known failures of {profile.path}")
        # Without its known failures the run fails by design; what counts is what it wrote.
        code = 0
    if args.readme:
        changed = rewrite_readme(args.readme, found)
        print(f"{'rewrote' if changed else 'unchanged:'} the table in {args.readme}")
    if args.check:
        committed = marks(args.check.read_text(encoding="utf-8"))
        fresh = marks(block(found))
        differ = {k: (committed.get(k), fresh.get(k)) for k in committed.keys() | fresh.keys()}
        differ = {k: v for k, v in differ.items() if v[0] != v[1]}
        if differ:
            print(
                f"{args.check}: the table is not what this run measured ((clause, function): "
                f"(committed, measured)): {differ}; rerun python -m conformance frameworks "
                f"--readme {args.check}",
                file=sys.stderr,
            )
            return code or 1
    return code
