"""Attention over packed variable-length documents in NumPy (SPEC §18): FlashAttention's
varlen API, ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)``.

Packing N documents into one array saves the padding a batch of unequal lengths would
need: they lie one after another on the token axis, document n being queries
cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1]. The
price is that every query must be kept away from the other documents' keys, and
causality and windows are counted inside each document.

Here each document is sliced out and attended alone, the literal meaning of SPEC §18. A
block-diagonal mask would compute the same weights, but the product P·V would still
multiply a weight of 0 by every other document's values, and 0 · NaN = NaN: one
document's NaN would reach the rest. Two forms, each with its gradients:

- ``attention_packed`` (the numpy backend): the core page's ``attention`` on each
  document; ``attention_packed_backward``, ``backward.attention_backward`` on each.
- ``attention_packed_flash`` and ``attention_packed_flash_vjp`` (numpy-flash): the same
  loop over ``flash.py``'s walk, each document on tiles of its own.

The backward of each form stands next to its forward, not in ``backward.py``, because it
is the forward's loop again with the backward called in it: read together, the two say
that packing changes which keys a query sees and nothing else. ``backward.py`` stays the
derivation of one attention call.

Shape legend: the core page's (``attention.py``), unbatched: q (H, T, D), k (K, S, D),
v (K, S, E), T and S the packed lengths; N documents, and T_n, S_n those of document n.
"""

from __future__ import annotations

import numpy as np

from .. import contract
from . import flash
from .attention import attention
from .backward import attention_backward


def attention_packed(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """Attention over packed variable-length sequences (FlashAttention's varlen API).

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone: no query sees another document,
    and causality and windows are counted inside each document.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``attention``, applied
        within each document (bottom-right puts document n's diagonal at S_n - T_n).

    Returns:
      out: (H, T, E), same dtype as q.
    """
    # 0. Validate with the input contract all impls share (the contract package): an error names the
    # argument, the expected shape and what was given.
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    call, cu_q, cu_k = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    H, T, E = call.H, call.T, call.E

    # 1. Each document alone: its queries against its own keys only, so nothing another
    # document holds (not even a NaN) is ever read (see Notes: packed documents).
    out = np.zeros((H, T, E), dtype=q.dtype)  # (H, T, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        out[:, t0:t1] = attention(q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], **options)  # (H, T_n, E)
    return out


def attention_packed_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_packed`` with respect to q, k, v (SPEC §18.5).

    Args:
      q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale, causal_alignment, window,
        softcap: as for ``attention_packed``.
      d_out: ∂L/∂out, (H, T, E), same dtype as q.

    Returns:
      (dq, dk, dv): (H, T, D), (K, S, D), (K, S, E), same dtype as q. The boundaries are
      integers and get no gradient.
    """
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    _, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, d_out=d_out, **options
    )

    # 1'. Each document alone, as in the forward: a document's loss reaches only its own
    # queries, keys and values, and a key of a document with no query gets 0.
    d_q = np.zeros(q.shape, dtype=q.dtype)  # (H, T, D)
    d_k = np.zeros(k.shape, dtype=q.dtype)  # (K, S, D)
    d_v = np.zeros(v.shape, dtype=q.dtype)  # (K, S, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        d_q[:, t0:t1], d_k[:, s0:s1], d_v[:, s0:s1] = attention_backward(
            q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], d_out[:, t0:t1], **options
        )  # (H, T_n, D), (K, S_n, D), (K, S_n, E)
    return d_q, d_k, d_v


# --- Blockwise: each document on tiles of its own -------------------------------------------


def attention_packed_flash(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
    block_k: int = 512,
) -> np.ndarray:
    """Attention over packed variable-length sequences (FlashAttention's varlen API), one
    document at a time, each tiled on its own.

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone. Tiling each document on its own
    skips every key tile that shares no document with the query tile: the work is
    Σ T_n·S_n, not T·S, and nothing another document holds (not even a NaN) is read, as
    in FlashAttention's varlen kernels, whose thread blocks each work inside one sequence.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``attention``, applied
        within each document (bottom-right puts document n's diagonal at S_n - T_n).
      block_q, block_k: queries and keys per tile.

    Returns:
      out: (H, T, E), same dtype as q.
    """
    # 0. Validate with the input contract all impls share (the contract package).
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    tiles = {"block_q": block_q, "block_k": block_k}
    call, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, tiles=tiles, **options
    )
    H, T, E = call.H, call.T, call.E

    # 1. Each document alone, on tiles of its own (flash.py's fast path, numpy-flash's).
    out = np.zeros((H, T, E), dtype=q.dtype)  # (H, T, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        out[:, t0:t1] = flash.attention(
            q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], **options, **tiles, fast=True
        )  # (H, T_n, E)
    return out


def attention_packed_flash_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
    block_k: int = 512,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_packed``: (dq, dk, dv) shaped like q, k, v, each document's
    from the blockwise backward on its own tiles; d_out (H, T, E) in q's dtype."""
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    tiles = {"block_q": block_q, "block_k": block_k}
    _, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, tiles=tiles, d_out=d_out, **options
    )

    # 1'. Each document alone: its loss reaches only its own queries, keys and values.
    d_q = np.zeros(q.shape, dtype=q.dtype)  # (H, T, D)
    d_k = np.zeros(k.shape, dtype=q.dtype)  # (K, S, D)
    d_v = np.zeros(v.shape, dtype=q.dtype)  # (K, S, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        d_q[:, t0:t1], d_k[:, s0:s1], d_v[:, s0:s1] = flash.attention_vjp(
            q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], d_out[:, t0:t1], **options, **tiles
        )  # (H, T_n, D), (K, S_n, D), (K, S_n, E)
    return d_q, d_k, d_v
