"""A function under test that kills its process fails one test, and the run goes on (SPEC §13.13).

A user's function (``--impl``, ``--impl-profile``) may abort, segfault, raise SIGFPE or hang
in compiled code, where no Python exception can catch it. Such a run is given to
pytest-xdist worker processes, one per core up to ``MAX_WORKERS`` (one where the function
runs on a device, or the run was started from another pytest run's test), unless the user
chose ``-n`` themselves: xdist reports a test whose worker died as failed and starts a new
worker for the rest. Here that
failure gets its words: the signal, read from the worker's ``faulthandler`` output, and
the case (the test's id), as its message and its behaviour; a known failure that lists
the test makes it an expected failure, as in the worker. A hang is stopped by
pytest-timeout's per-test limit (``DEFAULT_TIMEOUT`` seconds unless ``--timeout`` or its
ini or environment setting says otherwise), with its ``thread`` method, which ends a
worker stuck in compiled code too, and is named as a hang.

Only a plain command-line run of user functions is isolated: the shipped backends' runs
(``--backend``) are ours and never crash, and keep their speed; a ``pytest.main`` inside
another process (a test, a tool) keeps its own process model, since xdist's workers see
the sys.path of their parent's start.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

#: The per-test time limit of an isolated run, in seconds, where none is set.
DEFAULT_TIMEOUT = 300.0
#: The most worker processes an isolated run starts, one per core up to this: each holds
#: its own framework (about 1.7 GB for JAX), and past a few, more of the programs one
#: process compiled are compiled again in another.
MAX_WORKERS = 4
#: Worker restarts allowed: one per crashing test, for a function that crashes often.
MAX_RESTARTS = "100000"
#: How much of faulthandler's traceback a crash's message keeps.
TRACEBACK_LINES = 8
#: The shapes of a call (``behaviours.call_features``' words) a crash is named by: where a
#: function dies on them, it is commonly on them alone.
SHAPES = ("T = 0", "S = 0")
#: faulthandler's words for the fatal signals it catches.
SIGNALS = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
}
#: The words of an error that leaves a device's state lost for the rest of the process
#: (CUDA's errors are sticky: after an illegal memory access every later call fails).
DEVICE_ERROR = re.compile(r"CUDA error|CUDA_ERROR_|cudaError")
#: The exit status of a worker that ended itself after a device error (SPEC §13.20).
DEVICE_LOST_STATUS = 3
_CRASH_DIR = "conformance_crash_dir"
_CRASH = pytest.StashKey[Path]()
_HANDLER_FILE = pytest.StashKey[object]()
_CALL_NOTE = pytest.StashKey[object]()
_STARTED = pytest.StashKey[object]()


def _from_command_line(config: pytest.Config) -> bool:
    return tuple(config.invocation_params.args) == tuple(sys.argv[1:])


def wanted(config: pytest.Config) -> bool:
    """Whether this run is isolated: a command-line run of user functions, with
    pytest-xdist installed, no ``-n`` given, no debugger, not a worker itself."""
    option = config.option
    user = getattr(option, "impl", None) is not None or bool(getattr(option, "impl_profile", []))
    return (
        user
        and config.pluginmanager.hasplugin("xdist")
        and not hasattr(config, "workerinput")
        and getattr(option, "numprocesses", None) is None
        and not getattr(option, "usepdb", False)
        and not getattr(option, "collectonly", False)
        and _from_command_line(config)
    )


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    """Before xdist reads its options: the workers (``workers``, or one for a device),
    each restarted after a crash, and a per-test time limit, for an isolated run."""
    if wanted(config):
        # The cores compile and run at once (measured in SPEC §13.13). A device is left to
        # one process: JAX's takes most of its memory when it starts.
        config.option.numprocesses = 1 if names_a_device(config) else workers()
        if getattr(config.option, "dist", "no") == "no":
            # Our scope (scheduling.py): a test function's parametrizations, which share
            # their programs, stay in one worker.
            config.option.dist = "loadscope"
        if config.option.maxworkerrestart is None:
            config.option.maxworkerrestart = MAX_RESTARTS
        timeout_set = (
            getattr(config.option, "timeout", None) is not None
            or config.getini("timeout")
            or os.environ.get("PYTEST_TIMEOUT")
        )
        if config.pluginmanager.hasplugin("timeout") and not timeout_set:
            config.option.timeout = DEFAULT_TIMEOUT
            if getattr(config.option, "timeout_method", None) is None:
                config.option.timeout_method = "thread"
        config.stash[_CRASH] = Path(tempfile.mkdtemp(prefix="attention-conformance-crash-"))
    return (yield)


def workers() -> int:
    """The worker processes of an isolated run: one per core this process may use, up to
    ``MAX_WORKERS``; one where the run was started from a test of another pytest run
    (``PYTEST_CURRENT_TEST``), whose own processes already hold the cores."""
    if os.environ.get("PYTEST_CURRENT_TEST"):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_WORKERS))


def names_a_device(config: pytest.Config) -> bool:
    """Whether the run puts a function on a device other than the CPU: ``--impl-device``,
    or the ``device`` of a profile it names (a path, a shipped name, ``all-gpu``; SPEC
    §13.20), read as the profile's own loading reads it."""
    from conformance.adapters.profiles import ProfileError, gpu_profiles, read_profile

    named = [getattr(config.option, "impl_device", None)]
    for value in getattr(config.option, "impl_profile", None) or []:
        for name in {"all": [], "all-gpu": gpu_profiles()}.get(value, [value]):
            try:
                named.append(read_profile(name).device)
            except ProfileError:
                continue  # the run's own loading reports it, with its words
    return any(d and d.split(":")[0] != "cpu" for d in named)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Tell each worker where to write what faulthandler sees when it dies."""
    folder = node.config.stash.get(_CRASH, None)
    if folder is not None:
        node.workerinput[_CRASH_DIR] = str(folder)


def _crash_file(folder: str | Path, worker: str, what: str = "faulthandler") -> Path:
    return Path(folder) / f"{worker}.{what}.txt"


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """In a worker of an isolated run: faulthandler writes a fatal signal's traceback to
    the worker's file (after pytest's own faulthandler setup, which it replaces), and each
    call to the function under test is noted before it is made, for a crash to name it."""
    workerinput = getattr(session.config, "workerinput", {})
    if _CRASH_DIR in workerinput:
        path = _crash_file(workerinput[_CRASH_DIR], workerinput["workerid"])
        session.config.stash[_HANDLER_FILE] = handle = open(path, "w")
        faulthandler.enable(file=handle, all_threads=False)
        from conformance.suite import replay

        calling = _crash_file(workerinput[_CRASH_DIR], workerinput["workerid"], "calling")
        session.config.stash[_CALL_NOTE] = note = _CallNote(calling)
        replay.BEFORE_CALL.append(note)
        started = _crash_file(workerinput[_CRASH_DIR], workerinput["workerid"], "started")
        session.config.stash[_STARTED] = _CallNote(started)


class _CallNote:
    """Writes what a call is about to be (its shapes, in ``behaviours.call_features``'
    words, and its description) to the worker's file, before the call is made: one write
    to a file kept open, which the system keeps when the process dies (opening a file for
    each test measured 3.4 ms here, a few seconds a run)."""

    def __init__(self, path: Path) -> None:
        self.handle = open(path, "w")

    def write(self, text: str) -> None:
        self.handle.seek(0)
        self.handle.write(text)
        self.handle.truncate()
        self.handle.flush()

    def __call__(self, backend, method: str, args, kwargs) -> None:
        from conformance.suite import behaviours, replay

        shown = ", ".join(
            [replay._show(x) for x in args] + [f"{k}={replay._show(x)}" for k, x in kwargs.items()]
        )
        note = {
            "features": behaviours.call_features([(0, backend, method, args, kwargs)]),
            "call": f"{method}({shown})",
        }
        self.write(json.dumps(note))

    def clear(self) -> None:
        self.write("")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem) -> None:
    """In a worker of an isolated run: when the test started, for the crash to tell a
    hang (the time limit's end) from another death, and its label (SPEC §13.18)."""
    workerinput = getattr(item.config, "workerinput", {})
    if _CRASH_DIR in workerinput:
        from conformance.suite import verdicts

        note = item.config.stash.get(_CALL_NOTE, None)
        started = item.config.stash.get(_STARTED, None)
        if note is None or started is None:
            return
        note.clear()
        started.write(f"{time.time()!r}\t{item.nodeid}\t{json.dumps(verdicts.label(item))}")


def end_after_device_error(item: pytest.Item, call: pytest.CallInfo) -> None:
    """In a worker of an isolated run: a test whose function raised a device error (CUDA's,
    SPEC §13.20) ends the worker before the test's report is sent, so that the controller
    counts it as this test's crash and the next tests run in a fresh process on a device
    whose state is whole; the error's behaviour is left in a file for the crash's words."""
    workerinput = getattr(item.config, "workerinput", {})
    if call.excinfo is None or _CRASH_DIR not in workerinput:
        return
    from conformance.suite import behaviours

    inner = behaviours._innermost(call.excinfo.value)
    if not DEVICE_ERROR.search(str(inner)):
        return
    path = _crash_file(workerinput[_CRASH_DIR], workerinput["workerid"], "device-error")
    path.write_text(json.dumps({"nodeid": item.nodeid, "found": behaviours.raised(inner)}))
    os._exit(DEVICE_LOST_STATUS)


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session):
    """An isolated run stopped by ``-x`` or ``--maxfail`` exits as pytest's own does, 1
    (tests failed), not 2: xdist's controller raises its ``Interrupted`` there."""
    try:
        return (yield)
    except KeyboardInterrupt as err:
        stopped = str(err).startswith("stopping after ")
        if stopped and session.config.stash.get(_CRASH, None) is not None:
            raise session.Failed(str(err)) from None
        raise


def pytest_sessionfinish(session: pytest.Session) -> None:
    handle = session.config.stash.get(_HANDLER_FILE, None)
    if handle is not None:
        faulthandler.disable()
        handle.close()
    note = session.config.stash.get(_CALL_NOTE, None)
    if note is not None:
        from conformance.suite import replay

        replay.BEFORE_CALL.remove(note)
        note.handle.close()
    started = session.config.stash.get(_STARTED, None)
    if started is not None:
        started.handle.close()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller of an isolated run removes its workers' crash files, read by now."""
    folder = config.stash.get(_CRASH, None)
    if folder is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(folder, ignore_errors=True)


def what_killed(text: str) -> tuple[str, str]:
    """(the signal's name, faulthandler's first traceback line in the function) from a
    worker's faulthandler output; ("", "") where it shows no fatal signal."""
    found = re.search(r"Fatal Python error: ([A-Za-z -]+)", text)
    if not found:
        return "", ""
    name = SIGNALS.get(found[1].strip(), found[1].strip())
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
    ours = [f for f in frames if "_pytest" not in f[0] and "pluggy" not in f[0]]
    where = f"{ours[0][2]} ({ours[0][0]}:{ours[0][1]})" if ours else ""
    return name, where


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report, sched) -> None:
    """The test whose worker died: a failure of the test (not an error of the run) that
    names the signal and the case, with the behaviour the report lists."""
    from conformance.suite import behaviours, verdicts

    node = getattr(report, "node", None)
    config = getattr(node, "config", None)
    folder = None if config is None else config.stash.get(_CRASH, None)
    worker = getattr(getattr(node, "gateway", None), "id", "")
    text, started = "", ""
    if folder is not None and worker:
        path, begun = _crash_file(folder, worker), _crash_file(folder, worker, "started")
        text = path.read_text(errors="replace") if path.exists() else ""
        started = begun.read_text() if begun.exists() else ""
    signal, where = what_killed(text)
    limit = getattr(config.option, "timeout", None) if config is not None else None
    when, _, rest = started.partition("\t")
    nodeid, _, label = rest.partition("\t")
    note = {}
    if folder is not None and worker:
        calling = _crash_file(folder, worker, "calling")
        text_of_note = calling.read_text() if calling.exists() and nodeid == crashitem else ""
        try:
            note = json.loads(text_of_note) if text_of_note.strip() else {}
        except ValueError:  # cut off mid-write: the crash is named without it
            note = {}
    # The case's shape, where it is one the crash may be specific to (SPEC §13.13).
    shape = [f for f in note.get("features", []) if f in SHAPES]
    on = f" on a call with {' and '.join(shape)}" if shape else ""
    hung = bool(not signal and limit and nodeid == crashitem)
    hung = hung and time.time() - float(when) >= float(limit)
    device = _device_error(folder, worker, crashitem)
    if device:
        found = device
        said = (
            f"the function under test {device}, a device error after which the process's "
            "device state is lost; its worker process was ended"
        )
    elif signal:
        found = f"kills its process with {signal}{on}"
        said = f"the function under test killed its process with {signal}" + (
            f" in {where}" if where else ""
        )
    elif hung:
        found = "hangs: no answer within the time limit"
        said = f"the function under test gave no answer within {limit:g} s; its process was ended"
    else:
        found = "ends its process (no Python error, no fatal signal faulthandler saw)"
        said = "the function under test ended its process"
    if note.get("call"):
        said += f"; its last call: {note['call']}"
    lines = [
        f"finding: {found}",
        f"{said} while running {crashitem}; the run went on in a new worker process",
        *text.strip().splitlines()[:TRACEBACK_LINES],
    ]
    report.when = "call"
    path, _, name = crashitem.rpartition("::")
    report.location = (path, None, name)
    properties = [(behaviours.PROPERTY, found)]
    if label:
        properties.append((verdicts.LABEL, label))
        lines.append(f"rerun: {json.loads(label)['rerun']}")
    report.longrepr = _longrepr(lines, path, found)
    report.user_properties = [*report.user_properties, *properties]
    reason = _known_reason(config, crashitem)
    if reason is not None:
        report.outcome = "skipped"
        report.wasxfail = reason


def _device_error(folder: Path | None, worker: str, crashitem: str) -> str:
    """The behaviour of the device error that ended ``worker`` on ``crashitem``, or ""."""
    if folder is None or not worker:
        return ""
    path = _crash_file(folder, worker, "device-error")
    try:
        note = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        return ""
    path.unlink(missing_ok=True)
    return note.get("found", "") if note.get("nodeid") == crashitem else ""


def _longrepr(lines: list[str], path: str, found: str):
    """A crash's failure as pytest prints a test's: the lines, then its behaviour in a
    section of its own, as every failure's JUnit entry carries it (SPEC §13.13)."""
    from _pytest._code.code import ExceptionChainRepr, ReprFileLocation, ReprTracebackNative

    crash = ReprFileLocation(path, 0, lines[1])
    longrepr = ExceptionChainRepr(
        [(ReprTracebackNative([line + "\n" for line in lines]), crash, None)]
    )
    longrepr.addsection("behaviour", found)
    return longrepr


def _known_reason(config: pytest.Config | None, nodeid: str) -> str | None:
    """The known-failure reason that lists ``nodeid`` (``--known-failures`` or a profile's),
    as the worker would have marked it; None where none does."""
    if config is None or config.getoption("--ignore-known-failures"):
        return None
    from conformance.suite import known_failures, plugin

    keys = known_failures.known_failure_keys(nodeid)
    listed = config.stash.get(plugin.KNOWN_FAILURES, {})
    hits = [reason for test_id, reason in listed.items() if test_id in keys]
    loaded, _ = config.stash.get(plugin.PROFILES, ([], []))
    for profile in loaded:
        if f"[{profile.name}-" not in nodeid and f"[{profile.name}]" not in nodeid:
            continue
        for text, reason in profile.known_failures.items():
            if any(known_failures.pattern(text).match(k) for k in keys):
                hits.append(reason)
    return "known failure: " + "; ".join(hits) if hits else None
