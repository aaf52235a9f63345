"""The NumPy backends: the reference impl and its blockwise (flash) sibling."""

from __future__ import annotations

import importlib
from types import MappingProxyType

import numpy as np

from conformance.backends.base import Backend
from conformance.vocabulary import ALL_CAPABILITIES, DTYPES, GRAD_CAPABILITIES, QuantizedForm


class NumpyBackend(Backend):
    name = "numpy"
    capabilities = ALL_CAPABILITIES | GRAD_CAPABILITIES | {
        "sinks", "chunked", "alibi", "packed", "paged", "lse", "merge", "grad_lse"
    }  # fmt: skip
    dtypes = DTYPES

    #: The core page; the others build on it, each a teaching page of its own (the
    #: hand-written backward pass among them).
    impl_module = "conformance.impls.numpy.attention"
    backward_module = "conformance.impls.numpy.backward"
    packed_module = "conformance.impls.numpy.packed"
    paged_module = "conformance.impls.numpy.paged"
    layers_module = "conformance.impls.numpy.layers"
    merge_module = "conformance.impls.numpy.merge"

    def __init__(self) -> None:
        self.impl = importlib.import_module(self.impl_module)
        self.merge = importlib.import_module(self.merge_module)
        self.backward = importlib.import_module(self.backward_module)
        self.packed = importlib.import_module(self.packed_module)
        self.paged = importlib.import_module(self.paged_module)
        self.layers = importlib.import_module(self.layers_module)

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["rng"] = np.random.default_rng(seed)
        return self.impl.attention(q, k, v, **options)

    def _merge_states(self, o_a, lse_a, o_b, lse_b):
        return self.merge.merge_states(o_a, lse_a, o_b, lse_b)

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        return self.layers.multi_head_attention(
            params, x, n_heads=n_heads, mask=mask, is_causal=is_causal
        )

    def gpt_block(self, params, x, *, n_heads):
        return self.layers.gpt_block(params, x, n_heads=n_heads)

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.backward.attention_backward(q, k, v, d_out, **options)

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        return self.packed.attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        return self.packed.attention_packed_backward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options
        )

    def _attention_paged(self, q, k_pages, v_pages, block_table, seq_lens, **options):
        return self.paged.attention_paged(q, k_pages, v_pages, block_table, seq_lens, **options)

    def _attention_paged_vjp(self, q, k_pages, v_pages, block_table, seq_lens, d_out, **options):
        return self.paged.attention_paged_backward(
            q, k_pages, v_pages, block_table, seq_lens, d_out, **options
        )

    def module_param_grads(self, kind, params, x, d_out, *, n_heads, is_causal=False):
        if kind == "mha":
            d_x, grads = self.layers.multi_head_attention_backward(
                params, x, d_out, n_heads=n_heads, is_causal=is_causal
            )
        else:
            d_x, grads = self.layers.gpt_block_backward(params, x, d_out, n_heads=n_heads)
        return {**grads, "x": d_x}


class Blockwise:
    """The tiles of a blockwise impl: ``load_backend(name, block_q=..., block_k=...)``.

    Left out, the impl's own defaults apply (hundreds of rows: the fast configuration).
    The conformance run loads these backends with tiny tiles (``CONFORMANCE_OPTIONS``), so
    that every test's odd sizes cross many tiles, partial last tiles, and tiles skipped
    or half-masked by causality and windows; tests/test_flash.py checks the defaults on a
    problem large enough to tile. A blockwise backend holds one (composition): it has no
    module layers, and no parent backend's methods to run the reference impl in their
    place.
    """

    CONFORMANCE_OPTIONS = MappingProxyType({"block_q": 4, "block_k": 8})

    def __init__(self, impl, *, block_q: int | None = None, block_k: int | None = None) -> None:
        self.impl = impl
        self.options = {
            n: b for n, b in (("block_q", block_q), ("block_k", block_k)) if b is not None
        }

    def attention(self, q, k, v, *, seed=None, **options):
        # The blockwise impls have no dropout: they refuse dropout_p themselves, and the
        # seed that comes with it has no random source to go to.
        return self.impl.attention(q, k, v, **self.options, **options)

    def attention_vjp(self, q, k, v, d_out, **options):
        # The impl's own blockwise backward, on the same tiles as the forward.
        return self.impl.attention_vjp(q, k, v, d_out, **self.options, **options)

    def attention_paged(self, *arrays, **options):
        # A page is a key tile (SPEC §19.6): only the query tile is the backend's option.
        return self.impl.attention_paged(*arrays, **self._query_tiles(), **options)

    def attention_paged_vjp(self, *arrays, **options):
        return self.impl.attention_paged_vjp(*arrays, **self._query_tiles(), **options)

    def _query_tiles(self) -> dict:
        return {n: b for n, b in self.options.items() if n == "block_q"}


#: What a blockwise backend implements: no dropout, no module layers.
BLOCKWISE_CAPABILITIES = (ALL_CAPABILITIES - {"dropout", "module"}) | (
    GRAD_CAPABILITIES - {"module_grad"}
)


class NumpyFlashBackend(Backend):
    """Blockwise attention with the online softmax: never builds the (T, S) matrix."""

    name = "numpy-flash"
    #: The blockwise walk; its packed and paged entry points are on the variants' pages.
    impl_module = "conformance.impls.numpy.flash"
    packed_module = "conformance.impls.numpy.packed"
    paged_module = "conformance.impls.numpy.paged"
    capabilities = BLOCKWISE_CAPABILITIES | {
        "sinks", "chunked", "alibi", "packed", "paged", "lse", "grad_lse"
    }  # fmt: skip
    dtypes = DTYPES
    conformance_options = Blockwise.CONFORMANCE_OPTIONS

    def __init__(
        self, *, block_q: int | None = None, block_k: int | None = None, textbook: bool = False
    ) -> None:
        self.impl = importlib.import_module(self.impl_module)
        self.packed = importlib.import_module(self.packed_module)
        self.paged = importlib.import_module(self.paged_module)
        self.tiles = Blockwise(self.impl, block_q=block_q, block_k=block_k)
        self.options = self.tiles.options
        #: The forward's path on the page: its fast one (the default), or with
        #: ``textbook=True`` the textbook recurrence the page teaches, which the numpy tox
        #: env runs the spec on too. The backward is FlashAttention-2's either way.
        self.fast = not textbook
        if textbook:
            self.options = {**self.options, "textbook": True}

    def _attention(self, q, k, v, **options):
        return self.tiles.attention(q, k, v, fast=self.fast, **options)

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.tiles.attention_vjp(q, k, v, d_out, **options)

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        return self.packed.attention_packed_flash(
            q, k, v, cu_seqlens_q, cu_seqlens_k, **self.tiles.options, **options
        )

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        return self.packed.attention_packed_flash_vjp(
            q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **self.tiles.options, **options
        )

    # A page is a key tile (SPEC §19.6): only the query tile is the backend's option.
    def _attention_paged(self, *arrays, **options):
        return self.paged.attention_paged_flash(*arrays, **self.tiles._query_tiles(), **options)

    def _attention_paged_vjp(self, *arrays, **options):
        return self.paged.attention_paged_flash_vjp(*arrays, **self.tiles._query_tiles(), **options)


class NumpySplitBackend(Backend):
    """Split-KV decoding (flash-decoding): the keys cut into chunks, each attended on its
    own, the pieces merged by their log-sum-exp (SPEC §22.8):
    ``load_backend("numpy-split", num_splits=N)``; left out, chunks of at most 1024 keys."""

    name = "numpy-split"
    impl_module = "conformance.impls.numpy.split_kv"
    merge_module = "conformance.impls.numpy.merge"
    capabilities = (ALL_CAPABILITIES - {"dropout", "module"}) | {
        "sinks", "chunked", "alibi", "paged", "lse", "merge"
    }  # fmt: skip
    dtypes = DTYPES
    #: Three chunks, so that the suite's short rows (S of 0 to 20) are really split, into
    #: chunks of unequal lengths, some with no key a row may see.
    conformance_options = MappingProxyType({"num_splits": 3})

    def __init__(self, *, num_splits: int | None = None) -> None:
        self.impl = importlib.import_module(self.impl_module)
        self.merge = importlib.import_module(self.merge_module)
        self.num_splits = num_splits
        self.options = {} if num_splits is None else {"num_splits": num_splits}

    def _attention(self, q, k, v, *, seed=None, **options):
        return self.impl.attention(q, k, v, num_splits=self.num_splits, **options)

    def _attention_paged(self, q, k_pages, v_pages, block_table, seq_lens, **options):
        return self.impl.attention_paged(
            q, k_pages, v_pages, block_table, seq_lens, num_splits=self.num_splits, **options
        )

    def _merge_states(self, o_a, lse_a, o_b, lse_b):
        return self.merge.merge_states(o_a, lse_a, o_b, lse_b)


#: What the quantized pages take (SPEC §20.7): e4m3 and e5m2 operands (int8 for q and k),
#: descales of every granularity, float32 or float8 output.
QUANTIZED_FORMATS = {
    "q": ("float8_e4m3fn", "float8_e5m2", "int8"),
    "k": ("float8_e4m3fn", "float8_e5m2", "int8"),
    "v": ("float8_e4m3fn", "float8_e5m2"),
}
QUANTIZED_GRANULARITIES = {
    "q": ("tensor", "head"),
    "k": ("tensor", "head", "token", "block"),
    "v": ("tensor", "head", "token", "block"),
}


def quantized_form(pipeline: str, cast_rule: str) -> QuantizedForm:
    """The quantized pages' declaration, with the P pipeline a backend was loaded with."""
    return QuantizedForm(
        formats=QUANTIZED_FORMATS,
        granularities=QUANTIZED_GRANULARITIES,
        pipeline=pipeline,
        out_formats=("float8_e4m3fn", "float8_e5m2"),
        cast_rule=cast_rule,
    )


#: The quantized backends implement SPEC §20 alone, with these options of ``attention``.
QUANTIZED_CAPABILITIES = frozenset(
    {
        "quantized",
        "gqa",
        "value_dim",
        "causal_bottom_right",
        "window",
        "softcap",
        "sinks",
        "error_messages",
    }
)


class NumpyFp8Backend(Backend):
    """Quantized attention (SPEC §20) on the NumPy page, through ``ml_dtypes``:
    ``load_backend("numpy-fp8", pipeline="float32" | "e4m3_unnormalized" |
    "e4m3_normalized")``, FlashAttention-3's pipeline by default."""

    name = "numpy-fp8"
    impl_module = "conformance.impls.numpy.quantized"
    capabilities = QUANTIZED_CAPABILITIES
    dtypes = ("float32",)
    sections = ("20",)
    #: ml_dtypes' cast: past the largest finite value, NaN in e4m3 (SPEC §20.5).
    cast_rule = "overflow"

    def __init__(self, *, pipeline: str = "e4m3_unnormalized") -> None:
        self.impl = importlib.import_module(self.impl_module)
        self.quantized = quantized_form(pipeline, self.cast_rule)
        self.options = {"pipeline": pipeline} if pipeline != "e4m3_unnormalized" else {}

    def _attention_quantized(self, q, k, v, *, out_format=None, **options):
        if out_format is not None:
            options.update(out_format=out_format, cast_rule=self.cast_rule)
        return self.impl.attention_quantized(q, k, v, p_pipeline=self.quantized.pipeline, **options)
