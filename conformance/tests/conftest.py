"""The conformance tests' fixtures: every test runs once per chosen backend, named in its id.

The options and the loading of backends are the plugin's (``conformance/suite/plugin.py``);
this file only exists where the conformance tests are collected, so nothing here reaches
another project's test run. What a test needs is declared beside it
(``conformance/suite/requirements.py``); here the harness turns each need a backend does not
declare into a skip that names it, before the test runs.
"""

from __future__ import annotations

import json

import pytest

from conformance import backends
from conformance.suite import replay
from conformance.suite.domain_summary import EXERCISED_PROPERTY
from conformance.suite.plugin import conformance_backend, conformance_backends
from conformance.suite.quantized import EXERCISED, outside_sections
from conformance.suite.requirements import common_dtype, declared_refusal, item_needs, lacking


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = conformance_backends(metafunc.config)
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", names, ids=names, indirect=True)
    if "backend_pair" in metafunc.fixturenames:
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
        metafunc.parametrize(
            "backend_pair", pairs, ids=[f"{a}~{b}" for a, b in pairs], indirect=True
        )


def _backend_names(item: pytest.Item) -> list[str]:
    params = getattr(getattr(item, "callspec", None), "params", {})
    pair, single = params.get("backend_pair"), params.get("backend")
    return list(pair) if isinstance(pair, tuple) else [single] if single else []


def _shard_count(item: pytest.Item) -> int:
    return getattr(getattr(item, "callspec", None), "params", {}).get("P", 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, by name, every test whose declared needs a backend of it does not declare.

    Within a module, tests that run a backend at P shards are put in order of P: a
    torch.distributed backend starts P worker processes for each new P and keeps only two
    such pools, so tests that alternate between device counts would start one per test
    (xdist's ``--dist load`` hands each worker consecutive tests, so the order survives)."""
    module_order = {m: i for i, m in enumerate(dict.fromkeys(item.module for item in items))}
    items.sort(key=lambda item: (module_order[item.module], _shard_count(item)))
    for item in items:
        names = _backend_names(item)
        if not names:
            continue
        try:
            caps, dtypes = item_needs(item)
        except ValueError as err:
            raise pytest.UsageError(f"{item.nodeid}: {err}") from err
        loaded = [conformance_backend(name) for name in names]
        # A backend of some sections only (SPEC §20's) skips the others by that name first.
        why = next((w for b in loaded if (w := outside_sections(b, item))), None)
        why = why or next((w for b in loaded if (w := lacking(b, caps, dtypes))), None)
        why = why or next((w for b in loaded if (w := declared_refusal(b, item))), None)
        if why is None and "dtype" in getattr(item, "fixturenames", ()):
            if common_dtype(loaded) is None:
                why = f"{' and '.join(names)} declare no dtype in common"
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """What the test's quantized calls handed each backend, on its report (the run's end
    may be another process's, under xdist): the summary lists what no call exercised."""
    outcome = yield
    if call.when != "call" or not EXERCISED:
        return
    report = outcome.get_result()
    for name, words in EXERCISED:
        report.user_properties.append((EXERCISED_PROPERTY, json.dumps([name, words])))
    EXERCISED.clear()


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
    return _recording(request, conformance_backend(request.param))


@pytest.fixture
def backend_pair(request: pytest.FixtureRequest):
    return tuple(_recording(request, conformance_backend(n)) for n in request.param)


@pytest.fixture
def dtype(request: pytest.FixtureRequest) -> str:
    """For a test without a dtype parameter: the most precise dtype its backends declare."""
    names = _backend_names(request.node)
    return common_dtype(conformance_backend(n) for n in names) or "float64"


def _recording(request: pytest.FixtureRequest, backend) -> replay.RecordingBackend:
    """The backend as the test sees it: its calls are logged for a replay, and a call with
    anything the backend does not declare is stopped as the suite's error (unless the test
    is marked ``refusal``: it checks that such a call is refused)."""
    return replay.RecordingBackend(
        backend,
        replay.call_log(request.node),
        guard=all(request.node.get_closest_marker(n) is None for n in ("refusal", "refuses")),
    )
