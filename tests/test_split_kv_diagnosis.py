"""SPEC §13.16 and §22.8: a split-KV decoder's departure is named by the misreading it shows.

Each misreading of the ``SPLIT_KV`` area (``conformance/suite/misreadings.py``) is planted in
a correct decoder: the NumPy reference (``load_backend("numpy")``) on each split's keys,
the splits' partial states merged by the NumPy merge page, with one step misread (the keys
after the last whole block never read, the sink in every split's sum, the sums not
rescaled to the common maximum). The output is compared with the 50-digit oracle as a
test compares it, and the failure's behaviour must name the misreading; the right decoder
is named by nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from conformance.impls.numpy.merge import merge_states
from conformance.impls.numpy.split_kv import chunks

from conformance import load_backend
from conformance.suite.behaviours import behaviour
from conformance.suite.diagnosis import find
from conformance.suite.helpers import oracle_attention, random_qkv, random_tolerance
from conformance.suite.misreadings import ATTENTION, SPLIT_KV
from conformance.suite.tolerance import Departure, assert_within

pytestmark = pytest.mark.clause("22.8")
REFERENCE = load_backend("numpy")
BY_NAME_ATTENTION = {m.name: m for m in ATTENTION}
SPLITS = 4
#: The decode rows: four queries against 100 keys, two query heads per key/value head,
#: scores that grow from key to key (each split raises the row's maximum).
B, H, K, T, S, D = 1, 4, 2, 4, 100, 8


def _inputs(seed: int = 300):
    q, k, v = random_qkv(seed, B=B, H=H, K=K, T=T, S=S, D=D)
    k = k + np.linspace(0.0, 3.0, S)[None, None, :, None] * np.sign(q.mean(axis=(0, 1, 2)))
    return q, k, v


def _split(q, k, v, options, *, sink_per_split=False):
    """The partial states (o_c, lse_c) of each split, from the reference."""
    states = []
    for s0, s1 in chunks(S, SPLITS):
        part = dict(options)
        if not sink_per_split:
            part.pop("sinks", None)
        o, lse = REFERENCE.attention(q, k[:, :, s0:s1], v[:, :, s0:s1], return_lse=True, **part)
        states.append((np.asarray(o, np.float64), np.asarray(lse, np.float64)))
    return states


def _merged(states):
    o, lse = states[0]
    for o_c, lse_c in states[1:]:
        o, lse = merge_states(o, lse, o_c, lse_c)
    return o


def right_decoder(q, k, v, **options):
    """Split-KV done right: the sink merged once, as a piece of its own (o = 0)."""
    states = _split(q, k, v, options)
    if "sinks" in options:
        lse_sink = np.broadcast_to(options["sinks"][None, :, None], states[0][1].shape)
        states.append((np.zeros_like(states[0][0]), lse_sink.astype(np.float64)))
    return _merged(states)


def tail_dropped(q, k, v, **options):
    """A loop over whole blocks of 16 keys: the last 4 of 100 are never read."""
    kept = S // 16 * 16
    return REFERENCE.attention(q, k[:, :, :kept], v[:, :, :kept], **options)


def sink_per_split(q, k, v, **options):
    """Each split attends with the sink in its own softmax; the pieces merged."""
    return _merged(_split(q, k, v, options, sink_per_split=True))


def sum_not_rescaled(q, k, v, **options):
    """Each split's accumulator brought to the common maximum, its sum left at its own."""
    kk, vv = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    scores = q @ np.swapaxes(kk, -1, -2) / np.sqrt(D)  # (B, H, T, S)
    top = scores.max(axis=-1, keepdims=True)
    acc, total = 0.0, 0.0
    for s0, s1 in chunks(S, SPLITS):
        x = scores[..., s0:s1]
        m = x.max(axis=-1, keepdims=True)
        p = np.exp(x - m)
        total = total + p.sum(axis=-1, keepdims=True)
        acc = acc + np.exp(m - top) * (p @ vv[:, :, s0:s1])
    return acc / total


PLANTS = {
    "split-tail-dropped-16": (tail_dropped, {}),
    f"split-sink-per-split-{SPLITS}": (sink_per_split, {"sinks": np.array([0.5, 2.0, -1.0, 3.0])}),
    f"split-sum-not-rescaled-splits-{SPLITS}": (sum_not_rescaled, {}),
}


def _failure(out, q, k, v, options):
    expected = oracle_attention(q, k, v, **options)
    # The tolerance of the inputs with their NaN as numbers (a NaN would make it NaN).
    tol = random_tolerance(*(np.nan_to_num(x) for x in (q, k, v)), "float64", **options)
    calls = [(0, REFERENCE, "attention", (q, k, v), options)]
    with pytest.raises(Departure) as info:
        assert_within(out, expected, tol, "the test's comparison", behaviour="the test's words")
    return behaviour(info.value, calls, "7.1", "Tolerance"), find(out, calls, tol)


def test_every_sentence_has_a_plant():
    by_name = {m.name: m for m in SPLIT_KV}
    assert {by_name[n].sentence for n in PLANTS} == {m.sentence for m in SPLIT_KV}


@pytest.mark.parametrize("name", list(PLANTS))
def test_a_planted_split_kv_bug_is_named(name):
    q, k, v = _inputs()
    planted, options = PLANTS[name]
    out = planted(q, k, v, **options)
    named, _ = _failure(out, q, k, v, options)
    assert named == {m.name: m for m in SPLIT_KV}[name].sentence


@pytest.mark.parametrize("options", [{}, {"sinks": np.array([0.5, 2.0, -1.0, 3.0])}])
def test_the_right_decoder_is_named_by_nothing(options):
    q, k, v = _inputs()
    out = right_decoder(q, k, v, **options)
    expected = oracle_attention(q, k, v, **options)
    tol = random_tolerance(q, k, v, "float64", **options)
    assert_within(out, expected, tol, "the right decoder")
    calls = [(0, REFERENCE, "attention", (q, k, v), options)]
    assert find(out, calls, tol).sentence is None


def test_an_unexplained_departure_says_where_it_lies():
    """A decoder whose last split's output is off, by no known misreading: the finding
    says which rows and heads hold the error."""
    q, k, v = _inputs()
    out = right_decoder(q, k, v)
    out[:, 1] += 0.25
    named, found = _failure(out, q, k, v, {})
    assert named == "the test's words" and found.sentence is None
    assert found.where.startswith("the error lies in the one batch element, head 1 of 4")


def test_a_nan_the_tail_would_not_have_read_is_named_by_the_tail():
    """A NaN in a key the dropped tail leaves out, and one in a key it reads: the output's
    NaN rows are the reference's where the NaN is read, and the finding is the dropped
    tail, not "a NaN in the inputs reaches outputs that do not read it" (issue 49)."""
    q, k, v = _inputs()
    k = k.copy()
    k[0, 0, 3, 0] = np.nan  # read: key/value head 0's rows are NaN, as the reference's
    v[0, 1, 98, 0] = np.nan  # in the tail: key/value head 1 should be NaN, and is not
    out = tail_dropped(q, k, v)
    named, _ = _failure(out, q, k, v, {})
    assert named == {m.name: m for m in SPLIT_KV}["split-tail-dropped-16"].sentence


def test_an_attention_misreading_is_not_renamed_by_a_split_alike_on_its_case():
    """Keys read as if S = T at T = 16, S = 20 are the keys a decoder with blocks of 16
    reads: the failure is named by attention's misreading alone, both are recorded, and
    the run names it by whichever the most of its failures show."""
    q, k, v = random_qkv(301, B=1, H=2, T=16, S=20, D=4)
    out = REFERENCE.attention(q, k[:, :, :16], v[:, :, :16])
    named, found = _failure(out, q, k, v, {})
    keys = BY_NAME_ATTENTION["keys-as-if-s-is-t"].sentence
    tail = {m.name: m for m in SPLIT_KV}["split-tail-dropped-16"].sentence
    assert named == keys and found.sentence == keys
    assert keys in found.matches and tail in found.matches
