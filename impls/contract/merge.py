"""The contract of ``merge_states`` (SPEC §22): two partial states of the same rows.

A partial state is (o, lse): o (..., E) the attention output over some of a row's keys,
lse (...) the natural log-sum-exp of their scores, one per row (o's shape without its
last axis). Both states describe the same rows, so o_a and o_b share one shape and one
floating dtype, and lse_a and lse_b share o's leading shape and a floating dtype of
their own (float32 beside 16-bit outputs: FlashAttention's convention).
"""

from __future__ import annotations

from typing import Any

from .numbers import dtype_name, is_floating


def check_merge(o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> None:
    """Refuse two states that cannot be merged, naming the argument, what was expected
    and what was given: ValueError for a shape, TypeError for a dtype."""
    for name, x in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} should be an array, got {type(x).__name__}")
        if not is_floating(dtype_name(x)):
            raise TypeError(f"{name} should be a floating array, got dtype {dtype_name(x)}")
    if len(o_a.shape) < 1:
        raise ValueError(f"o_a should have a last axis E, (..., E), got shape {tuple(o_a.shape)}")
    rows = tuple(o_a.shape)[:-1]
    if tuple(o_b.shape) != tuple(o_a.shape):
        raise ValueError(
            f"o_b shape should be o_a's {tuple(o_a.shape)}, the same rows, got {tuple(o_b.shape)}"
        )
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(x.shape) != rows:
            raise ValueError(
                f"{name} shape should be o's without its last axis, {rows}, got {tuple(x.shape)}"
            )
    if dtype_name(o_b) != dtype_name(o_a):
        raise TypeError(f"o_b dtype should be o_a's {dtype_name(o_a)}, got {dtype_name(o_b)}")
    if dtype_name(lse_b) != dtype_name(lse_a):
        raise TypeError(
            f"lse_b dtype should be lse_a's {dtype_name(lse_a)}, got {dtype_name(lse_b)}"
        )
