"""Packed documents through ``jax.nn.dot_product_attention``'s sequence lengths: the
adapter the ``jax.nn.dot_product_attention`` profile calls for ``attention_packed``
(SPEC §18).

JAX has no packed call. Its answer to documents of unequal length is the padded batch:
``query_seq_lengths`` and ``key_value_seq_lengths`` (B,) tell the function how many rows
and keys of each batch element are real, and it masks the rest. So this is how a JAX
user runs packed documents: document n becomes batch element n, its tokens copied to the
front of a row of the longest document's length and the rest filled with zeros; the
lengths are its T_n and S_n; the function's output rows are copied back to where the
document's queries lie. Within a document the positions start at 0, so the function's
causal mask (top-left) and ``local_window_size`` are the spec's per document (§18.1).

Nothing else is converted: the keywords are the function's own (``is_causal``,
``scale``, ``local_window_size``), the padded arrays keep q's dtype, and whatever the
function returns for a real row comes back as it is. Layout: the profile's, (T, H, D)
for q, (S, K, D) for k and v, as ``jax.nn`` takes them; the boundaries (N + 1,) are the
adapter's words, so it checks them itself with the checks every backend of the suite
makes (``conformance.impls.contract``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from conformance.impls import contract

_dot_product_attention = jax.jit(
    jax.nn.dot_product_attention, static_argnames=("is_causal", "scale", "local_window_size")
)


def attention_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **keywords):
    """out (T, H, E) for q (T, H, D), k (S, K, D), v (S, K, E) holding the documents
    cu_seqlens_q and cu_seqlens_k (N + 1,) delimit, as a padded batch of N."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        return jax.nn.dot_product_attention(q, k, v, **keywords)
    T, S = q.shape[0], k.shape[0]
    cu_q, cu_k = (
        np.asarray(bounds)
        for bounds in contract.check_boundaries(
            np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k), T, S
        )
    )
    lengths_q, lengths_k = np.diff(cu_q), np.diff(cu_k)  # (N,)
    padded_q = _pad(q, cu_q, lengths_q)  # (N, Tn, H, D)
    padded_k, padded_v = _pad(k, cu_k, lengths_k), _pad(v, cu_k, lengths_k)  # (N, Sn, K, D)
    out = _dot_product_attention(
        padded_q,
        padded_k,
        padded_v,
        query_seq_lengths=jnp.asarray(lengths_q, jnp.int32),
        key_value_seq_lengths=jnp.asarray(lengths_k, jnp.int32),
        **keywords,
    )  # (N, Tn, H, E)
    # Each packed query's row: its document's batch element, at its place in the document.
    doc = np.searchsorted(cu_q, np.arange(T), side="right") - 1  # (T,)
    return out[doc, np.arange(T) - cu_q[doc]]  # (T, H, E)


def _pad(x, cu, lengths):
    """(N, longest, ...) from packed x (total, ...): document n's tokens first in row n,
    zeros after them."""
    longest = int(lengths.max(initial=0))
    index = cu[:-1, None] + np.arange(longest)[None, :]  # (N, longest)
    real = np.arange(longest)[None, :] < lengths[:, None]  # (N, longest)
    rows = x[np.where(real, index, 0)]  # (N, longest, ...)
    return jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 1)), rows, 0).astype(x.dtype)
