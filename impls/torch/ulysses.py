"""DeepSpeed-Ulysses attention with torch.distributed: an all-to-all trades sequence shards
for head shards.

The same algorithm as JAX's ``jax/ulysses.py`` (read its docstring for why it is exact), written
the way PyTorch runs it: one process per rank, and the two all-to-alls as
``dist.all_to_all_single``, which gloo implements on the CPU with uneven splits (measured
with torch 2.13.0: even and uneven split sizes, zero included). Rank r starts with slice
r of the sequence for every head; the first all-to-all gives it the whole sequence for
its own heads, it runs ordinary attention on them, and the second all-to-all hands the
outputs back as sequence slices:

    before (sequence-sharded)          after all_to_all_single (head-sharded)
    rank 0: s0 of h0 … h6              rank 0: s0 s1 s2 s3 of h0 h1
    rank 1: s1 of h0 … h6         ->   rank 1: s0 s1 s2 s3 of h2 h3
    rank 2: s2 of h0 … h6              rank 2: s0 s1 s2 s3 of h4 h5
    rank 3: s3 of h0 … h6              rank 3: s0 s1 s2 s3 of h6

Which heads. As DeepSpeed's uneven all-to-all does (PR #6392, 7 heads on 4 ranks), the H
query heads are split as evenly as they go, the first H mod P ranks holding one more
(above: 2, 2, 2, 1); with H < P some ranks hold none and only pass data on. Query head h
uses key/value head h // G (G = H // K), so rank r receives exactly the key/value heads
its query heads use, a contiguous range; a head two ranks need is sent to both, and its
gradient is the sum of what both send back. Nothing is padded: the split sizes say who
gets what. Sinks and ALiBi's slopes are per query head, so rank r takes the slice of sinks
(H,) and of the slopes (B, H) that belongs to its query heads, and its dsinks come back
to be gathered in head order; ALiBi's distance |t + S − T − s| is taken on the tokens'
original positions, which every rank holds for the whole sequence.

Who runs the ranks. ``ulysses_attention`` and ``ulysses_attention_backward`` are the
per-rank functions, for a script under ``torchrun``. ``attention`` and ``attention_vjp``
are the single-process entries: they lay the sequence out with ``ring_layout.Layout``, as
``ring.py`` does (contiguous or zigzag; the result is the same either way), and hand each
rank its shard through ``run``, the caller's runner of P ranks; the torch-ulysses backend
passes ``process_pool.run_on_ranks``, so one set of P processes serves both backends.
Each rank's attention on its heads is ``naive.py``'s steps on the tokens' positions, with
its softcap and softmax (``naive.softcapped``, ``naive.softmax``).

Shape legend: B batch · H query heads · K key/value heads (H % K == 0) · G = H // K ·
T query length · S key/value length · D q/k head dim · E v head dim · P ranks ·
Tl, Sl the per-rank slice lengths, Tp = P·Tl, Sp = P·Sl the padded lengths ·
Hr the query heads and Kr the key/value heads on this rank.

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)

Supports: bool and float masks, causal (both alignments), windows, chunked local
attention, softcap, attention sinks, ALiBi, GQA, every dtype (computed in float32 or float64, rounded once), unbatched
inputs, and the backward pass (autograd on each rank's attention, dsinks included; the
all-to-alls' adjoints are the reverse all-to-alls). Also packed variable-length sequences
(``attention_packed``, SPEC §18, and its backward). Not supported: dropout.

Packed documents. The packed tokens are one sequence (B = 1), laid out as ``attention``'s
is; every rank gets each slot's document (padding belongs to none) and its position inside
it (a query's shifted by S_n − T_n for bottom-right alignment), as it gets the positions
above. After the first all-to-all the whole sequence is on the rank, so each document is
attended there on its own, its queries against its own keys, causality and the window
counted on the positions inside it; one product over the whole sequence with the other
documents' keys at -inf would multiply their weights of 0 by their values, and 0 · NaN =
NaN would carry one document's NaN into another's rows (SPEC §18.3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .. import contract
from .naive import log_sum_exp, softcapped, softmax
from .ring_layout import Layout, scale_split, sum_to


def head_split(H: int, K: int, P: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Which heads go where: (first query head, query heads, first key/value head,
    key/value heads) per rank, as lists of P ints."""
    G = H // K
    counts = [H // P + (r < H % P) for r in range(P)]  # as even as they go
    starts = [sum(counts[:r]) for r in range(P)]
    kv_starts = [s // G for s in starts]
    # The key/value heads of query heads [s, s + n): (s + n − 1)//G − s//G + 1, or none.
    kv_counts = [(s + n - 1) // G - s // G + 1 if n else 0 for s, n in zip(starts, counts)]
    return starts, counts, kv_starts, kv_counts


def ulysses_attention(
    q, k, v, tpos, spos, mask, sinks=None, slopes=None, tdoc=None, sdoc=None, *,
    opts: dict, heads: tuple, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One rank's share: (B, H, Tl, E), its sequence slice of every head's output.

    q (B, H, Tl, D), k (B, K, Sl, D), v (B, K, Sl, E) in the working dtype, this rank's
    sequence slice; tpos (Tp,), spos (Sp,) int64, the original position of every slot of
    the whole laid-out sequence (padding at >= T, >= S); mask (B|1, Hr|1, Tp|1, Sp|1) or
    None: this rank's heads, the whole sequence; sinks (Hr,) and ALiBi's slopes (B, Hr) of
    this rank's query heads, or None. ``heads`` is ``head_split(H, K, P)``.

    Packed documents (SPEC §18): tdoc (Tp,) and sdoc (Sp,) int64, every slot's document
    (-1 for padding, which belongs to none), with tpos and spos then the positions inside
    the document (a query's shifted by S_n − T_n for bottom-right alignment, so that
    ``opts["offset"]`` is 0) and no mask. Left out (None), the whole sequence is one
    document and padding is told by tpos >= T, spos >= S.

    With ``return_lse`` (not with documents), (out, lse): lse (B, H, Tl), each row's
    natural log-sum-exp in the working dtype (SPEC §21), the sink's term included, taken on
    the rank that holds the row's head and sent back as the output is.
    """
    qh, kh, vh = _to_heads(q, k, v, heads)
    out = _attention_on_heads(
        qh, kh, vh, tpos, spos, mask, sinks, slopes, tdoc, sdoc, opts, heads, return_lse
    )
    if not return_lse:
        return _to_sequence(out, heads[1])  # (B, H, Tl, E)
    out, lse = out
    lse = _to_sequence(lse[..., None], heads[1])[..., 0]  # (B, H, Tl)
    return _to_sequence(out, heads[1]), lse  # (B, H, Tl, E), (B, H, Tl)


def ulysses_attention_backward(
    q, k, v, tpos, spos, mask, d_out, sinks=None, slopes=None, tdoc=None, sdoc=None, *,
    opts: dict, heads: tuple,
):  # fmt: skip
    """One rank's share of the backward: (dq, dk, dv, dmask or None, dsinks or None).

    The arguments are ``ulysses_attention``'s and d_out (B, H, Tl, E), this rank's slice
    of ∂L/∂out. dq (B, H, Tl, D), dk (B, K, Sl, D), dv (B, K, Sl, E) are this rank's
    sequence slice (dk, dv summed over every rank that used the head); dmask
    (B|1, Hr|1, Tp|1, Sp|1) with a float mask and dsinks (Hr,) with sinks: this rank's
    heads.
    """
    me = dist.get_rank()
    # Forward to head shards, then autograd through this rank's attention only: the
    # adjoint of an all-to-all is the reverse all-to-all, done by hand below.
    qh, kh, vh = (x.detach().requires_grad_(True) for x in _to_heads(q, k, v, heads))
    leaves = [qh, kh, vh]
    float_mask = mask is not None and mask.dtype != torch.bool
    if float_mask:
        mask = mask.detach().requires_grad_(True)
        leaves.append(mask)
    if sinks is not None:
        sinks = sinks.detach().requires_grad_(True)
        leaves.append(sinks)
    (d_head,) = _to_heads_q(d_out, heads)  # (B, Hr, Tp, E)
    with torch.enable_grad():
        out = _attention_on_heads(
            qh, kh, vh, tpos, spos, mask, sinks, slopes, tdoc, sdoc, opts, heads
        )
    grads = [None] * len(leaves)
    if out.requires_grad:  # packed documents none of which has a key: out is 0, from no input
        grads = torch.autograd.grad(out, leaves, grad_outputs=d_head, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    dq = _to_sequence(grads[0], heads[1])  # (B, H, Tl, D)
    dk = _kv_to_sequence(grads[1], heads, k.shape[1], me)  # (B, K, Sl, D)
    dv = _kv_to_sequence(grads[2], heads, k.shape[1], me)  # (B, K, Sl, E)
    dmask = grads[3] if float_mask else None
    return dq, dk, dv, dmask, grads[-1] if sinks is not None else None


def _attention_on_heads(
    q, k, v, tpos, spos, mask, sinks, slopes, tdoc, sdoc, opts: dict, heads: tuple,
    return_lse: bool = False,
):  # fmt: skip
    """Attention of this rank's query heads over the whole sequence: (B, Hr, Tp, E), and
    with ``return_lse`` (no documents) its lse (B, Hr, Tp).

    q (B, Hr, Tp, D), k (B, Kr, Sp, D), v (B, Kr, Sp, E); sinks (Hr,), slopes (B, Hr) or
    None; tdoc (Tp,), sdoc (Sp,) the packed documents or None."""
    starts, counts, kv_starts, _ = heads
    me = dist.get_rank()
    G = opts["G"]
    # Each query head's own key/value head, by index: a rank's query heads need not be
    # whole groups of G.
    slot = torch.arange(starts[me], starts[me] + counts[me]) // G - kv_starts[me]  # (Hr,)
    k = k[:, slot]  # (B, Hr, Sp, D)
    v = v[:, slot]  # (B, Hr, Sp, E)
    if tdoc is None:
        return _attend(q, k, v, tpos, spos, mask, sinks, slopes, None, None, opts, return_lse)

    # Packed documents: the whole sequence is here, so each document is attended on its
    # own, its queries against its own keys only. One product over all of them, with the
    # other documents' keys blocked, would still multiply a weight of 0 by their values,
    # and 0 · NaN = NaN (SPEC §18.3).
    out = q.new_zeros((*q.shape[:3], v.shape[-1]))  # (B, Hr, Tp, E): padding, keyless rows 0
    for d in torch.unique(tdoc).tolist():
        rows = torch.nonzero(tdoc == d)[:, 0]  # (Tn,): the slots of its queries
        cols = torch.nonzero(sdoc == d)[:, 0]  # (Sn,): the slots of its keys
        if d < 0 or len(cols) == 0:
            continue  # padding, or a document with no key: its rows stay 0
        part = _attend(
            q[:, :, rows], k[:, :, cols], v[:, :, cols], tpos[rows], spos[cols],
            None, sinks, slopes, tdoc[rows], sdoc[cols], opts,
        )  # fmt: skip  # (B, Hr, Tn, E)
        out = out.index_copy(2, rows, part)  # (B, Hr, Tp, E)
    return out


def _attend(q, k, v, tpos, spos, mask, sinks, slopes, tdoc, sdoc, opts: dict, return_lse=False):
    """Attention of q (B, Hr, Tp, D) on k (B, Hr, Sp, D), v (B, Hr, Sp, E), each query
    head with its own key/value head: (B, Hr, Tp, E), and with ``return_lse`` its lse
    (B, Hr, Tp). tpos (Tp,), spos (Sp,) are the tokens' positions, tdoc, sdoc their
    documents or None; Tp and Sp here are the slots given, the whole sequence or one
    packed document's."""
    # Which keys each query may see: causality, the window, local-attention chunks and
    # padding (from the tokens' original positions), a bool mask, a float mask's -inf
    # entries. Chunks use floor division: a query at a negative position lies in a chunk
    # of no key. With documents the positions are inside them, so padding cannot be told
    # by position: the test is the same document instead (padding is in none).
    t = tpos[:, None] + opts["offset"]  # (Tp, 1)
    distance = spos[None, :] - t  # (Tp, Sp)
    if tdoc is None:
        allowed = (tpos < opts["T"])[:, None] & (spos < opts["S"])[None, :]  # (Tp, Sp)
    else:
        allowed = (tdoc[:, None] == sdoc[None, :]) & (sdoc >= 0)[None, :]  # (Tp, Sp)
    allowed = allowed & (distance >= opts["lo"]) & (distance <= opts["hi"])
    if opts["chunk"] is not None:
        allowed = allowed & (t // opts["chunk"] == spos[None, :] // opts["chunk"])
    if mask is not None:
        allowed = allowed & (mask if mask.dtype == torch.bool else mask != -torch.inf)
    # A key no query of its head may see must have no effect whatever it holds (0 · NaN
    # is NaN): its rows are replaced by 0, by selection, before they are used.
    used = allowed.any(dim=-2)  # (Sp,) or (B|1, Hr|1, Sp)
    k = torch.where(used[..., None], k, 0.0)  # (B, Hr, Sp, D)
    v = torch.where(used[..., None], v, 0.0)  # (B, Hr, Sp, E)

    # 1. Scores and 2. scale, folded into q (a scale above 1 only in part, the rest
    # multiplies the products: ``ring_layout.scale_split``).
    folded, post = scale_split(opts["scale"], torch.finfo(q.dtype).max)
    x = torch.einsum("bhtd,bhsd->bhts", q * folded, k)  # (B, Hr, Tp, Sp)
    if post is not None:
        x = x * post  # (B, Hr, Tp, Sp)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    x = softcapped(x, opts["softcap"])  # (B, Hr, Tp, Sp)

    # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query may
    # not see gets -inf. ALiBi's distance is from the bottom-right diagonal, on the tokens'
    # original positions (the layout permutes the slots, not the positions).
    if slopes is not None:
        distance = (tpos[:, None] + opts["S"] - opts["T"] - spos[None, :]).abs()  # (Tp, Sp)
        x = x - slopes[:, :, None, None] * distance.to(x.dtype)  # (B, Hr, Tp, Sp)
    if mask is not None and mask.dtype != torch.bool:
        x = x + mask
    x = torch.where(allowed, x, -torch.inf)  # (B, Hr, Tp, Sp)

    # 5. Softmax over the keys, the row max subtracted; a row with no key gets weights 0,
    # and a sink joins the max and the sum (naive.py's softmax: its Notes say why).
    w = softmax(x, sinks)  # (B, Hr, Tp, Sp)

    # 7. Weighted sum of the values.
    out = torch.einsum("bhts,bhse->bhte", w, v)  # (B, Hr, Tp, E)
    if not return_lse:
        return out

    # 8. The log-sum-exp of the scores step 4 made (naive.py's, on this rank's heads).
    return out, log_sum_exp(x, sinks, _Heads(H=x.shape[1]))  # (B, Hr, Tp, E), (B, Hr, Tp)


class _Heads(NamedTuple):
    """What ``naive.log_sum_exp`` reads of a call: the heads of the scores, batched."""

    H: int
    unbatched: bool = False


def _to_heads(q, k, v, heads: tuple):
    """Sequence shards -> head shards: every rank sends each rank its heads' slice."""
    (qh,) = _to_heads_q(q, heads)  # (B, Hr, Tp, D)
    _, _, kv_starts, kv_counts = heads
    parts = [(s, n) for s, n in zip(kv_starts, kv_counts)]
    kh = _all_to_all_heads(k, parts)  # (B, Kr, Sp, D)
    vh = _all_to_all_heads(v, parts)  # (B, Kr, Sp, E)
    return qh, kh, vh


def _to_heads_q(x, heads: tuple):
    starts, counts, _, _ = heads
    return (_all_to_all_heads(x, list(zip(starts, counts))),)


def _all_to_all_heads(x, parts):
    """x (B, N, Ll, F), this rank's slice of N heads; parts[r] = (first, count): the heads
    rank r gets. Returns (B, n, P·Ll, F): this rank's n heads over the whole sequence."""
    P, me = dist.get_world_size(), dist.get_rank()
    B, _, Ll, F = x.shape
    # all_to_all_single splits dim 0: heads first, one block of heads per rank, in order.
    send = torch.cat([x[:, s : s + n] for s, n in parts], dim=1)  # (B, Σn, Ll, F)
    send = send.permute(1, 0, 2, 3).contiguous()  # (Σn, B, Ll, F)
    n = parts[me][1]
    recv = send.new_empty((P * n, B, Ll, F))  # (P·n, B, Ll, F): rank-major
    dist.all_to_all_single(recv, send, [n] * P, [c for _, c in parts])
    recv = recv.reshape(P, n, B, Ll, F).permute(2, 1, 0, 3, 4)  # (B, n, P, Ll, F)
    return recv.reshape(B, n, P * Ll, F)  # (B, n, P·Ll, F)


def _to_sequence(x, counts: list[int]):
    """Head shards -> sequence shards: x (B, Hr, Tp, F), this rank's heads over the whole
    sequence; returns (B, H, Tl, F), this rank's slice of every head."""
    P = dist.get_world_size()
    B, n, Tp, F = x.shape
    Tl = Tp // P
    send = x.reshape(B, n, P, Tl, F).permute(2, 1, 0, 3, 4).contiguous()  # (P, n, B, Tl, F)
    send = send.reshape(P * n, B, Tl, F)  # (P·n, B, Tl, F): one block per rank
    recv = x.new_empty((sum(counts), B, Tl, F))  # (H, B, Tl, F)
    dist.all_to_all_single(recv, send, counts, [n] * P)
    return recv.permute(1, 0, 2, 3)  # (B, H, Tl, F)


def _kv_to_sequence(g, heads: tuple, K: int, me: int):
    """The reverse of the key/value all-to-all: g (B, Kr, Sp, F), the gradient of this
    rank's key/value heads; returns (B, K, Sl, F), this rank's slice of every key/value
    head, the copies other ranks used summed."""
    _, _, kv_starts, kv_counts = heads
    P = dist.get_world_size()
    B, n, Sp, F = g.shape
    Sl = Sp // P
    send = g.reshape(B, n, P, Sl, F).permute(2, 1, 0, 3, 4).contiguous()  # (P, n, B, Sl, F)
    send = send.reshape(P * n, B, Sl, F)  # (P·n, B, Sl, F)
    recv = g.new_empty((sum(kv_counts), B, Sl, F))  # (Σ Kr, B, Sl, F): rank-major
    dist.all_to_all_single(recv, send, kv_counts, [n] * P)
    index = torch.cat([torch.arange(s, s + c) for s, c in zip(kv_starts, kv_counts)])
    out = g.new_zeros((K, B, Sl, F)).index_add_(0, index, recv)  # (K, B, Sl, F)
    return out.permute(1, 0, 2, 3)  # (B, K, Sl, F)


# ----------------------------------------------------------------------------------------
# The single-process entry: lay out, hand each rank its shard, gather.

#: run(fn, shards, **kwargs): fn(*shards[r], **kwargs) on rank r of a P-process group,
#: the P results as NumPy, in rank order.
Runner = Callable[..., list]


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
    world_size: int = 2,
    layout: str = "zigzag",
    run: Runner,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Ulysses attention on ``world_size`` ranks run by ``run``; NumPy in and out.
    ``sinks`` (H,), ``chunk_size`` and ``alibi_slopes`` (H,) or (B, H) as in SPEC §15-§17;
    with ``return_lse``, (out, lse), lse (B, H, T) in float64 for float64 inputs and
    float32 otherwise (SPEC §21)."""
    # 0. Validate: the input contract every impl shares (the contract package).
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    mask = None if mask is None else np.asarray(mask)
    sinks = None if sinks is None else np.asarray(sinks)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap,
        dropout_p=dropout_p, unsupported={"dropout_p": "torch-ulysses has no dropout"},
        sinks=sinks, chunk_size=chunk_size, alibi_slopes=slopes,
    )  # fmt: skip
    lay = Layout(call, q, k, v, mask, None, world_size, layout, sinks, slopes)
    heads = head_split(call.H, call.K, lay.P)
    outs = run(
        ulysses_attention, _shards(lay, heads), opts=lay.opts, heads=heads,
        return_lse=return_lse,
    )  # fmt: skip  # P × (B, H, Tl, E), or P × ((B, H, Tl, E), (B, H, Tl))
    out = lay.outputs(outs, q.dtype, return_lse)  # (B, H, T, E), or with the lse (B, H, T)
    if call.unbatched:
        return tuple(x[0] for x in out) if return_lse else out[0]
    return out


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
    sinks=None,
    chunk_size: int | None = None,
    alibi_slopes=None,
    world_size: int = 2,
    layout: str = "zigzag",
    run: Runner,
) -> tuple[np.ndarray, ...]:
    """The backward: (dq, dk, dv), then dmask with a float mask and dsinks with sinks;
    NumPy in and out, shaped and typed like q, k, v, the mask (summed over its broadcast
    axes) and the sinks."""
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    mask = None if mask is None else np.asarray(mask)
    sinks = None if sinks is None else np.asarray(sinks)
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
    call = contract.check(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap, d_out=d_out,
        sinks=sinks, chunk_size=chunk_size, alibi_slopes=slopes,
    )  # fmt: skip
    lay = Layout(call, q, k, v, mask, d_out, world_size, layout, sinks, slopes)
    heads = head_split(call.H, call.K, lay.P)
    parts = run(ulysses_attention_backward, _shards(lay, heads), opts=lay.opts, heads=heads)
    grads = lay.qkv_grads(parts, q.dtype)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)
    if call.unbatched:
        grads = [g[0] for g in grads]
    if mask is not None and mask.dtype != np.bool_:
        dm = [g[3] for g in parts]  # P × (B|1, Hr|1, Tp|1, Sp|1)
        # Per-head masks come back as each rank's heads; a mask without a head axis was
        # the same on every rank, so its gradient is the sum of theirs.
        dm = np.concatenate(dm, axis=1) if lay.mask.shape[1] != 1 else np.sum(dm, axis=0)
        if dm.shape[2] != 1:
            dm = lay.rows_back(dm)
        if dm.shape[3] != 1:
            dm = lay.cols_back(dm, 3)
        grads.append(sum_to(dm, mask.shape).astype(mask.dtype))
    if sinks is not None:
        # Each rank's heads' dsinks, gathered in head order (the ranks hold heads in order).
        grads.append(np.concatenate([g[4] for g in parts]).astype(sinks.dtype))  # (H,)
    return tuple(grads)


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
    world_size: int = 2,
    layout: str = "zigzag",
    run: Runner,
) -> np.ndarray:
    """Packed variable-length sequences (SPEC §18) on ``world_size`` ranks run by ``run``;
    NumPy in and out.

    q (H, T, D), k (K, S, D), v (K, S, E) hold N documents one after another, document n
    being queries cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:
    cu_seqlens_k[n + 1]; out (H, T, E). The packed tokens are one sequence (B = 1), laid
    out as ``attention``'s is; every rank gets each slot's document and its position
    inside it, and after the all-to-all, with the whole sequence at hand, attends each
    document on its own.
    """
    # 0. Validate: the input contract every impl shares (the contract package).
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    call, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap,
    )  # fmt: skip
    lay = Layout(call, q, k, v, None, None, world_size, layout, documents=(cu_q, cu_k))
    heads = head_split(call.H, call.K, lay.P)
    outs = run(
        ulysses_attention, _shards(lay, heads), opts=lay.opts, heads=heads
    )  # P × (1, H, Tl, E)
    out = lay.rows_back(np.concatenate(outs, axis=2)).astype(q.dtype)  # (1, H, T, E)
    return out[0]  # (H, T, E)


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
    world_size: int = 2,
    layout: str = "zigzag",
    run: Runner,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The backward of ``attention_packed``: (dq, dk, dv) for d_out (H, T, E), shaped and
    typed like q, k and v; the boundaries are integers and get no gradient."""
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    call, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap, d_out=d_out,
    )  # fmt: skip
    lay = Layout(call, q, k, v, None, d_out, world_size, layout, documents=(cu_q, cu_k))
    heads = head_split(call.H, call.K, lay.P)
    parts = run(ulysses_attention_backward, _shards(lay, heads), opts=lay.opts, heads=heads)
    return tuple(g[0] for g in lay.qkv_grads(parts, q.dtype))  # (H, T, D), (K, S, D), (K, S, E)


def _shards(lay: Layout, heads: tuple) -> list[tuple]:
    """Each rank's shard, in ``ulysses_attention``'s (or, with d_out, the backward's) order
    of arguments: its sequence slice of q, k, v (and d_out), every slot's position and
    document, and of the mask (the whole sequence), the sinks (H,) and the slopes (B, H)
    the part of its own query heads."""
    starts, counts, _, _ = heads
    shards = []
    for r in range(lay.P):
        rows = slice(r * lay.Tl, (r + 1) * lay.Tl)
        cols = slice(r * lay.Sl, (r + 1) * lay.Sl)
        own = slice(starts[r], starts[r] + counts[r])  # this rank's query heads
        m = lay.mask
        if m is not None and m.shape[1] != 1:
            m = m[:, own]  # (B|1, Hr, Tp|1, Sp|1)
        shard = (lay.q[:, :, rows], lay.k[:, :, cols], lay.v[:, :, cols], lay.tpos, lay.spos, m)
        if lay.d_out is not None:
            shard += (lay.d_out[:, :, rows],)
        shard += (None if lay.sinks is None else lay.sinks[own],)  # (Hr,)
        shard += (None if lay.slopes is None else lay.slopes[:, own],)  # (B, Hr)
        shard += (lay.tdoc, lay.sdoc)  # (Tp,), (Sp,) or None
        shards.append(shard)
    return shards
