"""The torch.distributed worker pool (impls/torch/process_pool.py, shared by torch-ring and
torch-ulysses): its processes never outlive the run that started them, on any path, and a
start-up failure names its cause.

Each run is a subprocess whose environment carries a fresh tag; every process it starts
inherits the tag, so afterwards /proc lists whatever is left, even processes adopted by
init (as the leaked pools of issue 22 were).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
TAG = "CONFORMANCE_POOL_TAG"


def _tagged(tag: str) -> list[str]:
    """The processes whose environment carries ``TAG=tag``: 'pid command line' each."""
    found = []
    want = f"{TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if want not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(f"{entry.name} {cmd.strip()}")
    return found


def _left_after(tag: str, wait_s: float = 30.0) -> list[str]:
    """What is still running with the tag once ``wait_s`` has passed (or nothing is)."""
    deadline = time.monotonic() + wait_s
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _run(args: list[str], tag: str, timeout: float = 600, **kwargs):
    env = {**os.environ, TAG: tag}
    return subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, **kwargs
    )


pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")

#: A script that starts a P = 2 pool under the guard, then ends the way it is told. The
#: signal goes to the main thread (raise_signal): one sent to the process (os.kill) may be
#: taken by another thread while the main thread goes on into a wait no signal then ends,
#: which hung this test once. The wait is bounded, so a signal that ends nothing fails the
#: test by what is left running, not by a timeout.
ENDING = """
import signal, sys, time
import numpy as np
from conformance.backends import load_backend


def main(how):
    backend = load_backend("{name}", shards=2)
    q = np.random.default_rng(0).standard_normal((1, 2, 4, 3))
    backend.attention(q, q, q)
    print("pool started", flush=True)
    if how == "raise":
        raise RuntimeError("a failure after the pool started")
    if how != "exit":
        signal.raise_signal(getattr(signal, how))
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1])
"""


#: torch-ulysses runs on torch-ring's pool (run_on_ranks): every way of ending is tried on
#: torch-ring, and the hardest, a kill, on torch-ulysses too.
ENDINGS = [("torch-ring", how) for how in ("exit", "raise", "SIGINT", "SIGTERM", "SIGKILL")]
ENDINGS.append(("torch-ulysses", "SIGKILL"))


@pytest.mark.parametrize("name, how", ENDINGS)
def test_no_worker_outlives_its_parent(tmp_path, name, how):
    """Normal exit, an exception, an interrupt, a termination without exit handlers and a
    kill: the workers and the resource tracker end with the process that started them."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING.format(name=name))
    tag = uuid.uuid4().hex
    run = _run([sys.executable, str(script), how], tag, timeout=240)
    assert "pool started" in run.stdout, f"the pool did not start:\n{run.stderr[-3000:]}"
    left = _left_after(tag)
    assert not left, f"{name}, parent ended by {how}: processes left running:\n" + "\n".join(left)


def test_a_sharded_pytest_run_leaves_no_worker():
    """Pools started the way the distributed env starts them: pytest-xdist workers running
    §14.2 at P = 7 and 8 on both torch backends (issue 22 found pools of exactly these
    left behind)."""
    tag = uuid.uuid4().hex
    run = _run(
        [
            sys.executable, "-m", "pytest", "conformance/tests/test_sharded.py",
            "--backend", "torch-ring", "--backend", "torch-ulysses", "-n", "2", "-q",
            "-k", "test_shard_count_invariance and (P7 or P8) and float64 and plain",
        ],
        tag,
    )  # fmt: skip
    assert run.returncode == 0, f"the run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert " passed" in run.stdout, run.stdout[-3000:]
    left = _left_after(tag)
    assert not left, "processes left running after pytest exited:\n" + "\n".join(left)


def test_module_level_script_names_the_start_method_and_the_guard(tmp_path):
    """A script that uses torch-ring at module level, without the ``__main__`` guard: the
    parent's error names the start method (forkserver) and the guard, not just an exit code; the
    same script under the guard (the README's form) runs."""
    body = """
        import numpy as np
        from conformance.backends import load_backend

        backend = load_backend("torch-ring", shards=2)
        q = np.random.default_rng(0).standard_normal((1, 2, 4, 3))
        print(backend.attention(q, q, q).shape)
    """
    tag = uuid.uuid4().hex
    bare = tmp_path / "bare.py"
    bare.write_text(textwrap.dedent(body))
    run = _run([sys.executable, str(bare)], tag)
    assert run.returncode != 0, f"the unguarded script ran:\n{run.stdout}"
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("conformance.impls.torch.process_pool.WorkerDied"), run.stderr[-3000:]
    for part in ("'forkserver' start method", 'if __name__ == "__main__":', str(bare)):
        assert part in last, f"the parent's error does not name {part!r}: {last}"

    guarded = tmp_path / "guarded.py"
    indented = textwrap.indent(textwrap.dedent(body).strip(), "    ")
    guarded.write_text(f'if __name__ == "__main__":\n{indented}\n')
    run = _run([sys.executable, str(guarded)], tag)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "(1, 2, 4, 3)", run.stdout
    left = _left_after(tag)
    assert not left, "processes left running:\n" + "\n".join(left)
