"""The outputs of a split-KV decoder with a misreading planted (SPEC §22.8), for
``conformance/suite/misreadings_split_kv.py``: the keys in splits, each a partial state,
merged, computed from the oracle's float64 forward on the departing ``Call``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from conformance.suite.planted import Call, oracle_run

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
