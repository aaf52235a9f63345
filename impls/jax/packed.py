"""Packed variable-length documents (FlashAttention's varlen API, SPEC §18) on the core
page's steps.

Packing N documents into one array saves the padding a batch of unequal lengths would
need; the price is that every query must be kept away from the other documents' keys.
Document n is queries cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:
cu_seqlens_k[n + 1], and its rows are ``attention`` on that document alone: no query
sees another document, and causality and windows are counted inside each document.

Under ``jax.jit`` the boundaries are traced, so that one compiled program serves every
packing of the same T, S and N, and documents cannot be sliced out by their lengths. Each
token's document comes from the boundaries (searchsorted), and steps 1-7 run once per
document (a fori_loop over the N documents) on that document's tokens selected by
``where``, every other token 0. A block-diagonal mask alone would compute the same
weights, but the product P·V would still multiply a weight of 0 by every other
document's values, and 0 · NaN = NaN: one document's NaN would reach the rest (and
through dS·K and dSᵀ·Q, their gradients).

Shape legend: the core page's, unbatched: q (H, T, D), k (K, S, D), v (K, S, E), out
(H, T, E), with T = cu_seqlens_q[-1] and S = cu_seqlens_k[-1]; N documents.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import contract
from .attention import as_arrays, compiled


def attention_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Attention over packed variable-length sequences, each document alone.

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
    # 0. Validate with the input contract every page shares, eagerly, so the boundaries'
    # values are checked before they become tracers.
    q, k, v, cu_seqlens_q, cu_seqlens_k = as_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k)
    options = _options(is_causal, scale, causal_alignment, window, softcap)
    call, _, _ = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    return attend_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **_static(call))  # (H, T, E)


def attention_packed_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    d_out: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``attention_packed`` by ``jax.vjp``: (dq, dk, dv) shaped like q, k, v,
    for the loss L = Σ d_out · attention_packed(...), d_out (H, T, E) in q's dtype. The
    boundaries are integers, traced and not differentiated."""
    q, k, v, d_out = as_arrays(q, k, v, d_out)
    cu_seqlens_q, cu_seqlens_k = as_arrays(cu_seqlens_q, cu_seqlens_k)
    options = _options(is_causal, scale, causal_alignment, window, softcap)
    call, _, _ = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out=d_out, **options)
    return _pullback(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **_static(call))


def _options(is_causal, scale, causal_alignment, window, softcap) -> dict:
    return dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )


def _static(call: contract.Checked) -> dict:
    """The checked options as ``attend_packed`` takes them: the scale traced, the others
    static."""
    return dict(
        scale=call.scale,
        is_causal=call.is_causal,
        causal_alignment=call.causal_alignment,
        window=call.window,
        softcap=call.softcap,
    )


@functools.partial(jax.jit, static_argnames=("is_causal", "causal_alignment", "window", "softcap"))
def attend_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
) -> jax.Array:
    """The core page's steps 1-7, once per document, on the packed inputs; the boundaries
    are traced, so the program depends on T, S and N only."""
    H, T, _ = q.shape
    S, E = v.shape[1], v.shape[2]
    N = cu_seqlens_q.shape[0] - 1

    # Each token's document and its position within it, from the boundaries: token t
    # lies in the last document n with cu_seqlens[n] <= t (empty documents are skipped).
    doc_q = jnp.searchsorted(cu_seqlens_q, jnp.arange(T), side="right") - 1  # (T,)
    doc_k = jnp.searchsorted(cu_seqlens_k, jnp.arange(S), side="right") - 1  # (S,)
    pos_q = jnp.arange(T) - cu_seqlens_q[doc_q]  # (T,)
    pos_k = jnp.arange(S) - cu_seqlens_k[doc_k]  # (S,)

    # Query t's diagonal is key t of its document (top-left), or key t + S_n - T_n
    # (bottom-right: the document's last query lines up with its last key).
    lengths_q = jnp.diff(cu_seqlens_q)[doc_q]  # (T,)
    lengths_k = jnp.diff(cu_seqlens_k)[doc_q]  # (T,): the keys of query t's document
    offset = 0 if causal_alignment == "top_left" else lengths_k - lengths_q  # (T,)
    distance = pos_k[None, :] - (pos_q + offset)[:, None]  # (T, S)
    allowed = doc_q[:, None] == doc_k[None, :]  # (T, S)
    if is_causal:
        allowed = allowed & (distance <= 0)  # (T, S)
    if window is not None and window[0] is not None:
        allowed = allowed & (distance >= -window[0])  # (T, S)
    if window is not None and window[1] is not None:
        allowed = allowed & (distance <= window[1])  # (T, S)

    # 1.-7. Each document alone (the module docstring): its queries, keys and values
    # selected, every other token replaced by 0, so that nothing another document holds
    # (not even a NaN) reaches its rows or its gradients; its rows kept. The core page's
    # call, unbatched, with the document's visibility as its bool mask.
    call = contract.check(q, k, v, mask=allowed, softcap=softcap)
    call = dataclasses.replace(call, scale=None)  # the scale traced

    def document(n, out):
        rows, keys = doc_q == n, doc_k == n  # (T,), (S,)
        q_n = jnp.where(rows[None, :, None], q, 0.0)  # (H, T, D)
        k_n = jnp.where(keys[None, :, None], k, 0.0)  # (K, S, D)
        v_n = jnp.where(keys[None, :, None], v, 0.0)  # (K, S, E)
        mask_n = allowed & rows[:, None]  # (T, S)
        out_n = compiled(q_n, k_n, v_n, mask_n, None, None, None, scale, call=call)  # (H, T, E)
        return jnp.where(rows[None, :, None], out_n, out)  # (H, T, E)

    out = jnp.zeros((H, T, E), dtype=q.dtype)  # (H, T, E)
    return jax.lax.fori_loop(0, N, document, out)  # (H, T, E)


@functools.partial(jax.jit, static_argnames=("is_causal", "causal_alignment", "window", "softcap"))
def _pullback(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
    """jax.vjp of ``attend_packed`` in q, k and v, compiled once per shape and options."""

    def forward(q, k, v):
        return attend_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)

    _, pull = jax.vjp(forward, q, k, v)
    return pull(d_out)
