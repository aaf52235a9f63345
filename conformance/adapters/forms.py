"""The forms of causality, window and scale a function takes, and causality through the mask.

A library function is judged on what it takes (SPEC §13.17). Beside its capabilities it
takes some of these forms of the core options, and a test whose calls use a form the
function does not take is skipped, naming it, never failed:

- ``causal``: ``is_causal=True`` reaches the function, by a keyword or built into the mask
  it takes (model code rarely has an ``is_causal``: it hands the function a causal mask);
- ``causal_top_left``: top-left alignment (of causality, a window or chunks) with T ≠ S;
  a KV-cache operator aligns bottom-right only;
- ``window_right``: a window's right side (other than 0, or None under causality);
- ``scale``: a ``scale`` other than the default;
- ``non_causal``: ``is_causal=False`` (a causal-only kernel takes only causal calls);
- ``mask_bool``, ``mask_float``: a bool mask, an additive float mask (a kernel may take
  neither: FlashAttention's main entry point has no mask).

A backend that says nothing takes them all (``forms_of``). For a function whose causality
comes through the mask, ``through_the_mask`` builds SPEC §1's visibility (causality in
either alignment, and a window and chunks the function has no keyword for) and combines
it with the call's own mask, as model code builds the mask it hands the function.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from conformance.impls import contract
from conformance.vocabulary import option_is_set

FORMS = {
    "causal": "is_causal=True (a keyword, or causality built into the mask it takes)",
    "causal_top_left": "top-left alignment (of causality, a window or chunks) with T ≠ S",
    "window_right": "a window's right side (other than 0, or None under causality)",
    "scale": "a scale keyword",
    "non_causal": "is_causal=False (a causal-only function takes causal calls only)",
    "mask_bool": "a bool mask",
    "mask_float": "an additive float mask",
}
ALL_FORMS = frozenset(FORMS)
#: The forms no test declares, because nearly every call uses one: a call that uses one the
#: function does not take is stopped at the call and its test skipped by name
#: (``conformance.suite.domain``), never handed to the function.
CALL_FORMS = ("non_causal", "mask_bool", "mask_float")
#: How causality reaches a function: its keyword, the mask it takes, not at all, or always
#: ("only": a causal-only kernel, causal with no keyword; is_causal=False never reaches it).
CAUSALITY = ("keyword", "mask", "none", "only")
#: The mask forms a function may take (a profile's ``[forms] masks``).
MASK_FORMS = ("bool", "float")
#: What an additive mask holds on a blocked key: -inf, or the dtype's most negative finite
#: number (``torch.finfo(dtype).min``, as transformers builds its masks).
BLOCKED = ("-inf", "min")
#: The options that reach a "through the mask" function as its mask where it has no
#: keyword of their own.
MASK_OPTIONS = ("is_causal", "causal_alignment", "window", "chunk_size")


def forms_of(backend: Any) -> frozenset[str]:
    """The forms ``backend`` takes: its ``forms`` attribute, or all of them."""
    return frozenset(getattr(backend, "forms", ALL_FORMS))


def forms_used(options: Mapping[str, Any], T: int | None = None, S: int | None = None) -> list:
    """The forms a call with ``options`` uses; ``causal_top_left`` only where T ≠ S is known
    (both None: assumed, for a test whose sizes are not parameters).

    Raises:
      TypeError, ValueError: a malformed window (its refusal is the function's part).
    """
    causal = bool(options.get("is_causal", False))
    window = contract.check_window(options.get("window"))
    windowed = window is not None and tuple(window) != (None, None)
    used = ["causal" if causal else "non_causal"]
    used += _mask_forms(options.get("mask"))
    aligned = causal or windowed or options.get("chunk_size") is not None
    top_left = options.get("causal_alignment", "top_left") == "top_left"
    if aligned and top_left and (T is None or S is None or T != S):
        used.append("causal_top_left")
    if windowed and window[1] != 0 and not (window[1] is None and causal):
        used.append("window_right")
    if option_is_set("scale", options.get("scale")):
        used.append("scale")
    return used


def _mask_forms(mask: Any) -> list[str]:
    """The mask form of a call's ``mask``: an array (bool, or floating), or a test's name
    for one ("bool", "float"). An integer mask, which the spec refuses, goes where a bool
    one goes (``native.OptionMap.mask``): a function that takes no bool mask has no mask
    keyword to refuse it with."""
    if mask is None:
        return []
    if isinstance(mask, str):
        return [f"mask_{mask}"] if mask in MASK_FORMS else []
    dtype = np.asarray(mask).dtype
    if dtype == np.bool_:
        return ["mask_bool"]
    if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
        return ["mask_float"]
    return ["mask_bool"]


def blocked_value(kind: str, dtype: np.dtype) -> Any:
    """The additive mask's entry for a blocked key in ``dtype``: -inf or its finfo.min."""
    if kind == "-inf":
        return -np.inf
    if dtype.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dtype).min
    return np.finfo(dtype).min


def visibility(T: int, S: int, options: Mapping[str, Any]) -> np.ndarray | None:
    """SPEC §1's visibility of ``options``' causality, window and chunks, (T, S) bool, or
    None when they allow every key. The options are checked as the contract checks them
    (the function has no keyword to refuse them with)."""
    is_causal = contract.check_bool("is_causal", options.get("is_causal", False))
    alignment = options.get("causal_alignment", "top_left")
    if not isinstance(alignment, str) or alignment not in contract.ALIGNMENTS:
        raise ValueError(
            f"causal_alignment should be one of {contract.ALIGNMENTS}, got {alignment!r}"
        )
    window = contract.check_window(options.get("window"))
    chunk = contract.check_chunk_size(options.get("chunk_size"))
    if not is_causal and window in (None, (None, None)) and chunk is None:
        return None
    t = np.arange(T)[:, None]  # (T, 1)
    s = np.arange(S)[None, :]  # (1, S)
    pos = t if alignment == "top_left" else t + S - T  # (T, 1)
    allowed = np.ones((T, S), dtype=bool)  # (T, S)
    if is_causal:
        allowed &= s <= pos
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= s >= pos - left
        if right is not None:
            allowed &= s <= pos + right
    if chunk is not None:
        allowed &= np.floor_divide(pos, chunk) == s // chunk
    return allowed


def through_the_mask(
    options: Mapping[str, Any],
    mask: np.ndarray | None,
    T: int,
    S: int,
    keywords: Mapping[str, str],
    blocked: str,
) -> tuple[dict, np.ndarray | None]:
    """(the options left for keywords, the mask to hand the function): the options of
    ``MASK_OPTIONS`` that have no keyword among ``keywords`` are taken out and built into
    the mask, a bool mask as ``visible & mask``, a float one as ``where(visible, mask,
    blocked)`` (a blocked key's entry replaced, as model code fills it)."""
    moved = {o: v for o, v in options.items() if o in MASK_OPTIONS and o not in keywords}
    rest = {o: v for o, v in options.items() if o not in moved}
    if "causal_alignment" in keywords and "causal_alignment" in options:
        moved["causal_alignment"] = options["causal_alignment"]
    visible = visibility(T, S, moved)
    if visible is None:
        return rest, mask
    if mask is None:
        return rest, visible
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return rest, np.logical_and(visible, mask)  # (..., T, S)
    if not (np.issubdtype(mask.dtype, np.floating) or mask.dtype.name == "bfloat16"):
        return rest, mask  # an integer mask, passed on for the function to refuse
    fill = np.asarray(blocked_value(blocked, mask.dtype), dtype=mask.dtype)  # ()
    return rest, np.where(visible, mask, fill)  # (..., T, S)


def declared_forms(
    call: Any,
    alignments: tuple[str, ...] = ("top_left", "bottom_right"),
    window_sides: tuple[str, ...] = ("left", "right"),
    masks: tuple[str, ...] | None = None,
) -> frozenset[str]:
    """The forms a function called through ``call`` (a ``native.OptionMap``) takes: causality
    unless it reaches the function not at all, non-causal calls unless it is causal only, a
    scale where it has a keyword, top-left alignment and a window's right side unless
    ``alignments`` and ``window_sides`` leave them out, and the masks ``masks`` names
    (default: those ``call`` has a keyword for; a bool mask reaches a function with only a
    float keyword as an additive one)."""
    forms = set()
    if call.causal != "none":
        forms.add("causal")
    if call.causal != "only":
        forms.add("non_causal")
    if masks is None:
        masks = tuple(
            m
            for m, taken in (
                ("bool", call.mask_bool is not None or call.mask_float is not None),
                ("float", call.mask_float is not None),
            )
            if taken
        )
    forms |= {f"mask_{m}" for m in masks}
    if "top_left" in alignments:
        forms.add("causal_top_left")
    if "right" in window_sides:
        forms.add("window_right")
    if "scale" in call.options:
        forms.add("scale")
    return frozenset(forms)
