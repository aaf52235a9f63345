"""The misreadings of attention whole, an area of the one registry
(``conformance/suite/misreadings.py``, SPEC §13.16): their outputs are the oracle's
float64 textbook run on the departing call's inputs with the misreading planted in them,
or a float64 textbook on the oracle's scores for what no input can express
(``conformance/suite/planted.py``). The order is the order in which ``diagnosis.find``
tries them: where two explain a failure alike, the first names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from conformance.suite.misreading import Misreading
from conformance.suite.planted import (
    CAUSAL_PENALTY,
    Call,
    allowed,
    batch_repeated,
    blockwise,
    causal_added,
    causal_penalty,
    diagonal_shifted,
    empty_rows,
    expanded,
    gqa_tiled,
    keys_as_if_s_is_t,
    keys_in_q_layout,
    keys_past_s,
    oracle_run,
    prescaled,
    rows_as,
    scale_is,
    textbook,
    v_from_last_columns,
    window_shifted,
)


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
    # and the slots read are the finding a slot-garbage test is after. The two ways a slot
    # is read differ where a slot's garbage is in its key alone (NaN + -inf in the scores
    # makes the row NaN; a key never multiplied by its weight 0 leaves it) or in its value
    # alone (both multiply it by 0): where a case has garbage in both, both are named, and
    # the run names the failure by the one its other cases show (§4.7's fixtures keep the
    # keys' garbage and the values' in other heads).
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
    # Before "causal-ignored": where the scores are so large that the penalty is nothing
    # (a huge scale), the two give the same output, and the penalty is the cause.
    Misreading(
        "causal-penalty-finite",
        f"causality is a finite penalty: {-CAUSAL_PENALTY:g} is added to a blocked key's score, "
        "not -inf, so a blocked key whose score is far above the row's allowed ones is attended",
        lambda c: c.is_causal and not _has_window(c) and c.options.get("chunk_size") is None,
        causal_penalty,
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
    "causal-penalty": ("3.4", "3.5", "4.1"),
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
