"""The seeded training loop of the induction-head model, and what the chapter measures."""
from __future__ import annotations

import math
import time

import torch
from torch.nn import functional as F

from ..capstone.train import deterministic
from ..reference import induction_score
from .data import PERIOD, repeated_tokens, training_batch
from .model import AttentionOnly

# The reference run: 6000 steps of 32 sequences of 48 tokens, about a minute on one idle CPU thread.
CONFIG = dict(vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_len=48, periods=(8, 24),
              steps=6000, batch_size=32, lr=3e-3, weight_decay=0.0, eval_every=20, eval_size=256,
              eval_period=PERIOD, eval_seed=1234)


def split_losses(logits, ids, period):
    """(first, second): the mean next-token cross-entropy of the predictions of the first copy's
    tokens 1 .. period - 1 and of the second copy's tokens period + 1 .. T - 1 (token ``period``,
    where the repeat starts, cannot be foreseen and counts in neither)."""
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T - 1)
    return loss[:, :period - 1].mean().item(), loss[:, period:].mean().item()


def previous_token_score(weights):
    """(...): the mean of weights[..., i, i - 1] over i = 1 .. T - 1."""
    return torch.diagonal(weights, offset=-1, dim1=-2, dim2=-1).mean(-1)


@torch.no_grad()
def measure(model, ids, period):
    """On sequences ``ids`` (B, 2 * period) of ``period`` tokens repeated twice: the two split losses
    and, per layer and head, the induction and previous-token scores averaged over the batch."""
    logits, attentions = model(ids)
    weights = torch.stack(attentions).mean(1)  # (n_layers, n_heads, T, T), batch mean
    first, second = split_losses(logits, ids, period)
    return {"first_half": first, "second_half": second, "induction": induction_score(weights, period),
            "previous": previous_token_score(weights)}


def eval_tokens(config=None):
    """The fixed evaluation sequences of ``config`` (its eval_size, eval_period and eval_seed)."""
    config = {**CONFIG, **(config or {})}
    g = torch.Generator().manual_seed(config["eval_seed"])
    return repeated_tokens(config["eval_size"], config["eval_period"], config["vocab_size"], g)


def train(config=None, seed=0, log=None):
    """Train an ``AttentionOnly`` model; deterministic for ``seed``. ``config`` overrides ``CONFIG``.

    Returns (model in eval mode, history): the training loss of every step (``loss``) and, every
    ``eval_every`` steps, on the evaluation sequences, the two split losses and each head's
    induction and previous-token scores (``eval_step``, ``first_half``, ``second_half``,
    ``induction``, ``previous``: lists of (n_layers, n_heads) nested lists), and the time in seconds.
    """
    config = {**CONFIG, **(config or {})}
    period = config["eval_period"]
    ids_eval = eval_tokens(config)
    with deterministic():
        torch.manual_seed(seed)
        model = AttentionOnly(config["vocab_size"], config["d_model"], config["n_heads"], config["n_layers"],
                              config["max_len"])
        opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
        gen = torch.Generator().manual_seed(seed)
        history = {k: [] for k in ("loss", "eval_step", "first_half", "second_half", "induction", "previous")}
        start = time.perf_counter()
        for step in range(config["steps"]):
            ids, _ = training_batch(config["batch_size"], config["max_len"], config["periods"],
                                    config["vocab_size"], gen)
            model.train()
            logits, _ = model(ids[:, :-1])  # (B, T - 1, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            history["loss"].append(loss.item())
            if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
                model.eval()
                m = measure(model, ids_eval, period)
                history["eval_step"].append(step + 1)
                for k in ("first_half", "second_half"):
                    history[k].append(m[k])
                for k in ("induction", "previous"):
                    history[k].append(m[k].tolist())
                if log:
                    log(f"step {step + 1}: loss {loss.item():.3f}, second half {m['second_half']:.3f}, "
                        f"induction scores {[[round(v, 2) for v in r] for r in m['induction'].tolist()]}")
        history["seconds"] = time.perf_counter() - start
    return model.eval(), history


def phase_change(history):
    """The first evaluation step at which the second-half loss is below the midpoint of its
    first and its last value: where the drop happens."""
    first, last = history["second_half"][0], history["second_half"][-1]
    middle = (first + last) / 2
    return next(s for s, v in zip(history["eval_step"], history["second_half"]) if v < middle)


def uniform_loss(config=None):
    """ln(vocab_size): the loss of a guess that knows nothing."""
    return math.log({**CONFIG, **(config or {})}["vocab_size"])


def main():
    """Train the reference model and store it in ``weights.pt`` (``python -m firstprinciples.induction.train``)."""
    from ..capstone.train import environment
    from .model import save_trained

    model, history = train(seed=0, log=print)
    history["environment"] = environment()
    history["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in CONFIG.items()}
    save_trained(model, history)
    print(f"trained in {history['seconds']:.1f} s; phase change near step {phase_change(history)}; saved")


if __name__ == "__main__":
    main()


__all__ = ["CONFIG", "eval_tokens", "measure", "phase_change", "previous_token_score", "split_losses", "train",
           "uniform_loss"]
