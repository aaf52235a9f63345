"""SPEC §4.11, §4.12 and §19.7: absorbed MLA decoding (multi-query, D = 576, E = 512, V the
first E columns of K) and decode rows of 4,096 keys with masks, dense and paged, against
the oracle's stored outputs (the fixtures ``mla-*``, one shared file)."""

from __future__ import annotations

import numpy as np
import pytest

from conformance.fixtures.oracle import naive_same_precision
from conformance.suite import mla
from conformance.suite.cases import case_entries, load_case
from conformance.suite.helpers import fixture_marks
from conformance.suite.tolerance import assert_within, expect, finite_error, tolerance
from conformance.vocabulary import numpy_dtype


def _params(kind: str):
    return [
        pytest.param(e["id"], marks=fixture_marks(e, "7.1"), id=e["id"])
        for e in case_entries((kind,))
    ]


@pytest.mark.parametrize("case_id", _params("attention_mla"))
def test_mla_fixture(backend, case_id):
    """One decode query (T = 1) against a cache of 4,096 latent keys, without a mask, with
    the bool mask of the 2,500 keys written so far, or with a float mask that blocks the
    first 1,000 keys and a quarter of the rest; and four queries (T = 4) causal bottom-right
    against 1,100 keys. Two query heads read the one key/value head, the scale is 1/√192,
    and each row's maximum grows from key tile to key tile. The output is the 50-digit
    oracle's within SPEC §7."""
    case = load_case(case_id)
    (q, k, v), options = mla.dense_call(case)
    out = backend.attention(q, k, v, **options)
    want = mla.expected(case)
    expect(
        out.shape == want.shape,
        "returns an output of the wrong shape",
        f"{case.id}: shape {out.shape}, expected {want.shape}",
    )
    # The naive run's error against the oracle, as for a fixture (computed here: it goes
    # through BLAS, whose summation order depends on the machine).
    naive = naive_same_precision(q, k, v, numpy_dtype(case.dtype), **options)
    assert_within(
        out,
        want,
        tolerance(case.dtype, finite_error(naive, want), want),
        f"{backend.name} on fixture {case.id} {case.meta['shape']}\n"
        f"  reproduce: {mla.reproduce(case, backend, 'attention')}",
        behaviour="MLA's decode shapes (D = 576, E = 512, one key/value head) or decode rows "
        "of 4,096 keys give a wrong output",
    )


@pytest.mark.parametrize("case_id", _params("attention_mla_paged"))
def test_mla_paged_fixture(backend, case_id):
    """The same cache in 64 pages of 64 slots, shuffled in a pool of 66 whose two others no
    sequence reads: one sequence decodes all 4,096 keys, one the first 2,500 through the
    same pages. Their rows are the dense decode rows (SPEC §19.1), the oracle's within
    SPEC §7."""
    case = load_case(case_id)
    arrays, options = mla.paged_call(case)
    out = backend.attention_paged(*arrays, **options)
    want = mla.expected(case)
    # Sequence b's gathered keys are the cache's first seq_lens[b] keys (by construction),
    # so the naive run is the dense one on them.
    (q, _, _, _, seq_lens), sh = arrays, case.meta["shape"]
    k = mla.array(case, "k").astype(q.dtype)  # (1, 1, S, D)
    naive = np.concatenate(
        [
            naive_same_precision(
                q[b : b + 1],
                k[:, :, :n],
                k[:, :, :n, : sh["E"]],
                numpy_dtype(case.dtype),
                **options,
            )
            for b, n in enumerate(seq_lens)
        ]
    )  # (B, H, 1, E)
    assert_within(
        out,
        want,
        tolerance(case.dtype, finite_error(naive, want), want),
        f"{backend.name} on fixture {case.id} {case.meta['shape']}\n"
        f"  reproduce: {mla.reproduce(case, backend, 'attention_paged')}",
        behaviour="paged MLA decoding over 4,096 keys differs from the oracle",
    )
