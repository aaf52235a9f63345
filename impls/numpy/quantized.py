"""Quantized attention in NumPy: float8 and int8 operands, the way FlashAttention-3 runs them.

A quantized operand is two things: codes in a narrow format and a float32 descale. Its
value is codes × descale. Quantising x picks the descale (here amax / the format's largest
value, so the largest |x| lands on the largest code) and rounds x / descale to a code:

    codes     = cast(x / descale)               cast: round to nearest, ties to even
    x ≈ codes × descale                         exact in float64 (≤ 4 + 24 significant bits)

The answer is attention on codes × descale, nothing else (SPEC §20.3). A kernel computes
it without ever forming codes × descale:

    scores    = (q_codes · k_codesᵀ) · (scale · q_descale · k_descale)     descales folded
    P         = exp(scores − m) · 2⁸, rounded to float8_e4m3fn             m: row maximum
    ℓ         = Σ_s exp(scores − m)                                        from float32 P
    out       = (P · v_codes) / 2⁸ / ℓ · v_descale                          v's at the end

Why fold: the descales of a (batch, key/value head) are constants of every score of that
head, so they join the softmax scale and the product stays on the codes (the fast path of
an FP8 tensor core). Why 2⁸: e4m3's normal numbers start at 2⁻⁶, so a weight P below
2⁻⁶ (of the row's largest, which is 1) keeps fewer than 4 significant bits and one below
2⁻¹⁰ rounds to 0; P · 2⁸ stays normal down to P = 2⁻¹⁴, and at most 256 it never passes
448, so no cast rule is ever involved. Why ℓ from float32 P: the rounding of P then errs
by at most 2⁻⁴ of each weight, and the sum that divides them is exact to float32. The
other pipelines: ``p_pipeline="float32"`` keeps P, ``"e4m3_normalized"`` rounds P / ℓ
(whose small weights underflow: the cost SPEC §20.6 measures).

Shape legend: B batch · H query heads · K key/value heads · G = H // K · T query length ·
S key/value length · D q/k head dim · E v head dim; q (B, H, T, D), k (B, K, S, D),
v (B, K, S, E), out (B, H, T, E). Descales (SPEC §20.2): () per tensor, (B, K) per
(batch, key/value head) for q (FlashAttention-3's q_descale: indexed by the key/value
head, shared by the G query heads of a group), k and v; (B, K, S) per token and
(B, K, ⌈S/L⌉) per block of L tokens for k and v.

Imports: NumPy, ``ml_dtypes`` (NumPy's float8 types) and this package's core page.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import contract
from .attention import add_float_mask, allowed_keys, repeat_heads, softcapped

#: The largest finite value of each format: past it, the cast rule decides.
LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
#: FlashAttention-3's offset on P, a power of two so that it is undone exactly.
P_OFFSET = np.float32(2.0**8)
PIPELINES = ("float32", "e4m3_unnormalized", "e4m3_normalized")
CAST_RULES = ("saturate", "overflow")


def quantize(x: np.ndarray, fmt: str = "float8_e4m3fn", *, cast_rule: str = "saturate", axes=()):
    """Codes and descale of x: descale = amax / largest over every axis but ``axes``
    (() per tensor; (0, 1) per (batch, head); (0, 1, 2) per token), codes = cast(x / descale).

    ``cast_rule`` says what a value past the largest finite one becomes: "saturate" clips it
    (torch's eager cast), "overflow" gives the format's overflow value, NaN in
    float8_e4m3fn (no infinity there) and ±inf in float8_e5m2 (``ml_dtypes``' cast).
    """
    x = np.asarray(x, dtype=np.float64)
    other = tuple(a for a in range(x.ndim) if a not in axes)
    amax = np.abs(x).max(axis=other, keepdims=True)  # (B|1, H|1, S|1, 1)
    descale = np.where(amax > 0, amax / LARGEST[fmt], 1.0).astype(np.float32)
    codes = cast(x / descale, fmt, cast_rule)  # like x
    return codes, descale.reshape([x.shape[a] for a in axes])


def cast(y: np.ndarray, fmt: str, cast_rule: str) -> np.ndarray:
    """y rounded to the nearest code of ``fmt`` (ties to even), past the largest by the rule."""
    if fmt == "int8":
        return np.clip(np.rint(y), -127, 127).astype(np.int8)
    if cast_rule == "saturate":
        y = np.clip(y, -LARGEST[fmt], LARGEST[fmt])
    return np.asarray(y).astype(getattr(ml_dtypes, fmt))


def dequantize(codes: np.ndarray, descale: np.ndarray, block_size: int | None = None):
    """codes × descale in float64, where the product is exact; codes (B, N, S, ·)."""
    B, N, S = codes.shape[:3]
    return codes.astype(np.float64) * per_slot(descale, B, N, S, block_size)[..., None]


@np.errstate(over="ignore", invalid="ignore")
def attention_quantized(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    q_descale: np.ndarray,
    k_descale: np.ndarray,
    v_descale: np.ndarray,
    block_size: int | None = None,
    p_pipeline: str = "e4m3_unnormalized",
    out_descale: np.ndarray | None = None,
    out_format: str = "float8_e4m3fn",
    cast_rule: str = "saturate",
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Attention on quantized q, k, v (SPEC §20), FlashAttention-3's pipeline by default.

    Args:
      q, k, v: codes (B, H, T, D), (B, K, S, D), (B, K, S, E) in float8_e4m3fn,
        float8_e5m2 or (q and k) int8.
      q_descale: () or (B, K). k_descale, v_descale: (), (B, K), (B, K, S), or
        (B, K, ⌈S/L⌉) with block_size=L.
      p_pipeline: "e4m3_unnormalized" (P · 2⁸ in e4m3), "float32" or "e4m3_normalized".
      out_descale, out_format, cast_rule: with out_descale (a float32 scalar), the output
        is returned as codes cast(out / out_descale) in out_format under cast_rule.
      mask, is_causal, scale, causal_alignment, window, softcap, sinks: as ``attention``.

    Returns:
      out: (B, H, T, E) float32, or its codes with ``out_descale``.
    """
    # 0. Validate: the codes' values are exact in float32, so the shared contract checks
    # the call on them; the descales' shapes are checked against its sizes.
    if p_pipeline not in PIPELINES:
        raise ValueError(f"p_pipeline should be one of {PIPELINES}, got {p_pipeline!r}")
    qc, kc, vc = (codes_in_float32(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
    call = contract.check(
        qc, kc, vc, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, sinks=None if sinks is None else np.asarray(sinks, np.float32),
    )  # fmt: skip
    if call.unbatched:
        raise ValueError(f"q shape should be (B, H, T, D) for quantized attention, got {q.shape}")
    B, K, S, G = call.B, call.K, call.S, call.G
    dq = check_descale("q_descale", q_descale, B, K, S, None, per_token=False)  # (B|1, K|1)
    dk = per_slot(check_descale("k_descale", k_descale, B, K, S, block_size), B, K, S, block_size)
    dv = per_slot(check_descale("v_descale", v_descale, B, K, S, block_size), B, K, S, block_size)
    mask = None if mask is None else np.asarray(mask).reshape(call.mask_shape)
    kc, vc = repeat_heads(kc, G), repeat_heads(vc, G)  # (B, H, S, D), (B, H, S, E)
    dq = repeat_heads(np.broadcast_to(dq, (B, K))[..., None, None], G)  # (B, H, 1, 1)
    dk = repeat_heads(dk, G)[:, :, None, :].astype(np.float32)  # (B, H, 1, S)
    dv = repeat_heads(dv, G)[..., None].astype(np.float32)  # (B, H, S, 1)
    allowed = allowed_keys(mask, call)  # (B|1, H|1, T, S)

    # 1. Scores on the codes: a product of two float8 (or int8) codes is exact in float32.
    scores = np.einsum("bhtd,bhsd->bhts", qc, kc)  # (B, H, T, S)

    # 2. Scale, with q's and k's descales folded in: they are constants of a head's scores.
    scores = scores * (np.float32(call.scale) * dq.astype(np.float32)) * dk  # (B, H, T, S)

    # 3. Softcap and 4. mask, as on the core page.
    scores = softcapped(scores, call.softcap)  # (B, H, T, S)
    scores = add_float_mask(scores, mask, call)  # (B, H, T, S)
    scores = np.where(allowed, scores, -np.inf).astype(np.float32)  # (B, H, T, S)

    # 5. P = exp(s − m) in float32, and the row sum ℓ from it (the sink joins m and ℓ).
    p, row_sum = unnormalized_p(scores, sinks)  # (B, H, T, S), (B, H, T, 1)

    # 6. P rounded as the pipeline says, before it meets V.
    p, row_sum = rounded_p(p, row_sum, p_pipeline)  # (B, H, T, S), (B, H, T, 1)

    # 7. P · V on v's codes, then the row sum and v's descale: at the end when it is one per
    # head, inside the sum when it changes from token to token.
    if per_head(v_descale):
        out = np.einsum("bhts,bhse->bhte", p, vc) * dv[:, :, :1, :]  # (B, H, T, E)
    else:
        out = np.einsum("bhts,bhse->bhte", p, vc * dv)  # (B, H, T, E)
    out = (out / row_sum).astype(np.float32)  # (B, H, T, E)
    if out_descale is None:
        return out
    return cast(out.astype(np.float64) / np.float64(out_descale), out_format, cast_rule)


def codes_in_float32(name: str, x) -> np.ndarray:
    """The codes' values in float32, where every float8 and int8 code is exact."""
    x = np.asarray(x)
    if x.dtype.name not in LARGEST:
        raise TypeError(f"{name} should be codes in one of {sorted(LARGEST)}, got {x.dtype}")
    return x.astype(np.float32)


def check_descale(name, d, B, K, S, block_size, *, per_token=True) -> np.ndarray:
    """The descale as float32, its shape one of SPEC §20.2's."""
    d = np.asarray(d)
    shapes = [(), (B, K)]
    if per_token:
        n = S if block_size is None else -(-S // block_size)
        shapes.append((B, K, n))
    if d.dtype != np.float32:
        raise TypeError(f"{name} should be float32, got {d.dtype}")
    if d.shape not in shapes:
        raise ValueError(f"{name} shape should be one of {shapes} (B, K, S|⌈S/L⌉), got {d.shape}")
    return d


def per_head(d) -> bool:
    return np.ndim(d) < 3


def per_slot(d, B: int, N: int, S: int, block_size: int | None) -> np.ndarray:
    """The descale of every slot (B, N, S): a block's is repeated over its L tokens."""
    d = np.asarray(d)
    if d.ndim < 2:
        return np.broadcast_to(d, (B, N, S))
    if d.ndim == 2:
        if d.shape[1] != N:  # q's (B, K) over H = K · G heads
            d = np.repeat(d, N // d.shape[1], axis=1)
        return np.broadcast_to(d[:, :, None], (B, N, S))
    if block_size is not None:
        d = np.repeat(d, block_size, axis=2)[:, :, :S]
    return d


def unnormalized_p(scores: np.ndarray, sinks):
    """exp(s − m) and its row sum; a row with no key has m = -inf, P = 0 and ℓ = 1."""
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, H, T, 1)
    sink = None
    if sinks is not None:
        H = scores.shape[1]
        logits = np.asarray(sinks, np.float32).reshape(1, H, 1, 1)  # (1, H, 1, 1)
        sink = np.where(row_max == -np.inf, -np.inf, logits)  # (B, H, T, 1)
        row_max = np.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0).astype(np.float32)  # (B, H, T, 1)
    p = np.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    if sink is not None:
        row_sum = row_sum + np.exp(sink - row_max)  # (B, H, T, 1)
    return p, np.where(row_sum > 0, row_sum, 1.0).astype(np.float32)


def rounded_p(p: np.ndarray, row_sum: np.ndarray, p_pipeline: str):
    """P as it meets V, with what the product is then divided by.

    "e4m3_unnormalized": P · 2⁸ in e4m3 (≤ 256 < 448, so no cast rule is involved), over
    2⁸ · ℓ. "e4m3_normalized": P / ℓ in e4m3, whose weights below 2⁻¹⁰ become 0, over 1.
    "float32": P itself, over ℓ."""
    e4m3 = ml_dtypes.float8_e4m3fn
    if p_pipeline == "e4m3_unnormalized":
        p8 = (p * P_OFFSET).astype(e4m3).astype(np.float32)  # (B, H, T, S)
        return p8, row_sum * P_OFFSET
    if p_pipeline == "e4m3_normalized":
        p8 = (p / row_sum).astype(e4m3).astype(np.float32)  # (B, H, T, S)
        return p8, np.ones_like(row_sum)
    return p, row_sum
