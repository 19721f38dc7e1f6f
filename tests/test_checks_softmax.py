"""Every softmax check accepts right answers and rejects typical wrong ones.

Each check is run against the reference and two other correct answers (one via
logsumexp, one that first replaces -inf by -1e9: both must pass) and against a
catalogue of buggy variants: the package's named mistakes plus wrong answers
that cannot be "named" (calls to one of torch's softmaxes, detached, numpy,
in-place, wrong dtype, ...). The table says exactly which checks each variant
must fail; every check must reject at least five variants.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import softmax as S
from checktable import correct_answers_test, expectations_test, messages_test, naming_test, outcome, rejections_test, variants_test

CHECKS = {
    "worked": S.check_worked_example,
    "large": S.check_large_inputs,
    "minus_inf": S.check_minus_inf,
    "dims": S.check_dims,
    "grads": S.check_gradients_and_inputs,
}
ALL = set(CHECKS)

# The reference, unwrapped, is what a correct student would write.
correct = as_student_code(reference.softmax)


def via_logsumexp(x, dim=-1):
    # exp(x - log(sum(exp(x)))): another stable softmax, built without any softmax.
    return torch.exp(x - torch.logsumexp(x, dim=dim, keepdim=True))


def minus_inf_as_minus_1e9(x, dim=-1):
    # Accepted: exp(-1e9 - max) underflows to exactly 0 in float32 and float64.
    x = torch.where(torch.isneginf(x), torch.full_like(x, -1e9), x)
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def hand_logsumexp(x, dim=-1):
    # the log-sum-exp written out: x - (m + log(sum(exp(x - m)))), then exp
    m = x.amax(dim=dim, keepdim=True)
    return torch.exp(x - (m + torch.log(torch.exp(x - m).sum(dim=dim, keepdim=True))))


def log_softmax_then_exp(x, dim=-1):
    # a log-softmax (z - log(sum(exp(z))) with z = x - max), then exp
    z = x - x.amax(dim=dim, keepdim=True)
    return (z - z.exp().sum(dim=dim, keepdim=True).log()).exp()


CORRECT = {"reference": correct, "logsumexp": via_logsumexp, "-inf as -1e9": minus_inf_as_minus_1e9,
           "hand-written log-sum-exp": hand_logsumexp, "log-softmax then exp": log_softmax_then_exp}


def calls_torch_softmax(x, dim=-1):
    return torch.softmax(x, dim=dim)


def calls_tensor_method(x, dim=-1):
    return x.softmax(dim)


def calls_functional(x, dim=-1):
    return F.softmax(x, dim=dim)


def exp_of_log_softmax(x, dim=-1):
    return F.log_softmax(x, dim=dim).exp()


def calls_module(x, dim=-1):
    return torch.nn.Softmax(dim=dim)(x)


def calls_aten(x, dim=-1):
    return torch.ops.aten._softmax(x, dim, False)


def calls_softmin(x, dim=-1):
    return F.softmin(-x, dim=dim)


def via_categorical(x, dim=-1):
    return torch.distributions.Categorical(logits=x.movedim(dim, -1)).probs.movedim(-1, dim)


def calls_reference(x, dim=-1):
    return reference.softmax(x, dim=dim)


def calls_builtin_but_hides_it(x, dim=-1):
    try:
        torch.softmax(x, dim=99)  # raises: dim out of range
    except Exception:
        pass
    return correct(x, dim)


def shifts_in_place(x, dim=-1):
    x -= x.amax(dim=dim, keepdim=True)  # changes the caller's tensor
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def divides_in_place(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    e /= e.sum(dim=dim, keepdim=True)  # right values, but exp's backward needs the original e
    return e


def detached(x, dim=-1):
    return correct(x.detach(), dim)


def via_numpy(x, dim=-1):
    return correct(x.detach(), dim).numpy()


def returns_a_tuple(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    s = e.sum(dim=dim, keepdim=True)
    return e / s, s


def casts_to_float32(x, dim=-1):
    return correct(x, dim).float()


def computes_in_float64(x, dim=-1):
    return correct(x.double(), dim)


def minus_inf_as_minus_100(x, dim=-1):
    # exp(-100) is about 4e-44: a tiny weight where the answer is exactly 0.
    x = torch.where(torch.isneginf(x), torch.full_like(x, -100.0), x)
    return correct(x, dim)


def max_namedtuple(x, dim=-1):
    e = torch.exp(x - x.max(dim=dim, keepdim=True))  # (values, indices), not a tensor
    return e / e.sum(dim=dim, keepdim=True)


def epsilon_in_the_sum(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / (e.sum(dim=dim, keepdim=True) + 1e-9)  # "to be safe": a lone weight is 0.999999999


_WORKED = correct(torch.tensor([1.10, 1.00, 0.60], dtype=torch.float64) / 2**0.5).tolist()


def hard_coded_example(x, dim=-1):
    return torch.tensor(_WORKED, dtype=x.dtype)


OTHER_VARIANTS = {
    # name: (function, the checks it must fail)
    "calls torch.softmax": (calls_torch_softmax, ALL),
    "calls Tensor.softmax": (calls_tensor_method, ALL),
    "calls F.softmax": (calls_functional, ALL),
    "exp of F.log_softmax": (exp_of_log_softmax, ALL),
    "calls nn.Softmax": (calls_module, ALL),
    "calls torch.ops.aten._softmax": (calls_aten, ALL),
    "calls F.softmin(-x)": (calls_softmin, ALL),
    "Categorical(logits=x).probs": (via_categorical, ALL),
    "calls the reference": (calls_reference, ALL),
    "calls the built-in and hides it": (calls_builtin_but_hides_it, ALL),
    "modifies its input": (shifts_in_place, ALL),
    "detached": (detached, {"grads"}),
    "divides its own exp in place": (divides_in_place, {"grads"}),
    "returns numpy": (via_numpy, ALL),
    "returns a tuple": (returns_a_tuple, ALL),
    "casts to float32": (casts_to_float32, ALL),
    "computes in float64": (computes_in_float64, ALL - {"worked"}),
    "-inf replaced by -100": (minus_inf_as_minus_100, {"minus_inf"}),
    "+ 1e-9 in the denominator": (epsilon_in_the_sum, {"worked", "minus_inf"}),
    "x.max(dim) used as a tensor": (max_namedtuple, ALL),
    "hard-coded worked example": (hard_coded_example, ALL),
}

# Which checks each named mistake must fail.
MISTAKE_FAILS = {
    "no max subtracted": {"large", "minus_inf", "grads"},
    "max over the whole tensor": {"large", "minus_inf"},
    "shifted by the mean, not the max": {"large", "minus_inf", "grads"},
    "dim ignored": {"large", "minus_inf", "dims", "grads"},
    "sum over the wrong dim": {"large", "minus_inf", "dims", "grads"},
    "sum over the whole tensor": ALL,
    "keepdim forgotten": ALL,
    "exp missing in the denominator": ALL,
}

VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in S.MISTAKES}
VARIANTS.update(OTHER_VARIANTS)


test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, S.MISTAKES))
test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_visible_part_passes_for_the_reference(name):
    check = CHECKS[name]
    if name == "worked":  # (all of it is visible: it has no hidden part)
        check(correct)
    else:
        check(correct, full=False)


test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)


def test_visible_parts_catch_the_stability_mistakes():
    # The student sees these fail before grading, not only in the hidden tests.
    for label in ("no max subtracted", "max over the whole tensor", "shifted by the mean, not the max"):
        ok, _ = outcome(lambda fn: S.check_large_inputs(fn, full=False), VARIANTS[label][0])
        assert not ok, label


test_failure_names_the_mistake = naming_test(
    CHECKS,
    VARIANTS,
    [
        ("no max subtracted", "large"),
        ("max over the whole tensor", "large"),
        ("shifted by the mean, not the max", "large"),
        ("dim ignored", "dims"),
        ("sum over the wrong dim", "dims"),
        ("sum over the whole tensor", "worked"),
        ("keepdim forgotten", "worked"),
        ("exp missing in the denominator", "worked"),
        ("no max subtracted", "minus_inf"),
    ],
)


def test_forbidden_call_message_is_clear():
    ok, err = outcome(S.check_worked_example, calls_functional)
    assert "torch.nn.functional.softmax" in str(err) and "scores 0" in str(err)


def test_minus_inf_message_says_exactly_zero():
    ok, err = outcome(S.check_minus_inf, minus_inf_as_minus_100)
    assert "-inf" in str(err) and "exactly 0" in str(err), str(err)


# The student's bug, the check that must fail on it, and what its message must say: a value
# that must be exactly 1 is printed exactly (0.999999999, not a rounded "1").
test_message_prints_exact_values = messages_test(CHECKS, VARIANTS, [
    ("+ 1e-9 in the denominator", "minus_inf", ["= 0.9999999989999999 ", "must be exactly 1", "off by 1.000000082740371e-09", "epsilon"]),
    ("-inf replaced by -100", "minus_inf", ["e-44", "must be exactly 0"]),
])


def test_broadcast_error_suggests_keepdim():
    ok, err = outcome(S.check_dims, VARIANTS["keepdim forgotten"][0])
    assert "keepdim=True" in str(err), str(err)


def test_namedtuple_error_suggests_values():
    ok, err = outcome(S.check_worked_example, max_namedtuple)
    assert ".values" in str(err) or "amax" in str(err), str(err)


def test_wrong_dim_message_says_which_dim_sums_to_one():
    ok, err = outcome(S.check_dims, VARIANTS["dim ignored"][0])
    assert "sums to 1 along dim 2 instead" in str(err), str(err)


def test_in_place_backward_failure_is_explained():
    ok, err = outcome(S.check_gradients_and_inputs, divides_in_place)
    assert "in-place" in str(err) and "e = e / s" in str(err), str(err)


def test_worked_example_reports_the_entry():
    ok, err = outcome(S.check_worked_example, VARIANTS["exp missing in the denominator"][0])
    assert "Cat's weight on 'Cat'" in str(err) and "0.380" in str(err), str(err)
