"""Known failures: tests expected to fail, one ``test_id  # reason`` per line.

Those tests are marked as strict expected failures (a fixed bug shows up as a failure,
until its line is removed), and ids that match no test are reported as stale.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance.adapters.profiles import skip_reason


class StaleKnownFailure(UserWarning):
    """A known-failures entry matches no collected test."""


def read_known_failures(path: str | os.PathLike) -> dict[str, str]:
    """``{test id: reason}`` from a known-failures file.

    The format: one entry per line, ``test id  # reason``; blank lines and lines starting
    with ``#`` are ignored. Every entry needs a reason.

    Raises:
      ValueError: a line without a reason, or an id listed twice.
    """
    found: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        test_id, sep, reason = line.partition("#")
        test_id, reason = test_id.strip(), reason.strip()
        if not sep or not reason:
            raise ValueError(
                f"{path}:{number}: give the reason after '#': {test_id}  # why it fails"
            )
        if test_id in found:
            raise ValueError(f"{path}:{number}: {test_id} is listed twice")
        found[test_id] = reason
    return found


def known_failure_keys(nodeid: str, originalname: str | None = None) -> set[str]:
    """The ids a known-failures entry may use for the test ``nodeid``.

    ``conformance/tests/test_errors.py::test_bad_input[mine-integer-mask]`` is matched by
    that whole node id, by ``test_errors.py::test_bad_input[mine-integer-mask]``, by
    ``test_bad_input[mine-integer-mask]``, and, for every parametrization at once, by
    ``test_errors.py::test_bad_input`` and ``test_bad_input``.
    """
    path, _, name = nodeid.rpartition("::")
    file = path.rsplit("/", 1)[-1]
    bare = originalname or name.split("[", 1)[0]
    return {nodeid, f"{file}::{name}", name, f"{file}::{bare}", bare}


def pattern(text: str) -> re.Pattern:
    """A profile's known-failure id as a regular expression: ``*`` matches anything, all
    else is literal (``[`` included, unlike ``fnmatch``)."""
    return re.compile(".*".join(re.escape(part) for part in text.split("*")) + r"\Z")


#: A known-failure rule: its id, whether it matches a test (given the test item and its
#: ``known_failure_keys``), and its reason.
Rule = tuple[Any, Callable[[Any, set[str]], bool], str]


#: The reason prefix of a test that fails on some processors and passes on others.
ON_SOME_PROCESSORS = "on some processors: "
#: The reason prefix of a test whose outcome varies from run to run on one processor.
FROM_RUN_TO_RUN = "varies from run to run: "


def mark_known_failures(
    items: list, rules: list[Rule], strict: bool = True, prefix: str = ON_SOME_PROCESSORS
) -> set:
    """The one known-failure marker: every test a rule matches becomes a strict xfail,
    with the reasons of all its rules (in the rules' order); with ``strict`` False, a
    non-strict one whose reason starts with ``prefix`` (it may fail or pass:
    ``ON_SOME_PROCESSORS`` or ``FROM_RUN_TO_RUN``). Returns the ids of the rules that
    matched a test."""
    used = set()
    prefix = "known failure: " if strict else prefix
    for item in items:
        keys = known_failure_keys(item.nodeid, getattr(item, "originalname", None))
        hits = [(rule_id, reason) for rule_id, matches, reason in rules if matches(item, keys)]
        if hits:
            used.update(rule_id for rule_id, _ in hits)
            reason = "; ".join(reason for _, reason in hits)
            item.add_marker(pytest.mark.xfail(strict=strict, reason=prefix + reason))
    return used


def mark_listed(items: list, known: dict[str, str]) -> list[str]:
    """Mark the tests a known-failures file lists (``read_known_failures``); returns its
    entries that match no test."""
    rules = [(test_id, _listed(test_id), known[test_id]) for test_id in sorted(known)]
    used = mark_known_failures(items, rules)
    return [test_id for test_id in known if test_id not in used]


def _listed(test_id: str) -> Callable[[Any, set[str]], bool]:
    return lambda item, keys: test_id in keys


def item_backends(item: Any) -> tuple:
    """The backends a test runs on: its ``backend`` or both of its ``backend_pair``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    pair, single = params.get("backend_pair"), params.get("backend")
    return tuple(pair) if isinstance(pair, tuple) else (single,)


#: How the skip of a test outside a profile's default run ([run] tests) begins.
NOT_IN_DEFAULT_RUN = "not in the default run of"


def mark_profiles(
    items: list, loaded: list, unavailable: list, known: bool = True, every_test: bool = False
) -> list[str]:
    """Mark the tests of the profiles' backends: every test of an unavailable profile as
    skipped (naming what is missing), a loaded profile's tests outside its default run
    (its [run] tests, unless ``every_test``) as skipped, naming the option that runs
    them, the loaded profiles' known failures as strict xfails and their
    processor-dependent and varies-between-runs entries as non-strict ones (neither when
    ``known`` is False). Returns the known-failure entries that match no test,
    "profile: pattern"."""
    skipped = {p.name: skip_reason(p) for p in unavailable}
    chosen = {p.name: p.tests for p in loaded if p.tests and not every_test}
    runs = {name: [pattern(text) for text in tests] for name, tests in chosen.items()}
    for item in items:
        for name in item_backends(item):
            if name in skipped:
                item.add_marker(pytest.mark.skip(reason=skipped[name]))
            elif name in runs and not _chosen(item, runs[name]):
                reason = (
                    f"{NOT_IN_DEFAULT_RUN} {name}, which compiles per shape: its [run] tests "
                    f"are {', '.join(chosen[name])}; every test: --every-test"
                )
                item.add_marker(pytest.mark.skip(reason=reason))
    if not known:
        return []
    stale = []
    tables = (
        ("known_failures", True, ""),
        ("processor_dependent", False, ON_SOME_PROCESSORS),
        ("varies_between_runs", False, FROM_RUN_TO_RUN),
    )
    for table, strict, prefix in tables:
        rules = [
            ((p.name, text), _profile_rule(p.name, pattern(text)), reason)
            for p in loaded
            for text, reason in getattr(p, table).items()
        ]
        used = mark_known_failures(items, rules, strict=strict, prefix=prefix)
        stale += [f"{name}: {text}" for (name, text), _, _ in rules if (name, text) not in used]
    return stale


def _chosen(item: Any, regexes: list[re.Pattern]) -> bool:
    keys = known_failure_keys(item.nodeid, getattr(item, "originalname", None))
    return any(regex.match(key) for regex in regexes for key in keys)


def _profile_rule(name: str, regex: re.Pattern) -> Callable[[Any, set[str]], bool]:
    return lambda item, keys: name in item_backends(item) and any(regex.match(k) for k in keys)
