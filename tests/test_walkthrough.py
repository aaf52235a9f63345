"""The learners' walkthrough (docs/walkthrough/) is what the NumPy impl produces today."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance import walkthrough

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "walkthrough" / "walkthrough.md"


@pytest.mark.clause("11.1")
def test_committed_walkthrough_is_regenerated_text():
    """Regenerating the markdown reproduces the committed page, character for character;
    if this fails, run `python -m conformance walkthrough --out docs/walkthrough`."""
    pictures = {case: f"{case}.png" for case, _ in walkthrough.CASES}
    assert walkthrough.markdown(pictures) == COMMITTED.read_text(encoding="utf-8")
    for name in pictures.values():
        assert (COMMITTED.parent / name).is_file(), f"docs/walkthrough/{name} is missing"


@pytest.mark.clause("11.1")
def test_walkthrough_command_writes_the_page_and_pictures(tmp_path):
    assert walkthrough.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "walkthrough.md").read_text(encoding="utf-8").startswith("# Attention")
    assert (tmp_path / "causal.png").stat().st_size > 0
    assert (tmp_path / "non-causal.png").stat().st_size > 0


@pytest.mark.clause("11.1")
def test_walkthrough_numbers_are_the_seed_values():
    """The causal output row 1 is the seed notes' 2.34, 3.34; every non-causal row is 3, 4."""
    text = walkthrough.markdown()
    assert "| 1 | 2.3395 | 3.3395 |" in text
    assert text.count("| 3.0000 | 4.0000 |") >= 4


@pytest.mark.clause("11.1")
def test_committed_backward_walkthrough_is_regenerated_text():
    """The backward page (docs/walkthrough/backward.md) is what impls/numpy_flash.py and
    the generator's own tile-by-tile arithmetic give today; if this fails, run
    `python -m conformance walkthrough --out docs/walkthrough`."""
    committed = COMMITTED.parent / "backward.md"
    assert walkthrough.backward_markdown() == committed.read_text(encoding="utf-8")


@pytest.mark.clause("11.1")
def test_backward_walkthrough_shows_delta_replacing_the_row_sum():
    """Δ = dO·O equals the naive Σ_s P·dP on every row, and the tile above the causal
    diagonal is skipped."""
    text = walkthrough.backward_markdown()
    for line in text.splitlines():
        if line.startswith("| ") and line.count("|") == 7 and not line.startswith("| t "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[4] == cells[5], line
    assert "## Queries 0–1, keys 2–2\n\nSkipped" in text
