"""The main job: run the spec on backends and write a report.

    python -m conformance report --backend all --out report/
    python -m conformance report --impl examples.my_attention:attention \
        --impl-capabilities causal_bottom_right,window,gqa --out report-mine/

Into ``--out`` go ``report.md`` (read this), ``report.json`` (the same, for programs),
``junit.xml`` (for CI), PNG pictures, and ``repro/`` (the inputs of failing calls). The
report has:

- per backend, each clause passed / failed / skipped (with the missing capability) /
  known failure (a pairwise test counts for both backends of its pair), and every
  failure's message (max absolute and relative error, where, the case) with a snippet
  that replays it;
- per dtype, the cross-framework agreement on the fixtures: each backend's max error
  against the oracle and every pair's max difference, absolute and in units of the
  dtype's epsilon, as tables and as heatmaps; the same for the gradients on the gradient
  fixtures (SPEC §12), for the backends declaring "grad";
- the frameworks' own functions on the spec's edge cases (``builtin_profile.py``);
- pictures: causal masks (top-left, bottom-right, windowed) and the seed's worked
  example's weights, drawn by running the reference;
- library versions, the machine and the date.

Any other options are passed to pytest (``-k``, ``--known-failures FILE``, ...).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from conformance.backends import DTYPES, BackendUnavailable, load_backend
from conformance.cases import case_entries, load_case, worked_example
from conformance.tolerance import EPS, tolerance

HERE = Path(__file__).resolve().parent
OUTCOMES = ("passed", "failed", "skipped", "xfailed")


class _Collector:
    """A pytest plugin that records each test's backend, clause and outcome."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        if rep.when == "call" or (rep.when != "call" and rep.outcome != "passed"):
            marker = item.get_closest_marker("clause")
            params = getattr(item, "callspec", None)
            backend = params.params.get("backend") if params else None
            pair = params.params.get("backend_pair") if params else None
            if not isinstance(pair, (tuple, list)):
                pair = None  # one backend: the pairwise test is a single skip with no pair
            result = rep.outcome
            reason = message = ""
            if hasattr(rep, "wasxfail"):
                result, reason = "xfailed", rep.wasxfail
            elif rep.skipped and isinstance(rep.longrepr, tuple):
                reason = rep.longrepr[2].removeprefix("Skipped: ")
            elif rep.failed:
                crash = getattr(rep.longrepr, "reprcrash", None)
                message = crash.message if crash else str(rep.longrepr)
                if rep.when != "call":
                    message = f"error in {rep.when}: {message}"
                reason = " ".join(message.strip().splitlines()[:2])[:300]
            self.rows.append(
                {
                    "test": item.nodeid,
                    "backend": backend or ("~".join(pair) if pair else None),
                    "clause": marker.args[0] if marker else None,
                    "outcome": result,
                    "reason": reason,
                    "message": message,
                    "reproduce": dict(rep.user_properties).get("reproduce", ""),
                }
            )


def run_tests(
    backends: list[str], extra: list[str], out: Path | None = None
) -> tuple[int, list[dict]]:
    collector = _Collector()
    # The report imported Hypothesis (through conftest) before pytest starts: nothing of it
    # needs rewriting, so pytest's warning about that is noise.
    args = [
        str(HERE),
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    for name in backends:
        args += ["--backend", name]
    if out is not None:
        args += [f"--junitxml={out / 'junit.xml'}", "--repro-dir", str(out / "repro")]
    code = pytest.main(args + extra, plugins=[collector])
    return int(code), collector.rows


def clause_table(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """{backend: {clause: {"passed": n, "failed": n, "skipped": n, "xfailed": n,
    "reasons": {outcome: [reason, ...]}}}}

    A pairwise test (backend "a~b", SPEC §7.3, §12.10) tests both backends: it is counted
    under "a~b" and also in the columns of a and of b. The cells are views of the tests,
    so their sum over columns is not the number of tests: the summary counts the rows.
    """
    table: dict = defaultdict(
        lambda: defaultdict(lambda: {**dict.fromkeys(OUTCOMES, 0), "reasons": {}})
    )
    for row in rows:
        columns = [row["backend"]]
        if row["backend"] and "~" in row["backend"]:
            columns += row["backend"].split("~")
        for column in columns:
            cell = table[column][row["clause"]]
            cell[row["outcome"]] += 1
            reasons = cell["reasons"].setdefault(row["outcome"], [])
            if row["reason"] and row["reason"] not in reasons:
                reasons.append(row["reason"])
    return {b: dict(c) for b, c in table.items()}


def error_matrix(backends: list[str]) -> dict[str, dict]:
    """Per dtype: each backend's max error against the oracle on the fixtures, and every
    pair's max difference on the fixtures both run, absolute and in units of eps (scaled
    by max(1, |expected|) of each case)."""
    result = {}
    for dtype in DTYPES:
        runs: dict[str, dict] = {}
        for name in backends:
            backend = load_backend(name)
            if dtype not in backend.dtypes:
                continue
            runs[name] = {}
            for entry in case_entries():
                if entry["dtype"] != dtype:
                    continue
                case = load_case(entry["id"])
                if any(c not in backend.capabilities for c in case.requires) or (
                    entry["unbatched"] and "unbatched" not in backend.capabilities
                ):
                    continue
                try:
                    out = backend.attention(*case.inputs(), mask=case.mask(), **case.options())
                except Exception:  # the tests report it; the matrix shows only what ran
                    continue
                runs[name][case.id] = (out, case.expected, case.naive_error)
        result[dtype] = _agreement(dtype, runs)
    return result


def gradient_matrix(backends: list[str]) -> dict[str, dict]:
    """Per dtype: each backend's worst gradient (dq, dk, dv, dmask) against the oracle on
    the gradient fixtures (SPEC §12.1, §12.9), the fixtures it skipped for a missing
    capability, and every pair's max difference on the gradients both computed, absolute
    and in units of eps (scaled by max(1, |expected|) of each gradient), as ``error_matrix``.
    Backends that do not declare "grad" are left out."""
    result = {}
    for dtype in DTYPES:
        runs: dict[str, dict] = {}
        skipped: dict[str, set] = {}
        for name in backends:
            backend = load_backend(name)
            if dtype not in backend.dtypes or "grad" not in backend.capabilities:
                continue
            runs[name], skipped[name] = {}, set()
            for entry in case_entries(("attention_grad",)):
                if entry["dtype"] != dtype:
                    continue
                case = load_case(entry["id"])
                missing = [c for c in case.requires if c not in backend.capabilities]
                if missing:
                    skipped[name].add(missing[0])
                    continue
                try:
                    got = backend.attention_vjp(
                        *case.inputs(), case.d_out(), mask=case.mask(), **case.options()
                    )
                except Exception:  # the tests report it; the matrix shows only what ran
                    continue
                for g, (gname, want) in zip(got, case.expected_grads.items()):
                    runs[name][(case.id, gname)] = (g, want, case.grad_naive_error(gname))
        block = _agreement(dtype, runs)
        for name, worst in block["vs_oracle"].items():
            worst["skipped_for"] = sorted(skipped[name])
        result[dtype] = block
    return result


def _agreement(dtype: str, runs: dict[str, dict]) -> dict:
    """Summarise {backend: {key: (got, expected, naive_error)}} for one dtype: each
    backend's worst error against the oracle (absolute, in eps scaled by max(1, |expected|),
    and as a fraction of SPEC §7's tolerance), and every pair's max difference (absolute
    and in eps) on the keys both computed. A result of the wrong shape is left out."""
    outs: dict[str, dict] = defaultdict(dict)
    units: dict = {}
    worst: dict[str, dict] = {}
    for name, results in runs.items():
        abs_err, ulp_err, ratio = 0.0, 0.0, 0.0
        for key, (got, want, naive_error) in results.items():
            got = np.asarray(got, dtype=np.float64)
            if got.shape != want.shape:
                continue
            outs[name][key] = got
            unit = EPS[dtype] * max(1.0, float(np.max(np.abs(want), initial=0.0)))
            units[key] = unit
            err = _max_abs(got - want)
            abs_err = max(abs_err, err)
            ulp_err = max(ulp_err, err / unit)
            ratio = max(ratio, err / tolerance(dtype, naive_error, want))
        worst[name] = {
            "max_abs_error": abs_err,
            "max_error_eps": ulp_err,
            "max_fraction_of_tolerance": ratio,
        }
    pairs, pairs_eps = {}, {}
    names = list(worst)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            shared = set(outs[a]) & set(outs[b])
            diffs = {c: _max_abs(outs[a][c] - outs[b][c]) for c in shared}
            pairs[f"{a}~{b}"] = max(diffs.values(), default=0.0)
            pairs_eps[f"{a}~{b}"] = max((d / units[c] for c, d in diffs.items()), default=0.0)
    return {"vs_oracle": worst, "pairs": pairs, "pairs_eps": pairs_eps}


def _max_abs(diff: np.ndarray) -> float:
    """Max |diff|, with NaN counted as infinitely wrong."""
    diff = np.abs(diff)
    return float(np.max(np.where(np.isnan(diff), np.inf, diff), initial=0.0))


def versions(backends: list[str]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "numpy": np.__version__}
    for package in ("pytest", "hypothesis", "mpmath", "ml_dtypes", "matplotlib"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    for name in backends:
        found.update(load_backend(name).versions())
    return found


def machine() -> str:
    return (
        f"{platform.machine()} {platform.system()} {platform.release()}, "
        f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores"
    )


# --- Pictures ------------------------------------------------------------------------------


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported only for the pictures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _weights(backend, q, k, **options) -> np.ndarray:
    """Run attention with V = identity: the output is the weight matrix (B, H, T, S)."""
    B, K, S, _ = k.shape
    eye = np.broadcast_to(np.eye(S), (B, K, S, S)).copy()
    return backend.attention(q, k, eye, **options)


#: The masks drawn: (title, T, S, options). Each is drawn by running attention with
#: q = k = 0 (equal scores) and V = identity, so a cell is 1/n on the n keys a query sees.
MASK_PICTURES = [
    ("causal, top-left (T=5, S=8)", 5, 8, {"is_causal": True}),
    (
        "causal, bottom-right (T=5, S=8)",
        5,
        8,
        {"is_causal": True, "causal_alignment": "bottom_right"},
    ),
    (
        "causal, bottom-right (T=8, S=5)",
        8,
        5,
        {"is_causal": True, "causal_alignment": "bottom_right"},
    ),
    ("window (2, 1) (T=S=8)", 8, 8, {"window": (2, 1)}),
    ("causal + window (2, 0) (T=S=8)", 8, 8, {"is_causal": True, "window": (2, 0)}),
]


def draw_masks(path: Path, backend_name: str = "numpy") -> None:
    plt = _pyplot()
    backend = load_backend(backend_name)
    columns = 3
    rows = -(-len(MASK_PICTURES) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.4 * columns, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(MASK_PICTURES) :]:
        ax.axis("off")
    for ax, (title, T, S, options) in zip(axes.flat, MASK_PICTURES):
        q, k = np.zeros((1, 1, T, 1)), np.zeros((1, 1, S, 1))
        w = _weights(backend, q, k, **options)[0, 0]  # (T, S)
        ax.imshow(w > 0, cmap="Blues", vmin=0, vmax=1.4)
        for t in range(T):
            for s in range(S):
                if w[t, s] > 0:
                    ax.text(s, t, f"1/{round(1 / w[t, s])}", ha="center", va="center", fontsize=7)
            if not (w[t] > 0).any():
                ax.text(
                    S / 2 - 0.5,
                    t,
                    "no key: output 0",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="firebrick",
                )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key s")
        ax.set_ylabel("query t")
        ax.set_xticks(range(S))
        ax.set_yticks(range(T))
        ax.set_xticks(np.arange(-0.5, S), minor=True)
        ax.set_yticks(np.arange(-0.5, T), minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
    fig.suptitle(
        f"Which keys each query attends (weights with equal scores, run on the {backend_name} backend)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_worked_example(path: Path, backend_name: str = "numpy") -> None:
    plt = _pyplot()
    backend = load_backend(backend_name)
    ex = worked_example()
    q, k, v = (np.array(ex[n], dtype=np.float64)[None, None] for n in "qkv")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for ax, causal in zip(axes, (True, False)):
        w = _weights(backend, q, k, is_causal=causal)[0, 0]  # (T, S)
        out = backend.attention(q, k, v, is_causal=causal)[0, 0]  # (T, E)
        ax.imshow(w, cmap="viridis", vmin=0, vmax=1)
        for t in range(w.shape[0]):
            for s in range(w.shape[1]):
                ax.text(
                    s,
                    t,
                    f"{w[t, s]:.2f}",
                    ha="center",
                    va="center",
                    color="w" if w[t, s] < 0.6 else "k",
                )
        rows = ", ".join("[" + ", ".join(f"{x:.2f}" for x in row) + "]" for row in out)
        ax.set_title(f"{'causal' if causal else 'non-causal'}: out = [{rows}]", fontsize=9)
        ax.set_xlabel("key s")
        ax.set_ylabel("query t")
        ax.set_xticks(range(w.shape[1]))
        ax.set_yticks(range(w.shape[0]))
    fig.suptitle(
        "The seed's worked example: attention weights (Q, K, V in fixtures/worked_example.json)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_heatmap(path: Path, dtype: str, block: dict, what: str = "") -> None:
    """Max error in units of eps: the diagonal against the oracle, the rest between backends.
    ``what`` names the compared quantity in the title ("" for the outputs)."""
    plt = _pyplot()
    names = list(block["vs_oracle"])
    n = len(names)
    grid = np.zeros((n, n))
    for i, a in enumerate(names):
        grid[i, i] = block["vs_oracle"][a]["max_error_eps"]
        for j, b in enumerate(names):
            if i != j:
                key = f"{a}~{b}" if f"{a}~{b}" in block["pairs_eps"] else f"{b}~{a}"
                grid[i, j] = block["pairs_eps"][key]
    fig, ax = plt.subplots(figsize=(1.4 * n + 3, 1.1 * n + 2))
    shown = np.log10(np.maximum(np.where(np.isfinite(grid), grid, 1e300), 1e-2))
    image = ax.imshow(shown, cmap="magma_r", vmin=-2, vmax=max(3.0, float(shown.max())))
    for i in range(n):
        for j in range(n):
            color = "w" if shown[i, j] > 1.5 else "k"
            ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", color=color, fontsize=9)
    ax.set_xticks(range(n), names, rotation=30, ha="right")
    ax.set_yticks(range(n), names)
    fig.colorbar(image, ax=ax, label="log10(max error / eps)")
    ax.set_title(
        f"{dtype}{what}: max error in eps\n(diagonal: vs the oracle; off-diagonal: between backends)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_pictures(out: Path, errors: dict, gradients: dict | None = None) -> dict[str, str]:
    """Every picture of the report: {name: file name}, or {"error": why} without matplotlib."""
    try:
        _pyplot()
    except ImportError as err:
        return {
            "error": f"no pictures: matplotlib is not installed ({err}); pip install matplotlib"
        }
    files = {"masks": "masks.png", "worked_example": "worked-example-weights.png"}
    draw_masks(out / files["masks"])
    draw_worked_example(out / files["worked_example"])
    for dtype, block in errors.items():
        if len(block["vs_oracle"]) >= 1:
            files[f"heatmap-{dtype}"] = f"agreement-{dtype}.png"
            draw_heatmap(out / files[f"heatmap-{dtype}"], dtype, block)
    for dtype, block in (gradients or {}).items():
        if len(block["vs_oracle"]) >= 1:
            files[f"gradient-heatmap-{dtype}"] = f"gradient-agreement-{dtype}.png"
            draw_heatmap(
                out / files[f"gradient-heatmap-{dtype}"],
                dtype,
                block,
                " gradients (dq, dk, dv, dmask)",
            )
    return files


# --- Markdown ------------------------------------------------------------------------------


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
    summary = data["summary"]
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
        "## Clauses per backend",
        "",
        "Each cell: passed/run. ✅ all ran and passed, ❌ a failure, ⚠️ known failures "
        "(from `--known-failures`), ➖ skipped (the reason names the missing capability).",
        "",
    ]
    backends = list(data["backends"])
    clauses = sorted({c for b in data["clauses"].values() for c in b}, key=_clause_key)
    lines.append("| clause | " + " | ".join(backends) + " |")
    lines.append("|---|" + "---|" * len(backends))
    notes: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for clause in clauses:
        cells = []
        for b in backends:
            cell = data["clauses"].get(b, {}).get(clause)
            if cell is None:
                cells.append("")
                continue
            run = cell["passed"] + cell["failed"]
            mark = "❌" if cell["failed"] else "⚠️" if cell["xfailed"] else "✅" if run else "➖"
            text = f"{mark} {cell['passed']}/{run}"
            if cell["skipped"]:
                text += f" ({cell['skipped']} skipped)"
            if cell["xfailed"]:
                text += f" ({cell['xfailed']} known)"
            for outcome, reasons in cell["reasons"].items():
                for reason in reasons:
                    reason = reason.removeprefix("known failure: ")
                    notes[(outcome, b, reason)].append(f"§{clause}")
            cells.append(text)
        title = titles.get(clause, "")
        lines.append(f"| §{clause} {title} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Failures, known failures and skips:", ""]
        label = {"failed": "**failed**", "xfailed": "known failure", "skipped": "skipped"}
        order = {"failed": 0, "xfailed": 1, "skipped": 2}
        for (outcome, b, reason), where in sorted(
            notes.items(), key=lambda n: (order.get(n[0][0], 3), n[0][1], n[0][2])
        ):
            lines.append(f"- {b}, {label.get(outcome, outcome)} ({', '.join(where)}): {reason}")
    failed = [r for r in data["tests"] if r["outcome"] == "failed"]
    if failed:
        lines += [
            "",
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
            lines.append(
                f"… and {len(failed) - MAX_FAILURES_SHOWN} more failures: see `report.json`."
            )
    pictures = data.get("pictures", {})
    lines += ["", "## Cross-framework agreement on the fixtures", ""]
    lines += [
        "Max error against the 50-digit oracle over every fixture of that dtype the backend runs: absolute, "
        "in units of the dtype's epsilon (scaled by max(1, |expected|)), and as a fraction of the SPEC §7 tolerance "
        "(≤ 1 passes). Then every pair's max difference on the fixtures both run, absolute (above the diagonal) "
        "and in eps (below it), and as a heatmap (diagonal: against the oracle).",
        "",
    ]
    if "error" in pictures:
        lines += [f"*{pictures['error']}*", ""]
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
                "| pair max difference: abs ╲ eps | " + " | ".join(names) + " |",
                "|---|" + "---|" * len(names),
            ]
            for i, a in enumerate(names):
                row = []
                for j, b in enumerate(names):
                    key = f"{a}~{b}" if f"{a}~{b}" in block["pairs"] else f"{b}~{a}"
                    if i == j:
                        row.append("·")
                    elif i < j:
                        row.append(f"{block['pairs'][key]:.1e}")
                    else:
                        row.append(f"{block['pairs_eps'][key]:.2f} eps")
                lines.append(f"| {a} | " + " | ".join(row) + " |")
        if f"heatmap-{dtype}" in pictures:
            lines += ["", f"![{dtype} agreement heatmap]({pictures[f'heatmap-{dtype}']})"]
        lines.append("")
    lines += render_gradients(data.get("gradients") or {}, pictures)
    pairs = {b: c for b, c in data["clauses"].items() if b and "~" in b}
    if pairs:
        lines += [
            "## Every pair on random inputs (SPEC §7.3, §12.10)",
            "",
            "Each pairwise test also counts in both backends' columns of the clause table; "
            "the totals above count it once.",
            "",
            "| pair | passed | failed | skipped |",
            "|---|---|---|---|",
        ]
        for pair, by_clause in pairs.items():
            cell = {o: sum(c[o] for c in by_clause.values()) for o in OUTCOMES}
            lines.append(f"| {pair} | {cell['passed']} | {cell['failed']} | {cell['skipped']} |")
        lines.append("")
    profile = data.get("builtin_profile")
    if profile:
        from conformance.builtin_profile import render_markdown as render_profile

        lines += [
            "## The frameworks' own functions, as they are",
            "",
            "Not our backends: the raw functions called directly on fixtures that expose where "
            "frameworks differ, to show where each deviates from the spec. Information only: "
            "nothing here fails the run. ✅ what the spec requires, ❌ a deviation (what it does "
            "instead). Versions: "
            + ", ".join(f"{n} ({v})" for n, v in profile["functions"].items())
            + ".",
            "",
            *render_profile(profile),
            "",
        ]
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


def render_gradients(block_by_dtype: dict[str, dict], pictures: dict | None = None) -> list[str]:
    """The gradients section (SPEC §12): per dtype, each backend against the oracle on the
    gradient fixtures, every pair's max difference, and the heatmap."""
    pictures = pictures or {}
    if not any(block["vs_oracle"] for block in block_by_dtype.values()):
        return []
    lines = [
        "## Gradients: cross-framework agreement on the gradient fixtures (SPEC §12)",
        "",
        "Worst of dq, dk, dv and dmask against the 50-digit oracle over every `grad-*` fixture "
        "of that dtype the backend runs (absolute, in eps scaled by max(1, |expected|), as a "
        "fraction of the SPEC §12.9 tolerance), fixtures skipped for a missing capability, "
        "then every pair's max difference, absolute (above the diagonal) and in eps (below "
        "it), and as a heatmap. Only backends declaring `grad` appear.",
        "",
    ]
    for dtype, block in block_by_dtype.items():
        if not block["vs_oracle"]:
            continue
        lines += [
            f"### {dtype} gradients",
            "",
            "| backend | max abs error | max error / eps | max error / tolerance | skipped for |",
            "|---|---|---|---|---|",
        ]
        for b, e in block["vs_oracle"].items():
            lines.append(
                f"| {b} | {e['max_abs_error']:.3e} | {e['max_error_eps']:.2f} | "
                f"{e['max_fraction_of_tolerance']:.2f} | {', '.join(e['skipped_for']) or '·'} |"
            )
        names = list(block["vs_oracle"])
        if len(names) > 1:
            lines += [
                "",
                "| pair max difference: abs ╲ eps | " + " | ".join(names) + " |",
                "|---|" + "---|" * len(names),
            ]
            for i, a in enumerate(names):
                row = []
                for j, b in enumerate(names):
                    key = f"{a}~{b}" if f"{a}~{b}" in block["pairs"] else f"{b}~{a}"
                    if i == j:
                        row.append("·")
                    elif i < j:
                        row.append(f"{block['pairs'][key]:.1e}")
                    else:
                        row.append(f"{block['pairs_eps'][key]:.2f} eps")
                lines.append(f"| {a} | " + " | ".join(row) + " |")
        if f"gradient-heatmap-{dtype}" in pictures:
            picture = pictures[f"gradient-heatmap-{dtype}"]
            lines += ["", f"![{dtype} gradient agreement heatmap]({picture})"]
        lines.append("")
    return lines


MAX_FAILURES_SHOWN = 40


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
    parser.add_argument("--impl", help="your implementation, MODULE:ATTR (see --impl in pytest)")
    parser.add_argument("--impl-capabilities", help="capabilities of an --impl function")
    parser.add_argument("--impl-dtypes", help="dtypes of an --impl function")
    parser.add_argument("--impl-name", help="the --impl backend's name")
    parser.add_argument(
        "--out", type=Path, default=Path("report"), help="output directory (default: report/)"
    )
    parser.add_argument(
        "--no-builtin-profile",
        action="store_true",
        help="skip the frameworks' own functions on the edge cases",
    )
    args, extra = parser.parse_known_args(argv)
    from conformance.plugin import selected_backends

    class _Opts:
        def getoption(self, _name):
            return args.backend

    backends = selected_backends(_Opts())
    if args.impl:
        from conformance.impl import load_impl

        try:
            impl = load_impl(
                args.impl,
                name=args.impl_name,
                capabilities=args.impl_capabilities,
                dtypes=args.impl_dtypes,
            )
        except (BackendUnavailable, ValueError) as err:
            parser.error(str(err))
        # Registered in this process, so the in-process pytest run finds it by name.
        backends = list(dict.fromkeys([*backends, impl.name]))
    if not backends:
        parser.error("choose backends with --backend NAME, --backend all, or --impl MODULE:ATTR")
    for name in backends:
        try:
            load_backend(name)
        except BackendUnavailable as err:
            parser.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    code, rows = run_tests(backends, extra, args.out)
    summary = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    errors = error_matrix(backends)
    gradients = gradient_matrix(backends)
    profile = None
    if not args.no_builtin_profile:
        from conformance.builtin_profile import profile as run_profile

        profile = run_profile()
    data = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m conformance report " + " ".join(argv),
        "backends": backends,
        "versions": versions(backends),
        "exit_code": code,
        "summary": summary,
        "clauses": clause_table(rows),
        "errors": errors,
        "gradients": gradients,
        "builtin_profile": profile,
        "pictures": draw_pictures(args.out, errors, gradients),
        "tests": rows,
    }
    (args.out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (args.out / "report.md").write_text(render_markdown(data))
    print(f"wrote {args.out / 'report.md'}, report.json, junit.xml and pictures", file=sys.stderr)
    return code
