"""The capstone's messages (the old checks' tests, ported to the declaration: issue 40), and what
issue 42 asks of a composed piece: a mistake costs where it is made.

The generic harness (``test_declarations.py``) runs every answer of ``capstone_answers.py`` and every
declared mistake through both runners; here, what the student reads."""
from __future__ import annotations

import pytest
import torch

from exercises import capstone_answers as A
from exercises import transformer_block_answers as TB
from firstprinciples import exercises
from firstprinciples.exercises import capstone as D
from firstprinciples.exercises import transformer_block as tb
from firstprinciples.grading import declared

PIECES = {e.piece: e for e in exercises.pieces("capstone")}
TransformerBlock = A.TransformerBlock  # the notebook's own block, for the models written here (their globals)
MISTAKES = {(e.piece, m.label): m.fn for e in PIECES.values() for m in e.mistakes}


def failure(check, *args) -> Exception:
    with pytest.raises(Exception) as err:
        check(*args)
    return err.value


def message(grade_id: str, answer) -> str:
    return str(failure(declared.check_for("capstone"), grade_id, answer))


class OtherBlock(TB.GoodBlock):
    """A correct block of a class other than the notebook's TransformerBlock."""


class UsesOtherBlock(A.PlainGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.blocks = torch.nn.ModuleList(OtherBlock(d_model, n_heads, dropout=0.0) for _ in range(n_layers))


def generate_and_recompute(model, ids, n_new):
    """Uses the caches, but also runs the whole prompt through the model at every step."""
    for _ in range(n_new):
        model(ids)
    return A.plain_generate(model, ids, n_new)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the old checks' messages
    ("test_model_structure", MISTAKES[("StudentGPT", "blocks with dropout")], ["dropout=0.0", "blocks with dropout"]),
    ("test_model_structure", UsesOtherBlock, ["your own TransformerBlock", "OtherBlock"]),
    ("test_model_structure", MISTAKES[("StudentGPT", "a head with a bias")], ["bias=False"]),
    ("test_model_structure", A.BlocksInAList, ["nn.ModuleList", "plain Python list"]),
    ("test_model_structure", MISTAKES[("StudentGPT", "head tied to the token embeddings")],
     ["parameters but should have", "a matrix of its own"]),
    ("test_model_forward", MISTAKES[("StudentGPT", "no final LayerNorm")],
     ["wired as the course's model", "no final LayerNorm"]),
    ("test_model_forward", A.WeightsReversed, ["attention weights of block 0", "wired"]),
    ("test_model_causal", MISTAKES[("StudentGPT", "no causal mask")], ["causal mask", "later position"]),
    ("test_model_forward", A.ModifiesIds, ["modified its input idx in place"]),
    ("test_generate_cached", A.generate_uncached, ["KVCache"]),
    ("test_generate_cached", generate_and_recompute, ["re-projects the prefix"]),
    ("test_generate_cached", A.generate_one_cache, ["one of your KVCache per block"]),
    ("test_generate_cached", MISTAKES[("generate_cached", "positions restart at 0")],
     ["without a cache", "positions restart at 0"]),
    ("test_generate_cached", A.generate_ids_only, ["should return a tuple (ids, logits)"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


@pytest.mark.parametrize("grade_id, answer", [("test_model_structure", A.SubclassesTinyGPT),
                                              ("test_model_forward", A.CourseBlocks),
                                              ("test_generate_cached", A.generate_calls_reference)])
def test_forbidden_call_messages_are_clear(grade_id, answer):
    from firstprinciples.guard import ForbiddenCall

    err = failure(declared.check_for("capstone"), grade_id, answer)
    assert isinstance(err, ForbiddenCall) and "scores 0" in str(err), err


# ---------------------------------------------------------------- issue 42: a mistake costs where it is made
def _model_with_blocks(block_class):
    """A correct StudentGPT whose notebook's TransformerBlock is ``block_class`` (its globals say so)."""
    namespace = {"nn": torch.nn, "torch": torch, "TransformerBlock": block_class}
    exec(compile("class StudentGPT(nn.Module):\n"
                 "    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):\n"
                 "        super().__init__()\n"
                 "        self.tok = nn.Embedding(vocab_size, d_model)\n"
                 "        self.pos = nn.Embedding(max_len, d_model)\n"
                 "        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, dropout=0.0)\n"
                 "                                    for _ in range(n_layers))\n"
                 "        self.ln_f = nn.LayerNorm(d_model)\n"
                 "        self.head = nn.Linear(d_model, vocab_size, bias=False)\n"
                 "    def forward(self, idx):\n"
                 "        T = idx.shape[1]\n"
                 "        x = self.tok(idx) + self.pos(torch.arange(T))\n"
                 "        mask = torch.triu(torch.full((T, T), float('-inf'), dtype=x.dtype), diagonal=1)\n"
                 "        weights = []\n"
                 "        for block in self.blocks:\n"
                 "            x, w = block(x, mask)\n"
                 "            weights.append(w)\n"
                 "        return self.head(self.ln_f(x)), weights\n", "<answer>", "exec"), namespace)
    return namespace["StudentGPT"]


class TanhBlock(TB.GoodBlock):
    """A block whose feed-forward network uses the tanh approximation of GELU (the block's mistake)."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ffn = tb._FFNTanhGELU(d_model)


def test_a_wrong_block_costs_only_its_recap_cell():
    """Issue 42: the model's tests compare the model with its own blocks wired as the course's model,
    so a model built of blocks with a tanh GELU passes every model test (its block recap fails)."""
    model = _model_with_blocks(TanhBlock)
    for grade_id in ("test_model_structure", "test_model_forward", "test_model_causal"):
        declared.check_for("capstone")(grade_id, model)
    text = message("recap_feed_forward", tb._FFNTanhGELU)
    assert "tanh approximation of GELU" in text, text


def test_cached_decoding_is_judged_with_the_students_own_model():
    """Issue 42: test_generate_cached decodes a seeded model of the notebook's own StudentGPT and compares
    with that model's own uncached decoding: with blocks whose GELU is the tanh approximation, a right
    decoder passes."""
    model = _model_with_blocks(TanhBlock)
    namespace = {"StudentGPT": model, "KVCache": A.KVCache, "cached_attention_step": A.cached_attention_step}
    (c,) = D.GENERATE_CACHED.visible
    out = D.generate_adapter(A.plain_generate, declared.tensors(c), namespace)
    plain = {k: exercises.plain(v) for k, v in out.items()}
    B, T_p = c["ids"].shape
    assert D.judge_decoding(plain, B, T_p, int(c["n_new"]), int(c["n_layers"])) is None
    # (and the model decoded was the student's: its logits are not those of the declaration's own model)
    theirs = D.generate_adapter(A.plain_generate, declared.tensors(c), {})
    assert not torch.allclose(out["logits"], theirs["logits"])


class DoubledLogits(A.PlainGPT):
    """Causal, but its logits are twice the network's: a wrong value that keeps the causal test."""

    def forward(self, idx):
        logits, weights = super().forward(idx)
        return 2 * logits, weights


def test_the_causal_test_compares_no_values():
    """test_model_causal judges causality, not values (values=False): the doubled logits keep it and
    lose test_model_forward, in the kernel and in the re-check (the audit of the old probes, kept)."""
    from exercises.harness import kernel_failures, recheck_failures

    model = PIECES["StudentGPT"]
    assert set(kernel_failures(model, DoubledLogits)) == {"test_model_forward"}
    assert set(recheck_failures(model, DoubledLogits, 0)) == {"test_model_forward"}
