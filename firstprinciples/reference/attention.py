"""Queries, keys and values, scores, softmax, attention and the causal mask."""
from __future__ import annotations

import math

import torch

from ..guard import reference_piece


@reference_piece("project_qkv")
def project_qkv(x, W_q, W_k, W_v):
    """Project x (B, T, d_model) with W_* (d_model, d_k or d_v) into (Q, K, V)."""
    return x @ W_q, x @ W_k, x @ W_v  # (B, T, d_k), (B, T, d_k), (B, T, d_v)


@reference_piece("dot_product_scores")
def dot_product_scores(Q, K):
    """Q K^T over the last two dimensions: (..., T_q, d_k), (..., T_k, d_k) -> (..., T_q, T_k)."""
    return Q @ K.transpose(-2, -1)


@reference_piece("softmax")
def softmax(x, dim=-1):
    """Numerically stable softmax along ``dim``; -inf entries get exactly 0.

    A row that is entirely -inf has no valid entry; its result is NaN, as with
    ``torch.softmax``.
    """
    shifted = x - x.amax(dim=dim, keepdim=True)  # largest entry becomes 0: exp cannot overflow
    e = torch.exp(shifted)
    return e / e.sum(dim=dim, keepdim=True)


@reference_piece("scaled_dot_product_attention")
def scaled_dot_product_attention(Q, K, V, mask=None):
    """softmax(Q K^T / sqrt(d_k) + mask) V.

    Q: (..., T_q, d_k), K: (..., T_k, d_k), V: (..., T_k, d_v); ``mask`` is an
    additive float tensor broadcastable to (..., T_q, T_k), with 0 where a query
    may look and -inf where it may not.
    Returns (output (..., T_q, d_v), weights (..., T_q, T_k)).
    """
    d_k = Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)  # (..., T_q, T_k)
    if mask is not None:
        scores = scores + mask
    weights = softmax(scores, dim=-1)  # each row sums to 1
    return weights @ V, weights  # (..., T_q, d_v), (..., T_q, T_k)


@reference_piece("causal_mask")
def causal_mask(T, dtype=torch.float32):
    """Additive causal mask (T, T): 0 on and below the diagonal, -inf above,
    so that position t attends to positions 0..t only."""
    return torch.triu(torch.full((T, T), float("-inf"), dtype=dtype), diagonal=1)
