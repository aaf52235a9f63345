"""Where pytest roots a conformance run: the helpers of the plugin's
``pytest_load_initial_conftests`` (``conformance.suite.plugin``)."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest


def initial_conftests_of_the_installed_suite(config: pytest.Config) -> None:
    """Under ``--pyargs``, read ``conformance`` as the package this plugin came from.

    pytest loads its first conftest files from each argument taken as a path, even under
    ``--pyargs``; in a checkout with a non-editable install, ``conformance`` is then the
    checkout's folder, whose ``conformance.tests.conftest`` clashes with the installed one
    (``ImportPathMismatchError``). The tests collected are the installed package's, so the
    conftest files read first are its too: only this scan's copy of the arguments changes.
    """
    namespace = config.known_args_namespace
    if not namespace.pyargs:
        return
    args = []
    for arg in namespace.file_or_dir:
        name, sep, rest = str(arg).partition("::")
        if name.split(".")[0] == "conformance":
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):  # pytest's collection reports it
                spec = None
            if spec is not None and spec.origin is not None:
                path = Path(spec.origin)
                arg = str(path.parent if path.name == "__init__.py" else path) + sep + rest
        args.append(arg)
    namespace.file_or_dir = args


def setup_without_option_values(config: pytest.Config):
    """(rootpath, inipath) as pytest determines them from the positional arguments now
    that this plugin's options have taken their values; None where pytest's internals
    (``_pytest.config.findpaths.determine_setup``) are not as expected."""
    try:
        from _pytest.config.findpaths import determine_setup

        namespace = config.known_args_namespace
        given = {
            "inifile": namespace.inifilename,
            "override_ini": namespace.override_ini,
            "args": namespace.file_or_dir,
            "rootdir_cmd_arg": namespace.rootdir or None,
            "invocation_dir": config.invocation_params.dir,
        }
        accepted = inspect.signature(determine_setup).parameters
        found = determine_setup(**{k: v for k, v in given.items() if k in accepted})
        return found[0], found[1]
    except Exception:  # a pytest whose internals differ: keep its own choice
        return None
