"""LengthGPT: the capstone's TinyGPT with one of five ways of knowing where a token is."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..capstone.model import TinyGPT
from ..reference import (MultiHeadAttention, alibi_bias, apply_rope, causal_mask, merge_heads,
                         scaled_dot_product_attention, sinusoidal_encoding, split_heads)

WEIGHTS = Path(__file__).with_name("weights.pt")
VARIANTS = ("none", "sinusoidal", "learned", "rope", "alibi")


class RotaryAttention(MultiHeadAttention):
    """``MultiHeadAttention`` whose queries and keys are rotated by RoPE in each head, after splitting."""

    def forward(self, x, mask=None):
        Q = apply_rope(split_heads(self.W_q(x), self.n_heads))  # (B, H, T, d_k), rotated by position
        K = apply_rope(split_heads(self.W_k(x), self.n_heads))
        V = split_heads(self.W_v(x), self.n_heads)
        out, weights = scaled_dot_product_attention(Q, K, V, mask)  # (B, H, T, d_k), (B, H, T, T)
        return self.W_o(merge_heads(out)), weights  # (B, T, d_model)


class LengthGPT(TinyGPT):
    """TinyGPT with positions given by ``position``, one of ``VARIANTS``:

    - ``none``: nothing but the causal mask; ``sinusoidal``: the fixed table added to the tokens;
    - ``learned``: a table of ``max_len`` learned rows added to the tokens (TinyGPT's own);
    - ``rope``: queries and keys rotated in every head; ``alibi``: ``alibi_bias`` added to the scores.

    Every variant draws the same initial weights for the same seed (the learned table is drawn and
    dropped by the others). ``forward(idx (B, T) long)`` returns (logits (B, T, vocab_size), a list of
    ``n_layers`` attention weights (B, n_heads, T, T)); only ``learned`` is limited to ``max_len``.
    """

    def __init__(self, vocab_size, position, d_model=64, n_heads=4, n_layers=2, max_len=128):
        if position not in VARIANTS:
            raise ValueError(f"position must be one of {VARIANTS}, got {position!r}")
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.config["position"] = position
        self.position = position
        if position != "learned":
            self.pos = None
        if position == "rope":
            for block in self.blocks:
                rotary = RotaryAttention(d_model, n_heads)
                rotary.load_state_dict(block.attn.state_dict())  # the same initial weights as the others
                block.attn = rotary

    def forward(self, idx):
        B, T = idx.shape
        x = self.tok(idx)  # (B, T, d_model)
        if self.position == "learned":
            if T > self.pos.num_embeddings:
                raise ValueError(f"sequence of {T} tokens is longer than max_len={self.pos.num_embeddings}")
            x = x + self.pos(torch.arange(T, device=idx.device))
        elif self.position == "sinusoidal":
            x = x + sinusoidal_encoding(T, x.shape[-1], x.dtype).to(x.device)
        mask = causal_mask(T, x.dtype).to(x.device)  # (T, T)
        if self.position == "alibi":
            mask = mask + alibi_bias(self.config["n_heads"], T, x.dtype).to(x.device)  # (n_heads, T, T)
        attentions = []
        for block in self.blocks:
            x, weights = block(x, mask)  # (B, T, d_model), (B, H, T, T)
            attentions.append(weights)
        return self.head(self.ln_f(x)), attentions  # (B, T, vocab_size)


def save_trained(models, history, path=WEIGHTS):
    """Store every variant's state dict and config, and the histories (tensors, str, numbers, lists)."""
    states = {name: {k: v.detach().clone() for k, v in m.state_dict().items()} for name, m in models.items()}
    configs = {name: dict(m.config) for name, m in models.items()}
    torch.save({"state_dicts": states, "configs": configs, "history": history}, path)


def load_checkpoint(path=WEIGHTS):
    """The raw stored dictionary (state_dicts, configs, history)."""
    return torch.load(path, weights_only=True)


def load_trained(path=WEIGHTS):
    """{variant: LengthGPT in eval mode with its stored trained weights}, in the order of ``VARIANTS``."""
    ckpt = load_checkpoint(path)
    models = {}
    for name in VARIANTS:
        config = ckpt["configs"][name]
        model = LengthGPT(config["vocab_size"], config["position"], config["d_model"], config["n_heads"],
                          config["n_layers"], config["max_len"])
        model.load_state_dict(ckpt["state_dicts"][name])
        models[name] = model.eval()
    return models


__all__ = ["VARIANTS", "WEIGHTS", "LengthGPT", "RotaryAttention", "load_checkpoint", "load_trained", "save_trained"]
