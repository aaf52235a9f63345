"""The main job: run the spec on backends and write a report (Markdown and JSON).

    python -m conformance report --backend all --out report/

The report has, per backend, each clause passed / failed / skipped (with the reason),
and per dtype the cross-framework error matrix on the fixtures: each backend's max error
against the oracle (absolute and in units of the dtype's epsilon) and every pair's max
difference.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from conformance.backends import DTYPES, load_backend
from conformance.cases import case_entries, load_case
from conformance.tolerance import EPS, tolerance

HERE = Path(__file__).resolve().parent


class _Collector:
    """A pytest plugin that records each test's backend, clause and outcome."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
            marker = item.get_closest_marker("clause")
            params = getattr(item, "callspec", None)
            backend = params.params.get("backend") if params else None
            pair = params.params.get("backend_pair") if params else None
            reason = ""
            if rep.skipped and isinstance(rep.longrepr, tuple):
                reason = rep.longrepr[2].removeprefix("Skipped: ")
            elif rep.failed:
                reason = str(rep.longrepr).strip().splitlines()[-1][:300]
            self.rows.append(
                {
                    "test": item.nodeid,
                    "backend": backend or ("~".join(pair) if pair else None),
                    "clause": marker.args[0] if marker else None,
                    "outcome": rep.outcome,
                    "reason": reason,
                }
            )


def run_tests(backends: list[str], extra: list[str]) -> tuple[int, list[dict]]:
    collector = _Collector()
    args = [str(HERE), "-q", "-p", "no:cacheprovider"]
    for name in backends:
        args += ["--backend", name]
    code = pytest.main(args + extra, plugins=[collector])
    return int(code), collector.rows


def clause_table(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """{backend: {clause: {"passed": n, "failed": n, "skipped": n, "reasons": [...]}}}"""
    table: dict = defaultdict(
        lambda: defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "reasons": []})
    )
    for row in rows:
        cell = table[row["backend"]][row["clause"]]
        cell[row["outcome"]] += 1
        if row["reason"] and row["reason"] not in cell["reasons"]:
            cell["reasons"].append(row["reason"])
    return {b: dict(c) for b, c in table.items()}


def error_matrix(backends: list[str]) -> dict[str, dict]:
    """Per dtype: each backend's max error against the oracle on the fixtures, and every
    pair's max difference on the fixtures both run."""
    result = {}
    for dtype in DTYPES:
        outs: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
        worst: dict[str, dict] = {}
        for name in backends:
            backend = load_backend(name)
            if dtype not in backend.dtypes:
                continue
            abs_err, ulp_err, ratio = 0.0, 0.0, 0.0
            for entry in case_entries():
                if entry["dtype"] != dtype:
                    continue
                case = load_case(entry["id"])
                if any(c not in backend.capabilities for c in case.requires) or (
                    entry["unbatched"] and "unbatched" not in backend.capabilities
                ):
                    continue
                out = np.asarray(
                    backend.attention(*case.inputs(), mask=case.mask(), **case.options()),
                    dtype=np.float64,
                )
                outs[name][case.id] = out
                err = float(np.max(np.abs(out - case.expected), initial=0.0))
                scale = max(1.0, float(np.max(np.abs(case.expected), initial=0.0)))
                abs_err = max(abs_err, err)
                ulp_err = max(ulp_err, err / (EPS[dtype] * scale))
                ratio = max(ratio, err / tolerance(dtype, case.naive_error, case.expected))
            worst[name] = {
                "max_abs_error": abs_err,
                "max_error_eps": ulp_err,
                "max_fraction_of_tolerance": ratio,
            }
        pairs = {}
        names = list(outs)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                shared = set(outs[a]) & set(outs[b])
                pairs[f"{a}~{b}"] = max(
                    (float(np.max(np.abs(outs[a][c] - outs[b][c]), initial=0.0)) for c in shared),
                    default=0.0,
                )
        result[dtype] = {"vs_oracle": worst, "pairs": pairs}
    return result


def versions(backends: list[str]) -> dict[str, str]:
    found = {"python": platform.python_version(), "numpy": np.__version__}
    for name in backends:
        found.update(load_backend(name).versions())
    return found


def _clause_titles() -> dict[str, str]:
    titles = {}
    for line in (HERE / "SPEC.md").read_text().splitlines():
        m = re.match(r"^\*\*(\d+\.\d+)\s+(.*?)\.?\*\*", line) or re.match(
            r"^#+\s+(\d+\.\d+)\s+(.*)", line
        )
        if m:
            titles[m.group(1)] = m.group(2)
    return titles


def _clause_key(clause: str | None) -> tuple:
    if clause is None:
        return (999,)
    return tuple(int(x) for x in clause.split("."))


def render_markdown(data: dict) -> str:
    titles = _clause_titles()
    lines = [
        "# Conformance report",
        "",
        f"Generated {data['date']} on {data['machine']} by `{data['command']}`.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(data["versions"].items())),
        "",
        f"Result: **{data['summary']['passed']} passed, {data['summary']['failed']} failed, "
        f"{data['summary']['skipped']} skipped** (pytest exit code {data['exit_code']}).",
        "",
        "## Clauses per backend",
        "",
        "Each cell: passed/run, with skips and their reasons. ✅ all ran and passed, ❌ a failure, ➖ skipped (the reason names the missing capability).",
        "",
    ]
    backends = [b for b in data["backends"]]
    clauses = sorted({c for b in data["clauses"].values() for c in b}, key=_clause_key)
    lines.append("| clause | " + " | ".join(backends) + " |")
    lines.append("|---|" + "---|" * len(backends))
    notes = []
    for clause in clauses:
        cells = []
        for b in backends:
            cell = data["clauses"].get(b, {}).get(clause)
            if cell is None:
                cells.append("")
                continue
            run = cell["passed"] + cell["failed"]
            mark = "❌" if cell["failed"] else ("✅" if run else "➖")
            text = f"{mark} {cell['passed']}/{run}"
            if cell["skipped"]:
                text += f" ({cell['skipped']} skipped)"
                notes += [f"- {b}, §{clause}: {r}" for r in cell["reasons"] if not cell["failed"]]
            if cell["failed"]:
                notes += [f"- **{b}, §{clause} failed**: {r}" for r in cell["reasons"]]
            cells.append(text)
        title = titles.get(clause, "")
        lines.append(f"| §{clause} {title} | " + " | ".join(cells) + " |")
    pairs = {b: c for b, c in data["clauses"].items() if b and "~" in b}
    if notes:
        lines += ["", "Skips and failures:", ""] + sorted(set(notes))
    lines += ["", "## Cross-framework agreement on the fixtures", ""]
    lines += [
        "Max error against the 50-digit oracle over every fixture of that dtype the backend runs: absolute, "
        "in units of the dtype's epsilon (scaled by max(1, |expected|)), and as a fraction of the SPEC §7 tolerance "
        "(≤ 1 passes). Then every pair's max absolute difference on the fixtures both run.",
        "",
    ]
    for dtype, block in data["errors"].items():
        if not block["vs_oracle"]:
            continue
        lines += [
            f"### {dtype}",
            "",
            "| backend | max abs error | max error / eps | max error / tolerance |",
            "|---|---|---|---|",
        ]
        for b, e in block["vs_oracle"].items():
            lines.append(
                f"| {b} | {e['max_abs_error']:.3e} | {e['max_error_eps']:.2f} | {e['max_fraction_of_tolerance']:.2f} |"
            )
        names = list(block["vs_oracle"])
        if len(names) > 1:
            lines += [
                "",
                "| pair max abs difference | " + " | ".join(names) + " |",
                "|---|" + "---|" * len(names),
            ]
            for a in names:
                row = []
                for b in names:
                    if a == b:
                        row.append("·")
                    else:
                        key = f"{a}~{b}" if f"{a}~{b}" in block["pairs"] else f"{b}~{a}"
                        row.append(f"{block['pairs'][key]:.1e}")
                lines.append(f"| {a} | " + " | ".join(row) + " |")
        lines.append("")
    if pairs:
        lines += [
            "## Every pair on random inputs (SPEC §7.3)",
            "",
            "| pair | passed | failed | skipped |",
            "|---|---|---|---|",
        ]
        for pair, by_clause in pairs.items():
            cell = {
                o: sum(c[o] for c in by_clause.values()) for o in ("passed", "failed", "skipped")
            }
            lines.append(f"| {pair} | {cell['passed']} | {cell['failed']} | {cell['skipped']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m conformance report", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        help="backend(s) to run; 'all' = every installed one",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("report"), help="output directory (default: report/)"
    )
    args, extra = parser.parse_known_args(argv)
    from conformance.conftest import selected_backends

    class _Opts:
        def getoption(self, _name):
            return args.backend

    backends = selected_backends(_Opts())
    if not backends:
        parser.error("choose backends with --backend NAME or --backend all")
    for name in backends:
        load_backend(name)
    code, rows = run_tests(backends, extra)
    summary = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "skipped")}
    data = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.system()} {platform.release()}, {platform.processor() or 'cpu'}",
        "command": "python -m conformance report " + " ".join(argv),
        "backends": backends,
        "versions": versions(backends),
        "exit_code": code,
        "summary": summary,
        "clauses": clause_table(rows),
        "errors": error_matrix(backends),
        "tests": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (args.out / "report.md").write_text(render_markdown(data))
    print(f"wrote {args.out / 'report.md'} and {args.out / 'report.json'}", file=sys.stderr)
    return code
