"""Timing and peak memory of every attention backend, from T = 512 to 16384.

A command, not a test; it runs from any directory once the project is installed (the
``bench`` extra adds matplotlib and tqdm):

    python -m conformance bench                                 # everything, a few minutes
    python -m conformance bench --sizes 512 1024 --repeats 3    # a quick look
    python -m conformance bench --backends numpy-flash jax-flash torch-sdpa --sizes 4096

Two measurements of their own, for the flash backends against torch-sdpa (issue 54):
``--ratios`` (``ratios.py``: the ratios, every call interleaved in one process) and
``--ceilings`` (``ceilings.py``: the best ratio each could reach on this machine, its
products at its framework's fastest matmul rate and its exponentials spread over every
core).

(``python -m conformance.bench`` is the same command.) Every backend is timed as users
get it, through ``conformance.load_backend(name)``, in its default configuration; two
anchors, ``anchor:F.sdpa`` and ``anchor:jax.nn.dpa``, are the frameworks' own functions
called directly, for reference (``bench/backends.py``).

What it measures, for T = S, B·H heads of size D, float32, causal and not:

* time: the median of ``--repeats`` calls (fewer, at least one, past ``--budget-s``
  seconds of timed calls) after a warm-up call (which also compiles, for
  JAX), each backend at each size in a fresh process of its own
  (``python -m conformance.bench.worker``), so that one framework's thread pool, still
  spinning after its call, cannot slow the next one on the same cores. Each is also given
  as a ratio of throughputs to ``torch-sdpa`` at the same size in the same run (> 1:
  faster than torch-sdpa). The sizes are run in order, all backends at one size before
  the next, so that comparisons at one size are measured close together in time.
* the backward pass (``--passes backward`` or ``both``): ``attention_vjp``, forward and
  backward together, of the backends that declare "grad", through
  ``load_backend(name).prepare_vjp(q, k, v, d_out, ...)`` (inputs converted once, outside
  the timing); its rows carry ``pass = "backward"``, its ratios are to torch-sdpa's
  backward, and it gets plots of its own (``*_backward.png``). Anchors time the forward
  only.
* nominal GFLOP/s: 4·B·H·D per (query, key) pair that the mask lets through, i.e.
  4·B·H·T·S·D without a mask and 4·B·H·D·T(T+1)/2 under a causal mask (T = S). The causal
  count is the work a kernel that skips masked blocks must do, so a causal run at the same
  GFLOP/s takes about half the time. Forward + backward counts 3.5 times that, as
  FlashAttention's benchmark does (the backward 2.5 forwards: five products to two).
* peak memory: in the same worker process, after the timed calls, the worker resets the
  kernel's high-water mark of its resident memory (``/proc/self/clear_refs``, value 5)
  and makes the measured call. ``peak`` is VmHWM during that call minus VmRSS just before
  it (inputs already resident), and ``extra`` is ``peak`` minus the output's bytes: the
  working memory beyond inputs and outputs. Before it, glibc's mmap threshold is pinned
  at 128 KiB (``mallopt``) and the heap trimmed, so that large temporaries are returned
  to the kernel on free rather than kept resident by the allocator, which would hide
  them from the next call (pinned only after the timed calls: an mmap per temporary
  slows them).
  NumPy backends also report tracemalloc's peak (NumPy reports its buffers to it), as a
  cross-check that needs no /proc. Where /proc/self/clear_refs is missing the child falls
  back to the growth of ru_maxrss over its first call (which then includes compilation).

A backend whose estimated memory (naive ones hold several B·H·T·S float32 arrays) exceeds
``--mem-limit-gib``, or whose predicted call time (the previous size's, scaled by T²)
exceeds ``--max-call-seconds``, is skipped at that size with the reason. A backend whose
module is missing is reported as not installed.

Outputs in ``--out`` (default bench/results): results.csv, results.json, results.md, and
time_vs_T.png, memory_vs_T.png (log-log, one line per backend), and with backward rows
time_vs_T_backward.png, memory_vs_T_backward.png.
"""
