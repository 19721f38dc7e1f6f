"""The rendered book: it builds with warnings as errors, chapters are executed,
exercises are shown as released, and the HTML is self-contained.

One build serves every test in this file (the browser tests included): a fresh
Sphinx build into a temporary folder (so that every warning is raised again),
with the execution cache shared with the README's build (`_build/.jupyter_cache`).
"""
import html as html_lib
import json
import re
from urllib.parse import urlparse

import pytest

from bookbuild import browser_on, built_book, settle, toc_files
from course import ROOT, released_notebooks



@pytest.fixture(scope="module")
def html(tmp_path_factory):
    return built_book(tmp_path_factory)


def chapter_files():
    return [f for f in toc_files() if f.startswith("chapters/")]


def test_every_toc_entry_is_a_page(html):
    for f in toc_files():
        assert (html / f"{f}.html").is_file(), f


def test_every_exercise_and_chapter_is_in_the_book():
    files = set(toc_files())
    for nb in released_notebooks():
        assert nb.relative_to(ROOT).with_suffix("").as_posix() in files
    for md in (ROOT / "chapters").glob("*.md"):
        assert md.relative_to(ROOT).with_suffix("").as_posix() in files


def _outputs(page):
    """The HTML of every code cell's output (what the build computed), and nothing else."""
    parts = page.split('<div class="cell_output docutils container">')[1:]
    return " ".join(re.split(r'<div class="cell docutils container|</main>|<section', part)[0] for part in parts)


def test_chapter_numbers_were_computed_at_build_time(html):
    outputs = _outputs((html / "chapters" / "attention.html").read_text())
    for number in ("1.10", "0.778", "0.707", "0.424", "0.380", "0.354", "0.2666", "1.026", "0.974"):
        assert number in outputs, number


@pytest.mark.parametrize("page", chapter_files())
def test_chapter_teaches(html, page):
    text = (html / f"{page}.html").read_text()
    figures = re.findall(r"<img[^>]*>", _outputs(text))
    assert figures, "no figure computed at build time"
    for img in figures:
        alt = re.search(r'alt="([^"]*)"', img)
        # Sphinx falls back to the file name; real alt text describes the figure.
        assert alt and alt.group(1).strip() and not alt.group(1).endswith(".png"), f"a figure without alt text: {img[:200]}"
    assert re.search(r'<h2[^>]*>\s*Summary', text) or 'id="summary"' in text, "no summary section"
    assert 'class="reference internal"' in _main(text), "no cross-reference to another page"


def _main(page):
    m = re.search(r'<main[^>]*>(.*)</main>', page, flags=re.S)
    return m.group(1) if m else page


def test_exercise_pages_are_released_notebooks_not_executed(html):
    for nb in released_notebooks():
        page = (html / nb.relative_to(ROOT).with_suffix(".html")).read_text()
        assert "NotImplementedError" in page  # the stub is shown...
        assert "most recent call last" not in page and 'class="cell_output' not in page  # ...never run
        assert "How to work on this exercise locally" in page
        link = re.search(r'<a class="exercise-download[^"]*"[^>]*href="([^"]+\.ipynb)"', page)
        assert link, "no download link to the notebook"
        target = (html / nb.relative_to(ROOT).parent / link.group(1)).resolve()
        assert target.read_bytes() == nb.read_bytes(), "the download is not the released notebook"


def _squash(text):
    return re.sub(r"\s+", " ", text).strip()


def test_no_solution_or_hidden_test_anywhere_in_the_html(html):
    """No nbgrader marker anywhere, and no whole solution or hidden-test block
    in any page's text, source or download (a chapter may show a line that a
    solution also has; it may not show the answer)."""
    import nbformat

    blocks = []
    for src in (ROOT / "solutions").glob("*/*.ipynb"):
        for cell in nbformat.read(src, as_version=4).cells:
            for block in re.findall(r"### BEGIN (?:SOLUTION|HIDDEN TESTS)\n(.*?)### END", cell.source, flags=re.S):
                if len(block.strip().splitlines()) >= 2:
                    blocks.append(_squash(block))
    assert blocks
    for f in html.rglob("*"):
        if f.suffix not in {".html", ".ipynb", ".txt", ".md", ".js"} or not f.is_file():
            continue
        text = f.read_text(errors="replace")
        for marker in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS"):
            assert marker not in text, f"{f.relative_to(html)} contains {marker}"
        if f.suffix == ".html":
            text = html_lib.unescape(re.sub(r"<[^>]+>", "", text))
        elif f.suffix == ".ipynb":
            text = "\n".join("".join(c.get("source", "")) for c in json.loads(text)["cells"])
        flat = _squash(text)
        for block in blocks:
            assert block not in flat, f"{f.relative_to(html)} contains a solution: {block[:120]}"


EXTERNAL = re.compile(
    r"""(?:<(?:script|img|iframe|source|audio|video)\b[^>]*\bsrc|<link\b[^>]*\bhref)\s*=\s*["']([^"']+)["']"""
    r"""|url\(\s*["']?([^"')]+)["']?\s*\)|@import\s+["']([^"']+)["']""",
    re.I,
)


def _is_external(url):
    u = urlparse(url.strip())
    return u.scheme in ("http", "https") or url.strip().startswith("//")


def test_html_loads_nothing_from_another_host(html):
    offenders = []
    for f in html.rglob("*"):
        if f.suffix not in {".html", ".css"} or not f.is_file():
            continue
        text = f.read_text(errors="replace")
        for m in EXTERNAL.finditer(text):
            url = next(g for g in m.groups() if g)
            tag = m.group(0)
            if tag.lower().startswith("<link") and not re.search(r'rel="(stylesheet|preload|icon|shortcut icon|modulepreload)"', tag):
                continue  # plain links to other sites (launch buttons, repository) are fine
            if _is_external(url):
                offenders.append(f"{f.relative_to(html)}: {url}")
    assert not offenders, "\n".join(offenders[:20])
    assert (html / "_static" / "mathjax" / "tex-chtml.js").is_file(), "MathJax is not served from the book"


# ---------------------------------------------------------------- in a real browser
@pytest.fixture(scope="module")
def browser(html):
    with browser_on(html) as b:
        yield b


def _open(browser, path):
    """Open a page; return (page, console errors, requests to other hosts)."""
    b, base = browser
    page = b.new_page(viewport={"width": 1280, "height": 900})
    errors, foreign = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(base) and not r.url.startswith("data:") else None)
    page.goto(f"{base}/{path}", wait_until="load")
    settle(page)
    return page, errors, foreign


def test_navigation_links_every_chapter(browser):
    page, errors, _ = _open(browser, "intro.html")
    try:
        hrefs = page.evaluate("() => Array.from(document.querySelectorAll('nav a')).map(a => a.getAttribute('href'))")
        for doc in toc_files()[1:]:
            assert any(h and h.split("#")[0].endswith(f"{doc}.html") for h in hrefs), f"no navigation link to {doc}"
    finally:
        page.close()


def test_search_finds_softmax(browser):
    page, errors, _ = _open(browser, "search.html?q=softmax")
    try:
        page.wait_for_selector("#search-results ul.search li", timeout=20000)
        results = page.locator("#search-results ul.search li a").all_inner_texts()
        assert results, "search found nothing"
        assert not errors, errors
    finally:
        page.close()
