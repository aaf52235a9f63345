"""The impls as teaching pages: the promises of the README's "Reading an impl" kept true.

A student opens a core page and meets the formula on the first screen, and ``diff`` of two
core pages shows framework spelling, not a different structure. These tests hold the pages
to that, by reading their source (nothing is imported, so they need no framework):

- the core pages' ``attention`` is the first definition, its body is at most 40 lines of
  code, the module docstring at most 40 lines, and the first ``q · k`` stands within the
  first 100 lines;
- the NumPy, JAX and PyTorch-naive core pages carry the same numbered step comments, the
  same public helper names in the same order and the same section banners;
- a core page imports only the standard library, NumPy, its framework and ``contract``;
- no function anywhere in the repository is over 100 lines of code, no module of
  ``impls/`` over 600 lines, none of ``conformance/`` over 450 (its spec tests,
  ``conformance/tests/``, aside: a test module holds one SPEC section's clauses).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ROOT / "impls"

#: The core pages, each with the top-level imports it may make beyond the standard library.
CORE_PAGES = {
    "numpy/attention.py": {"numpy"},
    "jax/attention.py": {"numpy", "jax"},
    "torch/naive.py": {"numpy", "torch"},
    "torch/module.py": {"numpy", "torch"},
    "torch/sdpa.py": {"numpy", "torch"},
}
#: The pages that diff line against line.
PARALLEL_PAGES = ("numpy/attention.py", "jax/attention.py", "torch/naive.py")
STEP = re.compile(r"^\s*# (\d)\. (.*)$")
BANNER = re.compile(r"^# --- (.*?) -*$")
PRODUCT = re.compile(r'einsum\("bhtd,bhsd->bhts"|F\.scaled_dot_product_attention\b|q @ k')


def _source(page: str) -> str:
    return (IMPLS / page).read_text(encoding="utf-8")


def _code_lines(source: str, node: ast.AST) -> int:
    """Lines of code in ``node``: not blank, not only a comment, not its docstring."""
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    first = node.lineno
    skip: set[int] = set()
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    comment_only: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
        if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
            comment_only.add(first + tok.start[0] - 1)
    return sum(
        1
        for n, line in enumerate(lines, start=first)
        if line.strip() and n not in skip and n not in comment_only
    )


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


@pytest.mark.parametrize("page", sorted(CORE_PAGES))
def test_a_core_page_shows_attention_first(page):
    source = _source(page)
    tree = ast.parse(source)
    docstring = ast.get_docstring(tree, clean=False) or ""
    assert len(docstring.splitlines()) <= 40, f"{page}: the docstring is over 40 lines"
    definitions = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    assert definitions and definitions[0].name == "attention", (
        f"{page}: the first definition is {definitions[0].name!r}, not 'attention'"
    )
    body = _code_lines(source, definitions[0]) - _signature_lines(source, definitions[0])
    assert body <= 40, f"{page}: attention() has {body} lines of code, over 40"
    first = next(n for n, line in enumerate(source.splitlines(), 1) if PRODUCT.search(line))
    assert first <= 100, f"{page}: the first q · k stands at line {first}, past line 100"


def _signature_lines(source: str, node: ast.FunctionDef) -> int:
    """Lines of ``def ...:`` up to the body's first statement (the docstring excluded)."""
    first_statement = node.body[0].lineno
    lines = source.splitlines()[node.lineno - 1 : first_statement - 1]
    return sum(1 for line in lines if line.strip())


def test_the_attention_body_is_the_numbered_steps():
    for page in PARALLEL_PAGES:
        steps = [int(m.group(1)) for m in map(STEP.match, _source(page).splitlines()) if m]
        body = steps[: steps.index(7) + 1] if 7 in steps else steps
        assert body == list(range(8)), f"{page}: attention's steps are {body}, not 0-7"


#: What a framework needs beyond the reference's helpers, each explained on its page: JAX
#: compiles steps 1-7 as one function of their own (``jax.jit`` cannot take the contract's
#: Python checks).
FRAMEWORK_HELPERS = {"jax/attention.py": {"compiled"}}


def _structure(page: str) -> dict[str, list[str]]:
    source = _source(page)
    lines = source.splitlines()
    tree = ast.parse(source)
    banners = [n for n, line in enumerate(lines) if BANNER.match(line)]
    # The steps stand before the first section of helpers: in attention() and, where a
    # framework needs it, the one function it hands them to.
    steps = lines[: banners[0]] if banners else lines
    extra = FRAMEWORK_HELPERS.get(page, set())
    return {
        "step comments": [m.group(0).strip() for m in map(STEP.match, steps) if m],
        "helpers": [
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_") and n.name not in extra
        ],
        "sections": [m.group(1) for m in map(BANNER.match, lines) if m],
    }


@pytest.mark.parametrize("page", PARALLEL_PAGES[1:])
@pytest.mark.parametrize("part", ["step comments", "helpers", "sections"])
def test_the_core_pages_diff_line_against_line(page, part):
    reference = _structure(PARALLEL_PAGES[0])[part]
    assert _structure(page)[part] == reference, f"{page}'s {part} differ from {PARALLEL_PAGES[0]}'s"


@pytest.mark.parametrize("page", sorted(CORE_PAGES))
def test_a_core_page_imports_only_its_framework_and_the_contract(page):
    tree = ast.parse(_source(page))
    allowed = CORE_PAGES[page] | set(sys.stdlib_module_names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module.split(".")[0]]
        elif isinstance(node, ast.ImportFrom):
            assert (node.level, node.module) == (2, None) and [a.name for a in node.names] == [
                "contract"
            ], f"{page} imports {ast.unparse(node)!r}: only '..contract' may be"
            continue
        else:
            continue
        outside = [n for n in names if n not in allowed | {"__future__"}]
        assert not outside, f"{page} imports {outside}"


def _python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if listed.returncode == 0 and listed.stdout.strip():
        return [ROOT / p for p in listed.stdout.split()]
    return sorted(p for p in ROOT.rglob("*.py") if ".tox" not in p.parts)


def test_no_function_is_over_100_lines_of_code():
    long = []
    for path in _python_files():
        source = path.read_text(encoding="utf-8")
        for node in _functions(ast.parse(source)):
            n = _code_lines(source, node)
            if n > 100:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 100 lines of code: " + "; ".join(long)


@pytest.mark.parametrize("folder, most", [("impls", 600), ("conformance", 450)])
def test_no_module_is_over_its_size(folder, most):
    big = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in _python_files()
        if p.relative_to(ROOT).parts[0] == folder
        and p.relative_to(ROOT).parts[:2] != ("conformance", "tests")
        and (n := len(p.read_text(encoding="utf-8").splitlines())) > most
    ]
    assert not big, f"modules of {folder}/ over {most} lines: " + "; ".join(big)
