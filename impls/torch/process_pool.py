"""The torch.distributed worker pool: the only place processes are started or stopped.

``ring.py`` and ``ulysses.py`` each write one rank's share as an ordinary function of its
shard that calls collectives (``batch_isend_irecv``, ``all_to_all_single``); a user's own
``torchrun`` script can call those functions directly (``examples/torch_ring_torchrun.py``).
Their single-process entries run the P ranks here instead: ``run_on_ranks(P, fn, shards)``
hands ``shards[r]`` to rank r of a pool of P worker processes in one gloo process group
and gathers the P results. A pool is started on first use and reused (at most
``MAX_POOLS`` of them alive), and shut down at exit; a worker also ends itself when the
process that started it is gone. Every collective has the process group's timeout
(``TIMEOUT_S``); a worker that dies raises ``WorkerDied`` in the caller, and the next call
starts a fresh pool. The torch-ring and torch-ulysses backends share one set of P
processes this way.
"""

from __future__ import annotations

import atexit
import datetime
import os
import queue
import socket
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120.0  # every collective, and the caller's wait for a result


class WorkerDied(RuntimeError):
    """A pool worker process died or stopped answering; the pool is shut down."""


def run_on_ranks(P: int, fn, shards, **kwargs) -> list:
    """Run ``fn(*shards[r], **kwargs)`` on rank r of the pool of P gloo processes; return
    the P results (NumPy), in rank order.

    ``fn`` is a module-level function (a worker imports it by name); the arrays of
    ``shards[r]`` arrive as tensors (None stays None), and its tensor results (or a tuple
    of them, None allowed) come back as NumPy arrays. It runs inside the process group, so
    it may call collectives. The pool starts on first use, is reused, and stops when this
    process exits or ``shutdown`` is called; a worker that dies raises ``WorkerDied`` and
    the next call starts a fresh pool.
    """
    return _pool(P).run(fn, shards, kwargs)


class _Pool:
    def __init__(self, P: int) -> None:
        # A fork server that has imported this module (and so torch) once forks each
        # worker from itself: a worker starts in milliseconds instead of importing torch
        # anew in a fresh interpreter, as "spawn" would (seconds each), and no worker is
        # forked from a caller that may already run threads, as plain "fork" would be.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        with socket.socket() as s:  # a free port for the process group's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.P = P
        self.tasks = [ctx.Queue() for _ in range(P)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, P, port, self.tasks[r], self.results), daemon=True)
            for r in range(P)
        ]
        for p in self.procs:
            p.start()
        # Each worker says it has started: one that dies before it does failed while
        # starting, and the caller is told the usual cause.
        ready: set[int] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while len(ready) < P:
            try:
                rank, _ = self.results.get(timeout=0.2)
                ready.add(rank)
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if r not in ready and not p.is_alive():
                        self._fail(_start_failure(r, p))
                if time.monotonic() > deadline:
                    self._fail(f"not every worker started within {TIMEOUT_S:.0f} s")

    def run(self, fn, shards, kwargs) -> list:
        for r, shard in enumerate(shards):
            self.tasks[r].put((fn, shard, kwargs))
        outs: dict[int, object] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(outs) < self.P:
            try:
                rank, result = self.results.get(timeout=1.0)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"no answer within {TIMEOUT_S:.0f} s")
                continue
            if isinstance(result, BaseException):
                self._fail(f"rank {rank} raised {result!r}")
            outs[rank] = result
        return [outs[r] for r in range(self.P)]

    def _check_alive(self) -> None:
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                self._fail(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}")

    def _fail(self, why: str):
        self.close()
        raise WorkerDied(
            f"torch.distributed worker pool (P={self.P}, gloo) failed: {why}; the pool was "
            f"shut down and the next call starts a fresh one"
        )

    def close(self) -> None:
        for t in self.tasks:
            try:
                t.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if _POOLS.get(self.P) is self:
            del _POOLS[self.P]


def _start_failure(rank: int, proc) -> str:
    """Why a worker died before it started: multiprocessing's bootstrapping rule, when
    there is a main script it re-imports."""
    said = f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} while starting"
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main is None:
        return f"{said} (its error is in its stderr)"
    return (
        f"{said}, before it ran any of the pool's code. The pool starts its workers with "
        f"multiprocessing's 'forkserver' start method, and each worker first re-imports the "
        f"main module, {main}, as under 'spawn': a script that uses the backend at module "
        f'level, outside an `if __name__ == "__main__":` guard, has every worker start a '
        f"pool of its own while it is still starting, which multiprocessing refuses (its "
        f"RuntimeError about the bootstrapping phase is in the workers' stderr). Put the "
        f"script's code under "
        f'`if __name__ == "__main__":`'
    )


_POOLS: dict[int, _Pool] = {}  # by P, the most recently used last
#: Pools kept alive at once: a caller comparing P with P = 1 needs two, and one per P
#: (P = 1 to 8 is 36 processes) would hold gigabytes.
MAX_POOLS = 2


def _pool(P: int) -> _Pool:
    """The pool of P workers, started on first use and reused. A pool with a dead worker
    raises WorkerDied and is shut down; the next call starts a fresh one. Starting one
    more than ``MAX_POOLS`` stops the least recently used."""
    pool = _POOLS.pop(P, None)
    if pool is not None:
        _POOLS[P] = pool
        pool._check_alive()  # a worker that died since the last call is an error, once
        return pool
    while len(_POOLS) >= MAX_POOLS:
        next(iter(_POOLS.values())).close()
    pool = _POOLS[P] = _Pool(P)
    return pool


@atexit.register
def shutdown(P: int | None = None) -> None:
    """Stop the pool of P workers, or every pool (also run at exit)."""
    for pool in list(_POOLS.values()):
        if P is None or pool.P == P:
            pool.close()


def _worker(rank: int, P: int, port: int, tasks, results) -> None:
    results.put((rank, "started"))
    _exit_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=P,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        while (task := tasks.get()) is not None:
            fn, shard, kwargs = task
            try:
                args = [None if x is None else torch.from_numpy(np.array(x)) for x in shard]
                out = fn(*args, **kwargs)
                if isinstance(out, tuple):
                    out = tuple(None if g is None else g.numpy() for g in out)
                else:
                    out = out.numpy()
                results.put((rank, out))
            except Exception as err:  # the caller raises it, naming the rank
                results.put((rank, err))
    finally:
        dist.destroy_process_group()


def _exit_with_parent() -> None:
    """End this worker as soon as the process that started it is gone.

    The parent stops its pools at exit, but a parent that is killed, or that leaves by
    ``os._exit`` (as a pytest-xdist worker can), runs no exit handler: without this its
    workers, and the resource tracker they keep open, would live on, adopted by init.
    """
    parent = mp.parent_process()

    def watch() -> None:
        parent.join()  # returns when the parent's sentinel closes: the parent has exited
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
