"""What the benchmark times: the suite's backends, through ``load_backend``, and two anchors.

A backend is timed as users get it: ``conformance.load_backend(name)`` (its default, fast
configuration; ``--block-q``/``--block-k`` become ``load_backend`` options), then
``backend.prepare(q, k, v, is_causal=...)``, which converts the NumPy inputs to the
framework once, outside the timing, and returns a call that waits for its result.

The anchors are the frameworks' own functions called directly, with no conformance layer
around them, so that a backend's time can be read against what its framework offers:

    anchor:F.sdpa       torch.nn.functional.scaled_dot_product_attention
    anchor:jax.nn.dpa   jax.nn.dot_product_attention, jitted (the XLA path on a CPU)

Frameworks are imported only inside ``make_call``, so a worker process measuring one
backend's memory loads only its own.

Letters as in the impls: q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), out (B, H, T, E).
``jax.nn.dot_product_attention`` is sequence-first, (B, T, N, H) in its letters.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import numpy as np

import conformance

Call = Callable[[], object]


def _torch_f(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> Call:
    import torch
    import torch.nn.functional as F

    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))

    def call():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return call


def _jax_nn(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> Call:
    import jax
    import jax.numpy as jnp

    # jax.nn wants (B, T, N, H): transposed once here, outside the timing.
    qj, kj, vj = (jnp.asarray(x.transpose(0, 2, 1, 3)).block_until_ready() for x in (q, k, v))
    f = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal))
    return lambda: f(qj, kj, vj).block_until_ready()


#: name -> (make, module it needs, what it is)
ANCHORS: dict[str, tuple[Callable[..., Call], str, str]] = {
    "anchor:F.sdpa": (
        _torch_f,
        "torch",
        "anchor: torch.nn.functional.scaled_dot_product_attention, called directly",
    ),
    "anchor:jax.nn.dpa": (
        _jax_nn,
        "jax",
        "anchor: jax.nn.dot_product_attention, called directly, jitted (XLA path on CPU)",
    ),
}

#: Working memory per (b, h, t, s) score, in bytes, of the backends that build the (T, S)
#: matrix: they hold several float32 (B, H, T, S) arrays at once (scores, masked scores,
#: exp, weights, the bool mask). The blockwise ones and SDPA hold none.
BYTES_PER_SCORE = {
    "numpy": 20,
    "jax": 12,
    "torch-naive": 16,
    "torch-module": 16,
    "anchor:jax.nn.dpa": 12,
}

NOTES = {
    "torch-module": "the module's attention core",
    **{name: note for name, (_, _, note) in ANCHORS.items()},
}


def names() -> list[str]:
    """Every name the benchmark can time: the suite's registered backends, then the anchors."""
    return conformance.registered_backends() + list(ANCHORS)


def default_names() -> list[str]:
    """The installed backends, then the anchors (the anchors only where installed)."""
    singles = conformance.available_backends(sharded=False)
    return singles + [n for n in ANCHORS if installed(n) is None]


def installed(name: str) -> str | None:
    """None if ``name`` can run here, else why not."""
    if name in ANCHORS:
        module = ANCHORS[name][1]
        return None if importlib.util.find_spec(module) else f"not installed: no module {module}"
    if name not in conformance.available_backends():
        return f"not installed: {name} is registered but its framework is not importable"
    return None


def make_call(
    name: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, options: dict
) -> Call:
    """A zero-argument call of ``name`` on q, k, v that returns once the result exists.

    ``options`` (the tile sizes) go to the backends that take them: those whose
    conformance run sets them too (``conformance_options``); the others ignore them.
    """
    if name in ANCHORS:
        return ANCHORS[name][0](q, k, v, causal)
    backend = conformance.load_backend(name)
    own = {key: val for key, val in options.items() if key in backend.conformance_options}
    if own:
        backend = conformance.load_backend(name, **own)
    return backend.prepare(q, k, v, is_causal=causal)


def make_vjp_call(
    name: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, options: dict
) -> Call:
    """A zero-argument call of ``name``'s backward pass, forward and backward together:
    ``load_backend(name).prepare_vjp(q, k, v, d_out, is_causal=...)``, which converts the
    inputs once, outside the timing (as ``prepare`` does for the forward: a framework's
    copy of the inputs is not the backward's memory), and returns once every gradient
    exists.

    Raises ValueError for an anchor or a backend that does not declare "grad".
    """
    if name in ANCHORS:
        raise ValueError(f"{name} is an anchor: anchors time the forward pass only")
    backend = conformance.load_backend(name)
    if "grad" not in backend.capabilities:
        raise ValueError(f"{name} does not declare 'grad': it has no backward pass")
    own = {key: val for key, val in options.items() if key in backend.conformance_options}
    if own:
        backend = conformance.load_backend(name, **own)
    d_out = np.random.default_rng(1).standard_normal(q.shape, dtype=np.float32)
    return backend.prepare_vjp(q, k, v, d_out, is_causal=causal)


def backward_reason(name: str) -> str | None:
    """Why ``name`` has no backward row (None if it has one), without loading it."""
    if name in ANCHORS:
        return "anchors time the forward pass only"
    factory = conformance.backends.REGISTRY.factories().get(name)
    if "grad" not in getattr(factory, "capabilities", ()):
        return "does not declare 'grad' (no backward pass)"
    return None


def memory_estimate(
    name: str, B: int, H: int, T: int, S: int, D: int, backward: bool = False
) -> int:
    """Bytes beyond the inputs: the T × S temporaries plus the output (the backward's
    naive runs hold about twice the forward's T × S arrays)."""
    per_score = BYTES_PER_SCORE.get(name, 0) * (2 if backward else 1)
    return B * H * T * S * per_score + B * H * T * D * 4 * (3 if backward else 1)


def inputs(B: int, H: int, T: int, D: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """q, k, v: (B, H, T, D) float32 each, standard normal."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, T, D), dtype=np.float32) for _ in range(3))


def flops(B: int, H: int, T: int, D: int, causal: bool, backward: bool = False) -> float:
    """Nominal FLOPs: 4·B·H·D per (query, key) pair the mask lets through (T = S); with
    ``backward``, forward and backward together, counted as FlashAttention's benchmark
    counts them: the backward 2.5 times the forward (its five products against the
    forward's two), 3.5 times the forward in all."""
    pairs = T * (T + 1) / 2 if causal else T * T
    return 4.0 * B * H * D * pairs * (3.5 if backward else 1.0)
