"""A user's quantized attention function as a backend of SPEC §20, from its profile's
``[quantized]`` table.

    [quantized]
    formats = { q = ["float8_e4m3fn"], k = ["float8_e4m3fn"], v = ["float8_e4m3fn"] }
    granularities = { q = ["head"], k = ["head"], v = ["head"] }
    pipeline = "e4m3_unnormalized"         # float32 | e4m3_unnormalized | e4m3_normalized
    lift = 256                             # P · lift rounded (448: SageAttention's)
    tile = 128                             # keys per tile: P rounded at its running max
    accumulator = "float32"                # P·V summed in: float32 | float16 | bfloat16
    cast_rule = "saturate"                 # or "overflow"; with out_formats
    out_formats = []                       # ["float8_e4m3fn"]: takes out_descale
    descales = { q = "q_descale", k = "k_descale", v = "v_descale" }
    descale_form = "array"                 # "scalar": a Python float (FlashInfer's q_scale)
    options = { is_causal = "causal", scale = "softmax_scale" }  # out_descale = ..., with
                                           # out_formats (and out_format = ..., if taken)
    alignment = "bottom_right"             # its causality's alignment (FlashAttention's)
    window_sides = ["left"]                # with a window keyword: the sides it takes
    quantizes = false                      # true: it takes float32 q, k, v and quantizes
                                           # them itself (then no descales)

The suite makes the codes and the descales itself, in the formats and granularities
declared, and hands them to the function in its framework (torch float8 tensors, JAX
float8 arrays, ``ml_dtypes`` arrays for NumPy) and layout (BHTD or BTHD: FlashAttention-3
takes (B, T, H, D)), each descale under its keyword: an array of SPEC §20.2's shape
(FlashAttention-3's (B, K)), or a float for a per-tensor scale. The function returns out
in that layout, float32, or codes with ``out_descale``. Its profile's other keys (name,
target, framework, layout, requires, capabilities) are read as for any profile; the
backend runs §20 alone.

A function that quantizes its own inputs (``quantizes = true``: a Transformer Engine DPA
under an FP8 recipe, a module that computes its scales from the data) takes float32 q, k
and v, and ``block_size`` where it has that keyword; the suite cannot know its codes, so
it is judged on §20.4's no future leakage alone (``attention_self_quantized``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.backends import Backend
from conformance.vocabulary import QuantizedForm

QUANTIZED_KEYS = {
    "formats",
    "granularities",
    "pipeline",
    "cast_rule",
    "out_formats",
    "descales",
    "descale_form",
    "options",
    "alignment",
    "window_sides",
    "quantizes",
    "lift",
    "tile",
    "accumulator",
}
#: The options of ``attention`` a quantized function may take, by the spec's names, and
#: the output's descale and format (SPEC §20.5), with ``out_formats``.
QUANTIZED_OPTIONS = (
    "is_causal", "scale", "causal_alignment", "window", "softcap", "sinks",
    "out_descale", "out_format",
)  # fmt: skip


class QuantizedFunctionBackend(Backend):
    """A quantized attention function described by a profile (SPEC §20.7)."""

    dtypes = ("float32",)
    sections = ("20",)

    def __init__(
        self, func, *, name: str, framework: str, layout: str, caps, table: dict,
        device: str | None = None,
    ) -> None:  # fmt: skip
        where = f"profile {name!r} [quantized]"
        unknown = sorted(set(table) - QUANTIZED_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(QUANTIZED_KEYS)}")
        try:
            self.quantized = QuantizedForm(
                formats={r: tuple(table["formats"][r]) for r in "qkv"},
                granularities={r: tuple(table["granularities"][r]) for r in "qkv"},
                pipeline=table.get("pipeline", "e4m3_unnormalized"),
                out_formats=tuple(table.get("out_formats", ())),
                cast_rule=table.get("cast_rule", "saturate"),
                lift=table.get("lift"),
                tile=table.get("tile"),
                accumulator=table.get("accumulator", "float32"),
                quantizes=table.get("quantizes", False) is True,
            )
        except KeyError as err:
            raise ValueError(
                f"{where}: {err.args[0]!r} of q, k and v is required (with quantizes = true "
                "too: the formats and granularities it quantizes to)"
            ) from err
        self.quantizes = table.get("quantizes", False)
        if not isinstance(self.quantizes, bool):
            raise ValueError(f"{where}: quantizes should be true or false, got {self.quantizes!r}")
        self.descales = dict(table.get("descales", {}))
        if set(self.descales) != {"q", "k", "v"} and not self.quantizes:
            raise ValueError(f"{where}: descales should name the keyword of q, k and v")
        self.descale_form = table.get("descale_form", "array")
        if self.descale_form not in ("array", "scalar"):
            raise ValueError(
                f"{where}: descale_form should be 'array' or 'scalar', got {self.descale_form!r}"
            )
        self.keywords = dict(table.get("options", {}))
        bad = sorted(set(self.keywords) - set(QUANTIZED_OPTIONS))
        if bad:
            raise ValueError(f"{where}: options names {bad}; known: {QUANTIZED_OPTIONS}")
        if self.quantized.out_formats and "out_descale" not in self.keywords:
            raise ValueError(
                f"{where}: out_formats needs the keyword that takes the output's descale, "
                "options = { out_descale = ... } (and out_format's, where it takes one)"
            )
        if layout not in ("BHTD", "BTHD"):
            raise ValueError(f"{where}: layout should be BHTD or BTHD, got {layout!r}")
        self.alignment = table.get("alignment", "top_left")
        if self.alignment not in ("top_left", "bottom_right"):
            raise ValueError(f"{where}: alignment should be top_left or bottom_right")
        self.func, self.name, self.framework, self.layout = func, name, framework, layout
        #: Where the function runs (SPEC §13.20): the framework's device, or None for its
        #: default; its inputs are placed there and its output read back to the host.
        self.device = _device(framework, device)
        self.capabilities = frozenset({"quantized", *caps})
        #: What the function takes (the suite skips a test needing anything else, by name);
        #: causality in its one alignment, which is then not passed on.
        self.takes = {*self.keywords, "causal_alignment"} - (
            set() if "is_causal" in self.keywords else {"causal_alignment"}
        )
        sides = tuple(table.get("window_sides", ("left", "right")))
        if set(sides) - {"left", "right"}:
            raise ValueError(f"{where}: window_sides should be among left, right, got {sides}")
        # A function without a causal keyword is non-causal, one with it takes both.
        forms = {"causal": "is_causal", "scale": "scale"}
        self.forms = (
            frozenset(f for f, o in forms.items() if o in self.keywords)
            | {"non_causal"}
            | ({"causal_top_left"} if self.alignment == "top_left" else set())
            | ({"window_right"} if "window" in self.keywords and "right" in sides else set())
        )

    def _attention_quantized(self, q, k, v, *, out_format=None, **options):
        kwargs: dict[str, Any] = {}
        for role in "qkv":
            d = np.asarray(options.pop(f"{role}_descale"))
            if self.descale_form == "scalar":
                if d.ndim:
                    raise ValueError(f"{self.name} takes a scalar {role} descale, got {d.shape}")
                kwargs[self.descales[role]] = float(d)
            else:
                kwargs[self.descales[role]] = self._array(d)
        block_size = options.pop("block_size", None)
        if block_size is not None:
            kwargs["block_size"] = block_size
        out_descale = options.pop("out_descale", None)
        if out_descale is not None:
            if "out_descale" not in self.keywords:
                raise NotImplementedError(f"{self.name} returns no FP8 output (no out_formats)")
            kwargs[self.keywords["out_descale"]] = float(out_descale)
            if "out_format" in self.keywords:
                kwargs[self.keywords["out_format"]] = out_format
        return self._call(q, k, v, kwargs, options)

    def attention_self_quantized(self, q, k, v, *, block_size=None, **options) -> np.ndarray:
        """A function that quantizes its own inputs (``quantizes = true``): q, k, v float32
        (B, H|K, T|S, D|E), ``block_size`` under that keyword where given, ``options`` by
        the profile's keywords; out (B, H, T, E)."""
        if not self.quantizes:
            raise NotImplementedError(f"{self.name} takes codes, not float inputs (§20.7)")
        kwargs = {} if block_size is None else {"block_size": block_size}
        return self._call(q, k, v, kwargs, options)

    def _call(self, q, k, v, kwargs: dict, options: dict) -> np.ndarray:
        """The function on q, k, v in its layout and framework, with ``kwargs`` and the
        spec's ``options`` under its keywords."""
        alignment = options.pop("causal_alignment", "top_left")
        # At T = S both alignments are the same call: only T ≠ S tells them apart.
        if options.get("is_causal") and alignment != self.alignment and _differ(q, k):
            raise NotImplementedError(f"{self.name} is causal {self.alignment} only")
        for option, value in options.items():
            if option not in self.keywords:
                raise NotImplementedError(f"{self.name} takes no {option} (its profile's options)")
            kwargs[self.keywords[option]] = self._array(value) if option == "sinks" else value
        q, k, v = (self._array(self._laid_out(x)) for x in (q, k, v))
        return self._laid_out(self._numpy(self.func(q, k, v, **kwargs)))

    def _laid_out(self, x: np.ndarray) -> np.ndarray:
        """BTHD ↔ BHTD: the same swap both ways."""
        return np.swapaxes(x, 1, 2) if self.layout == "BTHD" else x

    def _array(self, x):
        x = np.ascontiguousarray(x) if np.ndim(x) else np.asarray(x)
        if self.framework == "torch":
            import torch

            if x.dtype.name.startswith("float8"):
                t = torch.from_numpy(x.view(np.uint8)).view(getattr(torch, x.dtype.name))
            else:
                t = torch.from_numpy(x)
            return t if self.device is None else t.to(self.device)
        if self.framework == "jax":
            import jax

            # Committed to the device where one is named: a jitted function runs there.
            return jax.device_put(x, self.device)
        return x

    def _numpy(self, out) -> np.ndarray:
        if self.framework != "torch":
            return np.asarray(out)
        import torch

        out = out.detach().cpu()
        if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            import ml_dtypes

            fmt = str(out.dtype).removeprefix("torch.")
            return out.view(torch.uint8).numpy().view(getattr(ml_dtypes, fmt))
        return out.numpy()


def _differ(q, k) -> bool:
    """Whether q's T and k's S (B, H|K, T|S, ·) differ: where the causal alignments do."""
    return np.shape(q)[-2] != np.shape(k)[-2]


def _device(framework: str, device: str | None) -> Any:
    """``device`` in ``framework``'s own terms (SPEC §13.20), or None where none is named:
    a spelling the framework does not know is a ValueError, a device this machine lacks a
    LookupError, each naming it (a profile's ``resolve`` has checked both already)."""
    if not device:
        return None
    from conformance.backends.arrays import make_framework

    # No float64 switched on for a look at the devices.
    settings = {"float64": False} if framework == "jax" else {}
    return make_framework(framework, device=device, **settings).device
