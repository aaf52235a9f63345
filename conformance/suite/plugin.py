"""The pytest plugin (entry point ``pytest11``): choose backends explicitly, name them in
every test id.

    pytest --pyargs conformance --backend numpy --backend jax     # from any directory
    pytest --pyargs conformance --backend all                     # every installed backend
    pytest --pyargs conformance --impl mypkg.attn:attention --impl-capabilities window,gqa
    pytest conformance --impl mypkg.attn:MyBackend --known-failures mine.txt   # in a checkout
    pytest conformance --impl mylib:attend --impl-framework torch --impl-layout BTHD
    pytest conformance --impl-profile torch.sdpa --impl-profile mine.toml      # profiles

Installing the distribution registers this module with pytest, so the options exist in
every pytest run; in another project's run the plugin does nothing unless asked
(``--backend``/``--impl``, or collecting the ``conformance`` tests). Running the
conformance tests with no ``--backend`` (and no ``--impl``) is a usage error, and so is a
backend that cannot be loaded: a conformance run that tested nothing must never look green.

``--impl`` plugs in your own implementation (``conformance/adapters/impl.py``): a function with
the spec's signature, NumPy in and out, declaring the capabilities and dtypes you list,
or a ``conformance.Backend``; ``--impl-framework``/``--impl-layout`` call a function on
its framework's arrays in its layout (``conformance/adapters/native.py``), and ``--impl-profile``
runs a library function a profile describes (``conformance/profiles``), with the known
failures the profile lists. ``--known-failures FILE`` marks the tests it lists as
expected failures (strict: a fixed one fails until its line is removed), with a warning
for ids that match no test.

Every failing test carries a snippet that replays its last calls to ``attention``, with
the inputs saved to ``--repro-dir`` (default: a temporary directory).

Property-based tests (``test_properties.py``) use the Hypothesis profile "quick" (the
default: 25 examples per test, derandomized, the first failure only, so a run is
repeatable) or "deep" (500 random
examples): ``--hypothesis-profile deep``.
"""

from __future__ import annotations

import json
import re
import tempfile
import warnings
from pathlib import Path

import pytest

from conformance.adapters import impl
from conformance.adapters.domain import domain_flags
from conformance.backends import (
    BUILTIN,
    BackendUnavailable,
    available_backends,
    registered_backends,
)
from conformance.suite import (
    behaviours,
    compiles,
    device_summary,
    domain_summary,
    known_failures,
    oracle_store,
    replay,
    rootdir,
    scheduling,
    verdicts,
)
from conformance.suite.clauses import clause_titles

# A user's function that kills its process fails one test (SPEC §13.13): these hooks
# belong to this plugin, so they live wherever it is loaded.
from conformance.suite.isolation import (  # noqa: F401
    end_after_device_error,
    pytest_cmdline_main,
    pytest_configure_node,
    pytest_handlecrashitem,
    pytest_runtest_protocol,
    pytest_runtestloop,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_unconfigure,
)
from conformance.suite.nodeids import ids_carry_their_module

# The plugin's command-line options live on a page of their own; the hook is this plugin's.
from conformance.suite.options import (
    IMPL_FLAGS,
    draws_independent_of_loaded_modules,
    property_tests_use_the_runs_profile,
    pytest_addoption,  # noqa: F401
    register_hypothesis_profiles,
)

# What a run selects, its backends as tested and its layers, lives on a page of its own too.
from conformance.suite.selection import (
    _BACKEND_OPTIONS,
    LAYER_CHOICE,
    backend_options,
    chosen_layers,
    conformance_backend,
    deselect_other_layers,
)

#: What the plugin keeps for a run, in pytest's stash: the backends under test, the
#: known failures listed by ``--known-failures``, the profiles (loaded, unavailable), and
#: the directory of the saved failing calls.
BACKENDS = pytest.StashKey[list]()
KNOWN_FAILURES = pytest.StashKey[dict]()
PROFILES = pytest.StashKey[tuple]()
REPRO_DIR = pytest.StashKey[Path]()
#: The name of the plugin that counts the JAX programs (``compiles.ProgramCounter``).
COUNTER = "conformance-programs-compiled"


def conformance_backends(config: pytest.Config) -> list[str]:
    """The names of the backends this run tests (none when it chose none)."""
    return config.stash.get(BACKENDS, [])


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Keep the rootdir where it would be without this plugin's options.

    pytest picks its rootdir (and its ini file) before it loads this plugin, so the value
    of ``--impl-profile PATH`` (or ``--known-failures``, ``--repro-dir``), written with a
    space, is taken for a test path then, and the rootdir moves to that file's folder.
    Now that the options are known, the choice is made again without their values: the
    rootdir is set back where ``--impl-profile=PATH`` would have left it. Had the stray
    path also chosen another ini file, that cannot be undone here, and the run stops
    saying so.
    """
    settled = rootdir.setup_without_option_values(early_config)
    rootdir.initial_conftests_of_the_installed_suite(early_config)
    if settled is None:
        return
    rootpath, inipath = settled
    if inipath != early_config.inipath:
        raise pytest.UsageError(
            f"pytest read its configuration from {early_config.inipath} because an option's "
            f"value was taken for a test path; write the plugin's options with '=' "
            f"(--impl-profile=PATH, --known-failures=FILE, --repro-dir=DIR)"
        )
    if rootpath != early_config.rootpath:
        namespace = early_config.known_args_namespace
        if namespace.confcutdir == str(early_config.rootpath):
            namespace.confcutdir = str(rootpath)
        early_config._rootpath = rootpath
        early_config._parser.extra_info["rootdir"] = str(rootpath)


def selected_backends(config: pytest.Config) -> list[str]:
    names: list[str] = []
    for value in config.getoption("--backend"):
        for name in value.split(","):
            name = name.strip()
            if name == "all":
                names += available_backends(sharded=False)
            elif name:
                names.append(name)
    return list(dict.fromkeys(names))


def _load_impl(config: pytest.Config) -> str | None:
    spec = config.getoption("--impl")
    if spec is None:
        for flag in IMPL_FLAGS:
            if config.getoption(flag) is not None:
                raise pytest.UsageError(f"{flag} describes an --impl; give --impl MODULE:ATTR")
        return None
    try:
        backend = impl.load_impl(
            spec,
            name=config.getoption("--impl-name"),
            capabilities=config.getoption("--impl-capabilities"),
            dtypes=config.getoption("--impl-dtypes"),
            framework=config.getoption("--impl-framework") or "numpy",
            layout=config.getoption("--impl-layout") or "BHTD",
            causal=config.getoption("--impl-causal"),
            mask=config.getoption("--impl-mask"),
            domain=domain_flags(config.getoption("--impl-domain") or ()),
            device=config.getoption("--impl-device"),
        )
    except (BackendUnavailable, ValueError) as err:
        raise pytest.UsageError(str(err)) from err
    return backend.name


def _load_profiles(config: pytest.Config) -> list[str]:
    """Register the ``--impl-profile`` backends; return their names (those skipped for a
    missing library included: their tests are marked skipped, by name)."""
    from conformance.adapters import profiles

    try:
        loaded, unavailable = profiles.load_profiles(config.getoption("--impl-profile"))
    except (profiles.ProfileError, BackendUnavailable, ValueError) as err:
        raise pytest.UsageError(str(err)) from err
    config.stash[PROFILES] = (loaded, unavailable)
    return [p.name for p in [*loaded, *unavailable]]


def conformance_requested(config: pytest.Config) -> bool:
    """Whether this pytest run asked for the conformance suite (--backend or --impl)."""
    return (
        bool(config.getoption("--backend"))
        or config.getoption("--impl") is not None
        or bool(config.getoption("--impl-profile"))
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Load the chosen backends; in a run that chose none, change nothing.

    Runs before Hypothesis' own plugin reads ``--hypothesis-profile``, so the suite's
    profiles "quick" (the default) and "deep" exist by then.
    """
    config.addinivalue_line("markers", "clause(number): the SPEC.md clause a test checks")
    config.addinivalue_line("markers", "pairwise: compares every pair of selected backends")
    config.addinivalue_line(
        "markers", "requires(*capabilities): what the test's calls use (skipped where undeclared)"
    )
    config.addinivalue_line("markers", "dtypes(*names): the dtypes of a parameter set's arrays")
    config.addinivalue_line(
        "markers", "refusal: the test passes what a backend may not declare, to see it refused"
    )
    config.addinivalue_line(
        "markers", "refuses(capability): runs where the backend does not declare it (SPEC §8.5)"
    )
    config.stash[BACKENDS] = []
    config.stash[KNOWN_FAILURES] = {}
    if not conformance_requested(config):
        _load_impl(config)  # only to refuse --impl-* flags without an --impl
        if config.getoption("--check-programs") is not None:
            # The project's own tests, held to their record of JAX programs.
            config.pluginmanager.register(compiles.program_counter(config), COUNTER)
        if config.getoption("--known-failures") is not None:
            raise pytest.UsageError(
                "--known-failures describes a conformance run; give --backend NAME or --impl "
                "MODULE:ATTR"
            )
        return
    register_hypothesis_profiles()
    draws_independent_of_loaded_modules()
    if config.getoption("hypothesis_profile", None) is None:
        from hypothesis import settings

        settings.load_profile("quick")
    impl_name = _load_impl(config)
    _BACKEND_OPTIONS.clear()
    _BACKEND_OPTIONS.update(backend_options(config.getoption("--backend-option")))
    names = selected_backends(config)
    if impl_name is not None:
        names = list(dict.fromkeys([*names, impl_name]))
    names = list(dict.fromkeys([*names, *_load_profiles(config)]))
    loaded = []
    for name in names:
        try:
            loaded.append(conformance_backend(name))
        except BackendUnavailable as err:
            raise pytest.UsageError(str(err)) from err
    config.stash[BACKENDS] = names
    compiles.configure_jax_cache(config, loaded, own_code=_tests_own_code(config, loaded))
    oracle_store.configure(config)
    config.pluginmanager.register(compiles.program_counter(config), COUNTER)
    config.stash[LAYER_CHOICE] = chosen_layers(config)
    if not hasattr(config, "workerinput"):
        summary = verdicts.Summary(config, names, config.stash[LAYER_CHOICE])
        config.pluginmanager.register(summary, "conformance-verdicts")
    config.pluginmanager.register(domain_summary.DomainSummary(loaded), "conformance-domain")
    if not hasattr(config, "workerinput"):
        devices = device_summary.DeviceSummary(loaded)
        config.pluginmanager.register(devices, "conformance-device")
    path = config.getoption("--known-failures")
    try:
        config.stash[KNOWN_FAILURES] = known_failures.read_known_failures(path) if path else {}
    except (OSError, ValueError) as err:
        raise pytest.UsageError(f"--known-failures: {err}") from err


def _tests_own_code(config: pytest.Config, backends: list) -> bool:
    """Whether the run tests code of the user's: a backend that is neither a shipped one
    nor a shipped profile's (an ``--impl``, a profile of theirs, one they registered)."""
    from conformance.adapters import profiles

    loaded, unavailable = config.stash.get(PROFILES, ([], []))
    shipped = profiles.HERE.resolve()
    ours = {p.name for p in [*loaded, *unavailable] if p.path.resolve().parent == shipped}
    return any(b.name not in ours and type(b) is not BUILTIN.get(b.name) for b in backends)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``--dist loadscope``, a conformance run's work unit is one test function on
    one backend, whose parametrizations share compiled programs (``scheduling``)."""
    backends = conformance_backends(config)
    if config.getvalue("dist") != "loadscope" or not backends:
        return None
    return scheduling.scheduler(config, log, backends)


def _usage_error_without_backends(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The conformance tests were collected, but no backend was chosen: stop with pytest's
    usage-error exit code, before anything runs."""
    ours = any(
        getattr(getattr(item, "module", None), "__name__", "").startswith("conformance.tests.")
        for item in items
    )
    if ours and not conformance_backends(config):
        pytest.exit(
            "usage error: choose the backends to test with --backend NAME (repeatable), --backend all, "
            "or your own with --impl MODULE:FUNCTION; "
            f"registered: {registered_backends()}, installed here: {available_backends()}",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the known failures as strict xfails; warn about entries that match no test.

    Runs before -k and -m deselect anything, so an entry is stale only if no test of the
    suite has that id.
    """
    ids_carry_their_module(items)
    _usage_error_without_backends(config, items)
    if conformance_requested(config):
        property_tests_use_the_runs_profile(items)
        deselect_other_layers(config, items)
    if config.getoption("--ignore-known-failures"):
        _mark_profile_items(config, items, known=False)
        return
    _mark_profile_items(config, items)
    known = config.stash.get(KNOWN_FAILURES, {})
    if not known:
        return
    stale = known_failures.mark_listed(items, known)
    if stale:
        warnings.warn(
            known_failures.StaleKnownFailure(
                f"{len(stale)} known-failures entr{'y' if len(stale) == 1 else 'ies'} in "
                f"{config.getoption('--known-failures')} match{'es' if len(stale) == 1 else ''} no test: {stale}"
            ),
            stacklevel=1,
        )


def _mark_profile_items(config: pytest.Config, items: list[pytest.Item], known=True) -> None:
    """Profiles' known failures become strict xfails (unless ``known`` is False); an
    unavailable profile's tests are skipped by name; a known failure that matches no test
    is a ``StaleKnownFailure``."""
    loaded, unavailable = config.stash.get(PROFILES, ([], []))
    if not loaded and not unavailable:
        return
    stale = known_failures.mark_profiles(
        items, loaded, unavailable, known=known, every_test=config.getoption("--every-test")
    )
    if stale:
        warnings.warn(
            known_failures.StaleKnownFailure(
                f"{len(stale)} profile known-failure entr{'y' if len(stale) == 1 else 'ies'} "
                f"match{'es' if len(stale) == 1 else ''} no test: {stale}"
            ),
            stacklevel=1,
        )


def _repro_dir(config: pytest.Config) -> Path:
    if REPRO_DIR not in config.stash:
        given = config.getoption("--repro-dir")
        if given:
            path = Path(given)
            path.mkdir(parents=True, exist_ok=True)
        else:
            path = Path(tempfile.mkdtemp(prefix="attention-conformance-repro-"))
        config.stash[REPRO_DIR] = path
    return config.stash[REPRO_DIR]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test (a known failure too) gets its behaviour, the one sentence that says
    what the function did (``conformance.suite.behaviours``), and, unless it was expected, a
    section that replays its last calls. The outermost wrapper, so it sees the report after
    a known failure became an xfail: an expected failure writes no replay."""
    outcome = yield
    rep = outcome.get_result()
    end_after_device_error(item, call)  # SPEC §13.20: the next test in a fresh process
    if _ours(item) and (rep.when == "call" or not rep.passed):
        departs = rep.failed or hasattr(rep, "wasxfail")
        rep.user_properties.append((verdicts.LABEL, json.dumps(verdicts.label(item, departs))))
    # A test that passed where it may fail (non-strict xfail: on some processors) passed.
    if rep.when != "call" or not (rep.failed or (rep.skipped and hasattr(rep, "wasxfail"))):
        return
    calls = replay.logged_calls(item)
    marker = item.get_closest_marker("clause")
    clause = marker.args[0] if marker else None
    err = call.excinfo.value if call.excinfo is not None else None
    found = behaviours.behaviour(err, calls, clause, clause_titles().get(clause or "", ""))
    rep.user_properties.append((behaviours.PROPERTY, found))
    rep.user_properties.append((behaviours.FEATURES, json.dumps(behaviours.call_features(calls))))
    rep.user_properties.append(
        (behaviours.MISREADINGS, json.dumps(behaviours.misreadings(err, calls)))
    )
    located = behaviours.where(err, calls)
    if located:
        rep.user_properties.append((behaviours.WHERE, located))
        found = f"{found}\n{located}"
    if not rep.failed:
        return
    text, path, lines = "", "", []
    if calls:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name)[:150]
        path = _repro_dir(item.config) / f"{name}.npz"
        received = replay.received(calls)
        try:
            lines = replay.save_calls(path, calls)
        except Exception as err:  # the test's own failure matters more than the replay
            text, path = f"could not save the inputs for a replay: {err!r}", ""
            lines = [text]
        else:
            text = replay.replay_snippet(path, lines, received)
            lines = [f"  [{i - len(lines)}] {line}" for i, line in enumerate(lines)]
            if received:
                lines.append(f"  [-1] as the function received it: {received}")
        rep.user_properties.append(("reproduce", text))
    # A strict XPASS has no exception: pytest's one line says it all.
    if item.config.option.tbstyle == "auto" and _ours(item) and call.excinfo is not None:
        _shorten(rep, item, call, found, lines, str(path))
    elif hasattr(rep.longrepr, "addsection"):
        rep.longrepr.addsection("behaviour", found)
        if text:
            rep.longrepr.addsection("reproduce", text)


def _ours(item: pytest.Item) -> bool:
    """Whether ``item`` is one of the suite's tests, in a conformance run."""
    module = getattr(getattr(item, "module", None), "__name__", "")
    return module.startswith("conformance.tests.") and bool(conformance_backends(item.config))


def _shorten(rep, item: pytest.Item, call: pytest.CallInfo, found: str, calls, path) -> None:
    """pytest's default traceback style gives a conformance failure in at most 15 lines,
    its finding first (``verdicts.short_failure``); another ``--tb`` gives pytest's own."""
    from _pytest._code.code import ExceptionChainRepr, ReprTracebackNative

    rerun = verdicts.label(item)["rerun"]
    text = verdicts.short_failure(item, call.excinfo, found, calls, path, rerun)
    crash = getattr(rep.longrepr, "reprcrash", None)
    lines = [line + "\n" for line in text.splitlines()]
    rep.longrepr = ExceptionChainRepr([(ReprTracebackNative(lines), crash, None)])
