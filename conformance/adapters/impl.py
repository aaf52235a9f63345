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
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from conformance.adapters.forms import MASK_OPTIONS, declared_forms, through_the_mask
from conformance.adapters.native import (
    FRAMEWORKS,
    LAYOUTS,
    SPEC_OPTIONS,
    OptionMap,
    framework_of,
    make_framework,
)
from conformance.backends import (
    ALL_CAPABILITIES,
    DTYPES,
    GRAD_CAPABILITIES,
    Backend,
    BackendUnavailable,
    available_backends,
    load_backend,
    register_backend,
    registered_backends,
)
from conformance.vocabulary import OPTION_CAPABILITIES, VARIANT_CAPABILITIES, option_is_set

#: What a plain function can declare: everything but the module layers, which a single
#: attention function does not provide ("all" on the command line means these).
FUNCTION_CAPABILITIES = ALL_CAPABILITIES - {"module"}
#: The variants a function declares one by one, as keywords of ``attention`` (SPEC §15-§17),
#: or, for "packed", with a second function for ``attention_packed`` (a profile's
#: ``packed``, §13.12). "paged" needs a Backend subclass.
FUNCTION_VARIANTS = VARIANT_CAPABILITIES - {"paged"}


class FunctionBackend(Backend):
    """A library's attention function, called as its users call it, as a backend.

    The function takes its framework's arrays (NumPy by default), in its layout, with its
    own keywords; ``call`` (``conformance.adapters.native.OptionMap``) says how a spec call maps
    onto them, and ``conformance/adapters/native.py`` is where the conversion happens, visibly and
    without changing a number. With the defaults (NumPy, heads-first, the spec's option
    names) it is a function with the spec's signature, NumPy in and NumPy out.

    Options the caller leaves at their defaults are not passed on, so a function without,
    say, a ``window`` parameter works as long as ``window`` is not among its declared
    capabilities.

    Args:
      func: the attention function, returning the output array.
      name: the backend's name in test ids and the report; default ``module.function``
        (the last part of the module's dotted name).
      capabilities: the optional features ``func`` implements (``CAPABILITIES``, and the
        gradient ones for a torch or JAX function); default none, i.e. only the core.
      dtypes: the dtypes ``func`` accepts; default float64 and float32.
      framework: "numpy", "torch" or "jax": the arrays ``func`` takes and returns.
      call: how spec options become ``func``'s keywords; default: the spec's own names.
      libraries: distributions whose versions the report shows beside the framework's.
      jit: compile ``func`` as JAX users do (``jax.jit``, every keyword but the mask's
        static); JAX only.
      packed: the function for ``attention_packed`` (SPEC §18), taking q, k, v (unbatched,
        in ``call``'s layout), cu_seqlens_q and cu_seqlens_k as the framework's arrays
        and the same keywords as ``func``; needed to declare "packed".
      forms: the forms of causality, window and scale ``func`` takes
        (``conformance.adapters.forms``); default: those ``call`` gives it.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        name: str | None = None,
        capabilities: Iterable[str] = (),
        dtypes: Iterable[str] = ("float64", "float32"),
        *,
        framework: str = "numpy",
        call: OptionMap | None = None,
        libraries: Iterable[str] = (),
        jit: bool = False,
        packed: Callable[..., Any] | None = None,
        forms: Iterable[str] | None = None,
    ) -> None:
        self.func = func
        self.packed = packed
        self.name = name or _default_name(func.__module__, func.__name__)
        self.capabilities = frozenset(capabilities)
        self.dtypes = tuple(dtypes)
        self.arrays = make_framework(framework)
        self.framework = self.arrays.name
        self.call = call or OptionMap()
        self.libraries = tuple(libraries)
        # Messages name the function as its profile (or --impl) names it: an adapter's own
        # name (``attend``, ``call``) tells a reader nothing about the library.
        self.func_name = name or getattr(func, "__qualname__", None) or repr(func)
        self.forms = frozenset(declared_forms(self.call) if forms is None else forms)
        if jit:
            # The packed function is an adapter's: it reads the boundaries on the host to
            # build its call, and compiles the library's function itself.
            self.func = self.arrays.jit(func, self.call.static_keywords(func))
        if ("packed" in self.capabilities) != (packed is not None):
            raise ValueError(
                f"{self.name}: declaring 'packed' needs a function for attention_packed "
                f"(a profile's 'packed'), and one is given only with it; capabilities "
                f"{sorted(self.capabilities)}, packed function {packed!r}"
            )
        if "module" in self.capabilities:
            raise ValueError(
                f"{self.name}: a function cannot declare 'module' (it needs the multi-head "
                "layer and GPT block); subclass conformance.Backend instead"
            )

    def from_numpy(self, x):
        return self.arrays.from_numpy(x)

    def to_numpy(self, x):
        return self.arrays.to_numpy(x)

    def _prepare(self, q, k, v, mask, options) -> tuple[list, dict]:
        """Steps 1, 2 and 4 of ``conformance.adapters.native``: the framework's q, k, v and the
        library's keywords (the mask among them, converted); causality through the mask
        first, where the function takes it so."""
        if self.call.causal == "mask":
            if np.ndim(q) >= 2 and np.ndim(k) >= 2:
                T, S = np.shape(q)[-2], np.shape(k)[-2]
                options, mask = through_the_mask(
                    options, mask, T, S, self.call.options, self.call.blocked
                )
            else:  # malformed inputs, for the function to refuse: nothing to build on
                options = {o: x for o, x in options.items() if o not in MASK_OPTIONS}
        keywords = {
            **self.call.keywords(self.func_name, options, self.arrays),
            **{
                key: self.from_numpy(m)
                for key, m in self.call.mask(self.func_name, mask, np.asarray(q).dtype).items()
            },
        }
        return [self.from_numpy(x) for x in (q, k, v)], keywords

    def _call(self, q, k, v, keywords: dict, *boundaries, func=None) -> Any:
        """Step 3: the layout on the way in and out, around the library's call (``func``,
        by default the attention function; the packed one with the boundaries)."""
        swap = self.call.layout == "BTHD"
        if swap:
            q, k, v = (self.arrays.swap_heads_and_time(x) if x.ndim >= 3 else x for x in (q, k, v))
        out = (func or self.func)(q, k, v, *boundaries, **keywords)
        if swap and getattr(out, "ndim", 0) >= 3:
            out = self.arrays.swap_heads_and_time(out)
        return out

    def _result(self, out: Any, call: str) -> np.ndarray:
        return self.to_numpy(self._an_array(out, call))

    def _an_array(self, out: Any, call: str) -> Any:
        if not self.arrays.is_array(out):
            # An AssertionError fails the test: never a ValueError or TypeError that a
            # bad-input test could take for a refusal.
            raise AssertionError(
                f"{call} returned a {type(out).__name__}, not a {self.framework} array"
            )
        return out

    def _refuse_undeclared(self, options: dict, *, grad: bool = False) -> None:
        """SPEC §8.5: an option whose capability is not declared is refused here, naming it,
        rather than passed to a function that never promised to honour it."""
        needs = dict(_CAPABILITY_OF)
        if grad:
            if "grad" not in self.capabilities:
                raise NotImplementedError(f"{self.name} does not declare the 'grad' capability")
            needs["softcap"] = "grad_softcap"
        for option, value in options.items():
            capability = needs.get(option)
            if capability and option_is_set(option, value) and capability not in self.capabilities:
                raise NotImplementedError(
                    f"{self.name} does not declare {capability!r}: {option}={value!r} refused"
                )

    def attention(self, q, k, v, *, mask=None, **options):
        """out (B, H, T, E) for q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), NumPy in and
        out: the library's call in between (``conformance.adapters.native``)."""
        self._refuse_undeclared(options)
        (q, k, v), keywords = self._prepare(q, k, v, mask, options)
        return self._result(self._call(q, k, v, keywords), f"{self.func_name}()")

    def attention_vjp(self, q, k, v, d_out, *, mask=None, **options):
        """The backward pass by the framework's own differentiation (torch autograd,
        ``jax.vjp``) through the same call as ``attention``; a float mask is
        differentiated too when the backend declares ``grad_mask``."""
        self._refuse_undeclared(options, grad=True)
        _check_d_out(q, v, d_out)
        (q, k, v), keywords = self._prepare(q, k, v, mask, options)
        # Differentiated beside q, k, v, in the order SPEC §12.1 and §15.5 return them: a
        # float mask (with "grad_mask"), then the sinks.
        differentiated = []
        if "grad_mask" in self.capabilities and mask is not None and mask.dtype != np.bool_:
            differentiated.append(self.call.mask_float)
        if option_is_set("sinks", options.get("sinks")):
            differentiated.append(self.call.options["sinks"])
        primals = [q, k, v, *(keywords.pop(key) for key in differentiated)]

        def call(q, k, v, *rest):
            return self._call(q, k, v, {**keywords, **dict(zip(differentiated, rest))})

        grads = self.arrays.vjp(call, primals, self.from_numpy(d_out))
        # Autograd may hand back transposed views; the caller gets plain C-ordered arrays.
        return tuple(np.ascontiguousarray(self.to_numpy(g)) for g in grads)

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        """``attention_packed`` (SPEC §18) through the packed function, converted as
        ``attention`` is: the same layout and keywords, the boundaries as given."""
        keywords = self.call.keywords(self.func_name, options, self.arrays)
        out = self._call(q, k, v, keywords, cu_seqlens_q, cu_seqlens_k, func=self.packed)
        return self._an_array(out, f"{getattr(self.packed, '__name__', 'packed')}()")

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        keywords = self.call.keywords(self.func_name, options, self.arrays)

        def call(q, k, v):
            return self._call(q, k, v, keywords, cu_seqlens_q, cu_seqlens_k, func=self.packed)

        return self.arrays.vjp(call, [q, k, v], d_out)

    def versions(self) -> dict[str, str]:
        found = {**super().versions(), **self.arrays.version()}
        for package in self.libraries:
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                pass
        return found


def _check_d_out(q, v, d_out) -> None:
    """SPEC §12.1: a d_out not shaped like the output is refused here, in the contract's
    words, before the framework's differentiation sees it: the function has no d_out of its
    own to check, so an error raised inside autograd is not the function's."""
    if np.ndim(q) < 3 or np.ndim(v) < 3 or np.ndim(q) != np.ndim(v):
        return  # malformed inputs: refusing them is the function's part
    want = (*np.shape(q)[:-1], np.shape(v)[-1])
    letters = "(H, T, E)" if len(want) == 3 else "(B, H, T, E)"
    if tuple(np.shape(d_out)) != want:
        raise ValueError(
            f"d_out shape should be the output's {letters} = {want}, got {tuple(np.shape(d_out))}"
        )


#: The capability each optional spec option needs (SPEC §8.5): the vocabulary's table.
_CAPABILITY_OF = OPTION_CAPABILITIES

#: The keyword arguments a function needs for each capability it declares: the options that
#: need it, and dropout's seed.
_OPTIONS = {
    capability: tuple(o for o, c in OPTION_CAPABILITIES.items() if c == capability)
    + (("seed",) if capability == "dropout" else ())
    for capability in OPTION_CAPABILITIES.values()
}


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
        for option in _OPTIONS.get(cap, ()):
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


def _default_name(module: str, attr: str) -> str:
    return f"{module.rsplit('.', 1)[-1]}.{attr}"


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
) -> Backend:
    """The backend ``spec`` ('package.module:attr') names, not yet registered.

    A function is wrapped in ``FunctionBackend`` with ``capabilities`` (a list or a
    comma-separated string; "all" = every capability a function can have) and ``dtypes``
    ("all" = every dtype of the spec), taking ``framework``'s arrays ("numpy", "torch",
    "jax", or "auto": from the target's module) in ``layout`` ("BHTD" or "BTHD"); ``call``
    maps the spec's options to its keywords (a profile's, ``conformance.adapters.profiles``);
    ``packed`` ('package.module:attr') names the function for ``attention_packed``;
    ``causal`` ("keyword", "mask" or "none") and ``mask`` ("both", "additive" or
    "additive-min") say how causality and masks reach a function without a profile
    (``--impl-causal``, ``--impl-mask``), ``forms`` what it takes (a profile's). A
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
        if (
            caps
            or dts
            or framework != "numpy"
            or layout != "BHTD"
            or call is not None
            or packed is not None
            or causal is not None
            or mask is not None
        ):
            raise ValueError(
                f"--impl {spec!r} is a Backend, which declares its own capabilities and "
                "dtypes and converts its own arrays; --impl-capabilities, --impl-dtypes, "
                "--impl-framework, --impl-layout, --impl-causal, --impl-mask and profiles "
                "are for plain functions"
            )
        backend = target
        if name:
            backend.name = name
        elif not backend.name:
            backend.name = _default_name(spec.partition(":")[0], type(backend).__name__)
        return backend
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
    if dts == ["all"]:
        dts = list(DTYPES)
    unknown = sorted(set(caps or ()) - allowed)
    if unknown:
        raise ValueError(
            f"--impl-capabilities: unknown {unknown} for a {framework} function; known: "
            f"{', '.join(sorted(allowed))}"
        )
    bad = sorted(set(dts or ()) - set(DTYPES))
    if bad:
        raise ValueError(f"--impl-dtypes: unknown {bad}; known: {', '.join(DTYPES)}")
    call = call or _impl_call(layout, causal, mask)
    _check_keywords(spec, target, caps or (), call)
    try:
        return FunctionBackend(
            target,
            name=name or _default_name(spec.partition(":")[0], spec.partition(":")[2]),
            capabilities=caps or (),
            dtypes=dts or ("float64", "float32"),
            framework=framework,
            call=call,
            libraries=libraries,
            jit=jit,
            packed=None if packed is None else import_target(packed),
            forms=forms,
        )
    except LookupError as err:  # the framework is not installed
        raise ImplUnavailable(f"--impl {spec!r}: {err}") from err


#: ``--impl-mask``: the mask keywords of a function without a profile, and what an additive
#: mask holds on a blocked key.
IMPL_MASKS = {
    "both": {"mask_bool": "mask", "mask_float": "mask"},
    "additive": {"mask_bool": None, "mask_float": "mask", "blocked": "-inf"},
    "additive-min": {"mask_bool": None, "mask_float": "mask", "blocked": "min"},
}
IMPL_CAUSALITY = ("keyword", "mask", "none")


def _impl_call(layout: str, causal: str | None, mask: str | None) -> OptionMap:
    """The ``OptionMap`` of an ``--impl`` function: the spec's keywords, but for what
    ``causal`` ("mask": is_causal, causal_alignment, window and chunk_size are built into
    the mask; "none": no is_causal) and ``mask`` (``IMPL_MASKS``) leave out."""
    causal, mask = causal or "keyword", mask or "both"
    if causal not in IMPL_CAUSALITY:
        raise ValueError(f"--impl-causal {causal!r} is unknown; known: {', '.join(IMPL_CAUSALITY)}")
    if mask not in IMPL_MASKS:
        raise ValueError(f"--impl-mask {mask!r} is unknown; known: {', '.join(IMPL_MASKS)}")
    gone = {"mask": MASK_OPTIONS, "none": ("is_causal",)}.get(causal, ())
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
) -> Backend:
    """Import the implementation ``spec`` names, register it and return it loaded (a
    profile is loaded by ``conformance.adapters.profiles.load_profile``).

    Arguments as for ``resolve_impl``. Afterwards ``load_backend(backend.name)`` returns
    the same object, and the suite's ``--backend`` accepts the name.
    """
    if spec is None:
        raise ValueError("load_impl needs a spec ('package.module:function') or a profile")
    backend = resolve_impl(
        spec,
        name=name,
        capabilities=capabilities,
        dtypes=dtypes,
        framework=framework,
        layout=layout,
        causal=causal,
        mask=mask,
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
    }
    return register_loaded(backend, loader)


def register_loaded(backend: Backend, loader: dict) -> Backend:
    """Register ``backend`` under its name, remember how ``loader`` rebuilds it (for the
    replay snippets), and return it loaded."""
    # Loading the same impl again (a replay in the process that recorded it) replaces it.
    register_backend(backend.name, lambda: backend, replace=backend.name in LOADERS)
    LOADERS[backend.name] = loader
    return load_backend(backend.name)
