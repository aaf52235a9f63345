import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "clause(number): the SPEC.md clause a test checks")
    # The project's tests that compile JAX programs themselves (the pages, the flash tiles)
    # keep them in the user's shared cache too; JAX reads these when it is imported.
    from conformance.backends.jax_cache import jax_cache_for_run, jax_cache_mode

    directory = jax_cache_for_run(jax_cache_mode(), own_code=False)
    if directory is not None:
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(directory))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytest(tmp_path_factory):
    """The kit's runs that these tests start, in process or not, keep a failing case's
    inputs in a new temporary folder where no --repro-dir is given (a user's run keeps
    them for the user); under pytest's own base folder, which pytest prunes, they do not
    pile up in the system's temporary folder."""
    import tempfile

    folder = tmp_path_factory.mktemp("temporary")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", str(folder))
        yield


@pytest.fixture
def registry(monkeypatch):
    """A fresh backend registry for one test: what the test registers is forgotten after it."""
    from conformance import backends
    from conformance.adapters import impl
    from conformance.backends import registry as backend_registry

    fresh = backends.Registry(backends.BUILTIN)
    # The registry module's own name is the one its functions read; the package's
    # re-export is patched too, for code that reads ``conformance.backends.REGISTRY``.
    monkeypatch.setattr(backend_registry, "REGISTRY", fresh)
    monkeypatch.setattr(backends, "REGISTRY", fresh)
    monkeypatch.setattr(impl, "LOADERS", {})
    return fresh


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """``once(name, build)``: a directory that ``build`` fills a single time per test run.

    Under pytest-xdist the workers share the parent of their base temporary directories;
    the first worker to take the lock builds while the others wait, so a slow setup (a
    wheel in a fresh venv, a measurement of the installed frameworks) is paid once."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent

    def get(name: str, build: Callable[[Path], None]) -> Path:
        work = base / name
        with _locked(base / f"{name}.lock"):
            if not (work / ".ready").exists():
                if work.exists():
                    shutil.rmtree(work)
                work.mkdir()
                build(work)
                (work / ".ready").write_text("")
        return work

    return get


@contextmanager
def _locked(path: Path):
    try:
        import fcntl
    except ImportError:  # Windows: each pytest-xdist worker builds its own copy
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
