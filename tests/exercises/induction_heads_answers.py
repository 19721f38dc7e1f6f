"""induction_heads: the answers the generic harness (test_declarations.py) runs besides the
declaration's own mistakes: unusual correct answers, which must pass everywhere, and wrong answers
that no mistake names, each with the test cells it fails in the notebook (its visible cases) and in
the trusted re-check (the secret ones)."""
from __future__ import annotations

import torch

from course import as_student_code
from firstprinciples import reference

correct = as_student_code(reference.induction_score)  # what a correct student writes


def diagonal(weights, period):
    """The diagonal period - 1 below the main one, without its first entry (row period - 1)."""
    return torch.diagonal(weights, offset=-(period - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)


def gathered(weights, period):
    T = weights.shape[-1]
    rows = weights[..., period:, :]  # (..., period, T): the second copy's queries
    keys = (torch.arange(period, T) - period + 1).expand(*rows.shape[:-1])[..., None]  # (..., period, 1)
    return rows.gather(-1, keys).squeeze(-1).mean(-1)


def loop(weights, period):
    total = torch.zeros(weights.shape[:-2], dtype=weights.dtype)
    for i in range(period, 2 * period):
        total = total + weights[..., i, i - period + 1]
    return total / period


def masked_sum(weights, period):
    T = weights.shape[-1]
    target = torch.zeros(T, T, dtype=weights.dtype)
    for i in range(period, T):
        target[i, i - period + 1] = 1.0
    return (weights * target).sum((-2, -1)) / period


# (new with the declaration: written in ways the old tables did not foresee)
def flat_indices(weights, period):
    """The (i, i - period + 1) entries picked from the flattened (T * T) last two dimensions."""
    T = weights.shape[-1]
    i = torch.arange(period, T)
    flat = weights.reshape(*weights.shape[:-2], T * T)  # (..., T * T)
    return flat[..., i * T + (i - period + 1)].mean(dim=-1)


def rolled_onto_the_diagonal(weights, period):
    """The keys rolled by period - 1 columns, so that each query's target sits on the main diagonal;
    the second copy's part of that diagonal, summed and times 1 / period."""
    rolled = torch.roll(weights, shifts=period - 1, dims=-1)  # rolled[..., i, i] = weights[..., i, i - period + 1]
    return rolled.diagonal(dim1=-2, dim2=-1)[..., period:].sum(-1) * (1.0 / period)


def take_along_keys(weights, period):
    """torch.take_along_dim over the keys, with the leading dimensions moved behind and back."""
    T = weights.shape[-1]
    moved = weights.movedim((-2, -1), (0, 1))[period:]  # (period, T, ...): the second copy's queries
    keys = (torch.arange(period, T) - period + 1).view(period, 1, *([1] * (weights.dim() - 2)))
    return torch.take_along_dim(moved, keys, dim=1).squeeze(1).mean(0)


CORRECT = {"reference": correct, "diagonal": diagonal, "gather": gathered, "loop": loop, "masked sum": masked_sum,
           "flat indices": flat_indices, "rolled onto the diagonal": rolled_onto_the_diagonal,
           "take_along_dim over the keys": take_along_keys}


def _q(weights, period):
    return torch.arange(period, weights.shape[-1])


def python_float(weights, period):
    q = _q(weights, period)
    return weights[..., q, q - period + 1].mean().item()


def first_two_dimensions(weights, period):
    q = _q(weights, period)
    return weights[q, q - period + 1].mean(-1)


def default_diagonal(weights, period):
    return torch.diagonal(weights, offset=-(period - 1))[..., 1:].mean(-1)


def mean_over_dim0(weights, period):
    q = _q(weights, period)
    return weights[..., q, q - period + 1].mean(0)


def period_hard_coded(weights, period):
    q = torch.arange(3, weights.shape[-1])
    return weights[..., q, q - 2].mean(-1)


def typed_in(weights, period):
    return torch.tensor(0.7, dtype=weights.dtype)


def calls_reference(weights, period):
    return reference.induction_score(weights, period)


def clamps_in_place(weights, period):
    weights.clamp_(min=1e-9)  # "to avoid zeros": changes the caller's weights
    return correct(weights, period)


ALL = {"test_worked_example", "test_shapes", "test_random", "test_known_heads"}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
WRONG = {
    "a Python float": (python_float, ALL, ALL),
    # (the worked example has no leading dimension: there these are right)
    "the first two dimensions indexed": (first_two_dimensions, ALL - {"test_worked_example"},
                                         ALL - {"test_worked_example"}),
    "torch.diagonal over the first two dimensions": (default_diagonal, ALL - {"test_worked_example"},
                                                     ALL - {"test_worked_example"}),
    "mean over dimension 0": (mean_over_dim0, ALL - {"test_worked_example"}, ALL - {"test_worked_example"}),
    # (the worked example's period is 3, and shapes do not read values)
    "period hard-coded": (period_hard_coded, {"test_random", "test_known_heads"}, {"test_random", "test_known_heads"}),
    # (the re-check's worked example has fresh weights of the same size besides the chapter's)
    "hard-coded worked example": (typed_in, ALL - {"test_worked_example"}, ALL),
    "calls the reference": (calls_reference, ALL, ALL),
    "clamps its input in place": (clamps_in_place, ALL, ALL),
    "returns numpy": (lambda weights, period: correct(weights, period).numpy(), ALL, ALL),
}
