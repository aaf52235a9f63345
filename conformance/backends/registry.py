"""Backends: one small class per implementation, the only place data crosses frameworks.

A backend takes NumPy arrays, converts them to its framework (``from_numpy``), calls the
implementation and converts the result back (``to_numpy``). It declares the optional
capabilities it supports and the dtypes it accepts; the suite decides what to run from
those declarations, never from a backend's name.

Frameworks are imported lazily, inside the backend that needs them, so ``import
conformance`` imports neither torch nor jax.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

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
ENTRY_POINT_GROUP = "attention_conformance.backends"


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a dtype name; bfloat16 comes from ``ml_dtypes``."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class BackendUnavailable(LookupError):
    """A backend was asked for that is unknown or cannot be imported."""


class Backend:
    """The interface the suite tests. Subclass it to plug in your own implementation.

    Attributes:
      name: the id used in test ids and the report.
      framework: the library the implementation runs on, for the versions table.
      capabilities: a subset of ``CAPABILITIES``.
      dtypes: a subset of ``DTYPES``.
      options: the options it was loaded with (``load_backend(name, **options)``), so a
        replay can load it the same way.
      conformance_options: the options the conformance run loads it with, when the
        suite's small inputs need another configuration than the fast default to reach
        every code path (SPEC §10.4). Users get the defaults.
    """

    name: str = ""
    framework: str = "numpy"
    capabilities: frozenset[str] = frozenset()
    dtypes: tuple[str, ...] = ("float64", "float32")
    options: Mapping[str, Any] = MappingProxyType({})
    conformance_options: Mapping[str, Any] = MappingProxyType({})

    def from_numpy(self, x: np.ndarray) -> Any:
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        *,
        mask: np.ndarray | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        causal_alignment: str = "top_left",
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
        dropout_p: float = 0.0,
        seed: int | None = None,
    ) -> np.ndarray:
        """out (B, H, T, E) for q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), NumPy in and out."""
        options = {"is_causal": is_causal, "scale": scale}
        for key, value, default in (
            ("causal_alignment", causal_alignment, "top_left"),
            ("window", window, None),
            ("softcap", softcap, None),
            ("dropout_p", dropout_p, 0.0),
        ):
            # An option left at its default is not passed on, so an implementation
            # without that feature needs no parameter for it.
            if value != default:
                options[key] = value
        if dropout_p:
            options["seed"] = seed
        mask = None if mask is None else self.from_numpy(np.asarray(mask))
        out = self._attention(
            self.from_numpy(q), self.from_numpy(k), self.from_numpy(v), mask=mask, **options
        )
        return self.to_numpy(out)

    def _attention(self, q, k, v, **options):
        raise NotImplementedError

    def prepare(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, **options: Any
    ) -> Callable[[], Any]:
        """Convert q, k, v once; return a zero-argument call that runs attention and waits.

        For timing (the benchmark): the conversion from NumPy stays outside the call, and
        the call returns only once the result exists (JAX dispatches asynchronously, so
        an output with ``block_until_ready`` is waited on). ``options`` go to the
        implementation as given; the result stays in the backend's framework.
        """
        q, k, v = (self.from_numpy(x) for x in (q, k, v))

        def call() -> Any:
            out = self._attention(q, k, v, **options)
            wait = getattr(out, "block_until_ready", None)
            return out if wait is None else wait()

        return call

    def attention_vjp(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        d_out: np.ndarray,
        *,
        mask: np.ndarray | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        causal_alignment: str = "top_left",
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
    ) -> tuple[np.ndarray, ...]:
        """The backward pass (capability "grad"), NumPy in and out.

        For the loss L = Σ d_out · attention(q, k, v, ...), with d_out (B, H, T, E) like the
        output: (dq, dk, dv) = (∂L/∂q, ∂L/∂k, ∂L/∂v), shaped and typed like q, k, v; with a
        floating mask and capability "grad_mask", (dq, dk, dv, dmask), dmask shaped like
        the mask. Options as for ``attention``; there is no dropout in the backward.
        """
        options = {"is_causal": is_causal, "scale": scale}
        for key, value, default in (
            ("causal_alignment", causal_alignment, "top_left"),
            ("window", window, None),
            ("softcap", softcap, None),
        ):
            if value != default:
                options[key] = value
        mask = None if mask is None else self.from_numpy(np.asarray(mask))
        grads = self._attention_vjp(
            self.from_numpy(q),
            self.from_numpy(k),
            self.from_numpy(v),
            self.from_numpy(d_out),
            mask=mask,
            **options,
        )
        # Autograd may hand back transposed views; the caller gets plain C-ordered arrays.
        return tuple(np.ascontiguousarray(self.to_numpy(g)) for g in grads)

    def _attention_vjp(self, q, k, v, d_out, **options):
        raise NotImplementedError(f"{self.name} does not declare the 'grad' capability")

    def prepare_vjp(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, d_out: np.ndarray, **options: Any
    ) -> Callable[[], Any]:
        """``prepare`` for the backward pass: q, k, v and d_out converted once; the call
        runs ``attention_vjp`` (forward and backward) and returns once every gradient
        exists, in the backend's framework. ``options`` go to the implementation as given."""
        q, k, v, d_out = (self.from_numpy(x) for x in (q, k, v, d_out))

        def call() -> Any:
            grads = self._attention_vjp(q, k, v, d_out, **options)
            return [
                g if not hasattr(g, "block_until_ready") else g.block_until_ready() for g in grads
            ]

        return call

    def module_param_grads(
        self,
        kind: str,
        params: dict[str, np.ndarray],
        x: np.ndarray,
        d_out: np.ndarray,
        *,
        n_heads: int,
        is_causal: bool = False,
    ) -> dict[str, np.ndarray]:
        """Gradients of L = Σ d_out · module(x) (capability "module_grad").

        ``kind`` is "mha" (``multi_head_attention``) or "gpt_block" (``is_causal`` is then
        ignored: the block is causal). Returns {parameter name: ∂L/∂parameter} for every
        entry of ``params``, and "x": ∂L/∂x, all NumPy arrays.
        """
        raise NotImplementedError(f"{self.name} does not declare the 'module_grad' capability")

    def multi_head_attention(
        self,
        params: dict[str, np.ndarray],
        x: np.ndarray,
        *,
        n_heads: int,
        mask: np.ndarray | None = None,
        is_causal: bool = False,
    ) -> np.ndarray:
        """The seeds' multi-head layer from a PyTorch-layout ``state_dict`` (capability "module")."""
        raise NotImplementedError(f"{self.name} does not declare the 'module' capability")

    def gpt_block(
        self, params: dict[str, np.ndarray], x: np.ndarray, *, n_heads: int
    ) -> np.ndarray:
        """The seeds' pre-LN GPT block from a PyTorch-layout ``state_dict`` (capability "module")."""
        raise NotImplementedError(f"{self.name} does not declare the 'module' capability")

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this backend runs on, for the report."""
        return {"python": platform.python_version(), "numpy": np.__version__}

    def release(self) -> None:
        """Drop what the backend keeps from earlier calls (compiled programs, say); the
        next call builds it again. The conformance run calls this on every loaded backend
        after each test module. By default nothing is dropped."""

    def __repr__(self) -> str:
        return f"<backend {self.name}: {', '.join(self.dtypes)}; {', '.join(sorted(self.capabilities))}>"


#: Every capability of the forward pass ("sharded" and "sharded_heads" describe how a
#: backend runs, not a feature of the function: only the context-parallel backends
#: declare them).
ALL_CAPABILITIES = frozenset(CAPABILITIES) - GRAD_CAPABILITIES - {"sharded", "sharded_heads"}


class NumpyBackend(Backend):
    name = "numpy"
    capabilities = ALL_CAPABILITIES | GRAD_CAPABILITIES
    dtypes = DTYPES

    impl_module = "conformance.impls.numpy_attention"
    #: The hand-written backward pass, a teaching page of its own.
    backward_module = "conformance.impls.numpy_attention_backward"

    def __init__(self) -> None:
        self.impl = importlib.import_module(self.impl_module)
        self.backward = importlib.import_module(self.backward_module)

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["rng"] = np.random.default_rng(seed)
        return self.impl.attention(q, k, v, **options)

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        return self.impl.multi_head_attention(
            params, x, n_heads=n_heads, mask=mask, is_causal=is_causal
        )

    def gpt_block(self, params, x, *, n_heads):
        return self.impl.gpt_block(params, x, n_heads=n_heads)

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.backward.attention_backward(q, k, v, d_out, **options)

    def module_param_grads(self, kind, params, x, d_out, *, n_heads, is_causal=False):
        if kind == "mha":
            d_x, grads = self.backward.multi_head_attention_backward(
                params, x, d_out, n_heads=n_heads, is_causal=is_causal
            )
        else:
            d_x, grads = self.backward.gpt_block_backward(params, x, d_out, n_heads=n_heads)
        return {**grads, "x": d_x}


class _Blockwise:
    """Tile sizes of a blockwise backend: ``load_backend(name, block_q=..., block_k=...)``.

    Left out, the impl's own defaults apply (hundreds of rows: the fast configuration).
    The conformance run loads these backends with tiny tiles, so that every test's odd
    sizes cross many tiles, partial last tiles, and tiles skipped or half-masked by
    causality and windows; tests/test_flash.py checks the defaults on a problem large
    enough to tile.
    """

    conformance_options = MappingProxyType({"block_q": 4, "block_k": 8})

    def __init__(self, *, block_q: int | None = None, block_k: int | None = None) -> None:
        super().__init__()
        self.options = {
            n: b for n, b in (("block_q", block_q), ("block_k", block_k)) if b is not None
        }

    def _attention(self, q, k, v, *, seed=None, **options):
        # The blockwise impls have no dropout: they refuse dropout_p themselves, and the
        # seed that comes with it has no random source to go to.
        return self.impl.attention(q, k, v, **self.options, **options)

    def _attention_vjp(self, q, k, v, d_out, **options):
        # The impl's own blockwise backward, on the same tiles as the forward.
        return self.impl.attention_vjp(q, k, v, d_out, **self.options, **options)

    # No module layers here: the parent backend's methods would silently run the
    # reference impl in their place.
    module_param_grads = Backend.module_param_grads
    multi_head_attention = Backend.multi_head_attention
    gpt_block = Backend.gpt_block


class NumpyFlashBackend(_Blockwise, NumpyBackend):
    """Blockwise attention with the online softmax: never builds the (T, S) matrix."""

    name = "numpy-flash"
    impl_module = "conformance.impls.numpy_flash"
    capabilities = (ALL_CAPABILITIES - {"dropout", "module"}) | (
        GRAD_CAPABILITIES - {"module_grad"}
    )


class JaxBackend(Backend):
    name = "jax"
    framework = "jax"
    capabilities = ALL_CAPABILITIES | GRAD_CAPABILITIES
    dtypes = DTYPES
    impl_module = "conformance.impls.jax_attention"

    def __init__(self) -> None:
        import jax

        # float64 is part of the spec; JAX silently computes in float32 without this.
        jax.config.update("jax_enable_x64", True)
        self.jax = jax
        self.impl = importlib.import_module(self.impl_module)

    def from_numpy(self, x):
        # device_put moves the bytes as they are; jnp.asarray would compile a copy per shape.
        return self.jax.device_put(np.asarray(x))

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["key"] = self.jax.random.key(seed)
        return self.impl.attention(q, k, v, **options)

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        params = {n: self.from_numpy(p) for n, p in params.items()}
        mask = None if mask is None else self.from_numpy(mask)
        out = self.impl.multi_head_attention(
            params, self.from_numpy(x), n_heads=n_heads, mask=mask, is_causal=is_causal
        )
        return self.to_numpy(out)

    def gpt_block(self, params, x, *, n_heads):
        params = {n: self.from_numpy(p) for n, p in params.items()}
        return self.to_numpy(self.impl.gpt_block(params, self.from_numpy(x), n_heads=n_heads))

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.impl.attention_vjp(q, k, v, d_out, **options)

    def module_param_grads(self, kind, params, x, d_out, *, n_heads, is_causal=False):
        params = {n: self.from_numpy(p) for n, p in params.items()}
        d_params, d_x = self.impl.module_vjp(
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


class JaxFlashBackend(_Blockwise, JaxBackend):
    """Blockwise attention with the online softmax under ``jax.jit``: no (T, S) matrix."""

    name = "jax-flash"
    impl_module = "conformance.impls.jax_flash"
    capabilities = (ALL_CAPABILITIES - {"dropout", "module"}) | (
        GRAD_CAPABILITIES - {"module_grad"}
    )


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
    impl_module = "conformance.impls.jax_ring"
    capabilities = (ALL_CAPABILITIES - {"dropout", "module"}) | {
        "grad",
        "grad_mask",
        "grad_softcap",
        "sharded",
    }
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

    def release(self) -> None:
        # Each compiled multi-device program holds about 15 memory mappings on the CPU,
        # and JAX keeps every program it compiled: a whole conformance run (about a
        # thousand programs) passes Linux's vm.max_map_count (65530) and XLA crashes in a
        # later compile or cache write. Measured: a run died at 90 % twice. Dropping the
        # compiled programs frees their mappings; the persistent cache, where on, makes
        # the next compile of the same program cheap.
        self.jax.clear_caches()


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
    impl_module = "conformance.impls.jax_ulysses"
    capabilities = JaxRingBackend.capabilities | {"sharded_heads"}
    conformance_options = MappingProxyType({"shards": 3, "layout": "zigzag"})


def _at_shards(base: type[Backend], P: int) -> type[Backend]:
    """``base`` fixed at P shards by default, under the name ``{base.name}-p{P}``."""
    return type(
        f"{base.__name__}P{P}",
        (base,),
        {
            "name": f"{base.name}-p{P}",
            "default_shards": P,
            "conformance_options": MappingProxyType({}),
            "__doc__": f"{base.name} at P = {P} (SPEC §14.1).",
        },
    )


class _TorchBackend(Backend):
    framework = "torch"
    dtypes = DTYPES

    def __init__(self) -> None:
        # The one converter between NumPy and torch, shared with the profiles' calls.
        from conformance.adapters.native import TorchFramework

        self.arrays = TorchFramework()
        self.torch = self.arrays.torch

    def from_numpy(self, x):
        return self.arrays.from_numpy(x)

    def to_numpy(self, x):
        return self.arrays.to_numpy(x)

    def versions(self):
        return {**super().versions(), "torch": self.torch.__version__}

    def _attention_vjp(self, q, k, v, d_out, *, mask=None, **options):
        # Autograd through the very forward the suite tests: q, k, v (and a float mask)
        # become leaves that require grad, and the output's vector-Jacobian product with
        # d_out is read off them.
        torch = self.torch
        float_mask = mask is not None and mask.dtype.is_floating_point
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        if float_mask:
            mask = mask.detach().requires_grad_(True)
            leaves.append(mask)
        with torch.enable_grad():
            out = self._attention(*leaves[:3], mask=mask, **options)
        if d_out.shape != out.shape:
            letters = "(B, H, T, E)" if out.ndim == 4 else "(H, T, E)"
            raise ValueError(
                f"d_out shape should be the output's {letters} = {tuple(out.shape)}, "
                f"got {tuple(d_out.shape)}"
            )
        if d_out.dtype != out.dtype:
            raise TypeError(f"d_out dtype should be {out.dtype} like q, got {d_out.dtype}")
        grads = torch.autograd.grad(out, leaves, grad_outputs=d_out, allow_unused=True)
        # A leaf the output does not depend on (v with every row masked) has gradient 0.
        return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


class TorchRingBackend(_TorchBackend):
    """Ring attention on a pool of P torch.distributed (gloo) worker processes.

    ``load_backend("torch-ring", shards=P, layout=...)`` (``world_size=P`` is the same);
    left out, P = 4 and the zigzag layout. The pool starts on first use, is reused, and
    stops at exit; a dead worker raises ``WorkerDied`` and the next call starts a new one.
    The backward pass is a second ring, written by hand (autograd does not differentiate
    point-to-point communication).
    """

    name = "torch-ring"
    capabilities = (
        (ALL_CAPABILITIES - {"dropout", "module"})
        | (GRAD_CAPABILITIES - {"module_grad"})
        | {"sharded"}
    )
    conformance_options = MappingProxyType({"shards": 3, "layout": "zigzag"})
    default_shards = 4
    impl_module = "conformance.impls.torch_ring"

    def __init__(
        self, *, shards: int | None = None, world_size: int | None = None, layout: str = "zigzag"
    ) -> None:
        super().__init__()
        #: The ring impl owns the worker pools (torch-ulysses runs its ranks on them too).
        self.ring = importlib.import_module("conformance.impls.torch_ring")
        self.impl = importlib.import_module(self.impl_module)
        P = shards if shards is not None else world_size
        P = self.default_shards if P is None else P
        if isinstance(P, bool) or not isinstance(P, int) or P < 1:
            raise ValueError(f"shards should be a positive int (P processes), got {P!r}")
        if layout not in self.ring.LAYOUTS:
            raise ValueError(f"layout should be one of {self.ring.LAYOUTS}, got {layout!r}")
        self.shards, self.layout = P, layout
        self.options = {"shards": P, "layout": layout}

    def from_numpy(self, x):
        return np.asarray(x)  # the impl lays the arrays out and hands them to its ranks

    def to_numpy(self, x):
        return np.asarray(x)

    def _attention(self, q, k, v, *, seed=None, **options):
        # No dropout: the impl refuses dropout_p > 0 by name, so the seed goes nowhere.
        return self.impl.attention(q, k, v, world_size=self.shards, layout=self.layout, **options)

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.impl.attention_vjp(
            q, k, v, d_out, world_size=self.shards, layout=self.layout, **options
        )

    def release(self) -> None:
        # The worker processes stop here, after each test module, rather than at exit:
        # a run that loads many P would otherwise keep a pool per P (measured: 16 processes,
        # 4.6 GiB, at P = 7 and 8). The next call starts a pool again.
        self.ring.shutdown()


class TorchUlyssesBackend(TorchRingBackend):
    """DeepSpeed-Ulysses on the torch-ring worker pool: ``dist.all_to_all_single`` (gloo)
    from sequence to head shards and back, uneven splits for any H and K.

    ``load_backend("torch-ulysses", shards=P, layout=...)``, defaults as torch-ring's. The
    impl stands alone (its ranks are run by whatever ``run`` it is given); this backend
    gives it torch-ring's pool, so both backends share one set of P processes. The
    backward is autograd on each rank's attention between the two hand-written reverse
    all-to-alls.
    """

    name = "torch-ulysses"
    impl_module = "conformance.impls.torch_ulysses"
    capabilities = TorchRingBackend.capabilities | {"sharded_heads"}

    def _run(self, fn, shards, **kwargs):
        return self.ring.run_on_ranks(self.shards, fn, shards, **kwargs)

    def _attention(self, q, k, v, *, seed=None, **options):
        return self.impl.attention(
            q, k, v, world_size=self.shards, layout=self.layout, run=self._run, **options
        )

    def _attention_vjp(self, q, k, v, d_out, **options):
        return self.impl.attention_vjp(
            q, k, v, d_out, world_size=self.shards, layout=self.layout, run=self._run, **options
        )


class TorchNaiveBackend(_TorchBackend):
    name = "torch-naive"
    capabilities = (ALL_CAPABILITIES - {"module"}) | (GRAD_CAPABILITIES - {"module_grad"})

    def __init__(self) -> None:
        super().__init__()
        self.impl = importlib.import_module("conformance.impls.torch_naive")

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["generator"] = self.torch.Generator().manual_seed(seed)
        return self.impl.attention(q, k, v, **options)


class TorchModuleBackend(_TorchBackend):
    """The nn.Module backend: the core spec runs the module's own attention function."""

    name = "torch-module"
    capabilities = ALL_CAPABILITIES | GRAD_CAPABILITIES

    def __init__(self) -> None:
        super().__init__()
        self.impl = importlib.import_module("conformance.impls.torch_module")

    def _attention(self, q, k, v, *, seed=None, dropout_p=0.0, **options):
        # dropout_p arrives only when it is not 0 (Backend.attention): whatever it is, it
        # goes to the module's dropout, whose p the impl's input contract checks.
        if dropout_p != 0.0:
            if seed is not None:
                self.torch.manual_seed(seed)
            options["dropout"] = self.torch.nn.Dropout(dropout_p).train()
        return self.impl.attention(q, k, v, **options)

    def _load(self, module, params):
        state = {n: self.from_numpy(p) for n, p in params.items()}
        dtype = next(iter(state.values())).dtype
        module = module.to(dtype)
        module.load_state_dict(state)
        return module.eval()

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        C = np.asarray(x).shape[-1]
        mha = self._load(self.impl.MultiHeadAttention(C, n_heads), params)
        mask = None if mask is None else self.from_numpy(mask)
        with self.torch.no_grad():
            return self.to_numpy(mha(self.from_numpy(x), mask=mask, is_causal=is_causal))

    def gpt_block(self, params, x, *, n_heads):
        C = np.asarray(x).shape[-1]
        F = np.asarray(params["mlp.0.weight"]).shape[0]
        block = self._load(self.impl.SelfAttentionBlock(C, n_heads, F), params)
        with self.torch.no_grad():
            return self.to_numpy(block(self.from_numpy(x)))

    def module_param_grads(self, kind, params, x, d_out, *, n_heads, is_causal=False):
        C = np.asarray(x).shape[-1]
        if kind == "mha":
            module = self._load(self.impl.MultiHeadAttention(C, n_heads), params)
        else:
            F = np.asarray(params["mlp.0.weight"]).shape[0]
            module = self._load(self.impl.SelfAttentionBlock(C, n_heads, F), params)
        x = self.from_numpy(x).requires_grad_(True)
        with self.torch.enable_grad():
            out = module(x, is_causal=is_causal) if kind == "mha" else module(x)
            out.backward(self.from_numpy(d_out))
        grads = {n: self.to_numpy(p.grad) for n, p in module.named_parameters()}
        return {**grads, "x": self.to_numpy(x.grad)}


class TorchSdpaBackend(_TorchBackend):
    """SDPA's own backward; softcap goes through flex_attention, which has no CPU backward."""

    name = "torch-sdpa"
    capabilities = (ALL_CAPABILITIES - {"module"}) | {"grad", "grad_mask"}

    def __init__(self) -> None:
        super().__init__()
        self.impl = importlib.import_module("conformance.impls.torch_sdpa")

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            self.torch.manual_seed(seed)
        return self.impl.attention(q, k, v, **options)


BUILTIN: dict[str, type[Backend]] = {
    "numpy": NumpyBackend,
    "numpy-flash": NumpyFlashBackend,
    "jax": JaxBackend,
    "jax-flash": JaxFlashBackend,
    "torch-naive": TorchNaiveBackend,
    "torch-module": TorchModuleBackend,
    "torch-sdpa": TorchSdpaBackend,
    "jax-ring": JaxRingBackend,
    **{f"jax-ring-p{P}": _at_shards(JaxRingBackend, P) for P in (1, 2, 3)},
    "jax-ulysses": JaxUlyssesBackend,
    "jax-ulysses-p2": _at_shards(JaxUlyssesBackend, 2),
    "torch-ring": TorchRingBackend,
    **{f"torch-ring-p{P}": _at_shards(TorchRingBackend, P) for P in (1, 2, 4)},
    "torch-ulysses": TorchUlyssesBackend,
    "torch-ulysses-p2": _at_shards(TorchUlyssesBackend, 2),
}
#: The framework each built-in backend needs, to tell "not installed" from "broken".
REQUIRES = {
    "jax": "jax",
    "jax-flash": "jax",
    "torch-naive": "torch",
    "torch-module": "torch",
    "torch-sdpa": "torch",
    "jax-ring": "jax",
    **{f"jax-ring-p{P}": "jax" for P in (1, 2, 3)},
    "jax-ulysses": "jax",
    "jax-ulysses-p2": "jax",
    "torch-ring": "torch",
    **{f"torch-ring-p{P}": "torch" for P in (1, 2, 4)},
    "torch-ulysses": "torch",
    "torch-ulysses-p2": "torch",
}


class Registry:
    """Every backend the suite knows: built-in, from entry points, and registered at run time.

    ``register`` adds a backend for this process (``--impl`` does); entry points (group
    ``attention_conformance.backends``) register one for good. ``load`` builds a backend
    once per (name, options) and hands out the same object afterwards.
    """

    def __init__(self, builtin: dict[str, Callable[..., Backend]]) -> None:
        self._builtin = dict(builtin)
        self._runtime: dict[str, Callable[..., Backend]] = {}
        self._loaded: dict[tuple, Backend] = {}

    def factories(self) -> dict[str, Callable[..., Backend]]:
        found = {**self._builtin, **self._runtime}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            found.setdefault(ep.name, ep.load)
        return found

    def register(
        self, name: str, factory: Callable[..., Backend], *, replace: bool = False
    ) -> None:
        """Make ``factory`` loadable as ``name``; a taken name is refused unless ``replace``.

        Replacing drops the loaded instances of that name, so the next ``load`` builds anew.
        """
        if not replace and name in self.factories():
            raise ValueError(
                f"backend name {name!r} is already taken; registered backends are "
                f"{self.names()}: give yours another name (--impl-name)"
            )
        self._runtime[name] = factory
        self._forget(name)

    def unregister(self, name: str) -> None:
        """Remove a backend registered with ``register``."""
        self._runtime.pop(name, None)
        self._forget(name)

    def _forget(self, name: str) -> None:
        for key in [key for key in self._loaded if key[0] == name]:
            del self._loaded[key]

    def names(self) -> list[str]:
        return sorted(self.factories())

    def loaded(self) -> list[Backend]:
        """Every backend ``load`` has built so far in this process."""
        return list(self._loaded.values())

    def installed(self, name: str) -> bool:
        need = REQUIRES.get(name) if name in self._builtin else None
        return need is None or importlib.util.find_spec(need) is not None

    def load(self, name: str, **options: Any) -> Backend:
        key = (name, tuple(sorted(options.items())))
        if key in self._loaded:
            return self._loaded[key]
        factories = self.factories()
        if name not in factories:
            raise BackendUnavailable(
                f"unknown backend {name!r}: registered backends are {self.names()}, "
                f"installed here: {available_backends()}"
            )
        try:
            factory = factories[name]
            backend = factory(**options)
            if not isinstance(backend, Backend):
                backend = backend(**options)  # an entry point may name the class itself
        except ImportError as err:
            raise BackendUnavailable(
                f"backend {name!r} cannot be loaded ({err}); installed here: {available_backends()}"
            ) from err
        except TypeError as err:
            if options:
                raise TypeError(
                    f"backend {name!r} does not take the options {sorted(options)}: {err}"
                ) from err
            raise
        _check_declarations(backend)
        self._loaded[key] = backend
        return backend


REGISTRY = Registry(BUILTIN)


def register_backend(name: str, factory: Callable[..., Backend], *, replace: bool = False) -> None:
    """Register ``factory`` under ``name`` beside the built-in backends, for this process."""
    REGISTRY.register(name, factory, replace=replace)


def unregister_backend(name: str) -> None:
    """Remove a backend registered with ``register_backend``."""
    REGISTRY.unregister(name)


def registered_backends() -> list[str]:
    """Every backend name known to the suite, installed or not."""
    return REGISTRY.names()


def available_backends(*, sharded: bool = True) -> list[str]:
    """The backends whose framework is installed here, in a stable order.

    ``sharded=False`` leaves out the context-parallel backends (those whose class declares
    the capability "sharded"): they start devices or worker processes of their own, so
    ``--backend all`` runs them only when named (SPEC §10.3, §14).
    """
    names = [name for name in registered_backends() if REGISTRY.installed(name)]
    if not sharded:
        factories = REGISTRY.factories()
        names = [n for n in names if "sharded" not in getattr(factories[n], "capabilities", ())]
    return names


def load_backend(name: str, **options: Any) -> Backend:
    """Return the backend called ``name``, loading its framework on first use.

    Without options it is the backend as users get it: its defaults are its fast, real
    configuration. Options are the backend's own (SPEC §10.4), e.g. the tile sizes of the
    blockwise backends; the conformance run passes each backend's ``conformance_options``.

    Raises:
      BackendUnavailable: ``name`` is unknown, or its framework cannot be imported. The
        message lists what is registered and what is installed; it is never a silent skip.
      TypeError: the backend does not take one of ``options``.
    """
    return REGISTRY.load(name, **options)


def _check_declarations(backend: Backend) -> None:
    unknown = set(backend.capabilities) - set(CAPABILITIES)
    if unknown:
        raise ValueError(
            f"backend {backend.name!r} declares unknown capabilities {sorted(unknown)}; "
            f"known: {sorted(CAPABILITIES)}"
        )
    bad = set(backend.dtypes) - set(DTYPES)
    if bad:
        raise ValueError(
            f"backend {backend.name!r} declares unknown dtypes {sorted(bad)}; known: {DTYPES}"
        )
