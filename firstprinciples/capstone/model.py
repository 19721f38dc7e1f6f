"""TinyGPT: a small decoder-only transformer built from the course's reference pieces."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..guard import reference_piece
from ..reference import KVCache, TransformerBlock, cached_attention_step, causal_mask
from .corpus import Vocab

WEIGHTS = Path(__file__).with_name("weights.pt")


class TinyGPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` pre-LN blocks with the
    causal mask, a final layer norm and a bias-free language-model head.

    ``forward(idx (B, T) long)`` returns (logits (B, T, vocab_size), a list of
    ``n_layers`` attention weights (B, n_heads, T, T)). Position t sees tokens 0..t only.
    """

    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__()
        self.config = dict(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                           max_len=max_len)
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, dropout=0.0) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        if T > self.pos.num_embeddings:
            raise ValueError(f"sequence of {T} tokens is longer than max_len={self.pos.num_embeddings}")
        positions = torch.arange(T, device=idx.device)
        x = self.tok(idx) + self.pos(positions)  # (B, T, d_model)
        mask = causal_mask(T, x.dtype).to(x.device)  # (T, T)
        attentions = []
        for block in self.blocks:
            x, weights = block(x, mask)  # (B, T, d_model), (B, H, T, T)
            attentions.append(weights)
        return self.head(self.ln_f(x)), attentions  # (B, T, vocab_size)


@reference_piece("generate_cached")
@torch.no_grad()
def generate_greedy(model, ids, n_new, use_cache=True):
    """Greedy decoding: extend ``ids`` (B, T_p) long by ``n_new`` tokens, each the argmax of the logits.

    Works for any model with TinyGPT's parts (tok, pos, blocks with ln1, attn, ln2,
    ffn, ln_f, head). With ``use_cache`` the prompt goes through once and every
    later step feeds only the newest token, with one ``KVCache`` per block;
    without, every step runs ``model`` on the whole sequence. Returns (ids
    (B, T_p + n_new), logits (B, n_new, vocab_size): the logits each new token was chosen from).
    """
    steps = []
    if not use_cache:
        for _ in range(n_new):
            logits = model(ids)[0][:, -1]  # (B, V): the last position's prediction
            steps.append(logits)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        return ids, torch.stack(steps, dim=1)
    caches = [KVCache() for _ in model.blocks]
    new = ids
    for _ in range(n_new):
        T_past = len(caches[0])
        x = model.tok(new) + model.pos(torch.arange(T_past, T_past + new.shape[1], device=new.device))
        for block, cache in zip(model.blocks, caches):
            a, _ = cached_attention_step(block.ln1(x), cache, block.attn)  # (B, T_new, d_model)
            x = x + a
            x = x + block.ffn(block.ln2(x))
        logits = model.head(model.ln_f(x[:, -1]))  # (B, V)
        steps.append(logits)
        new = logits.argmax(-1, keepdim=True)  # (B, 1): the only token fed next time
        ids = torch.cat([ids, new], dim=1)
    return ids, torch.stack(steps, dim=1)


def save_trained(model, vocab, history, path=WEIGHTS):
    """Store the state dict, the config, the vocabulary and the training history (tensors, str, numbers)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "config": dict(model.config), "tokens": list(vocab.tokens),
                "history": history}, path)


def load_checkpoint(path=WEIGHTS):
    """The raw stored dictionary (state_dict, config, tokens, history)."""
    return torch.load(path, weights_only=True)


def load_trained(path=WEIGHTS):
    """(TinyGPT in eval mode with the stored trained weights, its Vocab)."""
    ckpt = load_checkpoint(path)
    model = TinyGPT(**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    return model.eval(), Vocab(ckpt["tokens"])


__all__ = ["TinyGPT", "generate_greedy", "load_trained", "load_checkpoint", "save_trained", "WEIGHTS"]
