"""The oracle's runs with a misreading of attention planted, for
``conformance.suite.diagnosis``: the departing call as float64 arrays (``Call``), the
oracle's float64 textbook run on it with changed inputs or options (``oracle_run``), the
keys each row attends (``allowed``), and a float64 textbook for the misreadings no input
can express (``textbook``).
"""

from __future__ import annotations

import math
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
