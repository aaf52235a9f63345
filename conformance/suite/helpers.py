"""What the conformance tests share: random inputs, tolerances, the oracle kept for the run.

What a test needs (capabilities, dtypes) is declared with ``conformance.suite.requirements``.
"""

from __future__ import annotations

import collections

import numpy as np

from conformance.backends import numpy_dtype
from conformance.suite.tolerance import expect, tolerance


def random_qkv(
    seed: int,
    *,
    B: int = 2,
    H: int = 3,
    K: int | None = None,
    T: int = 7,
    S: int = 13,
    D: int = 5,
    E: int | None = None,
    dtype: str = "float64",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard-normal q (B, H, T, D), k (B, K, S, D), v (B, K, S, E) in ``dtype``."""
    rng = np.random.default_rng(seed)
    K = K or H
    E = E or D
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((B, H, T, D)).astype(dt)
    k = rng.standard_normal((B, K, S, D)).astype(dt)
    v = rng.standard_normal((B, K, S, E)).astype(dt)
    return q, k, v


def random_tolerance(q, k, v, dtype: str, **options) -> float:
    """SPEC §7's tolerance for inputs without a fixture: the naive run in ``dtype`` against
    the same naive run in float64, which for these sizes is far closer to the oracle than
    any low-precision result."""
    from conformance.fixtures.oracle import naive_same_precision

    ref = naive_same_precision(q, k, v, np.float64, **options)
    low = naive_same_precision(q, k, v, numpy_dtype(dtype), **options)
    return tolerance(dtype, float(np.max(np.abs(low - ref), initial=0.0)), ref)


def as64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


#: Sizes every invariant runs on: awkward ones find bugs that round ones hide.
SIZES = {"T7-S13": {"T": 7, "S": 13}, "T13-S7": {"T": 13, "S": 7}, "T8-S8": {"T": 8, "S": 8}}


#: The oracle's results, most recently used last; at most ``_ORACLE_CACHE_SIZE`` of them.
_ORACLE_CACHE: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()
_ORACLE_CACHE_SIZE = 4096


def oracle_attention(q, k, v, *, mask=None, **options) -> np.ndarray:
    """The mpmath oracle on float64 inputs, kept for the process (the most recently used
    4096 results): its rows cost milliseconds each, and every backend (and every mutant of
    the project's tests) asks for the same inputs. The key is the inputs' bytes, so equal
    inputs are the only way to share."""
    from conformance.fixtures import oracle

    arrays = (q, k, v) if mask is None else (q, k, v, mask)
    # An array option (sinks) is keyed by its bytes, like the inputs.
    key = (
        tuple((x.dtype.str, x.shape, x.tobytes()) for x in arrays),
        *sorted(
            (name, (x.dtype.str, x.shape, x.tobytes()) if isinstance(x, np.ndarray) else x)
            for name, x in options.items()
        ),
    )
    if key in _ORACLE_CACHE:
        _ORACLE_CACHE.move_to_end(key)
    else:
        _ORACLE_CACHE[key] = oracle.attention(q, k, v, mask=mask, **options)
        if len(_ORACLE_CACHE) > _ORACLE_CACHE_SIZE:
            _ORACLE_CACHE.popitem(last=False)
    return _ORACLE_CACHE[key].copy()


def expect_no_weight_on_future_keys(name: str, w: np.ndarray, T: int, S: int) -> None:
    """Top-left causal weights (..., T, S): every key after its query's position has
    weight exactly 0."""
    future = np.triu(np.ones((T, S), dtype=bool), k=1)  # (T, S)
    expect(
        (w[..., future] == 0).all(),
        "puts weight on a key that a causal mask blocks",
        f"{name}: weight on a future key: {np.abs(w[..., future]).max()}",
    )
