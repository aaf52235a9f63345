"""The areas' readers of ``conformance/suite/diagnosis.py``: each reads a departing call of
its entry point into a ``Subject`` (the areas whose misreadings apply, the context they
are computed from, the output compared and the right one), and says where the error of
an output no misreading explains lies.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from conformance.suite.domain import CARRIED_BACK
from conformance.suite.planted import Call, call_of, oracle_run
from conformance.suite.planted_gradients import VjpCall, vjp_of
from conformance.suite.planted_lse_merge import LseCall, MergeCall, lse_of
from conformance.suite.planted_quantized import QuantizedCall, quantized_run
from conformance.suite.tolerance import nonfinite_mismatch


def matches(actual: np.ndarray, want: np.ndarray, tol: float) -> bool:
    """Whether ``actual`` equals ``want`` as SPEC §7 compares: the same shape, NaN and
    infinities where ``want`` has them, the finite entries within ``tol``."""
    if actual.shape != want.shape or nonfinite_mismatch(actual, want).any():
        return False
    both = np.isfinite(actual) & np.isfinite(want)
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.where(both, actual - want, 0.0))
    return bool(diff.max(initial=0.0) <= tol)


def magnitude(x: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(np.where(np.isfinite(x), x, 0.0)), initial=0.0)))


class Subject(NamedTuple):
    """A departing call as its area's reader gives it: the areas whose misreadings apply,
    the context they are computed from, the output compared and the right one, the map
    of a planted output to the compared one's shapes, and where the error lies where no
    misreading explains it."""

    areas: tuple[str, ...]
    context: Any
    actual: np.ndarray
    right: np.ndarray
    back: Callable[[np.ndarray], np.ndarray]
    where: Callable[[np.ndarray, np.ndarray, float], str | None]
    #: The least tolerance a misreading is held to: a check exact by the spec (a merge of
    #: two empty states) still names a misreading computed in float64 for a float32 call.
    floor: float = 0.0


def _same(x: np.ndarray) -> np.ndarray:
    return x


# --- The areas' readers ---------------------------------------------------------------------


def _attention(actual, calls: list) -> Subject | None:
    """A plain ``attention`` call (no lse): attention whole and split-KV."""
    call = call_of(calls[-1][3], calls[-1][4])
    if call is None:
        return None
    # A call carried into a kernel's domain (suite/domain.py): the kernel's output was
    # mapped back to the test's shapes, and so is each output the call is held against.
    back = CARRIED_BACK.get(calls[-1][0], _same)
    actual = np.asarray(actual, dtype=np.float64)
    if actual.ndim == 3:
        actual = actual[None]  # (1, H, T, E)
    right = back(oracle_run(call))
    if actual.shape != right.shape:
        return None

    def where(actual, right, tol):
        return where_it_departs(actual, call, right, tol)

    return Subject(("attention", "split-kv"), call, actual, right, back, where)


def _lse(actual, calls: list) -> Subject | None:
    """The lse of an ``attention(..., return_lse=True)`` call: (B, H, T) or (H, T), or its
    other layout; the output beside it is left to nothing (the lse's misreadings say
    nothing of it)."""
    logged = calls[-1]
    kwargs = {n: x for n, x in logged[4].items() if n != "return_lse"}
    call = call_of(logged[3], kwargs)
    if call is None:
        return None
    actual = np.asarray(actual, dtype=np.float64)
    if np.ndim(logged[3][0]) == 3:
        actual = actual[None]
    right = lse_of(call)  # (B, H, T)
    if actual.ndim != 3 or sorted(actual.shape[1:]) != sorted(right.shape[1:]):
        return None  # the output beside the lse, not the lse
    return Subject(("lse",), LseCall(call, right, actual), actual, right, _same, _lse_where)


def _merge(actual, calls: list) -> Subject | None:
    """o or lse of a ``merge_states`` call (o: (..., E), lse: o's shape without E)."""
    from conformance.fixtures import oracle_merge

    args = calls[-1][3]
    if len(args) != 4:
        return None
    o_a, lse_a, o_b, lse_b = (np.asarray(x, dtype=np.float64) for x in args)
    actual = np.asarray(actual, dtype=np.float64)
    part = 0 if actual.shape == o_a.shape else 1 if actual.shape == lse_a.shape else None
    if part is None:
        return None
    right = oracle_merge.merge_states([(o_a, lse_a), (o_b, lse_b)])[part]
    context = MergeCall(o_a, lse_a, o_b, lse_b, part)

    def where(actual, right, tol):
        return _merge_where(context, actual, right, tol)

    # The merge's own rounding in the pieces' dtype: 8 of its eps.
    dtype = np.asarray(args[part]).dtype  # o_a for o, lse_a for the lse
    eps = np.finfo(dtype).eps if np.issubdtype(dtype, np.floating) else 0.0
    floor = 8 * float(eps) * magnitude(right)
    return Subject(("merge",), context, actual, right, _same, where, floor)


def _quantized(actual, calls: list) -> Subject | None:
    """An ``attention_quantized`` call (not an FP8 output: its codes are judged by
    ``other_cast_rule``), against the declared P pipeline on its operands."""
    _, backend, _, args, kwargs = calls[-1]
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
    actual = np.asarray(actual, dtype=np.float64)
    context = QuantizedCall(operands, options, form.pipeline, actual)
    right = quantized_run(context)
    if actual.shape != right.shape:
        return None

    def where(actual, right, tol):
        return _quantized_where(context, actual, right, tol)

    return Subject(("quantized",), context, actual, right, _same, where)


def _vjp(actual, calls: list) -> Subject | None:
    """A gradient of an ``attention_vjp`` call: the one of its gradients (dq, dk, dv,
    dmask, dsinks) of ``actual``'s shape whose right answer it is nearest to (dk and dv
    share a shape where D = E)."""
    _, _, _, args, kwargs = calls[-1]
    call = call_of(args[:3], kwargs) if len(args) >= 4 else None
    if call is None:
        return None
    d_out = np.asarray(args[3], dtype=np.float64)
    d_out = d_out[None] if d_out.ndim == 3 else d_out  # (B, H, T, E)
    if d_out.shape != (*call.q.shape[:3], call.v.shape[-1]):
        return None
    back = CARRIED_BACK.get(calls[-1][0], _same)
    right = vjp_of(call, d_out, back)
    actual = np.asarray(actual, dtype=np.float64)
    if np.ndim(args[0]) == 3 and actual.ndim == 3:
        actual = actual[None]  # dq, dk or dv of an unbatched call
    names = [n for n, g in right.items() if g.shape == actual.shape]
    if not names:
        return None
    name = min(names, key=lambda n: float(np.nanmax(_error(actual, right[n]), initial=0.0)))
    context = VjpCall(call, d_out, name, back)
    return Subject(("gradients",), context, actual, right[name], _same, lambda *_: None)


#: The reader of each entry point's calls, and, for ``attention``, of its lse.
READERS: dict[str, Callable[[Any, list], Subject | None]] = {
    "attention": _attention,
    "attention_lse": _lse,
    "attention_vjp": _vjp,
    "merge_states": _merge,
    "attention_quantized": _quantized,
}


def read(actual, calls: list) -> Subject | None:
    """The last call, read by its area's reader; None where no reader takes it."""
    method = calls[-1][2]
    if method == "attention" and calls[-1][4].get("return_lse"):
        method = "attention_lse"
    reader = READERS.get(method)
    return None if reader is None else reader(actual, calls)


# --- Where an unexplained error lies --------------------------------------------------------


def _error(actual, right) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        error = np.where(np.isfinite(actual) & np.isfinite(right), np.abs(actual - right), np.inf)
    return np.where(np.isnan(actual) & np.isnan(right), 0.0, error)


def _axes_text(bad: np.ndarray, nouns) -> list[str]:
    parts = []
    for axis, (noun, plural) in enumerate(nouns):
        n = bad.shape[axis]
        which = np.flatnonzero(bad.any(axis=tuple(a for a in range(bad.ndim) if a != axis)))
        if len(which) == n:
            parts.append(f"every {noun} ({n})" if n > 1 else f"the one {noun}")
        else:
            parts.append(f"{noun if len(which) == 1 else plural} {_ranges(which)} of {n}")
    return parts


_BHT = (("batch element", "batch elements"), ("head", "heads"), ("row", "rows"))


def _heads_and_rows(actual, right, tol) -> str | None:
    """Which batch elements, heads, rows (and channels) of a quantized output hold the
    error."""
    bad = _error(actual, right) > tol
    if bad.ndim != 4 or not bad.any():
        return None
    return "the error lies in " + ", ".join(_axes_text(bad, (*_BHT, ("channel", "channels"))))


def _nearer(actual, other, right, tol) -> bool:
    """Whether ``other`` (the answer with one input changed) changes the right answer and
    is nearer to ``actual`` than the right answer is, by half at least."""
    if other.shape != actual.shape or matches(other, right, tol):
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.nanmax(np.abs(actual - other)) < 0.5 * np.nanmax(np.abs(actual - right)))


def _quantized_where(c: QuantizedCall, actual, right, tol) -> str | None:
    """Which heads and rows of a quantized output hold the error, and which of the call's
    options left out, or which descale taken as 1, bring the declared pipeline nearer."""
    text = _heads_and_rows(actual, right, tol)
    if text is None:
        return None
    moved = [
        name
        for name in sorted(c.options)
        if name != "causal_alignment"
        and _nearer(actual, quantized_run(c, options={name: None}), right, tol)
    ]
    for r in "qkv":
        ones = np.ones_like(c.descale(r), np.float32)
        if _nearer(actual, quantized_run(c, **{f"{r}_descale": ones}), right, tol):
            moved.append(f"{r}'s descale taken as 1")
    if moved:
        text += "; the output is nearer to the declared pipeline without " + " or ".join(moved)
    return text


def _lse_where(actual, right, tol) -> str | None:
    bad = _error(actual, right) > tol
    if bad.ndim != 3 or not bad.any():
        return None
    text = "the error lies in " + ", ".join(_axes_text(bad, _BHT))
    empty = right == -np.inf
    if empty.any() and not bad[~empty].any():
        text += ", only in rows with no key"
    return text


def _merge_where(c: MergeCall, actual, right, tol) -> str | None:
    """Which rows of a merge hold the error, and which pieces they had: both holding keys,
    one empty, both empty, or an lse past float32's exp (above 88)."""
    bad = _error(actual, right) > tol
    if c.part == 0:
        bad = bad.any(axis=-1)
    if not bad.any():
        return None
    a, b = np.isfinite(c.lse_a), np.isfinite(c.lse_b)
    kinds = {
        "both pieces holding keys": a & b,
        "one piece empty (lse = -inf)": a ^ b,
        "both pieces empty": ~a & ~b,
    }
    where = [name for name, rows in kinds.items() if (bad & rows).any()]
    text = f"the error lies in {int(bad.sum())} of {bad.size} rows of the merged " + (
        "o" if c.part == 0 else "lse"
    )
    text += ": rows with " + " or ".join(where)
    with np.errstate(invalid="ignore"):
        large = (np.where(a, np.abs(c.lse_a), 0) > 88) | (np.where(b, np.abs(c.lse_b), 0) > 88)
    if (bad & large).any() and not (bad & ~large).any():
        text += ", only where an lse is past 88"
    return text


def where_it_departs(actual, call: Call, right, tol: float) -> str | None:
    """For an output no misreading explains: which batch elements, heads, query rows and
    channels hold its error, and which of the call's options, left out, bring the output
    nearer (the oracle without that option is nearer to it than the right answer is)."""
    with np.errstate(invalid="ignore"):
        error = np.where(
            np.isfinite(actual) & np.isfinite(right), np.abs(actual - right), np.inf
        )  # (B, H, T, E)
    error = np.where(np.isnan(actual) & np.isnan(right), 0.0, error)
    bad = error > tol
    if not bad.any():
        return None
    parts = []
    for axis, (noun, plural) in enumerate(
        (
            ("batch element", "batch elements"),
            ("head", "heads"),
            ("row", "rows"),
            ("channel", "channels"),
        )
    ):
        n = bad.shape[axis]
        which = np.flatnonzero(bad.any(axis=tuple(a for a in range(4) if a != axis)))
        if len(which) == n:
            parts.append(f"every {noun} ({n})" if n > 1 else f"the one {noun}")
        else:
            parts.append(f"{noun if len(which) == 1 else plural} {_ranges(which)} of {n}")
    moved = []
    for name in ("mask", *sorted(call.options)):
        if name == "causal_alignment" or (name == "mask" and call.mask is None):
            continue
        without = oracle_run(call, **{name: None})
        if without.shape != actual.shape or matches(without, right, tol):
            continue
        # A row that is NaN throughout (a row with no key) is no evidence either way.
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            nearer = np.nanmax(np.abs(actual - without)) < 0.5 * np.nanmax(np.abs(actual - right))
        if nearer:
            moved.append("is_causal" if name == "is_causal" else name)
    text = "the error lies in " + ", ".join(parts)
    if moved:
        text += "; the output is nearer to attention without " + " or ".join(moved)
    return text


def _ranges(indices) -> str:
    """[0, 1, 2, 5] as "0-2, 5"."""
    runs: list[list[int]] = []
    for i in (int(x) for x in indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
