"""The README's code blocks, under test so they cannot drift from the code.

Every fenced block of README.md is checked, by its language:

- ``python``: run as written, in a fresh interpreter in an empty directory; a comment line
  ``# <value>`` right after an expression is the value's ``repr``, and must be it.
- ``sh``: each command is run as written from a directory holding a copy of
  ``examples/`` (the kit's steps, "from the directory holding your module"); a trailing
  comment with pytest's counts (``# ... passed, ... skipped, 2 xfailed``, ``...`` for any
  number) must match the run's summary, and the command must exit 0, or 1 where that
  comment says tests fail. A block that is deliberately not run (the whole ``tox``, an
  install into this environment, a benchmark) says so on the line before it, with the
  reason: ``<!-- not run: REASON -->``; its commands are still read, and every tox env,
  pip extra, pytest or ``python -m conformance`` option and file they name must exist.
- a block without a language is sample text: pytest's output of the kit's step 1 (each
  line must be a line the run printed, paths and temporary names aside, and its replay
  snippet must replay the saved call) or an excerpt of ``examples/known_failures.txt``.
- ``toml``: parsed; the profile excerpt must agree with the shipped profile, and the
  entry-point excerpt must name the group the registry reads.

The "Backends" table's column of today's variants (SPEC §15-§19) must name exactly the
variant capabilities each backend declares.
"""

from __future__ import annotations

import ast
import configparser
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = re.compile(r"<!--\s*not run:(?P<reason>.*?)-->")

pytestmark = pytest.mark.clause("13.9")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None  # the reason, where the line before the fence says it is not run


def readme_blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\S*)\s*", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
        reason = marker["reason"].strip() if marker else None
        blocks.append(Block(i + 1, fence[1], "\n".join(lines[i + 1 : end]), reason))
        i = end + 1
    return blocks


BLOCKS = readme_blocks()


def _id(block: Block) -> str:
    return f"line{block.line}-{block.lang or 'text'}"


def test_every_marker_has_a_reason_and_a_block():
    """``<!-- not run: REASON -->`` stands on the line right before a fence, with a reason."""
    lines = README.read_text().splitlines()
    for number, line in enumerate(lines):
        if "not run" in line and "<!--" in line:
            marker = MARKER.fullmatch(line.strip())
            assert marker and marker["reason"].strip(), f"README.md:{number + 1}: {line}"
            assert lines[number + 1].startswith("```"), f"README.md:{number + 1}: no block"
    assert sum(b.not_run is not None for b in BLOCKS) >= 1
    assert {b.lang for b in BLOCKS} <= {"python", "sh", "toml", ""}, {b.lang for b in BLOCKS}


# --- commands -------------------------------------------------------------------------


def commands(block: Block) -> list[tuple[list[str], str]]:
    """Each command of a shell block: its words, and its trailing comment."""
    text = block.text.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        code, _, comment = line.partition("  #")
        if code.lstrip().startswith("#") or not code.strip():
            continue
        found.append((shlex.split(code), comment.strip()))
    return found


@functools.cache
def _help(*command: str) -> str:
    run = subprocess.run(
        [sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def _tox_envs() -> set[str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return {s.removeprefix("testenv:") for s in parser.sections() if s.startswith("testenv:")}


def _options(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def check_command(words: list[str]) -> None:
    """What a command names exists: tox envs, pip extras, options, files."""
    program = words[0]
    if program == "tox":
        for i, word in enumerate(words):
            if word == "-e":
                assert words[i + 1] in _tox_envs(), words
    elif program == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"
        ]
        for word in words[2:]:
            for group in re.findall(r"\[([^\]]+)\]", word):
                assert set(group.split(",")) <= set(extras), word
    elif program == "pytest":
        shown = _help("-m", "pytest")
        for option in _options(words):
            assert re.search(rf"(^|[\s,]){re.escape(option)}\b", shown, re.M), option
        for word in words[1:]:
            if word.endswith(".py"):
                assert (ROOT / word).is_file(), word
    elif program == "python":
        assert words[1] == "-m", words
        if words[2] == "conformance":
            shown = _help("-m", "conformance", words[3])
        else:
            shown = _help("-m", words[2])
        for option in _options(words):
            assert re.search(rf"(^|[\s,]){re.escape(option)}\b", shown, re.M), option
    else:
        raise AssertionError(f"the README runs {program!r}: teach tests/test_readme.py it")
    if "--known-failures" in words:
        assert (ROOT / words[words.index("--known-failures") + 1]).is_file()


@pytest.fixture(scope="module")
def kit_dir(tmp_path_factory) -> Path:
    """A user's directory: a copy of examples/, outside the checkout."""
    where = tmp_path_factory.mktemp("kit")
    shutil.copytree(ROOT / "examples", where / "examples")
    return where


_RUNS: dict[str, subprocess.CompletedProcess] = {}


def run_command(words: list[str], where: Path) -> subprocess.CompletedProcess:
    """Run a README command as written (once per test module), in ``where``; ``pytest`` and
    ``python`` are this interpreter's. Temporary files go under ``where``."""
    key = shlex.join(words)
    if key not in _RUNS:
        program = {"python": [sys.executable], "pytest": [sys.executable, "-m", "pytest"]}
        environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        environment["TMPDIR"] = str(where)
        environment["COLUMNS"] = "80"  # pytest's section rules, as the README shows them
        _RUNS[key] = subprocess.run(
            [*program[words[0]], *words[1:]],
            cwd=where,
            capture_output=True,
            text=True,
            env=environment,
            timeout=600,
        )
    return _RUNS[key]


def _summary_pattern(comment: str) -> str | None:
    """A regex for pytest's summary from a comment like ``... passed, 2 xfailed``."""
    if not re.search(r"\b(passed|failed|xfailed|skipped)\b", comment):
        return None
    return re.escape(comment).replace(re.escape("..."), r"\d+")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "sh"], ids=_id)
def test_shell_block(block, kit_dir):
    for words, comment in commands(block):
        check_command(words)
        if block.not_run is not None:
            continue
        run = run_command(words, kit_dir)
        output = run.stdout + run.stderr
        pattern = _summary_pattern(comment)
        if pattern is not None:
            assert re.search(pattern, output), (comment, output[-2000:])
        fails = pattern is not None and re.search(r"\d+ failed|\.\.\. failed", comment)
        assert run.returncode == (1 if fails else 0), output[-3000:]


# --- sample output --------------------------------------------------------------------

STEP_1 = next(b for b in BLOCKS if b.lang == "sh" and "--impl examples.my_attention" in b.text)


def _normalise(line: str, where: Path) -> str:
    """A line of output as the README shows it: the temporary directory as ``/tmp/`` and
    its random part as ``…``, the test file's path as pytest prints it outside a checkout."""
    line = line.replace(f"{where}/", "/tmp/")
    line = re.sub(r"attention-conformance-repro-[^/]+/", "attention-conformance-repro-…/", line)
    return re.sub(r"(?<![\w/])conformance/tests/", "tests/", line)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == ""], ids=_id)
def test_sample_text_block(block, kit_dir):
    lines = [line for line in block.text.splitlines() if line.strip()]
    if lines[0].startswith("test_"):  # an excerpt of examples/known_failures.txt
        shipped = (ROOT / "examples" / "known_failures.txt").read_text().splitlines()
        for line in lines:
            assert line in shipped, line
        return
    assert any(line.startswith("FAILED ") for line in lines), block.text
    (words, _), *_ = commands(STEP_1)
    run = run_command(words, kit_dir)
    printed = {_normalise(line.rstrip(), kit_dir) for line in run.stdout.splitlines()}
    for line in lines:
        assert line.rstrip() in printed, f"{line!r} is not in the output:\n{run.stdout[-4000:]}"
    # The replay snippet runs: on the file the run saved, it rebuilds the call.
    snippet = textwrap.dedent("\n".join(lines[lines.index("replay in Python:") + 1 :][:3])).replace(
        "/tmp/", f"{kit_dir}/"
    )
    saved = re.search(r"load_call\('([^']+)'", snippet)[1]
    (real,) = [p for p in kit_dir.glob("attention-conformance-repro-*/*") if p.name in saved]
    snippet = snippet.replace(saved, str(real))
    check = snippet + "\nassert method == 'attention' and str(kwargs['mask'].dtype) == 'int64'\n"
    replayed = subprocess.run(
        [sys.executable, "-c", check], cwd=kit_dir, capture_output=True, text=True
    )
    assert replayed.returncode == 0, replayed.stderr


# --- Python ---------------------------------------------------------------------------

#: Runs a block statement by statement; after an expression, a ``# <value>`` comment line
#: is its repr.
#: Runs a block statement by statement, as a script would (``__name__ == "__main__"``).
#: Its own work sits under the guard, since worker processes re-import the main module.
DRIVER = """
import ast, sys


def run(source):
    lines = source.splitlines()
    env = {"__name__": "__main__"}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr):
            value = eval(compile(ast.Expression(node.value), "README", "eval"), env)
            after = lines[node.end_lineno] if node.end_lineno < len(lines) else ""
            if after.startswith("# ") and repr(value) != after[2:]:
                sys.exit(f"line {node.lineno}: {value!r} is not what the README shows: {after}")
        else:
            exec(compile(ast.Module([node], []), "README", "exec"), env)


if __name__ == "__main__":
    run(open(sys.argv[1]).read())
"""


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=_id)
def test_python_block(block, tmp_path):
    assert block.not_run is None, "every Python block runs"
    (tmp_path / "block.py").write_text(block.text + "\n")
    (tmp_path / "driver.py").write_text(DRIVER)
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "driver.py", "block.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


def test_the_signature_shown_is_the_examples():
    """The README's stub of examples/my_attention.py has the example's signature."""
    import inspect

    sys.path.insert(0, str(ROOT))
    try:
        from examples.my_attention import attention
    finally:
        sys.path.remove(str(ROOT))
    (block,) = [b for b in BLOCKS if b.lang == "python" and "def attention(" in b.text]
    tree = ast.parse(block.text)
    (shown,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    names = [a.arg for a in shown.args.args] + [a.arg for a in shown.args.kwonlyargs]
    assert names == list(inspect.signature(attention).parameters)


# --- TOML -----------------------------------------------------------------------------


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "toml"], ids=_id)
def test_toml_block(block):
    data = tomllib.loads(block.text)
    if "project" in data:  # registering a backend class for good
        from conformance.backends import ENTRY_POINT_GROUP

        (group,) = data["project"]["entry-points"]
        assert group == ENTRY_POINT_GROUP
        for target in data["project"]["entry-points"][group].values():
            assert re.fullmatch(r"[\w.]+:\w+", target), target
        return
    shipped = tomllib.loads(
        (ROOT / "conformance" / "adapters" / "profiles" / f"{data['name']}.toml").read_text()
    )
    for key, value in data.items():
        if key == "known_failures":  # "cut to one": a subset
            assert value.items() <= shipped[key].items(), value
        else:
            assert value == shipped[key], key


def _backends_table() -> dict[str, dict[str, str]]:
    """The README's "Backends" table, by backend name: each row's cells by column head."""
    lines = README.read_text().split("## Backends", 1)[1].splitlines()
    rows = [line for line in lines if line.startswith("| ")]
    table = rows[: next(i for i, r in enumerate(rows) if not r.startswith("| `") and i > 0)]
    heads = [c.strip() for c in table[0].strip("|").split(" | ")]
    return {
        cells[0].strip("` "): dict(zip(heads, (c.strip() for c in cells)))
        for cells in (row.strip("|").split(" | ") for row in table[1:])
    }


@pytest.mark.clause("15.6")
def test_backends_table_names_each_backends_variant_capabilities():
    """The "today's variants" cell of each backend lists the variant capabilities it
    declares (SPEC §15-§19), and says which it lacks."""
    from conformance import load_backend
    from conformance.vocabulary import VARIANT_CAPABILITIES

    table = _backends_table()
    assert len(table) == 7, sorted(table)
    for name, row in table.items():
        cell = row["today's variants (§15-§19)"]
        declared = set(load_backend(name).capabilities) & VARIANT_CAPABILITIES
        listed, _, lacking = cell.partition("(no ")
        assert set(listed.split()) == declared, f"{name}: README says {cell!r}, declared {declared}"
        missing = set(lacking.rstrip(")").replace(",", " ").split())
        assert missing == VARIANT_CAPABILITIES - declared, f"{name}: README says {cell!r}"
