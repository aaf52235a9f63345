"""The adapter to PyTorch's fused ``F.scaled_dot_product_attention`` (SDPA): the suite's
``attention()`` said in SDPA's arguments, and what SDPA cannot take built here.

    out = softmax(mask(softcap(scale · q kᵀ))) v        scale = 1/√D unless given

SDPA computes that whole formula, the steps of ``naive.py``, in one fused call. Each option
goes to it as follows (torch 2.13):

    option                          SDPA argument
    ------------------------------  ---------------------------------------------------------
    scale                           scale=
    mask, bool                      attn_mask=, bool (True = may attend)
    mask, float                     attn_mask=, float, in the scores' dtype
    is_causal, top-left, alone      is_causal=True
    is_causal otherwise, window,    attn_mask=: the band built here, ANDed into a bool mask,
      chunk_size                    or -inf in a float one
    alibi_slopes                    attn_mask=, float: −slope · |t + S − T − s| built here
    K < H (GQA, MQA)                enable_gqa=True
    dropout_p                       dropout_p=, from PyTorch's global generator
    softcap                         none: flex_attention with a score_mod in SDPA's place
    sinks                           none: not supported
    unbatched (H, T, D)             a batch axis of 1, added here and taken off after
    return_lse                      none: the logsumexp of the operator SDPA runs on the CPU,
                                      aten._scaled_dot_product_flash_attention_for_cpu,
                                      called on the same q, k and mask (flex_attention's
                                      return_lse with a softcap)

Shapes as on ``naive.py``: q (B, H, T, D), k (B, K, S, D), v (B, K, S, E) give out
(B, H, T, E); "B|1" is an axis of size B or 1. The Notes say why each row of the table is
so; "Edge cases" holds what this page repairs of SDPA's behaviour at the spec's edges.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import contract


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
    chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention through ``F.scaled_dot_product_attention``.

    Args, the inputs and the core options:
      q, k, v: (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B.
      mask: bool (True = may attend) or floating (added), broadcastable to (B, H, T, S).
      is_causal, scale: as in ``naive.attention``.
      dropout_p: drop each weight with this probability, drawn from PyTorch's global
        generator.

    Args, the variants (each off by default), as in ``naive.attention``:
      causal_alignment, window, chunk_size, alibi_slopes.
      softcap: scores become softcap · tanh(scores / softcap), through flex_attention
        (not with dropout_p > 0, nor with gradients on the CPU).
      return_lse: return each row's log-sum-exp beside the output (step 8).

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; q's dtype.
      lse: with return_lse, (B, H, T), or (H, T) unbatched; float32, float64 for float64.
    """
    # 0. Check the inputs: an error names the argument, the expected shape and what was
    # given. ``call`` holds the checked options and the sizes (call.T, call.G, ...).
    q, k, v, mask, alibi_slopes = as_arrays(q, k, v, mask, alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes, flags={"return_lse": return_lse},
    )  # fmt: skip

    # Prepare the batch axis: unbatched inputs get one, and the mask takes attn_mask's shape.
    q, k, v, mask = batched(q, k, v, mask, call)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32  # the scores' dtype

    # Prepare the visibility: which keys each query may see (causality, window, chunk, mask),
    # unless SDPA's own top-left triangle is all of it.
    causal = sdpa_is_causal(mask, alibi_slopes, call)  # whether SDPA's own triangle will do
    allowed = allowed_keys(mask, causal, call, q.device)  # (B|1, H|1, T, S) or None

    # Prepare step 4, the mask, as SDPA's one attn_mask: ALiBi's bias and a float mask are
    # added; every key a query may not see gets -inf.
    bias = alibi_bias(alibi_slopes, call, work)  # (B|1, H, T, S) or None
    added = float_mask(mask, bias, call, work)  # (B|1, H|1, T, S) or None
    q, k, v = unseen_slots_zeroed(q, k, v, allowed, added, causal, call)  # Edge cases
    attn_mask = sdpa_mask(allowed, added)  # (B|1, H|1, T, S) or None

    # 1.-7. One fused call: SDPA's scores, scale, mask, softmax, dropout and weighted sum
    # (K < H by enable_gqa); with a softcap (step 3), flex_attention in SDPA's place.
    fused = softcapped(F.scaled_dot_product_attention, allowed, added, call)
    options = dict(attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=causal,
                   scale=call.scale, enable_gqa=call.K != call.H)  # fmt: skip
    out = fused(q, k, v, **options)  # (B, H, T, E)
    out = nan_rows_again(out, q, k, v, options, fused)  # (B, H, T, E); Edge cases
    if return_lse:
        # 8. The log-sum-exp of each row's scores: SDPA returns none, the operator it
        # dispatches to on the CPU does.
        lse = log_sum_exp(q, k, options, fused, call, work)  # (B, H, T)
        lse = lse_repaired(lse, q, k, options, allowed, added, causal, call)  # Edge cases
        return as_given(out, call), as_given(lse, call)
    return as_given(out, call)  # (B, H, T, E), or (H, T, E) unbatched


# --- Step 0 and the preparation: the inputs -------------------------------------------------


def as_arrays(*xs):
    """The arrays as torch tensors, None left as it is."""
    return tuple(None if x is None else torch.as_tensor(x) for x in xs)


def batched(q, k, v, mask, call: contract.Checked):
    """q, k, v with a batch axis, as given (SDPA computes float16 and bfloat16 in float32
    itself); the mask reshaped and expanded to (B|1, H|1, T, S), the shape attn_mask takes."""
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = mask.reshape(call.mask_shape).expand(b, h, call.T, call.S)  # (B|1, H|1, T, S)
    return q, k, v, mask


def sdpa_is_causal(mask, alibi_slopes, call: contract.Checked) -> bool:
    """Whether SDPA's own is_causal=True is the whole mask: it is top-left only, and its
    math backend refuses it together with an attn_mask (see Notes)."""
    alone = mask is None and call.window is None and call.chunk_size is None
    alone = alone and alibi_slopes is None and call.softcap is None
    return call.is_causal and alone and (call.causal_alignment == "top_left" or call.T == call.S)


def allowed_keys(mask, causal: bool, call: contract.Checked, device) -> torch.Tensor | None:
    """Which keys each query may see, (B|1, H|1, T, S) bool, as far as SDPA is not told
    otherwise: a bool mask, and the causal triangle (unless SDPA draws it), the window and
    the chunk; None where every key may be seen (or SDPA's triangle is all there is)."""
    allowed = mask if mask is not None and call.mask_is_bool else None
    if (call.is_causal and not causal) or call.window is not None or call.chunk_size is not None:
        band = causal_band(call, device)  # (1, 1, T, S)
        allowed = band if allowed is None else allowed & band  # (B|1, H|1, T, S)
    return allowed


def causal_band(call: contract.Checked, device) -> torch.Tensor:
    """Which keys each query may see under causality, the window and the chunks:
    (1, 1, T, S) bool."""
    T, S, window, chunk = call.T, call.S, call.window, call.chunk_size
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if call.causal_alignment == "top_left" else S - T
    t = torch.arange(T, device=device)[:, None]  # (T, 1)
    s = torch.arange(S, device=device)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = torch.ones((T, S), dtype=torch.bool, device=device)  # (T, S)
    if call.is_causal:
        allowed &= distance <= 0
    if window is not None and window[0] is not None:
        allowed &= distance >= -window[0]
    if window is not None and window[1] is not None:
        allowed &= distance <= window[1]
    if chunk is not None:
        # Same chunk only; floor division puts a negative position in a chunk of no key.
        allowed &= (t + offset) // chunk == s // chunk
    return allowed[None, None]  # (1, 1, T, S)


# --- Steps 3 and 4: the variants of the scores ----------------------------------------------


def softcapped(sdpa, allowed, added, call: contract.Checked):
    """SDPA itself, or, for a softcapped call, flex_attention with SDPA's arguments: its
    score_mod softcaps the scaled scores, then adds the float mask and blocks, as step 4
    says. With T = 0 or S = 0 there is no score to softcap: SDPA gives the empty output or
    rows of 0, where flex_attention raises IndexError (torch 2.13, CPU)."""
    if call.softcap is None or call.T == 0 or call.S == 0:
        return sdpa
    return functools.partial(flex_softcapped, allowed=allowed, added=added, softcap=call.softcap)


def flex_softcapped(
    q, k, v, *, allowed, added, softcap: float, dropout_p: float, scale, return_lse=False, **_
):
    """Softcapped attention through flex_attention's score_mod: (B, H, T, E). SDPA's
    attn_mask and is_causal are not needed: ``allowed`` and ``added`` are the mask, and
    SDPA's own triangle is never asked for with a softcap (``sdpa_is_causal``)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

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
    if added is not None:
        added = added.expand(B, H, T, S)  # (B, H, T, S)

    def score_mod(score, b, h, t, s):
        # flex_attention has already applied step 2 (the scale) to the score.
        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        score = softcap * torch.tanh(score / softcap)
        # 4. Mask: the float mask is added, then blocked keys get -inf.
        if added is not None:
            score = score + added[b, h, t, s]
        if allowed is not None:
            score = torch.where(allowed[b, h, t, s], score, -math.inf)
        return score

    with warnings.catch_warnings():
        # Eager (uncompiled) flex_attention is what we want here: a reference, not speed.
        warnings.filterwarnings("ignore", message="flex_attention called without")
        # With return_lse, flex_attention's own lse beside the output: (out, lse (B, H, T)).
        aux = {"return_aux": AuxRequest(lse=True)} if return_lse else {}
        out = flex_attention(q, k, v, score_mod=score_mod, scale=scale, enable_gqa=K != H, **aux)
    return (out[0], out[1].lse) if return_lse else out  # (B, H, T, E)


def alibi_bias(slopes: torch.Tensor | None, call: contract.Checked, work) -> torch.Tensor | None:
    """ALiBi's bias, (B|1, H, T, S): −slope · |t + S − T − s|, the distance from the
    bottom-right diagonal whatever the causal alignment, as FlashAttention defines it;
    None without ALiBi."""
    if slopes is None:
        return None
    T, S, H = call.T, call.S, call.H
    t = torch.arange(T, device=slopes.device)[:, None]  # (T, 1)
    s = torch.arange(S, device=slopes.device)[None, :]  # (1, S)
    distance = (t + S - T - s).abs().to(work)  # (T, S)
    return -slopes.to(work).reshape(-1, H, 1, 1) * distance  # (B|1, H, T, S)


def float_mask(mask, bias, call: contract.Checked, work) -> torch.Tensor | None:
    """What SDPA's attn_mask adds to the scaled scores: a float mask, in the precision
    the scores are computed in (float32 for float16 and bfloat16 q, which SDPA accepts),
    plus ALiBi's bias; None for neither. A bool mask adds nothing, it only blocks."""
    added = mask.to(work) if mask is not None and not call.mask_is_bool else None
    if bias is None:
        return added  # (B|1, H|1, T, S) or None
    return bias if added is None else added + bias  # (B|1, H, T, S)


def sdpa_mask(allowed, added) -> torch.Tensor | None:
    """SDPA's one attn_mask: the bool mask of the keys each query may see; or the float
    one, -inf at every blocked key. SDPA on the CPU turns a row of -inf into weights of
    exactly 0 (checked for torch 2.13), so no fix-up is needed for it."""
    if added is None:
        return allowed  # (B|1, H|1, T, S) or None
    if allowed is None:
        return added  # (B|1, H|1, T, S)
    return torch.where(allowed, added, -math.inf)  # (B|1, H|1, T, S)


# --- Step 7: the output ---------------------------------------------------------------------


def as_given(out: torch.Tensor, call: contract.Checked) -> torch.Tensor:
    """The output (SDPA returns q's dtype) without the batch axis it was given for
    unbatched inputs."""
    return out[0] if call.unbatched else out  # (B, H, T, E) or (H, T, E)


# --- Step 8: the log-sum-exp ---------------------------------------------------------------


def log_sum_exp(q, k, options: dict, fused, call: contract.Checked, work) -> torch.Tensor:
    """Each row's log Σ_s exp(score[s]), (B, H, T), from the operator SDPA dispatches to on
    the CPU, ``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
    attn_mask=, scale=)``, which returns (out, logsumexp): called on the same q, k, mask,
    causality and scale as SDPA, with k in v's place (the operator wants v's head size
    to be D, and the lse does not read v) and no dropout (the lse is taken before it).
    The operator takes a float mask only: a bool one becomes 0 and -inf. float16 and
    bfloat16 q and k go in as float32, which holds them exactly and is the lse's precision
    (see Edge cases). With a softcap, flex_attention's own ``return_lse``. Float32, or
    float64 for float64 q."""
    B, H, T, S = call.B, call.H, call.T, call.S
    if T == 0 or S == 0:
        return torch.full((B, H, T), -math.inf, dtype=work, device=q.device)  # Edge cases
    if fused is not F.scaled_dot_product_attention:
        return fused(q, k, k, **{**options, "dropout_p": 0.0}, return_lse=True)[1]  # (B, H, T)
    mask = options["attn_mask"]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=work, device=q.device).masked_fill(~mask, -math.inf)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q, k = q.to(work), k.to(work)  # (B, H, T, D), (B, K, S, D); Edge cases
    _, lse = flash(q, k, k, 0.0, options["is_causal"], attn_mask=mask, scale=options["scale"])
    return lse  # (B, H, T)


# --- Notes ----------------------------------------------------------------------------------
#
# Blocked keys (step 4). A slot that no query of its key/value head may see (padding, a
# KV-cache slot not yet written, a key after every query) must have no effect, whatever it
# holds; but SDPA multiplies every value row by its weight (0 · NaN = NaN) and adds the mask
# to every score (NaN + -inf = NaN). Such key and value rows are replaced by 0 first, by
# selection, so that their gradients are exactly 0 as well; so is a query with no key to
# see (every query when S = 0), whose row SDPA would otherwise compute from a NaN in it.
#
# Why the table (the docstring's) reads as it does:
#
# - A float mask is cast to the scores' dtype (float32 for float16/bfloat16 q, which SDPA
#   accepts), so that it is added at the precision the reference adds it.
# - SDPA's is_causal is top-left only, and its math backend refuses is_causal with an
#   attn_mask ("Explicit attn_mask should not be set when is_causal=True"), while its CPU
#   flash backend accepts the pair and ANDs them: the outcome would depend on the backend
#   chosen. So any other causality, the window and the chunks (Llama 4's chunked attention
#   is a mask in transformers too) are built here as one band, ANDed into a bool mask or
#   written as -inf into a float one. ALiBi's bias is built in the scores' dtype and added
#   to the float mask (or given alone); the blocked keys then go in as -inf.
# - enable_gqa repeats key/value heads as repeat_interleave does.
# - SDPA has no softcap: the call goes to ``torch.nn.attention.flex_attention`` in eager
#   mode, with a score_mod that softcaps, adds the float mask and blocks with -inf (scale,
#   GQA passed through). Eager flex runs on the CPU but has no backward there and no
#   dropout: softcap with inputs that need gradients, or with dropout_p > 0, raises
#   NotImplementedError.
#
# SDPA's behaviour on the CPU, observed with torch 2.13.0 (and relied on here):
#
# - A row whose keys are all blocked gives exactly 0, with a bool mask and with a float
#   mask whose row is all -inf, in every dtype, on both the math and the CPU flash backend,
#   and its gradients are 0, not NaN (the math backend uses ``_safe_softmax``). So the
#   page needs no fix-up for empty rows; eager flex_attention also uses
#   ``_safe_softmax`` and gives 0.
# - float16 and bfloat16: the math backend (taken with dropout, GQA or E != D) computes in
#   float32 and rounds once; the CPU flash backend (taken otherwise) accumulates in float32
#   but is not bit-identical to a single rounding (about 1 ulp of float16/bfloat16 apart).
#   Eager flex_attention scores in float32 but rounds the weights to q's dtype before
#   multiplying v.
# - is_causal=True with T != S is aligned top-left (s <= t): with T > S nothing is empty,
#   and bottom-right alignment is not available.
# - Dropout (math backend only: the CPU flash backend takes none) draws
#   ``bernoulli_(1 - p)`` over the (B, H, T, S) weights in the compute dtype and multiplies
#   by the mask divided by 1 - p (``at::dropout``), so ``naive.py`` with the global
#   generator, and ``module.py`` with an ``nn.Dropout``, drop the same positions after
#   the same ``torch.manual_seed``.
#
# Gradients come from SDPA's own backward through autograd, including the gradient of a
# float ``attn_mask`` (0 on -inf entries, and 0 for fully masked rows, not NaN). Softcap
# has none on the CPU: flex_attention raises NotImplementedError for inputs that require
# grad, so the conformance backend does not declare ``grad_softcap``.


# --- Edge cases -----------------------------------------------------------------------------
#
# What this page repairs of SDPA at the spec's edges, each with why and the SPEC clause it
# meets.
#
# Slots no query sees (SPEC §4.7). A slot that no query of its key/value head may see
# (padding, a KV-cache slot not yet written, a key after every query) must have no effect,
# whatever it holds; but SDPA multiplies every value row by its weight (0 · NaN = NaN) and
# adds the mask to every score (NaN + -inf = NaN). Such key and value rows are replaced by 0
# first, by selection, so that their gradients are exactly 0 as well; so is a query with no
# key to see (every query when S = 0), whose row SDPA would otherwise compute from a NaN in
# it (SPEC §4.3).
#
# NaN rows (SPEC §4.9). SDPA's CPU flash kernel returns 0 for a row whose every score is
# NaN, as if the row had no key; ``nan_rows_again`` computes such rows again on the math
# backend, which propagates the NaN.
#
# The log-sum-exp's edges (SPEC §21.2-§21.4; torch 2.13, measured). The CPU flash operator
# returns a logsumexp of 0, not -inf, for a row with no key; for a row of NaN scores 0 or
# NaN, and for a row with a +inf score NaN or +inf, depending on the processor's vector
# width (AVX-512 or AVX2, ATEN_CPU_CAPABILITY); on AVX2 its float16 and bfloat16 lse is
# some 1e-5 off (relative), past the float32 tolerance, where its float32 one is not. And
# it stops the process (SIGFPE) for T = 0 or S = 0. So it is not called for T = 0 or S = 0,
# 16-bit q and k go in as float32 (exactly), and ``lse_repaired`` gives a row with no key
# -inf and, where q, k or the mask hold a NaN or the mask a +inf, takes the lse from the
# scores as the core pages do, NaN for such rows on every processor.


def unseen_slots_zeroed(q, k, v, allowed, added, causal: bool, call: contract.Checked):
    """q, k and v with every key/value slot that no query of its head group may see, and
    every query that sees no key, replaced by 0, so that whatever they hold has no effect
    (see Edge cases). Nothing is copied where every one is seen."""
    used, has_key = seen(allowed, added, causal, call, q.device)
    if used is not None and not bool(used.all()):
        k = torch.where(used, k, 0.0)  # (B, K, S, D)
        v = torch.where(used, v, 0.0)  # (B, K, S, E)
    if has_key is not None and not bool(has_key.all()):
        q = torch.where(has_key, q, 0.0)  # (B, H, T, D)
    return q, k, v


def seen(allowed, added, causal: bool, call: contract.Checked, device):
    """Which key/value slots some query of their head group sees, (B|1, K|1, S, 1), and
    which queries see some key, (B|1, H|1, T, 1); None where every one does."""
    H, K, T, S = call.H, call.K, call.T, call.S
    if S == 0:
        return None, torch.zeros((1, 1, T, 1), dtype=torch.bool, device=device)  # no key
    if causal:
        # SDPA's own top-left causal mask: query t sees keys s <= t, so key s is seen
        # (from query s on) when s < T, and every query sees key 0.
        return (torch.arange(S, device=device) < T)[:, None], None  # (S, 1)
    visible = allowed
    if added is not None:
        finite = added != -math.inf  # (B|1, H|1, T, S)
        visible = finite if visible is None else visible & finite  # (B|1, H|1, T, S)
    if visible is None:
        return None, None
    b, h = visible.shape[:2]
    kv = K if h == H else 1
    groups = visible.reshape(b, kv, h // kv, T, S)  # (B|1, K|1, G|1, T, S)
    used = groups.any(dim=3).any(dim=2)[..., None]  # (B|1, K|1, S, 1)
    return used, visible.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)


def nan_rows_again(out, q, k, v, options: dict, fused) -> torch.Tensor:
    """``out`` with its all-0 rows computed again on SDPA's math backend, when q, k or the
    mask hold a NaN: (B, H, T, E).

    SDPA's CPU flash kernel returns 0 for a row whose every score is NaN (a NaN query, or
    a row whose keys all hold a NaN), as if the row had no key: measured with torch 2.13
    (the torch.sdpa profile fails test_nan_propagates). The math backend propagates the
    NaN; so does flex_attention, whose rows are left as they are. Without a NaN this costs
    one pass over q and k.
    """
    if fused is not F.scaled_dot_product_attention or not has_nan(q, k, options["attn_mask"]):
        return out
    zero_rows = (out == 0).all(dim=-1, keepdim=True)  # (B, H, T, 1)
    if not bool(zero_rows.any()):
        return out
    with sdpa_kernel(SDPBackend.MATH):
        again = F.scaled_dot_product_attention(q, k, v, **options)  # (B, H, T, E)
    return torch.where(zero_rows, again, out)  # (B, H, T, E)


def has_nan(*tensors: torch.Tensor | None) -> bool:
    """Whether any of the tensors may hold a NaN: its sum is NaN then (and also, harmlessly,
    when +inf meets -inf). A sum allocates nothing of the inputs' size."""
    return any(
        x is not None and x.is_floating_point() and bool(torch.isnan(x.sum())) for x in tensors
    )


def lse_repaired(lse, q, k, options: dict, allowed, added, causal, call: contract.Checked):
    """The operator's log-sum-exp (B, H, T) with its edges repaired (see Edge cases): -inf
    for a row with no key; with a NaN in q, k or the mask, or a +inf in the mask, the lse
    of the scores as the core pages take it: the row maximum plus the log of the shifted
    sum, NaN for a row that reads NaN or +inf."""
    if call.T == 0 or call.S == 0:
        return lse
    mask = options["attn_mask"]
    plus_inf = mask is not None and mask.is_floating_point() and bool((mask == math.inf).any())
    if plus_inf or has_nan(q, k, mask):
        k = k.repeat_interleave(call.G, dim=1)  # (B, H, S, D)
        scores = torch.einsum("bhtd,bhsd->bhts", q.to(lse.dtype), k.to(lse.dtype))  # (B, H, T, S)
        scores = scores * call.scale  # (B, H, T, S)
        if added is not None:
            # A blocked key's score is -inf, not NaN + -inf.
            scores = torch.where(added == -math.inf, -math.inf, scores + added)  # (B, H, T, S)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, -math.inf)  # (B, H, T, S)
        if causal:
            scores = scores.masked_fill(~causal_band(call, q.device), -math.inf)  # (B, H, T, S)
        top = scores.amax(dim=-1, keepdim=True)  # (B, H, T, 1)
        shift = torch.where(top == -math.inf, 0.0, top)  # (B, H, T, 1): +inf - +inf is NaN
        return (shift + torch.exp(scores - shift).sum(dim=-1, keepdim=True).log())[..., 0]
    _, has_key = seen(allowed, added, causal, call, q.device)  # (B|1, H|1, T, 1) or None
    return lse if has_key is None else torch.where(has_key[..., 0], lse, -math.inf)
