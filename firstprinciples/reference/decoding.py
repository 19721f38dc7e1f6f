"""Decoding: the key/value cache for generation, and cross-attention."""
from __future__ import annotations

import torch

from ..guard import reference_piece
from .attention import causal_mask, scaled_dot_product_attention
from .multihead import merge_heads, split_heads


class KVCache:
    """The keys and values of every token processed so far, for one attention layer.

    ``K`` and ``V`` are ``None`` while the cache is empty, then (B, H, T, d_k)
    tensors; ``len(cache)`` is T. Queries are never stored.
    """

    def __init__(self):
        self.K = None
        self.V = None

    @reference_piece("KVCache")
    def append(self, k, v):
        """Add the keys and values (B, H, T_new, d_k) of new tokens; return the full (K, V)."""
        if self.K is None:
            self.K, self.V = k, v
        else:
            self.K = torch.cat([self.K, k], dim=-2)  # (B, H, T + T_new, d_k): time is dim -2
            self.V = torch.cat([self.V, v], dim=-2)
        return self.K, self.V

    def __len__(self):
        return 0 if self.K is None else self.K.shape[-2]


@reference_piece("cached_attention_step")
def cached_attention_step(x_new, cache, mha):
    """Multi-head self-attention of the T_new newest tokens over everything in ``cache``.

    x_new: (B, T_new, d_model), the tokens that follow the ``len(cache)`` cached ones;
    mha: a ``MultiHeadAttention`` whose layers W_q, W_k, W_v, W_o are used.
    Only x_new is projected; its keys and values are appended to ``cache``.
    Returns (output (B, T_new, d_model), weights (B, H, T_new, T_past + T_new)),
    equal to the last T_new rows of ``mha`` run on the whole sequence with a causal mask.
    """
    T_new, T_past = x_new.shape[1], len(cache)
    q = split_heads(mha.W_q(x_new), mha.n_heads)  # (B, H, T_new, d_k): never cached
    k = split_heads(mha.W_k(x_new), mha.n_heads)
    v = split_heads(mha.W_v(x_new), mha.n_heads)
    K, V = cache.append(k, v)  # (B, H, T_past + T_new, d_k)
    mask = None
    if T_new > 1:  # new token i sits at position T_past + i and sees keys 0..T_past + i
        mask = torch.triu(
            torch.full((T_new, T_past + T_new), float("-inf"), dtype=x_new.dtype, device=x_new.device),
            diagonal=T_past + 1,
        )
    out, weights = scaled_dot_product_attention(q, K, V, mask)  # (B, H, T_new, d_k)
    return mha.W_o(merge_heads(out)), weights  # (B, T_new, d_model)


@reference_piece("generate")
def generate(mha, prompt, n_new, use_cache=True):
    """Extend ``prompt`` (B, T_p, d_model) by ``n_new`` vectors, one at a time.

    A toy autoregressive model with no vocabulary: the next input is the
    attention output at the last position. With ``use_cache`` the prompt is
    processed once and every later step projects only the newest vector;
    without it every step re-runs ``mha`` on the whole sequence with a causal
    mask. Both return the same (B, T_p + n_new, d_model) sequence.
    """
    seq = prompt
    if use_cache:
        cache, x_new = KVCache(), prompt
        for _ in range(n_new):
            out, _ = cached_attention_step(x_new, cache, mha)
            x_new = out[:, -1:]  # (B, 1, d_model): the next input
            seq = torch.cat([seq, x_new], dim=1)
    else:
        for _ in range(n_new):
            out, _ = mha(seq, causal_mask(seq.shape[1], seq.dtype))  # the whole prefix, again
            seq = torch.cat([seq, out[:, -1:]], dim=1)
    return seq  # (B, T_p + n_new, d_model)


@reference_piece("cross_attention")
def cross_attention(x, context, W_q, W_k, W_v, mask=None):
    """Queries from x (B, T_q, d_model); keys and values from context (B, T_k, d_ctx).

    W_q: (d_model, d_k), W_k: (d_ctx, d_k), W_v: (d_ctx, d_v); ``mask`` is an
    additive float tensor broadcastable to (B, T_q, T_k), e.g. hiding padding in
    the context. Returns (output (B, T_q, d_v), weights (B, T_q, T_k)).
    """
    Q = x @ W_q  # (B, T_q, d_k)
    K = context @ W_k  # (B, T_k, d_k)
    V = context @ W_v  # (B, T_k, d_v)
    return scaled_dot_product_attention(Q, K, V, mask)
