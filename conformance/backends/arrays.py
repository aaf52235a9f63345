"""Arrays of each framework: the one place data crosses between NumPy and torch or JAX.

The backends convert with these classes, and so do the native calls of other libraries'
functions (``conformance.adapters.native``). Frameworks are imported inside their class,
when one is built, so ``import conformance`` imports neither torch nor jax.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from conformance.vocabulary import numpy_dtype

#: The global settings the suite changed for this process, each with why, for the run's
#: summary (``conformance.suite.domain_summary.DomainSummary``).
GLOBAL_SETTINGS: dict[str, str] = {}


def import_jax(float64: bool = True, *, why: str = "a JAX backend declares float64") -> Any:
    """JAX, with float64 switched on where ``float64`` asks for it: the one place the suite
    turns on ``jax_enable_x64``, a setting of the whole process.

    float64 is part of the spec; without this JAX silently computes in float32. A function
    that declares no float64 leaves JAX as its users run it (x64 off, the default), unless
    another backend of the same run switched it on: the summary says so (``GLOBAL_SETTINGS``).
    """
    import jax

    if float64:
        if not jax.config.jax_enable_x64:
            GLOBAL_SETTINGS.setdefault("jax_enable_x64 = True", why)
        jax.config.update("jax_enable_x64", True)
    return jax


#: The setting that says which JAX programs the suite caches on disk (``--jax-cache``
#: overrides it for one pytest run): "all", the default, every program of the run, your
#: own code's included; "shipped", only a run of the shipped backends and profiles
#: (a run that tests your code caches nothing); "off", none.
JAX_CACHE_SETTING = "CONFORMANCE_JAX_CACHE"
JAX_CACHE_MODES = ("all", "shipped", "off")
#: The cache's bound: before a run compiles anything, the least recently used programs
#: are deleted until the folder holds at most this many bytes (JAX's own
#: ``JAX_COMPILATION_CACHE_MAX_SIZE``, in bytes, where set; -1 there: no bound).
JAX_CACHE_MAX_BYTES = 2 * 1024**3


def jax_cache_mode(environ: Mapping[str, str] = os.environ) -> str:
    """The value of ``CONFORMANCE_JAX_CACHE`` ("all" where it is unset or empty)."""
    mode = environ.get(JAX_CACHE_SETTING) or "all"
    if mode not in JAX_CACHE_MODES:
        raise ValueError(
            f"{JAX_CACHE_SETTING}: expected one of {', '.join(JAX_CACHE_MODES)}, got {mode!r}"
        )
    return mode


def jax_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where JAX's persistent compilation cache is: ``$JAX_COMPILATION_CACHE_DIR`` where
    set, else ``attention-conformance/jax`` in the user's cache directory
    (``$XDG_CACHE_HOME``, else ``~/.cache``), one for every checkout and venv of the user.

    Sharing it is safe: JAX keys each entry by the program, the jax and jaxlib versions,
    the device and the compiler's flags, so a program is only ever read back by a process
    that would have compiled the very same one; a changed function of yours misses only
    the programs that changed.
    """
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(environ["JAX_COMPILATION_CACHE_DIR"])
    base = environ.get("XDG_CACHE_HOME", "")
    # The XDG specification ignores a relative path: it would move with the working directory.
    if not os.path.isabs(base):
        home = environ.get("HOME")
        base = os.path.join(home if home else Path.home(), ".cache")
    return Path(base) / "attention-conformance" / "jax"


def jax_cache_for_run(
    mode: str, own_code: bool, environ: Mapping[str, str] = os.environ
) -> Path | None:
    """The persistent cache of a run that compiles JAX programs, or None for none.

    JAX's cache is one per process: once on, it holds every program the process compiles,
    the shipped backends' and your own code's alike (an ``--impl``, a profile of yours),
    so that your second run reads back what your first compiled. Mode "shipped" keeps a
    run of your code out of it (unless you set JAX's own ``JAX_COMPILATION_CACHE_DIR``,
    which caches all your JAX code anyway); "off" turns it off, JAX's variable or not.
    """
    if mode not in JAX_CACHE_MODES:
        raise ValueError(f"mode: expected one of {', '.join(JAX_CACHE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if own_code and mode == "shipped":
        chosen = environ.get("JAX_COMPILATION_CACHE_DIR")
        return Path(chosen) if chosen else None
    return jax_cache_dir(environ)


def jax_cache_bound(environ: Mapping[str, str] = os.environ) -> int | None:
    """The most bytes the cache holds at the start of a run (None: no bound):
    ``JAX_COMPILATION_CACHE_MAX_SIZE`` where set (JAX's own variable, -1 for none), else
    ``JAX_CACHE_MAX_BYTES``."""
    setting = environ.get("JAX_COMPILATION_CACHE_MAX_SIZE")
    if not setting:
        return JAX_CACHE_MAX_BYTES
    try:
        bound = int(setting)
    except ValueError:
        raise ValueError(
            f"JAX_COMPILATION_CACHE_MAX_SIZE: expected a number of bytes (-1: no bound), "
            f"got {setting!r}"
        ) from None
    return None if bound < 0 else bound


def trim_jax_cache(directory: Path, bound: int | None) -> int:
    """Delete the least recently used files of ``directory`` until it holds at most
    ``bound`` bytes; the number deleted. Used is the later of a file's access and
    modification times (JAX writes a program once and only reads it after). Another
    process may delete the same file at the same time: a file already gone is skipped."""
    if bound is None or not directory.is_dir():
        return 0
    entries = []
    for path in directory.iterdir():
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        if path.is_file():
            entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
    held = sum(size for _, size, _ in entries)
    deleted = 0
    for _, size, path in sorted(entries):
        if held <= bound:
            break
        path.unlink(missing_ok=True)
        held -= size
        deleted += 1
    return deleted


def use_jax_cache(directory: Path | None, environ: Mapping[str, str] = os.environ) -> None:
    """Point this process's JAX at ``directory`` for its compiled programs (None: no
    persistent cache), before it compiles any: JAX opens its cache once, at the first
    compile. Every program is cached, however quick to compile (JAX's default keeps
    only those that took a second), unless ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``
    says otherwise. The cache is no reason to switch on float64: the backends decide that."""
    jax = import_jax(float64=False)
    jax.config.update("jax_compilation_cache_dir", None if directory is None else str(directory))
    if directory is not None and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


class Framework:
    """Arrays of one framework: the only place data crosses between NumPy and it.

    ``device`` (SPEC §13.20) is where the function under test runs, in the framework's own
    spelling: ``from_numpy`` places each array there, ``to_numpy`` brings it back to the
    host. None leaves the framework's default. NumPy's arrays live on the host only.
    """

    name = "numpy"
    #: The distribution that provides it, for "not installed" messages.
    package = "numpy"
    #: The device spellings this framework understands, for the messages.
    DEVICES = "cpu"

    def __init__(self, device: str | None = None) -> None:
        self.device = self.resolve_device(device)

    def resolve_device(self, device: str | None) -> Any:
        """The framework's device for ``device``.

        Raises:
          ValueError: a spelling the framework does not know, naming ``device``.
          LookupError: a device the framework knows but this machine does not have.
        """
        if device not in (None, "cpu"):
            raise ValueError(
                f"device should be cpu for a numpy function (NumPy's arrays live on the "
                f"host), got {device!r}"
            )
        return None

    def from_numpy(self, x: np.ndarray) -> Any:
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def is_array(self, x: Any) -> bool:
        return isinstance(x, (np.ndarray, np.generic)) or hasattr(x, "__array__")

    def swap_heads_and_time(self, x: Any) -> Any:
        return np.swapaxes(x, -3, -2)

    def seed(self, seed: int) -> None:
        """Seed the framework's global generator (for a library without a seed keyword)."""
        raise NotImplementedError(f"{self.name} has no global generator to seed")

    def key(self, seed: int) -> Any:
        """What a library's seed keyword takes in this framework: the int itself, except
        in JAX (a key)."""
        return seed

    def vjp(self, call: Callable, primals: list, d_out: Any) -> list:
        raise NotImplementedError(f"{self.name} arrays have no automatic differentiation")

    def jit(self, func: Callable, static: list[str]) -> Callable:
        """``func`` compiled as its users compile it (``jax.jit``); elsewhere ``func``."""
        raise ValueError(f"jit: {self.name} functions are not compiled by the suite")

    def scope(self) -> contextlib.AbstractContextManager:
        """The settings the function's calls run under (JAX's float64); none here."""
        return contextlib.nullcontext()

    def precision_settings(self) -> dict[str, str]:
        """The framework's settings that let a device compute float32 in less (TF32, a
        reduced-precision reduction), each with its value in this process (SPEC §13.20);
        NumPy has none."""
        return {}

    def version(self) -> dict[str, str]:
        return {"numpy": np.__version__}


class TorchFramework(Framework):
    name = "torch"
    package = "torch"
    DEVICES = "cpu, cuda, cuda:N, or another torch.device string"

    def __init__(self, device: str | None = None) -> None:
        import torch

        self.torch = torch
        super().__init__(device)

    def resolve_device(self, device):
        if device is None:
            return None
        try:
            found = self.torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"device should be a torch device ({self.DEVICES}), got {device!r}"
            ) from err
        try:
            self.torch.empty(0, device=found)
        except (RuntimeError, AssertionError) as err:
            raise LookupError(f"device {device!r} is not on this machine: {err}") from err
        return found

    def from_numpy(self, x):
        x = np.asarray(x)
        if x.dtype.name == "bfloat16":
            # torch cannot read ml_dtypes' bfloat16; the bits are the same, so reinterpret.
            bits = self.torch.from_numpy(np.ascontiguousarray(x).view(np.int16))
            found = bits.view(self.torch.bfloat16)
        else:
            found = self.torch.from_numpy(np.array(x))
        return found if self.device is None else found.to(self.device)

    def to_numpy(self, x):
        x = x.detach().cpu()
        if x.dtype == self.torch.bfloat16:
            return x.view(self.torch.int16).numpy().view(numpy_dtype("bfloat16"))
        return x.numpy()

    def is_array(self, x):
        return isinstance(x, self.torch.Tensor)

    def swap_heads_and_time(self, x):
        return x.transpose(-3, -2)

    def seed(self, seed):
        self.torch.manual_seed(seed)

    def vjp(self, call, primals, d_out, check=None):
        # Autograd through the very call the forward tests: the primals become leaves
        # that require grad, and the output's vector-Jacobian product is read off them.
        # ``check(out, d_out)``, when given, runs between the forward and the backward.
        leaves = [x.detach().requires_grad_(True) for x in primals]
        with self.torch.enable_grad():
            out = call(*leaves)
        if check is not None:
            check(out, d_out)
        grads = self.torch.autograd.grad(out, leaves, grad_outputs=d_out, allow_unused=True)
        # A leaf the output does not depend on (v with every row masked) has gradient 0.
        return [self.torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

    def precision_settings(self):
        matmul = self.torch.backends.cuda.matmul
        return {
            "torch.backends.cuda.matmul.allow_tf32": str(matmul.allow_tf32),
            "torch.backends.cudnn.allow_tf32": str(self.torch.backends.cudnn.allow_tf32),
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction": str(
                matmul.allow_fp16_reduced_precision_reduction
            ),
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction": str(
                matmul.allow_bf16_reduced_precision_reduction
            ),
            "torch.get_float32_matmul_precision()": self.torch.get_float32_matmul_precision(),
        }

    def version(self):
        return {"torch": self.torch.__version__}


class JaxFramework(Framework):
    name = "jax"
    package = "jax"
    DEVICES = "cpu, gpu, cuda, rocm or tpu, each with an optional :N"
    PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")

    def __init__(
        self,
        float64: bool = True,
        why: str = "a JAX function declares float64",
        device: str | None = None,
    ) -> None:
        self.jax = import_jax(float64, why=why)
        self.float64 = float64
        super().__init__(device)

    def resolve_device(self, device):
        if device is None:
            return None
        platform, _, index = str(device).partition(":")
        if platform not in self.PLATFORMS or (_ and not index.isdigit()):
            raise ValueError(f"device should be a JAX device ({self.DEVICES}), got {device!r}")
        try:
            devices = self.jax.devices(platform)
        except RuntimeError as err:
            raise LookupError(f"device {device!r} is not on this machine: {err}") from err
        if int(index or 0) >= len(devices):
            raise LookupError(
                f"device {device!r} is not on this machine: JAX has {len(devices)} "
                f"{platform} device(s)"
            )
        return devices[int(index or 0)]

    def scope(self):
        # x64 is a setting of the process: where another backend of the run switched it on,
        # a function without float64 still runs as its users run it, with JAX's default.
        return contextlib.nullcontext() if self.float64 else self.jax.enable_x64(False)

    def from_numpy(self, x):
        # Committed to the device where one is named: a jitted function then runs there.
        return self.jax.device_put(np.asarray(x), self.device)

    def to_numpy(self, x):
        return np.asarray(x)

    def is_array(self, x):
        return isinstance(x, self.jax.Array)

    def swap_heads_and_time(self, x):
        return self.jax.numpy.swapaxes(x, -3, -2)

    def key(self, seed):
        return self.jax.random.key(seed)

    def vjp(self, call, primals, d_out):
        out, pullback = self.jax.vjp(call, *primals)
        return list(pullback(d_out))

    def jit(self, func, static):
        # Options (is_causal, scale, a window) are static, as in users' code: the arrays
        # are traced, and each signature compiles once.
        return self.jax.jit(func, static_argnames=static)

    def precision_settings(self):
        # None is JAX's default: one pass of the device's fastest float32 matmul, TF32 on
        # NVIDIA GPUs from Ampere on and bfloat16 passes on a TPU; "highest" is float32.
        chosen = self.jax.config.jax_default_matmul_precision
        return {"jax_default_matmul_precision": "None (the default)" if chosen is None else chosen}

    def version(self):
        return {"jax": self.jax.__version__}


FRAMEWORKS: dict[str, type[Framework]] = {
    "numpy": Framework,
    "torch": TorchFramework,
    "jax": JaxFramework,
}


def make_framework(name: str, **settings: Any) -> Framework:
    """The framework ``name`` (JAX's ``settings``: ``float64``, and ``why`` it is needed;
    every framework's: ``device``, ``Framework.resolve_device``); a missing or unknown one,
    or a device this machine lacks, is a ``LookupError`` saying what is available."""
    if name not in FRAMEWORKS:
        raise LookupError(f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}")
    cls = FRAMEWORKS[name]
    if importlib.util.find_spec(cls.package) is None:
        installed = [n for n, c in FRAMEWORKS.items() if importlib.util.find_spec(c.package)]
        raise LookupError(
            f"framework {name!r} is not installed (pip install {cls.package}); installed: "
            f"{', '.join(installed)}"
        )
    device = settings.pop("device", None)
    return cls(**settings, device=device) if name == "jax" else cls(device=device)
