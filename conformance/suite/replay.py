"""Failures that replay: every failing test carries its last calls, saved and replayable.

The suite hands each test a ``RecordingBackend``, which remembers the last calls to
``attention``, ``attention_vjp``, ``multi_head_attention``, ``gpt_block`` and
``module_param_grads``. When a test fails, the calls' inputs go to an ``.npz`` file (no
pickle) and the failure carries a snippet that loads the backend as the test loaded it
(``load_backend(name, **options)``) and makes the call again::

    from conformance.suite.replay import load_call
    backend, method, args, kwargs = load_call("test_x.npz", index=-1)
    result = getattr(backend, method)(*args, **kwargs)
"""

from __future__ import annotations

import collections
import itertools
import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

from conformance.adapters import impl, profiles
from conformance.backends import Backend, load_backend, numpy_dtype
from conformance.suite.behaviours import mark_raised
from conformance.suite.domain import carry, remember_carried
from conformance.suite.requirements import SuiteError, undeclared

#: The backend methods a replay covers: everything that computes.
RECORDED = (
    "attention",
    "merge_states",
    "attention_quantized",
    "attention_vjp",
    "attention_packed",
    "attention_packed_vjp",
    "attention_paged",
    "attention_paged_vjp",
    "multi_head_attention",
    "gpt_block",
    "module_param_grads",
)

_CLOCK = itertools.count()
#: Called with (backend, method, args, kwargs) before each recorded call reaches the
#: backend: how an isolated run's worker notes the call a crash would end
#: (``conformance.suite.isolation``).
BEFORE_CALL: list = []
#: The call as a function received it (``FunctionBackend.received``: after its profile's
#: conversion of arrays, mask, layout and keywords), described, by the clock of the
#: recorded call that made it; only the last few are kept.
_RECEIVED: collections.OrderedDict[int, str] = collections.OrderedDict()
_RECEIVED_KEPT = 16


def _native(value: Any) -> str:
    """A framework's array as ``float32[1, 4, 5, 9]``, any other value as ``_show`` does."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or isinstance(value, np.generic):
        return _show(value)
    name = str(dtype).rsplit(".", 1)[-1]  # torch.float32 reads as float32
    return f"{name}{[int(n) for n in shape]}"


def _note_received(clock: int, received: Any) -> None:
    if received is None:
        return
    func, args, keywords = received
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    shown = [_native(x) for x in args] + [f"{key}={_native(x)}" for key, x in keywords.items()]
    _RECEIVED[clock] = f"{name}({', '.join(shown)})"
    while len(_RECEIVED) > _RECEIVED_KEPT:
        _RECEIVED.popitem(last=False)


def received(calls: list[tuple]) -> str | None:
    """How the function under test received the last of ``calls``, after its profile's
    conversion; None where no function of a profile or ``--impl`` received it, or where
    it received the suite's call as it was."""
    found = _RECEIVED.get(calls[-1][0]) if calls else None
    if found is None:
        return None
    _, _, _, args, kwargs = calls[-1]
    suite = [_show(x) for x in args] + [f"{key}={_show(x)}" for key, x in kwargs.items()]
    return None if found.partition("(")[2] == f"{', '.join(suite)})" else found


class RecordingBackend:
    """A backend that remembers its last calls, to replay a failure.

    With ``guard`` (the conformance run's default), a call using anything the backend does
    not declare (``conformance.suite.requirements.undeclared``) raises ``SuiteError`` and never
    reaches the backend. Everything else is the wrapped backend's own: attributes and
    other methods pass straight through.
    """

    def __init__(self, backend: Backend, log: collections.deque, *, guard: bool = False) -> None:
        self._backend = backend
        self._log = log
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name not in RECORDED:
            return attr

        def recorded(*args, **kwargs):
            if self._guard:
                found = undeclared(self._backend, name, args, kwargs)
                if found:
                    raise SuiteError(
                        f"suite error: the test would call {self._backend.name}.{name} with "
                        f"{'; '.join(found)}, which {self._backend.name} does not declare. "
                        "This is a bug in the conformance suite, not in the backend."
                    )
            # Inside the backend's declared forms and shapes, or skipped (suite/domain.py).
            args, kwargs, back = carry(self._backend, name, args, kwargs)
            # Copies: a test may change its arrays after the call.
            clock = next(_CLOCK)
            remember_carried(clock, back)
            self._log.append((clock, self._backend, name, _copy(args), _copy(kwargs)))
            for listener in BEFORE_CALL:
                listener(self._backend, name, args, kwargs)
            if hasattr(self._backend, "received"):
                self._backend.received = None
            try:
                return back(attr(*args, **kwargs))
            except Exception as err:
                mark_raised(err, self._backend.name, name)
                raise
            finally:
                _note_received(clock, getattr(self._backend, "received", None))

        return recorded

    def __repr__(self) -> str:
        return repr(self._backend)


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {key: _copy(x) for key, x in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(x) for x in value)
    return value


def new_call_log(size: int = 2) -> collections.deque:
    return collections.deque(maxlen=size)


_CALLS = pytest.StashKey[collections.deque]()


def call_log(item: pytest.Item) -> collections.deque:
    """The log of ``item``'s last calls (kept in the item's stash), made on first use."""
    if _CALLS not in item.stash:
        item.stash[_CALLS] = new_call_log()
    return item.stash[_CALLS]


def logged_calls(item: pytest.Item) -> list[tuple]:
    """The calls ``item`` logged, oldest first (none if it made none)."""
    return sorted(item.stash.get(_CALLS, ()), key=lambda c: c[0])


def _number(x: Any) -> Any:
    """A NumPy scalar as the plain Python number it holds, so it prints as ``0.5``."""
    return x.item() if isinstance(x, np.generic) else x


def _show(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype.name}{list(value.shape)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {_show(x)}" for key, x in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_show(x) for x in value)
        return (
            f"({inner}{',' if len(value) == 1 else ''})"
            if isinstance(value, tuple)
            else f"[{inner}]"
        )
    value = _number(value)
    return f"{value:.17g}" if isinstance(value, float) else repr(value)


class _Store:
    """Arrays of the saved calls, under unique keys; values described in JSON."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def put(self, key: str, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            x = value
            dtype = x.dtype.name
            # npz cannot hold ml_dtypes' bfloat16 without pickle; float32 holds it exactly.
            self.arrays[key] = x.astype(np.float32) if dtype == "bfloat16" else x
            return {"array": key, "dtype": dtype}
        if isinstance(value, dict):
            return {"dict": {name: self.put(f"{key}.{name}", x) for name, x in value.items()}}
        if isinstance(value, (list, tuple)):
            items = [self.put(f"{key}.{i}", x) for i, x in enumerate(value)]
            return {"tuple" if isinstance(value, tuple) else "list": items}
        return {"value": _number(value)}


def _restore(entry: dict, saved) -> Any:
    if "array" in entry:
        return saved[entry["array"]].astype(numpy_dtype(entry["dtype"]))
    if "dict" in entry:
        return {name: _restore(x, saved) for name, x in entry["dict"].items()}
    if "tuple" in entry:
        return tuple(_restore(x, saved) for x in entry["tuple"])
    if "list" in entry:
        return [_restore(x, saved) for x in entry["list"]]
    return entry["value"]


def load_expression(backend: Backend) -> str:
    """The call that loads ``backend`` as it is configured: ``load_backend('name', ...)``."""
    args = [repr(backend.name)] + [f"{n}={_show(v)}" for n, v in backend.options.items()]
    return f"load_backend({', '.join(args)})"


def save_calls(path: str | os.PathLike, calls: Iterable[tuple]) -> list[str]:
    """Write the recorded calls to ``path`` (.npz, no pickle); return one line per call,
    describing it, for the failure message."""
    store = _Store()
    meta: list[dict] = []
    lines: list[str] = []
    for i, (_, backend, method, args, kwargs) in enumerate(calls):
        meta.append(
            {
                "backend": backend.name,
                "options": store.put(f"{i}.options", dict(backend.options)),
                "loader": impl.LOADERS.get(backend.name),
                "method": method,
                "args": store.put(f"{i}.args", tuple(args)),
                "kwargs": store.put(f"{i}.kwargs", dict(kwargs)),
            }
        )
        shown = ", ".join(
            [_show(x) for x in args] + [f"{key}={_show(x)}" for key, x in kwargs.items()]
        )
        lines.append(f"{method}({shown})  # on {load_expression(backend)}")
    store.arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **store.arrays)
    return lines


def load_call(path: str | os.PathLike, index: int = -1) -> tuple[Backend, str, tuple, dict]:
    """``(backend, method, args, kwargs)`` of a call saved by a failing test.

    Replay it with ``getattr(backend, method)(*args, **kwargs)``. ``index`` picks the call
    (-1, the default, is the last one before the failure). The backend is loaded as the
    test loaded it: the same name and options (an ``--impl`` is imported again).
    """
    with np.load(path, allow_pickle=False) as saved:
        meta = json.loads(str(saved["meta"]))
        i = range(len(meta))[index]
        entry = meta[i]
        options = _restore(entry["options"], saved)
        if entry["loader"] and "profile" in entry["loader"]:
            backend = profiles.load_profile(**entry["loader"])
        elif entry["loader"]:
            backend = impl.load_impl(**entry["loader"])
        else:
            backend = load_backend(entry["backend"], **options)
        args = _restore(entry["args"], saved)
        kwargs = _restore(entry["kwargs"], saved)
    return backend, entry["method"], args, kwargs


def replay_snippet(path: str | os.PathLike, lines: list[str], received: str | None = None) -> str:
    """The text a failing test carries: what was called (and, for a function of a profile
    or ``--impl``, the last call as the function received it), and how to call it again."""
    n = len(lines)
    calls = "\n".join(f"  [{i - n}] {line}" for i, line in enumerate(lines))
    if received:
        calls += f"\n  [-1] as the function received it: {received}"
    return (
        f"the last {'call' if n == 1 else f'{n} calls'} to the backend before the failure "
        f"(inputs saved to {path}):\n{calls}\n"
        "replay in Python:\n"
        "  from conformance.suite.replay import load_call\n"
        f"  backend, method, args, kwargs = load_call({str(path)!r}, index=-1)\n"
        "  result = getattr(backend, method)(*args, **kwargs)"
    )
