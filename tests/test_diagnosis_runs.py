"""SPEC §13.16 over a run: the spec's own tests, run in-process on a function with one
planted bug (``tests/mutants.py``, or a small planted backend here), name each failure by
its cause; every misreading a failure's output equals is recorded with it, and
``diagnosis.explaining_causes`` names the run's failures by the cause that explains them
all. A comparison no misreading explains says where its error lies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from mutants import (
    MUTANTS,
    GradientMutantBackend,
    MutantBackend,
    Steps,
    block_by_adding,
    cast_output,
    hide_unused_never,
)

import conformance
from conformance.adapters.domain import Domain
from conformance.suite import behaviours, verdicts
from conformance.suite.diagnosis import explaining_causes, find
from conformance.suite.helpers import oracle_attention, random_qkv
from conformance.suite.misreadings import BY_NAME

pytestmark = pytest.mark.clause("13.16")
SUITE = Path(conformance.__file__).resolve().parent / "tests"


class _Behaviours:
    """A pytest plugin that keeps each failing test's behaviour, misreadings and where."""

    def __init__(self) -> None:
        self.failed: list[dict] = []

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.failed:
            props = dict(report.user_properties)
            self.failed.append(
                {
                    "test": report.nodeid,
                    "behaviour": props.get(behaviours.PROPERTY),
                    "misreadings": json.loads(props.get(behaviours.MISREADINGS, "[]")),
                    "where": props.get(behaviours.WHERE),
                    "clause": json.loads(props.get(verdicts.LABEL, "{}")).get("clause"),
                }
            )


def _run(registry, cls, tmp_path, *selection, args=()) -> list[dict]:
    registry.register(cls.name, cls)
    seen = _Behaviours()
    pytest.main(
        [*(str(SUITE / s) for s in selection), "--backend", cls.name, "-q", "--tb=no"]
        + ["-p", "no:cacheprovider", "--repro-dir", str(tmp_path), *args],
        plugins=[seen],
    )
    assert seen.failed, f"{cls.name} fails none of {selection}"
    return seen.failed


def _named(failed: list[dict]) -> list[str]:
    return explaining_causes([(f["behaviour"], f["misreadings"]) for f in failed])


def test_gqa_tiling_is_named_where_a_nan_is_lost(registry, tmp_path):
    """With GQA heads tiled, the NaN test's heads that should read the NaN do not: the
    failure is the tiling, not "a NaN in the inputs becomes a number in the output"."""
    failed = _run(
        registry, MUTANTS["mutant-gqa-tile"][0], tmp_path, "test_edges.py::test_nan_propagates"
    )
    tiled = BY_NAME["gqa-tiled"].sentence
    assert {f["behaviour"] for f in failed} == {tiled}, failed


def test_the_cause_that_explains_every_failure_names_them(registry, tmp_path):
    """Causality always aligned bottom-right: at T = 1 the output is also attention without
    causality, and those failures record both readings; over the run, bottom-right explains
    every failure, and names each of them."""
    cls = MUTANTS["mutant-bottom-right-for-top-left"][0]
    failed = _run(
        registry, cls, tmp_path, "test_fixtures.py::test_fixture_case", "test_variants.py"
    )
    bottom_right = BY_NAME["bottom-right-for-top-left"].sentence
    ignored = BY_NAME["causal-ignored"].sentence
    both = [f for f in failed if {bottom_right, ignored} <= set(f["misreadings"])]
    assert both, failed
    # A failure that cannot tell the two apart names both.
    assert all(ignored in f["behaviour"] and bottom_right in f["behaviour"] for f in both)
    # Over the run, every failure that shows bottom-right is named by it alone (the others
    # are garbage read from slots that bottom-right attends: named by those slots).
    named = _named(failed)
    shown = [n for f, n in zip(failed, named) if bottom_right in f["misreadings"]]
    assert len(shown) > len(both) and set(shown) == {bottom_right}, failed
    assert ignored not in " ".join(named)


def test_a_cause_is_named_alone_only_where_the_run_tells_it_apart():
    """Where every failure matches the same two misreadings, the run names them together,
    as each failure does; a failure no misreading matched keeps its own behaviour."""
    a, b = BY_NAME["causal-ignored"].sentence, BY_NAME["bottom-right-for-top-left"].sentence
    failures = [("a and b", [a, b]), ("a and b", [a, b]), ("raises ValueError: N", [])]
    assert explaining_causes(failures) == ["a and b", "a and b", "raises ValueError: N"]
    failures.append((b, [b]))
    assert explaining_causes(failures) == [b, b, "raises ValueError: N", b]


@pytest.mark.parametrize(
    "name", ["mutant-tiles-sum-not-rescaled", "mutant-tiles-accumulator-not-rescaled"]
)
def test_a_blockwise_rescale_is_named(registry, tmp_path, name):
    """At key tiles of 512 and 1,024 the long rows fail, named by the rescale left out
    (the test's docstring guesses at nothing)."""
    failed = _run(registry, MUTANTS[name][0], tmp_path, "test_long_rows.py")
    which = "sum" if "sum" in name else "accumulator"
    sentence = BY_NAME[f"tiles-{which}-not-rescaled-512"].sentence
    assert {f["behaviour"] for f in failed} == {sentence}, failed


class _KeysPastS(MutantBackend):
    """Reads keys past S under causality with T > S, as a kernel whose key loop runs to the
    query's own position does: the slots it reads there hold NaN."""

    name = "planted-keys-past-s"

    def _attention(self, q, k, v, *, is_causal=False, **options):
        T, S = q.shape[-2], k.shape[-2]
        if not is_causal or T <= S:
            return super()._attention(q, k, v, is_causal=is_causal, **options)
        pad = [(0, 0)] * (k.ndim - 2) + [(0, T - S), (0, 0)]
        k = np.pad(k, pad, constant_values=np.nan)  # (B, K, T, D)
        v = np.pad(v, pad, constant_values=np.nan)  # (B, K, T, E)
        return super()._attention(q, k, v, is_causal=True, **options)


def test_a_nan_weight_is_not_called_negative(registry, tmp_path):
    failed = _run(registry, _KeysPastS, tmp_path, "test_invariants.py::test_weight_rows_sum_to_one")
    past = BY_NAME["keys-past-s"].sentence
    assert {f["behaviour"] for f in failed} == {past}, failed


class _BlockedSlotsAdded(MutantBackend):
    """Blocks a key by adding -inf to a score computed from every slot: a NaN or inf in a
    blocked slot's key reaches the scores (NaN + -inf), one in its value the product with
    V (0 · NaN)."""

    name = "planted-blocked-slots-added"
    steps = type(
        "Steps_added",
        (Steps,),
        {"hide_unused": staticmethod(hide_unused_never), "block": staticmethod(block_by_adding)},
    )


@pytest.mark.parametrize(
    "cls, mechanism",
    [
        (MUTANTS["mutant-unused-slots-read"][0], "blocked-slot-multiplied"),
        (_BlockedSlotsAdded, "blocked-slot-read"),
    ],
    ids=["selected", "added"],
)
def test_a_blocked_slot_is_named_by_how_it_is_read(registry, tmp_path, cls, mechanism):
    """§4.7's fixtures hold garbage in some heads' keys and other heads' values: a function
    that selects -inf for a blocked key (its value still multiplied by weight 0) and one
    that adds -inf to the key's score are each named by their own mechanism, the other
    never, in every dtype."""
    failed = _run(
        registry, cls, tmp_path, "test_fixtures.py::test_fixture_case", args=["-k", "inert"]
    )
    named = _named(failed)
    slots = {BY_NAME[n].sentence for n in ("blocked-slot-read", "blocked-slot-multiplied")}
    assert set(named) & slots == {BY_NAME[mechanism].sentence}, failed
    for case in ("inert-causal-T4-S9", "inert-float-mask-column"):
        for dtype in ("float64", "float32", "float16", "bfloat16"):
            ours = [n for f, n in zip(failed, named) if f"-{case}-{dtype}]" in f["test"]]
            assert ours == [BY_NAME[mechanism].sentence], (case, dtype, failed)


def test_a_slot_with_garbage_in_its_key_and_its_value_names_both():
    """Garbage in both the key and the value of every blocked slot: reading the key into the
    scores and multiplying the value by 0 give the same NaN rows, and both are named; the
    run's other cases tell which (``explaining_causes``)."""
    q, k, v = random_qkv(12, B=1, H=2, T=3, S=6, D=4)
    k[..., 3:, :] = np.nan  # (B, K, S, D): keys 3-5 come after every query
    v[..., 3:, :] = np.nan
    calls = [(0, None, "attention", (q, k, v), {"is_causal": True})]
    nan_rows = np.full((1, 2, 3, 4), np.nan)
    found = find(nan_rows, calls, 1e-9)
    read, multiplied = (
        BY_NAME[n].sentence for n in ("blocked-slot-read", "blocked-slot-multiplied")
    )
    assert found.matches == (read, multiplied), found
    assert found.sentence == f"{read}; or, alike on this case, {multiplied}"
    failures = [(found.sentence, found.matches), ("x", [multiplied])]
    assert explaining_causes(failures) == [multiplied, multiplied]


class _MaskScaledWithScores(GradientMutantBackend):
    """Adds the float mask to the scores before the scale, ((q·k) + mask) · scale, forward
    and backward, as Pallas' TPU flash attention does with its bias: dmask comes back as
    the scale times dZ."""

    name = "planted-mask-scaled-with-scores"

    @staticmethod
    def _scaled(q, options):
        mask, scale = options.get("mask"), options.get("scale")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        if mask is None or mask.dtype == np.bool_:
            return options, 1.0
        return {**options, "mask": (mask * scale).astype(mask.dtype)}, scale

    def _attention(self, q, k, v, **options):
        return super()._attention(q, k, v, **self._scaled(q, options)[0])

    def _attention_vjp(self, q, k, v, d_out, **options):
        options, scale = self._scaled(q, options)
        grads = super()._attention_vjp(q, k, v, d_out, **options)
        if scale == 1.0:
            return grads
        return (*grads[:3], (grads[3] * scale).astype(grads[3].dtype), *grads[4:])


def test_a_gradient_is_named_by_the_forwards_cause(registry, tmp_path):
    """The float mask's gradient fixtures (§12.3, §12.4) of a function that scales the mask
    with the scores: every gradient that departs, dmask too, is named by the forward's
    misreading, one finding with the forward fixtures'."""
    failed = _run(
        registry,
        _MaskScaledWithScores,
        tmp_path,
        "test_gradients.py::test_gradient_fixture",
        "test_fixtures.py::test_fixture_case",
        args=["-k", "float-mask and not inert and not nan"],
    )
    scaled = BY_NAME["float-mask-scaled"].sentence
    gradients = [f for f in failed if "test_gradient_fixture" in f["test"]]
    assert "12.3" in {f["clause"] for f in gradients}, failed
    assert {f["behaviour"] for f in failed} == {scaled}, failed


def _float32_for_16_bit(out, dtype):
    """BUG: 16-bit inputs come back as the float32 they were computed in."""
    return out.astype(np.float32) if np.dtype(dtype).itemsize == 2 else cast_output(out, dtype)


class _Decode32(MutantBackend):
    """A decode kernel (T = 1 only) whose output for 16-bit inputs is the float32 it
    computed in."""

    name = "planted-decode-float32-out"
    domain = Domain(max_t=1)
    steps = type("Steps_float32", (Steps,), {"cast_output": staticmethod(_float32_for_16_bit)})


class _Decode32OneOverD(_Decode32):
    """The same kernel, whose 16-bit path also scales by 1/D by default."""

    name = "planted-decode-float32-out-1-over-d"

    def _attention(self, q, k, v, *, scale=None, **options):
        if np.dtype(q.dtype).itemsize == 2 and scale is None:
            scale = 1.0 / q.shape[-1]
        return super()._attention(q, k, v, scale=scale, **options)


#: The tests that look at a forward output's dtype or values at T = 1.
_OUTPUT_TESTS = (
    "test_fixtures.py::test_fixture_case",
    "test_invariants.py",
    "test_properties.py::test_matches_the_reference",
    "test_edges.py::test_empty_sequences",
)


def test_an_output_dtype_is_one_finding(registry, tmp_path):
    """float32 for 16-bit inputs fails §2.4's test once per dtype, and nothing else: every
    other test judged the values (right here) in the dtype they came in."""
    failed = _run(registry, _Decode32, tmp_path, *_OUTPUT_TESTS)
    dtype = "returns float32 for float16 or bfloat16 inputs"
    assert {(f["test"].rpartition("::")[2], f["behaviour"], f["clause"]) for f in failed} == {
        (f"test_output_dtype[{_Decode32.name}-{d}]", dtype, "2.4") for d in ("float16", "bfloat16")
    }, failed


def test_values_in_another_dtype_are_judged(registry, tmp_path):
    """The same kernel with its 16-bit values scaled by 1/D: the 16-bit fixtures fail,
    named by the scale, not by the dtype, which §2.4's test names alone."""
    failed = _run(registry, _Decode32OneOverD, tmp_path, *_OUTPUT_TESTS)
    dtype = "returns float32 for float16 or bfloat16 inputs"
    fixtures = [f for f in failed if "test_fixture_case" in f["test"]]
    assert fixtures and all(f["behaviour"].startswith("the default scale is 1/D") for f in fixtures)
    assert {f["test"].split("-")[-1] for f in fixtures} == {"float16]", "bfloat16]"}, fixtures
    assert [f["clause"] for f in failed if f["behaviour"] == dtype] == ["2.4", "2.4"], failed


def test_an_unexplained_departure_says_where_it_lies():
    """A wrong output no misreading explains: batch element 1, head 0, rows 2 on, off by
    0.3; the finding says so, and that the mask left out brings it nearer."""
    q, k, v = random_qkv(11, B=2, H=2, T=4, S=5, D=3)
    calls = [(0, None, "attention", (q, k, v), {})]
    wrong = oracle_attention(q, k, v)
    wrong[1, 0, 2:] += 0.3
    found = find(wrong, calls, 1e-9)
    assert found.sentence is None and found.matches == ()
    assert found.where == (
        "the error lies in batch element 1 of 2, head 0 of 2, rows 2-3 of 4, every channel (3)"
    )
    mask = np.ones((4, 5), dtype=bool)
    mask[:, 1] = False
    calls = [(0, None, "attention", (q, k, v), {"mask": mask})]
    unmasked = oracle_attention(q, k, v)
    unmasked[0, 0, 0, 0] += 0.01  # not quite the mask ignored: no misreading
    found = find(unmasked, calls, 1e-9)
    assert found.sentence is None
    assert found.where.endswith("the output is nearer to attention without mask"), found.where
