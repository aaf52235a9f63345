"""What one misreading is (``Misreading``): the record every area of the registry
(``conformance/suite/misreadings.py``) is made of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Misreading:
    """One way to misread the spec: when it ``applies`` to a departing call (the area's
    context: a ``Call``, ``LseCall``, ``MergeCall`` or ``QuantizedCall``), what the
    function with it planted returns (``compute``: the compared output's shape, or None
    where it cannot show on this call), and the sentence that names it; ``name`` is its
    short handle, ``clauses`` the clauses whose failures it explains."""

    name: str
    sentence: str
    applies: Callable[[Any], bool]
    compute: Callable[[Any], np.ndarray | None]
    #: How many times the comparison's tolerance an output may be from the planted one
    #: and still show it: more than 1 where the planted run's own rounding is of the
    #: tolerance's size (a blockwise loop's rescales at scores of -1e4).
    slack: float = 1.0
    clauses: tuple[str, ...] = ()
    #: Its mark is a NaN or an infinity: it counts where it changes only non-finite
    #: entries (else a planted output must depart from the right one where both are
    #: finite, or an output that overflowed for another reason would match it).
    nonfinite: bool = False
    #: Named without the misreadings not so marked even where they give the same output
    #: on the case (a slot read, not the mask ignored); joined by another so marked.
    alone: bool = False


def always(call: Any) -> bool:
    return True
