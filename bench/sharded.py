"""Ring attention across P devices: per-device memory, bytes sent, causal load balance.

    python -m conformance.bench.sharded                      # T = S = 4096, 16384; P = 1, 2, 4, 8
    python -m conformance.bench.sharded --lengths 4096 16384 65536 --out docs/benchmark-sharded
    python -m conformance.bench.sharded --lengths 4096 --run  # also one timed call

A command, not a test. For each P, T = S and layout, on P simulated CPU devices
(``jax_num_cpu_devices = 8``), float32, B = 1, H = 8, D = E = 64, causal:

- per-device memory: XLA's own accounting of the compiled per-device program
  (``compiled.memory_analysis()``: arguments + outputs + temporaries, in bytes), which
  should fall as 1/P: O((T/P)·(D + E)) for the slices plus one (T/P) × (S/P) score block;
- bytes each device sends per pass: measured from the compiled program (the operands of
  its ``collective-permute`` instructions, times the P − 1 trips of the ring loop) and
  the formula (P − 1) · (S/P) · (K·(D + E)·4 + 4) (keys, values and their int32
  positions);
- causal load balance: the number of (query piece, key piece) blocks each device
  computes, counted with the very predicate the ring uses to skip a block, for the
  contiguous and zigzag layouts (most and least per device).

Compiling needs no run (nothing of that size is allocated); ``--run`` also times one
call. Wall time on simulated devices that share a few CPU cores is not a speed result: it
is reported as such. ``--out DIR`` writes ``results.json``, ``results.md`` and, with
matplotlib, ``memory_vs_P.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

DTYPE_BYTES = {"f32": 4, "f64": 8, "s32": 4, "bf16": 2, "f16": 2, "pred": 1}


def _permute_bytes(hlo: str) -> int:
    """Bytes moved by the collective-permute instructions of one compiled program."""
    total = 0
    for line in hlo.splitlines():
        if "collective-permute(" not in line and "collective-permute-start(" not in line:
            continue
        shape = line.split("=", 1)[1].strip().split(" ", 1)[0]
        for dtype, dims in re.findall(r"(f32|f64|s32|bf16|f16|pred)\[([0-9,]*)\]", shape):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            total += n * DTYPE_BYTES[dtype]
            if "collective-permute-start(" in line:
                break  # the async start's tuple repeats the operand; count it once
    return total


def _blocks(P: int, T: int, layout: str) -> list[int]:
    """Blocks each device computes under top-left causality (T = S), as the ring decides."""
    from conformance.impls.jax.ring_layout import Ring

    class Run:
        mask = sinks = slopes = docs = chunk = None
        scale, softcap, is_causal, offset, window = 1.0, None, True, 0, None

    run = Run()
    run.T = run.S = T
    ring = Ring(run, P, layout)
    pos = ring.perm["t"].reshape(P, ring.pieces, -1)  # (P, pieces, chunk)
    counts = []
    for me in range(P):
        n = 0
        for step in range(P):
            src = (me - step) % P
            for a in range(ring.pieces):
                for b in range(ring.pieces):
                    t, s = pos[me, a], pos[src, b]
                    n += bool(((s[None, :] <= t[:, None]) & (t[:, None] < T)).any())
        counts.append(n)
    return counts


def main(argv: list[str] | None = None) -> None:
    # The results name the command that made them, arguments included.
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[4096, 16384], help="T = S values"
    )
    parser.add_argument(
        "--shards", type=int, nargs="+", default=[1, 2, 4, 8], help="device counts P"
    )
    parser.add_argument(
        "--run", action="store_true", help="also time one call (not a speed result)"
    )
    parser.add_argument("--out", type=Path, help="write results.json, results.md and a plot here")
    args = parser.parse_args(argv)
    rows = []

    import jax
    from conformance.impls.jax import ring as jax_ring
    from conformance.impls.jax.ring_layout import Ring, prepare

    jax_ring.host_devices(max(args.shards))
    B, H, K, D, E = 1, 8, 8, 64, 64
    print("per device, float32, B=1 H=K=8 D=E=64, causal; memory from XLA's memory_analysis")
    print(
        f"{'T=S':>6} {'P':>2} {'layout':>10} {'memory MiB':>10} {'sent MiB':>9} "
        f"{'formula MiB':>11} {'blocks max/min':>14}" + (" wall s (not speed)" if args.run else "")
    )
    for T in args.lengths:
        rng = np.random.default_rng(0)
        q = rng.standard_normal((B, H, T, D), dtype=np.float32)
        k = rng.standard_normal((B, K, T, D), dtype=np.float32)
        v = rng.standard_normal((B, K, T, E), dtype=np.float32)
        for P in args.shards:
            for layout in ("contiguous", "zigzag"):
                run = prepare(q, k, v, None, is_causal=True)
                ring = Ring(run, P, layout)
                fn = jax_ring.ring_fn(ring.mesh, **ring.static)
                placed = ring.put(run)
                compiled = fn.lower(*placed).compile()
                mem = compiled.memory_analysis()
                per_device = (
                    mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                )
                sent = _permute_bytes(compiled.as_text()) * (P - 1)
                Sl = len(ring.perm["s"]) // P
                formula = (P - 1) * Sl * (K * (D + E) * 4 + 4)
                blocks = _blocks(P, T, layout)
                line = (
                    f"{T:>6} {P:>2} {layout:>10} {per_device / 2**20:>10.1f} "
                    f"{sent / 2**20:>9.2f} {formula / 2**20:>11.2f} "
                    f"{max(blocks):>7}/{min(blocks):<6}"
                )
                row = {
                    "T": T, "P": P, "layout": layout, "memory_bytes": per_device,
                    "sent_bytes": sent, "formula_bytes": formula,
                    "blocks_max": max(blocks), "blocks_min": min(blocks),
                }  # fmt: skip
                if args.run:
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*placed))
                    row["wall_s_not_speed"] = time.perf_counter() - start
                    line += f" {row['wall_s_not_speed']:>8.2f}"
                rows.append(row)
                print(line, flush=True)
    if args.out:
        _write(args.out, rows, argv)


def _write(out: Path, rows: list[dict], argv: list[str] | None) -> None:
    import jax

    out.mkdir(parents=True, exist_ok=True)
    command = "python -m conformance.bench.sharded " + " ".join(argv or [])
    (out / "results.json").write_text(
        json.dumps({"command": command, "jax": jax.__version__, "rows": rows}, indent=1) + "\n"
    )
    lines = [
        "# Ring attention across P devices (jax-ring)",
        "",
        f"`{command}` (jax {jax.__version__}; simulated CPU devices). Per device, float32, "
        "B = 1, H = K = 8, D = E = 64, causal. Memory: XLA's `memory_analysis()` of the "
        "compiled per-device program (arguments + outputs + temporaries); sent: the "
        "`collective-permute` operands of the compiled program times the P − 1 ring steps, "
        "beside the formula (P − 1)·(S/P)·(K·(D + E)·4 + 4); blocks: (query piece, key "
        "piece) blocks a device computes, most/least over devices.",
        "",
        "| T = S | P | layout | memory MiB | sent MiB | formula MiB | blocks max/min |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['P']} | {r['layout']} | {r['memory_bytes'] / 2**20:.1f} | "
            f"{r['sent_bytes'] / 2**20:.2f} | {r['formula_bytes'] / 2**20:.2f} | "
            f"{r['blocks_max']}/{r['blocks_min']} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for T in sorted({r["T"] for r in rows}):
        pts = [
            (r["P"], r["memory_bytes"] / 2**20)
            for r in rows
            if r["T"] == T and r["layout"] == "zigzag"
        ]
        ax.plot(*zip(*pts), marker="o", label=f"T = S = {T}")
    Ps = sorted({r["P"] for r in rows})
    ax.set(xscale="log", yscale="log", xlabel="P devices", ylabel="per-device memory (MiB)")
    ax.set_xticks(Ps, [str(P) for P in Ps])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_title("jax-ring, causal, zigzag: XLA memory_analysis per device")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "memory_vs_P.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
