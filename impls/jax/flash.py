"""Blockwise (FlashAttention-style) attention in JAX, compiled: never a T × S matrix.

    out = softmax(mask(softcap(scale · q kᵀ))) v

The core page builds every score at once, a (B, H, T, S) array: 16 GiB in float32 for
16 heads of 16384 tokens. Yet an output row is a weighted average of value rows, which
can be built a block of keys at a time if the softmax can: the *online softmax*. For one
query row with scores x_1 … x_S and any constant m,

    out = Σ_s exp(x_s − m) v_s / Σ_s exp(x_s − m)

m cancels; the safe softmax takes m = max_s x_s, so that no exp() overflows, and so walks
the keys three times: for m, for l = Σ exp(x_s − m), for the weighted sum. They fold into
one through a surrogate, the sums against the maximum *so far* m_s = max(x_1 … x_s):

    l_s = Σ_{j ≤ s} exp(x_j − m_s)            a_s = Σ_{j ≤ s} exp(x_j − m_s) v_j

Each follows from the one before, by induction, since exp(x_j − m_{s−1}) · exp(m_{s−1} −
m_s) = exp(x_j − m_s): with α = exp(m_{s−1} − m_s) ≤ 1,

    l_s = α · l_{s−1} + exp(x_s − m_s)        a_s = α · a_{s−1} + exp(x_s − m_s) v_s

α is exact, no approximation: it moves every term summed so far onto the new maximum at
once. After the last key m_S is the row's maximum, so out = a_S / l_S; only the rounding
differs from the core page. A block of keys in place of one changes only the sums.
``online_softmax_row`` is this recurrence for one row (m, l, a); ``attention`` runs it,
with the same names, on tiles of Tb rows and Sb keys (``online_softmax_step``). NumPy's
docs/walkthrough/flash.md derives it in code that runs (three passes, two, one) and
follows the worked example through it, tile by tile.

Blocked keys have score −inf. A row that has seen only blocked keys has m = −inf, and
exp(x − m) would be exp(−inf + inf) = NaN: ``online_softmax_row``, the lesson, leaves that
out; ``attention`` takes such a row's exponents against 0 instead, so its weights are 0,
and a row that never sees a key returns exactly 0, as the core page's.

The fast path. ``attention(..., fast=True)``, what the jax-flash backend runs, is the same
recurrence compiled once for many calls: ``flash_fast.py`` holds its host and jit
plumbing (the shape buckets, the traced options, the compiled loops) and says how it
skips blocks, folds in sinks and adds ALiBi; ``flash_tiles.py`` does one tile's work.

The backward pass. ``attention_vjp`` is FlashAttention-2's backward, the algorithm
NumPy's ``flash.py`` derives: for each query block, the forward over its key
blocks gives each row's log-sum-exp lse = m + log l and its output O, hence
Δ = rowsum(dO ⊙ O); then a second walk over the same key blocks recomputes each tile's
weights as P = exp(Z − lse), forms dZ = P ⊙ (dO·Vᵀ − Δ), adds scale · dZ·K to the block's
dQ, and adds scale · dZᵀ·Q and Pᵀ·dO to dK and dV of the key block, in place (Z = scale ·
q·kᵀ, so the scale comes back in dQ and dK; with a softcap, dZ is first multiplied by the
cap's derivative). No (T, S) array, no
``jax.vjp`` through the loops (which would store every tile's weights), and the same
block skipping as the forward. ``ring.py``'s backward runs the same tile algorithm in a
body of its own: there the positions and options are traced values travelling with the
slices, where this page's band is static and skips blocks by loop bounds.

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim
    Tb query block     Sb key block       Tq, Sk: T and S padded to their buckets
                                          Tp, Sp: the padded lengths the tiles see

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores),
          broadcastable to (B, H, T, S)

Unbatched inputs q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

``jax.nn.dot_product_attention`` uses other letters and a sequence-first layout:

    here           B    H    K    T    S    D    E
    jax.nn         B    N    K    T    S    H    H

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks, grouped-query and
multi-query attention (K < H, in the grouped layout of ``flash_tiles.py``: no key/value
head is repeated), float64, float32, float16 and bfloat16 (computed in float32 and rounded
once), and the backward pass of all of them with a float mask's gradient. A query row with
no key left to attend returns exactly 0. Float64 needs ``jax.config.update(
"jax_enable_x64", True)`` set by the caller; this module never changes it. Not supported:
dropout (``dropout_p > 0`` raises NotImplementedError).

The pages beside it: ``flash_fast.py`` (the fast path's plumbing), ``flash_tiles.py``
(one tile's work, which its loops call), ``flash_packed.py`` (packed documents, SPEC
§18) and ``flash_paged.py`` (a paged KV cache, §19), each walking the same tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import contract
from .attention import visible
from .flash_fast import _flash, _flash_vjp, _host_array, _prepare, _result
from .flash_tiles import HIGHEST, running_lse


def online_softmax_row(x: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """The recurrence for one query row: scores x (S,), values v (S, E), ``block`` keys at
    a time. The lesson only: a first block of blocked keys (all −inf) makes the row NaN
    here; ``online_softmax_step`` guards that (see "Blocked keys" above)."""
    m, l, a = -jnp.inf, 0.0, jnp.zeros(v.shape[-1])  # a: (E,)
    for s0 in range(0, len(x), block):
        x_b, v_b = x[s0 : s0 + block], v[s0 : s0 + block]  # (Sb,), (Sb, E)
        m_new = jnp.maximum(m, x_b.max())  # the running maximum
        alpha = jnp.exp(m - m_new)  # α: what was summed against m, onto m_new
        p = jnp.exp(x_b - m_new)  # (Sb,)
        l = alpha * l + p.sum()
        a = alpha * a + p @ v_b  # (E,)
        m = m_new
    return a / l  # (E,)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    key: jax.Array | None = None,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
    block_q: int = 512,
    block_k: int = 256,
    fast: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention, computed one (query block, key block) tile at a time.

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
      softcap: scores become softcap · tanh(scores / softcap) before masking.
      dropout_p: must be 0; dropout is not supported here.
      key: unused (dropout is not supported).
      sinks: (H,), same dtype as q: one logit per query head that joins every row's
        softmax and carries no value; None for none.
      chunk_size: query t attends only keys s in its own chunk, (t + offset) // chunk_size
        == s // chunk_size, offset placed by causal_alignment (Llama 4); None for none.
      alibi_slopes: (H,) or (B, H), float32 or q's dtype: ALiBi adds -slope · |t + S - T -
        s| to the scores after the softcap, whatever causal_alignment says; None for none.
      block_q: Tb, queries per tile (per query head); shrunk to T's power of two when
        that is smaller.
      block_k: Sb, keys per tile; shrunk to S's power of two when that is smaller.
      fast: the same rows, compiled once for every call of a shape bucket (module
        docstring): what the jax-flash backend runs. Without it, the recurrence tile by
        tile, its tiles cut on the host, for concrete arrays (not under a trace).
      return_lse: return each row's log-sum-exp m + log l beside the output (NumPy's
        flash page derives it).

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
      lse: with return_lse, (B, H, T), or (H, T) unbatched; in the working precision.
    """
    options = dict(is_causal=is_causal, scale=scale, causal_alignment=causal_alignment)
    options.update(window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks)
    options.update(chunk_size=chunk_size, alibi_slopes=alibi_slopes)
    return_lse = contract.check_bool("return_lse", return_lse)
    if not contract.check_bool("fast", fast):
        out, lse = _textbook(q, k, v, mask, options, block_q, block_k)
        return (out, lse) if return_lse else out
    # 0. Validate: the input contract every impl shares (the contract package) checks shapes,
    # dtypes and options, and names the argument, the expected shape and what was given.
    call, (q, k, v, mask, sinks, alibi), static = _prepare(q, k, v, mask, options, block_q, block_k)
    if call.T == 0 or call.S == 0:
        # Nothing to tile: with T = 0 there is no query, and with S = 0 every query has
        # no key, so every output row is exactly 0, whatever q holds.
        out = np.zeros((call.B, call.H, call.T, call.E), dtype=q.dtype)  # (B, H, T, E)
        lse = np.full((call.B, call.H, call.T), -np.inf, dtype=_work(q.dtype))  # (B, H, T)
    else:
        out = _flash(q, k, v, mask, sinks, alibi=alibi, return_lse=return_lse, **static)
        out, lse = out if return_lse else (out, None)  # (B, H, Tq, E), (B, H, Tq)
    out = _result(out, ((2, call.T),), call.unbatched)  # (B, H, T, E), padding cut off
    if return_lse:
        return out, _result(lse, ((2, call.T),), call.unbatched)  # (B, H, T)
    return out


def _work(dtype) -> type:
    """The working precision: float64 for float64, float32 for every other dtype."""
    return np.float64 if dtype == np.float64 else np.float32


def _textbook(q, k, v, mask, options: dict, block_q: int, block_k: int) -> tuple:
    """``attention`` without ``fast``, (out, lse): the recurrence, tile by tile, as NumPy's
    page runs it. The tiles are cut on the host, in NumPy (``_tile``), every head's rows stacked and
    padded to a power of two (at least 8) of rows, of D and of E (zeros, blocked or cut
    off), so that a few tile shapes serve every call, each one compiled program."""
    # 0. Validate with the input contract every impl shares; add the batch axis.
    sinks, alibi = options.pop("sinks"), options.pop("alibi_slopes")
    q, k, v, mask, sinks, alibi = (
        None if x is None else _host_array(x) for x in (q, k, v, mask, sinks, alibi)
    )
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        **options,
        unsupported={"dropout_p": "jax-flash is blockwise attention without dropout"},
        tiles={"block_q": block_q, "block_k": block_k},
        sinks=sinks,
        alibi_slopes=alibi,
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = np.broadcast_to(mask.reshape(call.mask_shape), (b, h, call.T, call.S))
    B, H, T, S, E = call.B, call.H, call.T, call.S, call.E
    work = np.float64 if q.dtype == np.float64 else np.float32  # float16 is computed in float32
    R, Ep = _pow2(B * H), _pow2(E)  # rows of every head, and E, padded
    out = np.empty((B, H, T, E), dtype=q.dtype)  # (B, H, T, E)
    lse = np.empty((B, H, T), dtype=work)  # (B, H, T)

    for t0 in range(0, T, block_q):
        t1 = min(t0 + block_q, T)
        m = np.full((R, block_q, 1), -np.inf, dtype=work)  # (B·H, Tb, 1)
        l = np.zeros((R, block_q, 1), dtype=work)  # (B·H, Tb, 1)
        a = np.zeros((R, block_q, Ep), dtype=work)  # (B·H, Tb, E)
        for s0 in range(0, S, block_k):
            # Steps 1-4's inputs on the tile; None where no query of the block may see a
            # key of it (skipped).
            tile = _tile(q, k, v, mask, alibi, call, (t0, block_q, s0, block_k), work)
            if tile is not None:
                m, l, a = online_softmax_step(m, l, a, *tile, call.scale, call.softcap)
        sink = None
        if sinks is not None:
            sink = np.broadcast_to(sinks.astype(work).reshape(1, H), (B, H))  # (B, H)
            sink = _padded(sink.reshape(B * H, 1, 1), R)  # (B·H, 1, 1)
        a, lse_b = (np.asarray(x) for x in normalised(m, l, a, sink))  # (B·H, Tb, E), (B·H, Tb)
        out[:, :, t0:t1] = a[: B * H, : t1 - t0, :E].reshape(B, H, t1 - t0, E)  # rounded once
        lse[:, :, t0:t1] = lse_b[: B * H, : t1 - t0].reshape(B, H, t1 - t0)  # (B, H, Tb)
    if call.unbatched:
        out, lse = out[0], lse[0]  # (H, T, E), (H, T)
    return jax.device_put(out), jax.device_put(lse)


@jax.jit
def online_softmax_step(m, l, a, q_b, k_b, v_b, bias, allowed, scale, softcap):
    """Steps 1-5 and 7 on one tile: (m, l, a) (B·H, Tb, ·) after its keys. q_b (B·H, Tb,
    D), k_b (B·H, Sb, D) and v_b (B·H, Sb, E) in the working precision, bias (B·H, Tb, Sb)
    what ALiBi and a float mask add, allowed (B·H, Tb, Sb) bool."""
    # 1. Scores, and 2. the scale, so that their spread does not grow with D.
    x = jnp.einsum("rtd,rsd->rts", q_b, k_b, precision=HIGHEST) * scale  # (B·H, Tb, Sb)
    # 3. Softcap: squash the scores smoothly into (-softcap, softcap); a subnormal
    # x / softcap keeps the score (flash_tiles.py: huge softcaps).
    if softcap is not None:
        ratio = x / softcap  # (B·H, Tb, Sb)
        capped = softcap * jnp.tanh(ratio)  # (B·H, Tb, Sb)
        x = jnp.where(jnp.abs(ratio) < jnp.finfo(x.dtype).tiny, x, capped)  # (B·H, Tb, Sb)
    # 4. Mask: ALiBi's bias and a float mask are added; every key a query may not see
    # gets -inf.
    x = jnp.where(allowed, x + bias, -jnp.inf)  # (B·H, Tb, Sb)

    # 5. Softmax, online: the new running maximum, and α to move l and a onto it.
    # A row that has seen only blocked keys takes its exponents against 0.
    m_new = jnp.maximum(m, x.max(axis=-1, keepdims=True))  # (B·H, Tb, 1)
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B·H, Tb, 1)
    alpha = jnp.exp(m - m_safe)  # (B·H, Tb, 1)
    p = jnp.exp(x - m_safe)  # (B·H, Tb, Sb)
    l = alpha * l + p.sum(axis=-1, keepdims=True)  # (B·H, Tb, 1)

    # 7. Weighted sum of the values, accumulated unnormalised.
    a = alpha * a + jnp.einsum("rts,rse->rte", p, v_b, precision=HIGHEST)  # (B·H, Tb, E)
    return m_new, l, a


@jax.jit
def normalised(m, l, a, sink):
    """(a / l, m + log l), after the sink (B·H, 1, 1) if any joins as one more key of the
    recurrence whose value row is 0 (a row that saw no key gets none, and returns 0): the
    output and each row's log-sum-exp, (B·H, Tb)."""
    if sink is not None:
        x = jnp.where(l > 0, sink, -jnp.inf)  # (B·H, Tb, 1)
        m_new = jnp.maximum(m, x)  # (B·H, Tb, 1)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B·H, Tb, 1)
        alpha = jnp.exp(m - m_safe)  # (B·H, Tb, 1)
        p = jnp.exp(x - m_safe)  # (B·H, Tb, 1)
        l = alpha * l + p  # (B·H, Tb, 1)
        # p · (its value row, 0): NaN for a NaN or +inf sink, as the row must be.
        a = alpha * a + p * 0.0  # (B·H, Tb, E)
        m = m_new
    return a / jnp.where(l > 0, l, 1.0), running_lse(m, l)[..., 0]  # (B·H, Tb, E), (B·H, Tb)


def _tile(q, k, v, mask, alibi, call, span, work):
    """Steps 1-4's inputs on tile (t0, Tb, s0, Sb), on the host: (q_b, k_b, v_b, bias,
    allowed) as ``online_softmax_step`` takes them, every head's rows stacked and padded
    (``_textbook``), or None where no query of the block may see a key of the tile."""
    t0, Tb, s0, Sb = span
    t = np.arange(t0, t0 + Tb)[:, None]  # (Tb, 1)
    s = np.arange(s0, s0 + Sb)[None, :]  # (1, Sb)
    allowed = (t < call.T) & (s < call.S)  # (Tb, Sb): the padding sees no key
    # The core page's ``visible``, on NumPy positions (the tiles are cut on the host).
    offset = 0 if call.causal_alignment == "top_left" else call.S - call.T
    t = t + offset  # (Tb, 1): each query's diagonal
    allowed = visible(allowed, t, s, call.is_causal, call.window, call.chunk_size)  # (Tb, Sb)
    if not allowed.any():
        return None
    B, H, T, S, G = call.B, call.H, call.T, call.S, call.G
    rows, keys = slice(t0, min(t0 + Tb, T)), slice(s0, min(s0 + Sb, S))
    # Grouped-query attention: query head h reads key/value head h // G.
    q_b = q[:, :, rows].astype(work)  # (B, H, Tb, D)
    k_b = np.repeat(k[:, :, keys].astype(work), G, axis=1)  # (B, H, Sb, D)
    v_b = np.repeat(v[:, :, keys].astype(work), G, axis=1)  # (B, H, Sb, E)
    bias = np.zeros((1, 1, Tb, Sb), dtype=work)  # (1, 1, Tb, Sb)
    if alibi is not None:
        slopes = alibi.astype(work).reshape(-1, H, 1, 1)  # (B|1, H, 1, 1)
        bias = bias - slopes * np.abs(t + S - T - s).astype(work)  # (B|1, H, Tb, Sb)
    if mask is not None:
        m_b = np.zeros(mask.shape[:2] + (Tb, Sb), dtype=mask.dtype)  # (B|1, H|1, Tb, Sb)
        m_b[:, :, : rows.stop - t0, : keys.stop - s0] = mask[:, :, rows, keys]
        if m_b.dtype == np.bool_:
            allowed = allowed & m_b  # (B|1, H|1, Tb, Sb)
        else:
            m_b = m_b.astype(work)  # (B|1, H|1, Tb, Sb)
            allowed = allowed & (m_b != -np.inf)  # (B|1, H|1, Tb, Sb)
            bias = bias + np.where(m_b == -np.inf, 0.0, m_b)  # (B|1, H|1, Tb, Sb)
    bias = np.broadcast_to(bias, (B, H, Tb, Sb))  # (B, H, Tb, Sb)
    allowed = np.broadcast_to(allowed, (B, H, Tb, Sb))  # (B, H, Tb, Sb)
    # A value row no query of the tile may see (per head) is replaced by 0: its weight 0
    # times a NaN held there would be NaN.
    used = allowed[..., : keys.stop - s0].any(axis=-2)[..., None]  # (B, H, Sb, 1)
    v_b = np.where(used, v_b, 0.0).astype(work)  # (B, H, Sb, E)
    R, Dp, Ep = _pow2(B * H), _pow2(call.D), _pow2(call.E)
    return (
        _padded(q_b.reshape(B * H, -1, call.D), R, Tb, Dp),  # (B·H, Tb, D), padded
        _padded(k_b.reshape(B * H, -1, call.D), R, Sb, Dp),  # (B·H, Sb, D), padded
        _padded(v_b.reshape(B * H, -1, call.E), R, Sb, Ep),  # (B·H, Sb, E), padded
        _padded(bias.reshape(B * H, Tb, Sb), R),  # (B·H, Tb, Sb), padded
        _padded(allowed.reshape(B * H, Tb, Sb), R),  # (B·H, Tb, Sb), padded blocked
    )


def _pow2(n: int) -> int:
    """n rounded up to a power of two, at least 8: the sizes of a tile's padded axes."""
    return max(8, 1 << (n - 1).bit_length())


def _padded(x: np.ndarray, *sizes: int) -> np.ndarray:
    """x zero-padded (False for bool) at the end of its first axes up to ``sizes``."""
    widths = [(0, n - m) for n, m in zip(sizes, x.shape)] + [(0, 0)] * (x.ndim - len(sizes))
    return np.pad(x, widths)


def attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    d_out: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
    block_q: int = 512,
    block_k: int = 256,
    d_lse: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """Gradients of ``attention`` by FlashAttention-2's blockwise backward (module
    docstring; the derivation is NumPy's ``flash.py``'s).

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes, block_q, block_k: as for ``attention`` (no dropout:
        its gradient needs the forward's random draw).
      d_out: ∂L/∂out, shaped like the output, (B, H, T, E) or (H, T, E), in q's dtype.
      dropout_p: must be 0.
      d_lse: ∂L/∂lse for L = Σ d_out · out + Σ d_lse · lse (SPEC §21.7), shaped like the
        lse, (B, H, T) or (H, T), in its dtype (float64 for float64 q, else float32):
        Δ ← Δ − d_lse, as NumPy's ``flash.py`` derives. None: 0.

    Returns:
      (dq, dk, dv) shaped and typed like q, k, v, for L = Σ d_out · attention(q, k, v,
      ...); with a floating mask, (dq, dk, dv, dmask), dmask shaped and typed like the
      mask: ∂L/∂mask, summed over the axes the mask was broadcast along. With sinks,
      dsinks (H,) typed like sinks comes last.
    """
    # 0. Validate as the forward does, and d_out against the output's shape and dtype.
    options = dict(is_causal=is_causal, scale=scale, causal_alignment=causal_alignment)
    options.update(window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks)
    options.update(chunk_size=chunk_size, alibi_slopes=alibi_slopes)
    given = None if mask is None else np.shape(mask)  # dmask is shaped like this
    call, (q, k, v, mask, sinks, alibi), static = _prepare(
        q, k, v, mask, options, block_q, block_k, d_out=d_out, d_lse=d_lse
    )
    float_mask = mask is not None and not call.mask_is_bool
    if call.T == 0 or call.S == 0:
        # Nothing attends anything: every gradient is exactly 0.
        grads = tuple(np.zeros(x.shape, x.dtype) for x in (q, k, v))
        grads += (np.zeros(mask.shape, mask.dtype),) if float_mask else (None,)  # the mask's
        grads += (None if sinks is None else np.zeros(sinks.shape, sinks.dtype),)  # (H,)
    else:
        grads = _flash_vjp(q, k, v, mask, sinks, static.pop("d_out"), alibi=alibi, **static)
    # The bucket's padded rows and keys cut off: (B, H, T, D), (B, K, S, D), (B, K, S, E).
    T, S, unbatched = call.T, call.S, call.unbatched
    grads = (
        _result(grads[0], ((2, T),), unbatched),  # (B, H, T, D)
        _result(grads[1], ((2, S),), unbatched),  # (B, K, S, D)
        _result(grads[2], ((2, S),), unbatched),  # (B, K, S, E)
        _result(grads[3], ((2, T), (3, S)), False, given) if float_mask else None,  # the mask's
        None if sinks is None else _result(grads[4], (), False),  # (H,)
    )
    return tuple(g for g in grads if g is not None)
