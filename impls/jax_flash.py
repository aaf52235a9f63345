"""Blockwise (FlashAttention-style) attention in JAX, compiled: never a T × S matrix.

The reference (``numpy_attention``) builds every score at once: a (B, H, T, S) array, 16
GiB in float32 for one 16384-token batch of 16 heads (16 · 16384² · 4 bytes). Yet each
output row only needs a weighted average of value rows, and an average can be accumulated
a block of keys at a time, if the softmax can be too. The *online softmax* makes it so.

The online softmax. For one query row with scores x_1 … x_S, the softmax-weighted sum is

    out = Σ_s exp(x_s - m) v_s / Σ_s exp(x_s - m)        for any constant m

The constant cancels between numerator and denominator; it is there only so that exp()
cannot overflow, which needs m >= max_s x_s. Split the keys into blocks and keep, after
block j, three running quantities:

    m_j = max of all scores seen so far                          the running row max
    l_j = Σ_{s seen} exp(x_s - m_j)                              the running row sum
    a_j = Σ_{s seen} exp(x_s - m_j) v_s                          the unnormalised output

A new block with scores x_s (s in block j+1) updates them as

    m_{j+1} = max(m_j, max_{s in block} x_s)
    α       = exp(m_j - m_{j+1})                                 <= 1
    l_{j+1} = α · l_j + Σ_{s in block} exp(x_s - m_{j+1})
    a_{j+1} = α · a_j + Σ_{s in block} exp(x_s - m_{j+1}) v_s

and after the last block out = a / l. Why the rescaling is exact, not an approximation:
every term of l_j and a_j carries the factor exp(-m_j), and exp(x_s - m_j) · exp(m_j -
m_{j+1}) = exp(x_s - m_{j+1}) is an identity, so multiplying by α re-bases the old terms
onto the new maximum. After the last block l and a are exactly the two sums of the formula
above with m = the true row max; only floating-point rounding differs from the reference
(different summation order). Because m only grows, α <= 1 and nothing overflows.

Blocked keys. A key s the query may not see has score -inf. If a row has seen only blocked
keys, m_j = -inf and exp(x - m_j) would be exp(-inf + inf) = NaN; so the exponent is taken
against m_safe = 0 in that case, which gives exp(-inf) = 0 for the blocked keys and α = 0
for the (empty) history. A row that never sees a key ends with l = 0 and a = 0, and returns
exactly 0, as the reference does.

Compiled, with static shapes. XLA needs every array's shape at compile time, so T and S
are padded up to multiples of the block sizes; padded keys are masked like blocked ones
and padded query rows are cut off at the end. The query blocks are a ``lax.fori_loop``
writing into the output, and the key blocks an inner ``lax.fori_loop`` carrying (m, l, a).

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

Packed documents. ``attention_packed`` takes N documents one after another (FlashAttention's
varlen API, cu_seqlens_q and cu_seqlens_k) and attends each alone. The boundaries are
traced, so one program serves every packing of the same T, S and N; the query blocks stay
where they are, and a block may hold rows of several documents. Each row's visible keys
are one interval [lower, upper) of packed positions: its document's keys, narrowed by
causality and the window counted from the document's own diagonal. A query block walks
the documents its rows lie in, one at a time, and for each only the key blocks that
document's rows see (loop bounds from the intervals, as for the band), so a key tile that
shares no document with the query tile is never computed: the work grows with Σ T_n·S_n,
not T·S. Each row keeps (m, l, acc) from its own document's walk, selected with ``where``:
within a tile another document's row has weights 0, but 0 · NaN is NaN, so a NaN in one
document would otherwise reach the others through the products.

Huge softcaps. c · tanh(x / c) is x itself, to far below rounding, once |x / c| < 2^-27
(float64; 2^-12 in float32), as tanh(y) = y − y³/3 + …. For a softcap near the largest
float (1e308; 1e38 in float32) the ratio falls below the smallest normal number, and XLA
on a CPU flushes such subnormals to 0: every score became c · tanh(0) = 0 and the weights
uniform (SPEC §4.2). Where the ratio is below that smallest normal number the score is kept
as it is, the correctly rounded value of c · tanh(x / c) there; elsewhere nothing changes.
The backward's 1 − tanh² is then exactly 1 there, the right derivative.

Head size 1. With D = 1 XLA rewrites the tile's product q·kᵀ as an elementwise multiply
and, the multiply being cheap, recomputes it inside both of its consumers: the row
maximum m and exp(x − m). In the second, LLVM contracts the multiply and the subtraction
into one fused multiply-add, which subtracts m from the exact product, not from the
rounded score the maximum saw: exp() got the product's rounding error, up to half an ulp
of the score, where it should get 0. That is nothing for ordinary scores, but at large
ones (3e10 in float32: an exponent of −1024) the row's largest weight became 0 and its
output 0, or its exponent went positive and the output NaN (SPEC §4.1). A zero column
appended to q and k keeps the product a dot, computed once, whose rounded result both
consumers read; for D > 1 nothing changes.

The backward pass. ``attention_vjp`` is FlashAttention-2's backward, the algorithm
``numpy_flash.attention_vjp`` derives: for each query block, the forward over its key
blocks gives each row's log-sum-exp lse = m + log l and its output O, hence
Δ = rowsum(dO ⊙ O); then a second walk over the same key blocks recomputes each tile's
weights as P = exp(Z − lse), forms dZ = P ⊙ (dO·Vᵀ − Δ), adds dZ·K to the block's dQ,
and adds dZᵀ·Q and Pᵀ·dO to dK and dV of the key block, in place. No (T, S) array, no
``jax.vjp`` through the loops (which would store every tile's weights), and the same
block skipping as the forward. ``jax_ring``'s backward runs the same tile algorithm, but
keeps its own body: impls stand alone (only contract.py is shared), and the ring's
positions and options are traced values travelling with its slices, where this file's
band is static and skips blocks by loop bounds.

Memory. No input is copied whole (except to pad T or S up to a block multiple): tiles
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
    Tb query block     Sb key block       Tp, Sp: T and S padded to block multiples

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores),
          broadcastable to (B, H, T, S)

Unbatched inputs q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

``jax.nn.dot_product_attention`` uses other letters and a sequence-first layout:

    here           B    H    K    T    S    D    E
    jax.nn         B    N    K    T    S    H    H

The grouped layout. Query head h = k·G + g shares key/value head k (PyTorch's
repeat_interleave order), so the G query heads of a key/value head are stacked as G·Tb
rows of one tile: (B, K, G·Tb, ·). Each key tile is then read and multiplied once for
its G query heads, not G times, and no input is repeated or copied, which the
memory-efficient impls must avoid (the teaching reference repeats k and v instead).

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks, packed documents, grouped-query and multi-query attention (K < H), float64, float32,
float16 and bfloat16 (computed in float32 and rounded once), and the backward pass of all
of them with a float mask's gradient. A query row with no key left
to attend returns exactly 0. Float64 needs ``jax.config.update("jax_enable_x64", True)``
set by the caller; this module never changes it. Not supported: dropout (``dropout_p > 0``
raises NotImplementedError).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from . import contract

_HIGHEST = lax.Precision.HIGHEST


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
      block_q: Tb, queries per tile (per query head); shrunk to T when T is smaller.
      block_k: Sb, keys per tile; shrunk to S when S is smaller.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate: the input contract every impl shares (contract.py) checks shapes,
    # dtypes and options, and names the argument, the expected shape and what was given.
    options = dict(is_causal=is_causal, scale=scale, causal_alignment=causal_alignment)
    options.update(window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks)
    options.update(chunk_size=chunk_size, alibi_slopes=alibi_slopes)
    call, (q, k, v, mask, sinks, alibi), static = _prepare(q, k, v, mask, options, block_q, block_k)
    if call.T == 0 or call.S == 0:
        # Nothing to tile: with T = 0 there is no query, and with S = 0 every query has
        # no key, so every output row is exactly 0, whatever q holds.
        out = jnp.zeros((call.B, call.H, call.T, call.E), dtype=q.dtype)  # (B, H, T, E)
    else:
        out = _flash(q, k, v, mask, sinks, alibi=alibi, **static)  # (B, H, T, E)
    return out[0] if call.unbatched else out


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
    docstring; the derivation is ``numpy_flash.attention_vjp``'s).

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
    d_out = jnp.asarray(d_out)
    given = None if mask is None else jnp.shape(mask)  # dmask is shaped like this
    call, (q, k, v, mask, sinks, alibi), static = _prepare(
        q, k, v, mask, options, block_q, block_k, d_out=d_out
    )
    float_mask = mask is not None and not call.mask_is_bool
    if call.T == 0 or call.S == 0:
        # Nothing attends anything: every gradient is exactly 0.
        grads = tuple(jnp.zeros_like(x) for x in (q, k, v))
        grads += (jnp.zeros_like(mask),) if float_mask else (None,)  # (B|1, H|1, T|1, S|1)
        grads += (None if sinks is None else jnp.zeros_like(sinks),)  # (H,)
    else:
        d_out = d_out[None] if call.unbatched else d_out  # (B, H, T, E)
        grads = _flash_vjp(q, k, v, mask, sinks, d_out, alibi=alibi, **static)
    dq, dk, dv = (g[0] if call.unbatched else g for g in grads[:3])
    extra = (grads[3].reshape(given),) if float_mask else ()  # the mask's shape
    extra += (grads[4],) if sinks is not None else ()  # (H,)
    return (dq, dk, dv, *extra)


def attention_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 512,
    block_k: int = 256,
) -> jax.Array:
    """Attention over packed variable-length sequences (FlashAttention's varlen API),
    blockwise, skipping every key block that shares no document with the query block.

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone (the module docstring's Packed
    documents). The boundaries are traced: one compiled program serves every packing of
    the same T, S and N.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``attention``, applied
        within each document (bottom-right puts document n's diagonal at S_n - T_n).
      block_q, block_k: Tb and Sb, as for ``attention``.

    Returns:
      out: (H, T, E), same dtype as q.
    """
    # 0. Validate with the input contract all impls share (contract.py), eagerly, so the
    # boundaries' values are checked before they become tracers.
    q, k, v, bounds, static = _prepare_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_q, block_k, **_packed_options(locals())
    )
    H, T, _ = q.shape
    if T == 0 or k.shape[1] == 0:
        # Nothing to tile: no query, or no key in any document, so every row is 0.
        return jnp.zeros((H, T, v.shape[-1]), dtype=q.dtype)  # (H, T, E)
    return _flash_packed(q, k, v, *bounds, **static)  # (H, T, E)


def attention_packed_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    d_out: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 512,
    block_k: int = 256,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``attention_packed`` by the blockwise backward, on the same key
    blocks as the forward: (dq, dk, dv) shaped and typed like q, k, v, for the loss
    L = Σ d_out · attention_packed(...), d_out (H, T, E) in q's dtype. The boundaries
    are integers, traced and not differentiated."""
    # 0. Validate as the forward does, and d_out against the output's shape and dtype.
    d_out = jnp.asarray(d_out)
    q, k, v, bounds, static = _prepare_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_q, block_k, d_out, **_packed_options(locals())
    )
    if q.shape[1] == 0 or k.shape[1] == 0:
        # Nothing attends anything: every gradient is exactly 0.
        return tuple(jnp.zeros_like(x) for x in (q, k, v))
    return _flash_packed_vjp(q, k, v, *bounds, d_out, **static)


def _packed_options(given: dict) -> dict:
    """The options of an ``attention_packed(_vjp)`` call, from its ``locals()``."""
    names = ("is_causal", "scale", "causal_alignment", "window", "softcap")
    return {name: given[name] for name in names}


def _prepare_packed(q, k, v, cu_q, cu_k, block_q, block_k, d_out=None, **options):
    """Step 0 of a packed call: q, k, v and the boundaries as JAX arrays, and the static
    arguments of ``_flash_packed``."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)
    tiles = {"block_q": block_q, "block_k": block_k}
    call, _, _ = contract.check_packed(q, k, v, cu_q, cu_k, tiles=tiles, d_out=d_out, **options)
    # A window wider than T + S keys reaches past every document: cut to that, so that
    # the positions it adds stay within int32.
    window = call.window
    if window is not None:
        window = tuple(None if w is None else min(w, call.T + call.S) for w in window)
    static = dict(
        scale=call.scale,
        is_causal=call.is_causal,
        bottom_right=call.causal_alignment == "bottom_right",
        window=window,
        softcap=call.softcap,
        Tb=max(1, min(block_q, call.T)),
        Sb=max(1, min(block_k, call.S)),
    )
    return q, k, v, (cu_q, cu_k), static


_PACKED_STATIC = ("scale", "is_causal", "bottom_right", "window", "softcap", "Tb", "Sb")


@functools.partial(jax.jit, static_argnames=_PACKED_STATIC)
def _flash_packed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q: jax.Array,
    cu_k: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    bottom_right: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    Tb: int,
    Sb: int,
) -> jax.Array:
    """Steps 1-7 on checked packed inputs, (H, T, D) and so on, batched here as B = 1;
    compiled once per T, S, N, dtype and options, whatever the boundaries hold."""
    q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    B, H, T, _ = q.shape
    E = v.shape[-1]
    tiles = _Tiles(q, k, v, None, 0, False, None, softcap, None, Tb, Sb)
    docs = _Documents(cu_q, cu_k, tiles, is_causal, bottom_right, window)

    def query_block(i: jax.Array, out: jax.Array) -> jax.Array:
        qi = tiles.queries(i, scale)  # (B, K, G·Tb, D), steps 1-2
        _, l, acc = docs.online_softmax(qi, i)  # steps 3-5 and 7, document by document
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        acc = acc.reshape(B, H, Tb, E).astype(q.dtype)  # (B, H, Tb, E)
        return lax.dynamic_update_slice_in_dim(out, acc, i * Tb, axis=2)  # (B, H, Tp, E)

    out = jnp.zeros((B, H, tiles.Tp, E), dtype=q.dtype)  # (B, H, Tp, E)
    out = lax.fori_loop(0, tiles.nT, query_block, out)  # (B, H, Tp, E)
    return out[0, :, :T]  # (H, T, E), the padded rows cut off


@functools.partial(jax.jit, static_argnames=_PACKED_STATIC)
def _flash_packed_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_q: jax.Array,
    cu_k: jax.Array,
    d_out: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    bottom_right: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    Tb: int,
    Sb: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The backward on checked packed inputs, batched here as B = 1: (dq, dk, dv);
    compiled once per T, S, N, dtype and options."""
    q, k, v, d_out = q[None], k[None], v[None], d_out[None]  # (1, ·, ·, ·) each
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    tiles = _Tiles(q, k, v, None, 0, False, None, softcap, None, Tb, Sb)
    docs = _Documents(cu_q, cu_k, tiles, is_causal, bottom_right, window)
    work, G = tiles.work, tiles.G
    d_out = jnp.pad(d_out, ((0, 0), (0, 0), (0, tiles.Tp - T), (0, 0)))  # (B, H, Tp, E)

    def query_block(i: jax.Array, grads: tuple) -> tuple:
        dq, dk, dv = grads
        # Forward steps 1-5 and 7 for this block: its rows' O and log-sum-exp.
        qi = tiles.queries(i, scale)  # (B, K, G·Tb, D)
        m, l, acc = docs.online_softmax(qi, i)
        some = l > 0  # (B, K, G·Tb)
        o = acc / jnp.where(some, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        lse = _log_sum_exp(m, l)  # (B, K, G·Tb)

        # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O).
        do = lax.dynamic_slice_in_dim(d_out, i * Tb, Tb, axis=2).astype(work)
        do = do.reshape(B, K, G * Tb, E)  # (B, K, G·Tb, E)
        delta = (do * o).sum(axis=-1)  # (B, K, G·Tb)

        def document(n: jax.Array, carry: tuple) -> tuple:
            # The backward of document n's rows over its key blocks. Its rows alone carry
            # q, dO and lse into the products: another document's row (NaN in its q or
            # d_out, or in its lse through its values) must add nothing, and a product
            # with a weight of 0 would still carry its NaN.
            dq_i, dk, dv = carry
            rows, sel = docs.rows(i, n)  # (Tb,) twice, (G·Tb,)
            q_n = jnp.where(sel[:, None], qi, 0.0)  # (B, K, G·Tb, D)
            do_n = jnp.where(sel[:, None], do, 0.0)  # (B, K, G·Tb, E)
            lse_n = jnp.where(sel, lse, jnp.inf)  # (B, K, G·Tb)
            body = functools.partial(_backward_tile, tiles, i, q_n, do_n, lse_n, delta, rows=rows)
            dq_n = jnp.zeros((B, K, G * Tb, D), dtype=work)  # (B, K, G·Tb, D)
            dq_n, dk, dv, _ = tiles.walk(i, body, (dq_n, dk, dv, None), docs.span(rows))
            return jnp.where(sel[:, None], dq_n, dq_i), dk, dv

        dq_i = jnp.zeros((B, K, G * Tb, D), dtype=work)  # (B, K, G·Tb, D)
        dq_i, dk, dv = lax.fori_loop(*docs.touched(i), document, (dq_i, dk, dv))
        dq_i = (dq_i * scale).reshape(B, H, Tb, D).astype(q.dtype)  # (B, H, Tb, D)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * Tb, axis=2)  # (B, H, Tp, D)
        return dq, dk, dv

    grads = (
        jnp.zeros((B, H, tiles.Tp, D), dtype=q.dtype),  # dq: (B, H, Tp, D)
        jnp.zeros((B, K, tiles.Sp, D), dtype=work),  # dk: (B, K, Sp, D)
        jnp.zeros((B, K, tiles.Sp, E), dtype=work),  # dv: (B, K, Sp, E)
    )
    dq, dk, dv = lax.fori_loop(0, tiles.nT, query_block, grads)
    return (
        dq[0, :, :T],  # (H, T, D)
        dk[0, :, :S].astype(q.dtype),  # (K, S, D)
        dv[0, :, :S].astype(q.dtype),  # (K, S, E)
    )


@functools.partial(
    jax.jit,
    static_argnames=("scale", "is_causal", "offset", "window", "softcap", "chunk", "Tb", "Sb"),
)
def _flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array | None,
    *,
    scale: float,
    is_causal: bool,
    offset: int,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    chunk: int | None,
    Tb: int,
    Sb: int,
    alibi: jax.Array | None = None,
) -> jax.Array:
    """Steps 1-7 on checked, batched inputs; compiled once per shape, dtype and options."""
    B, H, T, _ = q.shape
    E = v.shape[-1]
    out_dtype = q.dtype
    tiles = _Tiles(q, k, v, mask, offset, is_causal, window, softcap, chunk, Tb, Sb, alibi)

    def query_block(i: jax.Array, out: jax.Array) -> jax.Array:
        # 1. Scores: every query of the block against every key, one key block at a time
        # (_Tiles.scores). Every tile's product starts from this query tile, so
        # 2. Scale, so that the scores' spread does not grow with the head size D, is
        # applied to it once, here: Tb·D multiplies instead of Tb·S.
        qi = tiles.queries(i, scale)  # (B, K, G·Tb, D)
        # Steps 3-5 and 7, key block by key block (_Tiles.online_softmax).
        m, l, acc = tiles.online_softmax(qi, i)
        if sinks is not None:
            _, l, acc = _add_sink(m, l, acc, tiles.sink_rows(sinks))
        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        acc = acc.reshape(B, H, Tb, E).astype(out_dtype)  # (B, H, Tb, E)
        return lax.dynamic_update_slice_in_dim(out, acc, i * Tb, axis=2)  # (B, H, Tp, E)

    out = jnp.zeros((B, H, tiles.Tp, E), dtype=out_dtype)  # (B, H, Tp, E)
    out = lax.fori_loop(0, tiles.nT, query_block, out)  # (B, H, Tp, E)
    return out[:, :, :T]  # (B, H, T, E), the padded rows cut off


@functools.partial(
    jax.jit,
    static_argnames=("scale", "is_causal", "offset", "window", "softcap", "chunk", "Tb", "Sb"),
)
def _flash_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array | None,
    d_out: jax.Array,
    *,
    scale: float,
    is_causal: bool,
    offset: int,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    chunk: int | None,
    Tb: int,
    Sb: int,
    alibi: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """The backward on checked, batched inputs: (dq, dk, dv, dmask, dsinks), dmask shaped
    (B|1, H|1, T|1, S|1) with a float mask and dsinks (H,) with sinks, else None;
    compiled once per shape, dtype and options."""
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    tiles = _Tiles(q, k, v, mask, offset, is_causal, window, softcap, chunk, Tb, Sb, alibi)
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
        qi = tiles.queries(i, scale)  # (B, K, G·Tb, D)
        m, l, acc = tiles.online_softmax(qi, i)
        if sinks is not None:
            sink = tiles.sink_rows(sinks)  # (B, K, G·Tb)
            m, l, acc = _add_sink(m, l, acc, sink)
        some = l > 0  # (B, K, G·Tb)
        o = acc / jnp.where(some, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        lse = _log_sum_exp(m, l)  # (B, K, G·Tb)

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
        body = functools.partial(_backward_tile, tiles, i, qi, do, lse, delta)
        dq_i, dk, dv, dm = tiles.walk(i, body, (dq_i, dk, dv, dm))
        dq_i = (dq_i * scale).reshape(B, H, Tb, D).astype(q.dtype)  # (B, H, Tb, D)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * Tb, axis=2)  # (B, H, Tp, D)
        return dq, dk, dv, dm, ds

    grads = (
        jnp.zeros((B, H, tiles.Tp, D), dtype=q.dtype),  # dq: (B, H, Tp, D)
        jnp.zeros((B, K, tiles.Sp, D), dtype=work),  # dk: (B, K, Sp, D)
        jnp.zeros((B, K, tiles.Sp, E), dtype=work),  # dv: (B, K, Sp, E)
        jnp.zeros(tiles.mask.shape, dtype=work) if float_mask else None,  # dmask, padded
        None if sinks is None else jnp.zeros((H,), dtype=work),  # dsinks: (H,)
    )
    dq, dk, dv, dm, ds = lax.fori_loop(0, tiles.nT, query_block, grads)
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


# --- Paged KV caches (SPEC §19) --------------------------------------------------------------


def attention_paged(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> jax.Array:
    """Attention over a paged KV cache (vLLM, FlashInfer, FlashAttention's
    ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``), a page at a
    time: each page a sequence reads is one key tile, read in place.

    Sequence b's key s lives in page block_table[b, s // L], slot s % L, and sequence b has
    seq_lens[b] keys; its T queries are its last T positions, so causality and the window
    are counted from the bottom-right diagonal t + seq_lens[b] - T. For each sequence and
    query block, the online softmax runs over the pages from the first the block's rows may
    see to the last, at most ⌈seq_lens[b] / L⌉: a ``lax.fori_loop`` with traced bounds (a
    while loop), so the table and the lengths stay traced, one program serves every table
    of the same shapes, and the cost follows the lengths, not the table's width M·L.

    Shape legend: the spec's letters, and N pages, L slots per page (the key tile), M table
    entries per sequence.

    Args:
      q: queries, (B, H, T, D).
      k_pages: (N, K, L, D), the pool of key pages; K must divide H.
      v_pages: (N, K, L, E), the value pages, laid out alike.
      block_table: (B, M) integer: the pages of sequence b, in order. Entries past
        ⌈seq_lens[b] / L⌉ are never read and may hold anything (-1 is common).
      seq_lens: (B,) integer: the number of keys of each sequence, 0 to M·L.
      is_causal: query t attends only keys s <= t + seq_lens[b] - T (T <= seq_lens[b]).
      scale, window, softcap: as for ``attention``, the window's diagonal placed
        bottom-right as causality's.
      block_q: Tb, queries per tile (per query head).

    Returns:
      out: (B, H, T, E), same dtype as q; a sequence with no key gives rows of 0.
    """
    # 0. Validate with the input contract every impl shares (contract.py), eagerly.
    arrays = tuple(jnp.asarray(x) for x in (q, k_pages, v_pages, block_table, seq_lens))
    call = _check_paged(arrays, block_q, is_causal, scale, window, softcap)
    return _flash_paged(*arrays, None, **_paged_statics(call, block_q))[0]  # (B, H, T, E)


def attention_paged_vjp(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    d_out: jax.Array,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of ``attention_paged``, FlashAttention-2's way (``attention_vjp``), over
    each sequence's pages: (dq, dk_pages, dv_pages). Each page's dK and dV are added into
    the page read (``.at[page].add``), so a page two sequences share collects both, and a
    slot no sequence reads stays exactly 0."""
    arrays = tuple(jnp.asarray(x) for x in (q, k_pages, v_pages, block_table, seq_lens))
    d_out = jnp.asarray(d_out)
    call = _check_paged(arrays, block_q, is_causal, scale, window, softcap, d_out)
    return _flash_paged(*arrays, d_out, **_paged_statics(call, block_q))[1:]


def _check_paged(arrays, block_q, is_causal, scale, window, softcap, d_out=None):
    options = dict(is_causal=is_causal, scale=scale, window=window, softcap=softcap)
    call = contract.check_paged(*arrays, **options, d_out=d_out)
    if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q <= 0:
        raise ValueError(f"block_q should be a positive int, got {block_q!r}")
    return call


def _paged_statics(call: contract.PagedChecked, block_q: int) -> dict:
    return dict(
        scale=call.scale,
        is_causal=call.is_causal,
        window=call.window,
        softcap=call.softcap,
        Tb=min(block_q, max(call.T, 1)),
    )


@functools.partial(jax.jit, static_argnames=("scale", "is_causal", "window", "softcap", "Tb"))
def _flash_paged(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    d_out: jax.Array | None,
    *,
    scale: float,
    is_causal: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    Tb: int,
) -> tuple[jax.Array, ...]:
    """The forward, and with ``d_out`` the backward, sequence by sequence and query block by
    query block over the pages; compiled once per shape, dtype and options: (out, dq,
    dk_pages, dv_pages), the gradients None without ``d_out``."""
    B, H, T, D = q.shape
    N, K, L, _ = k_pages.shape
    E = v_pages.shape[-1]
    G = H // K
    work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    left, right = window if window is not None else (None, None)
    hi = 0 if is_causal else right  # the last key a row sees, past its diagonal
    if is_causal and right is not None:
        hi = min(hi, right)
    grad = d_out is not None

    def sequence(b: jax.Array, carry: tuple) -> tuple:
        for t0 in range(0, T, Tb):  # query blocks: T and Tb are static
            carry = query_block(b, t0, min(t0 + Tb, T), carry)
        return carry

    def query_block(b: jax.Array, t0: int, t1: int, carry: tuple) -> tuple:
        out, dq, dk_pages, dv_pages = carry
        n = seq_lens[b]
        n_pages = (n + L - 1) // L
        R = G * (t1 - t0)  # rows: query head g·Tb + t of each key/value head
        qi = q[b, :, t0:t1].astype(work) * scale  # (H, Tb, D)
        qi = qi.reshape(K, R, D)  # (K, G·Tb, D)
        t = jnp.tile(jnp.arange(t0, t1), G)  # (G·Tb,): each row's query
        diagonal = t + n - T  # (G·Tb,): its bottom-right diagonal
        # The pages the block's rows may see: from the first row's first key to the
        # last row's last key, and never past the sequence's length.
        first, last = jnp.asarray(0), n_pages
        if left is not None:
            first = jnp.maximum(0, (t0 + n - T - left) // L)
        if hi is not None:
            last = jnp.clip((t1 - 1 + n - T + hi) // L + 1, 0, n_pages)

        def tile(j):
            # Steps 1, 3 and 4 on page j of sequence b: its (K, G·Tb, L) scores.
            page = jnp.clip(block_table[b, j], 0, N - 1)
            s = j * L + jnp.arange(L)  # (L,): the keys in the page
            allowed = s[None, :] < n  # (1, L)
            distance = s[None, :] - diagonal[:, None]  # (G·Tb, L)
            if hi is not None:
                allowed = allowed & (distance <= hi)  # (G·Tb, L)
            if left is not None:
                allowed = allowed & (distance >= -left)  # (G·Tb, L)
            allowed = jnp.broadcast_to(allowed, (R, L))  # (G·Tb, L)
            used = allowed.any(axis=0)[None, :, None]  # (1, L, 1)
            kj = jnp.where(used, k_pages[page].astype(work), 0.0)  # (K, L, D)
            vj = jnp.where(used, v_pages[page].astype(work), 0.0)  # (K, L, E)
            x = _score_product("krd,kld->krl", qi, kj)  # (K, G·Tb, L)
            tanh = None
            if softcap is not None:
                # A subnormal x / softcap keeps the score (see Notes: huge softcaps).
                ratio = x / softcap  # (K, G·Tb, L)
                tanh = jnp.tanh(ratio)  # (K, G·Tb, L)
                x = jnp.where(
                    jnp.abs(ratio) < jnp.finfo(work).tiny, x, softcap * tanh
                )  # (K, G·Tb, L)
            x = jnp.where(allowed, x, -jnp.inf)  # (K, G·Tb, L)
            return page, x, tanh, kj, vj, used

        def online(j, state):
            # 5 and 7: the online softmax over the pages (module docstring).
            m, l, acc = state
            _, x, _, _, vj, _ = tile(j)
            m_new = jnp.maximum(m, x.max(axis=-1))  # (K, G·Tb)
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (K, G·Tb)
            alpha = jnp.exp(m - m_safe)  # (K, G·Tb)
            p = jnp.exp(x - m_safe[..., None])  # (K, G·Tb, L)
            l = alpha * l + p.sum(axis=-1)  # (K, G·Tb)
            pv = jnp.einsum("krl,kle->kre", p, vj, precision=_HIGHEST)  # (K, G·Tb, E)
            return m_new, l, alpha[..., None] * acc + pv

        state = (
            jnp.full((K, R), -jnp.inf, dtype=work),  # m: (K, G·Tb)
            jnp.zeros((K, R), dtype=work),  # l: (K, G·Tb)
            jnp.zeros((K, R, E), dtype=work),  # acc: (K, G·Tb, E)
        )
        m, l, acc = lax.fori_loop(first, last, online, state)
        some = l > 0  # (K, G·Tb)
        o = acc / jnp.where(some, l, 1.0)[..., None]  # (K, G·Tb, E)
        rows = o.reshape(H, t1 - t0, E).astype(q.dtype)  # (H, Tb, E)
        out = out.at[b, :, t0:t1].set(rows)  # (B, H, T, E)
        if not grad:
            return out, dq, dk_pages, dv_pages

        # The backward of this block (``attention_vjp``): P = exp(Z − lse) and
        # Δ = rowsum(dO ⊙ O), then page by page dV, dK into the pages, dQ here.
        lse = _log_sum_exp(m, l)  # (K, G·Tb)
        do = d_out[b, :, t0:t1].astype(work).reshape(K, R, E)  # (K, G·Tb, E)
        delta = (do * o).sum(axis=-1)  # (K, G·Tb)

        def backward(j, grads):
            dq_i, dk_pages, dv_pages = grads
            page, z, tanh, kj, vj, used = tile(j)
            p = jnp.exp(z - lse[..., None])  # (K, G·Tb, L)
            dv_j = jnp.einsum("krl,kre->kle", p, do, precision=_HIGHEST)  # (K, L, E)
            dp = jnp.einsum("kre,kle->krl", do, vj, precision=_HIGHEST)  # (K, G·Tb, L)
            dz = p * (dp - delta[..., None])  # (K, G·Tb, L)
            if tanh is not None:
                dz = dz * (1.0 - tanh * tanh)  # (K, G·Tb, L)
            dq_i = dq_i + jnp.einsum("krl,kld->krd", dz, kj, precision=_HIGHEST)
            dk_j = jnp.einsum("krl,krd->kld", dz, qi, precision=_HIGHEST)  # (K, L, D)
            # Unused slots get nothing back; what was read goes back to its page.
            dk_pages = dk_pages.at[page].add(jnp.where(used, dk_j, 0.0))  # (N, K, L, D)
            dv_pages = dv_pages.at[page].add(jnp.where(used, dv_j, 0.0))  # (N, K, L, E)
            return dq_i, dk_pages, dv_pages

        dq_i = jnp.zeros((K, R, D), dtype=work)  # (K, G·Tb, D)
        dq_i, dk_pages, dv_pages = lax.fori_loop(first, last, backward, (dq_i, dk_pages, dv_pages))
        dq_i = (dq_i * scale).reshape(H, t1 - t0, D).astype(q.dtype)  # (H, Tb, D)
        dq = dq.at[b, :, t0:t1].set(dq_i)  # (B, H, T, D)
        return out, dq, dk_pages, dv_pages

    carry = (
        jnp.zeros((B, H, T, E), dtype=q.dtype),  # out
        jnp.zeros((B, H, T, D), dtype=q.dtype) if grad else None,  # dq
        jnp.zeros((N, K, L, D), dtype=work) if grad else None,  # dk_pages
        jnp.zeros((N, K, L, E), dtype=work) if grad else None,  # dv_pages
    )
    if N == 0:  # no pages at all: every sequence is empty (the contract checked it)
        return carry[:2] + tuple(None if g is None else g.astype(q.dtype) for g in carry[2:])
    out, dq, dk_pages, dv_pages = lax.fori_loop(0, B, sequence, carry)
    if not grad:
        return out, None, None, None
    return out, dq, dk_pages.astype(q.dtype), dv_pages.astype(q.dtype)


def _log_sum_exp(m: jax.Array, l: jax.Array) -> jax.Array:
    """Each row's log-sum-exp m + log l from its running maximum and sum, what the backward
    needs of the forward: +inf for a row with no key (l = 0), so that its weights
    exp(Z − lse) are all 0; NaN for a row that read a +inf score (l = +inf), so that every
    weight of it is NaN, as its output is (SPEC §4.1), not only its +inf ones."""
    some = l > 0
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.where(some, m_safe + jnp.log(jnp.where(some, l, 1.0)), jnp.inf)
    return jnp.where(l == jnp.inf, jnp.nan, lse)


def _add_sink(
    m: jax.Array, l: jax.Array, acc: jax.Array, sink: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold each row's sink into its (m, l, acc) after the last key block, as one more
    block of one key whose value row is 0 (the module docstring's Sinks): a row with no
    key (l = 0) is left alone, and a NaN or +inf sink makes a row with a key NaN (SPEC
    §15.4)."""
    some = l > 0  # (B, K, G·Tb)
    sink = jnp.where(some, sink, -jnp.inf)  # (B, K, G·Tb)
    m_new = jnp.maximum(m, sink)  # (B, K, G·Tb)
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, K, G·Tb)
    alpha = jnp.exp(m - m_safe)  # (B, K, G·Tb)
    l = alpha * l + jnp.exp(sink - m_safe)  # (B, K, G·Tb)
    bad = jnp.isnan(sink) | (sink == jnp.inf)  # (B, K, G·Tb)
    acc = jnp.where(bad[..., None], jnp.nan, alpha[..., None] * acc)  # (B, K, G·Tb, E)
    return m_new, jnp.where(bad, jnp.nan, l), acc


def _backward_tile(tiles, i, qi, do, lse, delta, j, grads, banded_tile, rows=None):
    """The backward of query block i against key block j (``attention_vjp``): adds to
    the block's dq / scale (B, K, G·Tb, D), to dk (B, K, Sp, D), dv (B, K, Sp, E) and,
    for a float mask, dm (B|1, H|1, Tp|1, Sp|1). ``rows``: one packed document's
    (``_Tiles.scores``)."""
    dq_i, dk, dv, dm = grads
    # Forward steps 1, 3 and 4 again: the tile's masked scores Z.
    z, tanh, used = tiles.scores(qi, i, j, banded_tile, rows)  # (B, K, G·Tb, Sb)
    # 5. The weights, recomputed from the row's log-sum-exp: P = exp(Z − lse).
    p = jnp.exp(z - lse[..., None])  # (B, K, G·Tb, Sb)
    kj = tiles.keys(j, used)  # (B, K, Sb, D)
    vj = tiles.values(j, used)  # (B, K, Sb, E)

    # 7'. Weighted sum, O = P·V: dV = Pᵀ·dO, and dP = dO·Vᵀ.
    dv_j = jnp.einsum("bkrs,bkre->bkse", p, do, precision=_HIGHEST)  # (B, K, Sb, E)
    dp = jnp.einsum("bkre,bkse->bkrs", do, vj, precision=_HIGHEST)  # (B, K, G·Tb, Sb)

    # 5'. Softmax: dZ = P ⊙ (dP − Δ).
    dz = p * (dp - delta[..., None])  # (B, K, G·Tb, Sb)
    if rows is not None and banded_tile:
        # A row outside the packed document has P = 0, but dP = 0 · V is NaN where this
        # document's values are: selected away, so that dK gets nothing from it.
        lo, hi = rows  # (Tb,), (Tb,)
        dz = jnp.where(jnp.tile(lo < hi, tiles.G)[:, None], dz, 0.0)  # (B, K, G·Tb, Sb)

    # 4'. Mask: a float mask was added to the scores, so its gradient is dZ.
    if dm is not None:
        dm = tiles.add_mask_grad(dm, dz, i, j)

    # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c), which fades where the cap bites.
    if tanh is not None:
        dz = dz * (1.0 - tanh * tanh)  # (B, K, G·Tb, Sb)

    # 2'-1'. Scores, R = scale · q·kᵀ: the scale is in qi (so dk has it already); dq
    # gets it once, at the end of the query block.
    dq_i = dq_i + jnp.einsum("bkrs,bksd->bkrd", dz, kj, precision=_HIGHEST)  # (B, K, G·Tb, D)
    dk_j = jnp.einsum("bkrs,bkrd->bksd", dz, qi, precision=_HIGHEST)  # (B, K, Sb, D)

    # The slots replaced by 0 get nothing back: a selection passes the gradient only to
    # the branch it took.
    if used is not None:
        dk_j = jnp.where(used[..., None], dk_j, 0.0)  # (B, K, Sb, D)
        dv_j = jnp.where(used[..., None], dv_j, 0.0)  # (B, K, Sb, E)
    dk = _add_block(dk, dk_j, j * tiles.Sb)  # (B, K, Sp, D)
    dv = _add_block(dv, dv_j, j * tiles.Sb)  # (B, K, Sp, E)
    return dq_i, dk, dv, dm


class _Tiles:
    """The padded inputs, the band, and what a tile needs: which key blocks a query
    block visits (``walk``), steps 1, 3 and 4 on one tile (``scores``), and the online
    softmax of one query block (``online_softmax``). Built inside the jitted functions:
    the arrays are traced, the sizes and options static."""

    def __init__(
        self, q, k, v, mask, offset, is_causal, window, softcap, chunk, Tb, Sb, alibi=None
    ) -> None:
        B, H, T, D = q.shape
        _, K, S, _ = k.shape
        self.B, self.K, self.G, self.T, self.S = B, K, H // K, T, S
        self.Tb, self.Sb, self.offset, self.softcap = Tb, Sb, offset, softcap
        self.nT, self.nS = -(-T // Tb), -(-S // Sb)  # blocks of queries and of keys
        self.Tp, self.Sp = self.nT * Tb, self.nS * Sb

        # Low precision inputs are computed in float32: exp() of a float16 score
        # overflows past 11.09, and summing many weights in float16 loses the small ones.
        self.work = jnp.float64 if q.dtype == jnp.float64 else jnp.float32

        # Pad T and S to whole blocks (a no-op when they already are). Tiles are sliced
        # from the inputs as they are, and cast to the working precision tile by tile, so
        # that no whole copy of an input is made.
        self.q = jnp.pad(q, ((0, 0), (0, 0), (0, self.Tp - T), (0, 0)))  # (B, H, Tp, D)
        self.k = jnp.pad(k, ((0, 0), (0, 0), (0, self.Sp - S), (0, 0)))  # (B, K, Sp, D)
        self.v = jnp.pad(v, ((0, 0), (0, 0), (0, self.Sp - S), (0, 0)))  # (B, K, Sp, E)
        if mask is not None:
            # Pad the mask's T and S axes where it has them (not where it broadcasts);
            # padded keys are blocked below anyway, and padded query rows are dropped.
            pad_t = self.Tp - T if mask.shape[2] == T else 0
            pad_s = self.Sp - S if mask.shape[3] == S else 0
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)))
            # mask: (B|1, H|1, Tp|1, Sp|1)
        self.mask = mask

        # Which keys query t may see under causality and the window: lo <= s - t' <= hi,
        # where t' = t + offset is its aligned diagonal (offset = S - T for bottom-right).
        left, right = window if window is not None else (None, None)
        self.lo = -math.inf if left is None else -left
        self.hi = math.inf if right is None else right
        if is_causal:
            self.hi = min(self.hi, 0)
        self.banded = is_causal or window is not None
        # Chunked local attention: t' // chunk == s // chunk as well.
        self.chunk = chunk
        # ALiBi's slopes in the grouped layout of the score tiles, or None.
        self.alibi = None
        if alibi is not None:
            self.alibi = alibi.astype(self.work).reshape(-1, K, H // K, 1, 1)  # (B|1, K, G, 1, 1)

    def queries(self, i: jax.Array, scale: float) -> jax.Array:
        """Query block i of every head, scaled, stacked by key/value head: query head
        h = k·G + g shares key/value head k, so a kv head's tile serves its G query
        heads, stacked as G·Tb rows. (B, K, G·Tb, D)."""
        qi = lax.dynamic_slice_in_dim(self.q, i * self.Tb, self.Tb, axis=2)  # (B, H, Tb, D)
        qi = qi.astype(self.work) * self.work(scale)  # (B, H, Tb, D)
        return qi.reshape(self.B, self.K, self.G * self.Tb, -1)  # (B, K, G·Tb, D)

    def key_blocks(self, i: jax.Array) -> tuple[jax.Array, ...]:
        """For query block i: the key blocks [first, last) that can hold a visible key, and
        within them [inner_first, inner_last), the blocks where every query of the block
        sees every key (no masking needed). Traced int32 scalars."""
        Tb, Sb, nS, lo, hi = self.Tb, self.Sb, self.nS, self.lo, self.hi
        t0 = i * Tb + self.offset  # diagonal of the block's first query
        first, inner_first, inner_last, last = 0, 0, nS, nS
        if lo != -math.inf:
            first = (t0 + lo) // Sb
            # Inside from the first block whose first key is >= lo past the last query's
            # diagonal: a ceiling division.
            inner_first = -(-(t0 + Tb - 1 + lo) // Sb)
        if hi != math.inf:
            last = (t0 + Tb - 1 + hi) // Sb + 1
            # Inside up to the last block whose last key is <= hi past the first query's.
            inner_last = (t0 + hi + 1) // Sb
        if self.chunk is not None:
            # The block's rows lie in chunks t0 // c … (t0 + Tb - 1) // c: key blocks outside
            # keys [lo_key, hi_key) of those chunks are skipped, and only a block within one
            # chunk has tiles that need no masking.
            c = self.chunk
            chunk_first, chunk_last = t0 // c, (t0 + Tb - 1) // c
            lo_key, hi_key = chunk_first * c, (chunk_last + 1) * c
            first = jnp.maximum(first, lo_key // Sb)
            last = jnp.minimum(last, -(-hi_key // Sb))
            inner_first = jnp.maximum(inner_first, -(-lo_key // Sb))
            single = chunk_first == chunk_last
            inner_last = jnp.where(single, jnp.minimum(inner_last, hi_key // Sb), 0)
        if self.Sp != self.S:
            inner_last = jnp.minimum(inner_last, nS - 1)  # the padded block is masked
        first = jnp.clip(first, 0, nS).astype(jnp.int32)
        last = jnp.clip(last, first, nS).astype(jnp.int32)
        inner_last = jnp.clip(inner_last, first, last).astype(jnp.int32)
        inner_first = jnp.clip(inner_first, first, inner_last).astype(jnp.int32)
        return first, inner_first, inner_last, last

    def walk(self, i: jax.Array, body, carry, span: tuple | None = None):
        """``carry = body(j, carry, banded_tile)`` for the key blocks j query block i can
        see, in order: those the band cuts on the left (a window), those wholly inside
        it, and those it cuts on the right (the causal diagonal), so that only the cut
        ones (``banded_tile``) pay for the masking. The others are skipped. ``span``, the
        four bounds of ``key_blocks``, is given by packed calls (``_Documents.span``)."""
        first, inner_first, inner_last, last = self.key_blocks(i) if span is None else span
        edge = functools.partial(body, banded_tile=True)
        inside = functools.partial(body, banded_tile=False)
        carry = lax.fori_loop(first, inner_first, edge, carry)
        carry = lax.fori_loop(inner_first, inner_last, inside, carry)
        return lax.fori_loop(inner_last, last, edge, carry)

    def scores(
        self, qi: jax.Array, i: jax.Array, j: jax.Array, banded_tile: bool, rows=None
    ) -> tuple:
        """Steps 1, 3 and 4 on tile (i, j): the masked scores (B, K, G·Tb, Sb); the
        softcap's tanh(R/c) (same shape, for its derivative) or None; and which keys of
        the tile some real query of the block may see, (B, K, Sb), or None when every
        query sees every key. The band (and the padding) is masked only on a
        ``banded_tile``; the others lie inside it. ``rows``, for packed documents: each
        row's keys [lo, hi) as two (Tb,) arrays (``_Documents.rows``)."""
        B, K, G, Tb, Sb, work = self.B, self.K, self.G, self.Tb, self.Sb, self.work
        # 1. Scores: every query of the block against every key of the block.
        kj = lax.dynamic_slice_in_dim(self.k, j * Sb, Sb, axis=2).astype(work)  # (B, K, Sb, D)
        x = _score_product("bkrd,bksd->bkrs", qi, kj)  # (B, K, G·Tb, Sb)

        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        tanh = None
        if self.softcap is not None:
            # A subnormal x / softcap keeps the score (see Notes: huge softcaps).
            ratio = x / self.softcap  # (B, K, G·Tb, Sb)
            tanh = jnp.tanh(ratio)  # (B, K, G·Tb, Sb)
            x = jnp.where(
                jnp.abs(ratio) < jnp.finfo(work).tiny, x, self.softcap * tanh
            )  # (B, K, G·Tb, Sb)

        # 4. Mask: ALiBi's linear bias and a float mask are added; a bool mask, the causal
        # triangle, the window and the chunks decide which keys each query may see at all,
        # and so does a float mask's -inf: blocked scores are replaced, not only pushed
        # down by adding -inf, since NaN + -inf is NaN.
        x = x.reshape(B, K, G, Tb, Sb)  # (B, K, G, Tb, Sb)
        if self.alibi is not None:
            x = x + self.alibi_bias(i, j)  # (B, K, G, Tb, Sb)
        allowed = None
        if self.mask is not None:
            m = _grouped(_mask_tile(self.mask, i, j, Tb, Sb), K, G)  # (B|1, K|1, G|1, Tb|1, Sb|1)
            if self.mask.dtype == jnp.bool_:
                allowed = m
            else:
                x = x + m.astype(work)  # (B, K, G, Tb, Sb)
                allowed = m != -jnp.inf  # (B|1, K|1, G|1, Tb|1, Sb|1)
        if banded_tile:
            s = j * Sb + jnp.arange(Sb, dtype=jnp.int32)[None, :]  # (1, Sb)
            if self.banded:
                t = i * Tb + jnp.arange(Tb, dtype=jnp.int32)[:, None]  # (Tb, 1)
                distance = s - (t + self.offset)  # (Tb, Sb)
                band = jnp.ones((Tb, Sb), dtype=bool)  # (Tb, Sb)
                if self.lo != -math.inf:
                    band &= distance >= self.lo
                if self.hi != math.inf:
                    band &= distance <= self.hi
                allowed = band if allowed is None else allowed & band
            if self.chunk is not None:
                t = i * Tb + jnp.arange(Tb, dtype=jnp.int32)[:, None]  # (Tb, 1)
                # Same chunk only; floor division puts a negative position in a chunk of no key.
                same = (t + self.offset) // self.chunk == s // self.chunk  # (Tb, Sb)
                allowed = same if allowed is None else allowed & same
            if rows is not None:
                # Packed documents: each row sees the keys [lo, hi) of its own document
                # that its causality and window leave; a row outside the document walked
                # has none.
                lo, hi = rows  # (Tb,), (Tb,)
                inside = (lo[:, None] <= s) & (s < hi[:, None])  # (Tb, Sb)
                allowed = inside if allowed is None else allowed & inside
            if self.Sp != self.S:
                allowed = s < self.S if allowed is None else allowed & (s < self.S)  # padding
        if self.Tp != self.T:
            # The padded query rows see no key: their q is 0, but a key holding NaN would
            # still make their scores NaN, and the backward sums over the rows.
            real = (i * Tb + jnp.arange(Tb, dtype=jnp.int32) < self.T)[:, None]  # (Tb, 1)
            allowed = real if allowed is None else allowed & real
        if allowed is None:
            return x.reshape(B, K, G * Tb, Sb), tanh, None
        x = jnp.where(allowed, x, -jnp.inf)  # (B, K, G, Tb, Sb)
        # A key that no query of the block may see (padding, a KV-cache slot not yet
        # written) must have no effect whatever it holds.
        used = jnp.broadcast_to(allowed, x.shape).any(axis=(2, 3))  # (B, K, Sb)
        return x.reshape(B, K, G * Tb, Sb), tanh, used

    def alibi_bias(self, i: jax.Array, j: jax.Array) -> jax.Array:
        """ALiBi's bias on tile (i, j), (B|1, K, G, Tb, Sb): −slope · |t + S − T − s| with
        the real (unpadded) T and S, the distance from the bottom-right diagonal whatever
        the causal alignment; computed from the tile's indices, no (T, S) array."""
        t = i * self.Tb + jnp.arange(self.Tb, dtype=jnp.int32)[:, None]  # (Tb, 1)
        s = j * self.Sb + jnp.arange(self.Sb, dtype=jnp.int32)[None, :]  # (1, Sb)
        distance = jnp.abs(t + self.S - self.T - s).astype(self.work)  # (Tb, Sb)
        return -self.alibi * distance  # (B|1, K, G, Tb, Sb)

    def keys(self, j: jax.Array, used: jax.Array | None) -> jax.Array:
        """Key block j in the working precision, (B, K, Sb, D); a key no query of the
        block may see replaced by 0, so that whatever it holds has no effect (0 · NaN
        and 0 · inf are NaN)."""
        kj = lax.dynamic_slice_in_dim(self.k, j * self.Sb, self.Sb, axis=2).astype(self.work)
        return kj if used is None else jnp.where(used[..., None], kj, 0.0)  # (B, K, Sb, D)

    def values(self, j: jax.Array, used: jax.Array | None) -> jax.Array:
        """Value block j in the working precision, (B, K, Sb, E); unused ones 0."""
        vj = lax.dynamic_slice_in_dim(self.v, j * self.Sb, self.Sb, axis=2).astype(self.work)
        return vj if used is None else jnp.where(used[..., None], vj, 0.0)  # (B, K, Sb, E)

    def online_softmax(
        self, qi: jax.Array, i: jax.Array, rows=None, span=None
    ) -> tuple[jax.Array, ...]:
        """Steps 3-5 and 7 of query block i over its key blocks: the running max m, the
        row sums l (B, K, G·Tb) and the unnormalised output acc (B, K, G·Tb, E). ``rows``
        and ``span``: one packed document's (``scores``, ``walk``)."""

        def key_block(j: jax.Array, carry: tuple, banded_tile: bool) -> tuple:
            m, l, acc = carry  # (B, K, G·Tb), (B, K, G·Tb), (B, K, G·Tb, E)
            x, _, used = self.scores(qi, i, j, banded_tile, rows)  # (B, K, G·Tb, Sb), 1, 3, 4

            # 5. Softmax over the keys, online: rescale what was accumulated against the
            # old running max onto the new one (see the module docstring). A row that
            # has seen only blocked keys keeps max -inf; its exponent is taken against 0,
            # so its weights are exactly 0 instead of exp(-inf - -inf) = NaN.
            m_new = jnp.maximum(m, x.max(axis=-1))  # (B, K, G·Tb)
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, K, G·Tb)
            alpha = jnp.exp(m - m_safe)  # (B, K, G·Tb)
            p = jnp.exp(x - m_safe[..., None])  # (B, K, G·Tb, Sb)
            l = alpha * l + p.sum(axis=-1)  # (B, K, G·Tb)

            # 7. Weighted sum of the values, accumulated unnormalised.
            pv = jnp.einsum(
                "bkrs,bkse->bkre", p, self.values(j, used), precision=_HIGHEST
            )  # (B, K, G·Tb, E)
            return m_new, l, alpha[..., None] * acc + pv

        B, K, R, E = self.B, self.K, self.G * self.Tb, self.v.shape[-1]
        carry = (
            jnp.full((B, K, R), -jnp.inf, dtype=self.work),  # m: (B, K, G·Tb)
            jnp.zeros((B, K, R), dtype=self.work),  # l: (B, K, G·Tb)
            jnp.zeros((B, K, R, E), dtype=self.work),  # acc: (B, K, G·Tb, E)
        )
        return self.walk(i, key_block, carry, span)

    def sink_rows(self, sinks: jax.Array) -> jax.Array:
        """Each row's sink logit in the grouped layout, (B, K, G·Tb): row g·Tb + t of
        key/value head k belongs to query head h = k·G + g."""
        rows = sinks.astype(self.work).reshape(1, self.K, self.G, 1)  # (1, K, G, 1)
        rows = jnp.broadcast_to(rows, (self.B, self.K, self.G, self.Tb))  # (B, K, G, Tb)
        return rows.reshape(self.B, self.K, self.G * self.Tb)  # (B, K, G·Tb)

    def add_mask_grad(self, dm: jax.Array, dz: jax.Array, i: jax.Array, j: jax.Array):
        """4'. dmask += dZ on tile (i, j), summed over the axes along which one mask entry
        served many scores (broadcasting). dm: (B|1, H|1, Tp|1, Sp|1)."""
        b, h, tm, sm = dm.shape
        d = dz.reshape(self.B, self.K * self.G, self.Tb, self.Sb)  # (B, H, Tb, Sb)
        axes = tuple(a for a, n in enumerate((b, h, tm, sm)) if n == 1)
        d = d.sum(axis=axes, keepdims=True)  # (B|1, H|1, Tb|1, Sb|1)
        start = (0, 0, 0 if tm == 1 else i * self.Tb, 0 if sm == 1 else j * self.Sb)
        start = tuple(jnp.asarray(x, dtype=jnp.int32) for x in start)
        old = lax.dynamic_slice(dm, start, d.shape)  # (B|1, H|1, Tb|1, Sb|1)
        return lax.dynamic_update_slice(dm, old + d, start)  # (B|1, H|1, Tp|1, Sp|1)


class _Documents:
    """Packed documents on the tiles of ``_Tiles``: each query row's document and the
    keys [lower, upper) it may see (its document's keys, narrowed by causality and the
    window, in packed positions: one interval per row), the documents a query block
    touches, and the key blocks each of them needs. Traced: built from the boundaries
    inside the jitted functions."""

    def __init__(self, cu_q, cu_k, tiles: _Tiles, is_causal, bottom_right, window) -> None:
        self.tiles = tiles
        cu_q, cu_k = cu_q.astype(jnp.int32), cu_k.astype(jnp.int32)  # (N + 1,), (N + 1,)
        N = cu_q.shape[0] - 1
        t = jnp.arange(tiles.Tp, dtype=jnp.int32)  # (Tp,)
        # Token t lies in the last document n with cu_q[n] <= t (so empty documents are
        # passed over); the padded rows t >= T in none (-1).
        real = t < tiles.T  # (Tp,)
        doc = jnp.searchsorted(cu_q, t, side="right").astype(jnp.int32) - 1  # (Tp,)
        n = jnp.clip(doc, 0, N - 1)  # (Tp,), in range to index with
        first_key, end_key = cu_k[n], cu_k[n + 1]  # (Tp,), (Tp,)
        # The row's diagonal key in packed positions: its place in its document, shifted
        # by S_n - T_n under bottom-right alignment, from the document's first key.
        diagonal = t - cu_q[n] + first_key  # (Tp,)
        if bottom_right:
            diagonal = diagonal + (end_key - first_key) - (cu_q[n + 1] - cu_q[n])  # (Tp,)
        lower, upper = first_key, end_key  # (Tp,), (Tp,)
        left, right = window if window is not None else (None, None)
        if is_causal:
            right = 0 if right is None else min(right, 0)
        if left is not None:
            lower = jnp.maximum(lower, diagonal - left)  # (Tp,)
        if right is not None:
            upper = jnp.minimum(upper, diagonal + right + 1)  # (Tp,)
        self.doc = jnp.where(real, doc, -1)  # (Tp,)
        self.lower, self.upper = lower, upper  # (Tp,), (Tp,)

    def touched(self, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The documents [first, last) query block i holds rows of (with the empty ones
        between them, which have none), as loop bounds."""
        doc = lax.dynamic_slice_in_dim(self.doc, i * self.tiles.Tb, self.tiles.Tb)  # (Tb,)
        return doc[0], doc.max() + 1  # the block's first row is real (i·Tb < T)

    def rows(self, i: jax.Array, n: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """Query block i's rows in document n: ((lo, hi), sel). A row of document n with
        some key sees keys [lo, hi); every other row gets the empty [Sp, 0). sel (G·Tb,):
        the rows with some key, in the grouped layout (row g·Tb + t is query t)."""
        Tb, Sp = self.tiles.Tb, self.tiles.Sp
        doc, lower, upper = (
            lax.dynamic_slice_in_dim(x, i * Tb, Tb) for x in (self.doc, self.lower, self.upper)
        )  # (Tb,) each
        mine = (doc == n) & (lower < upper)  # (Tb,)
        lo = jnp.where(mine, lower, Sp)  # (Tb,)
        hi = jnp.where(mine, upper, 0)  # (Tb,)
        return (lo, hi), jnp.tile(mine, self.tiles.G)  # (Tb,), (Tb,), (G·Tb,)

    def span(self, rows: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        """The key blocks [first, last) some row sees, and within them [inner_first,
        inner_last), those every row of the block sees whole (none when a row lies in
        another document): ``_Tiles.key_blocks`` for one document's rows."""
        lo, hi = rows  # (Tb,), (Tb,)
        Sb, nS = self.tiles.Sb, self.tiles.nS
        first = jnp.clip(lo.min() // Sb, 0, nS)
        last = jnp.clip(-(-hi.max() // Sb), first, nS)
        inner_last = jnp.clip(hi.min() // Sb, first, last)
        inner_first = jnp.clip(-(-lo.max() // Sb), first, inner_last)
        return tuple(x.astype(jnp.int32) for x in (first, inner_first, inner_last, last))

    def online_softmax(self, qi: jax.Array, i: jax.Array) -> tuple[jax.Array, ...]:
        """``_Tiles.online_softmax`` of query block i, one document at a time: each row
        takes (m, l, acc) from the walk of its own document, so that nothing another
        document holds reaches it, not even through a weight of 0 times a NaN value."""
        tiles = self.tiles

        def document(n: jax.Array, carry: tuple) -> tuple:
            rows, sel = self.rows(i, n)  # (Tb,) twice, (G·Tb,)
            new = tiles.online_softmax(qi, i, rows, self.span(rows))
            m, l, acc = (
                jnp.where(sel if x.ndim == 3 else sel[:, None], y, x) for x, y in zip(carry, new)
            )
            return m, l, acc

        B, K, R, E = tiles.B, tiles.K, tiles.G * tiles.Tb, tiles.v.shape[-1]
        carry = (
            jnp.full((B, K, R), -jnp.inf, dtype=tiles.work),  # m: (B, K, G·Tb)
            jnp.zeros((B, K, R), dtype=tiles.work),  # l: (B, K, G·Tb)
            jnp.zeros((B, K, R, E), dtype=tiles.work),  # acc: (B, K, G·Tb, E)
        )
        return lax.fori_loop(*self.touched(i), document, carry)


def _prepare(q, k, v, mask, options: dict, block_q: int, block_k: int, d_out=None):
    """Step 0 and the static options: (the checked call, the batched q, k, v, the mask as
    (B|1, H|1, T|1, S|1), the sinks (H,) and ALiBi's slopes (H,) or (B, H), the keyword
    arguments of ``_flash``)."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask = None if mask is None else jnp.asarray(mask)
    sinks = options.pop("sinks")
    sinks = None if sinks is None else jnp.asarray(sinks)
    alibi = options.pop("alibi_slopes")
    alibi = None if alibi is None else jnp.asarray(alibi)
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
    if mask is not None:
        # Keep the mask as small as it was given, (B|1, H|1, T|1, S|1): broadcasting it
        # to (B, H, T, S) here would build the very T × S array this module avoids.
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
    static = dict(
        scale=call.scale,
        is_causal=call.is_causal,
        offset=0 if call.causal_alignment == "top_left" else call.S - call.T,
        window=call.window,
        softcap=call.softcap,
        chunk=call.chunk_size,
        Tb=max(1, min(block_q, call.T)),
        Sb=max(1, min(block_k, call.S)),
    )
    return call, (q, k, v, mask, sinks, alibi), static


def _score_product(spec: str, qi: jax.Array, kj: jax.Array) -> jax.Array:
    """Step 1's q·kᵀ of one tile, ``spec`` naming the axes, D last. With D = 1 the
    product gets a zero column (see Notes: head size 1), so that XLA keeps it a dot."""
    if qi.shape[-1] == 1:
        pad = [(0, 0)] * (qi.ndim - 1) + [(0, 1)]
        qi, kj = jnp.pad(qi, pad), jnp.pad(kj, pad)  # (..., 2): q·k + 0·0, the same sum
    return jnp.einsum(spec, qi, kj, precision=_HIGHEST)


def _mask_tile(mask: jax.Array, i: jax.Array, j: jax.Array, Tb: int, Sb: int):
    """Tile (i, j) of a (B|1, H|1, Tp|1, Sp|1) mask: (B|1, H|1, Tb|1, Sb|1)."""
    b, h, t, s = mask.shape
    start = (0, 0, 0 if t == 1 else i * Tb, 0 if s == 1 else j * Sb)
    start = tuple(jnp.asarray(x, dtype=jnp.int32) for x in start)
    size = (b, h, 1 if t == 1 else Tb, 1 if s == 1 else Sb)
    return lax.dynamic_slice(mask, start, size)  # (B|1, H|1, Tb|1, Sb|1)


def _add_block(x: jax.Array, update: jax.Array, s0: jax.Array) -> jax.Array:
    """x[:, :, s0:s0 + Sb] += update, in place: (B, K, Sp, ·)."""
    old = lax.dynamic_slice_in_dim(x, s0, update.shape[2], axis=2)  # (B, K, Sb, ·)
    return lax.dynamic_update_slice_in_dim(x, old + update, s0, axis=2)  # (B, K, Sp, ·)


def _grouped(x: jax.Array, K: int, G: int) -> jax.Array:
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)  # (B|1, 1, 1, T, S)
    return x.reshape(b, K, G, t, s)  # (B|1, K, G, T, S)
