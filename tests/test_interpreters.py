"""Interpreters' known limitations named as the interpreter's (SPEC §13.19): a probe the
suite runs measures each, and a failing call in a dtype the limitation spoils is named by
it, not by the kernel's clause."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.adapters import interpreters
from conformance.adapters.interpreters import Interpreter, Limitation, interpreter_words
from conformance.suite import verdicts
from conformance.suite.behaviours import behaviour, misreadings
from conformance.suite.tolerance import Departure

ROOT = Path(__file__).resolve().parent.parent

#: A whole-row attention kernel in Triton, one program per (batch, head): right in float32
#: under the interpreter, wrong in bfloat16 only through the interpreter's tl.dot.
TRITON_KERNEL = """
import torch
import triton
import triton.language as tl


@triton.jit
def _attention(q_ptr, k_ptr, v_ptr, o_ptr, scale, T: tl.constexpr, S: tl.constexpr,
               D: tl.constexpr):
    bh = tl.program_id(0)
    t, s, d = tl.arange(0, T), tl.arange(0, S), tl.arange(0, D)
    q = tl.load(q_ptr + bh * T * D + t[:, None] * D + d[None, :])  # (T, D)
    k = tl.load(k_ptr + bh * S * D + s[:, None] * D + d[None, :])  # (S, D)
    v = tl.load(v_ptr + bh * S * D + s[:, None] * D + d[None, :])  # (S, D)
    scores = tl.dot(q, tl.trans(k)) * scale  # (T, S)
    p = tl.exp(scores - tl.max(scores, 1)[:, None])  # (T, S)
    p = p / tl.sum(p, 1)[:, None]
    o = tl.dot(p.to(v.dtype), v)  # (T, D)
    tl.store(o_ptr + bh * T * D + t[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty))


def attention(q, k, v, *, sm_scale):
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    _attention[(B * H,)](q.contiguous(), k.contiguous(), v.contiguous(), o, sm_scale, T,
                         k.shape[2], D)
    return o
"""

TRITON_PROFILE = """
name = "tkern"
target = "tkern:attention"
framework = "torch"
layout = "BHTD"
requires = ["torch", "triton"]
interpreter = "triton"
dtypes = ["float32", "bfloat16"]

[options]
scale = "sm_scale"

[call]
scale = "always"

[mask]
bool = false
float = false

[forms]
causal = "none"

[domain]
head_dims = [16]
t_multiple = 16
s_multiple = 16
"""

SENTENCE = interpreters.INTERPRETERS["triton"].limitations[0].sentence


class _Backend:
    name = "k"

    def __init__(self, interpreter: str) -> None:
        self.interpreter = interpreter


def _calls(interpreter: str, dtype) -> list:
    q = np.zeros((1, 1, 2, 2), dtype=dtype)  # (B, H, T, D)
    return [(0, _Backend(interpreter), "attention", (q, q, q), {})]


@pytest.mark.clause("13.19")
def test_a_measured_limitation_names_the_failures_of_its_dtypes(monkeypatch):
    shown = Limitation(("float16",), "the toy rounds float16 twice", lambda: "off", "float16")
    hidden = Limitation(("float32",), "the toy drops float32", lambda: None, "float32")
    toy = Interpreter("a toy interpreter", "numpy", (shown, hidden))
    monkeypatch.setitem(interpreters.INTERPRETERS, "toy", toy)
    interpreters.measured.cache_clear()
    err = Departure("m")
    assert behaviour(err, _calls("toy", np.float16), "4.1", "T") == shown.sentence
    assert misreadings(err, _calls("toy", np.float16)) == []
    # Its probe does not show it here: the failure is named as any other.
    assert behaviour(err, _calls("toy", np.float32), "4.1", "T").startswith("fails a check")
    # Another interpreter, or text that names none the suite knows: nothing is blamed on it.
    assert behaviour(err, _calls("Pallas' interpreter", np.float16), "4.1", "T") != shown.sentence
    assert interpreter_words("toy").startswith("a toy interpreter, numpy ")
    assert interpreter_words("my own words") == "my own words"
    interpreters.measured.cache_clear()


@pytest.mark.clause("13.19")
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch (pip install --no-deps triton)",
)
def test_tritons_bfloat16_dot_is_named_as_the_interpreters(tmp_path):
    """Measured on the installed Triton (3.9.0 here): its interpreter's 16 × 16 bfloat16
    tl.dot is off by about 2.8e10. The kernel passes in float32 and its bfloat16 failures
    are named as the interpreter's; the summary says what the probe measured."""
    (tmp_path / "tkern.py").write_text(TRITON_KERNEL)
    (tmp_path / "tkern.toml").write_text(TRITON_PROFILE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "conformance/tests/test_fixtures.py")]
        + ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0"]
        + ["--impl-profile", "tkern.toml", "-k", "test_fixture_case and T7-S7"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "1 failed, 1 passed" in out, out[-3000:]
    assert f"tkern: {SENTENCE}" in out, out[-3000:]
    version = interpreters.INTERPRETERS["triton"].version()
    assert (
        "verdict tkern — math: conforms (1 test), except 1 test its interpreter cannot run "
        f"right: tl.dot on bfloat16, {version} · edges: not run · contract: not run"
    ) in out, out[-3000:]
    assert "runs under Triton's interpreter (TRITON_INTERPRET=1), triton " in out
    assert "its interpreter's known limitation, measured here (a 16 × 16 tl.dot of" in out


@pytest.mark.clause("13.18")
def test_a_verdict_counts_the_interpreters_failures_apart():
    """A failure named as its interpreter's limitation is no departure of the kernel's: the
    layer conforms on the rest, or departs on its own failures alone, and says how many
    tests the interpreter spoiled; where it spoiled every test that ran, the layer is not
    judged, never "conforms"."""
    words = f"tl.dot on bfloat16, {interpreters.INTERPRETERS['triton'].version()}"

    def row(clause, outcome, found="", layer="math"):
        return {
            "backend": "k",
            "clause": clause,
            "layer": layer,
            "outcome": outcome,
            "behaviour": found,
            "test": f"t{clause}",
            "rerun": "pytest ...",
        }

    spoiled = [row("11.1", "failed", SENTENCE), row("5.1", "xfailed", SENTENCE)]
    own = row("6.3", "failed", "departs from §6.3 (No future leakage)")
    assert verdicts.layer_verdict([row("11.1", "passed"), *spoiled], "math", []) == (
        f"math: conforms (1 test), except 2 tests its interpreter cannot run right: {words}"
    )
    assert verdicts.layer_verdict([own, *spoiled], "math", []) == (
        "math: departs on §6.3 (departs from §6.3 (No future leakage)), except 2 tests its "
        f"interpreter cannot run right: {words}"
    )
    assert verdicts.layer_verdict(spoiled[:1], "math", []) == (
        f"math: not judged (1 test its interpreter cannot run right: {words})"
    )
    # The same behaviour under no interpreter the suite knows is the kernel's departure.
    assert verdicts.layer_verdict([row("11.1", "failed", "fails")], "math", []).startswith(
        "math: departs on §11.1"
    )


#: Integer arithmetic a quantized kernel does, under Triton's interpreter: an int8 tl.dot
#: into int32, the same accumulated, C's division and remainder, and uint8's refusal.
TRITON_INTEGERS = """
import numpy as np, torch, triton, triton.language as tl


@triton.jit
def _dot(a_ptr, b_ptr, c_ptr, twice_ptr):
    i = tl.arange(0, 16)
    square = i[:, None] * 16 + i[None, :]  # (16, 16)
    a, b = tl.load(a_ptr + square), tl.load(b_ptr + square)
    tl.store(c_ptr + square, tl.dot(a, b))
    tl.store(twice_ptr + square, tl.dot(a, b, tl.dot(a, b)))


@triton.jit
def _divmod(x_ptr, q_ptr, r_ptr):
    i = tl.arange(0, 8)
    x = tl.load(x_ptr + i)
    tl.store(q_ptr + i, x // 3)
    tl.store(r_ptr + i, x % 3)


rng = np.random.default_rng(0)
a, b = (torch.from_numpy(rng.integers(-128, 128, (16, 16))).to(torch.int8) for _ in "ab")
c, twice = torch.empty(16, 16, dtype=torch.int32), torch.empty(16, 16, dtype=torch.int32)
_dot[(1,)](a, b, c, twice)
exact = a.long() @ b.long()
print("dot", int((c.long() - exact).abs().max()), int((twice.long() - 2 * exact).abs().max()))
x = torch.tensor([-7, -4, -3, -1, 0, 1, 4, 7], dtype=torch.int32)
q, r = torch.empty_like(x), torch.empty_like(x)
_divmod[(1,)](x, q, r)
print("divmod", q.tolist(), r.tolist())
try:
    _dot[(1,)](a.to(torch.uint8), b.to(torch.uint8), c, twice)
except Exception as err:
    print("uint8", type(err).__name__, err)
"""


@pytest.mark.clause("13.19")
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch (pip install --no-deps triton)",
)
def test_tritons_interpreter_computes_integers_as_the_device(tmp_path):
    """Measured on the installed Triton (3.9.0 here): its interpreter has no integer
    limitation of the kind its bfloat16 tl.dot has, so INTERPRETERS names none: an int8
    tl.dot into int32 is exact, accumulated too; ``//`` and ``%`` truncate toward zero, as
    C and the GPU do; a uint8 tl.dot is refused by Triton's front end ("only int8
    supported!"), which a compiled kernel meets alike."""
    (tmp_path / "integers.py").write_text(TRITON_INTEGERS)
    run = subprocess.run(
        [sys.executable, "integers.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "dot 0 0", run.stdout
    assert lines[1] == "divmod [-2, -1, -1, 0, 0, 0, 1, 2] [-1, -1, 0, -1, 0, 1, 1, 1]"
    assert lines[2].startswith("uint8 ") and "only int8 supported!" in lines[2], run.stdout
    assert all("int8" not in lim.dtypes for lim in interpreters.INTERPRETERS["triton"].limitations)
