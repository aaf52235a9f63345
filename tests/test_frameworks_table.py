"""The README's table of how the frameworks' own functions differ is a measurement: its
cells are what ``python -m conformance frameworks`` measures on the installed versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance import frameworks

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def measured(once) -> dict:
    """One measurement per test run, shared by the pytest-xdist workers."""

    def measure(work: Path) -> None:
        (work / "measured.json").write_text(json.dumps(frameworks.measure()))

    return json.loads((once("frameworks-measured", measure) / "measured.json").read_text())


def test_the_readme_table_is_what_a_fresh_measurement_gives(measured):
    """Cells only: the header's versions may differ on another machine. A cell that
    differs means the README's claim is not what the installed framework does: rerun
    ``python -m conformance frameworks --readme README.md``."""
    print("measured on:", ", ".join(measured["functions"].values()))
    assert set(frameworks.FRAMEWORKS) <= set(measured["functions"]), (
        "the table's frameworks must be installed to be measured"
    )
    committed = frameworks.cells((ROOT / "README.md").read_text())
    fresh = frameworks.cells(frameworks.table(measured))
    assert committed, "no table between the README's frameworks-table markers"
    differ = {
        key: (committed.get(key), fresh.get(key))
        for key in committed.keys() | fresh.keys()
        if committed.get(key) != fresh.get(key)
    }
    assert not differ, f"README cell (row, column): (committed, measured): {differ}"


def test_rewriting_the_readme_changes_only_the_table(tmp_path, measured):
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# Title\n\nbefore\n\n{frameworks.START}\nstale | table\n{frameworks.END}\n\nafter\n"
    )
    assert frameworks.rewrite_readme(readme, measured)
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "stale" not in text
    assert frameworks.cells(text) == frameworks.cells(frameworks.table(measured))
    assert not frameworks.rewrite_readme(readme, measured)  # a second run changes nothing


def test_every_row_names_its_inputs_and_every_cell_is_measured(measured):
    """The rows come from the profile's edge cases, each with what the functions are
    given; a cell is a label of what the function returned or raised, with no error size
    (those change with the machine; the report shows them)."""
    table = frameworks.table(measured)
    assert len(table.splitlines()) == 2 + len(measured["cases"])
    for row in measured["cases"]:
        assert row["fixture"] in row["inputs"], row["case"]
        for name in frameworks.FRAMEWORKS:
            result = row["results"][name]
            assert result["summary"] and result["observed"], (row["case"], name)
            assert "eps" not in result["summary"], (row["case"], name)
    # The claim the README once had by hand and got wrong: "PyTorch SDPA: causal with
    # T ≠ S, top-left only". torch 2.13 (pinned) has a bottom-right causal mask,
    # torch.nn.attention.bias.causal_lower_right, and SDPA follows it.
    by_case = {row["case"]: row["results"] for row in measured["cases"]}
    bottom_right = by_case["causal bottom-right, T=13 > S=7"]["torch SDPA"]
    assert bottom_right["conforms"] and "causal_lower_right" in bottom_right["summary"]
