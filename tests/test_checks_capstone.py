"""The capstone's trained-model checks accept right answers and reject wrong ones.

(``StudentGPT`` and ``generate_cached`` are declared in ``firstprinciples.exercises.capstone``: their
tests are the generic harness's, ``tests/exercises/test_declarations.py``, with ``capstone_answers.py``
and the messages of ``tests/exercises/test_capstone.py``. What is left here is the trained model's
three cells, still in ``checks.capstone``: this file goes when they are declared.)


The capstone's checks take several of the student's answers at once (their
``StudentGPT``, ``TransformerBlock``, ``KVCache``, ``generate_cached`` and, for
the training checks, their trained model), so an "answer" here is a bundle of
them and each check is called on the bundle. Right answers: an independent
implementation written here (einsum attention, its own cache and step, a GPT
with a differently built mask), and a second wiring written the way TinyGPT is.
Wrong answers: the package's named mistakes, and others (dropout left on, a
plain list of blocks, the reference pieces, PyTorch's encoder layer, a
recomputing or cache-less decoder, an untrained or leaking model, ...). The
tables say exactly which checks each variant must fail; every check rejects at
least five variants. Training here is short: one correct model with the
exercise's budget (300 steps, about 7 s) and two smaller runs.
"""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from firstprinciples import reference
from firstprinciples.capstone import make_corpus
from firstprinciples.capstone.model import load_trained
from firstprinciples.capstone.train import train
from firstprinciples.checks import capstone as C
from checktable import assert_passes, outcome, rejections_test, variants_test


# ====================================================================== independent correct pieces
class GoodMHA(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        return mha_from_parts(self, x, x, mask)


def heads(t, n_heads):
    return t.unflatten(-1, (n_heads, -1)).permute(0, 2, 1, 3)  # (B, H, T, d_k)


def attend(q, K, V, mask=None):
    s = torch.einsum("bhqd,bhkd->bhqk", q, K) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s + mask
    w = s.softmax(dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", w, V).permute(0, 2, 1, 3).flatten(2), w  # (B, T, d_model)


def mha_from_parts(m, xq, xkv, mask):
    out, w = attend(heads(m.W_q(xq), m.n_heads), heads(m.W_k(xkv), m.n_heads), heads(m.W_v(xkv), m.n_heads), mask)
    return m.W_o(out), w


class GoodFFN(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class GoodBlock(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = GoodMHA(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = GoodFFN(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln2(x))), w


class GoodCache:
    def __init__(self):
        self.K = self.V = None

    def append(self, k, v):
        self.K = k if self.K is None else torch.cat([self.K, k], dim=2)
        self.V = v if self.V is None else torch.cat([self.V, v], dim=2)
        return self.K, self.V

    def __len__(self):
        return 0 if self.K is None else self.K.shape[2]


def good_step(x_new, cache, mha):
    T_new, T_past = x_new.shape[1], len(cache)
    K, V = cache.append(heads(mha.W_k(x_new), mha.n_heads), heads(mha.W_v(x_new), mha.n_heads))
    mask = torch.zeros(T_new, T_past + T_new, dtype=x_new.dtype)
    rows, cols = torch.arange(T_new)[:, None] + T_past, torch.arange(T_past + T_new)[None]
    mask = mask.masked_fill(cols > rows, float("-inf"))
    out, w = attend(heads(mha.W_q(x_new), mha.n_heads), K, V, mask)
    return mha.W_o(out), w


def causal(T, dtype):
    i = torch.arange(T)
    return torch.zeros(T, T, dtype=dtype).masked_fill(i[None] > i[:, None], float("-inf"))


class GoodGPT(nn.Module):
    Block = GoodBlock

    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList([self.Block(d_model, n_heads, 0.0) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def embed(self, idx):
        return self.tok(idx) + self.pos.weight[: idx.shape[1]]

    def mask(self, T, dtype):
        return causal(T, dtype)

    def forward(self, idx):
        x = self.embed(idx)
        mask = self.mask(idx.shape[1], x.dtype)
        atts = []
        for block in self.blocks:
            x, w = block(x, mask)
            atts.append(w)
        return self.head(self.ln_f(x)), atts


def make_generate(Cache=GoodCache, step=good_step, *, restart=False, fresh=False, first=False, no_ln=False,
                  no_ffn=False, shared=False, recompute=False):
    def generate_cached(model, ids, n_new):
        if recompute:
            out = []
            with torch.no_grad():
                for _ in range(n_new):
                    logits = model(ids)[0][:, -1]
                    out.append(logits)
                    ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            return ids, torch.stack(out, 1)
        one = Cache()
        caches = [one] * len(model.blocks) if shared else [Cache() for _ in model.blocks]
        new, out, seen = ids, [], 0
        with torch.no_grad():
            for _ in range(n_new):
                if fresh:
                    caches = [Cache() for _ in model.blocks]
                start = 0 if restart else seen
                x = model.tok(new) + model.pos(torch.arange(start, start + new.shape[1]))
                for block, cache in zip(model.blocks, caches):
                    a, _ = step(block.ln1(x), cache, block.attn)
                    x = x + a
                    if not no_ffn:
                        x = x + block.ffn(block.ln2(x))
                h = x[:, 0] if first else x[:, -1]
                logits = model.head(h if no_ln else model.ln_f(h))
                out.append(logits)
                seen += new.shape[1]
                new = logits.argmax(-1, keepdim=True)
                ids = torch.cat([ids, new], dim=1)
        return ids, torch.stack(out, dim=1)

    return generate_cached


good_generate = make_generate()


def answer(**changes):
    base = dict(StudentGPT=GoodGPT, TransformerBlock=GoodBlock, KVCache=GoodCache, generate_cached=good_generate)
    return SimpleNamespace(**{**base, **changes})


# ====================================================================== helpers of the trained table
def gpt(name, **methods):
    return type(name, (GoodGPT,), methods)


def _forward_with(self, idx, *, mask_blocks=None, final_ln=True, probs=False):
    x = self.embed(idx)
    full = self.mask(idx.shape[1], x.dtype)
    atts = []
    for i, block in enumerate(self.blocks):
        x, w = block(x, full if (mask_blocks is None or i in mask_blocks) else None)
        atts.append(w)
    logits = self.head(self.ln_f(x) if final_ln else x)
    return (logits.softmax(-1) if probs else logits), atts



class OtherBlockClass(nn.Module):
    """A correct block, but not the class the student pasted (the checks are given GoodBlock)."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), GoodMHA(d_model, n_heads)
        self.ln2, self.ffn, self.drop = nn.LayerNorm(d_model), GoodFFN(d_model), nn.Dropout(dropout)

    forward = GoodBlock.forward




# ====================================================================== table 2: the trained model
@pytest.fixture(scope="module")
def corpus():
    return the_corpus()


BUDGET = dict(steps=300, eval_every=300)  # the exercise's budget


@functools.lru_cache(maxsize=None)
def the_corpus():
    return make_corpus(seed=0)


@functools.lru_cache(maxsize=None)
def trained(kind):
    corpus = the_corpus()
    V = len(corpus.vocab)
    torch.manual_seed(0)
    if kind == "correct":
        return train(corpus, BUDGET, seed=0, model=GoodGPT(V))[0]
    if kind == "untrained":
        return GoodGPT(V).eval()
    if kind == "20 steps":
        return train(corpus, dict(steps=20, eval_every=20), seed=0, model=GoodGPT(V))[0]
    if kind == "leaks the future":
        return train(corpus, dict(steps=100, eval_every=100), seed=0, model=gpt("NoMask", mask=lambda s, T, d: None)(V))[0]
    if kind == "zero head":
        model = GoodGPT(V).eval()
        with torch.no_grad():
            model.head.weight.zero_()
        return model
    if kind == "wrong vocabulary size":
        return GoodGPT(V + 3).eval()
    if kind == "the reference TinyGPT":
        return load_trained()[0]
    raise KeyError(kind)


TRAINED_CHECKS = {
    "trained": lambda a: C.check_trained(trained(a.model), the_corpus(), a.TransformerBlock),
    "resolves": lambda a: C.check_resolves_it(trained(a.model), the_corpus(), a.TransformerBlock),
    "generate_trained": lambda a: C.check_generate_trained(a.generate_cached, trained(a.model), the_corpus(),
                                                           a.KVCache),
}
T_ALL = set(TRAINED_CHECKS)


def trained_answer(model="correct", **changes):
    return answer(model=model, **changes)


TRAINED_VARIANTS = {
    "untrained": (trained_answer("untrained"), {"trained", "resolves"}),
    "20 steps": (trained_answer("20 steps"), {"trained", "resolves"}),
    # (cached decoding is compared with the model's own parts wired as the course's model, with the causal
    # mask: the missing mask is the forward's mistake, charged by test_trained, not by the decoder's cell)
    "leaks the future": (trained_answer("leaks the future"), {"trained", "resolves"}),
    "zero head": (trained_answer("zero head"), {"trained", "resolves"}),
    "wrong vocabulary size": (trained_answer("wrong vocabulary size"), {"trained", "resolves"}),
    "the reference TinyGPT": (trained_answer("the reference TinyGPT"), T_ALL),  # decoding calls its FeedForward
    "blocks of another class": (trained_answer(TransformerBlock=OtherBlockClass), {"trained", "resolves"}),
    "positions restart at 0": (trained_answer(generate_cached=make_generate(restart=True)), {"generate_trained"}),
    "a new cache at every step": (trained_answer(generate_cached=make_generate(fresh=True)), {"generate_trained"}),
    "logits of the first position": (trained_answer(generate_cached=make_generate(first=True)), {"generate_trained"}),
    "decoder skips the final LayerNorm": (trained_answer(generate_cached=make_generate(no_ln=True)), {"generate_trained"}),
    "one cache shared by all blocks": (trained_answer(generate_cached=make_generate(shared=True)), {"generate_trained"}),
    "decoder uses the reference step": (
        trained_answer(generate_cached=make_generate(step=reference.cached_attention_step)), {"generate_trained"}
    ),
}


def test_correct_trained_model_passes(corpus, capsys):
    for name, check in TRAINED_CHECKS.items():
        assert_passes(check, trained_answer(), f"the correct trained model fails {name}")
    out = capsys.readouterr().out
    assert "held-out loss" in out and "max |logit difference|" in out


test_trained_variant_fails_exactly_the_expected_checks = variants_test(TRAINED_CHECKS, TRAINED_VARIANTS)
test_each_trained_check_rejects_at_least_five_variants = rejections_test(TRAINED_CHECKS, TRAINED_VARIANTS)


def test_training_messages():
    ok, err = outcome(TRAINED_CHECKS["trained"], TRAINED_VARIANTS["leaks the future"][0])
    assert "causal mask" in str(err), str(err)
    ok, err = outcome(TRAINED_CHECKS["trained"], TRAINED_VARIANTS["the reference TinyGPT"][0])
    assert "TinyGPT" in str(err), str(err)
    ok, err = outcome(TRAINED_CHECKS["trained"], TRAINED_VARIANTS["untrained"][0])
    assert "not below 0.8" in str(err), str(err)


def test_thresholds_sit_between_the_baselines_and_the_trained_model(corpus):
    """The stated thresholds: the trained model is well inside them, the baselines well outside."""
    from firstprinciples.capstone.train import held_out_loss, unigram_loss

    loss = held_out_loss(trained("correct"), corpus.held_out)
    assert C.LEAK_THRESHOLD < loss < C.LOSS_THRESHOLD - 0.1
    assert unigram_loss(corpus) > 3.0
    assert held_out_loss(trained("leaks the future"), corpus.held_out) < C.LEAK_THRESHOLD


# ====================================================================== the notebook, with the seed pasted in
def test_seed_pasted_into_the_notebook_gets_every_point(tmp_path):
    """The source notebook (hidden tests included) with the seed's attention function,
    MultiHeadAttention, FeedForward and TransformerBlock pasted into their answer cells
    passes every test: the capstone works with the seed's pieces as well as with the solution's."""
    import nbformat
    from nbgrader.validator import Validator

    from course import SOLUTIONS, with_answer
    from seeds import seed_code

    nb = nbformat.read(SOLUTIONS / "capstone" / "capstone.ipynb", as_version=4)
    for name in ("scaled_dot_product_attention", "MultiHeadAttention", "FeedForward", "TransformerBlock"):
        nb = with_answer(nb, name, seed_code(name))
    path = tmp_path / "capstone.ipynb"
    nbformat.write(nb, path)
    results = Validator(ignore_checksums=True).validate(str(path))
    assert not results.get("failed"), "\n\n".join(f["raw_error"][-2000:] for f in results["failed"])
