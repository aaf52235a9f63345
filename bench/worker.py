"""One backend at one size, in a process of its own: time it, then measure its peak memory.

    python -m conformance.bench.worker --backend numpy-flash --B 1 --H 8 --T 4096 --D 64 [--causal] [--backward]

prints one JSON object. The call is ``conformance.load_backend(name).prepare(q, k, v, ...)``
for a backend, or the framework's own function for an anchor (``bench.backends``); with
``--backward``, ``load_backend(name).prepare_vjp(q, k, v, d_out, ...)``: forward and
backward, the inputs converted once outside the timing. A process per backend keeps the frameworks' thread pools apart:
a PyTorch, XLA or OpenBLAS pool that is still spinning after its own call slows whatever
runs next on the same two cores. Timing: a warm-up call (compilation, for JAX), then the
median of ``--repeats`` calls (fewer, at least one, once the timed calls have taken
``--budget-s`` seconds). Memory (unless ``--no-memory``): pin glibc's mmap
threshold so freed temporaries leave the resident set, reset the kernel's
resident-memory high-water mark (VmHWM) by writing 5 to /proc/self/clear_refs, make one
more call, and report VmHWM minus the VmRSS just before it (the inputs are already
resident).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import resource
import statistics
import time
import tracemalloc

MIB = 2**20


def _status(key: str) -> int:
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _pin_mmap_threshold() -> bool:
    """Make glibc serve every block over 128 KiB by mmap and give it back on free.

    By default glibc raises its mmap threshold after the first large free (up to 32 MiB),
    so later temporaries come from the heap and stay resident after they are freed: a
    second call then reuses them and the high-water mark misses them. Pinning the
    threshold (and trimming the heap now) makes VmHWM count each call's temporaries.
    It is done only after the timed calls, because an mmap and page faults per large
    allocation would slow them.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_MMAP_THRESHOLD = -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1
        libc.malloc_trim(0)
        return ok
    except (OSError, AttributeError):
        return False


def run(
    name: str,
    B: int,
    H: int,
    T: int,
    D: int,
    causal: bool,
    repeats: int,
    memory: bool,
    options: dict,
    budget_s: float = float("inf"),
    backward: bool = False,
) -> dict:
    from conformance.bench.backends import inputs, make_call, make_vjp_call

    q, k, v = inputs(B, H, T, D)
    make = make_vjp_call if backward else make_call
    call = make(name, q, k, v, causal, options)
    # The outputs: out, or the gradients dq, dk, dv (d_out is an input).
    out_bytes = B * H * T * D * 4 * (3 if backward else 1)
    result: dict = {}
    can_reset = os.path.exists("/proc/self/clear_refs")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    out = call()  # warm-up: compilation, lazy imports, thread pools
    result["first_call_s"] = time.perf_counter() - t0
    if memory and not can_reset:
        # No way to reset the high-water mark: the first call's growth, compilation and all.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        result["method"] = "ru_maxrss growth over the first call (includes compilation)"
    del out
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s:
            break
    result["times"] = times
    if memory:
        gc.collect()
        _pin_mmap_threshold()
        if can_reset and _reset_peak():
            before = _status("VmRSS")
            out = call()
            peak = _status("VmHWM") - before
            result["method"] = "VmHWM reset after warm-up"
            del out
        result["peak_mib"] = peak / MIB
        result["extra_mib"] = (peak - out_bytes) / MIB
        if name.startswith("numpy"):
            # NumPy reports its buffers to tracemalloc: a cross-check that needs no /proc.
            gc.collect()
            tracemalloc.start()
            call()
            traced = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            result["tracemalloc_extra_mib"] = (traced - out_bytes) / MIB
    result["median_s"] = statistics.median(times)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m conformance.bench.worker",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--backend", required=True)
    for letter in "BHTD":
        p.add_argument(f"--{letter}", type=int, required=True)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=float("inf"))
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--backward", action="store_true", help="time attention_vjp instead")
    p.add_argument("--block-q", type=int, help="block_q for the blockwise backends")
    p.add_argument("--block-k", type=int, help="block_k for the blockwise backends")
    a = p.parse_args(argv)
    options = {
        key: val for key, val in (("block_q", a.block_q), ("block_k", a.block_k)) if val is not None
    }
    result = run(
        a.backend,
        a.B,
        a.H,
        a.T,
        a.D,
        a.causal,
        a.repeats,
        not a.no_memory,
        options,
        a.budget_s,
        a.backward,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
