"""The walkthroughs (docs/walkthrough/*.md) show what the NumPy impl runs and makes today.

The pages' prose is written by hand; the code they show (the core page's numbered steps and
functions by their own comments and names, the other pages' lines between ``--8<--``
section markers) and their numbers (docs/walkthrough/numbers/) are stored in the pages,
between ``<!-- include ... -->`` and ``<!-- end include -->``, written by docs/includes.py,
so that a page reads on a forge's view as on the site. Here: the stored parts are what
docs/includes.py writes from the files today, the committed numbers are what ``python -m
conformance walkthrough`` writes today, they are the worked example's hand values
(``fixtures/worked_example.json``) and the mpmath oracle's, and every step, function and
section a page includes exists (the site's build checks that too, but needs mkdocs: these
tests use the hook's own module).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conformance.fixtures import oracle

from conformance import walkthrough

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "walkthrough"
EXAMPLE = json.loads((ROOT / "fixtures" / "worked_example.json").read_text(encoding="utf-8"))
MARKER = re.compile(r"--8<-- \[(?P<kind>start|end):(?P<name>[a-z][-_0-9a-z]*)\]")
#: Four decimals, as the pages print them.
PRINTED = 5e-5


def _load_includes():
    """docs/includes.py, which the site's hook loads by its path too (docs/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "walkthrough_includes", ROOT / "docs" / "includes.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


includes = _load_includes()


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


def snippets(page: str) -> list[tuple[str, str]]:
    """The page's includes of a marked section: (path, section name)."""
    text = (PAGES / f"{page}.md").read_text(encoding="utf-8")
    return [(i.path, i.keys[0]) for i in includes.directives(text) if i.kind == "section"]


def code_includes(page: str) -> list[str]:
    """The page's includes of impl code by step or function name."""
    text = (PAGES / f"{page}.md").read_text("utf-8")
    return [str(i) for i in includes.directives(text) if i.kind != "section"]


def assembled(page: str) -> str:
    """The page as it is stored, which is what the site shows."""
    return (PAGES / f"{page}.md").read_text(encoding="utf-8")


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
@pytest.mark.parametrize("page", walkthrough.PAGES)
def test_the_stored_pages_are_what_the_generator_writes(page):
    """If this fails, run `python -m conformance walkthrough --out docs/walkthrough`: the
    code and numbers a page stores are what docs/includes.py writes from the files now."""
    stored = (PAGES / f"{page}.md").read_text(encoding="utf-8")
    fresh = includes.refresh(stored, ROOT)
    diff = difflib.unified_diff(stored.splitlines(), fresh.splitlines(), "stored", "now", n=1)
    assert fresh == stored, f"docs/walkthrough/{page}.md is stale:\n" + "\n".join(diff)


@pytest.mark.parametrize("page", walkthrough.PAGES)
def test_a_page_reads_without_a_build(page):
    """Nothing is left for a build to include: no snippets line, every include followed by
    what it shows (a python fence for code, a table for numbers) and its end."""
    lines = assembled(page).splitlines()
    assert not [line for line in lines if line.startswith("--8<--")], f"{page}.md has snippets"
    starts = [n for n, line in enumerate(lines) if includes.directives(line)]
    assert starts, f"{page}.md includes nothing"
    for n in starts:
        shown = lines[n + 2]
        assert shown == "```python" or shown.startswith("|"), f"{page}.md:{n + 1}: {shown!r}"
        end = lines.index(includes.END, n)
        assert end - n > 4, f"{page}.md:{n + 1} shows nothing"


def test_a_stale_page_is_found(tmp_path):
    """The staleness check bites: a stored step that no longer matches its impl, or a
    number edited by hand, is rewritten by refresh."""
    stored = (PAGES / "walkthrough.md").read_text(encoding="utf-8")
    for old, new in (
        ("scores = np.einsum(", "scores = np.dot("),
        ("| 0 | 0.7071 | 0.0000 | 0.7071 |", "| 0 | 0.7000 | 0.0000 | 0.7071 |"),
    ):
        assert old in stored
        edited = stored.replace(old, new, 1)
        assert includes.refresh(edited, ROOT) == stored


@pytest.mark.clause("11.1")
def test_the_command_writes_the_numbers_and_the_pictures(tmp_path):
    stale = (PAGES / "paged.md").read_text(encoding="utf-8").replace("| 0 |", "| 9 |")
    (tmp_path / "paged.md").write_text(stale, encoding="utf-8")
    assert walkthrough.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "paged.md").read_text(encoding="utf-8") == assembled("paged")
    for page in walkthrough.PAGES:
        written = (tmp_path / "numbers" / f"{page}.md").read_text(encoding="utf-8")
        assert written == (PAGES / "numbers" / f"{page}.md").read_text(encoding="utf-8")
    for case in walkthrough.CASES:
        assert (tmp_path / f"{case}.png").stat().st_size > 0


def test_every_section_is_included_once_and_exists():
    """Each page includes sections, steps and functions that exist, each once; each page's
    numbers are all shown; every marker pair in impls/numpy/ is shown by some page (a
    marker nobody reads is dead); the core page has no marker at all."""
    shown = {(path, name) for page in walkthrough.PAGES for path, name in snippets(page)}
    for page in walkthrough.PAGES:
        assert len(snippets(page)) == len(set(snippets(page))), f"{page}.md repeats a section"
        code = code_includes(page)
        assert len(code) == len(set(code)), f"{page}.md repeats an include: {code}"
        assembled(page)
        numbers = f"docs/walkthrough/numbers/{page}.md"
        for _, kind, name in _markers(ROOT / numbers):
            assert kind == "end" or (numbers, name) in shown, f"{page}.md never shows {name}"
    for impl in sorted((ROOT / "impls" / "numpy").glob("*.py")):
        path = impl.relative_to(ROOT).as_posix()
        for _, kind, name in _markers(impl):
            assert kind == "end" or (path, name) in shown, f"no walkthrough shows {path}:{name}"
    assert not _markers(ROOT / "impls" / "numpy" / "attention.py")


def test_the_core_pages_steps_are_included_by_their_numbers():
    """The worked example shows the page's textbook core, the visibility that builds the
    causal triangle (and the helper that spells it), attention()'s steps 1, 2, 4, 5 and 7 (3 and 6 are off in it) and step
    5's helpers, from the comment line to the blank line that ends each."""
    assert code_includes("walkthrough") == [
        "impls/numpy/attention.py def textbook_attention",
        "impls/numpy/attention.py step 1",
        "impls/numpy/attention.py step 2",
        "impls/numpy/attention.py def allowed_keys visible",
        "impls/numpy/attention.py step 4",
        "impls/numpy/attention.py step 5",
        "impls/numpy/attention.py def softmax softmax_with_sinks sink_logits",
        "impls/numpy/attention.py step 7",
    ]
    page = assembled("walkthrough")
    step_4 = [
        "# 4. Mask: ALiBi's bias and a float mask are added; every key a query may not see",
        "# gets -inf.",
        "scores = add_alibi_bias(scores, alibi_slopes, call)  # (B, H, T, S)",
        "scores = add_float_mask(scores, mask, call)  # (B, H, T, S)",
        "scores = np.where(allowed, scores, -np.inf)  # (B, H, T, S)",
        "```",
    ]
    assert "\n".join(step_4) in page
    step_0 = includes.source(ROOT, includes.Include("impls/numpy/attention.py", "step", ("0",)))
    assert step_0[-1] == ")  # fmt: skip"  # step 0 checks the inputs and nothing else
    assert "# 3. Softcap" not in page and "# 6. Dropout" not in page
    assert "\n        return softmax_with_sinks(scores, sinks)\n" in page  # dedented as a whole
    assert "return np.where(has_key, logits, -np.inf)  # (B, H, T, 1)\n```" in page


@pytest.mark.parametrize(
    ("directive", "says"),
    [
        ("<!-- include impls/numpy/attention.py step 9 -->", "no such step"),
        ("<!-- include impls/numpy/attention.py step one -->", "a step is one number"),
        ("<!-- include impls/numpy/attention.py def softmax_v2 -->", "no such run"),
        ("<!-- include impls/numpy/attention.py def softmax sink_logits -->", "no such run"),
        ("<!-- include impls/numpy/attention.py def sink_logits softmax -->", "no such run"),
        ("<!-- include impls/numpy/gone.py step 1 -->", "there is no file"),
    ],
)
def test_an_include_of_nothing_fails(directive, says):
    """A step or function that is not there (or functions that do not follow one another)
    is an error, which the hook turns into a failed build."""
    with pytest.raises(includes.IncludeError, match=says):
        includes.refresh(f"{directive}\n", ROOT)


def test_a_step_ends_at_its_blank_line_or_its_block(tmp_path):
    (tmp_path / "page.py").write_text(
        "def f(x):\n    # 1. One.\n    y = x\n\n    # 2. Two.\n    return y\ny = 1\n",
        encoding="utf-8",
    )
    one = "  <!-- include page.py step 1 -->\n  <!-- include page.py step 2 -->\n"
    fence = "\n  ```python\n  {}\n  ```\n\n  <!-- end include -->\n"
    expected = (
        "  <!-- include page.py step 1 -->\n" + fence.format("# 1. One.\n  y = x")
        + "  <!-- include page.py step 2 -->\n" + fence.format("# 2. Two.\n  return y")
    )  # fmt: skip
    assert includes.refresh(one, tmp_path) == expected
    assert includes.refresh(expected, tmp_path) == expected


def test_a_section_of_numbers_is_stored_as_it_stands(tmp_path):
    (tmp_path / "n.md").write_text(
        "<!-- --8<-- [start:a] -->\n| x |\n|---|\n<!-- --8<-- [end:a] -->\n", encoding="utf-8"
    )
    page = "<!-- include n.md section a -->\nold\n<!-- end include -->\n"
    expected = "<!-- include n.md section a -->\n\n| x |\n|---|\n\n<!-- end include -->\n"
    assert includes.refresh(page, tmp_path) == expected
    with pytest.raises(includes.IncludeError, match="no such section"):
        includes.refresh("<!-- include n.md section b -->\n", tmp_path)


@pytest.mark.clause("11.1")
def test_the_pages_show_the_impls_lines():
    walkthrough = assembled("walkthrough")
    assert 'scores = np.einsum("bhtd,bhsd->bhts", q, k)  # (B, H, T, S)' in walkthrough
    assert "allowed = allowed & (s <= t)  # (..., T, S)" in walkthrough
    sinks = assembled("sinks")
    assert "def sink_logits" in sinks
    assert "p.sum(axis=-1, keepdims=True) + np.exp(sink - highest)" in sinks
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


@pytest.mark.clause("11.1")
@pytest.mark.parametrize("case", ["non-causal", "causal"])
def test_flash_numbers_are_the_example_and_the_oracles(case):
    """The online softmax page: after key 0, every row's l is 1 and a is v[0] = (1, 2);
    after keys 1-2, row 1's maximum has moved from q·k[0] = 0 to 1/√2, so its α is
    exp(−1/√2), and every other α is 1; a / l is the oracle's output and the seed notes'
    (to ±0.005) beside the plain softmax's."""
    q, k, v = (np.array(EXAMPLE[n], dtype=np.float64) for n in "qkv")
    is_causal = walkthrough.CASES[case]
    first, second = table("flash", f"{case}-tile-0"), table("flash", f"{case}-tile-1")
    assert (first[:, 2] == 1.0).all() and (first[:, 3:] == v[0]).all()
    np.testing.assert_allclose(second[:, 1], [1, math.exp(-1 / math.sqrt(2)), 1], atol=PRINTED)
    np.testing.assert_allclose(second[:, 0], 1 / math.sqrt(2), atol=PRINTED)  # each row's max
    expected = oracle.attention(q[None, None], k[None, None], v[None, None], is_causal=is_causal)
    out = table("flash", f"{case}-out")
    np.testing.assert_allclose(out[:, :2], expected[0, 0], atol=PRINTED)
    np.testing.assert_allclose(out[:, 2:], expected[0, 0], atol=PRINTED)
    np.testing.assert_allclose(
        out[:, :2], EXAMPLE[case.replace("-", "_")]["seed_values"], atol=0.005
    )
    np.testing.assert_allclose(second[:, 3:] / second[:, 2:3], out[:, :2], atol=2 * PRINTED)
