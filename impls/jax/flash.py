"""Blockwise (FlashAttention-style) attention in JAX, compiled: never a T × S matrix.

    out = softmax(mask(softcap(scale · q kᵀ))) v

The core page builds every score at once, a (B, H, T, S) array: 16 GiB in float32 for
16 heads of 16384 tokens. Yet an output row is a weighted average of value rows, which
can be built a block of keys at a time if the softmax can: the *online softmax*. For one
query row with scores x_1 … x_S and any constant m,

    out = Σ_s exp(x_s − m) v_s / Σ_s exp(x_s − m)

m cancels; it is there so that exp() cannot overflow, which needs m ≥ every x_s. Walk the
keys in blocks and keep three running quantities:

    m   the largest score seen so far                  the running maximum
    l   Σ exp(x_s − m) over the keys seen              the running sum
    a   Σ exp(x_s − m) v_s over the keys seen          the unnormalised output

A new block of scores x raises the maximum to m' = max(m, max_s x_s); α = exp(m − m') ≤ 1
moves what was summed against m onto m':

    l' = α · l + Σ_{s in block} exp(x_s − m')
    a' = α · a + Σ_{s in block} exp(x_s − m') v_s

and after the last block out = a / l. The rescaling is exact: exp(x − m) · exp(m − m')
= exp(x − m'), so l and a end as the two sums above with m the row's true maximum; only
the rounding differs from the core page. ``online_softmax_row`` is this recurrence for
one row; ``attention`` runs it, with the same names, on tiles of Tb rows and Sb keys
(``online_softmax_step``). NumPy's docs/walkthrough/flash.md follows the worked example
through it, tile by tile.

Blocked keys have score −inf. A row that has seen only blocked keys has m = −inf, and
exp(x − m) would be exp(−inf + inf) = NaN: its exponents are taken against 0 instead, so
its weights are 0, and a row that never sees a key returns exactly 0, as the core page's.

The fast path. ``attention(..., fast=True)``, what the jax-flash backend runs, is the same
recurrence compiled once for many calls, in ``_flash`` below and the tiles of
``flash_tiles.py``. What follows describes it.

Compiled once per shape bucket. XLA needs every array's shape at compile time, and
compiling costs far more than running at the sizes tests and short prompts use (a
forward program about 0.3 s on a CPU, a backward one 0.7 s). So T and S are padded up to
a few buckets (``bucket``: a power of two of tiles) before the compiled program, and
their true values are runtime values of it, as FlashAttention's variable-length entry
points take their lengths as data: padded keys are masked like blocked ones, padded
query rows see no key and are cut off at the end, and tiles wholly past the true lengths
are never visited. The query blocks are a ``lax.fori_loop`` writing into the output, and
the key blocks an inner ``lax.fori_loop`` carrying (m, l, a). The options' values are not
compiled in either: the scale, the softcap, the window's sides (and causality, its right
side capped at 0), the chunk size and the diagonal's offset are runtime values, so one
program serves them all and only which of them are present specialises it. The loop
bounds are computed from them at run time, as they are from the query block's index.

Sinks. An attention sink (one logit per query head, gpt-oss) is one more term of the row
sum l with no value row: after the last key block it is folded in like one more block,
m' = max(m, sink), l' = exp(m - m') · l + exp(sink - m'), a' = exp(m - m') · a, so a sink
of 1e4 cannot overflow either. A row with no key keeps l = 0 and returns 0. Its gradient
is −Σ_t exp(sink − lse[t]) · Δ[t], from the backward's own lse and Δ.

Skipping blocks. Causal and window masks are bands around the diagonal, so for query block
i only the key blocks [first(i), last(i)) can hold a visible key: the inner loop runs
over just those (``fori_loop`` accepts traced bounds; it becomes a while loop). That
halves the work under a causal mask, which is where fused kernels get their causal
speed-up. Of those blocks, the ones wholly inside the band need no masking at all, so
the key loop is three loops: the blocks the band cuts on the left (a window), those
inside it (no mask computed), those it cuts on the right (the causal diagonal). (A
user-supplied mask is an input: its tiles are sliced, and a fully blocked tile is still
computed.) Chunked local attention (Llama 4) narrows [first(i), last(i)) to the chunks
the block's rows lie in, so key blocks wholly outside them are skipped; only a block
within one chunk has tiles that need no masking.

ALiBi. Its bias −slope · |t + S − T − s| depends only on the query's and the key's
positions, so each score tile adds its own slice of it, computed there from the tile's
row and column indices: no (T, S) bias is ever built.

The backward pass. ``attention_vjp`` is FlashAttention-2's backward, the algorithm
NumPy's ``flash.py`` derives: for each query block, the forward over its key
blocks gives each row's log-sum-exp lse = m + log l and its output O, hence
Δ = rowsum(dO ⊙ O); then a second walk over the same key blocks recomputes each tile's
weights as P = exp(Z − lse), forms dZ = P ⊙ (dO·Vᵀ − Δ), adds dZ·K to the block's dQ,
and adds dZᵀ·Q and Pᵀ·dO to dK and dV of the key block, in place. No (T, S) array, no
``jax.vjp`` through the loops (which would store every tile's weights), and the same
block skipping as the forward. ``ring.py``'s backward runs the same tile algorithm in a
body of its own: there the positions and options are traced values travelling with the
slices, where this page's band is static and skips blocks by loop bounds.

Memory. No input is copied whole (except to pad T or S up to their bucket): tiles
are sliced from the inputs and cast to the working precision tile by tile, and each
finished query block is written in place into the output. Beyond inputs and output the
loop holds one (B, K, G·Tb, Sb) score tile, its exponentials, and (B, K, G·Tb, E)
accumulators: with the defaults and B=1, H=8, a few MiB, whatever T and S are. The
backward holds a few tiles more, and dK and dV in the working precision (the outputs
themselves, for float32 and float64).

Speed, on a CPU. XLA hands the two products of a tile to its matmul library and fuses
the max, exp and sum passes into a few loops over the tile. Larger tiles amortise the
loop overhead and make bigger matmuls; smaller ones stay in cache and waste less on the
causal diagonal (a query block of Tb rows computes about Tb²/2 masked scores there).
512 × 256 (queries × keys) was fastest on 2 cores in float32, causal and not (T = 4096,
measured in one process: 256 × 256 took 1.7× as long non-causal, 1.5× causal). Precision is
HIGHEST, which the CPU honours anyway (it has no reduced-precision float32 matmul), and
which keeps float32 results bitwise stable.

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

The pages beside it: ``flash_tiles.py`` (one tile's work, which the loops here call),
``flash_packed.py`` (packed documents, SPEC §18) and ``flash_paged.py`` (a paged KV
cache, §19), each walking the same tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import contract
from .flash_tiles import (
    HIGHEST,
    Tiles,
    add_sink,
    backward_tile,
    bucket_count,
    log_sum_exp,
    scale_split,
)


def online_softmax_row(x: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """The recurrence for one query row: scores x (S,), values v (S, E), ``block`` keys at
    a time (the first block holding a visible key: ``online_softmax_step`` lifts that)."""
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
) -> jax.Array:
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

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    options = dict(is_causal=is_causal, scale=scale, causal_alignment=causal_alignment)
    options.update(window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks)
    options.update(chunk_size=chunk_size, alibi_slopes=alibi_slopes)
    if not fast:
        return _textbook(q, k, v, mask, options, block_q, block_k)
    # 0. Validate: the input contract every impl shares (the contract package) checks shapes,
    # dtypes and options, and names the argument, the expected shape and what was given.
    call, (q, k, v, mask, sinks, alibi), static = _prepare(q, k, v, mask, options, block_q, block_k)
    if call.T == 0 or call.S == 0:
        # Nothing to tile: with T = 0 there is no query, and with S = 0 every query has
        # no key, so every output row is exactly 0, whatever q holds.
        out = np.zeros((call.B, call.H, call.T, call.E), dtype=q.dtype)  # (B, H, T, E)
    else:
        out = _flash(q, k, v, mask, sinks, alibi=alibi, **static)  # (B, H, Tq, E)
    return _result(out, ((2, call.T),), call.unbatched)  # (B, H, T, E), padding cut off


def _textbook(q, k, v, mask, options: dict, block_q: int, block_k: int) -> jax.Array:
    """``attention`` without ``fast``: the recurrence, tile by tile, as NumPy's page runs
    it. The tiles are cut on the host, in NumPy (``_tile``), every head's rows stacked and
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
        a = np.asarray(normalised(m, l, a, sink))  # (B·H, Tb, E)
        out[:, :, t0:t1] = a[: B * H, : t1 - t0, :E].reshape(B, H, t1 - t0, E)  # rounded once
    return jax.device_put(out[0] if call.unbatched else out)


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
    """a / l, after the sink (B·H, 1, 1) if any joins as one more key of the recurrence
    whose value row is 0 (a row that saw no key gets none, and returns 0)."""
    if sink is not None:
        x = jnp.where(l > 0, sink, -jnp.inf)  # (B·H, Tb, 1)
        m_new = jnp.maximum(m, x)  # (B·H, Tb, 1)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B·H, Tb, 1)
        alpha = jnp.exp(m - m_safe)  # (B·H, Tb, 1)
        p = jnp.exp(x - m_safe)  # (B·H, Tb, 1)
        l = alpha * l + p  # (B·H, Tb, 1)
        # p · (its value row, 0): NaN for a NaN or +inf sink, as the row must be.
        a = alpha * a + p * 0.0  # (B·H, Tb, E)
    return a / jnp.where(l > 0, l, 1.0)  # (B·H, Tb, E)


def _tile(q, k, v, mask, alibi, call, span, work):
    """Steps 1-4's inputs on tile (t0, Tb, s0, Sb), on the host: (q_b, k_b, v_b, bias,
    allowed) as ``online_softmax_step`` takes them, every head's rows stacked and padded
    (``_textbook``), or None where no query of the block may see a key of the tile."""
    t0, Tb, s0, Sb = span
    t = np.arange(t0, t0 + Tb)[:, None]  # (Tb, 1)
    s = np.arange(s0, s0 + Sb)[None, :]  # (1, Sb)
    allowed = (t < call.T) & (s < call.S) & _visible(call, t, s)  # (Tb, Sb)
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


def _visible(call, t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Which keys s each query t may see by position (NumPy's ``flash.visible``): the
    causal triangle, the window's sides and the chunks, from t's aligned diagonal."""
    t = t + (0 if call.causal_alignment == "top_left" else call.S - call.T)  # (Tb, 1)
    allowed = np.ones(np.broadcast_shapes(t.shape, s.shape), dtype=bool)  # (Tb, Sb)
    if call.is_causal:
        allowed &= s <= t
    left, right = call.window if call.window is not None else (None, None)
    if left is not None:
        allowed &= s >= t - left
    if right is not None:
        allowed &= s <= t + right
    if call.chunk_size is not None:
        allowed &= t // call.chunk_size == s // call.chunk_size
    return allowed


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
) -> tuple[jax.Array, ...]:
    """Gradients of ``attention`` by FlashAttention-2's blockwise backward (module
    docstring; the derivation is NumPy's ``flash.py``'s).

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes, block_q, block_k: as for ``attention`` (no dropout:
        its gradient needs the forward's random draw).
      d_out: ∂L/∂out, shaped like the output, (B, H, T, E) or (H, T, E), in q's dtype.
      dropout_p: must be 0.

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
        q, k, v, mask, options, block_q, block_k, d_out=d_out
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


def _prepare(q, k, v, mask, options: dict, block_q: int, block_k: int, d_out=None):
    """Step 0 and the shape bucket: (the checked call, the batched q, k, v and the mask as
    (B|1, H|1, T|1, S|1), padded to the bucket, the sinks (H,) and ALiBi's slopes (H,) or
    (B, H), the keyword arguments of ``_flash``, with ``d_out`` batched and padded too)."""
    sinks, alibi = options.pop("sinks"), options.pop("alibi_slopes")
    # On the host, the reshapes and pads below are NumPy's (``_on_host``), on arrays of
    # the dtypes JAX gives them (float64 only with jax_enable_x64).
    host = _on_host(q, k, v, mask, sinks, alibi, d_out)
    q, k, v, mask, sinks, alibi, d_out = (
        None if x is None else _host_array(x) if host else jnp.asarray(x)
        for x in (q, k, v, mask, sinks, alibi, d_out)
    )
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        **options,
        unsupported={"dropout_p": "jax-flash is blockwise attention without dropout"},
        tiles={"block_q": block_q, "block_k": block_k},
        d_out=d_out,
        sinks=sinks,
        alibi_slopes=alibi,
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
        d_out = None if d_out is None else d_out[None]  # (1, H, T, E)
    if mask is not None:
        # Keep the mask as small as it was given, (B|1, H|1, T|1, S|1): broadcasting it
        # to (B, H, T, S) here would build the very T × S array this module avoids.
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
    if call.T == 0 or call.S == 0:
        return call, (q, k, v, mask, sinks, alibi), {}
    # The shape bucket: T and S padded up (``bucket``), so that one compiled program
    # serves every length of a bucket; the true lengths are runtime values of it.
    Tb, Tq = bucket(call.T, block_q)
    Sb, Sk = bucket(call.S, block_k)
    q = _pad(q, 2, Tq)  # (B, H, Tq, D)
    k, v = _pad(k, 2, Sk), _pad(v, 2, Sk)  # (B, K, Sk, D), (B, K, Sk, E)
    if mask is not None:
        # Padded only along the axes it has, not those it broadcasts along.
        mask = _pad(_pad(mask, 2, Tq), 3, Sk)  # (B|1, H|1, Tq|1, Sk|1)
    static = dict(opts=_traced_options(call, q.dtype, Tq), Tb=Tb, Sb=Sb)
    if d_out is not None:
        static["d_out"] = _pad(d_out, 2, Tq)  # (B, H, Tq, E)
    return call, (q, k, v, mask, sinks, alibi), static


def bucket(n: int, block: int) -> tuple[int, int]:
    """A length's tile and shape bucket, (tile, padded length): the tile is the block, or
    n's power of two where that is smaller, and the tiles are counted up to a bucket
    (``flash_tiles.bucket_count``). A run over many lengths compiles a few programs, not
    one per length; a padded tile is never visited (``Tiles``), so the padding costs
    memory, not work."""
    tile = min(block, 1 << (n - 1).bit_length())
    return tile, tile * bucket_count(-(-n // tile))


def _on_host(*arrays) -> bool:
    """Whether every array is on the host: NumPy's (or a list), or a JAX array on the CPU.
    There the conversions, pads, cuts and reshapes around the compiled program are
    NumPy's: done by JAX outside a compiled program, each would be a small program
    compiled for every shape (60-130 ms measured), the very cost the buckets save.
    Elsewhere (an accelerator, or inside the caller's own trace) they are JAX's, and the
    bytes stay on their device."""
    for x in arrays:
        if isinstance(x, jax.core.Tracer):
            return False
        if isinstance(x, jax.Array) and {d.platform for d in x.devices()} != {"cpu"}:
            return False
    return True


def _host_array(x) -> np.ndarray:
    """x as a NumPy array of the dtype ``jnp.asarray`` would give it."""
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def _pad(x, axis: int, n: int):
    """x zero-padded at the end of ``axis`` up to length n; an axis of length 1 (one the
    mask broadcasts along) is left as it is."""
    if x.shape[axis] in (1, n):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return (np.pad if isinstance(x, np.ndarray) else jnp.pad)(x, widths)


def _result(x, cuts: tuple, unbatched: bool, shape: tuple | None = None):
    """A padded, batched result as the caller gets it, a JAX array: cut to the true
    lengths (``cuts``: (axis, n) pairs; an axis of length 1, a broadcast one, is kept),
    unbatched, and reshaped to ``shape`` if given; on the host with NumPy (``_on_host``)."""
    index = [slice(None)] * x.ndim
    for axis, n in cuts:
        if x.shape[axis] not in (1, n):
            index[axis] = slice(0, n)
    if all(i == slice(None) for i in index) and not unbatched and shape is None:
        return jax.device_put(x) if isinstance(x, np.ndarray) else x
    host = _on_host(x)
    x = (np.asarray(x) if host else x)[tuple(index)]
    x = x[0] if unbatched else x
    x = x if shape is None else x.reshape(shape)
    return jax.device_put(x) if host else x


def _traced_options(call: contract.Checked, dtype, Tq: int) -> dict:
    """The options as runtime values, so that one compiled program serves every scale,
    softcap, window, chunk size and alignment of a shape bucket: which options are present
    (None where not) is all the program is specialised on. S is always present; T only
    where it is shorter than the bucket's Tq, as its padded rows are masked in every tile
    (a key's padding, only in the tiles that hold some). Causality is the window's right side
    capped at 0; a side or chunk wider than T + S reaches past every key, so it is cut to
    that, which keeps the positions it adds within int32. The scale comes in the two parts
    the tiles use (``flash_tiles.scale_split``), and whole for dq."""
    work = np.float64 if dtype == jnp.float64 else np.float32
    T, S = call.T, call.S
    left, right = call.window if call.window is not None else (None, None)
    if call.is_causal:
        right = 0 if right is None else min(right, 0)
    folded, post = scale_split(call.scale, work)

    def cut(n):
        return None if n is None else np.int32(min(n, T + S))

    return dict(
        offset=np.int32(0 if call.causal_alignment == "top_left" else S - T),
        left=cut(left),
        right=cut(right),
        chunk=cut(call.chunk_size),
        softcap=None if call.softcap is None else work(call.softcap),
        folded=work(folded),
        post=None if post is None else work(post),
        scale=work(call.scale),
        T=None if T == Tq else np.int32(T),
        S=np.int32(S),
    )


def _tiles(q, k, v, mask, alibi, opts: dict, Tb: int, Sb: int) -> Tiles:
    """The call's tiles, its options traced (``_traced_options``)."""
    window = (opts["left"], opts["right"])
    scale = (opts["folded"], opts["post"])
    return Tiles(
        q, k, v, mask, opts["offset"], window, opts["softcap"], opts["chunk"], Tb, Sb, alibi,
        scale, (opts["T"], opts["S"]),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("Tb", "Sb"))
def _flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array | None,
    *,
    opts: dict,
    Tb: int,
    Sb: int,
    alibi: jax.Array | None = None,
) -> jax.Array:
    """Steps 1-7 on checked, batched inputs; compiled once per shape, dtype, tile size and
    set of options present (their values are traced: ``_traced_options``)."""
    B, H, T, _ = q.shape
    E = v.shape[-1]
    out_dtype = q.dtype
    tiles = _tiles(q, k, v, mask, alibi, opts, Tb, Sb)

    def query_block(i: jax.Array, out: jax.Array) -> jax.Array:
        # 1. Scores: every query of the block against every key, one key block at a time
        # (Tiles.scores). Every tile's product starts from this query tile, so
        # 2. Scale, so that the scores' spread does not grow with the head size D, is
        # applied to it once, here: Tb·D multiplies instead of Tb·S (a scale above 1 in
        # part, the rest an exact power of two on the products: flash_tiles.py).
        qi = tiles.queries(i)  # (B, K, G·Tb, D)
        # Steps 3-5 and 7, key block by key block (Tiles.online_softmax).
        m, l, acc = tiles.online_softmax(qi, i)
        if sinks is not None:
            _, l, acc = add_sink(m, l, acc, tiles.sink_rows(sinks))
        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        acc = acc.reshape(B, H, Tb, E).astype(out_dtype)  # (B, H, Tb, E)
        return lax.dynamic_update_slice_in_dim(out, acc, i * Tb, axis=2)  # (B, H, Tp, E)

    out = jnp.zeros((B, H, tiles.Tp, E), dtype=out_dtype)  # (B, H, Tp, E)
    out = lax.fori_loop(0, tiles.nT_real, query_block, out)  # (B, H, Tp, E)
    return out[:, :, :T]  # (B, H, T, E), the padded rows cut off


@functools.partial(jax.jit, static_argnames=("Tb", "Sb"))
def _flash_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array | None,
    d_out: jax.Array,
    *,
    opts: dict,
    Tb: int,
    Sb: int,
    alibi: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """The backward on checked, batched inputs: (dq, dk, dv, dmask, dsinks), dmask shaped
    (B|1, H|1, T|1, S|1) with a float mask and dsinks (H,) with sinks, else None;
    compiled once per shape, dtype, tile size and set of options present."""
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    tiles = _tiles(q, k, v, mask, alibi, opts, Tb, Sb)
    work, G = tiles.work, tiles.G
    float_mask = mask is not None and mask.dtype != jnp.bool_
    d_out = jnp.pad(d_out, ((0, 0), (0, 0), (0, tiles.Tp - T), (0, 0)))  # (B, H, Tp, E)

    def query_block(i: jax.Array, grads: tuple) -> tuple:
        dq, dk, dv, dm, ds = grads
        # Forward steps 1-5 and 7 for this block, as in ``attention``: its rows' output
        # O and log-sum-exp, the one number per row the backward needs. A row with no key
        # has l = 0: its lse is +inf, so that its weights exp(Z − lse) are all 0. A row
        # that read a +inf score has l = +inf: its lse is NaN, so that every weight of it
        # is NaN, as in the forward (SPEC §4.1), not only its +inf ones.
        qi = tiles.queries(i)  # (B, K, G·Tb, D)
        m, l, acc = tiles.online_softmax(qi, i)
        if sinks is not None:
            sink = tiles.sink_rows(sinks)  # (B, K, G·Tb)
            m, l, acc = add_sink(m, l, acc, sink)
        some = l > 0  # (B, K, G·Tb)
        o = acc / jnp.where(some, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        lse = log_sum_exp(m, l)  # (B, K, G·Tb)

        # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O): one dot product per row.
        do = lax.dynamic_slice_in_dim(d_out, i * Tb, Tb, axis=2).astype(work)
        do = do.reshape(B, K, G * Tb, E)  # (B, K, G·Tb, E)
        delta = (do * o).sum(axis=-1)  # (B, K, G·Tb)

        # 5'. Sinks: dsink = −Σ_t p_sink · Δ, p_sink = exp(sink − lse) (0 with no key).
        if sinks is not None:
            p_sink = jnp.where(some, jnp.exp(sink - lse), 0.0)  # (B, K, G·Tb)
            d_rows = -(p_sink * delta).reshape(B, K, G, Tb)  # (B, K, G, Tb)
            ds = ds + d_rows.sum(axis=(0, 3)).reshape(H)  # (H,)

        # The backward over the block's key blocks; dq gets the scale once, here.
        dq_i = jnp.zeros((B, K, G * Tb, D), dtype=work)  # (B, K, G·Tb, D)
        body = functools.partial(backward_tile, tiles, i, qi, do, lse, delta)
        dq_i, dk, dv, dm = tiles.walk(i, body, (dq_i, dk, dv, dm))
        dq_i = (dq_i * opts["scale"]).reshape(B, H, Tb, D).astype(q.dtype)  # (B, H, Tb, D)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * Tb, axis=2)  # (B, H, Tp, D)
        return dq, dk, dv, dm, ds

    grads = (
        jnp.zeros((B, H, tiles.Tp, D), dtype=q.dtype),  # dq: (B, H, Tp, D)
        jnp.zeros((B, K, tiles.Sp, D), dtype=work),  # dk: (B, K, Sp, D)
        jnp.zeros((B, K, tiles.Sp, E), dtype=work),  # dv: (B, K, Sp, E)
        jnp.zeros(tiles.mask.shape, dtype=work) if float_mask else None,  # dmask, padded
        None if sinks is None else jnp.zeros((H,), dtype=work),  # dsinks: (H,)
    )
    dq, dk, dv, dm, ds = lax.fori_loop(0, tiles.nT_real, query_block, grads)
    out = (
        dq[:, :, :T],  # (B, H, T, D)
        dk[:, :, :S].astype(q.dtype),  # (B, K, S, D)
        dv[:, :, :S].astype(q.dtype),  # (B, K, S, E)
    )
    if float_mask:
        t = T if mask.shape[2] != 1 else 1
        s = S if mask.shape[3] != 1 else 1
        out += (dm[:, :, :t, :s].astype(mask.dtype),)  # (B|1, H|1, T|1, S|1)
    else:
        out += (None,)
    return out + (None if sinks is None else ds.astype(sinks.dtype),)  # dsinks: (H,)
