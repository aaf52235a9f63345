"""Where a library function returns its log-sum-exp, and how to read it (SPEC §21): a
profile's ``[lse]`` table, and the conversion of what the function returns to the spec's
``(out, lse)``, lse (B, H, T) in the natural log."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The layouts a function may return its lse in: heads-first, as the spec's, or
#: time-first (a (B, T, H, D) function's natural layout).
LSE_LAYOUTS = ("BHT", "BTH")
#: The bases of the log: e (the spec's, FlashAttention's ``softmax_lse``) or 2 (kernels that
#: work with exp2, FlashInfer's).
LSE_BASES = ("e", "2")
LSE_KEYS = {"index", "key", "out", "keyword", "layout", "base"}


@dataclass(frozen=True)
class LseForm:
    """How a function returns its log-sum-exp.

    Attributes:
      index, key: where the lse is in the function's result, one of them: an index into
        a tuple or list, or the name of a key (a dict) or of an attribute.
      out: where the output is in that result: an index or a key (default 0).
      keyword: the function's keyword that asks for the lse (passed True when the spec
        asks for it); None: the function always returns both.
      layout: "BHT" or "BTH" ((H, T) or (T, H) unbatched).
      base: "e" or "2": the log's base.
    """

    index: int | None = None
    key: str | None = None
    out: int | str = 0
    keyword: str | None = None
    layout: str = "BHT"
    base: str = "e"

    def __post_init__(self) -> None:
        if (self.index is None) == (self.key is None):
            raise ValueError(
                "[lse] needs one of index (its place in a tuple) and key (a dict key or an "
                f"attribute), got index={self.index!r}, key={self.key!r}"
            )
        if self.index is not None and (
            isinstance(self.index, bool) or not isinstance(self.index, int)
        ):
            raise ValueError(f"[lse] index should be an int, got {self.index!r}")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise ValueError(f"[lse] key should be a name, got {self.key!r}")
        if isinstance(self.out, bool) or not isinstance(self.out, (int, str)):
            raise ValueError(f"[lse] out should be an index (int) or a key (str), got {self.out!r}")
        if self.keyword is not None and (not isinstance(self.keyword, str) or not self.keyword):
            raise ValueError(f"[lse] keyword should be a keyword's name, got {self.keyword!r}")
        if self.layout not in LSE_LAYOUTS:
            raise ValueError(f"[lse] layout should be one of {LSE_LAYOUTS}, got {self.layout!r}")
        if self.base not in LSE_BASES:
            raise ValueError(f"[lse] base should be one of {LSE_BASES}, got {self.base!r}")

    def split(self, result: Any, asked: bool, func_name: str) -> tuple[Any, Any]:
        """(out, lse) from what the function returned; lse None where it was not asked for
        by ``keyword`` (the function then returned the output alone)."""
        if self.keyword is not None and not asked:
            return result, None
        at = self.key if self.index is None else self.index
        return _pick(result, self.out, func_name), _pick(result, at, func_name)

    def to_spec(self, lse: np.ndarray) -> np.ndarray:
        """The lse as the spec has it: (B, H, T) ((H, T) unbatched), the natural log, in
        the dtype the function returned it in."""
        lse = np.asarray(lse)
        if self.layout == "BTH" and lse.ndim >= 2:
            lse = np.swapaxes(lse, -1, -2)  # (B, H, T) or (H, T)
        if self.base == "2":
            # log2 x · ln 2 = ln x; one rounding in the lse's own dtype.
            lse = (lse.astype(np.float64) * math.log(2.0)).astype(lse.dtype)
        return np.ascontiguousarray(lse)


def _pick(result: Any, at: int | str, func_name: str) -> Any:
    """result[at] (a tuple's index or a dict's key) or result.at (an attribute)."""
    try:
        if isinstance(at, int) or isinstance(result, dict):
            return result[at]
        return getattr(result, at)
    except (IndexError, KeyError, TypeError, AttributeError) as err:
        # An AssertionError fails the test: never an error a bad-input test could take
        # for a refusal.
        raise AssertionError(
            f"{func_name}() returned a {type(result).__name__} with no {at!r} (its profile's "
            f"[lse] table): {err}"
        ) from None


def parse_lse(table: Any, where: str) -> LseForm:
    """A profile's ``[lse]`` table, checked: ValueError naming the key that is wrong."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: [lse] should be a table, got {table!r}")
    unknown = sorted(set(table) - LSE_KEYS)
    if unknown:
        raise ValueError(f"{where}: [lse] has unknown keys {unknown}; known: {sorted(LSE_KEYS)}")
    try:
        return LseForm(**table)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
