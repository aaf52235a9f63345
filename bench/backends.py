"""The backends the benchmark times: how to hand each one the inputs and make one call.

Every backend is a ``make(q, k, v, causal, blocks)`` that converts the NumPy inputs to its
framework once (outside the timing) and returns a no-argument function making one call
and waiting for its result (``block_until_ready`` for JAX). Frameworks are imported only
inside ``make``, so a child process measuring one backend's memory loads only its own.

Letters as in the impls: q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), out (B, H, T, E).
``jax.nn.dot_product_attention`` is sequence-first, (B, T, N, H) in its letters.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Call = Callable[[], object]


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # the module that must be importable for the backend to exist
    make: Callable[..., Call]
    # Working memory per (b, h, t, s) score, in bytes: the naive ones hold several float32
    # (B, H, T, S) arrays at once (scores, masked scores, exp, weights, the bool mask).
    bytes_per_score: int
    note: str = ""

    def installed(self) -> str | None:
        """None if the backend can run, else why not."""
        for mod in (self.module.split(".")[0], self.module):
            try:
                found = importlib.util.find_spec(mod) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                return f"not installed: no module {mod}"
        return None

    def memory_estimate(self, B: int, H: int, T: int, S: int, D: int) -> int:
        """Bytes beyond the inputs: the T × S temporaries plus the output."""
        return B * H * T * S * self.bytes_per_score + B * H * T * D * 4


def _numpy(module: str, flash: bool) -> Callable[..., Call]:
    def make(q, k, v, causal: bool, blocks: dict) -> Call:
        mod = importlib.import_module(module)
        kw = blocks if flash else {}
        return lambda: mod.attention(q, k, v, is_causal=causal, **kw)

    return make


def _jax(module: str, flash: bool) -> Callable[..., Call]:
    def make(q, k, v, causal: bool, blocks: dict) -> Call:
        import jax.numpy as jnp

        mod = importlib.import_module(module)
        qj, kj, vj = (jnp.asarray(x).block_until_ready() for x in (q, k, v))
        kw = blocks if flash else {}
        return lambda: mod.attention(qj, kj, vj, is_causal=causal, **kw).block_until_ready()

    return make


def _jax_nn(q, k, v, causal: bool, blocks: dict) -> Call:
    import jax
    import jax.numpy as jnp

    # jax.nn wants (B, T, N, H): transposed once here, outside the timing.
    qj, kj, vj = (jnp.asarray(x.transpose(0, 2, 1, 3)).block_until_ready() for x in (q, k, v))
    f = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal))
    return lambda: f(qj, kj, vj).block_until_ready()


def _torch(module: str, function: str) -> Callable[..., Call]:
    def make(q, k, v, causal: bool, blocks: dict) -> Call:
        import torch

        fn = getattr(importlib.import_module(module), function)
        qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))

        def call():
            with torch.inference_mode():
                return fn(qt, kt, vt, is_causal=causal)

        return call

    return make


def _torch_f(q, k, v, causal: bool, blocks: dict) -> Call:
    import torch
    import torch.nn.functional as F

    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))

    def call():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return call


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend(
            "numpy",
            "conformance.impls.numpy_attention",
            _numpy("conformance.impls.numpy_attention", False),
            20,
        ),
        Backend(
            "numpy-flash",
            "conformance.impls.numpy_flash",
            _numpy("conformance.impls.numpy_flash", True),
            0,
        ),
        Backend(
            "jax",
            "conformance.impls.jax_attention",
            _jax("conformance.impls.jax_attention", False),
            12,
        ),
        Backend(
            "jax-flash", "conformance.impls.jax_flash", _jax("conformance.impls.jax_flash", True), 0
        ),
        Backend(
            "torch-naive",
            "conformance.impls.torch_naive",
            _torch("conformance.impls.torch_naive", "scaled_dot_product_attention"),
            16,
        ),
        Backend(
            "torch-module",
            "conformance.impls.torch_module",
            _torch("conformance.impls.torch_module", "attention"),
            16,
            note="the module's attention core",
        ),
        Backend(
            "torch-sdpa",
            "conformance.impls.torch_sdpa",
            _torch("conformance.impls.torch_sdpa", "attention"),
            0,
        ),
        Backend(
            "F.sdpa",
            "torch",
            _torch_f,
            0,
            note="anchor: torch.nn.functional.scaled_dot_product_attention, direct",
        ),
        Backend(
            "jax.nn.dpa",
            "jax",
            _jax_nn,
            12,
            note="anchor: jax.nn.dot_product_attention, direct, jitted (XLA path on CPU)",
        ),
    ]
}


def inputs(B: int, H: int, T: int, D: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """q, k, v: (B, H, T, D) float32 each, standard normal."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, T, D), dtype=np.float32) for _ in range(3))


def flops(B: int, H: int, T: int, D: int, causal: bool) -> float:
    """Nominal FLOPs: 4·B·H·D per (query, key) pair the mask lets through (T = S)."""
    pairs = T * (T + 1) / 2 if causal else T * T
    return 4.0 * B * H * D * pairs
