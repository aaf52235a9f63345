"""DeepSpeed-Ulysses attention in JAX: an all-to-all trades sequence shards for head shards.

Ring attention (``ring.py``) keeps the sequence split and moves key/value blocks round.
Ulysses (Jacobs et al. 2023) moves the data once instead: every device starts with a slice
of the sequence for all heads, one ``lax.all_to_all`` gives each device the whole sequence
for H/P of the heads, each device runs ordinary attention on its heads, and a second
all-to-all hands the outputs back as sequence slices. Heads never interact, so the middle
step is exactly single-device attention: no merge, nothing to get wrong in it.

The two all-to-alls, P = 4, H = 4 heads (h0 … h3), sequence slices s0 … s3:

    before (sequence-sharded)          after all_to_all (head-sharded)
    device 0: s0 of h0 h1 h2 h3        device 0: s0 s1 s2 s3 of h0
    device 1: s1 of h0 h1 h2 h3   ->   device 1: s0 s1 s2 s3 of h1
    device 2: s2 of h0 h1 h2 h3        device 2: s0 s1 s2 s3 of h2
    device 3: s3 of h0 h1 h2 h3        device 3: s0 s1 s2 s3 of h3

    device d sends the d'-th group of its heads to device d' and receives every
    device's slice of its own group; the output goes back the same way.

Each device sends (P − 1)/P of its q, k, v and output slices per pass, whatever P: the
communication per device falls as 1/P, where the ring's stays the size of all keys and
values. Why it is exact: attention is independent per head, and the all-to-all only moves
numbers. Where causal imbalance comes from: nowhere — every device holds every query of
its heads, so each does the same causal triangle.

Which heads. ``lax.all_to_all`` splits an axis into P equal parts, so the head axis is
padded to Hp = P·⌈H/P⌉ with dummy query heads: device d gets query heads
[d·Hl, (d+1)·Hl) (Hl = Hp/P), the last ones dummies when P does not divide H (H = 7 on
P = 4: 2 + 2 + 2 + 1 real heads). A dummy head is inert: it may see no key, so its
weights, output and gradients are exactly 0, and its output rows are cut off. DeepSpeed
splits uneven heads the same way in effect (its all-to-all takes uneven splits, PR #6392);
here the padding stands in for the uneven split, which ``lax.all_to_all`` lacks.
Key/value heads follow the query heads: query head h uses key/value head h // G
(G = H // K), so device d needs the key/value heads of its query heads, Kl slots of them
(the most any device needs; a device that needs fewer repeats one). Each key/value head
is sent to every device that needs it, repeated before the all-to-all, and the gradient
of a repeated head is the sum over its copies. With K % P == 0 and H % P == 0 that is
K/P heads per device, no copy; with K < P (multi-query attention) each device gets the
one head its query heads share; any other H and K work too (K = 3 on P = 2: heads
0 and 1 on device 0, 1 and 2 on device 1).

Masks. A mask with an H axis is sharded along the heads, one without is replicated: each
device holds Hl × T × S (or T × S) of it (a dummy head's rows are padding), since it attends the whole sequence.
Sinks and ALiBi are per query head, so they are sharded with the heads too: device d takes
the sinks (H,) and slopes (H,) or (B, H) of its Hl query heads (a dummy head's are 0 and
never count), runs them as single-device attention does, and dsinks comes back gathered
in head order. ALiBi's distance |t + S − T − s| is taken on the tokens' original
positions, which every device holds for the whole sequence.
Lengths P does not divide are padded to whole slices; padded keys are never attended and
padded queries are cut off. The ``layout`` option (contiguous or zigzag) permutes the
sequence as ``ring.py`` does; the result is the same either way.

Packed documents. ``attention_packed`` (SPEC §18) lays the packed tokens out as one
sequence (B = 1), as ``ring.py`` does, each token with its document and its place in it
(bottom-right alignment folded into the query's place), which every device holds for the
whole sequence. After the all-to-all the whole sequence is local, so the document is one
more test in the local step: a key is allowed only if its document is the query's, and
causality and the window are counted on the places. The local step then runs once per
document (a loop of N passes, N the documents in the call), on that document's queries,
every other row kept from its own pass: a row of another document has weights 0, but
0 · NaN is NaN, so a NaN in one document would otherwise reach the others through the
products (and, by ``jax.vjp``, their gradients).

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       P devices (shards)
    Tl, Sl: the per-device slice lengths; Hp = P·⌈H/P⌉ the padded head count,
    Hl = Hp / P query heads and Kl key/value head slots per device

Supports what ``ring.py`` does (masks, both causal alignments, windows, softcap, GQA,
attention sinks, chunked local attention, ALiBi, packed documents, every dtype, unbatched
inputs, gradients by ``jax.vjp``, dsinks included), batch > 1; not dropout. The host
side (validation, the sequence's layout, the mesh) is ``ring_layout.py``'s, shared with
the ring, and so are the visibility and the softcap of ``ring_blocks.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as PS

from .ring_blocks import allowed_keys, scale_split, softcapped, working_dtype
from .ring_layout import AXIS, LAYOUTS, Ring, host_devices, prepare, prepare_packed

SEQ = PS(None, None, AXIS, None)  # sharded along the sequence


def head_split(H: int, K: int, P: int) -> tuple[np.ndarray, np.ndarray]:
    """Which heads go where: (kv_index (P·Kl,), kv_slot (Hp,)).

    Device d gets query heads [d·Hl, (d+1)·Hl) of the Hp = P·⌈H/P⌉ padded ones and the Kl
    key/value head slots kv_index[d·Kl : (d+1)·Kl] (original head numbers; a device that
    needs fewer than Kl repeats its first). kv_slot[h] is the slot, on its device, of query
    head h's key/value head, and -1 for a dummy head (h >= H).
    """
    G = H // K
    Hl = -(-H // P)  # query heads per device, the last devices' padded with dummies
    needed = [sorted({h // G for h in range(d * Hl, min((d + 1) * Hl, H))}) for d in range(P)]
    Kl = max(len(n) for n in needed)
    needed = [n + [n[0] if n else 0] * (Kl - len(n)) for n in needed]
    kv_index = np.array(needed, dtype=np.int64).reshape(P * Kl)  # (P·Kl,)
    kv_slot = np.array(
        [needed[h // Hl].index(h // G) if h < H else -1 for h in range(P * Hl)], dtype=np.int32
    )  # (Hp,)
    return kv_index, kv_slot


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
    layout: str = "contiguous",
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention over P devices by two all-to-alls (args as ring.py's);
    with ``return_lse``, (out, lse), each row's log-sum-exp taken on the device that holds
    its head and sent back as the output is."""
    return _run(q, k, v, None, mask, shards, layout, is_causal=is_causal, scale=scale,
                causal_alignment=causal_alignment, window=window, softcap=softcap,
                dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
                alibi_slopes=alibi_slopes, return_lse=return_lse)  # fmt: skip


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
    layout: str = "contiguous",
) -> tuple[np.ndarray, ...]:
    """Gradients by ``jax.vjp`` through both all-to-alls: (dq, dk, dv, then dmask and dsinks where given)."""
    return _run(q, k, v, d_out, mask, shards, layout, is_causal=is_causal, scale=scale,
                causal_alignment=causal_alignment, window=window, softcap=softcap,
                dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size,
                alibi_slopes=alibi_slopes)  # fmt: skip


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
    layout: str = "contiguous",
) -> np.ndarray:
    """Packed variable-length sequences (args as ring.attention_packed): out (H, T, E)."""
    return _run(q, k, v, None, None, shards, layout, is_causal=is_causal, scale=scale,
                causal_alignment=causal_alignment, window=window, softcap=softcap,
                packed=(cu_seqlens_q, cu_seqlens_k))  # fmt: skip


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
    layout: str = "contiguous",
) -> tuple[np.ndarray, ...]:
    """Gradients of ``attention_packed`` by ``jax.vjp``: (dq, dk, dv) shaped like q, k, v."""
    return _run(q, k, v, d_out, None, shards, layout, is_causal=is_causal, scale=scale,
                causal_alignment=causal_alignment, window=window, softcap=softcap,
                packed=(cu_seqlens_q, cu_seqlens_k))  # fmt: skip


def _run(q, k, v, d_out, mask, shards, layout, *, packed=None, return_lse=False, **options):
    # 0. Validate (the shared contract), then lay the heads and the sequence out and shard.
    if packed is None:
        run = prepare(q, k, v, mask, d_out, name="Ulysses attention", **options)
    else:
        # A packed call: its own contract (SPEC §18.1) first, and each token's document and
        # place in it (bottom-right alignment folded into the query's place); then it is an
        # unbatched call of one sequence.
        run = prepare_packed(q, k, v, *packed, d_out, **options)
    ring = Ring(run, shards, layout)  # the sequence layout and the mesh, as ring.py's
    heads = _Heads(run, ring)
    args, static = heads.place(run)
    static["documents"] = None if packed is None else np.asarray(packed[0]).size - 1  # N
    if run.d_out is None and return_lse:
        out, lse = _ulysses_fn(ring.mesh, **static, return_lse=True)(*args)
        return heads.output(out), heads.lse(lse)  # (B, H, T, E), (B, H, T) (or unbatched)
    if run.d_out is None:
        out = _ulysses_fn(ring.mesh, **static)(*args)  # (B, Hp, Tp, E)
        return heads.output(out)  # (B, H, T, E) or (H, T, E)
    float_mask = run.mask is not None and run.mask.dtype != np.bool_
    d_out = heads.pad(run.d_out.astype(heads.work))  # (B, Hp, T, E)
    d_out = ring.shard(ring.permute(d_out, axis=2, n=run.T, seq="t"), SEQ)  # (B, Hp, Tp, E)
    grads = _ulysses_vjp_fn(ring.mesh, float_mask, **static)(*args, d_out)
    return heads.gradients(grads, float_mask)


class _Heads:
    """The heads' layout over the devices (``head_split``): the query heads padded to Hp
    with dummies, each device's key/value head slots, and how the results come back. Low
    precision is computed in float32 (its values are exact there) and rounded once, after
    the copies of a repeated key/value head have had their gradients summed."""

    def __init__(self, run, ring: Ring):
        self.run, self.ring = run, ring
        self.H, self.K = run.q.shape[1], run.k.shape[1]
        self.dtype = run.q.dtype
        self.work = np.float64 if self.dtype == np.float64 else np.float32
        self.kv_index, self.kv_slot = head_split(self.H, self.K, ring.P)
        self.Hp = len(self.kv_slot)

    def pad(self, x, axis: int = 1):
        """x with the dummy query heads appended along ``axis`` (zeros)."""
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, self.Hp - self.H)
        return np.pad(x, pad)

    def place(self, run) -> tuple[list, dict]:
        """The shard_map's arguments, placed on the devices, and its static options."""
        ring, work, T, S = self.ring, self.work, run.T, run.S
        q = self.pad(run.q.astype(work))  # (B, Hp, T, D)
        k = np.take(run.k.astype(work), self.kv_index, axis=1)  # (B, P·Kl, S, D): the slots
        v = np.take(run.v.astype(work), self.kv_index, axis=1)  # (B, P·Kl, S, E)
        args = [
            ring.shard(ring.permute(q, axis=2, n=T, seq="t"), SEQ),  # (B, Hp, Tp, D)
            ring.shard(ring.permute(k, axis=2, n=S, seq="s"), SEQ),  # (B, P·Kl, Sp, D)
            ring.shard(ring.permute(v, axis=2, n=S, seq="s"), SEQ),  # (B, P·Kl, Sp, E)
            ring.shard(self.kv_slot, PS(AXIS)),  # (Hp,): sharded with the query heads
        ]
        # Positions (and packed documents) replicated: tiny, and each device attends the
        # whole sequence.
        tokens = ring.tokens(run)  # (Tp,), (Sp,), (Tp,) or None, (Sp,) or None
        args += [None if x is None else ring.shard(x, PS()) for x in tokens]
        m, mask_spec = run.mask, None
        if m is not None:
            if m.shape[1] != 1:
                m = self.pad(m)  # (B|1, Hp, T|1, S|1): a dummy head's rows never count
            if m.shape[2] != 1:
                m = ring.permute(m, axis=2, n=T, seq="t")
            if m.shape[3] != 1:
                m = ring.permute(m, axis=3, n=S, seq="s")
            mask_spec = PS(None, AXIS, None, None) if m.shape[1] != 1 else PS()
            m = ring.shard(m, mask_spec)  # (B|1, Hp|1, Tp|1, Sp|1): heads sharded
        # Sinks and slopes go with their query heads; a dummy head's are 0 and never count.
        sinks = None if run.sinks is None else ring.shard(self.pad(run.sinks, 0), PS(AXIS))
        slopes = None if run.slopes is None else ring.shard(self.pad(run.slopes), PS(None, AXIS))
        opts = {n: ring.shard(x, PS()) for n, x in ring.opts.items()}
        args += [m, sinks, slopes, opts]  # (Hp,) and (B, Hp) the sinks and slopes
        static = dict(
            mask_spec=mask_spec,
            softcap_on=run.softcap is not None,
            huge_scale=run.scale > 1,
            sinks_on=sinks is not None,
            alibi_on=slopes is not None,
        )
        return args, static

    def output(self, out):
        """The output gathered in the original order, the dummy heads and padding cut."""
        run = self.run
        out = self.ring.unpermute(np.asarray(out), axis=2, n=run.T, seq="t")[:, : self.H]
        out = out.astype(self.dtype)  # (B, H, T, E)
        return out[0] if run.unbatched else out

    def lse(self, lse):
        """The log-sum-exp (B, Hp, Tp) gathered as the output is, in the working dtype."""
        run = self.run
        lse = self.ring.unpermute(np.asarray(lse), axis=2, n=run.T, seq="t")[:, : self.H]
        return lse[0] if run.unbatched else lse  # (B, H, T) or (H, T)

    def gradients(self, grads, float_mask: bool) -> tuple:
        """(dq, dk, dv, then dmask and dsinks where given) gathered: the gradient of a key/value head is
        the sum over its copies on the devices."""
        run, ring, work, dtype = self.run, self.ring, self.work, self.dtype
        dq = ring.unpermute(np.asarray(grads[0]), axis=2, n=run.T, seq="t")[:, : self.H]
        dk_slots = ring.unpermute(np.asarray(grads[1]), axis=2, n=run.S, seq="s")
        dv_slots = ring.unpermute(np.asarray(grads[2]), axis=2, n=run.S, seq="s")
        dk = np.zeros((dk_slots.shape[0], self.K, *dk_slots.shape[2:]), work)  # (B, K, S, D)
        dv = np.zeros((dv_slots.shape[0], self.K, *dv_slots.shape[2:]), work)  # (B, K, S, E)
        np.add.at(dk, (slice(None), self.kv_index), dk_slots)
        np.add.at(dv, (slice(None), self.kv_index), dv_slots)
        out = [x.astype(dtype) for x in (dq, dk, dv)]
        out = [x[0] if run.unbatched else x for x in out]
        if float_mask:
            dm = np.asarray(grads[3])
            if dm.shape[1] != 1:
                dm = dm[:, : self.H]
            if dm.shape[2] != 1:
                dm = ring.unpermute(dm, axis=2, n=run.T, seq="t")
            if dm.shape[3] != 1:
                dm = ring.unpermute(dm, axis=3, n=run.S, seq="s")
            out.append(dm.reshape(run.mask_shape))
        if run.sinks is not None:
            # Each device's heads' dsinks, gathered in head order; the dummies cut off.
            out.append(np.asarray(grads[-1])[: self.H].astype(dtype))  # (H,)
        return tuple(out)


def _ulysses_body(
    q, k, v, kv_slot, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, *, documents,
    return_lse=False, **flags,
):  # fmt: skip
    """One device: all-to-all to head shards, attention on whole sequences, and back.

    q (B, Hp, Tl, D), k (B, P·Kl, Sl, D), v (B, P·Kl, Sl, E); kv_slot (Hl,) this device's
    query heads' key/value slots (-1: a dummy head); tpos (Tp,), spos (Sp,) the original
    positions of every slot (for packed documents, their places in them); tdoc (Tp,),
    sdoc (Sp,) every slot's packed document (-1: padding), or None, with ``documents``
    = N; mask (B|1, Hl|1, Tp|1, Sp|1) or None; sinks (Hl,) and ALiBi's slopes (B, Hl) of
    this device's query heads, or None; ``flags``: softcap_on and huge_scale, static.
    With ``return_lse`` (not packed): (out, lse (B, Hp, Tl) in the working dtype).
    """
    # Sequence shards -> head shards: split the heads into P groups, send group d' to
    # device d', and concatenate what arrives along the sequence.
    q = lax.all_to_all(q, AXIS, split_axis=1, concat_axis=2, tiled=True)  # (B, Hl, Tp, D)
    k = lax.all_to_all(k, AXIS, split_axis=1, concat_axis=2, tiled=True)  # (B, Kl, Sp, D)
    v = lax.all_to_all(v, AXIS, split_axis=1, concat_axis=2, tiled=True)  # (B, Kl, Sp, E)
    out_dtype = q.dtype
    # Each query head's own key/value head: a gather of the slots (GQA without a reshape,
    # since a device's query heads need not be whole groups).
    slot = jnp.maximum(kv_slot, 0)  # (Hl,)
    k = jnp.take(k, slot, axis=1)  # (B, Hl, Sp, D)
    v = jnp.take(v, slot, axis=1)  # (B, Hl, Sp, E)

    # Which keys each query may see: causality, the window, local-attention chunks,
    # padding and a packed document (from the tokens' positions, as the ring decides), a
    # real head, a bool mask, a float mask's -inf entries.
    docs = None if tdoc is None else (tdoc, sdoc)
    allowed = allowed_keys(tpos, spos, opts, docs)  # (Tp, Sp)
    allowed = allowed[None] & (kv_slot >= 0)[:, None, None]  # (Hl, Tp, Sp)
    if mask is not None:
        allowed = allowed & (mask if mask.dtype == jnp.bool_ else mask != -jnp.inf)
    # The scalar options in the working precision; a scale above 1 split (ring_blocks).
    work = working_dtype(out_dtype)
    softcap = opts["softcap"].astype(work)
    huge = flags["huge_scale"]
    folded, post = scale_split(opts["scale"], work) if huge else (opts["scale"].astype(work), None)
    local = functools.partial(
        _attend, k=k, v=v, mask=mask, sinks=sinks, slopes=slopes, tpos=tpos, spos=spos,
        opts=opts, scale=(folded, post), softcap=softcap if flags["softcap_on"] else None,
    )  # fmt: skip

    if return_lse:
        out, lse = local(q, allowed, return_lse=True)  # (B, Hl, Tp, E), (B, Hl, Tp)
        out = out.astype(out_dtype)  # (B, Hl, Tp, E)
        # Head shards -> sequence shards, the lse as the output.
        back = functools.partial(lax.all_to_all, axis_name=AXIS, split_axis=2, concat_axis=1)
        return back(out, tiled=True), back(lse, tiled=True)  # (B, Hp, Tl, E), (B, Hp, Tl)
    if tdoc is None:
        out = local(q, allowed)  # (B, Hl, Tp, E)
    else:
        # Packed: the local step once per document, on its queries alone (the others 0,
        # so that nothing of theirs, not even a NaN, reaches its keys' gradients); each
        # row keeps its own document's pass (module docstring).
        def document(n, out):
            rows = tdoc == n  # (Tp,)
            q_n = jnp.where(rows[:, None], q, 0.0)  # (B, Hl, Tp, D)
            out_n = local(q_n, allowed & rows[:, None])  # (B, Hl, Tp, E)
            return jnp.where(rows[:, None], out_n, out)  # (B, Hl, Tp, E)

        out = jnp.zeros((*q.shape[:3], v.shape[-1]), dtype=working_dtype(out_dtype))
        out = lax.pcast(out, AXIS, to="varying")  # (B, Hl, Tp, E): it differs by device
        out = lax.fori_loop(0, documents, document, out)  # (B, Hl, Tp, E)
    out = out.astype(out_dtype)  # (B, Hl, Tp, E)

    # Head shards -> sequence shards: the inverse all-to-all.
    return lax.all_to_all(out, AXIS, split_axis=2, concat_axis=1, tiled=True)  # (B, Hp, Tl, E)


def _attend(
    q, allowed, *, k, v, mask, sinks, slopes, tpos, spos, opts, scale, softcap, return_lse=False
):
    """Steps 1-7 of this device's heads over the whole sequence: (B, Hl, Tp, E), and with
    ``return_lse`` step 8, its log-sum-exp (B, Hl, Tp). scale: (the part folded into q, the
    power of two on the product or None); softcap: the cap, or None."""
    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    work = working_dtype(q.dtype)
    # A key no query of its head may see must have no effect whatever it holds (0 ·
    # NaN is NaN): its rows are replaced by 0, by selection, before they are used.
    used = allowed.any(axis=-2)  # (B|1, Hl, Sp)
    k_used = jnp.where(used[..., None], k.astype(work), 0.0)  # (B, Hl, Sp, D)
    v_used = jnp.where(used[..., None], v.astype(work), 0.0)  # (B, Hl, Sp, E)

    # 1. Scores and 2. scale (folded into q; a scale above 1 only in part, the rest a power
    # of two on the product: ring_blocks.scale_split).
    folded, post = scale
    q = q.astype(work) * folded  # (B, Hl, Tp, D)
    x = jnp.einsum("bhtd,bhsd->bhts", q, k_used, precision=lax.Precision.HIGHEST)
    if post is not None:
        x = x * post  # (B, Hl, Tp, Sp)
    # x: (B, Hl, Tp, Sp)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if softcap is not None:
        x = softcapped(x, softcap)  # (B, Hl, Tp, Sp)

    # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query
    # may not see gets -inf. ALiBi's distance is from the bottom-right diagonal, on the
    # tokens' original positions (the layout permutes the slots, not the positions).
    if slopes is not None:
        t_diag = tpos[:, None] + opts["S"] - opts["T"]  # (Tp, 1)
        distance = jnp.abs(t_diag - spos[None, :]).astype(work)  # (Tp, Sp)
        x = x - slopes.astype(work)[:, :, None, None] * distance  # (B, Hl, Tp, Sp)
    if mask is not None and mask.dtype != jnp.bool_:
        x = x + mask.astype(work)
    x = jnp.where(allowed, x, -jnp.inf)  # (B, Hl, Tp, Sp)

    # 5. Softmax over the keys, the row max subtracted; a row with no key gets weights
    # 0. Both guards select (the "double where"), so gradients through such a row are 0.
    row_max = x.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, Hl, Tp, 1)
    if sinks is not None:
        # A sink joins the maximum of every row that has a key; a row with none stays 0.
        has_key = row_max != -jnp.inf  # (B, Hl, Tp, 1)
        sink = sinks.astype(work)[:, None, None]  # (Hl, 1, 1)
        sink = jnp.where(has_key, sink, -jnp.inf)  # (B, Hl, Tp, 1)
        row_max = jnp.maximum(row_max, sink)  # (B, Hl, Tp, 1)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # (B, Hl, Tp, 1)
    p = jnp.exp(x - row_max)  # (B, Hl, Tp, Sp)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, Hl, Tp, 1)
    if sinks is not None:
        # The sink takes its share of the sum, and has no value row to give anything.
        row_sum = row_sum + jnp.exp(sink - row_max)  # (B, Hl, Tp, 1)
    # A row that reads +inf has row sum +inf: every weight of it is NaN, not only those
    # of its +inf scores (SPEC §4.1), so that its gradients reach every key it attends.
    divisor = jnp.where(row_sum > 0, row_sum, 1.0)  # (B, Hl, Tp, 1)
    divisor = jnp.where(row_sum == jnp.inf, jnp.nan, divisor)  # (B, Hl, Tp, 1)
    w = p / divisor  # (B, Hl, Tp, Sp)
    if sinks is not None:
        # A NaN or +inf sink makes its row NaN, as +inf - +inf does in the softmax
        # (SPEC §15.4); the shift by a finite row maximum cannot show it: selected.
        w = jnp.where(jnp.isnan(sink) | (sink == jnp.inf), jnp.nan, w)  # (B, Hl, Tp, Sp)

    # 7. Weighted sum of the values.
    out = jnp.einsum("bhts,bhse->bhte", w, v_used, precision=lax.Precision.HIGHEST)
    if not return_lse:
        return out

    # 8. The log-sum-exp: the row maximum plus the log of the shifted sum, the sink's term
    # in it; -inf for a row with no key (sum 0), NaN for a row that read a NaN or +inf
    # score or sink (sum NaN or +inf, SPEC §21.2).
    some = row_sum > 0  # (B, Hl, Tp, 1)
    lse = jnp.where(some, row_max + jnp.log(jnp.where(some, row_sum, 1.0)), -jnp.inf)
    lse = jnp.where(jnp.isnan(row_sum) | (row_sum == jnp.inf), jnp.nan, lse)  # (B, Hl, Tp, 1)
    return out, lse[..., 0]  # (B, Hl, Tp, E), (B, Hl, Tp)


def _sharded(
    mesh, mask_spec, softcap_on, huge_scale, sinks_on, alibi_on, documents, return_lse=False
):
    seq = SEQ
    sinks_spec = PS(AXIS) if sinks_on else None  # (Hp,): with the query heads
    slopes_spec = PS(None, AXIS) if alibi_on else None  # (B, Hp)
    docs = None if documents is None else PS()  # (Tp,), (Sp,): replicated, as positions
    return jax.shard_map(
        functools.partial(
            _ulysses_body, softcap_on=softcap_on, huge_scale=huge_scale, documents=documents,
            **({"return_lse": True} if return_lse else {}),
        ),
        mesh=mesh,
        in_specs=(seq, seq, seq, PS(AXIS), PS(), PS(), docs, docs, mask_spec, sinks_spec,
                  slopes_spec, PS()),
        out_specs=(seq, PS(None, None, AXIS)) if return_lse else seq,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _ulysses_fn(
    mesh, mask_spec, softcap_on, huge_scale, sinks_on, alibi_on, documents, return_lse=False
):
    static = (mask_spec, softcap_on, huge_scale, sinks_on, alibi_on, documents, return_lse)
    return jax.jit(_sharded(mesh, *static))


@functools.lru_cache(maxsize=64)
def _ulysses_vjp_fn(
    mesh, float_mask, mask_spec, softcap_on, huge_scale, sinks_on, alibi_on, documents
):
    f = _sharded(mesh, mask_spec, softcap_on, huge_scale, sinks_on, alibi_on, documents)

    def vjp(q, k, v, kv_slot, tpos, spos, tdoc, sdoc, mask, sinks, slopes, opts, d_out):
        # Differentiated: q, k, v, a float mask and the sinks (dsinks last); the slopes
        # are constants (SPEC §17.3).
        primals = [q, k, v] + [mask] * float_mask + [sinks] * sinks_on

        def g(q, k, v, *rest):
            m = rest[0] if float_mask else mask
            s = rest[-1] if sinks_on else sinks
            return f(q, k, v, kv_slot, tpos, spos, tdoc, sdoc, m, s, slopes, opts)

        _, pull = jax.vjp(g, *primals)
        return pull(d_out)

    return jax.jit(vjp)


__all__ = [
    "LAYOUTS",
    "attention",
    "attention_packed",
    "attention_packed_vjp",
    "attention_vjp",
    "head_split",
    "host_devices",
]
