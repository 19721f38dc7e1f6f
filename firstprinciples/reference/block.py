"""The pre-LN transformer block: attention and a feed-forward network, each
in a residual branch behind a layer norm."""
from __future__ import annotations

from torch import nn

from ..guard import reference_piece
from .multihead import MultiHeadAttention


@reference_piece("FeedForward")
class FeedForward(nn.Module):
    """Position-wise network: Linear(d_model, 4 d_model), GELU, Linear(4 d_model, d_model)."""

    def __init__(self, d_model):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        return self.net(x)  # (B, T, d_model)


@reference_piece("TransformerBlock")
class TransformerBlock(nn.Module):
    """Pre-LN block: x + drop(attn(ln1(x))), then x + drop(ffn(ln2(x))).

    ``forward(x, mask=None)`` returns (output (B, T, d_model), attention weights (B, H, T, T)).
    """

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        attn_out, weights = self.attn(self.ln1(x), mask)
        x = x + self.drop(attn_out)  # residual around attention
        x = x + self.drop(self.ffn(self.ln2(x)))  # residual around the feed-forward network
        return x, weights
