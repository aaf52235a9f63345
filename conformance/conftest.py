"""The pytest plugin: choose backends explicitly, name them in every test id.

    pytest conformance --backend numpy --backend jax
    pytest conformance --backend all          # every installed backend

No ``--backend`` is a usage error, and so is a backend that cannot be loaded: a
conformance run that tested nothing must never look green.
"""

from __future__ import annotations

import pytest

from conformance.backends import (
    BackendUnavailable,
    available_backends,
    load_backend,
    registered_backends,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance")
    group.addoption(
        "--backend",
        action="append",
        default=[],
        help="backend to test (repeatable or comma-separated); 'all' = every installed one",
    )


def selected_backends(config: pytest.Config) -> list[str]:
    names: list[str] = []
    for value in config.getoption("--backend"):
        for name in value.split(","):
            name = name.strip()
            if name == "all":
                names += available_backends()
            elif name:
                names.append(name)
    return list(dict.fromkeys(names))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(number): the SPEC.md clause a test checks")
    config.addinivalue_line("markers", "pairwise: compares every pair of selected backends")
    names = selected_backends(config)
    if not names:
        raise pytest.UsageError(
            "choose the backends to test with --backend NAME (repeatable) or --backend all; "
            f"registered: {registered_backends()}, installed here: {available_backends()}"
        )
    for name in names:
        try:
            load_backend(name)
        except BackendUnavailable as err:
            raise pytest.UsageError(str(err)) from err
    config.conformance_backends = names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.config.conformance_backends
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", names, ids=names, indirect=True)
    if "backend_pair" in metafunc.fixturenames:
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
        metafunc.parametrize(
            "backend_pair", pairs, ids=[f"{a}~{b}" for a, b in pairs], indirect=True
        )


@pytest.fixture
def backend(request: pytest.FixtureRequest):
    return load_backend(request.param)


@pytest.fixture
def backend_pair(request: pytest.FixtureRequest):
    return tuple(load_backend(name) for name in request.param)
