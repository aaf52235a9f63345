"""The suite's vocabulary: capabilities, dtypes and option defaults, the words every
layer speaks. A leaf: it imports nothing of the suite."""

from __future__ import annotations

import numpy as np

from conformance.impls.contract import OPTIONS

#: Optional features of the spec. A backend lists those it implements; tests of the others
#: are reported as skipped with the capability's name (SPEC §10.3).
CAPABILITIES = {
    "unbatched": "accepts unbatched (H, T, D) inputs (SPEC §2.2)",
    "value_dim": "a value head dim E that differs from the query/key head dim D (SPEC §2.1)",
    "causal_bottom_right": "causal_alignment='bottom_right' (SPEC §3.5)",
    "window": "sliding-window attention (SPEC §3.6)",
    "softcap": "score softcapping (SPEC §4.2)",
    "gqa": "grouped/multi-query attention with K < H (SPEC §4.6)",
    "dropout": "dropout on the weights with a seed (SPEC §5)",
    "sinks": "attention sinks: one learned logit per query head, sinks (H,), that takes "
    "softmax weight and carries no value (SPEC §15)",
    "chunked": "chunked local attention (Llama 4): chunk_size, query and key attend only "
    "within the same chunk (SPEC §16)",
    "alibi": "ALiBi: alibi_slopes (H,) or (B, H), a linear bias -slope * |t + S - T - s| "
    "added to the scores (SPEC §17)",
    "packed": "packed variable-length sequences: attention_packed(q, k, v, cu_seqlens_q, "
    "cu_seqlens_k), documents one after another, no query sees another document "
    "(SPEC §18)",
    "paged": "paged KV caches: attention_paged(q, k_pages, v_pages, block_table, seq_lens), "
    "keys and values in pages of L slots addressed by a block table (SPEC §19)",
    "lse": "attention(..., return_lse=True) returns (out, lse), lse (B, H, T) the natural "
    "log-sum-exp of each row's scores (SPEC §21)",
    "merge": "merge_states(o_a, lse_a, o_b, lse_b) -> (o, lse): attention over the union "
    "of two disjoint key sets from each set's partial state (SPEC §22)",
    "module": "the multi-head layer and GPT block from shared weights (SPEC §9)",
    "grad": "backward pass: attention_vjp (SPEC §12)",
    "grad_mask": "attention_vjp also returns the gradient of a float mask (SPEC §12.3)",
    "grad_softcap": "attention_vjp with softcap (SPEC §12.2)",
    "grad_lse": "attention_vjp(..., d_lse=) takes the log-sum-exp's cotangent too: the "
    "gradients of L = Σ d_out · out + Σ d_lse · lse (SPEC §21.7)",
    "module_grad": "parameter gradients of the module and GPT block: module_param_grads (SPEC §12.8)",
    "error_messages": "errors worded to this project's standard: argument, expected shape, "
    "what was given (SPEC §8.3)",
    "sharded": "context-parallel over P devices: load_backend(name, shards=P, layout=...) "
    "(SPEC §14)",
    "sharded_heads": "a sharded backend that splits heads over the devices (Ulysses), for "
    "any H and K: uneven head counts and K not dividing P included (SPEC §14.8)",
    "quantized": "quantized operands: attention_quantized(q, k, v, q_descale=, k_descale=, "
    "v_descale=), codes in float8 or int8 with float32 descales, in the form the backend "
    "declares as its ``quantized`` attribute (SPEC §20)",
}
#: Claiming a gradient capability means implementing ``attention_vjp`` (and, for
#: "module_grad", ``module_param_grads``), so these are opted into one by one: they are not
#: part of ``ALL_CAPABILITIES``, and a backend that declares ``ALL_CAPABILITIES`` has its
#: gradient tests skipped by name rather than failed.
GRAD_CAPABILITIES = frozenset({"grad", "grad_mask", "grad_softcap", "module_grad"})
DTYPES = ("float64", "float32", "float16", "bfloat16")

#: The backward pass through the log-sum-exp (SPEC §21.7), opted into by name: not a member
#: of ``GRAD_CAPABILITIES``, so that a backend or an ``--impl`` function that declares
#: ``grad`` (the rings, the mutants, the kit's functions) is not judged on a cotangent it
#: never promised to take.
LSE_GRAD_CAPABILITIES = frozenset({"grad_lse"})

#: The variants of today's models (SPEC §15 onwards), opted into one by one as a backend
#: implements them: they are not part of ``ALL_CAPABILITIES`` either, so that a backend
#: (or an ``--impl`` function) declaring ``ALL_CAPABILITIES`` promises only what it
#: promised before they existed, and has their tests skipped by name.
VARIANT_CAPABILITIES = frozenset({"sinks", "chunked", "alibi", "packed", "paged", "lse", "merge"})

#: Quantized operands (SPEC §20) are a separate entry point with its own declaration (a
#: ``QuantizedForm``), opted into by name like the variants, but not an option of
#: ``attention``: kept apart from ``VARIANT_CAPABILITIES``, whose members are options.
QUANTIZED_CAPABILITIES = frozenset({"quantized"})

#: Every capability of the forward pass ("sharded" and "sharded_heads" describe how a
#: backend runs, not a feature of the function: only the context-parallel backends
#: declare them).
ALL_CAPABILITIES = (
    frozenset(CAPABILITIES)
    - GRAD_CAPABILITIES
    - VARIANT_CAPABILITIES
    - QUANTIZED_CAPABILITIES
    - LSE_GRAD_CAPABILITIES
    - {"sharded", "sharded_heads"}
)

#: The options of ``Backend.attention``, each with the value that means "not set": an
#: option left at it is not passed on. Read from the impls' one table
#: (``conformance.impls.contract.OPTIONS``), with the suite's ``seed`` for dropout in place
#: of each framework's own random source.
OPTION_DEFAULTS = {
    name: value
    for option, spec in OPTIONS.items()
    for name, value in (
        (option, spec.default),
        *((("seed", None),) if option == "dropout_p" else ()),
    )
}
#: The capability each optional option needs (SPEC §8.5), the same table's.
OPTION_CAPABILITIES = {
    option: spec.capability for option, spec in OPTIONS.items() if spec.capability
}


def option_is_set(name: str, value: object) -> bool:
    """Whether ``value`` is other than option ``name``'s default, for array options too
    (``sinks``, ``alibi_slopes``: an array is set, ``None`` is not; ``array != None`` has
    no truth value)."""
    default = OPTION_DEFAULTS[name]
    if default is None:
        return value is not None
    return bool(value != default)


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a dtype name; bfloat16 comes from ``ml_dtypes``."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


#: The formats of a quantized operand's codes (SPEC §20.1), by their ``ml_dtypes`` names;
#: int8 for q and k (SageAttention) and for a KV cache's k and v (ONNX Runtime's
#: GroupQueryAttention). Each with its largest finite value.
QUANT_FORMATS = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
#: How a value past a format's largest finite one is cast (SPEC §20.5): clipped to it
#: ("saturate", torch's eager cast), or the format's overflow value ("overflow": NaN in
#: float8_e4m3fn, which has no infinity; ±inf in float8_e5m2; ml_dtypes' cast).
CAST_RULES = ("saturate", "overflow")
#: The granularities of a descale (SPEC §20.2), from its shape.
GRANULARITIES = ("tensor", "head", "token", "block")
#: What happens to P = exp(s − m) before P·V (SPEC §20.6): kept in float32, (a);
#: FlashAttention-3's unnormalised P · 2⁸ rounded to float8_e4m3fn with the row sum from
#: float32 P, (b); the normalised P rounded to float8_e4m3fn, (c).
P_PIPELINES = ("float32", "e4m3_unnormalized", "e4m3_normalized")
#: The dtypes P·V may be summed in (SPEC §20.9): float32, or a 16-bit accumulator.
P_ACCUMULATORS = ("float32", "float16", "bfloat16")


class QuantizedForm:
    """What a backend with the capability "quantized" takes and does (SPEC §20.7).

    formats: {"q": ..., "k": ..., "v": ...}, each a tuple of ``QUANT_FORMATS`` names.
    granularities: {"q": ..., "k": ..., "v": ...}, each a tuple of ``GRANULARITIES``.
    pipeline: one of ``P_PIPELINES``. out_formats: the formats it can return its output
    in with an ``out_descale`` (empty: float32 only). cast_rule: one of ``CAST_RULES``.
    The pipeline's parameters (SPEC §20.9): lift, the factor P is multiplied by before it
    is rounded (None: 2⁸ unnormalised, FlashAttention-3's; 1 normalised); tile, the keys
    per tile whose running maximum P is rounded at (None: the row's maximum); accumulator,
    one of ``P_ACCUMULATORS``. quantizes: the function quantizes its own float inputs
    (SPEC §20.4), so q may be per token or per block too.
    """

    def __init__(
        self,
        *,
        formats: dict[str, tuple[str, ...]],
        granularities: dict[str, tuple[str, ...]],
        pipeline: str,
        out_formats: tuple[str, ...] = (),
        cast_rule: str = "saturate",
        lift: float | None = None,
        tile: int | None = None,
        accumulator: str = "float32",
        quantizes: bool = False,
    ) -> None:
        # q's descale is per tensor or per head when the suite hands it codes; a kernel
        # that quantizes q itself may do it per token or per block (SageAttention).
        q_granularities = set(GRANULARITIES) if quantizes else {"tensor", "head"}
        for role in ("q", "k", "v"):
            bad = set(formats[role]) - set(QUANT_FORMATS)
            if bad:
                raise ValueError(
                    f"formats[{role!r}] should be among {sorted(QUANT_FORMATS)}, got "
                    f"{formats[role]}"
                )
            bad = set(granularities[role]) - set(GRANULARITIES)
            if bad or (role == "q" and set(granularities[role]) - q_granularities):
                raise ValueError(
                    f"granularities[{role!r}] should be among {GRANULARITIES} (q: tensor or "
                    f"head, unless it quantizes itself), got {granularities[role]}"
                )
        if pipeline not in P_PIPELINES:
            raise ValueError(f"pipeline should be one of {P_PIPELINES}, got {pipeline!r}")
        if cast_rule not in CAST_RULES:
            raise ValueError(f"cast_rule should be one of {CAST_RULES}, got {cast_rule!r}")
        if set(out_formats) - {"float8_e4m3fn", "float8_e5m2"}:
            raise ValueError(
                f"out_formats should be float8_e4m3fn or float8_e5m2, got {out_formats}"
            )
        if lift is not None and (
            isinstance(lift, bool)
            or not isinstance(lift, int | float)
            or not 0 < lift <= QUANT_FORMATS["float8_e4m3fn"]
        ):
            raise ValueError(f"lift should be a number in (0, 448], got {lift!r}")
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"tile should be a number of keys (an int ≥ 1), got {tile!r}")
        if accumulator not in P_ACCUMULATORS:
            raise ValueError(f"accumulator should be one of {P_ACCUMULATORS}, got {accumulator!r}")
        self.lift = None if lift is None else float(lift)
        self.tile = tile
        self.accumulator = accumulator
        self.formats = {r: tuple(formats[r]) for r in ("q", "k", "v")}
        self.granularities = {r: tuple(granularities[r]) for r in ("q", "k", "v")}
        self.pipeline = pipeline
        self.out_formats = tuple(out_formats)
        self.cast_rule = cast_rule

    def __repr__(self) -> str:
        return (
            f"QuantizedForm(formats={self.formats}, granularities={self.granularities}, "
            f"pipeline={self.pipeline!r}, out_formats={self.out_formats}, "
            f"cast_rule={self.cast_rule!r}, lift={self.lift!r}, tile={self.tile!r}, "
            f"accumulator={self.accumulator!r})"
        )
