"""What a conformance run selects: the backends as it tests them, with their
``--backend-option``s (SPEC §10.4), and the layers ``--layer`` chose (SPEC §13.18).
``plugin.py`` applies both."""

from __future__ import annotations

import ast
import re

import pytest

from conformance.backends import load_backend
from conformance.suite.clauses import LAYERS, layer_of

#: The layers the run chose, in pytest's stash (``chosen_layers``).
LAYER_CHOICE = pytest.StashKey[list]()


def chosen_layers(config: pytest.Config) -> list[str]:
    """The layers ``--layer`` chose (SPEC §13.18); none: every layer."""
    chosen = [name.strip() for value in config.getoption("--layer") for name in value.split(",")]
    unknown = [name for name in chosen if name not in LAYERS]
    if unknown:
        raise pytest.UsageError(
            f"--layer {','.join(unknown)}: the layers are {', '.join(LAYERS)} (SPEC §13.18)"
        )
    return list(dict.fromkeys(name for name in chosen if name))


def deselect_other_layers(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = config.stash.get(LAYER_CHOICE, [])
    if not chosen:
        return
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("clause")
        layer = layer_of(marker.args[0] if marker else None)
        (kept if layer in chosen else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def conformance_backend(name: str):
    """The backend as the conformance run tests it: loaded with its ``conformance_options``
    and the run's ``--backend-option``s for it (SPEC §10.4); ``load_backend(name)`` alone
    gives the users' default configuration."""
    backend = load_backend(name)
    options = {**backend.conformance_options, **_BACKEND_OPTIONS.get(name, {})}
    return load_backend(name, **options) if options else backend


#: The run's ``--backend-option NAME:KEY=VALUE``s, by backend name.
_BACKEND_OPTIONS: dict[str, dict] = {}


def backend_options(values: list[str]) -> dict[str, dict]:
    """``--backend-option`` values as {name: {key: value}}, each VALUE a Python literal."""
    found: dict[str, dict] = {}
    for value in values:
        m = re.fullmatch(r"([^:=\s]+):([A-Za-z_]\w*)=(.+)", value.strip())
        try:
            found.setdefault(m[1], {})[m[2]] = ast.literal_eval(m[3])
        except (TypeError, ValueError, SyntaxError) as err:
            raise pytest.UsageError(
                f"--backend-option should be NAME:KEY=VALUE with VALUE a Python literal, "
                f"e.g. numpy-flash:textbook=True; got {value!r}"
            ) from err
    return found
