"""Blockwise (FlashAttention-style) attention in JAX, compiled: never a T × S matrix.

The reference (``numpy_attention``) builds every score at once: a (B, H, T, S) array, 4 GiB
in float32 for one 16384-token batch of 16 heads. Yet each output row only needs a weighted
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
i only the key blocks [lo(i), hi(i)) can hold a visible key: the inner loop runs over just
those (``fori_loop`` accepts traced bounds; it becomes a while loop). That halves the work
under a causal mask, which is where fused kernels get their causal speed-up. (A
user-supplied mask is an input: its tiles are sliced, and a fully blocked tile is still
computed.)

Memory. No input is copied whole (except to pad T or S up to a block multiple): tiles
are sliced from the inputs and cast to the working precision tile by tile, and each
finished query block is written in place into the output. Beyond inputs and output the
loop holds one (B, K, G·Tb, Sb) score tile, its exponentials, and (B, K, G·Tb, E)
accumulators: with the defaults and B=1, H=8, a few MiB, whatever T and S are.

Speed, on a CPU. XLA hands the two products of a tile to its matmul library and fuses
the max, exp and sum passes into a few loops over the tile. Larger tiles amortise the
loop overhead and make bigger matmuls; smaller ones stay in cache. 512 × 256 was fastest
on 2 cores in float32, causal and not (T = 4096). Precision is HIGHEST, which the CPU honours anyway (it has no
reduced-precision float32 matmul), and which keeps float32 results bitwise stable.

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
import numpy as np
from jax import lax

ALIGNMENTS = ("top_left", "bottom_right")


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
    # 0. Validate: every problem is reported with the argument's name, the expected shape
    # in letters and numbers, and what was given.
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check_inputs(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    B, H, T, D = q.shape
    S = k.shape[-2]
    checked = _check_mask(mask, (B, H, T, S), unbatched)
    if isinstance(dropout_p, (int, float)) and 0 < dropout_p < 1:
        raise NotImplementedError(
            f"dropout_p={dropout_p!r} is not supported by jax-flash (blockwise "
            f"attention without dropout); pass dropout_p=0.0"
        )
    scale = _check_options(D, scale, is_causal, causal_alignment, window, softcap, dropout_p, key)
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{name} should be a positive int, got {size!r}")
    if checked is not None:
        # Keep the mask as small as it was given, (B|1, H|1, T|1, S|1): broadcasting it
        # to (B, H, T, S) here would build the very T × S array this module avoids.
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (B|1, H|1, T|1, S|1)
    # jax.jit needs hashable static options: a list window becomes a tuple.
    window = None if window is None else tuple(window)
    out = _flash(
        q,
        k,
        v,
        mask,
        scale=scale,
        is_causal=bool(is_causal),
        offset=0 if causal_alignment == "top_left" else S - T,
        window=window,
        softcap=softcap,
        Tb=max(1, min(block_q, T)),
        Sb=max(1, min(block_k, S)),
    )  # (B, H, T, E)
    return out[0] if unbatched else out


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

    def key_blocks(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The key blocks [first, last) that can hold a key visible to query block i."""
        if not banded:
            return jnp.int32(0), jnp.int32(nS)
        t0 = i * Tb + offset  # diagonal of the block's first query
        first = 0 if lo == -math.inf else jnp.clip((t0 + lo) // Sb, 0, nS)
        last = nS if hi == math.inf else jnp.clip((t0 + Tb - 1 + hi) // Sb + 1, 0, nS)
        return jnp.int32(first), jnp.maximum(jnp.int32(first), jnp.int32(last))

    def tile(i: jax.Array, j: jax.Array, x: jax.Array) -> jax.Array:
        """Steps 3-4 on the scores x of tile (i, j): softcap, then mask."""
        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        if softcap is not None:
            x = softcap * jnp.tanh(x / softcap)  # (B, K, G·Tb, Sb)

        # 4. Mask: a float mask is added; a bool mask, the causal triangle and the window
        # decide which keys each query may see at all.
        x = x.reshape(B, K, G, Tb, Sb)  # (B, K, G, Tb, Sb)
        allowed = None
        if mask is not None:
            m = _mask_tile(mask, i, j, Tb, Sb)  # (B|1, H|1, Tb|1, Sb|1)
            m = _grouped(m, K, G)  # (B|1, K|1, G|1, Tb|1, Sb|1)
            if mask.dtype == jnp.bool_:
                allowed = m
            else:
                x = x + m.astype(work)  # (B, K, G, Tb, Sb)
        s = j * Sb + jnp.arange(Sb)[None, :]  # (1, Sb)
        if banded:
            t = i * Tb + jnp.arange(Tb)[:, None]  # (Tb, 1)
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
        # 2. Scale, folded into the query tile (Tb·D multiplies instead of Tb·S), so that
        # the scores' spread does not grow with the head size D. Query head h = k·G + g
        # shares key/value head k, so a kv head's tile serves its G query heads, stacked
        # as G·Tb rows.
        qi = lax.dynamic_slice_in_dim(q, i * Tb, Tb, axis=2)  # (B, H, Tb, D)
        qi = qi.astype(work) * work(scale)  # (B, H, Tb, D)
        qi = qi.reshape(B, K, G * Tb, D)  # (B, K, G·Tb, D)

        def key_block(j: jax.Array, carry: tuple) -> tuple:
            m, l, acc = carry  # (B, K, G·Tb), (B, K, G·Tb), (B, K, G·Tb, E)
            # 1. Scores: every query of the block against every key of the block.
            kj = lax.dynamic_slice_in_dim(k, j * Sb, Sb, axis=2).astype(work)
            # kj: (B, K, Sb, D)
            x = jnp.einsum(
                "bkrd,bksd->bkrs", qi, kj, precision=lax.Precision.HIGHEST
            )  # (B, K, G·Tb, Sb), r = G·Tb rows
            x = tile(i, j, x)  # (B, K, G·Tb, Sb)

            # 5. Softmax over the keys, online: rescale what was accumulated against the
            # old running max onto the new one (see the module docstring). A row that has
            # seen only blocked keys keeps max -inf; its exponent is taken against 0, so
            # its weights are exactly 0 instead of exp(-inf - -inf) = NaN.
            m_new = jnp.maximum(m, x.max(axis=-1))  # (B, K, G·Tb)
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, K, G·Tb)
            alpha = jnp.exp(m - m_safe)  # (B, K, G·Tb)
            p = jnp.exp(x - m_safe[..., None])  # (B, K, G·Tb, Sb)
            l = alpha * l + p.sum(axis=-1)  # (B, K, G·Tb)

            # 7. Weighted sum of the values, accumulated unnormalised.
            vj = lax.dynamic_slice_in_dim(v, j * Sb, Sb, axis=2).astype(work)
            # vj: (B, K, Sb, E)
            pv = jnp.einsum(
                "bkrs,bkse->bkre", p, vj, precision=lax.Precision.HIGHEST
            )  # (B, K, G·Tb, E)
            acc = alpha[..., None] * acc + pv  # (B, K, G·Tb, E)
            return m_new, l, acc

        init = (
            jnp.full((B, K, G * Tb), -jnp.inf, dtype=work),  # m: (B, K, G·Tb)
            jnp.zeros((B, K, G * Tb), dtype=work),  # l: (B, K, G·Tb)
            jnp.zeros((B, K, G * Tb, E), dtype=work),  # acc: (B, K, G·Tb, E)
        )
        first, last = key_blocks(i)
        _, l, acc = lax.fori_loop(first, last, key_block, init)
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


def _is_float(a: np.ndarray) -> bool:
    # bfloat16 from ml_dtypes has kind "V", so it is recognised by name.
    return a.dtype.kind == "f" or a.dtype.name == "bfloat16"


def _check_inputs(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if q.ndim not in (3, 4):
        raise ValueError(
            f"q should have rank 4 (B, H, T, D) or 3 (H, T, D), got rank {q.ndim} "
            f"with shape {q.shape}"
        )
    letters = "(B, K, S, D)" if q.ndim == 4 else "(K, S, D)"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(
                f"{name} should have rank {q.ndim} {letters} like q, got rank {x.ndim} "
                f"with shape {x.shape}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _is_float(x):
            raise TypeError(f"{name} should be a floating array, got dtype {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} dtype should be {q.dtype} like q, got {x.dtype}")
    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, k, v))
    B, H, T, D = q4.shape
    _, K, S, _ = k4.shape
    E = v4.shape[-1]
    batch = "B, " if q.ndim == 4 else ""
    drop = 0 if q.ndim == 4 else 1
    if K == 0 or H % K != 0:
        raise ValueError(
            f"k heads K={K} should divide q heads H={H} (grouped-query attention shares "
            f"each key/value head among H // K query heads), got k shape {k.shape}"
        )
    want_k = (B, K, S, D)[drop:]
    if k.shape != want_k:
        raise ValueError(
            f"k shape should be ({batch}K, S, D) = {want_k} to match q {q.shape}, got {k.shape}"
        )
    want_v = (B, K, S, E)[drop:]
    if v.shape[:-1] != want_v[:-1]:
        raise ValueError(
            f"v shape should be ({batch}K, S, E) = {want_v} to match k {k.shape}, got {v.shape}"
        )


def _check_mask(
    mask: np.ndarray | None, shape: tuple[int, int, int, int], unbatched: bool
) -> np.ndarray | None:
    """Return the mask as a (B|1, H|1, T, S) array, or None."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ and not _is_float(mask):
        raise TypeError(
            f"mask dtype should be bool (True = may attend) or floating (added to the "
            f"scores), got {mask.dtype}: an integer mask is ambiguous"
        )
    want = shape[1:] if unbatched else shape
    letters = "(H, T, S)" if unbatched else "(B, H, T, S)"
    try:
        fits = mask.ndim <= len(want) and np.broadcast_shapes(mask.shape, want) == want
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"mask shape should broadcast to {letters} = {want}, got {mask.shape}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (B|1, H|1, T|1, S|1)
    B, H, T, S = shape
    b, h = mask.shape[0], mask.shape[1]
    return np.broadcast_to(mask, (b, h, T, S))  # (B|1, H|1, T, S)


def _check_options(
    D: int,
    scale: float | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    dropout_p: float,
    rng: np.random.Generator | None,
) -> float:
    """Check the keyword options; return the scale to use."""
    if not isinstance(is_causal, (bool, np.bool_)):
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
    if dropout_p > 0 and not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng should be a numpy.random.Generator when dropout_p > 0, got {rng!r}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale should be a positive float or None, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale should be a positive finite float, got {scale!r}")
    return float(scale)
