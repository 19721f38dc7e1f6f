"""Every ALiBi check accepts right answers and rejects typical wrong ones.

Correct answers: the reference, Python loops over heads and positions, arange broadcast in the
answer's own dtype, an outer product of slopes and distances kept by tril, float64 then cast, and
slopes from torch.logspace or from exp of a log. Wrong answers: the package's named mistakes plus
a call to the reference. The reference itself is checked against a plain loop and against the
slopes of the ALiBi paper where the two rules agree (a power of two).
"""
from __future__ import annotations

import math

import pytest
import torch
from checktable import correct_answers_test, expectations_test, messages_test, naming_test, rejections_test, variants_test

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import alibi as C

CHECKS = {"worked": C.check_worked_example, "shapes": C.check_shapes, "slopes": C.check_slopes,
          "upper": C.check_upper_triangle, "definition": C.check_against_definition, "attention": C.check_in_attention}
ALL = set(CHECKS)

correct = as_student_code(reference.alibi_bias)


def loops(n_heads, T, dtype=torch.float32):
    """Three Python loops, one entry at a time."""
    bias = torch.zeros(n_heads, T, T, dtype=dtype)
    for h in range(n_heads):
        m = 2 ** (-8 * (h + 1) / n_heads)
        for i in range(T):
            for j in range(i + 1):
                bias[h, i, j] = -m * (i - j)
    return bias


def broadcast_in_dtype(n_heads, T, dtype=torch.float32):
    """Everything in the requested dtype from the start, arange broadcast against itself."""
    pos = torch.arange(T, dtype=dtype)
    rel = pos.view(1, T, 1) - pos.view(1, 1, T)  # (1, T, T)
    m = 2.0 ** (-8.0 * torch.arange(1, n_heads + 1, dtype=dtype) / n_heads)
    return torch.where(rel >= 0, -m.view(-1, 1, 1) * rel, torch.zeros((), dtype=dtype))


def outer_tril(n_heads, T, dtype=torch.float32):
    """An outer product of the slopes with the distance table, the upper triangle cut by tril."""
    dist = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    m = torch.tensor([2 ** (-8 * (h + 1) / n_heads) for h in range(n_heads)], dtype=torch.float64)
    table = torch.einsum("h,ij->hij", m, dist.double())
    return torch.tril(-table).to(dtype)


def float32_then_cast(n_heads, T, dtype=torch.float32):
    """float32 arithmetic throughout, cast to float64 only at the end when asked."""
    d = torch.arange(T, dtype=torch.float32)
    dist = (d[:, None] - d[None, :]).clamp(min=0)
    m = torch.pow(2.0, -8.0 * (torch.arange(n_heads, dtype=torch.float32) + 1) / n_heads)
    return (-(m[:, None, None] * dist)).to(dtype) + 0


def logspace_slopes(n_heads, T, dtype=torch.float32):
    """Slopes from torch.logspace (base 2), the distance via tril_indices."""
    m = torch.logspace(-8 / n_heads, -8, n_heads, base=2.0, dtype=torch.float64)
    bias = torch.zeros(n_heads, T, T, dtype=torch.float64)
    i, j = torch.tril_indices(T, T)
    bias[:, i, j] = -m[:, None] * (i - j).double()
    return bias.to(dtype)


def exp_log_slopes(n_heads, T, dtype=torch.float32):
    """Slopes as exp((h + 1) * log(2^(-8 / n))): a geometric sequence, the ratio from a log."""
    ratio = math.log(2.0) * -8.0 / n_heads
    m = torch.exp(ratio * torch.arange(1, n_heads + 1, dtype=torch.float64))
    i = torch.arange(T).unsqueeze(1)
    j = torch.arange(T).unsqueeze(0)
    return (-m[:, None, None] * (i - j).clamp_min(0)).to(dtype).add(0.0)


CORRECT = {"reference": correct, "loops": loops, "broadcast in dtype": broadcast_in_dtype, "outer + tril": outer_tril,
           "float32 then cast": float32_then_cast, "logspace slopes": logspace_slopes,
           "exp-log slopes": exp_log_slopes}


def calls_reference(n_heads, T, dtype=torch.float32):
    return reference.alibi_bias(n_heads, T, dtype)


def calls_reference_slopes(n_heads, T, dtype=torch.float32):
    m = reference.alibi_slopes(n_heads)
    d = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).clamp(min=0)
    return (-m[:, None, None] * d).to(dtype)


MISTAKE_FAILS = {
    "slopes 2^(-8h/n_heads)": ALL - {"shapes", "upper"},
    "no factor 8": ALL - {"shapes", "upper"},
    "slopes in reverse order": ALL - {"shapes", "upper"},
    "the paper's rule for n_heads not a power of two": {"slopes", "definition", "attention"},
    "sign flipped": ALL - {"shapes", "upper"},
    "j - i instead of i - j": ALL - {"shapes"},
    "|i - j| in the upper triangle": {"worked", "upper", "definition"},
    "queries and keys swapped": ALL - {"shapes"},
    "-inf in the upper triangle": {"worked", "upper", "definition"},
    "heads last, (T, T, n_heads)": ALL,
    "a batch dimension added, (1, n_heads, T, T)": ALL,
    "one table for all heads, (T, T)": ALL,
    "dtype ignored": ALL - {"worked"},
}
VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in C.MISTAKES}
VARIANTS.update({
    "calls the reference": (calls_reference, ALL),
    "calls the reference's slopes": (calls_reference_slopes, ALL),
    "returns a NumPy array": (lambda n_heads, T, dtype=torch.float32: correct(n_heads, T, dtype).numpy(), ALL),
})

test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, C.MISTAKES))
test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)
test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)
test_failure_names_the_mistake = naming_test(CHECKS, VARIANTS, [
    ("slopes 2^(-8h/n_heads)", "worked"),
    ("no factor 8", "slopes"),
    ("slopes in reverse order", "definition"),
    ("the paper's rule for n_heads not a power of two", "slopes"),
    ("sign flipped", "worked"),
    ("j - i instead of i - j", "definition"),
    ("|i - j| in the upper triangle", "upper"),
    ("queries and keys swapped", "upper"),
    ("-inf in the upper triangle", "upper"),
    ("heads last, (T, T, n_heads)", "definition"),
])
test_messages = messages_test(CHECKS, VARIANTS, [
    ("the paper's rule for n_heads not a power of two", "slopes", ["n_heads=3", "2^(-8 (h + 1) / n_heads)"]),
    ("-inf in the upper triangle", "upper", ["-inf", "exactly 0"]),
    ("heads last, (T, T, n_heads)", "shapes", ["(1, 1, 4)", "The head comes first"]),
    ("dtype ignored", "shapes", ["dtype torch.float32", "torch.float64"]),
    ("calls the reference", "worked", ["scores 0"]),
    ("one table for all heads, (T, T)", "shapes", ["(4, 1, 1)", "its own slope"]),
    ("returns a NumPy array", "worked", ["torch.Tensor", "ndarray"]),
])


def test_reference_matches_a_loop_and_the_paper_for_powers_of_two():
    for n_heads in (1, 2, 4, 8, 16):
        assert torch.allclose(C.alibi_bias_slopes(n_heads), torch.tensor(C.paper_slopes(n_heads), dtype=torch.float64))
    for n_heads, T in ((3, 7), (8, 20), (1, 1)):
        for dtype in (torch.float32, torch.float64):
            got = reference.alibi_bias(n_heads, T, dtype)
            assert got.dtype == dtype and torch.allclose(got.double(), loops(n_heads, T, torch.float64), atol=1e-7)
    assert not torch.signbit(reference.alibi_bias(4, 6).triu()).any()  # +0.0 above and on the diagonal


def test_the_paper_rule_differs_for_other_head_counts():
    for n_heads in (3, 5, 6, 12):
        assert not torch.allclose(C.alibi_bias_slopes(n_heads), torch.tensor(C.paper_slopes(n_heads), dtype=torch.float64))
