"""Blockwise (FlashAttention-style) attention in NumPy: the same answer, never a T × S matrix.

    out = softmax(mask(softcap(scale · q kᵀ))) v

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
skipped, and a block that spans a chunk boundary masks key by key. That is where fused kernels get their 2×
causal speed-up. (A user-supplied mask is an input: its tiles are sliced, and a fully
blocked tile is still computed.)

The backward pass, ``attention_vjp``, is FlashAttention-2's: it keeps no T × S matrix
either, because the forward's log-sum-exp per row is enough to recompute any tile's
weights. Its derivation is in its docstring.

Memory. No input is copied whole: tiles are sliced from views of q, k and v (and cast
to the working precision tile by tile), and each finished query block is written
straight into the output. Beyond inputs and output, one call holds a (B·K, G·Tb, Sb)
score tile (reused from tile to tile), a (B·K, G·Tb, E) accumulator and a (B·K, G·Tb, D)
query tile: with the defaults and B=1, H=8, about 6 MiB in float32, whatever T and S are.
The backward holds a few such tiles more, and per query block its Tb log-sum-exps.

The code reads in two parts. First the algorithm as derived here: ``attention``,
``attention_vjp``, and the online softmax and the backward on one query block. Then, at
the end of the file and apart, the tuned path the calls actually run: the same online
softmax with the max deferred (no max, no rescaling in the common case), which falls
back to the textbook version row by row; its section says why it is exact and what it
saves.

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim
    Tb query block     Sb key block       (the last block of each may be shorter)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores),
          broadcastable to (B, H, T, S)

Unbatched inputs q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

The grouped layout. Query head h = k·G + g shares key/value head k (PyTorch's
repeat_interleave order), so the G query heads of a key/value head are stacked as G·Tb
rows of one tile: (B·K, G·Tb, ·). Each key tile is then read and multiplied once for
its G query heads, not G times, and no input is repeated or copied, which the
memory-efficient impls must avoid (the teaching reference repeats k and v instead).

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, chunked local attention, ALiBi, softcapping, attention sinks, grouped-query and multi-query attention (K < H), float64, float32,
float16 and bfloat16 (``ml_dtypes``, computed in float32 and rounded once), and the
backward pass of all of them with a float mask's gradient. A query row with no key left
to attend returns exactly 0. Not supported: dropout (``dropout_p > 0`` raises
NotImplementedError).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from . import contract


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
    # 0. Validate with the input contract every impl shares (contract.py, called in
    # _prepare), and lay the inputs out by key/value head, as views.
    options = dict(is_causal=is_causal, scale=scale, causal_alignment=causal_alignment)
    options.update(window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks)
    options.update(chunk_size=chunk_size, alibi_slopes=alibi_slopes)
    call, q, tiles = _prepare(q, k, v, mask, options, block_q, block_k)
    B, H, K, G, T, E = call.B, call.H, call.K, call.G, call.T, call.E
    out = np.empty((B * K, G, T, E), dtype=q.dtype)  # (B·K, G, T, E)

    for t0 in range(0, T, block_q):
        t1 = min(t0 + block_q, T)
        Tb = t1 - t0
        # 1. Scores: every query of the block against every key, one key tile at a time
        # (_KeyTiles.scores). Every tile's product starts from this query tile, so
        # 2. Scale, so that the scores' spread does not grow with the head size D, is
        # applied to it once, here: Tb·D multiplies instead of Tb·S.
        qs = _query_tile(q, t0, t1, call.scale, tiles.work)  # (B·K, G·Tb, D)

        # Steps 3-5 and 7, key tile by key tile: the online softmax (_online_softmax,
        # below), run through its tuned form (_fast_online_softmax, at the end of the
        # file), which gives the same rows.
        acc, l, m = _fast_online_softmax(qs, t0, t1, tiles)
        if sinks is not None:
            acc, l, _ = _add_sink(acc, l, m, _sink_rows(sinks, call, Tb, tiles.work))

        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        # Assigning into out rounds to the output dtype once.
        acc = _normalise(acc, l)  # (B·K, G·Tb, E)
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

    The naive backward (``numpy_attention_backward.py``) keeps the (T, S) weights P of
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
    call, q, tiles = _prepare(q, k, v, mask, options, block_q, block_k, d_out=d_out)
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
        qs = _query_tile(q, t0, t1, call.scale, work)  # (B·K, G·Tb, D)
        acc, l, m = _fast_online_softmax(qs, t0, t1, tiles)
        if sinks is not None:
            sink = _sink_rows(sinks, call, Tb, work)  # (B·K, G·Tb, 1)
            acc, l, m = _add_sink(acc, l, m, sink)
        o = _normalise(acc, l)  # (B·K, G·Tb, E)
        some = l > 0  # (B·K, G·Tb, 1)
        lse = _log_sum_exp(m, l)  # (B·K, G·Tb, 1)

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
        dq_b = _backward_block(qs, do, lse, delta, t0, t1, tiles, dk, dv, dm)
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


def attention_packed(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
    block_k: int = 512,
) -> np.ndarray:
    """Attention over packed variable-length sequences (FlashAttention's varlen API), one
    document at a time, each tiled on its own.

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone. Tiling each document on its own
    skips every key tile that shares no document with the query tile: the work is
    Σ T_n·S_n, not T·S, and nothing another document holds (not even a NaN) is read, as
    in FlashAttention's varlen kernels, whose thread blocks each work inside one sequence.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``attention``, applied
        within each document (bottom-right puts document n's diagonal at S_n - T_n).
      block_q, block_k: queries and keys per tile.

    Returns:
      out: (H, T, E), same dtype as q.
    """
    # 0. Validate with the input contract all impls share (contract.py).
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    tiles = {"block_q": block_q, "block_k": block_k}
    call, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, tiles=tiles, **options
    )
    H, T, E = call.H, call.T, call.E

    # 1. Each document alone, on tiles of its own.
    out = np.zeros((H, T, E), dtype=q.dtype)  # (H, T, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        out[:, t0:t1] = attention(
            q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], **options, **tiles
        )  # (H, T_n, E)
    return out


def attention_packed_vjp(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    cu_seqlens_q: np.ndarray,
    cu_seqlens_k: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
    block_k: int = 512,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_packed``: (dq, dk, dv) shaped like q, k, v, each document's
    from the blockwise backward on its own tiles; d_out (H, T, E) in q's dtype."""
    # 0. Validate with the forward's contract, and d_out against the output's shape.
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    options = dict(
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    tiles = {"block_q": block_q, "block_k": block_k}
    _, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, tiles=tiles, d_out=d_out, **options
    )

    # 1'. Each document alone: its loss reaches only its own queries, keys and values.
    d_q = np.zeros(q.shape, dtype=q.dtype)  # (H, T, D)
    d_k = np.zeros(k.shape, dtype=q.dtype)  # (K, S, D)
    d_v = np.zeros(v.shape, dtype=q.dtype)  # (K, S, E)
    for n in range(len(cu_q) - 1):
        t0, t1, s0, s1 = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        d_q[:, t0:t1], d_k[:, s0:s1], d_v[:, s0:s1] = attention_vjp(
            q[:, t0:t1], k[:, s0:s1], v[:, s0:s1], d_out[:, t0:t1], **options, **tiles
        )  # (H, T_n, D), (K, S_n, D), (K, S_n, E)
    return d_q, d_k, d_v


def _sink_rows(sinks: np.ndarray, call: contract.Checked, Tb: int, work: type) -> np.ndarray:
    """Each row's sink logit in the grouped layout, (B·K, G·Tb, 1): row g·Tb + t of key/value
    head k belongs to query head h = k·G + g."""
    B, K, G = call.B, call.K, call.G
    rows = np.asarray(sinks).astype(work).reshape(1, K, G, 1)  # (1, K, G, 1)
    return np.broadcast_to(rows, (B, K, G, Tb)).reshape(B * K, G * Tb, 1)  # (B·K, G·Tb, 1)


def _add_sink(
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


def _online_softmax(
    qs: np.ndarray, t0: int, t1: int, tiles: _KeyTiles
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


def _backward_block(
    qs: np.ndarray,
    do: np.ndarray,
    lse: np.ndarray,
    delta: np.ndarray,
    t0: int,
    t1: int,
    tiles: _KeyTiles,
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
        # 5. The weights, recomputed from the row's log-sum-exp: P = exp(Z − lse). A row
        # with no key has lse = +inf and so P = 0; a row that read a +inf score (q·k
        # overflowed) has l = +inf and lse = NaN, so that every weight of it is NaN, as
        # in the forward (SPEC §4.1), not only its +inf ones (exp(Z − inf) would be 0).
        with np.errstate(invalid="ignore"):
            z -= lse  # (B·K, G·Tb, Sb)
        p = np.exp(z, out=z)  # (B·K, G·Tb, Sb)
        kb = tiles.keys(s0, s1, used)  # (B·K, Sb, D)
        vb = tiles.values(s0, s1, used)  # (B·K, Sb, E)

        # 7'. Weighted sum, O = P·V: dV = Pᵀ·dO, and dP = dO·Vᵀ.
        dv_b = np.matmul(p.transpose(0, 2, 1), do)  # (B·K, Sb, E)
        dz = np.matmul(do, vb.transpose(0, 2, 1))  # (B·K, G·Tb, Sb), dP for now

        # 5'. Softmax: dZ = P ⊙ (dP − Δ).
        dz -= delta  # (B·K, G·Tb, Sb)
        dz *= p  # (B·K, G·Tb, Sb)

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
        dk_b = np.matmul(dz.transpose(0, 2, 1), qs)  # (B·K, Sb, D)

        # The slots replaced by 0 get nothing back: a selection passes the gradient only
        # to the branch it took.
        if used is not None:
            dk_b = np.where(used, dk_b, 0.0)  # (B·K, Sb, D)
            dv_b = np.where(used, dv_b, 0.0)  # (B·K, Sb, E)
        dk[:, s0:s1] += dk_b  # (B·K, Sb, D)
        dv[:, s0:s1] += dv_b  # (B·K, Sb, E)
    return dq


def _prepare(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    options: dict,
    block_q: int,
    block_k: int,
    d_out: np.ndarray | None = None,
) -> tuple[contract.Checked, np.ndarray, _KeyTiles]:
    """Step 0 and the layout: the checked call, q as (B·K, G, T, D) and the key tiles."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    if options["alibi_slopes"] is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        **options,
        unsupported={"dropout_p": "numpy-flash is blockwise attention without dropout"},
        tiles={"block_q": block_q, "block_k": block_k},
        d_out=d_out,
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    B, K, G, T, S, D, E = call.B, call.K, call.G, call.T, call.S, call.D, call.E
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = np.broadcast_to(mask.reshape(call.mask_shape), (b, h, T, S))  # (B|1, H|1, T, S)

    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    work = np.float64 if q.dtype == np.float64 else np.float32
    offset = 0 if call.causal_alignment == "top_left" else S - T
    slopes = options["alibi_slopes"]
    if slopes is not None:
        # One slope per query head, in the grouped layout the score tiles have.
        slopes = slopes.astype(work).reshape(-1, K, G, 1, 1)  # (B|1, K, G, 1, 1)
    tiles = _KeyTiles(
        k.reshape(B * K, S, D),  # (B·K, S, D)
        v.reshape(B * K, S, E),  # (B·K, S, E)
        mask,
        _Band(offset, call.is_causal, call.window, call.chunk_size),
        call.softcap,
        slopes,
        T,
        K,
        G,
        block_k,
        work,
    )
    # The grouped layout (module docstring): a view, no copy of an input.
    return call, q.reshape(B * K, G, T, D), tiles  # (B·K, G, T, D)


def _query_tile(q: np.ndarray, t0: int, t1: int, scale: float, work: type) -> np.ndarray:
    """Query rows [t0, t1) of every head, scaled, as G·Tb rows per key/value head."""
    BK, G, _, D = q.shape
    qs = q[:, :, t0:t1].astype(work) * work(scale)  # (B·K, G, Tb, D), a copy
    return qs.reshape(BK, G * (t1 - t0), D)  # (B·K, G·Tb, D)


def _normalise(acc: np.ndarray, l: np.ndarray) -> np.ndarray:
    """out = acc / l, in place; a row that saw no key has l = 0 and acc = 0 and gives 0."""
    # A row whose sums overflowed (a +inf score) is NaN, as the spec defines (§3.8):
    # inf / inf is that NaN.
    with np.errstate(invalid="ignore"):
        acc /= np.where(l > 0, l, 1.0)  # (B·K, G·Tb, E)
    return acc


def _log_sum_exp(m: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp m + log l, what the backward needs of the forward: +inf for a
    row with no key (l = 0), so that its weights exp(Z − lse) are all 0; NaN for a row that
    read a +inf score (l = +inf; see _backward_block)."""
    some = l > 0
    lse = np.where(some, m + np.log(np.where(some, l, 1.0)), np.inf)
    return np.where(l == np.inf, np.nan, lse)


class _KeyTiles:
    """The keys and values, the mask and the band: which key tiles a query block visits,
    and steps 1, 3 and 4 on one tile."""

    def __init__(
        self,
        k: np.ndarray,
        v: np.ndarray,
        mask: np.ndarray | None,
        band: _Band,
        softcap: float | None,
        alibi: np.ndarray | None,
        T: int,
        K: int,
        G: int,
        block_k: int,
        work: type,
    ) -> None:
        self.k, self.v = k, v  # (B·K, S, D), (B·K, S, E)
        self.S = k.shape[1]
        self.float_mask = mask if mask is not None and mask.dtype != np.bool_ else None
        self.bool_mask = mask if mask is not None and mask.dtype == np.bool_ else None
        self.band, self.softcap = band, softcap
        self.alibi, self.T = alibi, T  # ALiBi's slopes (B|1, K, G, 1, 1), or None
        self.K, self.G, self.block_k, self.work = K, G, block_k, work
        self.ones = np.ones(block_k, dtype=work)  # (Sb,): row sums as a matrix-vector product
        self.buffer = np.empty(0, dtype=work)  # the score tile, reused
        self.tanh = np.empty(0, dtype=work)  # the last tile's tanh(R/c), for the backward

    def ranges(self, t0: int, t1: int) -> Iterator[tuple[int, int, bool]]:
        """(s0, s1, whole) for each key tile query rows [t0, t1) visit, in key order.

        ``whole``: every row of the block may see every key of the tile (as far as the
        band goes), so the band needs no masking there.
        """
        for a, b, whole in self.band.ranges(t0, t1, self.S):
            for s0 in range(a, b, self.block_k):
                yield s0, min(s0 + self.block_k, b), whole

    def scores(
        self,
        qs: np.ndarray,
        t0: int,
        t1: int,
        s0: int,
        s1: int,
        whole: bool,
        keep_tanh: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Steps 1, 3 and 4 on tile (t0:t1, s0:s1): (B·K, G·Tb, Sb), in the reused buffer,
        and which keys of the tile some query of the block may see, (B·K, Sb, 1) bool, or
        None when every query may see every key. ``keep_tanh``: keep the softcap's
        tanh(R/c) in ``self.tanh``, for its derivative."""
        BK, R, _ = qs.shape  # R = G·Tb rows
        Tb, Sb = t1 - t0, s1 - s0
        if self.buffer.size < BK * R * Sb:
            self.buffer = np.empty(BK * R * self.block_k, dtype=self.work)

        # 1. Scores: every query of the block against every key of the tile. A key
        # holding inf or NaN, or one whose product overflows, gives inf or NaN scores
        # here: step 4 replaces them where the key is blocked (SPEC §4.7), and where it
        # is not they make the row NaN (§4.8, §4.9), so the invalid operation is meant.
        kb = self.k[:, s0:s1].astype(self.work, copy=False)  # (B·K, Sb, D)
        x = self.buffer[: BK * R * Sb].reshape(BK, R, Sb)  # (B·K, G·Tb, Sb)
        with np.errstate(invalid="ignore", over="ignore"):
            np.matmul(qs, kb.transpose(0, 2, 1), out=x)  # (B·K, G·Tb, Sb)

        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        if self.softcap is not None:
            # A score far above the softcap overflows to ±inf here, whose tanh is exactly ±1.
            with np.errstate(over="ignore"):
                np.tanh(x / self.softcap, out=x)  # (B·K, G·Tb, Sb)
            if keep_tanh:
                self.tanh = x.copy()  # (B·K, G·Tb, Sb)
            x *= self.work(self.softcap)  # (B·K, G·Tb, Sb)

        # 4. Mask: ALiBi's linear bias and a float mask are added; a bool mask, the causal
        # triangle, the window and the chunks decide which keys each query may see at all,
        # and so does a float mask's -inf: blocked scores are replaced, not only pushed
        # down by adding -inf, since NaN + -inf is NaN.
        x5 = x.reshape(BK // self.K, self.K, self.G, Tb, Sb)  # (B, K, G, Tb, Sb), a view
        if self.alibi is not None:
            with np.errstate(invalid="ignore"):
                x5 += self.alibi_bias(t0, t1, s0, s1)  # (B, K, G, Tb, Sb)
        allowed = True
        if self.float_mask is not None:
            tile = self.float_mask[:, :, t0:t1, s0:s1]  # (B|1, H|1, Tb, Sb)
            # +inf + -inf is NaN, which the -inf entry's replacement below undoes.
            with np.errstate(invalid="ignore"):
                x5 += _grouped(tile, self.K, self.G)  # (B, K, G, Tb, Sb)
            allowed = _grouped(tile != -np.inf, self.K, self.G)  # (B|1, K|1, G|1, Tb, Sb)
        if self.bool_mask is not None:
            tile = self.bool_mask[:, :, t0:t1, s0:s1]  # (B|1, H|1, Tb, Sb)
            allowed = _grouped(tile, self.K, self.G)  # (B|1, K|1, G|1, Tb, Sb)
        if not whole:
            allowed = allowed & self.band.allowed(t0, t1, s0, s1)  # (.., Tb, Sb)
        if allowed is True:
            return x, None
        np.copyto(x5, -np.inf, where=~allowed)  # (B, K, G, Tb, Sb)
        allowed = np.reshape(allowed, (1,) * (5 - np.ndim(allowed)) + np.shape(allowed))
        used = allowed.any(axis=(2, 3))  # (B|1, K|1, Sb)
        used = np.broadcast_to(used, (BK // self.K, self.K, Sb))  # (B, K, Sb)
        return x, used.reshape(BK, Sb, 1)  # (B·K, Sb, 1)

    def alibi_bias(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """ALiBi's bias on tile (t0:t1, s0:s1), (B|1, K, G, Tb, Sb): −slope · |t + S − T −
        s|, the distance from the bottom-right diagonal whatever the causal alignment."""
        t = np.arange(t0, t1)[:, None]  # (Tb, 1)
        s = np.arange(s0, s1)[None, :]  # (1, Sb)
        distance = np.abs(t + self.S - self.T - s).astype(self.work)  # (Tb, Sb)
        return -self.alibi * distance  # (B|1, K, G, Tb, Sb)

    def keys(self, s0: int, s1: int, used: np.ndarray | None) -> np.ndarray:
        """Key rows [s0, s1) in the working precision, (B·K, Sb, D); a key that no query
        of the block may see (padding, a KV-cache slot not yet written) replaced by 0, so
        that whatever it holds has no effect (0 · NaN and 0 · inf are NaN)."""
        kb = self.k[:, s0:s1].astype(self.work, copy=False)  # (B·K, Sb, D)
        return kb if used is None else np.where(used, kb, 0.0)  # (B·K, Sb, D)

    def values(self, s0: int, s1: int, used: np.ndarray | None) -> np.ndarray:
        """Value rows [s0, s1) in the working precision, (B·K, Sb, E); unused ones 0."""
        vb = self.v[:, s0:s1].astype(self.work, copy=False)  # (B·K, Sb, E)
        return vb if used is None else np.where(used, vb, 0.0)  # (B·K, Sb, E)

    def add_mask_grad(
        self, dm: np.ndarray, dz: np.ndarray, t0: int, t1: int, s0: int, s1: int
    ) -> None:
        """4'. dmask += dZ on tile (t0:t1, s0:s1), summed over the axes along which one
        mask entry served many scores (broadcasting)."""
        b, h, tm, sm = dm.shape  # (B|1, H|1, T|1, S|1)
        Tb, Sb = t1 - t0, s1 - s0
        d = dz.reshape(-1, self.K * self.G, Tb, Sb)  # (B, H, Tb, Sb): h = k·G + g
        axes = tuple(i for i, n in enumerate((b, h, tm, sm)) if n == 1)
        d = d.sum(axis=axes, keepdims=True)  # (B|1, H|1, Tb|1, Sb|1)
        rows = slice(None) if tm == 1 else slice(t0, t1)
        cols = slice(None) if sm == 1 else slice(s0, s1)
        dm[:, :, rows, cols] += d  # (B|1, H|1, Tb|1, Sb|1)


class _Band:
    """The causal/window band: which keys s query t may see, as s - (t + offset); and the
    chunks, (t + offset) // chunk == s // chunk."""

    def __init__(
        self,
        offset: int,
        is_causal: bool,
        window: tuple[int | None, int | None] | None,
        chunk: int | None = None,
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
        self.chunk = chunk

    def ranges(self, t0: int, t1: int, S: int) -> list[tuple[int, int, bool]]:
        """Key ranges (s0, s1, whole) that query rows [t0, t1) can see, in key order.

        Row t sees keys t + offset + lo … t + offset + hi. Moving down the block's Tb rows
        shifts that range by Tb - 1, so the keys the block can see are: a strip Tb wide
        that only the lower rows see, the keys every row sees (``whole``: no masking), and
        a strip Tb wide that only the upper rows see. Keys outside are never visited.
        """
        Tb = t1 - t0
        first = t0 + self.offset + self.lo  # row t0's first key (-inf: key 0)
        last = t0 + self.offset + self.hi  # row t0's last key (inf: key S - 1)
        if not self.active:
            edges = [(0, S, True)]
        elif first + Tb >= last:
            # A band narrower than the block: all of it is a diagonal strip.
            edges = [(first, last + Tb, False)]
        else:
            edges = [(first, first + Tb, False), (first + Tb, last, True), (last, last + Tb, False)]
        lo, hi, single = 0, S, True
        if self.chunk is not None:
            # The rows' chunks run from that of row t0 to that of row t1 - 1: keys outside
            # them are skipped, and a block in more than one chunk is masked key by key.
            first_chunk = (t0 + self.offset) // self.chunk
            last_chunk = (t1 - 1 + self.offset) // self.chunk
            lo, hi = first_chunk * self.chunk, (last_chunk + 1) * self.chunk
            single = first_chunk == last_chunk
        clipped = [(max(a, lo, 0), min(b, hi, S), whole and single) for a, b, whole in edges]
        return [(int(a), int(b), whole) for a, b, whole in clipped if a < b]

    def allowed(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """Which keys each query of the tile may see: (Tb, Sb) bool."""
        t = np.arange(t0, t1)[:, None]  # (Tb, 1)
        s = np.arange(s0, s1)[None, :]  # (1, Sb)
        distance = s - (t + self.offset)  # (Tb, Sb)
        allowed = (distance >= self.lo) & (distance <= self.hi)  # (Tb, Sb)
        if self.chunk is not None:
            # Same chunk only; floor division puts a negative position in a chunk of no key.
            allowed &= (t + self.offset) // self.chunk == s // self.chunk  # (Tb, Sb)
        return allowed


# --- Paged KV caches (SPEC §19) --------------------------------------------------------------


def attention_paged(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> np.ndarray:
    """Attention over a paged KV cache (vLLM, FlashInfer, FlashAttention's
    ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens``), a page at a
    time: each page a sequence reads is one key tile, read in place.

    Sequence b's key s lives in page block_table[b, s // L], slot s % L, and sequence b has
    seq_lens[b] keys; its T queries are its last T positions, so causality and the window
    are counted from the bottom-right diagonal t + seq_lens[b] - T. The online softmax
    runs over the sequence's pages as it runs over key tiles, and visits only the
    ⌈seq_lens[b] / L⌉ pages the sequence reads (fewer, where the band skips some): the
    cost follows the lengths, not the table's width M·L, and nothing is gathered.

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
    # 0. Validate with the input contract every impl shares (contract.py).
    call, q = _prepare_paged(q, k_pages, v_pages, block_table, seq_lens, block_q, locals())
    B, H, K, G, T, E = call.B, call.H, call.K, call.G, call.T, call.E
    out = np.empty((B, K, G, T, E), dtype=q.dtype)  # (B, K, G, T, E)

    for b in range(B):
        # Sequence b's pages as its key tiles (_PageTiles).
        tiles = _page_tiles(k_pages, v_pages, call, b)
        for t0 in range(0, T, block_q):
            t1 = min(t0 + block_q, T)
            # Steps 1-5 and 7 as in ``attention``, over the pages the block's rows may see.
            qs = _query_tile(q[b], t0, t1, call.scale, tiles.work)  # (K, G·Tb, D)
            acc, l, _ = _fast_online_softmax(qs, t0, t1, tiles)
            acc = _normalise(acc, l)  # (K, G·Tb, E)
            out[b, :, :, t0:t1] = acc.reshape(K, G, t1 - t0, E)  # (K, G, Tb, E)

    return out.reshape(B, H, T, E)  # (B, H, T, E)


def attention_paged_vjp(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    d_out: np.ndarray,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    block_q: int = 256,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``attention_paged``, FlashAttention-2's way (``attention_vjp``'s
    derivation), over each sequence's pages: (dq, dk_pages, dv_pages).

    Each sequence's backward adds into a dK and dV of its own length, page by page; they
    are then added into the pages they were read from, so a page two sequences share
    collects both, and a slot no sequence reads stays exactly 0.

    Args:
      q, k_pages, v_pages, block_table, seq_lens, is_causal, scale, window, softcap,
        block_q: as for ``attention_paged``.
      d_out: ∂L/∂out, (B, H, T, E), in q's dtype.
    """
    # 0. Validate as the forward does, and d_out against the output's shape and dtype.
    d_out = np.asarray(d_out)
    call, q = _prepare_paged(q, k_pages, v_pages, block_table, seq_lens, block_q, locals())
    B, H, K, G, T, D, E, L = call.B, call.H, call.K, call.G, call.T, call.D, call.E, call.L
    d_out = d_out.reshape(B, K, G, T, E)  # (B, K, G, T, E), a view
    dq = np.empty((B, K, G, T, D), dtype=q.dtype)  # (B, K, G, T, D)
    work = np.float64 if q.dtype == np.float64 else np.float32
    dk_pages = np.zeros(np.shape(k_pages), dtype=work)  # (N, K, L, D)
    dv_pages = np.zeros(np.shape(v_pages), dtype=work)  # (N, K, L, E)

    for b in range(B):
        tiles = _page_tiles(k_pages, v_pages, call, b)
        n = call.seq_lens[b]
        dk = np.zeros((K, n, D), dtype=work)  # (K, n, D): sequence b's keys
        dv = np.zeros((K, n, E), dtype=work)  # (K, n, E)
        for t0 in range(0, T, block_q):
            t1 = min(t0 + block_q, T)
            Tb = t1 - t0
            # Forward steps 1-5 and 7 for this block: O and the log-sum-exp.
            qs = _query_tile(q[b], t0, t1, call.scale, work)  # (K, G·Tb, D)
            acc, l, m = _fast_online_softmax(qs, t0, t1, tiles)
            o = _normalise(acc, l)  # (K, G·Tb, E)
            lse = _log_sum_exp(m, l)  # (K, G·Tb, 1)

            # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O).
            do = d_out[b, :, :, t0:t1].astype(work).reshape(K, G * Tb, E)  # (K, G·Tb, E)
            delta = np.sum(do * o, axis=-1, keepdims=True)  # (K, G·Tb, 1)

            # The backward over the block's pages; dq gets the scale once, here.
            dq_b = _backward_block(qs, do, lse, delta, t0, t1, tiles, dk, dv, None)
            dq_b *= work(call.scale)  # (K, G·Tb, D)
            dq[b, :, :, t0:t1] = dq_b.reshape(K, G, Tb, D)  # (K, G, Tb, D)

        # 1'. Each key's gradient back to the page slot it was read from.
        for j, page in enumerate(call.pages[b]):
            rows = slice(j * L, min((j + 1) * L, n))
            dk_pages[page, :, : rows.stop - rows.start] += dk[:, rows]  # (K, ≤L, D)
            dv_pages[page, :, : rows.stop - rows.start] += dv[:, rows]  # (K, ≤L, E)

    return (
        dq.reshape(B, H, T, D),  # (B, H, T, D)
        dk_pages.astype(q.dtype),  # (N, K, L, D)
        dv_pages.astype(q.dtype),  # (N, K, L, E)
    )


def _prepare_paged(q, k_pages, v_pages, block_table, seq_lens, block_q, given: dict):
    """Step 0 of a paged call: the checked call and q as (B, K, G, T, D), a view."""
    q = np.asarray(q)
    options = {n: given[n] for n in ("is_causal", "scale", "window", "softcap")}
    if "d_out" in given:
        options["d_out"] = given["d_out"]
    arrays = (np.asarray(x) for x in (k_pages, v_pages, block_table, seq_lens))
    call = contract.check_paged(q, *arrays, **options)
    if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q <= 0:
        raise ValueError(f"block_q should be a positive int, got {block_q!r}")
    return call, q.reshape(call.B, call.K, call.G, call.T, call.D)  # (B, K, G, T, D)


def _page_tiles(k_pages, v_pages, call: contract.PagedChecked, b: int) -> _PageTiles:
    """Sequence b's keys and values as key tiles of whole pages, with its band: causality
    and the window from the bottom-right diagonal of its own length."""
    n, dtype = call.seq_lens[b], np.asarray(k_pages).dtype
    work = np.float64 if dtype == np.float64 else np.float32
    band = _Band(n - call.T, call.is_causal, call.window)
    pages = call.pages[b]  # the ⌈n / L⌉ pages sequence b reads
    k = _PageRows(np.asarray(k_pages), pages, n)  # (K, n, D), read through the pages
    v = _PageRows(np.asarray(v_pages), pages, n)  # (K, n, E)
    return _PageTiles(k, v, None, band, call.softcap, None, call.T, call.K, call.G, call.L, work)


class _PageRows:
    """One sequence's key (or value) rows, read through its pages: ``rows[:, s0:s1]`` is
    slots s0 % L … of page pages[s0 // L], a view, for a range [s0, s1) within one page
    (``_PageTiles.ranges`` cuts every tile at the page boundaries)."""

    def __init__(self, pages: np.ndarray, table: tuple[int, ...], n: int) -> None:
        self.pages, self.table, self.L = pages, table, pages.shape[2]  # (N, K, L, X)
        self.shape = (pages.shape[1], n, pages.shape[3])  # (K, n, X)

    def __getitem__(self, index: tuple[slice, slice]) -> np.ndarray:
        rows = index[1]
        j, i0 = divmod(rows.start, self.L)
        return self.pages[self.table[j], :, i0 : i0 + rows.stop - rows.start]  # (K, Sb, X)


class _PageTiles(_KeyTiles):
    """``_KeyTiles`` over one sequence's pages: the key tiles are its pages (L keys each,
    ``block_k`` = L), cut where the band starts or ends inside one; pages past its length
    are never visited, and neither is any slot past it."""

    def ranges(self, t0: int, t1: int) -> Iterator[tuple[int, int, bool]]:
        L = self.block_k
        for a, b, whole in self.band.ranges(t0, t1, self.S):
            s0 = a
            while s0 < b:
                s1 = min((s0 // L + 1) * L, b)  # the end of s0's page, or of the range
                yield s0, s1, whole
                s0 = s1


def _grouped(x: np.ndarray, K: int, G: int) -> np.ndarray:
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)  # (B|1, 1, 1, T, S)
    return x.reshape(b, K, G, t, s)  # (B|1, K, G, T, S)


# ----------------------------------------------------------------------------------------
# The tuned path. Everything above is the algorithm as the module docstring derives it;
# the calls run the online softmax through the function below instead, which gives the
# same rows faster. Nothing above depends on it but the two call sites.
#
# Deferring the max. Since any constant m gives the same answer, m = 0 does too, as long
# as nothing leaves the floating-point range: then there is no max to find, nothing to
# subtract and nothing to rescale, only exp(x), and l and a are plain sums. That is the
# common case (scores of a few units), and it saves two of the four passes over every
# tile. Whether it held is checked for each row after its last key tile: its sum l finite
# and at least √tiny (about 1e-19 in float32, where tiny is the smallest normal number),
# and its output sums a finite. An overflow shows as inf or NaN in l or a; a weight small
# enough to underflow is below tiny, so with l >= √tiny all such weights together weigh
# less than S · √tiny of the row, far below rounding. A row that fails the check (huge or
# very negative scores, no key at all, a NaN) is taken from ``_online_softmax`` over its
# block instead; the choice is made row by row, so a row's result never depends on
# another row's values. The backward's log-sum-exp is then log l (m = 0) or m + log l.
#
# Why passes are what to save. The two products per tile are ``np.matmul`` on float32
# arrays, which BLAS runs on all cores, and so is the row sum, a matrix-vector product
# with a vector of ones; the rest is elementwise passes over the tile, done in place, on
# one core (NumPy's ufuncs are single-threaded). With the max deferred a tile needs one
# pass (exp) instead of four (max, subtract, exp, sum), and only the diagonal strips a
# fifth (the mask). The block sizes trade Python overhead and BLAS efficiency (larger
# tiles) against cache residency and causal skipping (smaller ones): a query block of Tb
# rows wastes about Tb²/2 masked scores on the diagonal. 256 × 512 was fastest on 2
# cores, causal and not (T = 4096, float32). (Running query blocks on Python threads
# would parallelise the elementwise passes, but OpenBLAS's own threads then fight them
# for the cores and every matmul stalls.)


def _fast_online_softmax(
    qs: np.ndarray, t0: int, t1: int, tiles: _KeyTiles
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_online_softmax``'s (acc, l, m) for one query block, with the max deferred where
    that is exact, and from ``_online_softmax`` for the other rows."""
    BK, R, _ = qs.shape  # R = G·Tb rows
    work = qs.dtype
    l = np.zeros((BK, R, 1), dtype=work)  # (B·K, G·Tb, 1)
    acc = np.zeros((BK, R, tiles.v.shape[-1]), dtype=work)  # (B·K, G·Tb, E)
    pv = np.empty_like(acc)  # (B·K, G·Tb, E)
    for s0, s1, whole in tiles.ranges(t0, t1):
        x, used = tiles.scores(qs, t0, t1, s0, s1, whole)  # (B·K, G·Tb, Sb), steps 1, 3, 4
        Sb = s1 - s0
        # A score above about 88 (float32) overflows exp() to inf, and an inf weight or
        # value makes inf or NaN in the sums: the check after the loop catches both and
        # takes the row from _online_softmax, so these are expected, not faults.
        with np.errstate(over="ignore", invalid="ignore"):
            # 5. Softmax over the keys, with the exponent taken against 0.
            p = np.exp(x, out=x)  # (B·K, G·Tb, Sb)
            # The row sums as a matrix-vector product: BLAS runs it on every core.
            l += np.dot(p.reshape(BK * R, Sb), tiles.ones[:Sb]).reshape(BK, R, 1)
            # 7. Weighted sum of the values, accumulated unnormalised.
            acc += np.matmul(p, tiles.values(s0, s1, used), out=pv)  # (B·K, G·Tb, E)
    m = np.zeros_like(l)  # (B·K, G·Tb, 1)
    exact = _in_range(acc, l)  # (B·K, G·Tb, 1)
    if not exact.all():
        acc_m, l_m, m_m = _online_softmax(qs, t0, t1, tiles)
        acc = np.where(exact, acc, acc_m)  # (B·K, G·Tb, E)
        l = np.where(exact, l, l_m)  # (B·K, G·Tb, 1)
        m = np.where(exact, m, m_m)  # (B·K, G·Tb, 1)
    return acc, l, m


def _in_range(acc: np.ndarray, l: np.ndarray) -> np.ndarray:
    """Which rows' sums are exact with the max deferred: (B·K, G·Tb, 1) bool. Not where
    something overflowed (inf or NaN in l or acc), nor where the row sum is so small that
    an underflowed weight could matter."""
    floor = math.sqrt(np.finfo(l.dtype).tiny)
    finite = np.isfinite(acc).all(axis=-1, keepdims=True)  # (B·K, G·Tb, 1)
    return (l >= floor) & np.isfinite(l) & finite  # (B·K, G·Tb, 1)
