"""Draw the book's schematic diagrams as SVG files in this folder.

    python chapters/images/diagrams.py          # (re)write every diagram
    python chapters/images/diagrams.py --check  # exit 1 if a file differs from what this script draws

The diagrams are plain SVG written by hand-placed coordinates: no plotting library, nothing
fetched, text kept as ``<text>``. Each is drawn on a ``WIDTH``-unit-wide canvas and shown at
``DESKTOP`` times that size on a wide screen (the tallest at 1.0, so they fit a laptop screen); on a phone (a column of about 358 px) it shrinks to
about 0.81 of its units, so no text is smaller than ``MIN_FONT`` units (about 9.8 px there).
Every diagram carries its own white panel, so it reads the same on the book's light and dark
themes. The text widths are measured with the DejaVu Sans metrics that ship with matplotlib, and a
label that would run out of its box stops the script.
"""
from __future__ import annotations

import argparse
import re
import sys
from functools import lru_cache
from pathlib import Path
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
WIDTH = 440
DESKTOP = 1.1
MIN_FONT = 12
FONT = "DejaVu Sans, Verdana, Arial, sans-serif"

INK = "#1f2328"
MUTED = "#4b5563"
GRID = "#94a3b8"
# fill, stroke
NEUTRAL = ("#f1f5f9", "#475569")
QUERY = ("#dbeafe", "#1d4ed8")
KEY = ("#ffedd5", "#c2410c")
VALUE = ("#dcfce7", "#15803d")
SCORE = ("#ede9fe", "#6d28d9")
ALERT = "#be123c"
HEADS = [("#ede9fe", "#6d28d9"), ("#cffafe", "#0e7490"), ("#fce7f3", "#be185d")]


# ---------------------------------------------------------------- text metrics
@lru_cache(maxsize=None)
def _font(size: float, bold: bool):
    import matplotlib
    from PIL import ImageFont

    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name), round(size * 10))


def runs(s: str):
    """``"W_{q} e^{x}"`` -> [("W", 0), ("q", -1), (" e", 0), ("x", 1)]: ``_{...}`` is a subscript,
    ``^{...}`` a superscript."""
    out = []
    for part in re.split(r"([_^]\{[^}]*\})", s):
        if part[:2] in ("_{", "^{"):
            out.append((part[2:-1], -1 if part[0] == "_" else 1))
        elif part:
            out.append((part, 0))
    return out


def sub_size(size: float) -> float:
    return max(MIN_FONT, round(0.78 * size, 1))


def text_width(s: str, size: float = 15, bold: bool = False) -> float:
    return sum(_font(sub_size(size) if sub else size, bold).getlength(t) / 10 for t, sub in runs(s))


# ---------------------------------------------------------------- the canvas
class Svg:
    def __init__(self, name: str, title: str, scale: float = DESKTOP):
        self.name, self.title, self.scale = name, title, scale
        self.parts: list[str] = []
        self.bottom = 0.0  # the lowest point drawn so far: the canvas ends 18 units below it

    def reach(self, y):
        self.bottom = max(self.bottom, y)

    def add(self, s: str):
        self.parts.append(s)

    def rect(self, x, y, w, h, fill="none", stroke=INK, sw=1.5, rx=4, dash=None, opacity=None):
        self.reach(y + h)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        extra += f' fill-opacity="{opacity}"' if opacity is not None else ""
        self.add(f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" rx="{rx:g}" fill="{fill}" '
                 f'stroke="{stroke}" stroke-width="{sw:g}"{extra}/>')

    def text(self, x, y, s, size=15, anchor="middle", bold=False, fill=INK, box=None, rotate=None):
        """Text with its baseline at y. ``box=(x0, x1)``: the text must fit between x0 and x1."""
        assert size >= MIN_FONT, (self.name, s, size)
        width = text_width(s, size, bold)
        left = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
        if box is not None:
            assert box[0] - 0.5 <= left and left + width <= box[1] + 0.5, \
                f"{self.name}: {s!r} ({width:.0f} units) does not fit in {box}"
        if rotate is None:
            assert -0.5 <= left and left + width <= WIDTH + 0.5, f"{self.name}: {s!r} runs off the canvas"
            self.reach(y + 0.3 * size)
        weight = ' font-weight="bold"' if bold else ""
        weight += f' transform="rotate({rotate:g} {x:g} {y:g})"' if rotate is not None else ""
        body, shift = [], 0.0
        for t, sub in runs(s):
            want = {-1: round(0.28 * size, 2), 0: 0.0, 1: round(-0.4 * size, 2)}[sub]
            dy = f' dy="{want - shift:g}"' if want != shift else ""
            fs = f' font-size="{sub_size(size):g}"' if sub else ""
            body.append(f"<tspan{dy}{fs}>{escape(t)}</tspan>" if (dy or fs) else escape(t))
            shift = want
        self.add(f'<text x="{x:g}" y="{y:g}" font-size="{size:g}" text-anchor="{anchor}" fill="{fill}"{weight}>'
                 + "".join(body) + "</text>")
        return width

    def lines(self, x, y, rows, size=13, anchor="start", fill=MUTED, gap=1.3, bold=False, box=None):
        for i, row in enumerate(rows):
            self.text(x, y + i * size * gap, row, size=size, anchor=anchor, fill=fill, bold=bold, box=box)
        return y + (len(rows) - 1) * size * gap

    def line(self, points, stroke=INK, sw=1.5, dash=None, opacity=None):
        self.reach(max(y for _, y in points))
        d = " ".join(f"{x:g},{y:g}" for x, y in points)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        extra += f' stroke-opacity="{opacity}"' if opacity is not None else ""
        self.add(f'<polyline points="{d}" fill="none" stroke="{stroke}" stroke-width="{sw:g}" '
                 f'stroke-linejoin="round"{extra}/>')

    def arrow(self, points, stroke=INK, sw=1.6, head=8, dash=None, opacity=None):
        """A polyline ending in a filled arrowhead (drawn as a polygon, no markers)."""
        (x0, y0), (x1, y1) = points[-2], points[-1]
        length = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5
        ux, uy = (x1 - x0) / length, (y1 - y0) / length
        bx, by = x1 - ux * head, y1 - uy * head
        self.line([*points[:-1], (bx, by)], stroke, sw, dash, opacity)
        w = head * 0.45
        tip = [(x1, y1), (bx - uy * w, by + ux * w), (bx + uy * w, by - ux * w)]
        extra = f' fill-opacity="{opacity}"' if opacity is not None else ""
        self.add('<polygon points="' + " ".join(f"{x:g},{y:g}" for x, y in tip) + f'" fill="{stroke}"{extra}/>')

    def circle(self, x, y, r, fill="none", stroke=INK, sw=1.5):
        self.add(f'<circle cx="{x:g}" cy="{y:g}" r="{r:g}" fill="{fill}" stroke="{stroke}" stroke-width="{sw:g}"/>')

    def matrix(self, x, y, w, h, colours, rows=0, cols=0, name=None, size=15, dash=None):
        """A box with faint row (and column) rules and an optional name in the middle."""
        fill, stroke = colours
        self.rect(x, y, w, h, fill, stroke, dash=dash, rx=2)
        for i in range(1, rows):
            self.line([(x, y + i * h / rows), (x + w, y + i * h / rows)], stroke, 0.7, opacity=0.55)
        for j in range(1, cols):
            self.line([(x + j * w / cols, y), (x + j * w / cols, y + h)], stroke, 0.7, opacity=0.55)
        if name:
            self.text(x + w / 2, y + h / 2 + size * 0.36, name, size=size, bold=True, box=(x, x + w))

    def plus(self, x, y, r=9, stroke=INK):
        self.circle(x, y, r, "#ffffff", stroke, 1.5)
        self.line([(x - r + 3, y), (x + r - 3, y)], stroke, 1.8)
        self.line([(x, y - r + 3), (x, y + r - 3)], stroke, 1.8)

    def svg(self) -> str:
        h = round(self.bottom + 18)
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {h:g}" '
                f'width="{WIDTH * self.scale:g}" height="{h * self.scale:g}" role="img" '
                f'font-family="{FONT}">\n<title>{escape(self.title)}</title>\n'
                # The diagram's own opaque panel: the same picture on a light or a dark page.
                f'<rect x="0.5" y="0.5" width="{WIDTH - 1}" height="{h - 1:g}" rx="10" fill="#ffffff" '
                f'stroke="#d0d7de" stroke-width="1"/>\n')
        return head + "\n".join(self.parts) + "\n</svg>\n"


# ---------------------------------------------------------------- the diagrams
DIAGRAMS = {}


def diagram(fn):
    DIAGRAMS[fn.__name__] = fn
    return fn


@diagram
def rnn_vs_attention():
    s = Svg("rnn_vs_attention", "An RNN's chain of hidden states against attention's all-pairs connections")
    T = 5
    box, gap = 50, 22
    x0 = (WIDTH - (T + 1) * box - T * gap) / 2
    xs = [x0 + i * (box + gap) for i in range(T + 1)]  # h_0 .. h_5
    s.text(20, 30, "RNN: one state, rewritten at every step", size=15, anchor="start", bold=True)
    y_h, y_x = 66, 140
    for i, x in enumerate(xs):
        s.text(x + box / 2, y_h - 8, f"step {i}" if i else "", size=12, fill=MUTED) if i else None
        s.rect(x, y_h, box, 40, *(NEUTRAL if i == 0 else ("#fff1f2", ALERT)), rx=6)
        s.text(x + box / 2, y_h + 26, f"h_{{{i}}}", size=15, box=(x, x + box))
        if i:
            s.arrow([(xs[i - 1] + box, y_h + 20), (x, y_h + 20)], ALERT if i > 1 else INK, 2.2 if i > 1 else 1.6)
            s.rect(x + 5, y_x, box - 10, 32, *NEUTRAL, rx=6)
            s.text(x + box / 2, y_x + 22, f"x_{{{i}}}", size=15)
            s.arrow([(x + box / 2, y_x), (x + box / 2, y_h + 40)], ALERT if i == 1 else INK,
                    2.2 if i == 1 else 1.6)
    s.lines(20, 202, ["Token 1 reaches h_{5} only through h_{1}, h_{2}, h_{3}, h_{4}:",
                      "a path of T steps, and step t cannot start before",
                      "step t − 1 has finished."], size=13, box=(20, 425))

    top = 262
    s.line([(20, top), (WIDTH - 20, top)], "#d0d7de", 1)
    s.text(20, top + 30, "Attention: every token reads every token", size=15, anchor="start", bold=True)
    y_out, y_in = top + 56, top + 156
    cx = [xs[i] + box / 2 for i in range(1, T + 1)]
    for j in range(T):
        for i in range(T):
            if i != 0:
                s.line([(cx[i], y_in), (cx[j], y_out + 32)], GRID, 1.1)
    for j in range(T):
        s.arrow([(cx[0], y_in), (cx[j], y_out + 32)], ALERT, 2.2)
    for i in range(T):
        s.rect(cx[i] - 25, y_out, 50, 32, "#fff1f2", ALERT, rx=6)
        s.text(cx[i], y_out + 22, f"out_{{{i + 1}}}", size=14, box=(cx[i] - 25, cx[i] + 25))
        s.rect(cx[i] - 20, y_in, 40, 32, *NEUTRAL, rx=6)
        s.text(cx[i], y_in + 22, f"x_{{{i + 1}}}", size=15)
    s.lines(20, y_in + 60, ["Token 1 reaches every output in one step, and all",
                            "outputs are computed at once."], size=13, box=(20, 425))
    return s


@diagram
def qkv_projections():
    s = Svg("qkv_projections", "One input X projected by W_q, W_k and W_v into Q, K and V, with their shapes")
    # X: (T, d_model), one row per token
    xw, xh = 150, 72
    x0, y0 = (WIDTH - xw) / 2, 30
    s.matrix(x0, y0, xw, xh, NEUTRAL, rows=3, name=None)
    for i, token in enumerate(("Cat", "sat", "mat")):
        s.text(x0 - 8, y0 + (i + 0.5) * xh / 3 + 5, token, size=13, anchor="end", fill=MUTED)
    s.text(x0 + xw / 2, y0 + xh / 2 + 6, "X", size=17, bold=True)
    s.text(x0 + xw + 10, y0 + xh / 2 + 5, "(T, d_{model})", size=14, anchor="start")
    s.text(x0 + xw / 2, y0 - 10, "one row per token", size=12, fill=MUTED)
    cols = [(WIDTH / 6 + i * WIDTH / 3) for i in range(3)]
    specs = [("W_{q}", "Q", QUERY, "d_{k}"), ("W_{k}", "K", KEY, "d_{k}"), ("W_{v}", "V", VALUE, "d_{v}")]
    y_w, ww, wh = 150, 46, 90
    y_r, rh = 292, xh
    for c, (wname, rname, col, width) in zip(cols, specs):
        s.arrow([(WIDTH / 2, y0 + xh), (c, y_w - 16)], INK, 1.5)
        s.text(c - ww / 2 - 8, y_w + wh / 2 + 6, "×", size=18, anchor="end")
        s.matrix(c - ww / 2, y_w, ww, wh, (col[0], col[1]), name=wname, size=15)
        s.text(c, y_w + wh + 18, f"(d_{{model}}, {width})", size=13, box=(c - 72, c + 72))
        s.arrow([(c, y_w + wh + 26), (c, y_r - 4)], col[1], 1.8)
        s.matrix(c - ww / 2, y_r, ww, rh, col, rows=3, name=rname, size=17)
        s.text(c, y_r + rh + 18, f"(T, {width})", size=13)
    s.lines(WIDTH / 2, y_r + rh + 48, ["The same three matrices serve every token: three matrix",
                                       "products over all positions at once. With a batch of B",
                                       "sequences, X is (B, T, d_{model}) and Q is (B, T, d_{k})."],
            size=13, anchor="middle", box=(10, WIDTH - 10))
    return s

def _grid(s, x, y, n_rows, n_cols, cell, colours, shade=None, text=None, size=12):
    """An n_rows x n_cols grid of cells; ``shade(i, j)`` in 0..1 darkens a cell, ``text(i, j)`` labels it."""
    fill, stroke = colours
    s.rect(x, y, n_cols * cell, n_rows * cell, fill, stroke, rx=2)
    for i in range(n_rows):
        for j in range(n_cols):
            if shade is not None and shade(i, j) > 0:
                s.add(f'<rect x="{x + j * cell:g}" y="{y + i * cell:g}" width="{cell:g}" height="{cell:g}" '
                      f'fill="{stroke}" fill-opacity="{0.12 + 0.7 * shade(i, j):.2f}"/>')
            if text is not None and text(i, j):
                label, colour = text(i, j)
                s.text(x + (j + 0.5) * cell, y + (i + 0.5) * cell + size * 0.36, label, size=size, fill=colour)
    for i in range(1, n_rows):
        s.line([(x, y + i * cell), (x + n_cols * cell, y + i * cell)], stroke, 0.7, opacity=0.55)
    for j in range(1, n_cols):
        s.line([(x + j * cell, y), (x + j * cell, y + n_rows * cell)], stroke, 0.7, opacity=0.55)
    s.rect(x, y, n_cols * cell, n_rows * cell, "none", stroke, rx=2)


@diagram
def attention_shapes():
    s = Svg("attention_shapes", "Scaled dot-product attention step by step, with the shape of every tensor",
            scale=1.0)
    c, n = 24, 3  # cell size; T_q = T_k = 3 drawn
    g = n * c
    narrow = 40  # d_k or d_v drawn as a narrow band
    ops = dict(size=20, fill=INK)

    def step(y, title):
        s.text(16, y, title, size=14, anchor="start", bold=True, box=(16, WIDTH - 10))

    def shape(x, y, label, name=None):
        if name:
            s.text(x, y, name, size=13, fill=INK, box=(x - 70, x + 70))
            y += 17
        s.text(x, y, label, size=13, fill=MUTED, box=(x - 70, x + 70))

    weights = [[1, 0, 0], [0.55, 0.45, 0], [0.3, 0.45, 0.25]]
    # 1. scores
    y = 28
    step(y, "1. Score every query against every key")
    top = y + 18
    qx, kx, sx = 40 + (g - narrow) / 2, 170, 300
    s.matrix(qx, top, narrow, g, QUERY, rows=n, name="Q")
    s.text(kx - 29, top + g / 2 + 7, "×", **ops)
    s.matrix(kx, top + (g - narrow) / 2, g, narrow, KEY, cols=n, name="Kᵀ")
    s.text(kx + g + 29, top + g / 2 + 7, "=", **ops)
    _grid(s, sx, top, n, n, c, SCORE)
    shape(qx + narrow / 2, top + g + 20, "(T_{q}, d_{k})", "Q")
    shape(kx + g / 2, top + g + 20, "(d_{k}, T_{k})", "K transposed")
    shape(sx + g / 2, top + g + 20, "(T_{q}, T_{k})", "QKᵀ")
    # 2. scale and mask
    y = top + g + 70
    step(y, "2. Divide by √d_{k}, add the mask (if any)")
    top = y + 18
    ax, mx, rx = 40, 170, 300
    _grid(s, ax, top, n, n, c, SCORE)
    s.text(ax + g + 29, top + g / 2 + 7, "+", **ops)
    _grid(s, mx, top, n, n, c, NEUTRAL,
          text=lambda i, j: ("−∞", ALERT) if j > i else ("0", MUTED))
    s.text(mx + g + 29, top + g / 2 + 7, "=", **ops)
    _grid(s, rx, top, n, n, c, SCORE, text=lambda i, j: ("−∞", ALERT) if j > i else None)
    shape(ax + g / 2, top + g + 20, "(T_{q}, T_{k})", "QKᵀ / √d_{k}")
    shape(mx + g / 2, top + g + 20, "(T_{q}, T_{k})", "causal mask")
    shape(rx + g / 2, top + g + 20, "(T_{q}, T_{k})", "scores")
    # 3. softmax
    y = top + g + 70
    step(y, "3. Softmax along each row: weights that sum to 1")
    top = y + 18
    _grid(s, ax, top, n, n, c, SCORE, text=lambda i, j: ("−∞", ALERT) if j > i else None)
    s.arrow([(ax + g + 14, top + g / 2), (rx - 14, top + g / 2)], INK, 1.6)
    s.text((ax + g + rx) / 2, top + g / 2 - 8, "softmax over keys", size=13, box=(ax + g + 4, rx - 4))
    s.text((ax + g + rx) / 2, top + g / 2 + 20, "e^{−∞} = 0", size=13, fill=MUTED, box=(ax + g + 4, rx - 4))
    _grid(s, rx, top, n, n, c, SCORE, shade=lambda i, j: weights[i][j])
    for i in range(n):
        s.text(rx + g + 8, top + (i + 0.5) * c + 5, "Σ = 1", size=12, anchor="start", fill=MUTED)
    shape(ax + g / 2, top + g + 20, "(T_{q}, T_{k})", "scores")
    shape(rx + g / 2, top + g + 20, "(T_{q}, T_{k})", "weights")
    # 4. mix the values
    y = top + g + 70
    step(y, "4. Mix the values: weights × V")
    top = y + 18
    wx, vx, ox = 40, 170, 300
    _grid(s, wx, top, n, n, c, SCORE, shade=lambda i, j: weights[i][j])
    s.text(wx + g + 29, top + g / 2 + 7, "×", **ops)
    s.matrix(vx + (g - narrow) / 2, top, narrow, g, VALUE, rows=n, name="V")
    s.text(vx + g + 29, top + g / 2 + 7, "=", **ops)
    s.matrix(ox + (g - narrow) / 2, top, narrow, g, VALUE, rows=n)
    shape(wx + g / 2, top + g + 20, "(T_{q}, T_{k})", "weights")
    shape(vx + g / 2, top + g + 20, "(T_{k}, d_{v})", "V")
    shape(ox + g / 2, top + g + 20, "(T_{q}, d_{v})", "output")
    s.lines(16, top + g + 78, ["Each output row is a weighted average of the rows of V.",
                               "With a batch and heads, every tensor gains leading",
                               "axes (B, H, …); the products act on the last two."],
            size=13, box=(16, WIDTH - 10))
    return s


@diagram
def multi_head():
    s = Svg("multi_head", "Multi-head attention: d_model cut into H heads of d_k, attention per head, "
            "heads concatenated and mixed by W_O", scale=1.0)
    H = 3
    bw = 126  # a (T, d_model) box
    bh = 48
    slice_w = bw / H
    # x
    xx, y = (WIDTH - bw) / 2, 24
    s.matrix(xx, y, bw, bh, NEUTRAL, rows=3, name="x")
    s.text(xx + bw + 10, y + bh / 2 + 5, "(T, d_{model})", size=13, anchor="start")
    # the projections
    y2 = y + bh + 58
    xs = [14 + i * (bw + 19) for i in range(3)]
    for xq, (name, w) in zip(xs, (("Q", "W_{Q}"), ("K", "W_{K}"), ("V", "W_{V}"))):
        s.arrow([(WIDTH / 2, y + bh), (xq + bw / 2, y2 - 22)], INK, 1.4)
        s.text(xq + bw / 2, y2 - 8, f"{name} = x {w}", size=13, box=(xq, xq + bw))
        for h in range(H):
            s.rect(xq + h * slice_w, y2, slice_w, bh, *HEADS[h], rx=0, sw=1)
            s.text(xq + (h + 0.5) * slice_w, y2 + bh / 2 + 5, str(h), size=13, fill=HEADS[h][1])
        s.rect(xq, y2, bw, bh, "none", INK, sw=1.4, rx=2)
    s.text(WIDTH / 2, y2 + bh + 18, "each (T, d_{model}); W_{Q}, W_{K}, W_{V}: (d_{model}, d_{model})",
           size=12, fill=MUTED)
    # split into heads
    y3 = y2 + bh + 90
    s.text(WIDTH / 2, y3 - 44, "split: head h takes its own d_{k} = d_{model} / H columns",
           size=13, box=(8, WIDTH - 8))
    s.text(WIDTH / 2, y3 - 27, "(B, T, d_{model}) → (B, T, H, d_{k}) → (B, H, T, d_{k})", size=12, fill=MUTED)
    hw, hh = 118, 92
    hx = [(WIDTH - 3 * hw) / 4 + i * (hw + (WIDTH - 3 * hw) / 4) for i in range(H)]
    for h in range(H):
        fill, stroke = HEADS[h]
        s.arrow([(hx[h] + hw / 2, y3 - 16), (hx[h] + hw / 2, y3 - 3)], stroke, 1.8, head=7)
        s.rect(hx[h], y3, hw, hh, fill, stroke, sw=1.8, rx=8)
        s.text(hx[h] + hw / 2, y3 + 22, f"head {h}", size=14, bold=True, fill=stroke)
        s.text(hx[h] + hw / 2, y3 + 42, "attention on", size=12)
        s.text(hx[h] + hw / 2, y3 + 61, f"Q_{{{h}}}, K_{{{h}}}, V_{{{h}}}", size=13, box=(hx[h], hx[h] + hw))
        s.text(hx[h] + hw / 2, y3 + 81, "→ (T, d_{k})", size=12, fill=MUTED, box=(hx[h], hx[h] + hw))
    # concatenate
    y4 = y3 + hh + 48
    cx = (WIDTH - bw) / 2
    for h in range(H):
        s.arrow([(hx[h] + hw / 2, y3 + hh), (cx + (h + 0.5) * slice_w, y4 - 4)],
                HEADS[h][1], 1.8)
        s.rect(cx + h * slice_w, y4, slice_w, bh, *HEADS[h], rx=0, sw=1)
        s.text(cx + (h + 0.5) * slice_w, y4 + bh / 2 + 5, str(h), size=13, fill=HEADS[h][1], bold=True)
    s.rect(cx, y4, bw, bh, "none", INK, sw=1.4, rx=2)
    s.text(cx - 10, y4 + bh / 2 - 3, "concatenate", size=13, anchor="end")
    s.text(cx - 10, y4 + bh / 2 + 14, "(merge heads)", size=12, anchor="end", fill=MUTED)
    s.text(cx + bw + 10, y4 + bh / 2 + 5, "(T, d_{model})", size=13, anchor="start")
    # W_O
    y5 = y4 + bh + 50
    s.arrow([(WIDTH / 2, y4 + bh), (WIDTH / 2, y5 - 4)], INK, 1.6)
    s.text(WIDTH / 2 + 10, y4 + bh + 30, "× W_{O}  (d_{model}, d_{model})", size=13, anchor="start")
    s.matrix(cx, y5, bw, bh, NEUTRAL, rows=3, name="output")
    s.text(cx + bw + 10, y5 + bh / 2 + 5, "(T, d_{model})", size=13, anchor="start")
    s.lines(WIDTH / 2, y5 + bh + 26, ["W_{O} lets every output feature draw on every head."],
            size=13, anchor="middle", box=(8, WIDTH - 8))
    return s

LAYERNORM = ("#fef9c3", "#a16207")
FFN = ("#e0f2fe", "#0369a1")


@diagram
def transformer_block():
    s = Svg("transformer_block", "The pre-LN transformer block: LayerNorm, multi-head attention, dropout and a "
            "residual addition, then LayerNorm, feed-forward network, dropout and a second residual addition",
            scale=1.0)
    sx = 74  # the residual stream
    bx0, bx1 = 150, 424  # the sub-layers' column
    bc = (bx0 + bx1) / 2
    s.rect(16, 18, WIDTH - 32, 40, *NEUTRAL, rx=8)
    s.text(WIDTH / 2, 44, "input x   (B, T, d_{model})", size=15, bold=False)

    def sublayer(y, norm, body, body_colours, note):
        """One residual branch from y: returns the y of its ⊕."""
        s.line([(sx, y), (bc, y), (bc, y + 12)], INK, 1.6)
        s.arrow([(bc, y + 12), (bc, y + 22)], INK, 1.6, head=7)
        s.rect(bx0, y + 22, bx1 - bx0, 32, *LAYERNORM, rx=6)
        s.text(bc, y + 44, norm, size=14, box=(bx0, bx1))
        s.arrow([(bc, y + 54), (bc, y + 74)], INK, 1.6, head=7)
        s.rect(bx0, y + 74, bx1 - bx0, 58, *body_colours, rx=6)
        s.text(bc, y + 97, body[0], size=14, bold=True, box=(bx0, bx1))
        s.text(bc, y + 118, body[1], size=12, fill=MUTED, box=(bx0, bx1))
        s.arrow([(bc, y + 132), (bc, y + 152)], INK, 1.6, head=7)
        s.rect(bx0, y + 152, bx1 - bx0, 28, "#ffffff", "#6b7280", rx=6, dash="4 3")
        s.text(bc, y + 171, "Dropout", size=13, box=(bx0, bx1))
        yp = y + 208
        s.line([(bc, y + 180), (bc, yp)], INK, 1.6)
        s.arrow([(bc, yp), (sx + 11, yp)], INK, 1.6, head=7)
        s.plus(sx, yp, r=11)
        s.text(sx + 18, yp - 6, note, size=12, anchor="start", fill=MUTED, box=(sx, bc - 6))
        return yp

    y1 = 86
    p1 = sublayer(y1, "LayerNorm LN_{1}", ("multi-head attention", "→ a, and weights w: (B, H, T, T)"),
                  SCORE, "x + Dropout(a)")
    y2 = p1 + 34
    p2 = sublayer(y2, "LayerNorm LN_{2}", ("feed-forward network", "d_{model} → 4 d_{model} → GELU → d_{model}"),
                  FFN, "x + Dropout(FFN(…))")
    yo = p2 + 40
    # the residual stream itself: straight down, through both additions
    s.arrow([(sx, 58), (sx, p1 - 11)], INK, 3)
    s.arrow([(sx, p1 + 11), (sx, p2 - 11)], INK, 3)
    s.arrow([(sx, p2 + 11), (sx, yo)], INK, 3)
    s.text(sx - 12, (58 + p1) / 2 + 40, "residual stream", size=13, fill=MUTED, rotate=-90)
    s.text(sx - 12, (p1 + p2) / 2 + 40, "residual stream", size=13, fill=MUTED, rotate=-90)
    s.rect(16, yo, WIDTH - 32, 40, *NEUTRAL, rx=8)
    s.text(WIDTH / 2, yo + 26, "output x   (B, T, d_{model}), and w", size=15)
    s.lines(16, yo + 66, ["Pre-LN: each sub-layer reads a normalised copy of the stream",
                          "and adds its result back; the stream itself is never",
                          "normalised (a stack ends with one more LayerNorm)."],
            size=13, box=(16, WIDTH - 10))
    return s


@diagram
def kv_cache():
    s = Svg("kv_cache", "One decoding step with a KV cache: only the new token's q, k and v are computed; "
            "the K and V caches each gain one row", scale=1.0)
    cell, c0 = 38, 214
    labels = ["0", "1", "…", "t−1", "t"]
    y_k, y_w, y_v, h = 78, 136, 204, 30
    s.text(16, 26, "Step t: the newest token, and what is kept", size=15, anchor="start", bold=True)
    # the new token and its three projections
    s.rect(16, y_k, 44, y_v + h - y_k, *NEUTRAL, rx=6)
    s.text(38, (y_k + y_v + h) / 2 + 6, "x_{t}", size=16, bold=True)
    for y, name, w, col in ((y_k, "k_{t}", "W_{K}", KEY), (y_w, "q_{t}", "W_{Q}", QUERY), (y_v, "v_{t}", "W_{V}", VALUE)):
        s.arrow([(60, y + h / 2), (118, y + h / 2)], INK, 1.5, head=7)
        s.text(89, y + h / 2 - 6, w, size=13)
        s.rect(120, y, 46, h, col[1], col[1], rx=4)
        s.text(143, y + h / 2 + 6, name, size=15, fill="#ffffff", bold=True)
    # the caches and the weights, one column per position
    for j, lab in enumerate(labels):
        x = c0 + j * cell
        new = j == len(labels) - 1
        for y, letter, col in ((y_k, "k", KEY), (y_v, "v", VALUE)):
            if new:
                s.rect(x, y, cell, h, col[1], col[1], rx=0)
            else:
                s.rect(x, y, cell, h, col[0], col[1], rx=0, sw=1)
            text = "…" if lab == "…" else f"{letter}_{{{lab}}}"
            s.text(x + cell / 2, y + h / 2 + 5, text, size=14, fill="#ffffff" if new else INK, bold=new)
        s.rect(x, y_w, cell, h, SCORE[1], SCORE[1], rx=0, sw=1, opacity=[0.25, 0.5, 0.3, 0.6, 0.45][j])
    s.rect(c0, y_w, 5 * cell, h, "none", SCORE[1], rx=0)
    s.text(c0 + 2.5 * cell, y_w + h + 17, "weights (1, t + 1)", size=13, fill=SCORE[1], box=(c0, c0 + 5 * cell))
    s.arrow([(166, y_w + h / 2), (c0 - 2, y_w + h / 2)], QUERY[1], 1.8, head=7)
    s.text((166 + c0) / 2, y_w - 5, "· Kᵀ", size=12, fill=QUERY[1])
    xn = c0 + 4.5 * cell
    # append arcs: k_t above the K cache, v_t below the V cache
    s.arrow([(143, y_k), (143, y_k - 22), (xn, y_k - 22), (xn, y_k - 2)], KEY[1], 1.8, head=7)
    s.text((143 + xn) / 2, y_k - 28, "append k_{t} to the K cache", size=12, fill=KEY[1])
    s.arrow([(143, y_v + h), (143, y_v + h + 22), (xn, y_v + h + 22), (xn, y_v + h + 2)], VALUE[1], 1.8, head=7)
    s.text((143 + xn) / 2, y_v + h + 40, "append v_{t} to the V cache", size=12, fill=VALUE[1])
    s.text(c0 - 6, y_k + h / 2 + 5, "K", size=14, anchor="end", bold=True, fill=KEY[1])
    s.text(c0 - 6, y_v + h / 2 + 5, "V", size=14, anchor="end", bold=True, fill=VALUE[1])
    y = y_v + h + 70
    s.lines(16, y, ["weights = softmax(q_{t} Kᵀ / √d_{k}): one row, no mask needed;",
                    "out_{t} = weights · V, one row (1, d_{v})."], size=13, fill=INK, box=(16, WIDTH - 10))
    s.lines(16, y + 44, ["Bright: computed at this step, one row through each of W_{Q},",
                         "W_{K}, W_{V}. Pale: read from the cache. q_{t} is used once and",
                         "never stored."], size=13, box=(16, WIDTH - 10))
    # the caches over the steps
    y0 = y + 106
    s.line([(16, y0), (WIDTH - 16, y0)], "#d0d7de", 1)
    s.text(16, y0 + 28, "The K cache, step by step (prompt: 2 tokens)", size=14, anchor="start", bold=True)
    c1, cw = 132, 32
    for r, (name, n, fresh) in enumerate((("prefill", 2, 2), ("step t = 2", 3, 1), ("step t = 3", 4, 1),
                                          ("step t = 4", 5, 1))):
        yy = y0 + 46 + r * 40
        s.text(16, yy + 20, name, size=13, anchor="start", box=(16, c1 - 6))
        for j in range(n):
            new = j >= n - fresh
            s.rect(c1 + j * cw, yy, cw, 28, KEY[1] if new else KEY[0], KEY[1], rx=0, sw=1)
            s.text(c1 + (j + 0.5) * cw, yy + 19, f"k_{{{j}}}", size=13, fill="#ffffff" if new else INK, bold=new)
        s.text(WIDTH - 16, yy + 19, f"(B, H, {n}, d_{{k}})", size=13, anchor="end", fill=MUTED)
    return s


@diagram
def cross_attention():
    s = Svg("cross_attention", "Encoder-decoder cross-attention: queries from the decoder's sequence, keys and "
            "values from the encoder's output", scale=1.0)
    L0, L1, R0, R1 = 12, 214, 236, 428
    lc, rc = (L0 + L1) / 2, (R0 + R1) / 2
    s.text(lc, 28, "encoder (source)", size=14, bold=True, fill=KEY[1])
    s.text(rc, 28, "decoder (target so far)", size=14, bold=True, fill=QUERY[1])
    source = ["the", "cat", "sat", "on", "the", "mat"]
    target = ["le", "chat", "était"]
    cw = (L1 - L0 - 5 * 3) / 6
    for i, w in enumerate(source):
        x = L0 + i * (cw + 3)
        s.rect(x, 42, cw, 28, "#ffffff", KEY[1], rx=5, sw=1.2)
        s.text(x + cw / 2, 61, w, size=13, box=(x, x + cw))
    tw = (R1 - R0 - 2 * 6) / 3
    for i, w in enumerate(target):
        x = R0 + i * (tw + 6)
        s.rect(x, 42, tw, 28, "#ffffff", QUERY[1], rx=5, sw=1.2)
        s.text(x + tw / 2, 61, w, size=13, box=(x, x + tw))
    for c, x0, x1, mask in ((lc, L0, L1, "self-attention, no mask"), (rc, R0, R1, "self-attention, causal")):
        s.arrow([(c, 70), (c, 88)], INK, 1.5, head=7)
        s.rect(x0, 90, x1 - x0, 34, *NEUTRAL, rx=6)
        s.text(c, 112, mask, size=13, box=(x0, x1))
        s.arrow([(c, 124), (c, 142)], INK, 1.5, head=7)
    s.matrix(L0 + 40, 144, L1 - L0 - 80, 48, KEY, rows=6)
    s.text(lc, 174, "C", size=16, bold=True)
    s.text(lc, 210, "context (T_{k}, d_{model})", size=13, box=(L0, L1))
    s.matrix(R0 + 40, 152, R1 - R0 - 80, 32, QUERY, rows=3)
    s.text(rc, 174, "X", size=16, bold=True)
    s.text(rc, 210, "(T_{q}, d_{model})", size=13, box=(R0, R1))
    # the projections: keys and values from C, queries from X
    y, bw = 244, 34
    kx, vx, qx = lc - 50, lc + 50, rc
    for x, name, label, shape, col, rows in ((kx, "K", "K = C W_{K}", "(T_{k}, d_{k})", KEY, 6),
                                            (vx, "V", "V = C W_{V}", "(T_{k}, d_{v})", VALUE, 6),
                                            (qx, "Q", "Q = X W_{Q}", "(T_{q}, d_{k})", QUERY, 3)):
        top = y if rows == 6 else y + 15
        s.arrow([(lc if x != qx else rc, 218), (x, top - 3)], col[1], 1.6, head=7)
        s.matrix(x - bw / 2, top, bw, 10 * rows, col, rows=rows, name=name, size=14)
        s.text(x, y + 82, label, size=13, bold=True, fill=col[1])
        s.text(x, y + 98, shape, size=12, fill=MUTED)
    # the cross-attention itself
    top = y + 126
    for x, col in ((kx, KEY), (vx, VALUE), (qx, QUERY)):
        s.arrow([(x, y + 104), (x, top - 2)], col[1], 1.6, head=7)
    s.rect(12, top, WIDTH - 24, 212, "#faf5ff", SCORE[1], rx=10, sw=1.4)
    s.text(WIDTH / 2, top + 24, "weights = softmax(Q Kᵀ / √d_{k})", size=14, bold=True, fill=SCORE[1])
    gx, gy, cell = 150, top + 56, 30
    for j, w in enumerate(source):
        s.text(gx + (j + 0.5) * cell, gy - 8, w, size=12, fill=KEY[1])
    _grid(s, gx, gy, 3, 6, cell, SCORE, shade=lambda i, j: 0.75 if j == i else 0.05)
    for i, w in enumerate(target):
        s.text(gx - 8, gy + (i + 0.5) * cell + 5, w, size=12, anchor="end", fill=QUERY[1])
    s.text(gx + 3 * cell, gy + 3 * cell + 20, "(T_{q}, T_{k}), not square, no mask", size=12, fill=MUTED)
    s.text(WIDTH / 2, top + 196, "output = weights · V   (T_{q}, d_{v})", size=14, bold=True)
    s.lines(16, top + 240, ["One row per target token, one column per source token: each",
                            "target token reads the whole source, which is known in full."],
            size=13, box=(16, WIDTH - 10))
    return s


@diagram
def tiled_attention():
    s = Svg("tiled_attention", "Tiled attention: a block of queries sweeps over blocks of keys with a running "
            "maximum and sum; the full score matrix is never formed", scale=1.0)
    nb, tile = 4, 44
    gx, gy = 92, 92
    g = nb * tile
    qi, kj = 1, 2  # the query block and the key block being worked on
    s.text(16, 26, "The score matrix, one tile at a time", size=15, anchor="start", bold=True)
    # K^T blocks above, Q blocks on the left
    for j in range(nb):
        s.rect(gx + j * tile + 2, gy - 36, tile - 4, 26, KEY[1] if j == kj else KEY[0], KEY[1], rx=3, sw=1)
        s.text(gx + (j + 0.5) * tile, gy - 18, f"K_{{{j}}}", size=13, fill="#ffffff" if j == kj else INK, bold=j == kj)
    for i in range(nb):
        s.rect(gx - 54, gy + i * tile + 2, 44, tile - 4, QUERY[1] if i == qi else QUERY[0], QUERY[1], rx=3, sw=1)
        s.text(gx - 32, gy + (i + 0.5) * tile + 5, f"Q_{{{i}}}", size=13, fill="#ffffff" if i == qi else INK,
               bold=i == qi)
    # the never-formed matrix: a dashed outline
    s.rect(gx, gy, g, g, "#ffffff", GRID, rx=0, sw=1.2, dash="5 4")
    for k in range(1, nb):
        s.line([(gx + k * tile, gy), (gx + k * tile, gy + g)], GRID, 0.8, dash="3 4")
        s.line([(gx, gy + k * tile), (gx + g, gy + k * tile)], GRID, 0.8, dash="3 4")
    for j in range(nb):
        x, y = gx + j * tile, gy + qi * tile
        if j < kj:
            s.rect(x + 1, y + 1, tile - 2, tile - 2, SCORE[0], SCORE[1], rx=0, sw=1, dash="3 2")
            s.text(x + tile / 2, y + tile / 2 + 5, "done", size=12, fill=MUTED)
        elif j == kj:
            s.rect(x, y, tile, tile, SCORE[1], SCORE[1], rx=0, sw=2)
            s.text(x + tile / 2, y + tile / 2 + 5, "S_{12}", size=13, fill="#ffffff", bold=True)
    s.arrow([(gx + 6, gy + qi * tile + tile + 14), (gx + g - 6, gy + qi * tile + tile + 14)], SCORE[1], 2)
    s.text(gx + g / 2, gy + qi * tile + tile + 32, "sweep over the key blocks", size=12, fill=SCORE[1])
    # V blocks under the matrix, aligned with their key blocks
    vy = gy + g + 16
    for j in range(nb):
        s.rect(gx + j * tile + 2, vy, tile - 4, 26, VALUE[1] if j == kj else VALUE[0], VALUE[1], rx=3, sw=1)
        s.text(gx + (j + 0.5) * tile, vy + 18, f"V_{{{j}}}", size=13, fill="#ffffff" if j == kj else INK,
               bold=j == kj)
    # notes on the right
    nx = gx + g + 14
    s.lines(nx, gy + 8, ["dashed: the", "T_{q} × T_{k} scores,", "never stored", "whole"], size=12, box=(nx, WIDTH - 6))
    s.lines(nx, gy + qi * tile + 70, ["now: one tile", "S_{12} = Q_{1} K_{2}ᵀ/√d_{k}", "(b_{q}, b), used",
                                      "then dropped"], size=12, fill=SCORE[1], box=(nx, WIDTH - 6))
    # the running state of query block 1
    y = vy + 62
    s.rect(16, y, WIDTH - 32, 150, "#faf5ff", SCORE[1], rx=10, sw=1.4)
    s.text(28, y + 24, "Running state of query block Q_{1}", size=14, anchor="start", bold=True, fill=SCORE[1])
    rows = [("m", "running max of each row", "(b_{q}, 1)"),
            ("ℓ", "running sum of e^{s − m}", "(b_{q}, 1)"),
            ("acc", "running sum of e^{s − m} v", "(b_{q}, d_{v})")]
    for r, (name, what, shape) in enumerate(rows):
        yy = y + 50 + r * 22
        s.text(40, yy, name, size=14, anchor="middle", bold=True)
        s.text(64, yy, what, size=13, anchor="start")
        s.text(WIDTH - 28, yy, shape, size=13, anchor="end", fill=MUTED)
    s.lines(28, y + 118, ["a larger max m′ rescales ℓ and acc by e^{m − m′}",
                          "after the last key block: output = acc / ℓ"], size=13, fill=INK, box=(28, WIDTH - 20))
    s.lines(16, y + 178, ["This chapter's code takes all T_{q} queries as one block and",
                          "splits only the keys (b per block); FlashAttention splits both."],
            size=13, box=(16, WIDTH - 10))
    return s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    parser.add_argument("names", nargs="*", help="only these diagrams")
    args = parser.parse_args(argv)
    stale = []
    for name, fn in DIAGRAMS.items():
        if args.names and name not in args.names:
            continue
        path = HERE / f"{name}.svg"
        text = fn().svg()
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print("differ from what diagrams.py draws (run python chapters/images/diagrams.py):", *stale)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
