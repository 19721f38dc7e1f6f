"""The ALiBi paper's slopes, which the chapter "Positions past the training length" sets
beside the course's rule, and which the exercise's declaration
(``exercises.alibi``) names when an answer uses them."""
from __future__ import annotations

import math


def paper_slopes(n_heads):
    """The ALiBi paper's slopes: 2^(-8 (h + 1) / n) for a power of two n; otherwise those of the
    power of two p below n, then every other slope of 2p, the first n - p of them."""
    def power(n):
        return [2 ** (-8 * (h + 1) / n) for h in range(n)]

    p = 2 ** int(math.floor(math.log2(n_heads)))
    if p == n_heads:
        return power(n_heads)
    return power(p) + power(2 * p)[0::2][:n_heads - p]
