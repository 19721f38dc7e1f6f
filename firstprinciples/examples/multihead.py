"""The worked example of the chapter "Multi-head attention" and of its exercise's
``split_heads`` (its tests: ``exercises.multi_head_attention``)."""
from __future__ import annotations

import torch


def split_example(dtype=torch.float64):
    """Two tokens of width d_model = 6, numbered 0..11, to be cut into 3 heads of width 2.

    Token 0 is [0, 1, 2, 3, 4, 5] and token 1 is [6, ..., 11], so head h should
    hold features 2h and 2h + 1 of both tokens: head 0 is [[0, 1], [6, 7]].
    """
    return torch.arange(12, dtype=dtype).reshape(1, 2, 6)  # (B=1, T=2, d_model=6)


EXAMPLE_HEADS = 3
