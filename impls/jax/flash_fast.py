"""The fast path of blockwise attention in JAX: its host and jit plumbing.

``flash.py``'s ``attention(..., fast=True)`` and ``attention_vjp`` run the online softmax
its docstring derives, compiled once for many calls: this page checks and pads the inputs
to a shape bucket (``_prepare``, ``bucket``), turns the options into runtime values
(``_traced_options``), runs the compiled loops over the tiles of ``flash_tiles.py``
(``_flash``, ``_flash_vjp``) and cuts the results back (``_result``). What follows
describes it.

Compiled once per shape bucket. XLA needs every array's shape at compile time, and
compiling costs far more than running at the sizes tests and short prompts use (a
forward program about 0.3 s on a CPU, a backward one 0.7 s). So T and S are padded up to
a few buckets (``bucket``: a power of two of tiles) before the compiled program, and
their true values are runtime values of it, as FlashAttention's variable-length entry
points take their lengths as data: padded keys are masked like blocked ones, padded
query rows see no key and are cut off at the end, and tiles wholly past the true lengths
are never visited. The query blocks are a ``lax.fori_loop`` writing into the output, and
the key blocks an inner ``lax.fori_loop`` carrying (m, l, a). The options' values are not
compiled in either: the scale, the softcap, the window's sides (and causality, its right
side capped at 0), the chunk size and the diagonal's offset are runtime values, so one
program serves them all and only which of them are present specialises it. The loop
bounds are computed from them at run time, as they are from the query block's index.

Sinks. An attention sink (one logit per query head, gpt-oss) is one more term of the row
sum l with no value row: after the last key block it is folded in like one more block,
m' = max(m, sink), l' = exp(m - m') · l + exp(sink - m'), a' = exp(m - m') · a, so a sink
of 1e4 cannot overflow either. A row with no key keeps l = 0 and returns 0. Its gradient
is −Σ_t exp(sink − lse[t]) · Δ[t], from the backward's own lse and Δ.

Skipping blocks. Causal and window masks are bands around the diagonal, so for query block
i only the key blocks [first(i), last(i)) can hold a visible key: the inner loop runs
over just those (``fori_loop`` accepts traced bounds; it becomes a while loop). That
halves the work under a causal mask, which is where fused kernels get their causal
speed-up. Of those blocks, the ones wholly inside the band need no masking at all, so
the key loop is three loops: the blocks the band cuts on the left (a window), those
inside it (no mask computed), those it cuts on the right (the causal diagonal). (A
user-supplied mask is an input: its tiles are sliced, and a fully blocked tile is still
computed.) Chunked local attention (Llama 4) narrows [first(i), last(i)) to the chunks
the block's rows lie in, so key blocks wholly outside them are skipped; only a block
within one chunk has tiles that need no masking.

ALiBi. Its bias −slope · |t + S − T − s| depends only on the query's and the key's
positions, so each score tile adds its own slice of it, computed there from the tile's
row and column indices: no (T, S) bias is ever built.

Memory. No input is copied whole (except to pad T or S up to their bucket): tiles
are sliced from the inputs and cast to the working precision tile by tile, and each
finished query block is written in place into the output. Beyond inputs and output the
loop holds one (B, K, G·Tb, Sb) score tile, its exponentials, and (B, K, G·Tb, E)
accumulators: with the defaults and B=1, H=8, a few MiB, whatever T and S are. The
backward holds a few tiles more, and dK and dV in the working precision (the outputs
themselves, for float32 and float64).

Speed, on a CPU. XLA hands the two products of a tile to its matmul library and fuses
the max, exp and sum passes into a few loops over the tile. Larger tiles amortise the
loop overhead and make bigger matmuls; smaller ones stay in cache and waste less on the
causal diagonal (a query block of Tb rows computes about Tb²/2 masked scores there).
512 × 256 (queries × keys) was fastest on 2 cores in float32, causal and not (T = 4096,
measured in one process: 256 × 256 took 1.7× as long non-causal, 1.5× causal). Precision is
HIGHEST, which the CPU honours anyway (it has no reduced-precision float32 matmul), and
which keeps float32 results bitwise stable.

Shape legend: ``flash.py``'s (Tb, Sb the query and key block, Tq, Sk: T and S padded
to their buckets, Tp, Sp the padded lengths the tiles see).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import contract
from .flash_tiles import (
    Tiles,
    add_sink,
    backward_lse,
    backward_tile,
    bucket_count,
    running_lse,
    scale_split,
)


def _prepare(q, k, v, mask, options: dict, block_q: int, block_k: int, d_out=None, d_lse=None):
    """Step 0 and the shape bucket: (the checked call, the batched q, k, v and the mask as
    (B|1, H|1, T|1, S|1), padded to the bucket, the sinks (H,) and ALiBi's slopes (H,) or
    (B, H), the keyword arguments of ``_flash``, with ``d_out`` batched and padded too,
    and ``d_lse``, zeros where it is not given)."""
    sinks, alibi = options.pop("sinks"), options.pop("alibi_slopes")
    # On the host, the reshapes and pads below are NumPy's (``_on_host``), on arrays of
    # the dtypes JAX gives them (float64 only with jax_enable_x64).
    host = _on_host(q, k, v, mask, sinks, alibi, d_out, d_lse)
    q, k, v, mask, sinks, alibi, d_out, d_lse = (
        None if x is None else _host_array(x) if host else jnp.asarray(x)
        for x in (q, k, v, mask, sinks, alibi, d_out, d_lse)
    )
    call = contract.check(
        q,
        k,
        v,
        mask=mask,
        **options,
        unsupported={"dropout_p": "jax-flash is blockwise attention without dropout"},
        tiles={"block_q": block_q, "block_k": block_k},
        d_out=d_out,
        sinks=sinks,
        alibi_slopes=alibi,
        d_lse=d_lse,
    )
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
        d_out = None if d_out is None else d_out[None]  # (1, H, T, E)
        d_lse = None if d_lse is None else d_lse[None]  # (1, H, T)
    if mask is not None:
        # Keep the mask as small as it was given, (B|1, H|1, T|1, S|1): broadcasting it
        # to (B, H, T, S) here would build the very T × S array this module avoids.
        mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
    if call.T == 0 or call.S == 0:
        return call, (q, k, v, mask, sinks, alibi), {}
    # The shape bucket: T and S padded up (``bucket``), so that one compiled program
    # serves every length of a bucket; the true lengths are runtime values of it.
    Tb, Tq = bucket(call.T, block_q)
    Sb, Sk = bucket(call.S, block_k)
    q = _pad(q, 2, Tq)  # (B, H, Tq, D)
    k, v = _pad(k, 2, Sk), _pad(v, 2, Sk)  # (B, K, Sk, D), (B, K, Sk, E)
    if mask is not None:
        # Padded only along the axes it has, not those it broadcasts along.
        mask = _pad(_pad(mask, 2, Tq), 3, Sk)  # (B|1, H|1, Tq|1, Sk|1)
    static = dict(opts=_traced_options(call, q.dtype, Tq), Tb=Tb, Sb=Sb)
    if d_out is not None:
        static["d_out"] = _pad(d_out, 2, Tq)  # (B, H, Tq, E)
        # Always an array, zeros where not given: one compiled backward serves both.
        if d_lse is None:
            work = np.float64 if q.dtype == np.float64 else np.float32
            d_lse = (np.zeros if host else jnp.zeros)((call.B, call.H, call.T), work)
        static["d_lse"] = _pad(d_lse, 2, Tq)  # (B, H, Tq)
    return call, (q, k, v, mask, sinks, alibi), static


def bucket(n: int, block: int) -> tuple[int, int]:
    """A length's tile and shape bucket, (tile, padded length): the tile is the block, or
    n's power of two where that is smaller, and the tiles are counted up to a bucket
    (``flash_tiles.bucket_count``). A run over many lengths compiles a few programs, not
    one per length; a padded tile is never visited (``Tiles``), so the padding costs
    memory, not work."""
    tile = min(block, 1 << (n - 1).bit_length())
    return tile, tile * bucket_count(-(-n // tile))


def _on_host(*arrays) -> bool:
    """Whether every array is on the host: NumPy's (or a list), or a JAX array on the CPU.
    There the conversions, pads, cuts and reshapes around the compiled program are
    NumPy's: done by JAX outside a compiled program, each would be a small program
    compiled for every shape (60-130 ms measured), the very cost the buckets save.
    Elsewhere (an accelerator, or inside the caller's own trace) they are JAX's, and the
    bytes stay on their device."""
    for x in arrays:
        if isinstance(x, jax.core.Tracer):
            return False
        if isinstance(x, jax.Array) and {d.platform for d in x.devices()} != {"cpu"}:
            return False
    return True


def _host_array(x) -> np.ndarray:
    """x as a NumPy array of the dtype ``jnp.asarray`` would give it."""
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def _pad(x, axis: int, n: int):
    """x zero-padded at the end of ``axis`` up to length n; an axis of length 1 (one the
    mask broadcasts along) is left as it is."""
    if x.shape[axis] in (1, n):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return (np.pad if isinstance(x, np.ndarray) else jnp.pad)(x, widths)


def _result(x, cuts: tuple, unbatched: bool, shape: tuple | None = None):
    """A padded, batched result as the caller gets it, a JAX array: cut to the true
    lengths (``cuts``: (axis, n) pairs; an axis of length 1, a broadcast one, is kept),
    unbatched, and reshaped to ``shape`` if given; on the host with NumPy (``_on_host``)."""
    index = [slice(None)] * x.ndim
    for axis, n in cuts:
        if x.shape[axis] not in (1, n):
            index[axis] = slice(0, n)
    if all(i == slice(None) for i in index) and not unbatched and shape is None:
        return jax.device_put(x) if isinstance(x, np.ndarray) else x
    host = _on_host(x)
    x = (np.asarray(x) if host else x)[tuple(index)]
    x = x[0] if unbatched else x
    x = x if shape is None else x.reshape(shape)
    return jax.device_put(x) if host else x


def _traced_options(call: contract.Checked, dtype, Tq: int) -> dict:
    """The options as runtime values, so that one compiled program serves every scale,
    softcap, window, chunk size and alignment of a shape bucket: which options are present
    (None where not) is all the program is specialised on. S is always present; T only
    where it is shorter than the bucket's Tq, as its padded rows are masked in every tile
    (a key's padding, only in the tiles that hold some). Causality is the window's right side
    capped at 0; a side or chunk wider than T + S reaches past every key, so it is cut to
    that, which keeps the positions it adds within int32. The scale comes in the two parts
    the tiles use (``flash_tiles.scale_split``), and whole for dq."""
    work = np.float64 if dtype == jnp.float64 else np.float32
    T, S = call.T, call.S
    left, right = call.window if call.window is not None else (None, None)
    if call.is_causal:
        right = 0 if right is None else min(right, 0)
    folded, post = scale_split(call.scale, work)

    def cut(n):
        return None if n is None else np.int32(min(n, T + S))

    return dict(
        offset=np.int32(0 if call.causal_alignment == "top_left" else S - T),
        left=cut(left),
        right=cut(right),
        chunk=cut(call.chunk_size),
        softcap=None if call.softcap is None else work(call.softcap),
        folded=work(folded),
        post=None if post is None else work(post),
        scale=work(call.scale),
        T=None if T == Tq else np.int32(T),
        S=np.int32(S),
    )


def _tiles(q, k, v, mask, alibi, opts: dict, Tb: int, Sb: int) -> Tiles:
    """The call's tiles, its options traced (``_traced_options``)."""
    window = (opts["left"], opts["right"])
    scale = (opts["folded"], opts["post"])
    return Tiles(
        q, k, v, mask, opts["offset"], window, opts["softcap"], opts["chunk"], Tb, Sb, alibi,
        scale, (opts["T"], opts["S"]),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("Tb", "Sb", "return_lse"))
def _flash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array | None,
    *,
    opts: dict,
    Tb: int,
    Sb: int,
    alibi: jax.Array | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Steps 1-7 on checked, batched inputs; compiled once per shape, dtype, tile size and
    set of options present (their values are traced: ``_traced_options``). With
    ``return_lse``, (out, lse), lse (B, H, T) each row's m + log l (step 8)."""
    B, H, T, _ = q.shape
    E = v.shape[-1]
    out_dtype = q.dtype
    tiles = _tiles(q, k, v, mask, alibi, opts, Tb, Sb)

    def query_block(i: jax.Array, carry: tuple) -> tuple:
        out, lse = carry
        # 1. Scores: every query of the block against every key, one key block at a time
        # (Tiles.scores). Every tile's product starts from this query tile, so
        # 2. Scale, so that the scores' spread does not grow with the head size D, is
        # applied to it once, here: Tb·D multiplies instead of Tb·S (a scale above 1 in
        # part, the rest an exact power of two on the products: flash_tiles.py).
        qi = tiles.queries(i)  # (B, K, G·Tb, D)
        # Steps 3-5 and 7, key block by key block (Tiles.online_softmax).
        m, l, acc = tiles.online_softmax(qi, i)
        if sinks is not None:
            m, l, acc = add_sink(m, l, acc, tiles.sink_rows(sinks))
        if return_lse:
            # 8. The log-sum-exp, m + log l: the pair the walk ends with holds it.
            lse_i = running_lse(m, l).reshape(B, H, Tb)  # (B, H, Tb)
            lse = lax.dynamic_update_slice_in_dim(lse, lse_i, i * Tb, axis=2)  # (B, H, Tp)
        # Normalise once at the end; a row that saw no key has l = 0 and acc = 0 -> 0.
        acc = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        acc = acc.reshape(B, H, Tb, E).astype(out_dtype)  # (B, H, Tb, E)
        out = lax.dynamic_update_slice_in_dim(out, acc, i * Tb, axis=2)  # (B, H, Tp, E)
        return out, lse

    out = jnp.zeros((B, H, tiles.Tp, E), dtype=out_dtype)  # (B, H, Tp, E)
    # A row's lse stays -inf where no query block reaches it (its keys all skipped).
    lse = jnp.full((B, H, tiles.Tp), -jnp.inf, tiles.work) if return_lse else None  # (B, H, Tp)
    out, lse = lax.fori_loop(0, tiles.nT_real, query_block, (out, lse))  # (B, H, Tp, E)
    if return_lse:
        return out[:, :, :T], lse[:, :, :T]  # (B, H, T, E), (B, H, T)
    return out[:, :, :T]  # (B, H, T, E), the padded rows cut off


@functools.partial(jax.jit, static_argnames=("Tb", "Sb"))
def _flash_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    sinks: jax.Array | None,
    d_out: jax.Array,
    *,
    d_lse: jax.Array,
    opts: dict,
    Tb: int,
    Sb: int,
    alibi: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """The backward on checked, batched inputs: (dq, dk, dv, dmask, dsinks), dmask shaped
    (B|1, H|1, T|1, S|1) with a float mask and dsinks (H,) with sinks, else None;
    compiled once per shape, dtype, tile size and set of options present."""
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    tiles = _tiles(q, k, v, mask, alibi, opts, Tb, Sb)
    work, G = tiles.work, tiles.G
    float_mask = mask is not None and mask.dtype != jnp.bool_
    d_out = jnp.pad(d_out, ((0, 0), (0, 0), (0, tiles.Tp - T), (0, 0)))  # (B, H, Tp, E)
    d_lse = jnp.pad(d_lse, ((0, 0), (0, 0), (0, tiles.Tp - T)))  # (B, H, Tp)

    def query_block(i: jax.Array, grads: tuple) -> tuple:
        dq, dk, dv, dm, ds = grads
        # Forward steps 1-5 and 7 for this block, as in ``attention``: its rows' output
        # O and log-sum-exp, the one number per row the backward needs. A row with no key
        # has l = 0: its lse is +inf, so that its weights exp(Z − lse) are all 0. A row
        # that read a +inf score has l = +inf: its lse is NaN, so that every weight of it
        # is NaN, as in the forward (SPEC §4.1), not only its +inf ones.
        qi = tiles.queries(i)  # (B, K, G·Tb, D)
        m, l, acc = tiles.online_softmax(qi, i)
        if sinks is not None:
            sink = tiles.sink_rows(sinks)  # (B, K, G·Tb)
            m, l, acc = add_sink(m, l, acc, sink)
        some = l > 0  # (B, K, G·Tb)
        o = acc / jnp.where(some, l, 1.0)[..., None]  # (B, K, G·Tb, E)
        lse = backward_lse(m, l)  # (B, K, G·Tb)

        # 5'. The softmax's row term, Δ = rowsum(dO ⊙ O): one dot product per row.
        do = lax.dynamic_slice_in_dim(d_out, i * Tb, Tb, axis=2).astype(work)
        do = do.reshape(B, K, G * Tb, E)  # (B, K, G·Tb, E)
        delta = (do * o).sum(axis=-1)  # (B, K, G·Tb)
        # 8'. The log-sum-exp's gradient joins Δ with the opposite sign (dZ += d_lse · P);
        # a row with no key has weights 0, so it reaches nothing there.
        dl = lax.dynamic_slice_in_dim(d_lse, i * Tb, Tb, axis=2).astype(work)  # (B, H, Tb)
        delta = delta - dl.reshape(B, K, G * Tb)  # (B, K, G·Tb)

        # 5'. Sinks: dsink = −Σ_t p_sink · Δ, p_sink = exp(sink − lse) (0 with no key).
        if sinks is not None:
            p_sink = jnp.where(some, jnp.exp(sink - lse), 0.0)  # (B, K, G·Tb)
            d_rows = -(p_sink * delta).reshape(B, K, G, Tb)  # (B, K, G, Tb)
            ds = ds + d_rows.sum(axis=(0, 3)).reshape(H)  # (H,)

        # The backward over the block's key blocks; dq gets the scale once, here.
        dq_i = jnp.zeros((B, K, G * Tb, D), dtype=work)  # (B, K, G·Tb, D)
        body = functools.partial(backward_tile, tiles, i, qi, do, lse, delta)
        dq_i, dk, dv, dm = tiles.walk(i, body, (dq_i, dk, dv, dm))
        dq_i = (dq_i * opts["scale"]).reshape(B, H, Tb, D).astype(q.dtype)  # (B, H, Tb, D)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * Tb, axis=2)  # (B, H, Tp, D)
        return dq, dk, dv, dm, ds

    grads = (
        jnp.zeros((B, H, tiles.Tp, D), dtype=q.dtype),  # dq: (B, H, Tp, D)
        jnp.zeros((B, K, tiles.Sp, D), dtype=work),  # dk: (B, K, Sp, D)
        jnp.zeros((B, K, tiles.Sp, E), dtype=work),  # dv: (B, K, Sp, E)
        jnp.zeros(tiles.mask.shape, dtype=work) if float_mask else None,  # dmask, padded
        None if sinks is None else jnp.zeros((H,), dtype=work),  # dsinks: (H,)
    )
    dq, dk, dv, dm, ds = lax.fori_loop(0, tiles.nT_real, query_block, grads)
    out = (
        dq[:, :, :T],  # (B, H, T, D)
        dk[:, :, :S].astype(q.dtype),  # (B, K, S, D)
        dv[:, :, :S].astype(q.dtype),  # (B, K, S, E)
    )
    if float_mask:
        t = T if mask.shape[2] != 1 else 1
        s = S if mask.shape[3] != 1 else 1
        out += (dm[:, :, :t, :s].astype(mask.dtype),)  # (B|1, H|1, T|1, S|1)
    else:
        out += (None,)
    return out + (None if sinks is None else ds.astype(sinks.dtype),)  # dsinks: (H,)
