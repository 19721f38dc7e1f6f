"""The worked example of the cross-attention exercise (its tests: ``firstprinciples.exercises.encoder_decoder``).

"Cat sat mat" of the attention chapter as the context that x reads: each context row is a
token's key followed by its value, ``[k | v]`` (width 4); W_k picks the key half and W_v the
value half. x holds two queries, Cat's [1.0, 0.5] and mat's [0.1, 0.9]; W_q is the identity.
So the first query's weights and output are the attention chapter's (``examples.WEIGHTS``,
``examples.OUTPUT``: 0.380, 0.354, 0.267 and 1.026, 0.974).
"""
from __future__ import annotations

import torch

from . import ALL_QUERIES, KEYS, VALUES

# The queries of x: Cat's and mat's (the first and the last of the chapter's three).
X_QUERIES = (ALL_QUERIES[0], ALL_QUERIES[2])


def worked_example(dtype=torch.float64):
    """(x, context, W_q, W_k, W_v): x (1, 2, 2), context (1, 3, 4), W_q (2, 2), W_k and W_v (4, 2)."""
    keys = torch.tensor(KEYS, dtype=dtype)
    values = torch.tensor(VALUES, dtype=dtype)
    context = torch.cat([keys, values], dim=-1)[None]  # (1, 3, 4): [k | v] per token
    x = torch.tensor(X_QUERIES, dtype=dtype)[None]  # (1, 2, 2)
    eye, zero = torch.eye(2, dtype=dtype), torch.zeros(2, 2, dtype=dtype)
    W_q = eye.clone()
    W_k = torch.cat([eye, zero])  # (4, 2): the key half of each context row
    W_v = torch.cat([zero, eye])  # (4, 2): the value half
    return x, context, W_q, W_k, W_v
