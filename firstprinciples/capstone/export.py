"""Export TinyGPT for the attention explorer, which runs the model in the browser.

- ``export_model(model, vocab)``: a JSON-serialisable dict with the model's
  sizes, its vocabulary and every tensor of its state dict (flat list + shape,
  under the state dict's own names).
- ``explorer_data(...)``: that dict plus what the page shows besides the model:
  example sentences of the corpus (training and held out) and the "Cat sat mat"
  numbers of ``firstprinciples.examples``.
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

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import examples as worked
from .corpus import ANIMATE, Vocab, make_corpus, make_example
from .model import WEIGHTS, TinyGPT, load_trained

ASSETS = Path(__file__).with_name("explorer")  # explorer.js and explorer.css, shipped with the package
FORMAT = "firstprinciples-tinygpt/1"
GLOBAL_NAME = "FP_EXPLORER_DATA"


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
    return {"format": FORMAT, "config": config, "vocab": list(vocab.tokens), "params": params}


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


__all__ = ["export_model", "explorer_model", "explorer_data", "example_sentences", "cat_sat_mat", "write_explorer_assets", "ASSETS"]
