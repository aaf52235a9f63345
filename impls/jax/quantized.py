"""Quantized attention in JAX: float8 and int8 operands, products with
``preferred_element_type=float32``.

The same page as ``impls/numpy/quantized.py``, line for line (read its docstring for the
lesson): codes × descale is the operand, FlashAttention-3 folds q's and k's descales into
the scale, rounds P · 2⁸ to float8_e4m3fn, takes the row sum from float32 P and applies
v's descale at the end. Here the two products take the codes themselves, as an FP8
tensor core does: ``jnp.einsum`` of two float8 arrays with ``preferred_element_type=
jnp.float32`` accumulates their exact products in float32 (on the CPU too). Where two
operands' formats differ (e4m3 P against e5m2 v), both are widened to float32 first,
which is exact. The cast rule is "saturate": values are clamped before ``astype``, whose
own rule (``ml_dtypes``') gives NaN past 448 in e4m3.

One compiled program per shape and set of options (``jax.jit`` with the options static).

Shape legend: B batch · H query heads · K key/value heads · G = H // K · T query length ·
S key/value length · D q/k head dim · E v head dim; q (B, H, T, D), k (B, K, S, D),
v (B, K, S, E), out (B, H, T, E); descales () or (B, K), and for k and v (B, K, S) per
token or (B, K, ⌈S/L⌉) per block of L tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import contract
from .attention import add_float_mask, allowed_keys, repeat_heads, softcapped

LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}
P_OFFSET = 2.0**8
PIPELINES = ("float32", "e4m3_unnormalized", "e4m3_normalized")


def cast(y: jax.Array, fmt: str) -> jax.Array:
    """y rounded to the nearest code of ``fmt``, clamped to its largest finite value first."""
    y = jnp.clip(y, -LARGEST[fmt], LARGEST[fmt])
    if fmt == "int8":
        return jnp.round(y).astype(jnp.int8)
    return y.astype(getattr(jnp, fmt))


def attention_quantized(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_descale: jax.Array,
    k_descale: jax.Array,
    v_descale: jax.Array,
    block_size: int | None = None,
    p_pipeline: str = "e4m3_unnormalized",
    out_descale: float | None = None,
    out_format: str = "float8_e4m3fn",
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention on quantized q, k, v (SPEC §20); arguments as the NumPy page's.

    Returns:
      out: (B, H, T, E) float32, or its codes in ``out_format`` with ``out_descale``.
    """
    # 0. Validate: the contract checks the call on float32 stand-ins of the codes' shapes.
    if p_pipeline not in PIPELINES:
        raise ValueError(f"p_pipeline should be one of {PIPELINES}, got {p_pipeline!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype.name not in LARGEST:
            raise TypeError(f"{name} should be codes in one of {sorted(LARGEST)}, got {x.dtype}")
    stand_in = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v)]
    call = contract.check(
        *stand_in, mask=mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, sinks=None if sinks is None else sinks.astype(jnp.float32),
    )  # fmt: skip
    if call.unbatched:
        raise ValueError(f"q shape should be (B, H, T, D) for quantized attention, got {q.shape}")
    B, K, S = call.B, call.K, call.S
    check_descale("q_descale", q_descale, B, K, S, None, per_token=False)
    check_descale("k_descale", k_descale, B, K, S, block_size)
    check_descale("v_descale", v_descale, B, K, S, block_size)
    return compiled(
        q, k, v, q_descale, k_descale, v_descale, mask, sinks, call=call, block_size=block_size,
        p_pipeline=p_pipeline, out_descale=out_descale, out_format=out_format,
    )  # fmt: skip


@functools.partial(
    jax.jit, static_argnames=("call", "block_size", "p_pipeline", "out_descale", "out_format")
)
def compiled(q, k, v, dq, dk, dv, mask, sinks, *, call, block_size, p_pipeline, out_descale, out_format):  # fmt: skip
    B, K, S, G = call.B, call.K, call.S, call.G
    v_per_head = dv.ndim < 3
    dk = per_slot(dk, B, K, S, block_size)  # (B, K, S)
    dv = per_slot(dv, B, K, S, block_size)  # (B, K, S)
    mask = None if mask is None else mask.reshape(call.mask_shape)
    k, v = repeat_heads(k, G), repeat_heads(v, G)  # (B, H, S, D), (B, H, S, E)
    dq = repeat_heads(jnp.broadcast_to(dq, (B, K))[..., None, None], G)  # (B, H, 1, 1)
    dk = repeat_heads(dk, G)[:, :, None, :]  # (B, H, 1, S)
    dv = repeat_heads(dv, G)[..., None]  # (B, H, S, 1)
    allowed = allowed_keys(mask, call)  # (B|1, H|1, T, S)

    # 1. Scores on the codes: a product of two float8 (or int8) codes is exact in float32.
    scores = product("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)

    # 2. Scale, with q's and k's descales folded in: they are constants of a head's scores.
    scores = scores * (jnp.float32(call.scale) * dq) * dk  # (B, H, T, S)

    # 3. Softcap and 4. mask, as on the core page.
    scores = softcapped(scores, call.softcap)  # (B, H, T, S)
    scores = add_float_mask(scores, mask, call)  # (B, H, T, S)
    scores = jnp.where(allowed, scores, -jnp.inf)  # (B, H, T, S)

    # 5. P = exp(s − m) in float32, and the row sum ℓ from it (the sink joins m and ℓ).
    p, row_sum = unnormalized_p(scores, sinks)  # (B, H, T, S), (B, H, T, 1)

    # 6. P rounded as the pipeline says, before it meets V (in e4m3 unless kept in float32).
    p, row_sum = rounded_p(p, row_sum, p_pipeline)  # (B, H, T, S), (B, H, T, 1)

    # 7. P · V on v's codes, then the row sum and v's descale: at the end when it is one per
    # head, inside the sum when it changes from token to token.
    if v_per_head:
        out = product("bhts,bhse->bhte", p, v) * dv[:, :, :1, :]  # (B, H, T, E)
    else:
        out = product("bhts,bhse->bhte", p, v.astype(jnp.float32) * dv)  # (B, H, T, E)
    out = out / row_sum  # (B, H, T, E)
    if out_descale is None:
        return out
    return cast(out / jnp.float32(out_descale), out_format)


def product(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """The einsum of two operands accumulated in float32: on the codes themselves when both
    are of one format, else on both widened to float32 (exact)."""
    if a.dtype != b.dtype:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def check_descale(name, d, B, K, S, block_size, *, per_token=True) -> None:
    """The descale's dtype and shape, one of SPEC §20.2's."""
    shapes = [(), (B, K)]
    if per_token:
        shapes.append((B, K, S if block_size is None else -(-S // block_size)))
    if np.dtype(d.dtype) != np.float32:
        raise TypeError(f"{name} should be float32, got {d.dtype}")
    if tuple(d.shape) not in shapes:
        raise ValueError(
            f"{name} shape should be one of {shapes} (B, K, S|⌈S/L⌉), got {tuple(d.shape)}"
        )


def per_slot(d: jax.Array, B: int, N: int, S: int, block_size: int | None) -> jax.Array:
    """The descale of every slot (B, N, S): a block's is repeated over its L tokens."""
    if d.ndim < 2:
        return jnp.broadcast_to(d, (B, N, S))
    if d.ndim == 2:
        return jnp.broadcast_to(d[:, :, None], (B, N, S))
    if block_size is not None:
        d = jnp.repeat(d, block_size, axis=2)[:, :, :S]
    return d


def unnormalized_p(scores: jax.Array, sinks: jax.Array | None):
    """exp(s − m) and its row sum; a row with no key has m = -inf, P = 0 and ℓ = 1."""
    row_max = scores.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, H, T, 1)
    sink = None
    if sinks is not None:
        logits = sinks.astype(jnp.float32).reshape(1, -1, 1, 1)  # (1, H, 1, 1)
        sink = jnp.where(row_max == -jnp.inf, -jnp.inf, logits)  # (B, H, T, 1)
        row_max = jnp.maximum(row_max, sink)  # (B, H, T, 1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)
    p = jnp.exp(scores - row_max)  # (B, H, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    if sink is not None:
        row_sum = row_sum + jnp.exp(sink - row_max)  # (B, H, T, 1)
    return p, jnp.where(row_sum > 0, row_sum, 1.0)


def rounded_p(p: jax.Array, row_sum: jax.Array, p_pipeline: str):
    """P as it meets V, with what the product is then divided by (the NumPy page's); the
    rounded P stays in float8_e4m3fn for the product."""
    if p_pipeline == "e4m3_unnormalized":
        return (p * P_OFFSET).astype(jnp.float8_e4m3fn), row_sum * P_OFFSET
    if p_pipeline == "e4m3_normalized":
        return (p / row_sum).astype(jnp.float8_e4m3fn), jnp.ones_like(row_sum)
    return p, row_sum
