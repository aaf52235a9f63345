"""The log-sum-exp's expected values and tolerance (SPEC §21): the oracle's lse beside its
output, and §21.3's rule, §7's form with a floor that scales with the scores."""

from __future__ import annotations

import numpy as np

from conformance.backends import numpy_dtype
from conformance.suite.helpers import as64
from conformance.suite.tolerance import EPS, FACTOR, finite_error

#: The floor of §21.3 in units of the working precision's eps: as §7.1's for float64 and
#: float32 (other association orders of the D-term products and the S-term sum).
LSE_FLOOR = 8.0


def working_dtype(dtype: str) -> str:
    """The precision the lse is computed and returned in (SPEC §21.4): float64 for
    float64, float32 for every other dtype."""
    return "float64" if dtype == "float64" else "float32"


def score_magnitude(q, k, options: dict) -> float:
    """The largest magnitude among the terms the scores are made of (SPEC §21.3): scale ·
    q·k before any softcap, a float mask's finite entries, ALiBi's bias and the sinks; at
    least 1. q (B, H, T, D) or (H, T, D), k with K heads."""
    q, k = as64(q), as64(k)
    if q.ndim == 3:
        q, k = q[None], k[None]  # (1, H, T, D), (1, K, S, D)
    G = q.shape[1] // k.shape[1]
    k = np.repeat(k, G, axis=1)  # (B, H, S, D)
    scale = options.get("scale")
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    with np.errstate(invalid="ignore", over="ignore"):
        products = np.abs(np.einsum("bhtd,bhsd->bhts", q, k) * scale)  # (B, H, T, S)
    terms = [products[np.isfinite(products)]]
    mask = options.get("mask")
    if mask is not None and np.asarray(mask).dtype != np.bool_:
        m = np.abs(as64(mask))
        terms.append(m[np.isfinite(m)])
    slopes = options.get("alibi_slopes")
    if slopes is not None:
        terms.append(np.abs(as64(slopes)).ravel() * (q.shape[2] + k.shape[2]))
    sinks = options.get("sinks")
    if sinks is not None:
        s = np.abs(as64(sinks))
        terms.append(s[np.isfinite(s)])
    return max(1.0, *(float(t.max(initial=0.0)) for t in terms))


def lse_tolerance(naive_error: float, dtype: str, magnitude: float) -> float:
    """SPEC §21.3: k · |naive lse − oracle lse| + 8 · eps(working precision) · max(1, M),
    M the largest magnitude among the scores' terms (``score_magnitude``)."""
    return FACTOR * naive_error + LSE_FLOOR * EPS[working_dtype(dtype)] * max(1.0, magnitude)


def oracle_lse_and_tolerance(q, k, v, dtype: str, **options):
    """(out, lse, tolerance of the lse): the oracle's output and log-sum-exp on the inputs
    as given (float64), and §21.3's tolerance from the naive run's lse in ``dtype``."""
    from conformance.suite.oracle_store import oracle

    wide = {
        n: as64(x) if isinstance(x, np.ndarray) and x.dtype != bool else x
        for n, x in options.items()
    }
    out, lse = oracle.attention(as64(q), as64(k), as64(v), return_lse=True, **wide)
    naive = oracle.naive_lse_same_precision(as64(q), as64(k), as64(v), numpy_dtype(dtype), **wide)
    magnitude = score_magnitude(q, k, wide)
    return out, lse, lse_tolerance(finite_error(naive, lse), dtype, magnitude)
