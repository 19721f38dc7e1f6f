"""The worked example of the chapter "The sequential bottleneck" and of its exercise
``rnn_forward`` (its tests: ``firstprinciples.exercises.rnn``).

"The cat sat": three tokens with 2-number embeddings, d_in = d_h = 2. W_xh and
W_hh are not symmetric, so a transposed weight gives different numbers.
"""
from __future__ import annotations

import torch

TOKENS = ("The", "cat", "sat")
EXAMPLE_X = ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0))
EXAMPLE_W_XH = ((0.5, -0.3), (0.2, 0.8))
EXAMPLE_W_HH = ((0.9, 0.4), (-0.2, 0.6))
EXAMPLE_B = (0.1, -0.1)


def worked_example(dtype=torch.float64):
    """(x, h0, W_xh, W_hh, b) of "The cat sat": x is (1, 3, 2), h0 is zeros (1, 2)."""
    x = torch.tensor((EXAMPLE_X,), dtype=dtype)
    h0 = torch.zeros(1, 2, dtype=dtype)
    return (
        x,
        h0,
        torch.tensor(EXAMPLE_W_XH, dtype=dtype),
        torch.tensor(EXAMPLE_W_HH, dtype=dtype),
        torch.tensor(EXAMPLE_B, dtype=dtype),
    )
