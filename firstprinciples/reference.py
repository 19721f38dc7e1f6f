"""Reference implementations: exactly one of each concept in the course.

Chapters import them to compute figures, the checks compare students' answers
with them, and ``tests/`` validates them against PyTorch's own modules.
Each is marked with ``reference_piece`` so that an exercise can tell when a
student's answer simply calls the reference instead of building the piece.
"""
from __future__ import annotations

import math

import torch

from .guard import reference_piece


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
    weights = torch.softmax(scores, dim=-1)  # each row sums to 1
    return weights @ V, weights  # (..., T_q, d_v), (..., T_q, T_k)


@reference_piece("causal_mask")
def causal_mask(T, dtype=torch.float32):
    """Additive causal mask (T, T): 0 on and below the diagonal, -inf above,
    so that position t attends to positions 0..t only."""
    return torch.triu(torch.full((T, T), float("-inf"), dtype=dtype), diagonal=1)
