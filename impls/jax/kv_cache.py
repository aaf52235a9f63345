"""A KV cache for decoding, on the core page's ``attention``.

Decoding feeds a few new tokens at a time. Their queries must see every cached key and,
among themselves, only earlier ones: that is causal attention aligned bottom-right,
because the new queries are the *last* T of the S positions (the core page's
``causal_alignment``). Shape legend: the core page's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .attention import attention


class KVCache:
    """Keys and values of the tokens decoded so far, for one sequence batch.

    Each call appends the new tokens' keys and values, then attends their queries:

        cache = KVCache()
        for q_t, k_t, v_t in chunks:            # (B, H, T, D), (B, K, T, D), (B, K, T, E)
            out_t = cache.attend(q_t, k_t, v_t)  # (B, H, T, E)
    """

    def __init__(self) -> None:
        self.k: jax.Array | None = None  # (B, K, S, D)
        self.v: jax.Array | None = None  # (B, K, S, E)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, **options) -> jax.Array:
        """Append k, v to the cache, then attend the new queries to everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = jnp.concatenate([self.k, k], axis=-2)  # (B, K, S, D)
            self.v = jnp.concatenate([self.v, v], axis=-2)  # (B, K, S, E)
        return attention(
            q, self.k, self.v, is_causal=True, causal_alignment="bottom_right", **options
        )  # (B, H, T, E)
