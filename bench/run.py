"""The benchmark driver: one worker process per backend, size and mask; then CSV, JSON,
Markdown and plots. See the package docstring for the method."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from conformance.bench import backends

SIZES = (512, 1024, 2048, 4096, 8192, 16384)
REFERENCE = "torch-sdpa"
GIB = 2**30


def _parse(argv: list[str] | None) -> argparse.Namespace:
    names = backends.names()
    p = argparse.ArgumentParser(
        prog="python -m conformance bench",
        description="Time and peak memory of every attention backend (float32, T = S), "
        "each through conformance.load_backend, beside two anchors: the frameworks' own "
        "functions called directly.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="T = S values")
    p.add_argument(
        "--backends",
        nargs="+",
        default=backends.default_names(),
        choices=names,
        metavar="NAME",
        help=f"backends and anchors to time, from: {' '.join(names)}",
    )
    p.add_argument("--B", type=int, default=1, help="batch")
    p.add_argument("--H", type=int, default=8, help="heads (K = H: no grouping)")
    p.add_argument("--D", type=int, default=64, help="head dim (E = D)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per backend and size")
    p.add_argument(
        "--budget-s",
        type=float,
        default=30.0,
        help="stop repeating (after at least one timed call) once a backend's timed calls "
        "at one size have taken this long",
    )
    p.add_argument(
        "--causal", choices=("both", "yes", "no"), default="both", help="which masks to run"
    )
    p.add_argument(
        "--passes",
        choices=("forward", "backward", "both"),
        default="forward",
        help="what to time: attention (forward), attention_vjp (forward + backward, for "
        "the backends that declare 'grad'), or both",
    )
    p.add_argument(
        "--memory",
        choices=("noncausal", "all", "off"),
        default="noncausal",
        help="which runs also get a peak-memory subprocess",
    )
    p.add_argument(
        "--mem-limit-gib",
        type=float,
        default=None,
        help="skip a backend whose estimated memory exceeds this; None: half of MemAvailable",
    )
    p.add_argument(
        "--max-call-seconds",
        type=float,
        default=20.0,
        help="skip a size whose predicted call time (previous size's × (T/T_prev)²) exceeds this",
    )
    p.add_argument(
        "--block-q", type=int, help="block_q for the blockwise backends; None: their defaults"
    )
    p.add_argument(
        "--block-k", type=int, help="block_k for the blockwise backends; None: their defaults"
    )
    p.add_argument(
        "--out", type=Path, default=Path("bench/results"), help="where results go (made if absent)"
    )
    p.add_argument(
        "--ratios",
        action="store_true",
        help="instead: the flash backends' ratios to torch-sdpa, interleaved in one process "
        "(issue 54's measurement; its options: python -m conformance bench --ratios --help)",
    )
    p.add_argument(
        "--ceilings",
        action="store_true",
        help="instead: the best ratio to torch-sdpa each flash backend could reach with its "
        "products at its framework's fastest matmul rate on this machine (options: python "
        "-m conformance bench --ceilings --help)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress at all (without a terminal there is no bar, one line per run)",
    )
    return p.parse_args(argv)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


def _environment(args: argparse.Namespace) -> dict:
    env = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        # Other work on the same cores skews every figure (threaded BLAS most of all).
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    for mod in ("numpy", "torch", "jax"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    try:
        import torch

        env["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    env["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return env


def _worker(
    name: str, args: argparse.Namespace, T: int, causal: bool, memory: bool, backward: bool
) -> dict:
    """Run bench.worker for one backend, size, mask and pass in a fresh process."""
    cmd = [sys.executable, "-m", "conformance.bench.worker", "--backend", name]
    cmd += ["--B", str(args.B), "--H", str(args.H), "--T", str(T), "--D", str(args.D)]
    cmd += ["--repeats", str(args.repeats), "--budget-s", str(args.budget_s)]
    cmd += ["--causal"] if causal else []
    cmd += ["--backward"] if backward else []
    cmd += [] if memory else ["--no-memory"]
    for flag, val in (("--block-q", args.block_q), ("--block-k", args.block_k)):
        if val is not None:
            cmd += [flag, str(val)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write(rows: list[dict], args: argparse.Namespace) -> None:
    """Add the ratios of throughput to torch-sdpa at the same size and mask (> 1: faster),
    then write the tables and plots."""
    from conformance.bench.report import write

    ref = {
        (r["pass"], r["T"], r["causal"]): r.get("time_ms")
        for r in rows
        if r["backend"] == REFERENCE
    }
    for r in rows:
        ref_t = ref.get((r["pass"], r["T"], r["causal"]))
        r["vs_torch_sdpa"] = ref_t / r["time_ms"] if ref_t and "time_ms" in r else None
    write(rows, _environment(args), args.out)


class _Progress:
    """A tqdm bar on a terminal; one plain line per finished run in a log (no flood of
    carriage-return redraws); nothing with --no-progress."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="run", dynamic_ncols=True)
            except ImportError:
                pass

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label)

    def finish(self, label: str, row: dict) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        elif self.enabled:
            what = f"{row['time_ms']:.1f} ms" if row["status"] == "ok" else row["reason"]
            print(f"[{self.done}/{self.total}] {label}: {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance bench [options]``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if "--ratios" in argv:
        from conformance.bench import ratios

        return ratios.main([a for a in argv if a != "--ratios"])
    if "--ceilings" in argv:
        from conformance.bench import ceilings

        return ceilings.main([a for a in argv if a != "--ceilings"])
    args = _parse(argv)
    mem_limit = args.mem_limit_gib * GIB if args.mem_limit_gib else _mem_available() / 2
    B, H, D = args.B, args.H, args.D
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    passes = {"both": ("forward", "backward")}.get(args.passes, (args.passes,))
    names = list(args.backends)
    missing = {n: backends.installed(n) for n in names}
    rows: list[dict] = []
    last_time: dict[tuple[str, bool, str], tuple[int, float]] = {}
    plan = [
        (T, c, n, p) for T in sorted(args.sizes) for p in passes for c in causals for n in names
    ]
    progress = _Progress(len(plan), enabled=not args.no_progress)
    for T, causal, name, pass_ in plan:
        backward = pass_ == "backward"
        label = f"T={T} {'causal' if causal else 'full'} {name}" + (" backward" if backward else "")
        progress.start(label)
        row = {
            "backend": name,
            "pass": pass_,
            "note": backends.NOTES.get(name, ""),
            "B": B,
            "H": H,
            "T": T,
            "S": T,
            "D": D,
            "causal": causal,
            "gflop": backends.flops(B, H, T, D, causal, backward) / 1e9,
            "status": "ok",
            "reason": "",
        }
        rows.append(row)
        reason = missing[name] or (backends.backward_reason(name) if backward else None)
        est = backends.memory_estimate(name, B, H, T, T, D, backward)
        if reason is None and est > mem_limit:
            reason = (
                f"estimated {est / GIB:.1f} GiB > limit {mem_limit / GIB:.1f} GiB "
                f"({backends.BYTES_PER_SCORE.get(name, 0)} B per score x B·H·T·S)"
            )
        prev = last_time.get((name, causal, pass_))
        if reason is None and prev is not None:
            predicted = prev[1] * (T / prev[0]) ** 2
            if predicted > args.max_call_seconds:
                reason = (
                    f"predicted {predicted:.0f} s per call > --max-call-seconds "
                    f"{args.max_call_seconds:g}"
                )
        if reason is None:
            memory = args.memory == "all" or (args.memory == "noncausal" and not causal)
            result = _worker(name, args, T, causal, memory, backward)
            if "error" in result:
                reason = result["error"]
            else:
                row.update(result)
                row["time_ms"] = result["median_s"] * 1e3
                row["min_ms"] = min(result["times"]) * 1e3
                row["gflops"] = row["gflop"] / result["median_s"]
                last_time[(name, causal, pass_)] = (T, result["median_s"])
        if reason is not None:
            row["status"], row["reason"] = "skipped", reason
        progress.finish(label, row)
        if len(rows) < len(plan) and plan[len(rows)][0] != T:
            _write(rows, args)  # each finished size is on disk, in case the run is cut short
    progress.close()
    _write(rows, args)
    plots = "time_vs_T.png, memory_vs_T.png" + (
        ", memory_vs_T_backward.png" if "backward" in passes else ""
    )
    print(f"wrote {args.out}/results.{{csv,json,md}}, {plots}")
    print((args.out / "results.md").read_text())
    return 0
