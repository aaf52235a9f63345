"""The JAX backends: the reference impl, its blockwise sibling, and the context-parallel
ring and Ulysses backends over P devices."""

from __future__ import annotations

import functools
import importlib
from types import MappingProxyType, SimpleNamespace

import numpy as np

from conformance.backends.arrays import JaxFramework, import_jax
from conformance.backends.base import Backend, BackendUnavailable
from conformance.backends.numpy_backends import (
    BLOCKWISE_CAPABILITIES,
    QUANTIZED_CAPABILITIES,
    Blockwise,
    quantized_form,
)
from conformance.vocabulary import ALL_CAPABILITIES, DTYPES, GRAD_CAPABILITIES


def _share_of_mappings_in_use() -> float:
    """The share of Linux's vm.max_map_count this process's memory mappings use; 1 where
    they cannot be counted (another system), so that compiled programs are dropped there
    after every test module, as a run without the count must."""
    try:
        with open("/proc/sys/vm/max_map_count") as limit, open("/proc/self/maps") as maps:
            return sum(1 for _ in maps) / int(limit.read())
    except (OSError, ValueError):
        return 1.0


class JaxBackend(Backend):
    name = "jax"
    framework = "jax"
    capabilities = ALL_CAPABILITIES | GRAD_CAPABILITIES | {
        "sinks", "chunked", "alibi", "packed", "paged", "lse", "merge", "grad_lse"
    }  # fmt: skip
    dtypes = DTYPES
    impl_module = "conformance.impls.jax.attention"
    #: The pages beside the core one that the backend calls (impls/jax/).
    pages = ("gradients", "packed", "paged", "layers", "merge")

    def __init__(self) -> None:
        self.jax = import_jax()
        self.impl = importlib.import_module(self.impl_module)
        package = self.impl_module.rpartition(".")[0]
        self.page = {name: importlib.import_module(f"{package}.{name}") for name in self.pages}

    def from_numpy(self, x):
        # device_put moves the bytes as they are; jnp.asarray would compile a copy per shape.
        return self.jax.device_put(np.asarray(x))

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["key"] = self.jax.random.key(seed)
        return self.impl.attention(q, k, v, **options)

    def _merge_states(self, o_a, lse_a, o_b, lse_b):
        return self.page["merge"].merge_states(o_a, lse_a, o_b, lse_b)

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        params = {n: self.from_numpy(p) for n, p in params.items()}
        mask = None if mask is None else self.from_numpy(mask)
        out = self.page["layers"].multi_head_attention(
            params, self.from_numpy(x), n_heads=n_heads, mask=mask, is_causal=is_causal
        )
        return self.to_numpy(out)

    def gpt_block(self, params, x, *, n_heads):
        params = {n: self.from_numpy(p) for n, p in params.items()}
        layers = self.page["layers"]
        return self.to_numpy(layers.gpt_block(params, self.from_numpy(x), n_heads=n_heads))

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.page["gradients"].attention_vjp(q, k, v, d_out, **options)

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        packed = self.page["packed"]
        return packed.attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        packed = self.page["packed"]
        return packed.attention_packed_vjp(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options)

    def _attention_paged(self, q, k_pages, v_pages, block_table, seq_lens, **options):
        paged = self.page["paged"]
        return paged.attention_paged(q, k_pages, v_pages, block_table, seq_lens, **options)

    def _attention_paged_vjp(self, q, k_pages, v_pages, block_table, seq_lens, d_out, **options):
        return self.page["paged"].attention_paged_vjp(
            q, k_pages, v_pages, block_table, seq_lens, d_out, **options
        )

    def module_param_grads(self, kind, params, x, d_out, *, n_heads, is_causal=False):
        params = {n: self.from_numpy(p) for n, p in params.items()}
        d_params, d_x = self.page["layers"].module_vjp(
            params,
            self.from_numpy(x),
            self.from_numpy(d_out),
            kind=kind,
            n_heads=n_heads,
            is_causal=is_causal,
        )
        return {**{n: self.to_numpy(g) for n, g in d_params.items()}, "x": self.to_numpy(d_x)}

    def versions(self):
        return {**super().versions(), "jax": self.jax.__version__}

    def release(self) -> None:
        # JAX keeps every program it compiled, and each holds memory mappings on the CPU
        # (measured: about 24 for a jax program, 86 for a jax-flash one): a conformance run
        # in one process passes Linux's vm.max_map_count (65530) after about 760 jax-flash
        # programs, and XLA crashes in a later compile (a segmentation fault at 82 % of a
        # one-process jax-flash run; jax-ring's died at 90 % twice). Dropping the compiled
        # programs frees their mappings, at the cost of compiling again those a later
        # module shares, so they are dropped once half the allowed mappings are in use.
        if _share_of_mappings_in_use() > 0.5:
            self.jax.clear_caches()


class JaxFlashBackend(Backend):
    """Blockwise attention with the online softmax under ``jax.jit``: no (T, S) matrix."""

    name = "jax-flash"
    framework = "jax"
    impl_module = "conformance.impls.jax.flash"
    capabilities = BLOCKWISE_CAPABILITIES | {
        "sinks", "chunked", "alibi", "packed", "paged", "lse", "grad_lse"
    }  # fmt: skip
    dtypes = DTYPES
    conformance_options = Blockwise.CONFORMANCE_OPTIONS

    def __init__(self, *, block_q: int | None = None, block_k: int | None = None) -> None:
        self.arrays = JaxFramework()
        self.jax = self.arrays.jax
        self.impl = importlib.import_module(self.impl_module)
        self.packed = importlib.import_module("conformance.impls.jax.flash_packed")
        paged = importlib.import_module("conformance.impls.jax.flash_paged")
        # The blockwise calls, each from its page (impls/jax/flash*.py), as one module.
        pages = SimpleNamespace(
            attention=functools.partial(self.impl.attention, fast=True),
            attention_vjp=self.impl.attention_vjp,
            attention_paged=paged.attention_paged,
            attention_paged_vjp=paged.attention_paged_vjp,
        )
        self.tiles = Blockwise(pages, block_q=block_q, block_k=block_k)
        self.options = self.tiles.options

    def from_numpy(self, x):
        return self.arrays.from_numpy(x)

    def _attention(self, q, k, v, **options):
        return self.tiles.attention(q, k, v, **options)

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.tiles.attention_vjp(q, k, v, d_out, **options)

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        return self.packed.attention_packed(
            q, k, v, cu_seqlens_q, cu_seqlens_k, **self.tiles.options, **options
        )

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        return self.packed.attention_packed_vjp(
            q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **self.tiles.options, **options
        )

    def _attention_paged(self, *arrays, **options):
        return self.tiles.attention_paged(*arrays, **options)

    def _attention_paged_vjp(self, *arrays, **options):
        return self.tiles.attention_paged_vjp(*arrays, **options)

    def versions(self):
        return {**super().versions(), "jax": self.jax.__version__}

    release = JaxBackend.release


class JaxRingBackend(JaxBackend):
    """Ring attention over P JAX devices: ``shard_map``, K/V blocks passed by ``ppermute``.

    ``load_backend("jax-ring", shards=P, layout="contiguous"|"zigzag")``; left out, P is
    every device JAX sees and the layout is zigzag (balanced causal work). On a CPU-only
    machine the constructor makes 8 host devices visible when JAX has not computed
    anything yet (``jax_num_cpu_devices``); when JAX has started with fewer than P devices
    it raises ``BackendUnavailable`` saying so. The ``jax-ring-pN`` names are the same
    backend at P = N, so that the whole spec runs at several P (SPEC §14.1).
    """

    name = "jax-ring"
    impl_module = "conformance.impls.jax.ring"
    capabilities = (ALL_CAPABILITIES - {"dropout", "module"}) | {
        "grad",
        "grad_mask",
        "grad_softcap",
        "sharded",
        "sinks",
        "chunked",
        "alibi",
        "packed",
        "lse",
    }
    pages = ()  # the ring and Ulysses pages hold their own gradients and packed calls
    default_shards: int | None = None
    conformance_options = MappingProxyType({"shards": 4, "layout": "zigzag"})

    def __init__(self, *, shards: int | None = None, layout: str = "zigzag") -> None:
        super().__init__()
        shards = self.default_shards if shards is None else shards
        try:
            self.impl.host_devices(1 if shards is None else shards)
        except RuntimeError as err:
            raise BackendUnavailable(f"{self.name}: {err}") from err
        if layout not in self.impl.LAYOUTS:
            raise ValueError(f"layout should be one of {self.impl.LAYOUTS}, got {layout!r}")
        self.shards = len(self.jax.devices()) if shards is None else shards
        self.layout = layout
        self.options = {"shards": self.shards, "layout": layout}

    def from_numpy(self, x):
        return np.asarray(x)  # the impl lays the arrays out over its devices itself

    def _attention(self, q, k, v, *, seed=None, **options):
        # No dropout: the impl refuses dropout_p > 0 by name, so the seed goes nowhere.
        return self.impl.attention(q, k, v, shards=self.shards, layout=self.layout, **options)

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.impl.attention_vjp(
            q, k, v, d_out, shards=self.shards, layout=self.layout, **options
        )

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        # The packed tokens are one sequence, split over the devices as attention's is.
        return self.impl.attention_packed(
            q, k, v, cu_seqlens_q, cu_seqlens_k, shards=self.shards, layout=self.layout,
            **options,
        )  # fmt: skip

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        return self.impl.attention_packed_vjp(
            q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, shards=self.shards,
            layout=self.layout, **options,
        )  # fmt: skip


class JaxUlyssesBackend(JaxRingBackend):
    """DeepSpeed-Ulysses over P JAX devices: ``lax.all_to_all`` from sequence to head shards.

    ``load_backend("jax-ulysses", shards=P, layout=...)`` takes any H, K and P: the heads
    are padded to a multiple of P with inert dummy heads (the all-to-all splits equally),
    and each device gets the key/value heads its query heads use, repeated where several
    devices need one. The conformance run uses P = 3, zigzag, so the spec's head counts
    (1, 2, 3, 4, ...) split unevenly and K rarely divides P; ``jax-ulysses-p2`` runs the
    whole spec again at P = 2 (SPEC §14.1, §14.8).
    """

    name = "jax-ulysses"
    impl_module = "conformance.impls.jax.ulysses"
    capabilities = JaxRingBackend.capabilities | {"sharded_heads"}
    conformance_options = MappingProxyType({"shards": 3, "layout": "zigzag"})


class JaxFp8Backend(Backend):
    """Quantized attention (SPEC §20) on the JAX page, float8 products with
    ``preferred_element_type=float32``: ``load_backend("jax-fp8", pipeline=...)``,
    FlashAttention-3's pipeline by default."""

    name = "jax-fp8"
    framework = "jax"
    impl_module = "conformance.impls.jax.quantized"
    capabilities = QUANTIZED_CAPABILITIES
    dtypes = ("float32",)
    sections = ("20",)
    #: The page clamps before casting (SPEC §20.5).
    cast_rule = "saturate"

    def __init__(self, *, pipeline: str = "e4m3_unnormalized") -> None:
        self.jax = import_jax()
        self.impl = importlib.import_module(self.impl_module)
        self.quantized = quantized_form(pipeline, self.cast_rule)
        self.options = {"pipeline": pipeline} if pipeline != "e4m3_unnormalized" else {}

    def from_numpy(self, x):
        return self.jax.device_put(np.asarray(x))

    def versions(self):
        return {**super().versions(), "jax": self.jax.__version__}

    def _attention_quantized(self, q, k, v, **options):
        arrays = {n: options.pop(n) for n in ("q_descale", "k_descale", "v_descale")}
        for name in ("mask", "sinks"):
            if name in options:
                arrays[name] = options.pop(name)
        arrays = {n: self.from_numpy(a) for n, a in arrays.items()}
        if options.get("out_format") is None:
            options.pop("out_format", None)
        if "out_descale" in options:
            options["out_descale"] = float(options["out_descale"])
        return self.impl.attention_quantized(
            *(self.from_numpy(x) for x in (q, k, v)), p_pipeline=self.quantized.pipeline,
            **arrays, **options,
        )  # fmt: skip

    def release(self):
        self.impl.compiled.clear_cache()
