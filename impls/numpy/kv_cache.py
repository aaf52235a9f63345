"""A KV cache for decoding, on top of the core page's ``attention``.

Decoding feeds a few new tokens at a time. Their queries must see every cached key and,
among themselves, only earlier ones: that is causal attention aligned bottom-right,
because the new queries are the *last* T of the S positions (SPEC §6.11).

Shape legend: the core page's (``attention.py``); S grows by T with every call.
"""

from __future__ import annotations

import numpy as np

from .attention import attention


class KVCache:
    """Keys and values of the tokens decoded so far, for one sequence batch.

    Fed one chunk of new tokens at a time, it returns their rows of the full causal
    attention:

        cache = KVCache()
        for q_t, k_t, v_t in chunks:            # (B, H, T, D), (B, K, T, D), (B, K, T, E)
            out_t = cache.attend(q_t, k_t, v_t)  # (B, H, T, E)
    """

    def __init__(self) -> None:
        self.k: np.ndarray | None = None  # (B, K, S, D)
        self.v: np.ndarray | None = None  # (B, K, S, E)

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, **options) -> np.ndarray:
        """Append k, v to the cache, then attend the new queries to everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = np.concatenate([self.k, k], axis=-2)  # (B, K, S, D)
            self.v = np.concatenate([self.v, v], axis=-2)  # (B, K, S, E)
        return attention(
            q,
            self.k,
            self.v,
            is_causal=True,
            causal_alignment="bottom_right",
            **options,
        )  # (B, H, T, E)
