"""A kernel's shape domain: the head dims and lengths it accepts (a profile's ``[domain]``).

Real kernels accept head dims of 16 to 256, query and key lengths that are multiples of a
tile, sometimes T = S only, and their backward may ask for more (S % 128 = 0). A profile
says so, and the suite judges the function on calls inside that domain and only there
(``conformance.suite.domain`` carries each call into it, or skips its test by name)::

    [domain]
    head_dims = [16, 32, 64, 128]          # or a range: { min = 16, max = 256, multiple = 16 }
                                           # or a list of both: [{ max = 128 }, { min = 128,
                                           # max = 512, multiple = 128 }] (D <= 128, or
                                           # a multiple of 128)
    t_multiple = 16                        # T a multiple of 16; or per dtype, a query tile
                                           # that depends on it: { float32 = 8, bfloat16 = 16 }
    s_multiple = 16                        # S a multiple of 16
    min_t = 16                             # T >= 16 (default 0)
    min_s = 16                             # S >= 16
    max_t = 1                              # T <= 1: a decode kernel (default: no limit)
    square = true                          # T = S only

    [domain.backward]                      # where the backward's limits differ
    s_multiple = 128

D = E is required unless the function declares ``value_dim`` (a capability); where it
declares it, E is drawn from the same head dims as D.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: The keys of ``[domain]`` (and of ``[domain.backward]``, less ``backward``).
DOMAIN_KEYS = {
    "head_dims",
    "t_multiple",
    "s_multiple",
    "min_t",
    "min_s",
    "max_t",
    "square",
    "backward",
}


@dataclass(frozen=True)
class Domain:
    """The shapes a function accepts. The defaults accept every shape.

    Attributes:
      head_dims: the head dims D (and E) it takes, listed: a tuple of them, or None.
      head_ranges: ranges of head dims it takes besides, each (min, max, multiple). With
        neither, any head dim.
      t_multiple, s_multiple: T and S must be multiples of these.
      t_multiples: T's multiple per dtype, ((dtype, multiple), ...), where it depends on
        the dtype (``for_dtype`` picks one); ``t_multiple`` is then the largest.
      min_t, min_s: the least T and S it takes.
      max_t: the most T it takes (a decode kernel's 1), or None (no limit). A call with
        more queries is never split into several: its test is skipped by name.
      square: T = S only.
      backward: the backward's domain where it differs, or None (the same).
    """

    head_dims: tuple[int, ...] | None = None
    head_ranges: tuple[tuple[int, int, int], ...] = ()
    t_multiple: int = 1
    t_multiples: tuple[tuple[str, int], ...] = ()
    s_multiple: int = 1
    min_t: int = 0
    min_s: int = 0
    max_t: int | None = None
    square: bool = False
    backward: Domain | None = field(default=None, compare=False)

    @property
    def everything(self) -> bool:
        """Whether this domain accepts every shape (the forward's and the backward's)."""
        return self._plain() and (self.backward is None or self.backward._plain())

    def _plain(self) -> bool:
        return self == Domain()

    def of(self, method: str) -> Domain:
        """The domain of ``method``'s calls: the backward's for a ``*_vjp``."""
        return self.backward if method.endswith("_vjp") and self.backward else self

    def for_dtype(self, dtype: str) -> Domain:
        """The domain of a call in ``dtype``: its T multiple, where that depends on it."""
        backward = self.backward.for_dtype(dtype) if self.backward is not None else None
        if not self.t_multiples:
            return self if backward is self.backward else replace(self, backward=backward)
        step = dict(self.t_multiples).get(dtype, self.t_multiple)
        return replace(self, t_multiple=step, t_multiples=(), backward=backward)

    def _heads_restricted(self) -> bool:
        return self.head_dims is not None or bool(self.head_ranges)

    def head_dim_ok(self, d: int) -> bool:
        if not self._heads_restricted():
            return True
        if self.head_dims is not None and d in self.head_dims:
            return True
        return any(lo <= d <= hi and d % step == 0 for lo, hi, step in self.head_ranges)

    def next_head_dim(self, d: int) -> int | None:
        """The least head dim of the domain that is at least ``d``, or None."""
        if not self._heads_restricted():
            return d
        fits = [x for x in self.head_dims or () if x >= d]
        for lo, hi, step in self.head_ranges:
            x = max(d, lo)
            x += -x % step
            if x <= hi:
                fits.append(x)
        return min(fits) if fits else None

    def fit_t(self, T: int) -> int:
        return _fit(T, self.t_multiple, self.min_t)

    def fit_s(self, S: int) -> int:
        return _fit(S, self.s_multiple, self.min_s)

    def why_not(self, T: int, S: int, D: int, E: int) -> str | None:
        """Why (T, S, D, E) is outside the domain, in words, or None."""
        for letter, d in (("D", D), ("E", E)):
            if not self.head_dim_ok(d):
                return f"{letter} = {d} is not a head dim of {self.head_words()}"
        if self.max_t is not None and T > self.max_t:
            return f"T = {T} is above its most {self.max_t}"
        for letter, n, step, least in (
            ("T", T, self.t_multiple, self.min_t),
            ("S", S, self.s_multiple, self.min_s),
        ):
            if n % step:
                return f"{letter} = {n} is not a multiple of {step}"
            if n < least:
                return f"{letter} = {n} is below its least length {least}"
        if self.square and T != S:
            return f"T = {T} ≠ S = {S} (it takes T = S only)"
        return None

    def head_words(self) -> str:
        if not self._heads_restricted():
            return "any"
        parts = ["{" + ", ".join(map(str, self.head_dims)) + "}"] if self.head_dims else []
        for lo, hi, step in self.head_ranges:
            parts.append(f"{lo}..{hi}" + (f" in steps of {step}" if step > 1 else ""))
        return " or ".join(parts)

    def words(self) -> str:
        """The domain in one line: "D, E in {16, 32}; T, S multiples of 16; T = S"."""
        parts = []
        if self._heads_restricted():
            parts.append(f"D, E in {self.head_words()}")
        for letter, step, least in (
            ("T", self.t_multiple, self.min_t),
            ("S", self.s_multiple, self.min_s),
        ):
            if letter == "T" and self.t_multiples:
                each = ", ".join(f"{n} in {dtype}" for dtype, n in self.t_multiples)
                parts.append(f"T a multiple of {each}")
            elif step > 1:
                parts.append(f"{letter} a multiple of {step}")
            if least > 0:
                parts.append(f"{letter} >= {least}")
        if self.max_t is not None:
            parts.append(f"T <= {self.max_t}")
        if self.square:
            parts.append("T = S")
        text = "; ".join(parts) or "every shape"
        if self.backward is not None and self.backward != self:
            text += f" (backward: {self.backward.words()})"
        return text


def _fit(n: int, step: int, least: int) -> int:
    """The least length that is at least ``n`` and ``least`` and a multiple of ``step``."""
    n = max(n, least)
    return n + (-n % step)


def parse_domain(table: Mapping[str, Any], where: str, *, inherit: Domain | None = None) -> Domain:
    """A ``[domain]`` table checked and built (``[domain.backward]`` inherits the
    forward's keys it does not set).

    Raises:
      ValueError: an unknown key, or a value of the wrong kind (naming it).
    """
    allowed = DOMAIN_KEYS - ({"backward"} if inherit is not None else set())
    bad = sorted(set(table) - allowed)
    if bad:
        raise ValueError(f"{where}: unknown keys {bad}; known: {', '.join(sorted(allowed))}")
    base = inherit or Domain()
    fields: dict[str, Any] = {}
    if "head_dims" in table:
        fields["head_dims"], fields["head_ranges"] = _head_dims(table["head_dims"], where)
    if isinstance(table.get("t_multiple"), Mapping):
        steps = dict(table["t_multiple"])
        if not steps or not all(isinstance(k, str) and _positive_int(n) for k, n in steps.items()):
            raise ValueError(
                f"{where}: t_multiple per dtype should map dtypes to positive integers, got "
                f"{steps!r}"
            )
        fields["t_multiples"] = tuple(sorted(steps.items()))
        fields["t_multiple"] = max(steps.values())
    for key in ("t_multiple", "s_multiple"):
        if key in table and key not in fields:
            if not _positive_int(table[key]):
                raise ValueError(f"{where}: {key} should be a positive integer, got {table[key]!r}")
            fields[key] = table[key]
    for key in ("min_t", "min_s"):
        if key in table:
            value = table[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where}: {key} should be an integer >= 0, got {value!r}")
            fields[key] = value
    if "max_t" in table:
        if not _positive_int(table["max_t"]):
            raise ValueError(f"{where}: max_t should be a positive integer, got {table['max_t']!r}")
        fields["max_t"] = table["max_t"]
    if "square" in table:
        if not isinstance(table["square"], bool):
            raise ValueError(f"{where}: square should be true or false, got {table['square']!r}")
        fields["square"] = table["square"]
    domain = replace(base, **fields, backward=None)
    if inherit is None and "backward" in table:
        if not isinstance(table["backward"], Mapping):
            raise ValueError(f"{where}: backward should be a table, got {table['backward']!r}")
        backward = parse_domain(table["backward"], f"{where}.backward", inherit=domain)
        domain = replace(domain, backward=backward)
    return domain


def _head_dims(
    dims: Any, where: str
) -> tuple[tuple[int, ...] | None, tuple[tuple[int, int, int], ...]]:
    """``head_dims``: a list of head dims, a range ``{min, max, multiple}``, or a list of
    both; (the listed dims or None, the ranges)."""
    items = dims if isinstance(dims, list) else [dims]
    listed, ranges = [], []
    for item in items:
        if _positive_int(item):
            listed.append(item)
        elif isinstance(item, Mapping) and set(item) <= {"min", "max", "multiple"}:
            lo, hi, step = item.get("min", 1), item.get("max"), item.get("multiple", 1)
            if not all(_positive_int(x) for x in (lo, hi, step)) or lo > hi:
                raise ValueError(
                    f"{where}: head_dims {{min, max, multiple}} should be positive integers "
                    f"with min <= max, got {dict(item)!r}"
                )
            ranges.append((lo, hi, step))
        else:
            items = []
            break
    if not items:
        raise ValueError(
            f"{where}: head_dims should be a list of positive integers, a table "
            f"{{min, max, multiple}}, or a list of both, got {dims!r}"
        )
    return (tuple(sorted(set(listed))) if listed else None), tuple(ranges)


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def domain_flags(values: Iterable[str]) -> dict[str, Any]:
    """The ``[domain]`` table that ``--impl-domain KEY=VALUE`` flags give: each a line of
    the table in TOML, ``backward.KEY`` for ``[domain.backward]``::

        --impl-domain "head_dims=[16, 32, 64]" --impl-domain s_multiple=16
        --impl-domain "head_dims={min=16, max=256, multiple=16}" --impl-domain backward.square=true

    Raises:
      ValueError: a flag that is not ``KEY=VALUE`` in TOML (naming it); the keys and
        values themselves are checked by ``parse_domain``.
    """
    table: dict[str, Any] = {}
    for value in values:
        try:
            line = tomllib.loads(value)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(
                f"--impl-domain should be KEY=VALUE, a line of a profile's [domain] table in "
                f"TOML (head_dims=[16, 32], s_multiple=16, backward.square=true), got "
                f"{value!r}: {err}"
            ) from None
        for key, x in line.items():
            if key == "backward" and isinstance(x, Mapping):
                table.setdefault("backward", {}).update(x)
            else:
                table[key] = x
    return table
