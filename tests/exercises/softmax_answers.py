"""softmax: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes: unusual correct answers, which must pass everywhere, and wrong answers that no mistake
names (a built-in called, a wrong type, an input changed), each with the test cells it fails in the
notebook (its visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course import as_student_code
from firstprinciples import reference

correct = as_student_code(reference.softmax)  # what a correct student writes


def via_logsumexp(x, dim=-1):
    return torch.exp(x - torch.logsumexp(x, dim=dim, keepdim=True))


def minus_inf_as_minus_1e9(x, dim=-1):
    # accepted: exp(-1e9 - max) underflows to exactly 0 in float32 and float64
    x = torch.where(torch.isneginf(x), torch.full_like(x, -1e9), x)
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def hand_logsumexp(x, dim=-1):
    m = x.amax(dim=dim, keepdim=True)
    return torch.exp(x - (m + torch.log(torch.exp(x - m).sum(dim=dim, keepdim=True))))


def log_softmax_then_exp(x, dim=-1):
    z = x - x.amax(dim=dim, keepdim=True)
    return (z - z.exp().sum(dim=dim, keepdim=True).log()).exp()


def moves_dim_last(x, dim=-1):
    # the slices moved to the last axis and back
    y = x.movedim(dim, -1)
    e = torch.exp(y - y.max(dim=-1, keepdim=True).values)
    return (e / e.sum(-1, keepdim=True)).movedim(-1, dim)


def divides_by_reciprocal(x, dim=-1):
    e = (x - x.amax(dim=dim, keepdim=True)).exp()
    return e * e.sum(dim=dim, keepdim=True).reciprocal()


CORRECT = {"reference": correct, "logsumexp": via_logsumexp, "-inf as -1e9": minus_inf_as_minus_1e9,
           "hand-written log-sum-exp": hand_logsumexp, "log-softmax then exp": log_softmax_then_exp,
           "dim moved last": moves_dim_last, "times the reciprocal": divides_by_reciprocal}


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


def returns_a_tuple(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    s = e.sum(dim=dim, keepdim=True)
    return e / s, s


def minus_inf_as_minus_100(x, dim=-1):
    # exp(-100) is about 4e-44: a tiny weight where the answer is exactly 0
    return correct(torch.where(torch.isneginf(x), torch.full_like(x, -100.0), x), dim)


def max_namedtuple(x, dim=-1):
    e = torch.exp(x - x.max(dim=dim, keepdim=True))  # (values, indices), not a tensor
    return e / e.sum(dim=dim, keepdim=True)


def epsilon_in_the_sum(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / (e.sum(dim=dim, keepdim=True) + 1e-9)  # "to be safe": a lone weight is 0.999999999


_WORKED = correct(torch.tensor([1.10, 1.00, 0.60], dtype=torch.float64) / 2**0.5).tolist()


def hard_coded_example(x, dim=-1):
    return torch.tensor(_WORKED, dtype=x.dtype)


ALL = {"test_worked_example", "test_large_inputs", "test_minus_inf", "test_dims", "test_gradients_and_inputs"}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
WRONG = {
    "calls torch.softmax": (lambda x, dim=-1: torch.softmax(x, dim=dim), ALL, ALL),
    "calls Tensor.softmax": (lambda x, dim=-1: x.softmax(dim), ALL, ALL),
    "calls F.softmax": (lambda x, dim=-1: F.softmax(x, dim=dim), ALL, ALL),
    "exp of F.log_softmax": (lambda x, dim=-1: F.log_softmax(x, dim=dim).exp(), ALL, ALL),
    "calls nn.Softmax": (lambda x, dim=-1: torch.nn.Softmax(dim=dim)(x), ALL, ALL),
    "calls torch.ops.aten._softmax": (lambda x, dim=-1: torch.ops.aten._softmax(x, dim, False), ALL, ALL),
    "calls F.softmin(-x)": (lambda x, dim=-1: F.softmin(-x, dim=dim), ALL, ALL),
    "Categorical(logits=x).probs": (lambda x, dim=-1: torch.distributions.Categorical(
        logits=x.movedim(dim, -1)).probs.movedim(-1, dim), ALL, ALL),
    "calls the reference": (lambda x, dim=-1: reference.softmax(x, dim=dim), ALL, ALL),
    "calls the built-in and hides it": (calls_builtin_but_hides_it, ALL, ALL),
    "modifies its input": (shifts_in_place, ALL, ALL),
    "detached": (lambda x, dim=-1: correct(x.detach(), dim), {"test_gradients_and_inputs"}, {"test_gradients_and_inputs"}),
    "divides its own exp in place": (divides_in_place, {"test_gradients_and_inputs"}, {"test_gradients_and_inputs"}),
    "returns numpy": (lambda x, dim=-1: correct(x.detach(), dim).numpy(), ALL, ALL),
    "returns a tuple": (returns_a_tuple, ALL, ALL),
    # (the notebook's dims cases are float32, its -inf and gradient cases float64, the re-check's worked
    # example's float64: elsewhere it has both)
    "casts to float32": (lambda x, dim=-1: correct(x, dim).float(), ALL - {"test_dims"}, ALL),
    "computes in float64": (lambda x, dim=-1: correct(x.double(), dim), {"test_large_inputs", "test_dims"},
                            ALL - {"test_worked_example"}),
    "-inf replaced by -100": (minus_inf_as_minus_100, {"test_minus_inf"}, {"test_minus_inf"}),
    "+ 1e-9 in the denominator": (epsilon_in_the_sum, {"test_worked_example", "test_minus_inf"},
                                  {"test_worked_example", "test_minus_inf"}),
    "x.max(dim) used as a tensor": (max_namedtuple, ALL, ALL),
    "hard-coded worked example": (hard_coded_example, ALL, ALL),
}
