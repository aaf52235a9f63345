"""How a conformance run spreads its tests over pytest-xdist's processes (``--dist
loadscope``): one work unit per test function and backend.

A JAX backend compiles one program per distinct shape, dtype and option set, and the
parametrizations of one test function often share one: ``test_unused_slots_hold_anything``
runs the same call with NaN, inf, the largest number and a mix in the slots. xdist's
``load`` hands tests out one by one, so two processes compile the same program, each for
its own half of those tests (measured on ``test_edges.py`` for jax-flash: 208 programs
compiled in two processes, 169 in one). xdist's own ``loadscope`` keeps a whole module in
one process, which keeps the sharing but leaves a process idle while the other finishes a
large module. This scope sits between them: the tests of one function on one backend go
to one process, and the largest units go first (``--loadscope-reorder``, xdist's
default).

Tests are still run and reported one by one, under their own ids; only which process
runs a test changes.
"""

from __future__ import annotations

from collections.abc import Iterable


def work_unit(nodeid: str, backends: Iterable[str]) -> str:
    """The scope of a test id: ``path::function[backend`` when its parameters start with one
    of ``backends`` (the longest that matches: ``jax-flash`` before ``jax``), or with a pair
    ``a~b`` of them (the pairwise tests), else ``path::function``.

    >>> work_unit("t.py::test_x[jax-flash-float32-T7]", ["jax", "jax-flash"])
    't.py::test_x[jax-flash'
    >>> work_unit("t.py::test_x[jax~jax-flash-scale-int]", ["jax", "jax-flash"])
    't.py::test_x[jax~jax-flash'
    >>> work_unit("t.py::test_y", ["jax"])
    't.py::test_y'
    """
    function, bracket, params = nodeid.partition("[")
    names = sorted(backends, key=len, reverse=True)
    at = 0
    while bracket:
        name = next((n for n in names if params.startswith(n, at)), None)
        if name is None or params[at + len(name) : at + len(name) + 1] not in ("-", "]", "~"):
            break
        at += len(name)
        if params[at : at + 1] != "~":
            return f"{function}[{params[:at]}"
        at += 1
    return function


def scheduler(config, log, backends: list[str]):
    """xdist's ``LoadScopeScheduling`` with ``work_unit`` as its scope."""
    from xdist.scheduler import LoadScopeScheduling

    class FunctionAndBackendScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid, backends)

        def remove_node(self, node):
            """A worker that died (SPEC §13.13): its test is the crash, and the rest of
            its units go back to the queue. xdist's own puts the crashing test back too,
            so a function that kills its process on one test was run on it forever."""
            workload = self.assigned_work.get(node, {})
            pending = [n for unit in workload.values() for n, done in unit.items() if not done]
            for scope in [scope for scope, unit in workload.items() if all(unit.values())]:
                del workload[scope]
            if pending:
                next(u for u in workload.values() if pending[0] in u)[pending[0]] = True
            super().remove_node(node)
            return pending[0] if pending else None

    return FunctionAndBackendScheduling(config, log)
