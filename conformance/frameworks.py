"""How the frameworks' own attention functions differ from the spec: the README's table,
measured on the installed versions, never written by hand.

    python -m conformance frameworks                          # measure, print the table
    python -m conformance frameworks --out docs/frameworks.md # and write it, with details
    python -m conformance frameworks --readme README.md       # rewrite the README's table

Each cell is what ``conformance/builtin_profile.py`` measured when it called the
installed function on that row's inputs: a short label of the behaviour (✅ what the spec
requires, ❌ what the function does instead), never an error size, so a cell means the
same on any machine with the same versions. ``--readme`` replaces only the text between
``START`` and ``END``; ``tests/test_frameworks_table.py`` checks that the committed cells
are what a fresh measurement gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

START = "<!-- frameworks-table:start -->"
END = "<!-- frameworks-table:end -->"
#: The profile's functions that are frameworks', with the column heading they get.
FRAMEWORKS = {
    "torch SDPA": "PyTorch `F.scaled_dot_product_attention`",
    "jax.nn.dot_product_attention": "`jax.nn.dot_product_attention`",
}


def measure() -> dict:
    """The built-in profile: every function on every edge case (imports the frameworks)."""
    from conformance.builtin_profile import profile

    return profile()


def table(profile: dict) -> str:
    """The Markdown table: a row per edge case, the spec, then one column per framework
    the profile measured, headed with its version."""
    names = [n for n in FRAMEWORKS if n in profile["functions"]]
    heads = [f"{FRAMEWORKS[n]} ({profile['functions'][n]})" for n in names]
    lines = [
        "| behaviour | this suite | " + " | ".join(heads) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in profile["cases"]:
        cells = [_cell(row["results"][n]) for n in names]
        lines.append(f"| {row['case']} | {row['spec']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(result: dict) -> str:
    text = result["summary"].replace("|", "\\|")
    return f"{'✅' if result['conforms'] else '❌'} {text}"


def block(profile: dict) -> str:
    """What goes between the README's markers: the table and where it came from."""
    versions = ", ".join(profile["functions"][n] for n in FRAMEWORKS if n in profile["functions"])
    return (
        f"{START}\n"
        f"{table(profile)}\n"
        f"Measured on {versions} (CPU) by `python -m conformance frameworks --readme "
        "README.md`, which calls each function on the row's inputs "
        "(`conformance/builtin_profile.py`) and writes this table; the report shows the "
        "same with the errors and messages.\n"
        f"{END}"
    )


def cells(text: str) -> dict[tuple[str, int], str]:
    """The cells of the table in ``text`` (between the markers, if it has them), keyed by
    the row's first cell and the column number; the header row is left out, so the
    versions in it do not count."""
    if START in text:
        text = text.split(START, 1)[1].split(END, 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("|")]
    found = {}
    for line in rows[2:]:
        parts = [p.strip() for p in _split_row(line)]
        for i, part in enumerate(parts[1:], start=1):
            found[parts[0], i] = part
    return found


def _split_row(line: str) -> list[str]:
    """A Markdown table row's cells, honouring ``\\|`` inside a cell."""
    parts, cell, escaped = [], "", False
    for ch in line.strip()[1:-1]:
        if ch == "|" and not escaped:
            parts.append(cell)
            cell = ""
        else:
            cell += ch
        escaped = ch == "\\"
    return [*parts, cell]


def rewrite_readme(path: Path, profile: dict) -> bool:
    """Replace the table between the markers in ``path``; whether anything changed."""
    text = path.read_text()
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"{path}: expected one {START} and one {END}")
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    new = before + block(profile) + after
    path.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance frameworks", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, help="write the table, with the details, here")
    parser.add_argument(
        "--readme", type=Path, help=f"rewrite the table between {START} and {END} in this file"
    )
    args = parser.parse_args(argv)
    profile = measure()
    missing = [n for n in FRAMEWORKS if n not in profile["functions"]]
    if missing:
        print(f"not installed, so not measured: {', '.join(missing)}", file=sys.stderr)
    print(table(profile), end="")
    if args.out:
        from conformance.builtin_profile import render_markdown

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "# The frameworks' own attention functions, measured\n\n"
            + block(profile)
            + "\n\nIn detail, with the inputs of each row (and a plain -inf masked softmax "
            "for comparison):\n\n" + "\n".join(render_markdown(profile)) + "\n"
        )
        print(f"wrote {args.out}")
    if args.readme:
        changed = rewrite_readme(args.readme, profile)
        print(f"{'rewrote' if changed else 'unchanged:'} the table in {args.readme}")
    return 0
