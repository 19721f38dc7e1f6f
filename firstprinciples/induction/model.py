"""AttentionOnly: token embeddings, attention layers with residuals and relative position biases, an unembedding."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from ..given import MultiHeadAttention, causal_mask  # (given layers: no answer of an exercise)

WEIGHTS = Path(__file__).with_name("weights.pt")


class AttentionOnly(nn.Module):
    """A transformer with attention layers only: no feed-forward layers and no layer norm.

    Positions enter only through ``rel_bias`` (n_layers, n_heads, max_len): a learned score added
    to every query-key pair at distance i - j, per layer and head. No position is written into
    the token vectors. ``forward(idx (B, T) long)`` returns (logits (B, T, vocab_size), a list of
    ``n_layers`` attention weights (B, n_heads, T, T)). Position t sees tokens 0..t only.
    """

    def __init__(self, vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_len=48):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                           max_len=max_len)
        self.tok = nn.Embedding(vocab_size, d_model)
        self.rel_bias = nn.Parameter(torch.zeros(n_layers, n_heads, max_len))
        self.layers = nn.ModuleList(MultiHeadAttention(d_model, n_heads) for _ in range(n_layers))
        self.unembed = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        if T > self.rel_bias.shape[-1]:
            raise ValueError(f"sequence of {T} tokens is longer than max_len={self.rel_bias.shape[-1]}")
        x = self.tok(idx)  # (B, T, d_model)
        pos = torch.arange(T, device=idx.device)
        distance = (pos[:, None] - pos[None, :]).clamp(min=0)  # (T, T): i - j on and below the diagonal
        attentions = []
        for layer, attn in enumerate(self.layers):
            mask = causal_mask(T, x.dtype) + self.rel_bias[layer][:, distance]  # (n_heads, T, T)
            out, weights = attn(x, mask)  # (B, T, d_model), (B, H, T, T)
            x = x + out
            attentions.append(weights)
        return self.unembed(x), attentions  # (B, T, vocab_size)


@contextlib.contextmanager
def ablated(model, layer, head, replacement=None):
    """Inside the block, head ``head`` of layer ``layer`` contributes ``replacement`` (a (d_k,)
    tensor, e.g. its mean output) instead of its output; None: zero."""
    d_k = model.config["d_model"] // model.config["n_heads"]

    def hook(module, inputs):
        x = inputs[0].clone()  # (B, T, d_model): the heads' outputs side by side
        x[..., head * d_k:(head + 1) * d_k] = 0 if replacement is None else replacement
        return (x,)

    handle = model.layers[layer].W_o.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@torch.no_grad()
def head_outputs(model, idx, layer):
    """(B, T, n_heads, d_k): what each head of ``layer`` writes before the output projection."""
    seen = {}
    handle = model.layers[layer].W_o.register_forward_pre_hook(lambda m, inputs: seen.setdefault("x", inputs[0]))
    try:
        model(idx)
    finally:
        handle.remove()
    B, T, _ = seen["x"].shape
    return seen["x"].view(B, T, model.config["n_heads"], -1)


def save_trained(model, history, path=WEIGHTS):
    """Store the state dict, the config and the training history (tensors, str, numbers, lists)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "config": dict(model.config), "history": history}, path)


def load_checkpoint(path=WEIGHTS):
    """The raw stored dictionary (state_dict, config, history)."""
    return torch.load(path, weights_only=True)


def load_trained(path=WEIGHTS):
    """AttentionOnly in eval mode with the stored trained weights."""
    ckpt = load_checkpoint(path)
    model = AttentionOnly(**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()


__all__ = ["AttentionOnly", "WEIGHTS", "ablated", "head_outputs", "load_checkpoint", "load_trained", "save_trained"]
