"""JAX's persistent compilation cache as the suite uses it: where it lives (one folder per
user, shared by every checkout, venv and tox env), which runs write to it, and its bound.
``conformance.suite.compiles`` applies it to a run before anything compiles."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from conformance.backends.arrays import import_jax

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
    return cache_setting(environ, JAX_CACHE_SETTING, JAX_CACHE_MODES)


def cache_setting(environ: Mapping[str, str], name: str, modes: tuple[str, ...]) -> str:
    """The value of the setting ``name``, one of ``modes``; the first where it is unset or
    empty. Any other value is a ValueError naming the setting."""
    mode = environ.get(name) or modes[0]
    if mode not in modes:
        raise ValueError(f"{name}: expected one of {', '.join(modes)}, got {mode!r}")
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
    return user_cache_root(environ) / "jax"


def user_cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """The suite's folder in the user's cache directory: ``attention-conformance`` in
    ``$XDG_CACHE_HOME``, else in ``~/.cache``; it holds the JAX programs (``jax``) and
    the oracle's results (``oracle``, ``conformance.suite.oracle_store``)."""
    base = environ.get("XDG_CACHE_HOME", "")
    # The XDG specification ignores a relative path: it would move with the working directory.
    if not os.path.isabs(base):
        home = environ.get("HOME")
        base = os.path.join(home if home else Path.home(), ".cache")
    return Path(base) / "attention-conformance"


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


def trim_cache_folder(directory: Path, bound: int | None) -> int:
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
