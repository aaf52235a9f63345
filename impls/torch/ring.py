"""Ring attention with torch.distributed: P processes, key/value blocks passed round a ring.

The same algorithm as JAX's ``jax/ring.py`` (read its docstring for why the merge is exact
and where the causal imbalance comes from), written the way PyTorch runs it: one process
per rank, a process group created once (gloo on CPU, nccl with CUDA), and the ring as
point-to-point ``batch_isend_irecv``. Rank r keeps its query slice; at step j it holds the
key/value slice of rank (r − j) mod P, and while it computes on it, the slice is already on
its way to rank r + 1:

    step          rank 0        rank 1        rank 2        rank 3
    0             q0 · kv0      q1 · kv1      q2 · kv2      q3 · kv3
    1             q0 · kv3      q1 · kv0      q2 · kv1      q3 · kv2
    2             q0 · kv2      q1 · kv3      q2 · kv0      q3 · kv1
    3             q0 · kv1      q1 · kv2      q2 · kv3      q3 · kv0
                  send to r + 1 and receive from r − 1, overlapped with the step's compute

Each rank attends each block on its own, giving its partial state (o_b, m_b, l_b): output,
largest score, sum of exp(score − m_b). ``merge.py``'s ``merge_partials`` (SPEC §22, the
stable form) merges it into the rows' state, carried as (o, m, l) in the working
precision: an lse rounded to float32 near 1e4 is off by 4.9e-4, and so would be every
later weight of it (``merge.py``, the second step). Blocks no query of the slice may see
(causal, window, padding) are skipped; it returns o (0 for a row with no key) and lse.
Layouts (contiguous, or zigzag to balance causal work), and how positions and documents
travel with the tokens: ``ring_layout.py``.

``ring_attention`` is the per-rank function: a user's own ``torchrun`` script calls it on
its shards (``examples/torch_ring_torchrun.py``). ``attention`` is the single-process
entry: it lays the sequence out, runs each rank's shard on the worker pool of
``process_pool.py`` (``run_on_ranks``), and gathers the result.

Shape legend: B batch · H query heads · K key/value heads (H % K == 0) · G = H // K ·
T query length · S key/value length · D q/k head dim · E v head dim · P ranks ·
Tl, Sl the per-rank slice lengths, Tp = P·Tl, Sp = P·Sl the padded lengths · Tc, Sc a
piece's (zigzag: two per slice) · Tr, Sr the query rows and keys of one block (of one
document in it, when packed).

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)

Sinks and ALiBi, as in JAX's ring: a sink joins each row's softmax once, folded into
(m, l, a) after the last step of the ring (once per step it would count P times), and its
gradient dsinks[h] = −Σ_t p_sink·(dO·O) is summed over this rank's rows and then over the
ranks (``dist.all_reduce``); ALiBi's bias −slope·|t + S − T − s| is computed per block from
the tokens' global positions, which travel with them, so it holds in both layouts and
with padding. Sinks (H,) and slopes (B, H) are small: every rank gets all of them.

Supports: bool and float masks, causal (both alignments), windows, chunked local
attention, softcap, attention sinks, ALiBi, GQA (no repeated heads built), every dtype
(computed in float32 or float64, rounded once), unbatched inputs, and the backward pass
(dsinks included). Chunked local attention is one more test on the tokens' positions, like
the window, so a block with no key in its queries' chunks is skipped like one above the
causal diagonal. Also packed variable-length sequences (``attention_packed``, SPEC §18,
and its backward). Not supported: dropout.

Packed documents. Each token carries its document and its position inside it round the
ring, so document membership is one more test on the tokens: a key is allowed only if its
document is the query's, and a block whose queries and keys share no document is skipped.
Inside a block that holds several documents each is computed on its own, its rows against
its keys: one product over the block, with the other documents' keys at -inf, would still
multiply their weights of 0 by their values, and 0 · NaN = NaN would carry one document's
NaN into another's rows (SPEC §18.3). The backward splits its blocks the same way.

The backward (``ring_attention_backward``) is a second ring, written by hand because
autograd does not differentiate point-to-point communication. The forward's per-row
log-sum-exp L = m + log l fixes every weight on its own, P = exp(x − L), so each key/value
block's share of the gradient needs only that block (NumPy's ``backward.py`` derives the
steps):

    dV_j += Pᵀ·dO        dP = dO·V_jᵀ        dZ = P ⊙ (dP − rowsum(dO ⊙ O))
    dK_j += dRᵀ·q        dq += dR·K_j        (dR: dZ through softcap and the scale)

dq stays on its rank; dK_j and dV_j travel round the ring with block j, each rank adding
its rows' share, and after the last step one more hop brings them home to the block's
owner. Every step computes with the block it holds, so a stale block cannot pass
(SPEC §14.4).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from .. import contract
from .merge import divisor, merge_partials, union_lse
from .process_pool import run_on_ranks
from .ring_layout import Layout, scale_split, sum_to


def ring_attention(
    q, k, v, tpos, spos, mask, sinks=None, slopes=None, tdoc=None, sdoc=None, *,
    opts: dict, pieces: int, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One rank's share: its query slice against every key/value slice in turn.

    q (B, H, Tl, D), k (B, K, Sl, D), v (B, K, Sl, E) in the working dtype; tpos (Tl,),
    spos (Sl,) int64, the original positions (padding at >= T, >= S); mask (B|1, H|1,
    Tl|1, Sp|1) or None: this rank's rows, every column in the layout's order; sinks (H,)
    and ALiBi's slopes (B, H) in the working dtype, the same on every rank, or None. The
    process group is the default one; every rank calls this with its own shard.

    Packed documents (SPEC §18): tdoc (Tl,) and sdoc (Sl,) int64, each token's document
    (-1 for padding, which belongs to none), with tpos and spos then the positions inside
    the document (a query's shifted by S_n − T_n for bottom-right alignment, so that
    ``opts["offset"]`` is 0) and no mask. Left out (None), the whole sequence is one
    document and padding is told by tpos >= T, spos >= S.

    With ``return_lse``, (out, lse): lse (B, H, Tl), each row's natural log-sum-exp in the
    working dtype (SPEC §21), the sink's term included.
    """
    out, lse = _ring_forward(
        q, k, v, tpos, spos, mask, sinks, slopes, tdoc, sdoc, opts=opts, pieces=pieces
    )
    return (out, lse) if return_lse else out  # (B, H, Tl, E), (B, H, Tl)


def _ring_forward(q, k, v, tpos, spos, mask, sinks, slopes, tdoc, sdoc, *, opts, pieces):
    """The forward ring: (out (B, H, Tl, E), lse (B, H, Tl)), lse = -inf for a row with
    no key; the sink, if any, is in lse."""
    P, me = dist.get_world_size(), dist.get_rank()
    B, H, Tl, D = q.shape
    _, K, Sl, _ = k.shape
    E = v.shape[-1]
    G = H // K
    Tc, Sc = Tl // pieces, Sl // pieces  # rows and keys per piece (zigzag: two pieces)
    work = q.dtype
    # What travels round the ring: the key/value slice and its tokens' positions and
    # documents; it must be contiguous.
    travel = [None if x is None else x.contiguous() for x in (k, v, spos, sdoc)]

    # 2. Scale, folded into the queries (a scale above 1 only in part, the rest multiplies
    # the products: ``scale_split``); query head h = κ·G + g shares kv head κ.
    folded, post = scale_split(opts["scale"], torch.finfo(work).max)
    q = (q * folded).reshape(B, K, G, Tl, D)  # (B, K, G, Tl, D)
    alibi = None if slopes is None else slopes.reshape(B, K, G, 1, 1)  # (B, K, G, 1, 1)

    def attend(qa, kb, vb, allowed, used, mb, bias):
        """One block's partial state, its rows' attention over its keys alone: o_b (B, K,
        G, Tr, E), m_b and l_b (B, K, G, Tr) (l_b = 0: a row that sees none)."""
        # A key no query of this block may see is replaced by 0 before use (0 · NaN is NaN).
        kb = torch.where(used[..., None], kb, 0.0)  # (B, K, Sr, D)
        vb = torch.where(used[..., None], vb, 0.0)  # (B, K, Sr, E)

        # 1. Scores: the local query rows against the key columns now on this rank (and 2.
        # the rest of the scale).
        x = torch.einsum("bkgtd,bksd->bkgts", qa, kb)  # (B, K, G, Tr, Sr)
        if post is not None:
            x = x * post  # (B, K, G, Tr, Sr)

        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        if opts["softcap"] is not None:
            x = opts["softcap"] * torch.tanh(x / opts["softcap"])

        # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query
        # may not see gets -inf.
        if bias is not None:
            x = x + bias
        if mb is not None and mb.dtype != torch.bool:
            x = x + mb
        x = torch.where(allowed, x, -torch.inf)  # (B, K, G, Tr, Sr)

        # 5. Softmax over the block's keys, against the block's own maximum (a row that
        # sees none of them takes its exponents against 0: exp(-inf) = 0).
        m = x.amax(dim=-1)  # (B, K, G, Tr)
        p = torch.exp(x - torch.where(torch.isfinite(m), m, 0.0)[..., None])  # (B, K, G, Tr, Sr)
        l = p.sum(dim=-1)  # (B, K, G, Tr)

        # 7. Weighted sum of the values, normalised within the block.
        o_b = torch.einsum("bkgts,bkse->bkgte", p, vb) / divisor(l)[..., None]
        return o_b, m, l

    # Each row's state so far, (o, m, l): the empty state (l = 0) until a block with a key
    # arrives, in the working precision (SPEC §22.11).
    o = torch.zeros((B, K, G, Tl, E), dtype=work)  # (B, K, G, Tl, E)
    m = torch.full((B, K, G, Tl), -torch.inf, dtype=work)  # (B, K, G, Tl)
    l = torch.zeros((B, K, G, Tl), dtype=work)  # (B, K, G, Tl)
    for step in range(P):
        src = (me - step) % P  # whose key/value slice this rank holds now
        k, v, spos, sdoc = travel
        pending = []
        if step < P - 1:
            # Pass the slice on while computing on it: send to r + 1, receive from r − 1.
            travel, pending = _send_on(travel, me, P)
        for a in range(pieces):
            for b in range(pieces):
                ta, sb = slice(a * Tc, (a + 1) * Tc), slice(b * Sc, (b + 1) * Sc)
                # Skip a block no query of this piece may see (causality, the window,
                # padding, no document in common): the causal saving.
                if not _allowed_keys(tpos, spos, tdoc, sdoc, ta, sb, opts).any():
                    continue
                mb = _mask_block(mask, a, b, src, Tc, Sc, Sl)
                # One document at a time, so that no product mixes two (SPEC §18.3).
                for rows, cols in _documents(tdoc, sdoc, ta, sb):
                    seen = _visible(tpos, spos, tdoc, sdoc, rows, cols, mb, opts, K, G)
                    bias = _alibi_bias(alibi, tpos[rows], spos[cols], opts)
                    piece = attend(q[:, :, :, rows], k[:, :, cols], v[:, :, cols], *seen, bias)
                    # The block's state merged into its rows' (merge.py, SPEC §22).
                    new = merge_partials(o[..., rows, :], m[..., rows], l[..., rows], *piece)
                    o[..., rows, :], m[..., rows], l[..., rows] = new
        for req in pending:
            req.wait()

    if sinks is not None:
        # The sink joins each row's softmax once (per step, it would count P times): a piece
        # of its own, o = 0, m = the sink and l = 1, in each row that saw a key (SPEC §22.6).
        sink = sinks.reshape(1, K, G, 1).expand(B, K, G, Tl)  # (B, K, G, Tl)
        sink = torch.where(l > 0, sink, -torch.inf)  # (B, K, G, Tl)
        o, m, l = merge_partials(o, m, l, torch.zeros_like(o), sink, 1.0)
    lse = union_lse(m, l)  # (B, K, G, Tl)
    # A row that read a +inf score (q·k overflowed) has l = +inf or NaN: its lse is NaN, as
    # its output is, so that in the backward every weight of it is NaN (§4.1).
    lse = torch.where(torch.isnan(l) | (l == torch.inf), torch.nan, lse)  # (B, K, G, Tl)
    return o.reshape(B, H, Tl, E), lse.reshape(B, H, Tl)  # (B, H, Tl, E), (B, H, Tl)


def ring_attention_backward(
    q, k, v, tpos, spos, mask, d_out, sinks=None, slopes=None, tdoc=None, sdoc=None, *,
    opts: dict, pieces: int,
):  # fmt: skip
    """One rank's share of the backward: (dq, dk, dv, dmask or None, dsinks or None).

    The arguments are ``ring_attention``'s and d_out (B, H, Tl, E), this rank's rows of
    ∂L/∂out. dq (B, H, Tl, D) is this rank's rows; dk (B, K, Sl, D) and dv (B, K, Sl, E)
    are its own key/value slice's, summed over every rank's queries; dmask (B, H, Tl, Sp)
    with a float mask: its rows, every column in the layout's order; dsinks (H,) with
    sinks, summed over every rank's rows (the same on every rank).

    Its block body is its own: this package has no single-device blockwise backward to
    share one with (and no page imports another framework's), and its blocks are decided
    by the tokens' travelling positions, not by a static band and block index as in the
    NumPy and JAX ``flash.py`` pages.
    """
    P, me = dist.get_world_size(), dist.get_rank()
    out, lse = _ring_forward(
        q, k, v, tpos, spos, mask, sinks, slopes, tdoc, sdoc, opts=opts, pieces=pieces
    )
    B, H, Tl, D = q.shape
    _, K, Sl, _ = k.shape
    E = v.shape[-1]
    G = H // K
    Tc, Sc = Tl // pieces, Sl // pieces
    work = q.dtype
    float_mask = mask is not None and mask.dtype != torch.bool
    travel = [None if x is None else x.contiguous() for x in (k, v, spos, sdoc)]

    folded, post = scale_split(opts["scale"], torch.finfo(work).max)
    qs = (q * folded).reshape(B, K, G, Tl, D)  # (B, K, G, Tl, D)
    # 5'. The softmax's row term, rowsum(dO ⊙ O): one dot product per row.
    d_row = (d_out * out).sum(dim=-1)  # (B, H, Tl)
    some = torch.isfinite(lse)  # (B, H, Tl): the rows that see a key
    dsinks = None
    if sinks is not None:
        # 5'. Sinks: dsink = −Σ_t p_sink · rowsum(dO ⊙ O), p_sink = exp(sink − lse) (0 for a
        # row with no key), over this rank's rows; then over every rank's rows.
        p_sink = torch.where(some, torch.exp(sinks[None, :, None] - lse), 0.0)  # (B, H, Tl)
        dsinks = -(p_sink * d_row).sum(dim=(0, 2))  # (H,)
        dist.all_reduce(dsinks, op=dist.ReduceOp.SUM)
    alibi = None if slopes is None else slopes.reshape(B, K, G, 1, 1)  # (B, K, G, 1, 1)
    lse = torch.where(lse == -torch.inf, torch.inf, lse)  # no key: P = 0; NaN stays (§4.1)
    lse = lse.reshape(B, K, G, Tl)  # (B, K, G, Tl)
    d_row = d_row.reshape(B, K, G, Tl)  # (B, K, G, Tl)
    d_out = d_out.reshape(B, K, G, Tl, E)  # (B, K, G, Tl, E)
    dq = torch.zeros((B, K, G, Tl, D), dtype=work)
    dmask = torch.zeros((B, H, Tl, P * Sl), dtype=work) if float_mask else None
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # travel with their block

    for step in range(P):
        src = (me - step) % P  # whose key/value slice this rank holds now
        k, v, spos, sdoc = travel
        for a in range(pieces):
            for b in range(pieces):
                ta, sb = slice(a * Tc, (a + 1) * Tc), slice(b * Sc, (b + 1) * Sc)
                if not _allowed_keys(tpos, spos, tdoc, sdoc, ta, sb, opts).any():
                    continue
                mb = _mask_block(mask, a, b, src, Tc, Sc, Sl)
                for rows, cols in _documents(tdoc, sdoc, ta, sb):
                    seen = _visible(tpos, spos, tdoc, sdoc, rows, cols, mb, opts, K, G)
                    allowed, used, mbd = seen
                    kb = torch.where(used[..., None], k[:, :, cols], 0.0)  # (B, K, Sr, D)
                    vb = torch.where(used[..., None], v[:, :, cols], 0.0)  # (B, K, Sr, E)

                    # Forward steps 1-5 again for this block: raw scores, weights from lse.
                    qa = qs[:, :, :, rows]  # (B, K, G, Tr, D)
                    raw = torch.einsum("bkgtd,bksd->bkgts", qa, kb)  # (B, K, G, Tr, Sr)
                    if post is not None:
                        raw = raw * post  # (B, K, G, Tr, Sr)
                    x = raw
                    if opts["softcap"] is not None:
                        x = opts["softcap"] * torch.tanh(raw / opts["softcap"])
                    if alibi is not None:
                        x = x + _alibi_bias(alibi, tpos[rows], spos[cols], opts)
                    if float_mask:
                        x = x + mbd
                    x = torch.where(allowed, x, -torch.inf)  # (B, K, G, Tr, Sr)
                    p = torch.exp(x - lse[:, :, :, rows, None])  # (B, K, G, Tr, Sr)

                    # 7'. dV = Pᵀ·dO, and dP = dO·Vᵀ.
                    do = d_out[:, :, :, rows]  # (B, K, G, Tr, E)
                    dv_b = torch.einsum("bkgts,bkgte->bkse", p, do)  # (B, K, Sr, E)
                    dp = torch.einsum("bkgte,bkse->bkgts", do, vb)  # (B, K, G, Tr, Sr)
                    # 5'. dZ = P ⊙ (dP − rowsum(dO ⊙ O)).
                    dz = p * (dp - d_row[:, :, :, rows, None])  # (B, K, G, Tr, Sr)
                    # 4'. A float mask was added to the scores: its gradient is dZ. (A mask
                    # comes only without documents, so the block is the whole piece.)
                    if float_mask:
                        start = src * Sl + b * Sc
                        dmask[:, :, ta, start : start + Sc] = dz.reshape(B, H, Tc, Sc)
                    # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c).
                    if opts["softcap"] is not None:
                        dz = dz * (1.0 - torch.tanh(raw / opts["softcap"]) ** 2)
                    # 2'-1'. The scale is folded into qa and post; dq gets it once at the end.
                    dq[:, :, :, rows] += torch.einsum("bkgts,bksd->bkgtd", dz, kb)
                    dk_b = torch.einsum("bkgts,bkgtd->bksd", dz, qa)  # (B, K, Sr, D)
                    if post is not None:
                        dk_b = dk_b * post  # (B, K, Sr, D)
                    # The slots replaced by 0 get nothing back.
                    dk[:, :, cols] += torch.where(used[..., None], dk_b, 0.0)
                    dv[:, :, cols] += torch.where(used[..., None], dv_b, 0.0)
        if step < P - 1:
            # The block and its gradients so far go on to r + 1; r − 1's arrive here.
            *travel, dk, dv = _pass_on((k, v, spos, sdoc, dk, dv), me, P)
    if P > 1:
        # One more hop: the gradients of the block held now belong to rank r + 1.
        dk, dv = _pass_on((dk, dv), me, P)
    return (dq * opts["scale"]).reshape(B, H, Tl, D), dk, dv, dmask, dsinks


def _alibi_bias(alibi, tp, sp, opts: dict):
    """ALiBi's bias on one block, (B, K, G, Tr, Sr): −slope · |t + S − T − s|, t and s the
    tokens' global positions (which travel with them), so the layout and the padding do
    not change it; the distance is from the bottom-right diagonal whatever the alignment.
    None without ALiBi."""
    if alibi is None:
        return None
    distance = (tp[:, None] + opts["S"] - opts["T"] - sp[None, :]).abs()  # (Tr, Sr)
    return -alibi * distance.to(alibi.dtype)  # (B, K, G, Tr, Sr)


def _send_on(tensors, me: int, P: int):
    """Start sending each tensor (None stays None) to rank r + 1 and receiving rank
    r − 1's in its place: (the tensors on their way here, the pending requests)."""
    nxt = [None if x is None else torch.empty_like(x) for x in tensors]
    ops = [dist.P2POp(dist.isend, x.contiguous(), (me + 1) % P) for x in tensors if x is not None]
    ops += [dist.P2POp(dist.irecv, x, (me - 1) % P) for x in nxt if x is not None]
    return nxt, dist.batch_isend_irecv(ops)


def _pass_on(tensors, me: int, P: int):
    """Send each tensor to rank r + 1 and receive rank r − 1's in its place."""
    nxt, pending = _send_on(tensors, me, P)
    for req in pending:
        req.wait()
    return nxt


def _allowed_keys(tpos, spos, tdoc, sdoc, rows, cols, opts: dict):
    """(Tr, Sr): may query slot rows[i] see key slot cols[j]? Causality, the window,
    local-attention chunks and padding, from the tokens' original positions; with packed
    documents, also the same document (padding is in none). Chunks use floor division: a
    query at a negative position lies in a chunk of no key."""
    tp, sp = tpos[rows], spos[cols]  # (Tr,), (Sr,)
    t = tp[:, None] + opts["offset"]  # (Tr, 1)
    distance = sp[None, :] - t  # (Tr, Sr)
    if tdoc is None:
        real = (tp < opts["T"])[:, None] & (sp < opts["S"])[None, :]  # (Tr, Sr)
    else:
        td, sd = tdoc[rows], sdoc[cols]  # (Tr,), (Sr,)
        real = (td[:, None] == sd[None, :]) & (sd >= 0)[None, :]  # (Tr, Sr)
    allowed = real & (distance >= opts["lo"]) & (distance <= opts["hi"])  # (Tr, Sr)
    if opts["chunk"] is not None:
        allowed = allowed & (t // opts["chunk"] == sp[None, :] // opts["chunk"])
    return allowed


def _documents(tdoc, sdoc, rows: slice, cols: slice) -> list:
    """The (rows, cols) of each document that query slots ``rows`` and key slots ``cols``
    have in common, as index tensors into the rank's slices; without documents, the block
    itself. Attending one document at a time is what keeps them apart: one product over
    two documents would multiply a weight of 0 by the other's values, and 0 · NaN = NaN."""
    if tdoc is None:
        return [(rows, cols)]
    td, sd = tdoc[rows], sdoc[cols]  # (Tc,), (Sc,)
    shared = [d for d in torch.unique(td).tolist() if d >= 0 and bool((sd == d).any())]
    return [
        (torch.nonzero(td == d)[:, 0] + rows.start, torch.nonzero(sd == d)[:, 0] + cols.start)
        for d in shared
    ]


def _mask_block(mask, a: int, b: int, src: int, Tc: int, Sc: int, Sl: int):
    """This rank's mask for query piece a and key piece b of rank src's slice, or None."""
    if mask is None:
        return None
    mb = mask if mask.shape[2] == 1 else mask[:, :, a * Tc : (a + 1) * Tc]
    if mb.shape[3] != 1:
        start = src * Sl + b * Sc
        mb = mb[..., start : start + Sc]  # (B|1, H|1, Tc|1, Sc)
    return mb


def _visible(tpos, spos, tdoc, sdoc, rows, cols, mb, opts: dict, K: int, G: int):
    """(allowed, used, mb) for one block: which keys each query may see, (Tr, Sr) or
    (B|1, K|1, G|1, Tr, Sr) with a mask; which keys any of them sees, (Sr,) or
    (B|1, K|1, Sr); and the mask grouped by key/value head (or None)."""
    allowed = _allowed_keys(tpos, spos, tdoc, sdoc, rows, cols, opts)  # (Tr, Sr)
    if mb is not None:
        mb = _grouped(mb, K, G)  # (B|1, K|1, G|1, Tc|1, Sc|1)
        allowed = allowed & (mb if mb.dtype == torch.bool else mb != -torch.inf)
    used = allowed.any(dim=-2) if allowed.ndim == 2 else allowed.any(dim=-2).any(dim=-2)
    return allowed, used, mb


def _grouped(x, K: int, G: int):
    b, h, t, s = x.shape
    return x.reshape(b, 1, 1, t, s) if h == 1 else x.reshape(b, K, G, t, s)


# ----------------------------------------------------------------------------------------
# The single-process entry: lay out, hand each rank its shard, gather.


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
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Ring attention on a pool of ``world_size`` worker processes; NumPy in and out.
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
        dropout_p=dropout_p, unsupported={"dropout_p": "torch-ring has no dropout"},
        sinks=sinks, chunk_size=chunk_size, alibi_slopes=slopes,
    )  # fmt: skip
    lay = Layout(call, q, k, v, mask, None, world_size, layout, sinks, slopes)
    outs = run_on_ranks(
        lay.P, ring_attention, _shards(lay), opts=lay.opts, pieces=lay.pieces,
        return_lse=return_lse,
    )  # fmt: skip
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
) -> tuple[np.ndarray, ...]:
    """The backward ring: (dq, dk, dv), then dmask with a float mask and dsinks with
    sinks; NumPy in and out, shaped and typed like q, k, v, the mask (summed over its
    broadcast axes) and the sinks."""
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
    parts = run_on_ranks(
        lay.P, ring_attention_backward, _shards(lay), opts=lay.opts, pieces=lay.pieces
    )
    grads = lay.qkv_grads(parts, q.dtype)  # (B, H, T, D), (B, K, S, D), (B, K, S, E)
    if call.unbatched:
        grads = [g[0] for g in grads]
    if mask is not None and mask.dtype != np.bool_:
        d_full = lay.cols_back(lay.rows_back(np.concatenate([g[3] for g in parts], axis=2)), 3)
        d_full = d_full[0] if call.unbatched else d_full  # (B, H, T, S) or (H, T, S)
        grads.append(sum_to(d_full, mask.shape).astype(mask.dtype))
    if sinks is not None:
        grads.append(parts[0][4].astype(sinks.dtype))  # (H,): all-reduced, alike on every rank
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
) -> np.ndarray:
    """Packed variable-length sequences (SPEC §18) on the ring; NumPy in and out.

    q (H, T, D), k (K, S, D), v (K, S, E) hold N documents one after another, document n
    being queries cu_seqlens_q[n]:cu_seqlens_q[n + 1] and keys cu_seqlens_k[n]:
    cu_seqlens_k[n + 1]; out (H, T, E). The packed tokens are one sequence (B = 1), laid
    out over the ranks as ``attention``'s is; each token takes its document and its
    position inside it round the ring, and a query sees only keys of its own document,
    causality and the window counted from the document's own start (see ``Layout``).
    """
    # 0. Validate: the input contract every impl shares (the contract package).
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    call, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap,
    )  # fmt: skip
    lay = Layout(call, q, k, v, None, None, world_size, layout, documents=(cu_q, cu_k))
    outs = run_on_ranks(lay.P, ring_attention, _shards(lay), opts=lay.opts, pieces=lay.pieces)
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The backward ring of ``attention_packed``: (dq, dk, dv) for d_out (H, T, E), shaped
    and typed like q, k and v; the boundaries are integers and get no gradient."""
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    call, cu_q, cu_k = contract.check_packed(
        q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, scale=scale,
        causal_alignment=causal_alignment, window=window, softcap=softcap, d_out=d_out,
    )  # fmt: skip
    lay = Layout(call, q, k, v, None, d_out, world_size, layout, documents=(cu_q, cu_k))
    parts = run_on_ranks(
        lay.P, ring_attention_backward, _shards(lay), opts=lay.opts, pieces=lay.pieces
    )
    return tuple(g[0] for g in lay.qkv_grads(parts, q.dtype))  # (H, T, D), (K, S, D), (K, S, E)


def _shards(lay: Layout) -> list[tuple]:
    """Each rank's shard, in ``ring_attention``'s (or, with d_out, the backward's) order
    of arguments: its query slice and key/value slice with their positions, its rows of
    the mask (every column, in the layout's order), of d_out, all sinks and slopes, and
    its slices' documents."""
    shards = []
    for r in range(lay.P):
        rows = slice(r * lay.Tl, (r + 1) * lay.Tl)
        cols = slice(r * lay.Sl, (r + 1) * lay.Sl)
        m = None
        if lay.mask is not None:
            m = lay.mask if lay.mask.shape[2] == 1 else lay.mask[:, :, rows]
        shard = (lay.q[:, :, rows], lay.k[:, :, cols], lay.v[:, :, cols])
        shard += (lay.tpos[rows], lay.spos[cols], m)
        if lay.d_out is not None:
            shard += (lay.d_out[:, :, rows],)
        shard += (lay.sinks, lay.slopes)
        shard += (None, None) if lay.tdoc is None else (lay.tdoc[rows], lay.sdoc[cols])
        shards.append(shard)
    return shards
