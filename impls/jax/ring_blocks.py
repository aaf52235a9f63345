"""One block of the ring, written as for one device: a query piece of this device's slice
against the key piece it holds now (``QueryPieces`` forward, ``QueryGradients`` backward),
and the helpers both use: which keys a query may see, from the tokens' positions that
travel with them (``allowed_keys``, ``visible``), the mask's block, ALiBi's bias, the sink.

The block forward is steps 1-5 and 7 over the block's keys alone, its partial state merged
into the rows' with ``merge.py``'s ``merge_partials`` (no online softmax of its own), and
backward FlashAttention-2's tile, dZ = P ⊙ (dP − Δ). It is
written apart from ``flash_tiles.py``'s on purpose: here the options and every token's
position are traced values that travel with the slices (one compiled program serves every
option and layout), where the flash tiles mask a static band and skip by loop bounds.

Huge scales: q · scale can overflow where the score does not, so a scale above 1 is folded
in part and the rest, a power of two, multiplies the product exactly (``scale_split``;
``flash_tiles.py``'s docstring says why that changes nothing else). The scale is traced,
so whether it is above 1 is a static flag (``huge_scale``) beside it: a call with a scale
of at most 1 compiles the very program it did before, rounding for rounding.

Shape legend: ``ring.py``'s; Tc and Sc are a query and a key piece (a slice, or its half
in zigzag), r = G·Tc the rows of a block (query head g·Tc + t of each key/value head).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .merge import divisor, merge_partials

HIGHEST = lax.Precision.HIGHEST


class QueryPieces:
    """This device's query slice, in pieces (one, or two in zigzag), and what one block of
    it does against a key piece: the forward's block and merge (``update``). The options
    (``opts``) are traced, the sizes static."""

    def __init__(
        self, q, tpos, tdoc, slopes, opts, *, K: int, pieces: int, softcap_on: bool,
        huge_scale: bool,
    ):  # fmt: skip
        B, H, Tl, _ = q.shape
        self.B, self.K, self.G, self.Tc = B, K, H // K, Tl // pieces
        self.opts, self.softcap_on = opts, softcap_on
        self.work = work = working_dtype(q.dtype)
        self.scale, self.softcap = opts["scale"].astype(work), opts["softcap"].astype(work)
        # 2. Scale, folded into the queries; a scale above 1 (``huge_scale``, static) only
        # in part, the rest, a power of two, multiplies the products (``scale_split``).
        # Query head h = κ·G + g shares key/value head κ, so a kv head's block serves its
        # G query heads, stacked as G·Tc rows.
        folded, self.post = scale_split(opts["scale"], work) if huge_scale else (self.scale, None)
        self.qs = pieces_of(q.astype(work) * folded, K, pieces)  # (pieces, B, K, G·Tc, D)
        self.tps = tpos.reshape(pieces, self.Tc)  # (pieces, Tc)
        self.tds = None if tdoc is None else tdoc.reshape(pieces, self.Tc)  # (pieces, Tc)
        self.alibi = None if slopes is None else grouped_slopes(slopes.astype(work), K, self.G)

    def keys(self, a, kb, vb, sp, mb, docs):
        """Which keys of the piece query piece a may see, and the key and value rows with
        every one no query of the block sees replaced by 0, by selection: whatever it holds
        (0 · NaN is NaN) then has no effect. (allowed, used, mb grouped, kb, vb)."""
        allowed, used, mb = visible(self.tps[a], sp, mb, self.opts, self.K, self.G, docs)
        kb = jnp.where(used[..., None], kb.astype(self.work), 0.0)  # (B, K, Sc, D)
        vb = jnp.where(used[..., None], vb.astype(self.work), 0.0)  # (B, K, Sc, E)
        return allowed, used, mb, kb, vb

    def scores(self, qa, a, kb, sp, mb, allowed, float_mask: bool):
        """Steps 1-4 of one block: (the raw scores q·k·scale, the masked scores), both
        (B, K, G·Tc, Sc)."""
        B, K, G, Tc, Sc = self.B, self.K, self.G, self.Tc, kb.shape[2]
        # 1. Scores: the local query piece against the key piece now on this device (and
        # 2. the rest of the scale).
        raw = jnp.einsum("bkrd,bksd->bkrs", qa, kb, precision=HIGHEST)  # (B, K, G·Tc, Sc)
        if self.post is not None:
            raw = raw * self.post  # (B, K, G·Tc, Sc), r = G·Tc rows
        # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
        x = softcapped(raw, self.softcap) if self.softcap_on else raw  # (B, K, G·Tc, Sc)
        # 4. Mask: ALiBi's linear bias and a float mask are added, then every key a query
        # may not see gets -inf (replaced, not only pushed down: NaN + -inf is NaN).
        x = x.reshape(B, K, G, Tc, Sc)  # (B, K, G, Tc, Sc)
        if self.alibi is not None:
            x = x + alibi_bias(self.alibi, self.tps[a], sp, self.opts)  # (B, K, G, Tc, Sc)
        if float_mask:
            x = x + mb.astype(self.work)  # (B, K, G, Tc, Sc)
        x = jnp.where(allowed, x, -jnp.inf).reshape(B, K, G * Tc, Sc)  # (B, K, G·Tc, Sc)
        return raw, x

    def attend(self, m, l, o, a, kb, vb, sp, mb, docs):
        """Query piece a's (m, l, o) (B, K, G·Tc), ..., (B, K, G·Tc, E) after one key
        piece: the block's own partial state merged into it with ``merge.py``'s
        ``merge_partials`` (SPEC §22); docs: the pieces' documents (tokens of no document
        -1), or None."""
        allowed, _, mb, kb, vb = self.keys(a, kb, vb, sp, mb, docs)
        float_mask = mb is not None and mb.dtype != jnp.bool_
        _, x = self.scores(self.qs[a], a, kb, sp, mb, allowed, float_mask)

        # 5. Softmax over the block's keys, against the block's own maximum m_b. A row that
        # sees none of them keeps m_b = -inf and takes its exponents against 0, so its
        # weights are exactly 0 instead of exp(-inf - -inf) = NaN.
        m_b = x.max(axis=-1)  # (B, K, G·Tc)
        p = jnp.exp(x - jnp.where(jnp.isfinite(m_b), m_b, 0.0)[..., None])  # (B, K, G·Tc, Sc)
        l_b = p.sum(axis=-1)  # (B, K, G·Tc)

        # 7. Weighted sum of the values, normalised within the block.
        pv = jnp.einsum("bkrs,bkse->bkre", p, vb, precision=HIGHEST)  # (B, K, G·Tc, E)
        o_b = pv / divisor(l_b)[..., None]  # (B, K, G·Tc, E)

        # The block's state (o_b, m_b, l_b) merged into the rows' (SPEC §22).
        o, m, l = merge_partials(o, m, l, o_b, m_b, l_b)
        return m, l, o

    def update(self, state, a, b, src, kb, vb, sp, sd, mb):
        """Query piece a's (m, l, o) after key piece b of device src's slice."""
        (ms, ls, outs), travelling = state  # (pieces, B, K, G·Tc), ..., (pieces, B, K, G·Tc, E)
        piece = (ms[a], ls[a], outs[a])  # this query piece's
        if sd is None:
            new = self.attend(*piece, a, kb, vb, sp, mb, None)
        else:
            td = self.tds[a]  # (Tc,)

            def document(n, piece):
                # Packed documents: document n's rows against its keys, the other rows
                # counted in no document for this pass; each row keeps its own document's
                # pass, since 0 · NaN is NaN (``ring.py``'s docstring).
                mine = td == n  # (Tc,)
                new = self.attend(*piece, a, kb, vb, sp, mb, (jnp.where(mine, n, -1), sd))
                rows = jnp.tile(mine, self.G)  # (G·Tc,): row g·Tc + t is query t
                return tuple(
                    jnp.where(rows if x.ndim == 3 else rows[:, None], y, x)
                    for x, y in zip(piece, new)
                )

            new = lax.fori_loop(*shared_documents(td, sd), document, piece)
        stay = tuple(lax.dynamic_update_index_in_dim(x, y, a, 0) for x, y in zip(state[0], new))
        return stay, travelling


class QueryGradients(QueryPieces):
    """The backward of this device's query pieces against one key piece (``block``): the
    forward's pieces, and each row's dO, log-sum-exp and Δ = rowsum(dO ⊙ O)."""

    def __init__(self, q, tpos, tdoc, slopes, opts, d_out, delta, lse, *, float_mask, Sl, **sizes):
        super().__init__(q, tpos, tdoc, slopes, opts, **sizes)
        K, pieces = sizes["K"], sizes["pieces"]
        self.float_mask, self.Sl = float_mask, Sl
        self.dos = pieces_of(d_out, K, pieces)  # (pieces, B, K, G·Tc, E)
        self.d_row = pieces_of(delta[..., None], K, pieces)[..., 0]  # (pieces, B, K, G·Tc)
        self.lses = pieces_of(lse[..., None], K, pieces)[..., 0]  # (pieces, B, K, G·Tc)

    def gradients(self, a, kb, vb, sp, mb, docs, rows):
        """Query piece a against one key piece: (dq_a (B, K, G·Tc, D), dk_b (B, K, Sc, D),
        dv_b (B, K, Sc, E), dZ (B, K, G·Tc, Sc) for the mask). docs: the pieces'
        documents, or None; rows (G·Tc,): the rows of the one document computed (the
        others give nothing), or None."""
        allowed, used, mbg, kb, vb = self.keys(a, kb, vb, sp, mb, docs)
        qa, do, lse_a = self.qs[a], self.dos[a], self.lses[a]  # (B, K, G·Tc, ·), (B, K, G·Tc)
        if rows is not None:
            # Only this document's rows carry q, dO and lse into the products: another
            # document's row (NaN in its q or d_out, or in its lse through its values)
            # must add nothing, and a product with a weight of 0 would still carry a NaN.
            qa = jnp.where(rows[:, None], qa, 0.0)  # (B, K, G·Tc, D)
            do = jnp.where(rows[:, None], do, 0.0)  # (B, K, G·Tc, E)
            lse_a = jnp.where(rows, lse_a, jnp.inf)  # (B, K, G·Tc)

        # Forward steps 1-5 again for this block: raw scores, weights from lse.
        raw, x = self.scores(qa, a, kb, sp, mbg, allowed, self.float_mask)
        p = jnp.exp(x - lse_a[..., None])  # (B, K, G·Tc, Sc)

        # 7'. dV = Pᵀ·dO, and dP = dO·Vᵀ.
        dv_b = jnp.einsum("bkrs,bkre->bkse", p, do, precision=HIGHEST)  # (B, K, Sc, E)
        dp = jnp.einsum("bkre,bkse->bkrs", do, vb, precision=HIGHEST)  # (B, K, G·Tc, Sc)
        # 5'. dZ = P ⊙ (dP − rowsum(dO ⊙ O)).
        dz = p * (dp - self.d_row[a][..., None])  # (B, K, G·Tc, Sc)
        dz_mask = dz
        # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c).
        if self.softcap_on:
            dz = dz * (1.0 - jnp.tanh(raw / self.softcap) ** 2)  # (B, K, G·Tc, Sc)
        if rows is not None:
            # A row of another document has P = 0, but its dP = 0 · V (and its softcap
            # factor) is NaN where this document's values are: selected away, so that
            # dK gets nothing from it.
            dz = jnp.where(rows[:, None], dz, 0.0)  # (B, K, G·Tc, Sc)
        # 2'-1'. The scale is folded into qa and ``post``; dq gets it once at the end.
        dq_a = jnp.einsum("bkrs,bksd->bkrd", dz, kb, precision=HIGHEST)  # (B, K, G·Tc, D)
        dk_b = jnp.einsum("bkrs,bkrd->bksd", dz, qa, precision=HIGHEST)  # (B, K, Sc, D)
        if self.post is not None:
            dk_b = dk_b * self.post  # (B, K, Sc, D)
        # The slots replaced by 0 get nothing back.
        dk_b = jnp.where(used[..., None], dk_b, 0.0)  # (B, K, Sc, D)
        dv_b = jnp.where(used[..., None], dv_b, 0.0)  # (B, K, Sc, E)
        return dq_a, dk_b, dv_b, dz_mask

    def block(self, state, a, b, src, kb, vb, sp, sd, mb):
        """The gradients after query piece a against key piece b of device src's slice."""
        (dq, dm), (dk, dv) = state
        B, K, G, Tc, Sc, work = self.B, self.K, self.G, self.Tc, kb.shape[2], self.work
        if sd is None:
            dq_a, dk_b, dv_b, dz = self.gradients(a, kb, vb, sp, mb, None, None)
            # 4'. A float mask was added to the scores: its gradient is dZ, summed over
            # the axes the mask broadcasts along.
            if self.float_mask:
                dm = add_mask_grad(dm, dz.reshape(B, K, G, Tc, Sc), a, b, src, self.Sl)
        else:
            td = self.tds[a]  # (Tc,)

            def document(n, sums):
                # Packed documents: document n's rows against its keys (the forward's
                # ``document``); a row's dq comes from its own document's pass alone.
                mine = td == n  # (Tc,)
                rows = jnp.tile(mine, G)  # (G·Tc,)
                docs = (jnp.where(mine, n, -1), sd)
                dq_a, dk_b, dv_b, _ = self.gradients(a, kb, vb, sp, None, docs, rows)
                dq_a = jnp.where(rows[:, None], dq_a, 0.0)  # (B, K, G·Tc, D)
                return tuple(x + y for x, y in zip(sums, (dq_a, dk_b, dv_b)))

            sums = (jnp.zeros_like(dq[a]), jnp.zeros_like(kb, dtype=work))  # dq_a, dk_b
            sums += (jnp.zeros_like(vb, dtype=work),)  # dv_b
            dq_a, dk_b, dv_b = lax.fori_loop(*shared_documents(td, sd), document, sums)
        dq = lax.dynamic_update_index_in_dim(dq, dq[a] + dq_a, a, 0)
        dk = add_key_piece(dk, dk_b, b, Sc)
        dv = add_key_piece(dv, dv_b, b, Sc)
        return (dq, dm), (dk, dv)


def scale_split(scale, work):
    """(folded, post), scale = folded · post, both in the working precision, for a traced
    scale above 1: folded in [0.5, 1) and post = 2^e, a power of two still finite in work
    (the module docstring: huge scales)."""
    _, e = jnp.frexp(scale)  # scale = m · 2^e, 0.5 <= m < 1
    e = jnp.where(scale > 1, jnp.minimum(e, jnp.finfo(work).maxexp - 1), 0)
    return jnp.ldexp(scale, -e).astype(work), jnp.ldexp(jnp.ones_like(scale), e).astype(work)


def softcapped(x, softcap):
    """softcap · tanh(x / softcap); where x / softcap is subnormal, which XLA on a CPU may
    flush to 0 (and the score with it), x itself: tanh(y) = y there far below rounding, and
    the derivative, 1 − tanh², is 1 (SPEC §4.2)."""
    ratio = x / softcap
    return jnp.where(jnp.abs(ratio) < jnp.finfo(x.dtype).tiny, x, softcap * jnp.tanh(ratio))


def working_dtype(dtype):
    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def shared_documents(td, sd) -> tuple:
    """The packed documents [first, last) that a query piece td (Tc,) and a key piece
    sd (Sc,) both hold tokens of (padding, -1, is in none), as loop bounds: a document
    only one side holds adds nothing to the block."""
    none = jnp.iinfo(jnp.int32).max
    first = jnp.maximum(
        jnp.where(td >= 0, td, none).min(), jnp.where(sd >= 0, sd, none).min()
    )  # a token of no document is left out of the minimum
    last = jnp.minimum(td.max(), sd.max()) + 1
    return first, jnp.maximum(first, last)


def add_sink(m, l, o, sink):
    """Merge each row's sink into its (m, l, o) after the last key block, as a piece of
    its own, o = 0, m = the sink, l = 1 (SPEC §22.6): a row with no key (l = 0) is left
    alone, and a NaN or +inf sink makes a row with a key NaN (SPEC §15.4)."""
    sink = jnp.where(l > 0, sink, -jnp.inf)  # (pieces, B, K, G·Tc)
    o, m, l = merge_partials(o, m, l, jnp.zeros_like(o), sink, 1.0)
    return m, l, o


def sink_rows(sinks, shape, K: int, G: int):
    """Each row's sink logit in the pieces' grouped layout, ``shape`` = (pieces, B, K,
    G·Tc): row g·Tc + t of key/value head κ belongs to query head h = κ·G + g."""
    pieces, B, _, R = shape
    rows = sinks.reshape(1, 1, K, G, 1)  # (1, 1, K, G, 1)
    rows = jnp.broadcast_to(rows, (pieces, B, K, G, R // G))  # (pieces, B, K, G, Tc)
    return rows.reshape(shape)  # (pieces, B, K, G·Tc)


def grouped_slopes(slopes, K: int, G: int):
    """ALiBi's slopes (B, H) in the grouped layout of the score blocks, (B, K, G, 1, 1)."""
    return slopes.reshape(slopes.shape[0], K, G, 1, 1)


def alibi_bias(alibi, tp, sp, opts):
    """ALiBi's bias on one block, (B, K, G, Tc, Sc): −slope · |t + S − T − s|, t and s the
    tokens' global positions (which travel with them), so the layout and the padding do
    not change it; the distance is from the bottom-right diagonal whatever the alignment."""
    distance = jnp.abs(tp[:, None] + opts["S"] - opts["T"] - sp[None, :])  # (Tc, Sc)
    return -alibi * distance.astype(alibi.dtype)  # (B, K, G, Tc, Sc)


def pieces_of(x, K: int, pieces: int):
    """(B, H, Tl, F) -> (pieces, B, K, G·Tc, F): query pieces, rows grouped by kv head."""
    B, H, Tl, F = x.shape
    G, Tc = H // K, Tl // pieces
    x = x.reshape(B, K, G, pieces, Tc, F)  # (B, K, G, pieces, Tc, F)
    return jnp.moveaxis(x, 3, 0).reshape(pieces, B, K, G * Tc, F)


def unpieces(x, H: int):
    """Undo ``pieces_of``: (pieces, B, K, G·Tc, F) -> (B, H, Tl, F)."""
    pieces, B, K, _, F = x.shape
    G = H // K
    x = x.reshape(pieces, B, K, G, -1, F)  # (pieces, B, K, G, Tc, F)
    return jnp.moveaxis(x, 0, 3).reshape(B, H, -1, F)


def key_piece(x, b, Sc: int):
    """Key piece b of a slice: (B, K, Sc, ·) of (B, K, Sl, ·), or (Sc,) of positions."""
    return lax.dynamic_slice_in_dim(x, b * Sc, Sc, axis=min(2, x.ndim - 1))


def add_key_piece(x, update, b, Sc: int):
    """x with ``update`` added into key piece b (axis 2)."""
    return lax.dynamic_update_slice_in_dim(x, key_piece(x, b, Sc) + update, b * Sc, axis=2)


def allowed_keys(tp, sp, opts, docs=None):
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


def mask_block(mask, a, b, src, Tc: int, Sc: int, Sl: int):
    """This device's mask for query piece a and key piece b of device src's slice."""
    if mask is None:
        return None
    mb = mask
    if mb.shape[2] != 1:
        mb = lax.dynamic_slice_in_dim(mb, a * Tc, Tc, axis=2)
    if mb.shape[3] != 1:
        mb = lax.dynamic_slice_in_dim(mb, src * Sl + b * Sc, Sc, axis=3)
    return mb  # (B|1, H|1, Tc|1, Sc|1)


def visible(tp, sp, mb, opts, K: int, G: int, docs=None):
    """(allowed, used, mb) for one block: which keys each query may see, (Tc, Sc) or
    (B|1, K|1, G|1, Tc, Sc) with a mask (a bool mask's False and a float mask's -inf
    block); which keys any of them sees, (Sc,) or (B|1, K|1, Sc); and the mask grouped
    by key/value head (or None). docs: as for ``allowed_keys``."""
    allowed = allowed_keys(tp, sp, opts, docs)  # (Tc, Sc)
    if mb is not None:
        mb = grouped(mb, K, G)  # (B|1, K|1, G|1, Tc|1, Sc|1)
        allowed = allowed & (mb if mb.dtype == jnp.bool_ else mb != -jnp.inf)
    used = allowed.any(axis=-2) if allowed.ndim == 2 else allowed.any(axis=(-3, -2))
    return allowed, used, mb


def add_mask_grad(dm, dz, a, b, src, Sl: int):
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


def grouped(x, K: int, G: int):
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)
    return x.reshape(b, K, G, t, s)
