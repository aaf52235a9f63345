"""Arrays of each framework: the one place data crosses between NumPy and torch, JAX, MLX,
tinygrad or Paddle.

The backends convert with these classes, and so do the native calls of other libraries'
functions (``conformance.adapters.native``). Frameworks are imported inside their class,
when one is built, so ``import conformance`` imports neither torch nor jax.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
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


class Framework:
    """Arrays of one framework: the only place data crosses between NumPy and it.

    ``device`` (SPEC §13.20) is where the function under test runs, in the framework's own
    spelling: ``from_numpy`` places each array there, ``to_numpy`` brings it back to the
    host. None leaves the framework's default. NumPy's arrays live on the host only, and
    the suite places MLX's, tinygrad's and Paddle's there too: ``cpu`` is all they take.
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
                f"device should be cpu for a {self.name} function (the suite hands it "
                f"arrays on the host only), got {device!r}"
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
        # A concrete array on the host is swapped by NumPy: jnp.swapaxes would compile a
        # program for each shape and dtype a profile's BTHD layout meets (a quarter of the
        # frameworks env's programs), and the function receives the same values, placed
        # as ``from_numpy`` places its inputs. Traced (inside a gradient) or on a device,
        # the swap is JAX's.
        if self._on_host(x):
            return self.from_numpy(np.swapaxes(np.asarray(x), -3, -2))
        return self.jax.numpy.swapaxes(x, -3, -2)

    def _on_host(self, x) -> bool:
        """Whether x is a concrete array on one CPU device, the one ``from_numpy`` uses."""
        if not isinstance(x, self.jax.Array) or isinstance(x, self.jax.core.Tracer):
            return False
        (device, *others) = x.devices()
        return not others and device.platform == "cpu" and self.device in (None, device)

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


class MlxFramework(Framework):
    """MLX arrays, on the CPU stream where MLX has no GPU. ``mx.array`` reads NumPy's
    float16 and float32 as they are, float64 only when asked (else it narrows it to
    float32); bfloat16 (ml_dtypes) it cannot read, so bfloat16 crosses as float32 (exact:
    every bfloat16 is a float32) and is cast back in MLX."""

    name = "mlx"
    package = "mlx"

    def __init__(self, device: str | None = None) -> None:
        super().__init__(device)
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

    def __init__(self, device: str | None = None) -> None:
        super().__init__(device)
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

    def __init__(self, device: str | None = None) -> None:
        super().__init__(device)
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
