"""The course's training loop for the capstone, and the measurements of the pronoun task."""
from __future__ import annotations

import contextlib
import math
import time

import torch
from torch.nn import functional as F

from .corpus import Corpus

# The reference run: 600 steps of 64 sentences, about 12 s on one CPU thread.
CONFIG = dict(d_model=64, n_heads=4, n_layers=2, max_len=32,
              steps=600, batch_size=64, lr=3e-3, weight_decay=0.01, warmup=100, eval_every=50)
# One thread: the matrices are tiny, so a second thread barely helps on an idle
# machine and, on a busy one, makes a run several times slower. Results depend on
# the thread count (sums are split differently), so it is fixed.
THREADS = 1


def batch_tensor(examples, pad=0):
    """(N, L) long tensor of the examples' ids, right-padded with ``pad`` to the longest."""
    L = max(len(ex.ids) for ex in examples)
    return torch.tensor([ex.ids + [pad] * (L - len(ex.ids)) for ex in examples], dtype=torch.long)


def lm_loss(logits, targets, pad=0):
    """Mean next-token cross-entropy; positions whose target is ``pad`` do not count."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=pad)


@contextlib.contextmanager
def deterministic(threads=THREADS):
    """A fixed thread count and deterministic algorithms inside the block; the previous settings after it."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


@torch.no_grad()
def held_out_loss(model, examples, pad=0):
    """Mean next-token cross-entropy of ``model`` on ``examples`` (all non-pad targets)."""
    was_training = model.training
    model.eval()
    X = batch_tensor(examples, pad)
    logits = model(X[:, :-1])[0]
    model.train(was_training)
    return lm_loss(logits, X[:, 1:], pad).item()


@torch.no_grad()
def resolve(model, examples):
    """Greedy answer of ``model`` after the final "it" of each example: a (N,) long tensor of token ids.

    The model sees each sentence only up to that "it" (prompts of equal length go
    in one batch), so even a model without a causal mask cannot peek at the answer.
    """
    was_training = model.training
    model.eval()
    pred = torch.empty(len(examples), dtype=torch.long)
    by_length = {}
    for i, ex in enumerate(examples):
        by_length.setdefault(ex.pronoun_index + 1, []).append(i)
    for T, rows in sorted(by_length.items()):
        prompts = torch.tensor([examples[i].ids[:T] for i in rows])  # (n, T): ends with the final "it"
        pred[rows] = model(prompts)[0][:, -1].argmax(-1)
    model.train(was_training)
    return pred


def accuracy(model, examples):
    """Fraction of examples whose greedy prediction after the final "it" is the referent noun."""
    pred = resolve(model, examples)
    target = torch.tensor([ex.ids[ex.answer_index] for ex in examples])
    return (pred == target).float().mean().item()


@torch.no_grad()
def head_scores(model, examples):
    """Attention of the final "it" to the two nouns, per layer and head.

    Returns a dict of (n_layers, n_heads) tensors: ``wins``, the fraction of
    examples in which the head gives the referent more weight than the
    distractor; ``referent`` and ``distractor``, the mean weights they receive.
    """
    was_training = model.training
    model.eval()
    X = batch_tensor(examples)
    attentions = model(X)[1]
    model.train(was_training)
    rows = torch.arange(len(examples))
    pron = torch.tensor([ex.pronoun_index for ex in examples])
    ref = torch.tensor([ex.referent_index for ex in examples])
    dis = torch.tensor([ex.distractor_index for ex in examples])
    w_ref = torch.stack([a[rows, :, pron, ref] for a in attentions])  # (n_layers, N, H)
    w_dis = torch.stack([a[rows, :, pron, dis] for a in attentions])
    return {
        "wins": (w_ref > w_dis).double().mean(1),
        "referent": w_ref.double().mean(1),
        "distractor": w_dis.double().mean(1),
    }


def unigram_loss(corpus):
    """Held-out cross-entropy of the best context-free guess: training token frequencies."""
    pad = corpus.vocab.pad
    counts = torch.zeros(len(corpus.vocab), dtype=torch.float64)
    for ex in corpus.train:
        counts += torch.bincount(torch.tensor(ex.ids[1:]), minlength=len(corpus.vocab)).double()
    logp = (counts / counts.sum()).log()
    targets = torch.tensor([t for ex in corpus.held_out for t in ex.ids[1:] if t != pad])
    return -logp[targets].mean().item()


def bigram_loss(corpus, smoothing=0.01):
    """Held-out cross-entropy of guessing from the previous word alone (training bigram counts,
    ``smoothing`` added to every count)."""
    V = len(corpus.vocab)
    counts = torch.full((V, V), smoothing, dtype=torch.float64)
    for ex in corpus.train:
        ids = torch.tensor(ex.ids)
        counts.index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1, dtype=torch.float64), accumulate=True)
    logp = (counts / counts.sum(1, keepdim=True)).log()
    pairs = torch.tensor([(a, b) for ex in corpus.held_out for a, b in zip(ex.ids[:-1], ex.ids[1:])])
    return -logp[pairs[:, 0], pairs[:, 1]].mean().item()


def lr_at(step, config):
    """Linear warm-up, then cosine decay to a tenth of ``lr``."""
    lr, warm, steps = config["lr"], config["warmup"], config["steps"]
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train_step(model, opt, xb, step: int, config: dict, pad: int = 0):
    """One optimiser step of next-token prediction on the batch ``xb`` (B, L) with the
    learning rate of ``step``; returns the loss (a 0-d tensor)."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, config)
    logits, _ = model(xb[:, :-1])  # (B, L-1, V)
    loss = lm_loss(logits, xb[:, 1:], pad)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def train(corpus: Corpus, config=None, seed=0, model=None, log=None):
    """Train a ``TinyGPT`` (or the given ``model``) on ``corpus.train``; deterministic for ``seed``.

    ``config`` overrides entries of ``CONFIG``. Returns (model in eval mode,
    history): ``history`` holds the loss of every step (``loss``), and every
    ``eval_every`` steps the held-out loss and accuracy (``eval_step``,
    ``held_out_loss``, ``held_out_accuracy``), and the wall time in seconds.
    """
    config = {**CONFIG, **(config or {})}
    pad = corpus.vocab.pad
    with deterministic():
        torch.manual_seed(seed)
        if model is None:
            from .model import TinyGPT  # (here: the exercise trains its own model, and its re-check has no TinyGPT)

            model = TinyGPT(len(corpus.vocab), config["d_model"], config["n_heads"], config["n_layers"],
                            config["max_len"])
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
        X = batch_tensor(corpus.train, pad)  # (N, L)
        gen = torch.Generator().manual_seed(seed)
        history = {"loss": [], "eval_step": [], "held_out_loss": [], "held_out_accuracy": []}
        order, cursor, start = torch.randperm(len(X), generator=gen), 0, time.perf_counter()
        for step in range(config["steps"]):
            if cursor + config["batch_size"] > len(X):  # a new epoch: a new shuffle
                order, cursor = torch.randperm(len(X), generator=gen), 0
            xb = X[order[cursor:cursor + config["batch_size"]]]
            cursor += config["batch_size"]
            loss = train_step(model, opt, xb, step, config, pad)
            history["loss"].append(loss.item())
            if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
                history["eval_step"].append(step + 1)
                history["held_out_loss"].append(held_out_loss(model, corpus.held_out, pad))
                history["held_out_accuracy"].append(accuracy(model, corpus.held_out))
                if log:
                    log(f"step {step + 1}: loss {loss.item():.3f}, held-out loss "
                        f"{history['held_out_loss'][-1]:.3f}, accuracy {history['held_out_accuracy'][-1]:.3f}")
        history["seconds"] = time.perf_counter() - start
    return model.eval(), history


def _cpu_features() -> list | None:
    """The CPU's vector-instruction flags (avx*, amx*) on Linux, None elsewhere. torch's own
    capability ("AVX512") is not enough: MKL and oneDNN pick their kernels by finer features (a
    machine with AMX and AVX512-FP16 rounds the same training run differently, in the 7th digit,
    from one without them, though both report AVX512)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else sorted(x for x in flags if x.startswith(("avx", "amx")))


def environment():
    """What bit-for-bit reproduction depends on: the torch version, the thread count and the CPU's
    vector instructions, as torch names them and as the kernels' dispatch sees them."""
    return {"torch": torch.__version__.split("+")[0], "cpu": torch.backends.cpu.get_cpu_capability(),
            "cpu_features": _cpu_features(), "threads": THREADS}


def main():
    """Train the reference model and store it in ``weights.pt`` (``python -m firstprinciples.capstone.train``)."""
    from .corpus import make_corpus
    from .model import save_trained

    corpus = make_corpus(seed=0)
    model, history = train(corpus, seed=0, log=print)
    history["environment"] = environment()
    history["config"] = dict(CONFIG)
    save_trained(model, corpus.vocab, history)
    print(f"trained in {history['seconds']:.1f} s; saved")


if __name__ == "__main__":
    main()


__all__ = ["CONFIG", "train", "held_out_loss", "accuracy", "resolve", "head_scores", "unigram_loss", "bigram_loss",
           "batch_tensor", "lm_loss", "deterministic", "environment"]
