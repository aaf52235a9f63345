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
    "module": "the multi-head layer and GPT block from shared weights (SPEC §9)",
    "grad": "backward pass: attention_vjp (SPEC §12)",
    "grad_mask": "attention_vjp also returns the gradient of a float mask (SPEC §12.3)",
    "grad_softcap": "attention_vjp with softcap (SPEC §12.2)",
    "module_grad": "parameter gradients of the module and GPT block: module_param_grads (SPEC §12.8)",
    "error_messages": "errors worded to this project's standard: argument, expected shape, "
    "what was given (SPEC §8.3)",
    "sharded": "context-parallel over P devices: load_backend(name, shards=P, layout=...) "
    "(SPEC §14)",
    "sharded_heads": "a sharded backend that splits heads over the devices (Ulysses), for "
    "any H and K: uneven head counts and K not dividing P included (SPEC §14.8)",
}
#: Claiming a gradient capability means implementing ``attention_vjp`` (and, for
#: "module_grad", ``module_param_grads``), so these are opted into one by one: they are not
#: part of ``ALL_CAPABILITIES``, and a backend that declares ``ALL_CAPABILITIES`` has its
#: gradient tests skipped by name rather than failed.
GRAD_CAPABILITIES = frozenset({"grad", "grad_mask", "grad_softcap", "module_grad"})
DTYPES = ("float64", "float32", "float16", "bfloat16")

#: The variants of today's models (SPEC §15 onwards), opted into one by one as a backend
#: implements them: they are not part of ``ALL_CAPABILITIES`` either, so that a backend
#: (or an ``--impl`` function) declaring ``ALL_CAPABILITIES`` promises only what it
#: promised before they existed, and has their tests skipped by name.
VARIANT_CAPABILITIES = frozenset({"sinks", "chunked", "alibi", "packed", "paged"})

#: Every capability of the forward pass ("sharded" and "sharded_heads" describe how a
#: backend runs, not a feature of the function: only the context-parallel backends
#: declare them).
ALL_CAPABILITIES = (
    frozenset(CAPABILITIES)
    - GRAD_CAPABILITIES
    - VARIANT_CAPABILITIES
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
