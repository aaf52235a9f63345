"""The oracle's store (``conformance.suite.oracle_store``, SPEC §13.22): an answer read
back is the oracle's own, bit for bit; any change to the question, or to the oracle, is a
new key; a naive run (BLAS) is never kept; an unreadable file is computed again; the
setting turns it off; a run from outside the checkout fills it once and then reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conformance.fixtures import oracle as real

from conformance.suite import oracle_store
from conformance.suite.oracle_store import (
    Store,
    oracle_cache_dir,
    oracle_cache_mode,
    oracle_digest,
    question_key,
)

pytestmark = pytest.mark.clause("13.22")


def _inputs(seed=0, T=3, S=4):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, T, 4))  # (B, H, T, D)
    k = rng.standard_normal((1, 2, S, 4))  # (B, K, S, D)
    v = rng.standard_normal((1, 2, S, 3))  # (B, K, S, E)
    return q, k, v


class Counted:
    """The oracle's function, counting its calls."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.mark.parametrize(
    "name, extra, options",
    [
        ("attention", (), {"is_causal": True}),
        ("attention", (), {"return_lse": True, "window": (1, 0)}),
        ("attention_vjp", ("d_out",), {"softcap": 2.5}),
    ],
    ids=["array", "tuple", "dict"],
)
def test_an_answer_read_back_is_the_oracles_bit_for_bit(tmp_path, name, extra, options):
    q, k, v = _inputs()
    args = (q, k, v) + tuple(np.random.default_rng(1).standard_normal((1, 2, 3, 3)) for _ in extra)
    fresh = getattr(real, name)(*args, **options)
    first = Counted(getattr(real, name))
    Store(tmp_path, "d").answer(name, first, *args, **options)
    assert first.calls == 1 and len(list(tmp_path.glob("*.npz"))) == 1
    # A new process's store: nothing in memory, the answer on disk.
    again = Counted(getattr(real, name))
    got = Store(tmp_path, "d").answer(name, again, *args, **options)
    assert again.calls == 0
    assert type(got) is type(fresh)
    pairs = {
        np.ndarray: lambda: [(got, fresh)],
        tuple: lambda: list(zip(got, fresh, strict=True)),
        dict: lambda: [(got[n], fresh[n]) for n in fresh] if got.keys() == fresh.keys() else [],
    }[type(fresh)]()
    assert pairs
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_what_a_caller_changes_is_not_the_stored_answer(tmp_path):
    store = Store(tmp_path, "d")
    q, k, v = _inputs()
    out = store.answer("attention", real.attention, q, k, v)
    out[...] = 7.0
    assert not (store.answer("attention", real.attention, q, k, v) == 7.0).any()


def test_every_part_of_the_question_is_in_the_key():
    q, k, v = _inputs()
    base = question_key("d", "attention", (q, k, v), {"scale": 0.5})
    other = [
        question_key("e", "attention", (q, k, v), {"scale": 0.5}),  # another oracle
        question_key("d", "attention_vjp", (q, k, v), {"scale": 0.5}),
        question_key("d", "attention", (q, k, v), {"scale": 0.25}),
        question_key("d", "attention", (q, k, v), {"scale": 0.5, "is_causal": True}),
        question_key("d", "attention", (q.astype(np.float32), k, v), {"scale": 0.5}),
        question_key("d", "attention", (q.reshape(1, 2, 4, 3), k, v), {"scale": 0.5}),
        question_key("d", "attention", (np.nextafter(q, 9), k, v), {"scale": 0.5}),
        question_key("d", "attention", (q, k, v), {"scale": 1}),  # not 1.0
        question_key("d", "attention", (q, k, v), {"scale": 0.5, "window": (1, 0)}),
        question_key("d", "attention", (q, k, v), {"scale": 0.5, "window": (0, 1)}),
    ]
    assert base == question_key("d", "attention", (q.copy(), k, v), {"scale": 0.5})
    assert len({base, *other}) == len(other) + 1
    # An argument with no value to key by is asked every time, never kept.
    assert question_key("d", "attention", (q, k, v), {"random": object()}) is None


def test_the_oracles_digest_follows_its_source(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("X = 1\n")
    second.write_text("X = 2\n")

    class Module:
        __file__ = str(first)

    before = oracle_digest(Module)
    Module.__file__ = str(second)
    assert oracle_digest(Module) != before
    assert oracle_digest(real) == oracle_digest(real)


def test_a_naive_run_is_never_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(oracle_store, "_store", lambda: Store(tmp_path, "d"))
    q = np.random.default_rng(2).standard_normal((1, 2, 1, 4))  # (B, H, T, D)
    pages = np.random.default_rng(3).standard_normal((3, 2, 2, 4))  # (N, K, L, D)
    table, lens = np.array([[2, 0]]), np.array([3])
    oracle_store.oracle.attention_paged(q, pages, pages, table, lens, naive_dtype=np.float32)
    assert not list(tmp_path.glob("*.npz"))
    oracle_store.oracle.attention_paged(q, pages, pages, table, lens)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    # A name outside the 50-digit functions is the module's own, unwrapped.
    assert oracle_store.oracle.naive_same_precision is real.naive_same_precision


def test_an_unreadable_file_is_computed_again_and_replaced(tmp_path):
    q, k, v = _inputs()
    Store(tmp_path, "d").answer("attention", real.attention, q, k, v)
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"not a zip")
    counted = Counted(real.attention)
    got = Store(tmp_path, "d").answer("attention", counted, q, k, v)
    assert counted.calls == 1
    assert got.tobytes() == real.attention(q, k, v).tobytes()
    with np.load(path, allow_pickle=False) as stored:
        assert stored["out"].tobytes() == got.tobytes()


def test_a_folder_that_cannot_be_written_costs_only_time(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    q, k, v = _inputs()
    got = Store(blocked / "oracle", "d").answer("attention", real.attention, q, k, v)
    assert got.tobytes() == real.attention(q, k, v).tobytes()


def test_the_setting_and_the_folder():
    env = {"XDG_CACHE_HOME": "/x/cache", "HOME": "/home/u"}
    assert oracle_cache_dir(env) == Path("/x/cache/attention-conformance/oracle")
    assert oracle_cache_dir({**env, "CONFORMANCE_ORACLE_CACHE": "off"}) is None
    assert oracle_cache_mode({"CONFORMANCE_ORACLE_CACHE": ""}) == "on"
    with pytest.raises(ValueError, match=r"CONFORMANCE_ORACLE_CACHE: expected one of on, off"):
        oracle_cache_mode({"CONFORMANCE_ORACLE_CACHE": "yes"})


def _run(tmp_path, **env):
    environ = {k: v for k, v in os.environ.items() if k != "CONFORMANCE_ORACLE_CACHE"}
    environ.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), **env})
    command = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "--backend", "numpy"]
    command += ["-p", "no:cacheprovider", "-n", "0", "-q", "-k", "test_alibi_matches_the_oracle"]
    return subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True)


def test_a_run_fills_the_store_once_and_the_next_reads_it(tmp_path):
    """From outside the checkout: the first run writes the oracle's answers, a second
    writes nothing new and passes the same tests; off writes nothing; a bad setting is a
    usage error naming it."""
    folder = tmp_path / "xdg" / "attention-conformance" / "oracle"
    first = _run(tmp_path)
    assert first.returncode == 0, first.stdout[-3000:]
    stored = {p: p.stat().st_mtime_ns for p in folder.glob("*.npz")}
    assert stored
    second = _run(tmp_path)
    assert second.returncode == 0, second.stdout[-3000:]
    assert (
        second.stdout.splitlines()[-1].split(" in ")[0]
        == (first.stdout.splitlines()[-1].split(" in ")[0])
    )
    assert {p: p.stat().st_mtime_ns for p in folder.glob("*.npz")}.keys() == stored.keys()
    off = tmp_path / "off"
    assert _run(tmp_path, CONFORMANCE_ORACLE_CACHE="off", XDG_CACHE_HOME=str(off)).returncode == 0
    assert not (off / "attention-conformance" / "oracle").exists()
    bad = _run(tmp_path, CONFORMANCE_ORACLE_CACHE="yes")
    assert bad.returncode == 4 and "CONFORMANCE_ORACLE_CACHE: expected one of" in bad.stderr
