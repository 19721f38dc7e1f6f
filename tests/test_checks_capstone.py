"""Every capstone check accepts right answers and rejects wrong ones.

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
from firstprinciples.capstone.model import TinyGPT, generate_greedy, load_trained
from firstprinciples.capstone.train import train
from firstprinciples.checks import capstone as C
from checktable import assert_names_the_mistake, assert_passes, outcome, rejections_test, variants_test


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


# ====================================================================== table 1: the model and cached generation
MODEL_CHECKS = {
    "structure": lambda a: C.check_model_structure(a.StudentGPT, a.TransformerBlock),
    "forward": lambda a: C.check_model_forward(a.StudentGPT),
    "forward_visible": lambda a: C.check_model_forward(a.StudentGPT, full=False),
    "causal": lambda a: C.check_model_causal(a.StudentGPT),
    "generate": lambda a: C.check_generate_cached(a.generate_cached, a.StudentGPT, a.KVCache),
    "generate_visible": lambda a: C.check_generate_cached(a.generate_cached, a.StudentGPT, a.KVCache, full=False),
}
ALL = set(MODEL_CHECKS)
FORWARD = {"forward", "forward_visible"}
GENERATE = {"generate", "generate_visible"}


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


class ReferenceBlocks(GoodGPT):
    Block = reference.TransformerBlock


class TorchLayerBlock(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.0):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, activation="gelu",
                                                batch_first=True, norm_first=True)

    def forward(self, x, mask=None):
        return self.layer(x, src_mask=mask), None


class TorchLayerGPT(GoodGPT):
    Block = TorchLayerBlock


class DropoutLeftOn(GoodGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.blocks = nn.ModuleList([GoodBlock(d_model, n_heads) for _ in range(n_layers)])  # default 0.1


class PlainList(GoodGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        blocks = list(self.blocks)
        del self.blocks
        self.blocks = blocks


class HeadWithBias(GoodGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.head = nn.Linear(d_model, vocab_size)


class SinusoidalPositions(GoodGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        del self.pos
        self.register_buffer("pos", reference.sinusoidal_encoding(max_len, d_model))


class OtherBlockClass(nn.Module):
    """A correct block, but not the class the student pasted (the checks are given GoodBlock)."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), GoodMHA(d_model, n_heads)
        self.ln2, self.ffn, self.drop = nn.LayerNorm(d_model), GoodFFN(d_model), nn.Dropout(dropout)

    forward = GoodBlock.forward


class UsesOtherBlock(GoodGPT):
    Block = OtherBlockClass


MODEL_VARIANTS = {
    # the package's named mistakes
    "no positional embedding": (answer(StudentGPT=gpt("NoPos", embed=lambda s, idx: s.tok(idx))), FORWARD | GENERATE),
    "positions counted from 1": (
        answer(StudentGPT=gpt("FromOne", embed=lambda s, idx: s.tok(idx) + s.pos.weight[1: idx.shape[1] + 1])),
        FORWARD | GENERATE,
    ),
    "no causal mask": (answer(StudentGPT=gpt("NoMask", mask=lambda s, T, d: None)), FORWARD | {"causal"} | GENERATE),
    "no final LayerNorm": (
        answer(StudentGPT=gpt("NoLnF", forward=lambda s, idx: _forward_with(s, idx, final_ln=False))),
        FORWARD | GENERATE,
    ),
    "embeddings scaled by sqrt(d_model)": (
        answer(StudentGPT=gpt("Scaled", embed=lambda s, idx: s.tok(idx) * math.sqrt(s.tok.weight.shape[1])
                              + s.pos.weight[: idx.shape[1]])),
        FORWARD | GENERATE,
    ),
    "probabilities instead of logits": (
        answer(StudentGPT=gpt("Probs", forward=lambda s, idx: _forward_with(s, idx, probs=True))),
        FORWARD | GENERATE,
    ),
    # other wrong models
    "mask in the first block only": (
        answer(StudentGPT=gpt("MaskFirst", forward=lambda s, idx: _forward_with(s, idx, mask_blocks={0}))),
        FORWARD | {"causal", "generate"},  # the visible case has 2 blocks: the last position is unaffected
    ),
    "mask sees one token ahead": (
        answer(StudentGPT=gpt("Ahead", mask=lambda s, T, d: torch.triu(torch.full((T, T), float("-inf"), dtype=d), 2))),
        FORWARD | {"causal"} | GENERATE,
    ),
    "dropout left at 0.1": (answer(StudentGPT=DropoutLeftOn), {"structure"}),
    "blocks in a plain list": (answer(StudentGPT=PlainList), ALL),
    "head with a bias": (answer(StudentGPT=HeadWithBias), ALL),
    "sinusoidal positions instead of learned": (answer(StudentGPT=SinusoidalPositions), ALL),
    "blocks of another class": (answer(StudentGPT=UsesOtherBlock), {"structure"}),
    "blocks are the reference TransformerBlock": (answer(StudentGPT=ReferenceBlocks), ALL),
    "blocks are nn.TransformerEncoderLayer": (answer(StudentGPT=TorchLayerGPT), ALL),
    "uses the course's causal_mask": (
        answer(StudentGPT=gpt("RefMask", mask=lambda s, T, d: reference.causal_mask(T, d))),
        {"structure", "causal"} | FORWARD,  # cached decoding never calls forward itself
    ),
    "attentions of the last block only": (
        answer(StudentGPT=gpt("LastOnly", forward=lambda s, idx: (GoodGPT.forward(s, idx)[0], GoodGPT.forward(s, idx)[1][-1:]))),
        {"structure", "causal"} | FORWARD,
    ),
    "returns the logits only": (answer(StudentGPT=gpt("LogitsOnly", forward=lambda s, idx: GoodGPT.forward(s, idx)[0])), ALL),
    # wrong decoders (with a correct model)
    "positions restart at 0": (answer(generate_cached=make_generate(restart=True)), GENERATE),
    "a new cache at every step": (answer(generate_cached=make_generate(fresh=True)), GENERATE),
    "logits of the first position": (answer(generate_cached=make_generate(first=True)), GENERATE),
    "decoder skips the final LayerNorm": (answer(generate_cached=make_generate(no_ln=True)), GENERATE),
    "feed-forward skipped": (answer(generate_cached=make_generate(no_ffn=True)), GENERATE),
    "one cache shared by all blocks": (answer(generate_cached=make_generate(shared=True)), GENERATE),
    "recomputes the whole sequence": (answer(generate_cached=make_generate(recompute=True)), GENERATE),
    "decoder uses the reference KVCache": (answer(generate_cached=make_generate(Cache=reference.KVCache)), GENERATE),
    "decoder uses the reference step": (answer(generate_cached=make_generate(step=reference.cached_attention_step)), GENERATE),
    "calls the course's generate_greedy": (answer(generate_cached=lambda m, i, n: generate_greedy(m, i, n)), GENERATE),
    "returns the ids only": (answer(generate_cached=lambda m, i, n: good_generate(m, i, n)[0]), GENERATE),
}


def test_correct_answer_passes_every_model_check():
    for name, check in MODEL_CHECKS.items():
        assert_passes(check, answer(), f"the correct answer fails {name}")


class Wired(GoodGPT):
    """A second correct wiring, as TinyGPT writes it (self.pos of an arange, a triu mask)."""

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        mask = torch.triu(torch.full((T, T), float("-inf"), dtype=x.dtype), diagonal=1)
        weights = []
        for block in self.blocks:
            x, w = block(x, mask)
            weights.append(w)
        return self.head(self.ln_f(x)), weights


def test_tinygpt_wiring_passes():
    """The second correct wiring, with the independent block."""
    for name, check in MODEL_CHECKS.items():
        assert_passes(check, answer(StudentGPT=Wired), f"TinyGPT's wiring fails {name}")


test_model_variant_fails_exactly_the_expected_checks = variants_test(MODEL_CHECKS, MODEL_VARIANTS)
test_each_model_check_rejects_at_least_five_variants = rejections_test(MODEL_CHECKS, MODEL_VARIANTS)


@pytest.mark.parametrize("label", sorted(m.label for m in C.FORWARD_MISTAKES))
def test_forward_failure_names_the_mistake(label):
    assert_names_the_mistake(MODEL_CHECKS["forward_visible"], MODEL_VARIANTS[label][0], label)


@pytest.mark.parametrize("variant, label", [
    ("positions restart at 0", "positions restart at 0"),
    ("a new cache at every step", "a new cache at every step"),
    ("logits of the first position", "logits of the first position"),
    ("decoder skips the final LayerNorm", "no final LayerNorm"),
    ("feed-forward skipped", "feed-forward skipped"),
])
def test_generate_failure_names_the_mistake(variant, label):
    assert_names_the_mistake(MODEL_CHECKS["generate_visible"], MODEL_VARIANTS[variant][0], label)


def test_every_named_mistake_is_in_the_tables():
    for m in C.FORWARD_MISTAKES:
        assert m.label in MODEL_VARIANTS
    assert len(C.GENERATE_MISTAKES) == 5


def test_forward_mistakes_match_their_classes():
    """Each named forward mistake computes what the variant class of the same name does."""
    g = torch.Generator().manual_seed(0)
    cfg = C.SMALL
    P = C.random_parameters(g, dtype=torch.float64, **cfg)
    idx = torch.randint(0, cfg["vocab_size"], (2, 6), generator=g)
    for m in C.FORWARD_MISTAKES:
        model = MODEL_VARIANTS[m.label][0].StudentGPT(**cfg).double().eval()
        C.load_parameters(model, P)
        torch.testing.assert_close(model(idx)[0], m.fn(idx, P, cfg["n_heads"])[0], msg=m.label)


def test_reference_gpt_equals_tinygpt():
    g = torch.Generator().manual_seed(1)
    cfg = C.SMALL
    P = C.random_parameters(g, dtype=torch.float64, **cfg)
    model = TinyGPT(**cfg).double().eval()
    C.load_parameters(model, P)
    idx = torch.randint(0, cfg["vocab_size"], (2, 9), generator=g)
    logits, atts = model(idx)
    want = C.reference_gpt(idx, P, cfg["n_heads"])
    torch.testing.assert_close(logits, want[0], atol=1e-12, rtol=0)
    for a, w in zip(atts, want[1:]):
        torch.testing.assert_close(a, w, atol=1e-12, rtol=0)
    assert C.parameter_count(**cfg) == sum(p.numel() for p in model.parameters())


def test_structure_messages():
    ok, err = outcome(MODEL_CHECKS["structure"], MODEL_VARIANTS["dropout left at 0.1"][0])
    assert "dropout=0.0" in str(err), str(err)
    ok, err = outcome(MODEL_CHECKS["structure"], MODEL_VARIANTS["blocks of another class"][0])
    assert "your own TransformerBlock" in str(err), str(err)
    ok, err = outcome(MODEL_CHECKS["generate_visible"], MODEL_VARIANTS["recomputes the whole sequence"][0])
    assert "KVCache" in str(err), str(err)
    ok, err = outcome(MODEL_CHECKS["structure"], MODEL_VARIANTS["blocks are nn.TransformerEncoderLayer"][0])
    assert "scores 0" in str(err), str(err)


def test_recompute_is_caught_by_the_row_count():
    """A decoder that uses the caches but also re-runs the prefix is named by the key-row count."""
    def both(model, ids, n_new):
        model(ids)  # an extra full pass on the prompt
        for _ in range(n_new):
            model(ids)
        return good_generate(model, ids, n_new)

    ok, err = outcome(MODEL_CHECKS["generate_visible"], answer(generate_cached=both))
    assert not ok and "re-projects the prefix" in str(err), str(err)


def test_checks_leave_the_global_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for check in MODEL_CHECKS.values():
        check(answer())
    assert torch.equal(torch.rand(3), expected)


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
    "leaks the future": (trained_answer("leaks the future"), T_ALL),  # and its cached decoding differs
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
