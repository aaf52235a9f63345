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
