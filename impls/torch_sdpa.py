"""Our attention contract mapped onto PyTorch's fused ``F.scaled_dot_product_attention``.

    out = softmax(mask(softcap(scale · q kᵀ))) v

Step by step, for one query row t:

    score[s]  = scale · Σ_d q[t, d] · k[s, d]          scale defaults to 1/√D
    score[s]  = c · tanh(score[s] / c)                  only with softcap=c
    score[s]  = score[s] + mask[t, s]                   a float mask is added;
    score[s]  = -inf where the key s is blocked         a bool mask, causal or window blocks
    w[s]      = exp(score[s] - max) / Σ exp(score - max)
    out[t, e] = Σ_s w[s] · v[s, e]

Why 1/√D: if the entries of q and k have unit variance, q·k sums D such products and has
variance D; dividing by √D keeps the scores near unit variance whatever the head size, so
the softmax neither saturates (one-hot weights, vanishing gradients) nor flattens.

Shape legend (heads-first, as in PyTorch; PyTorch's own docs call T "L" and E "Ev"):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       C model width (module only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores),
          broadcastable to (B, H, T, S)

Unbatched inputs q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, softcapping (through ``flex_attention``, forward only on the CPU), grouped-query
and multi-query attention (K < H), dropout on the weights (seeded by ``torch.manual_seed``),
float64, float32, float16 and bfloat16. A query row with no key left to attend returns
exactly 0.

What this adapter hands to SDPA, and what it builds itself:

    our option                      SDPA (torch 2.13)
    ------------------------------  ------------------------------------------------------
    scale                           scale=, passed through (default 1/√D, as SDPA's)
    mask, bool                      attn_mask=, bool (True = may attend), as given
    mask, float                     attn_mask=, float, cast to the compute dtype (float32
                                    for float16/bfloat16 q, which SDPA accepts), so it is
                                    added at the precision the reference adds it
    is_causal, top_left, no mask    is_causal=True
      and no window
    is_causal otherwise             built here: SDPA's is_causal is top-left only, and its
      (bottom_right with T != S,    math backend refuses is_causal with an attn_mask
      with a mask or a window)      ("Explicit attn_mask should not be set when
                                    is_causal=True"), while its CPU flash backend accepts
                                    the pair and ANDs them: the outcome would depend on the
                                    backend chosen. The band is ANDed into a bool mask, or
                                    written as -inf into a float mask.
    window                          built here the same way; SDPA has no window
    K < H (GQA, MQA)                enable_gqa=True (repeat_interleave semantics)
    dropout_p                       dropout_p=, passed through; the keep mask comes from
                                    PyTorch's global generator (``torch.manual_seed``)
    softcap                         SDPA has none: the call goes to
                                    ``torch.nn.attention.flex_attention`` in eager mode,
                                    with a score_mod that softcaps, adds the float mask
                                    and blocks with -inf (scale, GQA passed through).
                                    Eager flex runs on the CPU but has no backward there
                                    and no dropout: softcap with inputs that need
                                    gradients, or with dropout_p > 0, raises
                                    NotImplementedError.
    unbatched (H, T, D)             a batch axis of 1 added here, removed after

SDPA's behaviour on the CPU, observed with torch 2.13.0 (and relied on here):

- A row whose keys are all blocked gives exactly 0, with a bool mask and with a float
  mask whose row is all -inf, in every dtype, on both the math and the CPU flash backend,
  and its gradients are 0, not NaN (the math backend uses ``_safe_softmax``). So the
  adapter needs no fix-up for empty rows; eager flex_attention also uses
  ``_safe_softmax`` and gives 0.
- float16 and bfloat16: the math backend (taken with dropout, GQA or E != D) computes in
  float32 and rounds once; the CPU flash backend (taken otherwise) accumulates in float32
  but is not bit-identical to a single rounding (about 1 ulp of float16/bfloat16 apart).
  Eager flex_attention scores in float32 but rounds the weights to q's dtype before
  multiplying v.
- is_causal=True with T != S is aligned top-left (s <= t): with T > S nothing is empty,
  and bottom-right alignment is not available.
- Dropout (math backend only: the CPU flash backend takes none) draws
  ``bernoulli_(1 - p)`` over the (B, H, T, S) weights in the compute dtype and multiplies
  by the mask divided by 1 - p (``at::dropout``), so ``torch_naive`` with the global
  generator, and ``torch_module`` with an ``nn.Dropout``, drop the same positions after
  the same ``torch.manual_seed``.

Gradients come from SDPA's own backward through autograd, including the gradient of a
float ``attn_mask`` (0 on -inf entries, and 0 for fully masked rows, not NaN). Softcap
has none on the CPU: flex_attention raises NotImplementedError for inputs that require
grad, so the conformance backend does not declare ``grad_softcap``.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

ALIGNMENTS = ("top_left", "bottom_right")


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
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention through ``F.scaled_dot_product_attention``.

    Args:
      q: queries, (B, H, T, D) or unbatched (H, T, D).
      k: keys, (B, K, S, D) or (K, S, D); K must divide H.
      v: values, (B, K, S, E) or (K, S, E).
      mask: bool (True = may attend) or floating (added to the scores, -inf blocks),
        broadcastable to (B, H, T, S).
      is_causal: query t attends only keys s on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      causal_alignment: where the diagonal sits when T != S. "top_left": s <= t.
        "bottom_right": s <= t + S - T (the last query sees the last key, as in a KV cache).
        Also places the window's diagonal.
      window: (left, right): query t attends keys in [t' - left, t' + right] where t' is
        its aligned diagonal; None on a side is unbounded.
      softcap: scores become softcap · tanh(scores / softcap) before masking (through
        flex_attention; not with dropout_p > 0, nor with gradients on the CPU).
      dropout_p: probability of zeroing each attention weight; the mask is drawn from
        PyTorch's global generator.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate: every problem is reported with the argument's name, the expected shape
    # in letters and numbers, and what was given.
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    _check_inputs(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    mask = _check_mask(mask, (B, H, T, S), unbatched)
    scale = _check_options(D, scale, is_causal, causal_alignment, window, softcap, dropout_p)

    # A float mask is added at the precision the scores are computed in: float32 for
    # float16 and bfloat16 q (SDPA accepts a float32 mask for them), q's dtype otherwise.
    work = torch.float64 if q.dtype == torch.float64 else torch.float32

    # 1.-3. Scores, scale and softcap happen inside SDPA (or flex_attention, for softcap).

    # 4. Mask: a float mask is added; a bool mask, the causal triangle and the window
    # decide which keys each query may see at all.
    sdpa_causal = (
        is_causal
        and mask is None
        and window is None
        and softcap is None
        and (causal_alignment == "top_left" or T == S)
    )
    allowed, additive = None, None
    if mask is not None and mask.dtype == torch.bool:
        allowed = mask  # (B|1, H|1, T, S)
    elif mask is not None:
        additive = mask.to(work)  # (B|1, H|1, T, S)
    if (is_causal and not sdpa_causal) or window is not None:
        band = _band(T, S, is_causal, causal_alignment, window, q.device)
        allowed = band if allowed is None else allowed & band  # (B|1, H|1, T, S)

    if softcap is not None:
        out = _flex_attention(q, k, v, allowed, additive, scale, softcap, dropout_p)
        return out[0] if unbatched else out

    # A float mask carries the blocked keys as -inf. SDPA on the CPU turns a row of -inf
    # into weights of exactly 0 (checked above for torch 2.13), so no fix-up is needed.
    attn_mask = allowed
    if additive is not None and allowed is not None:
        attn_mask = torch.where(allowed, additive, -math.inf)  # (B|1, H|1, T, S)
    elif additive is not None:
        attn_mask = additive  # (B|1, H|1, T, S)

    # 5.-7. Softmax, dropout and the weighted sum: SDPA, with K < H through enable_gqa.
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=sdpa_causal,
        scale=scale,
        enable_gqa=K != H,
    )  # (B, H, T, E)
    return out[0] if unbatched else out


def _flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    additive: torch.Tensor | None,
    scale: float,
    softcap: float,
    dropout_p: float,
) -> torch.Tensor:
    """Softcapped attention through flex_attention's score_mod: (B, H, T, E)."""
    from torch.nn.attention.flex_attention import flex_attention

    if dropout_p > 0:
        raise NotImplementedError(
            "softcap: SDPA has no softcap and flex_attention, which softcaps here, has no "
            f"dropout; softcap with dropout_p > 0 is not supported, got dropout_p={dropout_p!r}"
        )
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if needs_grad and q.device.type == "cpu":
        raise NotImplementedError(
            "softcap: SDPA has no softcap and flex_attention, which softcaps here, has no "
            "backward on the CPU; call under torch.no_grad() or on another device"
        )
    if not needs_grad:
        # flex_attention refuses CPU inputs that require grad even under no_grad.
        q, k, v = q.detach(), k.detach(), v.detach()
    B, H, T, _ = q.shape
    K, S = k.shape[1], k.shape[2]
    if allowed is not None:
        allowed = allowed.expand(B, H, T, S)  # (B, H, T, S)
    if additive is not None:
        additive = additive.expand(B, H, T, S)  # (B, H, T, S)

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        t: torch.Tensor,
        s: torch.Tensor,
    ) -> torch.Tensor:
        # flex_attention has already applied step 2 (the scale) to the score.
        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        score = softcap * torch.tanh(score / softcap)
        # 4. Mask: the float mask is added, then blocked keys get -inf.
        if additive is not None:
            score = score + additive[b, h, t, s]
        if allowed is not None:
            score = torch.where(allowed[b, h, t, s], score, -math.inf)
        return score

    with warnings.catch_warnings():
        # Eager (uncompiled) flex_attention is what we want here: a reference, not speed.
        warnings.filterwarnings("ignore", message="flex_attention called without")
        return flex_attention(
            q, k, v, score_mod=score_mod, scale=scale, enable_gqa=K != H
        )  # (B, H, T, E)


def _band(
    T: int,
    S: int,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    device: torch.device,
) -> torch.Tensor:
    """Which keys each query may see under causality and the window: (1, 1, T, S) bool."""
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if causal_alignment == "top_left" else S - T
    t = torch.arange(T, device=device)[:, None]  # (T, 1)
    s = torch.arange(S, device=device)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = torch.ones((T, S), dtype=torch.bool, device=device)  # (T, S)
    if is_causal:
        allowed &= distance <= 0
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    return allowed[None, None]  # (1, 1, T, S)


def _dtype_name(dtype: torch.dtype) -> str:
    # "float16", not "torch.float16": messages read the same as the NumPy reference's.
    return str(dtype).removeprefix("torch.")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.ndim not in (3, 4):
        raise ValueError(
            f"q should have rank 4 (B, H, T, D) or 3 (H, T, D), got rank {q.ndim} "
            f"with shape {tuple(q.shape)}"
        )
    letters = "(B, K, S, D)" if q.ndim == 4 else "(K, S, D)"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(
                f"{name} should have rank {q.ndim} {letters} like q, got rank {x.ndim} "
                f"with shape {tuple(x.shape)}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} should be a floating tensor, got dtype {_dtype_name(x.dtype)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name} dtype should be {_dtype_name(q.dtype)} like q, got {_dtype_name(x.dtype)}"
            )
    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, k, v))
    B, H, _, D = q4.shape
    _, K, S, _ = k4.shape
    E = v4.shape[-1]
    batch = "B, " if q.ndim == 4 else ""
    drop = 0 if q.ndim == 4 else 1
    if K == 0 or H % K != 0:
        raise ValueError(
            f"k heads K={K} should divide q heads H={H} (grouped-query attention shares "
            f"each key/value head among H // K query heads), got k shape {tuple(k.shape)}"
        )
    want_k = (B, K, S, D)[drop:]
    if tuple(k.shape) != want_k:
        raise ValueError(
            f"k shape should be ({batch}K, S, D) = {want_k} to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    want_v = (B, K, S, E)[drop:]
    if tuple(v.shape[:-1]) != want_v[:-1]:
        raise ValueError(
            f"v shape should be ({batch}K, S, E) = {want_v} to match k {tuple(k.shape)}, "
            f"got {tuple(v.shape)}"
        )


def _check_mask(
    mask: torch.Tensor | None, shape: tuple[int, int, int, int], unbatched: bool
) -> torch.Tensor | None:
    """Return the mask as a (B|1, H|1, T, S) tensor, or None."""
    if mask is None:
        return None
    mask = torch.as_tensor(mask)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"mask dtype should be bool (True = may attend) or floating (added to the "
            f"scores), got {_dtype_name(mask.dtype)}: an integer mask is ambiguous"
        )
    want = shape[1:] if unbatched else shape
    letters = "(H, T, S)" if unbatched else "(B, H, T, S)"
    try:
        fits = mask.ndim <= len(want) and tuple(torch.broadcast_shapes(mask.shape, want)) == want
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask shape should broadcast to {letters} = {want}, got {tuple(mask.shape)}"
        )
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (B|1, H|1, T|1, S|1)
    _, _, T, S = shape
    b, h = mask.shape[0], mask.shape[1]
    return mask.expand(b, h, T, S)  # (B|1, H|1, T, S)


def _check_options(
    D: int,
    scale: float | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    dropout_p: float,
) -> float:
    """Check the keyword options; return the scale to use."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal should be a bool, got {is_causal!r}")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(
            f"causal_alignment should be one of {ALIGNMENTS}, got {causal_alignment!r}"
        )
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(
                f"window should be a pair (left, right) of ints >= 0 or None, got {window!r}"
            )
        for side in window:
            if side is not None and (
                isinstance(side, bool) or not isinstance(side, int) or side < 0
            ):
                raise ValueError(
                    f"window should be a pair (left, right) of ints >= 0 or None, got {window!r}"
                )
    if softcap is not None and not (
        isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0
    ):
        raise ValueError(f"softcap should be a positive finite float, got {softcap!r}")
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p should be a float in [0, 1), got {dropout_p!r}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale should be a positive float or None, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale should be a positive finite float, got {scale!r}")
    return float(scale)
