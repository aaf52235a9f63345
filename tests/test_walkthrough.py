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
    assert (tmp_path / "sinks.md").read_text(encoding="utf-8").startswith("# Attention sinks")
    assert (tmp_path / "paged.md").read_text(encoding="utf-8").startswith("# A paged KV cache")


@pytest.mark.clause("11.1")
def test_walkthrough_numbers_are_the_seed_values():
    """The causal output row 1 is the seed notes' 2.34, 3.34; every non-causal row is 3, 4."""
    text = walkthrough.markdown()
    assert "| 1 | 2.3395 | 3.3395 |" in text
    assert text.count("| 3.0000 | 4.0000 |") >= 4


@pytest.mark.clause("11.1")
def test_committed_backward_walkthrough_is_regenerated_text():
    """The backward page (docs/walkthrough/backward.md) is what impls/numpy/flash.py and
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


@pytest.mark.clause("15.1")
def test_committed_sinks_walkthrough_is_regenerated_text():
    """docs/walkthrough/sinks.md is what impls/numpy/attention.py gives today on the
    worked example's `sinks` (the generator refuses numbers other than the hand values);
    if this fails, run `python -m conformance walkthrough --out docs/walkthrough`."""
    committed = COMMITTED.parent / "sinks.md"
    assert walkthrough.sinks_markdown() == committed.read_text(encoding="utf-8")


@pytest.mark.clause("15.3")
def test_sinks_walkthrough_shows_the_sink_taking_weight_and_the_empty_row():
    """The causal row 0 splits its weight 1/2 key 0, 1/2 sink and returns (1.5, 3); a row
    with no key puts all its weight on the sink and returns 0; dsinks is −67/12."""
    text = walkthrough.sinks_markdown()
    assert "| 0 | 0.5000 | 0.0000 | 0.5000 |" in text
    assert "| 0 | 1.5000 | 3.0000 |" in text
    assert "| 1 | 0.0000 | 0.0000 | 1.0000 |" in text
    assert "| 1 | 0.0000 | 0.0000 |" in text
    assert "= −5.5833" in text
    assert "def sink_logits" in text
    assert "row_sum = p.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)" in text


@pytest.mark.clause("19.1")
def test_committed_paged_walkthrough_is_regenerated_text():
    """docs/walkthrough/paged.md is what impls/numpy/paged.py's attention_paged gives
    today on the worked example's `paged`; if this fails, run
    `python -m conformance walkthrough --out docs/walkthrough`."""
    committed = COMMITTED.parent / "paged.md"
    assert walkthrough.paged_markdown() == committed.read_text(encoding="utf-8")


@pytest.mark.clause("19.1")
def test_paged_walkthrough_gathers_through_the_table():
    """Key 2 comes from table entry 1, that is page 0, slot 0; key 3 lies past
    the length; decode gives (3, 6) and the causal pair (3, 4.5), (3, 6)."""
    text = walkthrough.paged_markdown()
    assert "| 2 | 1 | 0 | 0 | (3.0000, 9.0000) | yes |" in text
    assert "| 3 | 1 | 0 | 1 | (100.0000, 100.0000) | no: s ≥ seq_lens[0] = 3 |" in text
    assert "| 0 | 3.0000 | 6.0000 |" in text
    assert "| 0 | 3.0000 | 4.5000 |" in text
    assert "def paged_allowed" not in text and "distance = s - (t + n - T)" in text


@pytest.mark.clause("11.1")
@pytest.mark.parametrize("page", ["sinks", "paged"])
def test_variant_walkthrough_refuses_numbers_off_the_hand_values(monkeypatch, page):
    """The generator checks the impl's numbers against the worked example's hand values:
    with one hand value changed it writes nothing and says which number differs."""
    example = walkthrough.worked_example()
    case = example[page]["causal" if page == "sinks" else "decode"]
    case["hand"][0][0] += 1.0
    monkeypatch.setattr(walkthrough, "worked_example", lambda: example)
    make = walkthrough.sinks_markdown if page == "sinks" else walkthrough.paged_markdown
    with pytest.raises(AssertionError, match="hand value"):
        make()
