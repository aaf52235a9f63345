"""mkdocs hooks (mkdocs.yml names this file; it is not a page).

- Every clause of the spec gets an anchor of its number: ``**4.1 Scale.**`` becomes the
  target of ``spec.md#4.1``. It runs after pymdownx.snippets has included SPEC.md, so the
  anchors are known to mkdocs' own check of every link's anchor.
- The reference page of the impls (reference/impls.md) lists every page of every framework
  package under impls/, the core pages first, so that a new page is documented by being
  written.
- A link from a page to a file of the repository outside docs/ (``../impls/contract/__init__.py``,
  as the Markdown reads on a forge) cannot be a link of the site: it becomes the file's
  path in code, and a link to a path that does not exist fails the build.
- A walkthrough stores its generated parts (an impl page's steps and functions, the numbers)
  between ``<!-- include ... -->`` and ``<!-- end include -->`` (docs/includes.py), so that
  it reads where it is stored; a page whose stored parts differ from what the files give
  now, or an include that names nothing, fails the (strict) build.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from pathlib import Path, PurePosixPath

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.exceptions import PluginError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLAUSE = re.compile(r"^\*\*(\d+\.\d+) ([^*]+)\*\*")
LINK = re.compile(r"\[([^\]]+)\]\(((?:\.\./)+[^)#\s]+)\)")
log = logging.getLogger("mkdocs.hooks")
PACKAGES = {"numpy": "NumPy", "jax": "JAX", "torch": "PyTorch"}
CORE = ("attention", "naive", "module", "sdpa")


def _load_includes():
    # mkdocs loads this file by its path, with docs/ not on sys.path: its neighbour too.
    spec = importlib.util.spec_from_file_location("walkthrough_includes", HERE / "includes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


includes = _load_includes()


class ClauseAnchors(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return [CLAUSE.sub(r"**\1 \2**{ #\1 }", line) for line in lines]


class ClauseAnchorsExtension(Extension):
    def extendMarkdown(self, md) -> None:
        # Below pymdownx.snippets (32), so that included files get their anchors too.
        md.preprocessors.register(ClauseAnchors(md), "clause-anchors", 31)


def on_config(config):
    config.markdown_extensions.append(ClauseAnchorsExtension())
    return config


def impl_pages() -> str:
    """A ``:::`` directive per page of each framework package, the core pages first."""
    lines = []
    for package, title in PACKAGES.items():
        names = [p.stem for p in (ROOT / "impls" / package).glob("*.py") if p.stem != "__init__"]
        names.sort(key=lambda n: (n not in CORE, CORE.index(n) if n in CORE else 0, n))
        lines += [f"## {title}", ""]
        for name in names:
            lines += [
                f"::: impls.{package}.{name}",
                "    options:",
                f"      heading: conformance.impls.{package}.{name}",
                "      heading_level: 3",
                "      show_source: true",
                "",
            ]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri == "reference/impls.md":
        markdown = markdown.replace("<!-- impls: every page -->", impl_pages())
    try:
        fresh = includes.refresh(markdown, ROOT)
    except includes.IncludeError as error:
        raise PluginError(f"{page.file.src_uri}: {error}") from error
    if fresh.rstrip("\n") != markdown.rstrip("\n"):
        log.warning(
            "%s: its generated parts are stale: run "
            "`python -m conformance walkthrough --out docs/walkthrough`",
            page.file.src_uri,
        )
    here = PurePosixPath("docs") / PurePosixPath(page.file.src_uri).parent

    def outside(match: re.Match) -> str:
        text, target = match.groups()
        path = (ROOT / here / target).resolve()
        if not path.is_relative_to(ROOT / "docs"):
            if not path.exists():
                log.warning("%s links to %s, which does not exist", page.file.src_uri, target)
            return text if text.startswith("`") else f"`{text}`"
        return match[0]

    return LINK.sub(outside, markdown)
