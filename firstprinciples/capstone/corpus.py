"""The capstone corpus: sentences whose pronoun is resolved by meaning.

Every sentence names one animate noun (``dog``) and one inanimate noun
(``river``), in either order and in either grammatical role, then says
"because it was too <adjective>". The adjective decides what "it" is: an
animal can be tired but not wide, a river wide but not tired. The sentence ends
with a short recap, ``. it <referent> .``, so that predicting the token after
the final "it" is resolving the pronoun::

    the dog did not cross the river because it was too tired . it dog .
    the river was not crossed by the dog because it was too wide . it river .

A causal model cannot resolve the first "it" (the adjective comes after it);
the final "it" has seen the whole sentence, and the model's next-token
prediction there is its answer.

Held out: every sentence whose (referent noun, adjective) pair is in
``HELD_OUT_PAIRS``, one pair per noun (the k-th noun of a class with the
adjective number k mod 7 of the matching class). No training sentence contains
such a pair, so a held-out sentence is a new combination of a known noun and a
known adjective, in known templates.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

ANIMATE = ("animal", "dog", "cat", "horse", "cow", "fox", "boy", "girl", "man", "woman")
INANIMATE = ("street", "road", "river", "bridge", "field", "path", "track", "valley", "hill", "stream")
# Adjectives that fit only one kind of noun: they decide the referent.
ANIMATE_ADJECTIVES = ("tired", "weak", "scared", "slow", "lazy", "sleepy", "hungry")
INANIMATE_ADJECTIVES = ("wide", "long", "steep", "busy", "icy", "deep", "muddy")
VERBS = ("cross", "reach", "pass", "follow")
PARTICIPLES = ("crossed", "reached", "passed", "followed")

# {a}: the animate noun, {i}: the inanimate one, {v}: a verb or participle.
# The first three name the animate noun first, the last three the inanimate one.
TEMPLATES = (
    "the {a} did not {v} the {i} because it was too {adj} .",
    "the {a} could not {v} the {i} because it was too {adj} .",
    "the {a} avoided the {i} because it was too {adj} .",
    "the {i} was not {p} by the {a} because it was too {adj} .",
    "the {i} stopped the {a} because it was too {adj} .",
    "the {i} was avoided by the {a} because it was too {adj} .",
)
ANIMATE_FIRST = (True, True, True, False, False, False)

SPECIALS = ("<pad>", "<bos>", "<eos>")
WORDS = (
    ".", "the", "did", "not", "could", "avoided", "was", "by", "stopped", "because", "it", "too",
    *VERBS, *PARTICIPLES, *ANIMATE, *INANIMATE, *ANIMATE_ADJECTIVES, *INANIMATE_ADJECTIVES,
)


def _held_out_pairs():
    pairs = set()
    for nouns, adjectives in ((ANIMATE, ANIMATE_ADJECTIVES), (INANIMATE, INANIMATE_ADJECTIVES)):
        for k, noun in enumerate(nouns):
            pairs.add((noun, adjectives[k % len(adjectives)]))
    return frozenset(pairs)


HELD_OUT_PAIRS = _held_out_pairs()  # 20 (referent, adjective) pairs, never seen in training


class Vocab:
    """Word-level vocabulary. ``tokens[i]`` is the word with id i; id 0 is ``<pad>``."""

    def __init__(self, tokens=SPECIALS + WORDS):
        self.tokens = list(tokens)
        self._ids = {w: i for i, w in enumerate(self.tokens)}
        self.pad, self.bos, self.eos = self.id("<pad>"), self.id("<bos>"), self.id("<eos>")

    def __len__(self):
        return len(self.tokens)

    def id(self, word):
        if word not in self._ids:
            raise KeyError(f"{word!r} is not in the capstone vocabulary")
        return self._ids[word]

    def split(self, sentence):
        """Lower-case, split on spaces; a "." stuck to a word becomes its own token."""
        words = []
        for w in sentence.lower().split():
            if len(w) > 1 and w.endswith("."):
                words += [w[:-1], "."]
            else:
                words.append(w)
        return words

    def encode(self, sentence, bos=False, eos=False):
        """Token ids of ``sentence``; ``bos``/``eos`` add ``<bos>`` in front / ``<eos>`` at the end."""
        ids = [self.id(w) for w in self.split(sentence)]
        return [self.bos] * bos + ids + [self.eos] * eos

    def decode(self, ids):
        return " ".join(self.tokens[int(i)] for i in ids)


@dataclass
class Example:
    """One corpus sentence. ``ids`` is ``<bos>`` + the words + ``<eos>``; every index is a position in ``ids``.

    pronoun_index: the final "it" (the recap), the position whose next token is the referent;
    sentence_pronoun_index: the "it" inside the sentence (before the adjective);
    referent_index / distractor_index: the correct / other noun inside the sentence;
    adjective_index: the adjective; answer_index = pronoun_index + 1: the referent in the recap.
    """

    sentence: str
    ids: list
    pronoun_index: int
    referent_index: int
    distractor_index: int
    adjective_index: int
    sentence_pronoun_index: int
    answer_index: int
    referent: str
    distractor: str
    adjective: str
    template: int
    animate_first: bool = field(default=True)


@dataclass
class Corpus:
    vocab: Vocab
    train: list
    held_out: list


def make_example(vocab, template, animate, inanimate, adjective, verb_index=0):
    """Build the Example of one template filled with two nouns and an adjective."""
    animate_ref = adjective in ANIMATE_ADJECTIVES
    if not animate_ref and adjective not in INANIMATE_ADJECTIVES:
        raise ValueError(f"unknown adjective {adjective!r}")
    referent, distractor = (animate, inanimate) if animate_ref else (inanimate, animate)
    body = TEMPLATES[template].format(
        a=animate, i=inanimate, v=VERBS[verb_index], p=PARTICIPLES[verb_index], adj=adjective
    )
    sentence = f"{body} it {referent} ."
    ids = vocab.encode(sentence, bos=True, eos=True)
    words = ["<bos>"] + vocab.split(sentence) + ["<eos>"]
    it_positions = [t for t, w in enumerate(words) if w == "it"]
    return Example(
        sentence=sentence,
        ids=ids,
        pronoun_index=it_positions[-1],
        referent_index=words.index(referent),
        distractor_index=words.index(distractor),
        adjective_index=words.index(adjective),
        sentence_pronoun_index=it_positions[0],
        answer_index=it_positions[-1] + 1,
        referent=referent,
        distractor=distractor,
        adjective=adjective,
        template=template,
        animate_first=ANIMATE_FIRST[template],
    )


def all_combinations():
    """Every (template, animate, inanimate, adjective, verb_index) the generator can produce."""
    combos = []
    for t, text in enumerate(TEMPLATES):
        verbs = range(len(VERBS)) if ("{v}" in text or "{p}" in text) else (0,)
        for a in ANIMATE:
            for i in INANIMATE:
                for adj in ANIMATE_ADJECTIVES + INANIMATE_ADJECTIVES:
                    for v in verbs:
                        combos.append((t, a, i, adj, v))
    return combos


def make_corpus(seed=0, n_train=4000, n_held_out=400):
    """Sample distinct training and held-out sentences, deterministically for ``seed``.

    Training sentences never contain a pair of ``HELD_OUT_PAIRS``; held-out
    sentences always do. Both sets are drawn uniformly from the possible
    sentences of their kind, so orders, templates and referent kinds are mixed.
    """
    vocab = Vocab()
    rng = random.Random(seed)
    seen, held = [], []
    for t, a, i, adj, v in all_combinations():
        referent = a if adj in ANIMATE_ADJECTIVES else i
        (held if (referent, adj) in HELD_OUT_PAIRS else seen).append((t, a, i, adj, v))
    train = [make_example(vocab, *c) for c in rng.sample(seen, n_train)]
    held_out = [make_example(vocab, *c) for c in rng.sample(held, n_held_out)]
    return Corpus(vocab, train, held_out)


def baselines(corpus):
    """Accuracy on ``corpus.held_out`` of rules that ignore the adjective's meaning.

    first_noun / second_noun: always answer the noun that comes first / second;
    animate: always the animate noun; most_frequent: the noun most often the
    referent in training when it appears, else the other one. ``chance`` is the
    best of them: what resolving "it" without the adjective's meaning achieves.
    """
    held = corpus.held_out
    counts = {}
    for ex in corpus.train:
        counts[ex.referent] = counts.get(ex.referent, 0) + 1
    res = {
        "first_noun": sum(ex.referent_index < ex.distractor_index for ex in held) / len(held),
        "second_noun": sum(ex.referent_index > ex.distractor_index for ex in held) / len(held),
        "animate": sum(ex.referent in ANIMATE for ex in held) / len(held),
        "most_frequent": sum(counts.get(ex.referent, 0) > counts.get(ex.distractor, 0) for ex in held)
        / len(held),
    }
    res["chance"] = max(res.values())
    return res


__all__ = [
    "ANIMATE", "INANIMATE", "ANIMATE_ADJECTIVES", "INANIMATE_ADJECTIVES", "TEMPLATES", "HELD_OUT_PAIRS",
    "Vocab", "Example", "Corpus", "make_example", "make_corpus", "baselines", "all_combinations",
]
