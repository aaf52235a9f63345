"""The size pool (SPEC §13.21): the shapes the suite's tests draw or pick their sizes from.

A framework that compiles per shape (JAX, torch.compile) builds a program for every
distinct shape a run hands it, and an eager JAX function one per operation and shape: the
number of distinct shapes is the suite's choice, and it is most of a cold run's time.
So sizes are not drawn freely: Hypothesis keeps drawing values, masks and options, and
draws the shape of a problem from this pool, whose shapes the suite's own tests already
use (the invariants' lengths at ``random_qkv``'s heads, the fixtures'), so that a drawn
problem mostly reuses programs another test compiled.

Each shape is in the pool for a case that tells bugs apart; a shape is
(B, H, K, T, S, D, E), batch, query heads, key/value heads, queries, keys, q/k head dim,
v head dim.
"""

from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):
    B: int
    H: int
    K: int
    T: int
    S: int
    D: int
    E: int


#: The pool, each shape with why it is in it, smallest first (Hypothesis shrinks a failing
#: example towards the first).
SHAPES: dict[str, tuple[Shape, str]] = {
    "T1-S1": (Shape(1, 2, 2, 1, 1, 4, 4), "one query and one key: the least call"),
    "T1-S9": (Shape(1, 2, 2, 1, 9, 4, 4), "T = 1, a decode row (the fixtures' T1-S9)"),
    "H1-E3": (
        Shape(1, 1, 1, 5, 6, 4, 3),
        "one head, E ≠ D: a head axis squeezed or summed away shows (the edges' shape)",
    ),
    "D1": (Shape(1, 2, 2, 6, 8, 1, 1), "a head dim of 1 (the fixtures' D1)"),
    "GQA-T5-S9": (
        Shape(2, 4, 2, 5, 9, 4, 3),
        "K < H (groups of 2), E ≠ D, T < S, two batch elements (§4.7's unused slots)",
    ),
    "MQA-T7-S7": (Shape(1, 4, 1, 7, 7, 4, 4), "K = 1, T = S odd (the fixtures' MQA case)"),
    "T7-S13": (
        Shape(2, 3, 3, 7, 13, 5, 5),
        "T < S, lengths no tile divides, an odd D (the invariants' T7-S13)",
    ),
    "T13-S7-E3": (
        Shape(1, 2, 2, 13, 7, 5, 3),
        "T > S with E ≠ D: a 1/sqrt(E) scale or a swapped T and S shows",
    ),
    "T13-S7": (Shape(2, 3, 3, 13, 7, 5, 5), "T > S (the invariants' T13-S7)"),
    "T8-S8": (Shape(2, 3, 3, 8, 8, 5, 5), "T = S, a multiple of tiles of 2, 4, 8"),
}

#: The lengths every invariant runs on (``helpers.SIZES``): T < S, T > S and T = S from
#: the pool, awkward ones that find bugs round ones hide.
SIZES = {
    name: {"T": SHAPES[name][0].T, "S": SHAPES[name][0].S} for name in ("T7-S13", "T13-S7", "T8-S8")
}


def pooled_shape(shape: Shape, *, gqa: bool, value_dim: bool, unbatched: bool) -> Shape:
    """``shape`` as a backend can take it: K = H without "gqa", E = D without
    "value_dim", B = 1 for unbatched inputs; every length and head dim stays the pool's."""
    return shape._replace(
        K=shape.K if gqa else shape.H,
        E=shape.E if value_dim else shape.D,
        B=1 if unbatched else shape.B,
    )
