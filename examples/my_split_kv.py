"""Your split-KV decoder, checked against the spec: copy this file and replace the
function. Its profile is ``examples/my_split_kv.toml``; the output and the lse are held to
attention over every key (SPEC §1, §21), whatever the chunks:

    pytest --pyargs conformance.tests.test_invariants conformance.tests.test_lse \\
        --impl-profile examples/my_split_kv.toml

Flash-decoding (SPEC §22.8): the keys cut into ``num_splits`` chunks of consecutive
positions, each chunk attended on its own into a partial state (o, lse), the states merged
by ``examples/my_merge.py``. Shapes: q (B, H, T, D), k (B, K, S, D), v (B, K, S, E).
"""

from __future__ import annotations

import math

import numpy as np

from examples.my_merge import merge_states


def decode(
    q, k, v, *, is_causal=False, scale=None, causal_alignment="top_left", return_lse=False,
    num_splits=3,
):  # fmt: skip
    """Attention by chunks of keys, merged: out (B, H, T, E), and lse (B, H, T) with
    ``return_lse``; causal top-left or bottom-right (the last query sees the last key)."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    work = np.float64 if q.dtype == np.float64 else np.float32
    scale = 1 / math.sqrt(D) if scale is None else scale
    qg = q.astype(work).reshape(B, K, H // K, T, D)  # (B, K, G, T, D): GQA, no copy of k
    offset = S - T if causal_alignment == "bottom_right" else 0
    o = np.zeros((B, H, T, v.shape[-1]), work)  # the empty state: no key seen yet
    lse = np.full((B, H, T), -np.inf, work)
    for keys in np.array_split(np.arange(S), num_splits):
        if not len(keys):
            continue
        with np.errstate(over="ignore"):  # the largest float in an input: inf, as the spec's
            s = np.einsum("bkgtd,bksd->bkgts", qg, k[:, :, keys].astype(work)) * work(scale)
        s = s.reshape(B, H, T, len(keys))  # (B, H, T, L)
        if is_causal:
            seen = keys[None, :] <= np.arange(T)[:, None] + offset  # (T, L)
            s = np.where(seen, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)  # (B, H, T, 1)
        m = np.where(m == -np.inf, work(0), m)  # a row with no key here: all weights 0
        with np.errstate(invalid="ignore"):  # a +inf score: inf - inf, the row is NaN
            p = np.exp(s - m)  # (B, H, T, L)
        total = p.sum(axis=-1)  # (B, H, T)
        vg = np.repeat(v[:, :, keys].astype(work), H // K, axis=1)  # (B, H, L, E)
        safe = np.where(total == 0, work(1), total)
        # A key the row may not see weighs exactly 0, and so does its value, whatever it
        # holds (NaN or inf in an unused slot: 0 · NaN would be NaN, SPEC §4.7).
        with np.errstate(invalid="ignore"):
            terms = np.where(p[..., None] > 0, p[..., None] * vg[:, :, None], work(0))
        o_c = terms.sum(axis=-2) / safe[..., None]  # (B, H, T, E)
        with np.errstate(divide="ignore"):
            lse_c = m[..., 0] + np.log(total)  # (B, H, T): -inf where no key was seen
        o, lse = merge_states(o, lse, o_c, lse_c)
    out = o.astype(q.dtype)
    return (
        (out, lse.astype(np.float64 if q.dtype == np.float64 else np.float32))
        if return_lse
        else out
    )
