"""What a comparison measured, published by the test that made it, for the report to read.

A test that compares a backend with the oracle (a fixture) or two backends with each other
(SPEC §7.3, §12.10) calls ``publish`` just before it asserts: the max error, by the same
rule as ``conformance.suite.tolerance.assert_within``, the tolerance that assertion applies, and
the unit eps · max(1, |expected|). The numbers go into the test's ``user_properties``
(as JSON under the name ``PROPERTY``), so they travel with pytest's reports, through
pytest-xdist's workers too, and land in JUnit XML; ``published`` reads them back. The
report's agreement tables are built from these numbers alone: what the tests checked is
what the report shows, with no second run of its own.
"""

from __future__ import annotations

import json
import math

import numpy as np

from conformance.suite.tolerance import EPS, nonfinite_mismatch

#: The name of the user property a measurement is stored under.
PROPERTY = "conformance-measurement"


def max_error(actual, expected) -> float:
    """max |actual - expected| as ``assert_within`` judges it: over the entries finite in
    both; infinite when the shapes differ or NaN and the infinities do not match (SPEC §7.4:
    a NaN where a number was expected is infinitely wrong)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape or nonfinite_mismatch(actual, expected).any():
        return math.inf
    both = np.isfinite(actual) & np.isfinite(expected)
    with np.errstate(invalid="ignore"):
        return float(np.max(np.abs(np.where(both, actual - expected, 0.0)), initial=0.0))


def publish(
    node,
    *,
    backend: str,
    case: str,
    dtype: str,
    actual,
    expected,
    tolerance: float,
    quantity: str = "out",
) -> None:
    """Attach one comparison's numbers to the running test ``node`` (``request.node``).

    Args:
      backend: the backend's name, or "a~b" for a pair of backends.
      case: the fixture id, or the pairwise test's setup.
      dtype: the inputs' dtype name.
      actual, expected: what was compared (expected: the oracle, or the second backend).
      tolerance: the largest error the test's assertion allows.
      quantity: "out" for the output, or the gradient's name ("dq", "dk", "dv", "dmask",
        or a module parameter's).
    """
    expected64 = np.asarray(expected, dtype=np.float64)
    magnitude = float(np.max(np.abs(np.where(np.isfinite(expected64), expected64, 0.0)), initial=0))
    record = {
        "backend": backend,
        "case": case,
        "dtype": dtype,
        "quantity": quantity,
        "error": max_error(actual, expected),
        "tolerance": float(tolerance),
        "unit": EPS[dtype] * max(1.0, magnitude),
    }
    node.user_properties.append((PROPERTY, json.dumps(record)))


def published(user_properties) -> list[dict]:
    """The measurements among a report's ``user_properties``, as dicts."""
    return [json.loads(value) for name, value in user_properties if name == PROPERTY]


#: The name of the user property a quantized comparison's bounds are stored under.
PIPELINE_COSTS = "conformance-pipeline-costs"


def publish_pipeline_costs(
    node, *, backend: str, case: str, pipeline: str, actual, expected, bounds: dict
) -> None:
    """Attach a quantized comparison's numbers to the running test ``node`` (SPEC §20.6):
    the error against the oracle, the backend's declared P ``pipeline`` and ``bounds``,
    §20.6's bound on the same operands under every P pipeline, so that the report can say
    what the declared pipeline costs against the others."""
    record = {
        "backend": backend,
        "case": case,
        "pipeline": pipeline,
        "error": max_error(actual, expected),
        "bounds": {p: float(b) for p, b in bounds.items()},
    }
    node.user_properties.append((PIPELINE_COSTS, json.dumps(record)))


def published_pipeline_costs(user_properties) -> list[dict]:
    """The quantized comparisons among a report's ``user_properties``, as dicts."""
    return [json.loads(value) for name, value in user_properties if name == PIPELINE_COSTS]
