"""A test's id as pytest prints it, in FAILED lines and under ``--co``."""

from __future__ import annotations

from pathlib import Path

import pytest


def ids_carry_their_module(items: list[pytest.Item]) -> None:
    """Give a test collected by ``--pyargs`` from outside the rootdir its module's path.

    pytest writes such a test's id relative to the argument it came from, which is the
    module itself: ``::test_lse_of_rows_whose_output_is_nan[...]``, with no module, in
    the FAILED lines and under ``--co``. The id becomes the module's path inside the
    installed package (``conformance/tests/test_lse.py::...``), as in a checkout."""
    root = Path(__file__).resolve().parents[2]  # the folder holding the package
    for item in items:
        if not item.nodeid.startswith("::"):
            continue
        try:
            module = Path(item.path).resolve().relative_to(root).as_posix()
        except ValueError:  # a module outside the package keeps pytest's id
            continue
        _set_nodeid(item, module + item.nodeid)


def _set_nodeid(item: pytest.Item, nodeid: str) -> None:
    """pytest 9 keeps a node's id as a ``NodeId`` (``_id``), earlier ones as a string."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:
        item._nodeid = nodeid
    else:
        item._id = NodeId.parse(nodeid)
