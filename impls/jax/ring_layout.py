"""The host side of the context-parallel pages (``ring.py``, ``ulysses.py``): validate,
lay the sequence out over the devices (pad, permute, shard), and undo the layout.

Step 0 is the input contract every page shares (``prepare``, and ``prepare_packed`` for
packed documents, where each token gets its document and its place in it). ``Ring`` then
holds the mesh of P devices and the layout: which original position sits in which slot
of which device, contiguous (device i holds the i-th slice) or zigzag (chunks i and
2P − 1 − i of 2P; ``ring.py``'s docstring draws both). Lengths are padded to whole slices
(zigzag: whole chunks) of a power of two times ``ROWS`` rows (past 16 times, a multiple of
4 times), so that one compiled program serves every length in a bucket: the true
lengths travel as data. ``Ring.put`` places the arrays, their positions and the options
(traced: one compilation serves every option value) on the devices; ``unpermute`` brings
a result back into the original order, padding cut off.

Shape legend: ``ring.py``'s (Tp, Sp: T and S padded to the layout's slots).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from .. import contract
from .flash_tiles import bucket_count

LAYOUTS = ("contiguous", "zigzag")
AXIS = "ring"  # the mesh axis: the devices' ring (or, for Ulysses, their all-to-all)
FAR = 2**30  # "unbounded" for a window side, as an int32
ROWS = 8  # a chunk's length is a power of two times ROWS: one program per bucket of lengths


class Run:
    """Checked, batched inputs and options."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def prepare(q, k, v, mask, d_out=None, *, name: str = "ring attention", **options) -> Run:
    """Step 0: the input contract every page shares (the contract package), on the host arrays;
    ``name`` says whose call refuses dropout."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    d_out = None if d_out is None else np.asarray(d_out)
    why = f"{name} here has no dropout"
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
    return Run(
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


def prepare_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out=None, **options) -> Run:
    """Step 0 of a packed call: the input contract (the contract package), then the documents as
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
    return Run(
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


class Ring:
    """The mesh and the layout: which original position sits in which slot of which device."""

    def __init__(self, run: Run, shards: int | None, layout: str):
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
            huge_scale=run.scale > 1,
            sinks_on=run.sinks is not None,
            alibi_on=run.slopes is not None,
            packed_on=run.docs is not None,
        )
        # The scalar options travel as data, so that one compilation serves them all.
        left, right = run.window if run.window is not None else (None, None)
        hi = FAR if right is None else right
        self.opts = dict(
            scale=np.float64(run.scale),
            softcap=np.float64(run.softcap or 1.0),
            offset=np.int32(run.offset),
            lo=np.int32(-FAR if left is None else -left),
            hi=np.int32(min(hi, 0) if run.is_causal else hi),
            T=np.int32(run.T),
            S=np.int32(run.S),
        )
        if run.docs is not None:
            # Packed: the positions are places in the documents, which may pass T; the
            # padding is in no document instead, and the document test refuses it.
            self.opts.update(T=np.int32(FAR), S=np.int32(FAR))
        if run.chunk is not None:
            # Only with chunks: a call without them compiles no chunk test at all. One
            # chunk wider than every position holds them all.
            self.opts["chunk"] = np.int32(min(run.chunk, FAR))

    def _perm(self, n: int) -> np.ndarray:
        chunks = self.P * self.pieces  # P slices, or 2P zigzag chunks
        c = -(-max(1, n) // chunks)  # chunk length: n padded up to whole chunks
        c = bucket_count(-(-c // ROWS)) * ROWS  # ... of ROWS rows, counted up to a bucket
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

    def put(self, run: Run) -> tuple:
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
