"""The worked example of the chapter "Queries, keys and values" and of its exercise
``project_qkv`` (its tests are declared in ``exercises.qkv``).

Three tokens with 3-number embeddings. The weights were chosen so that the
projections give exactly the queries, keys and values of the attention
chapter's "Cat sat mat" (``examples.ALL_QUERIES``, ``KEYS``, ``VALUES``):
d_model = 3, d_k = d_v = 2. No weight matrix is square, and each differs from
the others.
"""
from __future__ import annotations

import torch

EMBEDDINGS = ((1.0, 0.0, 0.0), (1.0, 1.0, 0.0), (0.0, 1.0, 1.0))
W_Q = ((1.0, 0.5), (-0.6, 0.5), (0.7, 0.4))
W_K = ((1.0, 0.2), (-0.5, 0.8), (0.7, 0.0))
W_V = ((2.0, 0.0), (-2.0, 2.0), (3.0, -1.0))


def worked_projection(dtype=torch.float64):
    """(x, W_q, W_k, W_v) of the worked example: x is (1, 3, 3), each W is (3, 2)."""
    x = torch.tensor((EMBEDDINGS,), dtype=dtype)
    return (x, *(torch.tensor(W, dtype=dtype) for W in (W_Q, W_K, W_V)))
