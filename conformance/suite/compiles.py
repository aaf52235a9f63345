"""The programs a run compiles with JAX: the cache that keeps them, how many there are,
and the guard on their growth.

A JAX backend compiles one XLA program for each distinct shape, dtype and set of static
options it meets, and compiling is most of a cold JAX run's time; every test that adds a
shape adds programs.

**The cache.** ``configure_jax_cache`` points the run's JAX at its persistent compilation
cache, one per user (``conformance.backends.jax_cache.jax_cache_dir``), which the plugin
does in every test process once the backends are loaded, before anything is compiled.
It holds every program of the run, the shipped backends' and profiles' and your own
code's (an ``--impl``, a profile of yours), so that a second run of your function reads
back what the first compiled; ``--jax-cache shipped`` keeps your code's out, and
``--jax-cache off`` (or ``CONFORMANCE_JAX_CACHE=off``) turns it off. Before the run
compiles anything, the controlling process trims the folder to its bound
(``conformance.backends.jax_cache.jax_cache_bound``, 2 GiB), least recently used first.

**The count.** The summary line of a run ends with, for example, ``934 programs compiled
(jax-flash)``: the number of distinct programs the backend's tests asked JAX for. A
program is identified by its persistent-cache key, which JAX computes from the program,
the jax and jaxlib versions, the device and the compiler's flags before it looks in the
cache (``compile_requests_use_cache``, one event per request that missed the process's
memory), so a program read back from the cache counts as one compiled: a warm run counts
what a cold one does. Programs are counted once per run whatever the number of
pytest-xdist processes (each sends its keys to the controller) and however often a
process compiled one again after dropping it (``JaxBackend.release``): the count depends
on the tests, not on the machine. A run that never imports JAX counts nothing and shows
nothing; JAX is never imported here.

What the programs cost is shown on a line of its own above the summary line: the seconds
JAX spent compiling for each backend, from its own duration events for the three stages
of a compile (tracing to a jaxpr, lowering it, XLA's compile or the persistent cache's
load), summed over the processes. On a cold run of a JAX backend this is most of the run:
it is the part that more cores, not faster tests, would shorten; on a warm one, what is
left is the tracing and lowering.

**The guard.** ``--check-programs ENV`` compares the run's distinct programs with ENV's
record in ``--programs-record`` (``.ci/programs.toml``: a total and one count per test
module, each module's being the distinct programs its tests asked for). More than 10 %
above the recorded total fails the run, naming the modules that grew;
``--record-programs`` writes the run's counts as the new record, an edit to commit with
the tests that added the programs.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from conformance.backends.jax_cache import (
    jax_cache_bound,
    jax_cache_for_run,
    jax_cache_mode,
    trim_cache_folder,
    use_jax_cache,
)

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

#: JAX's event for a compile request that missed the in-memory cache.
EVENT = "/jax/compilation_cache/compile_requests_use_cache"
#: JAX's duration events for the three stages of compiling one program.
STAGES = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
#: Where a pytest-xdist process leaves its programs and seconds for the controller.
WORKER_KEY = "conformance_programs_compiled"
SECONDS_KEY = "conformance_seconds_compiling"
UNKEYED_KEY = "conformance_unkeyed_requests"
#: How far above its record an env's count may go.
GROWTH = 0.10


def configure_jax_cache(config: pytest.Config, backends: list, own_code: bool) -> None:
    """Point JAX at the run's persistent cache (or none), where the run has JAX in it.

    ``backends`` are the loaded backends; ``own_code``: the run tests an ``--impl`` or a
    profile that is not shipped. A run without JAX changes nothing and imports nothing."""
    if "jax" not in sys.modules and not any(b.framework == "jax" for b in backends):
        return
    try:
        mode = config.getoption("--jax-cache") or jax_cache_mode()
        bound = jax_cache_bound()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from err
    directory = jax_cache_for_run(mode, own_code)
    # Trimmed once per run, by the controller, before its workers start.
    if directory is not None and not hasattr(config, "workerinput"):
        trim_cache_folder(directory, bound)
    use_jax_cache(directory)


class ProgramCounter:
    """The pytest plugin that counts; ``plugin.pytest_configure`` registers one."""

    def __init__(
        self, check: str | None = None, record: Path | None = None, rewrite: bool = False
    ) -> None:
        #: The distinct programs (their cache keys) per backend and per test module.
        self.by_backend: defaultdict[str, set[str]] = defaultdict(set)
        self.by_module: defaultdict[str, set[str]] = defaultdict(set)
        self.seconds: Counter[str] = Counter()
        #: The env whose record the run is held to, its file, and whether to rewrite it.
        self.check, self.record, self.rewrite = check, record, rewrite
        self.verdict: list[str] = []
        self._requests = 0
        #: Requests made in tests that JAX gave no key for: programs that cannot be counted.
        self._unkeyed = 0
        self._keys: list[str] = []
        self._spent = 0.0
        self._listening = False

    def _listen(self) -> None:
        if self._listening or "jax" not in sys.modules:
            return
        from jax import monitoring
        from jax._src import compiler

        def count(event: str, **_: object) -> None:
            if event == EVENT:
                self._requests += 1

        def spend(event: str, duration_secs: float, **_: object) -> None:
            if event in STAGES:
                self._spent += duration_secs

        # JAX looks each request up in the persistent cache by its key, with or without a
        # cache directory (the lookup then finds nothing), right after the event above:
        # the key, which no public interface gives, is read on its way there.
        read = compiler._cache_read

        def keyed_read(module_name, cache_key, *args, **kwargs):
            self._keys.append(cache_key)
            return read(module_name, cache_key, *args, **kwargs)

        compiler._cache_read = keyed_read
        monitoring.register_event_listener(count)
        monitoring.register_event_duration_secs_listener(spend)
        self._listening = True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self._listen()
        keys, spent, requests = len(self._keys), self._spent, self._requests
        try:
            return (yield)
        finally:
            self._listen()
            compiled = set(self._keys[keys:])
            del self._keys[keys:]
            if self._requests > requests and not compiled:
                self._unkeyed += self._requests - requests
            name = _backend_of(item)
            if compiled:
                self.by_module[item.nodeid.split("::")[0]] |= compiled
                if name:
                    self.by_backend[name] |= compiled
            if self._spent > spent and name:
                self.seconds[name] += self._spent - spent

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        output = getattr(node, "workeroutput", {})
        for mine, theirs in zip((self.by_backend, self.by_module), output.get(WORKER_KEY, ())):
            for name, keys in theirs.items():
                mine[name] |= set(keys)
        self.seconds.update(output.get(SECONDS_KEY, {}))
        self._unkeyed += output.get(UNKEYED_KEY, 0)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[WORKER_KEY] = [
                {name: sorted(keys) for name, keys in counted.items()}
                for counted in (self.by_backend, self.by_module)
            ]
            workeroutput[SECONDS_KEY] = dict(self.seconds)
            workeroutput[UNKEYED_KEY] = self._unkeyed
            return
        if self.check is not None and self.record is not None:
            self.verdict, over = self._judge()
            if over and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def counts(self) -> dict:
        """The run's counts as a record: the distinct programs of the run, and of each
        test module's tests."""
        every = set().union(*self.by_module.values())
        modules = {name: len(keys) for name, keys in sorted(self.by_module.items())}
        return {"total": len(every), "modules": modules}

    def _judge(self) -> tuple[list[str], bool]:
        """The lines the guard prints, and whether the run is over its record."""
        counts = self.counts()
        env, path = self.check, self.record
        if self._unkeyed:
            return [
                f"JAX programs: JAX compiled {self._unkeyed} programs but gave no cache key "
                f"to count them by (jax {_jax_version()}): the guard of {env} cannot count"
            ], True
        if not counts["total"] and "jax" in sys.modules:
            from jax import config

            if not config.jax_enable_compilation_cache:
                return [
                    "JAX programs: JAX's compilation cache is disabled "
                    "(JAX_ENABLE_COMPILATION_CACHE), so its programs cannot be counted; "
                    f"the guard of {env} needs it on"
                ], True
        records = read_records(path)
        if self.rewrite:
            records[env] = counts
            write_records(path, records)
            return [f"JAX programs of {env}: {counts['total']}, written to {path}"], False
        recorded = records.get(env)
        if recorded is None:
            # The record to paste, so that a run's log is enough to start one.
            return [
                f"JAX programs of {env}: {counts['total']}; {path} has no record of {env}. "
                f"Its record, to paste there (or write with tox -e {env} -- --record-programs):",
                *format_records({env: counts}).splitlines(),
            ], False
        limit = math.floor(recorded["total"] * (1 + GROWTH))
        line = (
            f"JAX programs of {env}: {counts['total']}, recorded {recorded['total']} "
            f"(at most {limit}: {path})"
        )
        if counts["total"] <= limit:
            return [line], False
        grown = []
        for module, count in counts["modules"].items():
            before = recorded["modules"].get(module, 0)
            if count > before:
                grown.append((count - before, module, before, count))
        lines = [
            line,
            f"{env} compiles {counts['total'] - recorded['total']} more programs than its "
            f"record, over {round(GROWTH * 100)} %; the test modules that grew:",
        ]
        for growth, module, before, count in sorted(grown, key=lambda g: (-g[0], g[1])):
            lines.append(f"  {module}: {before} -> {count} (+{growth})")
        lines.append(
            f"If the tests need them, record the new counts in the change that adds them, with "
            f"the reason in its commit message: tox -e {env} -- --record-programs (or pytest "
            f"... --check-programs {env} --record-programs) rewrites [{env}] in {path}."
        )
        return lines, True

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.seconds:
            spent = ", ".join(f"{name} {s:.1f} s" for name, s in sorted(self.seconds.items()))
            terminalreporter.write_line(f"JAX compiling, summed over the test processes: {spent}")
        for line in self.verdict:
            terminalreporter.write_line(line)
        # pytest's summary line counts every category of ``stats``, its own and others'
        # (as it does "warnings"), so one category per backend puts the count on that line.
        for name, keys in sorted(self.by_backend.items()):
            terminalreporter.stats[f"programs compiled ({name})"] = [None] * len(keys)


def read_records(path: Path) -> dict:
    """The records of ``path``: per env, the total and the count per test module."""
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise pytest.UsageError(f"--programs-record: {path} is not valid TOML: {err}") from err
    records = {}
    for env, record in data.items():
        total, modules = record.get("total"), record.get("modules", {})
        if not isinstance(total, int) or not all(isinstance(n, int) for n in modules.values()):
            raise pytest.UsageError(
                f"--programs-record: [{env}] in {path} needs an integer 'total' and integer "
                f"counts in [{env}.modules], got total = {total!r}"
            )
        records[env] = {"total": total, "modules": dict(modules)}
    return records


HEADER = """\
# The distinct JAX programs each tox env compiles (conformance/suite/compiles.py), per env
# and per test module. A run of an env with `--check-programs ENV` fails when it compiles
# more than 10 % above its total, naming the modules that grew. Raising a count is a
# deliberate edit, in the change that adds the programs, with the reason in its commit:
# `tox -e ENV -- --record-programs` rewrites ENV's record from a run.
"""


def format_records(records: dict) -> str:
    """``records`` as the TOML of the record file, without its header."""
    blocks = []
    for env in sorted(records):
        modules = sorted(records[env]["modules"].items())
        blocks.append(
            f"[{env}]\ntotal = {records[env]['total']}\n\n[{env}.modules]\n"
            + "".join(f'"{module}" = {count}\n' for module, count in modules)
        )
    return "\n".join(blocks)


def write_records(path: Path, records: dict) -> None:
    path.write_text(HEADER + "\n" + format_records(records), encoding="utf-8")


def _jax_version() -> str:
    jax = sys.modules.get("jax")
    return getattr(jax, "__version__", "?")


def program_counter(config: pytest.Config) -> ProgramCounter:
    """The counter of a run, with its guard where ``--check-programs`` asks for one."""
    check = config.getoption("--check-programs")
    record = None
    if check is not None:
        record = config.invocation_params.dir / config.getoption("--programs-record")
    elif config.getoption("--record-programs"):
        raise pytest.UsageError("--record-programs writes a record: give --check-programs ENV")
    return ProgramCounter(check, record, bool(config.getoption("--record-programs")))


def _backend_of(item: pytest.Item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    pair, single = params.get("backend_pair"), params.get("backend")
    if isinstance(pair, tuple):
        return "~".join(pair)
    return single if isinstance(single, str) else None
