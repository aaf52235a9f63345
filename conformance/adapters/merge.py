"""A library's merge of partial states (SPEC §22) as the suite calls it: a profile's
``[merge]`` table.

    capabilities = ["merge", ...]
    [merge]
    function = "flashinfer:merge_state"      # merge(o_a, lse_a, o_b, lse_b) -> (o, lse)
    layout = "BTH"                           # the lse's: or "BHT" (the default)
    base = "2"                               # the lse's: or "e" (the default)

The outputs o are in the profile's ``layout`` (BHTD: (B, H, T, E); BTHD: (B, T, H, E)),
the log-sum-exps in the table's ``layout`` and ``base`` (the ``[lse]`` table's keys and
values, ``conformance/adapters/lse.py``), all in the profile's framework's arrays; the function returns the merged (o, lse) in the same conventions.
The suite hands it the spec's (o (B, H, T, E), lse (B, H, T) natural log) and reads its
answer back: the conversions are here, visibly, and change no number but by the base's
factor log₂e. (The lse of ``attention`` itself is the profile's ``[lse]`` table's.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.adapters.impl import import_target
from conformance.adapters.lse import LSE_BASES, LSE_LAYOUTS
from conformance.backends import Backend
from conformance.backends.arrays import make_framework

MERGE_KEYS = {"function", "layout", "base"}


def parse_merge(table: Any, where: str) -> dict:
    """The ``[merge]`` table, checked: {function, layout, base}, the last two the lse's.

    Raises:
      ValueError: an unknown key, or a value that is not one of those allowed.
    """
    if not isinstance(table, dict):
        raise ValueError(f"{where}: [merge] should be a table, got {table!r}")
    unknown = sorted(set(table) - MERGE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: [merge] has unknown keys {unknown}; known: {sorted(MERGE_KEYS)}"
        )
    function = table.get("function")
    if not isinstance(function, str) or ":" not in function:
        raise ValueError(
            f"{where}: [merge] function should be the 'module:function' of the merge, "
            f"got {function!r}"
        )
    parsed = {
        "function": function,
        "layout": table.get("layout", "BHT"),
        "base": str(table.get("base", "e")),
    }
    for key, allowed in (("layout", LSE_LAYOUTS), ("base", LSE_BASES)):
        if parsed[key] not in allowed:
            raise ValueError(
                f"{where}: [merge] {key} should be one of {list(allowed)}, got {parsed[key]!r}"
            )
    return parsed


class MergeFunction:
    """A library's merge, NumPy in and out in the spec's conventions (SPEC §22.1)."""

    def __init__(
        self,
        func: Callable[..., Any],
        arrays: Any,
        *,
        layout: str = "BHTD",
        lse_layout: str = "BHT",
        lse_base: str = "e",
    ) -> None:
        self.func = func
        self.arrays = arrays
        self.layout = layout
        self.lse_layout = lse_layout
        self.lse_base = lse_base

    def __call__(self, o_a, lse_a, o_b, lse_b) -> tuple[np.ndarray, np.ndarray]:
        given = [self._o_in(o_a), self._lse_in(lse_a), self._o_in(o_b), self._lse_in(lse_b)]
        out = self.func(*(self.arrays.from_numpy(x) for x in given))
        if not (isinstance(out, tuple | list) and len(out) == 2):
            # An AssertionError fails the test: never taken for a refusal of bad input.
            raise AssertionError(f"the merge returned {type(out).__name__}, not (o, lse)")
        o, lse = (self.arrays.to_numpy(x) for x in out)
        lse = self._lse_bht(lse)  # (B, H, T), in the function's base
        natural = self._natural(lse)  # (B, H, T)
        if self.lse_base == "2":
            # A value the function hands back unchanged (the other piece empty, §22.2) comes
            # back as it was given: the base's round trip could move it by an ulp.
            for mine, theirs in ((lse_a, given[1]), (lse_b, given[3])):
                natural = np.where(lse == self._lse_bht(theirs), mine, natural)  # (B, H, T)
        return self._o_out(o), natural.astype(lse.dtype)

    def conversion(self, magnitude: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
        """SPEC §22.12: for an lse of magnitude at most ``magnitude`` held in ``dtype``, the
        largest change (natural units) of its handing in, ``a``, and of its reading back,
        ``b``. In base e nothing is converted: (0, 0). In base 2 each is one rounding in
        ``dtype`` of a float64 product (with a constant rounded once): within one ulp of
        the value it yields."""
        magnitude = np.asarray(magnitude, dtype=np.float64)
        if self.lse_base == "e":
            return np.zeros_like(magnitude), np.zeros_like(magnitude)
        ulp = lambda x: np.spacing(np.abs(x).astype(dtype)).astype(np.float64)  # noqa: E731
        return math.log(2.0) * ulp(magnitude / math.log(2.0)), ulp(magnitude)

    def _o_in(self, o: np.ndarray) -> np.ndarray:
        o = np.asarray(o)
        return np.swapaxes(o, -2, -3).copy() if self.layout == "BTHD" else o  # (B, T, H, E)

    def _o_out(self, o: np.ndarray) -> np.ndarray:
        return np.swapaxes(o, -2, -3).copy() if self.layout == "BTHD" else o  # (B, H, T, E)

    def _lse_in(self, lse: np.ndarray) -> np.ndarray:
        lse = np.asarray(lse)
        if self.lse_base == "2":
            lse = (lse * np.asarray(1.0 / math.log(2.0))).astype(lse.dtype)  # log₂ Σ exp
        return np.swapaxes(lse, -1, -2).copy() if self.lse_layout == "BTH" else lse

    def _lse_bht(self, lse: np.ndarray) -> np.ndarray:
        return np.swapaxes(lse, -1, -2).copy() if self.lse_layout == "BTH" else lse  # (B, H, T)

    def _natural(self, lse: np.ndarray) -> np.ndarray:
        if self.lse_base == "2":
            return (lse * np.asarray(math.log(2.0))).astype(lse.dtype)  # log Σ exp
        return lse


def merge_table(data: dict[str, Any], where: str) -> dict | None:
    """A profile's [merge] table, checked, or None; it goes with the capability "merge"."""
    if ("merge" in data) != ("merge" in data.get("capabilities", ())):
        raise ValueError(
            f"{where}: the capability 'merge' and the table [merge] (the merge function) go "
            "together"
        )
    return parse_merge(data["merge"], where) if "merge" in data else None


def with_merge(backend: Any, table: dict | None, layout: str) -> Any:
    """``backend`` (a ``FunctionBackend``) with the merge function of ``table`` attached,
    where the profile names one."""
    if table is not None:
        backend.merge_function = MergeFunction(
            import_target(table["function"]), backend.arrays, layout=layout,
            lse_layout=table["layout"], lse_base=table["base"],
        )  # fmt: skip
    return backend


class MergeOnlyBackend(Backend):
    """A merge-only profile's function (a ``[merge]`` table and no ``target``): the suite
    runs SPEC §22 on it alone, and names no form of attention it does not take.

        name = "my-merge"
        capabilities = ["merge"]
        [merge]
        function = "my_package.merge:merge_states"
    """

    sections = ("22",)
    #: No attention function: the summary lists no forms of attention for it.
    attends = False

    def __init__(
        self, table: dict, *, name: str, framework: str, layout: str, capabilities, dtypes
    ) -> None:
        others = sorted(set(capabilities) - {"merge"})
        if "merge" not in capabilities or others:
            raise ValueError(
                f"a merge-only profile (no target) declares the capability 'merge' alone, got "
                f"{sorted(capabilities)}; the others need an attention function, its target"
            )
        self.arrays = make_framework(framework)
        self.name, self.framework = name, self.arrays.name
        self.capabilities = frozenset(capabilities)
        self.dtypes = tuple(dtypes)
        self.merge_function = with_merge(self, table, layout).merge_function

    @property
    def merge_conversion(self):
        """The merge function's conversion of the lse (SPEC §22.12), None in base e."""
        form = self.merge_function
        return None if form.lse_base == "e" else form.conversion

    def from_numpy(self, x):
        return self.arrays.from_numpy(x)

    def to_numpy(self, x):
        return self.arrays.to_numpy(x)

    def _merge_states(self, o_a, lse_a, o_b, lse_b):
        o_a, lse_a, o_b, lse_b = (self.to_numpy(x) for x in (o_a, lse_a, o_b, lse_b))
        o, lse = self.merge_function(o_a, lse_a, o_b, lse_b)
        return self.from_numpy(o), self.from_numpy(lse)

    def _attention(self, q, k, v, **options):
        raise NotImplementedError(f"{self.name} is a merge-only profile: it names no attention")
