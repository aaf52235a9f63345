"""The interpreters a GPU or TPU kernel runs under on the CPU, and their known limitations.

A profile's ``interpreter`` names what its function runs under on a machine without its
device (SPEC §13.19): one of ``INTERPRETERS`` by its name, whose words (with the installed
version) the summary repeats and whose known limitations the suite measures, or any other
text, repeated as it is.

A limitation is the interpreter's, not the kernel's: Triton 3.9's interpreter computes
``tl.dot`` on bfloat16 from the operands' raw bit patterns (measured: a 16 × 16 product of
standard normals comes out near 1.7e10, the product of the bits read as unsigned 16-bit
integers, to float32's rounding). Each limitation has a probe, which the suite runs, once
per process, where the limitation could explain a failure: a tiny program under the same
interpreter, compared with float32. Where the probe shows it, a failing call in one of its
dtypes is named by the limitation (``conformance.suite.behaviours``); where it does not
(the interpreter fixed, or the kernel compiled on its device), nothing is said.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Limitation:
    """A known limitation of an interpreter: the dtypes whose results it spoils, the
    sentence that names a failure it causes (no number in it), its probe (what it measured
    where the limitation shows here, in words, or None), and its name in a few words, for
    the verdicts (SPEC §13.18)."""

    dtypes: tuple[str, ...]
    sentence: str
    probe: Callable[[], str | None]
    short: str


@dataclass(frozen=True)
class Interpreter:
    """An interpreter the suite knows: its words, the distribution whose version it names,
    and its known limitations."""

    words: str
    distribution: str
    limitations: tuple[Limitation, ...] = ()

    def version(self) -> str:
        """The installed distribution and its version: "triton 3.9.0"."""
        try:
            version = importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        return f"{self.distribution} {version}"

    def describe(self) -> str:
        """Its words with the installed version: "Triton's interpreter ..., triton 3.9.0"."""
        return f"{self.words}, {self.version()}"


def _triton_bf16_dot() -> str | None:
    """Triton's interpreter on a 16 × 16 ``tl.dot`` of bfloat16 standard normals, against
    the same product in float32: its largest error, where beyond 1 (a float32 sum of 16
    products of bfloat16 numbers is off by about 1e-6)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None  # compiled on its device: no interpreter to limit it
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def dot16(a_ptr, b_ptr, c_ptr):
        i = tl.arange(0, 16)
        square = i[:, None] * 16 + i[None, :]  # (16, 16)
        tl.store(c_ptr + square, tl.dot(tl.load(a_ptr + square), tl.load(b_ptr + square)))

    rng = np.random.default_rng(0)
    a, b = (torch.from_numpy(rng.standard_normal((16, 16))).to(torch.bfloat16) for _ in "ab")
    c = torch.empty(16, 16, dtype=torch.float32)
    dot16[(1,)](a, b, c)
    error = float((c - a.float() @ b.float()).abs().max())
    if error <= 1.0:
        return None
    return f"a 16 × 16 tl.dot of bfloat16 standard normals is off by {error:.3g}"


INTERPRETERS = {
    "triton": Interpreter(
        "Triton's interpreter (TRITON_INTERPRET=1)",
        "triton",
        (
            Limitation(
                ("bfloat16",),
                "Triton's interpreter computes tl.dot on bfloat16 from raw bit patterns: the "
                "interpreter's limitation, not the kernel's",
                _triton_bf16_dot,
                "tl.dot on bfloat16",
            ),
        ),
    ),
    "pallas": Interpreter("Pallas' interpreter (interpret=True)", "jax"),
    "pallas-tpu": Interpreter("Pallas' TPU interpret mode (pltpu.force_tpu_interpret_mode)", "jax"),
}


def interpreter_words(interpreter: str) -> str:
    """What a profile's ``interpreter`` says in the summary: a known one's words with its
    installed version, any other text as it is."""
    known = INTERPRETERS.get(interpreter)
    return known.describe() if known else interpreter


@functools.cache
def measured(interpreter: str) -> tuple[tuple[Limitation, str], ...]:
    """The known limitations of ``interpreter`` that their probes show here, each with what
    the probe measured. A probe that cannot run (its library missing, say) shows nothing:
    a failure is then named as any other, never blamed on the interpreter unmeasured."""
    known = INTERPRETERS.get(interpreter)
    shown = []
    for limitation in known.limitations if known else ():
        try:
            found = limitation.probe()
        except Exception:  # an unmeasured limitation is no finding
            found = None
        if found:
            shown.append((limitation, found))
    return tuple(shown)


def limitation_for(interpreter: str, dtype: str) -> Limitation | None:
    """The measured limitation of ``interpreter`` that spoils ``dtype``'s results, or None."""
    if interpreter not in INTERPRETERS:
        return None
    return next((lim for lim, _ in measured(interpreter) if dtype in lim.dtypes), None)


def limitation_named(behaviour: str) -> str | None:
    """For a failure's behaviour that is a known limitation's sentence: the limitation in a
    few words with its interpreter's version ("tl.dot on bfloat16, triton 3.9.0"), which a
    verdict names instead of counting the failure as the kernel's departure; else None."""
    for known in INTERPRETERS.values():
        for limitation in known.limitations:
            if behaviour == limitation.sentence:
                return f"{limitation.short}, {known.version()}"
    return None
