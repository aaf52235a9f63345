"""SPEC §10: the programmatic entry point and its loud failures."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import conformance
from conformance import BackendUnavailable, available_backends, load_backend

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.mark.clause("10.1")
def test_readme_example_lists_what_available_backends_returns():
    """The README's "Using it from code" shows the real lists (with every extra installed,
    as in the project env)."""
    text = (ROOT / "README.md").read_text()
    for call, listed in (
        ("available_backends()", available_backends()),
        ("available_backends(sharded=False)", available_backends(sharded=False)),
    ):
        line = text.split(f"\n{call}", 1)[1].split("\n# ", 1)[1].split("\n", 1)[0]
        assert line == repr(listed), (call, line)


@pytest.mark.clause("10.1")
def test_available_backends_lists_the_builtins():
    assert set(available_backends()) >= {
        "numpy",
        "jax",
        "torch-naive",
        "torch-module",
        "torch-sdpa",
    }


@pytest.mark.clause("10.1")
@pytest.mark.parametrize("name", ["numpy", "jax", "torch-naive", "torch-module", "torch-sdpa"])
def test_backend_takes_and_returns_numpy(name):
    b = load_backend(name)
    q = np.ones((1, 1, 2, 3))
    out = b.attention(q, q, q, is_causal=True)
    assert type(out) is np.ndarray and out.shape == (1, 1, 2, 3)
    assert set(b.capabilities) <= set(conformance.CAPABILITIES) and set(b.dtypes) <= set(
        conformance.DTYPES
    )


@pytest.mark.clause("10.2")
def test_unknown_backend_lists_what_is_available():
    with pytest.raises(
        BackendUnavailable, match=r"unknown backend 'mlx'.*registered backends are \[.*'numpy'"
    ):
        load_backend("mlx")


@pytest.mark.clause("10.2")
def test_uninstalled_backend_is_an_error(registry):
    def broken():
        raise ImportError("No module named 'jax'")

    registry.register("jax-broken", broken)
    with pytest.raises(
        BackendUnavailable, match=r"jax-broken.*cannot be loaded.*No module named 'jax'"
    ):
        load_backend("jax-broken")


@pytest.mark.clause("10.2")
@pytest.mark.parametrize(
    "args, message",
    [([], "choose the backends"), (["--backend", "nope"], "unknown backend 'nope'")],
)
def test_pytest_without_a_valid_backend_fails(args, message):
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance", "-q", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 4, run.stdout + run.stderr
    assert message in run.stdout + run.stderr


@pytest.mark.clause("10.3")
def test_import_does_not_load_frameworks():
    code = "import sys, conformance, conformance.report.command; print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "[]"


@pytest.mark.clause("10.3")
def test_conformance_never_branches_on_backend_names():
    """The tests decide from capabilities: no backend's name appears in them."""
    names = [
        "numpy",
        "jax",
        "torch-naive",
        "torch-module",
        "torch-sdpa",
        "numpy-flash",
        "jax-flash",
    ]
    for path in (ROOT / "conformance" / "tests").glob("*.py"):
        text = path.read_text()
        for name in names:
            assert f'"{name}"' not in text and f"'{name}'" not in text, (
                f"{path.name} names backend {name}"
            )


@pytest.mark.clause("10.4")
def test_load_backend_defaults_are_what_users_get():
    """Without options a backend is the fast default; the suite's tiles are an option."""
    import inspect

    from conformance.impls.numpy import flash as numpy_flash

    from conformance.suite.plugin import conformance_backend

    default = load_backend("numpy-flash")
    assert default.options == {}
    tiled = load_backend("numpy-flash", block_q=4, block_k=8)
    assert tiled is not default and tiled.options == {"block_q": 4, "block_k": 8}
    assert load_backend("numpy-flash", block_q=4, block_k=8) is tiled
    assert conformance_backend("numpy-flash") is tiled
    assert conformance_backend("numpy") is load_backend("numpy")
    # The default configuration really is the impl's own defaults, and it tiles the work.
    params = inspect.signature(numpy_flash.attention).parameters
    assert params["block_q"].default >= 64 and params["block_k"].default >= 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 37, 8)) for _ in range(3))
    assert np.allclose(default.attention(q, k, v), tiled.attention(q, k, v), rtol=0, atol=1e-13)


@pytest.mark.clause("10.4")
def test_unknown_backend_option_is_a_type_error():
    with pytest.raises(TypeError, match=r"'numpy' does not take the options \['block_q'\]"):
        load_backend("numpy", block_q=4)


@pytest.mark.clause("10.4")
def test_the_run_releases_every_loaded_backend_after_each_module(registry):
    """After each test module the conformance run calls ``release()`` on every backend it
    loaded, so a backend can drop compiled programs before they exhaust the process."""
    from pathlib import Path

    from conformance.backends import NumpyBackend

    released: list[str] = []

    class Releasing(NumpyBackend):
        name = "releasing-numpy"

        def release(self) -> None:
            released.append(self.name)

    registry.register(Releasing.name, Releasing)
    suite = Path(conformance.__file__).resolve().parent / "tests"
    code = pytest.main(
        [
            str(suite / "test_invariants.py"),
            str(suite / "test_fixtures.py"),
            "--backend",
            Releasing.name,
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "shapes_and_dtypes or worked_example",
        ]
    )
    assert code == 0
    assert released == [Releasing.name, Releasing.name]  # one per module that ran
