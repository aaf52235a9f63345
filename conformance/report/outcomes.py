"""What the test run says per backend: clauses passed and failed, a verdict, and the skips
grouped by the capability that caused them.

Every function here reads the rows ``conformance.report.collect.Collector`` gathered:
{"test", "backend", "clause", "outcome", "reason", ...}. A pairwise test (backend "a~b",
SPEC §7.3, §12.10) tests both backends: it counts under "a~b" and for a and for b.
"""

from __future__ import annotations

import re
from collections import defaultdict

from conformance.adapters.interpreters import limitation_named
from conformance.backends import CAPABILITIES, DTYPES
from conformance.report.collect import OUTCOMES
from conformance.suite.behaviours import describe_common, family
from conformance.suite.clauses import clause_key
from conformance.vocabulary import VARIANT_CAPABILITIES

_LACKS = re.compile(r"^(?P<who>.+?) lacks (?P<kind>capability|dtype) '(?P<what>[^']+)'")


def columns(backend: str | None) -> list[str | None]:
    """The clause-table columns a row counts in: its backend, and both of a pair."""
    if backend and "~" in backend:
        return [backend, *backend.split("~")]
    return [backend]


def clause_table(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """{backend: {clause: {"passed": n, "failed": n, "skipped": n, "xfailed": n}}}

    The cells are views of the tests, so their sum over columns is not the number of
    tests: the summary counts the rows.
    """
    table: dict = defaultdict(lambda: defaultdict(lambda: dict.fromkeys(OUTCOMES, 0)))
    for row in rows:
        for column in columns(row["backend"]):
            table[column][row["clause"]][row["outcome"]] += 1
    return {b: dict(c) for b, c in table.items()}


def variant_section(capability: str) -> str:
    """The SPEC section of a variant capability ("15" for "sinks"), as its description
    names it."""
    return re.search(r"SPEC §(\d+)", CAPABILITIES[capability])[1]


def variants(clauses: dict[str, dict[str, dict]], declared: dict[str, dict]) -> list[dict]:
    """The variants of today's models (SPEC §15 onwards), one entry each in section order:
    {"capability", "section", "backends": {backend: {"declared": bool, "passed": n,
    "failed": n, "skipped": n, "xfailed": n}}}, the counts summed over the section's
    clauses from ``clause_table`` (a pairwise test counts for both backends, as there)."""
    result = []
    for capability in sorted(VARIANT_CAPABILITIES, key=lambda c: int(variant_section(c))):
        section = variant_section(capability)
        cells = {}
        for name, decl in declared.items():
            cell = {"declared": capability in decl["capabilities"], **dict.fromkeys(OUTCOMES, 0)}
            for clause, counts in clauses.get(name, {}).items():
                if clause and clause.split(".")[0] == section:
                    for outcome in OUTCOMES:
                        cell[outcome] += counts[outcome]
            cells[name] = cell
        result.append({"capability": capability, "section": section, "backends": cells})
    return result


def _clauses(rows: list[dict]) -> list[str]:
    found = {r["clause"] or "(no clause)" for r in rows}
    return sorted(found, key=lambda c: clause_key(None if c == "(no clause)" else c))


def _spoiler(row: dict) -> str | None:
    return limitation_named(row.get("behaviour") or "")


def verdicts(rows: list[dict], declared: dict[str, dict]) -> dict[str, dict]:
    """Per backend: whether it conforms; the clauses its own tests fail; per partner, the
    clauses where a pairwise test found the two apart (which of them is wrong, the pair
    cannot say); the clauses with known failures; how many tests ran; the tests a known
    limitation of its interpreter spoiled (``interpreter``: how many, and the limitations in
    words), which count in none of these; and the capabilities and dtypes it does not
    declare.

    ``declared``: {backend: {"capabilities": [...], "dtypes": [...], "declarable": [...]}};
    what it does not declare is what it could (``declarable``, default every capability)
    and did not: a function is never said to lack what only a Backend class can have.
    """
    result = {}
    for name, decl in declared.items():
        own = [r for r in rows if r["backend"] == name]
        # A failure its interpreter's known limitation explains is not the kernel's (SPEC
        # §13.18): counted apart, neither a departure nor a test that conforms.
        spoiled = [r for r in own if r["outcome"] in ("failed", "xfailed") and _spoiler(r)]
        own = [r for r in own if all(r is not s for s in spoiled)]
        paired = [r for r in rows if r["backend"] and name in r["backend"].split("~")[:2]]
        paired = [r for r in paired if "~" in r["backend"]]
        failed = [r for r in own if r["outcome"] == "failed"]
        apart: dict[str, list[dict]] = defaultdict(list)
        for r in paired:
            if r["outcome"] == "failed":
                a, b = r["backend"].split("~")
                apart[b if a == name else a].append(r)
        known = [r for r in own + paired if r["outcome"] == "xfailed"]
        ran = sum(r["outcome"] in ("passed", "failed", "xfailed") for r in own + paired)
        result[name] = {
            "conforms": ran > 0 and not failed and not apart and not known,
            "ran": ran,
            "failed_tests": len(failed),
            "failed_clauses": _clauses(failed),
            "apart_from": {
                partner: {"tests": len(rs), "clauses": _clauses(rs)}
                for partner, rs in apart.items()
            },
            "known_failure_clauses": _clauses(known),
            "interpreter": {
                "tests": len(spoiled),
                "limitations": list(dict.fromkeys(_spoiler(r) for r in spoiled)),
            },
            "lacks_capabilities": sorted(
                set(decl.get("declarable", CAPABILITIES)) - set(decl["capabilities"])
            ),
            "lacks_dtypes": [d for d in DTYPES if d not in decl["dtypes"]],
        }
    return result


def grouped_skips(rows: list[dict], declared: dict[str, dict]) -> list[dict]:
    """The skipped tests, one entry per backend and missing capability (or dtype, or other
    reason): {"backend", "missing", "reason", "tests", "pairwise", "clauses"}; "missing"
    ("capability window", "dtype float16") is None for a skip of another reason.

    A pairwise test skipped because "a or b lacks capability 'c'" counts for whichever of
    a and b does not declare c.
    """
    groups: dict[tuple[str | None, str], dict] = {}
    for row in rows:
        if row["outcome"] != "skipped":
            continue
        reason, backend = row["reason"], row["backend"]
        owners: list[str | None] = [backend]
        match = _LACKS.match(reason)
        if match:
            missing = f"{match['kind']} {match['what']}"
            if backend and "~" in backend:
                key = "capabilities" if match["kind"] == "capability" else "dtypes"
                owners = [
                    b
                    for b in backend.split("~")
                    if match["what"] not in declared.get(b, {}).get(key, [match["what"]])
                ] or [backend]
        elif reason.startswith("got empty parameter set"):
            owners, missing = [None], "a second backend (pairwise tests need two)"
        else:
            missing = None
        for owner in owners:
            group = groups.setdefault(
                (owner, missing or reason),
                {
                    "backend": owner,
                    "missing": missing,
                    "reason": reason,
                    "tests": 0,
                    "pairwise": 0,
                    "clauses": set(),
                },
            )
            group["tests"] += 1
            group["pairwise"] += bool(backend and "~" in backend)
            if row["clause"]:
                group["clauses"].add(row["clause"])
    order = list(declared)
    result = sorted(
        groups.values(),
        key=lambda g: (
            order.index(g["backend"]) if g["backend"] in order else len(order),
            g["missing"] or g["reason"],
        ),
    )
    for group in result:
        group["clauses"] = sorted(group["clauses"], key=clause_key)
    return result


def grouped_known_failures(rows: list[dict]) -> list[dict]:
    """Known failures, one entry per backend and reason: {"backend", "reason", "tests", "clauses"}."""
    groups: dict[tuple, dict] = {}
    for row in rows:
        if row["outcome"] != "xfailed":
            continue
        reason = row["reason"].removeprefix("known failure: ")
        group = groups.setdefault(
            (row["backend"], reason),
            {"backend": row["backend"], "reason": reason, "tests": 0, "clauses": set()},
        )
        group["tests"] += 1
        if row["clause"]:
            group["clauses"].add(row["clause"])
    for group in groups.values():
        group["clauses"] = sorted(group["clauses"], key=clause_key)
    return list(groups.values())


def departures(rows: list[dict]) -> dict[str, list[dict]]:
    """What each backend does differently from the spec, one entry per distinct behaviour:
    {backend: [{"behaviour", "covers", "clauses", "tests", "known", "example",
    "reproduce", "common", "dtypes"}]}, the behaviour touching most tests first.

    Failed tests and known failures both count ("known": how many of them were listed as
    known failures). Behaviours of one family (``behaviours.FAMILIES``: inputs accepted
    that the spec refuses, say) share one entry whose text lists their details; "covers"
    holds the behaviours an entry stands for. "example" is one test that shows it,
    "reproduce" its replay where one was saved, and "common" what every call of it had in
    common (its dtype, say), in words. A pairwise test counts under its pair, "a~b".
    """
    groups: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if row["outcome"] in ("failed", "xfailed") and row["backend"]:
            text = row.get("behaviour") or row["reason"] or row["message"]
            groups[row["backend"]][family(text)[0]].append({**row, "behaviour": text})
    result: dict[str, list[dict]] = {}
    for backend, by_line in groups.items():
        entries = []
        for line, members in by_line.items():
            members = sorted(members, key=lambda r: r["test"])
            covers = sorted({r["behaviour"] for r in members})
            details = sorted({family(text)[1] for text in covers} - {""})
            entries.append(
                {
                    "behaviour": f"{line} {'; '.join(details)}" if details else line,
                    "covers": covers,
                    "clauses": _clauses(members),
                    "tests": len(members),
                    "known": sum(r["outcome"] == "xfailed" for r in members),
                    "example": members[0]["test"],
                    "reproduce": next((r["reproduce"] for r in members if r["reproduce"]), ""),
                    "common": describe_common([r.get("call", []) for r in members]),
                    # One cause across dtypes is one entry, which says which it spans.
                    "dtypes": [d for d in DTYPES if any(d in r.get("call", []) for r in members)],
                }
            )
        result[backend] = sorted(entries, key=lambda e: (-e["tests"], e["behaviour"]))
    return result


def layer_verdicts(rows: list[dict], backends: list[str]) -> dict[str, dict[str, str]]:
    """{backend: {layer: its verdict}} (SPEC §13.18), as a pytest run's last lines give
    them: a failure counts in the layer its behaviour names, else in its clause's."""
    from conformance.suite.clauses import LAYERS, layer_of
    from conformance.suite.verdicts import layer_of_failure, layer_verdict

    labelled = []
    for row in rows:
        departs = row["outcome"] in ("failed", "xfailed")
        text = row.get("behaviour") or ""
        layer = layer_of_failure(row["clause"], text) if departs else layer_of(row["clause"])
        labelled.append({**row, "layer": layer, "behaviour": text, "rerun": ""})
    result = {}
    for name in backends:
        mine = [r for r in labelled if r["backend"] == name]
        result[name] = {
            layer: layer_verdict(mine, layer, []).removeprefix(f"{layer}: ") for layer in LAYERS
        }
    return result
