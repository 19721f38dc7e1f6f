"""ALiBi: a linear penalty on the distance between query and key, one slope per head."""
from __future__ import annotations

import torch

from ..guard import reference_piece


def slopes(n_heads):
    """``alibi_slopes`` itself in float64 (undecorated: the bias and the checks use it)."""
    h = torch.arange(n_heads, dtype=torch.float64)
    return torch.exp2(-8.0 * (h + 1) / n_heads)


@reference_piece("alibi_slopes")
def alibi_slopes(n_heads, dtype=torch.float64):
    """(n_heads,): m_h = 2^(-8 (h + 1) / n_heads) for h = 0 .. n_heads - 1, the steepest first."""
    return slopes(n_heads).to(dtype)


@reference_piece("alibi_bias")
def alibi_bias(n_heads, T, dtype=torch.float32):
    """The (n_heads, T, T) bias added to the attention scores: bias[h, i, j] = -m_h * (i - j)
    for j <= i, and 0 above the diagonal (the causal mask hides those keys)."""
    pos = torch.arange(T, dtype=torch.float64)
    distance = (pos[:, None] - pos[None, :]).clamp(min=0)  # (T, T): i - j, 0 above the diagonal
    bias = -slopes(n_heads)[:, None, None] * distance  # (n_heads, T, T)
    return bias.to(dtype) + 0.0  # + 0.0 turns the -0.0 of the zero distances into 0.0
