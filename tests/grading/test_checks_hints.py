"""The hints added to an error of the student's code: each row of the hint table fires on the error it
describes and on no other.

Every row of ``_student.HINTS`` has a case it must fire on and a case it must not fire on (where
another row, or none, fires instead). The student's code is the functions below (this file is not
the course's, so its frames are the student's), raising real torch errors.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from firstprinciples.checks import _student

g = torch.Generator().manual_seed(0)


def _t(*shape):
    return torch.randn(*shape, generator=g)


# ---------------------------------------------------------------- the student's buggy code
def if_mask(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1)
    if mask:
        scores = scores + mask
    return scores


def if_computed_tensor(x):
    positive = x > 0
    if positive:
        return x
    return -x


def view_after_transpose(x):
    B, T, d = x.shape
    return x.transpose(1, 2).view(B, T * d)


def view_to_another_size(x):
    return x.view(5, 5)


class NoSuperInit(nn.Module):
    def __init__(self, d):
        self.W = nn.Linear(d, d)


class ReadsAMissingAttribute(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.h = 2

    def forward(self, x):
        return x.view(*x.shape[:-1], self.n_heads, -1)


def placeholder(x):
    raise NotImplementedError()


def module_without_forward(x):
    return nn.Module()(x)


def dot_T(Q, K):
    return Q @ K.T / math.sqrt(Q.shape[-1])


def dot_no_transpose(Q, K):
    return Q @ K / math.sqrt(Q.shape[-1])


def gqa_without_repeat(Q, K):
    """Q has 8 heads, K 2: each key head must be repeated for its group of 4 query heads first."""
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])


def cross_attention_values_from_x(weights, x, W_v):
    """Encoder-decoder: the values taken from x (T_q rows) instead of the context (T_k rows)."""
    V = x @ W_v
    return weights @ V


def rnn_step_wrong_bias(x_t, h, W_xh, W_hh, b):
    return torch.tanh(x_t @ W_xh + h @ W_hh.T + b)


def linear_of_the_wrong_width(x):
    layer = nn.Linear(4, 3)
    return layer(x)


def concatenates_mismatched(a, b):
    return torch.cat([a, b], dim=0)


# ---------------------------------------------------------------- the table
# case name -> (student call, the hint row that must fire: '' for none)
CASES = {
    "if mask:": (lambda: if_mask(_t(2, 3, 4), _t(2, 3, 4), _t(2, 3, 4), torch.zeros(3, 3)),
                 "optional tensor tested with if"),
    "if on a computed tensor": (lambda: if_computed_tensor(_t(3)), "tensor as a truth value"),
    "view after a transpose": (lambda: view_after_transpose(_t(2, 3, 4)), "view of a transposed tensor"),
    "view to another size": (lambda: view_to_another_size(_t(2, 3, 4)), "reshape to another size"),
    "no super().__init__()": (lambda: NoSuperInit(4), "no super().__init__()"),
    "a missing attribute": (lambda: ReadsAMissingAttribute(4)(_t(2, 4)), ""),
    "the placeholder": (lambda: placeholder(_t(2)), "the placeholder"),
    "a module without forward": (lambda: module_without_forward(_t(2)), ""),
    "Q @ K.T, four dimensions": (lambda: dot_T(_t(2, 2, 3, 4), _t(2, 2, 5, 4)), ".T on more than two dimensions"),
    "Q @ K": (lambda: dot_no_transpose(_t(2, 2, 3, 4), _t(2, 2, 5, 4)), "matmul inner dimensions"),
    "GQA without the head repeat": (lambda: gqa_without_repeat(_t(2, 8, 5, 4), _t(2, 2, 5, 4)),
                                    "matmul leading dimensions"),
    "encoder-decoder values from x": (lambda: cross_attention_values_from_x(_t(2, 3, 5), _t(2, 3, 4), _t(4, 4)),
                                      "matmul inner dimensions"),
    "RNN addition, wrong bias": (lambda: rnn_step_wrong_bias(_t(2, 3), _t(2, 5), _t(3, 5), _t(5, 5), _t(3)),
                                 "broadcasting"),
    "a linear layer of the wrong width": (lambda: linear_of_the_wrong_width(_t(2, 5)), "matmul inner dimensions"),
    "cat of mismatched tensors": (lambda: concatenates_mismatched(_t(2, 3), _t(2, 4)), "shapes that do not fit"),
}

# hint row -> (a case it must fire on, a case it must not fire on)
ROWS = {
    "optional tensor tested with if": ("if mask:", "if on a computed tensor"),
    "tensor as a truth value": ("if on a computed tensor", "if mask:"),
    "view of a transposed tensor": ("view after a transpose", "view to another size"),
    "no super().__init__()": ("no super().__init__()", "a missing attribute"),
    "the placeholder": ("the placeholder", "a module without forward"),
    ".T on more than two dimensions": ("Q @ K.T, four dimensions", "RNN addition, wrong bias"),
    "reshape to another size": ("view to another size", "view after a transpose"),
    "matmul inner dimensions": ("Q @ K", "GQA without the head repeat"),
    "matmul leading dimensions": ("GQA without the head repeat", "RNN addition, wrong bias"),
    "broadcasting": ("RNN addition, wrong bias", "GQA without the head repeat"),
    "shapes that do not fit": ("cat of mismatched tensors", "RNN addition, wrong bias"),
}


def _error(case):
    call, _ = CASES[case]
    with pytest.raises(Exception) as info:
        call()
    return info.value


def _row(case):
    return _student.student_hint(_error(case))


def test_every_hint_row_has_a_case_to_fire_on_and_one_not_to():
    assert set(ROWS) == {name for name, _ in _student.HINTS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_case_gets_the_hint_of_its_error(case):
    name, text = _row(case)
    assert name == CASES[case][1], f"{case}: hint {name!r}: {text}"


@pytest.mark.parametrize("row", sorted(ROWS))
def test_each_row_fires_on_its_error_and_not_on_another(row):
    fire, other = ROWS[row]
    assert _row(fire)[0] == row
    assert _row(other)[0] != row


# The cases: "for Q K^T write K.transpose(-2, -1)" was added to every shape error on a
# line with a @, although only a product missing its transpose needs it.
@pytest.mark.parametrize("case", ["RNN addition, wrong bias", "encoder-decoder values from x",
                                  "GQA without the head repeat", "a linear layer of the wrong width"])
def test_no_transpose_advice_where_no_transpose_is_missing(case):
    text = _row(case)[1]
    assert "transpose its last two" not in text and "Q K^T" not in text, text


def test_a_missing_transpose_is_named_with_the_students_operands():
    text = _row("Q @ K")[1]
    assert "`Q @ K.transpose(-2, -1)`" in text and "(2, 2, 3, 4)" in text, text


def test_gqa_names_the_head_dimensions_that_do_not_meet():
    text = _row("GQA without the head repeat")[1]
    assert "(2, 8) meets (2, 2)" in text, text


def test_the_shapes_are_said_to_be_where_they_are_printed():
    """The shapes are printed before the hint: the hint says "above", never "below"."""
    message = _student.explain(_error("RNN addition, wrong bias"))
    assert "below" not in message, message
    assert message.index("Shapes on this line") < message.index("Hint:") and "compare the shapes above" in message
