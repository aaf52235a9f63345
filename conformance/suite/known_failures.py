"""Known failures: tests expected to fail, one ``test_id  # reason`` per line.

Those tests are marked as strict expected failures (a fixed bug shows up as a failure,
until its line is removed), and ids that match no test are reported as stale.
"""

from __future__ import annotations

import os
from pathlib import Path


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
