"""The induction score of attention weights on a sequence repeated twice."""
from __future__ import annotations

import torch

from ..guard import reference_piece


@reference_piece("induction_score")
def induction_score(weights, period):
    """Mean attention from each query of the second copy to the token after its first occurrence.

    weights: (..., T, T) attention weights (queries, keys) for ``period`` tokens repeated twice
    (T = 2 * period) -> (...): the mean of weights[..., i, i - period + 1] over i = period .. T - 1.
    """
    queries = torch.arange(period, weights.shape[-1], device=weights.device)  # (period,)
    return weights[..., queries, queries - period + 1].mean(-1)  # (...)
