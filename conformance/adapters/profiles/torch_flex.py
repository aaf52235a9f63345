"""PyTorch's ``flex_attention`` as the spec's options: the adapter the ``torch.flex_attention``
profile calls.

``flex_attention`` has no mask, causal or window keyword: users express them as a
``score_mod`` (a function of one score and its indices b, h, q_idx, kv_idx, returning the
new score) and a ``block_mask`` (built by ``create_block_mask`` from a ``mask_mod``
returning True where a query may attend a key). This file writes them the way the
PyTorch documentation shows, one spec option at a time, and nothing else:

    softcap c         score_mod: c * tanh(score / c)       (first: SPEC §4.2's order)
    alibi_slopes m    score_mod: score - m[b, h] * |q_idx + S - T - kv_idx|   (§17.1)
    float mask m      score_mod: score + m[b, h, q_idx, kv_idx]
    bool mask m       mask_mod:  m[b, h, q_idx, kv_idx]
    is_causal         mask_mod:  kv_idx <= q_idx + offset  (offset 0, or S - T bottom-right)
    window (l, r)     mask_mod:  q_idx + offset - l <= kv_idx <= q_idx + offset + r
    chunk_size c      mask_mod:  (q_idx + offset) // c == kv_idx // c              (§16.1)

``attention_packed`` (SPEC §18) is PyTorch's document masking: the packed tokens are one
sequence (B = 1), each token's document is looked up from the cumulative lengths, and
the mask_mod allows a key only in the query's document, with causality and the window
on the positions inside the document (``q_idx - cu_seqlens_q[doc]``), as the
flex_attention examples write it (``generate_doc_mask_mod``).

``scale`` is flex_attention's own keyword and ``enable_gqa=True`` is always passed (as
with SDPA). Masks are expanded to (B, H, T, S) and slopes (H,) to (B, H) so the index
functions can read them; torch tensors in, a torch tensor out. It runs eagerly (no
``torch.compile``), as on a CPU without a compiler. ``causal_alignment``, ``window``,
``softcap``, ``chunk_size``, ``alibi_slopes`` and the cumulative lengths are this
adapter's words, not flex_attention's, so the adapter checks them itself (ValueError,
TypeError, with the checks every backend of the suite makes: ``conformance.impls.contract``);
q, k, v, the mask and ``scale`` go to flex_attention as given, and inputs that are not 4-D
are passed straight on, for flex_attention to judge.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from conformance.impls import contract


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """out (B, H, T, E) for q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), via flex_attention."""
    _check_options(causal_alignment, window, softcap, chunk_size)
    if q.dim() != 4 or k.dim() != 4:
        return flex_attention(q, k, v, scale=scale, enable_gqa=True)
    B, H, T, D = q.shape
    S = k.shape[-2]
    offset = S - T if causal_alignment == "bottom_right" else 0

    float_mask = None if mask is None or mask.dtype == torch.bool else mask.expand(B, H, T, S)
    bool_mask = None if mask is None or mask.dtype != torch.bool else mask.expand(B, H, T, S)
    slopes = None
    if alibi_slopes is not None:
        contract.check_alibi_slopes(alibi_slopes, q)
        # SPEC §17.1 computes the bias in the working precision: float32 for float16 and
        # bfloat16, else q's dtype (float32 slopes times a distance would round a float64
        # bias to float32).
        working = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        slopes = alibi_slopes.to(working).expand(B, H)  # (B, H)

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[b, h] * torch.abs(q_idx + S - T - kv_idx)
        if float_mask is not None:
            score = score + float_mask[b, h, q_idx, kv_idx]
        return score

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = kv_idx >= 0
        if bool_mask is not None:
            allowed = allowed & bool_mask[b, h, q_idx, kv_idx]
        return allowed & _positions_allowed(q_idx + offset, kv_idx, is_causal, window, chunk_size)

    masked = bool_mask is not None or is_causal or window is not None or chunk_size is not None
    block_mask = create_block_mask(mask_mod, B, H, T, S, device=q.device) if masked else None
    modded = softcap is not None or float_mask is not None or slopes is not None
    return flex_attention(
        q,
        k,
        v,
        score_mod=score_mod if modded else None,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
    )


def attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """out (H, T, E) for q (H, T, D), k (K, S, D), v (K, S, E) holding the documents that
    cu_seqlens_q and cu_seqlens_k (N + 1,) delimit, via flex_attention's document mask."""
    _check_options(causal_alignment, window, softcap, None)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return flex_attention(q, k, v, scale=scale, enable_gqa=True)
    H, T, D = q.shape
    S = k.shape[-2]
    cu_q, cu_k = contract.check_boundaries(_host(cu_seqlens_q), _host(cu_seqlens_k), T, S)
    # Each token's document, and where the document starts; bottom-right puts document
    # n's diagonal at S_n - T_n.
    doc_q = torch.as_tensor(np.searchsorted(cu_q, np.arange(T), side="right") - 1)  # (T,)
    doc_k = torch.as_tensor(np.searchsorted(cu_k, np.arange(S), side="right") - 1)  # (S,)
    start_q, start_k = torch.as_tensor(cu_q), torch.as_tensor(cu_k)  # (N + 1,)
    lengths_q, lengths_k = start_q.diff(), start_k.diff()  # (N,)
    offset = lengths_k - lengths_q if causal_alignment == "bottom_right" else 0 * lengths_q

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    def mask_mod(b, h, q_idx, kv_idx):
        n = doc_q[q_idx]
        position = q_idx - start_q[n] + offset[n]
        return (n == doc_k[kv_idx]) & _positions_allowed(
            position, kv_idx - start_k[doc_k[kv_idx]], is_causal, window, None
        )

    block_mask = create_block_mask(mask_mod, 1, 1, T, S, device=q.device) if T and S else None
    return flex_attention(
        q[None],
        k[None],
        v[None],
        score_mod=score_mod if softcap is not None else None,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
    )[0]


def _positions_allowed(position, kv_idx, is_causal, window, chunk_size):
    """The keys a query at ``position`` may attend by causality, the window and chunks
    (SPEC §3.4-§3.6, §16.1), as a mask_mod writes it."""
    allowed = kv_idx >= 0
    if is_causal:
        allowed = allowed & (kv_idx <= position)
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (kv_idx >= position - left)
        if right is not None:
            allowed = allowed & (kv_idx <= position + right)
    if chunk_size is not None:
        allowed = allowed & (
            torch.div(position, chunk_size, rounding_mode="floor") == kv_idx // chunk_size
        )
    return allowed


def _check_options(causal_alignment, window, softcap, chunk_size) -> None:
    """The adapter's own words, checked as every backend checks them (SPEC §8.1)."""
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment should be 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )
    contract.check_window(window)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap should be positive, got {softcap!r}")
    if chunk_size is not None:
        contract.check_chunk_size(chunk_size)


def _host(x):
    """The boundaries as NumPy: they decide which token is in which document."""
    return x.numpy() if isinstance(x, torch.Tensor) else x
