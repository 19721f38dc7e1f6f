"""The trusted re-check of the plain-function pieces not yet declared agrees with their checks.

cross_attention: for every correct answer and every variant of its check table
(tests/test_checks_*.py), the test cells that the trusted re-check fails are exactly
those whose checks the variant fails.

(The declared pieces, tests/exercises/test_declarations.py runs through both runners.)
"""
from __future__ import annotations

from probetable import agreement_test

import test_checks_encoder_decoder as ED
from course import as_student_code
from firstprinciples import reference


# ---------------------------------------------------------------- cross_attention
CROSS_CELLS = {
    "test_scaled_dot_product_attention": set(),  # another piece's recap: a cross_attention answer never fails it
    "test_worked_example": {"worked"}, "test_shapes": {"shapes"}, "test_roles": {"roles"},
    "test_against_torch": {"torch"}, "test_padding_mask": {"padding"}, "test_gradients_and_inputs": {"grads"},
}
test_cross_attention_agrees = agreement_test(
    "encoder_decoder/encoder_decoder.ipynb", "cross_attention", CROSS_CELLS, ED.CORRECT, ED.VARIANTS,
    {"scaled_dot_product_attention": as_student_code(reference.scaled_dot_product_attention)})


# ---------------------------------------------------------------- the audit of the re-checks that do not compare values
# Every Aspect in "structure" mode stands for a test cell whose checks (visible and hidden) do not compare
# values with the reference either: shapes, dtypes and a property (rows summing to 1, the first state, RoPE's
# relative positions, causality), or gradients checked against finite differences of the answer itself
# (gradcheck; the gradient cells that compare with the reference or torch, softmax's, the KV cache's and
# the KV step's, are compared in "values" mode). So an answer with the right structure and property but wrong
# values keeps such a cell, in the kernel as in the re-check, and loses the cells that do compare values.
# (attention's and multi-head attention's, declared, are tested in tests/exercises/test_attention.py and
# tests/exercises/test_multi_head_attention.py.)
import math  # noqa: E402

import pytest  # noqa: E402

import torch  # noqa: E402

import test_checks_capstone as Cap  # noqa: E402
from checktable import outcome  # noqa: E402
from firstprinciples.checks import capstone as Cap_checks  # noqa: E402
from firstprinciples.checks import encoder_decoder as ED_checks  # noqa: E402
from probetable import trusted_failures  # noqa: E402


def _sharp_attention(Q_, K, V, mask=None):
    """Rows that are distributions, of the right shapes: the scores scaled twice too little."""
    s = Q_ @ K.transpose(-2, -1) * 2 / math.sqrt(Q_.shape[-1]) + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def _plain_attention(Q_, K, V, mask=None, doubled=False):
    s = Q_ @ K.transpose(-2, -1) / math.sqrt(Q_.shape[-1]) + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-1)
    return (2 if doubled else 1) * (w @ V), w


def _doubled(fn):
    """The answer's outputs times 2: honest gradients of wrong values (answers written in the tests, not
    the reference's code, which the re-check's runner sees as a call of the reference)."""
    def answer(*args, **kwargs):
        out = fn(*args, **kwargs)
        return tuple(2 * t for t in out) if isinstance(out, tuple) else 2 * out

    return answer


class _GPTDoubled(Cap.GoodGPT):
    def forward(self, idx):
        logits, atts = super().forward(idx)
        return 2 * logits, atts


def _cell(*checks):
    def run(answer):
        for check in checks:
            check(answer)

    return run


AUDIT = {
    # id: (notebook, piece, answer, base, (structure cell, its checks), a values cell it loses)
    "cross_attention shapes": (
        "encoder_decoder/encoder_decoder.ipynb", "cross_attention",
        lambda x, c, W_q, W_k, W_v, mask=None: _sharp_attention(x @ W_q, c @ W_k, c @ W_v, mask),
        {"scaled_dot_product_attention": _plain_attention},
        ("test_shapes", _cell(ED_checks.check_shapes)), "test_against_torch"),
    "cross_attention gradients": (
        "encoder_decoder/encoder_decoder.ipynb", "cross_attention",
        lambda x, c, W_q, W_k, W_v, mask=None: _plain_attention(x @ W_q, c @ W_k, c @ W_v, mask, doubled=True),
        {"scaled_dot_product_attention": _plain_attention},
        ("test_gradients_and_inputs", _cell(ED_checks.check_gradients_and_inputs)), "test_against_torch"),
    "StudentGPT causal": (
        "capstone/capstone.ipynb", "StudentGPT", _GPTDoubled, {},
        ("test_model_causal", _cell(Cap_checks.check_model_causal)), "test_model_forward"),
}


@pytest.mark.parametrize("name", sorted(AUDIT))
def test_a_cell_that_compares_no_values_is_re_checked_without_values(name):
    notebook, piece, answer, base, (cell, checks), values_cell = AUDIT[name]
    ok, err = outcome(checks, answer)
    assert ok, f"the in-kernel checks of {cell} reject the answer: {err}"
    assert trusted_failures(notebook, {**base, piece: answer}, 0, (cell, values_cell)) == {values_cell}
