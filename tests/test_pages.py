"""The impls as teaching pages: the promises of docs/architecture.md's core pages kept true.

A student opens a core page and meets the formula on the first screen, and ``diff`` of two
core pages shows framework spelling, not a different structure. These tests hold the pages
to that, by reading their source (nothing is imported, so they need no framework):

- the NumPy, JAX and PyTorch-naive core pages open, after a docstring of at most 25 lines,
  with ``textbook_attention``: at most 15 lines of code, its ``q · k`` within the first 50
  lines; ``attention`` comes next (tests/test_pages_core.py holds the two equal); the
  other core pages (module, sdpa) open with ``attention``, under a docstring of at most 40
  lines, and their first ``q · k`` (or SDPA's call) stands within the first 100 lines;
- ``attention``'s body is at most 40 lines of code;
- the NumPy, JAX and PyTorch-naive core pages carry the same numbered step comments and
  preparation labels, the same public helper names in the same order and the same section
  banners; with the frameworks' prefixes and names normalised, the JAX and PyTorch pages
  differ from the NumPy page in at most 60 lines, each of them listed here (``DIFFERENCES``)
  and explained on its page;
- no SPEC § reference stands on the lesson path: they live in the "Edge cases" section;
- a core page imports only the standard library, NumPy, its framework and ``contract``;
- no function anywhere in the repository is over 100 lines of code, no module of
  ``impls/`` over 600 lines, none of ``conformance/`` over 450 (its spec tests,
  ``conformance/tests/``, aside: a test module holds one SPEC section's clauses).
"""

from __future__ import annotations

import ast
import difflib
import io
import re
import subprocess
import sys
import tokenize
from collections import Counter
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
PREPARE = re.compile(r"^\s*# Prepare (.*)$")
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


#: What each core page opens with: (its first definitions, the most docstring lines, the
#: line by which the first q · k stands).
OPENING = {
    page: (("textbook_attention", "attention"), 25, 50)
    if page in PARALLEL_PAGES
    else (("attention",), 40, 100)
    for page in CORE_PAGES
}


@pytest.mark.parametrize("page", sorted(CORE_PAGES))
def test_a_core_page_shows_attention_first(page):
    source = _source(page)
    tree = ast.parse(source)
    names, most_docstring, product_by = OPENING[page]
    docstring = ast.get_docstring(tree, clean=False) or ""
    lines = len(docstring.splitlines())
    assert lines <= most_docstring, f"{page}: the docstring is {lines} lines, over {most_docstring}"
    definitions = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    first = tuple(n.name for n in definitions[: len(names)])
    assert first == names, f"{page}: the first definitions are {first}, not {names}"
    by_name = {n.name: n for n in definitions}
    body = _code_lines(source, by_name["attention"]) - _signature_lines(
        source, by_name["attention"]
    )
    assert body <= 40, f"{page}: attention() has {body} lines of code, over 40"
    if "textbook_attention" in names:
        core = by_name["textbook_attention"]
        n = _code_lines(source, core) - _signature_lines(source, core)
        assert n <= 15, f"{page}: textbook_attention() has {n} lines of code, over 15"
    first = next(n for n, line in enumerate(source.splitlines(), 1) if PRODUCT.search(line))
    assert first <= product_by, f"{page}: the first q · k stands at line {first}, past {product_by}"


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
        "step comments": [
            line.strip() for line in steps if STEP.match(line) or PREPARE.match(line)
        ],
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


EDGE_CASES = re.compile(r"^# --- Edge cases -*$", re.MULTILINE)


@pytest.mark.parametrize("page", sorted(CORE_PAGES))
def test_the_lesson_path_has_no_spec_reference(page):
    """Above the "Edge cases" section a page teaches attention; the SPEC's clauses, which
    say why each guard is there, stand below it."""
    source = _source(page)
    found = EDGE_CASES.search(source)
    assert found, f"{page} has no '# --- Edge cases ---' section"
    lesson = source[: found.start()].splitlines()
    cited = [f"{n}: {line.strip()}" for n, line in enumerate(lesson, 1) if "§" in line]
    assert not cited, f"{page} cites the SPEC on the lesson path: " + "; ".join(cited)


#: How the frameworks spell one thing, made one spelling before two pages are compared: the
#: array type, the module prefix, the axis keyword, the cast, the random source's name, the
#: generator class, the grouped-query repeat, the tensor constructor, the maximum, the bool
#: dtype and the framework's name.
NORMALISE = (
    (r"\bjax\.Array\b|\bnp\.ndarray\b|\btorch\.Tensor\b", "Array"),
    (r"\bjnp\.|\bnp\.|\btorch\.", "xp."),
    (r"\bkeepdim=", "keepdims="),
    (r"\bdim=", "axis="),
    (r"\.to\(", ".astype("),
    (r"\bNumPy\b|\bJAX\b|\bPyTorch\b", "FRAMEWORK"),
    (r"\b(rng|key|generator)\b", "random"),
    (r"\bxp\.random\.Generator\b", "xp.Generator"),
    (r"\brepeat_interleave\b", "repeat"),
    (r"\bas_tensor\b", "asarray"),
    (r"\bamax\b", "max"),
    (r"dtype=xp\.bool\b", "dtype=bool"),
)
MOST_DIFFERENT_LINES = 60


def _normalised(page: str) -> list[str]:
    lines = []
    for line in _source(page).splitlines():
        for pattern, spelling in NORMALISE:
            line = re.sub(pattern, spelling, line)
        lines.append(line.rstrip())
    return lines


def _different_lines(page: str) -> list[str]:
    """The lines in which ``page`` differs from the NumPy page, normalised: "-" the NumPy
    page's, "+" this page's, as ``diff -U0`` lists them."""
    diff = difflib.unified_diff(_normalised(PARALLEL_PAGES[0]), _normalised(page), n=0)
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]


#: Where the JAX and PyTorch pages differ from the NumPy page once normalised, line by line
#: ("-" the NumPy page's line, "+" the other's), each for a reason the page gives.
DIFFERENCES = {
    "jax/attention.py": (
        # The docstring: the framework's own letters, the package's other pages.
        "+jax.nn.dot_product_attention is sequence-first, (B, T, N, H): N for H, H for D and E.",
        "-other pages: backward, flash, layers, kv_cache, packed and paged.",
        "+other pages: gradients, flash, layers, kv_cache, packed, paged, ring and ulysses.",
        # Imports.
        "+import dataclasses",
        "+import functools",
        "-import numpy as np",
        "+import jax",
        "+import jax.numpy as jnp",
        # NumPy silences its overflow warnings (Notes: framework spelling).
        '-@xp.errstate(over="ignore", invalid="ignore", divide="ignore")',
        # The random source: a jax.random key, and what the contract checks it against.
        "-    random: xp.Generator | None = None,",
        "+    random: Array | None = None,",
        # JAX compiles the preparation and steps 1-7 (Notes: jit).
        "-",
        "+    static = dataclasses.replace(call, scale=None)  # the rest compiled (see Notes: jit)",
        "+    arrays = (q, k, v, mask, sinks, alibi_slopes, random, call.scale)",
        "+    return compiled(*arrays, call=static, return_lse=return_lse)",
        "+",
        "+",
        '+@functools.partial(jax.jit, static_argnames=("call", "return_lse"))',
        "+def compiled(",
        "+    q, k, v, mask, sinks, alibi_slopes, random, scale, *, call: contract.Checked, return_lse=False",
        "+):",
        "-    scores = scores * call.scale  # (B, H, T, S)",
        "+    scores = scores * xp.asarray(scale, scores.dtype)  # (B, H, T, S)",
        '-    """What the contract checks dropout\'s random source against (see the Args)."""',
        '-    return ("random", random, isinstance(random, xp.Generator), "a numpy.random.Generator")',
        '+    """What the contract checks dropout\'s random source against (see the Args): a typed random',
        '+    (``jax.random.random``) or a legacy uint32 (2,) one (``jax.random.PRNGKey``)."""',
        "+    typed = isinstance(random, Array) and xp.issubdtype(random.dtype, jax.dtypes.prng_key)",
        "+    legacy = isinstance(random, Array) and random.dtype == xp.uint32 and random.shape == (2,)",
        '+    return ("random", random, (typed and random.ndim == 0) or legacy, "a jax.random random")',
        # Each framework's softcap guard (Edge cases).
        "-    return softcap * xp.tanh(scores / softcap)  # (B, H, T, S)",
        "+    return _subnormal_ratio_kept(scores, softcap)  # (B, H, T, S); Edge cases",
        # JAX's second shift (Edge cases: fused multiply-add).
        "-    p = xp.exp(shifted)  # (B, H, T, S)",
        "+    p = xp.exp(shifted - finite_or_0(row_max(shifted)))  # (B, H, T, S); Edge cases: FMA",
        "-    p = xp.exp(shifted)  # (B, H, T, S)",
        "-    weights = p / divisor(p.sum(axis=-1, keepdims=True) + xp.exp(sink - highest))  # (B, H, T, S)",
        "+    shift = finite_or_0(xp.maximum(row_max(shifted), sink - highest))  # Edge cases: FMA",
        "+    p = xp.exp(shifted - shift)  # (B, H, T, S)",
        "+    weights = p / divisor(p.sum(axis=-1, keepdims=True) + xp.exp(sink - highest - shift))",
        # Dropout, drawn the framework's way (Notes: framework spelling).
        "-    keep = random.random(weights.shape) >= dropout_p  # (B, H, T, S)",
        "+    keep = jax.random.uniform(random, weights.shape) >= dropout_p  # (B, H, T, S)",
        # JAX's own notes: jit, and fused multiply-add.
        "+#",
        "+# Jit (FRAMEWORK only). The preparation and steps 1-7 are one XLA program, ``compiled`` once per",
        "+# shape, dtype and option. Step 0 reads the options' values, which a traced argument has",
        "+# not, so it stays in Python; the scale enters traced, so a new scale reuses the program.",
        "+#",
        "+# Fused multiply-add (FRAMEWORK only; SPEC §4.1). XLA may fuse step 2's multiply into step 5's",
        "+# subtraction, unrounded, where the maximum saw it rounded: past scores of ~1e18 a row was",
        "+# NaN. The softmax's second shift, by the largest difference itself, makes that one 0.",
        # The divisor of a row that reads +inf: NaN where autograd differentiates (Edge cases).
        "-    return xp.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, 1)",
        "+    return xp.where(row_sum == xp.inf, xp.nan, xp.where(row_sum > 0, row_sum, 1.0))",
        # JAX's softcap guard (Edge cases: huge softcaps).
        "+",
        "+",
        "+def _subnormal_ratio_kept(scores: Array, softcap: float) -> Array:",
        '+    """Huge softcaps (SPEC §4.2; FRAMEWORK only): where scores / softcap is subnormal, XLA on a CPU',
        '+    flushes it to 0, so the score itself, the correctly rounded answer, is kept."""',
        "+    ratio = scores / softcap  # (B, H, T, S)",
        "+    tiny = xp.abs(ratio) < xp.finfo(scores.dtype).tiny  # (B, H, T, S)",
        "+    return xp.where(tiny, scores, softcap * xp.tanh(ratio))  # (B, H, T, S)",
    ),
    "torch/naive.py": (
        # The docstring: the framework's own letters, the package's other pages.
        '+FRAMEWORK\'s docs call B "N", T "L", D "E" and E "Ev".',
        "-other pages: backward, flash, layers, kv_cache, packed and paged.",
        "+other pages: module, sdpa, layers, kv_cache, packed, paged, ring and ulysses.",
        "-import numpy as np",
        "+import torch",
        # NumPy silences its overflow warnings (Notes: framework spelling).
        '-@xp.errstate(over="ignore", invalid="ignore", divide="ignore")',
        # PyTorch's return_weights (Notes: framework spelling).
        "+    return_weights: bool = False,",
        "+      return_weights: also return the weights that multiplied v (after dropout); not",
        "+        with return_lse, each asks for the second output.",
        "-      out: (B, H, T, E), or (H, T, E) for unbatched input; q's dtype.",
        "+      out: (B, H, T, E), or (H, T, E) for unbatched input; q's dtype. Or (out, weights).",
        # return_weights and return_lse both ask for the second output: refused together
        # (the contract checks that return_lse is a bool, as on every page; this line,
        # return_weights).
        '+    if contract.check_bool("return_weights", return_weights) and return_lse:',
        '+        raise ValueError("return_weights and return_lse: set one of the two, got both True")',
        # PyTorch makes its tensors on q's device (Notes: framework spelling).
        "-    allowed = allowed_keys(mask, call)  # (B|1, H|1, T, S)",
        "+    allowed = allowed_keys(mask, call, q.device)  # (B|1, H|1, T, S)",
        "-        causal = xp.tril(xp.ones((T, S), dtype=bool))  # (T, S): s <= t",
        "+        causal = xp.tril(xp.ones((T, S), dtype=bool, device=q.device))  # (T, S): s <= t",
        # return_weights.
        "+    if return_weights:",
        "+        return as_given(out, dtype, call), as_given(weights, dtype, call)",
        '-    return ("random", random, isinstance(random, xp.Generator), "a numpy.random.Generator")',
        "+    ok = random is None or isinstance(random, xp.Generator)",
        '+    return ("random", random, ok, "a xp.Generator or None")',
        "-def allowed_keys(mask: Array | None, call: contract.Checked) -> Array:",
        "+def allowed_keys(mask: Array | None, call: contract.Checked, device) -> Array:",
        "-    t = xp.arange(T)[:, None] + offset  # (T, 1): each query's diagonal",
        "-    s = xp.arange(S)[None, :]  # (1, S)",
        "+    t = xp.arange(T, device=device)[:, None] + offset  # (T, 1): each query's diagonal",
        "+    s = xp.arange(S, device=device)[None, :]  # (1, S)",
        "-    allowed = xp.ones((1, 1, T, S), dtype=bool)  # (1, 1, T, S)",
        "+    allowed = xp.ones((1, 1, T, S), dtype=bool, device=device)  # (1, 1, T, S)",
        # Each framework's softcap guard (Edge cases).
        "-    return softcap * xp.tanh(scores / softcap)  # (B, H, T, S)",
        "+    return _Softcap.apply(scores, softcap)  # (B, H, T, S); Edge cases",
        "-    t = xp.arange(T)[:, None]  # (T, 1)",
        "-    s = xp.arange(S)[None, :]  # (1, S)",
        "+    t = xp.arange(T, device=scores.device)[:, None]  # (T, 1)",
        "+    s = xp.arange(S, device=scores.device)[None, :]  # (1, S)",
        # Dropout, drawn the framework's way (Notes: framework spelling).
        "-    keep = random.random(weights.shape) >= dropout_p  # (B, H, T, S)",
        "-    return weights * keep / (1.0 - dropout_p)  # (B, H, T, S)",
        "+    keep = xp.empty_like(weights)  # (B, H, T, S)",
        "+    keep = keep.bernoulli_(1.0 - dropout_p, random=random)  # (B, H, T, S)",
        "+    return weights * keep.div_(1.0 - dropout_p)  # (B, H, T, S)",
        # torch's S = 0 maximum keeps q's device (Edge cases: row_max).
        "-        return xp.full((*scores.shape[:-1], 1), -xp.inf, dtype=scores.dtype)  # (B, H, T, 1)",
        "+        return scores.new_full((*scores.shape[:-1], 1), -xp.inf)  # (B, H, T, 1)",
        # The divisor of a row that reads +inf: NaN where autograd differentiates (Edge cases).
        "-    return xp.where(row_sum > 0, row_sum, 1.0)  # (B, H, T, 1)",
        "+    return xp.where(row_sum == xp.inf, xp.nan, xp.where(row_sum > 0, row_sum, 1.0))",
        # PyTorch's softcap guard (Edge cases: huge softcaps).
        "+",
        "+",
        "+class _Softcap(xp.autograd.Function):",
        '+    """Huge softcaps (SPEC §4.2; FRAMEWORK only): the derivative 1 − tanh² as it is, since',
        '+    autograd\'s d · softcap overflowed near the largest float (3e38 in float32)."""',
        "+",
        "+    @staticmethod",
        "+    def forward(ctx, scores: Array, softcap: float) -> Array:",
        "+        ctx.save_for_backward(tanh := xp.tanh(scores / softcap))  # (B, H, T, S)",
        "+        return softcap * tanh  # (B, H, T, S)",
        "+",
        "+    @staticmethod",
        "+    def backward(ctx, d_capped: Array) -> tuple[Array, None]:",
        "+        (tanh,) = ctx.saved_tensors",
        "+        return d_capped * (1.0 - tanh * tanh), None  # (B, H, T, S)",
    ),
}


@pytest.mark.parametrize("page", PARALLEL_PAGES[1:])
def test_the_core_pages_differ_only_in_the_listed_lines(page):
    different = _different_lines(page)
    assert len(different) <= MOST_DIFFERENT_LINES, (
        f"{page} differs from {PARALLEL_PAGES[0]} in {len(different)} normalised lines, "
        f"over {MOST_DIFFERENT_LINES}"
    )
    unlisted = Counter(different) - Counter(DIFFERENCES[page])
    assert not unlisted, (
        f"{page} differs from {PARALLEL_PAGES[0]} in lines not in DIFFERENCES: "
        + "\n".join(unlisted.elements())
    )
    stale = Counter(DIFFERENCES[page]) - Counter(different)
    assert not stale, f"DIFFERENCES lists lines of {page} that no longer differ: {list(stale)}"


#: How a framework spells the textbook core beyond NORMALISE: PyTorch makes the causal
#: triangle on q's device.
TEXTBOOK_SPELLING = ((r", device=q\.device", ""),)


def _textbook(page: str) -> list[str]:
    """``textbook_attention``'s lines on ``page``, normalised to one spelling."""
    source = _source(page)
    node = next(
        n for n in ast.parse(source).body
        if isinstance(n, ast.FunctionDef) and n.name == "textbook_attention"
    )  # fmt: skip
    lines = source.splitlines()[node.lineno - 1 : node.end_lineno]
    for pattern, spelling in (*NORMALISE, *TEXTBOOK_SPELLING):
        lines = [re.sub(pattern, spelling, line) for line in lines]
    return lines


def test_the_textbook_core_calls_nothing_of_its_page():
    """The core reads whole on one screen: every name it calls is the framework's or a
    builtin, none a helper of its page."""
    for page in PARALLEL_PAGES:
        tree = ast.parse(_source(page))
        own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        core = next(n for n in tree.body if getattr(n, "name", "") == "textbook_attention")
        called = {
            n.func.id
            for n in ast.walk(core)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert not called & own, f"{page}: textbook_attention calls {sorted(called & own)}"


@pytest.mark.parametrize("page", PARALLEL_PAGES[1:])
def test_the_textbook_core_is_the_same_lines_in_each_framework(page):
    """Normalised (NORMALISE, TEXTBOOK_SPELLING), the JAX and PyTorch cores are the NumPy
    core line for line: the same steps, the same comments, nothing listed as different."""
    reference, mine = _textbook(PARALLEL_PAGES[0]), _textbook(page)
    diff = [
        line
        for line in difflib.unified_diff(reference, mine, n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    assert not diff, f"{page}'s textbook_attention differs from the NumPy one:\n" + "\n".join(diff)
