"""The sequences: distinct random tokens, a block of which is repeated once."""
from __future__ import annotations

import torch

PERIOD = 16  # the page's evaluation sequences: 16 tokens, then the same 16 again (T = 32)


def repeated_tokens(n, period, vocab_size, generator):
    """(n, 2 * period) long: ``period`` distinct random tokens, then the same tokens again."""
    block = torch.stack([torch.randperm(vocab_size, generator=generator)[:period] for _ in range(n)])
    return torch.cat([block, block], dim=1)  # (n, T)


def training_batch(n, T, periods, vocab_size, generator):
    """(ids (n, T) long, repeat (n, T) bool): each row holds distinct random tokens, except that a
    block of p tokens (p drawn from ``periods``) at a random offset r is repeated right after itself.
    ``repeat[b, t]`` is True where token t is a copy (r + p <= t < r + 2p). The period and the offset
    vary from row to row, so no head can find the copy by position alone."""
    ids = torch.empty(n, T, dtype=torch.long)
    repeat = torch.zeros(n, T, dtype=torch.bool)
    lo, hi = periods
    for b in range(n):
        p = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        r = int(torch.randint(0, T - 2 * p + 1, (1,), generator=generator))
        fresh = torch.randperm(vocab_size, generator=generator)[:T - p]  # every token but the copies
        ids[b] = torch.cat([fresh[:r + p], fresh[r:r + p], fresh[r + p:]])
        repeat[b, r + p:r + 2 * p] = True
    return ids, repeat


def worked_example(dtype=torch.float32):
    """The chapter's worked example: (tokens, weights (6, 6) of ``dtype``, period 3).

    The tokens "A B C A B C"; the attention weights of a head that is partly an induction head:
    queries 3, 4 and 5 (the second A, B and C) put 0.5, 0.7 and 0.9 on keys 1, 2 and 3, the
    tokens that followed A, B and C the first time. Its induction score is 0.7.
    """
    weights = torch.tensor([
        [1.00, 0.00, 0.00, 0.00, 0.00, 0.00],
        [0.60, 0.40, 0.00, 0.00, 0.00, 0.00],
        [0.20, 0.30, 0.50, 0.00, 0.00, 0.00],
        [0.20, 0.50, 0.10, 0.20, 0.00, 0.00],
        [0.05, 0.10, 0.70, 0.10, 0.05, 0.00],
        [0.00, 0.02, 0.03, 0.90, 0.03, 0.02],
    ], dtype=dtype)
    return "A B C A B C".split(), weights, 3
