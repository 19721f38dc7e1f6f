"""Figures for the chapters (matplotlib, computed at build time)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def attention_heatmap(weights, query_labels, key_labels, ax=None, title=None, fmt="{:.2f}"):
    """Draw a (T_q, T_k) attention matrix with its values written in the cells.

    Rows are queries (who is looking), columns are keys (who is looked at).
    """
    w = np.asarray(weights.detach() if hasattr(weights, "detach") else weights, dtype=float)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 0.9 * w.shape[1], 1.0 + 0.8 * w.shape[0]))
    # Weights are probabilities: a fixed 0..1 colour scale makes panels comparable.
    im = ax.imshow(w, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(key_labels)), key_labels)
    ax.set_yticks(range(len(query_labels)), query_labels)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            dark = w[i, j] > 0.6
            ax.text(j, i, fmt.format(w[i, j]), ha="center", va="center", color="white" if dark else "black")
    if title:
        ax.set_title(title)
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ax
