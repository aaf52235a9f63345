"""``python -m conformance bench --ceilings``: whether issue 54's ratios can be reached on
this machine at all, by any arrangement of the flash backends' tiles.

    python -m conformance bench --ceilings                        # T = S = 4096, about 2 min
    python -m conformance bench --ceilings --T 1024 --repeats 3   # a quick look

A flash backend's forward makes two products per tile, Q·Kᵀ and P·V; its vjp makes those
two again and five more (FlashAttention's count: a backward is 2.5 forwards), whatever its
tiles. However the tiles are cut, each product has the head dim D on one side: Q·Kᵀ, and
the backward's dO·Vᵀ, contract over it (an (M, D) · (D, N) product), and P·V, dPᵀ·dO,
dS·K and dSᵀ·Q yield D columns (an (M, N) · (N, D) product). That is 3 of the vjp's 7 and
1 of the forward's 2 contracting over D. Their FLOPs, 2·B·H·T·S·D per product (times
(T + 1) / 2T under a causal mask, the fraction of scores a query may see at T = S, which
a perfect skipping of masked tiles would compute), divided by the fastest rate the
framework's matmul reaches on products of that kind on this machine, set a floor on the
backend's time. The rates are measured here, on the backends' own tiles, on 1024-square
tiles and on the whole (T, S) products, each timed over back-to-back calls as a flash
loop makes them. The floor adds one exponential per score a query may see (two in the
vjp), at the framework's measured rate per core, spread over every core; it counts
nothing else: no maximum, no mask, no loop. A square product, which BLAS libraries run
fastest, is measured beside them for scale; no attention product has its shape.

The ceiling is torch-sdpa's measured time over that floor: the most a backend built on
that framework's matmul could reach, were the rest of its work free. A goal above the
ceiling cannot be met on this machine by changing the backend; only a faster product
(another library's matmul, another processor) could. torch-sdpa's own row shows its
work over its time, as a rate to set beside the frameworks' matmuls.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import numpy as np
from conformance.bench import ratios

#: The framework whose matmul each flash backend's products run on, and its default tiles
#: (Tb queries × Sb keys per tile, as its page's ``attention`` defaults give them).
BACKENDS = {"numpy-flash": ("numpy", 256, 512), "jax-flash": ("jax", 512, 256)}
FRAMEWORKS = ("numpy", "jax", "torch")
#: How many of a pass's products, each 2·B·H·T·S·D FLOPs, contract over D and how many
#: yield D columns (the module's docstring).
PRODUCTS = {"forward": {"contracts D": 1, "yields D": 1}, "vjp": {"contracts D": 3, "yields D": 4}}
#: The exponentials of a pass per score a query may see: the forward's, and the
#: backward's again (it recomputes the weights; storing them would cost a (T, S) matrix).
EXPS = {"forward": 1, "vjp": 2}
#: The side of the square tiles measured beside each backend's own.
SQUARE_TILE = 1024


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m conformance bench --ceilings",
        description="The fastest each framework multiplies matrices on this machine, and the "
        "best ratio to torch-sdpa a flash backend could reach with its products at that rate "
        "and nothing else costing time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ratios.add_problem(p)
    p.add_argument("--square", type=int, default=2048, help="the square product's side")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed rounds of each product (of back-to-back calls) and of torch-sdpa's "
        "passes; the minimum counts",
    )
    p.add_argument(
        "--settle", type=float, default=0.25, help="as for --ratios: seconds before each call"
    )
    return p.parse_args(argv)


def products(args: argparse.Namespace) -> dict[str, tuple[str, tuple[int, int, int, int]]]:
    """name -> (kind, (batch, M, K, N)) of a batched (M, K) · (K, N) product; the kind is
    "contracts D" (K = D), "yields D" (N = D) or "square"."""
    BH, T, D, n = args.B * args.H, args.T, args.D, args.square
    shapes = {}
    tiles = {name: (Tb, Sb) for name, (_, Tb, Sb) in BACKENDS.items()}
    tiles[f"{SQUARE_TILE}-square"] = (SQUARE_TILE, SQUARE_TILE)
    tiles["whole"] = (T, T)
    for name, (Tb, Sb) in tiles.items():
        Tb, Sb = min(Tb, T), min(Sb, T)
        # (B·H, Tb, D) · (B·H, D, Sb): Q·Kᵀ's kind; (B·H, Tb, Sb) · (B·H, Sb, E): P·V's.
        shapes[f"{name} Q·Kᵀ"] = ("contracts D", (BH, Tb, D, Sb))
        shapes[f"{name} P·V"] = ("yields D", (BH, Tb, Sb, D))
    shapes[f"square {n}"] = ("square", (1, n, n, n))
    return shapes


def _product(framework: str, shape: tuple[int, int, int, int], transposed: bool):
    """(call, wait): a zero-argument call of the framework's own matmul on float32
    operands of this shape, made outside the timing, and what waits for its result (JAX
    returns before the product exists, and queues the next call behind it, as a compiled
    loop runs its products back to back). ``transposed`` stores the right operand as
    (batch, N, K), as keys are stored (Q·Kᵀ reads K so). NumPy and torch write into one
    output, so no call pays for fresh pages."""
    batch, M, K, N = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((batch, M, K), dtype=np.float32)  # (batch, M, K)
    b = rng.standard_normal((batch, N, K) if transposed else (batch, K, N), dtype=np.float32)
    if framework == "numpy":
        out = np.empty((batch, M, N), dtype=np.float32)  # (batch, M, N)
        right = b.transpose(0, 2, 1) if transposed else b  # (batch, K, N)
        return (lambda: np.matmul(a, right, out=out)), _done
    if framework == "torch":
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        tb = tb.transpose(1, 2) if transposed else tb  # (batch, K, N)
        out = torch.empty((batch, M, N), dtype=torch.float32)  # (batch, M, N)
        return (lambda: torch.matmul(ta, tb, out=out)), _done
    import jax
    import jax.numpy as jnp

    ja, jb = jax.device_put(a), jax.device_put(b)
    # The backends' own einsums, at the precision they ask for.
    spec = "bmk,bnk->bmn" if transposed else "bmk,bkn->bmn"
    product = jax.jit(lambda a, b: jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST))
    return (lambda: product(ja, jb)), jax.block_until_ready


def _done(result: object) -> object:
    """NumPy's and torch's products exist once their call returns."""
    return result


def _fastest(
    call: Callable[[], object],
    wait: Callable[[object], object],
    repeats: int,
    settle: float,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The least ``clock`` time of one call, in seconds: each of ``repeats`` rounds makes
    back-to-back calls for about 0.1 s of wall time (at least one), after two warm-up
    calls, as a flash loop makes its tiles' products one after another, and waits for the
    last. With ``time.process_time`` as the clock, the CPU seconds of all threads: the
    call's work per core, however many cores it used (summed over 0.1 s, since Linux adds
    another thread's CPU time to the process's at its scheduler tick)."""
    wait(call())  # JAX compiles here
    t0 = time.perf_counter()
    wait(call())
    calls = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        time.sleep(settle)
        t0 = clock()
        for _ in range(calls):
            result = call()
        wait(result)
        best = min(best, (clock() - t0) / calls)
    return best


def _exp(framework: str, shape: tuple[int, ...]):
    """(call, wait) as ``_product``'s, for the framework's exp of a float32 score tile."""
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)  # (B·H, Tb, Sb)
    if framework == "numpy":
        out = np.empty_like(x)  # (B·H, Tb, Sb)
        return (lambda: np.exp(x, out=out)), _done
    if framework == "torch":
        import torch

        tx = torch.from_numpy(x)
        out = torch.empty_like(tx)  # (B·H, Tb, Sb)
        return (lambda: torch.exp(tx, out=out)), _done
    import jax

    jx = jax.device_put(x)
    exp = jax.jit(jax.numpy.exp)
    return (lambda: exp(jx)), jax.block_until_ready


def rates(args: argparse.Namespace, frameworks=FRAMEWORKS) -> dict[str, dict[str, float]]:
    """framework -> product name -> FLOP/s (2 per multiply-add), each its fastest call,
    the right operand stored either way; and "exp" -> exponentials per CPU second, on a
    score tile of jax-flash's size."""
    found = {}
    for framework in frameworks:
        found[framework] = {}
        for name, (_, shape) in products(args).items():
            batch, M, K, N = shape
            work = 2 * batch * M * K * N
            found[framework][name] = max(
                work / _fastest(*_product(framework, shape, t), args.repeats, args.settle)
                for t in (False, True)
            )
        _, Tb, Sb = BACKENDS["jax-flash"]
        tile = (args.B * args.H, min(Tb, args.T), min(Sb, args.T))  # (B·H, Tb, Sb)
        cpu = _fastest(*_exp(framework, tile), args.repeats, args.settle, time.process_time)
        found[framework]["exp"] = math.prod(tile) / cpu
        print(f"{framework}'s products: done", file=sys.stderr, flush=True)
    return found


def flops(args: argparse.Namespace, causal: bool) -> float:
    """One product's FLOPs, 2·B·H·T·S·D, times (T + 1) / 2T under a causal mask."""
    visible = (args.T + 1) / (2 * args.T) if causal else 1.0
    return 2 * args.B * args.H * args.T * args.T * args.D * visible


def ceilings(args: argparse.Namespace, found: dict, reference: dict) -> list[dict]:
    """One row per flash backend, pass and mask: the floor of its time (each of its
    products at its framework's fastest rate for the product's kind) and the ceiling of its
    ratio; ``reference``: (pass, causal) -> torch-sdpa's seconds."""
    kinds = {name: kind for name, (kind, _) in products(args).items()}
    rows = []
    for (pass_, causal), ref_s in reference.items():
        one = flops(args, causal)
        work = one * sum(PRODUCTS[pass_].values())
        for name, (framework, _, _) in BACKENDS.items():
            fastest = {
                kind: max((r, p) for p, r in found[framework].items() if kinds.get(p) == kind)
                for kind in PRODUCTS[pass_]
            }
            floor = sum(n * one / fastest[kind][0] for kind, n in PRODUCTS[pass_].items())
            # Every score a query may see has its exponentials, spread over every core.
            exps = EXPS[pass_] * one / (2 * args.D)
            floor += exps / (found[framework]["exp"] * (os.cpu_count() or 1))
            goal = ratios.PREVIOUS.get((name, pass_))
            rows.append(
                {"backend": name, "pass": pass_, "causal": causal, "reference_s": ref_s,
                 "flops": work, "fastest": fastest, "exp": found[framework]["exp"],
                 "floor_s": floor,
                 "ceiling": ref_s / floor, "goal": goal,
                 "reachable": None if goal is None else ref_s / floor >= goal}
            )  # fmt: skip
        rows.append(
            {"backend": ratios.REFERENCE, "pass": pass_, "causal": causal, "reference_s": ref_s,
             "flops": work, "fastest": {"its own kernel": (work / ref_s, "")}, "exp": None,
             "floor_s": ref_s, "ceiling": 1.0, "goal": None, "reachable": None}
        )  # fmt: skip
    return rows


def rate_table(args: argparse.Namespace, found: dict) -> str:
    """The frameworks' rates as a Markdown table, a product a row, in GFLOP/s."""
    lines = ["| product | kind | (batch, M, K, N) | " + " | ".join(found) + " |"]
    lines.append("|---|---|---|" + "---|" * len(found))
    for name, (kind, shape) in products(args).items():
        cells = " | ".join(f"{found[fw][name] / 1e9:.0f}" for fw in found)
        lines.append(f"| {name} | {kind} | {shape} | {cells} |")
    cells = " | ".join(f"{found[fw]['exp'] / 1e9:.2f}" for fw in found)
    lines.append(f"| exp, per core, G/s | exponentials | one score tile | {cells} |")
    return "\n".join(lines)


def ceiling_table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| backend | pass | causal | GFLOP of products | fastest rates, GFLOP/s (product) "
        "| exp per core, G/s | floor ms | torch-sdpa ms | ceiling | goal | reachable |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["backend"] == ratios.REFERENCE):
        goal = "-" if r["goal"] is None else f"{r['goal']:.2f}"
        reach = "-" if r["reachable"] is None else ("yes" if r["reachable"] else "no")
        fastest = "; ".join(
            f"{kind} {rate / 1e9:.0f}" + (f" ({product})" if product else "")
            for kind, (rate, product) in r["fastest"].items()
        )
        lines.append(
            f"| {r['backend']} | {r['pass']} | {'yes' if r['causal'] else 'no'} "
            f"| {r['flops'] / 1e9:.1f} | {fastest} "
            f"| {'-' if r['exp'] is None else format(r['exp'] / 1e9, '.2f')} "
            f"| {r['floor_s'] * 1e3:.0f} "
            f"| {r['reference_s'] * 1e3:.0f} | {r['ceiling']:.2f} | {goal} | {reach} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance bench --ceilings [options]``; returns the exit status."""
    args = _parse(argv)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    found = rates(args)
    timing = argparse.Namespace(
        B=args.B, H=args.H, T=args.T, D=args.D, repeats=args.repeats, settle=args.settle,
        backends=[ratios.REFERENCE], passes=["forward", "vjp"], causal="both",
    )  # fmt: skip
    reference = {(r["pass"], r["causal"]): r["min_s"] for r in ratios.measure(timing)}
    print(
        f"B={args.B} H={args.H} T=S={args.T} D={args.D} float32, square {args.square}, "
        f"min of {args.repeats} after a warm-up, settle {args.settle:g} s; load average "
        f"(1 min) {load:.2f} before, {os.getloadavg()[0]:.2f} after; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print(ratios.machine())
    print(rate_table(args, found))
    print()
    print(ceiling_table(ceilings(args, found, reference)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
