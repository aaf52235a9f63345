"""The SPEC's clauses as data: their titles (read from ``SPEC.md``) and their order."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

SPEC = Path(__file__).resolve().parent.parent / "SPEC.md"


@cache
def clause_titles() -> dict[str, str]:
    """{"4.3": "Fully masked rows are 0", ...} for every numbered clause of SPEC.md."""
    titles = {}
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\*\*(\d+\.\d+)\s+(.*?)\.?\*\*", line) or re.match(
            r"^#+\s+(\d+\.\d+)\s+(.*)", line
        )
        if m:
            titles[m.group(1)] = m.group(2)
    return titles


def clause_key(clause: str | None) -> tuple:
    """Sort key for "12.10" after "12.9"; no clause last."""
    if clause is None:
        return (999,)
    return tuple(int(x) for x in clause.split("."))


#: The three layers of SPEC §13.18, in the order a verdict gives them.
LAYERS = ("math", "edges", "contract")


def _expand(token: str, clauses: list[str]) -> list[str]:
    """The clauses a token of §13.18's table stands for: "6" (every clause of §6),
    "2.1-2.4" (a run within one section) or "4.3" (itself)."""
    if "-" in token:
        first, last = token.split("-")
        low, high = clause_key(first), clause_key(last)
        return [c for c in clauses if low <= clause_key(c) <= high]
    if "." not in token:
        return [c for c in clauses if c.split(".")[0] == token]
    return [token]


@cache
def layer_table() -> dict[str, list[str]]:
    """{layer: its tokens} as SPEC §13.18's table writes them."""
    table = {}
    for line in SPEC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\|\s*`(\w+)`\s*\|\s*([\d., -]+?)\s*\|$", line)
        if m and m.group(1) in LAYERS:
            table[m.group(1)] = [t.strip() for t in m.group(2).split(",") if t.strip()]
    return table


@cache
def clause_layers() -> dict[str, str]:
    """{"4.3": "edges", ...}: the layer of every clause SPEC §13.18's table assigns."""
    clauses = sorted(clause_titles(), key=clause_key)
    found: dict[str, str] = {}
    for layer, tokens in layer_table().items():
        for token in tokens:
            for clause in _expand(token, clauses):
                found.setdefault(clause, layer)
    return found


def layer_of(clause: str | None) -> str | None:
    """The layer of a test whose first clause is ``clause`` (None: no clause, or one the
    table leaves out)."""
    return clause_layers().get(clause) if clause else None
