"""The oracle's results, kept between runs: the mpmath oracle computed once per input.

The oracle (``fixtures/oracle.py``) works each score in 50-digit arithmetic, milliseconds a
row, and a run asks it the same questions every time: the suite's inputs are drawn from
fixed seeds, and a function under test changes only its own answers. Measured on this
project's 2-core machine, it is 10 of the 16 seconds of ``pytest conformance --backend
numpy`` and 45 CPU-seconds of the run of every backend (SPEC §13.22).

So its answers are kept in the user's cache, ``attention-conformance/oracle`` beside the
JAX programs (``conformance.backends.jax_cache.user_cache_root``), one file per question,
and read back by any later process that asks the same one:

- **The key** is the SHA-256 of the question: the function's name, every input's dtype,
  shape and bytes, every option, and the oracle itself (its source file's bytes, mpmath's
  and NumPy's versions). A changed oracle, input or option is a new key, never a stale
  answer.
- **Only the oracle.** The 50-digit functions are kept (``REMEMBERED``); the naive
  same-precision runs are not, as their results depend on the BLAS kernel of the machine.
- **Data only.** A file is an ``.npz`` of float64 arrays, read with
  ``allow_pickle=False``; one that cannot be read is computed again and replaced.
- **Bounded.** Before a run tests anything, the controlling process trims the folder to
  ``ORACLE_CACHE_MAX_BYTES`` (256 MiB), least recently used first.
- ``CONFORMANCE_ORACLE_CACHE=off`` turns it off: nothing is read or written, and each
  process keeps its answers in memory only.

``oracle`` below stands in for the module: ``oracle.attention_vjp(...)`` answers as
``fixtures/oracle.py``'s does, from the store where it can.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from conformance.backends.jax_cache import cache_setting, trim_cache_folder, user_cache_root

#: The setting that turns the store on ("on", the default) or off.
ORACLE_CACHE_SETTING = "CONFORMANCE_ORACLE_CACHE"
ORACLE_CACHE_MODES = ("on", "off")
#: The folder's bound, trimmed before each run (least recently used first).
ORACLE_CACHE_MAX_BYTES = 256 * 1024**2
#: The oracle's functions whose answers are kept: the 50-digit ones. A paged call with
#: ``naive_dtype`` is the naive run (BLAS), and is never kept.
REMEMBERED = frozenset(
    {
        "attention",
        "attention_vjp",
        "attention_packed",
        "attention_packed_vjp",
        "attention_paged",
        "attention_paged_vjp",
    }
)
#: Answers kept in a process's memory, most recently used last.
MEMORY_SIZE = 4096


def oracle_cache_mode(environ: Mapping[str, str] = os.environ) -> str:
    """The value of ``CONFORMANCE_ORACLE_CACHE`` ("on" where it is unset or empty)."""
    return cache_setting(environ, ORACLE_CACHE_SETTING, ORACLE_CACHE_MODES)


def oracle_cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The store's folder, or None where ``CONFORMANCE_ORACLE_CACHE=off``."""
    if oracle_cache_mode(environ) == "off":
        return None
    return user_cache_root(environ) / "oracle"


def configure(config) -> None:
    """A pytest run's store: its setting checked in every process, the folder trimmed to
    its bound once, by the controller, before its workers start."""
    import pytest

    try:
        directory = oracle_cache_dir()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from err
    if directory is not None and not hasattr(config, "workerinput"):
        trim_cache_folder(directory, ORACLE_CACHE_MAX_BYTES)


class Store:
    """Answers by key: in memory, then in ``directory`` (None: memory only)."""

    def __init__(self, directory: Path | None, digest: str) -> None:
        self.directory, self.digest = directory, digest
        self.memory: collections.OrderedDict[str, object] = collections.OrderedDict()

    def answer(self, name: str, function, *args, **kwargs):
        """``function(*args, **kwargs)``, asked once per distinct question; a copy, so
        that a caller may change what it gets."""
        key = question_key(self.digest, name, args, kwargs)
        if key is None:
            return function(*args, **kwargs)
        if key in self.memory:
            self.memory.move_to_end(key)
        else:
            found = self._read(key)
            if found is None:
                found = function(*args, **kwargs)
                self._write(key, found)
            self.memory[key] = found
            if len(self.memory) > MEMORY_SIZE:
                self.memory.popitem(last=False)
        return _copied(self.memory[key])

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.npz"

    def _read(self, key: str):
        if self.directory is None:
            return None
        path = self._path(key)
        try:
            with np.load(path, allow_pickle=False) as stored:
                found = _unpacked(dict(stored))
            os.utime(path)  # recently used: the trim keeps it
            return found
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile):
            # Unreadable: computed again, and replaced where the folder can be written.
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return None

    def _write(self, key: str, found) -> None:
        packed = _packed(found)
        if self.directory is None or packed is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Written whole under a temporary name, then renamed: a process reading the
            # key meanwhile finds no file or the whole one, never a part.
            handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".part")
            with os.fdopen(handle, "wb") as out:
                np.savez(out, **packed)
            os.replace(temporary, self._path(key))
        except OSError:
            return  # a folder that cannot be written costs the next run time, nothing else


def question_key(digest: str, name: str, args: tuple, kwargs: dict) -> str | None:
    """The SHA-256 of one question, or None for an argument it cannot name by value."""
    h = hashlib.sha256()
    try:
        _feed(h, (digest, name, args, sorted(kwargs.items())))
    except TypeError:
        return None
    return h.hexdigest()


def _feed(h, x) -> None:
    if isinstance(x, (np.ndarray, np.generic)):
        x = np.asarray(x)
        if x.dtype.hasobject:
            raise TypeError("an object array has no bytes to key")
        h.update(f"a{x.dtype.str}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, (tuple, list)):
        h.update(f"s{type(x).__name__}{len(x)}".encode())
        for y in x:
            _feed(h, y)
    elif x is None or isinstance(x, (bool, int, float, str)):
        # repr is exact for a float and tells 1 from 1.0 from True.
        h.update(f"v{type(x).__name__}:{x!r};".encode())
    elif isinstance(x, type) and issubclass(x, np.generic):
        h.update(f"t{np.dtype(x).str};".encode())
    else:
        raise TypeError(f"no key for {type(x).__name__}")


def _packed(found) -> dict[str, np.ndarray] | None:
    """An answer as named arrays: "out" for one array, "0", "1", … for a tuple, "grad.NAME"
    for a dict; None for anything else, which is not kept."""
    if isinstance(found, np.ndarray):
        parts = {"out": found}
    elif isinstance(found, tuple) and all(isinstance(x, np.ndarray) for x in found):
        parts = {str(i): x for i, x in enumerate(found)}
    elif isinstance(found, dict) and all(isinstance(x, np.ndarray) for x in found.values()):
        parts = {f"grad.{n}": x for n, x in found.items()}
    else:
        return None
    return None if any(x.dtype.hasobject for x in parts.values()) else parts


def _unpacked(parts: dict[str, np.ndarray]):
    if "out" in parts:
        return parts["out"]
    if all(n.startswith("grad.") for n in parts):
        return {n[5:]: x for n, x in parts.items()}
    return tuple(parts[str(i)] for i in range(len(parts)))


def _copied(found):
    if isinstance(found, np.ndarray):
        return found.copy()
    if isinstance(found, tuple):
        return tuple(_copied(x) for x in found)
    if isinstance(found, dict):
        return {n: _copied(x) for n, x in found.items()}
    return found


def oracle_digest(module) -> str:
    """What names the oracle in every key: its source file's bytes, mpmath's and NumPy's
    versions."""
    import mpmath

    h = hashlib.sha256(Path(module.__file__).read_bytes())
    h.update(f"mpmath {mpmath.__version__} numpy {np.__version__}".encode())
    return h.hexdigest()


class _Oracle:
    """``fixtures/oracle.py`` with its 50-digit answers kept (``Store``); every other name
    is the module's own."""

    def __getattr__(self, name: str):
        module = _module()
        function = getattr(module, name)
        if name not in REMEMBERED:
            return function
        return functools.partial(_remembered, name, function)


def _remembered(name: str, function, *args, **kwargs):
    if kwargs.get("naive_dtype") is not None:
        return function(*args, **kwargs)
    return _store().answer(name, function, *args, **kwargs)


@functools.cache
def _module():
    from conformance.fixtures import oracle as module

    return module


@functools.cache
def _store() -> Store:
    return Store(oracle_cache_dir(), oracle_digest(_module()))


oracle = _Oracle()
