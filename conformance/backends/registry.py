"""The registry: every backend the suite knows, by name: built-in, from entry points
(group ``attention_conformance.backends``), and registered at run time."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from conformance.backends.base import Backend, BackendUnavailable
from conformance.backends.jax_backends import (
    JaxBackend,
    JaxFlashBackend,
    JaxFp8Backend,
    JaxRingBackend,
    JaxUlyssesBackend,
)
from conformance.backends.numpy_backends import (
    NumpyBackend,
    NumpyFlashBackend,
    NumpyFp8Backend,
    NumpySplitBackend,
)
from conformance.backends.torch_backends import (
    TorchFp8Backend,
    TorchModuleBackend,
    TorchNaiveBackend,
    TorchRingBackend,
    TorchSdpaBackend,
    TorchSplitBackend,
    TorchUlyssesBackend,
)
from conformance.vocabulary import CAPABILITIES, DTYPES

ENTRY_POINT_GROUP = "attention_conformance.backends"


def _at_shards(base: type[Backend], P: int) -> type[Backend]:
    """``base`` fixed at P shards by default, under the name ``{base.name}-p{P}``."""
    return type(
        f"{base.__name__}P{P}",
        (base,),
        {
            "name": f"{base.name}-p{P}",
            "default_shards": P,
            "conformance_options": MappingProxyType({}),
            "__doc__": f"{base.name} at P = {P} (SPEC §14.1).",
        },
    )


BUILTIN: dict[str, type[Backend]] = {
    "numpy": NumpyBackend,
    "numpy-flash": NumpyFlashBackend,
    "numpy-split": NumpySplitBackend,
    "jax": JaxBackend,
    "jax-flash": JaxFlashBackend,
    "torch-naive": TorchNaiveBackend,
    "torch-module": TorchModuleBackend,
    "torch-sdpa": TorchSdpaBackend,
    "torch-split": TorchSplitBackend,
    "jax-ring": JaxRingBackend,
    **{f"jax-ring-p{P}": _at_shards(JaxRingBackend, P) for P in (1, 2, 3)},
    "jax-ulysses": JaxUlyssesBackend,
    "jax-ulysses-p2": _at_shards(JaxUlyssesBackend, 2),
    "torch-ring": TorchRingBackend,
    **{f"torch-ring-p{P}": _at_shards(TorchRingBackend, P) for P in (1, 2, 4)},
    "torch-ulysses": TorchUlyssesBackend,
    "torch-ulysses-p2": _at_shards(TorchUlyssesBackend, 2),
    "numpy-fp8": NumpyFp8Backend,
    "jax-fp8": JaxFp8Backend,
    "torch-fp8": TorchFp8Backend,
}
#: The framework each built-in backend needs, to tell "not installed" from "broken".
REQUIRES = {
    "jax": "jax",
    "jax-flash": "jax",
    "torch-naive": "torch",
    "torch-module": "torch",
    "torch-sdpa": "torch",
    "torch-split": "torch",
    "jax-ring": "jax",
    **{f"jax-ring-p{P}": "jax" for P in (1, 2, 3)},
    "jax-ulysses": "jax",
    "jax-ulysses-p2": "jax",
    "torch-ring": "torch",
    **{f"torch-ring-p{P}": "torch" for P in (1, 2, 4)},
    "torch-ulysses": "torch",
    "torch-ulysses-p2": "torch",
    "jax-fp8": "jax",
    "torch-fp8": "torch",
}


class Registry:
    """Every backend the suite knows: built-in, from entry points, and registered at run time.

    ``register`` adds a backend for this process (``--impl`` does); entry points (group
    ``attention_conformance.backends``) register one for good. ``load`` builds a backend
    once per (name, options) and hands out the same object afterwards.
    """

    def __init__(self, builtin: dict[str, Callable[..., Backend]]) -> None:
        self._builtin = dict(builtin)
        self._runtime: dict[str, Callable[..., Backend]] = {}
        self._loaded: dict[tuple, Backend] = {}

    def factories(self) -> dict[str, Callable[..., Backend]]:
        found = {**self._builtin, **self._runtime}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            found.setdefault(ep.name, ep.load)
        return found

    def register(
        self, name: str, factory: Callable[..., Backend], *, replace: bool = False
    ) -> None:
        """Make ``factory`` loadable as ``name``; a taken name is refused unless ``replace``.

        Replacing drops the loaded instances of that name, so the next ``load`` builds anew.
        """
        if not replace and name in self.factories():
            raise ValueError(
                f"backend name {name!r} is already taken; registered backends are "
                f"{self.names()}: give yours another name (--impl-name)"
            )
        self._runtime[name] = factory
        self._forget(name)

    def unregister(self, name: str) -> None:
        """Remove a backend registered with ``register``."""
        self._runtime.pop(name, None)
        self._forget(name)

    def _forget(self, name: str) -> None:
        for key in [key for key in self._loaded if key[0] == name]:
            del self._loaded[key]

    def names(self) -> list[str]:
        return sorted(self.factories())

    def loaded(self) -> list[Backend]:
        """Every backend ``load`` has built so far in this process."""
        return list(self._loaded.values())

    def installed(self, name: str) -> bool:
        need = REQUIRES.get(name) if name in self._builtin else None
        return need is None or importlib.util.find_spec(need) is not None

    def load(self, name: str, **options: Any) -> Backend:
        key = (name, tuple(sorted(options.items())))
        if key in self._loaded:
            return self._loaded[key]
        factories = self.factories()
        if name not in factories:
            raise BackendUnavailable(
                f"unknown backend {name!r}: registered backends are {self.names()}, "
                f"installed here: {available_backends()}"
            )
        try:
            factory = factories[name]
            backend = factory(**options)
            if not isinstance(backend, Backend):
                backend = backend(**options)  # an entry point may name the class itself
        except ImportError as err:
            raise BackendUnavailable(
                f"backend {name!r} cannot be loaded ({err}); installed here: {available_backends()}"
            ) from err
        except TypeError as err:
            if options:
                raise TypeError(
                    f"backend {name!r} does not take the options {sorted(options)}: {err}"
                ) from err
            raise
        _check_declarations(backend)
        self._loaded[key] = backend
        return backend


REGISTRY = Registry(BUILTIN)


def register_backend(name: str, factory: Callable[..., Backend], *, replace: bool = False) -> None:
    """Register ``factory`` under ``name`` beside the built-in backends, for this process."""
    REGISTRY.register(name, factory, replace=replace)


def unregister_backend(name: str) -> None:
    """Remove a backend registered with ``register_backend``."""
    REGISTRY.unregister(name)


def registered_backends() -> list[str]:
    """Every backend name known to the suite, installed or not."""
    return REGISTRY.names()


def available_backends(*, sharded: bool = True) -> list[str]:
    """The backends whose framework is installed here, in a stable order.

    ``sharded=False`` leaves out the context-parallel backends (those whose class declares
    the capability "sharded"): they start devices or worker processes of their own, so
    ``--backend all`` runs them only when named (SPEC §10.3, §14).
    """
    names = [name for name in registered_backends() if REGISTRY.installed(name)]
    if not sharded:
        factories = REGISTRY.factories()
        names = [n for n in names if "sharded" not in getattr(factories[n], "capabilities", ())]
    return names


def load_backend(name: str, **options: Any) -> Backend:
    """Return the backend called ``name``, loading its framework on first use.

    Without options it is the backend as users get it: its defaults are its fast, real
    configuration. Options are the backend's own (SPEC §10.4), e.g. the tile sizes of the
    blockwise backends; the conformance run passes each backend's ``conformance_options``.

    Raises:
      BackendUnavailable: ``name`` is unknown, or its framework cannot be imported. The
        message lists what is registered and what is installed; it is never a silent skip.
      TypeError: the backend does not take one of ``options``.
    """
    return REGISTRY.load(name, **options)


def _check_declarations(backend: Backend) -> None:
    unknown = set(backend.capabilities) - set(CAPABILITIES)
    if unknown:
        raise ValueError(
            f"backend {backend.name!r} declares unknown capabilities {sorted(unknown)}; "
            f"known: {sorted(CAPABILITIES)}"
        )
    bad = set(backend.dtypes) - set(DTYPES)
    if bad:
        raise ValueError(
            f"backend {backend.name!r} declares unknown dtypes {sorted(bad)}; known: {DTYPES}"
        )
