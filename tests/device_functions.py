"""Planted functions for the device tests (SPEC §13.20): each asserts that its inputs are on
the device it was told, so that a run that leaves them where they were fails."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

#: The device the JAX function must see, "cpu:1" by default: JAX's second host device.
JAX_DEVICE = os.environ.get("CONFORMANCE_TEST_DEVICE", "cpu:1")


def _expected_device():
    platform, _, index = JAX_DEVICE.partition(":")
    return jax.devices(platform)[int(index or 0)]


def _check(where: str, *arrays) -> None:
    want = _expected_device()
    for x in arrays:
        found = x.devices()
        assert found == {want}, f"{where}: an array on {sorted(map(str, found))}, not {want}"


def _forward(q, k, v, scale):
    scores = jnp.einsum("bhtd,bhsd->bhts", q, k) * scale  # (B, H, T, S)
    weights = jax.nn.softmax(scores, axis=-1)  # (B, H, T, S)
    return jnp.einsum("bhts,bhse->bhte", weights, v), weights  # (B, H, T, E)


@jax.custom_vjp
def _attention(q, k, v):
    return _forward(q, k, v, q.shape[-1] ** -0.5)[0]


def _attention_fwd(q, k, v):
    # custom_vjp calls this with the arrays themselves outside jax.jit: their devices show.
    _check("forward", q, k, v)
    out, weights = _forward(q, k, v, q.shape[-1] ** -0.5)
    return out, (q, k, v, weights)


def _attention_bwd(residuals, d_out):
    q, k, v, weights = residuals
    _check("backward", d_out, *residuals)
    scale = q.shape[-1] ** -0.5
    d_v = jnp.einsum("bhts,bhte->bhse", weights, d_out)  # (B, H, S, E)
    d_weights = jnp.einsum("bhte,bhse->bhts", d_out, v)  # (B, H, T, S)
    d_scores = weights * (d_weights - (d_weights * weights).sum(-1, keepdims=True))
    d_q = jnp.einsum("bhts,bhsd->bhtd", d_scores, k) * scale  # (B, H, T, D)
    d_k = jnp.einsum("bhts,bhtd->bhsd", d_scores, q) * scale  # (B, H, S, D)
    return d_q, d_k, d_v


_attention.defvjp(_attention_fwd, _attention_bwd)


def jax_on_device(q, k, v):
    """Attention (B, H, T, E) that fails unless q, k, v, and in the backward d_out, are on
    ``JAX_DEVICE``."""
    if not any(isinstance(x, jax.core.Tracer) for x in (q, k, v)):  # the forward alone
        _check("call", q, k, v)
    return _attention(q, k, v)


def quantized_on_device(q, k, v, *, q_scale, k_scale, v_scale, sm_scale=None):
    """A JAX quantized function with one descale array per tensor (SPEC §20.7) that asserts
    its codes and descales are on the device it was told, then attends in float32."""
    _check("quantized", q, k, v, q_scale, k_scale, v_scale)
    q, k, v = (x.astype(jnp.float32) * s for x, s in ((q, q_scale), (k, k_scale), (v, v_scale)))
    G = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, G, axis=1), jnp.repeat(v, G, axis=1)  # (B, H, S, D), (B, H, S, E)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return _forward(q, k, v, scale)[0]  # (B, H, T, E)
