"""The one registry of misreadings: every known way to misread the spec that
``diagnosis.py`` holds a departing output against (SPEC §13.16), each a ``Misreading`` of
data: its name, the sentence that names it, the clauses whose failures it explains, when
it applies to a departing call and how to compute what the function with it planted
returns. They are grouped by area (``AREAS``): attention whole, split-KV decoding, the
log-sum-exp, merges of partial states, quantized attention. A new frontier adds an area
here and a reader of its calls in ``diagnosis.py``, not a module of its own.

Each is computed from the departing call's inputs (``conformance/suite/planted.py``): for
attention, the oracle's float64 textbook run (``naive_same_precision`` in float64, the
fast path; the 50-digit ``attention`` costs milliseconds a row) on the inputs with the
misreading planted in them, or, for what no input can express (a slot that is read
though blocked, a softcap after the mask, a sink in the numerator, splits of the keys), a
float64 textbook on the oracle's scores; for the lse, the textbook lse; for a merge, the
formula on the call's own pieces; for quantized attention, the declared P pipeline
(``conformance.fixtures.quantized.pipeline``) on misread codes or descales. The order
within an area is the order in which ``diagnosis.find`` tries them: where two explain a
failure alike, the first names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from conformance.suite.planted import (
    Call,
    LseCall,
    QuantizedCall,
    allowed,
    balanced,
    batch_repeated,
    blockwise,
    causal_added,
    descale_by_query_head,
    descale_twice,
    descales_dropped,
    descales_transposed,
    diagonal_shifted,
    empty_rows,
    expanded,
    first_descale_for_all,
    gqa_tiled,
    keys_as_if_s_is_t,
    keys_in_q_layout,
    keys_past_s,
    lse_of,
    lse_where_no_key,
    lse_without,
    merge_averaged,
    merge_unguarded,
    merge_without_maximum,
    merged,
    oracle_run,
    p_pipeline_misread,
    prescaled,
    q_and_v_descales_swapped,
    quantized_run,
    quantized_scale_twice,
    rows_as,
    scale_is,
    sink_per_split,
    splits_sum_unrescaled,
    tail_dropped,
    textbook,
    v_codes_as,
    v_descale_before_softmax,
    v_from_last_columns,
    v_offset_per_head,
    window_shifted,
)


@dataclass(frozen=True)
class Misreading:
    """One way to misread the spec: when it ``applies`` to a departing call (the area's
    context: a ``Call``, ``LseCall``, ``MergeCall`` or ``QuantizedCall``), what the
    function with it planted returns (``compute``: the compared output's shape, or None
    where it cannot show on this call), and the sentence that names it; ``name`` is its
    short handle, ``clauses`` the clauses whose failures it explains."""

    name: str
    sentence: str
    applies: Callable[[Any], bool]
    compute: Callable[[Any], np.ndarray | None]
    #: How many times the comparison's tolerance an output may be from the planted one
    #: and still show it: more than 1 where the planted run's own rounding is of the
    #: tolerance's size (a blockwise loop's rescales at scores of -1e4).
    slack: float = 1.0
    clauses: tuple[str, ...] = ()
    #: Its mark is a NaN or an infinity: it counts where it changes only non-finite
    #: entries (else a planted output must depart from the right one where both are
    #: finite, or an output that overflowed for another reason would match it).
    nonfinite: bool = False
    #: Named alone even where another gives the same output on the case.
    alone: bool = False


def _always(call: Any) -> bool:
    return True


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


def _has_window(call: Call) -> bool:
    return call.options.get("window") is not None


def _default_scale(call: Call) -> bool:
    return call.options.get("scale") is None


def _heads_and_dim(call: Call) -> tuple[int, int]:
    return call.q.shape[1], call.q.shape[-1]


def _mask_batch_repeated(call: Call) -> bool:
    mask, (B, H) = call.mask, call.q.shape[:2]
    return mask is not None and mask.ndim == 4 and mask.shape[:2] == (B, 1) and B > 1 and H > 1


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


_ATTENTION: tuple[Misreading, ...] = (
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
        causal_added,
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
        diagonal_shifted(-1),
    ),
    Misreading(
        "diagonal-with-next-key",
        "the causal diagonal is one key off: each row also attends the next key",
        lambda c: c.is_causal,
        diagonal_shifted(1),
    ),
    Misreading(
        "window-left-wider",
        "the window is off by one: one key more on its left side",
        _has_window,
        window_shifted(0, 1),
    ),
    Misreading(
        "window-left-narrower",
        "the window is off by one: one key fewer on its left side",
        _has_window,
        window_shifted(0, -1),
    ),
    Misreading(
        "window-right-wider",
        "the window is off by one: one key more on its right side",
        _has_window,
        window_shifted(1, 1),
    ),
    Misreading(
        "window-right-narrower",
        "the window is off by one: one key fewer on its right side",
        _has_window,
        window_shifted(1, -1),
    ),
    Misreading(
        "scale-1-over-sqrt-e",
        "the default scale is 1/√E (the value head size), not 1/√D",
        lambda c: _default_scale(c) and c.v.shape[-1] != c.q.shape[-1],
        scale_is(lambda c: 1.0 / math.sqrt(c.v.shape[-1])),
    ),
    Misreading(
        "scale-1-over-d",
        "the default scale is 1/D, not 1/√D",
        lambda c: _default_scale(c) and c.q.shape[-1] > 1 and c.q.shape[1] != c.q.shape[-1],
        scale_is(lambda c: 1.0 / c.q.shape[-1]),
    ),
    Misreading(
        "scale-1-over-sqrt-model-width",
        "the default scale is 1/√(H·D), from the model width, not 1/√D",
        lambda c: _default_scale(c) and 1 != c.q.shape[1] != c.q.shape[-1],
        scale_is(lambda c: 1.0 / math.sqrt(c.q.shape[1] * c.q.shape[-1])),
    ),
    # Where H = D the two coincide, and the case cannot tell them apart.
    Misreading(
        "scale-1-over-d-or-model-width",
        "the default scale is 1/D, or 1/√(H·D) from the model width (the two are equal "
        "where H = D), not 1/√D",
        lambda c: _default_scale(c) and c.q.shape[-1] > 1 and c.q.shape[1] == c.q.shape[-1],
        scale_is(lambda c: 1.0 / c.q.shape[-1]),
    ),
    Misreading(
        "scale-sqrt-d",
        "the default scale is √D, not 1/√D",
        lambda c: _default_scale(c) and c.q.shape[-1] > 1,
        scale_is(lambda c: math.sqrt(c.q.shape[-1])),
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
        scale_is(lambda c: 1.0),
    ),
    Misreading(
        "scale-before-product",
        "q is multiplied by the scale before the product, so q · scale overflows where the "
        "score does not",
        lambda c: bool(np.isinf(prescaled(c)).any()),
        lambda c: oracle_run(c, q=prescaled(c), scale=1.0),
    ),
    # A given scale: the default one applied twice is 1/D.
    Misreading(
        "scale-twice",
        "the scale is applied twice",
        lambda c: not _default_scale(c) and c.scale != 1.0,
        scale_is(lambda c: c.scale * c.scale),
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
        batch_repeated,
    ),
    Misreading(
        "empty-rows-mean-of-v",
        "a query with no key to attend returns the mean of V, not 0",
        lambda c: True,
        lambda c: rows_as(c, "mean"),
    ),
    Misreading(
        "empty-rows-nan",
        "a query with no key to attend returns NaN, not 0",
        lambda c: True,
        lambda c: rows_as(c, "nan"),
    ),
    Misreading(
        "softcap-after-mask",
        "the softcap is applied after the mask: a blocked key gets the score -softcap, "
        "not -inf, and is attended",
        lambda c: c.options.get("softcap") is not None and not empty_rows(c).all(),
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
        gqa_tiled,
    ),
    Misreading(
        "keys-as-if-s-is-t",
        "the keys are read as if S = T: with fewer queries than keys, only the first T "
        "keys are attended",
        lambda c: 0 < c.q.shape[2] < c.k.shape[2],
        keys_as_if_s_is_t,
    ),
    Misreading(
        "keys-in-q-layout",
        "the keys are read as if S = T, through q's layout: k and v addressed with q's "
        "length and strides, so with fewer queries than keys each head reads a slice of "
        "the key buffer that runs into other heads' keys",
        lambda c: 0 < c.q.shape[2] < c.k.shape[2] and c.k.shape[1] == c.q.shape[1],
        keys_in_q_layout,
    ),
    Misreading(
        "keys-past-s",
        "keys are read past S: with more queries than keys under causality, the rows past "
        "the last key read slots that do not exist, and are NaN",
        lambda c: c.is_causal and c.q.shape[2] > c.k.shape[2],
        keys_past_s,
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


#: The clauses each misreading of attention whole explains, by name (a prefix names a family).
_ATTENTION_CLAUSES = {
    "blocked-slot": ("4.7", "4.8"),
    "causal-added": ("3.8", "3.7"),
    "causal-ignored": ("3.4", "3.5", "3.7"),
    "mask-ignored": ("3.1", "3.2", "3.7"),
    "window": ("3.6",),
    "bottom-right": ("3.4",),
    "top-left": ("3.5",),
    "diagonal": ("3.4", "3.5"),
    "scale": ("4.1",),
    "float-mask": ("3.2",),
    "bool-mask": ("3.1",),
    "mask-batch": ("3.1", "3.2"),
    "empty-rows": ("4.3",),
    "softcap": ("4.2",),
    "gqa": ("4.6",),
    "keys": ("2.1", "3.5"),
    "sink": ("15.1", "15.2"),
    "tiles": ("4.4", "4.10"),
}
#: Whose very mark is a NaN or an infinity in the output.
_NONFINITE = {
    "blocked-slot-read",
    "blocked-slot-multiplied",
    "causal-added",
    "keys-past-s",
    "empty-rows-nan",
    "scale-before-product",
}


def _with_data(m: Misreading) -> Misreading:
    clauses = next(c for p, c in _ATTENTION_CLAUSES.items() if m.name.startswith(p))
    return replace(
        m,
        clauses=clauses,
        nonfinite=m.name in _NONFINITE,
        # Garbage in the blocked slots makes the mask ignored look the same, and the
        # slots read are the finding.
        alone=m.name.startswith("blocked-slot"),
    )


#: An output of zeros that no misreading gives: no key's value reaches the output. Tried
#: by ``diagnosis.find`` after every area's misreadings, on an output of exact zeros only.
ZEROS = Misreading(
    "zeros",
    "returns zeros: no key's value reaches the output",
    _always,
    lambda c: None,
    alone=True,
)

ATTENTION: tuple[Misreading, ...] = tuple(_with_data(m) for m in _ATTENTION) + (
    Misreading(
        "mla-v-from-last-columns",
        "MLA's V is read from the wrong columns of the latent cache: the last E columns "
        "of K, not the first E",
        lambda c: c.v.shape[-1] < c.k.shape[-1],
        v_from_last_columns,
        clauses=("4.11", "4.12", "19.7"),
    ),
)


# --- Split-KV decoding (SPEC §22.8): the keys in splits, each a partial state --------------

#: The split counts and block lengths a decoder may use.
SPLITS = tuple(range(2, 17))
BLOCKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _has_sinks(c: Call) -> bool:
    return c.options.get("sinks") is not None


SPLIT_KV: tuple[Misreading, ...] = (
    *(
        Misreading(
            f"split-tail-dropped-{block}",
            "a split-KV decoder drops the keys after the last whole block: the keys past "
            "the largest multiple of its block length are never read",
            _always,
            tail_dropped(block),
            clauses=("22.8", "4.10"),
        )
        for block in BLOCKS
    ),
    *(
        Misreading(
            f"split-sink-per-split-{n}",
            "a split-KV decoder counts the sink once per split: each split's partial state "
            "has the sink in its sum, so the merged denominator holds it once per split",
            _has_sinks,
            sink_per_split(n),
            clauses=("22.6", "22.8", "15.1"),
        )
        for n in SPLITS
    ),
    *(
        Misreading(
            f"split-sum-not-rescaled-{how}-{n}",
            "a split-KV decoder divides by a sum that was not rescaled: each split's "
            "accumulator is brought to the common maximum, its sum is not",
            lambda c: not _has_sinks(c),
            splits_sum_unrescaled(bounds),
            slack=4.0,
            clauses=("22.8", "4.4"),
        )
        # Splits of one length are a blockwise loop's tiles, named by ATTENTION's
        # tiles-sum-not-rescaled.
        for how, n, bounds in (("splits", n, balanced(n)) for n in SPLITS)
    ),
)


# --- The log-sum-exp (SPEC §21) --------------------------------------------------------------
# The public record: one API gave base-2 or base-e depending on the kernel it picked
# (FlashInfer #4485), and merges that mixed the two gave garbage (vLLM #28840, SGLang
# #35045); a fully masked row returned a finite lse of -49994 instead of -inf (FlashInfer
# #4452); an lse read in the other layout, or of the scores before the scale.


def _option(name: str) -> Callable[[LseCall], bool]:
    return lambda c: c.call.options.get(name) is not None


LSE: tuple[Misreading, ...] = (
    Misreading(
        "lse-base-2",
        "returns the log-sum-exp in base 2 where base e is declared (a factor log₂ e off)",
        _always,
        lambda c: c.right / math.log(2.0),
        clauses=("21.1",),
    ),
    Misreading(
        "lse-unscaled",
        "returns the log-sum-exp of the scores before the scale",
        lambda c: c.call.scale != 1.0,
        lambda c: lse_of(c.call, scale=1.0),
        clauses=("21.1", "4.1"),
    ),
    Misreading(
        "lse-given-scale-ignored",
        "returns the log-sum-exp at the default scale 1/√D, not at the scale given",
        _option("scale"),
        lse_without("scale"),
        clauses=("21.1", "4.1"),
    ),
    Misreading(
        "lse-softcap-ignored",
        "returns the log-sum-exp of the scores before the softcap",
        _option("softcap"),
        lse_without("softcap"),
        clauses=("21.5", "4.2"),
    ),
    Misreading(
        "lse-alibi-ignored",
        "returns the log-sum-exp of the scores without the ALiBi bias",
        _option("alibi_slopes"),
        lse_without("alibi_slopes"),
        clauses=("21.5", "17.1"),
    ),
    Misreading(
        "lse-sinks-ignored",
        "returns the log-sum-exp without the sink's term",
        _option("sinks"),
        lse_without("sinks"),
        clauses=("21.5", "15.1"),
    ),
    Misreading(
        "lse-finite-no-key",
        "gives a finite log-sum-exp for a row with no key, not -inf",
        _always,
        lse_where_no_key(finite=True),
        clauses=("21.2",),
        nonfinite=True,
    ),
    Misreading(
        "lse-plus-inf-no-key",
        "gives +inf as the log-sum-exp of a row with no key, not -inf",
        _always,
        lse_where_no_key(finite=False),
        clauses=("21.2",),
        nonfinite=True,
    ),
    Misreading(
        "lse-other-layout",
        "returns the log-sum-exp in the other layout, (B, T, H) for (B, H, T)",
        _always,
        lambda c: np.swapaxes(c.right, -1, -2),
        clauses=("21.1",),
    ),
)


# --- Merges of partial states (SPEC §22) ----------------------------------------------------
# The public record: outputs averaged as if every piece held as many keys, two empty
# pieces merged into NaN (FlashInfer #4051), base-e lse merged in base 2 (vLLM #28840,
# SGLang #35045).


def _other_pieces_lse(m, a, b):
    return np.exp(b - m), np.exp(a - m)


MERGE: tuple[Misreading, ...] = (
    Misreading(
        "merge-averaged",
        "averages the pieces' outputs instead of weighting each by exp(lse), its share of "
        "the union's denominator",
        _always,
        merge_averaged,
        clauses=("22.1",),
    ),
    Misreading(
        "merge-other-pieces-lse",
        "weights each piece with the other piece's lse",
        _always,
        lambda c: merged(c, weights=_other_pieces_lse),
        clauses=("22.1",),
    ),
    Misreading(
        "merge-base-2-on-base-e",
        "merges natural-log lse in base 2 (exp2 and log2 on base-e lse): the weights and "
        "the merged lse are off",
        _always,
        lambda c: merged(c, exp=np.exp2, log=np.log2),
        clauses=("22.1", "22.10"),
    ),
    Misreading(
        "merge-empty-as-zero",
        "reads a piece's lse of -inf (no key) as 0: the empty piece is weighted as if it held keys",
        lambda c: bool(np.isneginf(c.lse_a).any() or np.isneginf(c.lse_b).any()),
        lambda c: merged(
            c,
            lse_a=np.where(np.isneginf(c.lse_a), 0.0, c.lse_a),
            lse_b=np.where(np.isneginf(c.lse_b), 0.0, c.lse_b),
        ),
        clauses=("22.2", "22.3"),
        nonfinite=True,
    ),
    Misreading(
        "merge-empty-nan",
        "merges two empty pieces (lse = -inf) into NaN: -inf - (-inf) is NaN where the "
        "larger lse is taken off unguarded",
        _always,
        merge_unguarded,
        clauses=("22.3",),
        nonfinite=True,
    ),
    Misreading(
        "merge-exp-without-maximum",
        "takes exp(lse) without subtracting the larger lse: large lse overflow, and "
        "the weights lose precision",
        _always,
        merge_without_maximum,
        clauses=("22.5", "22.2"),
        nonfinite=True,
    ),
)


# --- Quantized attention (SPEC §20) ---------------------------------------------------------
# The commonest public bugs of FP8 attention are a descale lost on its way: dropped (vLLM
# #42580, FlashInfer #1023), replaced by 1 (SGLang #20705), applied twice (vLLM #48016),
# indexed by the query head instead of the key/value head, or one used for every head where
# per-head ones were given (vLLM #51363); then v's descale applied to the scores, a
# normalised P rounded to e4m3, whose small weights underflow (FlashInfer #5020), and P
# rounded at a stale row maximum (FlashAttention #2577).


#: The key tiles an FP8 kernel may round P over.
P_TILES = (16, 32, 64, 128)


def _per_head(role: str) -> Callable[[QuantizedCall], bool]:
    return lambda c: c.descale(role).ndim == 2 and c.descale(role).size > 1


def _dropped_sentence(roles: str) -> str:
    if roles == "qkv":
        return "every descale is replaced by 1: the codes are read as the values"
    names = " and ".join(f"{r}'s" for r in roles)
    what = "descale is" if len(roles) == 1 else "descales are"
    read = f"{roles} is read as its codes" if len(roles) == 1 else "read as their codes"
    return f"{names} {what} dropped: {read}"


QUANTIZED: tuple[Misreading, ...] = (
    *(
        Misreading(
            "all-descales-one" if roles == "qkv" else f"{'-'.join(roles)}-descale-dropped",
            _dropped_sentence(roles),
            _always,
            descales_dropped(roles),
            clauses=("20.1", "20.3"),
        )
        for roles in ("qkv", "q", "k", "v", "kv", "qk", "qv")
    ),
    Misreading(
        "q-and-v-descales-swapped",
        "q's and v's descales are swapped: q is scaled by v's, v by q's",
        _always,
        q_and_v_descales_swapped,
        clauses=("20.1", "20.3"),
    ),
    *(
        Misreading(
            f"{r}-descale-twice",
            f"{r}'s descale is applied twice",
            _always,
            descale_twice(r),
            clauses=("20.1", "20.3"),
        )
        for r in "qkv"
    ),
    Misreading(
        "softmax-scale-twice",
        "the softmax scale is applied twice",
        _always,
        quantized_scale_twice,
        clauses=("20.3", "4.1"),
    ),
    Misreading(
        "descale-batch-head-transposed",
        "a (B, K) descale is read as (K, B): each (batch, key/value head) reads the "
        "descale of another",
        lambda c: any(np.ndim(c.descale(r)) == 2 for r in "qkv"),
        descales_transposed,
        clauses=("20.2", "20.4"),
    ),
    Misreading(
        "q-descale-by-query-head",
        "q's descale is indexed by the query head, not the key/value head",
        lambda c: _per_head("q")(c) and c.shape()[1] != c.shape()[2],
        descale_by_query_head,
        clauses=("20.2", "20.4"),
    ),
    Misreading(
        "per-tensor-for-per-head",
        "one descale (the first head's) is used for every head where per-head descales were given",
        lambda c: any(c.descale(r).ndim >= 2 and c.descale(r).size > 1 for r in "qkv"),
        first_descale_for_all,
        clauses=("20.2", "20.4"),
    ),
    Misreading(
        "v-descale-before-softmax",
        "v's descale is applied to the scores, before the softmax, not to the output",
        lambda c: c.descale("v").ndim < 3 and c.descale("q").ndim <= c.descale("v").ndim,
        v_descale_before_softmax,
        clauses=("20.3",),
    ),
    Misreading(
        "v-e4m3-read-as-e5m2",
        "v's float8_e4m3fn codes are read as float8_e5m2: their bytes decoded in the other format",
        lambda c: c.format("v") == "float8_e4m3fn",
        v_codes_as("float8_e5m2", reinterpret=True),
        clauses=("20.1",),
    ),
    Misreading(
        "v-rounded-to-e5m2",
        "v is rounded again to float8_e5m2 before P·V: one bit of its mantissa is lost",
        lambda c: c.format("v") == "float8_e4m3fn",
        v_codes_as("float8_e5m2", reinterpret=False),
        clauses=("20.1", "20.6"),
    ),
    Misreading(
        "v-zero-point-dropped",
        "an int8 v's zero point is dropped: every output row of a head is off by one constant",
        lambda c: c.format("v") == "int8",
        v_offset_per_head,
        clauses=("20.1", "20.3"),
    ),
    Misreading(
        "normalised-p-underflow",
        "P is normalised before it is rounded to float8_e4m3fn: weights below 2⁻¹⁰ underflow to 0",
        lambda c: c.pipeline != "e4m3_normalized",
        lambda c: quantized_run(c, "e4m3_normalized"),
        clauses=("20.6",),
    ),
    *(
        Misreading(
            f"p-rounded-to-e5m2-{tile or 'row'}",
            "P is rounded to float8_e5m2, not float8_e4m3fn: one bit of its mantissa is lost",
            lambda c: c.pipeline != "float32",
            p_pipeline_misread(p_format="float8_e5m2", tile=tile),
            clauses=("20.6",),
        )
        for tile in (None, *P_TILES)
    ),
    *(
        Misreading(
            f"p-at-stale-maximum-{rule}-{tile}",
            "P is rounded at a stale row maximum (the tiles' before it): a growing score "
            "lifts P · 2⁸ past float8_e4m3fn's 448",
            lambda c: c.pipeline == "e4m3_unnormalized",
            p_pipeline_misread(tile=tile, stale=True, cast_rule=rule),
            clauses=("20.4", "20.6"),
            nonfinite=rule == "overflow",
        )
        for rule in ("overflow", "saturate")
        for tile in P_TILES
    ),
    Misreading(
        "pv-accumulated-in-bfloat16",
        "P·V is accumulated in bfloat16: each partial sum rounded to 8 bits",
        lambda c: c.pipeline != "float32",
        p_pipeline_misread(accumulate="bfloat16"),
        slack=4.0,
        clauses=("20.6",),
    ),
)


#: Every misreading by area, in the order the areas' calls are read.
AREAS: dict[str, tuple[Misreading, ...]] = {
    "attention": ATTENTION,
    "split-kv": SPLIT_KV,
    "lse": LSE,
    "merge": MERGE,
    "quantized": QUANTIZED,
}
MISREADINGS: tuple[Misreading, ...] = tuple(m for area in AREAS.values() for m in area)
#: The misreadings by name.
BY_NAME = {m.name: m for m in MISREADINGS}
assert len(BY_NAME) == len(MISREADINGS), "two misreadings share a name"
