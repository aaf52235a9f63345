"""Split-KV decoding (flash-decoding) in NumPy: the keys cut into chunks, the pieces merged.

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

``attention_paged`` is the same over a paged KV cache (``paged.py``'s call): each
sequence's keys read from the pages its table lists, then chunked and merged.

Shapes: the core page's (``attention.py``), and Sc the keys of one chunk.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .. import contract
from .attention import visible
from .merge import merge_states

#: Keys per chunk when ``num_splits`` is left out: chunks of at most this many keys.
CHUNK = 1024


@np.errstate(over="ignore", invalid="ignore", divide="ignore")
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
    # 0. Check the inputs; add the batch axis; the working precision.
    dtype = np.asarray(q).dtype
    work = np.float64 if dtype == np.float64 else np.float32
    call, q, k, v, mask, slopes = batched(
        q, k, v, mask, num_splits, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap,
        dropout_p=dropout_p, sinks=sinks, chunk_size=chunk_size, alibi_slopes=alibi_slopes,
        flags={"return_lse": return_lse},
    )  # fmt: skip

    # 1. The empty state: a row that has seen no key yet, (0, -inf).
    o = np.zeros((call.B, call.H, call.T, call.E), dtype=work)  # (B, H, T, E)
    lse = np.full((call.B, call.H, call.T), -np.inf, dtype=work)  # (B, H, T)

    # 2. Each chunk of keys attended on its own, and its piece merged in.
    for s0, s1 in chunks(call.S, num_splits):
        o_c, lse_c = attend_chunk(q, k, v, mask, slopes, call, s0, s1, work)
        o, lse = merge_states(o, lse, o_c, lse_c)  # (B, H, T, E), (B, H, T)

    # 3. The sinks, one more piece each row, with no value.
    if sinks is not None:
        o, lse = merge_states(o, lse, *sink_piece(sinks, lse, o))
    return as_given(o, lse, dtype, call, return_lse)


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
    num_splits: int | None = None,
) -> np.ndarray:
    """Split-KV decoding over a paged KV cache (``paged.py``'s call): each sequence's keys
    read from the pages its table lists, then ``attention`` on them, chunked and merged;
    its T queries are its last T positions, so causality and the window are placed
    bottom-right against its own length. out (B, H, T, E) in q's dtype."""
    q, k_pages, v_pages = np.asarray(q), np.asarray(k_pages), np.asarray(v_pages)
    block_table, seq_lens = np.asarray(block_table), np.asarray(seq_lens)
    call = contract.check_paged(
        q, k_pages, v_pages, block_table, seq_lens,
        is_causal=is_causal, scale=scale, window=window, softcap=softcap,
    )  # fmt: skip
    rows = []
    for b in range(call.B):
        n = call.seq_lens[b]
        pages = np.asarray(call.pages[b], dtype=np.int64)  # (⌈n / L⌉,): the pages it reads
        k = k_pages[pages].transpose(1, 0, 2, 3).reshape(call.K, -1, call.D)[:, :n]  # (K, n, D)
        v = v_pages[pages].transpose(1, 0, 2, 3).reshape(call.K, -1, call.E)[:, :n]  # (K, n, E)
        out = attention(
            q[b : b + 1], k[None], v[None], is_causal=call.is_causal,
            causal_alignment="bottom_right", scale=call.scale, window=call.window,
            softcap=call.softcap, num_splits=num_splits,
        )  # fmt: skip
        rows.append(out)  # (1, H, T, E)
    return np.concatenate(rows, axis=0)  # (B, H, T, E)


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
    k_c = np.repeat(k[:, :, s0:s1].astype(work), call.G, axis=1)  # (B, H, Sc, D)
    v_c = np.repeat(v[:, :, s0:s1].astype(work), call.G, axis=1)  # (B, H, Sc, E)

    # 1.-2. The chunk's scores, scaled.
    x = np.matmul(q, k_c.transpose(0, 1, 3, 2)) * work(call.scale)  # (B, H, T, Sc)

    # 3. Softcap; 4. ALiBi's bias and the masks, every key a query may not see at -inf.
    if call.softcap is not None:
        x = call.softcap * np.tanh(x / call.softcap)  # (B, H, T, Sc)
    if slopes is not None:
        x = x + alibi_bias(slopes, call, s0, s1)  # (B, H, T, Sc)
    allowed = visible_in_chunk(call, s0, s1)  # (T, Sc)
    if mask is not None and mask.dtype == np.bool_:
        allowed = allowed & mask[..., s0:s1]  # (B|1, H|1, T, Sc)
    elif mask is not None:
        m_c = mask[..., s0:s1].astype(work)  # (B|1, H|1, T, Sc)
        x = x + m_c  # (B, H, T, Sc)
        allowed = allowed & (m_c != -np.inf)  # (B|1, H|1, T, Sc)
    x = np.where(allowed, x, -np.inf)  # (B, H, T, Sc)
    v_c = unseen_values_zeroed(v_c, allowed)  # (B, H, Sc, E)

    # 5. The chunk's softmax, against its own maximum; 7. its weighted sum of values.
    m = finite_or_0(x.max(axis=-1, keepdims=True, initial=-np.inf))  # (B, H, T, 1)
    p = np.exp(x - m)  # (B, H, T, Sc)
    l = p.sum(axis=-1)  # (B, H, T)
    o_c = np.matmul(p, v_c) / np.where(l == 0, 1.0, l)[..., None]  # (B, H, T, E)

    # Its log-sum-exp: m + log l, and -inf for a row that saw no key of the chunk.
    lse_c = np.where(l == 0, -np.inf, m[..., 0] + np.log(np.where(l == 0, 1.0, l)))  # (B, H, T)
    return o_c, lse_c


def visible_in_chunk(call: contract.Checked, s0: int, s1: int) -> np.ndarray:
    """Which keys s0:s1 each query may see by position, (T, Sc): the core page's
    ``visible`` on the chunk's positions, from the queries' diagonals (key t, or
    t + S - T bottom-right)."""
    offset = 0 if call.causal_alignment == "top_left" else call.S - call.T
    t = np.arange(call.T)[:, None] + offset  # (T, 1): each query's diagonal
    s = np.arange(s0, s1)[None, :]  # (1, Sc)
    allowed = np.ones((call.T, s1 - s0), dtype=bool)  # (T, Sc)
    return visible(allowed, t, s, call.is_causal, call.window, call.chunk_size)  # (T, Sc)


def alibi_bias(slopes: np.ndarray, call: contract.Checked, s0: int, s1: int) -> np.ndarray:
    """ALiBi's bias on the chunk, (B|1, H, T, Sc): −slope · |t + S − T − s|."""
    t = np.arange(call.T)[:, None]  # (T, 1)
    s = np.arange(s0, s1)[None, :]  # (1, Sc)
    return -slopes * np.abs(t + call.S - call.T - s).astype(slopes.dtype)  # (B|1, H, T, Sc)


def sink_piece(sinks: np.ndarray, lse: np.ndarray, o: np.ndarray):
    """The sinks as a piece of their own: o = 0 and lse = sinks[h] in every row of head h
    that saw a key, the empty state (0, -inf) in a row that saw none."""
    logits = np.asarray(sinks).astype(lse.dtype).reshape(1, -1, 1)  # (1, H, 1)
    return np.zeros_like(o), np.where(lse > -np.inf, logits, -np.inf)  # (B, H, T, E), (B, H, T)


def as_given(o, lse, dtype, call: contract.Checked, return_lse: bool):
    """The output in q's dtype (rounded once) and the log-sum-exp, without the batch axis
    for unbatched inputs."""
    o = o.astype(dtype)  # (B, H, T, E)
    if call.unbatched:
        o, lse = o[0], lse[0]  # (H, T, E), (H, T)
    return (o, lse) if return_lse else o


def batched(q, k, v, mask, num_splits, **options):
    """Step 0: the input contract's checks; then the batch axis, the mask as (B|1, H|1, T,
    S) (a view), q and ALiBi's slopes ((B|1, H, 1, 1)) in the working precision."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    if options["alibi_slopes"] is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    call = contract.check(
        q, k, v, mask=mask, **options,
        unsupported={"dropout_p": "split-KV decoding has no dropout"},
        tiles={} if num_splits is None else {"num_splits": num_splits},
    )  # fmt: skip
    work = np.float64 if q.dtype == np.float64 else np.float32
    if call.unbatched:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D), (1, K, S, D), (1, K, S, E)
    if mask is not None:
        b, h = call.mask_shape[:2]
        mask = np.broadcast_to(mask.reshape(call.mask_shape), (b, h, call.T, call.S))
    slopes = options["alibi_slopes"]
    if slopes is not None:
        slopes = slopes.astype(work).reshape(-1, call.H, 1, 1)  # (B|1, H, 1, 1)
    return call, q.astype(work), k, v, mask, slopes


# --- Edge cases -----------------------------------------------------------------------------
#
# A chunk with no key a row may see (the causal triangle, a window, a mask, an empty
# chunk when S < num_splits) gives that row the empty state (0, -inf), which the merge
# leaves out exactly (SPEC §22.2); a row that sees no key of any chunk stays (0, -inf):
# output 0, lse -inf (§4.3, §21).
# Overflow and NaN (SPEC §4.1, §4.9): a +inf score makes its chunk's sum +inf or NaN and
# its lse +inf or NaN, and the merge makes the row NaN (§22.7); a NaN score, NaN. Their
# warnings are IEEE's answers, not faults: silenced by ``attention``'s errstate.
# Blocked keys (SPEC §4.7): a value row that no query of the chunk may see is replaced by 0
# before the product, since its weight 0 times a NaN held there is NaN.


def finite_or_0(row_max: np.ndarray) -> np.ndarray:
    """A chunk's row maximum, 0 where it is not finite: a row that sees no key of the
    chunk takes its exponents against 0 (exp(-inf) = 0), not against -inf (NaN)."""
    return np.where(np.isfinite(row_max), row_max, 0.0)  # (B, H, T, 1)


def unseen_values_zeroed(v_c: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The chunk's value rows (B, H, Sc, E), those no query may see replaced by 0."""
    used = np.any(allowed, axis=-2)[..., None]  # (B|1, H|1, Sc, 1) or (Sc, 1)
    return np.where(used, v_c, 0.0)  # (B, H, Sc, E)
