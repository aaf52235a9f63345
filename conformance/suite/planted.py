"""The oracle's runs with a misreading of attention planted, for
``conformance.suite.diagnosis``: the departing call as float64 arrays (``Call``), the
oracle's float64 textbook run on it with changed inputs or options (``oracle_run``), the
keys each row attends (``allowed``), a float64 textbook for the misreadings no input
can express (``textbook``), and the outputs with one input or option misread that
``conformance/suite/misreadings.py`` names (``rows_as``, ``window_shifted``,
``keys_past_s``, ...).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

#: The keywords of ``attention`` the misreadings know; a call with another one (dropout,
#: a seed) is not diagnosed.
OPTIONS = (
    "is_causal",
    "scale",
    "causal_alignment",
    "window",
    "softcap",
    "sinks",
    "chunk_size",
    "alibi_slopes",
)


class Call(NamedTuple):
    """The departing call, batched and in float64: q (B, H, T, D), k (B, K, S, D), v (B, K,
    S, E); the mask as given (bool, or float64); the options with their defaults filled in."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    options: dict

    @property
    def is_causal(self) -> bool:
        return bool(self.options.get("is_causal"))

    @property
    def scale(self) -> float:
        given = self.options.get("scale")
        return 1.0 / math.sqrt(self.q.shape[-1]) if given is None else float(given)

    @property
    def float_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype != np.bool_

    @property
    def bool_mask(self) -> bool:
        return self.mask is not None and self.mask.dtype == np.bool_


def call_of(args: tuple, kwargs: dict) -> Call | None:
    """The ``Call`` of a logged ``attention`` call, or None where it is not one the
    misreadings cover (dropout, packed or other keywords, arrays of the wrong rank)."""
    if len(args) < 3 or set(kwargs) - {"mask", *OPTIONS}:
        return None
    q, k, v = (np.asarray(a).astype(np.float64) for a in args[:3])
    if q.ndim == 3 and k.ndim == 3 and v.ndim == 3:
        q, k, v = q[None], k[None], v[None]  # (1, H, T, D)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[1] == 0:
        return None
    if q.shape[1] % k.shape[1] or k.shape[2] != v.shape[2]:
        return None
    mask = kwargs.get("mask")
    if mask is not None:
        mask = np.asarray(mask)
        mask = mask if mask.dtype == np.bool_ else mask.astype(np.float64)
    options = {name: kwargs[name] for name in OPTIONS if kwargs.get(name) is not None}
    options.setdefault("causal_alignment", "top_left")
    for name in ("sinks", "alibi_slopes"):
        if name in options:
            options[name] = np.asarray(options[name]).astype(np.float64)
    if options.get("window") is not None:
        options["window"] = tuple(options["window"])
    return Call(q, k, v, mask, options)


# --- The oracle's runs ------------------------------------------------------------------------


def oracle_run(call: Call, **changes) -> np.ndarray:
    """The oracle's float64 run on ``call`` with ``changes`` to its inputs (q, k, v, mask)
    or options (a value of None removes the option)."""
    from conformance.fixtures import oracle

    inputs = {"q": call.q, "k": call.k, "v": call.v, "mask": call.mask}
    options = dict(call.options)
    for name, value in changes.items():
        target = inputs if name in inputs else options
        target[name] = value
    options = {n: x for n, x in options.items() if x is not None}
    with np.errstate(all="ignore"):
        return oracle.naive_same_precision(
            inputs["q"], inputs["k"], inputs["v"], np.float64, mask=inputs["mask"], **options
        )


def allowed(call: Call) -> np.ndarray:
    """(B, H, T, S) bool: the keys each row attends (SPEC §1.2), from the oracle's
    ``allowed_keys``, the bool mask and the float mask's -inf entries."""
    from conformance.fixtures.oracle import allowed_keys

    B, H, T, _ = call.q.shape
    S = call.k.shape[2]
    band = np.zeros((T, S), dtype=bool)
    for t in range(T):
        keys = allowed_keys(
            t,
            T,
            S,
            bool_row=None,
            is_causal=call.is_causal,
            causal_alignment=call.options["causal_alignment"],
            window=call.options.get("window"),
            chunk_size=call.options.get("chunk_size"),
        )
        band[t, keys] = True
    out = np.broadcast_to(band, (B, H, T, S)).copy()
    if call.bool_mask:
        out &= np.broadcast_to(call.mask, out.shape)
    elif call.float_mask:
        out &= np.broadcast_to(call.mask != -np.inf, out.shape)
    return out


def expanded(call: Call) -> tuple[np.ndarray, np.ndarray]:
    G = call.q.shape[1] // call.k.shape[1]
    return np.repeat(call.k, G, axis=1), np.repeat(call.v, G, axis=1)  # (B, H, S, ·)


def textbook(call: Call, *, read_blocked=None, cap_after_mask=False, sink_in_numerator=False):
    """Float64 attention, for the misreadings no input can express: ``read_blocked``, the
    slots no row attends are read, their scores then set to -inf by selection ("select":
    their values still meet weight 0 in the product, and 0 · NaN is NaN) or by addition
    ("add": NaN + -inf is NaN too);
    ``cap_after_mask``, the softcap squashes the masked scores too, so a blocked key's -inf
    becomes -softcap; ``sink_in_numerator``, the sink's term is added to every attended
    key's weight as well as to the sum (SPEC §15.1 has it in the sum only)."""
    if call.options.get("alibi_slopes") is not None:
        return None
    k, v = expanded(call)
    ok = allowed(call)
    bias = np.where(ok, 0.0, -np.inf)  # (B, H, T, S)
    if call.float_mask:
        bias = bias + np.where(ok, np.broadcast_to(call.mask, ok.shape), 0.0)
    if not (read_blocked or cap_after_mask):
        used = ok.any(axis=2)[..., None]  # (B, H, S, 1)
        k, v = np.where(used, k, 0.0), np.where(used, v, 0.0)
    cap = call.options.get("softcap")
    with np.errstate(all="ignore"):
        scores = np.matmul(call.q, np.swapaxes(k, -1, -2)) * call.scale  # (B, H, T, S)
        if cap is not None and cap_after_mask:
            scores = cap * np.tanh((scores + bias) / cap)
        elif cap is not None:
            scores = cap * np.tanh(scores / cap) + bias
        elif read_blocked == "select":
            scores = np.where(ok, scores + np.where(ok, bias, 0.0), -np.inf)
        else:
            scores = scores + bias
        top = scores.max(axis=-1, keepdims=True, initial=-np.inf)
        sinks = call.options.get("sinks")
        sink = None if sinks is None else sinks.reshape(1, -1, 1, 1)
        if sink is not None:
            top = np.maximum(top, sink)
        top = np.where(np.isfinite(top), top, 0.0)
        p = np.exp(scores - top)
        total = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            extra = np.exp(sink - top)
            total = total + extra
            if sink_in_numerator:
                p = p + np.where(scores != -np.inf, extra, 0.0)
        live = (scores != -np.inf).any(axis=-1, keepdims=True)
        weights = np.where(live, p / np.where(total > 0, total, 1.0), 0.0)
        return np.matmul(weights, v)  # (B, H, T, E)


def blockwise(call: Call, tile: int, *, rescale_sum=True, rescale_acc=True):
    """Float64 attention as a blockwise (online) softmax over key tiles of ``tile`` keys
    computes it: per tile, the running maximum, the running sum and the accumulator, the
    last two rescaled by exp(old max - new max) when a tile raises the maximum;
    ``rescale_sum`` or ``rescale_acc`` False leaves that rescale out. None where the call
    has sinks or ALiBi slopes, which this loop does not model."""
    if call.options.get("alibi_slopes") is not None or call.options.get("sinks") is not None:
        return None
    k, v = expanded(call)
    ok = allowed(call)
    bias = np.where(ok, 0.0, -np.inf)  # (B, H, T, S)
    if call.float_mask:
        bias = bias + np.where(ok, np.broadcast_to(call.mask, ok.shape), 0.0)
    used = ok.any(axis=2)[..., None]  # (B, H, S, 1)
    k, v = np.where(used, k, 0.0), np.where(used, v, 0.0)
    cap = call.options.get("softcap")
    with np.errstate(all="ignore"):
        scores = np.matmul(call.q, np.swapaxes(k, -1, -2)) * call.scale  # (B, H, T, S)
        if cap is not None:
            scores = cap * np.tanh(scores / cap)
        scores = scores + bias
        m = np.full((*scores.shape[:-1], 1), -np.inf)  # (B, H, T, 1)
        total = np.zeros_like(m)  # (B, H, T, 1)
        acc = np.zeros((*scores.shape[:-1], v.shape[-1]))  # (B, H, T, E)
        for s0 in range(0, scores.shape[-1], tile):
            x = scores[..., s0 : s0 + tile]  # (B, H, T, Sb)
            m_new = np.maximum(m, x.max(axis=-1, keepdims=True))
            shift = np.where(np.isfinite(m_new), m_new, 0.0)
            alpha = np.exp(m - shift)  # (B, H, T, 1)
            p = np.exp(x - shift)  # (B, H, T, Sb)
            total = (alpha if rescale_sum else 1.0) * total + p.sum(axis=-1, keepdims=True)
            acc = (alpha if rescale_acc else 1.0) * acc + np.matmul(p, v[..., s0 : s0 + tile, :])
            m = m_new
        return acc / np.where(total > 0, total, 1.0)  # (B, H, T, E)


def empty_rows(call: Call) -> np.ndarray:
    return ~allowed(call).any(axis=-1)  # (B, H, T)


def rows_as(call: Call, fill: str) -> np.ndarray | None:
    """The right answer, but the rows with no key to attend hold ``fill``: "nan", or
    "mean" (the mean of their value rows, as uniform weights over every key give)."""
    empty = empty_rows(call)
    if not empty.any() or call.k.shape[2] == 0:
        return None
    out = oracle_run(call)
    if fill == "nan":
        out[empty] = np.nan
    else:
        _, v = expanded(call)
        out[empty] = np.broadcast_to(v.mean(axis=2, keepdims=True), out.shape)[empty]
    return out


def window_shifted(side: int, step: int) -> Callable[[Call], np.ndarray | None]:
    def compute(call: Call) -> np.ndarray | None:
        window = list(call.options["window"])
        if window[side] is None or window[side] + step < 0:
            return None
        window[side] += step
        return oracle_run(call, window=tuple(window))

    return compute


def diagonal_shifted(step: int) -> Callable[[Call], np.ndarray | None]:
    """Causality with its diagonal ``step`` keys off, as a window's right side."""

    def compute(call: Call) -> np.ndarray | None:
        left, right = call.options.get("window") or (None, None)
        right = step if right is None else min(right, 0) + step
        return oracle_run(call, is_causal=False, window=(left, right))

    return compute


def gqa_tiled(call: Call) -> np.ndarray:
    H, K = call.q.shape[1], call.k.shape[1]
    heads = [h % K for h in range(H)]
    return oracle_run(call, k=call.k[:, heads], v=call.v[:, heads])  # k, v (B, H, S, ·)


def scale_is(value: Callable[[Call], float]) -> Callable[[Call], np.ndarray]:
    return lambda call: oracle_run(call, scale=value(call))


def prescaled(call: Call) -> np.ndarray:
    with np.errstate(over="ignore"):
        return call.q * call.scale  # (B, H, T, D)


def batch_repeated(call: Call) -> np.ndarray:
    """A per-batch mask (B, 1, T, S) spread over the heads as ``mask.repeat(H, 1, 1)`` does
    on (B, T, S) where q is reshaped to (B·H, T, D): query head h of batch element b gets
    the mask of batch element (b·H + h) mod B, not its own."""
    B, H = call.q.shape[:2]
    index = (np.arange(B)[:, None] * H + np.arange(H)[None, :]) % B  # (B, H)
    return oracle_run(call, mask=call.mask[index][:, :, 0])  # mask (B, H, T, S)


def keys_as_if_s_is_t(call: Call) -> np.ndarray | None:
    """The keys read as if S = T: with T < S, only the first T keys (and the mask's first
    T columns), and causality aligned as for a square problem."""
    T, S = call.q.shape[2], call.k.shape[2]
    if not 0 < T < S:
        return None
    mask = call.mask
    if mask is not None and mask.shape[-1] == S:
        mask = mask[..., :T]  # (·, ·, ·, T)
    k, v = call.k[:, :, :T], call.v[:, :, :T]  # (B, K, T, ·)
    return oracle_run(call, k=k, v=v, mask=mask, causal_alignment="top_left")


def keys_in_q_layout(call: Call) -> np.ndarray | None:
    """The keys read as if S = T through q's layout: with T < S and K = H, a kernel that
    addresses k and v with q's strides (one length, q's) reads, for head h of batch b, the
    T rows that start at element (b·H + h)·T of k's contiguous (B, K, S, ·) buffer, which
    spill into other heads' keys (the Triton tutorial's fused attention)."""
    B, H, T = call.q.shape[:3]
    K, S = call.k.shape[1:3]
    if not (0 < T < S and K == H):
        return None
    mask = call.mask
    if mask is not None and mask.shape[-1] == S:
        mask = mask[..., :T]  # (·, ·, ·, T)
    k = np.ascontiguousarray(call.k).reshape(-1)[: B * H * T * call.k.shape[3]]
    v = np.ascontiguousarray(call.v).reshape(-1)[: B * H * T * call.v.shape[3]]
    k = k.reshape(B, H, T, call.k.shape[3])  # (B, H, T, D)
    v = v.reshape(B, H, T, call.v.shape[3])  # (B, H, T, E)
    return oracle_run(call, k=k, v=v, mask=mask, causal_alignment="top_left")


def keys_past_s(call: Call) -> np.ndarray | None:
    """Keys read past S: with T > S under causality, rows t >= S read key slots S .. t as a
    square causal problem would, and what those slots hold is no number (NaN)."""
    T, S = call.q.shape[2], call.k.shape[2]
    if T <= S:
        return None
    B, K = call.k.shape[:2]
    k = np.concatenate([call.k, np.full((B, K, T - S, call.k.shape[-1]), np.nan)], axis=2)
    v = np.concatenate([call.v, np.full((B, K, T - S, call.v.shape[-1]), np.nan)], axis=2)
    mask = call.mask
    if mask is not None and mask.shape[-1] == S:
        fill = np.ones if call.bool_mask else np.zeros
        extra = fill((*mask.shape[:-1], T - S), dtype=mask.dtype)
        mask = np.concatenate([mask, extra], axis=-1)  # (·, ·, ·, T)
    return oracle_run(call, k=k, v=v, mask=mask, causal_alignment="top_left")  # k, v (B, K, T, ·)


def causal_added(call: Call) -> np.ndarray:
    """Causality (and the window, chunks) added to the float mask as 0 / -inf, not selected:
    where the mask holds +inf or NaN at a key causality blocks, the score is NaN."""
    band = allowed(call._replace(mask=None))  # (B, H, T, S)
    with np.errstate(invalid="ignore"):
        mask = call.mask + np.where(band, 0.0, -np.inf)  # (B, H, T, S)
    return oracle_run(call, mask=mask, is_causal=None, window=None, chunk_size=None)


def v_from_last_columns(call: Call) -> np.ndarray | None:
    """MLA's V read from the wrong columns of its latent cache: where v is the first E
    columns of k (SPEC §4.11), the last E (past the positional part) instead."""
    D, E = call.k.shape[-1], call.v.shape[-1]
    if not (E < D and np.array_equal(call.v, call.k[..., :E], equal_nan=True)):
        return None
    return oracle_run(call, v=call.k[..., D - E :])  # v (B, K, S, E)


# --- Split-KV: the keys in splits, each a partial state, merged -----------------------------


#: What the split-KV misreadings computed for the call being diagnosed (one engine pass
#: hands every misreading the same ``Call``): the forward once, each tail length once.
_SHARED: list = [None, {}]


def _shared(call: Call, key, compute: Callable[[], object]):
    if _SHARED[0] is not call:
        _SHARED[0], _SHARED[1] = call, {}
    if key not in _SHARED[1]:
        _SHARED[1][key] = compute()
    return _SHARED[1][key]


def _forward(call: Call):
    """The oracle's float64 forward up to the scores: (scores (B, H, T, S), -inf where
    blocked; v (B, H, S, E), unread slots zeroed; the sink logits (1, H, 1, 1) or None)."""
    return _shared(call, "forward", lambda: _forward_of(call))


def _forward_of(call: Call):
    from conformance.fixtures import oracle

    o = call.options
    with np.errstate(all="ignore"):
        fwd = oracle._naive_forward(
            call.q, call.k, call.v, np.dtype(np.float64), call.mask, call.is_causal,
            o.get("scale"), o["causal_alignment"], o.get("window"), o.get("softcap"),
            o.get("sinks"), o.get("chunk_size"), o.get("alibi_slopes"),
        )  # fmt: skip
    return fwd.scores, fwd.v, fwd.sinks


def tail_dropped(block: int) -> Callable[[Call], np.ndarray | None]:
    """The keys after the last whole block of ``block`` keys dropped: a split-KV decoder
    whose loop runs S // block times."""

    def compute(call: Call) -> np.ndarray | None:
        S = call.k.shape[2]
        kept = S // block * block  # 0 where S < block: no key is read, every row is 0
        if kept == S:
            return None
        return _shared(call, ("tail", kept), lambda: _keys_kept(call, kept))

    return compute


def _keys_kept(call: Call, kept: int) -> np.ndarray:
    """The oracle's run with the keys from ``kept`` on blocked."""
    S = call.k.shape[2]
    keep = np.arange(S) < kept  # (S,)
    if call.bool_mask:
        mask = call.mask & keep
    elif call.float_mask:
        mask = np.where(keep, call.mask, -np.inf)
    else:
        mask = np.broadcast_to(keep, (1, 1, 1, S))
    return oracle_run(call, mask=mask)


def sink_per_split(splits: int) -> Callable[[Call], np.ndarray | None]:
    """The sink counted once per split: each of ``splits`` partial states has the sink's
    term in its sum, so the merged denominator holds it ``splits`` times (SPEC §15.1 has
    it once)."""

    def compute(call: Call) -> np.ndarray | None:
        if call.options.get("sinks") is None:
            return None
        scores, v, sinks = _forward(call)
        with np.errstate(all="ignore"):
            top = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sinks)
            top = np.where(np.isfinite(top), top, 0.0)  # (B, H, T, 1)
            p = np.exp(scores - top)  # (B, H, T, S)
            total = p.sum(axis=-1, keepdims=True) + splits * np.exp(sinks - top)
            live = (scores != -np.inf).any(axis=-1, keepdims=True)
            return np.where(live, np.matmul(p, v) / total, 0.0)  # (B, H, T, E)

    return compute


def splits_sum_unrescaled(
    bounds: Callable[[int], list[int]],
) -> Callable[[Call], np.ndarray | None]:
    """The splits merged with their accumulators rescaled to the common maximum but their
    sums not: o = Σ exp(m_c - M) acc_c / Σ l_c, each l_c taken at its own maximum m_c.
    ``bounds(S)``: the splits' key boundaries [0, ..., S]."""

    def compute(call: Call) -> np.ndarray | None:
        if call.options.get("sinks") is not None:
            return None
        scores, v, _ = _forward(call)
        edges = bounds(scores.shape[-1])
        if len(edges) < 3:
            return None
        with np.errstate(all="ignore"):
            top = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, H, T, 1)
            acc = np.zeros((*scores.shape[:-1], v.shape[-1]))  # (B, H, T, E)
            total = np.zeros_like(top)
            for s0, s1 in itertools.pairwise(edges):
                x = scores[..., s0:s1]  # (B, H, T, Sc)
                m = x.max(axis=-1, keepdims=True, initial=-np.inf)
                m = np.where(np.isfinite(m), m, top)
                p = np.exp(x - m)
                total = total + p.sum(axis=-1, keepdims=True)
                acc = acc + np.exp(m - top) * np.matmul(p, v[..., s0:s1, :])
            live = np.isfinite(top)
            return np.where(live, acc / np.where(total > 0, total, 1.0), 0.0)

    return compute


def balanced(splits: int) -> Callable[[int], list[int]]:
    """``splits`` splits of lengths that differ by at most one."""
    return lambda S: sorted({S * i // splits for i in range(splits + 1)})


# --- The log-sum-exp (SPEC §21) -------------------------------------------------------------


class LseCall(NamedTuple):
    """A departing lse: the call, its right lse (B, H, T) and the lse returned."""

    call: Call
    right: np.ndarray
    actual: np.ndarray


def lse_of(call: Call, **changes) -> np.ndarray:
    """The float64 textbook lse (B, H, T) of ``call`` with ``changes`` to its options (a
    value of None removes the option)."""
    from conformance.fixtures import oracle

    options = {n: x for n, x in {**call.options, **changes}.items() if x is not None}
    with np.errstate(all="ignore"):
        return oracle.naive_lse_same_precision(
            call.q, call.k, call.v, np.float64, mask=call.mask, **options
        )


def lse_without(name: str) -> Callable[[LseCall], np.ndarray]:
    return lambda c: lse_of(c.call, **{name: None})


def lse_where_no_key(finite: bool) -> Callable[[LseCall], np.ndarray | None]:
    """The right lse, but what was returned in the rows with no key: a finite number
    (whichever: 0, -49994) with ``finite``, +inf without."""

    def compute(c: LseCall) -> np.ndarray | None:
        empty = c.right == -np.inf
        if not empty.any() or c.actual.shape != c.right.shape:
            return None
        got = c.actual[empty]
        if not (np.isfinite(got).all() if finite else (got == np.inf).all()):
            return None
        return np.where(empty, c.actual, c.right)

    return compute


# --- Merges of partial states (SPEC §22) ----------------------------------------------------


class MergeCall(NamedTuple):
    """A departing merge: the two pieces, float64, and which part of the answer was
    compared (0: o (..., E), 1: lse)."""

    o_a: np.ndarray
    lse_a: np.ndarray
    o_b: np.ndarray
    lse_b: np.ndarray
    part: int


def merged(c: MergeCall, *, weights=None, lse_a=None, lse_b=None, exp=np.exp, log=np.log):
    """The merge formula in float64 on the call's pieces (with ``lse_a``, ``lse_b`` in
    their place): each piece weighted by exp(lse - m), m the larger lse, two empty pieces
    guarded; ``weights`` (m, lse_a, lse_b) -> (w_a, w_b) replaces the weights, ``exp`` and
    ``log`` the base. Returns the part compared."""
    a = c.lse_a if lse_a is None else lse_a
    b = c.lse_b if lse_b is None else lse_b
    with np.errstate(all="ignore"):
        m = np.maximum(a, b)  # (B, H, T)
        m = np.where(m == -np.inf, 0.0, m)
        w_a, w_b = (exp(a - m), exp(b - m)) if weights is None else weights(m, a, b)
        total = w_a + w_b
        safe = np.where(total == 0, 1.0, total)
        o = (w_a[..., None] * c.o_a + w_b[..., None] * c.o_b) / safe[..., None]
        lse = np.where(total == 0, -np.inf, m + log(safe))
    return (o, lse)[c.part]


def merge_averaged(c: MergeCall) -> np.ndarray:
    both = np.isfinite(c.lse_a) & np.isfinite(c.lse_b)  # (B, H, T)
    one = np.where(np.isfinite(c.lse_a)[..., None], c.o_a, c.o_b)
    o = np.where(both[..., None], (c.o_a + c.o_b) / 2, one)
    with np.errstate(over="ignore", invalid="ignore"):
        return (o, np.logaddexp(c.lse_a, c.lse_b))[c.part]


def merge_unguarded(c: MergeCall) -> np.ndarray:
    with np.errstate(all="ignore"):
        m = np.maximum(c.lse_a, c.lse_b)  # (B, H, T): -inf for two empty pieces
        w_a, w_b = np.exp(c.lse_a - m), np.exp(c.lse_b - m)  # NaN there: -inf - (-inf)
        o = (w_a[..., None] * c.o_a + w_b[..., None] * c.o_b) / (w_a + w_b)[..., None]
        return (o, m + np.log(w_a + w_b))[c.part]


def merge_without_maximum(c: MergeCall) -> np.ndarray:
    """exp(lse) taken as it is: an lse past about 709 overflows to inf, and inf / inf is
    NaN."""
    with np.errstate(all="ignore"):
        w_a, w_b = np.exp(c.lse_a), np.exp(c.lse_b)
        total = w_a + w_b
        o = (w_a[..., None] * c.o_a + w_b[..., None] * c.o_b) / total[..., None]
        return (o, np.log(total))[c.part]


# --- Quantized attention (SPEC §20) ---------------------------------------------------------


class QuantizedCall(NamedTuple):
    """A departing ``attention_quantized`` call: codes, descales (``operands``), options,
    the declared P pipeline, and the output returned."""

    operands: dict
    options: dict
    pipeline: str
    actual: np.ndarray | None = None

    def descale(self, role: str) -> np.ndarray:
        return np.asarray(self.operands[f"{role}_descale"], dtype=np.float64)

    def shape(self) -> tuple[int, int, int]:
        B, H = np.shape(self.operands["q"])[:2]
        return B, H, np.shape(self.operands["k"])[1]

    def format(self, role: str) -> str:
        return np.asarray(self.operands[role]).dtype.name


def quantized_run(call: QuantizedCall, pipeline: str | None = None, options=None, **changes):
    """The declared pipeline (or ``pipeline``) on the call's operands with ``changes`` (a
    code array or descale replaced) and ``options`` changed."""
    from conformance.fixtures import quantized as fq

    o = {**call.operands, **changes}
    with np.errstate(all="ignore"):
        return fq.pipeline(
            o["q"], o["k"], o["v"], o["q_descale"], o["k_descale"], o["v_descale"],
            pipeline or call.pipeline, block_size=o.get("block_size"),
            **{**call.options, **(options or {})},
        )  # fmt: skip


def descales_dropped(roles: str) -> Callable[[QuantizedCall], np.ndarray]:
    return lambda c: quantized_run(
        c, **{f"{r}_descale": np.ones_like(c.descale(r), np.float32) for r in roles}
    )


def descale_twice(role: str) -> Callable[[QuantizedCall], np.ndarray]:
    return lambda c: quantized_run(
        c, **{f"{role}_descale": (c.descale(role) ** 2).astype(np.float32)}
    )


def descale_by_query_head(c: QuantizedCall) -> np.ndarray:
    """Query head h reads q_descale[b, h % K], not q_descale[b, h // G]: a (B, H) descale."""
    B, H, K = c.shape()
    return quantized_run(c, q_descale=c.descale("q")[:, np.arange(H) % K].astype(np.float32))


def first_descale_for_all(c: QuantizedCall) -> np.ndarray:
    changes = {}
    for r in "qkv":
        d = c.descale(r)
        if d.ndim >= 2 and d.size > 1:
            changes[f"{r}_descale"] = np.full_like(d, d.flat[0], dtype=np.float32)
    return quantized_run(c, **changes)


def v_descale_before_softmax(c: QuantizedCall) -> np.ndarray:
    """v's descale multiplies the scores with q's and k's, and not the output."""
    dq, dv = c.descale("q"), c.descale("v")
    both = np.broadcast_to(dq * dv, np.broadcast_shapes(dq.shape, dv.shape))
    return quantized_run(
        c, q_descale=both.astype(np.float32), v_descale=np.ones_like(dv, np.float32)
    )


def q_and_v_descales_swapped(c: QuantizedCall) -> np.ndarray | None:
    dq, dv = c.descale("q"), c.descale("v")
    if dq.shape != dv.shape or np.array_equal(dq, dv):
        return None
    return quantized_run(c, q_descale=dv.astype(np.float32), v_descale=dq.astype(np.float32))


def _is_batch_by_head(c: QuantizedCall, role: str) -> bool:
    B, _, K = c.shape()
    return c.descale(role).shape == (B, K) and B > 1 and K > 1


def descales_transposed(c: QuantizedCall) -> np.ndarray | None:
    """Each (B, K) descale read as a (K, B) array: element [b, κ] taken from the memory
    offset κ·B + b, where b·K + κ holds it."""
    B, _, K = c.shape()
    changes = {
        f"{r}_descale": c.descale(r).reshape(-1).reshape(K, B).T.astype(np.float32)
        for r in "qkv"
        if _is_batch_by_head(c, r)
    }
    return quantized_run(c, **changes) if changes else None


def quantized_scale_twice(c: QuantizedCall) -> np.ndarray:
    D = np.shape(c.operands["q"])[-1]
    scale = c.options.get("scale")
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    return quantized_run(c, options={"scale": scale * scale})


def v_codes_as(fmt: str, *, reinterpret: bool) -> Callable[[QuantizedCall], np.ndarray | None]:
    """v's float8_e4m3fn codes as ``fmt``: their bytes read as that format
    (``reinterpret``), or their values rounded to it."""
    import ml_dtypes

    def compute(c: QuantizedCall) -> np.ndarray | None:
        codes = np.asarray(c.operands["v"])
        if codes.dtype.name != "float8_e4m3fn":
            return None
        target = np.dtype(getattr(ml_dtypes, fmt))
        misread = codes.view(target) if reinterpret else codes.astype(np.float32).astype(target)
        return quantized_run(c, v=misread)

    return compute


def v_offset_per_head(c: QuantizedCall) -> np.ndarray | None:
    """An int8 v whose zero point is dropped: every value of a (batch, key/value head) off
    by one constant, so every output row of its query heads is off by that constant. The
    constant is read off the output returned (the median of its offset)."""
    if c.format("v") != "int8" or c.actual is None or c.descale("v").ndim > 2:
        return None
    right = quantized_run(c)
    if c.actual.shape != right.shape:
        return None
    with np.errstate(invalid="ignore"):
        offset = np.nanmedian(c.actual - right, axis=(2, 3), keepdims=True)  # (B, H, 1, 1)
    offset = np.where(np.isfinite(offset), offset, 0.0)
    live = np.any(right != 0, axis=-1, keepdims=True)  # rows with no key stay 0
    return np.where(live, right + offset, right)


def p_pipeline_misread(
    p_format: str = "float8_e4m3fn",
    accumulate: str = "float32",
    tile: int | None = None,
    stale: bool = False,
    cast_rule: str = "overflow",
) -> Callable[[QuantizedCall], np.ndarray | None]:
    """The declared P pipeline, over key tiles of ``tile`` (None: one tile) with a running
    maximum, with one step misread: P rounded to ``p_format``; P·V accumulated key by key
    in ``accumulate``; or (``stale``) P taken at the row maximum of the tiles before (the
    running maximum not updated before P is rounded), so a growing score lifts P · 2⁸ past
    448 (NaN with the overflow ``cast_rule``, 448 with saturate)."""
    stale_tile = tile if stale else None
    import ml_dtypes

    def compute(c: QuantizedCall) -> np.ndarray | None:
        from conformance.fixtures import quantized as fq

        if c.pipeline == "float32" or "sinks" in c.options or "softcap" in c.options:
            return None
        if c.options.get("mask") is not None and np.asarray(c.options["mask"]).dtype != bool:
            return None
        unnormalized = c.pipeline == "e4m3_unnormalized"
        f32 = np.float32
        o = c.operands
        L = o.get("block_size")
        q = fq.dequantize(o["q"], o["q_descale"]).astype(f32)
        k = fq.dequantize(o["k"], o["k_descale"], L).astype(f32)
        # A per-head v descale is applied at the end, as kernels do: P·V is summed over
        # the codes, whose rounding in a narrow accumulator differs from the values'.
        late = np.ndim(o["v_descale"]) <= 2
        v_scale = fq.dequantize(np.ones_like(np.asarray(o["v"], np.float32)[..., :1]),
                                o["v_descale"], L).astype(f32) if late else f32(1)  # fmt: skip
        v = (
            np.asarray(o["v"]).astype(f32)
            if late
            else fq.dequantize(o["v"], o["v_descale"], L).astype(f32)
        )
        call = Call(q.astype(np.float64), k.astype(np.float64), k[..., :1].astype(np.float64),
                    c.options.get("mask"), {"causal_alignment": "top_left", **{
                        n: x for n, x in c.options.items() if n != "mask"}})  # fmt: skip
        ok = allowed(call)  # (B, H, T, S)
        k, v = (np.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
        scale = f32(call.scale)
        with np.errstate(all="ignore"):
            s = np.where(ok, np.matmul(q, np.swapaxes(k, -1, -2)) * scale, -np.inf).astype(f32)
            width = tile or s.shape[-1] or 1
            if tile is not None and not unnormalized:
                return None
            lift = f32(fq.P_OFFSET if unnormalized else 1.0)
            m = np.full((*s.shape[:-1], 1), -np.inf, f32)  # (B, H, T, 1)
            total = np.zeros_like(m)
            acc = np.zeros((*s.shape[:-1], v.shape[-1]), f32)  # (B, H, T, E)
            top = s.max(axis=-1, keepdims=True, initial=-np.inf)
            for s0 in range(0, s.shape[-1], width):
                x = s[..., s0 : s0 + width]
                m_new = np.maximum(m, x.max(axis=-1, keepdims=True)) if tile else top
                at = np.where(np.isfinite(m), m, m_new) if stale_tile else m_new
                at = np.where(np.isfinite(at), at, f32(0))
                alpha = np.where(np.isfinite(m), np.exp(m - at), f32(0)).astype(f32)
                p = np.exp(x - at).astype(f32)
                total = total * alpha + p.sum(axis=-1, keepdims=True, dtype=f32)
                lifted = p * lift if unnormalized else p
                if not unnormalized:
                    row = np.exp(s - at).sum(axis=-1, keepdims=True, dtype=f32)
                    lifted = p / np.where(row > 0, row, f32(1))
                if cast_rule == "saturate":
                    lifted = np.minimum(lifted, f32(fq.LARGEST[p_format]))
                p8 = lifted.astype(np.dtype(getattr(ml_dtypes, p_format))).astype(f32)
                pv = _accumulated(p8, v[..., s0 : s0 + width, :], accumulate)
                acc = (acc * alpha + pv).astype(f32)
                m = at
            if unnormalized:
                out = acc / lift / np.where(total > 0, total, f32(1))
            else:
                out = acc
            if late:  # v_scale (B, K, S, 1): one descale a head, over its query heads
                out = out * np.repeat(v_scale[:, :, :1], q.shape[1] // v_scale.shape[1], axis=1)
            live = ok.any(axis=-1)[..., None]
            return np.where(live, out, 0.0).astype(np.float64)

    return compute


def _accumulated(p, v, dtype: str) -> np.ndarray:
    """p @ v in float32, or summed key by key in ``dtype`` (each partial sum rounded)."""
    if dtype == "float32":
        return np.matmul(p, v)
    import ml_dtypes

    low = np.dtype(getattr(ml_dtypes, dtype))
    acc = np.zeros((*p.shape[:-1], v.shape[-1]), np.float32)  # (B, H, T, E)
    for s in range(p.shape[-1]):
        term = p[..., s, None] * v[..., s, None, :]  # (B, H, T, E)
        acc = (acc + term).astype(low).astype(np.float32)
    return acc
