"""The project's documentation as the tests read it: README.md and every page under docs/.

Tests that run a documented command or check a documented setting find its text here, in
whichever page it lives, so that moving a section between pages keeps it tested."""
from __future__ import annotations

import re
from pathlib import Path

from course import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md, then every Markdown page under docs/, in a fixed order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def text() -> str:
    """All the documentation, one page after another."""
    return "\n\n".join(p.read_text() for p in pages())


def section(heading: str) -> str:
    """The text under a heading line (``## Accessibility``), up to the next heading of the same
    level or higher, from the one page that has that heading."""
    level = len(heading) - len(heading.lstrip("#"))
    found = []
    for page in pages():
        lines = page.read_text().splitlines()
        heads = [i for i, line in enumerate(lines) if re.match(r"#+ ", line) and not _in_code(lines, i)]
        for i in heads:
            if lines[i].strip() == heading:
                end = next((j for j in heads if j > i and re.match(rf"#{{1,{level}}} ", lines[j])), len(lines))
                found.append((page, "\n".join(lines[i + 1:end])))
    assert len(found) == 1, f"{heading!r} is a heading in {len(found)} doc pages: {[str(p) for p, _ in found]}"
    return found[0][1]


def _in_code(lines: list[str], i: int) -> bool:
    """Whether line i is inside a fenced code block (a shell comment there is no heading)."""
    return sum(1 for line in lines[:i] if line.lstrip().startswith("```")) % 2 == 1


def line_with(words: str) -> str:
    """The one line of the documentation that contains ``words``."""
    lines = [line for line in text().splitlines() if words in line]
    assert len(lines) == 1, f"{words!r} is on {len(lines)} lines of the docs: {lines}"
    return lines[0]


def code_blocks(page_text: str, lang: str | None = None) -> list[str]:
    """The fenced code blocks of a page's text (of one language, if given), without the fences."""
    pattern = r"^\s*```" + (re.escape(lang) if lang else r"[\w-]*") + r"\n(.*?)^\s*```"
    return [m.group(1) for m in re.finditer(pattern, page_text, flags=re.S | re.M)]
