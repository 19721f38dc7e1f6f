"""Positions past the training length: five ways of giving a TinyGPT positions, trained on short windows.

- ``data``: a long stream of capstone sentences, cut into training windows of 32 tokens and
  evaluation windows of 32, 64 and 128 tokens (the same target tokens at every length);
- ``model``: ``LengthGPT``, the capstone's TinyGPT with no positions, sinusoidal, learned, RoPE or
  ALiBi, and ``load_trained`` for the stored weights;
- ``train``: the seeded training loop and the losses per length and per position
  (``python -m firstprinciples.lengths.train`` rewrites ``weights.pt``).
"""
from .data import TRAIN_LEN, eval_windows, split_windows, streams
from .model import VARIANTS, LengthGPT, load_checkpoint, load_trained

__all__ = ["TRAIN_LEN", "VARIANTS", "LengthGPT", "eval_windows", "load_checkpoint", "load_trained",
           "split_windows", "streams"]
