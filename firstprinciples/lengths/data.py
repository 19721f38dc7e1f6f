"""The token streams: capstone sentences one after another, cut into windows."""
from __future__ import annotations

import torch

from ..capstone.corpus import make_corpus

TRAIN_LEN = 32  # the training windows: 32 input tokens (and the 32 next tokens as targets)
N_TRAIN, N_EVAL = 4000, 1200  # sentences in the training stream and in the evaluation stream


def streams(seed=0):
    """(train, eval): two 1-D long tensors, each the ids of distinct capstone sentences
    (``<bos>`` ... ``<eos>``) in a seeded random order, end to end. No sentence is in both."""
    corpus = make_corpus(seed=seed, n_train=N_TRAIN + N_EVAL, n_held_out=0)
    sentences = corpus.train  # drawn without replacement: the first N_TRAIN train, the rest evaluate
    return (torch.tensor([t for ex in sentences[:N_TRAIN] for t in ex.ids]),
            torch.tensor([t for ex in sentences[N_TRAIN:] for t in ex.ids]))


def training_batch(stream, n, T, generator):
    """(n, T + 1) long: windows of the stream at random offsets (inputs [:, :-1], targets [:, 1:])."""
    start = torch.randint(0, len(stream) - T - 1, (n,), generator=generator)
    return stream[start[:, None] + torch.arange(T + 1)]  # (n, T + 1)


def eval_windows(stream, T=4 * TRAIN_LEN):
    """(N, T + 1) long: the stream cut into consecutive, non-overlapping windows of T + 1 tokens."""
    n = (len(stream) - 1) // T
    return torch.stack([stream[k * T:k * T + T + 1] for k in range(n)])


def split_windows(windows, T):
    """The same target tokens with shorter context: (N, L + 1) windows -> (N * L / T, T + 1),
    each row of ``windows`` cut into L / T consecutive windows of T inputs."""
    L = windows.shape[1] - 1
    if L % T:
        raise ValueError(f"windows of {L} tokens do not split into windows of {T}")
    starts = torch.arange(0, L, T)
    return windows[:, starts[:, None] + torch.arange(T + 1)].reshape(-1, T + 1)  # (N * L / T, T + 1)
