"""Probes for the capstone: ``StudentGPT``, ``generate_cached`` and the trained ``model``.

- ``StudentGPT``: the class is built with the sizes of a case, seeded random
  parameters (from a seed in the case) are loaded into its parts with the
  checks' own ``load_parameters`` and the forward pass is compared with the
  course's ``TinyGPT`` holding the same parameters. Cases by tag: ``structure``
  (the parts, the parameter count, no dropout, one forward pass), ``forward``
  (logits and every block's attention weights), ``logits`` (the logits alone:
  what cached decoding is compared with in ``test_generate_cached``) and
  ``causal`` (a property: no weight above the diagonal, earlier logits unchanged
  when later tokens change).
- ``generate_cached``: greedy decoding of a seeded random model, compared with
  the course's cached decoding of a model with the same parameters: ids, logits,
  the key rows each block projects (the prompt once, then one row per token) and
  the number of caches used (objects of the notebook's ``KVCache`` that a method
  of the class is called on: ``append``, or a helper of the student's own, as the
  checks count them). The model is the notebook's own ``StudentGPT`` so that a
  decoder may rely on the student's own attributes; when there is none,
  ``ProbeGPT`` below, a plain model with TinyGPT's parts. The probe ``needs``
  ``StudentGPT`` and ``KVCache`` (from the namespace the runner passes, else
  through the function's globals; the test cell passes both).
- ``model``: there is no reference for a trained model, so the run ships the
  log-probabilities of the held-out targets, the greedy answers after the final
  "it", and the logits at the final "it" with and without the rest of the
  sentence; ``judge_model`` computes the held-out loss, the accuracy and the
  causality in the trusted grader, with the checks' thresholds.

What the ``model`` probe can prove: the object named ``model`` in the kernel,
run on the course's held-out sentences, produced those numbers, and the
thresholds are applied by the grader, not by code the notebook can patch. It
cannot prove that the numbers come from a network: the held-out corpus is public
(``make_corpus(seed=0)``), so a kernel that forges its output can ship good
numbers. That the notebook's ``StudentGPT`` computes the network is what its own
probe proves on secret random weights; that ``model`` is such a network trained
here is not provable from its outputs.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ...capstone.model import TinyGPT, generate_greedy
from ...checks import capstone as C
from ...reference import KVCache  # noqa: F401  (the reference decoder's cache class, found by _cache_class)
from .. import wire
from . import Probe, arrays, aspect, looked_up, register

SMALL = C.SMALL


# ---------------------------------------------------------------- a plain model with TinyGPT's parts
def _plain_model_classes():
    """ProbeGPT: TinyGPT's parts (tok, pos, blocks of ln1, attn (W_q, W_k, W_v, W_o, n_heads), ln2, ffn;
    ln_f, head) written with plain torch layers only, so that it runs in the student's kernel without
    touching a reference piece. Built lazily (torch is imported on first use)."""
    import torch
    from torch import nn

    class ProbeAttention(nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.d_model, self.n_heads = d_model, n_heads
            self.d_k = self.head_dim = self.d_head = d_model // n_heads
            self.W_q = nn.Linear(d_model, d_model, bias=False)
            self.W_k = nn.Linear(d_model, d_model, bias=False)
            self.W_v = nn.Linear(d_model, d_model, bias=False)
            self.W_o = nn.Linear(d_model, d_model, bias=False)

        def forward(self, x, mask=None):
            B, T, d = x.shape

            def heads(t):
                return t.reshape(B, T, self.n_heads, d // self.n_heads).transpose(1, 2)

            q, k, v = heads(self.W_q(x)), heads(self.W_k(x)), heads(self.W_v(x))
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_heads)
            if mask is not None:
                scores = scores + mask
            w = scores.softmax(-1)
            return self.W_o((w @ v).transpose(1, 2).reshape(B, T, d)), w

    class ProbeFeedForward(nn.Module):
        def __init__(self, d_model):
            super().__init__()
            self.expand = nn.Linear(d_model, 4 * d_model)
            self.gelu = nn.GELU()
            self.project = nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            return self.project(self.gelu(self.expand(x)))

    class ProbeBlock(nn.Module):
        def __init__(self, d_model, n_heads, dropout=0.0):
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.attn = ProbeAttention(d_model, n_heads)
            self.ln2 = nn.LayerNorm(d_model)
            self.ffn = ProbeFeedForward(d_model)
            self.drop = nn.Dropout(dropout)

        def forward(self, x, mask=None):
            a, w = self.attn(self.ln1(x), mask)
            x = x + self.drop(a)
            return x + self.drop(self.ffn(self.ln2(x))), w

    class ProbeGPT(nn.Module):
        def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
            super().__init__()
            self.tok = nn.Embedding(vocab_size, d_model)
            self.pos = nn.Embedding(max_len, d_model)
            self.blocks = nn.ModuleList(ProbeBlock(d_model, n_heads) for _ in range(n_layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab_size, bias=False)
            self.max_len, self.d_model, self.n_heads, self.n_layers = max_len, d_model, n_heads, n_layers

        def forward(self, idx):
            T = idx.shape[1]
            x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
            mask = torch.triu(torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device), diagonal=1)
            weights = []
            for block in self.blocks:
                x, w = block(x, mask)
                weights.append(w)
            return self.head(self.ln_f(x)), weights

    return ProbeGPT


@functools.cache
def probe_gpt():
    return _plain_model_classes()


# ---------------------------------------------------------------- shared helpers
CONFIG_KEYS = ("vocab_size", "d_model", "n_heads", "n_layers", "max_len")


def _cfg(case):
    return {k: int(case[k]) for k in CONFIG_KEYS}


def _build(cls, cfg, seed):
    """``cls(**cfg)`` with a fixed seed, leaving the caller's random state alone."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(**cfg)


def _loaded(cls, case, dtype):
    """The model of ``cls`` with the case's seeded random parameters, in eval mode (the checks' loader)."""
    import torch

    cfg = _cfg(case)
    model = _build(cls, cfg, case["seed"])
    C._check_parts(model, **cfg)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(case["seed"])
    C.load_parameters(model, C.random_parameters(g, dtype=dtype, **cfg))
    return model


def _forward(model, idx, n_layers):
    """The model on a copy of ``idx``: (logits, [weights per block]), with the checks' demands on the result."""
    import torch

    copy = idx.clone()
    res = model(copy)
    if not torch.equal(copy, idx):
        raise AssertionError("the model modified its input ids in place")
    return _unpack(res, n_layers)


def _unpack(res, n_layers):
    import torch

    if not isinstance(res, (tuple, list)) or len(res) != 2:
        raise AssertionError("forward(idx) should return a tuple (logits, attentions)")
    logits, atts = res
    if not isinstance(logits, torch.Tensor):
        raise AssertionError(f"the logits should be a tensor, not a {type(logits).__name__}")
    if not isinstance(atts, (list, tuple)) or len(atts) != n_layers or not all(isinstance(a, torch.Tensor) for a in atts):
        raise AssertionError(f"attentions should be a list of {n_layers} tensors, one per block")
    return logits, list(atts)


def _dtype(name):
    import torch

    return getattr(torch, name)


# ---------------------------------------------------------------- StudentGPT
def _gpt_case(rng, kind, tags, B, T, dtype="float64", label="", **cfg):
    cfg = {**SMALL, **cfg}
    return {"label": f"{label}ids of shape {(B, T)}, {dtype}, vocabulary {cfg['vocab_size']}, width {cfg['d_model']}, "
                     f"{cfg['n_heads']} heads, {cfg['n_layers']} blocks", "tags": tags, "kind": kind,
            "seed": int(rng.integers(0, 2**31)), "dtype": dtype, **cfg,
            "idx": rng.integers(0, cfg["vocab_size"], size=(B, T)).astype(np.int64)}


def gpt_cases(rng: np.random.Generator) -> list:
    cases = [
        # the structure test's two sizes: the exercise's model and a small three-block one
        _gpt_case(rng, "structure", ("structure",), 2, 5, "float32", "the parts and one forward pass, ",
                  vocab_size=57, d_model=64, n_heads=4, n_layers=2, max_len=32),
        _gpt_case(rng, "structure", ("structure",), 2, 5, "float32", "the parts and one forward pass, ", n_layers=3),
    ]
    # the forward test's shapes: B=2, T=7 (visible), then T=1, T=max_len and float32
    for B, T, dtype in ((2, 7, "float64"), (1, 1, "float64"), (3, 10, "float64"), (2, 6, "float32")):
        cases.append(_gpt_case(rng, "forward", ("forward",), B, T, dtype, "random parameters, "))
    # the logits alone (what cached decoding is compared with): two and three blocks
    cases.append(_gpt_case(rng, "logits", ("logits",), 2, 8, "float64", "the logits, "))
    cases.append(_gpt_case(rng, "logits", ("logits",), 3, 10, "float64", "the logits, ", n_layers=3))
    # causality: later tokens changed after positions 2 and 5
    cases.append(_gpt_case(rng, "causal", ("causal",), 2, 8, "float64", "later tokens changed, "))
    return cases


def run_gpt(cls, case):
    import torch
    from torch import nn

    kind, cfg = case["kind"], _cfg(case)
    n_layers = cfg["n_layers"]
    idx = case["idx"]
    with torch.no_grad():
        if kind == "structure":
            model = _build(cls, cfg, case["seed"])
            C._check_parts(model, **cfg)
            _forward(model.eval(), idx, n_layers)
            return {"parameters": int(sum(p.numel() for p in model.parameters())),
                    "dropout": [float(m.p) for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]}
        model = _loaded(cls, case, _dtype(case["dtype"]))
        if kind == "logits":  # as decoding without a cache reads them: model(ids)[0]
            copy = idx.clone()
            logits = model(copy)[0]
            if not torch.equal(copy, idx):
                raise AssertionError("the model modified its input ids in place")
            return {"logits": logits}
        logits, atts = _forward(model, idx, n_layers)
        if kind == "forward":
            return {"logits": logits, "attentions": atts}
        # causal: the weights above the diagonal, and the earlier logits when later tokens change
        T, V = idx.shape[1], cfg["vocab_size"]
        out = {"largest weight above the diagonal": [
            float(torch.triu(a.detach().double(), diagonal=1).abs().max()) if tuple(a.shape[-2:]) == (T, T) else 0.0
            for a in atts]}
        for t in (2, 5):
            changed = idx.clone()
            changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.arange(T - t - 1)) % V
            logits2, _ = _forward(model, changed, n_layers)
            out[f"logits up to position {t}"] = logits[:, :t + 1]
            out[f"logits up to position {t}, later tokens changed"] = logits2[:, :t + 1]
        return out


def causal_property(case, got, want):
    """No block gives weight to a later position; changing the tokens after position t leaves the
    logits at 0..t unchanged (float64 tolerance, as the causal test)."""
    for i, v in enumerate(got["largest weight above the diagonal"]["items"]):
        w = wire.scalar(v)
        if not isinstance(w, float) or w != 0.0:
            return f"block {i} gives weight {w!r} to a later position"
    a = arrays(got)
    atol, rtol = C.tolerance(_dtype("float64"))
    for t in (2, 5):
        x, y = a[f"logits up to position {t}"], a[f"logits up to position {t}, later tokens changed"]
        if x.shape != y.shape or not np.allclose(x.astype(np.float64), y.astype(np.float64), atol=atol, rtol=rtol,
                                                 equal_nan=True):
            return f"changing the tokens after position {t} changes the logits at positions 0..{t}"
    return None


GPT_CELLS = {
    "test_model_structure": aspect("structure"),
    "test_model_forward": aspect("forward"),
    "test_model_causal": aspect("causal", mode="structure", also=causal_property),
    # cached decoding is compared with the model's own forward pass: its logits must be the network's
    "test_generate_cached": aspect("logits"),
}


# ---------------------------------------------------------------- generate_cached
def _model_class(fn, namespace=None):
    """The notebook's StudentGPT (the test cell's model class); else ProbeGPT."""
    from torch import nn

    cls = looked_up(fn, "StudentGPT", namespace)
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) else probe_gpt()


def _cache_class(fn, namespace=None):
    """The notebook's KVCache (the test cell's cache class); else None."""
    cls = looked_up(fn, "KVCache", namespace)
    return cls if isinstance(cls, type) else None


def reference_generate_cached(model, ids, n_new):
    """The course's cached greedy decoding (its globals hold the reference KVCache and no StudentGPT)."""
    return generate_greedy(model, ids, n_new)


def generate_cases(rng: np.random.Generator) -> list:
    cases = []
    for B, T_p, n_new, n_layers in ((2, 3, 5, 2), (1, 1, 6, 2), (3, 4, 6, 3), (2, 9, 1, 2)):
        cfg = {**SMALL, "n_layers": n_layers}
        cases.append({"label": f"a random model of {n_layers} blocks (float64), B={B}, a prompt of {T_p}, "
                               f"n_new={n_new}", "tags": ("generate",), "seed": int(rng.integers(0, 2**31)),
                      **cfg, "n_new": n_new,
                      "ids": rng.integers(0, cfg["vocab_size"], size=(B, T_p)).astype(np.int64)})
    return cases


def run_generate(fn, case, namespace=None):
    """``namespace``: the notebook's (``Probe.needs``: its StudentGPT and KVCache); None: ``fn``'s globals."""
    import torch

    cfg = _cfg(case)
    model = _loaded(_model_class(fn, namespace), case, torch.float64)
    ids, n_new = case["ids"], int(case["n_new"])
    B, T_p = ids.shape
    counts = [0] * len(model.blocks)

    def hook(i):
        def record(module, inputs, output):
            counts[i] += inputs[0].shape[:-1].numel()
        return record

    handles = [block.attn.W_k.register_forward_hook(hook(i)) for i, block in enumerate(model.blocks)]
    Cache = _cache_class(fn, namespace)
    caches, unpatch = C.recording_caches(Cache) if Cache is not None else ([], lambda: None)
    try:
        copy = ids.clone()
        with torch.no_grad():
            res = fn(model, copy, n_new)
    finally:
        unpatch()
        for h in handles:
            h.remove()
    if not torch.equal(copy, ids):
        raise AssertionError("generate_cached modified the prompt ids in place")
    if not isinstance(res, (tuple, list)) or len(res) != 2 or not all(isinstance(r, torch.Tensor) for r in res):
        raise AssertionError("generate_cached(model, ids, n_new) should return a tuple (ids, logits)")
    return {"ids": res[0], "logits": res[1],
            # the cache is used: the prompt once, then one key row per new token (as the test counts them)
            "key rows within the cache's budget": [c <= B * (T_p + n_new) for c in counts],
            "KVCache objects used": len(caches) if Cache is not None else cfg["n_layers"]}


GENERATE_CELLS = {
    "test_generate_cached": aspect("generate"),
    "test_generate_trained": aspect("generate"),  # the trained model's decoding needs a correct decoder
}


# ---------------------------------------------------------------- the trained model
CAUSAL_EXAMPLES = 24  # as many prompts as test_generate_trained


@functools.lru_cache(maxsize=1)
def _held_out():
    from ...capstone import make_corpus

    corpus = make_corpus(seed=0)
    pad = corpus.vocab.pad
    L = max(len(ex.ids) for ex in corpus.held_out)
    ids = np.array([ex.ids + [pad] * (L - len(ex.ids)) for ex in corpus.held_out], dtype=np.uint8)
    pronoun = np.array([ex.pronoun_index for ex in corpus.held_out], dtype=np.int64)
    return ids, pronoun, pad


def model_cases(rng: np.random.Generator) -> list:
    ids, pronoun, pad = _held_out()
    n = len(ids)
    pick = np.sort(rng.choice(n, size=CAUSAL_EXAMPLES, replace=False))
    return [
        {"label": f"the {n} held-out sentences (next-token loss)", "tags": ("loss",), "kind": "loss",
         "ids": ids, "pad": pad},
        {"label": f"the {n} held-out sentences (the word after the final 'it')", "tags": ("resolve",),
         "kind": "resolve", "ids": ids, "pronoun": pronoun, "pad": pad},
        {"label": f"{CAUSAL_EXAMPLES} held-out sentences (the logits at the final 'it' with and without the rest "
                  "of the sentence)", "tags": ("causal",), "kind": "causal", "ids": ids[pick],
         "pronoun": pronoun[pick], "pad": pad},
    ]


def _by_length(pronoun):
    groups = {}
    for i, p in enumerate(pronoun.tolist()):
        groups.setdefault(p + 1, []).append(i)
    return sorted(groups.items())


def run_model(model, case):
    """The model on the held-out ids, as ``held_out_loss``, ``resolve`` and cached decoding see it."""
    import torch

    X = case["ids"].long()
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        with torch.no_grad():
            if case["kind"] == "loss":
                logits = model(X[:, :-1])[0]  # all sentences in one batch, as held_out_loss
                targets = X[:, 1:]
                logp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                return {"logp": logp[targets != int(case["pad"])].float()}
            pronoun = case["pronoun"]
            last = {}
            for T, rows in _by_length(pronoun):  # prompts ending with the final "it", one batch per length
                last.update(zip(rows, model(X[rows, :T])[0][:, -1]))
            prefix = torch.stack([last[i] for i in range(len(X))])
            if case["kind"] == "resolve":
                return {"pred": prefix.argmax(-1)}
            full = model(X)[0][torch.arange(len(X)), pronoun]  # the same position, the whole sentence fed
            return {"prefix": prefix.float(), "full": full.float()}
    finally:
        if hasattr(model, "train"):
            model.train(was_training)


def _array(got, key, what):
    d = got.get(key)
    if not wire.is_array(d):
        return None, f"it returned no {what}"
    try:
        return wire.array(d), None
    except wire.WireError as e:
        return None, f"its {what}: {e}"


def judge_model(case, got):
    """The checks' thresholds, applied in the trusted grader to what the model's run shipped."""
    ids = case["ids"].numpy().astype(np.int64)
    pad = int(case["pad"])
    if case["kind"] == "loss":
        logp, why = _array(got, "logp", "log-probabilities")
        if why:
            return why
        n = int((ids[:, 1:] != pad).sum())
        if logp.shape != (n,) or logp.dtype.kind != "f":
            return f"its log-probabilities have shape {logp.shape}, expected ({n},)"
        logp = logp.astype(np.float64)
        if np.any(logp > 1e-6):
            return "a log-probability is above 0"
        loss = float(-logp.mean())
        if not math.isfinite(loss) or loss >= C.LOSS_THRESHOLD:
            return f"the held-out loss is {loss:.3f}, not below {C.LOSS_THRESHOLD}"
        if loss < C.LEAK_THRESHOLD:
            return (f"the held-out loss is {loss:.3f}, below {C.LEAK_THRESHOLD}: the model sees the word it "
                    "predicts (the causal mask)")
        return None
    pronoun = case["pronoun"].numpy()
    if case["kind"] == "resolve":
        pred, why = _array(got, "pred", "predictions")
        if why:
            return why
        if pred.shape != (len(ids),) or pred.dtype.kind not in "iu":
            return f"its predictions have shape {pred.shape} and dtype {pred.dtype}, expected ({len(ids)},) integers"
        acc = float((pred == ids[np.arange(len(ids)), pronoun + 1]).mean())
        if acc < C.ACCURACY_THRESHOLD:
            return f"it names the right noun after the final 'it' in {acc:.1%} of the held-out sentences"
        return None
    prefix, why = _array(got, "prefix", "logits of the prompts")
    full, why2 = _array(got, "full", "logits of the whole sentences")
    if why or why2:
        return why or why2
    if prefix.shape != full.shape or prefix.ndim != 2 or prefix.shape[0] != len(ids):
        return f"its logits have shapes {prefix.shape} and {full.shape}"
    diff = np.abs(prefix.astype(np.float64) - full.astype(np.float64))
    if not np.all(np.isfinite(diff)) or diff.max(initial=0.0) > C.TRAINED_LOGIT_TOL:
        return ("its logits at the final 'it' change when the rest of the sentence is fed too (by up to "
                f"{np.nan_to_num(diff, nan=np.inf).max():.3g}): decoding with a cache cannot match it")
    return None


def rebuild_model(namespace, state):
    """The trained model built again in the runner (``Probe.rebuild``), as the locked training cell
    builds it: ``StudentGPT(len(vocab.tokens))`` of the notebook's own class, then the kernel's
    parameters loaded into it (every key, every shape: ``load_state_dict(strict=True)``)."""
    import torch

    cls = namespace.get("StudentGPT")
    if cls is None:
        raise NameError("the notebook defines no StudentGPT to rebuild the trained model in")
    from ...capstone.corpus import Vocab

    model = cls(len(Vocab().tokens))  # (make_corpus(seed=0)'s vocabulary: the course's words)
    params = {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for k, v in state.items()}
    model.load_state_dict(params, strict=True)
    return model.eval()


MODEL_CELLS = {
    "test_trained": aspect("loss"),
    "test_resolves_it": aspect("resolve"),
    "test_generate_trained": aspect("causal"),
}

register(
    Probe("StudentGPT", gpt_cases, run_gpt, reference=TinyGPT, forbidden=C.MODEL_FORBIDDEN, cells=GPT_CELLS),
    Probe("generate_cached", generate_cases, run_generate, reference=reference_generate_cached,
          forbidden=C.GENERATE_FORBIDDEN, cells=GENERATE_CELLS, needs=("StudentGPT", "KVCache")),
    Probe("model", model_cases, run_model, forbidden=C.MODEL_FORBIDDEN, judge=judge_model, cells=MODEL_CELLS,
          rebuild=rebuild_model, rebuilt_from=("StudentGPT",)),
)
