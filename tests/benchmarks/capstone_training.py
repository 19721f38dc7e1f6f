"""Benchmark: the capstone's reference training run and the exercise's budget.

Prints, for the reference run (600 steps, seed 0) and the exercise's budget
(400 steps): the wall time, the final training loss (mean of the last 50
steps), the held-out loss and the held-out accuracy of resolving "it", and
whether the reference run reproduced the stored weights bit for bit. Also prints
the target: the reference run must finish in under 2 minutes on 2 CPU cores
(it uses one thread).

Run from the repository root: python tests/benchmarks/capstone_training.py
Nothing is written: weights.pt is left as it is.
"""
from __future__ import annotations

import statistics

import torch

from firstprinciples.capstone import baselines, make_corpus
from firstprinciples.capstone.model import load_checkpoint
from firstprinciples.capstone.train import environment, train

TARGET_SECONDS = 120


def run(corpus, config, label):
    model, history = train(corpus, config, seed=0)
    print(f"{label}: {history['seconds']:.1f} s; final training loss {statistics.mean(history['loss'][-50:]):.3f}; "
          f"held-out loss {history['held_out_loss'][-1]:.3f}; "
          f"held-out accuracy {history['held_out_accuracy'][-1]:.3f}")
    return model, history


def main():
    corpus = make_corpus(seed=0)
    print(f"chance baseline of resolving 'it' (held-out): {baselines(corpus)['chance']:.3f}")
    model, history = run(corpus, None, "reference run (600 steps)")
    ckpt = load_checkpoint()
    same = all(torch.equal(v, ckpt["state_dict"][k]) for k, v in model.state_dict().items())
    print(f"stored weights reproduced bit for bit: {same} "
          f"(stored on {ckpt['history']['environment']}, this machine {environment()})")
    print(f"target: under {TARGET_SECONDS} s -> {'met' if history['seconds'] < TARGET_SECONDS else 'NOT MET'}")
    run(corpus, dict(steps=400, eval_every=100), "exercise budget (400 steps)")


if __name__ == "__main__":
    main()
