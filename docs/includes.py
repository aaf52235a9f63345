"""The walkthroughs' includes of an impl page's code, keyed by what the page already has.

A line ``<!-- include PATH step N -->`` (inside a code fence, where the code goes) becomes
the numbered step N of the file at PATH (relative to the repository): its comment line
``# N. ...`` through the line before the blank line that ends the step. A line
``<!-- include PATH def NAME [NAME ...] -->`` becomes the top-level functions NAME, which
must follow one another in the file, from the first one's ``def`` (or decorator) through
the last one's last line. Both are dedented and keep the directive's own indent.

So the core page's body needs no marker lines: the steps it is read by are the keys. The
site's hook (docs/hooks.py) and tests/test_walkthrough.py load this module by its path; it
needs nothing outside the standard library.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

DIRECTIVE = re.compile(
    r"^(?P<indent>[ \t]*)<!-- include (?P<path>\S+) (?P<kind>step|def) (?P<keys>[^<>]*?) -->\s*$"
)


class IncludeError(ValueError):
    """An include names a file, a step or a function that is not there."""


@dataclass(frozen=True)
class Include:
    path: str
    kind: str
    keys: tuple[str, ...]
    indent: str = ""

    def __str__(self) -> str:
        return f"{self.path} {self.kind} {' '.join(self.keys)}"


def directives(markdown: str) -> list[Include]:
    """Every include of a page, in order."""
    return [
        Include(m["path"], m["kind"], tuple(m["keys"].split()), m["indent"])
        for m in map(DIRECTIVE.match, markdown.splitlines())
        if m
    ]


def source(root: Path, include: Include) -> list[str]:
    """The lines that ``include`` shows, dedented."""
    file = root / include.path
    if not file.is_file():
        raise IncludeError(f"include {include}: there is no file {include.path}")
    text = file.read_text(encoding="utf-8")
    if include.kind == "step":
        if len(include.keys) != 1 or not include.keys[0].isdigit():
            raise IncludeError(f"include {include}: a step is one number, as in 'step 1'")
        lines = step(text, include.keys[0])
    else:
        if not include.keys:
            raise IncludeError(f"include {include}: name at least one function")
        lines = functions(text, include.keys)
    if not lines:
        what = "step" if include.kind == "step" else "run of consecutive top-level functions"
        raise IncludeError(f"include {include}: {include.path} has no such {what}")
    return textwrap.dedent("\n".join(lines)).splitlines()


def step(text: str, number: str) -> list[str]:
    """Step ``number``'s lines: its ``# N. `` comment, the one such line in the file,
    through the line before the first blank line (or the end of the enclosing block);
    none if the file has no such comment or more than one."""
    lines = text.splitlines()
    head = re.compile(rf"^(?P<indent>\s*)# {re.escape(number)}\. ")
    starts = [(i, m["indent"]) for i, m in enumerate(map(head.match, lines)) if m]
    if len(starts) != 1:
        return []
    first, indent = starts[0]
    end = first + 1
    while end < len(lines) and lines[end].strip() and _indent(lines[end]) >= len(indent):
        end += 1
    return lines[first:end]


def functions(text: str, names: tuple[str, ...]) -> list[str]:
    """The top-level functions ``names``, one right after the other in the file; none if
    one is missing or they do not follow one another."""
    body = ast.parse(text).body
    where = {
        node.name: i
        for i, node in enumerate(body)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    if any(name not in where for name in names):
        return []
    first = where[names[0]]
    if [where[name] for name in names] != list(range(first, first + len(names))):
        return []
    start, last = body[first], body[first + len(names) - 1]
    top = min([start.lineno, *(d.lineno for d in start.decorator_list)])
    return text.splitlines()[top - 1 : last.end_lineno]


def expand(markdown: str, root: Path) -> str:
    """The page with every include replaced by its lines."""
    out = []
    for line in markdown.splitlines():
        found = directives(line)
        if not found:
            out.append(line)
            continue
        out += [found[0].indent + code if code else code for code in source(root, found[0])]
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
