"""The walkthroughs' generated parts: an impl page's code and the numbers, written into the page.

A walkthrough is Markdown written by hand, read where it is stored (a forge's view of the
repository) as well as on the site. What it shows of the code and the numbers is generated
and stored in the page itself, between a directive and its end:

    <!-- include PATH step N -->          the numbered step N of the Python file PATH: its
                                          comment line ``# N. ...`` through the line before
                                          the blank line that ends the step
    <!-- include PATH def NAME ... -->    the top-level functions NAME, one right after the
                                          other in the file, from the first one's ``def`` (or
                                          decorator) through the last one's last line
    <!-- include PATH section NAME -->    the lines between PATH's ``--8<-- [start:NAME]``
                                          and ``[end:NAME]`` markers (other markers left out)
    ...what ``refresh`` writes...
    <!-- end include -->

Code is written dedented, in a ``python`` fence; a section of a Markdown file (the numbers
that ``python -m conformance walkthrough`` writes into docs/walkthrough/numbers/) as it
stands. ``refresh`` rewrites every directive's lines from the files as they are now: that
command runs it on the pages, tests/test_walkthrough.py fails when a stored page differs
from it, and the site's hook (docs/hooks.py) fails a strict build then too. PATH is the
repository's; a file, step, function or section that is not there is an error. So the core
page's body needs no marker lines: the steps it is read by are the keys. This module needs
nothing outside the standard library.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

DIRECTIVE = re.compile(
    r"^(?P<indent>[ \t]*)<!-- include (?P<path>\S+) (?P<kind>step|def|section) "
    r"(?P<keys>[^<>]*?) -->\s*$"
)
END = "<!-- end include -->"
MARKER = re.compile(r"--8<-- \[(?P<kind>start|end):(?P<name>[a-z][-_0-9a-z]*)\]")


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
    elif include.kind == "section":
        if len(include.keys) != 1:
            raise IncludeError(f"include {include}: a section is one name, as in 'section q'")
        lines = section(text, include.keys[0])
    else:
        if not include.keys:
            raise IncludeError(f"include {include}: name at least one function")
        lines = functions(text, include.keys)
    if not lines:
        what = {"step": "step", "section": "section (one start and one end marker)"}.get(
            include.kind, "run of consecutive top-level functions"
        )
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


def section(text: str, name: str) -> list[str]:
    """The lines between the one ``--8<-- [start:name]`` and ``[end:name]`` marker of
    ``text``, other markers' lines left out; none if there is not exactly one pair."""
    lines = text.splitlines()
    found = [
        (i, m["kind"])
        for i, line in enumerate(lines)
        if (m := MARKER.search(line)) and m["name"] == name
    ]
    if [kind for _, kind in found] != ["start", "end"]:
        return []
    inside = lines[found[0][0] + 1 : found[1][0]]
    return [line for line in inside if not MARKER.search(line)]


def block(root: Path, include: Include) -> list[str]:
    """What stands between ``include``'s directive and its end: code in a python fence, a
    Markdown section as it is; a blank line either side, so that both read as blocks."""
    lines = source(root, include)
    if include.kind != "section" or include.path.endswith(".py"):
        lines = ["```python", *lines, "```"]
    return ["", *lines, ""]


def refresh(markdown: str, root: Path) -> str:
    """The page with every directive's lines written anew from the files under ``root``:
    the lines that stood between a directive and its ``<!-- end include -->`` are
    replaced (a directive without an end, as first written, gets one)."""
    lines, out, i = markdown.splitlines(), [], 0
    while i < len(lines):
        found = directives(lines[i])
        out.append(lines[i])
        i += 1
        if not found:
            continue
        include = found[0]
        end = next((j for j in range(i, len(lines)) if lines[j].strip() == END), None)
        if end is not None and not directives("\n".join(lines[i:end])):
            i = end + 1
        out += [include.indent + line if line else line for line in block(root, include)]
        out.append(include.indent + END)
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
