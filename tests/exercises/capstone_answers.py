"""capstone: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes, per piece: unusual correct answers, which must pass everywhere, and wrong answers that no
mistake names (a built-in or the course's pieces called, a wrong type, an input changed, a wrong
structure), each with the test cells it fails in the notebook (its visible cases) and in the trusted
re-check (the secret ones). The recaps of the earlier pieces reuse those exercises' answers.

The model's answers find "TransformerBlock" where they are defined (this module), as a notebook's
StudentGPT finds the notebook's: ``TransformerBlock`` below is a correct block of the student's kind."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from course import as_student_code
from exercises import kv_cache_answers as KV
from exercises import multi_head_attention_answers as M
from exercises import transformer_block_answers as TB
from firstprinciples import reference
from firstprinciples.capstone.model import TinyGPT, generate_greedy
from firstprinciples.exercises import capstone as D

PIECES = True

# ================================================================ the recaps of earlier pieces
ATTENTION, SPLIT, MERGE, MHA, FFN, BLOCK, CACHE, STEP = (
    "test_scaled_dot_product_attention", "test_split_heads", "recap_merge_heads", "test_multi_head_attention",
    "recap_feed_forward", "test_transformer_block", "recap_kv_cache", "test_cached_attention_step")


def _one(cell, kernel=True, recheck=True):
    return {cell} if kernel else set(), {cell} if recheck else set()


ATTENTION_WRONG = M.ATTENTION_WRONG  # (the same cell id as in the later notebooks)
SPLIT_WRONG = {
    "calls the reference": (M.split_calls_reference, *_one(SPLIT)),
    "returns numpy": (M.split_numpy, *_one(SPLIT)),
    "modifies its input": (M.split_in_place, *_one(SPLIT)),
    "casts to float32": (M.split_float32, *_one(SPLIT)),
    "hard-coded worked example": (M.split_hard_coded, *_one(SPLIT)),
    # (the notebook's cases have no gradient; the re-check's have: judged as in its own notebook)
    "detached": (M.split_detached, *_one(SPLIT, kernel=False)),
}
MERGE_WRONG = {
    "calls the reference": (M.merge_calls_reference, *_one(MERGE)),
    ".view on a transposed tensor": (M.merge_with_view, *_one(MERGE)),
    "returns numpy": (M.merge_numpy, *_one(MERGE)),
    "modifies its input": (M.merge_in_place, *_one(MERGE)),
    "casts to float32": (M.merge_float32, *_one(MERGE)),
}
MHA_WRONG = TB.MHA_WRONG  # (the same cell id as in the transformer block's notebook)
FFN_WRONG = {
    "subclasses the reference": (TB.FFNCallsReference, *_one(FFN)),
    "no biases": (TB.FFNNoBias, *_one(FFN)),
    "returns numpy": (TB.FFNNumpy, *_one(FFN)),
    "modifies its input": (TB.FFNInPlace, *_one(FFN)),
    "casts to float32": (TB.FFNFloat32, *_one(FFN)),
    "hidden layer d_model wide": (D.tb._FFNNarrow, *_one(FFN)),
}
BLOCK_WRONG = {
    "calls nn.TransformerEncoderLayer": (TB.CallsEncoderLayer, *_one(BLOCK)),
    "subclasses the reference": (TB.CallsReferenceBlock, *_one(BLOCK)),
    "the reference's attention": (TB.CallsReferenceAttention, *_one(BLOCK)),
    "one LayerNorm shared": (TB.SharedNorm, *_one(BLOCK)),
    "dropout on in eval mode too": (TB.DropoutAlsoInEval, *_one(BLOCK)),
    "returns numpy": (TB.BlockNumpy, *_one(BLOCK)),
    "modifies its input": (TB.BlockInPlace, *_one(BLOCK)),
    "returns the output only": (TB.BlockOutputOnly, *_one(BLOCK)),
}
CACHE_WRONG = {
    "subclasses the reference": (KV.CallsReferenceCache, *_one(CACHE)),
    "wraps the reference": (KV.WrapsReferenceCache, *_one(CACHE)),
    "modifies its inputs": (KV.ZeroesInputsCache, *_one(CACHE)),
    "returns numpy": (KV.NumpyCache, *_one(CACHE)),
    "casts to float32": (KV.Float32Cache, *_one(CACHE)),
    "K and V swapped": (KV.SwappedCache, *_one(CACHE)),
    "borrows the grader's cache": (KV.GraderCache, *_one(CACHE)),
}
STEP_WRONG = {
    "calls the reference": (KV.step_calls_reference, *_one(STEP)),
    "calls mha itself": (KV.step_calls_mha, *_one(STEP)),
    "calls torch's attention": (KV.step_calls_torch, *_one(STEP)),
    "returns the output only": (KV.step_output_only, *_one(STEP)),
    "returns numpy": (KV.step_numpy, *_one(STEP)),
    "modifies its input": (KV.step_modifies_input, *_one(STEP)),
    "weights averaged over heads": (KV.step_weights_averaged_over_heads, *_one(STEP)),
}


# ================================================================ StudentGPT
STRUCTURE, FORWARD, CAUSAL, GENERATE = D.STRUCTURE, D.FORWARD, D.CAUSAL, D.GENERATE
RUNS = {FORWARD, CAUSAL}
ALL = {STRUCTURE, FORWARD, CAUSAL}

TransformerBlock = TB.GoodBlock  # the notebook's own block, for the answers below


class PlainGPT(nn.Module):
    """A correct model as the notebook asks, written plainly."""

    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, dropout=0.0) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        mask = torch.triu(torch.full((T, T), float("-inf"), dtype=x.dtype), diagonal=1)
        weights = []
        for block in self.blocks:
            x, w = block(x, mask)
            weights.append(w)
        return self.head(self.ln_f(x)), weights


class IndexedGPT(nn.Module):
    """The embeddings read off their weights by indexing, the mask from a boolean lower triangle with
    torch.where, the blocks appended one by one, the head applied with F.linear, a tuple of weights."""

    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__()
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.ln_f = nn.LayerNorm(d_model)
        self.blocks = nn.ModuleList()
        for _ in range(n_layers):
            self.blocks.append(TransformerBlock(d_model, n_heads, dropout=0.0))
        self.pos = nn.Embedding(max_len, d_model)
        self.tok = nn.Embedding(vocab_size, d_model)

    def forward(self, idx):
        T = idx.shape[-1]
        x = self.tok.weight[idx] + self.pos.weight[:T]
        seen = torch.ones(T, T, dtype=torch.bool).tril()
        mask = torch.where(seen, torch.zeros((), dtype=x.dtype), torch.tensor(-math.inf, dtype=x.dtype))
        weights = ()
        for block in self.blocks:
            x, w = block(x, mask)
            weights = weights + (w,)
        return F.linear(self.ln_f(x), self.head.weight), weights


class ConfiguredGPT(PlainGPT):
    """Keeps its sizes as attributes and the mask as a non-persistent buffer cut to T."""

    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.d_model, self.max_len = d_model, max_len
        full = torch.triu(torch.full((max_len, max_len), float("-inf")), diagonal=1)
        self.register_buffer("causal", full, persistent=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T))
        mask = self.causal[:T, :T].to(x.dtype)
        weights = []
        for block in self.blocks:
            x, w = block(x, mask)
            weights.append(w)
        return self.head(self.ln_f(x)), weights


class SubclassesTinyGPT(TinyGPT):
    """The course's model itself (its blocks and mask are the course's)."""


class BlocksInAList(PlainGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        nn.Module.__init__(self)
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = [TransformerBlock(d_model, n_heads, dropout=0.0) for _ in range(n_layers)]  # hidden parameters
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)


class PositionsAParameter(PlainGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.pos = nn.Parameter(torch.zeros(max_len, d_model))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos[:T]
        mask = torch.triu(torch.full((T, T), float("-inf"), dtype=x.dtype), diagonal=1)
        weights = []
        for block in self.blocks:
            x, w = block(x, mask)
            weights.append(w)
        return self.head(self.ln_f(x)), weights


class AlwaysTwoBlocks(PlainGPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, 2, max_len)


class LogitsOnly(PlainGPT):
    def forward(self, idx):
        return super().forward(idx)[0]


class LogitsNumpy(PlainGPT):
    def forward(self, idx):
        logits, weights = super().forward(idx)
        return logits.detach().numpy(), weights


class ModifiesIds(PlainGPT):
    def forward(self, idx):
        out = super().forward(idx)
        idx.zero_()
        return out


class WeightsReversed(PlainGPT):
    def forward(self, idx):
        logits, weights = super().forward(idx)
        return logits, weights[::-1]


class CourseBlocks(PlainGPT):
    """Blocks of the course's TransformerBlock, not the notebook's."""

    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.blocks = nn.ModuleList(reference.TransformerBlock(d_model, n_heads, dropout=0.0)
                                    for _ in range(n_layers))


MODEL_CORRECT = {"reference": as_student_code(TinyGPT), "plain": PlainGPT, "indexed, torch.where": IndexedGPT,
                 "a mask buffer": ConfiguredGPT}
MODEL_WRONG = {
    "subclasses TinyGPT": (SubclassesTinyGPT, ALL, ALL),
    "the course's blocks": (CourseBlocks, ALL, ALL),
    "blocks in a Python list": (BlocksInAList, ALL, ALL),
    "positions a bare nn.Parameter": (PositionsAParameter, ALL, ALL),
    # (the notebook's forward and causal cases have two blocks; the re-check's have three too)
    "n_layers ignored": (AlwaysTwoBlocks, {STRUCTURE}, ALL),
    "returns the logits only": (LogitsOnly, RUNS, RUNS),
    "returns numpy logits": (LogitsNumpy, RUNS, RUNS),
    "modifies the ids": (ModifiesIds, RUNS, RUNS),
    "attention weights in reverse order": (WeightsReversed, {FORWARD}, {FORWARD}),
}


# ================================================================ generate_cached
KVCache = KV.CatCache  # the notebook's own cache and step, for the answers below
cached_attention_step = KV.einsum_step


def plain_generate(model, ids, n_new):
    """A correct decoder as the notebook asks."""
    caches = [KVCache() for _ in model.blocks]
    new, steps = ids, []
    with torch.no_grad():
        for _ in range(n_new):
            T_past = len(caches[0])
            x = model.tok(new) + model.pos(torch.arange(T_past, T_past + new.shape[1]))
            for block, cache in zip(model.blocks, caches):
                a, _ = cached_attention_step(block.ln1(x), cache, block.attn)
                x = x + a
                x = x + block.ffn(block.ln2(x))
            logits = model.head(model.ln_f(x[:, -1]))
            steps.append(logits)
            new = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, new], dim=1)
    return ids, torch.stack(steps, dim=1)


def generate_counting_positions(model, ids, n_new):
    """Positions from a counter of its own, caches in a dict, the new ids collected in a list, the
    argmax by topk, the ids and logits assembled at the end."""
    caches = {i: KVCache() for i in range(len(model.blocks))}
    seen, new, picked, steps = 0, ids, [], []
    for _ in range(n_new):
        with torch.no_grad():
            x = model.tok(new) + model.pos.weight[seen:seen + new.shape[1]]
            seen += new.shape[1]
            for i, block in enumerate(model.blocks):
                x = x + cached_attention_step(block.ln1(x), caches[i], block.attn)[0]
                x = x + block.ffn(block.ln2(x))
            logits = model.head(model.ln_f(x))[:, -1, :]
        new = logits.topk(1, dim=-1).indices
        picked.append(new)
        steps.append(logits)
    return torch.cat([ids, *picked], dim=1), torch.stack(steps, dim=1)


def generate_prompt_token_by_token(model, ids, n_new):
    """The prompt fed one token at a time (each projected once): the same numbers, more steps."""
    caches = [KVCache() for _ in model.blocks]
    out, steps = ids, []
    with torch.no_grad():
        feed = [ids[:, t:t + 1] for t in range(ids.shape[1])]
        while len(steps) < n_new:
            for new in feed:
                T_past = len(caches[0])
                x = model.tok(new) + model.pos(torch.arange(T_past, T_past + 1))
                for block, cache in zip(model.blocks, caches):
                    x = x + cached_attention_step(block.ln1(x), cache, block.attn)[0]
                    x = x + block.ffn(block.ln2(x))
            logits = model.head(model.ln_f(x[:, -1]))
            steps.append(logits)
            feed = [logits.argmax(-1, keepdim=True)]
            out = torch.cat([out, feed[0]], dim=1)
    return out, torch.stack(steps, dim=1)


def generate_calls_reference(model, ids, n_new):
    return generate_greedy(model, ids, n_new)


def generate_uncached(model, ids, n_new):
    """No cache at all: the whole sequence through the model at every step."""
    steps = []
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(ids)[0][:, -1]
            steps.append(logits)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids, torch.stack(steps, dim=1)


def generate_one_cache(model, ids, n_new):
    """One cache shared by every block."""
    cache = KVCache()
    new, steps, seen = ids, [], 0
    with torch.no_grad():
        for _ in range(n_new):
            x = model.tok(new) + model.pos(torch.arange(seen, seen + new.shape[1]))
            seen += new.shape[1]
            for block in model.blocks:
                x = x + cached_attention_step(block.ln1(x), cache, block.attn)[0]
                x = x + block.ffn(block.ln2(x))
            logits = model.head(model.ln_f(x[:, -1]))
            steps.append(logits)
            new = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, new], dim=1)
    return ids, torch.stack(steps, dim=1)


def generate_new_tokens_only(model, ids, n_new):
    out, logits = plain_generate(model, ids, n_new)
    return out[:, ids.shape[1]:], logits


def generate_modifies_prompt(model, ids, n_new):
    out = plain_generate(model, ids, n_new)
    ids.zero_()
    return out


def generate_float_ids(model, ids, n_new):
    out, logits = plain_generate(model, ids, n_new)
    return out.double(), logits


def generate_ids_only(model, ids, n_new):
    return plain_generate(model, ids, n_new)[0]


GENERATE_CORRECT = {"reference": as_student_code(generate_greedy), "plain": plain_generate,
                    "a position counter, topk": generate_counting_positions,
                    "the prompt token by token": generate_prompt_token_by_token}
G = {GENERATE}
GENERATE_WRONG = {
    "calls the reference": (generate_calls_reference, G, G),
    "no cache": (generate_uncached, G, G),
    "one cache for every block": (generate_one_cache, G, G),
    "returns the new tokens only": (generate_new_tokens_only, G, G),
    "modifies the prompt": (generate_modifies_prompt, G, G),
    "float ids": (generate_float_ids, G, G),
    "returns the ids only": (generate_ids_only, G, G),
}

CORRECT = {"scaled_dot_product_attention": M.ATTENTION_CORRECT, "split_heads": M.SPLIT_CORRECT,
           "merge_heads": M.MERGE_CORRECT, "MultiHeadAttention": M.MHA_CORRECT, "FeedForward": TB.FFN_CORRECT,
           "TransformerBlock": TB.BLOCK_CORRECT, "KVCache": KV.CORRECT["KVCache"],
           "cached_attention_step": KV.CORRECT["cached_attention_step"], "StudentGPT": MODEL_CORRECT,
           "generate_cached": GENERATE_CORRECT}
WRONG = {"scaled_dot_product_attention": ATTENTION_WRONG, "split_heads": SPLIT_WRONG, "merge_heads": MERGE_WRONG,
         "MultiHeadAttention": MHA_WRONG, "FeedForward": FFN_WRONG, "TransformerBlock": BLOCK_WRONG,
         "KVCache": CACHE_WRONG, "cached_attention_step": STEP_WRONG, "StudentGPT": MODEL_WRONG,
         "generate_cached": GENERATE_WRONG}
