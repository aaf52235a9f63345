"""Write the benchmark's rows as CSV, JSON, a Markdown summary and log-log plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

COLUMNS = [
    "backend",
    "pass",
    "causal",
    "B",
    "H",
    "T",
    "S",
    "D",
    "status",
    "time_ms",
    "min_ms",
    "gflop",
    "gflops",
    "vs_torch_sdpa",
    "first_call_s",
    "peak_mib",
    "extra_mib",
    "tracemalloc_extra_mib",
    "method",
    "reason",
    "memory_error",
    "note",
]


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _markdown(rows: list[dict], env: dict) -> str:
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    sizes = sorted({r["T"] for r in rows})
    cell = {(r["backend"], r["T"], r["causal"], r.get("pass", "forward")): r for r in rows}
    a = env["args"]
    lines = [
        "# Attention benchmark",
        "",
        f"float32, B={a['B']}, H={a['H']}, D={a['D']}, T = S; median of {a['repeats']} "
        f"calls (fewer past {a.get('budget_s')} s of timed calls) after a warm-up, each backend and size in its own process. CPUs: {env['cpu_count']}, "
        f"torch threads: {env.get('torch_threads')}, numpy {env['numpy']}, torch "
        f"{env['torch']}, jax {env['jax']}, XLA_FLAGS={env['XLA_FLAGS']!r}; load average "
        f"(1 min) at the end: {env.get('loadavg_1min')}."
        + (
            " That is more than the CPUs: other work skewed these figures, threaded BLAS "
            "(the NumPy backends) most of all."
            if (env.get("loadavg_1min") or 0) > (env["cpu_count"] or 1)
            else ""
        ),
        "",
        "Nominal FLOPs: 4·B·H·D per (query, key) pair the mask lets through: 4·B·H·T·S·D "
        "without a mask, 4·B·H·D·T(T+1)/2 causal; forward + backward (`attention_vjp`) "
        "3.5 times that, the backward counted as 2.5 forwards, as FlashAttention's "
        "benchmark counts it. Cells: time in ms, GFLOP/s, and the throughput ratio to "
        "torch-sdpa in the same run and pass (> 1 is faster).",
        "",
        "Every backend is timed through `conformance.load_backend(name)`, in its default "
        "configuration, via `backend.prepare(q, k, v, is_causal=...)` (inputs converted "
        "once, outside the timing). Notes:",
        "",
    ]
    notes = {r["backend"]: r.get("note", "") for r in rows}
    lines += [f"- `{b}`: {note}" for b, note in notes.items() if note]
    lines.append("")
    passes = [
        p for p in ("forward", "backward") if any(r.get("pass", "forward") == p for r in rows)
    ]
    for pass_, causal in [(p, c) for p in passes for c in sorted({r["causal"] for r in rows})]:
        mask = "causal" if causal else "non-causal"
        title = mask.capitalize() if pass_ == "forward" else f"Forward + backward, {mask}"
        lines += [f"## {title}: time", ""]
        lines += ["| backend | " + " | ".join(f"T={T}" for T in sizes) + " |"]
        lines += ["|---" * (len(sizes) + 1) + "|"]
        for b in backends:
            if not any((b, T, causal, pass_) in cell for T in sizes):
                continue
            cells = []
            for T in sizes:
                r = cell.get((b, T, causal, pass_))
                if r is None:
                    cells.append("")
                elif r["status"] != "ok":
                    cells.append("skipped")
                else:
                    ratio = r.get("vs_torch_sdpa")
                    cells.append(
                        f"{r['time_ms']:.1f} ms, {r['gflops']:.0f} GF/s"
                        + (f", ×{ratio:.2f}" if ratio else "")
                    )
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _memory_section(rows, backends, sizes, cell)
    lines += _skipped_section(rows)
    errors = [r for r in rows if "memory_error" in r]
    for r in errors:
        lines.append(f"- memory {r['backend']} T={r['T']}: {r['memory_error']}")
    return "\n".join(lines) + "\n"


def _memory_section(rows: list[dict], backends: list, sizes: list, cell: dict) -> list[str]:
    """The peak-memory table, for the rows that measured memory."""
    lines: list[str] = []
    mem_rows = [r for r in rows if "extra_mib" in r or "memory_error" in r]
    if mem_rows:
        lines += [
            "## Peak memory of one call, beyond inputs and outputs (MiB)",
            "",
            "Each in its own process: VmHWM reset after a warm-up call, minus VmRSS before "
            "the call, minus the output's bytes (glibc mmap threshold pinned so freed "
            "temporaries leave the resident set). NumPy backends: tracemalloc's figure in "
            "brackets.",
            "",
        ]
        lines += ["| backend | pass | causal | " + " | ".join(f"T={T}" for T in sizes) + " |"]
        lines += ["|---" * (len(sizes) + 3) + "|"]
        mem_keys = {(r.get("pass", "forward"), r["causal"]) for r in mem_rows}
        for pass_, causal in sorted(mem_keys, key=lambda x: (x[0] != "forward", x[1])):
            for b in backends:
                cells = []
                for T in sizes:
                    r = cell.get((b, T, causal, pass_), {})
                    if "extra_mib" in r:
                        tm = r.get("tracemalloc_extra_mib")
                        cells.append(
                            f"{r['extra_mib']:.1f}" + (f" [{tm:.1f}]" if tm is not None else "")
                        )
                    elif "memory_error" in r:
                        cells.append("error")
                    else:
                        cells.append("")
                if any(cells):
                    lines.append(f"| {b} | {pass_} | {causal} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _skipped_section(rows: list[dict]) -> list[str]:
    """One line per backend, pass and reason that was skipped, with its sizes."""
    lines: list[str] = []
    skipped = [r for r in rows if r["status"] != "ok"]
    if skipped:
        lines += ["## Skipped", ""]
        seen = set()
        for r in skipped:
            key = (r["backend"], r.get("pass"), r["reason"])
            if key not in seen:
                seen.add(key)
                sizes_b = sorted(
                    {x["T"] for x in skipped if (x["backend"], x.get("pass"), x["reason"]) == key}
                )
                what = " (backward)" if r.get("pass") == "backward" else ""
                lines.append(f"- {r['backend']}{what} at T={sizes_b}: {r['reason']}")
        lines.append("")
    return lines


def _plots(rows: list[dict], out: Path) -> None:
    """time_vs_T.png and memory_vs_T.png for the forward; with backward rows, the same
    two plots of ``attention_vjp`` (forward + backward) as *_backward.png."""
    for pass_, suffix, what in (
        ("forward", "", ""),
        ("backward", "_backward", "forward + backward, "),
    ):
        selected = [r for r in rows if r.get("pass", "forward") == pass_]
        if selected:
            _pass_plots(selected, out, suffix, what)


def _pass_plots(rows: list[dict], out: Path, suffix: str, what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(dict.fromkeys(r["backend"] for r in rows))
    causals = sorted({r["causal"] for r in rows})
    fig, axes = plt.subplots(1, len(causals), figsize=(6.5 * len(causals), 5), squeeze=False)
    for ax, causal in zip(axes[0], causals):
        for b in backends:
            pts = sorted(
                (r["T"], r["time_ms"])
                for r in rows
                if r["backend"] == b and r["causal"] == causal and r["status"] == "ok"
            )
            if pts:
                ax.loglog(*zip(*pts), marker="o", label=b, base=2)
        ax.set_title(f"{what}{'causal' if causal else 'non-causal'}, float32")
        ax.set_xlabel("T = S")
        ax.set_ylabel("median time per call (ms)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"time_vs_T{suffix}.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 5))
    for b in backends:
        pts = sorted(
            (r["T"], max(r["extra_mib"], 0.01))
            for r in rows
            if r["backend"] == b and "extra_mib" in r and not r["causal"]
        )
        if pts:
            ax.loglog(*zip(*pts), marker="o", label=b, base=2)
    ax.set_title(f"{what}peak memory beyond inputs and outputs, non-causal")
    ax.set_xlabel("T = S")
    ax.set_ylabel("MiB")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"memory_vs_T{suffix}.png", dpi=120)
    plt.close(fig)


def write(rows: list[dict], env: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.json", "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in COLUMNS})
    (out / "results.md").write_text(_markdown(rows, env))
    _plots(rows, out)
