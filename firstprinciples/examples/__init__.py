"""The worked examples that appear in the chapters, the exercises and the grader.

One place for each: the chapters, the checks and the re-check's probes import
them from here (a chapter never imports a checker). This module holds the
attention chapter's example; the other chapters' are in the modules of this
package named after their exercise's checks (``examples.rnn``, ``examples.qkv``,
``examples.multihead``, ``examples.sampling``, ``examples.alibi``,
``examples.modern_block``).

"Cat sat mat": three tokens, d_k = 2, the query of "Cat" against the keys and
values of all three tokens. The queries, keys and values are the projections
worked out in the chapter "Queries, keys and values" (``examples.qkv``).

The figures the book quotes (``RAW_SCORES``, ``SCALED_SCORES``, ``WEIGHTS``,
``OUTPUT``) are not typed in: they are computed below from the example's
vectors, exactly, and each is rounded once, at the end (two decimals for the
raw scores, three for the rest). The book states this rounding once, in the
attention chapter; Cat's weights are 0.380, 0.354 and 0.267 (0.2666 before
rounding).
"""
from __future__ import annotations

import math

import torch

TOKENS = ("Cat", "sat", "mat")

# One query (Cat's) against three keys and values: rows are tokens.
CAT_QUERY = ((1.0, 0.5),)
KEYS = ((1.0, 0.2), (0.5, 1.0), (0.2, 0.8))
VALUES = ((2.0, 0.0), (0.0, 2.0), (1.0, 1.0))

# The queries of all three tokens, as projected in the chapter "Queries, keys and values".
ALL_QUERIES = ((1.0, 0.5), (0.4, 1.0), (0.1, 0.9))


def _exact_figures():
    """Cat's raw and scaled scores, weights and output, in exact (float64) arithmetic."""
    q = CAT_QUERY[0]
    raw = [sum(a * b for a, b in zip(q, k)) for k in KEYS]
    scaled = [s / math.sqrt(len(q)) for s in raw]
    top = max(scaled)
    exps = [math.exp(s - top) for s in scaled]
    weights = [e / sum(exps) for e in exps]
    output = [sum(w * v[c] for w, v in zip(weights, VALUES)) for c in range(len(VALUES[0]))]
    return raw, scaled, weights, output


EXACT_RAW_SCORES, EXACT_SCALED_SCORES, EXACT_WEIGHTS, EXACT_OUTPUT = (tuple(x) for x in _exact_figures())

# The figures the book quotes: each exact value rounded once.
RAW_SCORES = tuple(round(x, 2) for x in EXACT_RAW_SCORES)  # (1.1, 1.0, 0.6)
SCALED_SCORES = tuple(round(x, 3) for x in EXACT_SCALED_SCORES)  # (0.778, 0.707, 0.424)
WEIGHTS = tuple(round(x, 3) for x in EXACT_WEIGHTS)  # (0.38, 0.354, 0.267)
OUTPUT = tuple(round(x, 3) for x in EXACT_OUTPUT)  # (1.026, 0.974)


def cat_sat_mat(dtype=torch.float64, all_queries=False):
    """Return (Q, K, V) of the worked example as tensors of ``dtype``.

    Q is (1, 2) with Cat's query only, or (3, 2) with ``all_queries=True``.
    """
    Q = torch.tensor(ALL_QUERIES if all_queries else CAT_QUERY, dtype=dtype)
    K = torch.tensor(KEYS, dtype=dtype)
    V = torch.tensor(VALUES, dtype=dtype)
    return Q, K, V
