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

from conformance.bench.backends import BACKENDS, flops

SIZES = (512, 1024, 2048, 4096, 8192, 16384)
REFERENCE = "torch-sdpa"
GIB = 2**30


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Time and peak memory of every attention backend (float32, T = S).",
    )
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="T = S values")
    p.add_argument(
        "--backends",
        nargs="+",
        default=list(BACKENDS),
        choices=list(BACKENDS),
        metavar="NAME",
        help=f"subset of: {' '.join(BACKENDS)}",
    )
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per backend and size")
    p.add_argument(
        "--causal", choices=("both", "yes", "no"), default="both", help="which masks to run"
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
        help="skip a backend whose estimated memory exceeds this (default: half of MemAvailable)",
    )
    p.add_argument(
        "--max-call-seconds",
        type=float,
        default=20.0,
        help="skip a size whose predicted call time (previous size's × (T/T_prev)²) exceeds this",
    )
    p.add_argument("--block-q", type=int, help="block_q for the flash backends")
    p.add_argument("--block-k", type=int, help="block_k for the flash backends")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--no-progress", action="store_true")
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


def _worker(name: str, args: argparse.Namespace, T: int, causal: bool, memory: bool) -> dict:
    """Run bench.worker for one backend, size and mask in a fresh process."""
    cmd = [sys.executable, "-m", "conformance.bench.worker", "--backend", name]
    cmd += ["--B", str(args.B), "--H", str(args.H), "--T", str(T), "--D", str(args.D)]
    cmd += ["--repeats", str(args.repeats)]
    cmd += ["--causal"] if causal else []
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


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    from tqdm import tqdm

    mem_limit = args.mem_limit_gib * GIB if args.mem_limit_gib else _mem_available() / 2
    B, H, D = args.B, args.H, args.D
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    names = list(args.backends)
    missing = {n: BACKENDS[n].installed() for n in names}
    rows: list[dict] = []
    last_time: dict[tuple[str, bool], tuple[int, float]] = {}
    plan = [(T, c, n) for T in sorted(args.sizes) for c in causals for n in names]
    bar = tqdm(plan, disable=args.no_progress, unit="run", dynamic_ncols=True)
    for T, causal, name in bar:
        bar.set_description(f"T={T} {'causal' if causal else 'full'} {name}")
        row = {
            "backend": name,
            "B": B,
            "H": H,
            "T": T,
            "S": T,
            "D": D,
            "causal": causal,
            "gflop": flops(B, H, T, D, causal) / 1e9,
            "status": "ok",
            "reason": "",
        }
        rows.append(row)
        reason = missing[name]
        est = BACKENDS[name].memory_estimate(B, H, T, T, D)
        if reason is None and est > mem_limit:
            reason = (
                f"estimated {est / GIB:.1f} GiB > limit {mem_limit / GIB:.1f} GiB "
                f"({BACKENDS[name].bytes_per_score} B per score x B·H·T·S)"
            )
        prev = last_time.get((name, causal))
        if reason is None and prev is not None:
            predicted = prev[1] * (T / prev[0]) ** 2
            if predicted > args.max_call_seconds:
                reason = (
                    f"predicted {predicted:.0f} s per call > --max-call-seconds "
                    f"{args.max_call_seconds:g}"
                )
        if reason is None:
            memory = args.memory == "all" or (args.memory == "noncausal" and not causal)
            result = _worker(name, args, T, causal, memory)
            if "error" in result:
                reason = result["error"]
            else:
                row.update(result)
                row["time_ms"] = result["median_s"] * 1e3
                row["min_ms"] = min(result["times"]) * 1e3
                row["gflops"] = row["gflop"] / result["median_s"]
                last_time[(name, causal)] = (T, result["median_s"])
        if reason is not None:
            row["status"], row["reason"] = "skipped", reason
    bar.close()

    # Ratios of throughput to torch-sdpa at the same size and mask (> 1: faster).
    ref = {(r["T"], r["causal"]): r.get("time_ms") for r in rows if r["backend"] == REFERENCE}
    for r in rows:
        ref_t = ref.get((r["T"], r["causal"]))
        r["vs_torch_sdpa"] = ref_t / r["time_ms"] if ref_t and "time_ms" in r else None

    from conformance.bench.report import write

    env = _environment(args)
    write(rows, env, args.out)
    print(f"wrote {args.out}/results.{{csv,json,md}}, time_vs_T.png, memory_vs_T.png")
    print((args.out / "results.md").read_text())
