"""PyTorch's ``flex_attention`` as the spec's options: the adapter the ``torch.flex_attention``
profile calls.

``flex_attention`` has no mask, causal or window keyword: users express them as a
``score_mod`` (a function of one score and its indices b, h, q_idx, kv_idx, returning the
new score) and a ``block_mask`` (built by ``create_block_mask`` from a ``mask_mod``
returning True where a query may attend a key). This file writes them the way the
PyTorch documentation shows, one spec option at a time, and nothing else:

    softcap c         score_mod: c * tanh(score / c)       (first: SPEC §4.2's order)
    float mask m      score_mod: score + m[b, h, q_idx, kv_idx]
    bool mask m       mask_mod:  m[b, h, q_idx, kv_idx]
    is_causal         mask_mod:  kv_idx <= q_idx + offset  (offset 0, or S - T bottom-right)
    window (l, r)     mask_mod:  q_idx + offset - l <= kv_idx <= q_idx + offset + r

``scale`` is flex_attention's own keyword and ``enable_gqa=True`` is always passed (as
with SDPA). Masks are expanded to (B, H, T, S) so the index functions can read them; torch
tensors in, a torch tensor out. It runs eagerly (no ``torch.compile``), as on a CPU
without a compiler. ``causal_alignment``, ``window`` and ``softcap`` are this adapter's
words, not flex_attention's, so the adapter checks their values itself (ValueError); q,
k, v, the mask and ``scale`` go to flex_attention as given, and inputs that are not 4-D
are passed straight on, for flex_attention to judge.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


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
) -> torch.Tensor:
    """out (B, H, T, E) for q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), via flex_attention."""
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment should be 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )
    if window is not None and not (
        isinstance(window, tuple)
        and len(window) == 2
        and all(w is None or (isinstance(w, int) and w >= 0) for w in window)
    ):
        raise ValueError(f"window should be (left, right) of ints >= 0 or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap should be positive, got {softcap!r}")
    if q.dim() != 4 or k.dim() != 4:
        return flex_attention(q, k, v, scale=scale, enable_gqa=True)
    B, H, T, D = q.shape
    S = k.shape[-2]
    offset = S - T if causal_alignment == "bottom_right" else 0

    float_mask = None if mask is None or mask.dtype == torch.bool else mask.expand(B, H, T, S)
    bool_mask = None if mask is None or mask.dtype != torch.bool else mask.expand(B, H, T, S)

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if float_mask is not None:
            score = score + float_mask[b, h, q_idx, kv_idx]
        return score

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = kv_idx >= 0
        if bool_mask is not None:
            allowed = allowed & bool_mask[b, h, q_idx, kv_idx]
        if is_causal:
            allowed = allowed & (kv_idx <= q_idx + offset)
        if window is not None:
            left, right = window
            if left is not None:
                allowed = allowed & (kv_idx >= q_idx + offset - left)
            if right is not None:
                allowed = allowed & (kv_idx <= q_idx + offset + right)
        return allowed

    masked = bool_mask is not None or is_causal or window is not None
    block_mask = create_block_mask(mask_mod, B, H, T, S, device=q.device) if masked else None
    modded = softcap is not None or float_mask is not None
    return flex_attention(
        q,
        k,
        v,
        score_mod=score_mod if modded else None,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
    )
