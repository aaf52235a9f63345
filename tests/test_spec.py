"""SPEC.md and the tests agree: every clause is checked, every checked clause exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conformance.suite import cases

ROOT = Path(__file__).resolve().parent.parent


def _spec_clauses() -> set[str]:
    text = (ROOT / "conformance" / "SPEC.md").read_text()
    return set(re.findall(r"^\*\*(\d+\.\d+) ", text, flags=re.M))


def _tested_clauses() -> set[str]:
    found = {e["clause"] for e in cases.manifest()["cases"]}
    for path in list((ROOT / "conformance" / "tests").glob("*.py")) + list(
        (ROOT / "tests").glob("*.py")
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            # pytest.mark.clause("6.3"), and a fixture case's extra clauses: case_marks(e, "7.1")
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in ("clause", "case_marks"):
                found |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return found


def test_every_clause_has_a_test():
    # §1 is notation: its content is checked through every other clause.
    untested = {c for c in _spec_clauses() - _tested_clauses() if not c.startswith("1.")}
    assert not untested, f"SPEC.md clauses with no test: {sorted(untested)}"


def test_every_tested_clause_is_in_the_spec():
    unknown = _tested_clauses() - _spec_clauses()
    assert not unknown, f"tests name clauses SPEC.md lacks: {sorted(unknown)}"
