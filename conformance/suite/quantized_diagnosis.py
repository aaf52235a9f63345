"""Quantized departures diagnosed by name (SPEC §20): the known misreadings of codes and
descales, each computed from the inputs of the call that departed.

The commonest public bugs of FP8 attention are a descale lost on its way: dropped (vLLM
#42580, FlashInfer #1023), replaced by 1 (SGLang #20705), applied twice (vLLM #48016),
indexed by the query head instead of the key/value head, or one used for every head where
per-head ones were given (vLLM #51363); then v's descale applied to the scores, and a
normalised P rounded to e4m3, whose small weights underflow (FlashInfer #5020). Each is
here the declared P pipeline (``conformance.fixtures.quantized.pipeline``) run on the
operands with the misreading planted in them: a function with that bug returns it up to
its own rounding, well within the comparison's bound. As in ``diagnosis.py``, a
misreading counts only where it changes the answer beyond the bound.

``diagnosis.diagnose`` hands an ``attention_quantized`` call here; the cast rule of an FP8
output is named by ``other_cast_rule``, which the output's test asks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from conformance.fixtures import quantized as fq


@dataclass(frozen=True)
class QuantizedCall:
    """One logged ``attention_quantized`` call: codes, descales, options, the pipeline."""

    operands: dict
    options: dict
    pipeline: str

    def descale(self, role: str) -> np.ndarray:
        return np.asarray(self.operands[f"{role}_descale"], dtype=np.float64)

    def shape(self) -> tuple[int, int, int]:
        B, H = np.shape(self.operands["q"])[:2]
        return B, H, np.shape(self.operands["k"])[1]


def run(call: QuantizedCall, **changes) -> np.ndarray:
    """The declared pipeline on the call's operands with ``changes`` (a descale replaced)."""
    o = {**call.operands, **changes}
    return fq.pipeline(
        o["q"], o["k"], o["v"], o["q_descale"], o["k_descale"], o["v_descale"], call.pipeline,
        block_size=o.get("block_size"), **call.options,
    )  # fmt: skip


@dataclass(frozen=True)
class QuantizedMisreading:
    name: str
    sentence: str
    applies: Callable[[QuantizedCall], bool]
    compute: Callable[[QuantizedCall], np.ndarray]


def _always(call: QuantizedCall) -> bool:
    return True


def _dropped(role: str) -> Callable[[QuantizedCall], np.ndarray]:
    return lambda c: run(c, **{f"{role}_descale": np.ones_like(c.descale(role), np.float32)})


def _all_ones(c: QuantizedCall) -> np.ndarray:
    return run(c, **{f"{r}_descale": np.ones_like(c.descale(r), np.float32) for r in "qkv"})


def _twice(role: str) -> Callable[[QuantizedCall], np.ndarray]:
    return lambda c: run(c, **{f"{role}_descale": (c.descale(role) ** 2).astype(np.float32)})


def _per_head(role: str) -> Callable[[QuantizedCall], bool]:
    return lambda c: c.descale(role).ndim == 2 and c.descale(role).size > 1


def _by_query_head(c: QuantizedCall) -> np.ndarray:
    """Query head h reads q_descale[b, h % K], not q_descale[b, h // G]: a (B, H) descale."""
    B, H, K = c.shape()
    return run(c, q_descale=c.descale("q")[:, np.arange(H) % K].astype(np.float32))


def _first_for_all(c: QuantizedCall) -> np.ndarray:
    changes = {}
    for r in "qkv":
        d = c.descale(r)
        if d.ndim >= 2 and d.size > 1:
            changes[f"{r}_descale"] = np.full_like(d, d.flat[0], dtype=np.float32)
    return run(c, **changes)


def _v_before_softmax(c: QuantizedCall) -> np.ndarray:
    """v's descale multiplies the scores with q's and k's, and not the output."""
    dq, dv = c.descale("q"), c.descale("v")
    return run(
        c,
        q_descale=np.broadcast_to(dq * dv, np.broadcast_shapes(dq.shape, dv.shape)).astype(
            np.float32
        ),
        v_descale=np.ones_like(dv, np.float32),
    )


def _v_per_head(c: QuantizedCall) -> bool:
    return c.descale("v").ndim < 3 and c.descale("q").ndim <= c.descale("v").ndim


def _normalised_p(c: QuantizedCall) -> np.ndarray:
    return run(QuantizedCall(c.operands, c.options, "e4m3_normalized"))


MISREADINGS: tuple[QuantizedMisreading, ...] = (
    QuantizedMisreading(
        "all-descales-one",
        "every descale is replaced by 1: the codes are read as the values",
        _always,
        _all_ones,
    ),
    *(
        QuantizedMisreading(
            f"{r}-descale-dropped",
            f"{r}'s descale is dropped: {r} is read as its codes",
            _always,
            _dropped(r),
        )
        for r in "qkv"
    ),
    *(
        QuantizedMisreading(
            f"{r}-descale-twice",
            f"{r}'s descale is applied twice",
            _always,
            _twice(r),
        )
        for r in "qkv"
    ),
    QuantizedMisreading(
        "q-descale-by-query-head",
        "q's descale is indexed by the query head, not the key/value head",
        lambda c: _per_head("q")(c) and c.shape()[1] != c.shape()[2],
        _by_query_head,
    ),
    QuantizedMisreading(
        "per-tensor-for-per-head",
        "one descale (the first head's) is used for every head where per-head descales were given",
        lambda c: any(c.descale(r).ndim >= 2 and c.descale(r).size > 1 for r in "qkv"),
        _first_for_all,
    ),
    QuantizedMisreading(
        "v-descale-before-softmax",
        "v's descale is applied to the scores, before the softmax, not to the output",
        _v_per_head,
        _v_before_softmax,
    ),
    QuantizedMisreading(
        "normalised-p-underflow",
        "P is normalised before it is rounded to float8_e4m3fn: weights below 2⁻¹⁰ underflow to 0",
        lambda c: c.pipeline != "e4m3_normalized",
        _normalised_p,
    ),
)
BY_NAME = {m.name: m for m in MISREADINGS}


def call_of(backend, args: tuple, kwargs: dict) -> QuantizedCall | None:
    """The ``QuantizedCall`` of a logged call, or None (an FP8 output: its codes are judged
    by ``other_cast_rule``)."""
    form = getattr(backend, "quantized", None)
    if form is None or len(args) < 3 or kwargs.get("out_descale") is not None:
        return None
    operands = dict(zip("qkv", args[:3]))
    for name in ("q_descale", "k_descale", "v_descale", "block_size"):
        operands[name] = kwargs.get(name)
    options = {
        n: x
        for n, x in kwargs.items()
        if n not in operands and n not in ("out_descale", "out_format") and x is not None
    }
    return QuantizedCall(operands, options, form.pipeline)


def _within(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    if a.shape != b.shape or (np.isnan(a) != np.isnan(b)).any():
        return False
    both = np.isfinite(a) & np.isfinite(b)
    return bool(np.abs(np.where(both, a - b, 0.0)).max(initial=0.0) <= tol)


def diagnose(actual, calls: list, tol: float) -> str | None:
    """The sentence of the first misreading whose output ``actual`` equals within ``tol``
    (SPEC §20.6's bound of the call), where it changes the right answer beyond it."""
    _, backend, _, args, kwargs = calls[-1]
    call = call_of(backend, args, kwargs)
    if call is None:
        return None
    actual = np.asarray(actual, dtype=np.float64)
    right = run(call)
    if actual.shape != right.shape or _within(actual, right, tol):
        return None
    found = []
    for misreading in MISREADINGS:
        if not misreading.applies(call):
            continue
        planted = misreading.compute(call)
        if _within(planted, right, tol):
            continue
        if _within(actual, planted, tol):
            found.append(misreading.sentence)
    # Where the inputs cannot tell two apart (q's and k's descales both scale the scores,
    # and a score so large that either makes the softmax one-hot), each is named.
    return " or ".join(found) or None


def other_cast_rule(got, y: np.ndarray, out_descale: float, fmt: str, declared: str) -> str | None:
    """The sentence for an FP8 output whose codes past the largest value follow the rule
    other than the declared one, or None."""
    other = "overflow" if declared == "saturate" else "saturate"
    got = np.asarray(got, dtype=np.float64)
    want = fq.cast(np.asarray(y) / float(out_descale), fmt, other).astype(np.float64)
    past = np.abs(np.asarray(y) / float(out_descale)) > fq.LARGEST[fmt] * (1 + 2**-3)
    if not past.any():
        return None
    same = (got[past] == want[past]) | (np.isnan(got[past]) & np.isnan(want[past]))
    if same.all():
        return f"casts past the largest value with the {other} rule, where {declared} is declared"
    return None
