"""Backends: one small class per implementation, and the registry that loads them by name.

    from conformance.backends import load_backend, available_backends

``base`` holds the interface (``Backend``), ``arrays`` the one converter per framework,
``numpy_backends``/``jax_backends``/``torch_backends`` the shipped adapters and
``registry`` the names. The vocabulary (capabilities, dtypes) comes from
``conformance.vocabulary`` and is re-exported here, where the suite has always read it.
"""

from conformance.backends.base import Backend, BackendUnavailable
from conformance.backends.jax_backends import (
    JaxBackend,
    JaxFlashBackend,
    JaxRingBackend,
    JaxUlyssesBackend,
)
from conformance.backends.numpy_backends import NumpyBackend, NumpyFlashBackend
from conformance.backends.registry import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    REGISTRY,
    REQUIRES,
    Registry,
    available_backends,
    load_backend,
    register_backend,
    registered_backends,
    unregister_backend,
)
from conformance.backends.torch_backends import (
    TorchModuleBackend,
    TorchNaiveBackend,
    TorchRingBackend,
    TorchSdpaBackend,
    TorchUlyssesBackend,
)
from conformance.vocabulary import (
    ALL_CAPABILITIES,
    CAPABILITIES,
    DTYPES,
    GRAD_CAPABILITIES,
    OPTION_DEFAULTS,
    numpy_dtype,
)

__all__ = [
    "ALL_CAPABILITIES",
    "BUILTIN",
    "CAPABILITIES",
    "DTYPES",
    "ENTRY_POINT_GROUP",
    "GRAD_CAPABILITIES",
    "OPTION_DEFAULTS",
    "REGISTRY",
    "REQUIRES",
    "Backend",
    "BackendUnavailable",
    "JaxBackend",
    "JaxFlashBackend",
    "JaxRingBackend",
    "JaxUlyssesBackend",
    "NumpyBackend",
    "NumpyFlashBackend",
    "Registry",
    "TorchModuleBackend",
    "TorchNaiveBackend",
    "TorchRingBackend",
    "TorchSdpaBackend",
    "TorchUlyssesBackend",
    "available_backends",
    "load_backend",
    "numpy_dtype",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]
