"""A library's attention function (or yours) called as its users call it, as a backend.

``FunctionBackend`` wraps one function: it turns the suite's NumPy arrays into the
function's framework and layout (``native.py``), maps the spec's options onto its keywords
(a profile's ``[options]``), builds causality into its mask where it takes it that way
(``forms.py``), refuses by name what the function did not declare (SPEC §8.5), and
differentiates it with its framework's autograd where it declares ``grad``. ``impl.py``
makes one from ``--impl`` and a profile.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from conformance.adapters.domain import Domain
from conformance.adapters.forms import MASK_OPTIONS, declared_forms, through_the_mask
from conformance.adapters.lse import LseForm
from conformance.adapters.native import OptionMap, make_framework
from conformance.backends import ALL_CAPABILITIES, Backend
from conformance.vocabulary import OPTION_CAPABILITIES, VARIANT_CAPABILITIES, option_is_set

#: What a function may declare it computes float32 matmuls in (SPEC §13.20).
FLOAT32_MATMULS = ("float32", "tf32")

#: What a plain function can declare: everything but the module layers, which a single
#: attention function does not provide ("all" on the command line means these).
FUNCTION_CAPABILITIES = ALL_CAPABILITIES - {"module"}
#: The variants a function declares one by one, as keywords of ``attention`` (SPEC §15-§17),
#: or, for "packed", with a second function for ``attention_packed`` (a profile's
#: ``packed``, §13.12). "paged" needs a Backend subclass.
FUNCTION_VARIANTS = VARIANT_CAPABILITIES - {"paged"}


#: The capability each optional spec option needs (SPEC §8.5): the vocabulary's table.
_CAPABILITY_OF = OPTION_CAPABILITIES

#: The keyword arguments a function needs for each capability it declares: the options that
#: need it, and dropout's seed.
KEYWORDS_OF = {
    capability: tuple(o for o, c in OPTION_CAPABILITIES.items() if c == capability)
    + (("seed",) if capability == "dropout" else ())
    for capability in OPTION_CAPABILITIES.values()
}


def default_name(module: str, attr: str) -> str:
    return f"{module.rsplit('.', 1)[-1]}.{attr}"


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
      forms: the forms of causality, window, scale and masks ``func`` takes
        (``conformance.adapters.forms``); default: those ``call`` gives it.
      domain: the shapes ``func`` accepts (``conformance.adapters.domain``); default all.
      interpreter: the interpreter ``func`` runs under on the CPU (Pallas' interpret mode,
        ``TRITON_INTERPRET=1``), in words, or "" for none.
      lse: where ``func``'s result holds its log-sum-exp (``conformance.adapters.lse``);
        needed to declare "lse" (SPEC §21), given only with it.
      device: where ``func`` runs (SPEC §13.20), in its framework's spelling ("cuda",
        "cuda:1", "gpu", "tpu", "cpu"): its inputs are placed there and its outputs brought
        back (``conformance.adapters.native``, step 2); None: the framework's default.
      float32_matmul: what the function computes float32 matmuls in, as its profile
        declares (SPEC §13.20): "float32", the spec's, or "tf32" (a 10-bit mantissa); the
        run's summary shows it beside the framework's settings.
      assumed: what was taken from ``func``'s signature rather than declared, in words
        (a plain ``--impl`` without a ``mask`` parameter is called with none); the run's
        summary shows each.
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
        domain: Domain | None = None,
        interpreter: str = "",
        lse: LseForm | None = None,
        device: str | None = None,
        float32_matmul: str = "float32",
        assumed: Iterable[str] = (),
    ) -> None:
        self.func = func
        self.assumed = tuple(assumed)
        self.lse = lse
        self.packed = packed
        self.name = name or default_name(func.__module__, func.__name__)
        self.capabilities = frozenset(capabilities)
        self.dtypes = tuple(dtypes)
        # JAX's float64 (a setting of the whole process) only where the function needs it.
        self.arrays = make_framework(
            framework,
            device=device,
            **(
                {"float64": "float64" in self.dtypes, "why": f"{self.name} declares float64"}
                if framework == "jax"
                else {}
            ),
        )
        #: Where the function runs, as its profile (or ``--impl-device``) spells it.
        self.device = device
        if float32_matmul not in FLOAT32_MATMULS:
            raise ValueError(
                f"float32_matmul should be one of {', '.join(FLOAT32_MATMULS)}, got "
                f"{float32_matmul!r}"
            )
        self.float32_matmul = float32_matmul
        self.framework = self.arrays.name
        self.call = call or OptionMap()
        self.libraries = tuple(libraries)
        # Messages name the function as its profile (or --impl) names it: an adapter's own
        # name (``attend``, ``call``) tells a reader nothing about the library.
        self.func_name = name or getattr(func, "__qualname__", None) or repr(func)
        self.forms = frozenset(declared_forms(self.call) if forms is None else forms)
        self.domain = domain or Domain()
        self.interpreter = interpreter
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
        if ("lse" in self.capabilities) != (lse is not None):
            raise ValueError(
                f"{self.name}: declaring 'lse' needs where the result holds it (a profile's "
                f"[lse] table), and that is given only with it; capabilities "
                f"{sorted(self.capabilities)}, lse {lse!r}"
            )
        if "module" in self.capabilities:
            raise ValueError(
                f"{self.name}: a function cannot declare 'module' (it needs the multi-head "
                "layer and GPT block); subclass conformance.Backend instead"
            )

    #: A profile's merge function (``conformance.adapters.merge.MergeFunction``), or None.
    merge_function = None

    @property
    def merge_conversion(self):
        """The merge function's conversion of the lse (SPEC §22.12), None in base e."""
        form = self.merge_function
        return None if form is None or form.lse_base == "e" else form.conversion

    def _merge_states(self, o_a, lse_a, o_b, lse_b):
        # NumPy in and out: the merge function converts to the library's conventions.
        o_a, lse_a, o_b, lse_b = (self.to_numpy(x) for x in (o_a, lse_a, o_b, lse_b))
        if self.merge_function is None:
            raise NotImplementedError(f"{self.name} names no merge function (SPEC §22)")
        o, lse = self.merge_function(o_a, lse_a, o_b, lse_b)
        return self.from_numpy(o), self.from_numpy(lse)

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
        options = self.call.with_scale(options, q)
        keywords = {
            **self.call.keywords(self.func_name, options, self.arrays),
            **{
                key: self.from_numpy(m)
                for key, m in self.call.mask(self.func_name, mask, np.asarray(q).dtype).items()
            },
        }
        return [self.from_numpy(x) for x in (q, k, v)], keywords

    def _call(self, q, k, v, keywords: dict, *boundaries, func=None, lse=False) -> Any:
        """Step 3: the layout on the way in and out, around the library's call (``func``,
        by default the attention function; the packed one with the boundaries). With
        ``lse`` (the spec asked for it), (out, lse as the function returned it)."""
        swap = self.call.layout == "BTHD"
        if swap:
            q, k, v = (self.arrays.swap_heads_and_time(x) if x.ndim >= 3 else x for x in (q, k, v))
        if lse and self.lse.keyword is not None:
            keywords = {**keywords, self.lse.keyword: True}
        # The call as the function receives it, for a failure's replay to show.
        self.received = (func or self.func, (q, k, v, *boundaries), keywords)
        out = (func or self.func)(q, k, v, *boundaries, **keywords)
        found = None
        if self.lse is not None and func is None:
            # A function that returns its lse beside the output (SPEC §21).
            out, found = self.lse.split(out, lse, self.func_name)
        if swap and getattr(out, "ndim", 0) >= 3:
            out = self.arrays.swap_heads_and_time(out)
        return (out, found) if lse else out

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

    def attention(self, q, k, v, *, mask=None, return_lse=False, **options):
        """out (B, H, T, E) for q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), NumPy in and
        out: the library's call in between (``conformance.adapters.native``). With
        ``return_lse`` (capability "lse", SPEC §21), (out, lse (B, H, T)), the lse read
        where the profile's [lse] table says, in the spec's layout and the natural log."""
        if return_lse:
            self._refuse_unless_declared("lse", "return_lse", "§21", lambda: None)
        self._refuse_undeclared(options)
        with self.arrays.scope():
            (q, k, v), keywords = self._prepare(q, k, v, mask, options)
            if not return_lse:
                return self._result(self._call(q, k, v, keywords), f"{self.func_name}()")
            out, lse = self._call(q, k, v, keywords, lse=True)
            out = self._result(out, f"{self.func_name}()")
            return out, self.lse.to_spec(self._result(lse, f"{self.func_name}()'s lse"))

    def attention_vjp(self, q, k, v, d_out, *, mask=None, **options):
        """The backward pass by the framework's own differentiation (torch autograd,
        ``jax.vjp``) through the same call as ``attention``; a float mask is
        differentiated too when the backend declares ``grad_mask``."""
        self._refuse_undeclared(options, grad=True)
        _check_d_out(q, v, d_out)
        with self.arrays.scope():
            return self._vjp(q, k, v, d_out, mask, options)

    def _vjp(self, q, k, v, d_out, mask, options) -> tuple:
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
        options = self.call.with_scale(options, q)
        keywords = self.call.keywords(self.func_name, options, self.arrays)
        out = self._call(q, k, v, keywords, cu_seqlens_q, cu_seqlens_k, func=self.packed)
        return self._an_array(out, f"{getattr(self.packed, '__name__', 'packed')}()")

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        options = self.call.with_scale(options, q)
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
