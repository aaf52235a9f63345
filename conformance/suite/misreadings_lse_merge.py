"""The misreadings of the log-sum-exp (SPEC §21) and of merges of partial states (SPEC
§22), two areas of the one registry (``conformance/suite/misreadings.py``): the lse held
against the float64 textbook lse, a merge against the formula on its own pieces
(``conformance/suite/planted_lse_merge.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from conformance.suite.misreading import Misreading, always
from conformance.suite.planted_lse_merge import (
    LseCall,
    lse_of,
    lse_where_no_key,
    lse_without,
    merge_averaged,
    merge_unguarded,
    merge_without_maximum,
    merged,
)

# --- The log-sum-exp (SPEC §21) --------------------------------------------------------------
# The public record: one API gave base-2 or base-e depending on the kernel it picked
# (FlashInfer #4485), and merges that mixed the two gave garbage (vLLM #28840, SGLang
# #35045); a fully masked row returned a finite lse of -49994 instead of -inf (FlashInfer
# #4452); an lse read in the other layout, or of the scores before the scale.


def _option(name: str) -> Callable[[LseCall], bool]:
    return lambda c: c.call.options.get(name) is not None


LSE: tuple[Misreading, ...] = (
    Misreading(
        "lse-base-2",
        "returns the log-sum-exp in base 2 where base e is declared (a factor log₂ e off)",
        always,
        lambda c: c.right / math.log(2.0),
        clauses=("21.1",),
    ),
    Misreading(
        "lse-unscaled",
        "returns the log-sum-exp of the scores before the scale",
        lambda c: c.call.scale != 1.0,
        lambda c: lse_of(c.call, scale=1.0),
        clauses=("21.1", "4.1"),
    ),
    Misreading(
        "lse-given-scale-ignored",
        "returns the log-sum-exp at the default scale 1/√D, not at the scale given",
        _option("scale"),
        lse_without("scale"),
        clauses=("21.1", "4.1"),
    ),
    Misreading(
        "lse-softcap-ignored",
        "returns the log-sum-exp of the scores before the softcap",
        _option("softcap"),
        lse_without("softcap"),
        clauses=("21.5", "4.2"),
    ),
    Misreading(
        "lse-alibi-ignored",
        "returns the log-sum-exp of the scores without the ALiBi bias",
        _option("alibi_slopes"),
        lse_without("alibi_slopes"),
        clauses=("21.5", "17.1"),
    ),
    Misreading(
        "lse-sinks-ignored",
        "returns the log-sum-exp without the sink's term",
        _option("sinks"),
        lse_without("sinks"),
        clauses=("21.5", "15.1"),
    ),
    Misreading(
        "lse-finite-no-key",
        "gives a finite log-sum-exp for a row with no key, not -inf",
        always,
        lse_where_no_key(finite=True),
        clauses=("21.2",),
        nonfinite=True,
    ),
    Misreading(
        "lse-plus-inf-no-key",
        "gives +inf as the log-sum-exp of a row with no key, not -inf",
        always,
        lse_where_no_key(finite=False),
        clauses=("21.2",),
        nonfinite=True,
    ),
    Misreading(
        "lse-other-layout",
        "returns the log-sum-exp in the other layout, (B, T, H) for (B, H, T)",
        always,
        lambda c: np.swapaxes(c.right, -1, -2),
        clauses=("21.1",),
    ),
)


# --- Merges of partial states (SPEC §22) ----------------------------------------------------
# The public record: outputs averaged as if every piece held as many keys, two empty
# pieces merged into NaN (FlashInfer #4051), base-e lse merged in base 2 (vLLM #28840,
# SGLang #35045).


def _other_pieces_lse(m, a, b):
    return np.exp(b - m), np.exp(a - m)


MERGE: tuple[Misreading, ...] = (
    Misreading(
        "merge-averaged",
        "averages the pieces' outputs instead of weighting each by exp(lse), its share of "
        "the union's denominator",
        always,
        merge_averaged,
        clauses=("22.1",),
    ),
    Misreading(
        "merge-other-pieces-lse",
        "weights each piece with the other piece's lse",
        always,
        lambda c: merged(c, weights=_other_pieces_lse),
        clauses=("22.1",),
    ),
    Misreading(
        "merge-base-2-on-base-e",
        "merges natural-log lse in base 2 (exp2 and log2 on base-e lse): the weights and "
        "the merged lse are off",
        always,
        lambda c: merged(c, exp=np.exp2, log=np.log2),
        clauses=("22.1", "22.10"),
    ),
    Misreading(
        "merge-empty-as-zero",
        "reads a piece's lse of -inf (no key) as 0: the empty piece is weighted as if it held keys",
        lambda c: bool(np.isneginf(c.lse_a).any() or np.isneginf(c.lse_b).any()),
        lambda c: merged(
            c,
            lse_a=np.where(np.isneginf(c.lse_a), 0.0, c.lse_a),
            lse_b=np.where(np.isneginf(c.lse_b), 0.0, c.lse_b),
        ),
        clauses=("22.2", "22.3"),
        nonfinite=True,
    ),
    Misreading(
        "merge-empty-nan",
        "merges two empty pieces (lse = -inf) into NaN: -inf - (-inf) is NaN where the "
        "larger lse is taken off unguarded",
        always,
        merge_unguarded,
        clauses=("22.3",),
        nonfinite=True,
    ),
    Misreading(
        "merge-exp-without-maximum",
        "takes exp(lse) without subtracting the larger lse: large lse overflow, and "
        "the weights lose precision",
        always,
        merge_without_maximum,
        clauses=("22.5", "22.2"),
        nonfinite=True,
    ),
)
