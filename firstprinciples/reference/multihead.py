"""Multi-head attention: split, attend per head, merge, project."""
from __future__ import annotations

from torch import nn

from ..guard import reference_piece
from .attention import scaled_dot_product_attention


@reference_piece("split_heads")
def split_heads(x, n_heads):
    """(B, T, d_model) -> (B, n_heads, T, d_model // n_heads)."""
    B, T, d_model = x.shape
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    return x.reshape(B, T, n_heads, d_model // n_heads).transpose(1, 2)  # (B, H, T, d_k)


@reference_piece("merge_heads")
def merge_heads(x):
    """(B, n_heads, T, d_k) -> (B, T, n_heads * d_k): the inverse of ``split_heads``."""
    B, H, T, d_k = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d_k)  # (B, T, d_model)


@reference_piece("MultiHeadAttention")
class MultiHeadAttention(nn.Module):
    """Self-attention with ``n_heads`` heads of width d_model // n_heads.

    ``W_q``, ``W_k``, ``W_v`` and ``W_o`` are bias-free (d_model, d_model)
    linear layers. ``forward(x, mask=None)`` takes x (B, T, d_model) and an
    additive mask broadcastable to (B, n_heads, T, T); it returns
    (output (B, T, d_model), weights (B, n_heads, T, T)).
    """

    def __init__(self, d_model, n_heads):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        Q = split_heads(self.W_q(x), self.n_heads)  # (B, H, T, d_k)
        K = split_heads(self.W_k(x), self.n_heads)
        V = split_heads(self.W_v(x), self.n_heads)
        out, weights = scaled_dot_product_attention(Q, K, V, mask)  # (B, H, T, d_k), (B, H, T, T)
        return self.W_o(merge_heads(out)), weights  # (B, T, d_model)
