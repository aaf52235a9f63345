"""The pytest plugin: choose backends explicitly, name them in every test id.

    pytest conformance --backend numpy --backend jax
    pytest conformance --backend all          # every installed backend
    pytest conformance --impl mypkg.attn:attention --impl-capabilities window,gqa
    pytest conformance --impl mypkg.attn:MyBackend --known-failures mine.txt

No ``--backend`` (and no ``--impl``) is a usage error, and so is a backend that cannot be
loaded: a conformance run that tested nothing must never look green.

``--impl`` plugs in your own implementation (``conformance/plugins.py``): a function with
the spec's signature, NumPy in and out, declaring the capabilities and dtypes you list,
or a ``conformance.Backend``. ``--known-failures FILE`` marks the tests it lists as
expected failures (strict: a fixed one fails until its line is removed), with a warning
for ids that match no test.

Every failing test carries a snippet that replays its last calls to ``attention``, with
the inputs saved to ``--repro-dir`` (default: a temporary directory).

Property-based tests (``test_properties.py``) use the Hypothesis profile "quick" (the
default: 25 examples per test, derandomized, so a run is repeatable) or "deep" (500 random
examples): ``--hypothesis-profile deep``.
"""

from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from conformance import plugins
from conformance.backends import (
    BackendUnavailable,
    available_backends,
    load_backend,
    registered_backends,
)

# Registered on import, before Hypothesis' own plugin reads --hypothesis-profile.
settings.register_profile(
    "quick",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "deep",
    max_examples=500,
    deadline=None,
    # Explicit: under CI=true Hypothesis' own defaults derandomize, and a deep run should
    # draw new examples each time.
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("quick")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance")
    group.addoption(
        "--backend",
        action="append",
        default=[],
        help="backend to test (repeatable or comma-separated); 'all' = every installed one",
    )
    group.addoption(
        "--impl",
        default=None,
        metavar="MODULE:ATTR",
        help="your implementation: a function with the spec's signature (NumPy in and out) "
        "or a conformance.Backend subclass or instance, e.g. examples.my_attention:attention",
    )
    group.addoption(
        "--impl-capabilities",
        default=None,
        metavar="CAP,...",
        help="the optional capabilities an --impl function implements (default: none, the "
        "core only; 'all' = every one a function can have): "
        + ", ".join(sorted(plugins.FUNCTION_CAPABILITIES)),
    )
    group.addoption(
        "--impl-dtypes",
        default=None,
        metavar="DTYPE,...",
        help="the dtypes an --impl function accepts (default: float64,float32; 'all')",
    )
    group.addoption(
        "--impl-name",
        default=None,
        help="the --impl backend's name in test ids (default: module.function)",
    )
    group.addoption(
        "--known-failures",
        default=None,
        metavar="FILE",
        help="tests expected to fail: one 'test_id  # reason' per line (strict xfail)",
    )
    group.addoption(
        "--repro-dir",
        default=None,
        metavar="DIR",
        help="where a failing test saves the inputs of its last calls (default: a temp dir)",
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


def _load_impl(config: pytest.Config) -> str | None:
    spec = config.getoption("--impl")
    if spec is None:
        for flag in ("--impl-capabilities", "--impl-dtypes", "--impl-name"):
            if config.getoption(flag) is not None:
                raise pytest.UsageError(f"{flag} describes an --impl; give --impl MODULE:ATTR")
        return None
    try:
        backend = plugins.load_impl(
            spec,
            name=config.getoption("--impl-name"),
            capabilities=config.getoption("--impl-capabilities"),
            dtypes=config.getoption("--impl-dtypes"),
        )
    except (BackendUnavailable, ValueError) as err:
        raise pytest.UsageError(str(err)) from err
    return backend.name


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clause(number): the SPEC.md clause a test checks")
    config.addinivalue_line("markers", "pairwise: compares every pair of selected backends")
    impl = _load_impl(config)
    names = selected_backends(config)
    if impl is not None:
        names = list(dict.fromkeys([*names, impl]))
    if not names:
        raise pytest.UsageError(
            "choose the backends to test with --backend NAME (repeatable), --backend all, "
            "or your own with --impl MODULE:FUNCTION; "
            f"registered: {registered_backends()}, installed here: {available_backends()}"
        )
    for name in names:
        try:
            load_backend(name)
        except BackendUnavailable as err:
            raise pytest.UsageError(str(err)) from err
    config.conformance_backends = names
    path = config.getoption("--known-failures")
    try:
        config.conformance_known_failures = plugins.read_known_failures(path) if path else {}
    except (OSError, ValueError) as err:
        raise pytest.UsageError(f"--known-failures: {err}") from err


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.config.conformance_backends
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", names, ids=names, indirect=True)
    if "backend_pair" in metafunc.fixturenames:
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
        metafunc.parametrize(
            "backend_pair", pairs, ids=[f"{a}~{b}" for a, b in pairs], indirect=True
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the known failures as strict xfails; warn about entries that match no test.

    Runs before -k and -m deselect anything, so an entry is stale only if no test of the
    suite has that id.
    """
    known = config.conformance_known_failures
    if not known:
        return
    used: set[str] = set()
    for item in items:
        keys = plugins.known_failure_keys(item.nodeid, getattr(item, "originalname", None))
        hits = sorted(keys & known.keys())
        if hits:
            used.update(hits)
            reason = "; ".join(known[h] for h in hits)
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"known failure: {reason}"))
    stale = [test_id for test_id in known if test_id not in used]
    if stale:
        warnings.warn(
            plugins.StaleKnownFailure(
                f"{len(stale)} known-failures entr{'y' if len(stale) == 1 else 'ies'} in "
                f"{config.getoption('--known-failures')} match{'es' if len(stale) == 1 else ''} no test: {stale}"
            ),
            stacklevel=1,
        )


@pytest.fixture
def backend(request: pytest.FixtureRequest):
    return plugins.RecordingBackend(load_backend(request.param), _call_log(request.node))


@pytest.fixture
def backend_pair(request: pytest.FixtureRequest):
    log = _call_log(request.node)
    return tuple(plugins.RecordingBackend(load_backend(name), log) for name in request.param)


def _call_log(item: pytest.Item):
    if not hasattr(item, "attention_calls"):
        item.attention_calls = plugins.new_call_log()
    return item.attention_calls


def _repro_dir(config: pytest.Config) -> Path:
    if not hasattr(config, "conformance_repro_dir"):
        given = config.getoption("--repro-dir")
        if given:
            path = Path(given)
            path.mkdir(parents=True, exist_ok=True)
        else:
            path = Path(tempfile.mkdtemp(prefix="attention-conformance-repro-"))
        config.conformance_repro_dir = path
    return config.conformance_repro_dir


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test gets a section that replays its last calls to ``attention``."""
    outcome = yield
    rep = outcome.get_result()
    calls = getattr(item, "attention_calls", None)
    if rep.when != "call" or not rep.failed or not calls:
        return
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name)[:150]
    path = _repro_dir(item.config) / f"{name}.npz"
    try:
        lines = plugins.save_calls(path, sorted(calls, key=lambda c: c[0]))
    except Exception as err:  # the test's own failure matters more than the replay
        text = f"could not save the inputs for a replay: {err!r}"
    else:
        text = plugins.replay_snippet(path, lines)
    rep.user_properties.append(("reproduce", text))
    if hasattr(rep.longrepr, "addsection"):
        rep.longrepr.addsection("reproduce", text)
