"""A profile's ``[forms]`` table and the ``OptionMap`` its ``[options]`` and ``[mask]``
tables make (SPEC §13.17), checked; ``parse_profile`` in the package builds the rest."""

from __future__ import annotations

from typing import Any

from conformance.adapters.forms import BLOCKED, CAUSALITY, MASK_FORMS, declared_forms
from conformance.adapters.native import SCALE_PASSING, OptionMap

FORMS_KEYS = {"causal", "alignments", "window_sides", "scale", "masks"}
#: The keys of ``[call]``: how the adapter calls the function beyond its keywords.
CALL_KEYS = {"scale"}
ALIGNMENTS = ("top_left", "bottom_right")
WINDOW_SIDES = ("left", "right")


class ProfileError(LookupError):
    """A profile that cannot be used: missing, malformed, or naming something missing."""


def call_and_forms(
    data: dict[str, Any], where: str, options: dict, mask: dict, bool_true: str
) -> tuple[OptionMap, frozenset[str]]:
    """The profile's ``OptionMap`` and the forms of the core it takes (SPEC §13.17)."""
    forms = _check_forms(data, where)
    blocked = mask.get("blocked", "-inf")
    if blocked not in BLOCKED:
        raise ProfileError(
            f"{where}: [mask] blocked should be one of {', '.join(BLOCKED)}, got {blocked!r}"
        )
    mapped = {k: v for k, v in options.items() if v}
    passing = _check_call(data, where)
    if passing == "always" and "scale" not in mapped:
        raise ProfileError(
            f"{where}: [call] scale = 'always' passes the scale through [options]' scale "
            "keyword, which maps none"
        )
    try:
        call = OptionMap(
            options=mapped,
            mask_bool=mask.get("bool") or None,
            bool_true=bool_true,
            mask_float=mask.get("float") or None,
            fixed=dict(data.get("fixed", {})),
            layout=data.get("layout", "BHTD"),
            causal=forms.get("causal", "keyword" if "is_causal" in mapped else "none"),
            blocked=blocked,
            scale=passing,
        )
    except ValueError as err:
        raise ProfileError(f"{where}: [options], [mask], [forms]: {err}") from err
    if forms.get("scale", "scale" in mapped) != ("scale" in mapped):
        raise ProfileError(
            f"{where}: [forms] scale = {forms['scale']} but [options] maps "
            f"{'a' if 'scale' in mapped else 'no'} scale keyword"
        )
    if call.causal == "mask" and "packed" in data.get("capabilities", ()):
        raise ProfileError(
            f"{where}: causality through the mask cannot reach attention_packed's documents; "
            "'packed' needs is_causal as a keyword"
        )
    masks = forms.get("masks")
    if masks is not None:
        takes = {"bool": call.mask_bool or call.mask_float, "float": call.mask_float}
        unreached = [m for m in masks if not takes[m]]
        if unreached:
            raise ProfileError(
                f"{where}: [forms] masks = {masks} but [mask] names no keyword for "
                f"{unreached} (a bool mask needs bool or float, a float mask float)"
            )
    return call, declared_forms(
        call,
        tuple(forms.get("alignments", ALIGNMENTS)),
        tuple(forms.get("window_sides", WINDOW_SIDES)),
        None if masks is None else tuple(masks),
    )


def _check_forms(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``[forms]`` table, its keys and values checked."""
    forms = data.get("forms", {})
    bad = sorted(set(forms) - FORMS_KEYS)
    if bad:
        raise ProfileError(
            f"{where}: [forms] has unknown keys {bad}; known: {', '.join(sorted(FORMS_KEYS))}"
        )
    if forms.get("causal", "keyword") not in CAUSALITY:
        raise ProfileError(
            f"{where}: [forms] causal should be one of {', '.join(CAUSALITY)}, got "
            f"{forms['causal']!r}"
        )
    for key, allowed in (("alignments", ALIGNMENTS), ("window_sides", WINDOW_SIDES)):
        value = forms.get(key, list(allowed))
        if not isinstance(value, list) or not value or not set(value) <= set(allowed):
            raise ProfileError(
                f"{where}: [forms] {key} should be a non-empty list of {list(allowed)}, got "
                f"{value!r}"
            )
    masks = forms.get("masks", list(MASK_FORMS))
    if not isinstance(masks, list) or not set(masks) <= set(MASK_FORMS):
        raise ProfileError(
            f"{where}: [forms] masks should be a list of {list(MASK_FORMS)} (empty: it takes "
            f"no mask), got {masks!r}"
        )
    if not isinstance(forms.get("scale", True), bool):
        raise ProfileError(
            f"{where}: [forms] scale should be true or false, got {forms['scale']!r}"
        )
    return forms


def _check_call(data: dict[str, Any], where: str) -> str:
    """``[call] scale``: "when_set" (the default) or "always" (SPEC §13.10)."""
    table = data.get("call", {})
    bad = sorted(set(table) - CALL_KEYS) if isinstance(table, dict) else ["(not a table)"]
    if bad:
        raise ProfileError(
            f"{where}: [call] has unknown keys {bad}; known: {', '.join(sorted(CALL_KEYS))}"
        )
    passing = table.get("scale", "when_set")
    if passing not in SCALE_PASSING:
        raise ProfileError(
            f"{where}: [call] scale should be one of {', '.join(SCALE_PASSING)} (always: a "
            f"call without a scale passes 1/sqrt(D)), got {passing!r}"
        )
    return passing
