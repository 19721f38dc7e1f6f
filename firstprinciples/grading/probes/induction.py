"""Probe for ``induction_score(weights, period)``.

Tags name the test cell each case stands for: ``worked`` (fresh causal weights of the worked
example's size, T = 6 and period 3, so that a typed-in 0.7 earns nothing), ``shapes`` (type,
dtype and shape only, for several leading dimensions), ``random`` (random causal weights of
several periods, float32 and float64) and ``heads`` (the four heads of known score of the check,
for a fresh period). Scores are compared with the reference within the dtype's tolerance, and
the weights must be unchanged after the call.
"""
from __future__ import annotations

import numpy as np

from ...checks import induction as C
from ...reference import induction_score
from . import Probe, aspect, call_runner, register

run = call_runner(args=("weights", "period"), outputs=("score",))


def _causal(rng, lead, T, dtype, scale=2.0):
    scores = rng.standard_normal((*lead, T, T)) * scale
    scores[..., np.triu(np.ones((T, T), dtype=bool), 1)] = -np.inf
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(dtype)


def _case(tag, weights, period, what="causal weights"):
    label = f"{what} of shape {weights.shape} ({weights.dtype}), period={period}"
    return {"label": label, "tags": (tag,), "weights": weights, "period": int(period)}


def cases(rng: np.random.Generator) -> list:
    out = [_case("worked", _causal(rng, (), 6, dtype), 3) for dtype in ("float32", "float64")]
    for lead, period, dtype in (((), 4, "float32"), ((3,), 5, "float32"), ((2, 2), 3, "float32"),
                                ((1, 2, 3), int(rng.integers(4, 9)), "float32"), ((2, 1, 1, 2), 4, "float64"),
                                ((5,), 2, "float64"), ((2, 3), int(rng.integers(10, 17)), "float32")):
        out.append(_case("shapes", _causal(rng, lead, 2 * period, dtype), period))
    for lead, period, dtype in (((2, 3), 5, "float32"), ((), int(rng.integers(6, 11)), "float64"),
                                ((4,), 1, "float32"), ((2,), 2, "float64"), ((2, 2), int(rng.integers(12, 21)), "float32"),
                                ((1, 3), 24, "float64"), ((3, 1, 2), int(rng.integers(4, 9)), "float32")):
        out.append(_case("random", _causal(rng, lead, 2 * period, dtype), period))
    import torch

    for period, dtype in ((int(rng.integers(4, 9)), torch.float32), (int(rng.integers(9, 25)), torch.float64)):
        heads, _ = C.known_heads(period, dtype)
        out.append(_case("heads", heads.numpy(), period, "four heads of known score"))
    return out


CELLS = {
    "test_worked_example": aspect("worked"),
    "test_shapes": aspect("shapes", mode="structure"),
    "test_random": aspect("random"),
    "test_known_heads": aspect("heads"),
}

register(Probe("induction_score", cases, run, reference=induction_score, forbidden=C.FORBIDDEN, cells=CELLS))
