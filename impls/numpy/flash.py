"""Blockwise (FlashAttention-style) attention in NumPy: the same answer, never a T × S matrix.

    out = softmax(mask(softcap(scale · q kᵀ))) v

The core page (``attention.py``) builds every score at once: a (B, H, T, S) array, 16
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

Sinks. An attention sink (one logit per query head, gpt-oss) is one more term of the row
sum l with no value row: after the last key tile it is folded in like one more block,
m' = max(m, sink), l' = exp(m - m') · l + exp(sink - m'), a' = exp(m - m') · a, so a sink
of 1e4 cannot overflow either. A row with no key keeps l = 0 and returns 0.

ALiBi. Its bias −slope · |t + S − T − s| depends only on the query's and the key's
positions, so each score tile adds its own slice of it, computed there from the tile's
row and column indices: no (T, S) bias is ever built.

Skipping tiles. Causal and window masks are bands around the diagonal. For a block of
queries, the keys split into ranges: keys no row of the block may see are skipped, keys
every row sees need no masking, and only the two diagonal strips between them (each as
wide as the query block) are masked key by key. Chunked local attention (Llama 4) cuts
those ranges to the chunks the block's rows lie in: key tiles wholly outside them are
skipped, and a block that spans a chunk boundary masks key by key. That is where fused
kernels get their 2× causal speed-up. (A user-supplied mask is an input: its tiles are
sliced, and a fully blocked tile is still computed.)

Scale. Every tile's product starts from the same query tile, so the scale is applied to
it once, (scale·q)·kᵀ: Tb·D multiplies instead of Tb·S. Under a huge scale that order can
overflow where the core page's (q·kᵀ)·scale does not: scale·q itself, or a partial sum of
the product (scale 1e308, q·k = 1.36 gives a finite score of 1.36e308; SPEC §4.1 says such
a score is ordinary). So where the scale could make that happen at all, an entry of the
prescaled product that is not finite is computed again in the core page's order
(``flash_tiles.KeyTiles.rescored``): it is then ±inf exactly where the score overflows.
Elsewhere no entry can overflow, and nothing is checked.

The backward pass, ``attention_vjp``, is FlashAttention-2's: it keeps no T × S matrix
either, because the forward's log-sum-exp per row is enough to recompute any tile's
weights. Its derivation is in its docstring.

Memory. No input is copied whole: tiles are sliced from views of q, k and v (and cast
to the working precision tile by tile), and each finished query block is written
straight into the output. Beyond inputs and output, one call holds a (B·K, G·Tb, Sb)
score tile (reused from tile to tile), a (B·K, G·Tb, E) accumulator and a (B·K, G·Tb, D)
query tile: with the defaults and B=1, H=8, about 6 MiB in float32, whatever T and S are.
The backward holds a few such tiles more, and per query block its Tb log-sum-exps.

Where things are. This page holds the algorithm as derived here: ``attention``,
``attention_vjp``, the online softmax and the backward on one query block.
``flash_tiles.py`` holds the tiles: which key tiles a query block visits (the band),
steps 1, 3 and 4 on one tile, and the tuned pass the calls run first, the online softmax
with the max deferred (no max, no rescaling in the common case); ``fast_online_softmax``
below falls back from it to the textbook version row by row. The packed and paged entry
points of the blockwise walk are on their pages, ``packed.py`` and ``paged.py``.

Shape legend: the core page's (``attention.py``), and

    Tb query block     Sb key block       (the last block of each may be shorter)

The grouped layout. Query head h = k·G + g shares key/value head k (PyTorch's
repeat_interleave order), so the G query heads of a key/value head are stacked as G·Tb
rows of one tile: (B·K, G·Tb, ·). Each key tile is then read and multiplied once for
its G query heads, not G times, and no input is repeated or copied, which the
memory-efficient impls must avoid (the core page repeats k and v instead).

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks, grouped-query and
multi-query attention (K < H), float64, float32, float16 and bfloat16 (``ml_dtypes``,
computed in float32 and rounded once), unbatched inputs, and the backward pass of all of
them with a float mask's gradient. A query row with no key left to attend returns exactly
0. Not supported: dropout (``dropout_p > 0`` raises NotImplementedError).
"""

from __future__ import annotations

import numpy as np

from .. import contract
from .flash_tiles import KeyTiles, deferred_max_softmax, in_range, prepare, query_tile


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
      sinks: (H,), same dtype as q: one logit per query head that joins every row's
        softmax and carries no value; None for none.
      chunk_size: query t attends only keys s in its own chunk, (t + offset) // chunk_size
        == s // chunk_size, offset placed by causal_alignment (Llama 4); None for none.
      alibi_slopes: (H,) or (B, H), float32 or q's dtype: ALiBi adds -slope · |t + S - T -
        s| to the scores after the softcap, whatever causal_alignment says; None for none.
      block_q: Tb, queries per tile (per query head).
      block_k: Sb, keys per tile.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate with the input contract every impl shares (the contract package, called in
    # prepare), and lay the inputs out by key/value head, as views.
    options = dict(is_causal=is_causal, scale=scale, causal_alignment=causal_alignment)
    options.update(window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks)
    options.update(chunk_size=chunk_size, alibi_slopes=alibi_slopes)
    call, q, tiles = prepare(q, k, v, mask, options, block_q, block_k)
    B, H, K, G, T, E = call.B, call.H, call.K, call.G, call.T, call.E
    out = np.empty((B * K, G, T, E), dtype=q.dtype)  # (B·K, G, T, E)

    for t0 in range(0, T, block_q):
        t1 = min(t0 + block_q, T)
        Tb = t1 - t0
        # 1. Scores: every query of the block against every key, one key tile at a time
        # (KeyTiles.scores). Every tile's product starts from this query tile, so
        # 2. Scale, so that the scores' spread does not grow with the head size D, is
        # applied to it once, here: Tb·D multiplies instead of Tb·S (see Scale above).
        qs = query_tile(q, t0, t1, call.scale, tiles.work)  # (B·K, G·Tb, D)

        # Steps 3-5 and 7, key tile by key tile: the online softmax (online_softmax,
        # below), run through its tuned form first (fast_online_softmax, at the end of
        # the page), which gives the same rows.
        acc, l, m = fast_online_softmax(qs, t0, t1, tiles)
        if sinks is not None:
            acc, l, _ = add_sink(acc, l, m, sink_rows(sinks, call, Tb, tiles.work))

        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        # Assigning into out rounds to the output dtype once.
        acc = normalise(acc, l)  # (B·K, G·Tb, E)
        out[:, :, t0:t1] = acc.reshape(B * K, G, Tb, E)  # (B·K, G, Tb, E)

    # The query heads back in order h = k·G + g.
    out = out.reshape(B, H, T, E)  # (B, H, T, E)
    return out[0] if call.unbatched else out


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
    rescaling in the backward. A row with no key has l = 0; its lse is taken as +inf,
    so its weights are exp(-inf) = 0 and its gradients exactly 0. (A backward kept
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
    d_out = np.asarray(d_out)
    call, q, tiles = prepare(q, k, v, mask, options, block_q, block_k, d_out=d_out)
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
        qs = query_tile(q, t0, t1, call.scale, work)  # (B·K, G·Tb, D)
        acc, l, m = fast_online_softmax(qs, t0, t1, tiles)
        if sinks is not None:
            sink = sink_rows(sinks, call, Tb, work)  # (B·K, G·Tb, 1)
            acc, l, m = add_sink(acc, l, m, sink)
        o = normalise(acc, l)  # (B·K, G·Tb, E)
        some = l > 0  # (B·K, G·Tb, 1)
        lse = log_sum_exp(m, l)  # (B·K, G·Tb, 1)

        # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O): one dot product per row.
        do = d_out[:, :, t0:t1].astype(work).reshape(B * K, G * Tb, E)  # (B·K, G·Tb, E)
        delta = np.sum(do * o, axis=-1, keepdims=True)  # (B·K, G·Tb, 1)

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


def sink_rows(sinks: np.ndarray, call: contract.Checked, Tb: int, work: type) -> np.ndarray:
    """Each row's sink logit in the grouped layout, (B·K, G·Tb, 1): row g·Tb + t of key/value
    head k belongs to query head h = k·G + g."""
    B, K, G = call.B, call.K, call.G
    rows = np.asarray(sinks).astype(work).reshape(1, K, G, 1)  # (1, K, G, 1)
    return np.broadcast_to(rows, (B, K, G, Tb)).reshape(B * K, G * Tb, 1)  # (B·K, G·Tb, 1)


def add_sink(
    acc: np.ndarray, l: np.ndarray, m: np.ndarray, sink: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fold each row's sink into its (acc, l, m) after the last key tile, as one more block
    of one key whose value row is 0 (the module docstring's Sinks): a row with no key (l =
    0) is left alone, and a NaN or +inf sink makes a row with a key NaN (SPEC §15.4)."""
    some = l > 0  # (B·K, G·Tb, 1)
    sink = np.where(some, sink, -np.inf)  # (B·K, G·Tb, 1)
    m_new = np.maximum(m, sink)  # (B·K, G·Tb, 1)
    m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # (B·K, G·Tb, 1)
    with np.errstate(over="ignore", invalid="ignore"):
        alpha = np.exp(m - m_safe)  # (B·K, G·Tb, 1)
        l = alpha * l + np.exp(sink - m_safe)  # (B·K, G·Tb, 1)
    bad = np.isnan(sink) | (sink == np.inf)  # (B·K, G·Tb, 1)
    acc = np.where(bad, np.nan, alpha * acc)  # (B·K, G·Tb, E)
    return acc, np.where(bad, np.nan, l), m_safe


def online_softmax(
    qs: np.ndarray, t0: int, t1: int, tiles: KeyTiles
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 3-5 and 7 of one query block over its key tiles, with the running max (the
    module docstring's derivation): the unnormalised output acc (B·K, G·Tb, E), the row
    sums l and the constant m they are taken against, (B·K, G·Tb, 1) each."""
    BK, R, _ = qs.shape  # R = G·Tb rows
    work = qs.dtype
    m = np.full((BK, R, 1), -np.inf, dtype=work)  # (B·K, G·Tb, 1)
    l = np.zeros((BK, R, 1), dtype=work)  # (B·K, G·Tb, 1)
    acc = np.zeros((BK, R, tiles.v.shape[-1]), dtype=work)  # (B·K, G·Tb, E)
    for s0, s1, whole in tiles.ranges(t0, t1):
        x, used = tiles.scores(qs, t0, t1, s0, s1, whole)  # (B·K, G·Tb, Sb), steps 1, 3, 4

        # 5. Softmax over the keys, online: rescale what was accumulated against the
        # old running max onto the new one (see the module docstring). A row that has
        # seen only blocked keys keeps max -inf; its exponent is taken against 0, so
        # its weights are exactly 0 instead of exp(-inf - -inf) = NaN.
        m_new = np.maximum(m, x.max(axis=-1, keepdims=True))  # (B·K, G·Tb, 1)
        m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # (B·K, G·Tb, 1)
        # A score of +inf (q·k overflowed) makes its row NaN, and so does an inf value
        # or one whose weighted sum overflows, as the spec defines (§3.8, §4.8, §4.9):
        # inf − inf and inf · 0 are that NaN, not a fault.
        with np.errstate(over="ignore", invalid="ignore"):
            alpha = np.exp(m - m_safe)  # (B·K, G·Tb, 1)
            p = np.exp(x - m_safe)  # (B·K, G·Tb, Sb)
            l = alpha * l + p.sum(axis=-1, keepdims=True)  # (B·K, G·Tb, 1)

            # 7. Weighted sum of the values, accumulated unnormalised.
            acc = alpha * acc + p @ tiles.values(s0, s1, used)  # (B·K, G·Tb, E)
        m = m_new
    return acc, l, np.where(np.isfinite(m), m, 0.0)


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
        # with no key has lse = +inf and so P = 0; a row that read a +inf score (q·k
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


def normalise(acc: np.ndarray, l: np.ndarray) -> np.ndarray:
    """out = acc / l, in place; a row that saw no key has l = 0 and acc = 0 and gives 0."""
    # A row whose sums overflowed (a +inf score) is NaN, as the spec defines (§3.8):
    # inf / inf is that NaN.
    with np.errstate(invalid="ignore"):
        acc /= np.where(l > 0, l, 1.0)  # (B·K, G·Tb, E)
    return acc


def log_sum_exp(m: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp m + log l, what the backward needs of the forward: +inf for a
    row with no key (l = 0), so that its weights exp(Z − lse) are all 0; NaN for a row that
    read a +inf score (l = +inf; see backward_block)."""
    some = l > 0
    lse = np.where(some, m + np.log(np.where(some, l, 1.0)), np.inf)
    return np.where(l == np.inf, np.nan, lse)


def fast_online_softmax(
    qs: np.ndarray, t0: int, t1: int, tiles: KeyTiles
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``online_softmax``'s (acc, l, m) for one query block: from the tuned pass with the
    max deferred (``flash_tiles.deferred_max_softmax``, m = 0) for the rows where that is
    exact, and from ``online_softmax`` for the others, row by row."""
    acc, l = deferred_max_softmax(qs, t0, t1, tiles)
    m = np.zeros_like(l)  # (B·K, G·Tb, 1)
    exact = in_range(acc, l)  # (B·K, G·Tb, 1)
    if not exact.all():
        acc_m, l_m, m_m = online_softmax(qs, t0, t1, tiles)
        acc = np.where(exact, acc, acc_m)  # (B·K, G·Tb, E)
        l = np.where(exact, l, l_m)  # (B·K, G·Tb, 1)
        m = np.where(exact, m, m_m)  # (B·K, G·Tb, 1)
    return acc, l, m
