"""The benchmark command: it times backends through ``load_backend``, runs from any
directory, and writes its tables and plots. Smoke tests on tiny sizes; no timing is
asserted (speed is what the benchmark measures, not what the tests check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conformance.bench import backends as bench_backends
from conformance.bench import run as bench_run

import conformance


def test_bench_quick_run_from_any_directory(tmp_path):
    """``python -m conformance.bench`` from outside the repository: one worker process per
    backend and size, results written, plain progress lines (no bar) when not on a TTY."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "conformance.bench", "--sizes", "64", "--repeats", "1"]
    cmd += ["--backends", "numpy-flash", "torch-sdpa", "anchor:F.sdpa", "--causal", "yes"]
    cmd += ["--out", str(out)]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for name in ("results.csv", "results.json", "results.md", "time_vs_T.png", "memory_vs_T.png"):
        assert (out / name).stat().st_size > 0, name
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["backend"], r["causal"]) for r in rows] == [
        ("numpy-flash", True),
        ("torch-sdpa", True),
        ("anchor:F.sdpa", True),
    ]
    assert all(r["status"] == "ok" for r in rows), [r["reason"] for r in rows]
    assert all(r["vs_torch_sdpa"] is not None for r in rows)
    table = (out / "results.md").read_text()
    assert "| numpy-flash |" in table and "| anchor:F.sdpa |" in table
    # Not a terminal: one line per run, no carriage-return redraws of a bar.
    assert "\r" not in run.stderr
    assert "[3/3] T=64 causal anchor:F.sdpa:" in run.stderr, run.stderr[-2000:]


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_run.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "python -m conformance bench" in text
    assert "(default: 5)" in text  # --repeats
    assert "anchor:jax.nn.dpa" in text


def test_no_progress_prints_no_progress_lines(tmp_path, capsys):
    code = bench_run.main(
        ["--sizes", "32", "--repeats", "1", "--backends", "numpy-flash", "--causal", "no"]
        + ["--memory", "off", "--no-progress", "--out", str(tmp_path)]
    )
    assert code == 0
    assert "[1/1]" not in capsys.readouterr().err


def test_backends_are_timed_through_load_backend(monkeypatch):
    """The benchmark's call is ``load_backend(name).prepare(...)``; tile options reach
    only the backends that take them."""
    loaded = []
    real = conformance.load_backend

    def recording(name, **options):
        loaded.append((name, options))
        return real(name, **options)

    monkeypatch.setattr(conformance, "load_backend", recording)
    q, k, v = bench_backends.inputs(1, 2, 16, 8)
    call = bench_backends.make_call("numpy-flash", q, k, v, True, {"block_q": 4, "block_k": 8})
    expected = real("numpy").attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(call(), expected, rtol=1e-5, atol=1e-6)
    assert ("numpy-flash", {"block_q": 4, "block_k": 8}) in loaded
    loaded.clear()
    call = bench_backends.make_call("numpy", q, k, v, False, {"block_q": 4})
    np.testing.assert_allclose(call(), real("numpy").attention(q, k, v), rtol=1e-6)
    assert loaded == [("numpy", {})]


def test_prepare_waits_for_jax():
    """``Backend.prepare`` converts once and its call returns a finished result."""
    pytest.importorskip("jax")
    q, k, v = bench_backends.inputs(1, 2, 16, 8)
    call = conformance.load_backend("jax-flash").prepare(q, k, v, is_causal=True)
    out = call()
    assert out.is_ready()
    expected = conformance.load_backend("numpy").attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


def test_every_name_is_a_backend_or_an_anchor():
    names = bench_backends.names()
    assert set(conformance.registered_backends()) <= set(names)
    assert {"anchor:F.sdpa", "anchor:jax.nn.dpa"} <= set(names)


def test_backward_section(tmp_path):
    """``--passes backward`` times ``attention_vjp`` for the backends that declare "grad",
    counts forward + backward as 3.5 forwards (FlashAttention's count), skips anchors
    with the reason, and draws the backward's memory plot."""
    code = bench_run.main(
        ["--sizes", "32", "--repeats", "1", "--backends", "numpy-flash", "anchor:F.sdpa"]
        + ["--causal", "no", "--passes", "backward", "--no-progress", "--out", str(tmp_path)]
    )
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["backend"], r["pass"], r["status"]) for r in rows] == [
        ("numpy-flash", "backward", "ok"),
        ("anchor:F.sdpa", "backward", "skipped"),
    ]
    assert rows[0]["gflop"] == pytest.approx(3.5 * bench_backends.flops(1, 8, 32, 64, False) / 1e9)
    assert "forward pass only" in rows[1]["reason"]
    assert (tmp_path / "memory_vs_T_backward.png").stat().st_size > 0
    assert "## Forward + backward, non-causal: time" in (tmp_path / "results.md").read_text()


def test_ratios_table_from_any_directory(tmp_path):
    """``python -m conformance bench --ratios``, tiny: every backend, pass and mask has a
    row, torch-sdpa's own ratio is 1 and the others are its minimum over theirs; the
    goals column names fd4b5cd's ratios. The ratios themselves are not asserted."""
    cmd = [sys.executable, "-m", "conformance", "bench", "--ratios", "--T", "32", "--H", "2"]
    cmd += ["--D", "8", "--repeats", "2", "--settle", "0", "--backends", "numpy-flash"]
    cmd += ["--goals"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "T=S=32" in run.stdout and "min of 2 after a warm-up, interleaved" in run.stdout
    machine = next(line for line in run.stdout.splitlines() if line.startswith("machine: "))
    assert f"{os.cpu_count()} cores" in machine and "numpy " in machine and "tree " in machine
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in rows[0]] == [
        "backend", "pass", "causal", "min ms", "torch-sdpa ms", "ratio", "cores busy",
        "fd4b5cd's", "met",
    ]  # fmt: skip
    cells = [[c.strip() for c in r] for r in rows[1:]]
    assert [(c[0], c[1], c[2]) for c in cells] == [
        (name, pass_, causal)
        for name in ("numpy-flash", "torch-sdpa")
        for pass_ in ("forward", "vjp")
        for causal in ("no", "yes")
    ]
    assert [c[7] for c in cells[:4]] == ["0.86", "0.86", "0.75", "0.75"]
    assert all(c[5] == "1.00" and c[7] == "-" for c in cells[4:])
    # Only positive: at calls of tens of microseconds, Linux's accounting of the other
    # threads' CPU time by scheduler ticks reads up to 10 or more cores busy (ratios.py);
    # test_ratios_interleave_the_backends checks the arithmetic on a clock of its own.
    assert all(float(c[6]) > 0 for c in cells)


def test_ratios_interleave_the_backends(monkeypatch):
    """Each round calls every backend once, in order, after one warm-up round; a row's
    time is the minimum of its timed rounds and its ratio torch-sdpa's minimum over it."""
    from conformance.bench import ratios

    order = []
    clock = iter(range(1000))
    # Each call takes one tick of this clock, except numpy-flash's second timed call.
    monkeypatch.setattr(ratios.time, "perf_counter", lambda: float(next(clock)))
    # Two CPU seconds pass per call, whatever its wall time: two cores busy on a 1-tick call.
    cpu = iter(range(0, 2000, 2))
    monkeypatch.setattr(ratios.time, "process_time", lambda: float(next(cpu)))

    def fake_calls(names, pass_, q, k, v, causal):
        def make(name):
            def call():
                order.append(name)
                if name == "numpy-flash" and order.count(name) == 3:
                    next(clock), next(clock)

            return call

        return {name: make(name) for name in names}

    monkeypatch.setattr(ratios, "_calls", fake_calls)
    args = ratios._parse(["--T", "8", "--repeats", "3", "--settle", "0"])
    args.passes, args.causal, args.backends = ["forward"], "no", ["torch-sdpa", "numpy-flash"]
    rows = ratios.measure(args)
    assert order == ["numpy-flash", "torch-sdpa"] * 4
    flash, torch_ = rows
    assert flash["times_s"] == [1.0, 3.0, 1.0] and torch_["times_s"] == [1.0, 1.0, 1.0]
    assert flash["min_s"] == 1.0 and torch_["ratio"] == 1.0
    # Two CPU seconds a call: 6 over numpy-flash's 5 timed seconds, 6 over torch-sdpa's 3.
    assert flash["cores"] == 6 / 5 and torch_["cores"] == 2.0


def test_ceilings_table_from_any_directory(tmp_path):
    """``python -m conformance bench --ceilings``, tiny: a rate for every product and
    framework, then a row per backend, pass and mask, whose "reachable" says whether its
    ceiling reaches its goal. The rates themselves are not asserted."""
    cmd = [sys.executable, "-m", "conformance", "bench", "--ceilings", "--T", "32", "--H", "2"]
    cmd += ["--D", "8", "--square", "32", "--repeats", "1", "--settle", "0"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert any(line.startswith("machine: ") for line in run.stdout.splitlines())
    tables = run.stdout.split("\n\n")
    rates = [line.split("|")[1:-1] for line in tables[0].splitlines() if line.startswith("| ")]
    assert [c.strip() for c in rates[0]] == [
        "product",
        "kind",
        "(batch, M, K, N)",
        "numpy",
        "jax",
        "torch",
    ]
    assert [r[0].strip() for r in rates[2:]][-2:] == ["square 32", "exp, per core, G/s"]
    assert all(float(c) >= 0 for r in rates[2:] for c in r[3:])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in tables[1].splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (name, pass_, causal)
        for pass_ in ("forward", "vjp")
        for causal in ("no", "yes")
        for name in ("numpy-flash", "jax-flash")
    ] + [("torch-sdpa", pass_, causal) for pass_ in ("forward", "vjp") for causal in ("no", "yes")]
    for r in rows[:8]:
        assert r[10] == ("yes" if float(r[8]) >= float(r[9]) else "no")


def test_ceilings_floor_is_the_products_and_exponentials_at_their_fastest(monkeypatch):
    """The floor of a pass, worked by hand at B = H = 1, T = S = 4, D = 2: a product is
    2·4·4·2 = 64 FLOPs, 40 under a causal mask (5 of 8 scores visible); the forward
    makes one product of each kind and 16 exponentials (10 causal), the vjp 3 that
    contract over D, 4 that yield D, and twice the exponentials; exponentials spread
    over 2 cores."""
    from conformance.bench import ceilings

    monkeypatch.setattr(ceilings.os, "cpu_count", lambda: 2)
    args = ceilings._parse(["--B", "1", "--H", "1", "--T", "4", "--D", "2"])
    kinds = {name: kind for name, (kind, _) in ceilings.products(args).items()}
    # NumPy: its fastest contracting product the whole Q·Kᵀ (64 FLOP/s), every other 32;
    # products yielding D at 16; exponentials at 4 per second; the square is never used.
    numpy_rates = {
        name: 64.0
        if name == "whole Q·Kᵀ"
        else {"contracts D": 32.0, "yields D": 16.0, "square": 1e9}[kind]
        for name, kind in kinds.items()
    }
    found = {"numpy": {**numpy_rates, "exp": 4.0}, "jax": {**numpy_rates, "exp": 8.0}}
    reference = {("forward", False): 14.0, ("forward", True): 4.0, ("vjp", False): 40.0}
    rows = {
        (r["backend"], r["pass"], r["causal"]): r for r in ceilings.ceilings(args, found, reference)
    }
    # forward: 64/64 + 64/16 = 5 s of products, 16 / (4·2) = 2 s of exponentials.
    assert rows[("numpy-flash", "forward", False)]["floor_s"] == pytest.approx(7.0)
    assert rows[("numpy-flash", "forward", False)]["ceiling"] == pytest.approx(2.0)
    # jax's exponentials twice as fast: 16 / (8·2) = 1 s.
    assert rows[("jax-flash", "forward", False)]["floor_s"] == pytest.approx(6.0)
    # causal: 40/64 + 40/16 = 3.125 s, 10 / (4·2) = 1.25 s.
    assert rows[("numpy-flash", "forward", True)]["floor_s"] == pytest.approx(4.375)
    # vjp: 3·64/64 + 4·64/16 = 19 s, 32 / (4·2) = 4 s; 40 / 23 is above the goal 0.75.
    vjp = rows[("numpy-flash", "vjp", False)]
    assert vjp["floor_s"] == pytest.approx(23.0)
    assert vjp["flops"] == 7 * 64 and vjp["goal"] == 0.75 and vjp["reachable"] is True
    # jax-flash, causal: 3.125 s and 10 / (8·2) = 0.625 s; 4 / 3.75 is below its goal 1.15.
    causal = rows[("jax-flash", "forward", True)]
    assert causal["floor_s"] == pytest.approx(3.75) and causal["reachable"] is False
    assert rows[("torch-sdpa", "vjp", False)]["ceiling"] == 1.0
