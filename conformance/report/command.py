"""The main job: run the spec on backends and write a report.

    python -m conformance report --backend all --out report/
    python -m conformance report --impl examples.my_attention:attention \
        --impl-capabilities value_dim,causal_bottom_right,window,gqa --out report-mine/

Into ``--out`` go ``report.md`` (read this), ``report.json`` (the same, for programs),
``junit.xml`` (for CI), PNG pictures, and ``repro/`` (the inputs of failing calls). The
report has, in order: a verdict per backend (conforms, or the clauses it fails, and what
it does not declare); each clause passed / failed / skipped / known to fail per backend,
with the skips grouped by the capability the backend lacks; every failure's message with
a snippet that replays it; per dtype, the cross-framework agreement on the outputs and
the gradients, as the tests measured it (tables naming the worst fixture, and heatmaps on
one scale: the fraction of the tolerance); for a quantized backend (SPEC §20.6), what its
declared P pipeline costs: its bound against the other pipelines' on the same cases;
pictures of the masks and the worked example; the versions, the machine and the date.
With ``--impl-profile`` (``all``: every shipped one) the library functions the profiles
describe are columns of the clause table beside the backends, with their libraries'
versions (``python -m conformance frameworks`` is that run, with the README's table).

The parts: ``report_collect`` (the pytest run and what it gathers), ``report_outcomes``
(clauses, verdicts, grouped skips), ``report_agreement`` (the tests' measurements,
summarised), ``report_pictures`` and ``report_markdown``. This module is the command.

JAX's persistent compilation cache is the user's, shared by every run, checkout and venv
(``--jax-cache`` in ``conformance/suite/compiles.py``). The tests run in two pytest-xdist
processes where xdist is installed and there are two cores (``--workers``).

Any other options are passed to pytest (``-k``, ``--known-failures FILE``, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

from conformance.backends import CAPABILITIES, DTYPES, BackendUnavailable, load_backend
from conformance.report.agreement import agreement, pipeline_costs, shard_counts
from conformance.report.collect import OUTCOMES, run_tests, xdist_installed
from conformance.report.markdown import render_markdown
from conformance.report.outcomes import (
    clause_table,
    departures,
    grouped_known_failures,
    grouped_skips,
    layer_verdicts,
    variants,
    verdicts,
)
from conformance.report.pictures import draw_pictures
from conformance.suite.options import IMPL_FLAGS
from conformance.suite.verdicts import named_by_run


def versions(backends: list[str]) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "numpy": np.__version__}
    for package in ("pytest", "pytest-xdist", "hypothesis", "mpmath", "ml_dtypes", "matplotlib"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    for name in backends:
        try:
            found.update(load_backend(name).versions())
        except BackendUnavailable:
            pass
    return found


def machine() -> str:
    return (
        f"{platform.machine()} {platform.system()} {platform.release()}, "
        f"{platform.processor() or 'cpu'}, {os.cpu_count()} cores"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m conformance report",
        description=__doc__.splitlines()[0],
        epilog="Any other options are passed to pytest (-k EXPR, --known-failures FILE, "
        "--backend-option NAME:KEY=VALUE, ...).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        help="backend(s) to run; 'all' = every installed one",
    )
    parser.add_argument("--impl", help="your implementation, MODULE:ATTR (see --impl in pytest)")
    parser.add_argument("--impl-capabilities", help="capabilities of an --impl function")
    parser.add_argument("--impl-dtypes", help="dtypes of an --impl function")
    parser.add_argument("--impl-name", help="the --impl backend's name")
    _impl_form_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("report"), help="output directory")
    parser.add_argument(
        "--workers",
        default="auto",
        help="test processes (pytest-xdist); 'auto' = 2 where xdist is installed and there "
        "are 2 cores or more, else 1 (in this process); an --impl runs in this process",
    )
    parser.add_argument(
        "--impl-profile",
        action="append",
        default=[],
        metavar="NAME|PATH",
        help="a library function described by a profile (repeatable; 'all' = every shipped "
        "one): the report then has its clauses, versions and agreement beside the backends'",
    )
    return parser


def _impl_form_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say how an --impl function is called and what it takes, as
    pytest's (``conformance.suite.options``): its arrays, layout, causality, masks and
    shapes (SPEC §13.17, §13.19)."""
    from conformance.adapters.impl import IMPL_CAUSALITY, IMPL_MASKS

    parser.add_argument(
        "--impl-framework",
        choices=["numpy", "torch", "jax", "auto"],
        help="the arrays an --impl function takes and returns (default: numpy)",
    )
    parser.add_argument(
        "--impl-layout", choices=["BHTD", "BTHD"], help="an --impl function's axis order"
    )
    parser.add_argument(
        "--impl-causal",
        choices=list(IMPL_CAUSALITY),
        help="how causality reaches an --impl function (default: keyword)",
    )
    parser.add_argument(
        "--impl-mask",
        choices=list(IMPL_MASKS),
        help="what an --impl function's mask= takes (default: both)",
    )
    parser.add_argument(
        "--impl-domain",
        action="append",
        metavar="KEY=VALUE",
        help="the shapes an --impl function accepts (repeatable), e.g. 'head_dims=[16, 32]', "
        "s_multiple=16, square=true",
    )
    parser.add_argument(
        "--impl-device",
        metavar="DEVICE",
        help="where an --impl function runs, in its framework's spelling (cuda, cuda:1, gpu)",
    )


def _load_impl(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """Register the --impl function in this process, with every --impl-* option; its name,
    or None without --impl (where an --impl-* option is an error, as in pytest)."""
    from conformance.adapters.domain import domain_flags
    from conformance.adapters.impl import load_impl

    if not args.impl:
        for flag in IMPL_FLAGS:
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                parser.error(f"{flag} describes an --impl; give --impl MODULE:ATTR")
        return None
    try:
        impl = load_impl(
            args.impl,
            name=args.impl_name,
            capabilities=args.impl_capabilities,
            dtypes=args.impl_dtypes,
            framework=args.impl_framework or "numpy",
            layout=args.impl_layout or "BHTD",
            causal=args.impl_causal,
            mask=args.impl_mask,
            domain=domain_flags(args.impl_domain or ()),
            device=args.impl_device,
        )
    except (BackendUnavailable, ValueError) as err:
        parser.error(str(err))
    return impl.name


def _declarations(name: str) -> dict:
    """What backend ``name`` declares, and what it could (``declarable``); everything,
    where it cannot be loaded here."""
    try:
        backend = load_backend(name)
    except BackendUnavailable:
        return {"capabilities": sorted(CAPABILITIES), "dtypes": list(DTYPES)}
    return {
        "capabilities": sorted(backend.capabilities),
        "dtypes": list(backend.dtypes),
        "declarable": sorted(declarable(backend)),
    }


def declarable(backend) -> frozenset[str]:
    """The capabilities a backend of its kind can declare: a function (``--impl``, a
    profile) those its keywords and its framework's differentiation give, never the
    layers, the sharded entry points or the paged cache, which need a Backend class; a
    Backend every one."""
    from conformance.adapters.function import (
        FUNCTION_CAPABILITIES,
        FUNCTION_VARIANTS,
        FunctionBackend,
    )
    from conformance.vocabulary import GRAD_CAPABILITIES

    if not isinstance(backend, FunctionBackend):
        return frozenset(CAPABILITIES)
    found = FUNCTION_CAPABILITIES | FUNCTION_VARIANTS
    if backend.framework != "numpy":
        found |= GRAD_CAPABILITIES - {"module_grad"}
    return frozenset(found)


def _workers(value: str, impl: bool) -> int:
    if impl:
        # An --impl is registered in this process only; xdist's workers would not find it.
        return 1
    if value == "auto":
        return 2 if xdist_installed() and (os.cpu_count() or 1) >= 2 else 1
    return int(value)


def main(argv: list[str]) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    from conformance.suite.plugin import selected_backends

    class _Opts:
        def getoption(self, _name):
            return args.backend

    backends = selected_backends(_Opts())
    impl = _load_impl(parser, args)
    if impl:
        # Registered in this process, so the in-process pytest run finds it by name.
        backends = list(dict.fromkeys([*backends, impl]))
    for profile in args.impl_profile:
        # Every test process (xdist's workers too) registers the profiles from this option.
        extra += ["--impl-profile", profile]
    if not backends and not args.impl_profile:
        parser.error(
            "choose backends with --backend NAME, --backend all, --impl MODULE:ATTR or "
            "--impl-profile NAME"
        )
    declared = {}
    for name in backends:
        try:
            load_backend(name)
        except BackendUnavailable as err:
            parser.error(str(err))
        declared[name] = _declarations(name)
    workers = _workers(args.workers, impl=bool(args.impl))
    if workers > 1 and not xdist_installed():
        parser.error("--workers above 1 needs pytest-xdist: pip install pytest-xdist")
    args.out.mkdir(parents=True, exist_ok=True)
    code, collected = run_tests(backends, extra, args.out, workers)
    rows = named_by_run(collected.rows)
    # Backends the run added itself (e.g. from pytest options passed through) get a
    # verdict too, with their declarations where they can be loaded here.
    for name in dict.fromkeys(r["backend"] for r in rows):
        if name and "~" not in name and name not in declared:
            backends.append(name)
            declared[name] = _declarations(name)
    agreed = agreement(collected.measurements, backends)
    data = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m conformance report " + " ".join(argv),
        "backends": backends,
        "versions": versions(backends),
        "exit_code": code,
        "summary": {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES},
        "verdicts": verdicts(rows, declared),
        "layers": layer_verdicts(rows, backends),
        "domains": collected.domains,
        "departures": departures(rows),
        "clauses": clause_table(rows),
        "variants": variants(clause_table(rows), declared),
        "skips": grouped_skips(rows, declared),
        "known_failures": grouped_known_failures(rows),
        "agreement": agreed,
        "shard_counts": shard_counts(collected.measurements),
        "pipeline_costs": pipeline_costs(collected.pipeline_costs, backends),
        "measurements": collected.measurements,
        "pictures": draw_pictures(args.out, agreed),
        "tests": rows,
    }
    (args.out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (args.out / "report.md").write_text(render_markdown(data))
    # pytest's last line is on stdout: flush it first, so this line stands on its own.
    sys.stdout.flush()
    print(f"wrote {args.out / 'report.md'}", flush=True)
    print(
        f"  and {args.out / 'report.json'}, {args.out / 'junit.xml'}, the pictures "
        f"({len([p for p in data['pictures'] if p != 'error'])})",
        flush=True,
    )
    return code
