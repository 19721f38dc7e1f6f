"""Every induction-score check accepts right answers and rejects typical wrong ones.

Correct answers: the reference (advanced indexing), torch.diagonal with an offset over the last two
dimensions, gather, a Python loop over the queries, and a 0/1 mask summed over both positions.
Wrong answers: the package's named mistakes, plus a Python float, indexing the first two
dimensions, torch.diagonal over its default (first two) dimensions, a mean over dimension 0, a
hard-coded period, a typed-in worked example and a call to the reference.
"""
from __future__ import annotations

import torch
from checktable import correct_answers_test, expectations_test, messages_test, naming_test, rejections_test, variants_test

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import induction as C
from firstprinciples.induction import worked_example

CHECKS = {"worked": C.check_worked_example, "shapes": C.check_shapes, "random": C.check_random,
          "heads": C.check_known_heads}
ALL = set(CHECKS)

correct = as_student_code(reference.induction_score)


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


CORRECT = {"reference": correct, "diagonal": diagonal, "gather": gathered, "loop": loop, "masked sum": masked_sum}


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


MISTAKE_FAILS = {
    "the duplicate token": ALL - {"shapes"},
    "query period - 1 included": ALL - {"shapes"},
    "query period left out": ALL - {"shapes"},
    "divided by T": ALL - {"shapes"},
    "sum instead of mean": ALL - {"shapes"},
    "rows and columns swapped": ALL - {"shapes"},
    "the share of rows whose largest weight is there": ALL - {"shapes"},
    "averaged over the leading dimensions too": ALL - {"worked"},
}
VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in C.MISTAKES}
VARIANTS.update({
    "a Python float": (python_float, ALL),
    "the first two dimensions indexed": (first_two_dimensions, ALL - {"worked"}),
    "torch.diagonal over the first two dimensions": (default_diagonal, ALL - {"worked"}),
    "mean over dimension 0": (mean_over_dim0, ALL - {"worked"}),
    "period hard-coded": (period_hard_coded, {"random", "heads"}),
    "hard-coded worked example": (typed_in, ALL - {"worked"}),
    "calls the reference": (calls_reference, ALL),
})

test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, C.MISTAKES))
test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)
test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)
test_failure_names_the_mistake = naming_test(CHECKS, VARIANTS, [
    ("the duplicate token", "worked"),
    ("query period - 1 included", "worked"),
    ("query period left out", "random"),
    ("sum instead of mean", "heads"),
    ("rows and columns swapped", "random"),
    ("the share of rows whose largest weight is there", "worked"),
])
test_messages = messages_test(CHECKS, VARIANTS, [
    ("a Python float", "worked", ["Python float", "tensor of shape"]),
    ("averaged over the leading dimensions too", "shapes", ["should have shape (3,)", ".mean(-1)"]),
    ("the duplicate token", "heads", ["A perfect induction head", "should score 1"]),
    ("calls the reference", "worked", ["scores 0"]),
    ("period hard-coded", "random", ["period=3", "use the period argument"]),
    ("a Python float", "shapes", ["Python float", ".item()"]),
])


def test_worked_example_is_the_chapters():
    tokens, weights, period = worked_example()
    assert tokens == ["A", "B", "C", "A", "B", "C"] and period == 3
    assert torch.allclose(weights.sum(-1), torch.ones(6)) and bool((weights.triu(1) == 0).all())
    assert abs(reference.induction_score(weights, period).item() - C.WORKED_SCORE) < 1e-6


def test_known_heads_have_their_scores():
    for period in (3, 6, 24):
        heads, expected = C.known_heads(period, torch.float64)
        assert torch.allclose(heads.sum(-1), torch.ones(4, 2 * period, dtype=torch.float64))
        assert torch.allclose(reference.induction_score(heads, period), expected, atol=1e-12)
