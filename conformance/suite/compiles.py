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
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

#: JAX's event for a compile request that missed the in-memory cache.
EVENT = "/jax/compilation_cache/compile_requests_use_cache"
#: Where a pytest-xdist process leaves its counts for the controller.
WORKER_KEY = "conformance_programs_compiled"


class ProgramCounter:
    """The pytest plugin that counts; ``plugin.pytest_configure`` registers one."""

    def __init__(self) -> None:
        self.by_backend: Counter[str] = Counter()
        self._seen = 0
        self._listening = False

    def _listen(self) -> None:
        if self._listening or "jax" not in sys.modules:
            return
        from jax import monitoring

        def count(event: str, **_: object) -> None:
            if event == EVENT:
                self._seen += 1

        monitoring.register_event_listener(count)
        self._listening = True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self._listen()
        before = self._seen
        try:
            return (yield)
        finally:
            self._listen()
            compiled = self._seen - before
            name = _backend_of(item)
            if compiled and name:
                self.by_backend[name] += compiled

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        self.by_backend.update(getattr(node, "workeroutput", {}).get(WORKER_KEY, {}))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[WORKER_KEY] = dict(self.by_backend)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
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
