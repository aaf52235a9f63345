"""The misreadings of split-KV decoding (SPEC §22.8), an area of the one registry
(``conformance/suite/misreadings.py``): the keys in splits, each a partial state; their
outputs computed in ``conformance/suite/planted_split_kv.py``.
"""

from __future__ import annotations

from conformance.suite.misreading import Misreading, always
from conformance.suite.planted import Call
from conformance.suite.planted_split_kv import (
    balanced,
    sink_per_split,
    splits_sum_unrescaled,
    tail_dropped,
)

#: The split counts and block lengths a decoder may use.
SPLITS = tuple(range(2, 17))
BLOCKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _has_sinks(c: Call) -> bool:
    return c.options.get("sinks") is not None


SPLIT_KV: tuple[Misreading, ...] = (
    *(
        Misreading(
            f"split-tail-dropped-{block}",
            "a split-KV decoder drops the keys after the last whole block: the keys past "
            "the largest multiple of its block length are never read",
            always,
            tail_dropped(block),
            clauses=("22.8", "4.10"),
        )
        for block in BLOCKS
    ),
    *(
        Misreading(
            f"split-sink-per-split-{n}",
            "a split-KV decoder counts the sink once per split: each split's partial state "
            "has the sink in its sum, so the merged denominator holds it once per split",
            _has_sinks,
            sink_per_split(n),
            clauses=("22.6", "22.8", "15.1"),
        )
        for n in SPLITS
    ),
    *(
        Misreading(
            f"split-sum-not-rescaled-{how}-{n}",
            "a split-KV decoder divides by a sum that was not rescaled: each split's "
            "accumulator is brought to the common maximum, its sum is not",
            lambda c: not _has_sinks(c),
            splits_sum_unrescaled(bounds),
            slack=4.0,
            clauses=("22.8", "4.4"),
        )
        # Splits of one length are a blockwise loop's tiles, named by ATTENTION's
        # tiles-sum-not-rescaled.
        for how, n, bounds in (("splits", n, balanced(n)) for n in SPLITS)
    ),
)
