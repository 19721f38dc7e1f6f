"""The worked examples that appear in the chapters, the exercises and the grader.

"Cat sat mat" is the three-token example of the source material: d_k = 2, the
query of "Cat" against the keys and values of all three tokens. The expected
figures are the ones printed in the source, rounded to three decimals.
"""
from __future__ import annotations

import torch

TOKENS = ("Cat", "sat", "mat")

# One query (Cat's) against three keys and values: rows are tokens.
CAT_QUERY = ((1.0, 0.5),)
KEYS = ((1.0, 0.2), (0.5, 1.0), (0.2, 0.8))
VALUES = ((2.0, 0.0), (0.0, 2.0), (1.0, 1.0))

# Queries for "sat" and "mat" are not in the source; we chose them to draw a full
# 3 x 3 attention matrix in the chapter. Only Cat's row is the source's.
ALL_QUERIES = ((1.0, 0.5), (0.4, 1.0), (0.1, 0.9))

# The figures of the source, to three decimals (Cat's row).
RAW_SCORES = (1.10, 1.00, 0.60)
SCALED_SCORES = (0.778, 0.707, 0.424)
WEIGHTS = (0.380, 0.354, 0.266)
OUTPUT = (1.026, 0.974)


def cat_sat_mat(dtype=torch.float64, all_queries=False):
    """Return (Q, K, V) of the worked example as tensors of ``dtype``.

    Q is (1, 2) with Cat's query only, or (3, 2) with ``all_queries=True``.
    """
    Q = torch.tensor(ALL_QUERIES if all_queries else CAT_QUERY, dtype=dtype)
    K = torch.tensor(KEYS, dtype=dtype)
    V = torch.tensor(VALUES, dtype=dtype)
    return Q, K, V
