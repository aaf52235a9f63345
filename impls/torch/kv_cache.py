"""A KV cache for decoding, in PyTorch: each step's queries attend to every key so far.

Decoding feeds a few new tokens at a time. Their queries must see every cached key and,
among themselves, only earlier ones: that is causal attention aligned bottom-right (SPEC
§6.11), because the new queries are the *last* T of the S positions. The attention is
``naive.attention``.

Shape legend: B batch · H query heads · K key/value heads · T new tokens · S tokens so far
(the cache's length after this step) · D q/k head dim · E v head dim.
"""

from __future__ import annotations

import torch

from .naive import attention


class KVCache:
    """Keys and values of the tokens decoded so far, for one sequence batch.

    cache = KVCache()
    for q_t, k_t, v_t in chunks:            # (B, H, T, D), (B, K, T, D), (B, K, T, E)
        out_t = cache.attend(q_t, k_t, v_t)  # (B, H, T, E)
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, K, S, D)
        self.v: torch.Tensor | None = None  # (B, K, S, E)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        """Append k, v to the cache, then attend the new queries to everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=-2)  # (B, K, S, D)
            self.v = torch.cat([self.v, v], dim=-2)  # (B, K, S, E)
        return attention(
            q,
            self.k,
            self.v,
            is_causal=True,
            causal_alignment="bottom_right",
            **options,
        )  # (B, H, T, E)
