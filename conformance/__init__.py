"""Conformance suite for scaled dot-product attention.

    from conformance import load_backend, available_backends

    available_backends()                  # ['jax', 'numpy', 'torch-module', ...]
    b = load_backend("numpy")
    out = b.attention(q, k, v, is_causal=True)     # NumPy in, NumPy out

The normative text is ``conformance/SPEC.md``; the tests in ``conformance/tests`` check
it clause by clause (``pytest conformance --backend NAME``).
"""

from conformance.backends import (
    CAPABILITIES,
    DTYPES,
    Backend,
    BackendUnavailable,
    available_backends,
    load_backend,
    registered_backends,
)

__all__ = [
    "CAPABILITIES",
    "DTYPES",
    "Backend",
    "BackendUnavailable",
    "available_backends",
    "load_backend",
    "registered_backends",
]
