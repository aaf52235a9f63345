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

Why the merge is exact. Each device attends each key block as it arrives on its own:
the block's partial state is its rows' largest score m_b, their sum l_b = Σ exp(x_s − m_b)
and their output o_b over its keys. ``merge.py``'s ``merge_partials`` (SPEC §22) merges
it into the rows' state (o, m, l): m = max(m, m_b), each piece's sum moved onto it,
w = exp(m_piece − m) · l_piece, o the outputs weighted by w / Σ w. exp(x − m_b) ·
exp(m_b − m) = exp(x − m) is an identity, so after the last block l = Σ_s exp(x_s − m) and
o the softmax-weighted sum with m the true row max, in any block order: only rounding
differs from the reference. Nothing is exponentiated above 0, so a row's maximum on another
device than most of its mass cannot overflow (log(exp(a) + exp(b)) would, EasyContext
#14). The state is m and l, not the lse = m + log l: an lse rounded to float32 near 1e4
is off by 4.9e-4, and so would be every later weight of it (``merge.py``, the second step).

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
whole chunks), and a chunk's length up to a bucket: 8 rows times a power of two (past
16 times, a multiple of 4 times). XLA compiles one program per shape, and compiling
costs far more than running at the lengths tests and short prompts use, so one program
serves every length of a bucket, its true T and S travelling as data. Padded keys carry
position S or more and are blocked like any blocked key, so they are never attended;
padded queries are computed and cut off. A query whose keys
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
``flash.py`` folds it in after its last key block. Folded in at every step (or on every
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

The pages: this one holds the calls, the per-device forward and backward and the ring
itself (``walk``, its one collective ``lax.ppermute``); ``ring_blocks.py`` one block, a
query piece against the key piece at hand, written as for one device; ``ring_layout.py``
the host side (validate, pad, permute, shard, and back), which ``ulysses.py`` shares.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as PS

from .merge import union_lse
from .ring_blocks import (
    QueryGradients,
    QueryPieces,
    add_sink,
    allowed_keys,
    key_piece,
    mask_block,
    sink_rows,
    unpieces,
    working_dtype,
)
from .ring_layout import AXIS, LAYOUTS, Ring, host_devices, prepare, prepare_packed

__all__ = [
    "LAYOUTS",
    "attention",
    "attention_packed",
    "attention_packed_vjp",
    "attention_vjp",
    "host_devices",
]


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
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
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
      return_lse: also return each row's natural log-sum-exp (SPEC §21), the merged
        state's m + log l.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input, as a NumPy array in q's dtype;
      with ``return_lse``, (out, lse), lse (B, H, T) or (H, T) in float64 for float64
      inputs and float32 otherwise.
    """
    # 0. Validate, and lay the sequence out over the devices (pad, permute, shard).
    run = prepare(
        q, k, v, mask, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    return run_forward(run, shards, layout, return_lse)  # (B, H, T, E) or (H, T, E)


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
    run = prepare(
        q, k, v, mask, d_out, is_causal=is_causal, scale=scale, causal_alignment=causal_alignment,
        window=window, softcap=softcap, dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )  # fmt: skip
    return run_backward(run, shards, layout)


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
    run = prepare_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap,
    )  # fmt: skip
    return run_forward(run, shards, layout)  # (H, T, E)


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
    run = prepare_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap,
    )  # fmt: skip
    return run_backward(run, shards, layout)


def run_forward(run, shards: int | None, layout: str, return_lse: bool = False):
    """Lay the checked inputs out over the devices, run the forward ring, gather: out,
    or (out, lse) with ``return_lse``."""
    ring = Ring(run, shards, layout)
    if not return_lse:
        out = ring_fn(ring.mesh, **ring.static)(*ring.put(run))  # (B, H, Tp, E), sharded
        out = ring.unpermute(np.asarray(out), axis=2, n=run.T)  # (B, H, T, E)
        return out[0] if run.unbatched else out
    out, lse = ring_lse_fn(ring.mesh, **ring.static)(*ring.put(run))  # sharded along Tp
    out = ring.unpermute(np.asarray(out), axis=2, n=run.T)  # (B, H, T, E)
    lse = ring.unpermute(np.asarray(lse)[..., None], axis=2, n=run.T)[..., 0]  # (B, H, T)
    return (out[0], lse[0]) if run.unbatched else (out, lse)


def run_backward(run, shards: int | None, layout: str) -> tuple[np.ndarray, ...]:
    """Lay the checked inputs and d_out out, run the backward ring, gather the gradients."""
    ring = Ring(run, shards, layout)
    float_mask = run.mask is not None and run.mask.dtype != np.bool_
    fn = ring_vjp_fn(ring.mesh, float_mask, **ring.static)
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


def ring_body(
    q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, *, P, pieces, softcap_on, huge_scale
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
    out, _ = ring_forward(
        q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts,
        P=P, pieces=pieces, softcap_on=softcap_on, huge_scale=huge_scale,
    )  # fmt: skip
    return out.astype(q.dtype)


def ring_body_lse(q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, **static):
    """``ring_body`` with each row's log-sum-exp beside the output: (out (B, H, Tl, E) in
    q's dtype, lse (B, H, Tl) in the working dtype, SPEC §21)."""
    out, lse = ring_forward(q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, **static)
    return out.astype(q.dtype), lse


def ring_forward(
    q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, *, P, pieces, softcap_on,
    huge_scale,
):  # fmt: skip
    """The forward ring, in the working dtype: (out (B, H, Tl, E), lse (B, H, Tl)), with
    lse = -inf for a row that sees no key; the sink, if any, is in lse."""
    B, H, Tl, _ = q.shape
    K, E = k.shape[1], v.shape[-1]
    G, Tc = H // K, Tl // pieces
    flags = dict(softcap_on=softcap_on, huge_scale=huge_scale)
    here = QueryPieces(q, tpos, tdoc, slopes, opts, K=K, pieces=pieces, **flags)
    work = here.work

    # One (m, l, o) per query piece, stacked on a leading axis: the rows' state, merged
    # with each block's (merge.py's merge_partials); they differ from device to device
    # ("varying" over the ring axis). Nothing travels with the key/value slices.
    stay = varying(
        jnp.full((pieces, B, K, G * Tc), -jnp.inf, dtype=work),  # m: the row max so far
        jnp.zeros((pieces, B, K, G * Tc), dtype=work),  # l: the row sum against m
        jnp.zeros((pieces, B, K, G * Tc, E), dtype=work),  # o: the output so far
    )
    kv = (k, v, spos, sdoc)
    (m, l, out), _ = walk(
        here.update, stay, (), kv, mask, here.tps, here.tds, opts, P=P, pieces=pieces
    )
    if sinks is not None:
        # The sink joins each row's softmax once, now that every key block has been merged
        # (once per step or per device, it would count P times).
        m, l, out = add_sink(m, l, out, sink_rows(sinks.astype(work), m.shape, K, G))

    # A row that saw no key has l = 0 and o = 0; its lse is -inf.
    lse = union_lse(m, l)  # (pieces, B, K, G·Tc)
    # A row that read a +inf score (q·k overflowed) has l = +inf or NaN: its lse is NaN, so
    # that in the backward every weight of it is NaN, as its output is (SPEC §4.1).
    lse = jnp.where(jnp.isnan(l) | (l == jnp.inf), jnp.nan, lse)  # (pieces, B, K, G·Tc)
    return unpieces(out, H), unpieces(lse[..., None], H)[..., 0]  # (B, H, Tl, E), (B, H, Tl)


def ring_backward(
    q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, d_out,
    *, P, pieces, softcap_on, huge_scale, float_mask,
):  # fmt: skip
    """One device's share of the backward: (dq, dk, dv), then dmask with a float mask and
    dsinks (H,) with sinks, summed over the devices.

    The arguments are ``ring_body``'s and d_out (B, H, Tl, E), this device's rows of
    ∂L/∂out. The forward ring runs again for each row's log-sum-exp, then a second ring
    recomputes every block's weights from it (FlashAttention's backward): dq stays with
    its queries, while dk and dv travel round the ring with their key/value slice and
    make one hop more, home. dq (B, H, Tl, D) is this device's rows; dk (B, K, Sl, D) and
    dv (B, K, Sl, E) its own slice's, summed over every device's queries; dmask has the
    mask's shape (its T axis sharded with the queries, or summed over the devices).
    """
    out, lse = ring_forward(
        q, k, v, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts,
        P=P, pieces=pieces, softcap_on=softcap_on, huge_scale=huge_scale,
    )  # fmt: skip
    B, H, Tl, D = q.shape
    K, Sl = k.shape[1], k.shape[2]
    G, Tc = H // K, Tl // pieces
    work = working_dtype(q.dtype)
    d_out = d_out.astype(work)  # (B, H, Tl, E)

    # 5'. The softmax's row term, rowsum(dO ⊙ O): one dot product per row.
    delta = (d_out * out).sum(axis=-1)  # (B, H, Tl)
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
    here = QueryGradients(
        q, tpos, tdoc, slopes, opts, d_out, delta, lse,
        float_mask=float_mask, Sl=Sl, K=K, pieces=pieces, softcap_on=softcap_on,
        huge_scale=huge_scale,
    )  # fmt: skip

    # dq and dmask stay on this device; dk and dv travel with the key/value slice.
    stay = varying(
        jnp.zeros((pieces, B, K, G * Tc, D), dtype=work),  # dq, by query piece
        jnp.zeros(mask.shape, dtype=work) if float_mask else None,  # dmask, mask-shaped
    )
    travelling = varying(jnp.zeros(k.shape, dtype=work), jnp.zeros(v.shape, dtype=work))
    kv = (k, v, spos, sdoc)
    (dq, dm), (dk, dv) = walk(
        here.block, stay, travelling, kv, mask, here.tps, here.tds, opts, P=P, pieces=pieces
    )
    dq = unpieces(dq * here.scale, H)  # (B, H, Tl, D)
    out = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    if float_mask:
        if mask.shape[2] == 1:
            dm = lax.psum(dm, AXIS)  # a mask without a T axis: every device's rows add up
        out += (dm.astype(mask.dtype),)
    if ds is not None:
        out += (ds.astype(q.dtype),)  # (H,), the same on every device
    return out


def walk(block, stay, travelling, kv, mask, tps, tds, opts, *, P: int, pieces: int):
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
            kb, vb, sp, sd = (None if x is None else key_piece(x, b, Sc) for x in kv)
            mb = mask_block(mask, a, b, src, Tc, Sc, Sl)  # (B|1, H|1, Tc|1, Sc|1)
            # Skip a block no query of this piece may see (above the causal diagonal,
            # outside the window, in no shared document, or all padding): this is the
            # causal saving, and the source of the contiguous layout's imbalance.
            docs = None if sd is None else (tds[a], sd)
            visible = jnp.any(allowed_keys(tps[a], sp, opts, docs))
            return lax.cond(visible, block, _skip, state, a, b, src, kb, vb, sp, sd, mb)

        return lax.fori_loop(0, pieces * pieces, piece_pair, state)

    def step_and_pass(i, loop):
        state, kv = loop
        stay, travelling = step(i, state, kv)
        # Pass the slice on, with its positions and what travels with it: device i sends
        # to i + 1.
        moved = pass_on((*kv, *travelling), P)
        return (stay, moved[len(kv) :]), moved[: len(kv)]

    # Steps 0 .. P-2 compute and pass the slice on; the last step only computes, so each
    # slice makes P - 1 hops.
    state, kv = lax.fori_loop(0, P - 1, step_and_pass, ((stay, travelling), kv))
    stay, travelling = step(P - 1, state, kv)
    if travelling and P > 1:
        travelling = pass_on(travelling, P)  # one more hop: home
    return stay, travelling


def varying(*xs):
    # Values that differ from device to device are "varying" over the ring axis.
    return tuple(None if x is None else lax.pcast(x, AXIS, to="varying") for x in xs)


def pass_on(xs, P: int) -> tuple:
    """Send each array to device i + 1 (mod P) and receive device i − 1's (None stays)."""
    ring = [(j, (j + 1) % P) for j in range(P)]
    return tuple(None if x is None else lax.ppermute(x, AXIS, ring) for x in xs)


def _skip(carry, *_):
    return carry  # a block no query may see changes nothing


def _specs(mask_spec, sinks_on: bool, alibi_on: bool, packed_on: bool):
    seq = PS(None, None, AXIS, None)
    sinks, slopes = (PS() if on else None for on in (sinks_on, alibi_on))  # replicated
    docs = PS(AXIS) if packed_on else None  # with the tokens, as their positions
    return (seq, seq, seq, PS(AXIS), PS(AXIS), docs, docs, mask_spec, sinks, slopes, PS())


@functools.lru_cache(maxsize=64)
def ring_fn(mesh, mask_spec, sinks_on, alibi_on, packed_on, **static):
    body = functools.partial(ring_body, P=mesh.size, **static)
    in_specs = _specs(mask_spec, sinks_on, alibi_on, packed_on)
    ring = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=PS(None, None, AXIS, None))
    return jax.jit(ring)


@functools.lru_cache(maxsize=64)
def ring_lse_fn(mesh, mask_spec, sinks_on, alibi_on, packed_on, **static):
    body = functools.partial(ring_body_lse, P=mesh.size, **static)
    in_specs = _specs(mask_spec, sinks_on, alibi_on, packed_on)
    out_specs = (PS(None, None, AXIS, None), PS(None, None, AXIS))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@functools.lru_cache(maxsize=64)
def ring_vjp_fn(mesh, float_mask, mask_spec, sinks_on, alibi_on, packed_on, **static):
    body = functools.partial(ring_backward, P=mesh.size, float_mask=float_mask, **static)
    seq = PS(None, None, AXIS, None)
    grads = (seq, seq, seq) + ((mask_spec or PS(),) if float_mask else ())
    grads += (PS(),) if sinks_on else ()  # dsinks, summed over the devices
    in_specs = (*_specs(mask_spec, sinks_on, alibi_on, packed_on), seq)
    ring = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=grads)
    return jax.jit(ring)
