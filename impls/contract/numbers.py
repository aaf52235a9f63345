"""The one rule for numbers and dtype names every option of the contract follows (SPEC §8.4):
see the package's docstring."""

from __future__ import annotations

import math
import numbers
from typing import Any


def dtype_name(x: Any) -> str:
    # NumPy and JAX dtypes have a name ("float32", "bfloat16"); torch's print as
    # "torch.float32".
    dtype = x.dtype
    return getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")


def is_floating(name: str) -> bool:
    return name.startswith("float") or name == "bfloat16"


def scalar(value: Any) -> Any:
    """A NumPy scalar or a 0-d array (NumPy, JAX, torch) as the Python scalar it holds;
    anything else as it is."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def number(name: str, value: Any, expected: str) -> float:
    """The float a Python or NumPy number (or 0-d array) stands for; TypeError otherwise."""
    x = scalar(value)
    # numbers.Real is int and float here (NumPy scalars were made Python ones above);
    # bool is an int subclass, but not a number.
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} should be {expected}, got {value!r}")
    return float(x)


def positive(name: str, value: Any) -> float:
    x = number(name, value, "a positive finite float or None")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} should be a positive finite float, got {value!r}")
    return x


# The smallest normal number of each working precision (float16 and bfloat16 inputs are
# computed in float32).
_SMALLEST_NORMAL = {"float64": 2.0**-1022, "float32": 2.0**-126}


def check_softcap(value: Any, dtype: str) -> float:
    x = positive("softcap", value)
    work = "float64" if dtype == "float64" else "float32"
    if x < _SMALLEST_NORMAL[work]:
        raise ValueError(
            f"softcap should be at least {_SMALLEST_NORMAL[work]!r}, the smallest normal "
            f"{work} ({dtype} inputs are computed in {work}; a subnormal softcap may be "
            f"flushed to 0, and 0 / 0 is NaN), got {value!r}"
        )
    return x


def probability(name: str, value: Any) -> float:
    x = number(name, value, "a float in [0, 1)")
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{name} should be a float in [0, 1), got {value!r}")
    return x + 0.0  # -0.0 becomes 0.0


def integer(name: str, value: Any) -> int:
    x = scalar(value)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} should be an int, got {value!r}")
    return int(x)


def check_bool(name: str, value: Any) -> bool:
    x = scalar(value)  # a NumPy bool becomes a Python bool here
    if isinstance(x, bool):
        return x
    raise TypeError(f"{name} should be a bool, got {value!r}")


def check_window(window: Any) -> tuple[int | None, int | None] | None:
    """A pair (left, right) of ints >= 0 or None, as a tuple (hashable, for jax.jit)."""
    if window is None:
        return None
    pair = f"window should be a pair (left, right) of ints >= 0 or None, got {window!r}"
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(pair)
    sides = []
    for side in window:
        if side is None:
            sides.append(None)
            continue
        x = scalar(side)
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{pair}: {side!r} is not an int")
        if x < 0:
            raise ValueError(pair)
        sides.append(int(x))
    return (sides[0], sides[1])


# --- The multi-head layer --------------------------------------------------------------------


def check_chunk_size(chunk_size: Any) -> int | None:
    """None, or the chunk length of chunked local attention as an int >= 1 (SPEC §16): a
    Python or NumPy int (or 0-d integer array); bool and floats are not chunk lengths."""
    if chunk_size is None:
        return None
    x = scalar(chunk_size)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"chunk_size should be an int >= 1 or None, got {chunk_size!r}")
    if x < 1:
        raise ValueError(f"chunk_size should be an int >= 1 or None, got {chunk_size!r}")
    return int(x)
