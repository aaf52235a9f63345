"""The conformance tests' fixtures: every test runs once per chosen backend, named in its id.

The options and the loading of backends are the plugin's (``conformance/plugin.py``);
this file only exists where the conformance tests are collected, so nothing here reaches
another project's test run.
"""

from __future__ import annotations

import pytest

from conformance import backends, replay
from conformance.plugin import conformance_backend


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.config.conformance_backends
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", names, ids=names, indirect=True)
    if "backend_pair" in metafunc.fixturenames:
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
        metafunc.parametrize(
            "backend_pair", pairs, ids=[f"{a}~{b}" for a, b in pairs], indirect=True
        )


@pytest.fixture(autouse=True, scope="module")
def _release_after_each_module():
    """After each test module, every loaded backend drops what it keeps from earlier calls
    (``Backend.release``): a process that keeps every compiled program can run out of
    memory mappings long before the run ends."""
    yield
    for loaded in backends.REGISTRY.loaded():
        loaded.release()


@pytest.fixture
def backend(request: pytest.FixtureRequest):
    return replay.RecordingBackend(conformance_backend(request.param), _call_log(request.node))


@pytest.fixture
def backend_pair(request: pytest.FixtureRequest):
    log = _call_log(request.node)
    return tuple(replay.RecordingBackend(conformance_backend(n), log) for n in request.param)


def _call_log(item: pytest.Item):
    if not hasattr(item, "backend_calls"):
        item.backend_calls = replay.new_call_log()
    return item.backend_calls
