"""Ring attention in JAX: the sequence split over P devices, key/value blocks passed round.

When T and S outgrow one device, each device keeps one slice of the queries and one slice
of the keys and values (Liu, Zaharia, Abbeel 2023, "Ring Attention"). The key/value slices
then travel round a ring of devices, one hop per step, and after P steps every query slice
has met every key slice. Nothing bigger than a slice ever sits on one device: per-device
memory is O((T/P)·D + (S/P)·(D + E)) plus one (T/P) × (S/P) score block.

The ring, P = 4, contiguous layout (q_i, kv_i: the i-th quarter of the sequence):

    step          device 0      device 1      device 2      device 3
    0             q0 · kv0      q1 · kv1      q2 · kv2      q3 · kv3
    1             q0 · kv3      q1 · kv0      q2 · kv1      q3 · kv2
    2             q0 · kv2      q1 · kv3      q2 · kv0      q3 · kv1
    3             q0 · kv1      q1 · kv2      q2 · kv3      q3 · kv0
                  after each step: device i sends its kv block to device i + 1 (mod P)
                  with lax.ppermute, so at step j it holds block (i − j) mod P

Why the merge is exact. Each device runs the online softmax of ``jax_flash`` over the key
blocks as they arrive: it keeps, per query row, the running max m, the running sum
l = Σ exp(x_s − m) and the unnormalised output a = Σ exp(x_s − m) v_s over the keys seen so
far, and rescales the old l and a by α = exp(m_old − m_new) when a block raises the max.
exp(x − m_old) · exp(m_old − m_new) = exp(x − m_new) is an identity, so after the last
block l and a are exactly Σ_s exp(x_s − m) and Σ_s exp(x_s − m) v_s with m the true row
max, whatever order the blocks came in: only rounding differs from the reference. The
form is the stable one: m only grows, α <= 1, nothing is exponentiated above 0, so a
row's maximum on another device than most of its mass cannot overflow. (The other
form keeps a log-sum-exp lse and merges out = out_a·exp(lse_a − lse) + ...;
written as log(exp(a) + exp(b)) it overflows, EasyContext #14.)

Where the causal imbalance comes from. Under a causal mask, query slice i needs only the
key slices j <= i. A block wholly above the diagonal is skipped (``lax.cond``), so in the
contiguous layout device 0 computes 1 block and device P − 1 computes P: the ring is as
slow as its busiest device, which does about twice the average work. The zigzag layout
(Brandon et al. 2023; ring-flash-attention's "zigzag") cuts the sequence into 2P chunks
and gives device i chunks i and 2P − 1 − i, one early and one late:

    zigzag, P = 4, chunks c0 … c7:   device 0: c0 c7   device 1: c1 c6
                                     device 2: c2 c5   device 3: c3 c4

Each device's slice is then two half-blocks, and at every step of the ring each device
computes the same number of unmasked half-block pairs (2 of 4 off the diagonal, 3 of 4 on
it): the causal work is balanced. The layout is a permutation of the sequence made on the
host before sharding and undone after gathering; every mask decision is taken on the
tokens' original positions, which travel with them, so the result is the same function.

Lengths that are not multiples of P. T and S are padded up to whole slices (for zigzag,
whole chunks), and a chunk's length up to a multiple of 8 rows: XLA compiles one program
per shape, and so one program serves every length in a band of 8 rows a chunk, for at
most 7 padded rows a chunk (none when the chunks are already multiples of 8). Padded keys carry position S or more and are blocked like any blocked key,
so they are never attended; padded queries are computed and cut off. A query whose keys
all live on other devices is fine (it simply gets nothing from its own block); one with no
key anywhere ends with l = 0, a = 0 and returns exactly 0, as the reference does.

Gradients: ``attention_vjp`` is a second ring, written by hand (FlashAttention's
backward, ring-distributed). The forward ring runs again for each row's log-sum-exp;
then, as the key/value slices travel round once more, each device recomputes a block's
weights from it, keeps dq for its own queries, and adds dk and dv for the slice at hand
into buffers that travel with the slice and make one last hop home. Per-device memory
stays that of the forward, where ``jax.vjp`` through the loop would store every step's
weights; and each step's gradient is computed from the block that step holds.

Sinks. An attention sink (one logit per query head, gpt-oss) is one more term of a row's
softmax with no value row. It joins the merge once, after the last step of the ring: m' =
max(m, sink), l' = exp(m − m')·l + exp(sink − m'), a' = exp(m − m')·a, exactly as
``jax_flash`` folds it in after its last key block. Folded in at every step (or on every
device's partial result) it would count P times. Its gradient is
dsinks[h] = −Σ_t p_sink[t]·(dO·O)[t] with p_sink = exp(sink − lse), summed over this
device's rows and then over the devices (``lax.psum``): every device holds some of every
head's rows.

ALiBi. Its bias −slope·|t + S − T − s| needs each token's global position; the positions
travel with the slices (the same ones the causal mask and the window read), so each block
computes its own slice of the bias, in both layouts and with padded lengths, and no
(T, S) bias is ever built. The slopes, (B, H), are replicated: they are tiny.

Masks. A mask with a T axis is sharded along T with its queries (each device holds the
rows of its own query slice, every column), so it never travels; its column block for the
key slice at hand is sliced by the slice's index. A mask without a T axis is replicated.
Per-device mask memory is (T/P) × S.

Packed documents. ``attention_packed`` takes N documents one after another (FlashAttention's
varlen API, SPEC §18): q (H, T, D) with document n's queries at cu_seqlens_q[n] <= t <
cu_seqlens_q[n + 1], keys and values likewise. The packed tokens are one sequence (B = 1),
split over the devices, padded and laid out exactly as ``attention``'s; each token carries
its document and its place in it, which travel with the slices as the positions do, and
the document is one more test in the mask: a key is allowed only if its document is the
query's, and causality and the window are counted on the in-document places (a query's
place shifted by S_n − T_n under bottom-right alignment, so that each document has its own
diagonal). Padding is in no document (-1). A block whose pieces share no document is
skipped like one above the diagonal. Within a block that holds several documents, each
is computed on its own and each row keeps the result of its own document's pass: a row of
another document has weights 0, but 0 · NaN is NaN, so a NaN in one document would
otherwise reach the others through the products. The documents are data, not structure:
one compiled program serves every packing of lengths in the same band.

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       P devices (shards)
    Tl, Sl: the per-device slice lengths  Tc, Sc: their halves in zigzag (pieces)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, softcapping, attention sinks, ALiBi, grouped-query and multi-query attention
(K < H, no repeated heads built), float64, float32, float16 and bfloat16 (computed in
float32 and rounded once), unbatched inputs, and the backward pass with a float mask's
and the sinks' gradients. Chunked local attention (Llama 4) is one more test on the
tokens' positions, like the window, so a block none of whose keys shares a chunk with
the query block's rows is skipped like one above the causal diagonal; packed documents
(``attention_packed``, with its backward) are a test of the same kind. Not supported:
dropout. On a CPU-only machine, P devices need ``jax.config.update("jax_num_cpu_devices",
P)`` before JAX's first computation (``host_devices`` does it, or says why it cannot).
The same code runs unchanged over real devices, and over hosts after
``jax.distributed.initialize()``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from . import contract

LAYOUTS = ("contiguous", "zigzag")
AXIS = "ring"
_FAR = 2**30  # "unbounded" for a window side, as an int32
ROWS = 8  # a chunk's length is a multiple of ROWS: one compiled program per band of lengths


def attention(
    q,
    k,
    v,
    *,
    mask=None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks=None,
    chunk_size: int | None = None,
    alibi_slopes=None,
    shards: int | None = None,
    layout: str = "zigzag",
) -> np.ndarray:
    """Scaled dot-product attention over P devices, key/value blocks passed round a ring.

    Args:
      q: queries, (B, H, T, D) or unbatched (H, T, D).
      k: keys, (B, K, S, D) or (K, S, D); K must divide H.
      v: values, (B, K, S, E) or (K, S, E).
      mask: bool (True = may attend) or floating (added to the scores, -inf blocks),
        broadcastable to (B, H, T, S).
      is_causal: query t attends only keys s on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      causal_alignment: "top_left" (s <= t) or "bottom_right" (s <= t + S - T); also
        places the window's diagonal.
      window: (left, right): query t attends keys in [t' - left, t' + right], t' its
        aligned diagonal; None on a side is unbounded.
      softcap: scores become softcap · tanh(scores / softcap) before masking.
      dropout_p: must be 0; dropout is not supported here.
      sinks: (H,), same dtype as q: one logit per query head that joins every row's
        softmax and carries no value (SPEC §15), or None.
      chunk_size: query t and key s attend each other only within one chunk of that many
        positions, ⌊(t + offset) / chunk_size⌋ == ⌊s / chunk_size⌋ (SPEC §16), or None.
      alibi_slopes: (H,) or (B, H), float32 or q's dtype: ALiBi adds -slope · |t + S - T -
        s| to the scores, t and s the global positions (SPEC §17), or None.
      shards: P, the number of devices in the ring (default: every device JAX sees).
      layout: "contiguous" (device i holds the i-th slice) or "zigzag" (chunks i and
        2P - 1 - i of 2P: balanced causal work).

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input, as a NumPy array in q's dtype.
    """
    # 0. Validate, and lay the sequence out over the devices (pad, permute, shard).
    run = _prepare(
        q,
        k,
        v,
        mask,
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
        dropout_p=dropout_p,
        sinks=sinks,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    return _run_forward(run, shards, layout)  # (B, H, T, E) or (H, T, E)


def attention_vjp(
    q,
    k,
    v,
    d_out,
    *,
    mask=None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks=None,
    chunk_size: int | None = None,
    alibi_slopes=None,
    shards: int | None = None,
    layout: str = "zigzag",
) -> tuple[np.ndarray, ...]:
    """Gradients of ``attention`` by a second ring (see the module docstring).

    Args:
      q, k, v, mask, options, sinks, chunk_size, alibi_slopes, shards, layout: as for
        ``attention`` (no dropout).
      d_out: ∂L/∂out, shaped like the output, in q's dtype.

    Returns:
      (dq, dk, dv), shaped like q, k, v, for L = Σ d_out · attention(q, k, v, ...); with a
      floating mask, (dq, dk, dv, dmask), dmask shaped like the mask; with sinks, dsinks
      (H,) last. The slopes are constants: no gradient.
    """
    run = _prepare(
        q,
        k,
        v,
        mask,
        d_out,
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
        dropout_p=dropout_p,
        sinks=sinks,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    return _run_backward(run, shards, layout)


def attention_packed(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    shards: int | None = None,
    layout: str = "zigzag",
) -> np.ndarray:
    """Attention over packed variable-length sequences (FlashAttention's varlen API) on
    the ring: the packed tokens are one sequence, split and passed round as ``attention``'s.

    N documents lie one after another on the token axis; document n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:cu_seqlens_k[n + 1], and
    its rows are ``attention`` on that document alone (the module docstring's Packed
    documents). The documents travel as data: one compiled program serves every packing.

    Args:
      q: queries of every document, (H, T, D), T = cu_seqlens_q[-1].
      k: keys, (K, S, D), S = cu_seqlens_k[-1]; K must divide H.
      v: values, (K, S, E).
      cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths from 0.
      is_causal, scale, causal_alignment, window, softcap: as for ``attention``, applied
        within each document (bottom-right puts document n's diagonal at S_n - T_n).
      shards, layout: as for ``attention``.

    Returns:
      out: (H, T, E), as a NumPy array in q's dtype.
    """
    # 0. Validate, and give each token its document and its place in it.
    run = _prepare_packed(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    return _run_forward(run, shards, layout)  # (H, T, E)


def attention_packed_vjp(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    d_out,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    shards: int | None = None,
    layout: str = "zigzag",
) -> tuple[np.ndarray, ...]:
    """Gradients of ``attention_packed`` by the backward ring: (dq, dk, dv) shaped like
    q, k, v, for L = Σ d_out · attention_packed(...), d_out (H, T, E) in q's dtype. The
    boundaries are integers and get no gradient; a key gets nothing from another
    document's queries."""
    run = _prepare_packed(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        d_out,
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
    )
    return _run_backward(run, shards, layout)


def _run_forward(run, shards: int | None, layout: str) -> np.ndarray:
    """Lay the checked inputs out over the devices, run the forward ring, gather."""
    ring = _Ring(run, shards, layout)
    fn = _ring_fn(ring.mesh, **ring.static)
    out = fn(*ring.put(run))  # (B, H, Tp, E), sharded along Tp
    out = ring.unpermute(np.asarray(out), axis=2, n=run.T)  # (B, H, T, E)
    return out[0] if run.unbatched else out


def _run_backward(run, shards: int | None, layout: str) -> tuple[np.ndarray, ...]:
    """Lay the checked inputs and d_out out, run the backward ring, gather the gradients."""
    ring = _Ring(run, shards, layout)
    float_mask = run.mask is not None and run.mask.dtype != np.bool_
    fn = _ring_vjp_fn(ring.mesh, float_mask, **ring.static)
    args = ring.put(run)
    d_out = ring.permute(run.d_out, axis=2, n=run.T, seq="t")  # (B, H, Tp, E)
    d_out = ring.shard(d_out, PS(None, None, AXIS, None))
    grads = fn(*args, d_out)
    dq = ring.unpermute(np.asarray(grads[0]), axis=2, n=run.T, seq="t")  # (B, H, T, D)
    dk = ring.unpermute(np.asarray(grads[1]), axis=2, n=run.S, seq="s")  # (B, K, S, D)
    dv = ring.unpermute(np.asarray(grads[2]), axis=2, n=run.S, seq="s")  # (B, K, S, E)
    out = [x[0] if run.unbatched else x for x in (dq, dk, dv)]
    if float_mask:
        dm = np.asarray(grads[3])  # (B|1, H|1, Tp|1, Sp|1)
        if run.mask.shape[2] != 1:
            dm = ring.unpermute(dm, axis=2, n=run.T, seq="t")
        if run.mask.shape[3] != 1:
            dm = ring.unpermute(dm, axis=3, n=run.S, seq="s")
        out.append(dm.reshape(run.mask_shape))
    if run.sinks is not None:
        out.append(np.asarray(grads[-1]).astype(run.q.dtype))  # dsinks (H,), summed over devices
    return tuple(out)


# ----------------------------------------------------------------------------------------
# The per-device ring: steps 1-7, written as for one device; the axis name is the ring.


def _ring_body(
    q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, *, P, pieces, softcap_on
):
    """One device's share: its query slice against every key/value slice in turn.

    q (B, H, Tl, D), k (B, K, Sl, D), v (B, K, Sl, E), tpos (Tl,), spos (Sl,): the original
    positions of the local queries and keys (padding at positions >= T, >= S); tdoc (Tl,)
    and sdoc (Sl,): for packed documents, each token's document (-1: padding), its
    position then being its place in the document, or None; mask
    (B|1, H|1, Tl|1, Sp|1) or None; sinks (H,) and ALiBi's slopes (B, H), replicated, or
    None; opts: the scalar options, traced (one compilation serves every scale, alignment,
    window and softcap value). Returns (B, H, Tl, E).
    """
    out, _ = _ring_forward(
        q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts,
        P=P, pieces=pieces, softcap_on=softcap_on,
    )  # fmt: skip
    return out.astype(q.dtype)


def _softcap(x, softcap):
    """softcap · tanh(x / softcap); where x / softcap is subnormal, which XLA on a CPU may
    flush to 0 (and the score with it), x itself: tanh(y) = y there far below rounding, and
    the derivative, 1 − tanh², is 1 (SPEC §4.2)."""
    ratio = x / softcap
    return jnp.where(jnp.abs(ratio) < jnp.finfo(x.dtype).tiny, x, softcap * jnp.tanh(ratio))


def _ring_forward(
    q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, *, P, pieces, softcap_on
):
    """The forward ring, in the working dtype: (out (B, H, Tl, E), lse (B, H, Tl)), with
    lse = -inf for a row that sees no key; the sink, if any, is in lse."""
    B, H, Tl, D = q.shape
    _, K, Sl, _ = k.shape
    E = v.shape[-1]
    G = H // K
    Tc, Sc = Tl // pieces, Sl // pieces  # rows and keys per piece (zigzag: two pieces)
    work = _working_dtype(q.dtype)
    scale, softcap = opts["scale"].astype(work), opts["softcap"].astype(work)

    # 2. Scale, folded into the queries. Query head h = κ·G + g shares key/value head κ,
    # so a kv head's block serves its G query heads, stacked as G·Tc rows.
    qs = _pieces(q.astype(work) * scale, K, pieces)  # (pieces, B, K, G·Tc, D)
    tps = tpos.reshape(pieces, Tc)  # (pieces, Tc)
    tds = None if tdoc is None else tdoc.reshape(pieces, Tc)  # (pieces, Tc)
    alibi = None if slopes is None else _grouped_slopes(slopes.astype(work), K, G)

    def attend(m, l, acc, a, kb, vb, sp, mb, docs):
        """Query piece a's (m, l, acc) (B, K, G·Tc), ..., (B, K, G·Tc, E) after one key
        piece; docs: the pieces' documents (tokens of no document -1), or None."""
        qa = qs[a]  # (B, K, G·Tc, D)
        # A key no query of this block may see must have no effect whatever it holds
        # (0 · NaN is NaN): its key and value rows are replaced by 0, by selection.
        allowed, used, mb = _visible(tps[a], sp, mb, opts, K, G, docs)
        kb = jnp.where(used[..., None], kb.astype(work), 0.0)  # (B, K, Sc, D)
        vb = jnp.where(used[..., None], vb.astype(work), 0.0)  # (B, K, Sc, E)

        # 1. Scores: the local query piece against the key piece now on this device.
        x = jnp.einsum(
            "bkrd,bksd->bkrs", qa, kb, precision=lax.Precision.HIGHEST
        )  # (B, K, G·Tc, Sc), r = G·Tc rows

        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        if softcap_on:
            x = _softcap(x, softcap)  # (B, K, G·Tc, Sc)

        # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query
        # may not see gets -inf (replaced, not only pushed down: NaN + -inf is NaN).
        x = x.reshape(B, K, G, Tc, Sc)  # (B, K, G, Tc, Sc)
        if alibi is not None:
            x = x + _alibi_bias(alibi, tps[a], sp, opts)  # (B, K, G, Tc, Sc)
        if mb is not None and mb.dtype != jnp.bool_:
            x = x + mb.astype(work)
        x = jnp.where(allowed, x, -jnp.inf).reshape(B, K, G * Tc, Sc)  # (B, K, G·Tc, Sc)

        # 5. Softmax over the keys, online: rescale what was accumulated against the old
        # running max onto the new one (see the module docstring). A row that has seen
        # only blocked keys keeps max -inf; its exponent is taken against 0, so its
        # weights are exactly 0 instead of exp(-inf - -inf) = NaN.
        m_new = jnp.maximum(m, x.max(axis=-1))  # (B, K, G·Tc)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, K, G·Tc)
        alpha = jnp.exp(m - m_safe)  # (B, K, G·Tc)
        p = jnp.exp(x - m_safe[..., None])  # (B, K, G·Tc, Sc)
        l = alpha * l + p.sum(axis=-1)  # (B, K, G·Tc)

        # 7. Weighted sum of the values, accumulated unnormalised.
        pv = jnp.einsum(
            "bkrs,bkse->bkre", p, vb, precision=lax.Precision.HIGHEST
        )  # (B, K, G·Tc, E)
        return m_new, l, alpha[..., None] * acc + pv

    def update(state, a, b, src, kb, vb, sp, sd, mb):
        """Query piece a's running (m, l, acc) after key piece b of device src's slice."""
        (ms, ls, accs), travelling = state  # (pieces, B, K, G·Tc), ..., (pieces, B, K, G·Tc, E)
        piece = (ms[a], ls[a], accs[a])  # this query piece's
        if sd is None:
            new = attend(*piece, a, kb, vb, sp, mb, None)
        else:
            td = tds[a]  # (Tc,)

            def document(n, piece):
                # Packed documents: document n's rows against its keys, the other rows
                # counted in no document for this pass; each row keeps its own
                # document's pass, since 0 · NaN is NaN (module docstring).
                mine = td == n  # (Tc,)
                new = attend(*piece, a, kb, vb, sp, mb, (jnp.where(mine, n, -1), sd))
                rows = jnp.tile(mine, G)  # (G·Tc,): row g·Tc + t is query t
                return tuple(
                    jnp.where(rows if x.ndim == 3 else rows[:, None], y, x)
                    for x, y in zip(piece, new)
                )

            new = lax.fori_loop(*_shared_documents(td, sd), document, piece)
        stay = tuple(lax.dynamic_update_index_in_dim(x, y, a, 0) for x, y in zip(state[0], new))
        return stay, travelling

    # One (m, l, acc) per query piece, stacked on a leading axis; they differ from device
    # to device ("varying" over the ring axis). Nothing travels with the key/value slices.
    stay = _varying(
        jnp.full((pieces, B, K, G * Tc), -jnp.inf, dtype=work),  # m: running row max
        jnp.zeros((pieces, B, K, G * Tc), dtype=work),  # l: running row sum
        jnp.zeros((pieces, B, K, G * Tc, E), dtype=work),  # acc: unnormalised output
    )
    kv = (k, v, spos, sdoc)
    (m, l, acc), _ = _walk(update, stay, (), kv, mask, tps, tds, opts, P=P, pieces=pieces)
    if sinks is not None:
        # The sink joins each row's softmax once, now that every key block has been merged
        # (once per step or per device, it would count P times).
        m, l, acc = _add_sink(m, l, acc, _sink_rows(sinks.astype(work), m.shape, K, G))

    # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
    some = l > 0
    out = acc / jnp.where(some, l, 1.0)[..., None]  # (pieces, B, K, G·Tc, E)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)  # (pieces, B, K, G·Tc)
    lse = jnp.where(some, m_safe + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)
    # A row that read a +inf score (q·k overflowed) has l = +inf or NaN: its lse is NaN, so
    # that in the backward every weight of it is NaN, as its output is (SPEC §4.1).
    lse = jnp.where(jnp.isnan(l) | (l == jnp.inf), jnp.nan, lse)  # (pieces, B, K, G·Tc)
    return _unpieces(out, H), _unpieces(lse[..., None], H)[..., 0]  # (B, H, Tl, E), (B, H, Tl)


def _ring_backward(
    q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, d_out,
    *, P, pieces, softcap_on, float_mask,
):  # fmt: skip
    """One device's share of the backward: (dq, dk, dv), then dmask with a float mask and
    dsinks (H,) with sinks, summed over the devices.

    The arguments are ``_ring_body``'s and d_out (B, H, Tl, E), this device's rows of
    ∂L/∂out. The forward ring runs again for each row's log-sum-exp, then a second ring
    recomputes every block's weights from it (FlashAttention's backward): dq stays with
    its queries, while dk and dv travel round the ring with their key/value slice and
    make one hop more, home. dq (B, H, Tl, D) is this device's rows; dk (B, K, Sl, D) and
    dv (B, K, Sl, E) its own slice's, summed over every device's queries; dmask has the
    mask's shape (its T axis sharded with the queries, or summed over the devices).

    The block body is the same algorithm as ``jax_flash``'s backward tile but kept apart:
    an impl may import only contract.py, and here the options and every token's position
    are traced values that travel with the slices (one compiled program serves every
    option and layout), where ``jax_flash`` masks by a static band and skips by loop bounds.
    """
    out, lse = _ring_forward(
        q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts,
        P=P, pieces=pieces, softcap_on=softcap_on,
    )  # fmt: skip
    B, H, Tl, D = q.shape
    _, K, Sl, _ = k.shape
    G = H // K
    Tc, Sc = Tl // pieces, Sl // pieces
    work = _working_dtype(q.dtype)
    scale, softcap = opts["scale"].astype(work), opts["softcap"].astype(work)
    d_out = d_out.astype(work)  # (B, H, Tl, E)

    qs = _pieces(q.astype(work) * scale, K, pieces)  # (pieces, B, K, G·Tc, D)
    dos = _pieces(d_out, K, pieces)  # (pieces, B, K, G·Tc, E)
    # 5'. The softmax's row term, rowsum(dO ⊙ O): one dot product per row.
    delta = (d_out * out).sum(axis=-1)  # (B, H, Tl)
    d_row = _pieces(delta[..., None], K, pieces)[..., 0]  # (pieces, B, K, G·Tc)
    some = jnp.isfinite(lse)  # (B, H, Tl): the rows that see a key
    ds = None
    if sinks is not None:
        # 5'. Sinks: dsink = −Σ_t p_sink · rowsum(dO ⊙ O), p_sink = exp(sink − lse) (0 for a
        # row with no key), over this device's rows; then over every device's rows.
        sink = sinks.astype(work)[None, :, None]  # (1, H, 1)
        p_sink = jnp.where(some, jnp.exp(sink - lse), 0.0)  # (B, H, Tl)
        ds = lax.psum(-(p_sink * delta).sum(axis=(0, 2)), AXIS)  # (H,)
    # A row with no key has lse = -inf; against +inf its weights are exp(-inf) = 0. (A NaN
    # row keeps lse = NaN: §4.1.)
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # (B, H, Tl)
    lses = _pieces(lse[..., None], K, pieces)[..., 0]  # (pieces, B, K, G·Tc)
    tps = tpos.reshape(pieces, Tc)  # (pieces, Tc)
    tds = None if tdoc is None else tdoc.reshape(pieces, Tc)  # (pieces, Tc)
    alibi = None if slopes is None else _grouped_slopes(slopes.astype(work), K, G)

    def gradients(a, kb, vb, sp, mb, docs, rows):
        """Query piece a against one key piece: (dq_a (B, K, G·Tc, D), dk_b (B, K, Sc, D),
        dv_b (B, K, Sc, E), dZ (B, K, G·Tc, Sc) for the mask). docs: the pieces'
        documents, or None; rows (G·Tc,): the rows of the one document computed (the
        others give nothing), or None."""
        allowed, used, mbg = _visible(tps[a], sp, mb, opts, K, G, docs)
        kb = jnp.where(used[..., None], kb.astype(work), 0.0)  # (B, K, Sc, D)
        vb = jnp.where(used[..., None], vb.astype(work), 0.0)  # (B, K, Sc, E)
        qa, do, lse_a = qs[a], dos[a], lses[a]  # (B, K, G·Tc, D), (B, K, G·Tc, E), (B, K, G·Tc)
        if rows is not None:
            # Only this document's rows carry q, dO and lse into the products: another
            # document's row (NaN in its q or d_out, or in its lse through its values)
            # must add nothing, and a product with a weight of 0 would still carry a NaN.
            qa = jnp.where(rows[:, None], qa, 0.0)  # (B, K, G·Tc, D)
            do = jnp.where(rows[:, None], do, 0.0)  # (B, K, G·Tc, E)
            lse_a = jnp.where(rows, lse_a, jnp.inf)  # (B, K, G·Tc)

        # Forward steps 1-5 again for this block: raw scores, weights from lse.
        raw = jnp.einsum("bkrd,bksd->bkrs", qa, kb, precision=lax.Precision.HIGHEST)
        x = _softcap(raw, softcap) if softcap_on else raw  # (B, K, G·Tc, Sc)
        x = x.reshape(B, K, G, Tc, Sc)  # (B, K, G, Tc, Sc)
        if alibi is not None:
            x = x + _alibi_bias(alibi, tps[a], sp, opts)  # (B, K, G, Tc, Sc)
        if float_mask:
            x = x + mbg.astype(work)
        x = jnp.where(allowed, x, -jnp.inf).reshape(B, K, G * Tc, Sc)  # (B, K, G·Tc, Sc)
        p = jnp.exp(x - lse_a[..., None])  # (B, K, G·Tc, Sc)

        # 7'. dV = Pᵀ·dO, and dP = dO·Vᵀ.
        dv_b = jnp.einsum("bkrs,bkre->bkse", p, do, precision=lax.Precision.HIGHEST)
        dp = jnp.einsum("bkre,bkse->bkrs", do, vb, precision=lax.Precision.HIGHEST)
        # 5'. dZ = P ⊙ (dP − rowsum(dO ⊙ O)).
        dz = p * (dp - d_row[a][..., None])  # (B, K, G·Tc, Sc)
        dz_mask = dz
        # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c).
        if softcap_on:
            dz = dz * (1.0 - jnp.tanh(raw / softcap) ** 2)
        if rows is not None:
            # A row of another document has P = 0, but its dP = 0 · V (and its softcap
            # factor) is NaN where this document's values are: selected away, so that
            # dK gets nothing from it.
            dz = jnp.where(rows[:, None], dz, 0.0)  # (B, K, G·Tc, Sc)
        # 2'-1'. The scale is folded into qa; dq gets it once at the end.
        dq_a = jnp.einsum("bkrs,bksd->bkrd", dz, kb, precision=lax.Precision.HIGHEST)
        dk_b = jnp.einsum("bkrs,bkrd->bksd", dz, qa, precision=lax.Precision.HIGHEST)
        # The slots replaced by 0 get nothing back.
        dk_b = jnp.where(used[..., None], dk_b, 0.0)  # (B, K, Sc, D)
        dv_b = jnp.where(used[..., None], dv_b, 0.0)  # (B, K, Sc, E)
        return dq_a, dk_b, dv_b, dz_mask

    def block(state, a, b, src, kb, vb, sp, sd, mb):
        """The gradients after query piece a against key piece b of device src's slice."""
        (dq, dm), (dk, dv) = state
        if sd is None:
            dq_a, dk_b, dv_b, dz = gradients(a, kb, vb, sp, mb, None, None)
            # 4'. A float mask was added to the scores: its gradient is dZ, summed over
            # the axes the mask broadcasts along.
            if float_mask:
                dm = _add_mask_grad(dm, dz.reshape(B, K, G, Tc, Sc), a, b, src, Sl)
        else:
            td = tds[a]  # (Tc,)

            def document(n, sums):
                # Packed documents: document n's rows against its keys (the forward's
                # ``document``); a row's dq comes from its own document's pass alone.
                mine = td == n  # (Tc,)
                rows = jnp.tile(mine, G)  # (G·Tc,)
                dq_a, dk_b, dv_b, _ = gradients(
                    a, kb, vb, sp, None, (jnp.where(mine, n, -1), sd), rows
                )
                dq_a = jnp.where(rows[:, None], dq_a, 0.0)  # (B, K, G·Tc, D)
                return tuple(x + y for x, y in zip(sums, (dq_a, dk_b, dv_b)))

            sums = (jnp.zeros_like(dq[a]), jnp.zeros_like(kb, dtype=work))  # dq_a, dk_b
            sums += (jnp.zeros_like(vb, dtype=work),)  # dv_b
            dq_a, dk_b, dv_b = lax.fori_loop(*_shared_documents(td, sd), document, sums)
        dq = lax.dynamic_update_index_in_dim(dq, dq[a] + dq_a, a, 0)
        dk = _add_key_piece(dk, dk_b, b, Sc)
        dv = _add_key_piece(dv, dv_b, b, Sc)
        return (dq, dm), (dk, dv)

    # dq and dmask stay on this device; dk and dv travel with the key/value slice.
    stay = _varying(
        jnp.zeros((pieces, B, K, G * Tc, D), dtype=work),  # dq, by query piece
        jnp.zeros(mask.shape, dtype=work) if float_mask else None,  # dmask, mask-shaped
    )
    travelling = _varying(jnp.zeros(k.shape, dtype=work), jnp.zeros(v.shape, dtype=work))
    kv = (k, v, spos, sdoc)
    (dq, dm), (dk, dv) = _walk(
        block, stay, travelling, kv, mask, tps, tds, opts, P=P, pieces=pieces
    )
    dq = _unpieces(dq * scale, H)  # (B, H, Tl, D)
    out = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    if float_mask:
        if mask.shape[2] == 1:
            dm = lax.psum(dm, AXIS)  # a mask without a T axis: every device's rows add up
        out += (dm.astype(mask.dtype),)
    if ds is not None:
        out += (ds.astype(q.dtype),)  # (H,), the same on every device
    return out


def _walk(block, stay, travelling, kv, mask, tps, tds, opts, *, P: int, pieces: int):
    """The ring itself, the same for the forward and the backward.

    At each of the P steps, for every (query piece a, key piece b) that some query of
    piece a may see, ``state = block(state, a, b, src, kb, vb, sp, sd, mb)``, state being
    (stay, travelling); then the key/value slice kv = (k, v, spos, sdoc) moves on to the
    next device (sdoc, the keys' documents, and tds, the query pieces', are None unless
    the call is packed), and ``travelling`` (the backward's dk and dv) with it. After the last step
    ``travelling`` makes one hop more, home to the device whose slice it belongs to.
    Returns (stay, travelling).
    """
    me = lax.axis_index(AXIS)
    Tc, Sl = tps.shape[1], kv[0].shape[2]
    Sc = Sl // pieces

    def step(i, state, kv):
        src = (me - i) % P  # whose key/value slice this device holds now

        def piece_pair(c, state):
            # Query piece a against key piece b: one loop body, so that XLA compiles the
            # block once, not once per pair (zigzag has four).
            a, b = c // pieces, c % pieces
            kb, vb, sp, sd = (None if x is None else _key_piece(x, b, Sc) for x in kv)
            mb = _mask_block(mask, a, b, src, Tc, Sc, Sl)  # (B|1, H|1, Tc|1, Sc|1)
            # Skip a block no query of this piece may see (above the causal diagonal,
            # outside the window, in no shared document, or all padding): this is the
            # causal saving, and the source of the contiguous layout's imbalance.
            docs = None if sd is None else (tds[a], sd)
            visible = jnp.any(_allowed_keys(tps[a], sp, opts, docs))
            return lax.cond(visible, block, _skip, state, a, b, src, kb, vb, sp, sd, mb)

        return lax.fori_loop(0, pieces * pieces, piece_pair, state)

    def step_and_pass(i, loop):
        state, kv = loop
        stay, travelling = step(i, state, kv)
        # Pass the slice on, with its positions and what travels with it: device i sends
        # to i + 1.
        moved = _pass_on((*kv, *travelling), P)
        return (stay, moved[len(kv) :]), moved[: len(kv)]

    # Steps 0 .. P-2 compute and pass the slice on; the last step only computes, so each
    # slice makes P - 1 hops.
    state, kv = lax.fori_loop(0, P - 1, step_and_pass, ((stay, travelling), kv))
    stay, travelling = step(P - 1, state, kv)
    if travelling and P > 1:
        travelling = _pass_on(travelling, P)  # one more hop: home
    return stay, travelling


def _working_dtype(dtype):
    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _skip(carry, *_):
    return carry  # a block no query may see changes nothing


def _shared_documents(td, sd) -> tuple:
    """The packed documents [first, last) that a query piece td (Tc,) and a key piece
    sd (Sc,) both hold tokens of (padding, -1, is in none), as loop bounds: a document
    only one side holds adds nothing to the block."""
    none = jnp.iinfo(jnp.int32).max
    first = jnp.maximum(
        jnp.where(td >= 0, td, none).min(), jnp.where(sd >= 0, sd, none).min()
    )  # a token of no document is left out of the minimum
    last = jnp.minimum(td.max(), sd.max()) + 1
    return first, jnp.maximum(first, last)


def _add_sink(m, l, acc, sink):
    """Fold each row's sink into its (m, l, acc) after the last key block, as one more
    block of one key whose value row is 0: a row with no key (l = 0) is left alone, and a
    NaN or +inf sink makes a row with a key NaN (SPEC §15.4)."""
    some = l > 0  # (pieces, B, K, G·Tc)
    sink = jnp.where(some, sink, -jnp.inf)  # (pieces, B, K, G·Tc)
    m_new = jnp.maximum(m, sink)  # (pieces, B, K, G·Tc)
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (pieces, B, K, G·Tc)
    alpha = jnp.exp(m - m_safe)  # (pieces, B, K, G·Tc)
    l = alpha * l + jnp.exp(sink - m_safe)  # (pieces, B, K, G·Tc)
    bad = jnp.isnan(sink) | (sink == jnp.inf)  # (pieces, B, K, G·Tc)
    acc = jnp.where(bad[..., None], jnp.nan, alpha[..., None] * acc)  # (pieces, B, K, G·Tc, E)
    return m_new, jnp.where(bad, jnp.nan, l), acc


def _sink_rows(sinks, shape, K: int, G: int):
    """Each row's sink logit in the pieces' grouped layout, ``shape`` = (pieces, B, K,
    G·Tc): row g·Tc + t of key/value head κ belongs to query head h = κ·G + g."""
    pieces, B, _, R = shape
    rows = sinks.reshape(1, 1, K, G, 1)  # (1, 1, K, G, 1)
    rows = jnp.broadcast_to(rows, (pieces, B, K, G, R // G))  # (pieces, B, K, G, Tc)
    return rows.reshape(shape)  # (pieces, B, K, G·Tc)


def _grouped_slopes(slopes, K: int, G: int):
    """ALiBi's slopes (B, H) in the grouped layout of the score blocks, (B, K, G, 1, 1)."""
    return slopes.reshape(slopes.shape[0], K, G, 1, 1)


def _alibi_bias(alibi, tp, sp, opts):
    """ALiBi's bias on one block, (B, K, G, Tc, Sc): −slope · |t + S − T − s|, t and s the
    tokens' global positions (which travel with them), so the layout and the padding do
    not change it; the distance is from the bottom-right diagonal whatever the alignment."""
    distance = jnp.abs(tp[:, None] + opts["S"] - opts["T"] - sp[None, :])  # (Tc, Sc)
    return -alibi * distance.astype(alibi.dtype)  # (B, K, G, Tc, Sc)


def _varying(*xs):
    # Values that differ from device to device are "varying" over the ring axis.
    return tuple(None if x is None else lax.pcast(x, AXIS, to="varying") for x in xs)


def _pass_on(xs, P: int) -> tuple:
    """Send each array to device i + 1 (mod P) and receive device i − 1's (None stays)."""
    ring = [(j, (j + 1) % P) for j in range(P)]
    return tuple(None if x is None else lax.ppermute(x, AXIS, ring) for x in xs)


def _pieces(x, K: int, pieces: int):
    """(B, H, Tl, F) -> (pieces, B, K, G·Tc, F): query pieces, rows grouped by kv head."""
    B, H, Tl, F = x.shape
    G, Tc = H // K, Tl // pieces
    x = x.reshape(B, K, G, pieces, Tc, F)  # (B, K, G, pieces, Tc, F)
    return jnp.moveaxis(x, 3, 0).reshape(pieces, B, K, G * Tc, F)


def _unpieces(x, H: int):
    """Undo ``_pieces``: (pieces, B, K, G·Tc, F) -> (B, H, Tl, F)."""
    pieces, B, K, _, F = x.shape
    G = H // K
    x = x.reshape(pieces, B, K, G, -1, F)  # (pieces, B, K, G, Tc, F)
    return jnp.moveaxis(x, 0, 3).reshape(B, H, -1, F)


def _key_piece(x, b, Sc: int):
    """Key piece b of a slice: (B, K, Sc, ·) of (B, K, Sl, ·), or (Sc,) of positions."""
    return lax.dynamic_slice_in_dim(x, b * Sc, Sc, axis=min(2, x.ndim - 1))


def _add_key_piece(x, update, b, Sc: int):
    """x with ``update`` added into key piece b (axis 2)."""
    return lax.dynamic_update_slice_in_dim(x, _key_piece(x, b, Sc) + update, b * Sc, axis=2)


def _allowed_keys(tp, sp, opts, docs=None):
    """(Tc, Sc): causality, the window, local-attention chunks, packed documents and
    padding, from the tokens' original positions (and documents: docs = (td (Tc,),
    sd (Sc,)), or None).

    Query t' = t + offset (its aligned diagonal) sees keys s with lo <= s - t' <= hi and,
    with chunks, ⌊t' / chunk⌋ == ⌊s / chunk⌋ (floor division: a query at a negative
    position lies in a chunk of no key). Padding (a key at position >= S, a query at
    >= T) attends and is attended by nothing, so that it cannot make a key look used; in
    a packed call padding is in no document, which the document test refuses.
    """
    t = tp[:, None] + opts["offset"]  # (Tc, 1)
    distance = sp[None, :] - t  # (Tc, Sc)
    padding = (tp < opts["T"])[:, None] & (sp < opts["S"])[None, :]  # (Tc, Sc)
    allowed = padding & (distance >= opts["lo"]) & (distance <= opts["hi"])  # (Tc, Sc)
    if "chunk" in opts:
        allowed = allowed & (t // opts["chunk"] == sp[None, :] // opts["chunk"])  # (Tc, Sc)
    if docs is not None:
        # Packed documents: a query sees only its own document's keys (the positions are
        # then places in the documents); a token of no document (-1) sees nothing.
        td, sd = docs
        same = (td[:, None] == sd[None, :]) & (td >= 0)[:, None]  # (Tc, Sc)
        allowed = allowed & same  # (Tc, Sc)
    return allowed


def _mask_block(mask, a, b, src, Tc: int, Sc: int, Sl: int):
    """This device's mask for query piece a and key piece b of device src's slice."""
    if mask is None:
        return None
    mb = mask
    if mb.shape[2] != 1:
        mb = lax.dynamic_slice_in_dim(mb, a * Tc, Tc, axis=2)
    if mb.shape[3] != 1:
        mb = lax.dynamic_slice_in_dim(mb, src * Sl + b * Sc, Sc, axis=3)
    return mb  # (B|1, H|1, Tc|1, Sc|1)


def _visible(tp, sp, mb, opts, K: int, G: int, docs=None):
    """(allowed, used, mb) for one block: which keys each query may see, (Tc, Sc) or
    (B|1, K|1, G|1, Tc, Sc) with a mask (a bool mask's False and a float mask's -inf
    block); which keys any of them sees, (Sc,) or (B|1, K|1, Sc); and the mask grouped
    by key/value head (or None). docs: as for ``_allowed_keys``."""
    allowed = _allowed_keys(tp, sp, opts, docs)  # (Tc, Sc)
    if mb is not None:
        mb = _grouped(mb, K, G)  # (B|1, K|1, G|1, Tc|1, Sc|1)
        allowed = allowed & (mb if mb.dtype == jnp.bool_ else mb != -jnp.inf)
    used = allowed.any(axis=-2) if allowed.ndim == 2 else allowed.any(axis=(-3, -2))
    return allowed, used, mb


def _add_mask_grad(dm, dz, a, b, src, Sl: int):
    """dm (the mask's shape) with one block's dZ (B, K, G, Tc, Sc) added where that block
    read the mask: summed over every axis the mask broadcasts along."""
    mb, mh, mt, ms = dm.shape
    B, K, G, Tc, Sc = dz.shape
    sums = (0,) * (mb == 1) + (1, 2) * (mh == 1) + (3,) * (mt == 1) + (4,) * (ms == 1)
    dz = dz.sum(axis=sums, keepdims=True).reshape(
        mb, mh, Tc if mt != 1 else 1, Sc if ms != 1 else 1
    )
    start = (0, 0, a * Tc if mt != 1 else 0, src * Sl + b * Sc if ms != 1 else 0)
    start = tuple(jnp.asarray(i, dtype=jnp.int32) for i in start)  # one index type
    old = lax.dynamic_slice(dm, start, dz.shape)
    return lax.dynamic_update_slice(dm, old + dz, start)


def _specs(mask_spec, sinks_on: bool, alibi_on: bool, packed_on: bool):
    seq = PS(None, None, AXIS, None)
    sinks, slopes = (PS() if on else None for on in (sinks_on, alibi_on))  # replicated
    docs = PS(AXIS) if packed_on else None  # with the tokens, as their positions
    return (seq, seq, seq, PS(AXIS), PS(AXIS), docs, docs, mask_spec, sinks, slopes, PS())


@functools.lru_cache(maxsize=64)
def _ring_fn(mesh, mask_spec, sinks_on, alibi_on, packed_on, **static):
    body = functools.partial(_ring_body, P=mesh.size, **static)
    in_specs = _specs(mask_spec, sinks_on, alibi_on, packed_on)
    ring = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=PS(None, None, AXIS, None))
    return jax.jit(ring)


@functools.lru_cache(maxsize=64)
def _ring_vjp_fn(mesh, float_mask, mask_spec, sinks_on, alibi_on, packed_on, **static):
    body = functools.partial(_ring_backward, P=mesh.size, float_mask=float_mask, **static)
    seq = PS(None, None, AXIS, None)
    grads = (seq, seq, seq) + ((mask_spec or PS(),) if float_mask else ())
    grads += (PS(),) if sinks_on else ()  # dsinks, summed over the devices
    in_specs = (*_specs(mask_spec, sinks_on, alibi_on, packed_on), seq)
    ring = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=grads)
    return jax.jit(ring)


# ----------------------------------------------------------------------------------------
# The host side: validate, lay out (pad, permute), shard; gather and undo the layout.


class _Run:
    """Checked, batched inputs and options."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _prepare(q, k, v, mask, d_out=None, **options) -> _Run:
    """Step 0: the input contract every impl shares (contract.py), on the host arrays."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    d_out = None if d_out is None else np.asarray(d_out)
    why = "ring attention here has no dropout"
    if d_out is not None:
        why = "the backward pass would need the forward's random draw"
    sinks, slopes = (options.pop(n) for n in ("sinks", "alibi_slopes"))
    sinks = None if sinks is None else np.asarray(sinks)
    slopes = None if slopes is None else np.asarray(slopes)
    call = contract.check(
        q, k, v, mask=mask, **options, unsupported={"dropout_p": why}, d_out=d_out,
        sinks=sinks, alibi_slopes=slopes,
    )  # fmt: skip
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
        d_out = None if d_out is None else d_out[None]  # (1, H, T, E)
    # Sinks and slopes in the working precision (exact there); slopes (H,) as (B, H), so
    # that one compiled program serves both forms.
    work = np.float64 if q.dtype == np.float64 else np.float32
    if slopes is not None:
        slopes = np.broadcast_to(slopes.astype(work).reshape(-1, call.H), (call.B, call.H))
    return _Run(
        sinks=None if sinks is None else sinks.astype(work),  # (H,)
        slopes=slopes,  # (B, H)
        q=q,
        k=k,
        v=v,
        d_out=d_out,
        mask=None if mask is None else mask.reshape(call.mask_shape),  # (B|1, H|1, T|1, S|1)
        mask_shape=None if mask is None else mask.shape,
        unbatched=call.unbatched,
        T=call.T,
        S=call.S,
        scale=call.scale,
        is_causal=call.is_causal,
        offset=0 if call.causal_alignment == "top_left" else call.S - call.T,
        window=call.window,
        softcap=call.softcap,
        chunk=call.chunk_size,
        docs=None,
    )


def _prepare_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out=None, **options) -> _Run:
    """Step 0 of a packed call: the input contract (contract.py), then the documents as
    one sequence of B = 1, each token with its document and its place in it."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    d_out = None if d_out is None else np.asarray(d_out)
    call, cu_q, cu_k = contract.check_packed(q, k, v, cu_q, cu_k, d_out=d_out, **options)
    cu_q, cu_k = np.array(cu_q), np.array(cu_k)  # (N + 1,) each, checked
    T_n, S_n = np.diff(cu_q), np.diff(cu_k)  # (N,) each
    doc_q = np.repeat(np.arange(len(T_n)), T_n)  # (T,): each query's document
    doc_k = np.repeat(np.arange(len(S_n)), S_n)  # (S,)
    # Places in the documents: causality and the window are counted within each one, and
    # bottom-right alignment puts document n's diagonal at S_n - T_n, so it is folded
    # into the query's place (the ring's offset is then 0).
    place_q = np.arange(call.T) - cu_q[doc_q]  # (T,)
    if call.causal_alignment == "bottom_right":
        place_q = place_q + (S_n - T_n)[doc_q]  # (T,)
    place_k = np.arange(call.S) - cu_k[doc_k]  # (S,)
    return _Run(
        sinks=None,
        slopes=None,
        q=q[None],  # (1, H, T, D)
        k=k[None],  # (1, K, S, D)
        v=v[None],  # (1, K, S, E)
        d_out=None if d_out is None else d_out[None],  # (1, H, T, E)
        mask=None,
        mask_shape=None,
        unbatched=True,
        T=call.T,
        S=call.S,
        scale=call.scale,
        is_causal=call.is_causal,
        offset=0,
        window=call.window,
        softcap=call.softcap,
        chunk=None,
        docs=(doc_q, place_q, doc_k, place_k),
    )


def host_devices(P: int) -> list:
    """P devices for the ring; on a CPU-only machine, make 8 (or P) host devices visible.

    ``jax_num_cpu_devices`` takes effect only before JAX's first computation; after it,
    the devices are what they are, and too few is an error that says so.
    """
    try:
        jax.config.update("jax_num_cpu_devices", max(8, P))
    except RuntimeError:
        pass  # JAX has started: its devices are fixed
    devices = jax.devices()
    if len(devices) < P:
        raise RuntimeError(
            f"the ring needs P={P} devices but JAX sees {len(devices)} ({devices[0].platform}); "
            f"on a CPU, call jax.config.update('jax_num_cpu_devices', {max(8, P)}) (or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={max(8, P)}) before JAX's first "
            f"computation in this process"
        )
    return devices[:P]


class _Ring:
    """The mesh and the layout: which original position sits in which slot of which device."""

    def __init__(self, run: _Run, shards: int | None, layout: str):
        if layout not in LAYOUTS:
            raise ValueError(f"layout should be one of {LAYOUTS}, got {layout!r}")
        if shards is None:
            shards = len(jax.devices())
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards should be a positive int (P devices), got {shards!r}")
        P = shards
        self.mesh = Mesh(np.array(host_devices(P)), (AXIS,))
        self.P, self.layout = P, layout
        self.pieces = 2 if layout == "zigzag" else 1
        # perm[slot] = original position (>= n: padding); slots are device-major.
        self.perm = {"t": self._perm(run.T), "s": self._perm(run.S)}
        mask = run.mask
        self.mask_spec = None if mask is None or mask.shape[2] == 1 else PS(None, None, AXIS, None)
        self.static = dict(
            mask_spec=self.mask_spec,
            pieces=self.pieces,
            softcap_on=run.softcap is not None,
            sinks_on=run.sinks is not None,
            alibi_on=run.slopes is not None,
            packed_on=run.docs is not None,
        )
        # The scalar options travel as data, so that one compilation serves them all.
        left, right = run.window if run.window is not None else (None, None)
        hi = _FAR if right is None else right
        self.opts = dict(
            scale=np.float64(run.scale),
            softcap=np.float64(run.softcap or 1.0),
            offset=np.int32(run.offset),
            lo=np.int32(-_FAR if left is None else -left),
            hi=np.int32(min(hi, 0) if run.is_causal else hi),
            T=np.int32(run.T),
            S=np.int32(run.S),
        )
        if run.docs is not None:
            # Packed: the positions are places in the documents, which may pass T; the
            # padding is in no document instead, and the document test refuses it.
            self.opts.update(T=np.int32(_FAR), S=np.int32(_FAR))
        if run.chunk is not None:
            # Only with chunks: a call without them compiles no chunk test at all. One
            # chunk wider than every position holds them all.
            self.opts["chunk"] = np.int32(min(run.chunk, _FAR))

    def _perm(self, n: int) -> np.ndarray:
        chunks = self.P * self.pieces  # P slices, or 2P zigzag chunks
        c = -(-max(1, n) // chunks)  # chunk length: n padded up to whole chunks
        c = -(-c // ROWS) * ROWS  # ... of whole multiples of ROWS
        if self.layout == "contiguous":
            return np.arange(chunks * c)  # (Np,)
        order = [i for d in range(self.P) for i in (d, 2 * self.P - 1 - d)]
        return np.concatenate([np.arange(i * c, (i + 1) * c) for i in order])  # (Np,)

    def permute(self, x: np.ndarray, *, axis: int, n: int, seq: str) -> np.ndarray:
        """Pad axis (length n) to Np and put it in the layout's order."""
        perm = self.perm[seq]
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, len(perm) - n)
        return np.take(np.pad(x, pad), perm, axis=axis)

    def unpermute(self, x: np.ndarray, *, axis: int, n: int, seq: str = "t") -> np.ndarray:
        """Undo ``permute``: back to the original order, padding cut off."""
        perm = self.perm[seq]
        out = np.empty_like(x)
        idx = [slice(None)] * x.ndim
        idx[axis] = perm
        out[tuple(idx)] = x
        return np.take(out, np.arange(n), axis=axis)

    def shard(self, x: np.ndarray, spec) -> jax.Array:
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    def tokens(self, run) -> tuple:
        """Each slot's position, (Tp,) and (Sp,): its original one, or for a packed
        call its place in its document; and its document, (Tp,) and (Sp,), -1 for
        padding (None unless packed). Host int32 arrays, in slot order."""
        if run.docs is None:
            return self.perm["t"].astype(np.int32), self.perm["s"].astype(np.int32), None, None
        doc_q, place_q, doc_k, place_k = run.docs
        tdoc = self.permute(doc_q + 1, axis=0, n=run.T, seq="t") - 1  # (Tp,): pads 0 - 1
        sdoc = self.permute(doc_k + 1, axis=0, n=run.S, seq="s") - 1  # (Sp,)
        tpos = self.permute(place_q, axis=0, n=run.T, seq="t")  # (Tp,)
        spos = self.permute(place_k, axis=0, n=run.S, seq="s")  # (Sp,)
        return tuple(x.astype(np.int32) for x in (tpos, spos, tdoc, sdoc))

    def put(self, run: _Run) -> tuple:
        seq = PS(None, None, AXIS, None)
        q = self.shard(self.permute(run.q, axis=2, n=run.T, seq="t"), seq)  # (B, H, Tp, D)
        k = self.shard(self.permute(run.k, axis=2, n=run.S, seq="s"), seq)  # (B, K, Sp, D)
        v = self.shard(self.permute(run.v, axis=2, n=run.S, seq="s"), seq)  # (B, K, Sp, E)
        # Positions and documents travel with their tokens: sharded like them.
        tpos, spos, tdoc, sdoc = (
            None if x is None else self.shard(x, PS(AXIS)) for x in self.tokens(run)
        )  # (Tp,), (Sp,), (Tp,) or None, (Sp,) or None
        mask = run.mask
        if mask is not None:
            if mask.shape[2] != 1:
                mask = self.permute(mask, axis=2, n=run.T, seq="t")
            if mask.shape[3] != 1:
                mask = self.permute(mask, axis=3, n=run.S, seq="s")
            mask = self.shard(mask, self.mask_spec or PS())  # (B|1, H|1, Tp|1, Sp|1)
        # Sinks (H,) and slopes (B, H) are replicated: every device holds rows of every head.
        sinks = None if run.sinks is None else self.shard(run.sinks, PS())  # (H,)
        slopes = None if run.slopes is None else self.shard(run.slopes, PS())  # (B, H)
        opts = {n: self.shard(x, PS()) for n, x in self.opts.items()}
        return q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts


def _grouped(x, K: int, G: int):
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)
    return x.reshape(b, K, G, t, s)
