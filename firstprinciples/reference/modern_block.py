"""The pieces of a modern decoder block: RMSNorm, the SwiGLU feed-forward, grouped-query attention."""
from __future__ import annotations

import torch
from torch import nn

from ..guard import reference_piece
from .attention import scaled_dot_product_attention
from .multihead import merge_heads, split_heads


@reference_piece("RMSNorm")
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2 over the last dim) + eps) * weight; ``weight`` (d_model,) starts at ones."""

    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        mean_square = x.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        return x / torch.sqrt(mean_square + self.eps) * self.weight  # (..., d_model)


@reference_piece("SwiGLU")
class SwiGLU(nn.Module):
    """W2(silu(W1 x) * W3 x): bias-free W1, W3 (d_model -> d_hidden) and W2 (d_hidden -> d_model)."""

    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.W1 = nn.Linear(d_model, d_hidden, bias=False)  # the gate
        self.W3 = nn.Linear(d_model, d_hidden, bias=False)  # the value it gates
        self.W2 = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x):
        return self.W2(nn.functional.silu(self.W1(x)) * self.W3(x))  # (..., d_model)


@reference_piece("GroupedQueryAttention")
class GroupedQueryAttention(nn.Module):
    """Self-attention whose ``n_heads`` query heads share ``n_kv_heads`` key/value heads.

    ``W_q`` and ``W_o`` are (d_model, d_model); ``W_k`` and ``W_v`` map d_model to
    n_kv_heads * d_k, d_k = d_model // n_heads. Query head h reads key/value head
    h // (n_heads // n_kv_heads). ``forward(x, mask=None)``: x (B, T, d_model) ->
    (output (B, T, d_model), weights (B, n_heads, T, T)).
    """

    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        if d_model % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"need n_kv_heads | n_heads | d_model, got {n_kv_heads}, {n_heads}, {d_model}")
        self.n_heads, self.n_kv_heads, self.d_k = n_heads, n_kv_heads, d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
        self.W_v = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        group = self.n_heads // self.n_kv_heads
        Q = split_heads(self.W_q(x), self.n_heads)  # (B, H, T, d_k)
        K = split_heads(self.W_k(x), self.n_kv_heads)  # (B, H_kv, T, d_k)
        V = split_heads(self.W_v(x), self.n_kv_heads)
        K = K.repeat_interleave(group, dim=1)  # (B, H, T, d_k): head h gets kv head h // group
        V = V.repeat_interleave(group, dim=1)
        out, weights = scaled_dot_product_attention(Q, K, V, mask)  # (B, H, T, d_k), (B, H, T, T)
        return self.W_o(merge_heads(out)), weights  # (B, T, d_model)
