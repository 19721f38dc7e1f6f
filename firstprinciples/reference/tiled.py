"""Attention over blocks of keys, with an online softmax: no (T_q, T_k) matrix is ever held."""
from __future__ import annotations

import math

import torch

from ..guard import reference_piece


@reference_piece("tiled_attention")
def tiled_attention(Q, K, V, block_size=64, causal=False):
    """softmax(Q K^T / sqrt(d_k)) V, one block of ``block_size`` keys at a time.

    Q: (..., T_q, d_k), K: (..., T_k, d_k), V: (..., T_k, d_v) -> (..., T_q, d_v).
    ``causal``: T_q == T_k and query i sees keys 0..i. No intermediate is larger than
    (..., T_q, block_size) or the output.
    """
    T_q, T_k = Q.shape[-2], K.shape[-2]
    scale = 1.0 / math.sqrt(Q.shape[-1])
    running_max = Q.new_full((*Q.shape[:-1], 1), float("-inf"))  # (..., T_q, 1)
    running_sum = Q.new_zeros((*Q.shape[:-1], 1))  # (..., T_q, 1)
    acc = Q.new_zeros((*Q.shape[:-1], V.shape[-1]))  # (..., T_q, d_v): unnormalised output
    query_pos = torch.arange(T_q, device=Q.device)[:, None]  # (T_q, 1)
    for start in range(0, T_k, block_size):
        K_b = K[..., start:start + block_size, :]  # (..., b, d_k)
        V_b = V[..., start:start + block_size, :]  # (..., b, d_v)
        scores = Q @ K_b.transpose(-2, -1) * scale  # (..., T_q, b)
        if causal:
            key_pos = torch.arange(start, start + K_b.shape[-2], device=Q.device)[None, :]  # (1, b)
            scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))  # (..., T_q, 1)
        # Key 0 is in the first block and every query sees it, so new_max is finite.
        weights = torch.exp(scores - new_max)  # (..., T_q, b)
        rescale = torch.exp(running_max - new_max)  # exp(-inf) = 0 on the first block
        running_sum = running_sum * rescale + weights.sum(-1, keepdim=True)
        acc = acc * rescale + weights @ V_b
        running_max = new_max
    return acc / running_sum  # (..., T_q, d_v)
