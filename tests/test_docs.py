"""The README and docs/ hold: every `>>>` example runs, and every relative link resolves.

Each markdown page's examples run as one doctest (the standard `doctest`
module, ELLIPSIS and NORMALIZE_WHITESPACE), in a namespace of their own; the
fence lines of code blocks are blanked first, so a block's closing fence is
not read as expected output. A failing page fails with doctest's report.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

import hp  # noqa: F401  (imported here, once: a page's time is its examples')

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def without_fences(text: str) -> str:
    """The text with each code fence line blank (same line numbers)."""
    return "\n".join("" if FENCE.match(line) else line for line in text.split("\n"))


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_examples_run(path: Path):
    text = without_fences(path.read_text())
    name = page_id(path)
    test = doctest.DocTestParser().get_doctest(text, {"__name__": name}, name, str(path), 0)
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link and image outside code."""
    links, fenced = [], False
    for number, line in enumerate(path.read_text().split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            links.append((number, target))
    return links


def test_relative_links_resolve():
    broken = []
    for path in PAGES:
        for number, target in relative_links(path):
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{page_id(path)}:{number}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_pages_have_links():
    """The link check sees links: the README links to the docs, and every page is linked from somewhere."""
    linked = {(path.parent / t.split("#", 1)[0]).resolve() for path in PAGES for _, t in relative_links(path)}
    unlinked = [page_id(p) for p in PAGES if p != ROOT / "README.md" and p.resolve() not in linked]
    assert not unlinked, f"pages no other page links to: {unlinked}"
