"""DeepSpeed-Ulysses attention in JAX: an all-to-all trades sequence shards for head shards.

Ring attention (``jax_ring``) keeps the sequence split and moves key/value blocks round.
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

Which heads. Query head h uses key/value head h // G (G = H // K), so the heads are split
as contiguous groups: device d gets query heads [d·H/P, (d+1)·H/P) and key/value heads
[d·K/P, (d+1)·K/P). That needs H % P == 0 and K % P == 0. With fewer key/value heads
than devices (K < P, as in multi-query attention), each key/value head is repeated P/K
times before the all-to-all, so that device d holds the one copy its query heads use
(this needs P % K == 0 and H % P == 0; every device still holds one head's keys and
values, and their gradients are summed over the copies). Other head counts raise
ValueError naming H, K and P.

Masks. A mask with an H axis is sharded along the heads, one without is replicated: each
device holds (H/P) × T × S (or T × S) of it, since it attends the whole sequence.
Lengths P does not divide are padded to whole slices; padded keys are never attended and
padded queries are cut off. The ``layout`` option (contiguous or zigzag) permutes the
sequence as ``jax_ring`` does; the result is the same either way.

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       P devices (shards)
    Tl, Sl: the per-device slice lengths; Hl = H / P, Kl = max(K, P) / P heads per device

Supports what ``jax_ring`` does (masks, both causal alignments, windows, softcap, GQA,
every dtype, unbatched inputs, gradients by ``jax.vjp``), batch > 1; not dropout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as PS

from . import contract
from .jax_ring import LAYOUTS, _Ring, host_devices

AXIS = "ring"  # the mesh axis jax_ring names


def heads_per_device(H: int, K: int, P: int) -> int:
    """The key/value heads after the K < P scheme (K, or P when each is repeated P/K times);
    a ValueError naming H, K and P when the heads cannot be split over P devices."""
    if H % P == 0 and K % P == 0:
        return K
    if H % P == 0 and K < P and P % K == 0:
        return P
    raise ValueError(
        f"jax-ulysses shards heads: it needs H % P == 0 and either K % P == 0 or "
        f"P % K == 0 (K < P: each key/value head repeated P/K times), got H={H} query "
        f"heads, K={K} key/value heads, P={P} devices"
    )


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
    shards: int | None = None,
    layout: str = "contiguous",
) -> np.ndarray:
    """Scaled dot-product attention over P devices by two all-to-alls (args as jax_ring)."""
    return _run(q, k, v, None, mask, shards, layout, is_causal=is_causal, scale=scale,
                causal_alignment=causal_alignment, window=window, softcap=softcap,
                dropout_p=dropout_p)  # fmt: skip


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
    shards: int | None = None,
    layout: str = "contiguous",
) -> tuple[np.ndarray, ...]:
    """Gradients by ``jax.vjp`` through both all-to-alls: (dq, dk, dv[, dmask])."""
    return _run(q, k, v, d_out, mask, shards, layout, is_causal=is_causal, scale=scale,
                causal_alignment=causal_alignment, window=window, softcap=softcap,
                dropout_p=dropout_p)  # fmt: skip


def _run(q, k, v, d_out, mask, shards, layout, **options):
    # 0. Validate (the shared contract), then lay the sequence out and shard it.
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    d_out = None if d_out is None else np.asarray(d_out)
    why = "Ulysses attention here has no dropout"
    call = contract.check(
        q, k, v, mask=mask, **options, unsupported={"dropout_p": why}, d_out=d_out
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]
        d_out = None if d_out is None else d_out[None]
    P = len(jax.devices()) if shards is None else shards
    if layout not in LAYOUTS:
        raise ValueError(f"layout should be one of {LAYOUTS}, got {layout!r}")
    Kd = heads_per_device(call.H, call.K, P) if isinstance(P, int) and P >= 1 else call.K
    if Kd != call.K:
        # K < P: repeat each key/value head P/K times, so that device d holds the copy of
        # head d·K/P its query heads use.
        k = np.repeat(k, Kd // call.K, axis=1)  # (B, P, S, D)
        v = np.repeat(v, Kd // call.K, axis=1)  # (B, P, S, E)
    run = type("Run", (), {})()
    run.__dict__.update(
        q=q, k=k, v=v, T=call.T, S=call.S, scale=call.scale, is_causal=call.is_causal,
        offset=0 if call.causal_alignment == "top_left" else call.S - call.T,
        window=call.window, softcap=call.softcap,
        mask=None if mask is None else mask.reshape(call.mask_shape),
    )  # fmt: skip
    ring = _Ring(run, P, layout)  # the sequence layout and the mesh, as jax_ring's
    mesh = ring.mesh
    seq = PS(None, None, AXIS, None)
    args = [
        ring.shard(ring.permute(q, axis=2, n=call.T, seq="t"), seq),  # (B, H, Tp, D)
        ring.shard(ring.permute(k, axis=2, n=call.S, seq="s"), seq),  # (B, Kd, Sp, D)
        ring.shard(ring.permute(v, axis=2, n=call.S, seq="s"), seq),  # (B, Kd, Sp, E)
        ring.shard(ring.perm["t"].astype(np.int32), PS()),  # (Tp,) replicated: tiny
        ring.shard(ring.perm["s"].astype(np.int32), PS()),  # (Sp,)
    ]
    m = run.mask
    mask_spec = None
    if m is not None:
        if m.shape[2] != 1:
            m = ring.permute(m, axis=2, n=call.T, seq="t")
        if m.shape[3] != 1:
            m = ring.permute(m, axis=3, n=call.S, seq="s")
        mask_spec = PS(None, AXIS, None, None) if m.shape[1] != 1 else PS()
        m = ring.shard(m, mask_spec)  # (B|1, H|1, Tp|1, Sp|1): heads sharded
    args.append(m)
    opts = {n: ring.shard(x, PS()) for n, x in ring.opts.items()}
    args.append(opts)
    static = dict(mask_spec=mask_spec, softcap_on=call.softcap is not None)
    if d_out is None:
        out = _ulysses_fn(mesh, **static)(*args)  # (B, H, Tp, E)
        out = ring.unpermute(np.asarray(out), axis=2, n=call.T, seq="t")
        return out[0] if call.unbatched else out
    float_mask = m is not None and m.dtype != jnp.bool_
    d_out = ring.shard(ring.permute(d_out, axis=2, n=call.T, seq="t"), seq)
    grads = _ulysses_vjp_fn(mesh, float_mask, **static)(*args, d_out)
    dq = ring.unpermute(np.asarray(grads[0]), axis=2, n=call.T, seq="t")
    dk = ring.unpermute(np.asarray(grads[1]), axis=2, n=call.S, seq="s")
    dv = ring.unpermute(np.asarray(grads[2]), axis=2, n=call.S, seq="s")
    if Kd != call.K:
        # The gradient of a repeated head is the sum over its copies.
        dk = dk.reshape(dk.shape[0], call.K, Kd // call.K, *dk.shape[2:]).sum(2).astype(dk.dtype)
        dv = dv.reshape(dv.shape[0], call.K, Kd // call.K, *dv.shape[2:]).sum(2).astype(dv.dtype)
    out = [x[0] if call.unbatched else x for x in (dq, dk, dv)]
    if float_mask:
        dm = np.asarray(grads[3])
        if dm.shape[2] != 1:
            dm = ring.unpermute(dm, axis=2, n=call.T, seq="t")
        if dm.shape[3] != 1:
            dm = ring.unpermute(dm, axis=3, n=call.S, seq="s")
        out.append(dm.reshape(mask.shape))
    return tuple(out)


def _ulysses_body(q, k, v, tpos, spos, mask, opts, *, softcap_on):
    """One device: all-to-all to head shards, attention on whole sequences, and back.

    q (B, H, Tl, D), k (B, Kd, Sl, D), v (B, Kd, Sl, E); tpos (Tp,), spos (Sp,) the
    original positions of every slot; mask (B|1, Hl|1, Tp|1, Sp|1) or None.
    """
    # Sequence shards -> head shards: split the heads into P groups, send group d' to
    # device d', and concatenate what arrives along the sequence.
    q = lax.all_to_all(q, AXIS, split_axis=1, concat_axis=2, tiled=True)  # (B, Hl, Tp, D)
    k = lax.all_to_all(k, AXIS, split_axis=1, concat_axis=2, tiled=True)  # (B, Kl, Sp, D)
    v = lax.all_to_all(v, AXIS, split_axis=1, concat_axis=2, tiled=True)  # (B, Kl, Sp, E)
    B, Hl, Tp, D = q.shape
    Kl = k.shape[1]
    G = Hl // Kl  # query heads per key/value head on this device
    out_dtype = q.dtype
    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    work = jnp.float64 if out_dtype == jnp.float64 else jnp.float32
    scale, softcap = opts["scale"].astype(work), opts["softcap"].astype(work)

    # Which keys each query may see: causality, the window and padding (from the tokens'
    # original positions), a bool mask, a float mask's -inf entries.
    distance = spos[None, :] - (tpos[:, None] + opts["offset"])  # (Tp, Sp)
    allowed = (tpos < opts["T"])[:, None] & (spos < opts["S"])[None, :]  # (Tp, Sp)
    allowed = allowed & (distance >= opts["lo"]) & (distance <= opts["hi"])
    if mask is not None:
        mask = _grouped(mask, Kl, G)  # (B|1, Kl|1, G|1, Tp|1, Sp|1)
        allowed = allowed & (mask if mask.dtype == jnp.bool_ else mask != -jnp.inf)
    # A key no query of its head may see must have no effect whatever it holds (0 · NaN
    # is NaN): its rows are replaced by 0, by selection, before they are used.
    used = allowed.any(axis=-2) if allowed.ndim == 2 else allowed.any(axis=(-3, -2))
    k = jnp.where(used[..., None], k.astype(work), 0.0)  # (B, Kl, Sp, D)
    v = jnp.where(used[..., None], v.astype(work), 0.0)  # (B, Kl, Sp, E)

    # 1. Scores and 2. scale (folded into q): query head g of kv head κ against its keys.
    q = (q.astype(work) * scale).reshape(B, Kl, G, Tp, D)  # (B, Kl, G, Tp, D)
    x = jnp.einsum("bkgtd,bksd->bkgts", q, k, precision=lax.Precision.HIGHEST)
    # x: (B, Kl, G, Tp, Sp)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if softcap_on:
        x = softcap * jnp.tanh(x / softcap)

    # 4. Mask: a float mask is added, then every key a query may not see gets -inf.
    if mask is not None and mask.dtype != jnp.bool_:
        x = x + mask.astype(work)
    x = jnp.where(allowed, x, -jnp.inf)  # (B, Kl, G, Tp, Sp)

    # 5. Softmax over the keys, the row max subtracted; a row with no key gets weights 0.
    # Both guards select (the "double where"), so gradients through such a row are 0.
    row_max = x.max(axis=-1, keepdims=True, initial=-jnp.inf)  # (B, Kl, G, Tp, 1)
    p = jnp.exp(x - jnp.where(jnp.isfinite(row_max), row_max, 0.0))  # (B, Kl, G, Tp, Sp)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, Kl, G, Tp, 1)
    w = p / jnp.where(row_sum > 0, row_sum, 1.0)  # (B, Kl, G, Tp, Sp)

    # 7. Weighted sum of the values.
    out = jnp.einsum("bkgts,bkse->bkgte", w, v, precision=lax.Precision.HIGHEST)
    out = out.reshape(B, Hl, Tp, -1).astype(out_dtype)  # (B, Hl, Tp, E)

    # Head shards -> sequence shards: the inverse all-to-all.
    return lax.all_to_all(out, AXIS, split_axis=2, concat_axis=1, tiled=True)  # (B, H, Tl, E)


def _grouped(x, K: int, G: int):
    """A (B|1, H|1, T|1, S|1) array on the grouped layout (B|1, K|1, G|1, T|1, S|1)."""
    b, h, t, s = x.shape
    return x.reshape(b, 1, 1, t, s) if h == 1 else x.reshape(b, K, G, t, s)


def _sharded(mesh, mask_spec, softcap_on):
    seq = PS(None, None, AXIS, None)
    return jax.shard_map(
        functools.partial(_ulysses_body, softcap_on=softcap_on),
        mesh=mesh,
        in_specs=(seq, seq, seq, PS(), PS(), mask_spec, PS()),
        out_specs=seq,
    )


@functools.lru_cache(maxsize=64)
def _ulysses_fn(mesh, mask_spec, softcap_on):
    return jax.jit(_sharded(mesh, mask_spec, softcap_on))


@functools.lru_cache(maxsize=64)
def _ulysses_vjp_fn(mesh, float_mask, mask_spec, softcap_on):
    f = _sharded(mesh, mask_spec, softcap_on)

    def vjp(q, k, v, tpos, spos, mask, opts, d_out):
        if float_mask:
            _, pull = jax.vjp(lambda q, k, v, m: f(q, k, v, tpos, spos, m, opts), q, k, v, mask)
        else:
            _, pull = jax.vjp(lambda q, k, v: f(q, k, v, tpos, spos, mask, opts), q, k, v)
        return pull(d_out)

    return jax.jit(vjp)


__all__ = ["attention", "attention_vjp", "heads_per_device", "host_devices"]
