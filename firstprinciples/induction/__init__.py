"""Induction heads: a two-layer attention-only transformer trained on repeated random tokens.

- ``data``: the training sequences (a block of distinct random tokens repeated once, at a
  random offset) and the evaluation sequences (``period`` tokens repeated twice);
- ``model``: ``AttentionOnly``, built from the given ``MultiHeadAttention`` (``firstprinciples.given``), and
  ``load_trained`` for the stored weights;
- ``train``: the seeded training loop, the split losses and the head scores
  (``python -m firstprinciples.induction.train`` rewrites ``weights.pt``).
"""
from .data import PERIOD, repeated_tokens, training_batch, worked_example

_MODEL = ("AttentionOnly", "load_checkpoint", "load_trained")


def __getattr__(name):
    """The model's names, imported at their first use: the data alone (what the induction_heads
    exercise's tests read) needs no model at all."""
    if name in _MODEL:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["PERIOD", "AttentionOnly", "load_checkpoint", "load_trained", "repeated_tokens", "training_batch",
           "worked_example"]
