"""The capstone: a tiny GPT that learns which noun "it" refers to.

- ``corpus``: the sentence generator, the vocabulary and the held-out split;
- ``model``: ``TinyGPT``, built from the reference pieces, and ``load_trained``;
- ``train``: the seeded training loop and the evaluation of the pronoun task.
"""
from .corpus import Corpus, Example, Vocab, baselines, make_corpus
from .model import TinyGPT, load_trained

__all__ = ["Corpus", "Example", "Vocab", "TinyGPT", "baselines", "load_trained", "make_corpus"]
