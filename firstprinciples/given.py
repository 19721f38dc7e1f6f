"""Layers the notebooks are *given* (not graded where they are used), written so that they are no answer.

The KV-cache notebook is handed a multi-head attention layer to cache, and the induction-heads notebook
a trained attention-only model; some checks apply a student's mask or bias in attention (``attention``). Both used to be the course's reference, which is also the answer to
the attention and multi-head exercises; a student bundle (``firstprinciples.bundle``) may not hold it.
These are the same layers (same parameters, names and results, up to float rounding) built on
PyTorch's own multi-head attention, ``F.multi_head_attention_forward``: every graded test of
attention, multi-head attention, the KV cache and the block refuses that built-in (their declarations'
``forbidden``), so a student who copies this layer into an answer loses those points. The causal mask
likewise comes from ``nn.Transformer.generate_square_subsequent_mask``, which the causal-mask test
refuses.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def causal_mask(T: int, dtype=torch.float32) -> torch.Tensor:
    """The additive causal mask (T, T): 0 on and below the diagonal, -inf above."""
    return nn.Transformer.generate_square_subsequent_mask(T, dtype=dtype)


def attention(Q, K, V, mask=None):
    """Scaled dot-product attention of queries Q (..., T_q, d) over keys K and values V (..., T_k, d), with
    an additive mask broadcastable to (..., T_q, T_k): (output (..., T_q, d), weights (..., T_q, T_k)).
    PyTorch's own (one head of ``F.multi_head_attention_forward``, identity projections), for the
    declarations' checks that apply a student's mask or bias in attention."""
    *lead, T_q, d = Q.shape
    T_k = K.shape[-2]
    n = 1
    for size in lead:
        n *= size
    q, k, v = (t.reshape(n, t.shape[-2], d).transpose(0, 1) for t in (Q, K, V))  # (T, n, d)
    eye = torch.eye(d, dtype=Q.dtype, device=Q.device)
    attn_mask = None
    if mask is not None:
        attn_mask = torch.broadcast_to(mask.to(Q.dtype), (*lead, T_q, T_k)).reshape(n, T_q, T_k)
    out, weights = F.multi_head_attention_forward(
        q, k, v, d, 1, in_proj_weight=None, in_proj_bias=None, bias_k=None, bias_v=None, add_zero_attn=False,
        dropout_p=0.0, out_proj_weight=eye, out_proj_bias=None, training=False, need_weights=True,
        attn_mask=attn_mask, use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
        v_proj_weight=eye, average_attn_weights=False)
    return out.transpose(0, 1).reshape(*lead, T_q, d), weights.reshape(*lead, T_q, T_k)


class MultiHeadAttention(nn.Module):
    """Self-attention with ``n_heads`` heads of width ``d_k = d_model // n_heads``: bias-free (d_model,
    d_model) layers ``W_q``, ``W_k``, ``W_v``, ``W_o`` (called as modules, so that hooks on them see
    their inputs); ``forward(x (B, T, d_model), mask=None)``, with an additive mask broadcastable to
    (B, n_heads, T, T), returns (output (B, T, d_model), weights (B, n_heads, T, T))."""

    # (the reference's constructor, written again: the reference may not be imported where this is given,
    # and the re-check's watch recognises the reference's construction by its code, in the reference's file)
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        q, k, v = (layer(x).transpose(0, 1) for layer in (self.W_q, self.W_k, self.W_v))  # (T, B, D)
        eye = torch.eye(D, dtype=x.dtype, device=x.device)  # (the projections are done above, by the layers)
        attn_mask = None
        if mask is not None:  # PyTorch takes a (T, T) mask or one of (B * n_heads, T, T)
            attn_mask = torch.broadcast_to(mask.to(x.dtype), (B, self.n_heads, T, T)).reshape(B * self.n_heads, T, T)
        heads, weights = F.multi_head_attention_forward(
            q, k, v, D, self.n_heads, in_proj_weight=None, in_proj_bias=None, bias_k=None, bias_v=None,
            add_zero_attn=False, dropout_p=0.0, out_proj_weight=eye, out_proj_bias=None, training=False,
            need_weights=True, attn_mask=attn_mask, use_separate_proj_weight=True, q_proj_weight=eye,
            k_proj_weight=eye, v_proj_weight=eye, average_attn_weights=False)
        return self.W_o(heads.transpose(0, 1)), weights  # (B, T, D), (B, n_heads, T, T)
