"""Export TinyGPT for the attention explorer, which runs the model in the browser.

- ``export_model(model, vocab)``: a JSON-serialisable dict with the model's
  sizes, its vocabulary and every tensor of its state dict (flat list + shape,
  under the state dict's own names).
- ``explorer_data(...)``: that dict plus what the page shows besides the model:
  example sentences of the corpus (training and held out) and the "Cat sat mat"
  numbers of ``firstprinciples.examples``.
- ``split_free_text(text)`` / ``encode_free_text(vocab, text)``: the page's
  tokenizer for free text, in Python (``explorer.js`` has the same rules; a
  test runs both on the same sentences). It splits punctuation and
  contractions as the corpus writes them ("didn't" is "did not"), and a word
  the model does not know is kept for display but skipped: the model has no
  unknown-word token.
- ``first_it_heads(model, examples)``: what each head does at the "it" inside
  the sentence (before the adjective), over a set of corpus sentences.
- ``write_explorer_assets(outdir)``: writes ``explorer.js``, ``explorer.css``,
  ``model.json`` and ``model.js`` (the same JSON, assigned to
  ``window.FP_EXPLORER_DATA`` so that a page opened from disk can load it with a
  ``<script>`` tag) into ``outdir``. The Sphinx extension ``sphinx_explorer``
  calls it at build time.

Precision: a float32 value is written as the shortest decimal that reads back
as the same float32 (numpy's ``str``), about half the size of a full float64
repr; the JavaScript restores the exact float32 with ``Math.fround``. Float64
tensors are written with Python's ``repr``, which is exact.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import examples as worked
from .corpus import ANIMATE, ANIMATE_ADJECTIVES, INANIMATE, INANIMATE_ADJECTIVES, Vocab, make_corpus, make_example
from .model import WEIGHTS, TinyGPT, load_trained
from .train import batch_tensor

ASSETS = Path(__file__).with_name("explorer")  # explorer.js and explorer.css, shipped with the package
FORMAT = "firstprinciples-tinygpt/1"
GLOBAL_NAME = "FP_EXPLORER_DATA"

# ---------------------------------------------------------------- free text
# Punctuation: every one of these characters is a token of its own, except an
# apostrophe or a hyphen between two letters ("didn't", "well-known").
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~\u00a1\u00ab\u00bb\u00bf\u2013\u2014\u201c\u201d\u2026"
_P = re.escape(PUNCTUATION)
_PIECE = re.compile(f"[^\\s{_P}]+(?:['-][^\\s{_P}]+)*|[{_P}]")
CLITICS = ("s", "re", "ve", "ll", "d", "m")  # it's -> it 's, we're -> we 're, ...
NOT_STEMS = {"ca": "can", "wo": "will", "sha": "shall"}  # can't -> can not, won't -> will not


def split_free_text(text):
    """Free text -> the words of the corpus's spelling, in order.

    Lower case; curly apostrophes read as "'"; every punctuation mark its own
    token; "n't" is "not", as the corpus writes it ("didn't" -> "did", "not";
    "can't" -> "can", "not"; "cannot" -> "can", "not"); other clitics are split
    off ("it's" -> "it", "'s"). For the corpus's own sentences this is
    ``Vocab.split``.
    """
    text = str(text).lower().replace("\u2019", "'").replace("\u2018", "'")
    words = []
    for w in _PIECE.findall(text):
        if w == "cannot":
            words += ["can", "not"]
        elif len(w) > 3 and w.endswith("n't"):
            stem = w[:-3]
            words += [NOT_STEMS.get(stem, stem), "not"]
        elif "'" in w and w.rsplit("'", 1)[1] in CLITICS:
            stem, clitic = w.rsplit("'", 1)
            words += [stem, "'" + clitic]
        else:
            words.append(w)
    return words


def encode_free_text(vocab, text, bos=True):
    """What the page does with typed text: {"pieces": every word of ``split_free_text`` with
    "known" and, if known, its "position" in the model's input; "words" and "ids": the model's
    input (``<bos>`` first, unknown words left out); "unknown": the unknown words, once each}."""
    pieces, words, unknown = [], ["<bos>"] if bos else [], []
    for w in split_free_text(text):
        known = w in vocab.tokens and not w.startswith("<")
        pieces.append({"text": w, "known": known, "position": len(words) if known else None})
        if known:
            words.append(w)
        elif w not in unknown:
            unknown.append(w)
    return {"pieces": pieces, "words": words, "ids": [vocab.id(w) for w in words], "unknown": unknown}


def _flat(t):
    """A tensor as (dtype name, flat list of Python floats that round-trip exactly)."""
    a = t.detach().cpu().contiguous().reshape(-1)
    if a.dtype == torch.float32:
        arr = a.numpy()
        values = [float(str(x)) for x in arr]  # shortest decimal that reads back as this float32
        if not np.array_equal(np.asarray(values, dtype=np.float32), arr):
            raise AssertionError("float32 values did not round-trip")  # cannot happen with numpy's shortest repr
        name = "float32"
    elif a.dtype == torch.float64:
        values, name = a.tolist(), "float64"
    else:
        raise TypeError(f"cannot export a tensor of dtype {a.dtype}")
    if not all(np.isfinite(values)):
        raise ValueError("the model has non-finite parameters")
    return name, values


def _config(model):
    """The sizes the forward pass needs, read from the modules themselves."""
    block = model.blocks[0]
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    eps = {m.eps for m in norms}
    if len(eps) != 1:
        raise ValueError(f"the layer norms use different eps values: {sorted(eps)}")
    gelus = {m.approximate for m in model.modules() if isinstance(m, nn.GELU)}
    if gelus != {"none"}:
        raise ValueError(f"the explorer computes the exact (erf) GELU; the model uses {sorted(gelus)}")
    return {
        "vocab_size": model.tok.num_embeddings,
        "d_model": model.tok.embedding_dim,
        "n_heads": block.attn.n_heads,
        "n_layers": len(model.blocks),
        "max_len": model.pos.num_embeddings,
        "d_ff": block.ffn.net[0].out_features,
        "ln_eps": eps.pop(),
        "gelu": "erf",
        "prepend": "<bos>",  # the corpus's sentences start with <bos> (Example.ids)
    }


def export_model(model, vocab):
    """TinyGPT + its Vocab -> a JSON-serialisable dict: config, vocab tokens and parameters.

    ``params[name] = {"shape": [...], "dtype": "float32" | "float64", "data": [flat values]}``
    for every tensor of ``model.state_dict()``, in row-major order (a Linear's
    weight is (out_features, in_features), as in torch).
    """
    config = _config(model)
    if config["vocab_size"] != len(vocab.tokens):
        raise ValueError(f"the model has {config['vocab_size']} token embeddings, the vocabulary {len(vocab.tokens)} words")
    params = {}
    for name, t in model.state_dict().items():
        dtype, data = _flat(t)
        params[name] = {"shape": list(t.shape), "dtype": dtype, "data": data}
    tokenizer = {"punctuation": PUNCTUATION, "clitics": list(CLITICS), "not_stems": NOT_STEMS}
    return {"format": FORMAT, "config": config, "vocab": list(vocab.tokens), "tokenizer": tokenizer, "params": params}


def _untrained_model(vocab, seed=0):
    """A seeded random TinyGPT (used only when no trained weights are stored)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(vocab_size=len(vocab.tokens)).eval()


def example_sentences(vocab, per_split=4, seed=0):
    """Sentences for the explorer's list: the source's own pair first, then, for the
    held-out and the training split, one sentence for each (noun order, referent kind).

    Each is a dict with the sentence, its split ("held_out" or "train") and the
    positions (in ``<bos>`` + words) of the final "it", the referent and the distractor.
    """
    corpus = make_corpus(seed=seed)
    # "The animal didn't cross the street because it was too tired", in the corpus's words,
    # and its twin that the adjective turns round. Both pairs are held out by construction.
    picked = [("held_out", make_example(vocab, 0, "animal", "street", adj)) for adj in ("tired", "wide")]
    for split, pool in (("held_out", corpus.held_out), ("train", corpus.train)):
        seen = set()
        for ex in pool:
            kind = (ex.animate_first, ex.referent in ANIMATE)
            if kind not in seen and all(ex.sentence != p.sentence for _, p in picked):
                seen.add(kind)
                picked.append((split, ex))
            if len(seen) == per_split:
                break
    return [
        {"sentence": ex.sentence, "split": split, "referent": ex.referent, "distractor": ex.distractor,
         "adjective": ex.adjective, "pronoun_index": ex.pronoun_index, "referent_index": ex.referent_index,
         "distractor_index": ex.distractor_index}
        for split, ex in picked
    ]


@torch.no_grad()
def first_it_heads(model, examples):
    """What each head does at the "it" inside the sentence, which comes before the adjective.

    For every example, the weights from that "it" (``sentence_pronoun_index``) to the
    two nouns, per layer and head. Returns a dict of (n_layers, n_heads) float64 tensors,
    each the fraction of examples in which the head gives more weight to: ``referent``,
    the right noun rather than the other; ``first_noun``, the noun named first rather
    than the second; ``animate``, the living thing rather than the place. Also ``final``:
    ``referent`` at the final "it" (the recap, after the adjective), for comparison, and
    ``n``: the number of examples.
    """
    m64 = copy.deepcopy(model).double().eval()
    ids = batch_tensor(examples)
    attentions = torch.stack([a for a in m64(ids)[1]], 1)  # (N, n_layers, n_heads, T, T)
    rows = torch.arange(len(examples))

    def share(query, a_pos, b_pos):
        q, a, b = (torch.tensor(v) for v in (query, a_pos, b_pos))
        return (attentions[rows, :, :, q, a] > attentions[rows, :, :, q, b]).double().mean(0)

    first = [ex.sentence_pronoun_index for ex in examples]
    ref = [ex.referent_index for ex in examples]
    dis = [ex.distractor_index for ex in examples]
    animate = [r if ex.referent in ANIMATE else d for ex, r, d in zip(examples, ref, dis)]
    place = [d if ex.referent in ANIMATE else r for ex, r, d in zip(examples, ref, dis)]
    return {
        "referent": share(first, ref, dis),
        "first_noun": share(first, [min(r, d) for r, d in zip(ref, dis)], [max(r, d) for r, d in zip(ref, dis)]),
        "animate": share(first, animate, place),
        "final": share([ex.pronoun_index for ex in examples], ref, dis),
        "n": len(examples),
    }


def head_summary(model, seed=0):
    """``first_it_heads`` over the held-out sentences of ``make_corpus(seed)``, as lists for the page."""
    stats = first_it_heads(model, make_corpus(seed=seed).held_out)
    return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in stats.items()}


def cat_sat_mat():
    """The worked example's inputs and the chapter's rounded figures (firstprinciples.examples)."""
    return {
        "tokens": list(worked.TOKENS),
        "query": list(worked.CAT_QUERY[0]),
        "keys": [list(r) for r in worked.KEYS],
        "values": [list(r) for r in worked.VALUES],
        "expected": {
            "raw_scores": list(worked.RAW_SCORES),
            "scaled_scores": list(worked.SCALED_SCORES),
            "weights": list(worked.WEIGHTS),
            "output": list(worked.OUTPUT),
        },
    }


def explorer_model():
    """(model, vocab, trained): ``load_trained()``, or, if no weights are stored, a seeded
    random TinyGPT with ``trained=False``. The explorer page's figures use the same."""
    if WEIGHTS.is_file():
        model, vocab = load_trained()
        return model, vocab, True
    vocab = Vocab()
    return _untrained_model(vocab), vocab, False


def explorer_data(model=None, vocab=None):
    """Everything the explorer page reads: the exported model, example sentences, Cat sat mat.

    Without arguments, the model of ``explorer_model()``; an untrained one is
    flagged ``"trained": false`` (the page says so).
    """
    trained = True
    if model is None:
        model, vocab, trained = explorer_model()
    return {
        "model": export_model(model, vocab),
        "trained": trained,
        "heads": head_summary(model),
        "nouns": list(ANIMATE + INANIMATE),
        "adjectives": list(ANIMATE_ADJECTIVES + INANIMATE_ADJECTIVES),
        "examples": example_sentences(vocab),
        "cat_sat_mat": cat_sat_mat(),
    }


def write_explorer_assets(outdir, model=None, vocab=None):
    """Write explorer.js, explorer.css, model.json and model.js into ``outdir``; return their paths."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("explorer.js", "explorer.css"):
        shutil.copyfile(ASSETS / name, outdir / name)
        written.append(outdir / name)
    text = json.dumps(explorer_data(model, vocab), separators=(",", ":"), allow_nan=False)
    (outdir / "model.json").write_text(text, encoding="utf-8")
    (outdir / "model.js").write_text(f"window.{GLOBAL_NAME} = {text};\n", encoding="utf-8")
    written += [outdir / "model.json", outdir / "model.js"]
    return written


__all__ = ["export_model", "split_free_text", "encode_free_text", "first_it_heads", "head_summary", "explorer_model", "explorer_data", "example_sentences", "cat_sat_mat", "write_explorer_assets", "ASSETS"]
