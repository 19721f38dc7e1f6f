"""Checks for the capstone exercise: the student's own GPT, trained and decoded with a cache.

The student writes two things on top of the pieces pasted from earlier exercises:

- ``StudentGPT(vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32)``, with
  the parts of the course's ``TinyGPT``: ``tok`` (nn.Embedding(vocab_size, d_model)),
  ``pos`` (nn.Embedding(max_len, d_model), learned positions), ``blocks`` (an
  nn.ModuleList of the student's ``TransformerBlock(d_model, n_heads, dropout=0.0)``),
  ``ln_f`` (nn.LayerNorm(d_model)) and ``head`` (nn.Linear(d_model, vocab_size,
  bias=False)); ``forward(idx (B, T) long)`` returns (logits (B, T, vocab_size),
  a list of the blocks' attention weights (B, n_heads, T, T)), with the causal mask.
- ``generate_cached(model, ids, n_new)``: greedy decoding with one of the
  student's ``KVCache`` per block and their ``cached_attention_step``; returns
  (ids (B, T_p + n_new), logits (B, n_new, vocab_size)), the logits each new
  token was picked from.

The model is compared, after seeded parameters have been loaded into its parts,
with the same network written as a function of those parameters (the block math
of ``checks.block.reference_block``). Cached decoding is compared with uncached
greedy decoding of the same model (``model(ids)`` on the whole sequence at every
step): the token ids must be equal, the logits equal within the tolerance of
their dtype; forward hooks count the key rows each block projects (the prompt
once, then one per token) and every ``KVCache`` object that a method of the class is called
on is recorded (one cache per block: ``append``, or a helper method of the student's own).

Tolerances: random models are compared in float64 (``_core.TOLERANCES``:
1e-10 + 1e-8 |value|); the trained float32 model's cached logits may differ from
full recomputation by the rounding of sums taken in another order, a few 1e-6
for logits of size about 10, so ``TRAINED_LOGIT_TOL`` is 1e-4; every known
mistake moves logits by more than 1e-2.

Training thresholds (measured on the course's corpus, seed 0): the held-out
cross-entropy of the unigram guess is 3.26 nats per token, of the bigram guess
(the previous word only) 1.24; the corpus's own randomness (which nouns,
adjective, template and verb) leaves at least about 0.47; the reference model
reaches 0.61 after the exercise's 300 steps. ``LOSS_THRESHOLD`` = 0.8 is well
below the bigram guess, and a held-out loss below ``LEAK_THRESHOLD`` = 0.35 is
impossible without seeing the next token (a missing causal mask).
"""
from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..capstone.model import TinyGPT, generate_greedy
from ..capstone.train import accuracy, held_out_loss
from ..guard import ForbiddenCall, call_without
from ._student import describe, wrap_checks
from ._core import Mistake, assert_matches, close, fmt, tolerance
from .block import TORCH_PATTERNS, block_parameter_count, load_block, random_block_parameters, reference_block
from .multihead import build

PIECES = ("TransformerBlock", "FeedForward", "MultiHeadAttention", "split_heads", "merge_heads",
          "scaled_dot_product_attention", "causal_mask", "KVCache", "cached_attention_step", "generate",
          "generate_cached")
MODEL_FORBIDDEN = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECES, what="the model (with your own pieces)")
GENERATE_FORBIDDEN = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECES,
                          what="cached generation (with your own KVCache and cached_attention_step)")

LOSS_THRESHOLD = 0.8
LEAK_THRESHOLD = 0.35
ACCURACY_THRESHOLD = 0.9
TRAINED_LOGIT_TOL = 1e-4

# A small model for the value checks: vocabulary 11, width 16, 2 heads, 2 blocks, 10 positions.
SMALL = dict(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_len=10)


def parameter_count(vocab_size, d_model, n_heads, n_layers, max_len):
    """Embeddings, blocks, final LayerNorm and a bias-free head."""
    return (vocab_size * d_model + max_len * d_model + n_layers * block_parameter_count(d_model)
            + 2 * d_model + d_model * vocab_size)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- the network as a function of its parameters
def random_parameters(g, vocab_size, d_model, n_heads, n_layers, max_len, dtype):
    """dict(tok, pos, blocks=[P per block], ln_f=(w, b), head), seeded; LayerNorms random around 1 and 0."""
    return dict(
        tok=torch.randn(vocab_size, d_model, generator=g, dtype=dtype),
        pos=torch.randn(max_len, d_model, generator=g, dtype=dtype),
        blocks=[random_block_parameters(g, d_model, dtype) for _ in range(n_layers)],
        ln_f=(1 + 0.3 * torch.randn(d_model, generator=g, dtype=dtype), 0.3 * torch.randn(d_model, generator=g, dtype=dtype)),
        head=torch.randn(vocab_size, d_model, generator=g, dtype=dtype) / math.sqrt(d_model),
    )


def _mask(T, dtype, diagonal=1):
    return torch.triu(torch.full((T, T), float("-inf"), dtype=dtype), diagonal=diagonal)


def _gpt(idx, P, n_heads, *, positions=True, offset=0, mask=True, final_ln=True, scale=False, probs=False):
    T = idx.shape[1]
    x = P["tok"][idx] * (math.sqrt(P["tok"].shape[1]) if scale else 1.0)  # (B, T, d_model)
    if positions:
        x = x + P["pos"][offset:offset + T]
    m = _mask(T, x.dtype) if mask else None
    weights = []
    for Pb in P["blocks"]:
        x, w = reference_block(x, Pb, n_heads, m)
        weights.append(w)
    if final_ln:
        x = F.layer_norm(x, (x.shape[-1],), *P["ln_f"])
    logits = x @ P["head"].T  # (B, T, V)
    return (logits.softmax(-1) if probs else logits, *weights)


def reference_gpt(idx, P, n_heads):
    """(logits, *attention weights of every block) of the course's GPT with parameters P (eval mode)."""
    return _gpt(idx, P, n_heads)


FORWARD_MISTAKES = (
    Mistake("no positional embedding", "add self.pos(torch.arange(T)) to the token embeddings: without it the "
            "model cannot tell 'the dog ... the road' from 'the road ... the dog'.",
            lambda idx, P, H: _gpt(idx, P, H, positions=False)),
    Mistake("positions counted from 1", "the first token has position 0: self.pos(torch.arange(T)).",
            lambda idx, P, H: _gpt(idx, P, H, offset=1)),
    Mistake("no causal mask", "pass the causal mask (0 on and below the diagonal, -inf above) to every block: "
            "without it each position sees the token it must predict.",
            lambda idx, P, H: _gpt(idx, P, H, mask=False)),
    Mistake("no final LayerNorm", "apply self.ln_f to the last block's output before self.head.",
            lambda idx, P, H: _gpt(idx, P, H, final_ln=False)),
    Mistake("embeddings scaled by sqrt(d_model)", "TinyGPT adds the token and position embeddings as they are.",
            lambda idx, P, H: _gpt(idx, P, H, scale=True)),
    Mistake("probabilities instead of logits", "return the head's output itself: the loss applies the softmax.",
            lambda idx, P, H: _gpt(idx, P, H, probs=True)),
)


def load_parameters(model, P):
    """Copy P into the student's model (whose dtype is already P's)."""
    with torch.no_grad():
        for name, W in (("tok", P["tok"]), ("pos", P["pos"])):
            emb = getattr(model, name)
            emb.weight.copy_(W)
        for block, Pb in zip(model.blocks, P["blocks"]):
            load_block(block, Pb)
        model.ln_f.weight.copy_(P["ln_f"][0])
        model.ln_f.bias.copy_(P["ln_f"][1])
        model.head.weight.copy_(P["head"])


def build_model(cls, *, vocab_size, d_model, n_heads, n_layers, max_len, seed=0):
    """The student's model, built seeded under the guard, with its parts checked."""
    model = build(cls, vocab_size, d_model, n_heads, n_layers, max_len, forbidden=MODEL_FORBIDDEN, seed=seed)
    _check_parts(model, vocab_size, d_model, n_heads, n_layers, max_len)
    return model


def _check_parts(model, vocab_size, d_model, n_heads, n_layers, max_len):
    name = type(model).__name__
    for attr, kind, shape in (("tok", nn.Embedding, (vocab_size, d_model)), ("pos", nn.Embedding, (max_len, d_model))):
        part = getattr(model, attr, None)
        if not isinstance(part, kind):
            raise AssertionError(
                f"{name} should have an attribute {attr} that is an nn.Embedding{shape}; "
                + ("it has none." if part is None else f"yours is a {type(part).__name__}.")
                + (" Learned positions: one trainable vector per position." if attr == "pos" else "")
            )
        if tuple(part.weight.shape) != shape:
            raise AssertionError(f"{name}.{attr} should be nn.Embedding{shape}; its weight is {tuple(part.weight.shape)}.")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise AssertionError(
            f"{name}.blocks should be an nn.ModuleList of your TransformerBlocks (a plain Python list hides their "
            "parameters from the optimizer); "
            + ("it has none." if blocks is None else f"yours is a {type(blocks).__name__}.")
        )
    if len(blocks) != n_layers:
        raise AssertionError(f"{name}(..., n_layers={n_layers}) should hold {n_layers} blocks; it holds {len(blocks)}.")
    ln_f = getattr(model, "ln_f", None)
    if not isinstance(ln_f, nn.LayerNorm) or tuple(ln_f.normalized_shape) != (d_model,):
        raise AssertionError(f"{name} should have an attribute ln_f = nn.LayerNorm(d_model), the final LayerNorm.")
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear) or tuple(head.weight.shape) != (vocab_size, d_model):
        raise AssertionError(f"{name} should have an attribute head = nn.Linear(d_model, vocab_size, bias=False).")
    if head.bias is not None:
        raise AssertionError(f"{name}.head should have no bias: nn.Linear(d_model, vocab_size, bias=False).")


def _run(model, idx, n_layers):
    """Call the model on a copy of idx under the guard; unpack (logits, [weights per block])."""
    copy = idx.clone()
    res = call_without(model, (copy,), **MODEL_FORBIDDEN)
    if not torch.equal(copy, idx):
        raise AssertionError("Your model modified its input ids in place.")
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        raise AssertionError("forward(idx) should return a tuple (logits, attentions), attentions a list with "
                             "one (B, n_heads, T, T) tensor per block.")
    logits, atts = res
    if not isinstance(logits, torch.Tensor):
        raise AssertionError(f"The logits should be a tensor; yours is a {type(logits).__name__}.")
    if not isinstance(atts, (list, tuple)) or len(atts) != n_layers or not all(isinstance(a, torch.Tensor) for a in atts):
        raise AssertionError(f"attentions should be a list of {n_layers} tensors (B, n_heads, T, T), one per block, "
                             "in order: collect the weights each block returns.")
    return logits, list(atts)


# ---------------------------------------------------------------- checks: the model
def check_model_structure(StudentGPT, TransformerBlock):
    """The parts and their sizes, blocks of your own TransformerBlock without dropout, the parameter count;
    one forward pass under the guard."""
    for cfg in (dict(vocab_size=57, d_model=64, n_heads=4, n_layers=2, max_len=32), dict(SMALL, n_layers=3)):
        model = build_model(StudentGPT, **cfg)
        idx = torch.randint(0, cfg["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
        _run(model.eval(), idx, cfg["n_layers"])  # under the guard: PyTorch's layers or the reference score 0
        for i, block in enumerate(model.blocks):
            if not isinstance(block, TransformerBlock):
                raise AssertionError(
                    f"{type(model).__name__}.blocks[{i}] is a {type(block).__module__}.{type(block).__name__}; "
                    "build the blocks from your own TransformerBlock class (the one pasted above)."
                )
        drops = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        if drops:
            raise AssertionError(f"Build the blocks with dropout=0.0 (the corpus is small and training is short); "
                                 f"these have p > 0: {', '.join(drops)}.")
        want, got = parameter_count(**cfg), sum(p.numel() for p in model.parameters())
        if got != want:
            raise AssertionError(
                f"StudentGPT({', '.join(f'{k}={v}' for k, v in cfg.items())}) has {got:,} parameters but should have "
                f"{want:,}: token embeddings V*d, positions max_len*d, {cfg['n_layers']} blocks of 12 d^2 + 9 d, "
                "ln_f 2 d and a bias-free head d*V."
            )


def _forward_case(StudentGPT, B, T, dtype, seed, cfg=SMALL):
    g = torch.Generator().manual_seed(600 + seed)
    P = random_parameters(g, dtype=dtype, **cfg)
    model = build_model(StudentGPT, **cfg).to(dtype).eval()
    load_parameters(model, P)
    idx = torch.randint(0, cfg["vocab_size"], (B, T), generator=g)
    logits, atts = _run(model, idx, cfg["n_layers"])
    with torch.no_grad():
        want = reference_gpt(idx, P, cfg["n_heads"])
    label = f"for ids of shape {(B, T)}, {_dtype_name(dtype)}"

    def check():
        assert_matches("logits", logits, want[0], context=label)
        for i, (a, w) in enumerate(zip(atts, want[1:])):
            assert_matches(f"attention weights of block {i}", a, w, context=label)

    try:
        check()
    except AssertionError as err:
        found = []
        for m in FORWARD_MISTAKES:
            with torch.no_grad():
                res = m.fn(idx, P, cfg["n_heads"])
            if close(logits, res[0], *tolerance(dtype)) and not close(res[0], want[0], *tolerance(dtype)):
                found.append(m)
        if found:
            lines = "\n".join(f"  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"{err}\nYour model matches a typical mistake:\n{lines}") from None
        raise


def check_model_forward(StudentGPT, full=True):
    """Seeded parameters loaded into your model (eval mode), against the same network written out;
    logits and every block's attention weights. The full check adds shapes, T = max_len and float32."""
    _forward_case(StudentGPT, 2, 7, torch.float64, 0)
    if not full:
        return
    for seed, (B, T, dtype) in enumerate([(1, 1, torch.float64), (3, 10, torch.float64), (2, 6, torch.float32)], 1):
        _forward_case(StudentGPT, B, T, dtype, seed)


def check_model_causal(StudentGPT):
    """Changing the tokens after position t leaves the logits at positions 0..t unchanged,
    and no block gives weight to a later position."""
    cfg = SMALL
    g = torch.Generator().manual_seed(700)
    P = random_parameters(g, dtype=torch.float64, **cfg)
    model = build_model(StudentGPT, **cfg).to(torch.float64).eval()
    load_parameters(model, P)
    idx = torch.randint(0, cfg["vocab_size"], (2, 8), generator=g)
    logits, atts = _run(model, idx, cfg["n_layers"])
    for i, a in enumerate(atts):
        above = torch.triu(a.detach(), diagonal=1)
        if tuple(a.shape[-2:]) == (8, 8) and above.abs().max() > 0:
            b, h, q, k = (int(v) for v in (above.abs() == above.abs().max()).nonzero()[0])
            raise AssertionError(
                f"Block {i}'s attention weights: position {q} gives weight {fmt(a[b, h, q, k].item())} to the later "
                f"position {k}. Every block needs the causal mask (-inf above the diagonal), or each position "
                "sees the token it is asked to predict."
            )
    for t in (2, 5):
        changed = idx.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.arange(8 - t - 1)) % cfg["vocab_size"]
        logits2, _ = _run(model, changed, cfg["n_layers"])
        a, b = logits[:, :t + 1].detach(), logits2[:, :t + 1].detach()
        if not close(a, b, *tolerance(torch.float64)):
            raise AssertionError(
                f"Changing the tokens after position {t} changed the logits at positions 0..{t} (by up to "
                f"{fmt((a - b).abs().max().item())}): your model looks at later tokens. Pass the causal mask to every block."
            )


# ---------------------------------------------------------------- checks: cached generation
def _uncached(model, ids, n_new):
    return generate_greedy.__wrapped__(model, ids, n_new, use_cache=False)


def _gen_variant(model, ids, n_new, *, restart_positions=False, fresh_cache=False, first_row=False,
                 final_ln=True, skip_ffn=False):
    """Greedy cached decoding written out (with the model's own layers), optionally with one typical mistake."""
    H = model.blocks[0].attn.n_heads
    caches = [None] * len(model.blocks)
    new, steps, seen = ids, [], 0
    for _ in range(n_new):
        if fresh_cache:
            caches = [None] * len(model.blocks)
        start = 0 if restart_positions else seen
        x = model.tok(new) + model.pos(torch.arange(start, start + new.shape[1]))
        for i, block in enumerate(model.blocks):
            h = block.ln1(x)
            B, T_new, d = h.shape

            def heads(t):
                return t.reshape(B, T_new, H, d // H).transpose(1, 2)  # (B, H, T_new, d_k)

            q, k, v = heads(block.attn.W_q(h)), heads(block.attn.W_k(h)), heads(block.attn.W_v(h))
            if caches[i] is not None:
                k, v = torch.cat([caches[i][0], k], dim=-2), torch.cat([caches[i][1], v], dim=-2)
            caches[i] = (k, v)
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // H)
            T_all = k.shape[-2]
            scores = scores + torch.triu(torch.full((T_new, T_all), float("-inf"), dtype=h.dtype),
                                         diagonal=T_all - T_new + 1)
            a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T_new, d)
            x = x + block.attn.W_o(a)
            if not skip_ffn:
                x = x + block.ffn(block.ln2(x))
        last = x[:, 0] if first_row else x[:, -1]
        logits = model.head(model.ln_f(last) if final_ln else last)
        steps.append(logits)
        seen += new.shape[1]
        new = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, new], dim=1)
    return ids, torch.stack(steps, dim=1)


GENERATE_MISTAKES = (
    Mistake("positions restart at 0", "the token at position t needs self.pos at t: number the new tokens from "
            "len(cache) (the tokens already cached), not from 0.",
            lambda m, i, n: _gen_variant(m, i, n, restart_positions=True)),
    Mistake("a new cache at every step", "make the caches once, before the loop: one KVCache per block for the "
            "whole generation; a fresh one forgets the prefix.",
            lambda m, i, n: _gen_variant(m, i, n, fresh_cache=True)),
    Mistake("logits of the first position", "the next token comes from the last position of the chunk you fed: "
            "x[:, -1], not x[:, 0] (they differ for the prompt).",
            lambda m, i, n: _gen_variant(m, i, n, first_row=True)),
    Mistake("no final LayerNorm", "apply model.ln_f before model.head, as the model's forward does.",
            lambda m, i, n: _gen_variant(m, i, n, final_ln=False)),
    Mistake("feed-forward skipped", "each block is attention and then x + ffn(ln2(x)): keep the second residual branch.",
            lambda m, i, n: _gen_variant(m, i, n, skip_ffn=True)),
)


_NOT_USE = frozenset({"__init__", "__new__", "__init_subclass__", "__subclasshook__", "__class_getitem__"})


def recording_caches(KVCache):
    """Patch every method of the class ``KVCache`` (its own and its bases', not object's; not the
    constructor nor special methods such as ``__len__``) to record the objects it is called on:
    ``append`` as the course's cache has it, or a helper method of the student's own that the step
    calls instead. Returns (the list of distinct objects used, a function that undoes the patch)."""
    used = []
    patched = {}
    for klass in KVCache.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name in patched or name in _NOT_USE or (name.startswith("__") and name.endswith("__")):
                continue
            if not inspect.isfunction(value):  # staticmethod, classmethod, property, data: not a call on a cache
                continue
            patched[name] = (name in vars(KVCache), vars(KVCache).get(name))

            def method(self, *args, _original=value, **kwargs):
                if not any(c is self for c in used):
                    used.append(self)
                return _original(self, *args, **kwargs)

            functools.update_wrapper(method, value)
            setattr(KVCache, name, method)

    def undo():
        for name, (own, original) in patched.items():
            if own:
                setattr(KVCache, name, original)
            else:
                delattr(KVCache, name)

    return used, undo


def _counting(model, KVCache):
    """Hooks counting the key rows each block's attention projects; a patch recording every cache used."""
    counts = [0] * len(model.blocks)

    def hook(i):
        def record(module, inputs, output):
            counts[i] += inputs[0].shape[:-1].numel()
        return record

    handles = []
    for i, block in enumerate(model.blocks):
        W_k = getattr(getattr(block, "attn", None), "W_k", None)
        if W_k is None:
            raise AssertionError("Your blocks should hold your MultiHeadAttention as attn, with a layer attn.W_k.")
        handles.append(W_k.register_forward_hook(hook(i)))
    used, unpatch = recording_caches(KVCache)

    def undo():
        unpatch()
        for h in handles:
            h.remove()

    return counts, used, undo


def _run_generate(generate_cached, model, ids, n_new, KVCache):
    counts, used, undo = _counting(model, KVCache)
    try:
        copy = ids.clone()
        with torch.no_grad():
            res = call_without(generate_cached, (model, copy, n_new), **GENERATE_FORBIDDEN)
    finally:
        undo()
    if not torch.equal(copy, ids):
        raise AssertionError("generate_cached modified the prompt ids in place.")
    if not isinstance(res, (tuple, list)) or len(res) != 2 or not all(isinstance(r, torch.Tensor) for r in res):
        raise AssertionError("generate_cached(model, ids, n_new) should return a tuple (ids, logits): the prompt "
                             "followed by the new tokens, and the (B, n_new, vocab_size) logits they were picked from.")
    return res[0], res[1], counts, len(used)


def _compare_generation(generate_cached, model, ids, n_new, KVCache, label, logit_tol=None, verbose=False):
    """Compare with uncached decoding; on failure name the typical mistakes the answer's logits match."""
    out, logits, counts, n_caches = _run_generate(generate_cached, model, ids, n_new, KVCache)
    with torch.no_grad():
        want_ids, want_logits = _uncached(model, ids, n_new)
    try:
        _judge_generation(out, logits, counts, n_caches, want_ids, want_logits, model, ids, n_new, label,
                          logit_tol, verbose)
    except AssertionError as err:
        found = []
        tol = tolerance(want_logits.dtype)
        for m in GENERATE_MISTAKES:
            try:
                with torch.no_grad():
                    res = m.fn(model, ids, n_new)
            except Exception:
                continue
            if close(logits, res[1], *tol) and not close(res[1], want_logits, *tol):
                found.append(m)
        if found:
            lines = "\n".join(f"  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"{err}\nYour answer matches a typical mistake:\n{lines}") from None
        raise
    return out, logits, want_logits


def _judge_generation(out, logits, counts, n_caches, want_ids, want_logits, model, ids, n_new, label, logit_tol,
                      verbose):
    B, T_p = ids.shape
    V = want_logits.shape[-1]
    if tuple(out.shape) != (B, T_p + n_new) or out.dtype != torch.long:
        raise AssertionError(f"The ids {label} are {out.dtype} of shape {tuple(out.shape)}; expected torch.int64 of "
                             f"shape {(B, T_p + n_new)}: the prompt followed by the {n_new} new tokens.")
    if not torch.equal(out[:, :T_p], ids):
        raise AssertionError(f"The ids {label} should start with the prompt itself.")
    if tuple(logits.shape) != (B, n_new, V):
        raise AssertionError(f"The logits {label} have shape {tuple(logits.shape)}; expected {(B, n_new, V)}: "
                             "for each new token, the logits of the last position it was picked from.")
    atol = logit_tol if logit_tol is not None else tolerance(logits.dtype)[0]
    rtol = 0.0 if logit_tol is not None else tolerance(logits.dtype)[1]
    assert_matches("the logits of the new tokens", logits, want_logits, atol=atol, rtol=rtol,
                   context=f"{label}, against greedy decoding without a cache")
    if not torch.equal(out, want_ids):
        b, t = (int(v) for v in (out != want_ids).nonzero()[0])
        raise AssertionError(f"The generated token {t} of sequence {b} {label} is {int(out[b, t])} but decoding "
                             f"without a cache picks {int(want_ids[b, t])}: take the argmax of the last position's logits.")
    n_layers = len(model.blocks)
    if n_caches != n_layers:
        raise AssertionError(
            f"generate_cached used {n_caches} KVCache object(s) for a model of {n_layers} blocks: "
            "make one of your KVCache per block and let cached_attention_step append to it."
        )
    needed = T_p + n_new - 1
    for i, c in enumerate(counts):
        if c > B * (T_p + n_new):
            raise AssertionError(
                f"Block {i} projected {c // B} key rows per sequence {label}; with a cache it needs {needed} (the "
                f"prompt once, then one per new token). Yours re-projects the prefix: feed only the newest token."
            )
    if verbose:
        diff = (logits.detach().double() - want_logits.double()).abs().max().item()
        print(f"generate_cached {label}: same {n_new} new tokens as without a cache; "
              f"max |logit difference| = {diff:.3g}; key rows per sequence and block: {counts[0] // B} (uncached: "
              f"{sum(range(T_p, T_p + n_new))})")


def check_generate_cached(generate_cached, StudentGPT, KVCache, full=True):
    """Greedy decoding of a seeded random model of yours, with your cache, against decoding without a cache:
    the same token ids, logits within the float64 tolerance, one cache per block, key rows counted.
    The full check adds batch sizes, prompt lengths and a three-block model."""
    cases = [(2, 3, 5, SMALL, 0)]
    if full:
        cases += [(1, 1, 6, SMALL, 1), (3, 4, 6, dict(SMALL, n_layers=3), 2), (2, 9, 1, SMALL, 3)]
    for i, (B, T_p, n_new, cfg, seed) in enumerate(cases):
        g = torch.Generator().manual_seed(800 + seed)
        P = random_parameters(g, dtype=torch.float64, **cfg)
        model = build_model(StudentGPT, **cfg).to(torch.float64).eval()
        load_parameters(model, P)
        ids = torch.randint(0, cfg["vocab_size"], (B, T_p), generator=g)
        label = f"(B={B}, prompt of {T_p}, n_new={n_new}, {cfg['n_layers']} blocks, float64)"
        _compare_generation(generate_cached, model, ids, n_new, KVCache, label, verbose=(i == 0))


def check_generate_trained(generate_cached, model, corpus, KVCache, n_examples=24):
    """Your trained model completes held-out prompts ending with the final "it" (two new tokens: the
    noun and "."), with and without your cache: the same ids, logits within TRAINED_LOGIT_TOL (float32)."""
    examples = corpus.held_out[:n_examples]
    by_length = {}
    for ex in examples:
        by_length.setdefault(ex.pronoun_index + 1, []).append(ex)
    right = 0
    worst = 0.0
    for T_p, group in sorted(by_length.items()):
        ids = torch.tensor([ex.ids[:T_p] for ex in group])
        label = f"(held-out prompts of {T_p} tokens, trained model)"
        out, logits, want_logits = _compare_generation(generate_cached, model, ids, 2, KVCache, label,
                                                       logit_tol=TRAINED_LOGIT_TOL)
        worst = max(worst, (logits.double() - want_logits.double()).abs().max().item())
        right += sum(int(out[j, T_p]) == ex.ids[ex.answer_index] for j, ex in enumerate(group))
    print(f"{len(examples)} held-out prompts: cached and uncached decoding pick the same tokens; "
          f"max |logit difference| = {worst:.3g} (tolerance {TRAINED_LOGIT_TOL:g}); "
          f"the referent is named in {right} of {len(examples)}.")


# ---------------------------------------------------------------- checks: training
def _student_model(model, TransformerBlock):
    if isinstance(model, TinyGPT):
        raise AssertionError("This is the course's TinyGPT, not your StudentGPT: train your own model.")
    blocks = getattr(model, "blocks", None)
    if blocks is None or not len(blocks) or not all(isinstance(b, TransformerBlock) for b in blocks):
        raise AssertionError("The trained model should be your StudentGPT, built from your own TransformerBlock.")


def _loss(model, corpus):
    try:
        with torch.no_grad():
            return call_without(held_out_loss, (model, corpus.held_out, corpus.vocab.pad), **MODEL_FORBIDDEN)
    except ForbiddenCall:
        raise
    except Exception as err:
        raise AssertionError(f"Your model failed on the held-out sentences: it {describe(err)}") from None


def check_trained(model, corpus, TransformerBlock):
    """Your trained StudentGPT's held-out loss (mean next-token cross-entropy) is below LOSS_THRESHOLD
    and above LEAK_THRESHOLD."""
    _student_model(model, TransformerBlock)
    loss = _loss(model, corpus)
    print(f"held-out loss {loss:.3f} nats per token (threshold {LOSS_THRESHOLD}; previous word only: 1.24; "
          "word frequencies only: 3.26)")
    if not math.isfinite(loss) or loss >= LOSS_THRESHOLD:
        raise AssertionError(
            f"The held-out loss of your trained model is {loss:.3f}, not below {LOSS_THRESHOLD}. A correct model "
            "reaches about 0.61 with this budget. Check the forward pass tests above, that you train the model "
            "you built (train(corpus, config, seed, model=model)) and that you did not change the budget."
        )
    if loss < LEAK_THRESHOLD:
        raise AssertionError(
            f"The held-out loss of your trained model is {loss:.3f}: below {LEAK_THRESHOLD}, which no model can reach "
            "from the words before each position alone. Your model sees the word it predicts: pass the causal mask."
        )


def check_resolves_it(model, corpus, TransformerBlock):
    """On held-out sentences, your trained model's greedy prediction after the final "it" is the correct noun
    at least ACCURACY_THRESHOLD of the time (always naming the first noun scores about 0.5)."""
    _student_model(model, TransformerBlock)
    try:
        acc = call_without(accuracy, (model, corpus.held_out), **MODEL_FORBIDDEN)
    except ForbiddenCall:
        raise
    except Exception as err:
        raise AssertionError(f"Your model failed on the held-out sentences: it {describe(err)}") from None
    print(f"held-out accuracy of resolving 'it': {acc:.3f} (threshold {ACCURACY_THRESHOLD})")
    if acc < ACCURACY_THRESHOLD:
        raise AssertionError(
            f"Your trained model names the right noun after the final 'it' in {acc:.1%} of the held-out sentences; "
            f"at least {ACCURACY_THRESHOLD:.0%} is expected (always naming the first noun gives about 50%). "
            "Check the training cell ran to the end with the stated budget."
        )


__all__ = [
    "check_model_structure", "check_model_forward", "check_model_causal", "check_generate_cached",
    "check_generate_trained", "check_trained", "check_resolves_it", "reference_gpt", "random_parameters",
    "load_parameters", "parameter_count", "LOSS_THRESHOLD", "LEAK_THRESHOLD", "ACCURACY_THRESHOLD",
    "TRAINED_LOGIT_TOL",
]


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
