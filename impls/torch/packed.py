"""Packed variable-length sequences in PyTorch (FlashAttention's varlen API, SPEC §18).

N documents lie one after another on the token axis; document n is queries
cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and its
rows are attention on that document alone: no query sees another document, and causality
and windows are counted inside each document (bottom-right puts document n's diagonal at
S_n - T_n).

Two ways here. ``attention_packed`` slices each document out and hands it to a core
page's ``attention`` (``naive.attention`` unless another is given, as the torch-module
backend gives ``module.attention``). ``attention_packed_sdpa`` gives SDPA the documents as
PyTorch's nested jagged tensors where SDPA takes them, and each document to
``sdpa.attention`` where it does not (see Notes).

Shape legend: H query heads · K key/value heads (H % K == 0) · G = H // K · T = Σ T_n
packed queries · S = Σ S_n packed keys · D q/k head dim · E v head dim · N documents.

    q (H, T, D)    k (K, S, D)    v (K, S, E)    out (H, T, E)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import contract
from . import naive, sdpa


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
    attend: Callable[..., torch.Tensor] = naive.attention,
) -> torch.Tensor:
    """Attention over packed variable-length sequences, one document at a time.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``naive.attention``,
        applied within each document.
      attend: the attention each document goes to: a core page's ``attention``.

    Returns:
      out: (H, T, E), same dtype as q.
    """
    # 0. Validate with the input contract every page shares: an error names the argument,
    # the expected shape and what was given.
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    call, cu_q, cu_k = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    H, E = call.H, call.E

    # 1. Each document alone: its queries against its own keys only, so nothing another
    # document holds (not even a NaN) is ever read (see Notes: packed documents).
    rows = [q.new_zeros((H, 0, E))]  # (H, 0, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        rows.append(attend(q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], **options))  # (H, T_n, E)
    return torch.cat(rows, dim=1)  # (H, T, E)


def attention_packed_sdpa(
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
    """Attention over packed variable-length sequences, through PyTorch's nested jagged
    tensors where SDPA takes them: arguments and result as ``attention_packed``'s, whose
    cu_seqlens are the ``offsets`` of ``torch.nested.nested_tensor_from_jagged``."""
    # 0. Validate with the input contract every page shares: an error names the argument,
    # the expected shape and what was given.
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    call, cu_q, cu_k = contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
    H, G, E = call.H, call.G, call.E
    N = len(cu_q) - 1
    jagged = not call.is_causal and call.window is None and call.softcap is None and N > 0

    # 1.-7. Without causality, a window or a softcap, SDPA itself takes the documents as
    # nested jagged tensors (N, H, j, D), one ragged length per document (see Notes: packed
    # documents). Its nested path has no GQA, so the key/value heads are repeated first,
    # as enable_gqa would.
    if jagged:
        offsets_q = torch.tensor(cu_q, dtype=torch.int64)  # (N + 1,)
        offsets_k = torch.tensor(cu_k, dtype=torch.int64)  # (N + 1,)
        k = k.repeat_interleave(G, dim=0)  # (H, S, D)
        v = v.repeat_interleave(G, dim=0)  # (H, S, E)
        nested = [
            torch.nested.nested_tensor_from_jagged(x.transpose(0, 1).contiguous(), offsets=o)
            for x, o in ((q, offsets_q), (k, offsets_k), (v, offsets_k))
        ]  # (N, j, H, ·) each
        q_n, k_n, v_n = (x.transpose(1, 2) for x in nested)  # (N, H, j, ·)
        with warnings.catch_warnings():
            # Raised from inside SDPA's nested path (torch 2.13), which builds a strided
            # nested tensor of its own; nothing the caller can change.
            warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
            out = F.scaled_dot_product_attention(q_n, k_n, v_n, scale=call.scale)  # (N, H, j, E)
        return out.transpose(1, 2).values().transpose(0, 1)  # (H, T, E)

    # Otherwise each document goes to ``sdpa.attention`` alone: SDPA's nested path refuses
    # is_causal, an attn_mask and GQA, and one dense call with a block-diagonal mask would
    # let one document's NaN reach the others through P·V.
    rows = [q.new_zeros((H, 0, E))]  # (H, 0, E)
    for n in range(N):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        if t0 == t1:
            continue  # no queries, no rows
        rows.append(sdpa.attention(q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], **options))  # (H, T_n, E)
    return torch.cat(rows, dim=1)  # (H, T, E)


# --- Notes -----------------------------------------------------------------------------------
#
# Packed documents. Packing N documents into one array saves the padding a batch of unequal
# lengths would need; the price is that every query must be kept away from the other
# documents' keys. ``attention_packed`` slices each document out and attends it alone, the
# literal meaning of SPEC §18; autograd differentiates through the slices and the
# concatenation. A block-diagonal mask would compute the same weights, but the product P·V
# would still multiply a weight of 0 by every other document's values, and 0 · NaN = NaN:
# one document's NaN would reach the rest.
#
# SDPA's nested jagged tensors (``attention_packed_sdpa``). SDPA takes packed documents as
# ``torch.nested.nested_tensor_from_jagged(values (T, H, D), offsets = cu_seqlens)``,
# transposed to (N, H, j, D). Measured with torch 2.13.0 on the CPU: it gives each
# document's attention (T_n != S_n, E != D, empty documents, rows of exactly 0 for S_n = 0,
# float64 to bfloat16, gradients by autograd), and a NaN in one document stays there. It
# refuses the rest: is_causal=True raises "RuntimeError: No viable backend for
# scaled_dot_product_attention was found" (its log: "Nested tensors for query / key are not
# supported when is_causal=True"), enable_gqa=True with K < H a RuntimeError from matmul
# ("batch dimensions must have the same sizes"), an attn_mask "ValueError: Masks are not
# yet supported!". So GQA is the heads repeated before the nested call (what enable_gqa
# means), and causality, windows and softcap go to ``sdpa.attention`` document by document:
# one dense call with a block-diagonal bool mask gives the right weights, but a NaN in one
# document's v made every row of the other documents NaN (measured, float64 and float32),
# since SDPA multiplies whole rows of P by V.
