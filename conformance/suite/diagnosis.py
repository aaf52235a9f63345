"""Departures diagnosed by name: the known misreadings of attention, each computed by the
oracle from the inputs of the call that departed.

When a comparison fails (a ``Departure`` that saw the function's output), the suite asks
whether that output equals, within the comparison's tolerance, attention computed with one
known misreading planted: ``is_causal`` ignored, the other causal alignment, the scale
1/√E, a bool mask added as 0/1, GQA heads tiled, and so on (``MISREADINGS``). The first
that matches names the failure, in one sentence that holds no number, so one cause is one
finding across dtypes and sizes (SPEC §13.15).

Each misreading (``conformance/suite/misreadings.py``) is computed by the oracle from
the departing call's inputs with the misreading planted in them. A misreading counts only
where it changes the answer: the correct output must depart from it beyond the tolerance,
or the sentence could name a bug the inputs cannot show.

Every misreading the output equals is kept (``find``): where the case cannot tell two
apart, the failure names both, and over a run ``explaining_causes`` names each failure by
the one the most failures show. An output no misreading explains gets where its error lies
(``where_it_departs``).

The pass is cheap and runs only on departures: a few float64 runs of the failing call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from conformance.suite import lse_diagnosis, merge_diagnosis, quantized_diagnosis
from conformance.suite.domain import CARRIED_BACK
from conformance.suite.misreadings import MISREADINGS, Misreading
from conformance.suite.planted import (
    Call,
    call_of,
    oracle_run,
)
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


def _magnitude(x: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(np.where(np.isfinite(x), x, 0.0)), initial=0.0)))


class Found(NamedTuple):
    """What the diagnosis found in a departing output: ``sentence``, the one that names the
    failure (None: nothing does); ``matches``, the sentence of every misreading the output
    equals, in ``MISREADINGS``' order; ``where``, for an output no misreading explains,
    where its error lies and which options move it (None otherwise)."""

    sentence: str | None
    matches: tuple[str, ...]
    where: str | None


NOTHING = Found(None, (), None)


def _same(x: np.ndarray) -> np.ndarray:
    return x


def diagnose(actual, calls: list, tol: float) -> str | None:
    """The sentence that names the departure of ``actual`` (the last call's output): its
    first misreading's (``find``), or None."""
    return find(actual, calls, tol).sentence


def find(actual, calls: list, tol: float) -> Found:
    """Every misreading whose output ``actual`` (the last call's output) equals within
    ``tol``, and the sentence that names it: the first one's, joined with the sentences of
    the later ones whose outputs equal it on this call, since the case cannot tell them
    apart (a misreading that ``PRECEDES`` names alone). ``NOTHING`` where the last call is
    no plain ``attention`` call or ``actual`` is right for it; where no misreading fits,
    ``where`` says where the error lies."""
    if calls and calls[-1][2] == "attention_quantized":
        sentence = quantized_diagnosis.diagnose(actual, calls, tol)  # SPEC §20
        return Found(sentence, (sentence,) if sentence else (), None)
    if calls and calls[-1][2] == "merge_states":
        sentence = merge_diagnosis.diagnose(actual, calls, tol)  # SPEC §22
        return Found(sentence, (sentence,) if sentence else (), None)
    if not calls or calls[-1][2] != "attention":
        return NOTHING
    if calls[-1][4].get("return_lse"):
        sentence = lse_diagnosis.diagnose(actual, calls[-1], tol)  # SPEC §21
        return Found(sentence, (sentence,) if sentence else (), None)
    call = call_of(calls[-1][3], calls[-1][4])
    if call is None:
        return NOTHING
    # A call carried into a kernel's domain (suite/domain.py): the kernel's output was
    # mapped back to the test's shapes, and so is each output the call is held against.
    back = CARRIED_BACK.get(calls[-1][0], _same)
    actual = np.asarray(actual, dtype=np.float64)
    if actual.ndim == 3:
        actual = actual[None]  # (1, H, T, E)
    right = back(oracle_run(call))
    if actual.shape != right.shape or matches(actual, right, tol):
        return NOTHING
    found: list[tuple[Misreading, np.ndarray, float]] = []
    for misreading in MISREADINGS:
        if not misreading.applies(call):
            continue
        planted = misreading.compute(call)
        if planted is None:
            continue
        planted = back(planted)
        # The tolerance was set for the right answer's magnitude (SPEC §7).
        allowed_error = tol * _magnitude(planted) / _magnitude(right)
        if matches(planted, right, allowed_error):
            continue
        if not _finite_evidence(misreading, planted, right, allowed_error):
            continue
        within = max(tol, allowed_error) * misreading.slack
        if matches(actual, planted, within):
            found.append((misreading, planted, within))
    if not found:
        return Found(None, (), where_it_departs(actual, call, right, tol))
    sentences = tuple(dict.fromkeys(m.sentence for m, _, _ in found))
    first, planted, within = found[0]
    alike = [first.sentence]
    if first.name not in PRECEDES:
        for other, other_planted, _ in found[1:]:
            if other.sentence not in alike and matches(other_planted, planted, within):
                alike.append(other.sentence)
    if len(alike) == 1:
        return Found(first.sentence, sentences, None)
    return Found("; or, alike on this case, ".join(alike), sentences, None)


#: Misreadings named alone even where another gives the same output: garbage in the
#: blocked slots makes the mask ignored look the same, and the slots read are the finding.
PRECEDES = {"blocked-slot-read", "blocked-slot-multiplied"}


def explaining_causes(failures: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """The behaviour to name each failure of one run of one function by, where the run as
    a whole tells the causes apart.

    ``failures``: per failing test, (its behaviour, the sentences of every misreading its
    output equals): ``behaviours.behaviour`` and ``behaviours.misreadings`` of the test's
    error, or the report's ``behaviours.PROPERTY`` and ``behaviours.MISREADINGS`` (a JSON
    list). Returns one behaviour per failure, in order: of a failure's misreadings, the
    one that the most failures of the run show; where several tie for the most (nothing
    in the run tells them apart) or the failure matched none, its own behaviour. So where
    one misreading explains every failure and another only some, each is named by the one
    that explains them all: causality aligned bottom-right, not "is_causal is ignored" at
    T = 1, where the two are the same.
    """
    counts = Counter(s for _, found in failures for s in set(found))
    named = []
    for behaviour, found in failures:
        top = max((counts[s] for s in found), default=0)
        best = [s for s in dict.fromkeys(found) if counts[s] == top]
        named.append(best[0] if len(best) == 1 else behaviour)
    return named


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
        with np.errstate(invalid="ignore"):
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


def output_dtype(in_dtype, out_dtype) -> str:
    """What an output in another dtype than the inputs shows: float32 for 16-bit inputs
    (a kernel that accumulates in float32 and never casts back) is named as such."""
    names = {np.dtype(in_dtype).name, np.dtype(out_dtype).name}
    if np.dtype(out_dtype).name == "float32" and names & {"float16", "bfloat16"}:
        return "returns float32 for float16 or bfloat16 inputs"
    return "returns an output in another dtype than its inputs"


#: The misreadings whose very mark is a NaN or an infinity in the output.
_NONFINITE_BY_NATURE = {
    "blocked-slot-read",
    "causal-added",
    "keys-past-s",
    "blocked-slot-multiplied",
    "empty-rows-nan",
    "scale-before-product",
}


def _finite_evidence(misreading: Misreading, planted, right, tol: float) -> bool:
    """Whether the planted output departs from the right one somewhere it is finite. Where it
    departs only by NaN or infinity (a scale applied twice to scores near the largest float
    overflows), an output that overflowed for another reason would match it by its
    non-finite entries alone, and the sentence would name a cause the inputs cannot tell
    apart; a misreading that shows as NaN by nature is exempt."""
    if misreading.name in _NONFINITE_BY_NATURE:
        return True
    finite = np.isfinite(planted) & np.isfinite(right)
    with np.errstate(invalid="ignore"):
        departs = finite & (np.abs(np.where(finite, planted - right, 0.0)) > tol)
    return bool(departs.any())
