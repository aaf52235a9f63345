"""Departures diagnosed by name: the known misreadings of attention, each computed by the
oracle from the inputs of the call that departed.

When a comparison fails (a ``Departure`` that saw the function's output), the suite asks
whether that output equals, within the comparison's tolerance, attention computed with one
known misreading planted: ``is_causal`` ignored, the other causal alignment, the scale
1/√E, a bool mask added as 0/1, GQA heads tiled, and so on (``MISREADINGS``). The first
that matches names the failure, in one sentence that holds no number, so one cause is one
finding across dtypes and sizes (SPEC §13.15).

Each misreading is computed by ``conformance.fixtures.oracle``: its float64 textbook run
(``naive_same_precision`` in float64, the fast path; the 50-digit ``attention`` costs
milliseconds a row) on the inputs with the misreading planted in them, or, for the three
that no input can express (a slot that is read though blocked, a softcap after the mask, a
sink in the numerator), a float64 textbook on the oracle's ``allowed_keys``
(``conformance/suite/planted.py``).
A misreading counts only where it changes the answer: the correct output must depart from
it beyond the tolerance, or the sentence could name a bug the inputs cannot show.

Every misreading the output equals is kept (``find``): where the case cannot tell two
apart, the failure names both, and over a run ``explaining_causes`` names each failure by
the one the most failures show. An output no misreading explains gets where its error lies
(``where_it_departs``).

The pass is cheap and runs only on departures: a few float64 runs of the failing call.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from conformance.suite import quantized_diagnosis
from conformance.suite.planted import (
    Call,
    allowed,
    blockwise,
    call_of,
    expanded,
    oracle_run,
    textbook,
)
from conformance.suite.tolerance import nonfinite_mismatch


@dataclass(frozen=True)
class Misreading:
    """One way to misread the spec: when it ``applies`` to a call, what attention with it
    planted returns (``compute``: the call's output shape, or None where it cannot be
    computed), and the sentence that names it; ``name`` is its short handle."""

    name: str
    sentence: str
    applies: Callable[[Call], bool]
    compute: Callable[[Call], np.ndarray | None]
    #: How many times the comparison's tolerance an output may be from the planted one
    #: and still show it: more than 1 where the planted run's own rounding is of the
    #: tolerance's size (a blockwise loop's rescales at scores of -1e4).
    slack: float = 1.0


def _empty_rows(call: Call) -> np.ndarray:
    return ~allowed(call).any(axis=-1)  # (B, H, T)


def _rows_as(call: Call, fill: str) -> np.ndarray | None:
    """The right answer, but the rows with no key to attend hold ``fill``: "nan", or
    "mean" (the mean of their value rows, as uniform weights over every key give)."""
    empty = _empty_rows(call)
    if not empty.any() or call.k.shape[2] == 0:
        return None
    out = oracle_run(call)
    if fill == "nan":
        out[empty] = np.nan
    else:
        _, v = expanded(call)
        out[empty] = np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape)[empty]
    return out


def _blocked_slot_holds_nonfinite(call: Call) -> bool:
    k, v = expanded(call)
    bad = ~(np.isfinite(k).all(axis=-1) & np.isfinite(v).all(axis=-1))  # (B, H, S)
    return bool((bad[:, :, None, :] & ~allowed(call)).any())


def _other_alignment(call: Call) -> str:
    return "bottom_right" if call.options["causal_alignment"] == "top_left" else "top_left"


def _aligned(which: str) -> Callable[[Call], bool]:
    def applies(call: Call) -> bool:
        T, S = call.q.shape[2], call.k.shape[2]
        banded = call.is_causal or call.options.get("window") is not None
        return banded and T != S and call.options["causal_alignment"] == which

    return applies


def _window_shifted(side: int, step: int) -> Callable[[Call], np.ndarray | None]:
    def compute(call: Call) -> np.ndarray | None:
        window = list(call.options["window"])
        if window[side] is None or window[side] + step < 0:
            return None
        window[side] += step
        return oracle_run(call, window=tuple(window))

    return compute


def _has_window(call: Call) -> bool:
    return call.options.get("window") is not None


def _diagonal_shifted(step: int) -> Callable[[Call], np.ndarray | None]:
    """Causality with its diagonal ``step`` keys off, as a window's right side."""

    def compute(call: Call) -> np.ndarray | None:
        left, right = call.options.get("window") or (None, None)
        right = step if right is None else min(right, 0) + step
        return oracle_run(call, is_causal=False, window=(left, right))

    return compute


def _gqa_tiled(call: Call) -> np.ndarray:
    H, K = call.q.shape[1], call.k.shape[1]
    heads = [h % K for h in range(H)]
    return oracle_run(call, k=call.k[:, heads], v=call.v[:, heads])  # k, v (B, H, S, ·)


def _scale_is(value: Callable[[Call], float]) -> Callable[[Call], np.ndarray]:
    return lambda call: oracle_run(call, scale=value(call))


def _prescaled(call: Call) -> np.ndarray:
    with np.errstate(over="ignore"):
        return call.q * call.scale  # (B, H, T, D)


def _default_scale(call: Call) -> bool:
    return call.options.get("scale") is None


def _heads_and_dim(call: Call) -> tuple[int, int]:
    return call.q.shape[1], call.q.shape[-1]


def _mask_batch_repeated(call: Call) -> bool:
    mask, (B, H) = call.mask, call.q.shape[:2]
    return mask is not None and mask.ndim == 4 and mask.shape[:2] == (B, 1) and B > 1 and H > 1


def _batch_repeated(call: Call) -> np.ndarray:
    """A per-batch mask (B, 1, T, S) spread over the heads as ``mask.repeat(H, 1, 1)`` does
    on (B, T, S) where q is reshaped to (B·H, T, D): query head h of batch element b gets
    the mask of batch element (b·H + h) mod B, not its own."""
    B, H = call.q.shape[:2]
    index = (np.arange(B)[:, None] * H + np.arange(H)[None, :]) % B  # (B, H)
    return oracle_run(call, mask=call.mask[index][:, :, 0])  # mask (B, H, T, S)


def _keys_as_if_s_is_t(call: Call) -> np.ndarray | None:
    """The keys read as if S = T: with T < S, only the first T keys (and the mask's first
    T columns), and causality aligned as for a square problem."""
    T, S = call.q.shape[2], call.k.shape[2]
    if not 0 < T < S:
        return None
    mask = call.mask
    if mask is not None and mask.shape[-1] == S:
        mask = mask[..., :T]  # (·, ·, ·, T)
    k, v = call.k[:, :, :T], call.v[:, :, :T]  # (B, K, T, ·)
    return oracle_run(call, k=k, v=v, mask=mask, causal_alignment="top_left")


def _keys_past_s(call: Call) -> np.ndarray | None:
    """Keys read past S: with T > S under causality, rows t >= S read key slots S .. t as a
    square causal problem would, and what those slots hold is no number (NaN)."""
    T, S = call.q.shape[2], call.k.shape[2]
    if T <= S:
        return None
    B, K = call.k.shape[:2]
    k = np.concatenate([call.k, np.full((B, K, T - S, call.k.shape[-1]), np.nan)], axis=2)
    v = np.concatenate([call.v, np.full((B, K, T - S, call.v.shape[-1]), np.nan)], axis=2)
    mask = call.mask
    if mask is not None and mask.shape[-1] == S:
        fill = np.ones if call.bool_mask else np.zeros
        extra = fill((*mask.shape[:-1], T - S), dtype=mask.dtype)
        mask = np.concatenate([mask, extra], axis=-1)  # (·, ·, ·, T)
    return oracle_run(call, k=k, v=v, mask=mask, causal_alignment="top_left")  # k, v (B, K, T, ·)


def _causal_added(call: Call) -> np.ndarray:
    """Causality (and the window, chunks) added to the float mask as 0 / -inf, not selected:
    where the mask holds +inf or NaN at a key causality blocks, the score is NaN."""
    band = allowed(call._replace(mask=None))  # (B, H, T, S)
    with np.errstate(invalid="ignore"):
        mask = call.mask + np.where(band, 0.0, -np.inf)  # (B, H, T, S)
    return oracle_run(call, mask=mask, is_causal=None, window=None, chunk_size=None)


def _banded_float_mask(call: Call) -> bool:
    banded = call.is_causal or any(
        call.options.get(n) is not None for n in ("window", "chunk_size")
    )
    return banded and call.float_mask


#: Key tiles a blockwise kernel may use.
TILES = (16, 32, 64, 128, 256, 512, 1024, 2048)


def _tiled(which: str, tile: int) -> Misreading:
    part = {"sum": "running sum", "accumulator": "accumulator"}[which]
    return Misreading(
        f"tiles-{which}-not-rescaled-{tile}",
        f"a blockwise softmax's {part} is not rescaled when a later key tile raises the "
        "row's maximum",
        lambda c: c.k.shape[2] > tile,
        lambda c: blockwise(c, tile, **{f"rescale_{which[:3]}": False}),
        slack=4.0,
    )


MISREADINGS: tuple[Misreading, ...] = (
    # First: with garbage in the blocked slots, ignoring the mask gives the same NaN rows,
    # and the slots read are the finding a slot-garbage test is after.
    Misreading(
        "blocked-slot-read",
        "a key slot the row may not attend is still read: the NaN or inf it holds reaches "
        "the output (NaN + -inf in the scores)",
        _blocked_slot_holds_nonfinite,
        lambda c: textbook(c, read_blocked="add"),
    ),
    Misreading(
        "blocked-slot-multiplied",
        "a key slot the row may not attend is still read: the NaN or inf it holds reaches "
        "the output (0 · NaN in the product with V)",
        _blocked_slot_holds_nonfinite,
        lambda c: textbook(c, read_blocked="select"),
    ),
    Misreading(
        "causal-added",
        "causality is added to the float mask as -inf, not selected: an infinite or NaN "
        "entry of the mask at a key causality blocks makes the row NaN",
        _banded_float_mask,
        _causal_added,
    ),
    Misreading(
        "causal-ignored-with-mask",
        "is_causal is ignored when a mask is given: the output equals attention with the mask alone",
        lambda c: c.is_causal and c.mask is not None,
        lambda c: oracle_run(c, is_causal=None),
    ),
    Misreading(
        "causal-ignored",
        "is_causal is ignored: the output equals attention without causality",
        lambda c: c.is_causal and c.mask is None,
        lambda c: oracle_run(c, is_causal=None),
    ),
    Misreading(
        "mask-ignored",
        "the mask is ignored: the output equals attention without it",
        lambda c: c.mask is not None,
        lambda c: oracle_run(c, mask=None),
    ),
    Misreading(
        "window-ignored-without-mask",
        "the window is ignored when no mask is given: the output equals attention without it",
        lambda c: _has_window(c) and c.mask is None,
        lambda c: oracle_run(c, window=None),
    ),
    Misreading(
        "bottom-right-for-top-left",
        "causality is aligned bottom-right where top-left is asked: the output equals "
        "bottom-right causal attention",
        _aligned("top_left"),
        lambda c: oracle_run(c, causal_alignment=_other_alignment(c)),
    ),
    Misreading(
        "top-left-for-bottom-right",
        "causality is aligned top-left where bottom-right is asked: the output equals "
        "top-left causal attention",
        _aligned("bottom_right"),
        lambda c: oracle_run(c, causal_alignment=_other_alignment(c)),
    ),
    Misreading(
        "diagonal-without-own-key",
        "the causal diagonal is one key off: each row's own key is blocked",
        lambda c: c.is_causal,
        _diagonal_shifted(-1),
    ),
    Misreading(
        "diagonal-with-next-key",
        "the causal diagonal is one key off: each row also attends the next key",
        lambda c: c.is_causal,
        _diagonal_shifted(1),
    ),
    Misreading(
        "window-left-wider",
        "the window is off by one: one key more on its left side",
        _has_window,
        _window_shifted(0, 1),
    ),
    Misreading(
        "window-left-narrower",
        "the window is off by one: one key fewer on its left side",
        _has_window,
        _window_shifted(0, -1),
    ),
    Misreading(
        "window-right-wider",
        "the window is off by one: one key more on its right side",
        _has_window,
        _window_shifted(1, 1),
    ),
    Misreading(
        "window-right-narrower",
        "the window is off by one: one key fewer on its right side",
        _has_window,
        _window_shifted(1, -1),
    ),
    Misreading(
        "scale-1-over-sqrt-e",
        "the default scale is 1/√E (the value head size), not 1/√D",
        lambda c: _default_scale(c) and c.v.shape[-1] != c.q.shape[-1],
        _scale_is(lambda c: 1.0 / math.sqrt(c.v.shape[-1])),
    ),
    Misreading(
        "scale-1-over-d",
        "the default scale is 1/D, not 1/√D",
        lambda c: _default_scale(c) and c.q.shape[-1] > 1 and c.q.shape[1] != c.q.shape[-1],
        _scale_is(lambda c: 1.0 / c.q.shape[-1]),
    ),
    Misreading(
        "scale-1-over-sqrt-model-width",
        "the default scale is 1/√(H·D), from the model width, not 1/√D",
        lambda c: _default_scale(c) and 1 != c.q.shape[1] != c.q.shape[-1],
        _scale_is(lambda c: 1.0 / math.sqrt(c.q.shape[1] * c.q.shape[-1])),
    ),
    # Where H = D the two coincide, and the case cannot tell them apart.
    Misreading(
        "scale-1-over-d-or-model-width",
        "the default scale is 1/D, or 1/√(H·D) from the model width (the two are equal "
        "where H = D), not 1/√D",
        lambda c: _default_scale(c) and c.q.shape[-1] > 1 and c.q.shape[1] == c.q.shape[-1],
        _scale_is(lambda c: 1.0 / c.q.shape[-1]),
    ),
    Misreading(
        "scale-sqrt-d",
        "the default scale is √D, not 1/√D",
        lambda c: _default_scale(c) and c.q.shape[-1] > 1,
        _scale_is(lambda c: math.sqrt(c.q.shape[-1])),
    ),
    Misreading(
        "scale-ignored",
        "the scale is ignored: the output equals attention with 1/√D",
        lambda c: not _default_scale(c),
        lambda c: oracle_run(c, scale=None),
    ),
    Misreading(
        "scale-1",
        "the scores are not scaled: the output equals attention with scale 1",
        lambda c: c.scale != 1.0,
        _scale_is(lambda c: 1.0),
    ),
    Misreading(
        "scale-before-product",
        "q is multiplied by the scale before the product, so q · scale overflows where the "
        "score does not",
        lambda c: bool(np.isinf(_prescaled(c)).any()),
        lambda c: oracle_run(c, q=_prescaled(c), scale=1.0),
    ),
    # A given scale: the default one applied twice is 1/D.
    Misreading(
        "scale-twice",
        "the scale is applied twice",
        lambda c: not _default_scale(c) and c.scale != 1.0,
        _scale_is(lambda c: c.scale * c.scale),
    ),
    Misreading(
        "float-mask-as-bool",
        "a float mask is read as a bool mask: its nonzero entries attend, its zeros block",
        lambda c: c.float_mask,
        lambda c: oracle_run(c, mask=c.mask != 0),
    ),
    Misreading(
        "float-mask-scaled",
        "a bias or float mask is multiplied by the scale: the output equals attention with "
        "mask · scale",
        lambda c: c.float_mask and c.scale != 1.0,
        lambda c: oracle_run(c, mask=c.mask * c.scale),
    ),
    Misreading(
        "bool-mask-added",
        "a bool mask is added to the scores as 1 and 0, not read as attend and block",
        lambda c: c.bool_mask,
        lambda c: oracle_run(c, mask=c.mask.astype(np.float64)),
    ),
    Misreading(
        "bool-mask-flipped",
        "a bool mask is read the other way round: True blocks",
        lambda c: c.bool_mask,
        lambda c: oracle_run(c, mask=~c.mask),
    ),
    Misreading(
        "mask-batch-repeated",
        "a per-batch mask is spread over the heads with repeat, not repeat_interleave: "
        "query heads use the masks of other batch elements",
        _mask_batch_repeated,
        _batch_repeated,
    ),
    Misreading(
        "empty-rows-mean-of-v",
        "a query with no key to attend returns the mean of V, not 0",
        lambda c: True,
        lambda c: _rows_as(c, "mean"),
    ),
    Misreading(
        "empty-rows-nan",
        "a query with no key to attend returns NaN, not 0",
        lambda c: True,
        lambda c: _rows_as(c, "nan"),
    ),
    Misreading(
        "softcap-after-mask",
        "the softcap is applied after the mask: a blocked key gets the score -softcap, "
        "not -inf, and is attended",
        lambda c: c.options.get("softcap") is not None and not _empty_rows(c).all(),
        lambda c: textbook(c, cap_after_mask=True),
    ),
    Misreading(
        "softcap-ignored",
        "the softcap is accepted and ignored: the output equals attention without it",
        lambda c: c.options.get("softcap") is not None,
        lambda c: oracle_run(c, softcap=None),
    ),
    Misreading(
        "gqa-tiled",
        "GQA heads are grouped the wrong way: query head h uses key/value head h % K, not h // G",
        lambda c: 1 < c.k.shape[1] < c.q.shape[1],
        _gqa_tiled,
    ),
    Misreading(
        "keys-as-if-s-is-t",
        "the keys are read as if S = T: with fewer queries than keys, only the first T "
        "keys are attended",
        lambda c: 0 < c.q.shape[2] < c.k.shape[2],
        _keys_as_if_s_is_t,
    ),
    Misreading(
        "keys-past-s",
        "keys are read past S: with more queries than keys under causality, the rows past "
        "the last key read slots that do not exist, and are NaN",
        lambda c: c.is_causal and c.q.shape[2] > c.k.shape[2],
        _keys_past_s,
    ),
    Misreading(
        "sink-scaled",
        "the sink is multiplied by the scale: the output equals attention with sinks · scale",
        lambda c: c.options.get("sinks") is not None and c.scale != 1.0,
        lambda c: oracle_run(c, sinks=c.options["sinks"] * c.scale),
    ),
    Misreading(
        "sink-carries-value",
        "the sink carries a value: its weight is added to every attended key's weight",
        lambda c: c.options.get("sinks") is not None,
        lambda c: textbook(c, sink_in_numerator=True),
    ),
    Misreading(
        "sinks-dropped",
        "the sinks are accepted and dropped: the output equals attention without them",
        lambda c: c.options.get("sinks") is not None,
        lambda c: oracle_run(c, sinks=None),
    ),
    *(_tiled(which, tile) for which in ("sum", "accumulator") for tile in TILES),
)


#: The misreadings by name.
BY_NAME = {m.name: m for m in MISREADINGS}


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
    if not calls or calls[-1][2] != "attention":
        return NOTHING
    call = call_of(calls[-1][3], calls[-1][4])
    if call is None:
        return NOTHING
    actual = np.asarray(actual, dtype=np.float64)
    if actual.ndim == 3:
        actual = actual[None]  # (1, H, T, E)
    right = oracle_run(call)
    if actual.shape != right.shape or matches(actual, right, tol):
        return NOTHING
    found: list[tuple[Misreading, np.ndarray, float]] = []
    for misreading in MISREADINGS:
        if not misreading.applies(call):
            continue
        planted = misreading.compute(call)
        if planted is None:
            continue
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
