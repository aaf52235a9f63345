"""Fixtures built again inside a kernel's domain, with the oracle (SPEC §13.19).

A fixture whose call cannot be carried into a kernel's declared domain exactly
(``conformance.suite.domain``: a kernel with no mask cannot hide the keys that S = 7 grows
by to reach S = 16) is not skipped while its clause has a case inside the domain. It is
built again there: the same construction (its manifest entry: the large scores, the fully
masked row, the NaN at its position, the padding lengths) drawn from the same seed by the
fixtures' own generator at the kernel's T, S, D and E, its expected output from the
50-digit oracle and its tolerance from SPEC §7's naive run on those inputs, as for every
fixture.

Positions keep what they mean. A query keeps its index, a key its index, except where
alignment gives an index its meaning: under bottom-right alignment both count from the
end, and under top-left causality a key at or after T (after every query, the unwritten
slots of a cache) stays after every query, T' - T further on. A case with no counterpart
inside the domain stays skipped, by name: an empty sequence (its clause is the emptiness),
a window, chunks or ALiBi (whose positions are the clause), or a call that at the
domain's lengths would need a form the kernel does not take.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from typing import Any

import numpy as np
import pytest

from conformance.adapters.domain import Domain
from conformance.adapters.forms import forms_of, forms_used
from conformance.backends import numpy_dtype
from conformance.suite.cases import Case, load_case
from conformance.suite.domain import (
    OUTSIDE,
    carry,
    domain_of,
    head_dims_inside,
    inside,
)
from conformance.suite.domain_summary import REBUILT_PROPERTY
from conformance.suite.helpers import oracle_attention

#: Why an empty sequence is not built again: its emptiness is the clause (the carry's
#: skip already says it has no counterpart inside the domain).
EMPTY = "an empty sequence is its clause"


def case_inside(backend: Any, case: Case, node: pytest.Item | None = None) -> Case:
    """``case`` as ``backend`` is judged on it: the fixture itself where its call lies in
    the backend's domain or is carried into it exactly, else the fixture built again at the
    domain's shapes (noted on ``node`` for the run's summary).

    Raises:
      pytest.skip.Exception: no exact carry and no counterpart inside the domain (the
        reason names both).
    """
    options = {"mask": case.mask(), **case.options()}
    grad = case.meta["kind"] == "attention_grad"
    method = "attention_vjp" if grad else "attention"
    domain = domain_of(backend).of(method).for_dtype(case.meta["dtype"])
    try:
        carry(backend, method, (*case.inputs(), *([case.d_out()] if grad else [])), options)
        return case
    except pytest.skip.Exception as stop:
        why = _why_not_rebuilt(backend, domain, case)
        if why == EMPTY or OUTSIDE not in stop.msg:  # a form it lacks stays skipped
            raise
        if why:
            pytest.skip(f"{stop.msg}; not built again inside it: {why}")
    shape = case.meta["shape"]
    T, S = inside(domain, shape["T"], shape["S"])
    D, E = head_dims_inside(backend, domain, shape["D"], shape["E"])
    moved = {**shape, "T": T, "S": S, "D": D, "E": E}
    lacking = [
        f
        for f in forms_used({"mask": options["mask"], **case.options()}, T, S)
        if f not in forms_of(backend)
    ]
    if lacking:
        pytest.skip(
            f"{case.id} is outside the domain of {backend.name} and, built again at "
            f"T = {T}, S = {S}, would need form {lacking[0]!r}"
        )
    rebuilt = rebuilt_case(case.id, T, S, D, E)
    if node is not None:
        node.user_properties.append(
            (REBUILT_PROPERTY, json.dumps([backend.name, case.id, _shape_words(moved)]))
        )
    return rebuilt


def _why_not_rebuilt(backend: Any, domain: Domain, case: Case) -> str | None:
    shape, options = case.meta["shape"], case.options()
    if shape["T"] == 0 or shape["S"] == 0:
        return EMPTY
    for option, words in (
        ("window", "a window's positions"),
        ("chunk_size", "chunks' positions"),
        ("alibi_slopes", "ALiBi's distances"),
    ):
        if options.get(option) is not None:
            return f"{words} are its clause"
    D, _ = head_dims_inside(backend, domain, shape["D"], shape["E"])
    if D is None:
        return f"no head dim of the domain is at least {max(shape['D'], shape['E'])}"
    T, S = inside(domain, shape["T"], shape["S"])
    if domain.max_t is not None and T > domain.max_t:
        return f"T = {T} is above its most {domain.max_t}, and a fixture's queries are not split"
    # Keys after every query exist only where S > T; with T > S there are none to keep.
    after_every_query = shape["S"] > shape["T"]
    if _causal_top_left(case.meta) and after_every_query and S - shape["S"] < T - shape["T"]:
        return f"at T = {T}, S = {S} its keys after every query would not stay after them"
    return None


def _causal_top_left(meta: dict) -> bool:
    options = meta["options"]
    return bool(options.get("is_causal")) and options.get("causal_alignment") != "bottom_right"


@cache
def rebuilt_case(case_id: str, T: int, S: int, D: int, E: int) -> Case:
    """The fixture ``case_id`` drawn again at T, S, D and E by the fixtures' generator (the
    same seed, its positions moved as the module says), the oracle's output its expected
    (and, for a gradient case, its upstream gradient and the oracle's gradients)."""
    from conformance.fixtures.generate import draw, draw_d_out
    from conformance.suite.oracle_store import oracle

    case = load_case(case_id)
    meta = _moved_entry(case.meta, T, S, D, E)
    arrays = draw(meta)
    extras = {n: arrays[n] for n in ("sinks",) if n in arrays}
    arrays["expected"] = oracle_attention(
        arrays["q"], arrays["k"], arrays["v"], mask=arrays.get("mask"), **meta["options"], **extras
    )
    if meta["kind"] == "attention_grad":
        arrays["d_out"] = draw_d_out(meta)
        grads = oracle.attention_vjp(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            arrays["d_out"],
            mask=arrays.get("mask"),
            **meta["options"],
            **extras,
        )
        arrays.update({f"expected.{name}": g for name, g in grads.items()})
    if meta["unbatched"]:
        for name in list(arrays):
            if name in ("q", "k", "v", "d_out") or name.startswith("expected"):
                arrays[name] = arrays[name][0]
        if "mask" in arrays and arrays["mask"].ndim == 4:
            arrays["mask"] = arrays["mask"][0]
    loader = (
        "from conformance.suite.rebuilt import rebuilt_case\n"
        f"    case = rebuilt_case({case_id!r}, {T}, {S}, {D}, {E})"
    )
    return replace(case, meta=meta, arrays=arrays, loader=loader)


def _moved_entry(meta: dict, T2: int, S2: int, D2: int, E2: int) -> dict:
    """The manifest entry of a case at (T2, S2, D2, E2), its positions moved."""
    shape = meta["shape"]
    T, S = shape["T"], shape["S"]
    front = meta["options"].get("causal_alignment") == "bottom_right" and bool(
        meta["options"].get("is_causal")
    )
    after = _causal_top_left(meta)

    def query(t: int | None) -> int | None:
        return t if t is None or not front else t + T2 - T

    def key(s: int | None) -> int | None:
        if s is None:
            return None
        if front:
            return s + S2 - S
        return s + T2 - T if after and s >= T else s

    edges = dict(meta.get("edges", {}))
    if "poison" in edges:
        edges["poison"] = [
            [name, [*index[:2], (query if name == "q" else key)(index[2]), *index[3:]], value]
            for name, index, value in edges["poison"]
        ]
    if "mask_block_cols" in edges:
        edges["mask_block_cols"] = [key(s) for s in edges["mask_block_cols"]]
    if "mask_values" in edges:
        edges["mask_values"] = [[query(t), key(s), v] for t, s, v in edges["mask_values"]]
    # Large scores stay as large: q·k / sqrt(D) is magnitude² / sqrt(D) plus a spread.
    magnitude = meta["magnitude"]
    if magnitude != 1.0:
        wide = magnitude * (D2 / shape["D"]) ** 0.25
        magnitude = float(np.float64(wide).astype(numpy_dtype(meta["dtype"])))
    mask_shape = meta.get("mask_shape")
    if mask_shape is not None:  # an axis of 1 broadcasts still
        t, s = mask_shape[-2:]
        mask_shape = [*mask_shape[:-2], T2 if t != 1 else 1, S2 if s != 1 else 1]
    return {
        **meta,
        "shape": {**shape, "T": T2, "S": S2, "D": D2, "E": E2},
        "mask_shape": mask_shape,
        "mask_block_rows": [query(t) for t in meta.get("mask_block_rows", [])],
        "magnitude": magnitude,
        "edges": edges,
    }


def _shape_words(shape: dict) -> str:
    return ", ".join(f"{x} = {shape[x]}" for x in "TSDE")
