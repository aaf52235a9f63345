"""Blockwise (FlashAttention-style) attention in NumPy: the same answer, never a T × S matrix.

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

Skipping blocks. Causal and window masks are bands around the diagonal; a (query block,
key block) tile that lies entirely outside the band contributes nothing and is never
computed, and a tile entirely inside needs no masking. That is where fused kernels get
their 2× causal speed-up. (A user-supplied mask is an input: its tiles are sliced, and a
fully blocked tile is still computed.)

Memory. No input is copied whole: tiles are sliced from views of q, k and v (and cast
to the working precision tile by tile), and each finished query block is written
straight into the output. Beyond inputs and output, one call holds a (B·K, G·Tb, Sb)
score tile, a (B·K, G·Tb, E) accumulator and a (B·K, G·Tb, D) query tile: with the
defaults and B=1, H=8, about 10 MiB in float32, whatever T and S are.

Speed. The two products per tile are ``np.matmul`` on float32 arrays, which BLAS runs on
all cores; everything else is an elementwise pass over the tile, done in place, on one
core (NumPy's ufuncs are single-threaded). The block sizes trade Python overhead and BLAS
efficiency (larger tiles) against cache residency (smaller ones). Square tiles also make
causal skipping pay: with Tb < Sb every query block's diagonal tile is a wide, half-masked
one. 512 × 512 was fastest on 2 cores, causal and not (T = 4096, float32). (Running query blocks on Python threads would parallelise the elementwise
passes, but OpenBLAS's own threads then fight them for the cores and every matmul
stalls.)

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim
    Tb query block     Sb key block       (the last block of each may be shorter)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores),
          broadcastable to (B, H, T, S)

Unbatched inputs q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, softcapping, grouped-query and multi-query attention (K < H), float64, float32,
float16 and bfloat16 (``ml_dtypes``, computed in float32 and rounded once). A query row with
no key left to attend returns exactly 0. Not supported: dropout (``dropout_p > 0`` raises
NotImplementedError).
"""

from __future__ import annotations

import math

import numpy as np

ALIGNMENTS = ("top_left", "bottom_right")


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    rng: np.random.Generator | None = None,
    block_q: int = 512,
    block_k: int = 512,
) -> np.ndarray:
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
      rng: unused (dropout is not supported).
      block_q: Tb, queries per tile (per query head).
      block_k: Sb, keys per tile.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate: every problem is reported with the argument's name, the expected shape
    # in letters and numbers, and what was given.
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check_inputs(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    G = H // K
    mask = _check_mask(mask, (B, H, T, S), unbatched)
    if isinstance(dropout_p, (int, float)) and 0 < dropout_p < 1:
        raise NotImplementedError(
            f"dropout_p={dropout_p!r} is not supported by numpy-flash (blockwise "
            f"attention without dropout); pass dropout_p=0.0"
        )
    scale = _check_options(D, scale, is_causal, causal_alignment, window, softcap, dropout_p, rng)
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{name} should be a positive int, got {size!r}")

    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    out_dtype = q.dtype
    work = np.float64 if out_dtype == np.float64 else np.float32

    # Query head h = k·G + g shares key/value head k (PyTorch's repeat_interleave, not
    # tiling). All of these are views: no copy of an input is made, only of its tiles.
    q = q.reshape(B * K, G, T, D)  # (B·K, G, T, D)
    k = k.reshape(B * K, S, D)  # (B·K, S, D)
    v = v.reshape(B * K, S, E)  # (B·K, S, E)
    out = np.empty((B * K, G, T, E), dtype=out_dtype)  # (B·K, G, T, E)

    offset = 0 if causal_alignment == "top_left" else S - T
    band = _Band(offset, is_causal, window)
    float_mask = mask if mask is not None and mask.dtype != np.bool_ else None
    bool_mask = mask if mask is not None and mask.dtype == np.bool_ else None

    def query_block(t0: int) -> None:
        t1 = min(t0 + block_q, T)
        Tb = t1 - t0
        # 2. Scale, folded into the query tile (Tb·D multiplies instead of Tb·S), so that
        # the scores' spread does not grow with the head size D. A kv head's tile is
        # shared by its G query heads: stack them as G·Tb rows.
        qb = q[:, :, t0:t1].astype(work) * work(scale)  # (B·K, G, Tb, D), a copy
        qb = qb.reshape(B * K, G * Tb, D)  # (B·K, G·Tb, D)
        m = np.full((B * K, G * Tb, 1), -np.inf, dtype=work)  # (B·K, G·Tb, 1)
        l = np.zeros((B * K, G * Tb, 1), dtype=work)  # (B·K, G·Tb, 1)
        acc = np.zeros((B * K, G * Tb, E), dtype=work)  # (B·K, G·Tb, E)
        pv = np.empty_like(acc)  # (B·K, G·Tb, E)
        for s0 in range(0, S, block_k):
            s1 = min(s0 + block_k, S)
            Sb = s1 - s0
            inside = band.tile(t0, t1, s0, s1)
            if inside is None:
                continue  # every (query, key) pair of the tile is outside the band

            # 1. Scores: every query of the block against every key of the block.
            kb = k[:, s0:s1].astype(work, copy=False)  # (B·K, Sb, D)
            x = np.matmul(qb, kb.transpose(0, 2, 1))  # (B·K, G·Tb, Sb)

            # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
            if softcap is not None:
                np.tanh(x / softcap, out=x)  # (B·K, G·Tb, Sb)
                x *= work(softcap)  # (B·K, G·Tb, Sb)

            # 4. Mask: a float mask is added; a bool mask, the causal triangle and the
            # window decide which keys each query may see at all.
            x5 = x.reshape(B, K, G, Tb, Sb)  # (B, K, G, Tb, Sb), a view of x
            if float_mask is not None:
                tile = float_mask[:, :, t0:t1, s0:s1]  # (B|1, H|1, Tb, Sb)
                x5 += _grouped(tile, K, G)  # (B, K, G, Tb, Sb)
            allowed = None
            if bool_mask is not None:
                allowed = _grouped(bool_mask[:, :, t0:t1, s0:s1], K, G)
                # allowed: (B|1, K|1, G|1, Tb, Sb)
            if not inside:
                allowed = band.allowed(t0, t1, s0, s1) & (
                    True if allowed is None else allowed
                )  # (B|1, K|1, G|1, Tb, Sb)
            if allowed is not None:
                np.copyto(x5, -np.inf, where=~allowed)  # (B, K, G, Tb, Sb)

            # 5. Softmax over the keys, online: rescale what was accumulated against the
            # old running max onto the new one (see the module docstring). A row that has
            # seen only blocked keys keeps max -inf; its exponent is taken against 0, so
            # its weights are exactly 0 instead of exp(-inf - -inf) = NaN.
            m_new = np.maximum(m, x.max(axis=-1, keepdims=True))  # (B·K, G·Tb, 1)
            m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # (B·K, G·Tb, 1)
            alpha = np.exp(m - m_safe)  # (B·K, G·Tb, 1)
            x -= m_safe  # (B·K, G·Tb, Sb)
            p = np.exp(x, out=x)  # (B·K, G·Tb, Sb)
            l *= alpha  # (B·K, G·Tb, 1)
            l += p.sum(axis=-1, keepdims=True)  # (B·K, G·Tb, 1)
            m = m_new

            # 7. Weighted sum of the values, accumulated unnormalised.
            acc *= alpha  # (B·K, G·Tb, E)
            vb = v[:, s0:s1].astype(work, copy=False)  # (B·K, Sb, E)
            acc += np.matmul(p, vb, out=pv)  # (B·K, G·Tb, E)

        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        # Assigning into out rounds to the output dtype once.
        acc /= np.where(l > 0, l, 1.0)  # (B·K, G·Tb, E)
        out[:, :, t0:t1] = acc.reshape(B * K, G, Tb, E)  # (B·K, G, Tb, E)

    for t0 in range(0, T, block_q):
        query_block(t0)

    # The query heads back in order h = k·G + g.
    out = out.reshape(B, H, T, E)  # (B, H, T, E)
    return out[0] if unbatched else out


class _Band:
    """The causal/window band: which keys s query t may see, as s - (t + offset)."""

    def __init__(
        self,
        offset: int,
        is_causal: bool,
        window: tuple[int | None, int | None] | None,
    ) -> None:
        # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that
        # the last query lines up with the last key). Allowed: lo <= s - (t + offset) <= hi.
        left, right = window if window is not None else (None, None)
        self.offset = offset
        self.lo = -math.inf if left is None else -left
        self.hi = math.inf if right is None else right
        if is_causal:
            self.hi = min(self.hi, 0)
        self.active = is_causal or window is not None

    def tile(self, t0: int, t1: int, s0: int, s1: int) -> bool | None:
        """True: the whole tile is inside the band; False: partly; None: all outside."""
        if not self.active:
            return True
        near = s0 - (t1 - 1 + self.offset)  # smallest distance in the tile
        far = s1 - 1 - (t0 + self.offset)  # largest distance in the tile
        if far < self.lo or near > self.hi:
            return None
        return bool(near >= self.lo and far <= self.hi)

    def allowed(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """Which keys each query of the tile may see: (Tb, Sb) bool."""
        t = np.arange(t0, t1)[:, None]  # (Tb, 1)
        s = np.arange(s0, s1)[None, :]  # (1, Sb)
        distance = s - (t + self.offset)  # (Tb, Sb)
        return (distance >= self.lo) & (distance <= self.hi)  # (Tb, Sb)


def _grouped(x: np.ndarray, K: int, G: int) -> np.ndarray:
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
