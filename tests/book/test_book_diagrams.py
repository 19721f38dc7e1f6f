"""The schematic diagrams (chapters/images/*.svg, drawn by chapters/images/diagrams.py): each is a
self-contained SVG with text kept as text, each of the eight chapters that teach their idea
shows one with alt text and a caption, and in Chromium every diagram fits its column, keeps its
smallest text at 9 px or more on a phone, and stays readable in the theme's dark mode.

The built book is tests/bookbuild.py's (one build per session, warnings as errors).
"""
from __future__ import annotations

import io
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from bookbuild import browser_on, built_book, settle
from course import ROOT

IMAGES = ROOT / "chapters" / "images"
SVG_NS = "{http://www.w3.org/2000/svg}"
XLINK_HREF = "{http://www.w3.org/1999/xlink}href"
MIN_TEXT_PX = 9.0  # the smallest text of a diagram, as shown on a 390 px phone
MIN_CONTRAST = 7.0  # the diagram's ink against its own panel, as shown in dark mode (WCAG AAA is 7)

# chapter -> the diagram that draws its idea
DIAGRAMS = {
    "chapters/rnn_bottleneck": "rnn_vs_attention",
    "chapters/queries_keys_values": "qkv_projections",
    "chapters/attention": "attention_shapes",
    "chapters/multi_head_attention": "multi_head",
    "chapters/transformer_block": "transformer_block",
    "chapters/kv_cache": "kv_cache",
    "chapters/encoder_decoder": "cross_attention",
    "chapters/tiled_attention": "tiled_attention",
}
SVGS = sorted(IMAGES.glob("*.svg"))


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    return built_book(tmp_path_factory)


@pytest.fixture(scope="module")
def browser(html):
    with browser_on(html) as b:
        yield b


# ---------------------------------------------------------------- the files
@pytest.mark.parametrize("path", SVGS, ids=[p.name for p in SVGS])
def test_svg_is_well_formed_and_self_contained(path):
    """Parses as XML, has a viewBox, and refers to nothing outside itself: no link, image, font
    or stylesheet from anywhere (only ``#id`` references within the file)."""
    text = path.read_text(encoding="utf-8")
    root = ET.fromstring(text)  # raises on malformed XML
    assert root.tag == f"{SVG_NS}svg", f"{path.name}: the root is {root.tag}"
    box = root.get("viewBox", "").split()
    assert len(box) == 4 and float(box[2]) > 0 and float(box[3]) > 0, f"{path.name}: no usable viewBox"
    for el in root.iter():
        for attr in ("href", XLINK_HREF, "src"):
            ref = el.get(attr)
            assert ref is None or ref.startswith("#"), f"{path.name}: <{el.tag}> refers to {ref}"
        assert el.tag not in (f"{SVG_NS}image", f"{SVG_NS}foreignObject", f"{SVG_NS}script"), \
            f"{path.name}: has a <{el.tag.split('}')[1]}>"
        style = (el.get("style") or "") + (el.text or "" if el.tag == f"{SVG_NS}style" else "")
        assert "@import" not in style and "@font-face" not in style, f"{path.name}: fetches a font or stylesheet"
        for value in el.attrib.values():
            if "url(" in value:
                assert value.replace(" ", "").startswith("url(#"), f"{path.name}: {value}"
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text, \
        f"{path.name}: names an address"


@pytest.mark.parametrize("name", sorted(DIAGRAMS.values()))
def test_diagram_has_text_and_its_own_light_panel(name):
    """Text is kept as text, and the first thing drawn is an opaque light panel over the whole
    canvas, so the diagram looks the same on a light or a dark page."""
    root = ET.fromstring((IMAGES / f"{name}.svg").read_text(encoding="utf-8"))
    assert len(list(root.iter(f"{SVG_NS}text"))) >= 5, f"{name}: its text is not kept as <text>"
    shapes = [el for el in root if el.tag != f"{SVG_NS}title"]
    panel = shapes[0]
    _, _, width, height = (float(v) for v in root.get("viewBox").split())
    assert panel.tag == f"{SVG_NS}rect", f"{name}: the first shape is not a background panel"
    assert float(panel.get("width")) >= width - 1 and float(panel.get("height")) >= height - 1, \
        f"{name}: the panel does not cover the canvas"
    assert panel.get("fill-opacity") in (None, "1") and panel.get("opacity") in (None, "1")
    fill = panel.get("fill", "")
    assert fill.startswith("#") and len(fill) == 7, f"{name}: panel fill {fill!r}"
    assert _luminance(tuple(int(fill[i:i + 2], 16) for i in (1, 3, 5))) > 0.9, f"{name}: the panel is not light"


def test_diagrams_are_what_the_script_draws():
    """The committed files are the script's output: nobody edited one by hand, and a change to
    the script was followed by running it."""
    proc = subprocess.run([sys.executable, str(IMAGES / "diagrams.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- the pages
@pytest.mark.parametrize("doc", list(DIAGRAMS))
def test_chapter_shows_its_diagram_with_alt_text_and_caption(html, doc):
    from bs4 import BeautifulSoup

    soup = BeautifulSoup((html / f"{doc}.html").read_text(encoding="utf-8"), "html.parser")
    main = soup.find("main") or soup
    wanted = f"{DIAGRAMS[doc]}.svg"
    figures = [f for f in main.find_all("figure") if f.find("img", src=lambda s: s and s.endswith(wanted))]
    assert figures, f"{doc} does not show {wanted} in a figure"
    for figure in figures:
        alt = (figure.find("img").get("alt") or "").strip()
        assert len(alt) >= 300, f"{doc}: the alt text of {wanted} does not describe it ({len(alt)} characters)"
        caption = figure.find("figcaption")
        assert caption is not None and len(caption.get_text(strip=True)) > 20, f"{doc}: {wanted} has no caption"


def _open(browser, doc, width, mode="light"):
    b, base = browser
    page = b.new_page(viewport={"width": width, "height": 900})
    # The theme reads the reader's choice from localStorage before it paints.
    page.add_init_script(f"localStorage.setItem('theme', '{mode}'); localStorage.setItem('mode', '{mode}');")
    page.goto(f"{base}/{doc}.html", wait_until="load")
    settle(page)
    page.wait_for_function("() => Array.from(document.querySelectorAll('main figure img')).every(i => i.complete)")
    assert page.evaluate("document.documentElement.dataset.theme") == mode
    return page


# For every diagram on the page: its shown box, its column's, and the smallest font size of its
# text as shown (the SVG is parsed, laid out at the shown width in a hidden copy, and each text's
# computed size scaled by shown width / viewBox width).
MEASURE_JS = """async () => {
  const out = [];
  for (const img of document.querySelectorAll('main figure img')) {
    if (!/\\/_?images\\/[^/]+\\.svg$/.test(img.src)) continue;
    const source = await (await fetch(img.src)).text();
    const svg = new DOMParser().parseFromString(source, 'image/svg+xml').documentElement;
    const shown = img.getBoundingClientRect();
    const column = img.closest('figure').parentElement.getBoundingClientRect();
    const box = svg.getAttribute('viewBox').split(/[\\s,]+/).map(Number);
    const holder = document.createElement('div');
    holder.style.cssText = `position:absolute;left:-10000px;top:0;width:${shown.width}px`;
    svg.setAttribute('width', shown.width);
    svg.removeAttribute('height');
    holder.appendChild(document.importNode(svg, true));
    document.body.appendChild(holder);
    const scale = shown.width / box[2];
    const sizes = Array.from(holder.querySelectorAll('text, tspan'))
      .filter(t => t.textContent.trim())
      .map(t => parseFloat(getComputedStyle(t).fontSize) * scale);
    holder.remove();
    out.push({src: img.src.split('/').pop(), left: shown.left, right: shown.right, width: shown.width,
              colLeft: column.left, colRight: column.right, natural: img.naturalWidth,
              texts: sizes.length, smallest: Math.min(...sizes)});
  }
  return out;
}"""
OVERFLOW_JS = "() => document.querySelector('main').scrollWidth - document.querySelector('main').clientWidth"


@pytest.mark.parametrize("width", (390, 1280))
def test_diagrams_fit_and_their_text_is_readable(browser, width):
    """At 390 px every diagram fits its column (no sideways scrolling) with no text under 9 px;
    at 1280 px it is shown whole, at its natural size or smaller."""
    problems, seen = [], 0
    for doc, name in DIAGRAMS.items():
        page = _open(browser, doc, width)
        try:
            shown = page.evaluate(MEASURE_JS)
            overflow = page.evaluate(OVERFLOW_JS)
        finally:
            page.close()
        ours = [d for d in shown if d["src"] == f"{name}.svg"]
        if not ours:
            problems.append(f"{doc}: {name}.svg not shown")
        for d in shown:
            seen += 1
            where = f"{doc} {d['src']} at {width} px"
            if d["left"] < d["colLeft"] - 0.5 or d["right"] > d["colRight"] + 0.5:
                problems.append(f"{where}: {d['width']:.0f} px wide, outside its column "
                                f"({d['colLeft']:.0f}..{d['colRight']:.0f})")
            if d["width"] > d["natural"] + 0.5:
                problems.append(f"{where}: enlarged past its natural {d['natural']} px")
            if d["texts"] < 5 or d["smallest"] < MIN_TEXT_PX:
                problems.append(f"{where}: smallest text {d['smallest']:.1f} px ({d['texts']} texts)")
        if overflow > 1:
            problems.append(f"{doc} at {width} px: the page scrolls sideways by {overflow} px")
    assert seen >= len(DIAGRAMS)
    assert not problems, "\n".join(problems)


def _luminance(rgb) -> float:
    """WCAG relative luminance of an sRGB colour (0..255 channels)."""
    def channel(c):
        c = c / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(a, b) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("width", (390, 1280))
def test_diagrams_are_readable_in_dark_mode(browser, width):
    """Measured on screen, in the theme's dark mode: the diagram's background (its most common
    colour) is light, and its darkest ink (the text) stands out from it by 7:1 or more."""
    from PIL import Image

    problems = []
    for doc, name in DIAGRAMS.items():
        page = _open(browser, doc, width, mode="dark")
        try:
            img = page.locator(f"main figure img[src$='{name}.svg']").first
            img.scroll_into_view_if_needed()
            shot = Image.open(io.BytesIO(img.screenshot())).convert("RGB")
            page_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
        finally:
            page.close()
        colours = shot.getcolors(maxcolors=1 << 20)
        background = max(colours)[1]
        # the ink: the darkest colour that covers a visible share of the picture (text, not a stray pixel)
        total = shot.width * shot.height
        inks = [c for n, c in colours if n >= total * 0.0005]
        ink = min(inks, key=_luminance)
        where = f"{doc} {name}.svg at {width} px (page background {page_bg})"
        if _luminance(background) < 0.4:
            problems.append(f"{where}: dark background {background}")
        if _contrast(background, ink) < MIN_CONTRAST:
            problems.append(f"{where}: ink {ink} on {background}, contrast {_contrast(background, ink):.1f}")
    assert not problems, "\n".join(problems)
