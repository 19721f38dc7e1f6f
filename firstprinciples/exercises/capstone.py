"""The capstone: the student's own GPT and its cached decoding, declared once.

- ``StudentGPT(vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32)``: the parts of the
  course's ``TinyGPT``: ``tok`` (nn.Embedding(vocab_size, d_model)), ``pos`` (nn.Embedding(max_len,
  d_model), learned positions), ``blocks`` (an nn.ModuleList of the notebook's own
  ``TransformerBlock(d_model, n_heads, dropout=0.0)``), ``ln_f`` (nn.LayerNorm(d_model)) and ``head``
  (nn.Linear(d_model, vocab_size, bias=False)); ``forward(idx (B, T) long)`` returns (logits (B, T,
  vocab_size), a list of the blocks' attention weights (B, n_heads, T, T)), with the causal mask.
- ``generate_cached(model, ids, n_new)``: greedy decoding with one of the notebook's ``KVCache`` per
  block and its ``cached_attention_step``; returns (ids (B, T_p + n_new), logits (B, n_new,
  vocab_size)), the logits each new token was picked from.

Decisions stated once (issue 42: a mistake costs where it is made):

- The model's tests judge the model's own wiring, not its blocks: ``test_model_forward`` compares
  ``StudentGPT(idx)`` with the same wiring written out over the model's OWN parts (``tok(idx) +
  pos(0..T-1)``, each of its blocks with the causal mask, ``ln_f``, ``head``), both run in the
  adapter on seeded parameters loaded by name. A wrong block (a tanh GELU, attention divided by d_k)
  costs only its own recap cell (``recap_feed_forward``, ``test_transformer_block``); a wrong wiring
  costs ``test_model_forward``. The comparison with the course's ``TinyGPT`` (the reference) is of
  type, dtype and shape only (``values=False``).
- ``test_generate_cached`` compares the answer's cached decoding with uncached greedy decoding of the
  same model, both in the adapter: the model is the notebook's own ``StudentGPT`` (``needs``) with
  seeded parameters, so a decoder is judged with the student's parts (their blocks, a tanh GELU
  included), not the course's; where the notebook has no StudentGPT class, the adapter's own correct
  model (``_GPT``) stands in. Uncached decoding runs the model's own parts wired as the course's
  model (``wired``) on the whole sequence at every step, not the model's ``forward``: a wrong forward
  (no positions, say) costs ``test_model_forward`` only, not the decoder's cells too. The token ids must be equal and the logits equal within the
  float64 defaults of ``grading.compare`` (the cache does the same sums grouped otherwise: about
  1e-15); forward hooks count the key rows each block's ``attn.W_k`` projects (the prompt once, then
  one per token), and the objects of the notebook's ``KVCache`` that a method of the class is called
  on are counted (one cache per block). The adapter never reads ``attn.n_heads`` or ``d_k``: the
  student's ``cached_attention_step`` may (the contract multi_head_attention states).
- ``test_model_structure``: the parts and their sizes as plain data, every block an instance of the
  notebook's own ``TransformerBlock`` (looked up where the class is defined: the notebook's
  namespace), no dropout above 0, the parameter count; one forward pass under the guard.
- ``test_model_causal``: no block gives weight to a later position, and changing the tokens after
  position t leaves the logits at 0..t unchanged (float64 defaults).
- The trained model (``model``, ``test_trained`` and ``test_resolves_it``) has no reference: its tests
  judge what it gives on the course's public held-out sentences by the thresholds below (``TRAINED``,
  ``reference`` ""). The re-check does not train it again: it rebuilds the notebook's ``StudentGPT``
  from the parameters the kernel ended with (``rebuild``). What that can prove, and what not: the
  thresholds are applied by the grader to what the model object gave; that the object is a network
  trained here is what the locked training cell and the StudentGPT tests stand for (a kernel that
  forges its model's outputs is not told apart by outputs alone: the threat model).
- ``test_generate_trained`` (``TRAINED_DECODING``, in the notebook only) decodes held-out prompts with
  the answer's ``generate_cached`` and the kernel's trained model, against its own decoding without a
  cache (``TRAINED_LOGIT_TOL``); the re-check judges the decoder by ``elsewhere`` below (random models:
  a trained model decodes right only with a right decoder).
- The notebook's recaps of the earlier pieces are those exercises' (``exercises.recap``).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import numpy as np
import torch
from torch import nn

from .. import given
from . import Exercise, Mistake, Test, attention, case, globals_of, kv_cache as kv, multi_head_attention as mha, recap
from . import transformer_block as tb
from .transformer_block import _Attention, _FeedForward
from .multi_head_attention import describe_layer

NAME = "capstone"
STRUCTURE, FORWARD, CAUSAL, GENERATE = ("test_model_structure", "test_model_forward", "test_model_causal",
                                        "test_generate_cached")
GENERATE_TRAINED = "test_generate_trained"

TORCH_PATTERNS = tb.TORCH_PATTERNS
PIECE_NAMES = ("TransformerBlock", "FeedForward", "MultiHeadAttention", "split_heads", "merge_heads",
               "scaled_dot_product_attention", "causal_mask", "KVCache", "cached_attention_step", "generate",
               "generate_cached")
CONFIG = ("vocab_size", "d_model", "n_heads", "n_layers", "max_len")
# A small model for the value tests: vocabulary 11, width 16, 2 heads, 2 blocks, 10 positions.
SMALL = dict(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_len=10)
EXERCISE_SIZE = dict(vocab_size=57, d_model=64, n_heads=4, n_layers=2, max_len=32)
# the float64 comparison of two computations of the same numbers (grading.compare's defaults)
ATOL, RTOL = 1e-10, 1e-8


def parameter_count(vocab_size, d_model, n_heads, n_layers, max_len):
    """Embeddings, blocks, final LayerNorm and a bias-free head."""
    return (vocab_size * d_model + max_len * d_model + n_layers * tb.block_parameter_count(d_model)
            + 2 * d_model + d_model * vocab_size)


def parameter_names(n_layers):
    """The model's parameters by name, as the cases hold them and the adapter loads them."""
    blocks = [f"blocks.{i}.{n}" for i in range(n_layers) for n in tb.BLOCK_PARAMS]
    return ("tok.weight", "pos.weight", *blocks, "ln_f.weight", "ln_f.bias", "head.weight")


# ================================================================ a correct model, and the mistakes
# (built on the correct pieces of the earlier declarations: transformer_block's attention and feed-forward,
# kv_cache's cache and step; the harness grades a mistake as a student's own code, every declaration it
# reaches recoded with it, tests/course.py::as_answer)
class TransformerBlock(nn.Module):
    """A correct pre-LN block (dropout an nn.Dropout, what the structure test looks for): every mistake
    below is a wiring mistake, not a block's."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = _FeedForward(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln2(x))), w


# A correct model the decoder's adapter builds where the notebook has no StudentGPT (left out of a student
# bundle: ``firstprinciples.bundle``, where this message is the test's reason instead)
STAND_INS = {"_GPT": "this test decodes with your StudentGPT: define it (Step 1) and run its cell first."}


class _GPT(nn.Module):
    """A correct model with TinyGPT's parts, one step per method so that each mistake changes one. It
    also stands in for the notebook's StudentGPT where a decoder is judged without one."""

    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, dropout=0.0) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def embed(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))

    def mask(self, T, dtype):
        return torch.triu(torch.full((T, T), float("-inf"), dtype=dtype), diagonal=1)

    def finish(self, x):
        return self.head(self.ln_f(x))

    def forward(self, idx):
        x = self.embed(idx)
        mask = self.mask(idx.shape[1], x.dtype)
        weights = []
        for block in self.blocks:
            x, w = block(x, mask)
            weights.append(w)
        return self.finish(x), weights


class _NoPositions(_GPT):
    def embed(self, idx):
        return self.tok(idx)


class _PositionsFromOne(_GPT):
    def embed(self, idx):
        return self.tok(idx) + self.pos(torch.arange(1, idx.shape[1] + 1))


class _NoMask(_GPT):
    def mask(self, T, dtype):
        return None


class _NoFinalNorm(_GPT):
    def finish(self, x):
        return self.head(x)


class _ScaledEmbeddings(_GPT):
    def embed(self, idx):
        return self.tok(idx) * self.tok.weight.shape[1] ** 0.5 + self.pos(torch.arange(idx.shape[1]))


class _Probabilities(_GPT):
    def finish(self, x):
        return torch.softmax(super().finish(x), dim=-1)


class _HeadWithBias(_GPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.head = nn.Linear(d_model, vocab_size)


class _BlocksWithDropout(_GPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads) for _ in range(n_layers))  # dropout 0.1


class _TiedHead(_GPT):
    def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
        super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
        self.head.weight = self.tok.weight  # one matrix for both: TinyGPT keeps two


MODEL_MISTAKES = (
    Mistake("no positional embedding", "add self.pos(torch.arange(T)) to the token embeddings: without it the "
            "model cannot tell 'the dog ... the road' from 'the road ... the dog'.", _NoPositions,
            frozenset({FORWARD})),
    Mistake("positions counted from 1", "the first token has position 0: self.pos(torch.arange(T)).",
            _PositionsFromOne, frozenset({FORWARD})),
    Mistake("no causal mask", "pass the causal mask (0 on and below the diagonal, -inf above) to every block: "
            "without it each position sees the token it must predict.", _NoMask, frozenset({FORWARD, CAUSAL})),
    Mistake("no final LayerNorm", "apply self.ln_f to the last block's output before self.head.", _NoFinalNorm,
            frozenset({FORWARD})),
    Mistake("embeddings scaled by sqrt(d_model)", "TinyGPT adds the token and position embeddings as they are.",
            _ScaledEmbeddings, frozenset({FORWARD})),
    Mistake("probabilities instead of logits", "return the head's output itself: the loss applies the softmax.",
            _Probabilities, frozenset({FORWARD})),
    Mistake("a head with a bias", "the head is nn.Linear(d_model, vocab_size, bias=False).", _HeadWithBias,
            frozenset({STRUCTURE})),
    Mistake("blocks with dropout", "build the blocks with TransformerBlock(d_model, n_heads, dropout=0.0): the "
            "corpus is small and training is short.", _BlocksWithDropout, frozenset({STRUCTURE})),
    Mistake("head tied to the token embeddings", "TinyGPT's head has a weight of its own: self.head = "
            "nn.Linear(d_model, vocab_size, bias=False), not self.tok's matrix.", _TiedHead, frozenset({STRUCTURE})),
)


# ================================================================ the model's adapter
def looked_up(piece, name, namespace=None):
    """Another notebook object for an adapter (``needs``): ``name`` where the piece was defined (the
    notebook's namespace, in the kernel and in the re-check's runner alike), else ``namespace[name]``
    (the runner's namespace, or the course's objects for the reference), else None."""
    found = globals_of(piece).get(name)
    if found is None and isinstance(namespace, dict):
        found = namespace.get(name)
    return found


def build(cls, case):
    """``cls(vocab_size, d_model, n_heads, n_layers, max_len)`` (by keyword) under a fixed seed, the
    caller's random state left as it was: an nn.Module."""
    sizes = {k: int(case[k]) for k in CONFIG}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(**sizes)
    if not isinstance(model, nn.Module):
        raise AssertionError(f"StudentGPT(...) should build an nn.Module (a class that subclasses nn.Module and calls "
                             f"super().__init__()), but it built a {type(model).__name__}.")
    return model


def _blocks(model):
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise AssertionError(
            "StudentGPT.blocks should be an nn.ModuleList of your TransformerBlocks (a plain Python list hides their "
            "parameters from the optimizer); " + ("it has none." if blocks is None else
                                                 f"yours is a {type(blocks).__name__}."))
    return blocks


def _check_parts(model, case):
    """The parts the adapter loads and wires, with their sizes (the old checks' messages)."""
    V, d, L, M = (int(case[k]) for k in ("vocab_size", "d_model", "n_layers", "max_len"))
    for attr, shape in (("tok", (V, d)), ("pos", (M, d))):
        part = getattr(model, attr, None)
        if not isinstance(part, nn.Embedding):
            raise AssertionError(
                f"StudentGPT should have an attribute {attr} that is an nn.Embedding{shape}; "
                + ("it has none." if part is None else f"yours is a {type(part).__name__}.")
                + (" Learned positions: one trainable vector per position." if attr == "pos" else ""))
        if tuple(part.weight.shape) != shape:
            raise AssertionError(f"StudentGPT.{attr} should be nn.Embedding{shape}; its weight is "
                                 f"{tuple(part.weight.shape)}.")
    if len(_blocks(model)) != L:
        raise AssertionError(f"StudentGPT(..., n_layers={L}) should hold {L} blocks; it holds {len(model.blocks)}.")
    ln_f = getattr(model, "ln_f", None)
    if not isinstance(ln_f, nn.LayerNorm) or tuple(ln_f.normalized_shape) != (d,):
        raise AssertionError("StudentGPT should have an attribute ln_f = nn.LayerNorm(d_model), the final LayerNorm.")
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear) or tuple(head.weight.shape) != (V, d):
        raise AssertionError("StudentGPT should have an attribute head = nn.Linear(d_model, vocab_size, bias=False).")


def model_parameter(model, name):
    """A parameter of the model by its name ("tok.weight", "blocks.1.attn.W_q.weight", "head.weight")."""
    first, _, rest = name.partition(".")
    if first == "blocks":
        i, _, rest = rest.partition(".")
        return tb.block_parameter(model.blocks[int(i)], rest)
    return getattr(getattr(model, first), rest)


def loaded(cls, case):
    """The model of ``cls`` with the case's sizes, its parts checked, in the case's dtype and eval mode,
    the case's parameters loaded by name, frozen."""
    model = build(cls, case)
    _check_parts(model, case)
    model = model.to(case["tok.weight"].dtype).eval()
    tb.load(model, {n: case[n] for n in parameter_names(int(case["n_layers"]))}, model_parameter)
    return model.requires_grad_(False)


def _pair(result, what, names):
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return tuple(result)
    kind = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
    raise AssertionError(f"{what} returned a {kind}, expected a tuple ({', '.join(names)}).")


def _forward(model, idx, n_layers):
    """model(idx): (logits, [weights per block]), with what the tests demand of the result."""
    logits, atts = _pair(model(idx), "forward(idx)", ("logits", "attentions"))
    if not isinstance(logits, torch.Tensor):
        raise AssertionError(f"the logits should be a tensor; yours are a {type(logits).__name__}.")
    if not isinstance(atts, (list, tuple)) or len(atts) != n_layers or not all(isinstance(a, torch.Tensor)
                                                                               for a in atts):
        raise AssertionError(f"the attentions should be a list of {n_layers} tensors (B, n_heads, T, T), one per "
                             "block, in order: collect the weights each block returns.")
    return logits, list(atts)


def _causal_mask(T, dtype):
    return given.causal_mask(T, dtype)  # (PyTorch's own: the causal-mask exercise's answer is not written here)


def wired(model, idx):
    """The course's wiring written out over the model's own parts: tok(idx) + pos(0..T-1), each of its
    blocks with the causal mask, ln_f, head. (logits, [weights per block])."""
    x = model.tok(idx) + model.pos(torch.arange(idx.shape[1]))
    weights = []
    for block in model.blocks:
        x, w = _pair(block(x, _causal_mask(idx.shape[1], x.dtype)), "a block", ("output", "weights"))
        weights.append(w)
    return model.head(model.ln_f(x)), weights


def _describe_embedding(part) -> str:
    if part is None:
        return "missing"
    if not isinstance(part, nn.Embedding):
        return type(part).__name__
    return f"nn.Embedding({part.num_embeddings}, {part.embedding_dim})"


def own_blocks(model, own_block, subclasses: bool = False) -> str:
    """"yes" when the model's blocks, an nn.ModuleList, are all objects of the notebook's own
    TransformerBlock class ``own_block`` (``subclasses``: or of a class built on it); else "no: " and
    what the first other one is."""
    blocks = getattr(model, "blocks", None)
    listed = list(blocks) if isinstance(blocks, nn.ModuleList) else []

    def mine(b) -> bool:
        return isinstance(own_block, type) and (isinstance(b, own_block) if subclasses else type(b) is own_block)

    strangers = [type(b).__name__ for b in listed if not mine(b)]
    return "yes" if listed and not strangers else f"no: {strangers[0] if strangers else 'no blocks'}"


def structure_data(model, own_block) -> dict:
    """What the structure test judges, as plain data."""
    blocks = getattr(model, "blocks", None)
    kind = ("missing" if blocks is None else f"nn.ModuleList of {len(blocks)}" if isinstance(blocks, nn.ModuleList)
            else type(blocks).__name__)
    mine = own_blocks(model, own_block)
    ln_f = getattr(model, "ln_f", None)
    return {
        "tok": _describe_embedding(getattr(model, "tok", None)),
        "pos": _describe_embedding(getattr(model, "pos", None)),
        "blocks": kind,
        "blocks of the notebook's TransformerBlock": mine,
        "dropout above 0": ", ".join(n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0)
                           or "none",
        "ln_f": tb._describe_norm(ln_f),
        "head": describe_layer(getattr(model, "head", None)),
        "parameters": int(sum(p.numel() for p in model.parameters())),
    }


def model_adapter(piece, case):
    """Build ``StudentGPT`` with the case's sizes; a structure case: its parts as plain data, after one
    forward pass in eval mode whose errors do not matter (what it calls is still watched); else its
    parameters loaded by name, eval mode, and

    - a forward case: the logits and every block's weights, and the same of the model's own parts
      wired as the course's model (``wired``);
    - a causal case (``causal``): the largest weight any block gives to a later position, and the
      logits at positions 0..t with and without the tokens after t changed (t = 2, 5).

    Always the ids after the call."""
    idx = case["idx"].clone()
    if "tok.weight" not in case:  # a structure case
        model = build(piece, case)
        try:
            model.eval()(idx.clone())
        except Exception:
            pass
        return structure_data(model, looked_up(piece, "TransformerBlock"))
    model = loaded(piece, case)
    L = int(case["n_layers"])
    logits, atts = _forward(model, idx, L)
    res = {}
    if case.get("causal"):
        T, V = idx.shape[1], int(case["vocab_size"])
        above = [float(torch.triu(a.detach().double(), diagonal=1).abs().max()) if tuple(a.shape[-2:]) == (T, T)
                 else float("inf") for a in atts]
        res["largest weight on a later position"] = max(above)
        res["the first block that weights a later position"] = next((i for i, w in enumerate(above) if w > 0), -1)
        for t in (2, 5):
            changed = case["idx"].clone()
            changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.arange(T - t - 1)) % V
            res[f"logits at positions 0..{t}"] = logits[:, :t + 1]
            res[f"logits at positions 0..{t}, later tokens changed"] = _forward(model, changed.clone(), L)[0][:, :t + 1]
    else:
        res["logits"] = logits
        res.update({f"attention weights of block {i}": a for i, a in enumerate(atts)})
        w_logits, w_atts = wired(model, case["idx"].clone())
        res["logits, wired"] = w_logits
        res.update({f"attention weights of block {i}, wired": a for i, a in enumerate(w_atts)})
    res["idx after the call"] = idx
    return res


# ---------------------------------------------------------------- properties of the model (plain data)
def _close(a, b) -> bool:
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
            and np.allclose(a.astype(np.float64), b.astype(np.float64), atol=ATOL if a.dtype == np.float64 else 1e-5,
                            rtol=RTOL if a.dtype == np.float64 else 1e-4, equal_nan=True))


def model_structure(case, out, want):
    """tok, pos, blocks (an nn.ModuleList of the notebook's TransformerBlock), no dropout above 0,
    ln_f, a bias-free head, and the parameter count."""
    cfg = ", ".join(f"{k}={case[k]}" for k in CONFIG)
    for attr in ("tok", "pos"):
        if out.get(attr) != want[attr]:
            got = out.get(attr)
            return (f"StudentGPT({cfg}) should have an attribute {attr} that is {want[attr]}; "
                    + ("it has none." if got == "missing" else f"yours is {got}.")
                    + (" Learned positions: one trainable vector per position." if attr == "pos" else ""))
    if out.get("blocks") != want["blocks"]:
        got = out.get("blocks")
        return (f"StudentGPT({cfg}).blocks should be an nn.ModuleList of {case['n_layers']} of your TransformerBlocks "
                "(a plain Python list hides their parameters from the optimizer); "
                + ("it has none." if got == "missing" else f"yours is a {got}."))
    mine = str(out.get("blocks of the notebook's TransformerBlock"))
    if mine != "yes":
        return (f"StudentGPT's blocks should be objects of your own TransformerBlock class; one is a "
                f"{mine.removeprefix('no: ')}. Build them from the TransformerBlock pasted above, "
                "TransformerBlock(d_model, n_heads, dropout=0.0).")
    if out.get("dropout above 0") != "none":
        return ("build the blocks with dropout=0.0 (the corpus is small and training is short); these have p > 0: "
                f"{out.get('dropout above 0')}.")
    if out.get("ln_f") != want["ln_f"]:
        return f"StudentGPT should have an attribute ln_f = nn.LayerNorm(d_model), the final LayerNorm; yours is " \
               f"{out.get('ln_f')}."
    if out.get("head") != want["head"]:
        got = str(out.get("head"))
        if got.endswith("bias=True)"):
            return "StudentGPT.head should have no bias: nn.Linear(d_model, vocab_size, bias=False)."
        return f"StudentGPT should have an attribute head = {want['head']}; yours is {got}."
    if out.get("parameters") != want["parameters"]:
        L = case["n_layers"]
        return (f"StudentGPT({cfg}) has {out.get('parameters'):,} parameters but should have {want['parameters']:,}: "
                f"token embeddings V*d, positions max_len*d, {L} blocks of 12 d^2 + 9 d, ln_f 2 d and a bias-free "
                "head d*V (a matrix of its own).")
    return None


def same_as_wired(case, out, want):
    """The model's logits and weights are those of its own parts wired as the course's model."""
    keys = ["logits"] + [k for k in sorted(out) if k.startswith("attention weights of block") and "wired" not in k]
    for key in keys:
        got, ref = out.get(key), out.get(f"{key}, wired")
        if _close(got, ref):
            continue
        by = ""
        if case["show"] and isinstance(got, np.ndarray) and isinstance(ref, np.ndarray) and got.shape == ref.shape:
            by = f" (by up to {float(np.nanmax(np.abs(got.astype(np.float64) - ref.astype(np.float64)))):.3g})"
        return (f"its {key} differ from those of its own parts wired as the course's model{by}: "
                "x = tok(idx) + pos(positions 0..T-1), then every block with the causal mask, then head(ln_f(x)). "
                "(Your blocks are your own: their mistakes cost their recap cells, not this one.)")
    return None


def causal(case, out, want):
    """No block gives weight to a later position; changing the tokens after t leaves the logits at 0..t."""
    block = int(out.get("the first block that weights a later position", -1))
    if block >= 0:
        return (f"block {block}'s attention weights give weight"
                + (f" {out.get('largest weight on a later position'):.3g}" if case["show"] else "")
                + " to a later position. Every block needs the causal mask (-inf above the diagonal), or each "
                "position sees the token it is asked to predict.")
    for t in (2, 5):
        a, b = out.get(f"logits at positions 0..{t}"), out.get(f"logits at positions 0..{t}, later tokens changed")
        if not _close(a, b):
            by = (f" (by up to {float(np.nanmax(np.abs(a.astype(np.float64) - b.astype(np.float64)))):.3g})"
                  if case["show"] and isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                  else "")
            return (f"changing the tokens after position {t} changed the logits at positions 0..{t}{by}: your model "
                    "looks at later tokens. Pass the causal mask to every block.")
    return None


# ---------------------------------------------------------------- the model's cases
def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _model_weights(rng, cfg, dtype):
    """Every parameter of the model, seeded: embeddings N(0, 1), the blocks' as the block exercise draws
    them (LayerNorms random around 1 and 0), ln_f random around 1 and 0, the head N(0, 1/d_model)."""
    V, d, L, M = cfg["vocab_size"], cfg["d_model"], cfg["n_layers"], cfg["max_len"]
    w = {"tok.weight": _normal(rng, (V, d), dtype), "pos.weight": _normal(rng, (M, d), dtype)}
    for i in range(L):
        w.update({f"blocks.{i}.{n}": v for n, v in tb._block_weights(rng, d, dtype).items()})
    w["ln_f.weight"] = (1 + _normal(rng, (d,), "float64", 0.3)).astype(dtype)
    w["ln_f.bias"] = _normal(rng, (d,), dtype, 0.3)
    w["head.weight"] = _normal(rng, (V, d), dtype, d ** -0.5)
    return w


def _describe(cfg) -> str:
    return (f"a model of vocabulary {cfg['vocab_size']}, width {cfg['d_model']}, {cfg['n_heads']} heads, "
            f"{cfg['n_layers']} blocks, max_len {cfg['max_len']}")


def _structure_case(rng, cfg):
    return case(f"for StudentGPT({', '.join(f'{k}={cfg[k]}' for k in CONFIG)})", "structure", **cfg,
                idx=rng.integers(0, cfg["vocab_size"], size=(2, 5)).astype(np.int64))


def _model_case(rng, tags, B, T, dtype="float64", **sizes):
    cfg = {**SMALL, **sizes}
    extra = {"causal": True} if tags == "causal" else {}
    return case(f"for ids of shape {(B, T)}, {dtype}, {_describe(cfg)}, seeded parameters, eval mode", tags, **cfg,
                **extra, idx=rng.integers(0, cfg["vocab_size"], size=(B, T)).astype(np.int64), **_model_weights(rng, cfg, dtype))


def _model_visible() -> tuple:
    g = np.random.default_rng(601)
    return (_structure_case(g, EXERCISE_SIZE), _structure_case(g, dict(SMALL, n_layers=3)),
            _model_case(np.random.default_rng(600), "forward", 2, 7),
            _model_case(np.random.default_rng(700), "causal", 2, 8))


def model_secret(rng: np.random.Generator) -> list:
    """The structure at the visible sizes and a random one; the forward pass at every shape of the old
    hidden tests (one token, T = max_len, float32) and with three blocks; causality with two and three
    blocks."""
    H = int(rng.integers(1, 5))
    random_size = dict(vocab_size=int(rng.integers(5, 40)), d_model=H * int(rng.integers(1, 9)), n_heads=H,
                       n_layers=int(rng.integers(1, 4)), max_len=int(rng.integers(5, 20)))
    cases = [_structure_case(rng, cfg) for cfg in (EXERCISE_SIZE, dict(SMALL, n_layers=3), random_size)]
    for B, T, dtype, L in ((2, 7, "float64", 2), (1, 1, "float64", 2), (3, 10, "float64", 2), (2, 6, "float32", 2),
                           (2, 5, "float64", 3)):
        cases.append(_model_case(rng, "forward", B, T, dtype, n_layers=L))
    cases += [_model_case(rng, "causal", 2, 8), _model_case(rng, "causal", 3, 9, n_layers=3)]
    return cases


# ================================================================ generate_cached
_NOT_USE = frozenset({"__init__", "__new__", "__init_subclass__", "__subclasshook__", "__class_getitem__"})


def recording_caches(cache_class):
    """Patch every method of the class (its own and its bases', not object's; not the constructor nor
    special methods such as ``__len__``) to record the objects it is called on: ``append`` as the
    course's cache has it, or a helper method of the student's own that the step calls instead.
    Returns (the list of distinct objects used, a function that undoes the patch)."""
    used = []
    patched = {}
    for klass in cache_class.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name in patched or name in _NOT_USE or (name.startswith("__") and name.endswith("__")):
                continue
            if not inspect.isfunction(value):  # staticmethod, classmethod, property, data: not a call on a cache
                continue
            patched[name] = (name in vars(cache_class), vars(cache_class).get(name))

            def method(self, *args, _original=value, **kwargs):
                if not any(c is self for c in used):
                    used.append(self)
                return _original(self, *args, **kwargs)

            functools.update_wrapper(method, value)
            setattr(cache_class, name, method)

    def undo():
        for name, (own, original) in patched.items():
            if own:
                setattr(cache_class, name, original)
            else:
                delattr(cache_class, name)

    return used, undo


def decode(generate, model, ids, n_new, cache_class):
    """``generate(model, ids, n_new)`` on a copy of ids under torch.no_grad(), then uncached greedy decoding
    of the same model's parts wired as the course's model (``wired`` on the whole sequence at every step:
    the model's own forward is test_model_forward's to judge, issue 42). Reports the ids and logits of
    both, how many objects of ``cache_class`` a method was called on, the blocks whose ``attn.W_k``
    projected more key rows than the prompt once and one per token, and the ids after the call."""
    counts = [0] * len(model.blocks)

    def hook(i):
        def record(module, inputs, output):
            counts[i] += inputs[0].shape[:-1].numel()
        return record

    handles = []
    for i, block in enumerate(model.blocks):
        W_k = getattr(getattr(block, "attn", None), "W_k", None)
        if W_k is None:
            raise AssertionError("your blocks should hold your MultiHeadAttention as attn, with a layer attn.W_k.")
        handles.append(W_k.register_forward_hook(hook(i)))
    used, unpatch = recording_caches(cache_class) if isinstance(cache_class, type) else ([], lambda: None)
    copy = ids.clone()
    try:
        with torch.no_grad():
            res = generate(model, copy, n_new)
    finally:
        unpatch()
        for h in handles:
            h.remove()
    if not isinstance(res, (tuple, list)) or len(res) != 2 or not all(isinstance(r, torch.Tensor) for r in res):
        raise AssertionError("generate_cached(model, ids, n_new) should return a tuple (ids, logits): the prompt "
                             "followed by the new tokens, and the (B, n_new, vocab_size) logits they were picked from.")
    seq, steps = ids.clone(), []
    with torch.no_grad():
        for _ in range(n_new):
            logits = wired(model, seq)[0][:, -1]
            steps.append(logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    B, T_p = ids.shape
    return {"ids": res[0], "logits": res[1], "ids without a cache": seq, "logits without a cache": torch.stack(steps, 1),
            "KVCache objects used": len(used) if isinstance(cache_class, type) else len(model.blocks),
            "blocks that projected the prefix again": ", ".join(str(i) for i, c in enumerate(counts)
                                                                if c > B * (T_p + n_new)) or "none",
            "ids after the call": copy}


def generate_adapter(piece, case, namespace=None):
    """The notebook's StudentGPT (``namespace``, else where the piece was defined; the adapter's own
    ``_GPT`` where there is none) with the case's sizes and parameters, float64, eval mode; ``decode``
    with the notebook's KVCache."""
    cls = looked_up(piece, "StudentGPT", namespace)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        cls = _GPT
    model = loaded(cls, case)
    return decode(piece, model, case["ids"], int(case["n_new"]), looked_up(piece, "KVCache", namespace))


def judge_decoding(out, B, T_p, n_new, n_layers, show=True, atol=ATOL, rtol=RTOL):
    """Why cached decoding ``out`` (``decode``'s results as plain data) fails, or None: the ids are the prompt
    and n_new tokens, the logits those of decoding without a cache within (atol, rtol), the same tokens, one
    cache per block, the prefix never projected again."""
    ids, logits = out.get("ids"), out.get("logits")
    want_ids, want_logits = out.get("ids without a cache"), out.get("logits without a cache")
    if not isinstance(ids, np.ndarray) or ids.shape != (B, T_p + n_new) or ids.dtype != np.int64:
        what = f"{ids.dtype} of shape {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__
        return (f"the ids are {what}; expected torch.int64 of shape {(B, T_p + n_new)}: the prompt followed by the "
                f"{n_new} new tokens.")
    if not np.array_equal(ids[:, :T_p], want_ids[:, :T_p]):
        return "the ids should start with the prompt itself."
    if not isinstance(logits, np.ndarray) or logits.shape != want_logits.shape:
        shape = logits.shape if isinstance(logits, np.ndarray) else type(logits).__name__
        return (f"the logits have shape {shape}; expected {want_logits.shape}: for each new token, the logits of the "
                "last position it was picked from.")
    # (before the values: a cache shared by the blocks, or none, is what makes them differ)
    if out.get("KVCache objects used") != n_layers:
        return (f"generate_cached used {out.get('KVCache objects used')} KVCache object(s) for a model of {n_layers} "
                "blocks: make one of your KVCache per block and let cached_attention_step append to it.")
    diff = np.abs(logits.astype(np.float64) - want_logits.astype(np.float64))
    if not np.all(diff <= atol + rtol * np.abs(want_logits.astype(np.float64))):
        b, t, v = np.argwhere(~(diff <= atol + rtol * np.abs(want_logits.astype(np.float64))))[0]
        at = (f": logits[{b}, {t}, {v}] is {logits[b, t, v]:.6g}, without a cache {want_logits[b, t, v]:.6g}"
              if show else f" (by up to {np.nan_to_num(diff, nan=np.inf).max():.3g})")
        return (f"the logits of the new tokens differ from greedy decoding without a cache of the same model (its "
                f"parts wired as in Step 1){at}. "
                "Feed the prompt once, then only the newest token, with positions that continue from len(cache).")
    if not np.array_equal(ids, want_ids):
        b, t = (int(v) for v in np.argwhere(ids != want_ids)[0])
        picked = f" is {ids[b, t]} but decoding without a cache picks {want_ids[b, t]}" if show else " differs"
        return (f"the generated token {t} of sequence {b}{picked} from decoding without a cache: take the argmax "
                "of the last position's logits.")
    again = out.get("blocks that projected the prefix again")
    if again != "none":
        return (f"block(s) {again} projected more key rows than the prompt once and then one per new token: yours "
                "re-projects the prefix. Feed only the newest token; the cache holds the rest.")
    return None


def decodes_as_without_a_cache(case, out, want):
    """``judge_decoding`` with the case's sizes and the float64 defaults."""
    B, T_p = case["ids"].shape
    return judge_decoding(out, B, T_p, int(case["n_new"]), int(case["n_layers"]), show=case["show"])


# ---------------------------------------------------------------- typical mistakes of generate_cached
def _variant(model, ids, n_new, *, restart_positions=False, fresh_cache=False, first_row=False, final_ln=True,
             skip_ffn=False):
    """Greedy cached decoding written out with the model's own layers, optionally with one typical mistake."""
    caches = [kv.GivenCache() for _ in model.blocks]
    new, steps, seen = ids, [], 0
    with torch.no_grad():
        for _ in range(n_new):
            if fresh_cache:
                caches = [kv.GivenCache() for _ in model.blocks]
            start = 0 if restart_positions else seen
            x = model.tok(new) + model.pos(torch.arange(start, start + new.shape[1]))
            for block, cache in zip(model.blocks, caches):
                x = x + kv._correct_step(block.ln1(x), cache, block.attn)[0]
                if not skip_ffn:
                    x = x + block.ffn(block.ln2(x))
            last = x[:, 0] if first_row else x[:, -1]
            logits = model.head(model.ln_f(last) if final_ln else last)
            steps.append(logits)
            seen += new.shape[1]
            new = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, new], dim=1)
    return ids, torch.stack(steps, dim=1)


def _restart_positions(model, ids, n_new):
    return _variant(model, ids, n_new, restart_positions=True)


def _fresh_cache(model, ids, n_new):
    return _variant(model, ids, n_new, fresh_cache=True)


def _first_row(model, ids, n_new):
    return _variant(model, ids, n_new, first_row=True)


def _no_final_norm(model, ids, n_new):
    return _variant(model, ids, n_new, final_ln=False)


def _no_ffn(model, ids, n_new):
    return _variant(model, ids, n_new, skip_ffn=True)


GENERATE_TESTS = frozenset({GENERATE})
GENERATE_MISTAKES = (
    Mistake("positions restart at 0", "the token at position t needs self.pos at t: number the new tokens from "
            "len(cache) (the tokens already cached), not from 0.", _restart_positions, GENERATE_TESTS),
    Mistake("a new cache at every step", "make the caches once, before the loop: one KVCache per block for the "
            "whole generation; a fresh one forgets the prefix.", _fresh_cache, GENERATE_TESTS),
    Mistake("logits of the first position", "the next token comes from the last position of the chunk you fed: "
            "x[:, -1], not x[:, 0] (they differ for the prompt).", _first_row, GENERATE_TESTS),
    Mistake("no final LayerNorm", "apply model.ln_f before model.head, as the model's forward does.", _no_final_norm,
            GENERATE_TESTS),
    Mistake("feed-forward skipped", "each block is attention and then x + ffn(ln2(x)): keep the second residual "
            "branch.", _no_ffn, GENERATE_TESTS),
)


def _generate_case(rng, B, T_p, n_new, n_layers=2):
    cfg = dict(SMALL, n_layers=n_layers)
    return case(f"for {_describe(cfg)}, float64, seeded parameters, B={B}, a prompt of {T_p}, n_new={n_new}, "
                "against greedy decoding of the same model without a cache", "generate", **cfg, n_new=n_new,
                ids=rng.integers(0, cfg["vocab_size"], size=(B, T_p)).astype(np.int64),
                **_model_weights(rng, cfg, "float64"))


def _generate_visible() -> tuple:
    return (_generate_case(np.random.default_rng(800), 2, 3, 5),)


def generate_secret(rng: np.random.Generator) -> list:
    """The visible sizes with fresh numbers and every size of the old hidden tests: one sequence and a
    prompt of one token, a three-block model, a prompt of max_len - 1 and one new token."""
    return [_generate_case(rng, *sizes) for sizes in ((2, 3, 5, 2), (1, 1, 6, 2), (3, 4, 6, 3), (2, 9, 1, 2))]



# ================================================================ the trained model
# Training thresholds (measured on the course's corpus, seed 0; tests/exercises/test_capstone.py): the
# held-out cross-entropy of the unigram guess is 3.26 nats per token, of the bigram guess (the previous
# word only) 1.24; the corpus's own randomness (which nouns, adjective, template and verb) leaves at least
# about 0.47; the reference model reaches 0.60 after the exercise's 400 steps. LOSS_THRESHOLD = 0.8 is well
# below the bigram guess, and a held-out loss below LEAK_THRESHOLD = 0.35 is impossible without seeing the
# next token (a missing causal mask). Always naming the first noun resolves "it" about half of the time.
# The budget is 400 steps because 300 were not enough from every start: over 9 initialisations (the model's
# parameters drawn in another order, as a student's class may), 300 steps resolved "it" in 77-79% for 2 of
# them, so an honest model failed ACCURACY_THRESHOLD; after 400 steps all 11 measured starts resolve at least
# 99.25% (held-out loss 0.597-0.607); tests/exercises/test_capstone_trained.py trains two of those starts.
TRAINED_TEST, RESOLVES_TEST = "test_trained", "test_resolves_it"
LOSS_THRESHOLD = 0.8
LEAK_THRESHOLD = 0.35
ACCURACY_THRESHOLD = 0.9
# The trained float32 model's cached logits may differ from full recomputation by the rounding of sums
# taken in another order, a few 1e-6 for logits of size about 10, so 1e-4; every known mistake moves logits
# by more than 1e-2.
TRAINED_LOGIT_TOL = 1e-4
VOCAB_SIZE = EXERCISE_SIZE["vocab_size"]  # len(make_corpus(seed=0).vocab.tokens): the locked cell's StudentGPT(57)
N_DECODED = 24  # held-out prompts the trained model completes in test_generate_trained


@functools.lru_cache(maxsize=1)
def _held_out():
    """The course's held-out sentences (``make_corpus(seed=0)``, public): ids padded to one length
    (uint8), the position of each final "it", the padding id."""
    from ..capstone.corpus import make_corpus

    corpus = make_corpus(seed=0)
    pad = corpus.vocab.pad
    L = max(len(ex.ids) for ex in corpus.held_out)
    ids = np.array([ex.ids + [pad] * (L - len(ex.ids)) for ex in corpus.held_out], dtype=np.uint8)
    pronoun = np.array([ex.pronoun_index for ex in corpus.held_out], dtype=np.int64)
    return ids, pronoun, pad


def _by_length(pronoun) -> list:
    """(prompt length, rows): the sentences grouped by the length of the prompt up to the final "it"."""
    groups = {}
    for i, p in enumerate(np.asarray(pronoun).tolist()):
        groups.setdefault(p + 1, []).append(i)
    return sorted(groups.items())


@functools.lru_cache(maxsize=1)
def trained_cases() -> tuple:
    """The trained model's cases, the same in the notebook and in the re-check (the corpus is public:
    the model is judged on sentences it never trained on, not on secret ones)."""
    ids, pronoun, pad = _held_out()
    n = len(ids)
    return (case(f"on the {n} held-out sentences", "loss", kind="loss", ids=ids, pad=pad),
            case(f"on the {n} held-out sentences (the word after the final 'it')", "resolve", kind="resolve",
                 ids=ids, pronoun=pronoun, pad=pad))


def trained_adapter(model, case, namespace=None):
    """The trained model on the held-out sentences, in eval mode without gradients (its mode restored
    after): every next token's log-probability (padding left out) for the loss, as ``held_out_loss``
    takes it (all sentences in one batch); the greedy prediction after each final "it" (one batch per
    prompt length) for the pronoun task; and whether its blocks are the notebook's own
    TransformerBlock (``namespace``, else where the model's class was defined)."""
    X = case["ids"].long()
    # (a block of a class built on the notebook's counts: the structure test alone asks for the class itself)
    mine = own_blocks(model, looked_up(model, "TransformerBlock", namespace), subclasses=True)
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        with torch.no_grad():
            if case["kind"] == "loss":
                logits = model(X[:, :-1])[0]
                targets = X[:, 1:]
                logp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                return {"logp": logp[targets != int(case["pad"])].float(), "blocks of the notebook's TransformerBlock": mine}
            last = {}
            for T, rows in _by_length(case["pronoun"]):
                last.update(zip(rows, model(X[rows, :T])[0][:, -1]))
            pred = torch.stack([last[i] for i in range(len(X))]).argmax(-1)
            return {"pred": pred, "blocks of the notebook's TransformerBlock": mine}
    finally:
        model.train(was_training)


def _own_model(out) -> str | None:
    mine = str(out.get("blocks of the notebook's TransformerBlock"))
    if mine != "yes":
        return (f"it should be your StudentGPT, built from your own TransformerBlock; one of its blocks "
                f"is a {mine.removeprefix('no: ')}. Train the model the training cell builds.")
    return None


def _held_out_loss(case, out) -> tuple:
    """(the held-out loss, or None, and why it cannot be computed from what the model gave)."""
    ids, pad = np.asarray(case["ids"]).astype(np.int64), int(case["pad"])
    logp = out.get("logp")
    n = int((ids[:, 1:] != pad).sum())
    if not isinstance(logp, np.ndarray) or logp.shape != (n,) or logp.dtype.kind != "f":
        shape = getattr(logp, "shape", type(logp).__name__)
        return None, f"the model gave log-probabilities of shape {shape}, expected ({n},): one per next token"
    logp = logp.astype(np.float64)
    if np.any(logp > 1e-6):
        return None, "a log-probability of the model is above 0: its output is not a distribution over the tokens"
    return float(-logp.mean()), None


def loss_in_range(case, out, want):
    """The held-out loss (mean next-token cross-entropy) is below LOSS_THRESHOLD and not below
    LEAK_THRESHOLD; the model is the notebook's StudentGPT with its own blocks."""
    loss, why = _held_out_loss(case, out)
    if why:
        return why
    if not np.isfinite(loss) or loss >= LOSS_THRESHOLD:
        return (f"its held-out loss is {loss:.3f}, not below {LOSS_THRESHOLD}. A correct model "
                "reaches about 0.61 with this budget. Check the forward pass tests above, that you train the model "
                "you built (train(corpus, config, seed, model=model)) and that you did not change the budget.")
    if loss < LEAK_THRESHOLD:
        return (f"its held-out loss is {loss:.3f}: below {LEAK_THRESHOLD}, which no model can "
                "reach from the words before each position alone. Your model sees the word it predicts: pass the "
                "causal mask.")
    return _own_model(out)


def resolves_it(case, out, want):
    """The greedy prediction after the final "it" names the right noun in at least ACCURACY_THRESHOLD of
    the held-out sentences."""
    ids, pronoun = np.asarray(case["ids"]).astype(np.int64), np.asarray(case["pronoun"])
    pred = out.get("pred")
    if not isinstance(pred, np.ndarray) or pred.shape != (len(ids),) or pred.dtype.kind not in "iu":
        return f"the model's predictions are {getattr(pred, 'shape', type(pred).__name__)}, expected ({len(ids)},) token ids"
    acc = float((pred == ids[np.arange(len(ids)), pronoun + 1]).mean())
    if acc < ACCURACY_THRESHOLD:
        return (f"it names the right noun after the final 'it' in {acc:.1%} of the held-out "
                f"sentences; at least {ACCURACY_THRESHOLD:.0%} is expected (always naming the first noun gives about "
                "50%). Check the training cell ran to the end with the stated budget.")
    return _own_model(out)


def says_loss(case, out) -> str:
    loss, _ = _held_out_loss(case, out)
    return (f"held-out loss {loss:.3f} nats per token (threshold {LOSS_THRESHOLD}; previous word only: 1.24; "
            "word frequencies only: 3.26)")


def says_accuracy(case, out) -> str:
    ids, pronoun = np.asarray(case["ids"]).astype(np.int64), np.asarray(case["pronoun"])
    acc = float((out["pred"] == ids[np.arange(len(ids)), pronoun + 1]).mean())
    return f"held-out accuracy of resolving 'it': {acc:.3f} (threshold {ACCURACY_THRESHOLD})"


def rebuild_trained(namespace, state):
    """The trained model built again in the re-check's runner, as the locked training cell builds it:
    ``StudentGPT(57)`` of the notebook's own class, then the kernel's parameters loaded into it (every
    key, every shape: ``load_state_dict(strict=True)``)."""
    cls = namespace.get("StudentGPT")
    if cls is None:
        raise NameError("the notebook defines no StudentGPT to rebuild the trained model in")
    model = cls(VOCAB_SIZE)
    params = {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for k, v in state.items()}
    model.load_state_dict(params, strict=True)
    return model.eval()


# ---------------------------------------------------------------- the trained model's cached decoding
@functools.lru_cache(maxsize=1)
def trained_prompts() -> tuple:
    """The first N_DECODED held-out sentences cut after their final "it", one case per prompt length:
    the trained model completes each with the noun (and "."), with the cache and without."""
    ids, pronoun, _ = _held_out()
    out = []
    for T, rows in _by_length(pronoun[:N_DECODED]):
        out.append(case(f"(your trained model, float32, {len(rows)} held-out prompts of {T} tokens ending with the "
                        "final 'it', n_new=2)", "trained", ids=ids[rows, :T].astype(np.int64), n_new=2))
    return tuple(out)


def trained_generate_adapter(piece, case, namespace=None):
    """``decode`` with the notebook's trained ``model`` (``namespace``, else where the piece was
    defined) and the KVCache of the piece's own namespace (a declared mistake has none: its caches
    count as one per block), and the model's number of blocks."""
    model = looked_up(piece, "model", namespace) if namespace is None else namespace.get("model")
    if not isinstance(model, nn.Module):
        raise AssertionError("there is no trained model to decode with: run the training cell above first.")
    out = decode(piece, model, case["ids"], int(case["n_new"]), globals_of(piece).get("KVCache"))
    return {**out, "blocks": len(model.blocks)}


def decodes_as_trained(case, out, want):
    """``judge_decoding`` of the trained float32 model, within TRAINED_LOGIT_TOL; the prompt left as it was."""
    if not np.array_equal(out.get("ids after the call"), case["ids"]):
        return "generate_cached modified the prompt ids in place."
    B, T_p = case["ids"].shape
    return judge_decoding(out, B, T_p, int(case["n_new"]), int(out["blocks"]), show=case["show"],
                          atol=TRAINED_LOGIT_TOL, rtol=0.0)


# ================================================================ the declaration
FORBIDDEN = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECE_NAMES)
MODEL_NAMES = {"logits, wired": "the logits of your parts wired as the course's model",
               "parameters": "the number of parameters"}

MODEL = Exercise(
    name=NAME,
    piece="StudentGPT",
    call="StudentGPT(vocab_size, d_model, n_heads, n_layers, max_len)(idx)",
    adapter=model_adapter,
    reference="firstprinciples.capstone.model:TinyGPT",
    names=MODEL_NAMES,
    visible=_model_visible(),
    secret=model_secret,
    tests={
        STRUCTURE: Test(2, frozenset({"structure"}), first=(model_structure,)),
        FORWARD: Test(3, frozenset({"forward"}), first=(same_as_wired,), values=False),
        CAUSAL: Test(2, frozenset({"causal"}), first=(causal,), values=False),
    },
    forbidden=dict(FORBIDDEN, what="the model (with your own pieces)"),
    mistakes=MODEL_MISTAKES,
)

GENERATE_CACHED = Exercise(
    name=NAME,
    piece="generate_cached",
    call="generate_cached(model, ids, n_new)",
    adapter=generate_adapter,
    reference="firstprinciples.capstone.model:generate_greedy",
    visible=_generate_visible(),
    secret=generate_secret,
    tests={GENERATE: Test(3, frozenset({"generate"}), first=(decodes_as_without_a_cache,), values=False)},
    forbidden=dict(FORBIDDEN, what="cached generation (with your own KVCache and cached_attention_step)"),
    mistakes=GENERATE_MISTAKES,
    # the trained model's decoding (``TRAINED_DECODING``): re-checked here on random models of the notebook's
    # StudentGPT (a trained model decodes right only with a right decoder; the model itself is judged by
    # test_trained and test_resolves_it)
    elsewhere={GENERATE_TRAINED: Test(2, frozenset({"generate"}), first=(decodes_as_without_a_cache,), values=False)},
    needs=("StudentGPT", "KVCache", "cached_attention_step"),
)

TRAINED = Exercise(
    name=NAME,
    piece="model",
    call="your trained model",
    adapter=trained_adapter,
    reference="",  # (no reference for a trained model: its tests judge what it gives by the thresholds)
    visible=trained_cases,
    secret=lambda rng: list(trained_cases()),
    tests={
        TRAINED_TEST: Test(3, frozenset({"loss"}), first=(loss_in_range,), values=False, says=says_loss),
        RESOLVES_TEST: Test(2, frozenset({"resolve"}), first=(resolves_it,), values=False, says=says_accuracy),
    },
    forbidden=dict(FORBIDDEN, what="the model (with your own pieces)"),
    needs=("TransformerBlock",),
    rebuild=rebuild_trained,
    rebuilt_from=("StudentGPT",),
)

# The trained model's cached decoding, in the notebook only: the answer's decoding of the kernel's trained
# model against its own decoding without a cache. (The re-check judges this cell's decoder by
# GENERATE_CACHED's ``elsewhere``, on random models; it has no trained model of its own.)
TRAINED_DECODING = dataclasses.replace(
    GENERATE_CACHED,
    adapter=trained_generate_adapter,
    reference="",
    visible=trained_prompts,
    secret=lambda rng: list(trained_prompts()),
    tests={GENERATE_TRAINED: Test(2, frozenset({"trained"}), first=(decodes_as_trained,), values=False)},
    elsewhere={},
    mistakes=tuple(dataclasses.replace(m, fails=frozenset({GENERATE_TRAINED})) for m in GENERATE_MISTAKES),
    needs=("model", "KVCache"),
    recap_of=NAME,  # (never the re-check's probe of generate_cached: exercises.by_piece leaves it out)
)


# ================================================================ this notebook's recaps of earlier pieces
_ATTENTION_TEST = attention.EXERCISE.elsewhere[attention.RECAP_ID]
ATTENTION_RECAP = recap(
    attention.EXERCISE, NAME, {attention.RECAP_ID: _ATTENTION_TEST},
    visible=tuple({**c, "tags": tuple(sorted(_ATTENTION_TEST.tags))} for c in attention.RECAP.visible),
    # (the re-check's cases of this cell, the attention exercise's "worked" ones, have no mask: the mask's
    # mistakes are named in the notebook only, ``missed``)
    mistakes={**{label: ({attention.RECAP_ID}, ()) for label in (
        "no scaling", "scaled by d_k", "scaled by sqrt(T_k)", "softmax over the wrong axis", "keys used as values",
        "scores returned as weights")},
        **{label: ({attention.RECAP_ID}, (), {attention.RECAP_ID}) for label in (
            "mask added after the softmax", "mask ignored")}},
)
# this notebook's split cell keeps the name test_split_heads, judged in the re-check as in its own
# notebook (its tags), for 1 point here; its merge and attention cells are multi_head_attention's recaps
_SPLIT_TEST = mha.SPLIT_EXERCISE.tests[mha.SPLIT]
SPLIT_RECAP = recap(mha.SPLIT_EXERCISE, NAME, {mha.SPLIT: dataclasses.replace(_SPLIT_TEST, points=1)},
                    visible=mha.SPLIT_RECAP.visible, mistakes={m.label: ({mha.SPLIT}, ()) for m in mha.SPLIT_MISTAKES})
MERGE_RECAP = recap(mha.MERGE_RECAP, NAME, dict(mha.MERGE_RECAP.tests), visible=mha.MERGE_RECAP.visible,
                    mistakes={m.label: ({mha.RECAP_MERGE}, ()) for m in mha.MERGE_MISTAKES})
MHA_RECAP = recap(mha.MHA_RECAP, NAME, dict(mha.MHA_RECAP.tests), visible=mha.MHA_RECAP.visible,
                  mistakes={m.label: ({mha.RECAP_MHA}, ()) for m in mha.MHA_MISTAKES if mha.VALUES in m.fails})
# (the narrow hidden layer fails the recap where its weights are loaded, before any value is compared:
# the answers table holds it, among the wrong answers no mistake names)
FFN_RECAP = recap(tb.FFN_RECAP, NAME, dict(tb.FFN_RECAP.tests), visible=tb.FFN_RECAP.visible,
                  mistakes={m.label: ({tb.RECAP_FFN}, ()) for m in tb.FFN_MISTAKES
                            if m.label != "hidden layer d_model wide"})
BLOCK_RECAP = recap(tb.BLOCK_RECAP, NAME, dict(tb.BLOCK_RECAP.tests), visible=tb.BLOCK_RECAP.visible,
                    mistakes={m.label: ({tb.RECAP_BLOCK}, ()) for m in tb.BLOCK_MISTAKES if tb.VALUES in m.fails})
CACHE_RECAP = recap(kv.CACHE_RECAP, NAME, dict(kv.CACHE_RECAP.tests), visible=kv.CACHE_RECAP.visible,
                    mistakes={m.label: ({kv.CACHE_RECAP_ID}, ()) for m in kv.CACHE_MISTAKES})
STEP_RECAP = recap(kv.STEP_RECAP, NAME, dict(kv.STEP_RECAP.tests), visible=kv.STEP_RECAP.visible,
                   mistakes={m.label: ({kv.STEP_RECAP_ID}, ()) for m in kv.STEP_MISTAKES if kv.ONE in m.fails})

PIECES = (ATTENTION_RECAP, SPLIT_RECAP, MERGE_RECAP, MHA_RECAP, FFN_RECAP, BLOCK_RECAP, CACHE_RECAP, STEP_RECAP,
          MODEL, GENERATE_CACHED, TRAINED, TRAINED_DECODING)
