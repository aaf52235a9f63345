"""SPEC §13.21: the size pool keeps the cases that tell bugs apart, the property tests draw
their shapes from it, and the kit's run on the JAX example compiles no more programs than
its record (issue: a JAX function judged in a minute)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.suite import helpers, sizes
from conformance.suite.sizes import SHAPES, Shape, pooled_shape

ROOT = Path(__file__).resolve().parent.parent
#: The user page's command on the JAX example (docs/test-your-own.md, SPEC §13.21).
KIT = [
    "--pyargs",
    "conformance",
    "--impl",
    "examples.jax_attention:attention",
    "--impl-framework",
    "jax",
    "--impl-capabilities",
    "value_dim,gqa",
]
#: The tests that ran (passed or failed) on the example when the pool came in: a pool that
#: made tests skip would lower it.
EXAMPLE_TESTS_RAN = 415


@pytest.mark.clause("13.21")
def test_the_pool_keeps_the_cases_that_tell_bugs_apart():
    pool = [shape for shape, _ in SHAPES.values()]
    kept = {
        "T < S": any(s.T < s.S for s in pool),
        "T > S": any(s.T > s.S for s in pool),
        "T = S": any(s.T == s.S for s in pool),
        "T = 1": any(s.T == 1 for s in pool),
        "S no tile of 2 divides": any(s.S % 2 for s in pool),
        "T > S with E != D": any(s.T > s.S and s.E != s.D for s in pool),
        "groups of G > 1 with K > 1": any(1 < s.K < s.H for s in pool),
        "K = 1 < H": any(s.K == 1 < s.H for s in pool),
        "H = 1": any(s.H == 1 for s in pool),
        "D = 1": any(s.D == 1 for s in pool),
        "B > 1": any(s.B > 1 for s in pool),
    }
    assert all(kept.values()), [case for case, ok in kept.items() if not ok]
    assert all(s.H % s.K == 0 for s in pool)
    # The invariants' sizes are the pool's.
    for name, size in helpers.SIZES.items():
        assert (SHAPES[name][0].T, SHAPES[name][0].S) == (size["T"], size["S"])
    assert pooled_shape(Shape(2, 4, 2, 5, 9, 4, 3), gqa=False, value_dim=False, unbatched=True) == (
        Shape(1, 4, 4, 5, 9, 4, 4)
    )


def test_a_clause_s_own_lengths_are_its_fixtures():
    """§2.5's empty sequences run at the stored fixtures' empty-T0 and empty-S0 shapes, so a
    framework that compiles per shape meets those calls once."""
    from conformance.suite.cases import case_entries
    from conformance.tests import test_edges

    shapes = {e["id"]: e["shape"] for e in case_entries()}
    T0, S0 = shapes["empty-T0-float64"], shapes["empty-S0-float64"]
    assert test_edges.EMPTY_LENGTHS == [(0, T0["S"]), (S0["T"], 0), (0, 0)]
    assert (T0["B"], T0["H"], T0["D"], T0["E"]) == (S0["B"], S0["H"], S0["D"], S0["E"])
    assert (T0["B"], T0["H"], T0["D"], T0["E"]) == (2, 2, 4, 3)


def test_the_properties_draw_every_shape_of_the_pool_and_no_other():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from conformance.adapters.forms import ALL_FORMS
    from conformance.tests import test_properties

    class Drawn:
        name, dtypes, forms = "drawn", ("float64",), frozenset(ALL_FORMS)

        def __init__(self, capabilities):
            self.capabilities = frozenset(capabilities)

    def shapes(backend) -> set:
        seen: set = set()

        @settings(
            max_examples=200,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def draw(data):
            p = data.draw(test_properties.problems(backend))
            (B, H, T, D), (_, K, S, _), E = p.q.shape, p.k.shape, p.v.shape[-1]
            seen.add(Shape(B, H, K, T, S, D, E))

        draw()
        return seen

    for caps in (set(), {"gqa", "value_dim"}):
        gqa, value_dim = "gqa" in caps, "value_dim" in caps
        pool = {
            pooled_shape(shape, gqa=gqa, value_dim=value_dim, unbatched=False)
            for shape, _ in sizes.SHAPES.values()
        }
        assert shapes(Drawn(caps)) == pool


def test_the_kit_on_the_jax_example_compiles_at_most_its_record():
    """The user page's command on ``examples/jax_attention.py`` is held to ``[example]`` in
    ``.ci/programs.toml``, as the tox envs are to theirs, and runs as many tests as it did."""
    pytest.importorskip("jax")
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *KIT, "-q", "-p", "no:cacheprovider"]
        + ["--check-programs", "example", "--programs-record", ".ci/programs.toml"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        check=False,
    )
    out = run.stdout + run.stderr
    # The example fails some tests by design (no guard for a row with no key, no GQA).
    assert run.returncode == 1, out[-3000:]
    guard = re.search(r"JAX programs of example: (\d+), recorded (\d+) \(at most (\d+)", out)
    assert guard, out[-3000:]
    assert int(guard.group(1)) <= int(guard.group(3)), out[-3000:]
    ran = re.search(r"(\d+) failed, (\d+) passed", out)
    assert ran and int(ran.group(1)) + int(ran.group(2)) >= EXAMPLE_TESTS_RAN, out[-3000:]
