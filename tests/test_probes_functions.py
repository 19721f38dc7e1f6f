"""The trusted re-check of the pieces not yet declared: the audit of the re-checks that compare no values.

(The declared pieces, tests/exercises/test_declarations.py runs through both runners; the tests that judge
no values of attention, multi-head attention and cross-attention, tests/exercises/test_attention.py,
test_multi_head_attention.py and test_encoder_decoder.py.)
"""
from __future__ import annotations


# ---------------------------------------------------------------- the audit of the re-checks that do not compare values
# Every Aspect in "structure" mode stands for a test cell whose checks (visible and hidden) do not compare
# values with the reference either: shapes, dtypes and a property (rows summing to 1, the first state, RoPE's
# relative positions, causality), or gradients checked against finite differences of the answer itself
# (gradcheck; the gradient cells that compare with the reference or torch, softmax's, the KV cache's and
# the KV step's, are compared in "values" mode). So an answer with the right structure and property but wrong
# values keeps such a cell, in the kernel as in the re-check, and loses the cells that do compare values.
import pytest  # noqa: E402

import test_checks_capstone as Cap  # noqa: E402
from checktable import outcome  # noqa: E402
from firstprinciples.checks import capstone as Cap_checks  # noqa: E402
from probetable import trusted_failures  # noqa: E402


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
