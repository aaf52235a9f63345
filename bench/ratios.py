"""``python -m conformance bench --ratios``: the flash backends' speed against torch-sdpa,
measured interleaved in one process, as issue 54 measures it.

    python -m conformance bench --ratios                        # T = S = 4096, about 3 min
    python -m conformance bench --ratios --T 1024 --repeats 3   # a quick look
    python -m conformance bench --ratios --settle 0             # no pause between calls

Each backend is loaded as a user gets it (``conformance.load_backend(name)``, its
defaults) and called through ``prepare`` (forward: ``attention``) or ``prepare_vjp``
(forward and backward: ``attention_vjp``), the NumPy inputs converted once outside the
timing, on q, k, v (B, H, T, D) float32 standard normal, causal and not. For each pass
and mask the backends take turns: one warm-up round (compilation, for JAX), then
``--repeats`` rounds, each backend called once per round, in the order given; a
backend's time is the minimum over its rounds. Ratio = torch-sdpa's time / the backend's
(above 1: faster than torch-sdpa). "cores busy" is the process CPU time of the backend's
timed calls over their wall time: how many of the machine's cores it kept working (2.0
on a 2-core machine is all of them; near 1.0, one core did the work while the other
waited). It is summed over the calls because Linux adds another thread's CPU time to the
process's total only at its scheduler tick (a few ms): over one call of a millisecond,
the ratio can read 10 or more. The
first line of the output names the machine, the libraries and the tree: a ratio is
comparable only with one measured on the same machine.

Interleaving keeps the backends' conditions alike (the machine's load drifts between
runs); the price is that one framework's worker threads, still spinning after its call,
slow the next backend's call on the same cores: OpenBLAS's threads (NumPy's matmul) poll
for 2^28 cycles (about 0.1 s) after their last task. ``--settle`` sleeps before each call
so that they have stopped; ``--settle 0`` shows what they cost.

The table is a measurement, not a test: no CI run fails on a ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import conformance

REFERENCE = "torch-sdpa"
BACKENDS = ("numpy-flash", "jax-flash", REFERENCE)

#: The ratios measured on the tree of 2026-12-04 (fd4b5cd) that issue 54 asks to keep
#: (the lower end of each range it quotes): (backend, pass) -> ratio to torch-sdpa.
PREVIOUS = {
    ("jax-flash", "forward"): 1.15,
    ("jax-flash", "vjp"): 0.83,
    ("numpy-flash", "forward"): 0.86,
    ("numpy-flash", "vjp"): 0.75,
}


def add_problem(p: argparse.ArgumentParser) -> None:
    """The problem's sizes, issue 54's by default: B = 1, H = 8, T = S = 4096, D = E = 64."""
    p.add_argument("--B", type=int, default=1, help="batch")
    p.add_argument("--H", type=int, default=8, help="heads (K = H: no grouping)")
    p.add_argument("--T", type=int, default=4096, help="T = S")
    p.add_argument("--D", type=int, default=64, help="head dim (E = D)")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m conformance bench --ratios",
        description="The ratio of torch-sdpa's time to each flash backend's, every call "
        "interleaved with the other backends' in one process (issue 54's measurement).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_problem(p)
    p.add_argument(
        "--repeats", type=int, default=5, help="timed rounds after the warm-up; the minimum counts"
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=list(BACKENDS),
        metavar="NAME",
        help=f"backends, called in this order each round ({REFERENCE} is always added)",
    )
    p.add_argument(
        "--passes",
        nargs="+",
        choices=("forward", "vjp"),
        default=["forward", "vjp"],
        help="attention (forward) and/or attention_vjp (forward and backward)",
    )
    p.add_argument(
        "--causal", choices=("both", "yes", "no"), default="both", help="which masks to run"
    )
    p.add_argument(
        "--settle",
        type=float,
        default=0.25,
        help="seconds to sleep before each timed call, so that the previous call's thread "
        "pools have gone idle: OpenBLAS's threads (NumPy's matmul) keep polling for 2^28 "
        "cycles after their last task (its THREAD_TIMEOUT default: about 0.1 s at 2.5 GHz, "
        "0.27 s at 1 GHz), and on a 2-core machine they take the cores from the next "
        "backend's call; 0 measures the calls back to back",
    )
    p.add_argument(
        "--goals",
        action="store_true",
        help="add the ratios issue 54 asks to keep (fd4b5cd's) and whether each is met",
    )
    return p.parse_args(argv)


def _calls(
    names: list[str], pass_: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool
) -> dict[str, Callable[[], object]]:
    """name -> a zero-argument call that returns once its result exists."""
    d_out = np.random.default_rng(1).standard_normal(q.shape, dtype=np.float32)
    calls = {}
    for name in names:
        backend = conformance.load_backend(name)
        if pass_ == "forward":
            calls[name] = backend.prepare(q, k, v, is_causal=causal)
        else:
            calls[name] = backend.prepare_vjp(q, k, v, d_out, is_causal=causal)
    return calls


def measure(args: argparse.Namespace) -> list[dict]:
    """One row per backend, pass and mask: its times (s), their minimum and the ratio."""
    names = [n for n in args.backends if n != REFERENCE] + [REFERENCE]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rng = np.random.default_rng(0)
    shape = (args.B, args.H, args.T, args.D)  # (B, H, T, D)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    rows = []
    for pass_ in args.passes:
        for causal in causals:
            calls = _calls(names, pass_, q, k, v, causal)
            times: dict[str, list[float]] = {n: [] for n in names}
            cores: dict[str, list[float]] = {n: [] for n in names}
            for round_ in range(1 + args.repeats):
                for name in names:
                    time.sleep(args.settle)
                    c0, t0 = time.process_time(), time.perf_counter()
                    calls[name]()
                    if round_:  # round 0 warms up
                        times[name].append(time.perf_counter() - t0)
                        cores[name].append(time.process_time() - c0)
            ref = min(times[REFERENCE])
            for name in names:
                best = min(times[name])
                rows.append(
                    {"backend": name, "pass": pass_, "causal": causal, "times_s": times[name],
                     "min_s": best, "ratio": ref / best,
                     "cores": sum(cores[name]) / sum(times[name])}
                )  # fmt: skip
            del calls
            print(f"{pass_}, causal={causal}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], goals: bool = False) -> str:
    """The rows as a Markdown table, the reference's own rows last."""
    head = "| backend | pass | causal | min ms | torch-sdpa ms | ratio | cores busy |"
    rule = "|---|---|---|---|---|---|---|"
    if goals:
        head += " fd4b5cd's | met |"
        rule += "---|---|"
    ref = {(r["pass"], r["causal"]): r["min_s"] for r in rows if r["backend"] == REFERENCE}
    lines = [head, rule]
    for r in sorted(rows, key=lambda r: r["backend"] == REFERENCE):
        line = (
            f"| {r['backend']} | {r['pass']} | {'yes' if r['causal'] else 'no'} "
            f"| {r['min_s'] * 1e3:.0f} | {ref[(r['pass'], r['causal'])] * 1e3:.0f} "
            f"| {r['ratio']:.2f} | {r['cores']:.1f} |"
        )
        if goals:
            goal = PREVIOUS.get((r["backend"], r["pass"]))
            line += (
                " - | - |"
                if goal is None
                else f" {goal:.2f} | {'yes' if r['ratio'] >= goal else 'no'} |"
            )
        lines.append(line)
    return "\n".join(lines)


def machine() -> str:
    """The machine and the libraries a ratio was measured on: ratios from two machines are
    not comparable (torch-sdpa's CPU kernel uses AVX-512 where the processor has it, and
    took 148 ms on one machine where it took 240 ms on another, at the same call)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(
                line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line
            )
        model = info.get("model name\t", model).strip()
        flags = set(info.get("flags\t\t", "").split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "amx_tile") if f in flags]
    versions = []
    for lib in ("numpy", "jax", "torch"):
        try:
            versions.append(f"{lib} {__import__(lib).__version__}")
        except ImportError:
            pass
    try:
        tree = subprocess.run(
            ["git", "-C", os.path.dirname(conformance.__file__), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        tree = ""
    return (
        f"machine: {model}, {os.cpu_count()} cores, {' '.join(simd) or 'no AVX2'}; "
        f"{', '.join(versions)}; tree {tree or 'not a git checkout'}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance bench --ratios [options]``; returns the exit status."""
    args = _parse(argv)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    rows = measure(args)
    print(
        f"B={args.B} H={args.H} T=S={args.T} D={args.D} float32, min of {args.repeats} "
        f"after a warm-up, interleaved, settle {args.settle:g} s; load average (1 min) "
        f"{load:.2f} before, {os.getloadavg()[0]:.2f} after; {time.perf_counter() - t0:.0f} s"
    )
    print(machine())
    print(table(rows, args.goals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
