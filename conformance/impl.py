"""Your implementation as a backend: ``--impl package.module:attr``.

``--impl`` names either a
   function with the spec's signature (NumPy in, NumPy out)::

       def attention(q, k, v, *, mask=None, is_causal=False, scale=None, ...) -> np.ndarray

   which ``FunctionBackend`` wraps, declaring only the capabilities and dtypes you list
   (``--impl-capabilities``, ``--impl-dtypes``), or a ``conformance.Backend`` subclass or
   instance, used as it is. ``load_impl`` imports it and registers it beside the built-in
   backends, so the suite, the report and ``load_backend`` all find it by its name.

2. **Known failures.** A plain-text file, one test id per line with the reason after
   ``#``; those tests are expected to fail (strict: a fixed bug shows up as a failure to
   remove the line), and ids that match no test are reported as stale.

3. **Failures that replay.** The suite records each test's last calls to
   ``backend.attention``; when a test fails, the inputs are saved to an ``.npz`` file and
   the failure carries a snippet that replays the call (``load_call``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from conformance.backends import (
    ALL_CAPABILITIES,
    CAPABILITIES,
    DTYPES,
    Backend,
    BackendUnavailable,
    available_backends,
    load_backend,
    register_backend,
    registered_backends,
)

#: What a plain function can declare: everything but the module layers, which a single
#: attention function does not provide.
FUNCTION_CAPABILITIES = ALL_CAPABILITIES - {"module"}


class FunctionBackend(Backend):
    """A function with the spec's signature, NumPy in and NumPy out, as a backend.

    Options the caller leaves at their defaults are not passed on (``Backend.attention``),
    so a function without, say, a ``window`` parameter works as long as ``window`` is not
    among its declared capabilities.

    Args:
      func: ``func(q, k, v, *, mask, is_causal, scale, ...)`` returning the output array.
      name: the backend's name in test ids and the report; default ``module.function``
        (the last part of the module's dotted name).
      capabilities: the optional features ``func`` implements (``CAPABILITIES``); default
        none, i.e. only the core of the spec.
      dtypes: the dtypes ``func`` accepts; default float64 and float32.
    """

    def __init__(
        self,
        func: Callable[..., np.ndarray],
        name: str | None = None,
        capabilities: Iterable[str] = (),
        dtypes: Iterable[str] = ("float64", "float32"),
    ) -> None:
        self.func = func
        self.name = name or _default_name(func.__module__, func.__name__)
        self.capabilities = frozenset(capabilities)
        self.dtypes = tuple(dtypes)
        if "module" in self.capabilities:
            raise ValueError(
                f"{self.name}: a function cannot declare 'module' (it needs the multi-head "
                "layer and GPT block); subclass conformance.Backend instead"
            )

    def _attention(self, q, k, v, **options):
        return self.func(q, k, v, **options)


#: The keyword arguments a function needs for each capability it declares.
_OPTIONS = {
    "causal_bottom_right": ("causal_alignment",),
    "window": ("window",),
    "softcap": ("softcap",),
    "dropout": ("dropout_p", "seed"),
}


def _accepts(func: Callable, option: str) -> bool:
    """Whether ``func`` takes the keyword ``option`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return True
    return option in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _default_name(module: str, attr: str) -> str:
    return f"{module.rsplit('.', 1)[-1]}.{attr}"


class ImplUnavailable(BackendUnavailable):
    """An ``--impl`` target cannot be imported, or is neither a function nor a Backend."""


#: How to rebuild each backend registered here, for the replay snippets: a name maps to
#: the keyword arguments of ``load_impl``.
LOADERS: dict[str, dict] = {}


def _import_target(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ImplUnavailable(
            f"--impl {spec!r} should be 'package.module:function' or 'package.module:Backend'; "
            f"registered backends are {registered_backends()}"
        )
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # `pytest` (unlike `python -m pytest`) does not put the working directory on
            # sys.path; a user's module next to where they run the suite should still load.
            if os.getcwd() in sys.path or not module_name.startswith(err.name or "\0"):
                raise
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
        target = module
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as err:
        raise ImplUnavailable(
            f"--impl {spec!r} cannot be imported ({type(err).__name__}: {err}); registered "
            f"backends are {registered_backends()}, installed here: {available_backends()}"
        ) from err
    return target


def _split(values: Iterable[str] | str | None) -> list[str] | None:
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def resolve_impl(
    spec: str,
    *,
    name: str | None = None,
    capabilities: Iterable[str] | str | None = None,
    dtypes: Iterable[str] | str | None = None,
) -> Backend:
    """The backend ``spec`` ('package.module:attr') names, not yet registered.

    A function is wrapped in ``FunctionBackend`` with ``capabilities`` (a list or a
    comma-separated string; "all" = every capability a function can have) and ``dtypes``
    ("all" = every dtype of the spec). A Backend subclass is instantiated, an instance is
    used as it is; both declare their own capabilities and dtypes.

    Raises:
      ImplUnavailable: the target cannot be imported or is not usable.
      ValueError: unknown capabilities or dtypes.
    """
    target = _import_target(spec)
    caps, dts = _split(capabilities), _split(dtypes)
    if isinstance(target, type) and issubclass(target, Backend):
        target = target()
    if isinstance(target, Backend):
        if caps or dts:
            raise ValueError(
                f"--impl {spec!r} is a Backend, which declares its own capabilities and "
                "dtypes; --impl-capabilities and --impl-dtypes are for plain functions"
            )
        backend = target
        if name:
            backend.name = name
        elif not backend.name:
            backend.name = _default_name(spec.partition(":")[0], type(backend).__name__)
    elif callable(target) and not isinstance(target, type):
        if caps == ["all"]:
            caps = sorted(FUNCTION_CAPABILITIES)
        if dts == ["all"]:
            dts = list(DTYPES)
        unknown = sorted(set(caps or ()) - set(CAPABILITIES))
        if unknown:
            raise ValueError(
                f"--impl-capabilities: unknown {unknown}; known: {', '.join(CAPABILITIES)}"
            )
        bad = sorted(set(dts or ()) - set(DTYPES))
        if bad:
            raise ValueError(f"--impl-dtypes: unknown {bad}; known: {', '.join(DTYPES)}")
        for cap in caps or ():
            for option in _OPTIONS.get(cap, ()):
                if not _accepts(target, option):
                    raise ValueError(
                        f"--impl {spec!r} declares {cap!r}, but {target.__name__}() has no "
                        f"{option!r} parameter"
                    )
        backend = FunctionBackend(
            target,
            name=name or _default_name(spec.partition(":")[0], spec.partition(":")[2]),
            capabilities=caps or (),
            dtypes=dts or ("float64", "float32"),
        )
    else:
        raise ImplUnavailable(
            f"--impl {spec!r} is a {type(target).__name__}, not a function or a "
            f"conformance.Backend; registered backends are {registered_backends()}"
        )
    return backend


def load_impl(
    spec: str,
    *,
    name: str | None = None,
    capabilities: Iterable[str] | str | None = None,
    dtypes: Iterable[str] | str | None = None,
) -> Backend:
    """Import the implementation ``spec`` names, register it and return it loaded.

    Arguments as for ``resolve_impl``. Afterwards ``load_backend(backend.name)`` returns
    the same object, and the suite's ``--backend`` accepts the name.
    """
    backend = resolve_impl(spec, name=name, capabilities=capabilities, dtypes=dtypes)
    # Loading the same impl again (a replay in the process that recorded it) replaces it.
    register_backend(backend.name, lambda: backend, replace=backend.name in LOADERS)
    LOADERS[backend.name] = {
        "spec": spec,
        "name": backend.name,
        "capabilities": sorted(backend.capabilities)
        if isinstance(backend, FunctionBackend)
        else None,
        "dtypes": list(backend.dtypes) if isinstance(backend, FunctionBackend) else None,
    }
    return load_backend(backend.name)
