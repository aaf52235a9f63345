"""Blockwise (FlashAttention-style) attention in JAX, compiled: never a T × S matrix.

The reference (``numpy_attention``) builds every score at once: a (B, H, T, S) array, 16
GiB in float32 for one 16384-token batch of 16 heads (16 · 16384² · 4 bytes). Yet each output row only needs a weighted
average of value rows, and an average can be accumulated a block of keys at a time, if the
softmax can be too. The *online softmax* makes it so.

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

Skipping blocks. Causal and window masks are bands around the diagonal, so for query block
i only the key blocks [first(i), last(i)) can hold a visible key: the inner loop runs
over just those (``fori_loop`` accepts traced bounds; it becomes a while loop). That
halves the work under a causal mask, which is where fused kernels get their causal
speed-up. Of those blocks, the ones wholly inside the band need no masking at all, so
the key loop is three loops: the blocks the band cuts on the left (a window), those
inside it (no mask computed), those it cuts on the right (the causal diagonal). (A
user-supplied mask is an input: its tiles are sliced, and a fully blocked tile is still
computed.)

Memory. No input is copied whole (except to pad T or S up to a block multiple): tiles
are sliced from the inputs and cast to the working precision tile by tile, and each
finished query block is written in place into the output. Beyond inputs and output the
loop holds one (B, K, G·Tb, Sb) score tile, its exponentials, and (B, K, G·Tb, E)
accumulators: with the defaults and B=1, H=8, a few MiB, whatever T and S are.

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
windows, softcapping, grouped-query and multi-query attention (K < H), float64, float32,
float16 and bfloat16 (computed in float32 and rounded once). A query row with no key left
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
      block_q: Tb, queries per tile (per query head); shrunk to T when T is smaller.
      block_k: Sb, keys per tile; shrunk to S when S is smaller.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate: the input contract every impl shares (contract.py) checks shapes,
    # dtypes and options, and names the argument, the expected shape and what was given.
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask = None if mask is None else jnp.asarray(mask)
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
        dropout_p=dropout_p,
        unsupported={"dropout_p": "jax-flash is blockwise attention without dropout"},
        tiles={"block_q": block_q, "block_k": block_k},
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    T, S = call.T, call.S
    if mask is not None:
        # Keep the mask as small as it was given, (B|1, H|1, T|1, S|1): broadcasting it
        # to (B, H, T, S) here would build the very T × S array this module avoids.
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
    if T == 0 or S == 0:
        # Nothing to tile: with T = 0 there is no query, and with S = 0 every query has
        # no key, so every output row is exactly 0, whatever q holds.
        out = jnp.zeros((call.B, call.H, T, call.E), dtype=q.dtype)  # (B, H, T, E)
        return out[0] if call.unbatched else out
    out = _flash(
        q,
        k,
        v,
        mask,
        scale=call.scale,
        is_causal=call.is_causal,
        offset=0 if call.causal_alignment == "top_left" else S - T,
        window=call.window,
        softcap=call.softcap,
        Tb=max(1, min(block_q, T)),
        Sb=max(1, min(block_k, S)),
    )  # (B, H, T, E)
    return out[0] if call.unbatched else out


@functools.partial(
    jax.jit,
    static_argnames=("scale", "is_causal", "offset", "window", "softcap", "Tb", "Sb"),
)
def _flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    *,
    scale: float,
    is_causal: bool,
    offset: int,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    Tb: int,
    Sb: int,
) -> jax.Array:
    """Steps 1-7 on checked, batched inputs; compiled once per shape, dtype and options."""
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    G = H // K
    nT, nS = -(-T // Tb), -(-S // Sb)  # blocks of queries and of keys
    Tp, Sp = nT * Tb, nS * Sb

    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    out_dtype = q.dtype
    work = jnp.float64 if out_dtype == jnp.float64 else jnp.float32

    # Pad T and S to whole blocks (a no-op when they already are). Tiles are sliced from
    # the inputs as they are, and cast to the working precision tile by tile, so that no
    # whole copy of an input is made.
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Tp - T), (0, 0)))  # (B, H, Tp, D)
    k = jnp.pad(k, ((0, 0), (0, 0), (0, Sp - S), (0, 0)))  # (B, K, Sp, D)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, Sp - S), (0, 0)))  # (B, K, Sp, E)
    if mask is not None:
        # Pad the mask's T and S axes where it has them (not where it broadcasts); padded
        # keys are blocked below anyway, and padded query rows are dropped.
        pad_t = Tp - T if mask.shape[2] == T else 0
        pad_s = Sp - S if mask.shape[3] == S else 0
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)))
        # mask: (B|1, H|1, Tp|1, Sp|1)

    # Which keys query t may see under causality and the window: lo <= s - t' <= hi, where
    # t' = t + offset is its aligned diagonal (offset = S - T for bottom-right).
    left, right = window if window is not None else (None, None)
    lo = -math.inf if left is None else -left
    hi = math.inf if right is None else right
    if is_causal:
        hi = min(hi, 0)
    banded = is_causal or window is not None

    def key_blocks(i: jax.Array) -> tuple[jax.Array, ...]:
        """For query block i: the key blocks [first, last) that can hold a visible key, and
        within them [inner_first, inner_last), the blocks where every query of the block
        sees every key (no masking needed). Traced int32 scalars."""
        t0 = i * Tb + offset  # diagonal of the block's first query
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
        if Sp != S:
            inner_last = jnp.minimum(inner_last, nS - 1)  # the padded block is masked
        first = jnp.clip(first, 0, nS).astype(jnp.int32)
        last = jnp.clip(last, first, nS).astype(jnp.int32)
        inner_last = jnp.clip(inner_last, first, last).astype(jnp.int32)
        inner_first = jnp.clip(inner_first, first, inner_last).astype(jnp.int32)
        return first, inner_first, inner_last, last

    def tile(i: jax.Array, j: jax.Array, x: jax.Array, banded_tile: bool) -> jax.Array:
        """Steps 3-4 on the scores x of tile (i, j): softcap, then mask. The band (and
        the padding) is masked only on a ``banded_tile``; the others lie inside it."""
        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        if softcap is not None:
            x = softcap * jnp.tanh(x / softcap)  # (B, K, G·Tb, Sb)

        # 4. Mask: a float mask is added; a bool mask, the causal triangle and the window
        # decide which keys each query may see at all, and so does a float mask's -inf:
        # blocked scores are replaced, not only pushed down by adding -inf, since
        # NaN + -inf is NaN.
        x = x.reshape(B, K, G, Tb, Sb)  # (B, K, G, Tb, Sb)
        allowed = None
        if mask is not None:
            m = _mask_tile(mask, i, j, Tb, Sb)  # (B|1, H|1, Tb|1, Sb|1)
            m = _grouped(m, K, G)  # (B|1, K|1, G|1, Tb|1, Sb|1)
            if mask.dtype == jnp.bool_:
                allowed = m
            else:
                x = x + m.astype(work)  # (B, K, G, Tb, Sb)
                allowed = m != -jnp.inf  # (B|1, K|1, G|1, Tb|1, Sb|1)
        if banded_tile:
            s = j * Sb + jnp.arange(Sb, dtype=jnp.int32)[None, :]  # (1, Sb)
            if banded:
                t = i * Tb + jnp.arange(Tb, dtype=jnp.int32)[:, None]  # (Tb, 1)
                distance = s - (t + offset)  # (Tb, Sb)
                band = jnp.ones((Tb, Sb), dtype=bool)  # (Tb, Sb)
                if lo != -math.inf:
                    band &= distance >= lo
                if hi != math.inf:
                    band &= distance <= hi
                allowed = band if allowed is None else allowed & band
            if Sp != S:
                allowed = s < S if allowed is None else allowed & (s < S)  # padded keys
        if allowed is not None:
            x = jnp.where(allowed, x, -jnp.inf)  # (B, K, G, Tb, Sb)
        return x.reshape(B, K, G * Tb, Sb)  # (B, K, G·Tb, Sb)

    def query_block(i: jax.Array, out: jax.Array) -> jax.Array:
        # 1. Scores: every query of the block against every key, one key block at a time
        # (key_block, below). Every tile's product starts from this query tile, so
        # 2. Scale, so that the scores' spread does not grow with the head size D, is
        # applied to it once, here: Tb·D multiplies instead of Tb·S. Query head h = k·G + g
        # shares key/value head k, so a kv head's tile serves its G query heads, stacked
        # as G·Tb rows.
        qi = lax.dynamic_slice_in_dim(q, i * Tb, Tb, axis=2)  # (B, H, Tb, D)
        qi = qi.astype(work) * work(scale)  # (B, H, Tb, D)
        qi = qi.reshape(B, K, G * Tb, D)  # (B, K, G·Tb, D)

        def key_block(j: jax.Array, carry: tuple, banded_tile: bool) -> tuple:
            m, l, acc = carry  # (B, K, G·Tb), (B, K, G·Tb), (B, K, G·Tb, E)
            # 1. Scores: every query of the block against every key of the block.
            kj = lax.dynamic_slice_in_dim(k, j * Sb, Sb, axis=2).astype(work)
            # kj: (B, K, Sb, D)
            x = jnp.einsum(
                "bkrd,bksd->bkrs", qi, kj, precision=lax.Precision.HIGHEST
            )  # (B, K, G·Tb, Sb), r = G·Tb rows
            x = tile(i, j, x, banded_tile)  # (B, K, G·Tb, Sb)

            # 5. Softmax over the keys, online: rescale what was accumulated against the
            # old running max onto the new one (see the module docstring). A row that has
            # seen only blocked keys keeps max -inf; its exponent is taken against 0, so
            # its weights are exactly 0 instead of exp(-inf - -inf) = NaN.
            m_new = jnp.maximum(m, x.max(axis=-1))  # (B, K, G·Tb)
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, K, G·Tb)
            alpha = jnp.exp(m - m_safe)  # (B, K, G·Tb)
            p = jnp.exp(x - m_safe[..., None])  # (B, K, G·Tb, Sb)
            l = alpha * l + p.sum(axis=-1)  # (B, K, G·Tb)

            # 7. Weighted sum of the values, accumulated unnormalised. A key that no query
            # of the block may see (padding, a KV-cache slot not yet written) has weight 0,
            # but 0 · NaN and 0 · inf are NaN: its value row is replaced by 0, so that
            # whatever it holds has no effect. (Only tiles that mask anything have one.)
            vj = lax.dynamic_slice_in_dim(v, j * Sb, Sb, axis=2).astype(work)
            # vj: (B, K, Sb, E)
            if mask is not None or banded_tile:
                seen = (x != -jnp.inf).reshape(B, K, G, Tb, Sb)  # (B, K, G, Tb, Sb)
                if Tp != T:
                    # The padded query rows see keys too, but are dropped: they use none.
                    real = i * Tb + jnp.arange(Tb, dtype=jnp.int32) < T  # (Tb,)
                    seen = seen & real[:, None]  # (B, K, G, Tb, Sb)
                used = seen.any(axis=(2, 3))  # (B, K, Sb)
                vj = jnp.where(used[..., None], vj, 0.0)  # (B, K, Sb, E)
            pv = jnp.einsum(
                "bkrs,bkse->bkre", p, vj, precision=lax.Precision.HIGHEST
            )  # (B, K, G·Tb, E)
            acc = alpha[..., None] * acc + pv  # (B, K, G·Tb, E)
            return m_new, l, acc

        inside = functools.partial(key_block, banded_tile=False)
        edge = functools.partial(key_block, banded_tile=True)
        carry = (
            jnp.full((B, K, G * Tb), -jnp.inf, dtype=work),  # m: (B, K, G·Tb)
            jnp.zeros((B, K, G * Tb), dtype=work),  # l: (B, K, G·Tb)
            jnp.zeros((B, K, G * Tb, E), dtype=work),  # acc: (B, K, G·Tb, E)
        )
        # The key blocks in order: those the band cuts on the left (a window), those
        # wholly inside it, and those it cuts on the right (the causal diagonal), so
        # that only the cut ones pay for the masking.
        first, inner_first, inner_last, last = key_blocks(i)
        carry = lax.fori_loop(first, inner_first, edge, carry)
        carry = lax.fori_loop(inner_first, inner_last, inside, carry)
        _, l, acc = lax.fori_loop(inner_last, last, edge, carry)
        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        acc = acc.reshape(B, H, Tb, E).astype(out_dtype)  # (B, H, Tb, E)
        return lax.dynamic_update_slice_in_dim(out, acc, i * Tb, axis=2)  # (B, H, Tp, E)

    out = jnp.zeros((B, H, Tp, E), dtype=out_dtype)  # (B, H, Tp, E)
    out = lax.fori_loop(0, nT, query_block, out)  # (B, H, Tp, E)
    return out[:, :, :T]  # (B, H, T, E), the padded rows cut off


def _mask_tile(mask: jax.Array, i: jax.Array, j: jax.Array, Tb: int, Sb: int):
    """Tile (i, j) of a (B|1, H|1, Tp|1, Sp|1) mask: (B|1, H|1, Tb|1, Sb|1)."""
    b, h, t, s = mask.shape
    start = (0, 0, 0 if t == 1 else i * Tb, 0 if s == 1 else j * Sb)
    start = tuple(jnp.asarray(x, dtype=jnp.int32) for x in start)
    size = (b, h, 1 if t == 1 else Tb, 1 if s == 1 else Sb)
    return lax.dynamic_slice(mask, start, size)  # (B|1, H|1, Tb|1, Sb|1)


def _grouped(x: jax.Array, K: int, G: int) -> jax.Array:
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)  # (B|1, 1, 1, T, S)
    return x.reshape(b, K, G, t, s)  # (B|1, K, G, T, S)
