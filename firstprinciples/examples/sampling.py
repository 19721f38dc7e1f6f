"""The worked example of the chapter "Sampling: where the randomness lives" and of its
exercise ``sample_next_token`` (declared in ``exercises.sampling``), and the statistics of the
frequency tests that the chapter quotes (``exercises.sampling`` states why they hold)."""
from __future__ import annotations

import math

# Six next words and their logits.
WORDS = ("tired", "hungry", "scared", "wide", "steep", "muddy")
LOGITS = (2.0, 1.0, 0.5, 0.0, -1.0, -2.0)
N_DRAWS = 10_000
DELTA = 1e-9  # false-failure probability of one token's frequency test


def allowed_deviation(n, p, delta=DELTA):
    """The t with 2 exp(-t^2 / (2 (n p (1 - p) + t / 3))) = delta (Bernstein's inequality)."""
    L = math.log(2 / delta)
    return L / 3 + math.sqrt(L * L / 9 + 2 * n * p * (1 - p) * L)
