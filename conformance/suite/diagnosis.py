"""Departures diagnosed by name: the one engine that holds a departing output against the
registry of misreadings (``conformance/suite/misreadings.py``), whatever the area.

When a comparison fails (a ``Departure`` that saw the function's output), the suite asks
whether that output equals, within the comparison's tolerance, what the function returns
with one known misreading planted: ``is_causal`` ignored, the lse in base 2, a merge
weighted with the other piece's lse, v's descale dropped, and so on. The departing call
is read by its area's reader (``READERS`` in ``diagnosis_readers.py``: attention whole
and split-KV for ``attention``, the lse for ``attention(..., return_lse=True)``, merges
for ``merge_states``, quantized attention for ``attention_quantized``, the gradients for
``attention_vjp``), which gives the
context the area's misreadings are computed from, the right answer and the output
compared; then one loop (``find``) tries every misreading of those areas. A misreading
counts only where it changes the answer: the right output must depart from it beyond the
tolerance, or the sentence could name a bug the inputs cannot show.

Every misreading the output equals is kept (``find``): where the case cannot tell two
apart, the failure names both, and over a run ``explaining_causes`` names each failure by
the one the most failures show, so one cause is one finding (SPEC §13.15). An output no
misreading explains gets where its error lies (``diagnosis_readers.where_it_departs``).

The pass is cheap and runs only on departures: a few float64 runs of the failing call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from conformance.suite.diagnosis_readers import magnitude, matches, read
from conformance.suite.misreadings import AREAS, ZEROS, Misreading


class Found(NamedTuple):
    """What the diagnosis found in a departing output: ``sentence``, the one that names the
    failure (None: nothing does); ``matches``, the sentence of every misreading the output
    equals, in the registry's order; ``where``, for an output no misreading explains,
    where its error lies and which options move it (None otherwise)."""

    sentence: str | None
    matches: tuple[str, ...]
    where: str | None


NOTHING = Found(None, (), None)


def diagnose(actual, calls: list, tol: float) -> str | None:
    """The sentence that names the departure of ``actual`` (the last call's output): its
    first misreading's (``find``), or None."""
    return find(actual, calls, tol).sentence


def find(actual, calls: list, tol: float) -> Found:
    """Every misreading whose output ``actual`` (the last call's output) equals within
    ``tol``, and the sentence that names it: the first one's, joined with the sentences of
    the later ones whose outputs equal it on this call, since the case cannot tell them
    apart (a misreading marked ``alone`` names without the others, joined only by another
    marked ``alone``). ``NOTHING`` where no reader takes
    the last call or ``actual`` is right for it; where no misreading fits, ``where`` says
    where the error lies."""
    subject = read(actual, calls) if calls else None
    if subject is None:
        return NOTHING
    actual, right = subject.actual, subject.right
    if matches(actual, right, tol):
        return NOTHING
    tol = max(tol, subject.floor)
    found: list[tuple[Misreading, np.ndarray, float, str]] = []
    # An output of zeros is named by a misreading only where that misreading's output is
    # zeros too (a normalised P that underflows everywhere), not where it is merely near
    # 0 (a descale applied twice to small descales); else by ``ZEROS``.
    zeros = bool((actual == 0).all())
    for area, misreading in ((a, m) for a in subject.areas for m in AREAS[a]):
        if not misreading.applies(subject.context):
            continue
        planted = misreading.compute(subject.context)
        if planted is None:
            continue
        planted = subject.back(np.asarray(planted, dtype=np.float64))
        if planted.shape != actual.shape:
            continue
        # The tolerance was set for the right answer's magnitude (SPEC §7).
        allowed_error = tol * magnitude(planted) / magnitude(right)
        if matches(planted, right, allowed_error):
            continue
        if not misreading.nonfinite and not _finite_evidence(planted, right, allowed_error):
            continue
        within = 0.0 if zeros else max(tol, allowed_error) * misreading.slack
        if matches(actual, planted, within):
            found.append((misreading, planted, within, area))
    if not found and zeros:
        return Found(ZEROS.sentence, (ZEROS.sentence,), None)
    if not found:
        where = subject.where(actual, right, tol) if actual.shape == right.shape else None
        return Found(None, (), where)
    sentences = tuple(dict.fromkeys(m.sentence for m, _, _, _ in found))
    if zeros:
        # Zeros too, for the run to name by whichever the most failures show.
        sentences = (*sentences, ZEROS.sentence)
    first, planted, within, area = found[0]
    alike = [first.sentence]
    # Within the first's area: another area's misreading that the case cannot tell apart
    # (a split-KV tail of 16 keys and keys read as if S = T at T = 16) is left to the run,
    # which names each failure by the one the most failures show. A misreading marked
    # ``alone`` is joined only by another marked so: garbage in both the key and the value
    # of a blocked slot reads the same whether the key reached the scores or the value the
    # product, and the run's other cases, with garbage in one of the two, tell which.
    for other, other_planted, _, other_area in found[1:]:
        if other_area != area or other.sentence in alike or other.alone != first.alone:
            continue
        if matches(other_planted, planted, within):
            alike.append(other.sentence)
    if first.alone:
        sentences = (*alike, *((ZEROS.sentence,) if zeros else ()))
    if len(alike) == 1:
        return Found(first.sentence, sentences, None)
    return Found("; or, alike on this case, ".join(alike), sentences, None)


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


def output_dtype(in_dtype, out_dtype) -> str:
    """What an output in another dtype than the inputs shows: float32 for 16-bit inputs
    (a kernel that accumulates in float32 and never casts back) is named as such."""
    names = {np.dtype(in_dtype).name, np.dtype(out_dtype).name}
    if np.dtype(out_dtype).name == "float32" and names & {"float16", "bfloat16"}:
        return "returns float32 for float16 or bfloat16 inputs"
    return "returns an output in another dtype than its inputs"


def _finite_evidence(planted, right, tol: float) -> bool:
    """Whether the planted output departs from the right one somewhere it is finite. Where it
    departs only by NaN or infinity (a scale applied twice to scores near the largest float
    overflows), an output that overflowed for another reason would match it by its
    non-finite entries alone, and the sentence would name a cause the inputs cannot tell
    apart (a misreading that shows as NaN by nature, ``nonfinite``, is not asked)."""
    if planted.shape != right.shape:
        return True
    finite = np.isfinite(planted) & np.isfinite(right)
    with np.errstate(invalid="ignore"):
        departs = finite & (np.abs(np.where(finite, planted - right, 0.0)) > tol)
    return bool(departs.any())


def other_cast_rule(got, y: np.ndarray, out_descale: float, fmt: str, declared: str) -> str | None:
    """The sentence for an FP8 output whose codes past the largest value follow the rule
    other than the declared one, or None."""
    from conformance.fixtures import quantized as fq

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
