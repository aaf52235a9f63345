"""The plugin's command-line options (``pytest --help``, group "conformance") and the
Hypothesis profiles of a conformance run. ``plugin.py`` registers both."""

from __future__ import annotations

import pytest

from conformance.adapters import impl


def register_hypothesis_profiles() -> None:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "quick",
        max_examples=25,
        deadline=None,
        derandomize=True,
        database=None,
        # One failure, the first drawn (then shrunk): to report several, Hypothesis keeps
        # drawing for ten seconds after the first, so which other failures a slow function
        # showed, and so the behaviour a run named, depended on the machine's speed.
        report_multiple_bugs=False,
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


def draws_independent_of_loaded_modules() -> None:
    """Derandomized examples that depend on the test alone.

    Hypothesis (6.170 measured) mixes into its draws literal constants it finds in the
    source of every loaded module outside the libraries, so the examples a derandomized
    test drew changed with what the process had imported: the report's modules, a user's
    ``--impl`` module, the next edit of this package. A property test could then pass
    under ``python -m conformance report`` and fail under ``pytest``. The suite's draws
    use Hypothesis' own constants only; a Hypothesis without the feature is left as is.
    """
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:
        return
    if hasattr(providers, "_get_local_constants"):
        none = Constants()
        providers._get_local_constants = lambda: none


def property_tests_use_the_runs_profile(items: list[pytest.Item]) -> None:
    """The suite's property tests draw as the run's profile says (``--hypothesis-profile``,
    else "quick"), whenever their module was imported.

    Hypothesis fixes a ``@given`` test's settings when its module is imported: the profile
    active then. A process that had imported ``conformance.tests.test_properties`` before a
    run began (an earlier run in the same process, a script that reads its strategies)
    ran it later under that import's profile, not the run's; under Hypothesis' default
    profile the property tests then failed a health check instead of testing the backend.
    None of the suite's property tests sets its own settings.
    """
    from hypothesis import settings

    for item in items:
        test = getattr(item, "obj", None)
        module = getattr(getattr(item, "module", None), "__name__", "")
        if module.startswith("conformance.tests.") and hasattr(
            test, "_hypothesis_internal_use_settings"
        ):
            test._hypothesis_internal_use_settings = settings.default


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance")
    _add_backend_options(group)
    _add_impl_options(group)
    _add_run_options(group)
    _add_jax_program_options(group)
    group.addoption(
        "--repro-dir",
        default=None,
        metavar="DIR",
        help="where a failing test saves the inputs of its last calls (default: a temp dir)",
    )


def _add_backend_options(group: pytest.OptionGroup) -> None:
    """What is tested: the named backends and their options."""
    group.addoption(
        "--backend",
        action="append",
        default=[],
        help="backend to test (repeatable or comma-separated); 'all' = every installed "
        "single-device one (the sharded backends run when named)",
    )
    group.addoption(
        "--backend-option",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="an option of a named backend for this run, beside its conformance options "
        "(SPEC §10.4), e.g. numpy-flash:textbook=True; VALUE is a Python literal",
    )


def _add_impl_options(group: pytest.OptionGroup) -> None:
    """A user's function (``--impl`` and how it is called) and the library profiles."""
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
        + ", ".join(sorted(impl.FUNCTION_CAPABILITIES)),
    )
    group.addoption(
        "--impl-dtypes",
        default=None,
        metavar="DTYPE,...",
        help="the dtypes an --impl function accepts (default: float64,float32; 'all')",
    )
    group.addoption(
        "--impl-framework",
        default=None,
        choices=["numpy", "torch", "jax", "auto"],
        help="the arrays an --impl function takes and returns (default: numpy; auto: from "
        "the function's module); the suite converts, keeping float16 and bfloat16",
    )
    group.addoption(
        "--impl-layout",
        default=None,
        choices=["BHTD", "BTHD"],
        help="the axis order of an --impl function's q, k, v and output (default: BHTD, the "
        "spec's; BTHD: (B, T, H, D)); the mask keeps the spec's (B, H, T, S)",
    )
    group.addoption(
        "--impl-causal",
        default=None,
        choices=list(impl.IMPL_CAUSALITY),
        help="how causality reaches an --impl function (SPEC §13.17; default: keyword, "
        "is_causal=): 'mask', built into the mask with causal_alignment, window and "
        "chunk_size; 'none': it takes none, and causal tests are skipped by name",
    )
    group.addoption(
        "--impl-mask",
        default=None,
        choices=list(impl.IMPL_MASKS),
        help="what an --impl function's mask= takes (default: both, bool and float); "
        "additive: float only, blocked keys -inf; additive-min: blocked keys finfo(dtype).min",
    )
    group.addoption(
        "--impl-domain",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="the shapes an --impl function accepts (SPEC §13.19; repeatable): a line of a "
        "profile's [domain] table in TOML, e.g. 'head_dims=[16, 32, 64]', s_multiple=16, "
        "t_multiple=16, min_t=1, min_s=1, square=true, backward.s_multiple=128",
    )
    group.addoption(
        "--impl-device",
        default=None,
        metavar="DEVICE",
        help="where an --impl function runs (SPEC §13.20), in its framework's spelling: "
        "torch cpu, cuda, cuda:N; JAX cpu, gpu, tpu, with :N; its inputs are placed there, "
        "its outputs brought back to compare",
    )
    group.addoption(
        "--impl-profile",
        action="append",
        default=[],
        metavar="NAME|PATH",
        help="a library function described by a profile (SPEC §13.10): a shipped one "
        "(conformance/adapters/profiles/NAME.toml), 'all' of them, 'all-gpu' (every device "
        "profile, gpu/*.toml, SPEC §13.20), or a TOML file (repeatable)",
    )
    group.addoption(
        "--impl-name",
        default=None,
        help="the --impl backend's name in test ids (default: module.function)",
    )


def _add_run_options(group: pytest.OptionGroup) -> None:
    """Which tests run and which are expected to fail."""
    group.addoption(
        "--known-failures",
        default=None,
        metavar="FILE",
        help="tests expected to fail: one 'test_id  # reason' per line (strict xfail)",
    )
    group.addoption(
        "--ignore-known-failures",
        action="store_true",
        help="run as if no known failures were listed (--known-failures, the profiles'), "
        "so each fails with today's message: how they are measured afresh",
    )
    group.addoption(
        "--every-test",
        action="store_true",
        help="run every test on a profile whose [run] tests choose its default run (a "
        "function that compiles per shape), not only those",
    )
    group.addoption(
        "--layer",
        action="append",
        default=[],
        metavar="LAYER",
        help="run only the tests of these layers (SPEC §13.18; repeatable or comma-separated): "
        "math (ordinary inputs), edges (rows with no key, NaN, overflow, empty sequences), "
        "contract (what bad input gets)",
    )


def _add_jax_program_options(group: pytest.OptionGroup) -> None:
    """The JAX compilation cache and the check of how many programs a run compiles."""
    group.addoption(
        "--jax-cache",
        default=None,
        choices=["all", "shipped", "off"],
        help="which JAX programs are kept in the compilation cache on disk, shared by your "
        "runs (default: $CONFORMANCE_JAX_CACHE, else all): all, every program of the run, "
        "your own code's (--impl, a profile of yours) included; shipped, none in a run of "
        "your own code; off, none",
    )
    group.addoption(
        "--check-programs",
        default=None,
        metavar="ENV",
        help="fail the run if it compiled more than 10%% more distinct JAX programs than "
        "the record of ENV in --programs-record, naming the test modules that grew",
    )
    group.addoption(
        "--programs-record",
        default=".ci/programs.toml",
        metavar="FILE",
        help="the recorded JAX program counts, per tox env and test module "
        "(default: %(default)s, in the directory pytest runs in)",
    )
    group.addoption(
        "--record-programs",
        action="store_true",
        help="with --check-programs ENV: write this run's counts as ENV's record",
    )


#: The options that describe an --impl, and need one (pytest's and the report's).
IMPL_FLAGS = (
    "--impl-capabilities",
    "--impl-dtypes",
    "--impl-name",
    "--impl-framework",
    "--impl-layout",
    "--impl-causal",
    "--impl-mask",
    "--impl-domain",
    "--impl-device",
)
