"""Merge functions as libraries write them, for the kit's tests (tests/test_merge_kit.py).

``merge_bth_base2`` is a correct merge in FlashInfer's conventions: o (B, T, H, E), lse
(B, T, H) in base 2; the others carry the merge misreadings of ``misreadings.py``, planted
in the spec's conventions (o (B, H, T, E), lse (B, H, T), natural log), the reference page
(``conformance.impls.numpy.merge``) doing the correct part. NumPy in and out.
"""

from __future__ import annotations

import numpy as np
from conformance.impls.numpy.merge import merge_states


def merge_bth_base2(o_a, lse_a, o_b, lse_b):
    """A merge written in base 2 (exp2 and log2, as FlashInfer's kernels), o (B, T, H, E)
    and lse (B, T, H); layout-blind, since it works row by row."""
    work = np.float64 if o_a.dtype == np.float64 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        m = np.maximum(lse_a, lse_b).astype(work)
        m = np.where(m == -np.inf, 0.0, m)
        w_a, w_b = np.exp2(lse_a - m), np.exp2(lse_b - m)
        l = w_a + w_b
        safe = np.where(l == 0, 1.0, l)
        o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / safe[..., None]
        lse = np.where(l == 0, -np.inf, m + np.log2(safe))
    return o.astype(o_a.dtype), lse.astype(lse_a.dtype)


def merge_averaged(o_a, lse_a, o_b, lse_b):
    """The outputs averaged, the lse right: every piece weighted alike."""
    _, lse = merge_states(o_a, lse_a, o_b, lse_b)
    both = np.isfinite(lse_a) & np.isfinite(lse_b)
    one = np.where(np.isfinite(lse_a)[..., None], o_a, o_b)
    o = np.where(both[..., None], (o_a.astype(np.float64) + o_b) / 2, one)
    return o.astype(o_a.dtype), lse


def merge_unguarded(o_a, lse_a, o_b, lse_b):
    """The formula without the guard for two empty pieces: -inf - (-inf) = NaN."""
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.maximum(lse_a, lse_b)
        w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)
        o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None]
        return o.astype(o_a.dtype), (m + np.log(w_a + w_b)).astype(lse_a.dtype)


def _weighted(o_a, lse_a, o_b, lse_b, w_a, w_b, lse):
    total = w_a + w_b
    safe = np.where(total == 0, 1.0, total)
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / safe[..., None]
    return o.astype(o_a.dtype), lse.astype(lse_a.dtype)


def merge_other_lse(o_a, lse_a, o_b, lse_b):
    """Each piece weighted with the other piece's lse; the lse right."""
    _, lse = merge_states(o_a, lse_a, o_b, lse_b)
    with np.errstate(invalid="ignore"):
        m = np.maximum(lse_a, lse_b)
        m = np.where(m == -np.inf, 0.0, m)
        return _weighted(o_a, lse_a, o_b, lse_b, np.exp(lse_b - m), np.exp(lse_a - m), lse)


def merge_base2_on_e(o_a, lse_a, o_b, lse_b):
    """FlashInfer's base-2 merge fed natural-log lse (vLLM #28840, SGLang #35045)."""
    return merge_bth_base2(o_a, lse_a, o_b, lse_b)


def merge_empty_as_zero(o_a, lse_a, o_b, lse_b):
    """An lse of -inf (a piece that saw no key) read as 0 before the right merge."""
    return merge_states(
        o_a, np.where(np.isneginf(lse_a), 0.0, lse_a), o_b, np.where(np.isneginf(lse_b), 0.0, lse_b)
    )


def merge_without_maximum(o_a, lse_a, o_b, lse_b):
    """exp(lse) as it is, the larger lse not subtracted: past lse = 709 it overflows."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        w_a, w_b = np.exp(lse_a), np.exp(lse_b)
        o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None]
        return o.astype(o_a.dtype), np.log(w_a + w_b).astype(lse_a.dtype)
