"""The code fences of README.md and of the site's pages run as written (tests/fences.py says
how), so that no page can drift from the code."""

from __future__ import annotations

import ast
import inspect
import re
import shutil
import sys
from pathlib import Path

import pytest
from fences import MARKER, ROOT, STEP_1, SYBIL, pages

pytestmark = pytest.mark.clause("13.9")


@pytest.fixture(scope="module")
def kit_dir(tmp_path_factory) -> Path:
    """A user's directory: a copy of examples/, outside the checkout."""
    where = tmp_path_factory.mktemp("kit")
    shutil.copytree(ROOT / "examples", where / "examples")
    return where


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_fences_of(page, kit_dir):
    document = SYBIL.parse(page)
    document.namespace.update(__name__="__main__", KIT=kit_dir)
    for example in document:
        example.evaluate()


def test_every_marker_has_a_reason_and_a_fence():
    """``<!-- not run: REASON -->`` stands on the line right before a fence, with a
    reason, and never before a Python fence: every Python fence runs."""
    for page in pages():
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if "not run" in line and "<!--" in line:
                where = f"{page.relative_to(ROOT)}:{number + 1}"
                marker = MARKER.fullmatch(line.strip())
                assert marker and marker["reason"].strip(), f"{where}: {line}"
                assert re.fullmatch(r"```(sh|toml)?", lines[number + 1]), f"{where}: no fence"


def test_the_sample_output_is_step_1s():
    """The sample of pytest's output is what the kit's step 1, as the page writes it, prints."""
    text = (ROOT / "docs" / "test-your-own.md").read_text()
    assert STEP_1 in text.replace(" \\\n    ", " ")


def test_the_signature_shown_is_the_examples():
    """The kit page's stub of examples/my_attention.py has the example's signature."""
    sys.path.insert(0, str(ROOT))
    try:
        from examples.my_attention import attention
    finally:
        sys.path.remove(str(ROOT))
    text = (ROOT / "docs" / "test-your-own.md").read_text()
    (fence,) = [f for f in re.findall(r"```python\n(.*?)```", text, re.S) if "def attention(" in f]
    (shown,) = [n for n in ast.parse(fence).body if isinstance(n, ast.FunctionDef)]
    names = [a.arg for a in shown.args.args] + [a.arg for a in shown.args.kwonlyargs]
    assert names == list(inspect.signature(attention).parameters)
