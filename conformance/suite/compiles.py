"""How many programs a conformance run compiled, per backend, in the run's summary line.

A JAX backend compiles one XLA program for each distinct shape, dtype and set of static
options it meets, and compiling is most of a cold JAX run's time; every test that adds a
shape adds programs. The count makes that growth visible: the summary line of a run ends
with, for example, ``412 programs compiled (jax-flash)``.

What is counted is JAX's own event for a compile request that missed the in-memory cache
(``/jax/compilation_cache/compile_requests_use_cache``, sent whether or not the persistent
cache then has the program), during each test's setup, call and teardown, credited to the
test's backend (a pairwise test's pair). Under pytest-xdist every process counts its own
and sends the counts to the controller, which adds them up: two processes that compile the
same program both count it, as both paid for it. A run that never imports JAX counts
nothing and shows nothing; JAX is never imported here.

What the programs cost is shown on a line of its own above the summary line: the seconds
JAX spent compiling for each backend, from its own duration events for the three stages
of a compile (tracing to a jaxpr, lowering it, XLA's compile or the persistent cache's
load), summed over the processes like the count. On a cold run of a JAX backend this is
most of the run: it is the part that more cores, not faster tests, would shorten.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

#: JAX's event for a compile request that missed the in-memory cache.
EVENT = "/jax/compilation_cache/compile_requests_use_cache"
#: JAX's duration events for the three stages of compiling one program.
STAGES = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
#: Where a pytest-xdist process leaves its counts and seconds for the controller.
WORKER_KEY = "conformance_programs_compiled"
SECONDS_KEY = "conformance_seconds_compiling"


class ProgramCounter:
    """The pytest plugin that counts; ``plugin.pytest_configure`` registers one."""

    def __init__(self) -> None:
        self.by_backend: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._seen = 0
        self._spent = 0.0
        self._listening = False

    def _listen(self) -> None:
        if self._listening or "jax" not in sys.modules:
            return
        from jax import monitoring

        def count(event: str, **_: object) -> None:
            if event == EVENT:
                self._seen += 1

        def spend(event: str, duration_secs: float, **_: object) -> None:
            if event in STAGES:
                self._spent += duration_secs

        monitoring.register_event_listener(count)
        monitoring.register_event_duration_secs_listener(spend)
        self._listening = True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self._listen()
        before, spent = self._seen, self._spent
        try:
            return (yield)
        finally:
            self._listen()
            compiled = self._seen - before
            name = _backend_of(item)
            if compiled and name:
                self.by_backend[name] += compiled
            if self._spent > spent and name:
                self.seconds[name] += self._spent - spent

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        output = getattr(node, "workeroutput", {})
        self.by_backend.update(output.get(WORKER_KEY, {}))
        self.seconds.update(output.get(SECONDS_KEY, {}))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[WORKER_KEY] = dict(self.by_backend)
            workeroutput[SECONDS_KEY] = dict(self.seconds)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.seconds:
            spent = ", ".join(f"{name} {s:.1f} s" for name, s in sorted(self.seconds.items()))
            terminalreporter.write_line(f"JAX compiling, summed over the test processes: {spent}")
        # pytest's summary line counts every category of ``stats``, its own and others'
        # (as it does "warnings"), so one category per backend puts the count on that line.
        for name, compiled in sorted(self.by_backend.items()):
            terminalreporter.stats[f"programs compiled ({name})"] = [None] * compiled


def _backend_of(item: pytest.Item) -> str | None:
    params = getattr(getattr(item, "callspec", None), "params", {})
    pair, single = params.get("backend_pair"), params.get("backend")
    if isinstance(pair, tuple):
        return "~".join(pair)
    return single if isinstance(single, str) else None
