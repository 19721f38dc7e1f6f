"""Figures for the chapters (matplotlib, computed at build time).

Every chapter calls :func:`book_style` once before drawing. Figures are then
SVG (vector, sharp at any size) with their text kept as text, at most
:data:`MAX_WIDTH` inches wide and with no text smaller than :data:`MIN_FONT`
points: shown on a phone (a column of about 360 px) such a figure is scaled
down to about 0.62 of its size, and its smallest text still measures about
9 px on screen; on a wide screen it is shown at its natural size, never
enlarged. ``tests/test_book_reader.py`` measures both in Chromium.
"""
from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np

MAX_WIDTH = 6.0  # inches; a figure drawn wider would be shrunk below readable on a phone
MIN_FONT = 11  # points


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
                      fontsize=None):
    """Draw a (T_q, T_k) attention matrix with its values written in the cells.

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
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            dark = w[i, j] > 0.6
            ax.text(j, i, fmt.format(w[i, j]), ha="center", va="center", color="white" if dark else "black",
                    fontsize=fontsize or MIN_FONT)
    if title:
        ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ax


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
