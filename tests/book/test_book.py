"""The rendered book: it builds with warnings as errors, chapters are executed,
exercises are shown as released, and the HTML is self-contained.

One build serves every test in this file (the browser tests included): a fresh
Sphinx build into a temporary folder (so that every warning is raised again),
with the execution cache shared with the README's build (`_build/.jupyter_cache`).
"""
import ast
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


def _code_cells(text):
    """Every ```{code-cell}``` of a MyST notebook: its options (the ``---`` block or the
    ``:key:`` lines, tags included) and its source lines, what a reader sees when it is shown."""
    for cell in re.findall(r"^```\{code-cell\}[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        options = re.match(r"\A(---\n.*?^---\n|(:\w[\w-]*:[^\n]*\n)+)?", cell, flags=re.S | re.M)
        yield options.group(0), cell[options.end():].splitlines()


def test_code_lines_fit_their_box():
    """No line of a chapter's code cell is wider than its code box at 1280 px: it would
    scroll, and a comment cut off reads as code. The box holds ``plots.TEXT_WIDTH``
    characters; a folded cell's (hide-input), once unfolded, is 18 px narrower and holds two
    fewer (measured in Chromium: 77 characters fit 684 px, and 75 fit 666 px).
    Source-level twin of test_book_reader.py::test_code_lines_fit_at_1280, which sees only
    the cells that are not folded."""
    from firstprinciples.plots import TEXT_WIDTH

    long = {}
    for md in sorted((ROOT / "chapters").glob("*.md")):
        cells = list(_code_cells(md.read_text()))
        assert cells, f"{md.name}: no code cell found (is the parser still right?)"
        for options, lines in cells:
            width = TEXT_WIDTH - 2 if "hide-input" in options else TEXT_WIDTH
            long.setdefault(md.name, []).extend(
                f"{line.strip()[:40]} ({len(line)} > {width})" for line in lines if len(line) > width)
    long = {name: lines for name, lines in long.items() if lines}
    assert not long, f"code lines longer than their box: {long}"


# What a chapter may not import: the in-kernel checkers and the grader. A worked example or a
# tool that a chapter shares with a check lives in ``firstprinciples.examples`` (or
# ``firstprinciples.memory``), and both import it from there (one place for each).
GRADER_PACKAGES = ("firstprinciples.checks", "firstprinciples.grading")


def _imported_modules(code):
    """The modules a cell's code imports, as dotted names (``from a import b`` gives a.b)."""
    from IPython.core.inputtransformer2 import TransformerManager

    python = TransformerManager().transform_cell("\n".join(code))  # IPython's magics made Python
    for node in ast.walk(ast.parse(python)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield from (f"{node.module}.{a.name}" for a in node.names)


@pytest.mark.parametrize("page", [f for f in toc_files() if not f.startswith("exercises/")])
def test_no_chapter_imports_a_checker(page):
    """A page's code imports neither the checks nor the grader: what it shares with them comes
    from firstprinciples.examples or firstprinciples.memory."""
    found = sorted({name for _, code in _code_cells((ROOT / f"{page}.md").read_text())
                    for name in _imported_modules(code)
                    if any(name == p or name.startswith(p + ".") for p in GRADER_PACKAGES)})
    assert not found, (f"{page} imports {', '.join(found)}: take the example or tool from "
                       "firstprinciples.examples (or firstprinciples.memory) instead")


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


# ---------------------------------------------------------------- reading order and sources
# These read the chapter sources only (no build): they fail fast, before the book is built.

def _toc_chapters():
    """The root and every chapter page, in the order of _toc.yml (exercises and references are not chapters)."""
    return [f for f in toc_files() if f == toc_files()[0] or f.startswith("chapters/")]


def _prose(source):
    """A MyST notebook's prose: no front matter, no fenced block (code cells and their options,
    alt texts included), no display math. Returns (line number, text) per paragraph."""
    source = re.sub(r"\A---\n.*?\n---\n", lambda m: "\n" * m.group(0).count("\n"), source, flags=re.S)
    blank = lambda m: "\n" * m.group(0).count("\n")  # keep line numbers
    source = re.sub(r"^(`{3,}|:{3,}).*?^\1[ \t]*$", blank, source, flags=re.S | re.M)
    source = re.sub(r"\$\$.*?\$\$", blank, source, flags=re.S)
    paragraphs, start, lines = [], None, []
    for number, line in enumerate(source.splitlines() + [""], start=1):
        if line.strip():
            start = start or number
            lines.append(line.strip())
        elif lines:
            paragraphs.append((start, " ".join(lines)))
            start, lines = None, []
    return paragraphs


def _sentences(paragraph):
    return re.split(r"(?<=[.!?])\s+(?=[A-Z(*_{\"'`])", paragraph)


# A sentence that refers to a chapter that comes later must say that it looks ahead.
FORWARD = re.compile(r"\b(later|next|will|ahead|coming|upcoming|comes back|come back|returns?( to)?)\b", re.I)
# Plain-text names that stand for one chapter (a link is not needed to name it).
NAMES = {"chapters/capstone": r"\bthe capstone\b", "chapters/explorer": r"\bthe (?:attention )?explorer\b"}


def _targets(sentence, chapters, labels):
    """The chapters a sentence refers to: {doc} links, {ref} to a label a chapter defines,
    markdown links to a chapter file, and the plain-text names in NAMES."""
    found = []
    for target in re.findall(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`", sentence):
        name = target.split("/")[-1]
        found += [c for c in chapters if c.split("/")[-1] == name and "exercises" not in target]
    for label in re.findall(r"\{ref\}`(?:[^`<]*<)?([^`>]+)>?`", sentence):
        found += [labels[label]] if label in labels else []
    for target in re.findall(r"\]\(([^)#\s]+)", sentence):
        stem = target.split("/")[-1].rsplit(".", 1)[0]
        found += [c for c in chapters if c.split("/")[-1] == stem]
    found += [c for c, pattern in NAMES.items() if re.search(pattern, sentence, flags=re.I)]
    return found


def _order_problems():
    """Every sentence of intro.md and the chapters that breaks the reading order of _toc.yml:

    1. **A later chapter as prior knowledge.** A sentence that refers to a chapter placed later
       in _toc.yml (a ``{doc}`` link, a ``{ref}`` to a label that chapter defines, a markdown
       link to its file, or a plain-text name such as "the capstone") must be marked as looking
       ahead by one of the words in FORWARD ("later", "next", "will", "ahead", "coming",
       "comes back", "returns"...). "As the capstone showed" fails; "the capstone will measure"
       and "a later chapter, {doc}`x`, tests this" pass. Links to exercises do not count (every
       chapter ends by sending the reader to its exercise, which _toc.yml lists after the chapters).
    2. **"Next" must be next.** "Next, {doc}`x`", "the next chapter, {doc}`x`", "{doc}`x`, the
       next page" name x as the chapter that follows: it must be the following chapter in _toc.yml.
    3. **Only the last is last.** A sentence that calls its own page "the last chapter" ("this
       last chapter", "this was the last chapter", "this is the last chapter") is allowed only on
       the last chapter of _toc.yml.
    """
    chapters = _toc_chapters()
    texts = {c: (ROOT / f"{c}.md").read_text() for c in chapters}
    labels = {label: c for c, text in texts.items() for label in re.findall(r"^\(([\w-]+)\)=\s*$", text, flags=re.M)}
    problems = []
    for i, page in enumerate(chapters):
        following = chapters[i + 1] if i + 1 < len(chapters) else None
        for line, paragraph in _prose(texts[page]):
            for sentence in _sentences(paragraph):
                where = f"{page}.md:{line}: {sentence[:160]}"
                later = [t for t in _targets(sentence, chapters, labels) if chapters.index(t) > i]
                if later and not FORWARD.search(sentence):
                    problems.append(f"{where}\n    refers to {later[0]}, which comes later, as if read")
                claimed = re.findall(r"\bnext(?: chapter| page)?\s*[,:]?\s*(?:the\s+)?\{doc\}`([^`]+)`", sentence, flags=re.I)
                claimed += re.findall(r"\{doc\}`([^`]+)`\s*,?\s*(?:is|comes)?\s*the next (?:chapter|page)", sentence, flags=re.I)
                for target in claimed:
                    if following is None or target.split("/")[-1] != following.split("/")[-1]:
                        problems.append(f"{where}\n    calls {target} next; the next chapter is {following}")
                if re.search(r"\bthis (?:last chapter|(?:is|was) the last chapter)\b", sentence, flags=re.I) and following:
                    problems.append(f"{where}\n    calls itself the last chapter; {following} follows")
    return problems


def test_no_chapter_leans_on_a_later_one():
    problems = _order_problems()
    assert not problems, "the reading order of _toc.yml is broken:\n" + "\n".join(problems)


# Python's string escapes turn "\t", "\n", "\r", "\f", "\b", "\a", "\v" into control characters:
# "\times" written in a normal string becomes a TAB and "imes". What such an accident leaves in
# math: a control character, or a command without its backslash.
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")  # TAB included, newline not
BROKEN_COMMAND = re.compile(r"(?<![\\A-Za-z])(imes|ext\{|heta|ilde|rac\{|lpha|ight(?:arrow)?|abla|ewline|eta|athrm|athbf)\b")


def _math_spans(source):
    """(line number, text) of every display ($$...$$, \\begin...\\end) and inline ($...$) math."""
    spans = []
    for m in re.finditer(r"\$\$.*?\$\$|\\begin\{(\w+\*?)\}.*?\\end\{\1\}|(?<![\\$])\$(?!\$)[^$\n]+?(?<!\\)\$", source, flags=re.S):
        spans.append((source.count("\n", 0, m.start()) + 1, m.group(0)))
    return spans


@pytest.mark.parametrize("page", [f for f in toc_files() if not f.startswith("exercises/")])
def test_no_control_character_in_a_source(page):
    """No TAB or other control character in a page's source (the newline aside), and no
    math command that lost its backslash to a string escape."""
    source = (ROOT / f"{page}.md").read_text()
    math_lines = {line + k for line, span in _math_spans(source) for k in range(span.count("\n") + 1)}
    bad = [f"line {n}{' (in math)' if n in math_lines else ''}: {line!r}"
           for n, line in enumerate(source.splitlines(), start=1) if CONTROL.search(line)]
    bad += [f"line {n}: {span!r} has a command without its backslash"
            for n, span in _math_spans(source) if BROKEN_COMMAND.search(span)]
    assert not bad, "\n".join(bad)
