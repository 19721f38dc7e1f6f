"""Induction heads: a two-layer attention-only transformer trained on repeated random tokens.

- ``data``: the training sequences (a block of distinct random tokens repeated once, at a
  random offset) and the evaluation sequences (``period`` tokens repeated twice);
- ``model``: ``AttentionOnly``, built from the reference ``MultiHeadAttention``, and
  ``load_trained`` for the stored weights;
- ``train``: the seeded training loop, the split losses and the head scores
  (``python -m firstprinciples.induction.train`` rewrites ``weights.pt``).
"""
from .data import PERIOD, repeated_tokens, training_batch, worked_example
from .model import AttentionOnly, load_checkpoint, load_trained

__all__ = ["PERIOD", "AttentionOnly", "load_checkpoint", "load_trained", "repeated_tokens", "training_batch",
           "worked_example"]
