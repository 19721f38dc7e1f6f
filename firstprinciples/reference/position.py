"""Positional encodings: the sinusoidal table and rotary embeddings (RoPE)."""
from __future__ import annotations

import math

import torch

from ..guard import reference_piece


@reference_piece("sinusoidal_encoding")
def sinusoidal_encoding(max_len, d_model, dtype=torch.float32):
    """The (max_len, d_model) table: sin at even columns 2i, cos at odd columns 2i+1,
    of pos * 10000^(-2i/d_model), positions from 0."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles = pos * freq  # (max_len, ceil(d_model / 2))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.to(dtype)


@reference_piece("apply_rope")
def apply_rope(x, base=10000.0):
    """Rotate each interleaved pair (x[..., 2i], x[..., 2i+1]) of x (..., T, d)
    by the angle pos * base^(-2i/d), for positions 0..T-1."""
    T, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even last dimension, got {d}")
    pos = torch.arange(T, dtype=torch.float64)[:, None]  # (T, 1)
    freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angle = (pos * freq).to(x.dtype)  # (T, d/2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    even, odd = x[..., 0::2], x[..., 1::2]  # (..., T, d/2) each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (..., T, d/2, 2)
    return rotated.flatten(-2)  # back to interleaved (..., T, d)
