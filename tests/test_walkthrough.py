"""The walkthroughs (docs/walkthrough/*.md) show what the NumPy impl runs and makes today.

The pages are written by hand; the site includes the code they show from the impl pages
and their numbers from docs/walkthrough/numbers/, both between pymdownx.snippets' section
markers. Here: the committed numbers are what ``python -m conformance walkthrough`` writes
today, they are the worked example's hand values (``fixtures/worked_example.json``) and the
mpmath oracle's, and every section a page includes exists, once (the site's build checks
that too, but needs mkdocs: these tests read the files as the snippets extension does).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conformance.fixtures import oracle

from conformance import walkthrough

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "walkthrough"
EXAMPLE = json.loads((ROOT / "fixtures" / "worked_example.json").read_text(encoding="utf-8"))
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^":]+):(?P<name>[a-z][-_0-9a-z]*)"$')
MARKER = re.compile(r"--8<-- \[(?P<kind>start|end):(?P<name>[a-z][-_0-9a-z]*)\]")
#: Four decimals, as the pages print them.
PRINTED = 5e-5


def _markers(path: Path) -> list[tuple[int, str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(i, m["kind"], m["name"]) for i, line in enumerate(lines) if (m := MARKER.search(line))]


def section(path: str, name: str) -> list[str]:
    """The lines between ``path``'s markers of ``name``, other markers left out, dedented
    (the site's ``dedent_subsections``); exactly one pair must exist."""
    file = ROOT / path
    found = [(i, kind) for i, kind, n in _markers(file) if n == name]
    assert [kind for _, kind in found] == ["start", "end"], f"{path}: section {name}: {found}"
    lines = file.read_text(encoding="utf-8").splitlines()[found[0][0] + 1 : found[1][0]]
    body = "\n".join(line for line in lines if not MARKER.search(line))
    assert body.strip(), f"{path}: section {name} is empty"
    return textwrap.dedent(body).splitlines()


def includes(page: str) -> list[tuple[str, str]]:
    text = (PAGES / f"{page}.md").read_text(encoding="utf-8")
    return [(m["path"], m["name"]) for m in map(INCLUDE.match, text.splitlines()) if m]


def assembled(page: str) -> str:
    """The page as the site shows it: each include replaced by its section."""
    out = []
    for line in (PAGES / f"{page}.md").read_text(encoding="utf-8").splitlines():
        m = INCLUDE.match(line)
        out += section(m["path"], m["name"]) if m else [line]
    return "\n".join(out)


def table(page: str, name: str) -> np.ndarray:
    """A numbers section's table as floats, its row labels dropped (−∞ is -inf, an empty
    cell NaN)."""
    lines = section(f"docs/walkthrough/numbers/{page}.md", name)
    rows = [[c.strip() for c in line.strip("|").split("|")][1:] for line in lines[2:]]
    cells = [[c.replace("−∞", "-inf").replace("−", "-") for c in row] for row in rows]
    return np.array([[float(c) if c else math.nan for c in row] for row in cells])


@pytest.mark.clause("11.1")
def test_committed_numbers_are_what_the_command_writes():
    """If this fails, run `python -m conformance walkthrough --out docs/walkthrough`."""
    for page, text in walkthrough.numbers().items():
        committed = PAGES / "numbers" / f"{page}.md"
        assert committed.read_text(encoding="utf-8") == text, f"{committed} is stale"
    for case in walkthrough.CASES:
        assert (PAGES / f"{case}.png").is_file(), f"docs/walkthrough/{case}.png is missing"


@pytest.mark.clause("11.1")
def test_the_command_writes_the_numbers_and_the_pictures(tmp_path):
    assert walkthrough.main(["--out", str(tmp_path)]) == 0
    for page in walkthrough.PAGES:
        written = (tmp_path / "numbers" / f"{page}.md").read_text(encoding="utf-8")
        assert written == (PAGES / "numbers" / f"{page}.md").read_text(encoding="utf-8")
    for case in walkthrough.CASES:
        assert (tmp_path / f"{case}.png").stat().st_size > 0


def test_every_section_is_included_once_and_exists():
    """Each page includes sections that exist; each page's numbers are all shown; every
    marker pair in impls/numpy/ is shown by some page (a marker nobody reads is dead)."""
    shown = {(path, name) for page in walkthrough.PAGES for path, name in includes(page)}
    for page in walkthrough.PAGES:
        assert len(includes(page)) == len(set(includes(page))), f"{page}.md repeats a section"
        assembled(page)
        numbers = f"docs/walkthrough/numbers/{page}.md"
        for _, kind, name in _markers(ROOT / numbers):
            assert kind == "end" or (numbers, name) in shown, f"{page}.md never shows {name}"
    for impl in sorted((ROOT / "impls" / "numpy").glob("*.py")):
        path = impl.relative_to(ROOT).as_posix()
        for _, kind, name in _markers(impl):
            assert kind == "end" or (path, name) in shown, f"no walkthrough shows {path}:{name}"


@pytest.mark.clause("11.1")
def test_the_pages_show_the_impls_lines():
    assert 'scores = np.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)' in assembled("walkthrough")
    sinks = assembled("sinks")
    assert "def sink_logits" in sinks
    assert "row_sum = p.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)" in sinks
    assert "distance = s - (t + n - T)" in assembled("paged")
    assert "dz *= p" in assembled("backward")


@pytest.mark.clause("11.1")
@pytest.mark.parametrize("case", ["non-causal", "causal"])
def test_walkthrough_numbers_are_the_example_and_the_oracles(case):
    """Scores q·kᵀ and q·kᵀ/√2 by hand; the weights the oracle's (V = identity, SPEC
    §6.2); the output the seed notes' (to ±0.005, causal row 1 is 2.34, 3.34) and exact."""
    q, k, v = (np.array(EXAMPLE[n], dtype=np.float64) for n in "qkv")
    is_causal = walkthrough.CASES[case]
    hand = EXAMPLE[case.replace("-", "_")]
    np.testing.assert_allclose(table("walkthrough", "scores"), q @ k.T, atol=PRINTED)
    np.testing.assert_allclose(table("walkthrough", "scaled"), q @ k.T / math.sqrt(2), atol=PRINTED)
    weights = oracle.attention(
        q[None, None], k[None, None], np.eye(3)[None, None], is_causal=is_causal
    )
    np.testing.assert_allclose(table("walkthrough", f"{case}-weights"), weights[0, 0], atol=PRINTED)
    out = table("walkthrough", f"{case}-out")
    np.testing.assert_allclose(out, hand["seed_values"], atol=0.005)
    np.testing.assert_allclose(out, hand["exact"], atol=PRINTED)
    blocked = table("walkthrough", f"{case}-masked") == -np.inf  # (T, S)
    above = np.triu(np.ones((3, 3), dtype=bool), 1)  # (T, S): keys after the query
    assert (blocked == (above & is_causal)).all()


@pytest.mark.clause("11.1")
def test_backward_numbers_are_the_oracles():
    """dq, dk, dv are the oracle's gradients of the causal example; Δ = dO·O equals the
    naive Σ_s P·dP on every row; the tile above the causal diagonal is skipped."""
    q, k, v = (np.array(EXAMPLE[n], dtype=np.float64)[None, None] for n in "qkv")
    d_out = table("backward", "d-out")
    grads = oracle.attention_vjp(q, k, v, d_out[None, None], is_causal=True)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(table("backward", name), grads[name][0, 0], atol=PRINTED)
    rows = table("backward", "rows")
    assert (rows[:, 3] == rows[:, 4]).all()
    assert "| 0–1 | 2 | skipped" in "\n".join(
        section("docs/walkthrough/numbers/backward.md", "tiles")
    )


@pytest.mark.clause("15.1")
@pytest.mark.parametrize("case", ["non-causal", "causal"])
def test_sinks_numbers_are_the_hand_values(case):
    """The outputs and dsinks (−20/3 non-causal, −67/12 causal) are the example's hand
    values; the sink takes 1/3 of every non-causal row and 1/2 of causal row 0."""
    hand = EXAMPLE["sinks"][case.replace("-", "_")]
    np.testing.assert_allclose(table("sinks", f"{case}-out"), hand["hand"], atol=PRINTED)
    dsinks = table("sinks", f"{case}-dsinks")
    np.testing.assert_allclose(dsinks[:-1, 2].sum(), hand["dsinks_hand"][0], atol=2 * PRINTED)
    assert dsinks[-1, -1] == pytest.approx(hand["dsinks_hand"][0], abs=PRINTED)
    sink = [1 / 3, 1 / 3] if case == "non-causal" else [1 / 2, 1 / 3]
    np.testing.assert_allclose(table("sinks", f"{case}-weights")[:, -1], sink, atol=PRINTED)


@pytest.mark.clause("15.3")
def test_sinks_row_with_no_key_is_all_sink_and_zero():
    weights = table("sinks", "empty-row-weights")
    assert weights[1].tolist() == [0.0, 0.0, 1.0]
    assert table("sinks", "empty-row-out")[1].tolist() == [0.0, 0.0]
    no_sink = EXAMPLE["sinks"]["no_sink_causal"]["hand"]
    np.testing.assert_allclose(table("sinks", "no-sink-out"), no_sink, atol=PRINTED)


@pytest.mark.clause("19.1")
def test_paged_numbers_are_the_hand_values():
    """Decode gives (3, 6) and the causal pair (3, 4.5), (3, 6); key 2 comes from table
    entry 1, that is page 0, slot 0; key 3 lies past the length and weighs 0."""
    paged = EXAMPLE["paged"]
    np.testing.assert_allclose(table("paged", "decode-out"), paged["decode"]["hand"], atol=PRINTED)
    causal = paged["causal_last_two"]["hand"]
    np.testing.assert_allclose(table("paged", "causal-out"), causal, atol=PRINTED)
    gather = section("docs/walkthrough/numbers/paged.md", "gather")
    assert "| 2 | 1 | 0 | 0 | (3.0000, 9.0000) | yes |" in gather
    assert "| 3 | 1 | 0 | 1 | (100.0000, 100.0000) | no: s ≥ seq_lens[0] = 3 |" in gather
    assert (table("paged", "decode-weights")[:, 1] == 0).all()


@pytest.mark.clause("11.1")
@pytest.mark.parametrize("page", ["walkthrough", "sinks", "paged"])
def test_the_command_refuses_numbers_off_the_hand_values(monkeypatch, page):
    """With one hand value of the worked example changed, the command writes nothing and
    says which number differs."""
    example = walkthrough.worked_example()
    if page == "walkthrough":
        example["causal"]["exact"][0][0] += 1.0
    else:
        example[page]["causal" if page == "sinks" else "decode"]["hand"][0][0] += 1.0
    monkeypatch.setattr(walkthrough, "worked_example", lambda: example)
    with pytest.raises(AssertionError, match="hand value"):
        walkthrough.numbers()
