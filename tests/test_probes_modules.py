"""The trusted re-check of the transformer-block pieces agrees with their checks.

(The multi-head attention and KV-cache pieces are declared: tests/exercises/test_multi_head_attention.py,
test_kv_cache.py.)

For each piece: every correct answer and every variant of the matching table
(tests/test_checks_block.py) gets, per test cell, the
trusted verdict its checks give (the cell -> check names maps below are read
off the notebooks' test cells). The later notebooks' 1-point recap cells are
covered too, in the notebook where they appear: they have grade_ids of their
own (``recap_feed_forward``, ...) and the re-check grades them as leniently as their
visible checks, with no difference.
"""
from __future__ import annotations

import functools

import nbformat
import pytest
from course import SOLUTIONS
from probetable import agreement_test

import test_checks_block as Bk
from firstprinciples.grading import trusted, wire
from firstprinciples.grading.runtime import report

BLOCK_NB = "transformer_block/transformer_block.ipynb"
CAPSTONE_NB = "capstone/capstone.ipynb"

# ====================================================================== FeedForward, TransformerBlock
FFN_ALL = {"ffn_structure", "ffn_values", "ffn_values_visible", "ffn_grads"}
FFN_CORRECT = {"independent": Bk.GoodFFN, "nn.Sequential": Bk.FFNSequential}
test_ffn_agrees = agreement_test(BLOCK_NB, "FeedForward", {"test_feed_forward": FFN_ALL}, FFN_CORRECT,
                                 Bk.FFN_VARIANTS, {})
test_ffn_recap_agrees = agreement_test(
    CAPSTONE_NB, "FeedForward", {"recap_feed_forward": {"ffn_values_visible"}}, FFN_CORRECT, Bk.FFN_VARIANTS, {})

BLOCK_CELLS = {
    "test_block_structure": {"structure"},
    "test_block_against_reference": {"reference", "reference_visible"},
    "test_block_causal": {"causal"},
    "test_block_dropout": {"dropout"},
    "test_block_gradients_and_inputs": {"grads", "grads_visible"},
}
BLOCK_CORRECT = {"independent": Bk.GoodBlock, "nn.Dropout submodule": Bk.SeedStyleDropoutModule}
test_block_agrees = agreement_test(BLOCK_NB, "TransformerBlock", BLOCK_CELLS, BLOCK_CORRECT, Bk.BLOCK_VARIANTS, {})
test_block_recap_agrees = agreement_test(
    CAPSTONE_NB, "TransformerBlock", {"test_transformer_block": {"reference_visible"}}, BLOCK_CORRECT,
    Bk.BLOCK_VARIANTS, {})


# ====================================================================== the capstone's cells that use a piece as a part
@functools.lru_cache(maxsize=None)
def _check(notebook, name, seed):
    """The trusted re-check of ``name`` in ``notebook`` (it keeps the reference's results once computed)."""
    plan = trusted.make_plan(nbformat.read(SOLUTIONS / notebook, as_version=4), seed)
    return next(c for c in plan.checks if c.name == name)


def _reason(notebook, name, answer, grade_id, seed=0):
    """The trusted reason (or None) for ``grade_id`` from ``name``'s probe alone, for ``answer``
    (the notebook's other objects, which those cells also name, are left out)."""
    check = _check(notebook, name, seed)
    found = trusted.outcome(check, wire.loads(wire.dumps(report({name: answer}, name, check.cases))))
    return found.reason(check, check.probe.cells[grade_id])


TYPE_ONLY = ("test_model_structure", "test_trained", "test_resolves_it")


@pytest.mark.parametrize("name", sorted(Bk.BLOCK_VARIANTS))
def test_block_as_a_type_is_not_rechecked(name):
    """test_model_structure, test_trained and test_resolves_it pass TransformerBlock along as a
    type: its probe never fails them (the model's probe re-checks what they grade)."""
    answer = Bk.BLOCK_VARIANTS[name][0]
    for grade_id in TYPE_ONLY:
        assert _reason(CAPSTONE_NB, "TransformerBlock", answer, grade_id) is None, (name, grade_id)
    assert _reason(CAPSTONE_NB, "TransformerBlock", answer, "test_transformer_block") is not None or (
        "reference_visible" not in Bk.BLOCK_VARIANTS[name][1])
