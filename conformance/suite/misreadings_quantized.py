"""The misreadings of quantized attention (SPEC §20), an area of the one registry
(``conformance/suite/misreadings.py``): the declared P pipeline on misread codes or
descales (``conformance/suite/planted_quantized.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from conformance.suite.misreading import Misreading, always
from conformance.suite.planted_quantized import (
    QuantizedCall,
    descale_by_query_head,
    descale_twice,
    descales_dropped,
    descales_transposed,
    first_descale_for_all,
    p_pipeline_misread,
    q_and_v_descales_swapped,
    quantized_run,
    quantized_scale_twice,
    v_codes_as,
    v_descale_before_softmax,
    v_offset_per_head,
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
            always,
            descales_dropped(roles),
            clauses=("20.1", "20.3"),
        )
        for roles in ("qkv", "q", "k", "v", "kv", "qk", "qv")
    ),
    Misreading(
        "q-and-v-descales-swapped",
        "q's and v's descales are swapped: q is scaled by v's, v by q's",
        always,
        q_and_v_descales_swapped,
        clauses=("20.1", "20.3"),
    ),
    *(
        Misreading(
            f"{r}-descale-twice",
            f"{r}'s descale is applied twice",
            always,
            descale_twice(r),
            clauses=("20.1", "20.3"),
        )
        for r in "qkv"
    ),
    Misreading(
        "softmax-scale-twice",
        "the softmax scale is applied twice",
        always,
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
