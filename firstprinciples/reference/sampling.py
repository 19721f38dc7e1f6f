"""Choosing the next token from the model's logits: greedy, temperature, top-k and top-p."""
from __future__ import annotations

import torch

from ..guard import reference_piece


@reference_piece("next_token_probabilities")
def next_token_probabilities(logits, temperature=1.0, top_k=None, top_p=None):
    """The distribution that ``sample_next_token`` draws from: logits (..., V) -> probabilities (..., V).

    ``temperature == 0`` gives all the mass to the argmax. Otherwise the logits are divided
    by the temperature; ``top_k`` keeps the k largest; ``top_p`` then keeps, from that
    distribution renormalised, the smallest set of most likely tokens whose total is at
    least ``top_p`` (the token that crosses the threshold is kept). Dropped tokens get 0.
    """
    return kept_probabilities(logits, temperature, top_k, top_p)


def kept_probabilities(logits, temperature=1.0, top_k=None, top_p=None):
    """``next_token_probabilities`` itself (undecorated: the sampler and the checks use it)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    scaled = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]  # (..., 1): the k-th largest
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p is not None:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # the mass of the more likely tokens
        drop_sorted = before >= top_p  # already reached without this token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@reference_piece("sample_next_token")
def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row of ``logits`` (..., V) -> int64 tensor (...).

    ``temperature == 0`` is greedy (the argmax) and draws no random number; otherwise one
    draw per row from ``next_token_probabilities``, taken from ``generator`` only.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = kept_probabilities(logits, temperature, top_k, top_p)
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V): multinomial wants two dimensions
    tokens = torch.multinomial(flat, 1, generator=generator)  # (N, 1)
    return tokens.reshape(logits.shape[:-1])
