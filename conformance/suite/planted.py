"""The oracle's runs with a misreading of attention whole planted, for
``conformance.suite.diagnosis``: the departing call as float64 arrays (``Call``), the
oracle's float64 textbook run on it with changed inputs or options (``oracle_run``), the
keys each row attends (``allowed``), a float64 textbook for the misreadings no input
can express (``textbook``), and the outputs with one input or option misread that
``conformance/suite/misreadings_attention.py`` names (``rows_as``, ``window_shifted``,
``keys_past_s``, ``causal_penalty``, ...). The other areas' computations build on these,
one module an area:
``planted_split_kv.py``, ``planted_lse_merge.py``, ``planted_quantized.py``.
"""

from __future__ import annotations

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


#: The finite penalty a causal mask built as an additive bias adds to a blocked key's
#: score: PaddlePaddle's CPU path (``paddle.nn.functional.flash_attention.
#: get_triangle_upper_mask``: ``paddle.triu(paddle.full_like(scores, -1e4), 1)``).
CAUSAL_PENALTY = 1e4


def causal_penalty(call: Call) -> np.ndarray:
    """Causality as a finite penalty: ``CAUSAL_PENALTY`` subtracted from a blocked key's
    score, not -inf, the mask (if any) still applied; a blocked key whose score is more
    than the penalty above the row's allowed ones takes the weight."""
    band = allowed(call._replace(mask=None))  # (B, H, T, S)
    bias = np.where(band, 0.0, -CAUSAL_PENALTY)  # (B, H, T, S)
    if call.bool_mask:
        bias = bias + np.where(np.broadcast_to(call.mask, band.shape), 0.0, -np.inf)
    elif call.float_mask:
        bias = bias + np.broadcast_to(call.mask, band.shape)
    return oracle_run(call, mask=bias, is_causal=None)


def v_from_last_columns(call: Call) -> np.ndarray | None:
    """MLA's V read from the wrong columns of its latent cache: where v is the first E
    columns of k (SPEC §4.11), the last E (past the positional part) instead."""
    D, E = call.k.shape[-1], call.v.shape[-1]
    if not (E < D and np.array_equal(call.v, call.k[..., :E], equal_nan=True)):
        return None
    return oracle_run(call, v=call.k[..., D - E :])  # v (B, K, S, E)
