"""Arrays of each framework: the one place data crosses between NumPy and torch, JAX, MLX,
tinygrad or Paddle.

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
#: overrides it for one pytest run): "shipped", the default, the shipped backends' and
#: profiles'; "all", your own code's too; "off", none.
JAX_CACHE_SETTING = "CONFORMANCE_JAX_CACHE"
JAX_CACHE_MODES = ("shipped", "all", "off")


def jax_cache_mode(environ: Mapping[str, str] = os.environ) -> str:
    """The value of ``CONFORMANCE_JAX_CACHE`` ("shipped" where it is unset or empty)."""
    mode = environ.get(JAX_CACHE_SETTING) or "shipped"
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
    that would have compiled the very same one.
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

    JAX's cache is one per process: once on, it holds every program the process compiles.
    So a run that tests your own code (an ``--impl``, a profile of yours) uses it only
    under mode "all", for the shipped backends' programs as for yours, or where you set
    JAX's own ``JAX_COMPILATION_CACHE_DIR`` (JAX then caches all your JAX code anyway).
    "off" turns it off, JAX's variable or not.
    """
    if mode not in JAX_CACHE_MODES:
        raise ValueError(f"mode: expected one of {', '.join(JAX_CACHE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    if own_code and mode != "all":
        chosen = environ.get("JAX_COMPILATION_CACHE_DIR")
        return Path(chosen) if chosen else None
    return jax_cache_dir(environ)


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
    """Arrays of one framework: the only place data crosses between NumPy and it."""

    name = "numpy"
    #: The distribution that provides it, for "not installed" messages.
    package = "numpy"

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

    def version(self) -> dict[str, str]:
        return {"numpy": np.__version__}


class TorchFramework(Framework):
    name = "torch"
    package = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def from_numpy(self, x):
        x = np.asarray(x)
        if x.dtype.name == "bfloat16":
            # torch cannot read ml_dtypes' bfloat16; the bits are the same, so reinterpret.
            bits = self.torch.from_numpy(np.ascontiguousarray(x).view(np.int16))
            return bits.view(self.torch.bfloat16)
        return self.torch.from_numpy(np.array(x))

    def to_numpy(self, x):
        x = x.detach()
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

    def version(self):
        return {"torch": self.torch.__version__}


class JaxFramework(Framework):
    name = "jax"
    package = "jax"

    def __init__(self, float64: bool = True, why: str = "a JAX function declares float64") -> None:
        self.jax = import_jax(float64, why=why)
        self.float64 = float64

    def scope(self):
        # x64 is a setting of the process: where another backend of the run switched it on,
        # a function without float64 still runs as its users run it, with JAX's default.
        return contextlib.nullcontext() if self.float64 else self.jax.enable_x64(False)

    def from_numpy(self, x):
        return self.jax.device_put(np.asarray(x))

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

    def version(self):
        return {"jax": self.jax.__version__}


class MlxFramework(Framework):
    """MLX arrays, on the CPU stream where MLX has no GPU. ``mx.array`` reads NumPy's
    float16 and float32 as they are, float64 only when asked (else it narrows it to
    float32); bfloat16 (ml_dtypes) it cannot read, so bfloat16 crosses as float32 (exact:
    every bfloat16 is a float32) and is cast back in MLX."""

    name = "mlx"
    package = "mlx"

    def __init__(self) -> None:
        import mlx.core as mx

        self.mx = mx

    def from_numpy(self, x):
        x = np.asarray(x)
        if x.dtype.name == "bfloat16":
            return self.mx.array(x.astype(np.float32)).astype(self.mx.bfloat16)
        if x.dtype == np.float64:
            return self.mx.array(x, dtype=self.mx.float64)
        return self.mx.array(x)

    def to_numpy(self, x):
        if x.dtype == self.mx.bfloat16:
            return np.array(x.astype(self.mx.float32)).astype(numpy_dtype("bfloat16"))
        return np.array(x)

    def is_array(self, x):
        return isinstance(x, self.mx.array)

    def swap_heads_and_time(self, x):
        return self.mx.swapaxes(x, -3, -2)

    def seed(self, seed):
        self.mx.random.seed(seed)

    def vjp(self, call, primals, d_out):
        _, grads = self.mx.vjp(lambda *xs: call(*xs), primals, [d_out])
        return list(grads)

    def version(self):
        return {"mlx": self.mx.__version__}


class TinygradFramework(Framework):
    """tinygrad Tensors on its default device (here the CPU, whose kernels tinygrad compiles
    with clang). bfloat16 crosses as float32 and is cast in tinygrad, as for MLX."""

    name = "tinygrad"
    package = "tinygrad"

    def __init__(self) -> None:
        import tinygrad

        self.tinygrad = tinygrad

    def from_numpy(self, x):
        x = np.asarray(x)
        if x.dtype.name == "bfloat16":
            wide = self.tinygrad.Tensor(x.astype(np.float32))
            return wide.cast(self.tinygrad.dtypes.bfloat16)
        return self.tinygrad.Tensor(np.ascontiguousarray(x))

    def to_numpy(self, x):
        if x.dtype == self.tinygrad.dtypes.bfloat16:
            wide = x.cast(self.tinygrad.dtypes.float32).numpy()
            return wide.astype(numpy_dtype("bfloat16"))
        return x.numpy()

    def is_array(self, x):
        return isinstance(x, self.tinygrad.Tensor)

    def swap_heads_and_time(self, x):
        return x.transpose(-3, -2)

    def seed(self, seed):
        self.tinygrad.Tensor.manual_seed(seed)

    def vjp(self, call, primals, d_out):
        leaves = [x.detach() for x in primals]
        for leaf in leaves:
            leaf.requires_grad = True
        out = call(*leaves)
        return list(out.gradient(*leaves, gradient=d_out))

    def version(self):
        from importlib.metadata import version

        return {"tinygrad": version("tinygrad")}


class PaddleFramework(Framework):
    """PaddlePaddle tensors on the CPU. bfloat16 crosses as float32 and is cast in Paddle."""

    name = "paddle"
    package = "paddle"

    def __init__(self) -> None:
        import paddle

        self.paddle = paddle

    def from_numpy(self, x):
        x = np.asarray(x)
        if x.dtype.name == "bfloat16":
            return self.paddle.to_tensor(x.astype(np.float32)).astype("bfloat16")
        return self.paddle.to_tensor(np.ascontiguousarray(x))

    def to_numpy(self, x):
        if x.dtype == self.paddle.bfloat16:
            return x.astype("float32").numpy().astype(numpy_dtype("bfloat16"))
        return x.numpy()

    def is_array(self, x):
        return isinstance(x, self.paddle.Tensor)

    def swap_heads_and_time(self, x):
        perm = list(range(x.ndim))
        perm[-3], perm[-2] = perm[-2], perm[-3]
        return self.paddle.transpose(x, perm)

    def seed(self, seed):
        self.paddle.seed(seed)

    def vjp(self, call, primals, d_out):
        leaves = [x.detach() for x in primals]
        for leaf in leaves:
            leaf.stop_gradient = False
        out = call(*leaves)
        grads = self.paddle.grad(out, leaves, grad_outputs=d_out, allow_unused=True)
        # A leaf the output does not depend on has gradient 0, as in torch.
        return [self.paddle.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

    def version(self):
        return {"paddlepaddle": self.paddle.__version__}


FRAMEWORKS: dict[str, type[Framework]] = {
    "numpy": Framework,
    "torch": TorchFramework,
    "jax": JaxFramework,
    "mlx": MlxFramework,
    "tinygrad": TinygradFramework,
    "paddle": PaddleFramework,
}


def make_framework(name: str, **settings: Any) -> Framework:
    """The framework ``name`` (JAX's ``settings``: ``float64``, and ``why`` it is needed); a
    missing or unknown one is a ``LookupError`` saying what is available."""
    if name not in FRAMEWORKS:
        raise LookupError(f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}")
    cls = FRAMEWORKS[name]
    if importlib.util.find_spec(cls.package) is None:
        installed = [n for n, c in FRAMEWORKS.items() if importlib.util.find_spec(c.package)]
        raise LookupError(
            f"framework {name!r} is not installed (pip install {cls.package}); installed: "
            f"{', '.join(installed)}"
        )
    return cls(**settings) if name == "jax" else cls()
