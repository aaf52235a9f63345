"""Quantized attention in PyTorch: float8 and int8 operands on torch's own float8 dtypes.

The same page as ``impls/numpy/quantized.py``, line for line (read its docstring for the
lesson): codes × descale is the operand, FlashAttention-3 folds q's and k's descales into
the scale, rounds P · 2⁸ to float8_e4m3fn, takes the row sum from float32 P and applies
v's descale at the end.

torch 2.13 casts to ``torch.float8_e4m3fn`` and ``torch.float8_e5m2`` on the CPU, but has
no CPU product of float8 tensors ("dot" not implemented for 'Float8_e4m3fn'), so the
products run on the codes' values in float32, where each float8 code is exact, as a
tensor core's float32 accumulation of float8 products does. torch's eager cast saturates
e4m3 (465 → 448) but not e5m2 (61440 → inf): this page clamps first, so its cast rule is
"saturate" for both, and says so.

Shape legend: B batch · H query heads · K key/value heads · G = H // K · T query length ·
S key/value length · D q/k head dim · E v head dim; q (B, H, T, D), k (B, K, S, D),
v (B, K, S, E), out (B, H, T, E); descales () or (B, K), and for k and v (B, K, S) per
token or (B, K, ⌈S/L⌉) per block of L tokens.
"""

from __future__ import annotations

import torch

from .. import contract
from .naive import add_float_mask, allowed_keys, repeat_heads, softcapped

LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
FORMATS = {
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
}
P_OFFSET = 2.0**8
PIPELINES = ("float32", "e4m3_unnormalized", "e4m3_normalized")


def quantize(x: torch.Tensor, fmt: str = "float8_e4m3fn", *, axes=()):
    """Codes and descale of x: descale = amax / largest over every axis but ``axes``,
    codes = cast(x / descale), saturating."""
    other = tuple(a for a in range(x.ndim) if a not in axes)
    amax = x.abs().amax(dim=other, keepdim=True)  # (B|1, H|1, S|1, 1)
    descale = torch.where(amax > 0, amax / LARGEST[fmt], 1.0).to(torch.float32)
    codes = cast(x.double() / descale.double(), fmt)  # like x
    return codes, descale.reshape([x.shape[a] for a in axes])


def cast(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """y rounded to the nearest code of ``fmt``, clamped to its largest finite value first
    (the "saturate" rule; torch's own e5m2 cast would give inf)."""
    y = y.clamp(-LARGEST[fmt], LARGEST[fmt])
    if fmt == "int8":
        return y.round().to(torch.int8)
    return y.to(getattr(torch, fmt))


def attention_quantized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    block_size: int | None = None,
    p_pipeline: str = "e4m3_unnormalized",
    out_descale: float | None = None,
    out_format: str = "float8_e4m3fn",
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention on quantized q, k, v (SPEC §20); arguments as the NumPy page's.

    Returns:
      out: (B, H, T, E) float32, or its codes in ``out_format`` with ``out_descale``.
    """
    # 0. Validate: the codes' values are exact in float32, so the shared contract checks
    # the call on them; the descales' shapes are checked against its sizes.
    if p_pipeline not in PIPELINES:
        raise ValueError(f"p_pipeline should be one of {PIPELINES}, got {p_pipeline!r}")
    qc, kc, vc = (codes_in_float32(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    sinks = None if sinks is None else sinks.to(torch.float32)
    call = contract.check(
        qc, kc, vc, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    if call.unbatched:
        raise ValueError(f"q shape should be (B, H, T, D) for quantized attention, got {q.shape}")
    B, K, S, G = call.B, call.K, call.S, call.G
    dq = check_descale("q_descale", q_descale, B, K, S, None, per_token=False)  # (B|1, K|1)
    dk = per_slot(check_descale("k_descale", k_descale, B, K, S, block_size), B, K, S, block_size)
    dv = per_slot(check_descale("v_descale", v_descale, B, K, S, block_size), B, K, S, block_size)
    mask = None if mask is None else mask.reshape(call.mask_shape)
    kc, vc = repeat_heads(kc, G), repeat_heads(vc, G)  # (B, H, S, D), (B, H, S, E)
    dq = repeat_heads(dq.broadcast_to((B, K))[..., None, None], G)  # (B, H, 1, 1)
    dk = repeat_heads(dk, G)[:, :, None, :]  # (B, H, 1, S)
    dv = repeat_heads(dv, G)[..., None]  # (B, H, S, 1)
    allowed = allowed_keys(mask, call, qc.device)  # (B|1, H|1, T, S)

    # 1. Scores on the codes: a product of two float8 (or int8) codes is exact in float32.
    scores = torch.einsum("bhtd,bhsd->bhts", qc, kc)  # (B, H, T, S)

    # 2. Scale, with q's and k's descales folded in: they are constants of a head's scores.
    scores = scores * (call.scale * dq) * dk  # (B, H, T, S)

    # 3. Softcap and 4. mask, as on the core page.
    scores = softcapped(scores, call.softcap)  # (B, H, T, S)
    scores = add_float_mask(scores, mask, call)  # (B, H, T, S)
    scores = torch.where(allowed, scores, -torch.inf)  # (B, H, T, S)

    # 5. P = exp(s − m) in float32, and the row sum ℓ from it (the sink joins m and ℓ).
    p, row_sum = unnormalized_p(scores, sinks)  # (B, H, T, S), (B, H, T, 1)

    # 6. P rounded as the pipeline says, before it meets V.
    p, row_sum = rounded_p(p, row_sum, p_pipeline)  # (B, H, T, S), (B, H, T, 1)

    # 7. P · V on v's codes, then the row sum and v's descale: at the end when it is one per
    # head, inside the sum when it changes from token to token.
    if v_descale.ndim < 3:
        out = torch.einsum("bhts,bhse->bhte", p, vc) * dv[:, :, :1, :]  # (B, H, T, E)
    else:
        out = torch.einsum("bhts,bhse->bhte", p, vc * dv)  # (B, H, T, E)
    out = out / row_sum  # (B, H, T, E)
    if out_descale is None:
        return out
    return cast(out.double() / float(out_descale), out_format)


def codes_in_float32(name: str, x: torch.Tensor) -> torch.Tensor:
    """The codes' values in float32, where every float8 and int8 code is exact."""
    if x.dtype not in FORMATS:
        raise TypeError(f"{name} should be codes in one of {sorted(LARGEST)}, got {x.dtype}")
    return x.to(torch.float32)


def check_descale(name, d, B, K, S, block_size, *, per_token=True) -> torch.Tensor:
    """The descale, float32, its shape one of SPEC §20.2's."""
    shapes = [(), (B, K)]
    if per_token:
        shapes.append((B, K, S if block_size is None else -(-S // block_size)))
    if d.dtype != torch.float32:
        raise TypeError(f"{name} should be float32, got {d.dtype}")
    if tuple(d.shape) not in shapes:
        raise ValueError(
            f"{name} shape should be one of {shapes} (B, K, S|⌈S/L⌉), got {tuple(d.shape)}"
        )
    return d


def per_slot(d: torch.Tensor, B: int, N: int, S: int, block_size: int | None) -> torch.Tensor:
    """The descale of every slot (B, N, S): a block's is repeated over its L tokens."""
    if d.ndim < 2:
        return d.broadcast_to((B, N, S))
    if d.ndim == 2:
        return d[:, :, None].broadcast_to((B, N, S))
    if block_size is not None:
        d = d.repeat_interleave(block_size, dim=2)[:, :, :S]
    return d


def unnormalized_p(scores: torch.Tensor, sinks: torch.Tensor | None):
    """exp(s − m) and its row sum; a row with no key has m = -inf, P = 0 and ℓ = 1."""
    row_max = scores.amax(dim=-1, keepdim=True)  # (B, H, T, 1)
    sink = None
    if sinks is not None:
        logits = sinks.reshape(1, -1, 1, 1)  # (1, H, 1, 1)
        sink = torch.where(row_max == -torch.inf, -torch.inf, logits)  # (B, H, T, 1)
        row_max = torch.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = torch.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(dim=-1, keepdim=True)  # (B, H, T, 1)
    if sink is not None:
        row_sum = row_sum + torch.exp(sink - row_max)  # (B, H, T, 1)
    return p, torch.where(row_sum > 0, row_sum, 1.0)


def rounded_p(p: torch.Tensor, row_sum: torch.Tensor, p_pipeline: str):
    """P as it meets V, with what the product is then divided by (the NumPy page's)."""
    e4m3 = torch.float8_e4m3fn
    if p_pipeline == "e4m3_unnormalized":
        p8 = (p * P_OFFSET).to(e4m3).to(torch.float32)  # (B, H, T, S)
        return p8, row_sum * P_OFFSET
    if p_pipeline == "e4m3_normalized":
        p8 = (p / row_sum).to(e4m3).to(torch.float32)  # (B, H, T, S)
        return p8, torch.ones_like(row_sum)
    return p, row_sum
