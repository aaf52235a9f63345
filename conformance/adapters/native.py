"""Native calls: a library's own attention function, called the way its users call it.

The suite speaks NumPy, heads-first (q (B, H, T, D), k (B, K, S, D), v (B, K, S, E)) and
the spec's option names. A library function speaks its framework's arrays, often another
layout, and its own keywords. This module is the one place where a spec call becomes the
library's call and the result comes back, in four visible steps:

1. **mask** (NumPy, before anything else): a bool mask goes to the library's bool keyword,
   inverted if the library's True means "blocked"; a library that takes only an additive
   float mask gets ``where(mask, 0, blocked)`` in q's dtype, blocked being -inf or the
   dtype's finfo.min as the profile says. A float mask goes to its float keyword
   unchanged. For a library whose causality comes through the mask, causality (and a
   window and chunks it has no keyword for) are first built into the mask
   (``conformance.adapters.forms``). Any other mask (an integer one, which the spec refuses) is passed
   on as it is, to the bool keyword if there is one: refusing it is the library's job.
2. **arrays** (``Framework.from_numpy``): NumPy to the framework's arrays, dtype kept
   (float16 and bfloat16 stay what they are), on the device the function runs on
   (``--impl-device``, a profile's ``device``; SPEC §13.20): torch's ``.to(device)``,
   ``jax.device_put(x, device)``, committed there, so that a jitted function and its
   gradient run there too. The output comes back the same way (``to_numpy``: torch's
   ``.cpu()``, JAX's ``np.asarray``); the oracle, the fixtures and the tolerance never
   see a device.
3. **layout** (in the framework, so that gradients flow through it): ``BTHD`` swaps the
   H and T axes of q, k, v (axes -3 and -2; T stands for S in k and v) and swaps them back
   in the output. The mask keeps the spec's (B, H, T, S) broadcasting. Arrays of rank
   below 3 (bad input) are passed as they are.
4. **keywords**: each spec option the caller set goes to the library keyword the
   profile names (``OptionMap``), the per-head arrays (``sinks``, ``alibi_slopes``) as
   the framework's arrays; fixed keywords (``enable_gqa=True``) are added. An
   option the caller set that the library has no keyword for raises
   ``NotImplementedError`` naming it: the test fails, it is never silently dropped.

Nothing here changes a number or fixes a behaviour: no NaN is cleaned, no fully masked
row is filled, no dtype is raised. What the library returns comes back as it is; only a
result that is not an array at all fails (an ``AssertionError`` naming the call), so that
it can never pass for the ``ValueError``/``TypeError`` a bad-input test waits for.

Frameworks are imported inside their class, when a backend is built.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conformance.adapters.forms import BLOCKED, CAUSALITY, blocked_value
from conformance.backends.arrays import (  # noqa: F401  (re-exported: native's arrays)
    FRAMEWORKS,
    Framework,
    JaxFramework,
    TorchFramework,
    make_framework,
)
from conformance.vocabulary import OPTION_DEFAULTS, option_is_set

#: The options of ``Backend.attention``, with the value that means "not set".
SPEC_OPTIONS = OPTION_DEFAULTS
LAYOUTS = ("BHTD", "BTHD")
#: When the scale keyword is passed (``OptionMap.scale``).
SCALE_PASSING = ("when_set", "always")
#: What True means in a library's bool mask.
BOOL_MEANINGS = ("attend", "blocked")
#: The options that are arrays (one value per query head): they go to the library as its
#: framework's arrays, are traced rather than static under ``jax.jit``, and ``sinks`` is
#: differentiated (SPEC §15.5).
ARRAY_OPTIONS = ("sinks", "alibi_slopes")


def framework_of(func: Callable) -> str:
    """``--impl-framework auto``: the framework ``func`` works on. A function of torch, jax
    or flax itself belongs to that framework (``torch.nn.functional`` -> torch,
    ``flax.nnx`` -> jax); a function of another module to the one framework that module
    imports (``import torch`` at its top); otherwise numpy."""
    packages = {"torch": "torch", "jax": "jax", "flax": "jax"}
    module_name = getattr(func, "__module__", None) or ""
    top = module_name.split(".", 1)[0]
    if top in packages:
        return packages[top]
    module = sys.modules.get(module_name)
    imported = (
        {
            packages[value.__name__.split(".", 1)[0]]
            for value in vars(module).values()
            if isinstance(value, types.ModuleType) and value.__name__.split(".", 1)[0] in packages
        }
        if module is not None
        else set()
    )
    return imported.pop() if len(imported) == 1 else "numpy"


@dataclass(frozen=True)
class OptionMap:
    """How a spec call becomes the library's call.

    Attributes:
      options: spec option -> the library's keyword (``SPEC_OPTIONS``). Options missing
        here are not passed; setting one is a ``NotImplementedError``. ``seed`` may be
        ``"global"``: the framework's global generator is seeded before the call.
      mask_bool: the keyword for a bool mask, or None: bool masks go to ``mask_float`` as
        an additive 0 / -inf mask in q's dtype.
      bool_true: what True means to the library: "attend" (the spec's) or "blocked".
      mask_float: the keyword for an additive float mask, or None (refused: setting one
        raises ``NotImplementedError``).
      fixed: keywords passed on every call, as they are.
      layout: "BHTD" (the spec's) or "BTHD".
      causal: how ``is_causal`` reaches the library (``forms.CAUSALITY``): its keyword
        (``options["is_causal"]``), "mask" (built into the mask, with the alignment, and a
        window and chunks that have no keyword), "none", or "only" (a causal-only kernel:
        is_causal=True is what it always does, and any other call is refused).
      blocked: an additive mask's entry for a blocked key: "-inf" or "min" (finfo.min).
      scale: when the scale keyword is passed: "when_set" (a call that sets it) or
        "always" (a kernel whose own default is not the spec's, such as an ``sm_scale``
        of 1.0, or that requires one: a call without a scale passes 1/sqrt(D)).
    """

    options: Mapping[str, str] = field(
        default_factory=lambda: {name: name for name in SPEC_OPTIONS}
    )
    mask_bool: str | None = "mask"
    bool_true: str = "attend"
    mask_float: str | None = "mask"
    fixed: Mapping[str, Any] = field(default_factory=dict)
    layout: str = "BHTD"
    causal: str = "keyword"
    blocked: str = "-inf"
    scale: str = "when_set"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.options) - set(SPEC_OPTIONS))
        if unknown:
            raise ValueError(
                f"options: unknown spec options {unknown}; known: {', '.join(SPEC_OPTIONS)}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout should be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.bool_true not in BOOL_MEANINGS:
            raise ValueError(
                f"bool_true should be one of {', '.join(BOOL_MEANINGS)}, got {self.bool_true!r}"
            )
        if self.causal not in CAUSALITY:
            raise ValueError(f"causal should be one of {', '.join(CAUSALITY)}, got {self.causal!r}")
        if self.blocked not in BLOCKED:
            raise ValueError(f"blocked should be one of {', '.join(BLOCKED)}, got {self.blocked!r}")
        if self.causal == "only" and "is_causal" in self.options:
            raise ValueError(
                "causal = 'only' is a function with no is_causal keyword (fix its own causal "
                "keyword in fixed), but options maps one"
            )
        if self.causal == "keyword" and "is_causal" not in self.options:
            raise ValueError("causal = 'keyword' needs a keyword for is_causal in options")
        if self.causal == "mask" and self.mask_bool is None and self.mask_float is None:
            raise ValueError("causal = 'mask' needs a mask keyword (bool or float)")
        if self.scale not in SCALE_PASSING:
            raise ValueError(
                f"scale should be one of {', '.join(SCALE_PASSING)}, got {self.scale!r}"
            )
        if self.scale == "always" and "scale" not in self.options:
            raise ValueError("scale = 'always' needs a keyword for scale in options")

    def with_scale(self, options: Mapping[str, Any], q: Any) -> Mapping[str, Any]:
        """``options`` with the spec's default scale, 1/sqrt(D) of q's last axis, where the
        kernel is always passed one and the call sets none (D = 0, or q with no axis:
        bad input or an empty head, passed on as it is)."""
        D = np.shape(q)[-1] if np.ndim(q) else 0
        if self.scale != "always" or option_is_set("scale", options.get("scale")) or not D:
            return options
        return {**options, "scale": 1.0 / math.sqrt(D)}

    def static_keywords(self, func: Callable) -> list[str]:
        """The keywords that are options, not arrays (everything but the mask), among
        those ``func`` takes: what ``jax.jit`` treats as static."""
        arrays = {self.mask_bool, self.mask_float, self.options.get("seed")}  # a seed is a key
        arrays |= {self.options.get(option) for option in ARRAY_OPTIONS}
        names = {*self.options.values(), *self.fixed} - arrays
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):
            return sorted(names)
        return sorted(n for n in names if n in params)

    def keywords(self, func_name: str, options: Mapping[str, Any], framework: Framework) -> dict:
        """The library's keywords for the spec options the caller set (step 4)."""
        found = dict(self.fixed)
        if self.causal == "only" and not _is_true(options.get("is_causal")):
            raise NotImplementedError(
                f"{func_name} is causal only (its profile): a call without is_causal=True "
                "has no meaning for it"
            )
        for option, value in options.items():
            if option == "is_causal" and self.causal == "only":
                continue  # what the function always does
            if option == "mask" or (option in SPEC_OPTIONS and not option_is_set(option, value)):
                continue
            keyword = self.options.get(option)
            if keyword is None:
                raise NotImplementedError(
                    f"{func_name} has no keyword for the spec's {option}={value!r} "
                    "(its profile maps none)"
                )
            if option == "seed":
                if keyword == "global":
                    framework.seed(value)
                    continue
                value = framework.key(value)
            elif option in ARRAY_OPTIONS:
                value = framework.from_numpy(np.asarray(value))
            found[keyword] = value
        return found

    def mask(self, func_name: str, mask: np.ndarray | None, dtype: np.dtype) -> dict:
        """The library's mask keyword and value for a spec mask (step 1, in NumPy)."""
        if mask is None:
            return {}
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            if self.mask_bool is not None:
                return {self.mask_bool: ~mask if self.bool_true == "blocked" else mask}
            if self.mask_float is not None:
                blocked = blocked_value(self.blocked, np.dtype(dtype))
                additive = np.where(mask, 0.0, blocked).astype(dtype)  # (..., T, S)
                return {self.mask_float: additive}
        elif np.issubdtype(mask.dtype, np.floating) or mask.dtype.name == "bfloat16":
            if self.mask_float is not None:
                return {self.mask_float: mask}
        else:
            keyword = self.mask_bool or self.mask_float
            if keyword is not None:
                return {keyword: mask}
        raise NotImplementedError(f"{func_name} takes no {mask.dtype.name} mask (its profile)")


def _is_true(value: Any) -> bool:
    """Whether ``value`` is the bool True (Python's or NumPy's), not merely truthy."""
    return isinstance(value, (bool, np.bool_)) and bool(value)
