"""Every count the README and the site's pages give is checked here against what it counts
(the frameworks table's counts are generated: tests/test_frameworks_table.py), and so is
the README's table of backends: its rows, the variants each declares, its core page, and
its verdict, which CI's run of the spec on that backend measures."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from fences import ROOT, pages

from conformance.adapters.profiles import shipped_profiles
from conformance.backends.registry import BUILTIN
from conformance.vocabulary import VARIANT_CAPABILITIES

#: What a count may count; a number before one of these words on any page is checked.
COUNTED = r"(mutants|profiles|clauses|backends|known failures|attention cases|gradient cases)"


def _mutants() -> tuple[int, int]:
    from mutants import GRADIENT_MUTANTS, MUTANTS

    return len(MUTANTS), len(GRADIENT_MUTANTS)


def _fixtures() -> Counter:
    manifest = json.loads((ROOT / "fixtures" / "manifest.json").read_text())
    return Counter(case["kind"] for case in manifest["cases"])


def _counts() -> dict[tuple[str, str], int]:
    """(page, the words after the number) -> the number they must say."""
    total, backward = _mutants()
    kinds = _fixtures()
    return {
        ("docs/test-your-own.md", "mutants, each the reference"): total,
        ("docs/test-your-own.md", "break\nthe forward pass"): total - backward,
        ("docs/test-your-own.md", "break\nonly the backward pass"): backward,
        ("docs/backends.md", "attention cases"): kinds["attention"],
        ("docs/backends.md", "gradient cases"): kinds["attention_grad"],
        ("docs/backends.md", "cases of the multi-head layer"): kinds["mha"] + kinds["gpt_block"],
        ("docs/other-libraries.md", "shipped profiles"): len(shipped_profiles()),
    }


@pytest.mark.parametrize(("page", "words"), list(_counts()), ids=lambda x: x.split("\n")[0])
def test_the_count_is_what_it_counts(page, words):
    text = (ROOT / page).read_text()
    found = re.findall(rf"(\d+) {re.escape(words)}", text)
    assert found, f"{page}: no count before {words!r}"
    assert {int(n) for n in found} == {_counts()[page, words]}, (page, words, found)


def test_every_count_is_checked():
    """A number before a counted word outside the generated table is one of the checks."""
    checked = {(page, m[1]) for page, words in _counts() if (m := re.match(COUNTED, words))}
    for path in pages():
        page = str(path.relative_to(ROOT))
        text = path.read_text()
        text = re.sub(
            r"<!-- frameworks-table:start -->.*?<!-- frameworks-table:end -->", "", text, flags=re.S
        )
        for number, word in re.findall(rf"\b(\d+) {COUNTED}", text):
            assert (page, word) in checked, f"{page}: '{number} {word}' is not checked"


# --- the README's backends ------------------------------------------------------------


def _backends_table() -> dict[str, dict[str, str]]:
    """The README's "Backends" table, by backend name: each row's cells by column head."""
    lines = (ROOT / "README.md").read_text().split("## Backends", 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    heads = [c.strip() for c in rows[0].strip("|").split(" | ")]
    return {
        cells[0].strip("` "): dict(zip(heads, (c.strip() for c in cells)))
        for cells in (row.strip("|").split(" | ") for row in rows[1:])
    }


def test_the_table_has_a_row_per_backend():
    """Every built-in backend but the fixed-P copies of the context-parallel ones."""
    names = {name for name in BUILTIN if not re.search(r"-p\d+$", name)}
    assert set(_backends_table()) == names


def _cell_says(cell: str, names: set[str], declared: set[str], backend: str) -> None:
    """A cell "a b (no c d)": what the backend declares of ``names``, then what it lacks."""
    listed, _, lacking = cell.partition("(no ")
    assert set(listed.split()) == declared, f"{backend}: README says {cell!r}, declared {declared}"
    missing = set(lacking.rstrip(")").replace(",", " ").split())
    assert missing == names - declared, f"{backend}: README says {cell!r}"


@pytest.mark.clause("15.6")
def test_the_table_names_each_backends_variant_capabilities():
    """The "today's variants" cell lists the variant capabilities the backend declares
    (SPEC §15-§19), and says which it lacks; the "in pieces" cell does the same for "lse"
    and "merge" (§21, §22), opted into like the variants."""
    pieces = {"lse", "merge"}
    variants = VARIANT_CAPABILITIES - pieces
    for name, row in _backends_table().items():
        caps = set(BUILTIN[name].capabilities)
        _cell_says(row["today's variants (§15-§19)"], variants, caps & variants, name)
        _cell_says(row["in pieces (§21, §22)"], pieces, caps & pieces, name)


def test_the_table_gives_each_backends_dtypes_and_page():
    short = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
    for name, row in _backends_table().items():
        assert row["dtypes"].split() == [short[d] for d in BUILTIN[name].dtypes], name
        page = Path(row["core page"].strip("`"))
        assert (ROOT / page).is_file(), f"{name}: {page} is not a page"


def test_each_verdict_is_measured_by_ci():
    """ "conforms" is what CI measures: a tox env in the default list runs the whole spec on
    the backend by name, and fails when one of its tests fails."""
    tox = (ROOT / "tox.ini").read_text()
    for name, row in _backends_table().items():
        assert row["verdict"] == "conforms", name
        assert re.search(rf"--backend {re.escape(name)}\b(?!-)", tox), f"no tox env runs {name}"


def test_the_readme_reads_in_five_minutes():
    """At most 200 lines, and "Test your own attention" under 20 (issue 33)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    start = lines.index("## Test your own attention")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    assert end - start - 1 < 20, end - start - 1
