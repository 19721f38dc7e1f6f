"""The seeded training of the five position variants, and what the chapter measures."""
from __future__ import annotations

import time

import torch
from torch.nn import functional as F

from ..capstone.corpus import Vocab
from ..capstone.train import deterministic, train_step
from .data import TRAIN_LEN, eval_windows, split_windows, streams, training_batch
from .model import VARIANTS, LengthGPT

# The reference run, per variant: the capstone's size and schedule, on windows of 32 tokens.
CONFIG = dict(d_model=64, n_heads=4, n_layers=2, max_len=4 * TRAIN_LEN, train_len=TRAIN_LEN,
              steps=600, batch_size=64, lr=3e-3, weight_decay=0.01, warmup=100, eval_every=100)
LENGTHS = (TRAIN_LEN, 2 * TRAIN_LEN, 4 * TRAIN_LEN)  # 1x, 2x and 4x the training length


@torch.no_grad()
def position_losses(model, windows, T):
    """(T,) float64: the mean next-token loss at each input position 0 .. T - 1, over the
    ``windows`` (N, L + 1) cut into windows of T inputs (the same target tokens for every T)."""
    was_training = model.training
    model.eval()
    X = split_windows(windows, T)  # (N * L / T, T + 1)
    logits = model(X[:, :-1])[0]  # (n, T, V)
    model.train(was_training)
    loss = F.cross_entropy(logits.transpose(1, 2), X[:, 1:], reduction="none")  # (n, T)
    return loss.double().mean(0)


def length_losses(model, windows):
    """{T: mean next-token loss over the same target tokens, in windows of T inputs} for ``LENGTHS``."""
    return {T: position_losses(model, windows, T).mean().item() for T in LENGTHS}


def train_variant(position, train_stream, windows, config=None, seed=0, log=None):
    """Train one ``LengthGPT`` with positions ``position`` on windows of ``train_len`` tokens of
    ``train_stream``; deterministic for ``seed``. Returns (model in eval mode, history): the loss of
    every step (``loss``), every ``eval_every`` steps the losses on ``windows`` at each length
    (``eval_step``, ``len_32`` ...) and the time in seconds."""
    config = {**CONFIG, **(config or {})}
    with deterministic():
        torch.manual_seed(seed)
        model = LengthGPT(len(Vocab()), position, config["d_model"], config["n_heads"], config["n_layers"],
                          config["max_len"])
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
        gen = torch.Generator().manual_seed(seed)
        history = {"loss": [], "eval_step": [], **{f"len_{T}": [] for T in LENGTHS}}
        start = time.perf_counter()
        for step in range(config["steps"]):
            xb = training_batch(train_stream, config["batch_size"], config["train_len"], gen)  # (B, L + 1)
            loss = train_step(model, opt, xb, step, config)
            history["loss"].append(loss.item())
            if (step + 1) % config["eval_every"] == 0 or step + 1 == config["steps"]:
                history["eval_step"].append(step + 1)
                for T, value in length_losses(model, windows).items():
                    history[f"len_{T}"].append(value)
                if log:
                    log(f"{position} step {step + 1}: loss {loss.item():.3f}, held-out "
                        + ", ".join(f"{T}: {history[f'len_{T}'][-1]:.3f}" for T in LENGTHS))
        history["seconds"] = time.perf_counter() - start
    return model.eval(), history


def train_all(config=None, seed=0, log=None, variants=VARIANTS):
    """({variant: model}, {variant: history}): every variant on the same stream, seed and steps."""
    train_stream, eval_stream = streams(seed)
    windows = eval_windows(eval_stream)
    models, histories = {}, {}
    for name in variants:
        models[name], histories[name] = train_variant(name, train_stream, windows, config, seed, log)
    return models, histories


def main():
    """Train the five variants and store them in ``weights.pt`` (``python -m firstprinciples.lengths.train``)."""
    from ..capstone.train import environment
    from .model import save_trained

    models, histories = train_all(seed=0, log=print)
    seconds = sum(h["seconds"] for h in histories.values())
    save_trained(models, {"variants": histories, "environment": environment(), "config": dict(CONFIG),
                          "seconds": seconds})
    print(f"trained the {len(models)} variants in {seconds:.1f} s; saved")


if __name__ == "__main__":
    main()


__all__ = ["CONFIG", "LENGTHS", "length_losses", "position_losses", "train_all", "train_variant"]
