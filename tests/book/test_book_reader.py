"""The book as a reader sees it, in Chromium: every page whole (formulas typeset, images
loaded, no console error, nothing from another host), one story, the same numbers on every
page, blocks and figures that fit and stay readable at 1280 px and 390 px, folded
plotting code, math as written, one search box, and no accessibility violation
(axe-core) caused by the course's own pages or extensions.

One build serves every test in this file: a fresh Sphinx build into a temporary
folder with the execution cache shared with the README's build, as in
tests/book/test_book.py. The axe-core tests need axe-core from the npm registry
(``npm install --prefix .axe axe-core``, which .ci/run does; or set
FP_AXE_CORE to its ``axe.min.js``): skipped without it, failed under CI.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import docpages
from bookbuild import browser_on, built_book, settle, toc_files
from course import ROOT
from firstprinciples import examples

WIDTHS = (1280, 390)
MIN_FONT_PX = {390: 9.0, 1280: 12.0}  # smallest text of a figure, as shown on screen


CHAPTERS = [f for f in toc_files() if f.startswith("chapters/")]
PAGES = toc_files()


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    # FP_BOOK_HTML: an HTML folder built already (to try these tests on another build)
    prebuilt = os.environ.get("FP_BOOK_HTML")
    return Path(prebuilt) if prebuilt else built_book(tmp_path_factory)


@pytest.fixture(scope="module")
def browser(html):
    with browser_on(html) as b:
        yield b


def _open(browser, path, width=1280, seen=None):
    """Open a page at ``width``; with a dict ``seen``, its "errors" (console errors and
    uncaught exceptions) and "foreign" (requests to any other host) are collected into it."""
    b, base = browser
    page = b.new_page(viewport={"width": width, "height": 900})
    if seen is not None:
        seen.update(errors=[], foreign=[])
        page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: seen["errors"].append(str(e)))
        page.on("request", lambda r: seen["foreign"].append(r.url)
                if not r.url.startswith(base) and not r.url.startswith("data:") else None)
    page.goto(f"{base}/{path}", wait_until="load")
    settle(page)
    return page


BODY_JS = "() => document.querySelector('main').scrollWidth - document.querySelector('main').clientWidth"
MATH_JS = """() => document.querySelector('div.math, span.math') === null ? null
  : Array.from(document.querySelectorAll('mjx-assistive-mml')).map(n => n.textContent)"""
SHOWN_JS = """() => ({
  typeset: document.querySelectorAll('mjx-container').length,
  text: document.querySelector('main').innerText,
  images: Array.from(document.querySelectorAll('main img')).map(i => [i.src, i.complete && i.naturalWidth > 0]),
})"""
SCREENSHOTS = ROOT / "_build" / "screenshots"


@pytest.fixture(scope="module")
def views(browser):
    """What the reader's tests look at, one visit per page and width (a visit is most of their
    cost): at both widths, every chapter's and the introduction's blocks that overflow their
    box and its figures; at 1280 px, for every page of the book, its console errors, requests
    to other hosts, typeset formulas, text and images, its formulas as MathML text, and
    axe-core's violations (when axe-core is installed; its test says why not otherwise).
    At both widths, for every page, its blocks that wrap or scroll (READING_JS) and the
    width of the whole page.
    A full-page screenshot of every chapter at 1280 px goes to _build/screenshots/."""
    axe = _axe_file()
    out = {}
    for width in WIDTHS:
        for doc in PAGES:
            view: dict = {}
            page = _open(browser, f"{doc}.html", width, seen=view)
            try:
                view.update(page.evaluate(READING_JS))
                out[width, doc] = view
                if width != 1280 and doc not in CHAPTERS + ["intro"]:
                    continue  # (exercise pages at 390 px: how wide they are is all we look at)
                view.update(overflow=page.evaluate(OVERFLOW_JS), body=page.evaluate(BODY_JS))
                if doc in CHAPTERS:
                    view["figures"] = page.evaluate(FIGURES_JS)
                if width == 1280:
                    math = page.evaluate(MATH_JS)
                    view["has_math"], view["math"] = math is not None, math or []
                    view.update(page.evaluate(SHOWN_JS))
                    if axe:
                        if doc == "chapters/explorer":
                            page.wait_for_selector("[data-fp-explorer][data-ready='true']", timeout=20000)
                        page.add_script_tag(path=str(axe))
                        view["axe"] = page.evaluate(AXE_JS)
                    if doc.startswith("chapters/"):
                        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
                        page.screenshot(path=str(SCREENSHOTS / f"{Path(doc).name}.png"), full_page=True)
            finally:
                page.close()
            out[width, doc] = view
    return out


def _main_text(html, doc, outputs=True):
    """The text of ``doc``'s main column, spaces collapsed; without what its code cells printed
    (``outputs=False``: measured times among them, which any number can be)."""
    page = (html / f"{doc}.html").read_text()
    m = re.search(r"<main[^>]*>(.*)</main>", page, flags=re.S)
    main = m.group(1) if m else page
    if not outputs:
        from bs4 import BeautifulSoup

        soup = BeautifulSoup(main, "html.parser")
        for out in soup.select("div.cell_output"):
            out.decompose()
        main = str(soup)
    text = re.sub(r"<[^>]+>", " ", main)
    return re.sub(r"\s+", " ", text)


# ---------------------------------------------------------------- every page loads whole
@pytest.mark.parametrize("doc", PAGES)
def test_page_in_browser(views, doc):
    """Formulas typeset (no raw TeX left), every image loaded, no console error, and nothing
    requested from another host."""
    view = views[1280, doc]
    if view["has_math"]:
        assert view["typeset"] > 0, "MathJax rendered nothing"
    assert "$$" not in view["text"] and "\\frac" not in view["text"], "raw TeX left on the page"
    broken = [src for src, ok in view["images"] if not ok]
    assert not broken, f"images that did not load: {broken}"
    assert not view["errors"], f"console errors: {view['errors']}"
    assert not view["foreign"], f"requests to other hosts: {view['foreign']}"


# ---------------------------------------------------------------- one story
def test_back_references_point_at_text_that_exists(html):
    intro = (html / "intro.html").read_text()
    for anchor in ("opening-sentence", "what-attention-is-not"):
        assert f'id="{anchor}"' in intro, anchor
    assert "animal didn" in intro and "too tired" in intro  # the sentence the capstone recalls
    capstone = (html / "chapters" / "capstone.html").read_text()
    for anchor in ("opening-sentence", "what-attention-is-not"):
        assert f'intro.html#{anchor}"' in capstone, f"the capstone does not link to the introduction's {anchor}"
    attention = (html / "chapters" / "attention.html").read_text()
    assert 'queries_keys_values.html"' in attention  # chapter 4 points to where the queries come from
    assert "choose queries" not in _main_text(html, "chapters/attention")


@pytest.mark.parametrize("doc", [p for p in PAGES if not p.startswith("exercises/")])
def test_no_page_speaks_of_the_source(html, doc):
    text = _main_text(html, doc)
    for phrase in ("source material", "the source of this example", "the source gives", "not in the source",
                   "the source prints"):
        assert phrase not in text.lower(), f"{doc} speaks of {phrase!r}"


def test_worked_example_numbers_agree_across_pages(html, browser):
    """Cat's weights are quoted with one rounding (examples.WEIGHTS, computed) on
    every page that quotes them, never with the other one."""
    weights = [f"{w:.3f}" for w in examples.WEIGHTS]
    assert weights == ["0.380", "0.354", "0.267"]
    exact = [f"{w:.4f}" for w in examples.EXACT_WEIGHTS]
    quoted = {
        "chapters/attention": ", ".join(weights[:2]) + " and " + weights[2],  # glued from the computation
        "chapters/encoder_decoder": ", ".join(weights),
        "chapters/softmax": " ".join(weights),  # the printed output (spaces collapsed)
    }
    for doc, figure in quoted.items():
        # (a glued number is an inline element: the tags around it leave a space before a comma)
        assert figure in _main_text(html, doc).replace(" ,", ","), f"{doc} does not show Cat's weights as {figure}"
    for doc in [p for p in PAGES if not p.startswith("exercises/")]:
        text = _main_text(html, doc, outputs=False)  # (what the code prints is computed, not quoted)
        for other in ("0.266", "0.2667"):
            assert not re.search(rf"(?<![\d.]){re.escape(other)}(?!\d)", text), f"{doc} quotes Cat's weight as {other}"
    assert exact[2] in _main_text(html, "chapters/attention")  # the unrounded figure, stated once
    page = _open(browser, "chapters/explorer.html")
    try:
        page.wait_for_selector("[data-fp-cat-sat-mat][data-ready='true']", timeout=20000)
        shown = page.eval_on_selector_all("[data-fp-cat-sat-mat] .fp-num[data-step='weights']",
                                          "ns => ns.map(n => n.textContent)")
        assert shown == exact
        check = page.inner_text("[data-fp-cat-sat-mat] .fp-check[data-step='weights']")
        assert ", ".join(weights) in check, check
    finally:
        page.close()


def test_heads_are_numbered_from_zero_everywhere(html, browser):
    for doc in ("chapters/capstone", "chapters/multi_head_attention", "chapters/explorer"):
        text = _main_text(html, doc)
        assert not re.search(r"\bL\d H\d\b", text), f"{doc} names a head L.. H.."
    assert "head 1.2" in _main_text(html, "chapters/capstone")
    page = _open(browser, "chapters/explorer.html")
    try:
        page.wait_for_selector("[data-fp-explorer][data-ready='true']", timeout=20000)
        captions = page.eval_on_selector_all("[data-fp-explorer] table.fp-head caption strong",
                                             "ns => ns.map(n => n.textContent)")
        assert captions[:5] == ["head 0.0", "head 0.1", "head 0.2", "head 0.3", "head 1.0"], captions
        layers = page.eval_on_selector_all("[data-fp-explorer] .fp-layer-title", "ns => ns.map(n => n.textContent)")
        assert layers == ["Layer 0", "Layer 1"]
    finally:
        page.close()


def test_references_are_cited_from_the_chapters(html):
    refs = (html / "references.html").read_text()
    for title in ("Attention Is All You Need", "FlashAttention", "A Mathematical Framework for Transformer Circuits",
                  "RoFormer", "Train Short, Test Long", "The Illustrated Transformer",
                  "Neural Machine Translation by Jointly Learning to Align and Translate"):
        assert title in refs, title
    cited = set()
    for doc in CHAPTERS:
        cited |= set(re.findall(r'href="\.\./references\.html#(id\d+)"', (html / f"{doc}.html").read_text()))
    entries = set(re.findall(r'<div class="citation" id="(id\d+)"', refs))
    assert entries and cited, "no citation links from the chapters"
    uncited = entries - cited
    assert not uncited, f"entries cited from no chapter: {uncited}"


# ---------------------------------------------------------------- presentation
OVERFLOW_JS = """() => Array.from(document.querySelectorAll('main pre, main div.highlight, main .cell_output, main table'))
  .filter(e => e.scrollWidth > e.clientWidth + 1)
  .map(e => e.tagName + ': ' + e.textContent.trim().slice(0, 80))"""


@pytest.mark.parametrize("width", WIDTHS)
def test_no_block_wider_than_its_box(views, width):
    """Nothing is wider than its box, except blocks that scroll with a cue
    (test_long_blocks_scroll_with_a_cue): any of them at 390 px, and at 1280 px code only
    (test_code_lines_fit_at_1280 says how many)."""
    wide = {}
    for doc in CHAPTERS + ["intro"]:
        view = views[width, doc]
        allowed = {b["text"] for b in view["blocks"] if b["wide"] and b["cued"]
                   and (width != 1280 or b["kind"] == "code")}
        overflow = [o for o in view["overflow"] if o.split(": ", 1)[-1] not in allowed]
        if overflow or view["body"] > 1:
            wide[doc] = overflow or [f"main is {view['body']} px wider than the window"]
    assert not wide, f"blocks wider than their box at {width} px: {wide}"


# What a reader sees of every code, output, table and display-formula block: whether its
# lines wrap (more lines on screen than in its text), whether it is wider than its box, and
# whether it then scrolls with a cue (a scroll container whose background scrolls with its
# content: the shadows of book.css).
READING_JS = """() => {
  const shown = pre => {
    const range = document.createRange();
    range.selectNodeContents(pre);
    return new Set(Array.from(range.getClientRects()).filter(r => r.width > 0)
      .map(r => Math.round(r.top))).size;
  };
  const written = pre => pre.textContent.replace(/\\n$/, '').split('\\n').length;
  const cued = e => { const cs = getComputedStyle(e);
    return ['auto', 'scroll'].includes(cs.overflowX) && cs.backgroundAttachment.includes('local'); };
  const kind = e => e.tagName === 'MJX-CONTAINER' ? 'math' : e.closest('.cell_output') ? 'output'
    : e.closest('.cell_input, div.highlight') ? 'code' : e.tagName.toLowerCase();
  const blocks = [];
  for (const e of document.querySelectorAll(
      'main pre, main table, main mjx-container[display="true"]')) {
    const wide = e.scrollWidth > e.clientWidth + 1;
    const wrapped = e.tagName === 'PRE' && shown(e) > written(e);
    if (wide || wrapped)
      blocks.push({kind: kind(e), wide, wrapped, cued: cued(e), text: e.textContent.trim().slice(0, 80)});
  }
  return {blocks, page_width: document.documentElement.scrollWidth};
}"""


@pytest.mark.parametrize("width", WIDTHS)
def test_no_code_or_output_line_wraps(views, width):
    """A wrapped line of code reads as two lines, a wrapped table as twice as many rows
    (the capstone's 9-row head table once showed 18 lines)."""
    wrapped = {doc: [f"{b['kind']}: {b['text'][:50]}" for b in views[width, doc]["blocks"] if b["wrapped"]]
               for doc in PAGES if (width, doc) in views}
    wrapped = {doc: w for doc, w in wrapped.items() if w}
    assert not wrapped, f"lines that wrap at {width} px: {wrapped}"


def test_printed_output_fits_at_1280(views):
    """What the chapters print fits its box on a wide screen: a table is shown as a table
    (firstprinciples.plots.table), a long line is broken where it reads well (plots.wrap)."""
    wide = {doc: [b["text"][:60] for b in views[1280, doc]["blocks"] if b["wide"] and b["kind"] != "code"]
            for doc in CHAPTERS + ["intro"]}
    wide = {doc: w for doc, w in wide.items() if w}
    assert not wide, f"printed output wider than its box at 1280 px: {wide}"


def test_code_lines_fit_at_1280(views):
    wide = {doc: sum(b["wide"] and b["kind"] == "code" for b in views[1280, doc]["blocks"])
            for doc in CHAPTERS + ["intro"]}
    wide = {doc: n for doc, n in wide.items() if n}
    assert not wide, f"code cells with a line longer than their box at 1280 px: {wide}"


@pytest.mark.parametrize("width", WIDTHS)
def test_long_blocks_scroll_with_a_cue(views, width):
    """A block wider than its box (a display formula or a line of code on a phone) scrolls
    inside it, and shows that it does: never clipped without a sign (the headline formula
    once lost its final V at 390 px)."""
    hidden = {doc: [f"{b['kind']}: {b['text'][:50]}" for b in views[width, doc]["blocks"]
                    if b["wide"] and not b["cued"] and b["kind"] != "table"]
              for doc in PAGES if (width, doc) in views}
    hidden = {doc: h for doc, h in hidden.items() if h}
    assert not hidden, f"blocks clipped without a scroll cue at {width} px: {hidden}"


def test_no_page_scrolls_sideways_on_a_phone(views):
    """At 390 px no page, the exercise pages included, is wider than the screen."""
    wide = {doc: views[390, doc]["page_width"] for doc in PAGES if views[390, doc]["page_width"] > 390}
    assert not wide, f"pages wider than 390 px (their width): {wide}"


FIGURES_JS = """async () => {
  const out = [];
  for (const img of document.querySelectorAll('main .cell_output img')) {
    const svg = await (await fetch(img.src)).text();
    const box = svg.match(/viewBox="([^"]+)"/);
    const sizes = [...svg.matchAll(/font-size:\\s*([0-9.]+)px/g)].map(m => parseFloat(m[1]));
    const shown = img.getBoundingClientRect().width;
    const column = img.closest('.cell_output').getBoundingClientRect().width;
    // Raster panels in the figure (imshow's heatmaps): the widest spread of any colour
    // channel over their pixels, 0 for a panel of one colour.
    const panels = [];
    for (const m of svg.matchAll(/href="(data:image\/png;base64,[^"]+)"/g)) {
      const pic = new Image();
      pic.src = m[1];
      await pic.decode();
      const canvas = document.createElement('canvas');
      canvas.width = pic.naturalWidth; canvas.height = pic.naturalHeight;
      const ctx = canvas.getContext('2d');
      ctx.drawImage(pic, 0, 0);
      const data = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
      const lo = [255, 255, 255], hi = [0, 0, 0];
      for (let i = 0; i < data.length; i += 4)
        for (let c = 0; c < 3; c++) { lo[c] = Math.min(lo[c], data[i + c]); hi[c] = Math.max(hi[c], data[i + c]); }
      panels.push(Math.max(...hi.map((h, c) => h - lo[c])));
    }
    out.push({src: img.src.split('/').pop(), svg: img.src.endsWith('.svg'), shown, column, panels,
              natural: box ? parseFloat(box[1].split(/\\s+/)[2]) * 4 / 3 : null,
              units: box ? parseFloat(box[1].split(/\\s+/)[2]) : null, smallest: sizes.length ? Math.min(...sizes) : null});
  }
  return out;
}"""


@pytest.mark.parametrize("width", WIDTHS)
def test_figures_are_drawn_at_their_size_and_readable(views, width):
    """SVG figures (text kept as text), shown at their natural size when it fits
    (never enlarged), shrunk only to fit the column, and with no text smaller
    than 9 px on a phone (12 px on a wide screen)."""
    problems, count = [], 0
    for doc in CHAPTERS:
        for f in views[width, doc]["figures"]:
            count += 1
            where = f"{doc} {f['src'][:12]}"
            if not f["svg"] or f["units"] is None or f["smallest"] is None:
                problems.append(f"{where}: not an SVG with text kept as text")
                continue
            expected = min(f["natural"], f["column"])
            if abs(f["shown"] - expected) > 1.5:
                problems.append(f"{where}: shown {f['shown']:.0f} px, drawn for {f['natural']:.0f} px")
            smallest = f["smallest"] * f["shown"] / f["units"]
            if smallest < MIN_FONT_PX[width]:
                problems.append(f"{where}: smallest text {smallest:.1f} px")
    assert count >= len(CHAPTERS)
    assert not problems, f"at {width} px:\n" + "\n".join(problems)


def test_no_flat_figure_panel(views):
    """Every heatmap panel shows its values: a colour scale much wider than the values
    paints the panel in one colour (an ALiBi bias of -0.027..0 on a scale of -2..0 was an
    empty square). A panel whose colours spread over less than FLAT of 255 levels fails."""
    flat = [f"{doc} {f['src'][:12]}: panel {i} spans {spread} levels"
            for doc in CHAPTERS for f in views[1280, doc]["figures"]
            for i, spread in enumerate(f["panels"]) if spread < FLAT]
    assert sum(len(f["panels"]) for doc in CHAPTERS for f in views[1280, doc]["figures"]) >= 10
    assert not flat, "figure panels of one colour:\n" + "\n".join(flat)


FLAT = 40  # of 255 colour levels


def test_plotting_code_is_folded(html):
    """Every cell that draws a figure has its code folded (the hide-input tag)."""
    folded = 0
    for doc in CHAPTERS:
        page = (html / f"{doc}.html").read_text().split("</main>")[0]
        # The prose's own figures (the schematic diagrams, {figure} directives) are drawn by no cell.
        page = re.sub(r"<figure\b.*?</figure>", "", page, flags=re.S)
        for cell in re.split(r'(?=<div class="cell[ "])', page)[1:]:
            if "<img" in cell:
                assert "tag_hide-input" in cell[:200], f"{doc}: a figure's code is not folded: {cell[:200]}"
                assert "Show code cell source" in cell, f"{doc}: no button to unfold the code"
                folded += 1
    assert folded >= len(CHAPTERS)


def test_math_renders_as_written(views):
    """No TeX escape shows up in the rendered formulas (MathJax's MathML copy
    holds the characters a reader sees), e.g. a backslash from \\text{max\\_len}."""
    assert sum(views[1280, doc]["has_math"] for doc in CHAPTERS) >= len(CHAPTERS) // 2, "most chapters have formulas"
    for doc in CHAPTERS:
        view = views[1280, doc]
        if not view["has_math"]:
            continue
        assert view["math"], f"{doc}: no MathML copy of the formulas"
        bad = [t for t in view["math"] if "\\" in t]
        assert not bad, f"{doc}: formulas rendered with a backslash: {bad[:3]}"


def test_long_display_formulas_fit(browser):
    for doc in ("chapters/positional_encoding", "chapters/attention"):
        page = _open(browser, f"{doc}.html")
        try:
            page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=20000)
            page.evaluate("() => MathJax.startup.promise")
            wide = page.evaluate("""() => Array.from(document.querySelectorAll('main div.math'))
              .filter(d => d.scrollWidth > d.clientWidth + 1).map(d => d.textContent.slice(0, 60))""")
            assert not wide, f"{doc}: formulas cut off at 1280 px: {wide}"
        finally:
            page.close()


def test_one_search_box(browser):
    page = _open(browser, "chapters/attention.html")
    try:
        visible = page.evaluate("""() => Array.from(document.querySelectorAll(
            '.search-button-field, .search-button, form.bd-search, input[type=search]'))
          .filter(e => e.offsetParent !== null && !e.closest('.search-button__wrapper')).length""")
        assert visible == 1, f"{visible} search boxes on the page"
    finally:
        page.close()


def test_no_empty_table_header(html):
    for doc in PAGES:
        page = (html / f"{doc}.html").read_text()
        for thead in re.findall(r"<thead>(.*?)</thead>", page, flags=re.S):
            assert re.sub(r"<[^>]+>|\s", "", thead), f"{doc}: an empty table header"


def test_launch_buttons_point_at_no_placeholder(html):
    for doc in ("chapters/attention", "exercises/attention/scaled_dot_product_attention"):
        page = (html / f"{doc}.html").read_text()
        assert "example.org" not in page and "jupyterhub" not in page.lower(), doc


def _launch_links(page: str) -> list[str]:
    import re

    return re.findall(r'href="(https://(?:colab\.research\.google\.com|mybinder\.org)[^"]*)"', page)


def test_launch_buttons_open_notebooks(html):
    """Colab cannot open a chapter's Markdown source: a chapter's buttons open its exercise
    notebook, an exercise page's its own notebook, and a page without an exercise has none."""
    chapter = _launch_links((html / "chapters/attention.html").read_text())
    assert chapter and all("exercises/attention/scaled_dot_product_attention.ipynb" in u for u in chapter), chapter
    exercise = _launch_links((html / "exercises/softmax/softmax.html").read_text())
    assert exercise and all("exercises/softmax/softmax.ipynb" in u for u in exercise), exercise
    for page in html.glob("**/*.html"):
        links = _launch_links(page.read_text())
        assert not [u for u in links if ".md" in u.split("?")[0] or "urlpath" in u and ".md" in u], page
    assert not _launch_links((html / "chapters/explorer.html").read_text()), "the explorer has no exercise"


# ---------------------------------------------------------------- accessibility (axe-core)
def _axe_file():
    candidates = [os.environ.get("FP_AXE_CORE"), ROOT / ".axe" / "node_modules" / "axe-core" / "axe.min.js",
                  ROOT / "node_modules" / "axe-core" / "axe.min.js"]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


def _require_axe() -> None:
    """Skip the calling test without axe-core (fail it under CI)."""
    if _axe_file():
        return
    msg = "axe-core is not installed (npm install --prefix .axe axe-core; .ci/run does it)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def theme_violations_documented():
    """Rule ids the docs list as caused by the theme (the accessibility table of
    docs/contributors/book.md)."""
    return set(re.findall(r"^\| `([a-z0-9-]+)` \|", docpages.section("## Accessibility"), flags=re.M))


AXE_JS = """async () => {
  const r = await axe.run(document, { resultTypes: ['violations'] });
  return r.violations.map(v => ({ id: v.id, nodes: v.nodes.map(n => ({
    target: n.target.join(' '), html: n.html.slice(0, 160),
    inArticle: !!(document.querySelector(n.target.join(' ')) || document.body).closest('article.bd-article') })) }));
}"""


@pytest.mark.parametrize("doc", PAGES)
def test_no_accessibility_violation_from_the_course(views, doc):
    _require_axe()
    allowed = theme_violations_documented()
    violations = views[1280, doc]["axe"]
    ours = [(v["id"], n["target"], n["html"]) for v in violations for n in v["nodes"] if n["inArticle"]]
    assert not ours, f"{doc}: violations in the course's own content:\n" + "\n".join(map(str, ours))
    unlisted = {v["id"] for v in violations} - allowed
    assert not unlisted, f"{doc}: theme violations not listed in docs/contributors/book.md: {unlisted}"
