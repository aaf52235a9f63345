"""Profiles: one small TOML file per library function, so the whole spec runs on it.

    pytest conformance --impl-profile torch.sdpa           # a shipped profile, by name
    pytest conformance --impl-profile all                  # every shipped profile
    pytest conformance --impl-profile path/to/mine.toml    # your own

A profile is data only (SPEC §13.10): the target ``module:function`` (or a thin adapter
module in this folder when the library cannot be called with arrays: ONNX, flex
attention), its framework and layout, which keyword takes each spec option, the mask's
convention, keywords fixed on every call, the capabilities and dtypes it has, the
distributions it needs, and its known failures, each with the reason in words. The
conversion itself is ``conformance/adapters/native.py``; a profile only says what to convert.

    name = "torch.sdpa"
    target = "torch.nn.functional:scaled_dot_product_attention"
    framework = "torch"                      # numpy | torch | jax
    layout = "BHTD"                          # or BTHD
    requires = ["torch"]                     # distributions; missing -> skipped by name
    jit = false                              # JAX: compile with jax.jit, options static
    # packed = "module:function"             # attention_packed (SPEC §18), with "packed"
    needs = []                               # hardware: ["cuda"]; skipped by name without
    probe = ""                               # "module:function": None, or why not (measured)
    interpreter = ""                         # on the CPU: triton, pallas, pallas-tpu or words
    device = ""                              # where it runs (SPEC §13.20): cuda, cuda:N,
                                             # gpu, tpu, cpu; missing here -> skipped by name
    float32_matmul = "float32"               # or "tf32": what its float32 matmuls use
    # [lse]                                  # with "lse" (SPEC §21): index = 1 or key =
                                             # "lse", out = 0, keyword, layout, base
    capabilities = ["unbatched", "gqa", "dropout", "grad", "grad_mask"]
    dtypes = ["float64", "float32", "float16", "bfloat16"]

    [options]                                # spec option = the library's keyword
    is_causal = "is_causal"
    scale = "scale"
    dropout_p = "dropout_p"
    seed = "global"                          # torch.manual_seed(seed) before the call

    [mask]
    bool = "attn_mask"                       # keyword for a bool mask (false: none)
    bool_true = "attend"                     # or "blocked": inverted on the way in
    float = "attn_mask"                      # keyword for an additive float mask
    blocked = "-inf"                         # an additive mask's blocked key: or "min"

    [forms]                                  # what it takes of the core (SPEC §13.17)
    causal = "keyword"                       # or "mask" (built into the mask), "none",
                                             # "only" (causal only, no keyword)
    masks = ["bool", "float"]                # the masks it takes ([]: none; default: those
                                             # [mask] has a keyword for)
    alignments = ["top_left", "bottom_right"]  # a KV-cache operator: ["bottom_right"]
    window_sides = ["left", "right"]         # a window with no right side: ["left"]
    scale = true                             # false: no scale keyword

    [fixed]                                  # passed on every call
    enable_gqa = true

    [call]                                   # how the adapter calls it
    scale = "when_set"                       # "always": scale=None passes 1/sqrt(D)

    [domain]                                 # the shapes it accepts (SPEC §13.19)
    head_dims = [16, 32, 64]                 # or { min = 16, max = 256, multiple = 16 }
    s_multiple = 16                          # also t_multiple, min_t, min_s, square
    [domain.backward]                        # where the backward's limits differ
    s_multiple = 128

    [run]                                    # a function compiled per shape: the tests
    tests = ["test_fixture_case[*-float32]"] # of its default run, ids as known failures
                                             # write them (every test: --every-test)

    [processor_dependent]                    # fails on some processors, not others
    "test_nan_propagates[torch.sdpa-float64-plain-q]" = "a NaN in the inputs becomes ..."

    [varies_between_runs]                    # fails one run, not another: the cause,
    "test_empty_sequences[*-S0-*]" = "returns its output buffer unwritten; ..."  # then what it shows

    [known_failures]                         # test id (* matches anything) = reason
    "test_bad_input[torch.sdpa-integer-mask]" = "SPEC §3.3: ... raises RuntimeError"

Known failures are strict expected failures: a library that fixes one shows up as
``XPASS(strict)``, and a pattern that matches no test as a ``StaleKnownFailure``.
Processor-dependent entries are for behaviour measured to differ between processors
(with the measurement in a comment): such a test may fail or pass (a non-strict xfail,
reason "on some processors: ..."), and ``python -m conformance frameworks`` lists it
apart from the ✅/❌ table, the same wherever it runs. Entries that vary between runs on
one processor (an output read from memory the function never wrote) are the same, under
their own label (reason "varies from run to run: ..."): the cause first, then, after
"; ", each behaviour a run showed, so that a run showing another one fails ``--check``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from conformance.adapters.domain import Domain
from conformance.adapters.impl import (
    ImplUnavailable,
    import_target,
    register_loaded,
    resolve_impl,
)
from conformance.adapters.lse import LseForm
from conformance.adapters.merge import MergeOnlyBackend, with_merge
from conformance.adapters.native import OptionMap, make_framework
from conformance.adapters.profiles.parse import (  # noqa: F401 - the [forms] names, re-exported
    ALIGNMENTS,
    FORMS_KEYS,
    KEYS,
    WINDOW_SIDES,
    ProfileError,
    call_and_forms,
    profile_fields,
)
from conformance.backends import Backend, register_backend

#: Where the shipped profiles live: ``<name>.toml``, adapters beside them.
HERE = Path(__file__).resolve().parent


def shipped_profiles() -> list[str]:
    """The names of the profiles shipped in this folder."""
    return sorted(path.stem for path in HERE.glob("*.toml"))


#: The device profiles (SPEC §13.20), in ``gpu/``: apart from ``all``, whose table is the
#: CPU's, and run by ``--impl-profile all-gpu``; each is skipped by name without its device.
GPU = HERE / "gpu"


def gpu_profiles() -> list[str]:
    """The names of the shipped device profiles, as ``read_profile`` takes them."""
    return sorted(f"gpu/{path.stem}" for path in GPU.glob("*.toml"))


@dataclass(frozen=True)
class Profile:
    """A library function as a profile describes it (the TOML's keys, checked)."""

    name: str
    target: str
    path: Path
    framework: str = "numpy"
    layout: str = "BHTD"
    description: str = ""
    requires: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float64", "float32")
    call: OptionMap = field(default_factory=OptionMap)
    known_failures: dict[str, str] = field(default_factory=dict)
    processor_dependent: dict[str, str] = field(default_factory=dict)
    varies_between_runs: dict[str, str] = field(default_factory=dict)
    jit: bool = False
    needs: tuple[str, ...] = ()
    probe: str = ""
    packed: str | None = None
    forms: frozenset[str] | None = None
    #: The [quantized] table: a quantized function, run on SPEC §20 alone.
    quantized: dict | None = None
    domain: Domain = field(default_factory=Domain)
    interpreter: str = ""
    #: The [lse] table: where the function's result holds its log-sum-exp (SPEC §21).
    lse: LseForm | None = None
    #: The [merge] table (``conformance.adapters.merge``): the merge function, SPEC §22.
    merge: dict | None = None
    #: Where the function runs (SPEC §13.20), in its framework's spelling; "" the default.
    device: str = ""
    #: What it computes float32 matmuls in (SPEC §13.20): "float32" or "tf32".
    float32_matmul: str = "float32"
    #: [run] tests: the tests of its default run, as known-failure ids (``*`` matches
    #: anything; none: every test); a function that compiles each signature would take
    #: hours on the whole spec.
    tests: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        """The distributions in ``requires`` that are not installed here."""
        return [p for p in self.requires if importlib.util.find_spec(_module_of(p)) is None]

    def unavailable(self) -> str | None:
        """Why the function cannot run here (a distribution missing, or the hardware that
        ``needs`` names, as the ``probe`` measured it), or None."""
        missing = self.missing()
        if missing:
            return f"{', '.join(missing)} not installed here (pip install {' '.join(missing)})"
        return self._hardware_missing() or self._device_missing()

    def _device_missing(self) -> str | None:
        """Why ``device`` is not here (the framework's own words), or None."""
        if not self.device:
            return None
        try:
            # No float64 switched on for a look at the devices.
            make_framework(self.framework, device=self.device,
                           **({"float64": False} if self.framework == "jax" else {}))  # fmt: skip
        except LookupError as err:
            return str(err)
        return None

    def _hardware_missing(self) -> str | None:
        """What the ``probe`` measured, when the hardware ``needs`` names is missing."""
        if not self.probe:
            return None
        why = import_target(self.probe)()
        return None if why is None else f"needs {', '.join(self.needs)}: {why}"

    def resolve(self) -> Backend:
        """The backend, not yet registered (``impl.resolve_impl`` with this profile).

        Raises:
          ProfileError: a required distribution is not installed, or the target or
            framework cannot be found.
        """
        missing = self.missing()
        if missing:
            raise ProfileError(
                f"profile {self.name!r} ({self.path}) needs {', '.join(missing)}, not "
                f"installed here (pip install {' '.join(missing)}); profiles whose libraries "
                f"are installed: {installed_profiles()}"
            )
        why = self._hardware_missing() or self._device_missing()
        if why:
            raise ProfileError(f"profile {self.name!r} ({self.path}) cannot run here: {why}")
        if self.quantized is not None:
            return self._quantized_backend()
        if not self.target:
            return self._merge_backend()
        try:
            return with_merge(resolve_impl(
                self.target,
                name=self.name,
                capabilities=list(self.capabilities),
                dtypes=list(self.dtypes),
                framework=self.framework,
                layout=self.layout,
                call=self.call,
                libraries=self.requires,
                jit=self.jit,
                packed=self.packed,
                forms=self.forms,
                domain=self.domain,
                interpreter=self.interpreter,
                lse=self.lse,
                device=self.device or None,
                float32_matmul=self.float32_matmul,
            ), self.merge, self.layout)  # fmt: skip
        except (ImplUnavailable, ValueError) as err:
            raise ProfileError(f"profile {self.name!r} ({self.path}): {err}") from err

    def _quantized_backend(self) -> Backend:
        """The function of a [quantized] profile (``conformance.adapters.quantized``)."""
        from conformance.adapters.quantized import QuantizedFunctionBackend

        try:
            return QuantizedFunctionBackend(
                import_target(self.target), name=self.name, framework=self.framework,
                layout=self.layout, caps=self.capabilities, table=self.quantized,
                device=self.device or None,
            )  # fmt: skip
        except (ImplUnavailable, ValueError) as err:
            raise ProfileError(f"profile {self.name!r} ({self.path}): {err}") from err

    def _merge_backend(self) -> Backend:
        """The merge function of a merge-only profile (``conformance.adapters.merge``)."""
        try:
            return MergeOnlyBackend(
                self.merge, name=self.name, framework=self.framework, layout=self.layout,
                capabilities=self.capabilities, dtypes=self.dtypes,
            )  # fmt: skip
        except (ImplUnavailable, ValueError) as err:
            raise ProfileError(f"profile {self.name!r} ({self.path}): {err}") from err


#: Distributions whose import name is not their own name.
IMPORT_NAMES = {"paddlepaddle": "paddle"}


def _module_of(distribution: str) -> str:
    """The import name of a distribution in ``requires`` (onnxruntime, torch, ...)."""
    return IMPORT_NAMES.get(distribution, distribution.replace("-", "_"))


def installed_profiles() -> list[str]:
    """The shipped profiles whose libraries are installed here."""
    return [n for n in shipped_profiles() if not read_profile(n).missing()]


def read_profile(name_or_path: str | Path) -> Profile:
    """The profile called ``name_or_path`` (a shipped one) or stored at that path.

    Raises:
      ProfileError: no such profile, or the file is not a valid profile (the message says
        which key is wrong and what is allowed).
    """
    path = Path(name_or_path)
    if not path.is_file():
        path = HERE / f"{name_or_path}.toml"
    if not path.is_file():
        raise ProfileError(
            f"no profile {str(name_or_path)!r}: neither a file nor a shipped profile; shipped: "
            f"{', '.join(shipped_profiles())}"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"{path}: not valid TOML: {err}") from err
    return parse_profile(data, path)


def parse_profile(data: dict[str, Any], path: Path) -> Profile:
    """Check a profile's keys and build the ``Profile`` (``parse.profile_fields``)."""
    return Profile(**profile_fields(data, path))


def load_profiles(names: Iterable[str]) -> tuple[list[Profile], list[Profile]]:
    """Register the profiles ``names`` (``all``: every shipped one; ``all-gpu``: every
    shipped device profile) as backends.

    Returns (loaded, unavailable). A profile named explicitly must load; under ``all`` or
    ``all-gpu``,
    one whose library is not installed here is registered as ``MissingLibrary`` (its
    tests are skipped by name, ``skip_reason``), never left out in silence.

    Raises:
      ProfileError: a named profile is missing, malformed, or its library or target is.
    """
    loaded, unavailable = [], []
    for value in names:
        every = value in ("all", "all-gpu")
        chosen = {"all": shipped_profiles, "all-gpu": gpu_profiles}.get(value)
        for name in chosen() if chosen else [value]:
            profile = read_profile(name)
            if every and profile.unavailable():
                register_backend(profile.name, lambda p=profile: MissingLibrary(p), replace=True)
                unavailable.append(profile)
                continue
            load_profile(str(profile.path))
            loaded.append(profile)
    return loaded, unavailable


def load_profile(profile: str) -> Backend:
    """Register the backend of ``profile`` (a shipped profile's name or a TOML file) and
    return it loaded; a replay rebuilds it the same way."""
    return register_loaded(read_profile(profile).resolve(), {"profile": profile})


class MissingLibrary(Backend):
    """A shipped profile that cannot run here (its library is not installed, or the
    hardware it needs is missing): its tests are skipped by name, with the reason."""

    def __init__(self, profile: Profile) -> None:
        self.name = profile.name
        self.profile = profile

    def _attention(self, q, k, v, **options):
        raise NotImplementedError(skip_reason(self.profile))


def skip_reason(profile: Profile) -> str:
    return f"profile {profile.name}: {profile.unavailable()}"
