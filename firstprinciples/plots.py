"""Figures for the chapters (matplotlib, computed at build time).

Every chapter calls :func:`book_style` once before drawing. Figures are then
SVG (vector, sharp at any size) with their text kept as text, at most
:data:`MAX_WIDTH` inches wide and with no text smaller than :data:`MIN_FONT`
points: shown on a phone (a column of about 360 px) such a figure is scaled
down to about 0.62 of its size, and its smallest text still measures about
9 px on screen; on a wide screen it is shown at its natural size, never
enlarged. ``tests/book/test_book_reader.py`` measures both in Chromium.
"""
from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np

MAX_WIDTH = 6.0  # inches; a figure drawn wider would be shrunk below readable on a phone
MIN_FONT = 11  # points
# Characters in a line of code or printed output that fit its box at 1280 px (measured in
# Chromium: 77.4 for code, 77.8 for output); longer lines scroll sideways.
TEXT_WIDTH = 77


def book_style():
    """Vector figures with readable text: call once per chapter, before the first figure."""
    try:  # inside a Jupyter kernel: ask the inline backend for SVG only
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("svg")
    except ImportError:  # pragma: no cover - not in a notebook
        pass
    mpl.rcParams.update({
        "svg.fonttype": "none",  # text stays text: searchable, sharp, and measurable by the tests
        "figure.figsize": (MAX_WIDTH, 3.8),
        "font.size": MIN_FONT,
        "axes.titlesize": MIN_FONT + 1,
        "axes.labelsize": MIN_FONT,
        "xtick.labelsize": MIN_FONT,
        "ytick.labelsize": MIN_FONT,
        "legend.fontsize": MIN_FONT,
        "figure.titlesize": MIN_FONT + 1,
    })


def attention_heatmap(weights, query_labels, key_labels, ax=None, title=None, fmt="{:.2f}", colorbar=True,
                      fontsize=None, annotate=True):
    """Draw a (T_q, T_k) attention matrix, with its values written in the cells unless
    ``annotate=False`` (for small panels, where numbers would be too small to read).

    Rows are queries (who is looking), columns are keys (who is looked at).
    """
    w = np.asarray(weights.detach() if hasattr(weights, "detach") else weights, dtype=float)
    if ax is None:
        width = min(MAX_WIDTH, 1.6 + 0.75 * w.shape[1])
        _, ax = plt.subplots(figsize=(width, 1.2 + 0.6 * w.shape[0]))
    # Weights are probabilities: a fixed 0..1 colour scale makes panels comparable.
    im = ax.imshow(w, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(key_labels)), key_labels)
    ax.set_yticks(range(len(query_labels)), query_labels)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    for i in range(w.shape[0] if annotate else 0):
        for j in range(w.shape[1]):
            dark = w[i, j] > 0.6
            ax.text(j, i, fmt.format(w[i, j]), ha="center", va="center", color="white" if dark else "black",
                    fontsize=fontsize or MIN_FONT)
    if title:
        ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ax


class Table:
    """Rows shown as an HTML table in the book (a printed table wraps on a narrow
    column and splits its numbers); plain text in a terminal. Made by :func:`table`."""

    def __init__(self, header, rows, caption=None, fmt="{:.3f}"):
        cell = lambda v: fmt.format(v) if isinstance(v, float) else str(v)  # noqa: E731
        self.header = [str(h) for h in header]
        self.rows = [[cell(v) for v in row] for row in rows]
        self.caption = caption
        # A column whose cells all read as numbers is aligned right.
        self.numeric = [all(_is_number(row[j]) for row in self.rows) for j in range(len(self.header))]

    def _repr_html_(self):
        from html import escape

        def tag(name, text, j):
            align = ' class="fp-num"' if self.numeric[j] else ""
            scope = ' scope="col"' if name == "th" else ""
            return f"<{name}{scope}{align}>{escape(text)}</{name}>"

        caption = f"<caption>{escape(self.caption)}</caption>" if self.caption else ""
        head = "".join(tag("th", h, j) for j, h in enumerate(self.header))
        body = "".join("<tr>" + "".join(tag("td", v, j) for j, v in enumerate(row)) + "</tr>" for row in self.rows)
        return f'<table class="fp-table">{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    def __repr__(self):
        widths = [max(len(r[j]) for r in [self.header, *self.rows]) for j in range(len(self.header))]
        lines = [self.caption] if self.caption else []
        for row in [self.header, *self.rows]:
            lines.append("  ".join(v.rjust(w) if num else v.ljust(w)
                                   for v, w, num in zip(row, widths, self.numeric)).rstrip())
        return "\n".join(lines)


def wrap(text, indent=4):
    """``text`` broken into lines that fit an output box (:data:`TEXT_WIDTH`), the lines
    after the first indented by ``indent`` spaces: for printing a long list or sentence."""
    import textwrap

    return textwrap.fill(text, TEXT_WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False)


def _is_number(text):
    try:
        float(text.replace(",", "").rstrip("%"))
    except ValueError:
        return False
    return True


def table(header, rows, caption=None, fmt="{:.3f}"):
    """Show ``rows`` (lists of values, floats written with ``fmt``) under ``header`` as a
    table: the last expression of a cell, or ``display(table(...))``."""
    return Table(header, rows, caption=caption, fmt=fmt)


def readable_log_axes(fig):
    """Label the log-scale axes of ``fig`` with plain numbers ("0.001", "1e-06").

    Matplotlib's default log labels are powers of ten whose exponents are set
    in a smaller font, too small to read on a phone; minor ticks stay unlabelled.
    """
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                axis.set_major_formatter(plain)
                axis.set_minor_formatter(NullFormatter())
