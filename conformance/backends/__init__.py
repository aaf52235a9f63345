"""Backends: one small class per implementation, and the registry that loads them by name."""

from conformance.backends.registry import *  # noqa: F403
from conformance.backends.registry import (  # noqa: F401
    ALL_CAPABILITIES,
    BUILTIN,
    CAPABILITIES,
    DTYPES,
    ENTRY_POINT_GROUP,
    GRAD_CAPABILITIES,
    REGISTRY,
    REQUIRES,
    Backend,
    BackendUnavailable,
    Registry,
    _check_declarations,
    available_backends,
    load_backend,
    numpy_dtype,
    register_backend,
    registered_backends,
    unregister_backend,
)
