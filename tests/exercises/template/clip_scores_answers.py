"""clip_scores: unusual correct answers and wrong answers no mistake names (the template exercise)."""
from __future__ import annotations

import torch

BOTH = {"test_worked_example", "test_shapes_and_dtypes"}


def with_where(x, limit):
    return torch.where(x > limit, torch.full_like(x, limit), torch.where(x < -limit, torch.full_like(x, -limit), x))


def by_sign(x, limit):
    return torch.sign(x) * torch.minimum(x.abs(), torch.full_like(x, limit))


CORRECT = {"where": with_where, "sign times magnitude": by_sign}
WRONG = {
    "calls torch.clamp": (lambda x, limit: torch.clamp(x, -limit, limit), BOTH, BOTH),
    "returns x": (lambda x, limit: x.clone(), BOTH, BOTH),
    "float64 always": (lambda x, limit: with_where(x.double(), limit), {"test_shapes_and_dtypes"}, BOTH),
}
