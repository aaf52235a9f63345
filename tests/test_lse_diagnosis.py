"""SPEC §21: a log-sum-exp departure is named by the misreading it shows.

Each misreading of ``LSE`` in ``conformance/suite/misreadings.py`` is planted in a correct
function, the NumPy core page's ``attention(..., return_lse=True)``, by misreading its lse
(read in base 2, taken of the unscaled scores, finite where a row has no key, in the
other layout); the lse is held to §21.3's tolerance against the oracle, as
``conformance/tests/test_lse.py`` holds it, and the diagnosis (``diagnosis.find``, the
suite's one entry) must name it. The right lse is named by nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from conformance.impls.numpy import attention as page

from conformance import load_backend
from conformance.suite.diagnosis import find
from conformance.suite.helpers import random_qkv
from conformance.suite.lse import oracle_lse_and_tolerance
from conformance.suite.misreadings import LSE as MISREADINGS
from conformance.suite.tolerance import Departure, assert_within

pytestmark = pytest.mark.clause("21.3")
BY_NAME = {m.name: m for m in MISREADINGS}


def _inputs(name: str = ""):
    """q, k, v (2, 3, 7, 5), (2, 3, 13, 5) and a bool mask whose row [0, 1, 2] sees no key;
    for a misreading of an option, that option too."""
    q, k, v = random_qkv(220, T=7, S=13, dtype="float32")
    mask = np.random.default_rng(221).random((2, 3, 7, 13)) < 0.7
    mask[0, 1, 2] = False
    options = {"mask": mask, "scale": 0.7}
    extra = {
        "lse-softcap-ignored": {"softcap": 0.5},
        "lse-alibi-ignored": {"alibi_slopes": np.array([0.5, 0.25, 0.125], np.float32)},
        "lse-sinks-ignored": {"sinks": np.array([0.5, -1.0, 1.5], np.float32)},
    }
    return q, k, v, {**options, **extra.get(name, {})}


def _lse(q, k, v, **options):
    return page.attention(q, k, v, return_lse=True, **options)[1]


def _without(name):
    return lambda q, k, v, o: _lse(q, k, v, **{n: x for n, x in o.items() if n != name})


def _no_key_as(value):
    def plant(q, k, v, o):
        lse = _lse(q, k, v, **o)
        return np.where(np.isneginf(lse), np.float32(value), lse)

    return plant


#: How each misreading is planted in the page's lse.
PLANTS = {
    "lse-base-2": lambda q, k, v, o: _lse(q, k, v, **o) / np.float32(np.log(2.0)),
    "lse-unscaled": lambda q, k, v, o: _lse(q, k, v, **{**o, "scale": 1.0}),
    "lse-given-scale-ignored": _without("scale"),
    "lse-softcap-ignored": _without("softcap"),
    "lse-alibi-ignored": _without("alibi_slopes"),
    "lse-sinks-ignored": _without("sinks"),
    "lse-finite-no-key": _no_key_as(-49994.0),
    "lse-plus-inf-no-key": _no_key_as(np.inf),
    "lse-other-layout": lambda q, k, v, o: np.swapaxes(_lse(q, k, v, **o), -1, -2),
}


def test_every_misreading_has_a_plant():
    assert set(PLANTS) == {m.name for m in MISREADINGS}


def _found(actual, q, k, v, options, tol):
    calls = [(0, load_backend("numpy"), "attention", (q, k, v), {**options, "return_lse": True})]
    return find(actual, calls, tol)


@pytest.mark.parametrize("name", list(PLANTS))
def test_planted_misreading_is_named(name):
    q, k, v, options = _inputs(name)
    _, expected, tol = oracle_lse_and_tolerance(q, k, v, "float32", **options)
    actual = np.asarray(PLANTS[name](q, k, v, options), dtype=np.float64)
    with pytest.raises(Departure):
        assert_within(actual, expected, tol, f"planted {name}")
    assert _found(actual, q, k, v, options, tol).sentence == BY_NAME[name].sentence


def test_the_right_lse_is_named_by_nothing():
    q, k, v, options = _inputs()
    _, expected, tol = oracle_lse_and_tolerance(q, k, v, "float32", **options)
    actual = np.asarray(_lse(q, k, v, **options), dtype=np.float64)
    assert_within(actual, expected, tol, "the page's lse")
    assert _found(actual, q, k, v, options, tol).sentence is None


def test_the_output_beside_the_lse_is_left_to_the_output_diagnosis():
    """A departing output of a return_lse call is no lse: the lse's misreadings say
    nothing of it."""
    q, k, v, options = _inputs()
    out = page.attention(q, k, v, **options).astype(np.float64)
    assert _found(out * 2.0, q, k, v, options, 1e-6).sentence is None
