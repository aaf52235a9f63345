"""A profile's ``[forms]`` table and the ``OptionMap`` its ``[options]`` and ``[mask]``
tables make (SPEC §13.17), and the rest of its keys, checked: ``profile_fields``, of which
``parse_profile`` in the package builds the ``Profile``."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from conformance.adapters.domain import parse_domain
from conformance.adapters.forms import BLOCKED, CAUSALITY, MASK_FORMS, declared_forms
from conformance.adapters.function import FLOAT32_MATMULS
from conformance.adapters.lse import parse_lse
from conformance.adapters.merge import merge_table
from conformance.adapters.native import BOOL_MEANINGS, SCALE_PASSING, SPEC_OPTIONS, OptionMap

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


#: The keys a profile may have.
KEYS = {
    "name",
    "description",
    "target",
    "framework",
    "layout",
    "requires",
    "capabilities",
    "dtypes",
    "options",
    "mask",
    "fixed",
    "known_failures",
    "processor_dependent",
    "varies_between_runs",
    "jit",
    "needs",
    "probe",
    "packed",
    "forms",
    "quantized",
    "domain",
    "interpreter",
    "call",
    "lse",
    "merge",
    "device",
    "float32_matmul",
    "run",
}
MASK_KEYS = {"bool", "bool_true", "float", "blocked"}
#: What a profile's ``needs`` may name: hardware a function requires beyond its libraries.
HARDWARE = {"cuda"}


def _entry_points(data: dict[str, Any], where: str) -> tuple:
    """A profile's second functions and result forms: (packed, domain, lse, merge), each
    checked with the capability it goes with."""
    packed = data.get("packed")
    if packed is not None and (not isinstance(packed, str) or ":" not in packed):
        raise ProfileError(
            f"{where}: 'packed' should be the 'module:function' of attention_packed, got {packed!r}"
        )
    if (packed is not None) != ("packed" in data.get("capabilities", ())):
        raise ProfileError(
            f"{where}: the capability 'packed' and the key 'packed' (the function for "
            "attention_packed) go together"
        )
    try:
        domain = parse_domain(data.get("domain", {}), f"{where}: [domain]")
        lse = parse_lse(data["lse"], where) if "lse" in data else None
    except ValueError as err:
        raise ProfileError(str(err)) from err
    if (lse is not None) != ("lse" in data.get("capabilities", ())):
        raise ProfileError(
            f"{where}: the capability 'lse' and the table [lse] (where the result holds it) "
            "go together"
        )
    try:
        merge = merge_table(data, where)
    except ValueError as err:
        raise ProfileError(str(err)) from err
    return packed, domain, lse, merge


def profile_fields(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """Check a profile's keys: the fields of its ``Profile``."""
    where = str(path)
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise ProfileError(f"{where}: unknown keys {unknown}; known: {', '.join(sorted(KEYS))}")
    # A merge-only profile (a [merge] table, no attention function) has no target.
    for key in ("name",) if "merge" in data and "target" not in data else ("name", "target"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ProfileError(
                f"{where}: {key!r} is required (a string)"
                + (", except in a merge-only profile (a [merge] table)" if key == "target" else "")
            )
    options = data.get("options", {})
    bad = sorted(set(options) - set(SPEC_OPTIONS))
    if bad:
        raise ProfileError(
            f"{where}: [options] names unknown spec options {bad}; known: {', '.join(SPEC_OPTIONS)}"
        )
    mask = data.get("mask", {})
    bad = sorted(set(mask) - MASK_KEYS)
    if bad:
        raise ProfileError(
            f"{where}: [mask] has unknown keys {bad}; known: {', '.join(sorted(MASK_KEYS))}"
        )
    bool_true = mask.get("bool_true", "attend")
    if bool_true not in BOOL_MEANINGS:
        raise ProfileError(
            f"{where}: [mask] bool_true should be one of {', '.join(BOOL_MEANINGS)}, got {bool_true!r}"
        )
    call, takes = call_and_forms(data, where, options, mask, bool_true)
    needs = data.get("needs", [])
    if not isinstance(needs, list) or not all(n in HARDWARE for n in needs):
        raise ProfileError(
            f"{where}: 'needs' should be a list of {sorted(HARDWARE)}, got {needs!r}"
        )
    probe = data.get("probe", "")
    if needs and (not isinstance(probe, str) or ":" not in probe):
        raise ProfileError(
            f"{where}: 'needs' requires 'probe', the 'module:function' that says whether the "
            f"function runs here (None) or what it raised"
        )
    known = data.get("known_failures", {})
    varies = data.get("processor_dependent", {})
    by_run = data.get("varies_between_runs", {})
    tables = (
        ("known failure", "known failures", known),
        ("processor-dependent entry", "processor-dependent", varies),
        ("varies-between-runs entry", "varying between runs", by_run),
    )
    for table, _, entries in tables:
        for pattern, reason in entries.items():
            if not isinstance(reason, str) or not reason.strip():
                raise ProfileError(f"{where}: {table} {pattern!r} needs a reason (a string)")
    for (_, one, first), (_, other, second) in itertools.combinations(tables, 2):
        both = sorted(set(first) & set(second))
        if both:
            raise ProfileError(
                f"{where}: {both} listed both as {one} and as {other}: a test is one or the other"
            )
    packed, domain, lse, merge = _entry_points(data, where)
    interpreter, device, tests = _how_it_runs(data, where)
    return dict(
        name=data["name"],
        target=data.get("target", ""),
        path=path,
        framework=data.get("framework", "numpy"),
        layout=data.get("layout", "BHTD"),
        description=data.get("description", ""),
        requires=tuple(data.get("requires", ())),
        capabilities=tuple(data.get("capabilities", ())),
        dtypes=tuple(data.get("dtypes", ("float64", "float32"))),
        call=call,
        known_failures=dict(known),
        processor_dependent=dict(varies),
        varies_between_runs=dict(by_run),
        jit=bool(data.get("jit", False)),
        needs=tuple(needs),
        probe=probe,
        packed=packed,
        forms=takes,
        quantized=data.get("quantized"),
        domain=domain,
        interpreter=interpreter,
        lse=lse,
        merge=merge,
        device=device,
        float32_matmul=data.get("float32_matmul", "float32"),
        tests=tuple(tests),
    )


def _how_it_runs(data: dict[str, Any], where: str) -> tuple[str, str, list[str]]:
    """A profile's interpreter, device and default run (``[run] tests``), checked, and its
    ``float32_matmul``."""
    interpreter = data.get("interpreter", "")
    if not isinstance(interpreter, str):
        raise ProfileError(
            f"{where}: 'interpreter' should be the interpreter it runs under, in words, got "
            f"{interpreter!r}"
        )
    device = data.get("device", "")
    if not isinstance(device, str):
        raise ProfileError(
            f"{where}: 'device' should be where the function runs, in its framework's "
            f"spelling (cuda, cuda:1, gpu, tpu, cpu), got {device!r}"
        )
    if data.get("float32_matmul", "float32") not in FLOAT32_MATMULS:
        raise ProfileError(
            f"{where}: 'float32_matmul' should be one of {', '.join(FLOAT32_MATMULS)} (what "
            f"its float32 matmuls compute in), got {data['float32_matmul']!r}"
        )
    run = data.get("run", {})
    tests = run.get("tests", [])
    if (
        set(run) - {"tests"}
        or not isinstance(tests, list)
        or not all(isinstance(t, str) and t.startswith("test_") for t in tests)
    ):
        raise ProfileError(
            f"{where}: [run] takes tests, a list of the suite's test ids (test_..., * for "
            f"anything), got {run!r}"
        )
    return interpreter, device, tests
