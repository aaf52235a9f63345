"""Deliberately broken NumPy attention backends: the suite must fail every one of them.

Each mutant is the reference algorithm of ``impls/numpy/attention.py`` with exactly one
step replaced by a small broken function. The steps are plain module-level functions;
a mutant backend names the one it swaps out. Input validation is borrowed from the
reference so that a mutant differs from it only in the one broken step.

The gradient mutants do the same to the backward pass: ``BackwardSteps`` is a copy of the
reference's ``attention_backward``, cut into steps, and each gradient mutant swaps one
step for a broken one. Their forward is the unbroken ``Steps``, so only the backward is
wrong; they declare "grad", "grad_mask" and "grad_softcap" (not "module_grad").

``MUTANTS`` maps a mutant's backend name to ``(backend class, expected clauses,
node substring)``: the suite must fail that backend with at least one failing test that
carries one of the expected clauses (and, when given, whose node id contains the
substring).
"""

from __future__ import annotations

import math

import numpy as np
from conformance.impls import contract
from conformance.impls.numpy.layers import gelu, layer_norm, linear

from conformance.backends import ALL_CAPABILITIES, DTYPES, Backend

#: What a gradient mutant (and the control) declares for its backward pass.
GRAD = frozenset({"grad", "grad_mask", "grad_softcap"})

# --- The correct steps ---------------------------------------------------------------------


def default_scale(D, scale):
    """1/√D unless a scale is given."""
    return 1.0 / math.sqrt(D) if scale is None else scale


def expand_kv(x, G):
    """(B, K, S, ·) -> (B, H, S, ·): key/value head κ serves query heads κ·G .. κ·G + G - 1."""
    return np.repeat(x, G, axis=1)


def apply_float_mask(scores, mask):
    """A float mask is added to the scores."""
    return scores + mask


def bool_allowed(mask):
    """A bool mask is True where the query may attend."""
    return mask


def band(T, S, is_causal, causal_alignment, window):
    """Which keys each query may see under causality and the window: (T, S) bool."""
    offset = 0 if causal_alignment == "top_left" else S - T
    distance = np.arange(S)[None, :] - (np.arange(T)[:, None] + offset)
    allowed = np.ones((T, S), dtype=bool)
    if is_causal:
        allowed &= distance <= 0
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    return allowed


def chunks(T, S, chunk_size, causal_alignment):
    """Which keys each query may see under chunked local attention (SPEC §16.1): those in
    the query's own chunk, pos(t) // chunk_size == s // chunk_size. (T, S) bool."""
    offset = 0 if causal_alignment == "top_left" else S - T
    position = np.arange(T)[:, None] + offset
    return position // chunk_size == np.arange(S)[None, :] // chunk_size


def alibi(slopes, T, S, H):
    """ALiBi's bias (SPEC §17.1): −slope · |t + S − T − s|, (B|1, H, T, S)."""
    distance = np.abs(np.arange(T)[:, None] + S - T - np.arange(S)[None, :])
    return -slopes.reshape(-1, H, 1, 1) * distance.astype(slopes.dtype)


def page_of(table_row, s, L):
    """The page holding a sequence's key s (SPEC §19.1): block_table[b, s // L]."""
    return table_row[s // L]


def softmax(scores, dtype):
    """Stable softmax over the keys; a row with every key at -inf gets weights 0."""
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    return p / np.where(row_sum > 0, row_sum, 1.0)


def sink_softmax(scores, sinks):
    """The softmax with each row's sink logit (..., 1) in the max and the sum only (SPEC
    §15.1); a row with no key gets weights 0, a NaN or +inf sink a NaN row."""
    live = (scores != -np.inf).any(axis=-1, keepdims=True)  # rows with a key
    sink = np.where(live, sinks, -np.inf)
    row_max = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    with np.errstate(over="ignore", invalid="ignore"):
        row_sum = p.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)
    weights = p / np.where(row_sum > 0, row_sum, 1.0)
    return np.where(np.isnan(sink) | (sink == np.inf), np.nan, weights)


def hide_unused(k, v, allowed):
    """Key and value rows no query of their head sees are replaced by 0 (SPEC §4.7)."""
    used = allowed.any(axis=2)[..., None]  # (B|1, H|1, S, 1)
    return np.where(used, k, 0.0), np.where(used, v, 0.0)


def block(scores, allowed):
    """A blocked key's score is set to -inf by selection: whatever its key held is gone."""
    return np.where(allowed, scores, -np.inf)


def dropout(weights, p, rng):
    """Zero each weight with probability p; scale the survivors by 1 / (1 - p)."""
    keep = rng.random(weights.shape) >= p
    return weights * keep / (1.0 - p)


def cast_output(out, dtype):
    """The output has the inputs' dtype."""
    return out.astype(dtype)


def merge_heads(context):
    """(B, H, T, D) -> (B, T, C), head-major: head h owns channels [h·D, (h+1)·D)."""
    B, H, T, D = context.shape
    return context.transpose(0, 2, 1, 3).reshape(B, T, H * D)


# --- The broken steps ----------------------------------------------------------------------


def scale_one_over_d(D, scale):
    """BUG: 1/D instead of 1/√D by default."""
    return 1.0 / D if scale is None else scale


def scale_none(D, scale):
    """BUG: the scores are never scaled, whatever scale is asked for."""
    return 1.0


def softmax_wrong_axis(scores, dtype):
    """BUG: normalises over the queries (axis -2) instead of the keys."""
    row_max = scores.max(axis=-2, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    row_sum = p.sum(axis=-2, keepdims=True)
    return p / np.where(row_sum > 0, row_sum, 1.0)


def band_causal_off_by_one(T, S, is_causal, causal_alignment, window):
    """BUG: causal keeps s < t, dropping the diagonal."""
    allowed = band(T, S, False, causal_alignment, window)
    if is_causal:
        offset = 0 if causal_alignment == "top_left" else S - T
        allowed &= np.arange(S)[None, :] < np.arange(T)[:, None] + offset
    return allowed


def band_always_bottom_right(T, S, is_causal, causal_alignment, window):
    """BUG: bottom-right alignment even when top-left is asked."""
    return band(T, S, is_causal, "bottom_right", window)


def band_always_top_left(T, S, is_causal, causal_alignment, window):
    """BUG: top-left alignment even when bottom-right is asked."""
    return band(T, S, is_causal, "top_left", window)


def documents(cu_seqlens_q, cu_seqlens_k):
    """Packed documents (SPEC §18.1): (t0, t1, s0, s1) of each, its queries t0:t1 and its
    keys s0:s1."""
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    return [(cq[n], cq[n + 1], ck[n], ck[n + 1]) for n in range(len(cq) - 1)]


def documents_leaking(cu_seqlens_q, cu_seqlens_k):
    """BUG: documents leak across a boundary: each document's keys start one early, so its
    queries also see the last key of the document before it."""
    return [
        (t0, t1, max(s0 - 1, 0), s1) for t0, t1, s0, s1 in documents(cu_seqlens_q, cu_seqlens_k)
    ]


def chunks_off_by_one(T, S, chunk_size, causal_alignment):
    """BUG: the chunk boundary off by one: the query's position counted from 1, so the
    last query of each chunk lands in the next one."""
    offset = 0 if causal_alignment == "top_left" else S - T
    position = np.arange(T)[:, None] + offset + 1
    return position // chunk_size == np.arange(S)[None, :] // chunk_size


def alibi_off_by_one(slopes, T, S, H):
    """BUG: ALiBi's distance off by one, |t + S − T − s + 1|: the diagonal key is
    penalised as if one step away, and the key after it not at all."""
    distance = np.abs(np.arange(T)[:, None] + S - T - np.arange(S)[None, :] + 1)
    return -slopes.reshape(-1, H, 1, 1) * distance.astype(slopes.dtype)


def page_of_off_by_one(table_row, s, L):
    """BUG: a page table read off by one: key s is read from the next table entry,
    block_table[b, s // L + 1] (the last entry for the last page), as if the table
    started one page late."""
    return table_row[min(s // L + 1, len(table_row) - 1)]


def expand_kv_tile(x, G):
    """BUG: tiles the key/value heads (κ = h % K) instead of repeat_interleave (κ = h // G)."""
    return np.tile(x, (1, G, 1, 1))


def softmax_no_max_subtraction(scores, dtype):
    """BUG: exp of the raw scores, which overflows for large logits."""
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(scores)
        row_sum = p.sum(axis=-1, keepdims=True)
        return p / np.where(row_sum > 0, row_sum, 1.0)


def softmax_nan_rows(scores, dtype):
    """BUG: the textbook softmax: a fully masked row is exp(-inf - -inf) = NaN."""
    with np.errstate(invalid="ignore"):
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return p / p.sum(axis=-1, keepdims=True)


def softmax_mean_rows(scores, dtype):
    """BUG: a fully masked row gets uniform weights, i.e. the mean of V (as JAX does)."""
    weights = softmax(scores, dtype)
    empty = np.isneginf(scores).all(axis=-1, keepdims=True)
    return np.where(empty, 1.0 / scores.shape[-1], weights)


def bool_allowed_flipped(mask):
    """BUG: a bool mask's True means "blocked"."""
    return ~mask


def float_mask_multiplied(scores, mask):
    """BUG: the float mask multiplies the scores instead of being added."""
    with np.errstate(invalid="ignore"):
        return scores * mask


def dropout_never(weights, p, rng):
    """BUG: ignores p, never drops anything."""
    return weights


def softmax_float16_sum(scores, dtype):
    """BUG: for float16 inputs the exponentials are summed in float16."""
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    if dtype == np.float16:
        # One running float16 total, key after key, as a loop or a kernel would keep it.
        row_sum = np.cumsum(p.astype(np.float16), axis=-1, dtype=np.float16)[..., -1:]
        row_sum = row_sum.astype(p.dtype)
    else:
        row_sum = p.sum(axis=-1, keepdims=True)
    return p / np.where(row_sum > 0, row_sum, 1.0)


def cast_output_float64(out, dtype):
    """BUG: the output is always float64."""
    return out.astype(np.float64)


def merge_heads_wrong_order(context):
    """BUG: merges the heads channel-major, (B, T, D, H) before the reshape."""
    B, H, T, D = context.shape
    return context.transpose(0, 2, 3, 1).reshape(B, T, H * D)


def hide_unused_never(k, v, allowed):
    """BUG: unused slots are multiplied by weight 0, and 0 · NaN = NaN leaks out."""
    return k, v


def block_by_adding(scores, allowed):
    """BUG: -inf is added to a blocked key's score, not selected: a NaN or inf its key
    put in the score stays NaN (NaN + -inf, inf + -inf)."""
    with np.errstate(invalid="ignore"):
        return scores + np.where(allowed, 0.0, -np.inf)


def softmax_nan_as_empty(scores, dtype):
    """BUG: NaN scores are read as blocked keys (PyTorch SDPA's CPU flash kernel does this
    for rows whose every score is NaN): a NaN query row comes back 0."""
    return softmax(np.where(np.isnan(scores), -np.inf, scores), dtype)


def sink_softmax_in_numerator(scores, sinks):
    """BUG: the sink's term is added to every attended key's numerator as well as to the
    sum, so the weights sum to more than 1."""
    live = (scores != -np.inf).any(axis=-1, keepdims=True)
    sink = np.where(live, sinks, -np.inf)
    row_max = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        extra = np.exp(sink - row_max)
        p = np.exp(scores - row_max) + np.where(scores != -np.inf, extra, 0.0)
        row_sum = np.exp(scores - row_max).sum(axis=-1, keepdims=True) + extra
    return p / np.where(row_sum > 0, row_sum, 1.0)


#: The key tile of the blockwise mutant: the size real kernels use.
KEY_TILE = 128


def softmax_tiles_max_kept_at_zero(scores, dtype):
    """BUG: a blockwise softmax over key tiles of 128, whose running max, after a row's
    first tile is fully masked, keeps the 0 it takes in place of -inf: a row whose later
    scores are all far below 0 then underflows, to a sum of 0 (the row comes back 0) or
    of subnormals."""
    m = np.full((*scores.shape[:-1], 1), -np.inf, dtype=scores.dtype)  # (B, H, T, 1)
    total = np.zeros_like(m)  # (B, H, T, 1)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for s0 in range(0, scores.shape[-1], KEY_TILE):
            x = scores[..., s0 : s0 + KEY_TILE]  # (B, H, T, Sb)
            m_new = np.maximum(m, x.max(axis=-1, keepdims=True))
            m_new = np.where(np.isfinite(m_new), m_new, 0.0)  # the bug: kept as the max
            total = np.exp(m - m_new) * total + np.exp(x - m_new).sum(axis=-1, keepdims=True)
            m = m_new
        p = np.exp(scores - m)  # (B, H, T, S)
        return p / np.where(total > 0, total, 1.0)


def online_softmax(scores, tile, *, rescale_sum=True, rescale_acc=True):
    """The weights a blockwise (online) softmax over key tiles of ``tile`` leaves: its loop
    run with V = the identity over the keys, so that the accumulator over the sum is the
    weights themselves (and their product with v what the kernel returns). When a tile
    raises the row's maximum, the running sum and the accumulator are rescaled by
    exp(old max - new max); ``rescale_sum`` or ``rescale_acc`` False leaves one out."""
    m = np.full((*scores.shape[:-1], 1), -np.inf, dtype=scores.dtype)  # (B, H, T, 1)
    total = np.zeros_like(m)  # (B, H, T, 1)
    acc = np.zeros_like(scores)  # (B, H, T, S): the accumulator, V = the identity
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for s0 in range(0, scores.shape[-1], tile):
            x = scores[..., s0 : s0 + tile]  # (B, H, T, Sb)
            m_new = np.maximum(m, x.max(axis=-1, keepdims=True))
            shift = np.where(np.isfinite(m_new), m_new, 0.0)  # a fully masked tile so far
            alpha = np.exp(m - shift)  # (B, H, T, 1)
            p = np.exp(x - shift)  # (B, H, T, Sb)
            total = (alpha if rescale_sum else 1.0) * total + p.sum(axis=-1, keepdims=True)
            acc = (alpha if rescale_acc else 1.0) * acc
            acc[..., s0 : s0 + tile] += p
            m = m_new
        return acc / np.where(total > 0, total, 1.0)


def softmax_tiles_sum_not_rescaled(scores, dtype):
    """BUG: a blockwise softmax over key tiles of 512 whose running sum is not rescaled
    when a tile raises the row's maximum."""
    return online_softmax(scores, 512, rescale_sum=False)


def softmax_tiles_accumulator_not_rescaled(scores, dtype):
    """BUG: a blockwise softmax over key tiles of 1,024 whose accumulator is not rescaled
    when a tile raises the row's maximum."""
    return online_softmax(scores, 1024, rescale_acc=False)


def softmax_no_identity(scores, dtype):
    """BUG: the row max of an empty key axis (S = 0) raises instead of starting at -inf."""
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    return p / np.where(row_sum > 0, row_sum, 1.0)


# --- The correct backward steps ------------------------------------------------------------


def grouped(x, K, G):
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    return x.reshape(b, 1, 1, t, s) if h == 1 else x.reshape(b, K, G, t, s)


def backward_weights(scores):
    """The forward's weights again; a row with every key at -inf gets weights 0, and one
    that read a +inf score (row sum +inf) NaN weights throughout (SPEC §4.1)."""
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    divisor = np.where(row_sum > 0, row_sum, 1.0)
    with np.errstate(invalid="ignore"):
        return p / np.where(row_sum == np.inf, np.nan, divisor)


def backward_sink_weights(scores, sinks):
    """The forward's weights with sinks, and each row's sink weight p_sink (..., 1): 0 in a
    row with no key."""
    live = (scores != -np.inf).any(axis=-1, keepdims=True)
    sink = np.where(live, sinks, -np.inf)
    row_max = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    p_sink = np.exp(sink - row_max)
    row_sum = p.sum(axis=-1, keepdims=True) + p_sink
    row_sum = np.where(row_sum > 0, row_sum, 1.0)
    return p / row_sum, p_sink / row_sum


def softmax_backward(weights, d_weights, d_out, out):
    """dZ = P ⊙ (dP − rowsum(dO ⊙ O))."""
    d_row = np.sum(d_out * out, axis=-1, keepdims=True)
    return weights * (d_weights - d_row)


def sum_to(x, shape):
    """The float mask's gradient: dZ summed over the axes the mask was broadcast along."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def softcap_backward(d_scores, raw, softcap):
    """Chain rule through c·tanh(R/c): times 1 − tanh²(R/c)."""
    return d_scores * (1.0 - np.tanh(raw / softcap) ** 2)


def key_scale(d_scores, scale):
    """R = scale · q·k, so dK carries the scale as dQ does."""
    return d_scores * scale


def group_sum(x):
    """(B, K, G, S, ·) -> (B, K, S, ·): a shared key/value head collects its whole group."""
    return x.sum(axis=2)


# --- The broken backward steps -------------------------------------------------------------


def softmax_backward_no_rowsum(weights, d_weights, d_out, out):
    """BUG: dZ = P ⊙ dP, without the rowsum(dO ⊙ O) coupling term."""
    return weights * d_weights


def softcap_backward_none(d_scores, raw, softcap):
    """BUG: no chain rule through the softcap (as if d tanh were 1)."""
    return d_scores


def key_scale_none(d_scores, scale):
    """BUG: dK misses the scale factor."""
    return d_scores


def group_first_head(x):
    """BUG: a shared key/value head takes the gradient of the group's first query head only."""
    return x[:, :, 0]


def backward_weights_nan_rows(scores):
    """BUG: the textbook softmax in the backward: fully masked rows give NaN gradients."""
    with np.errstate(invalid="ignore"):
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return p / p.sum(axis=-1, keepdims=True)


def sum_to_not_reduced(x, shape):
    """BUG: dmask is not reduced over the broadcast axes: it comes back (B, H, T, S)."""
    return x


# --- The algorithm, step by step -----------------------------------------------------------


class Steps:
    """The reference algorithm; a mutant replaces one of these staticmethods."""

    scale_for = staticmethod(default_scale)
    expand_kv = staticmethod(expand_kv)
    apply_float_mask = staticmethod(apply_float_mask)
    bool_allowed = staticmethod(bool_allowed)
    band = staticmethod(band)
    chunks = staticmethod(chunks)
    documents = staticmethod(documents)
    alibi = staticmethod(alibi)
    page_of = staticmethod(page_of)
    hide_unused = staticmethod(hide_unused)
    block = staticmethod(block)
    softmax = staticmethod(softmax)
    sink_softmax = staticmethod(sink_softmax)
    dropout = staticmethod(dropout)
    cast_output = staticmethod(cast_output)
    merge_heads = staticmethod(merge_heads)

    def run(
        self,
        q,
        k,
        v,
        *,
        mask=None,
        is_causal=False,
        scale=None,
        causal_alignment="top_left",
        window=None,
        softcap=None,
        dropout_p=0.0,
        rng=None,
        sinks=None,
        chunk_size=None,
        alibi_slopes=None,
    ):
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        mask = None if mask is None else np.asarray(mask)
        sinks = None if sinks is None else np.asarray(sinks)
        call = contract.check(
            q,
            k,
            v,
            mask=mask,
            is_causal=is_causal,
            scale=scale,
            causal_alignment=causal_alignment,
            window=window,
            softcap=softcap,
            dropout_p=dropout_p,
            random=("rng", rng, isinstance(rng, np.random.Generator), "a numpy.random.Generator"),
            sinks=sinks,
            chunk_size=chunk_size,
            alibi_slopes=alibi_slopes,
        )
        unbatched = call.unbatched
        if unbatched:
            q, k, v = q[None], k[None], v[None]
        B, H, T, D = q.shape
        _, K, S, _ = k.shape
        G = H // K
        if mask is not None:
            mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
        scale = self.scale_for(D, None if scale is None else call.scale)

        dtype = q.dtype
        work = np.float64 if dtype == np.float64 else np.float32
        q, k, v = q.astype(work), k.astype(work), v.astype(work)
        k, v = self.expand_kv(k, G), self.expand_kv(v, G)  # (B, H, S, ·)

        allowed = np.ones((1, 1, T, S), dtype=bool)
        if mask is not None and mask.dtype == np.bool_:
            allowed = allowed & self.bool_allowed(mask)
        elif mask is not None:
            allowed = allowed & (mask != -np.inf)
        if is_causal or window is not None:
            allowed = allowed & self.band(T, S, is_causal, causal_alignment, window)
        if chunk_size is not None:
            allowed = allowed & self.chunks(T, S, call.chunk_size, causal_alignment)
        k, v = self.hide_unused(k, v, allowed)  # (B, H, S, ·)

        scores = np.einsum("bhtd,bhsd->bhts", q, k) * work(scale)  # (B, H, T, S)
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        if alibi_slopes is not None:
            scores = scores + self.alibi(np.asarray(alibi_slopes).astype(work), T, S, H)
        if mask is not None and mask.dtype != np.bool_:
            scores = self.apply_float_mask(scores, mask.astype(work))
        scores = self.block(scores, allowed)  # (B, H, T, S)

        if sinks is None:
            weights = self.softmax(scores, dtype)  # (B, H, T, S)
        else:
            weights = self.sink_softmax(scores, sinks.astype(work).reshape(1, H, 1, 1))
        if dropout_p > 0:
            weights = self.dropout(weights, dropout_p, rng)
        out = self.cast_output(np.einsum("bhts,bhse->bhte", weights, v), dtype)
        return out[0] if unbatched else out

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        x = np.asarray(x)
        B, T, C = x.shape
        H = n_heads
        if not isinstance(H, int) or H <= 0 or C % H != 0:
            raise ValueError(
                f"n_heads H={H} should be a positive int dividing the model width C={C}"
            )
        D = C // H
        qkv = linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
        q, k, v = (
            part.reshape(B, T, H, D).transpose(0, 2, 1, 3) for part in np.split(qkv, 3, axis=-1)
        )  # 3 × (B, H, T, D)
        context = self.run(q, k, v, mask=mask, is_causal=is_causal)  # (B, H, T, D)
        context = self.merge_heads(context)  # (B, T, C)
        return linear(context, params["out_proj.weight"], params["out_proj.bias"])

    def gpt_block(self, params, x, *, n_heads):
        attn = {name[5:]: p for name, p in params.items() if name.startswith("attn.")}
        h = layer_norm(x, params["norm1.weight"], params["norm1.bias"])
        x = x + self.multi_head_attention(attn, h, n_heads=n_heads, is_causal=True)
        h = layer_norm(x, params["norm2.weight"], params["norm2.bias"])
        h = gelu(linear(h, params["mlp.0.weight"], params["mlp.0.bias"]))
        return x + linear(h, params["mlp.2.weight"], params["mlp.2.bias"])


class BackwardSteps:
    """The reference backward (``impls/numpy/backward.py:attention_backward``), cut into
    steps; a gradient mutant replaces one of these staticmethods."""

    weights = staticmethod(backward_weights)
    softmax_backward = staticmethod(softmax_backward)
    sum_to = staticmethod(sum_to)
    softcap_backward = staticmethod(softcap_backward)
    key_scale = staticmethod(key_scale)
    group_sum = staticmethod(group_sum)

    def run(
        self,
        q,
        k,
        v,
        d_out,
        *,
        mask=None,
        is_causal=False,
        scale=None,
        causal_alignment="top_left",
        window=None,
        softcap=None,
        sinks=None,
        chunk_size=None,
        alibi_slopes=None,
    ):
        q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
        mask = None if mask is None else np.asarray(mask)
        sinks = None if sinks is None else np.asarray(sinks)
        call = contract.check(
            q,
            k,
            v,
            mask=mask,
            is_causal=is_causal,
            scale=scale,
            causal_alignment=causal_alignment,
            window=window,
            softcap=softcap,
            d_out=d_out,
            sinks=sinks,
            chunk_size=chunk_size,
            alibi_slopes=alibi_slopes,
        )
        unbatched = call.unbatched
        if unbatched:
            q, k, v, d_out = q[None], k[None], v[None], d_out[None]
        B, H, T, D = q.shape
        _, K, S, _ = k.shape
        E = v.shape[-1]
        G = H // K
        mask_shape = None if mask is None else mask.shape
        mask_dtype = None if mask is None else mask.dtype
        if mask is not None:
            mask = mask.reshape(call.mask_shape)  # (B|1, H|1, T|1, S|1)
        scale = call.scale

        dtype = q.dtype
        work = np.float64 if dtype == np.float64 else np.float32
        q, k, v, d_out = q.astype(work), k.astype(work), v.astype(work), d_out.astype(work)

        # The forward again, keeping the raw scores R, the weights P and the output O;
        # slots no query of a group sees are replaced by 0 (SPEC §4.7, §12.12).
        allowed = _visible(mask, call)  # (B|1, H|1, T, S)
        used = np.broadcast_to(allowed, (*allowed.shape[:2], T, S))
        used = grouped(used, K, G).any(axis=(2, 3))[..., None]  # (B|1, K|1, S, 1)
        k, v = np.where(used, k, 0.0), np.where(used, v, 0.0)
        q = q.reshape(B, K, G, T, D)  # (B, K, G, T, D)
        raw = np.einsum("bkgtd,bksd->bkgts", q, k) * work(scale)  # (B, K, G, T, S)
        scores = softcap * np.tanh(raw / softcap) if softcap is not None else raw
        if alibi_slopes is not None:
            bias = alibi(np.asarray(alibi_slopes).astype(work), T, S, H)  # (B|1, H, T, S)
            scores = scores + grouped(bias, K, G)
        if mask is not None and mask.dtype != np.bool_:
            scores = scores + grouped(mask.astype(work), K, G)
        scores = np.where(grouped(allowed, K, G), scores, -np.inf)  # (B, K, G, T, S)
        if sinks is None:
            weights = self.weights(scores)  # (B, K, G, T, S)
        else:
            sink_logits = sinks.astype(work).reshape(1, K, G, 1, 1)
            weights, p_sink = backward_sink_weights(scores, sink_logits)  # p_sink (B, K, G, T, 1)
        out = np.einsum("bkgts,bkse->bkgte", weights, v)  # (B, K, G, T, E)
        d_out = d_out.reshape(B, K, G, T, E)  # (B, K, G, T, E)

        # Backward: dV = Pᵀ·dO, dP = dO·Vᵀ, dZ, dmask, softcap, scale, dQ and dK.
        d_v = self.group_sum(np.einsum("bkgts,bkgte->bkgse", weights, d_out))  # (B, K, S, E)
        d_weights = np.einsum("bkgte,bkse->bkgts", d_out, v)  # (B, K, G, T, S)
        d_scores = self.softmax_backward(weights, d_weights, d_out, out)  # (B, K, G, T, S)
        d_mask = None
        if mask_dtype is not None and mask_dtype != np.bool_:
            d_full = d_scores.reshape(B, H, T, S)
            d_mask = self.sum_to(d_full[0] if unbatched else d_full, mask_shape)
            d_mask = d_mask.astype(mask_dtype)
        if softcap is not None:
            d_scores = self.softcap_backward(d_scores, raw, softcap)
        d_q = np.einsum("bkgts,bksd->bkgtd", d_scores * work(scale), k).reshape(B, H, T, D)
        d_k = self.group_sum(
            np.einsum("bkgts,bkgtd->bkgsd", self.key_scale(d_scores, work(scale)), q)
        )  # (B, K, S, D)

        grads = [d_q.astype(dtype), d_k.astype(dtype), d_v.astype(dtype)]
        if unbatched:
            grads = [g[0] for g in grads]
        if d_mask is not None:
            grads.append(d_mask)
        if sinks is not None:
            # dsinks = −Σ_{b,t} p_sink · rowsum(dO ⊙ O) (SPEC §15.5).
            d_row = np.sum(d_out * out, axis=-1, keepdims=True)  # (B, K, G, T, 1)
            grads.append((-(p_sink * d_row).sum(axis=(0, 3, 4))).reshape(H).astype(dtype))
        return tuple(grads)


def _visible(mask, call) -> np.ndarray:
    """Which keys each query may see, (B|1, H|1, T, S): the mask's, the band's and the
    chunks' together, as the reference backward builds them."""
    T, S, alignment = call.T, call.S, call.causal_alignment
    allowed = np.ones((1, 1, T, S), dtype=bool)
    if mask is not None and mask.dtype == np.bool_:
        allowed = allowed & mask
    elif mask is not None:
        allowed = allowed & (mask != -np.inf)
    if call.is_causal or call.window is not None:
        allowed = allowed & band(T, S, call.is_causal, alignment, call.window)[None, None]
    if call.chunk_size is not None:
        allowed = allowed & chunks(T, S, call.chunk_size, alignment)[None, None]
    return allowed


class MutantBackend(Backend):
    """A NumPy backend running ``steps``; declares what the numpy backend declares."""

    capabilities = ALL_CAPABILITIES - {"module"}
    dtypes = DTYPES
    steps: type[Steps] = Steps
    backward: type[BackwardSteps] = BackwardSteps

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["rng"] = np.random.default_rng(seed)
        return self.steps().run(q, k, v, **options)

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        # Reached only by backends declaring "packed" (the packed mutant, the control).
        steps = self.steps()
        contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, **options)
        out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)
        for t0, t1, s0, s1 in steps.documents(cu_seqlens_q, cu_seqlens_k):
            out[:, t0:t1] = steps.run(
                q[None, :, t0:t1], k[None, :, s0:s1], v[None, :, s0:s1], **options
            )[0]
        return out

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        contract.check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, d_out=d_out, **options)
        grads = [np.zeros(x.shape, dtype=q.dtype) for x in (q, k, v)]
        for t0, t1, s0, s1 in self.steps().documents(cu_seqlens_q, cu_seqlens_k):
            doc = self.backward().run(
                q[None, :, t0:t1],
                k[None, :, s0:s1],
                v[None, :, s0:s1],
                d_out[None, :, t0:t1],
                **options,
            )
            grads[0][:, t0:t1], grads[1][:, s0:s1], grads[2][:, s0:s1] = (g[0] for g in doc[:3])
        return tuple(grads)

    def _attention_vjp(self, q, k, v, d_out, **options):
        # Reached only by backends declaring "grad" (the gradient mutants, the control).
        return self.backward().run(q, k, v, d_out, **options)

    # Paged KV caches (SPEC §19), reached only by backends declaring "paged": each
    # sequence's keys gathered through ``Steps.page_of``, then the steps above, aligned
    # bottom-right; the gradients added back into the slots read.

    def _sequences(self, k_pages, v_pages, block_table, seq_lens):
        L = k_pages.shape[2]
        for b, n in enumerate(np.asarray(seq_lens).tolist()):
            slots = [(int(self.steps.page_of(block_table[b], s, L)), s % L) for s in range(n)]
            k = np.stack([k_pages[p, :, i] for p, i in slots], axis=1) if slots else None
            v = np.stack([v_pages[p, :, i] for p, i in slots], axis=1) if slots else None
            empty = k_pages.shape[1], 0
            k = np.zeros((*empty, k_pages.shape[3]), k_pages.dtype) if k is None else k
            v = np.zeros((*empty, v_pages.shape[3]), v_pages.dtype) if v is None else v
            yield b, k[None], v[None], slots  # (1, K, n, D), (1, K, n, E)

    def _attention_paged(self, q, k_pages, v_pages, block_table, seq_lens, **options):
        contract.check_paged(q, k_pages, v_pages, block_table, seq_lens, **options)
        out = np.zeros((*q.shape[:3], v_pages.shape[-1]), dtype=q.dtype)
        for b, k, v, _ in self._sequences(k_pages, v_pages, block_table, seq_lens):
            run = self.steps().run(q[b : b + 1], k, v, causal_alignment="bottom_right", **options)
            out[b] = run[0]
        return out

    def _attention_paged_vjp(self, q, k_pages, v_pages, block_table, seq_lens, d_out, **options):
        contract.check_paged(q, k_pages, v_pages, block_table, seq_lens, d_out=d_out, **options)
        dq = np.zeros(q.shape, dtype=q.dtype)
        dk_pages = np.zeros(k_pages.shape)
        dv_pages = np.zeros(v_pages.shape)
        for b, k, v, slots in self._sequences(k_pages, v_pages, block_table, seq_lens):
            args = (q[b : b + 1], k, v, d_out[b : b + 1])
            dq_b, dk, dv = self.backward().run(*args, causal_alignment="bottom_right", **options)
            dq[b] = dq_b[0]
            for s, (p, i) in enumerate(slots):
                dk_pages[p, :, i] += dk[0, :, s]
                dv_pages[p, :, i] += dv[0, :, s]
        return dq, dk_pages.astype(q.dtype), dv_pages.astype(q.dtype)


class GradientMutantBackend(MutantBackend):
    """The unbroken forward with a backward running ``backward``."""

    capabilities = (ALL_CAPABILITIES - {"module"}) | GRAD


class SinkMutantBackend(MutantBackend):
    """A forward mutant that also declares "sinks" (SPEC §15)."""

    capabilities = (ALL_CAPABILITIES - {"module"}) | {"sinks"}


class ChunkMutantBackend(MutantBackend):
    """A forward mutant that also declares "chunked" (SPEC §16)."""

    capabilities = (ALL_CAPABILITIES - {"module"}) | {"chunked"}


class PackedMutantBackend(MutantBackend):
    """A forward mutant that also declares "packed" (SPEC §18)."""

    capabilities = (ALL_CAPABILITIES - {"module"}) | {"packed"}


class AlibiMutantBackend(MutantBackend):
    """A forward mutant that also declares "alibi" (SPEC §17)."""

    capabilities = (ALL_CAPABILITIES - {"module"}) | {"alibi"}


class PagedMutantBackend(MutantBackend):
    """A forward mutant that also declares "paged" (SPEC §19)."""

    capabilities = (ALL_CAPABILITIES - {"module"}) | {"paged"}


class ModuleMutantBackend(MutantBackend):
    capabilities = ALL_CAPABILITIES

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        return self.steps().multi_head_attention(
            params, x, n_heads=n_heads, mask=mask, is_causal=is_causal
        )

    def gpt_block(self, params, x, *, n_heads):
        return self.steps().gpt_block(params, x, n_heads=n_heads)


def _mutant(name, step, broken, base=MutantBackend):
    """A backend class whose ``Steps`` has ``step`` replaced by ``broken``."""
    steps = type(f"Steps_{broken.__name__}", (Steps,), {step: staticmethod(broken)})
    return type(f"Mutant_{broken.__name__}", (base,), {"name": name, "steps": steps})


def _gradient_mutant(name, step, broken):
    """A backend class whose ``BackwardSteps`` has ``step`` replaced by ``broken``."""
    backward = type(
        f"BackwardSteps_{broken.__name__}", (BackwardSteps,), {step: staticmethod(broken)}
    )
    return type(
        f"GradientMutant_{broken.__name__}",
        (GradientMutantBackend,),
        {"name": name, "backward": backward},
    )


#: The unbroken algorithm, forward and backward, as a control: the suite must pass it.
Control = type(
    "MutantControl",
    (ModuleMutantBackend,),
    {
        "name": "mutant-control",
        "capabilities": ALL_CAPABILITIES | GRAD | {"sinks", "chunked", "alibi", "packed", "paged"},
    },
)

#: name: (backend class, clauses that should catch it, substring the failing node id needs)
MUTANTS = {
    "mutant-scale-1-over-d": (
        _mutant("mutant-scale-1-over-d", "scale_for", scale_one_over_d),
        {"4.1", "11.1"},
        "",
    ),
    "mutant-no-scale": (
        _mutant("mutant-no-scale", "scale_for", scale_none),
        {"4.1", "11.1"},
        "",
    ),
    "mutant-softmax-wrong-axis": (
        _mutant("mutant-softmax-wrong-axis", "softmax", softmax_wrong_axis),
        {"4.1", "6.2", "11.1"},
        "",
    ),
    "mutant-causal-off-by-one": (
        _mutant("mutant-causal-off-by-one", "band", band_causal_off_by_one),
        {"3.4", "6.3"},
        "",
    ),
    "mutant-bottom-right-for-top-left": (
        _mutant("mutant-bottom-right-for-top-left", "band", band_always_bottom_right),
        {"3.4", "6.2", "6.3"},
        "",
    ),
    "mutant-top-left-for-bottom-right": (
        _mutant("mutant-top-left-for-bottom-right", "band", band_always_top_left),
        {"3.5", "6.11"},
        "",
    ),
    "mutant-gqa-tile": (
        _mutant("mutant-gqa-tile", "expand_kv", expand_kv_tile),
        {"4.6", "6.12"},
        "",
    ),
    "mutant-no-max-subtraction": (
        _mutant("mutant-no-max-subtraction", "softmax", softmax_no_max_subtraction),
        {"4.4", "6.7"},
        "",
    ),
    "mutant-nan-masked-rows": (
        _mutant("mutant-nan-masked-rows", "softmax", softmax_nan_rows),
        {"4.3"},
        "",
    ),
    "mutant-mean-masked-rows": (
        _mutant("mutant-mean-masked-rows", "softmax", softmax_mean_rows),
        {"4.3"},
        "",
    ),
    "mutant-mask-polarity": (
        _mutant("mutant-mask-polarity", "bool_allowed", bool_allowed_flipped),
        {"3.1", "6.4"},
        "",
    ),
    "mutant-float-mask-multiplied": (
        _mutant("mutant-float-mask-multiplied", "apply_float_mask", float_mask_multiplied),
        {"3.2", "6.4"},
        "",
    ),
    "mutant-dropout-never": (
        _mutant("mutant-dropout-never", "dropout", dropout_never),
        {"5.2"},
        "",
    ),
    "mutant-float16-sum": (
        _mutant("mutant-float16-sum", "softmax", softmax_float16_sum),
        {"7.1", "4.5"},
        "float16",
    ),
    "mutant-output-float64": (
        _mutant("mutant-output-float64", "cast_output", cast_output_float64),
        {"2.4", "6.1"},
        "",
    ),
    "mutant-heads-merged-wrong": (
        _mutant(
            "mutant-heads-merged-wrong",
            "merge_heads",
            merge_heads_wrong_order,
            base=ModuleMutantBackend,
        ),
        {"9.1", "9.2"},
        "",
    ),
    # Behaviour at the edges (SPEC §2.5, §4.7, §4.9).
    "mutant-unused-slots-read": (
        _mutant("mutant-unused-slots-read", "hide_unused", hide_unused_never),
        {"4.7"},
        "",
    ),
    "mutant-nan-rows-zero": (
        _mutant("mutant-nan-rows-zero", "softmax", softmax_nan_as_empty),
        {"4.9"},
        "",
    ),
    # Blockwise kernels (issue 31): rows whose first key tile is fully masked.
    "mutant-tiles-max-kept-at-zero": (
        _mutant("mutant-tiles-max-kept-at-zero", "softmax", softmax_tiles_max_kept_at_zero),
        {"4.4"},
        "test_tile_boundary_cases",
    ),
    # Blockwise kernels at the key tiles CPUs use: a missed rescale when the row max grows.
    "mutant-tiles-sum-not-rescaled": (
        _mutant("mutant-tiles-sum-not-rescaled", "softmax", softmax_tiles_sum_not_rescaled),
        {"4.10"},
        "test_long_rows",
    ),
    "mutant-tiles-accumulator-not-rescaled": (
        _mutant(
            "mutant-tiles-accumulator-not-rescaled",
            "softmax",
            softmax_tiles_accumulator_not_rescaled,
        ),
        {"4.10"},
        "test_long_rows",
    ),
    "mutant-empty-keys-raise": (
        _mutant("mutant-empty-keys-raise", "softmax", softmax_no_identity),
        {"2.5"},
        "",
    ),
    # Attention sinks (SPEC §15).
    "mutant-sink-in-numerator": (
        _mutant(
            "mutant-sink-in-numerator",
            "sink_softmax",
            sink_softmax_in_numerator,
            base=SinkMutantBackend,
        ),
        {"15.1"},
        "",
    ),
    # Chunked local attention (SPEC §16).
    "mutant-chunk-off-by-one": (
        _mutant(
            "mutant-chunk-off-by-one",
            "chunks",
            chunks_off_by_one,
            base=ChunkMutantBackend,
        ),
        {"16.1"},
        "",
    ),
    # ALiBi (SPEC §17).
    "mutant-alibi-off-by-one": (
        _mutant("mutant-alibi-off-by-one", "alibi", alibi_off_by_one, base=AlibiMutantBackend),
        {"17.1"},
        "",
    ),
    # Packed variable-length sequences (SPEC §18).
    "mutant-packed-documents-leak": (
        _mutant(
            "mutant-packed-documents-leak",
            "documents",
            documents_leaking,
            base=PackedMutantBackend,
        ),
        {"18.1"},
        "",
    ),
    # Paged KV caches (SPEC §19).
    "mutant-page-table-off-by-one": (
        _mutant(
            "mutant-page-table-off-by-one",
            "page_of",
            page_of_off_by_one,
            base=PagedMutantBackend,
        ),
        {"19.1"},
        "",
    ),
    # The backward pass (SPEC §12): the forward is correct, only the gradients are broken.
    "mutant-grad-no-rowsum": (
        _gradient_mutant("mutant-grad-no-rowsum", "softmax_backward", softmax_backward_no_rowsum),
        {"12.1"},
        "",
    ),
    "mutant-grad-no-softcap-chain-rule": (
        _gradient_mutant(
            "mutant-grad-no-softcap-chain-rule", "softcap_backward", softcap_backward_none
        ),
        {"12.2"},
        "softcap",
    ),
    "mutant-grad-gqa-first-head": (
        _gradient_mutant("mutant-grad-gqa-first-head", "group_sum", group_first_head),
        {"12.2"},
        "",
    ),
    "mutant-grad-dk-unscaled": (
        _gradient_mutant("mutant-grad-dk-unscaled", "key_scale", key_scale_none),
        {"12.1"},
        "",
    ),
    "mutant-grad-nan-masked-rows": (
        _gradient_mutant("mutant-grad-nan-masked-rows", "weights", backward_weights_nan_rows),
        {"12.4"},
        "",
    ),
    "mutant-grad-dmask-not-reduced": (
        _gradient_mutant("mutant-grad-dmask-not-reduced", "sum_to", sum_to_not_reduced),
        {"12.3"},
        "",
    ),
}

#: The mutants whose forward is correct: every test they fail must be a gradient test.
GRADIENT_MUTANTS = frozenset(name for name in MUTANTS if name.startswith("mutant-grad-"))
