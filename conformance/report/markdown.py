"""``report.md``: the report's data (``conformance/report/command.py``) as Markdown, in reading order.

Verdict per backend first; then today's variants (SPEC §15 onwards) by backend, the clause table, known failures and skips (grouped by the
missing capability), what failed with its replay, cross-framework agreement on the
outputs and the gradients, the shard counts, what a quantized backend's P pipeline costs,
the pairwise tests, and the pictures.
"""

from __future__ import annotations

from conformance.report.markdown_agreement import (  # noqa: F401 - re-exported
    PAIRWISE_DTYPES,
    no_pairs_line,
    render_agreement,
    render_pairs,
    render_pipeline_costs,
    render_shard_counts,
)
from conformance.suite.clauses import clause_key, clause_titles

MAX_FAILURES_SHOWN = 40


def _sections(clauses: list[str]) -> str:
    return ", ".join(f"§{c}" for c in clauses)


def render_markdown(data: dict) -> str:
    summary = data["summary"]
    pictures = data.get("pictures", {})
    lines = [
        "# Conformance report",
        "",
        f"Generated {data['date']} on {data['machine']} by `{data['command']}`.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(data["versions"].items())),
        "",
        f"Result: **{summary['passed']} passed, {summary['failed']} failed, "
        f"{summary['skipped']} skipped, {summary['xfailed']} known failures** "
        f"(pytest exit code {data['exit_code']}). Also written: `report.json`, `junit.xml`"
        + (", and the inputs of failing calls in `repro/`." if summary["failed"] else "."),
        "",
        *render_verdicts(data.get("verdicts", {})),
        *render_layers(data.get("layers", {})),
        *render_domains(data.get("domains", {})),
        *render_departures(data.get("departures", {})),
        *render_variants(data.get("variants", []), list(data["backends"])),
        *render_clauses(data),
        *render_known_failures_and_skips(data),
        *render_failures(data["tests"]),
    ]
    if "error" in pictures:
        lines += [f"*{pictures['error']}*", ""]
    agreement = data.get("agreement", {})
    lines += render_agreement(agreement.get("outputs", {}), pictures, "outputs")
    lines += render_agreement(agreement.get("gradients", {}), pictures, "gradients")
    lines += render_shard_counts(data.get("shard_counts", {}))
    lines += render_pipeline_costs(data.get("pipeline_costs", {}))
    lines += render_pairs(data["clauses"], data["backends"])
    if "masks" in pictures:
        lines += [
            "## Pictures",
            "",
            "Run it, draw the mask: each picture is the weight matrix the reference returns "
            "with equal scores and V = identity, so a query's n visible keys each get 1/n and "
            "a query with none returns 0 (SPEC §3.4–§3.6, §4.3).",
            "",
            f"![causal and windowed masks]({pictures['masks']})",
            "",
            "The seed notes' worked example (SPEC §11.1): the weights, and the output rows in "
            "the titles.",
            "",
            f"![worked example weights]({pictures['worked_example']})",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def render_verdicts(verdicts: dict[str, dict]) -> list[str]:
    """One line per backend: conforms, or the clauses it fails; and what it does not declare."""
    if not verdicts:
        return []
    lines = [
        "## Verdict",
        "",
        "| backend | verdict | does not declare (its tests are skipped) |",
        "|---|---|---|",
    ]
    for name, v in verdicts.items():
        parts = []
        if v["failed_clauses"]:
            n = v["failed_tests"]
            parts.append(
                f"❌ **fails {_sections(v['failed_clauses'])}** ({n} test{'s' * (n != 1)})"
            )
        for partner, apart in v["apart_from"].items():
            n = apart["tests"]
            parts.append(
                f"❌ **disagrees with {partner}** on {_sections(apart['clauses'])} "
                f"({n} pairwise test{'s' * (n != 1)})"
            )
        if v["known_failure_clauses"]:
            parts.append(f"⚠️ known failures in {_sections(v['known_failure_clauses'])}")
        spoiled = v.get("interpreter", {}).get("tests", 0)
        if v["conforms"]:
            parts.append(f"✅ conforms: {v['ran']} test{'s' * (v['ran'] != 1)}, none failed")
        elif not parts and not spoiled:
            parts.append("➖ no test ran")
        elif parts and not v["failed_clauses"] and not v["apart_from"]:
            parts.append("nothing else fails")
        if spoiled:
            parts.append(
                f"➖ {spoiled} test{'s' * (spoiled != 1)} its interpreter cannot run right: "
                + "; ".join(v["interpreter"]["limitations"])
            )
        lacks = [*v["lacks_capabilities"], *(f"dtype {d}" for d in v["lacks_dtypes"])]
        verdict = "; ".join(parts).replace("; nothing else fails", ", nothing else fails")
        lines.append(f"| {name} | {verdict} | {', '.join(lacks) or 'nothing: all declared'} |")
    lines.append("")
    return lines


def render_domains(domains: dict[str, dict[str, list[str]]]) -> list[str]:
    """Per function that declares a domain or leaves out a form (SPEC §13.19): what it was
    judged on and the clauses no call of theirs reached, as the run's summary says them: a
    verdict of "conforms" is a verdict on that domain only."""
    if not domains:
        return []
    lines = [
        "## What each function was judged on",
        "",
        "A function that declares a domain (SPEC §13.19) is judged inside it, and only there.",
        "",
    ]
    for name, judged in domains.items():
        lines.append(f"- `{name}`: " + "; ".join(judged["on"]) + ".")
        for words in judged.get("assumed", ()):
            lines.append(f"  Taken from its signature, not declared: {words}.")
        if judged.get("moved"):
            lines.append(f"  Sizes drawn inside its domain: {', '.join(judged['moved'])}.")
        if judged.get("rebuilt"):
            lines.append(
                "  Fixtures built again inside its domain with the oracle: "
                + ", ".join(judged["rebuilt"])
                + "."
            )
        untested = judged.get("untested")
        lines.append(
            "  **Untested**, no call of theirs fits what it takes: SPEC §"
            + ", §".join(untested)
            + "."
            if untested
            else "  Every clause run on it had a call inside its domain."
        )
    lines.append("")
    return lines


def render_layers(layers: dict[str, dict[str, str]]) -> list[str]:
    """Per backend, the verdict of each layer (SPEC §13.18): the math on ordinary inputs,
    the edges, and the contract of bad input."""
    if not layers:
        return []
    names = list(next(iter(layers.values())))
    lines = [
        "By layer (SPEC §13.18): **math** (ordinary inputs), **edges** (rows with no key, "
        "NaN and garbage in slots no query attends, overflow, empty sequences), "
        "**contract** (what bad input gets).",
        "",
        "| backend | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for backend, verdicts in layers.items():
        lines.append(f"| {backend} | " + " | ".join(verdicts[n] for n in names) + " |")
    lines.append("")
    return lines


def departure_line(entry: dict) -> str:
    """One behaviour: what the function does, where in the spec, how many tests."""
    n = entry["tests"]
    counts = f"{n} test{'s' * (n != 1)}"
    if entry["known"]:
        counts += ", all known failures" if entry["known"] == n else f", {entry['known']} known"
    common = f"; {entry['common']}" if entry.get("common") else ""
    dtypes = entry.get("dtypes", [])
    if len(dtypes) > 1:
        common += f"; {len(dtypes)} dtypes: {', '.join(dtypes)}"
    return f"{entry['behaviour']}: {_sections(entry['clauses'])} ({counts}{common})"


def render_departures(by_backend: dict[str, list[dict]]) -> list[str]:
    """Per backend, its distinct departures from the spec, the commonest first, each with
    one test that shows it and, where one was saved, its replay."""
    if not by_backend:
        return []
    lines = [
        "## What each backend does differently from the spec",
        "",
        "Every failing test (known failures included), grouped by the behaviour it shows: "
        "what the function does, the clauses it breaks, how many tests it touches, and one "
        "test to rerun. The clause table below counts the same tests per clause.",
        "",
    ]
    for backend, entries in by_backend.items():
        lines += [f"**{backend}**", ""]
        for i, entry in enumerate(entries, start=1):
            lines.append(f"{i}. {departure_line(entry)}; e.g. `{entry['example']}`")
        lines.append("")
        replays = [e for e in entries if e["reproduce"]]
        if replays:
            lines += ["<details><summary>replays</summary>", ""]
            for i, entry in enumerate(entries, start=1):
                if entry["reproduce"]:
                    lines += [
                        f"{i}. `{entry['example']}`",
                        "",
                        "```",
                        entry["reproduce"],
                        "```",
                        "",
                    ]
            lines += ["</details>", ""]
    return lines


def render_variants(variants: list[dict], backends: list[str]) -> list[str]:
    """One row per variant of today's models (sinks, chunked, ALiBi, packed, paged): per
    backend, whether it declares the capability, and how the tests of its SPEC section
    went."""
    if not variants or not backends:
        return []
    lines = [
        "## Today's variants per backend",
        "",
        "Attention sinks (§15), chunked local attention (§16), ALiBi (§17), packed "
        "variable-length sequences (§18) and paged KV caches (§19) are capabilities a "
        "backend opts into. Each cell counts the tests of the variant's SPEC section as the "
        "clause table below does; ➖ **not declared**: the backend refuses the variant, its "
        "tests are skipped by the capability's name, and the tests that ran check the "
        "refusal.",
        "",
        "| variant | " + " | ".join(backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for variant in variants:
        cells = []
        for name in backends:
            cell = variant["backends"].get(name)
            if cell is None:
                cells.append("")
            elif not cell["declared"]:
                # Its section's tests still run where they check the refusal (§15.6...).
                counts = clause_cell(cell).split(" ", 1)[1] if _counted(cell) else ""
                mark = "❌" if cell["failed"] else "➖"
                cells.append(f"{mark} not declared" + (f" ({counts})" if counts else ""))
            elif not _counted(cell):
                cells.append("declared; no test of it ran")
            else:
                cells.append(clause_cell(cell))
        label = f"`{variant['capability']}` (§{variant['section']})"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _counted(cell: dict) -> bool:
    return cell["passed"] + cell["failed"] + cell["xfailed"] + cell["skipped"] > 0


def render_clauses(data: dict) -> list[str]:
    titles = clause_titles()
    lines = [
        "## Clauses per backend",
        "",
        "Each cell: how many of the tests that ran passed, then how many failed, were known "
        "to fail or were skipped. ✅ all ran and passed, ❌ a failure, ⚠️ known failures "
        "(from `--known-failures` or a profile), ➖ all skipped (the skips are listed below, "
        "by the capability the backend lacks). A pairwise test counts in both backends' "
        "columns.",
        "",
    ]
    backends = list(data["backends"])
    clauses = sorted({c for b in data["clauses"].values() for c in b}, key=clause_key)
    lines.append("| clause | " + " | ".join(backends) + " |")
    lines.append("|---|" + "---|" * len(backends))
    for clause in clauses:
        cells = []
        for b in backends:
            cell = data["clauses"].get(b, {}).get(clause)
            if cell is None:
                cells.append("")
                continue
            cells.append(clause_cell(cell))
        if not any(cells):  # no backend's test of it (a pairwise one with one backend)
            continue
        lines.append(f"| §{clause} {titles.get(clause, '')} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def clause_cell(cell: dict) -> str:
    """One clause for one backend: how many of the tests that ran passed, then what failed,
    was known to fail, or was skipped ("⚠️ 20/22 passed, 2 known failures, 2 skipped")."""
    run = cell["passed"] + cell["failed"] + cell["xfailed"]
    mark = "❌" if cell["failed"] else "⚠️" if cell["xfailed"] else "✅" if run else "➖"
    parts = [f"{cell['passed']}/{run} passed"] if run else []
    if cell["failed"]:
        parts.append(f"{cell['failed']} failed")
    if cell["xfailed"]:
        n = cell["xfailed"]
        parts.append(f"{n} known failure{'s' * (n != 1)}")
    if cell["skipped"]:
        parts.append(f"{cell['skipped']} skipped")
    return f"{mark} {', '.join(parts)}"


def render_known_failures_and_skips(data: dict) -> list[str]:
    lines = []
    known = data.get("known_failures", [])
    if known:
        lines += ["Known failures (from `--known-failures`), by backend and reason:", ""]
        for g in known:
            lines.append(
                f"- {g['backend']}, known failure ({_sections(g['clauses'])}, "
                f"{g['tests']} test{'s' * (g['tests'] != 1)}): {g['reason']}"
            )
        lines.append("")
    skips = data.get("skips", [])
    if skips:
        lines += ["Skipped, one line per backend and what it lacks:", ""]
        for g in skips:
            who = g["backend"] or "the run"
            pairwise = f", {g['pairwise']} of them pairwise" if g["pairwise"] else ""
            n = f"{g['tests']} test{'s' * (g['tests'] != 1)} skipped{pairwise}"
            why = f"{who} lacks {g['missing']}" if g["missing"] else g["reason"].rstrip(".")
            lines.append(f"- {why}: {n} ({_sections(g['clauses'])})")
        lines.append("")
    return lines


def render_failures(rows: list[dict]) -> list[str]:
    failed = [r for r in rows if r["outcome"] == "failed"]
    if not failed:
        return []
    lines = [
        "## What failed, and how to reproduce it",
        "",
        "Each failure: the test, its message (max absolute and relative error, where, the "
        "case), and Python that replays the call on the saved inputs. Rerun one test with "
        '`pytest conformance <options of this run> "<test id>"`.',
        "",
    ]
    for row in failed[:MAX_FAILURES_SHOWN]:
        lines += [f"### `{row['test']}`", "", "```", row["message"].strip()]
        if row["reproduce"]:
            lines += ["", row["reproduce"].strip()]
        lines += ["```", ""]
    if len(failed) > MAX_FAILURES_SHOWN:
        lines += [
            f"… and {len(failed) - MAX_FAILURES_SHOWN} more failures: see `report.json`.",
            "",
        ]
    return lines
