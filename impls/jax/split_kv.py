"""Split-KV decoding (flash-decoding) in JAX: the keys cut into chunks, the pieces merged.

    out = merge over chunks c of attention(q, k[c], v[c])          (merge.py's merge_states)

A decoding step has a handful of queries (T = 1 per sequence) and a long key/value cache
(S in the thousands). Blockwise attention (``flash.py``) walks the keys one block after
another for each query block, and with one query block per head the only work to run
in parallel is the B·H walks, one per sequence and head: too few, at small batches, to
fill a device of a hundred cores or more. Flash-decoding cuts the cache into
``num_splits`` chunks of consecutive keys instead, attends each chunk on its own,
independently (on a GPU, one thread block per chunk), and merges the chunks' partial states:

    for each chunk c:   o_c   = softmax(scores over c's keys) · v[c]      (B, H, T, E)
                        lse_c = log Σ_{s in c} exp(score[s])              (B, H, T)
    (o, lse) = merge_states(… merge_states(merge_states(empty, c_1), c_2) …, c_n)

The merge (``merge.py``) is exact: attention over the union of disjoint key sets from
each set's (o, lse). No array ever spans two chunks: the largest is a chunk's scores,
(B, H, T, ⌈S / num_splits⌉), never the (B, H, T, S) matrix of the core page.

A sink (one logit per query head) belongs to no chunk: it is merged as one more piece,
with o = 0 (it has no value) and lse = the sink, in every row that sees a key.

Shapes: the core page's (``attention.py``), and Sc the keys of one chunk.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp

from .. import contract
from .attention import visible
from .merge import merged as merge_states

#: Keys per chunk when ``num_splits`` is left out: chunks of at most this many keys.
CHUNK = 1024


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
    sinks: jax.Array | None = None,
    chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """Attention as ``num_splits`` chunks of keys, each attended on its own, merged.

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap, sinks,
        chunk_size, alibi_slopes: as for the core page's ``attention``.
      dropout_p: must be 0; dropout is not supported here.
      num_splits: the number of chunks; None: ⌈S / 1024⌉ (at least 1).
      return_lse: also return each row's log-sum-exp.

    Returns:
      out (B, H, T, E) in q's dtype, or (H, T, E) unbatched; with ``return_lse``,
      (out, lse), lse (B, H, T) (or (H, T)) in float64 for float64 q, float32 otherwise.
    """
    # 0. Check the inputs; the steps run compiled, one program per shape and options.
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask = None if mask is None else jnp.asarray(mask)
    sinks = None if sinks is None else jnp.asarray(sinks)
    alibi_slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap,
        dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size, alibi_slopes=alibi_slopes,
        unsupported={"dropout_p": "split-KV decoding has no dropout"},
        tiles={} if num_splits is None else {"num_splits": num_splits},
        flags={"return_lse": return_lse},
    )  # fmt: skip
    o, lse = compiled(q, k, v, mask, sinks, alibi_slopes, call=call, num_splits=num_splits)
    return (o, lse) if return_lse else o


@functools.partial(jax.jit, static_argnames=("call", "num_splits"))
def compiled(q, k, v, mask, sinks, alibi_slopes, *, call, num_splits):
    """``attention``'s steps 1 to 3 under ``jax.jit``: (out, lse) as given back."""
    dtype = q.dtype
    work = jnp.float64 if dtype == jnp.float64 else jnp.float32
    q, k, v, mask, slopes = batched(q, k, v, mask, alibi_slopes, call, work)

    # 1. The empty state: a row that has seen no key yet, (0, -inf).
    o = jnp.zeros((call.B, call.H, call.T, call.E), dtype=work)  # (B, H, T, E)
    lse = jnp.full((call.B, call.H, call.T), -jnp.inf, dtype=work)  # (B, H, T)

    # 2. Each chunk of keys attended on its own, and its piece merged in.
    for s0, s1 in chunks(call.S, num_splits):
        o_c, lse_c = attend_chunk(q, k, v, mask, slopes, call, s0, s1, work)
        o, lse = merge_states(o, lse, o_c, lse_c)  # (B, H, T, E), (B, H, T)

    # 3. The sinks, one more piece each row, with no value.
    if sinks is not None:
        o, lse = merge_states(o, lse, *sink_piece(sinks, lse, o))
    return as_given(o, lse, dtype, call)


def chunks(S: int, num_splits: int | None) -> list[tuple[int, int]]:
    """The chunks' key ranges [s0, s1): ``num_splits`` of them, of lengths that differ by
    at most one (some empty when S < num_splits)."""
    n = max(1, math.ceil(S / CHUNK)) if num_splits is None else num_splits
    bounds = [S * i // n for i in range(n + 1)]
    return list(itertools.pairwise(bounds))


def attend_chunk(q, k, v, mask, slopes, call: contract.Checked, s0: int, s1: int, work):
    """Attention over keys s0:s1 alone: its partial state (o_c (B, H, T, E), lse_c (B, H,
    T)), the core page's steps 1 to 7 on the chunk's scores (B, H, T, Sc)."""
    # Grouped-query attention: query head h reads key/value head h // G.
    k_c = jnp.repeat(k[:, :, s0:s1].astype(work), call.G, axis=1)  # (B, H, Sc, D)
    v_c = jnp.repeat(v[:, :, s0:s1].astype(work), call.G, axis=1)  # (B, H, Sc, E)

    # 1.-2. The chunk's scores, scaled.
    x = jnp.matmul(q, jnp.swapaxes(k_c, -1, -2)) * jnp.asarray(call.scale, work)  # (B, H, T, Sc)

    # 3. Softcap; 4. ALiBi's bias and the masks, every key a query may not see at -inf.
    if call.softcap is not None:
        x = call.softcap * jnp.tanh(x / call.softcap)  # (B, H, T, Sc)
    if slopes is not None:
        x = x + alibi_bias(slopes, call, s0, s1)  # (B, H, T, Sc)
    allowed = visible_in_chunk(call, s0, s1)  # (T, Sc)
    if mask is not None and mask.dtype == jnp.bool_:
        allowed = allowed & mask[..., s0:s1]  # (B|1, H|1, T, Sc)
    elif mask is not None:
        m_c = mask[..., s0:s1].astype(work)  # (B|1, H|1, T, Sc)
        x = x + m_c  # (B, H, T, Sc)
        allowed = allowed & (m_c != -jnp.inf)  # (B|1, H|1, T, Sc)
    x = jnp.where(allowed, x, -jnp.inf)  # (B, H, T, Sc)
    v_c = unseen_values_zeroed(v_c, allowed)  # (B, H, Sc, E)

    # 5. The chunk's softmax, against its own maximum; 7. its weighted sum of values.
    m = finite_or_0(jnp.max(x, axis=-1, keepdims=True, initial=-jnp.inf))  # (B, H, T, 1)
    p = jnp.exp(x - m)  # (B, H, T, Sc)
    l = p.sum(axis=-1)  # (B, H, T)
    o_c = jnp.matmul(p, v_c) / jnp.where(l == 0, 1.0, l)[..., None]  # (B, H, T, E)

    # Its log-sum-exp: m + log l, and -inf for a row that saw no key of the chunk.
    lse_c = jnp.where(l == 0, -jnp.inf, m[..., 0] + jnp.log(jnp.where(l == 0, 1.0, l)))  # (B, H, T)
    return o_c, lse_c


def visible_in_chunk(call: contract.Checked, s0: int, s1: int) -> jax.Array:
    """Which keys s0:s1 each query may see by position, (T, Sc): the core page's
    ``visible`` on the chunk's positions, from the queries' diagonals (key t, or
    t + S - T bottom-right)."""
    offset = 0 if call.causal_alignment == "top_left" else call.S - call.T
    t = jnp.arange(call.T)[:, None] + offset  # (T, 1): each query's diagonal
    s = jnp.arange(s0, s1)[None, :]  # (1, Sc)
    allowed = jnp.ones((call.T, s1 - s0), dtype=bool)  # (T, Sc)
    return visible(allowed, t, s, call.is_causal, call.window, call.chunk_size)  # (T, Sc)


def alibi_bias(slopes: jax.Array, call: contract.Checked, s0: int, s1: int) -> jax.Array:
    """ALiBi's bias on the chunk, (B|1, H, T, Sc): −slope · |t + S − T − s|."""
    t = jnp.arange(call.T)[:, None]  # (T, 1)
    s = jnp.arange(s0, s1)[None, :]  # (1, Sc)
    return -slopes * jnp.abs(t + call.S - call.T - s).astype(slopes.dtype)  # (B|1, H, T, Sc)


def sink_piece(sinks: jax.Array, lse: jax.Array, o: jax.Array):
    """The sinks as a piece of their own: o = 0 and lse = sinks[h] in every row of head h
    that saw a key, the empty state (0, -inf) in a row that saw none."""
    logits = sinks.astype(lse.dtype).reshape(1, -1, 1)  # (1, H, 1)
    return jnp.zeros_like(o), jnp.where(lse > -jnp.inf, logits, -jnp.inf)  # (B, H, T, E), (B, H, T)


def as_given(o, lse, dtype, call: contract.Checked):
    """The output in q's dtype (rounded once) and the log-sum-exp, without the batch axis
    for unbatched inputs."""
    o = o.astype(dtype)  # (B, H, T, E)
    if call.unbatched:
        o, lse = o[0], lse[0]  # (H, T, E), (H, T)
    return o, lse


def batched(q, k, v, mask, slopes, call: contract.Checked, work):
    """The batch axis, the mask as (B|1, H|1, T, S) (a broadcast), q and ALiBi's slopes
    ((B|1, H, 1, 1)) in the working precision."""
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = jnp.broadcast_to(mask.reshape(call.mask_shape), (b, h, call.T, call.S))
    if slopes is not None:
        slopes = slopes.astype(work).reshape(-1, call.H, 1, 1)  # (B|1, H, 1, 1)
    return q.astype(work), k, v, mask, slopes


# --- Edge cases -----------------------------------------------------------------------------
#
# A chunk with no key a row may see (the causal triangle, a window, a mask, an empty
# chunk when S < num_splits) gives that row the empty state (0, -inf), which the merge
# leaves out exactly (SPEC §22.2); a row that sees no key of any chunk stays (0, -inf):
# output 0, lse -inf (§4.3, §21).
# Overflow and NaN (SPEC §4.1, §4.9): a +inf score makes its chunk's sum +inf or NaN and
# its lse +inf or NaN, and the merge makes the row NaN (§22.7); a NaN score, NaN. Their
# warnings are IEEE's answers, not faults (JAX gives none).
# Blocked keys (SPEC §4.7): a value row that no query of the chunk may see is replaced by 0
# before the product, since its weight 0 times a NaN held there is NaN.


def finite_or_0(row_max: jax.Array) -> jax.Array:
    """A chunk's row maximum, 0 where it is not finite: a row that sees no key of the
    chunk takes its exponents against 0 (exp(-inf) = 0), not against -inf (NaN)."""
    return jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)


def unseen_values_zeroed(v_c: jax.Array, allowed: jax.Array) -> jax.Array:
    """The chunk's value rows (B, H, Sc, E), those no query may see replaced by 0."""
    used = jnp.any(allowed, axis=-2)[..., None]  # (B|1, H|1, Sc, 1) or (Sc, 1)
    return jnp.where(used, v_c, 0.0)  # (B, H, Sc, E)
