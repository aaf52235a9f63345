"""Blockwise (FlashAttention-style) attention in NumPy: the same answer, never a T × S matrix.

    out = softmax(mask(softcap(scale · q kᵀ))) v

The core page builds every score at once, a (B, H, T, S) array: 16 GiB in float32 for
16 heads of 16384 tokens. Yet an output row, a weighted average of value rows, can be
built a block of keys at a time if the softmax can: the *online softmax*. For one query
row with scores x_1 … x_S, out = Σ_s exp(x_s − m) v_s / Σ_s exp(x_s − m) for any m; the
safe softmax takes m = max_s x_s, so that no exp() overflows, and so walks the keys three
times: for m, for l = Σ exp(x_s − m), for the weighted sum. The walks fold into one
through a surrogate, the sums against the maximum *so far* m_s = max(x_1 … x_s):

    l_s = Σ_{j ≤ s} exp(x_j − m_s)            a_s = Σ_{j ≤ s} exp(x_j − m_s) v_j

Each follows from the one before, by induction, since exp(x_j − m_{s−1}) · exp(m_{s−1} −
m_s) = exp(x_j − m_s): with α = exp(m_{s−1} − m_s) ≤ 1,

    l_s = α · l_{s−1} + exp(x_s − m_s)        a_s = α · a_{s−1} + exp(x_s − m_s) v_s

α is exact, no approximation: it moves every term summed so far onto the new maximum at
once. After the last key m_S is the row's maximum, so out = a_S / l_S; only the rounding
differs from the core page. A block of keys in place of one changes only the sums.
``online_softmax_row`` is this recurrence for one row (m, l, a); ``attention`` runs it,
with the same names, on tiles of Tb rows and Sb keys. docs/walkthrough/flash.md derives it
in code that runs (three passes, two, one) and follows the worked example through it.

Blocked keys have score −inf. A row that has seen only blocked keys has m = −inf, and
exp(x − m) would be exp(−inf + inf) = NaN: ``online_softmax_row``, the lesson, leaves that
out; ``attention`` takes such a row's exponents against 0 instead (``m_safe``), so its
weights are 0, and a row that never sees a key returns exactly 0, as the core page's.

``attention(..., fast=True)``, what the numpy-flash backend runs, gives the same rows
faster through the optimisations of ``flash_tiles.py``, on whose tiles ``attention_vjp``
runs FlashAttention-2's backward. Shapes: the core page's, and Tb query block, Sb key block.
"""

from __future__ import annotations

import numpy as np

from .. import contract
from . import flash_tiles
from .attention import visible
from .flash_tiles import KeyTiles, backward_lse, fast_online_softmax, normalise, running_lse


def online_softmax_row(x: np.ndarray, v: np.ndarray, block: int) -> np.ndarray:
    """The recurrence for one query row: scores x (S,), values v (S, E), ``block`` keys at
    a time. The lesson only: a first block of blocked keys (all −inf) makes the row NaN
    here; ``attention`` guards that (see "Blocked keys" above)."""
    m, l, a = -np.inf, 0.0, np.zeros(v.shape[-1])  # a: (E,)
    for s0 in range(0, len(x), block):
        x_b, v_b = x[s0 : s0 + block], v[s0 : s0 + block]  # (Sb,), (Sb, E)
        m_new = max(m, x_b.max())  # the running maximum
        alpha = np.exp(m - m_new)  # α: what was summed against m, onto m_new
        p = np.exp(x_b - m_new)  # (Sb,)
        l = alpha * l + p.sum()
        a = alpha * a + p @ v_b  # (E,)
        m = m_new
    return a / l  # (E,)


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
    sinks: np.ndarray | None = None,
    chunk_size: int | None = None,
    alibi_slopes: np.ndarray | None = None,
    block_q: int = 256,
    block_k: int = 512,
    fast: bool = False,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention, computed one (query block, key block) tile at a time.

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes: as for the core page's ``attention``.
      dropout_p: must be 0; dropout is not supported here.
      block_q, block_k: Tb and Sb, queries (per head) and keys per tile.
      fast: the same rows through ``flash_tiles.py``'s optimisations.

    Returns:
      out: (B, H, T, E), or (H, T, E) unbatched, q's dtype; with return_lse (out, lse (B, H, T)).
    """
    options = dict(is_causal=is_causal, scale=scale, causal_alignment=causal_alignment)
    options.update(window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks)
    options.update(chunk_size=chunk_size, alibi_slopes=alibi_slopes)
    return_lse = contract.check_bool("return_lse", return_lse)
    if contract.check_bool("fast", fast):
        return flash_tiles.attention(q, k, v, mask, options, block_q, block_k, return_lse)
    # 0. Validate with the input contract every impl shares; add the batch axis.
    call, q, k, v, mask, slopes = batched(q, k, v, mask, options, block_q, block_k)
    B, H, T, S, E = call.B, call.H, call.T, call.S, call.E
    work = np.float64 if q.dtype == np.float64 else np.float32  # float16 is computed in float32
    out, lse = np.empty((B, H, T, E), q.dtype), np.empty((B, H, T), work)  # and (B, H, T)

    for t0 in range(0, T, block_q):
        t1 = min(t0 + block_q, T)
        m = np.full((B, H, t1 - t0, 1), -np.inf, dtype=work)  # (B, H, Tb, 1)
        l = np.zeros((B, H, t1 - t0, 1), dtype=work)  # (B, H, Tb, 1)
        a = np.zeros((B, H, t1 - t0, E), dtype=work)  # (B, H, Tb, E)
        for s0 in range(0, S, block_k):
            s1 = min(s0 + block_k, S)
            # Steps 1-4 on the tile; None where no query of the block may see a key of it.
            x, v_b = tile(q, k, v, mask, slopes, call, (t0, t1, s0, s1), work)  # (B, H, Tb, Sb)
            if x is None:
                continue
            # 5. Softmax, online: the new running maximum, and α to move l and a onto it.
            # A row that has seen only blocked keys takes its exponents against 0.
            m_new = np.maximum(m, x.max(axis=-1, keepdims=True))  # (B, H, Tb, 1)
            m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # (B, H, Tb, 1)
            with np.errstate(over="ignore", invalid="ignore"):  # see Edge cases below
                alpha = np.exp(m - m_safe)  # (B, H, Tb, 1)
                p = np.exp(x - m_safe)  # (B, H, Tb, Sb)
                l = alpha * l + p.sum(axis=-1, keepdims=True)  # (B, H, Tb, 1)

                # 7. Weighted sum of the values, accumulated unnormalised.
                a = alpha * a + np.matmul(p, v_b)  # (B, H, Tb, E)
            m = m_new

        if sinks is not None:
            m, l, a = add_sink_key(m, l, a, sinks, work)
        # Normalise once, at the end; a row that saw no key has l = 0 and a = 0 and gives
        # 0. Assigning into out rounds to the output dtype once.
        with np.errstate(invalid="ignore"):  # inf / inf: see Edge cases below
            out[:, :, t0:t1] = a / np.where(l > 0, l, 1.0)  # (B, H, Tb, E)
        # 8. The log-sum-exp, for return_lse: l = Σ exp(x − m), so log Σ exp(x) = m + log l,
        # one number per row that the pair the walk ends with already holds. It is what the
        # backward keeps of the forward, and what merges results over two parts of the keys
        # (the core page's Notes: the log-sum-exp).
        lse[:, :, t0:t1] = running_lse(m, l)  # (B, H, Tb)
    if call.unbatched:
        out, lse = out[0], lse[0]  # (H, T, E), (H, T)
    return (out, lse) if return_lse else out


def tile(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    slopes: np.ndarray | None,
    call: contract.Checked,
    span: tuple[int, int, int, int],
    work: type,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Steps 1-4 on tile (t0:t1, s0:s1): the masked scores (B, H, Tb, Sb) and the values
    (B, H, Sb, E) in the working precision, or (None, None) where the causal triangle, the
    window or the chunks let no query of the block see any key of the tile (skipped: the
    fused kernels' 2× causal speed-up)."""
    t0, t1, s0, s1 = span
    allowed = visible_in_tile(call, t0, t1, s0, s1)  # (Tb, Sb)
    if not allowed.any():
        return None, None
    # Grouped-query attention: query head h reads key/value head h // G.
    q_b = q[:, :, t0:t1].astype(work)  # (B, H, Tb, D)
    k_b = np.repeat(k[:, :, s0:s1].astype(work), call.G, axis=1)  # (B, H, Sb, D)
    v_b = np.repeat(v[:, :, s0:s1].astype(work), call.G, axis=1)  # (B, H, Sb, E)

    # 1. Scores, and 2. the scale, so that their spread does not grow with D.
    with np.errstate(over="ignore", invalid="ignore"):  # see Edge cases below
        x = np.matmul(q_b, k_b.transpose(0, 1, 3, 2)) * work(call.scale)  # (B, H, Tb, Sb)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if call.softcap is not None:
        with np.errstate(over="ignore"):  # x / softcap = ±inf has tanh ±1
            x = call.softcap * np.tanh(x / call.softcap)  # (B, H, Tb, Sb)

    # 4. Mask: ALiBi's bias and a float mask are added; every key a query may not see
    # gets -inf.
    if slopes is not None:
        x = x + alibi_bias(slopes, call, t0, t1, s0, s1)  # (B, H, Tb, Sb)
    if mask is not None and mask.dtype == np.bool_:
        allowed = allowed & mask[:, :, t0:t1, s0:s1]  # (B|1, H|1, Tb, Sb)
    elif mask is not None:
        m_b = mask[:, :, t0:t1, s0:s1].astype(work)  # (B|1, H|1, Tb, Sb)
        with np.errstate(invalid="ignore"):  # +inf + -inf: blocked below anyway
            x = x + m_b  # (B, H, Tb, Sb)
        allowed = allowed & (m_b != -np.inf)  # (B|1, H|1, Tb, Sb)
    x = np.where(allowed, x, -np.inf)  # (B, H, Tb, Sb)
    v_b = unseen_values_zeroed(v_b, allowed)  # (B, H, Sb, E)
    return x, v_b


def visible_in_tile(call: contract.Checked, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
    """Which keys each query of the tile may see by position: (Tb, Sb) bool, the core page's
    ``visible`` on the tile's positions. Query t's diagonal is key t (top-left) or
    t + S − T (bottom-right: the last query sees the last key)."""
    offset = 0 if call.causal_alignment == "top_left" else call.S - call.T
    t = np.arange(t0, t1)[:, None] + offset  # (Tb, 1): each query's diagonal
    s = np.arange(s0, s1)[None, :]  # (1, Sb)
    allowed = np.ones((t1 - t0, s1 - s0), dtype=bool)  # (Tb, Sb)
    return visible(allowed, t, s, call.is_causal, call.window, call.chunk_size)  # (Tb, Sb)


def alibi_bias(
    slopes: np.ndarray, call: contract.Checked, t0: int, t1: int, s0: int, s1: int
) -> np.ndarray:
    """ALiBi's bias on the tile, (B|1, H, Tb, Sb): −slope · |t + S − T − s|, the distance
    from the bottom-right diagonal whatever the causal alignment, from the tile's own
    positions: no (T, S) bias is ever built."""
    t = np.arange(t0, t1)[:, None]  # (Tb, 1)
    s = np.arange(s0, s1)[None, :]  # (1, Sb)
    distance = np.abs(t + call.S - call.T - s).astype(slopes.dtype)  # (Tb, Sb)
    return -slopes * distance  # (B|1, H, Tb, Sb)


def add_sink_key(
    m: np.ndarray, l: np.ndarray, a: np.ndarray, sinks: np.ndarray, work: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sinks (one logit per query head): one more key per row, through the same update,
    whose value row is 0; a row that saw no key gets none, and stays 0."""
    x = np.asarray(sinks).astype(work).reshape(1, -1, 1, 1)  # (1, H, 1, 1)
    x = np.where(l > 0, x, -np.inf)  # (B, H, Tb, 1)
    m_new = np.maximum(m, x)  # (B, H, Tb, 1)
    m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # (B, H, Tb, 1)
    with np.errstate(over="ignore", invalid="ignore"):  # see Edge cases below
        alpha = np.exp(m - m_safe)  # (B, H, Tb, 1)
        p = np.exp(x - m_safe)  # (B, H, Tb, 1)
        l = alpha * l + p  # (B, H, Tb, 1)
        a = alpha * a + p * 0.0  # (B, H, Tb, E): p · (its value row, 0)
    return m_new, l, a


# Edge cases: the guards the spec's edges need, below the lesson.
#
# - Step 0, ``batched``: the contract names a bad argument, its expected shape and what was
#   given (SPEC §8); float16 and bfloat16 are computed in float32, whose exp() does not
#   overflow past 11.09 and whose sums keep the small weights, and rounded once.
# - Overflow (SPEC §3.8, §4.1, §4.8, §4.9): a score of +inf (q·k overflowed, or a +inf
#   float mask entry), an inf value, or a weighted sum past the largest float makes its
#   row NaN, as IEEE arithmetic says: inf − inf, inf / inf and inf · 0 are that NaN, not a
#   fault, so those warnings are silenced where they can happen. The scale multiplies
#   q·kᵀ after the product, as on the core page, so a finite score near 1e308 stays finite.
# - A softcap near 1e308: x / softcap may be subnormal, and its tanh is kept exact by
#   NumPy; a score far above the softcap gives x / softcap = ±inf, whose tanh is ±1.
# - Blocked keys (SPEC §4.3, §4.7): their scores are replaced by −inf, not only pushed
#   down by adding −inf, since NaN + −inf is NaN; a value row that no query of the tile may
#   see is replaced by 0 (``unseen_values_zeroed``), since its weight 0 times a NaN or inf
#   held there (padding, a KV-cache slot not yet written) is NaN.
# - Sinks (SPEC §15.3, §15.4): a sink of 1e4 joins the maximum, so nothing overflows; a NaN
#   or +inf sink makes a row with a key NaN through p · 0, and a row with no key stays 0.


def unseen_values_zeroed(v_b: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The tile's value rows (B, H, Sb, E), those that no query of the tile may see (per
    head) replaced by 0 (Edge cases, above)."""
    if np.all(allowed):
        return v_b
    used = np.any(allowed, axis=-2)[..., None]  # (B|1, H|1, Sb, 1) or (Sb, 1)
    return np.where(used, v_b, 0.0)  # (B, H, Sb, E)


def batched(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    options: dict,
    block_q: int,
    block_k: int,
) -> tuple:
    """Step 0: the input contract's checks (Edge cases, above); then the batch axis, added
    to unbatched inputs, the mask as (B|1, H|1, T, S), and ALiBi's slopes as (B|1, H, 1, 1)
    in the working precision, or None."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    slopes = options["alibi_slopes"]
    if slopes is not None:
        options["alibi_slopes"] = slopes = np.asarray(slopes)
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        **options,
        unsupported={"dropout_p": "numpy-flash is blockwise attention without dropout"},
        tiles={"block_q": block_q, "block_k": block_k},
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = np.broadcast_to(mask.reshape(call.mask_shape), (b, h, call.T, call.S))
    if slopes is not None:
        work = np.float64 if q.dtype == np.float64 else np.float32
        slopes = slopes.astype(work).reshape(-1, call.H, 1, 1)  # (B|1, H, 1, 1)
    return call, q, k, v, mask, slopes


def attention_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: np.ndarray | None = None,
    chunk_size: int | None = None,
    alibi_slopes: np.ndarray | None = None,
    block_q: int = 256,
    block_k: int = 512,
    d_lse: np.ndarray | None = None,
) -> tuple[np.ndarray, ...]:
    """Gradients of ``attention``, FlashAttention-2's way: tile by tile, no T × S matrix.

    The naive backward (``backward.py``) keeps the (T, S) weights P of
    the forward and walks back through them; for one query row t, with O the output, Z
    the scores entering the softmax and R the scaled raw scores:

        dV   = Pᵀ·dO                          dP = dO·Vᵀ
        dZ   = P ⊙ (dP − rowsum(dP ⊙ P))     the softmax's Jacobian
        dR   = dZ ⊙ (1 − tanh²(R/c))          softcap c (dR = dZ without it)
        dQ   = scale · dR·K                   dK = scale · dRᵀ·Q

    Every line but one is a product of a (T, S) tile with a (T, ·) or (S, ·) block, so
    it can be summed tile by tile: dV[s] and dK[s] collect Σ_t over the query blocks,
    dQ[t] collects Σ_s over the key tiles. Two things stand in the way, and both go:

    Why Δ replaces the row sums of dP ⊙ P. The softmax's coupling term
    Σ_s P[t,s]·dP[t,s] is a sum over every key of the row, which no single tile has.
    But dP[t,s] = dO[t]·v[s], so

        Σ_s P[t,s] dP[t,s] = dO[t] · Σ_s P[t,s] v[s] = dO[t] · O[t] =: Δ[t]

    one dot product of two E-vectors per row, from the output, before any tile is
    visited. With Δ, dZ[t,s] = P[t,s] (dP[t,s] − Δ[t]) needs only the tile's own P and
    dP.

    Why the log-sum-exp is all the forward must keep. The tile's P is needed again,
    but P[t,s] = exp(Z[t,s] − m[t]) / l[t] for the row's max m and sum l (against m),
    and the two row constants fold into one:

        P[t,s] = exp(Z[t,s] − lse[t]),        lse[t] = m[t] + log l[t] = log Σ_s exp Z[t,s]

    Z[t,s] itself is q[t]·k[s] again (with softcap and mask), so one number per row,
    lse, turns any tile's recomputed scores into its exact weights: no max, no sum, no
    rescaling in the backward. A row with no key has l = 0, and its true lse, log 0 =
    −inf (what ``return_lse`` gives), would make exp(Z − lse) = exp(−inf + inf) NaN: the
    backward takes +inf in its place (``flash_tiles.backward_lse``; ``running_lse`` gives
    the −inf), so its weights are exp(−inf) = 0 and its gradients exactly 0. (A backward kept
    separate from its forward stores lse, T numbers per head; here each query block's
    forward runs just before its backward, so lse and Δ live only as long as the
    block.)

    Order of the loops. FlashAttention-2 on a GPU puts the key blocks outside, so that
    dK and dV stay in fast memory while dQ is added up in global memory. On a CPU
    neither is in registers; here the query blocks are outside, as in the forward:
    for each, the forward over its key tiles gives lse and O (hence Δ), and then the
    backward over the same key tiles adds to dQ of the block and to dK and dV of each
    tile. Both walks skip the tiles the band blocks, so a causal backward costs about
    half.

    Blocked keys and unused slots. A blocked score is -inf, so its weight is exactly 0
    and dZ = 0 there: nothing reaches its mask entry, key or value. A key or value that
    no query of the block may see is replaced by 0 before the products (0 · NaN is
    NaN), and its dK, dV from the block by 0, so that whatever the slot holds, its
    gradients are 0 and no other gradient changes.

    Sinks. The sink joins lse (its term is in l), so P = exp(Z − lse) is already the
    weight with the sink in the sum; the sink has no value row, so its dP is 0 and its
    own gradient is dsink = Σ_t p_sink[t] · (0 − Δ[t]) with p_sink = exp(sink − lse).

    The log-sum-exp's gradient. Where the caller kept lse and sends d_lse = ∂L/∂lse back
    too (SPEC §21.7), ∂lse/∂Z = P adds d_lse · P to dZ: dZ = P ⊙ (dP − (Δ − d_lse)), so
    Δ ← Δ − d_lse before the tiles are visited, and nothing else changes (the sink's
    gradient below reads the same Δ). A row with no key has lse = −inf, a constant: its
    weights and its sink's are 0 (the backward's +inf in place of its lse, above), so its
    d_lse reaches nothing.

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes, block_q, block_k: as for ``attention`` (no dropout:
        its gradient needs the forward's random draw).
      d_out: ∂L/∂out, shaped like the output, (B, H, T, E) or (H, T, E), in q's dtype.
      dropout_p: must be 0.
      d_lse: ∂L/∂lse, shaped like the lse, (B, H, T) or (H, T), in its dtype (float64
        for float64 q, else float32); None: 0.

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
    d_out = np.asarray(d_out)
    if d_lse is not None:
        options.update(d_lse=np.asarray(d_lse))
    call, q, tiles = flash_tiles.prepare(q, k, v, mask, options, block_q, block_k, d_out=d_out)
    B, H, K, G, T, S, D, E = call.B, call.H, call.K, call.G, call.T, call.S, call.D, call.E
    work = tiles.work
    d_out = d_out.reshape(B * K, G, T, E)  # (B·K, G, T, E), a view
    dq = np.empty((B * K, G, T, D), dtype=q.dtype)  # (B·K, G, T, D)
    dk = np.zeros((B * K, S, D), dtype=work)  # (B·K, S, D)
    dv = np.zeros((B * K, S, E), dtype=work)  # (B·K, S, E)
    float_mask = mask is not None and not call.mask_is_bool
    dm = np.zeros(call.mask_shape, dtype=work) if float_mask else None  # (B|1, H|1, T|1, S|1)
    d_sinks = np.zeros((B, K, G), dtype=work)  # (B, K, G): per query head h = k·G + g

    for t0 in range(0, T, block_q):
        t1 = min(t0 + block_q, T)
        Tb = t1 - t0
        # Forward steps 1-5 and 7 for this block, as in ``attention``: its rows' output
        # O and log-sum-exp, the one number per row the backward needs.
        qs = flash_tiles.query_tile(q, t0, t1, call.scale, work)  # (B·K, G·Tb, D)
        acc, l, m = fast_online_softmax(qs, t0, t1, tiles)
        if sinks is not None:
            sink = flash_tiles.sink_rows(sinks, call, Tb, work)  # (B·K, G·Tb, 1)
            acc, l, m = flash_tiles.add_sink(acc, l, m, sink)
        o = normalise(acc, l)  # (B·K, G·Tb, E)
        some = l > 0  # (B·K, G·Tb, 1)
        lse = backward_lse(m, l)  # (B·K, G·Tb, 1)

        # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O): one dot product per row.
        do = d_out[:, :, t0:t1].astype(work).reshape(B * K, G * Tb, E)  # (B·K, G·Tb, E)
        delta = np.sum(do * o, axis=-1, keepdims=True)  # (B·K, G·Tb, 1)
        # --8<-- [start:backward-8-lse]
        # 8'. The log-sum-exp's gradient joins Δ with the opposite sign (dZ += d_lse · P).
        if d_lse is not None:
            dl = options["d_lse"].reshape(B * K, G, T)[:, :, t0:t1]  # (B·K, G, Tb)
            dl = dl.astype(work).reshape(B * K, G * Tb, 1)  # (B·K, G·Tb, 1)
            delta = delta - dl  # (B·K, G·Tb, 1)
        # --8<-- [end:backward-8-lse]

        # 5'. Sinks: dsink = −Σ_t p_sink · Δ, p_sink = exp(sink − lse) (0 with no key).
        if sinks is not None:
            with np.errstate(invalid="ignore"):
                p_sink = np.exp(sink - lse)  # (B·K, G·Tb, 1)
            p_sink = np.where(some, p_sink, 0.0)  # (B·K, G·Tb, 1)
            d_rows = -(p_sink * delta).reshape(B, K, G, Tb)  # (B, K, G, Tb)
            d_sinks += d_rows.sum(axis=-1)  # (B, K, G)

        # The backward over the block's key tiles; dq gets the scale once, here.
        dq_b = backward_block(qs, do, lse, delta, t0, t1, tiles, dk, dv, dm)
        dq_b *= work(call.scale)  # (B·K, G·Tb, D)
        dq[:, :, t0:t1] = dq_b.reshape(B * K, G, Tb, D)  # (B·K, G, Tb, D)

    grads = [
        dq.reshape(B, H, T, D),  # (B, H, T, D)
        dk.reshape(B, K, S, D).astype(q.dtype, copy=False),  # (B, K, S, D)
        dv.reshape(B, K, S, E).astype(q.dtype, copy=False),  # (B, K, S, E)
    ]
    if call.unbatched:
        grads = [g[0] for g in grads]
    if dm is not None:
        grads.append(dm.reshape(np.shape(mask)).astype(np.asarray(mask).dtype, copy=False))
    if sinks is not None:
        grads.append(d_sinks.sum(axis=0).reshape(H).astype(q.dtype))  # (H,)
    return tuple(grads)


def backward_block(
    qs: np.ndarray,
    do: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    t0: int,
    t1: int,
    tiles: KeyTiles,
    dk: np.ndarray,
    dv: np.ndarray,
    dm: np.ndarray | None,
) -> np.ndarray:
    """The backward of one query block over its key tiles (``attention_vjp``'s
    derivation): returns its dq / scale (B·K, G·Tb, D), and adds into dk (B·K, S, D),
    dv (B·K, S, E) and, for a float mask, dm (B|1, H|1, T|1, S|1).

    qs: the scaled queries (B·K, G·Tb, D); do: their rows of dO (B·K, G·Tb, E); lse and
    delta: their log-sum-exp and Δ, (B·K, G·Tb, 1).
    """
    BK, R, D = qs.shape  # R = G·Tb rows
    dq = np.zeros((BK, R, D), dtype=qs.dtype)  # (B·K, G·Tb, D)
    for s0, s1, whole in tiles.ranges(t0, t1):
        # Forward steps 1, 3 and 4 again: the tile's masked scores Z.
        z, used = tiles.scores(qs, t0, t1, s0, s1, whole, keep_tanh=True)  # (B·K, G·Tb, Sb)
        # --8<-- [start:backward-5-weights]
        # 5. The weights, recomputed from the row's log-sum-exp: P = exp(Z − lse). A row
        # with no key has +inf in place of its lse (log 0 = −inf) and so P = 0; a row that read a +inf score (q·k
        # overflowed) has l = +inf and lse = NaN, so that every weight of it is NaN, as
        # in the forward (SPEC §4.1), not only its +inf ones (exp(Z − inf) would be 0).
        # Under a huge scale Z − lse may overflow to -inf: weight 0, as it should be.
        with np.errstate(invalid="ignore", over="ignore"):
            z -= lse  # (B·K, G·Tb, Sb)
        p = np.exp(z, out=z)  # (B·K, G·Tb, Sb)
        kb = tiles.keys(s0, s1, used)  # (B·K, Sb, D)
        vb = tiles.values(s0, s1, used)  # (B·K, Sb, E)
        # --8<-- [end:backward-5-weights]

        # --8<-- [start:backward-7-dv-dp]
        # 7'. Weighted sum, O = P·V: dV = Pᵀ·dO, and dP = dO·Vᵀ.
        dv_b = np.matmul(p.transpose(0, 2, 1), do)  # (B·K, Sb, E)
        dz = np.matmul(do, vb.transpose(0, 2, 1))  # (B·K, G·Tb, Sb), dP for now
        # --8<-- [end:backward-7-dv-dp]

        # --8<-- [start:backward-5-dz]
        # 5'. Softmax: dZ = P ⊙ (dP − Δ).
        dz -= delta  # (B·K, G·Tb, Sb)
        dz *= p  # (B·K, G·Tb, Sb)
        # --8<-- [end:backward-5-dz]

        # 4'. Mask: a float mask was added to the scores, so its gradient is dZ.
        if dm is not None:
            tiles.add_mask_grad(dm, dz, t0, t1, s0, s1)

        # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c), which fades where the cap
        # bites.
        if tiles.softcap is not None:
            dz *= 1.0 - tiles.tanh * tiles.tanh  # (B·K, G·Tb, Sb)

        # 2'-1'. Scores, R = scale · q·kᵀ: the scale is in qs (so dk has it already);
        # dq gets it once, at the end of the block.
        dq += np.matmul(dz, kb)  # (B·K, G·Tb, D)
        with np.errstate(invalid="ignore"):  # 0 · inf where scale·q overflowed: see below
            dk_b = np.matmul(dz.transpose(0, 2, 1), qs)  # (B·K, Sb, D)
        if tiles.queries is not None:
            tiles.rescored_key_grads(dk_b, dz, t0, t1)

        # The slots replaced by 0 get nothing back: a selection passes the gradient only
        # to the branch it took.
        if used is not None:
            dk_b = np.where(used, dk_b, 0.0)  # (B·K, Sb, D)
            dv_b = np.where(used, dv_b, 0.0)  # (B·K, Sb, E)
        dk[:, s0:s1] += dk_b  # (B·K, Sb, D)
        dv[:, s0:s1] += dv_b  # (B·K, Sb, E)
    return dq
