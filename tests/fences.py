"""The code fences of README.md and of the documentation site (docs/), under test with sybil.

sybil runs the ``python`` fences: a fence of ``>>>`` lines is a doctest (the line after each
call is its value), any other fence runs as written. A page's fences share one namespace,
as a reader runs them in order, with ``__name__ == "__main__"``, as in the script a reader
pastes them into (the context-parallel example keeps its work under that guard).

What sybil cannot do is this parser, which takes every other fence, by its language:

- ``sh``: each command runs as written from a directory holding a copy of ``examples/``
  (the kit's steps, "from the directory holding your module"); a trailing comment with
  pytest's counts (``# ... passed, ... skipped, 2 xfailed``, ``...`` for any number) must
  match the run's summary, and the command must exit 0, or 1 where that comment says tests
  fail. A fence that is deliberately not run (the whole ``tox``, an install into this
  environment, a benchmark) says why on the line before it: ``<!-- not run: REASON -->``;
  its commands are still read, and every tox env, pip extra, pytest or ``python -m
  conformance`` option and file they name must exist.
- no language: sample text, either pytest's output of the kit's step 1 (each line must be
  a line that run printed, paths and temporary names aside, and its ``replay:`` line must
  replay the saved call) or an excerpt of ``examples/known_failures.txt``.
- ``toml``: parsed; a profile excerpt must agree with the shipped profile (or the example
  profile in examples/ of that name), and the
  entry-point excerpt must name the group the registry reads.
- ``text``: a figure (a diagram), read by no program.

The walkthroughs (docs/walkthrough/) are pages like the others, but for the parts they
store between ``<!-- include ... -->`` and ``<!-- end include -->``: those are the impls'
own lines (the code runs in the conformance suite) and the generated numbers, which
tests/test_walkthrough.py holds to what docs/includes.py writes. Their fences are not run
here; the fences a walkthrough writes itself (the online softmax's derivation) are.
"""

from __future__ import annotations

import configparser
import functools
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*not run:(?P<reason>.*?)-->")
LANGUAGES = {"sh", "toml", "text", ""}


INCLUDE = re.compile(r"^<!-- include \S+ (step|def|section) [^<>]*? -->$", re.MULTILINE)
END = "<!-- end include -->"


def pages() -> list[Path]:
    """The pages whose fences run: the README and the site's pages (not the numbers that
    the walkthroughs store, docs/walkthrough/numbers/)."""
    docs = ROOT / "docs"
    site = [p for p in sorted(docs.rglob("*.md")) if "numbers" not in p.parts]
    return [ROOT / "README.md", *site]


def stored(text: str) -> list[tuple[int, int]]:
    """Where a page stores generated parts: (start, end) offsets, each from an include
    directive to its end."""
    return [(m.start(), text.index(END, m.end())) for m in INCLUDE.finditer(text)]


def written(parser):
    """``parser`` on the fences a page writes itself, not those it stores generated."""

    def parse(document: Document) -> Iterable[Region]:
        spans = stored(document.text)
        for region in parser(document):
            if not any(start <= region.start < end for start, end in spans):
                yield region

    return parse


def not_run(example: Example) -> str | None:
    """The reason on the line before the fence, where it says the fence is not run."""
    before = example.document.text[: example.start].rstrip("\n").rpartition("\n")[2]
    marker = MARKER.fullmatch(before.strip())
    return marker["reason"].strip() if marker else None


class OtherFences:
    """Every fence that is not Python, each evaluated by its language (module docstring)."""

    def __init__(self) -> None:
        self.lexer = FencedCodeBlockLexer(language=r"[\w-]*")

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.lexer(document):
            language = region.lexemes["language"]
            if language == "python":
                continue
            assert language in LANGUAGES, f"{document.path}: a fence in {language!r}"
            region.parsed = (language, str(region.lexemes["source"]))
            region.evaluator = evaluate
            yield region


def evaluate(example: Example) -> None:
    language, text = example.parsed
    if language == "sh":
        run_shell(text, not_run(example), example.namespace["KIT"])
    elif language == "toml":
        check_toml(tomllib.loads(text))
    elif language == "":
        check_sample(text, example.namespace["KIT"])


SYBIL = Sybil(parsers=[written(PythonCodeBlockParser()), written(OtherFences())])


# --- commands -------------------------------------------------------------------------


def commands(text: str) -> list[tuple[list[str], str]]:
    """Each command of a shell fence: its words, and its trailing comment."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
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


def _offers(shown: str, option: str) -> bool:
    return re.search(rf"(^|[\s,]){re.escape(option)}\b", shown, re.M) is not None


def settings_and_program(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A command's leading environment settings (``NAME=value``, the shell's), and the
    program with its arguments."""
    n = next(
        (i for i, w in enumerate(words) if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)), len(words)
    )
    return dict(w.split("=", 1) for w in words[:n]), words[n:]


def check_command(words: list[str]) -> None:
    """What a command names exists: tox envs, pip extras, options, files."""
    _, words = settings_and_program(words)
    program = words[0]
    if program == "tox":
        for i, word in enumerate(words):
            if word == "-e":
                assert words[i + 1] in _tox_envs(), words
    elif program == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        for word in words[2:]:
            for group in re.findall(r"\[([^\]]+)\]", word):
                assert set(group.split(",")) <= set(extras["optional-dependencies"]), word
    elif program == "pytest":
        for option in _options(words):
            assert _offers(_help("-m", "pytest"), option), option
        for word in words[1:]:
            if word.endswith(".py"):
                assert (ROOT / word).is_file(), word
    elif program == "python":
        assert words[1] == "-m", words
        module = ["-m", "conformance", words[3]] if words[2] == "conformance" else ["-m", words[2]]
        # ``bench --ratios`` is a mode with options of its own, listed by its own --help.
        module += ["--ratios"] if "--ratios" in words else []
        for option in _options(words):
            assert _offers(_help(*module), option), option
    elif program == "mkdocs":
        assert (ROOT / "mkdocs.yml").is_file()
    else:
        raise AssertionError(f"a page runs {program!r}: teach tests/fences.py it")
    if "--known-failures" in words:
        assert (ROOT / words[words.index("--known-failures") + 1]).is_file()


_RUNS: dict[str, subprocess.CompletedProcess] = {}


def run_command(words: list[str], where: Path) -> subprocess.CompletedProcess:
    """Run a command as written (once per test process), in ``where``; ``pytest`` and
    ``python`` are this interpreter's. Temporary files go under ``where``."""
    key = shlex.join(words)
    if key not in _RUNS:
        settings, words = settings_and_program(words)
        program = {"python": [sys.executable], "pytest": [sys.executable, "-m", "pytest"]}
        environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        environment["TMPDIR"] = str(where)
        environment["COLUMNS"] = "80"  # pytest's section rules, as the pages show them
        environment.update(settings)
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


def run_shell(text: str, reason: str | None, kit: Path) -> None:
    for words, comment in commands(text):
        check_command(words)
        if reason is not None:
            continue
        run = run_command(words, kit)
        output = run.stdout + run.stderr
        pattern = _summary_pattern(comment)
        if pattern is not None:
            assert re.search(pattern, output), (comment, output[-2000:])
        fails = pattern is not None and re.search(r"\d+ failed|\.\.\. failed", comment)
        assert run.returncode == (1 if fails else 0), output[-3000:]


# --- sample output --------------------------------------------------------------------

#: The kit's step 1, whose output the sample shows.
STEP_1 = (
    "pytest --pyargs conformance --impl examples.my_attention:attention "
    "--impl-capabilities value_dim,causal_bottom_right,window,gqa"
)


def _normalise(line: str, where: Path) -> str:
    """A line of output as the pages show it: the temporary directory as ``/tmp/`` and its
    random part as ``…``, the test file's path as pytest prints it outside a checkout."""
    line = line.replace(f"{where}/", "/tmp/")
    line = re.sub(r"attention-conformance-repro-[^/]+/", "attention-conformance-repro-…/", line)
    return re.sub(r"(?<![\w/])conformance/tests/", "tests/", line)


def check_sample(text: str, kit: Path) -> None:
    lines = [line for line in text.splitlines() if line.strip()]
    if lines[0].startswith("test_"):  # an excerpt of examples/known_failures.txt
        shipped = (ROOT / "examples" / "known_failures.txt").read_text().splitlines()
        for line in lines:
            assert line in shipped, line
        return
    assert any(line.startswith(("FAILED ", "rerun: ", "verdict ")) for line in lines), text
    run = run_command(shlex.split(STEP_1), kit)
    printed = {_normalise(line.rstrip(), kit) for line in run.stdout.splitlines()}
    for line in lines:
        assert line.rstrip() in printed, f"{line!r} is not in the output:\n{run.stdout[-4000:]}"
    # The replay runs: on the file the run saved, it rebuilds the call.
    replay = [line for line in lines if line.startswith("replay: ")]
    if not replay:
        return
    code = replay[0].removeprefix("replay: ").split("  #", 1)[0]
    snippet = "from conformance.suite.replay import load_call\n" + code
    snippet = snippet.replace("/tmp/", f"{kit}/")
    saved = re.search(r"load_call\('([^']+)'", snippet)[1]
    (real,) = [p for p in kit.glob("attention-conformance-repro-*/*") if p.name in saved]
    check = snippet.replace(saved, str(real))
    check += "\nassert method == 'attention' and str(kwargs['mask'].dtype) == 'int64'\n"
    replayed = subprocess.run(
        [sys.executable, "-c", check], cwd=kit, capture_output=True, text=True
    )
    assert replayed.returncode == 0, replayed.stderr


# --- TOML -----------------------------------------------------------------------------


def check_toml(data: dict) -> None:
    if "project" in data:  # registering a backend class for good
        from conformance.backends import ENTRY_POINT_GROUP

        (group,) = data["project"]["entry-points"]
        assert group == ENTRY_POINT_GROUP
        for target in data["project"]["entry-points"][group].values():
            assert re.fullmatch(r"[\w.]+:\w+", target), target
        return
    profiles = ROOT / "conformance" / "adapters" / "profiles"
    # A shipped profile by its name, or one of the examples' (a user's own, as a page shows).
    candidates = [profiles / f"{data['name']}.toml", *sorted((ROOT / "examples").glob("*.toml"))]
    shipped = next(
        parsed
        for parsed in (tomllib.loads(path.read_text()) for path in candidates if path.exists())
        if parsed.get("name") == data["name"]
    )
    for key, value in data.items():
        if key == "known_failures":  # "cut to one": a subset
            assert value.items() <= shipped[key].items(), value
        else:
            assert value == shipped[key], key
