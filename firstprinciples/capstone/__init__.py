"""The capstone: a tiny GPT that learns which noun "it" refers to.

- ``corpus``: the sentence generator, the vocabulary and the held-out split;
- ``model``: ``TinyGPT``, built from the reference pieces, and ``load_trained``;
- ``train``: the seeded training loop and the evaluation of the pronoun task.

``TinyGPT`` and ``load_trained`` are imported when first used: the capstone's declaration reads the
corpus (its held-out sentences are the trained model's cases) without loading the course's model.
"""
from .corpus import Corpus, Example, Vocab, baselines, make_corpus

__all__ = ["Corpus", "Example", "Vocab", "TinyGPT", "baselines", "load_trained", "make_corpus"]


def __getattr__(name):
    if name in ("TinyGPT", "load_trained"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
