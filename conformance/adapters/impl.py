"""Your implementation as a backend: ``--impl package.module:attr``.

``--impl`` names either a
   function with the spec's signature (NumPy in, NumPy out)::

       def attention(q, k, v, *, mask=None, is_causal=False, scale=None, ...) -> np.ndarray

   which ``FunctionBackend`` wraps, declaring only the capabilities and dtypes you list
   (``--impl-capabilities``, ``--impl-dtypes``); a function on torch or JAX arrays, or in
   the (B, T, H, D) layout, with ``--impl-framework`` and ``--impl-layout`` (the
   conversion is ``conformance/adapters/native.py``), and a library function with its own
   keywords through a profile (``conformance/profiles``); or a ``conformance.Backend`` subclass or
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
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from conformance.adapters.domain import Domain, parse_domain
from conformance.adapters.forms import MASK_OPTIONS
from conformance.adapters.function import (
    FUNCTION_CAPABILITIES,
    FUNCTION_VARIANTS,
    KEYWORDS_OF,
    FunctionBackend,
    default_name,
)
from conformance.adapters.lse import LseForm
from conformance.adapters.native import (
    FRAMEWORKS,
    LAYOUTS,
    SPEC_OPTIONS,
    OptionMap,
    framework_of,
)
from conformance.backends import (
    DTYPES,
    GRAD_CAPABILITIES,
    Backend,
    BackendUnavailable,
    available_backends,
    load_backend,
    register_backend,
    registered_backends,
)


def _check_keywords(spec: str, target: Callable, caps: Iterable[str], call: OptionMap) -> None:
    """Each declared capability's options have a keyword ``target`` takes, or are built into
    the mask (causality through the mask); "packed" needs is_causal as a keyword.

    Raises:
      ValueError: naming the capability and the missing keyword or parameter.
    """
    if call.causal == "mask" and "packed" in caps:
        raise ValueError(
            f"--impl {spec!r} takes causality through the mask, which the suite cannot build "
            "for attention_packed's documents: 'packed' needs is_causal as a keyword"
        )
    for cap in caps:
        for option in KEYWORDS_OF.get(cap, ()):
            if call.causal == "mask" and option in MASK_OPTIONS and option not in call.options:
                continue  # built into the mask
            keyword = call.options.get(option)
            if keyword is None:
                raise ValueError(
                    f"--impl {spec!r} declares {cap!r}, but its profile maps no keyword for "
                    f"the spec's {option!r}"
                )
            if keyword != "global" and not _accepts(target, keyword):
                raise ValueError(
                    f"--impl {spec!r} declares {cap!r}, but {target.__name__}() has no "
                    f"{keyword!r} parameter"
                )


def _accepts(func: Callable, option: str) -> bool:
    """Whether ``func`` takes the keyword ``option`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return True
    return option in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class ImplUnavailable(BackendUnavailable):
    """An ``--impl`` target cannot be imported, or is neither a function nor a Backend."""


#: How to rebuild each backend registered here, for the replay snippets: a name maps to
#: the keyword arguments of ``load_impl``.
LOADERS: dict[str, dict] = {}


def import_target(spec: str) -> Any:
    """The object ``spec`` ('package.module:attr') names, imported."""
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


def _backend_as_given(spec: str, backend: Backend, name: str | None, options: bool) -> Backend:
    """``--impl`` naming a Backend: it declares its own capabilities and dtypes, so
    ``options`` (any of a plain function's flags or profile keys given) is refused."""
    if options:
        raise ValueError(
            f"--impl {spec!r} is a Backend, which declares its own capabilities and "
            "dtypes and converts its own arrays; --impl-capabilities, --impl-dtypes, "
            "--impl-framework, --impl-layout, --impl-causal, --impl-mask, --impl-domain, "
            "--impl-device and profiles are for plain functions"
        )
    if name:
        backend.name = name
    elif not backend.name:
        backend.name = default_name(spec.partition(":")[0], type(backend).__name__)
    return backend


def resolve_impl(
    spec: str,
    *,
    name: str | None = None,
    capabilities: Iterable[str] | str | None = None,
    dtypes: Iterable[str] | str | None = None,
    framework: str = "numpy",
    layout: str = "BHTD",
    call: OptionMap | None = None,
    libraries: Iterable[str] = (),
    jit: bool = False,
    packed: str | None = None,
    causal: str | None = None,
    mask: str | None = None,
    forms: Iterable[str] | None = None,
    domain: Domain | None = None,
    interpreter: str = "",
    lse: LseForm | None = None,
    device: str | None = None,
    float32_matmul: str = "float32",
) -> Backend:
    """The backend ``spec`` ('package.module:attr') names, not yet registered.

    A function is wrapped in ``FunctionBackend`` with ``capabilities`` (a list or a
    comma-separated string; "all" = every capability a function can have) and ``dtypes``
    ("all" = every dtype of the spec), taking ``framework``'s arrays ("numpy", "torch",
    "jax", or "auto": from the target's module) in ``layout`` ("BHTD" or "BTHD"); ``call``
    maps the spec's options to its keywords (a profile's, ``conformance.adapters.profiles``);
    ``packed`` ('package.module:attr') names the function for ``attention_packed``;
    ``causal`` ("keyword", "mask", "none" or "only") and ``mask`` ("both", "additive",
    "additive-min", "bool" or "none") say how causality and masks reach a function without a profile
    (``--impl-causal``, ``--impl-mask``), ``forms`` what it takes and ``domain`` the
    shapes it accepts (a profile's), ``interpreter`` what it runs under, ``lse`` where
    its result holds its log-sum-exp (a profile's [lse], with the capability "lse"),
    ``device`` where it runs (``--impl-device``, a profile's ``device``; SPEC §13.20) and
    ``float32_matmul`` what it computes float32 matmuls in (a profile's). A
    Backend subclass is instantiated, an instance is used as it is; both declare their own
    capabilities and dtypes.

    Raises:
      ImplUnavailable: the target cannot be imported or is not usable, or its framework
        is unknown or not installed.
      ValueError: unknown capabilities, dtypes or layout.
    """
    target = import_target(spec)
    caps, dts = _split(capabilities), _split(dtypes)
    if isinstance(target, type) and issubclass(target, Backend):
        target = target()
    if isinstance(target, Backend):
        plain = (framework != "numpy", layout != "BHTD", caps, dts)
        given = (call, packed, causal, mask, domain, lse, device)
        return _backend_as_given(
            spec, target, name, any(plain) or any(x is not None for x in given)
        )
    if not callable(target) or isinstance(target, type):
        raise ImplUnavailable(
            f"--impl {spec!r} is a {type(target).__name__}, not a function or a "
            f"conformance.Backend; registered backends are {registered_backends()}"
        )
    if framework == "auto":
        framework = framework_of(target)
    if framework not in FRAMEWORKS:
        raise ImplUnavailable(
            f"--impl-framework {framework!r} is unknown; known: auto, {', '.join(FRAMEWORKS)}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"--impl-layout {layout!r} is unknown; known: {', '.join(LAYOUTS)}")
    allowed = FUNCTION_CAPABILITIES | FUNCTION_VARIANTS
    if framework != "numpy":
        # torch autograd or jax.vjp differentiate the function itself.
        allowed = allowed | (GRAD_CAPABILITIES - {"module_grad"})
    if caps and "all" in caps:
        # "all" is the capabilities a function had before the variants; they are named
        # beside it ("all,sinks").
        caps = sorted(FUNCTION_CAPABILITIES | (set(caps) - {"all"}))
    if caps and "packed" in caps and packed is None:
        raise ValueError(
            "--impl-capabilities: 'packed' needs a second function for attention_packed, "
            "which a profile's 'packed' key names (SPEC §13.12); a plain --impl has one, "
            "attention"
        )
    dts = list(DTYPES) if dts == ["all"] else dts
    unknown = sorted(set(caps or ()) - allowed)
    if unknown:
        raise ValueError(
            f"--impl-capabilities: unknown {unknown} for a {framework} function; known: "
            f"{', '.join(sorted(allowed))}"
        )
    bad = sorted(set(dts or ()) - set(DTYPES))
    if bad:
        raise ValueError(f"--impl-dtypes: unknown {bad}; known: {', '.join(DTYPES)}")
    assumed: list[str] = []
    if call is None:
        causal, mask, assumed = _forms_from_signature(target, causal, mask)
    call = call or _impl_call(layout, causal, mask)
    _check_keywords(spec, target, caps or (), call)
    try:
        return FunctionBackend(
            target,
            name=name or default_name(spec.partition(":")[0], spec.partition(":")[2]),
            capabilities=caps or (),
            dtypes=dts or ("float64", "float32"),
            framework=framework,
            call=call,
            libraries=libraries,
            jit=jit,
            packed=None if packed is None else import_target(packed),
            forms=forms,
            domain=domain,
            interpreter=interpreter,
            lse=lse,
            device=device,
            float32_matmul=float32_matmul,
            assumed=assumed,
        )
    except LookupError as err:  # the framework is not installed, or the device not here
        raise ImplUnavailable(f"--impl {spec!r}: {err}") from err
    except ValueError as err:
        if str(err).startswith("device "):
            raise ValueError(f"--impl-device: {err}") from err
        raise


#: ``--impl-mask``: the mask keywords of a function without a profile, and what an additive
#: mask holds on a blocked key.
IMPL_MASKS = {
    "both": {"mask_bool": "mask", "mask_float": "mask"},
    "additive": {"mask_bool": None, "mask_float": "mask", "blocked": "-inf"},
    "additive-min": {"mask_bool": None, "mask_float": "mask", "blocked": "min"},
    "bool": {"mask_bool": "mask", "mask_float": None},
    "none": {"mask_bool": None, "mask_float": None},
}
IMPL_CAUSALITY = ("keyword", "mask", "none", "only")


def _forms_from_signature(
    target: Callable, causal: str | None, mask: str | None
) -> tuple[str | None, str | None, list[str]]:
    """``--impl-causal`` and ``--impl-mask`` where they were not given, from what the
    function's signature takes, and what was so assumed, in words: with no ``mask``
    parameter (and no ``**kwargs``) it is called with no mask ("none": its mask tests are
    skipped by name), with no ``is_causal`` with no causality ("none"), as a profile would
    declare it. The suite judges only what a function takes: passing it a keyword it lacks
    would fail every such test on a TypeError about the suite's call, not on the
    function's behaviour."""
    name = getattr(target, "__name__", "the function")
    assumed = []
    if mask is None and not _accepts(target, "mask"):
        mask = "none"
        assumed.append(
            f"{name}() has no 'mask' parameter: called with no mask, its mask tests skipped "
            "(--impl-mask says what its mask takes)"
        )
    if causal is None and not _accepts(target, "is_causal"):
        causal = "none"
        assumed.append(
            f"{name}() has no 'is_causal' parameter: no causal call reaches it, its causal "
            "tests skipped (--impl-causal mask builds causality into its mask)"
        )
    return causal, mask, assumed


def _impl_call(layout: str, causal: str | None, mask: str | None) -> OptionMap:
    """The ``OptionMap`` of an ``--impl`` function: the spec's keywords, but for what
    ``causal`` ("mask": is_causal, causal_alignment, window and chunk_size are built into
    the mask; "none": no is_causal) and ``mask`` (``IMPL_MASKS``) leave out."""
    causal, mask = causal or "keyword", mask or "both"
    if causal not in IMPL_CAUSALITY:
        raise ValueError(f"--impl-causal {causal!r} is unknown; known: {', '.join(IMPL_CAUSALITY)}")
    if mask not in IMPL_MASKS:
        raise ValueError(f"--impl-mask {mask!r} is unknown; known: {', '.join(IMPL_MASKS)}")
    gone = {"mask": MASK_OPTIONS, "none": ("is_causal",), "only": ("is_causal",)}.get(causal, ())
    options = {name: name for name in SPEC_OPTIONS if name not in gone}
    return OptionMap(options=options, layout=layout, causal=causal, **IMPL_MASKS[mask])


def load_impl(
    spec: str | None = None,
    *,
    name: str | None = None,
    capabilities: Iterable[str] | str | None = None,
    dtypes: Iterable[str] | str | None = None,
    framework: str = "numpy",
    layout: str = "BHTD",
    causal: str | None = None,
    mask: str | None = None,
    domain: Mapping[str, Any] | None = None,
    device: str | None = None,
) -> Backend:
    """Import the implementation ``spec`` names, register it and return it loaded (a
    profile is loaded by ``conformance.adapters.profiles.load_profile``).

    Arguments as for ``resolve_impl``; ``domain`` is a ``[domain]`` table (the
    ``--impl-domain`` flags, ``conformance.adapters.domain.domain_flags``). Afterwards
    ``load_backend(backend.name)`` returns the same object, and the suite's ``--backend``
    accepts the name.
    """
    if spec is None:
        raise ValueError("load_impl needs a spec ('package.module:function') or a profile")
    if "merge" in (_split(capabilities) or ()):
        raise ValueError(
            "--impl-capabilities: 'merge' needs a merge function, merge(o_a, lse_a, o_b, "
            "lse_b) -> (o, lse), which a profile's [merge] table names (SPEC §22.10); a plain "
            f"--impl names one function, attention ({spec!r})"
        )
    backend = resolve_impl(
        spec,
        name=name,
        capabilities=capabilities,
        dtypes=dtypes,
        framework=framework,
        layout=layout,
        causal=causal,
        mask=mask,
        domain=parse_domain(domain, "--impl-domain") if domain else None,
        device=device,
    )
    plain = isinstance(backend, FunctionBackend)
    loader = {
        "spec": spec,
        "name": backend.name,
        "capabilities": sorted(backend.capabilities) if plain else None,
        "dtypes": list(backend.dtypes) if plain else None,
        "framework": backend.framework if plain else "numpy",
        "layout": backend.call.layout if plain else "BHTD",
        **({"causal": causal, "mask": mask} if plain and (causal or mask) else {}),
        **({"domain": dict(domain)} if domain else {}),
        **({"device": device} if device else {}),
    }
    return register_loaded(backend, loader)


def register_loaded(backend: Backend, loader: dict) -> Backend:
    """Register ``backend`` under its name, remember how ``loader`` rebuilds it (for the
    replay snippets), and return it loaded."""
    # Loading the same impl again (a replay in the process that recorded it) replaces it.
    register_backend(backend.name, lambda: backend, replace=backend.name in LOADERS)
    LOADERS[backend.name] = loader
    return load_backend(backend.name)
