"""The trusted re-check of the plain-function pieces agrees with their checks.

project_qkv and dot_product_scores, rnn_forward, causal_mask, sinusoidal_encoding
and apply_rope, cross_attention: for every correct answer and every variant of
their check tables (tests/test_checks_*.py), the test cells that the trusted
re-check fails are exactly those whose checks the variant fails.

The one deliberate difference, for each piece that has it: an answer that types
in the worked example's result. The checks grant it the worked-example test;
the re-check draws fresh inputs of the same sizes, so it earns nothing there.
"""
from __future__ import annotations

from probetable import agreement_test

import test_checks_causal_mask as CM
import test_checks_encoder_decoder as ED
import test_checks_position as P
import test_checks_qkv as Q
import test_checks_rnn as R
from firstprinciples import reference


def _piece(variants: dict, piece: str) -> dict:
    return {name: entry for (p, name), entry in variants.items() if p == piece}


def _everywhere(cells: dict, why: str) -> tuple:
    return set(cells), why


HARD_CODED = "fresh inputs of the worked example's sizes: a typed-in result earns nothing there either"


# ---------------------------------------------------------------- qkv
PROJECT_CELLS = {
    "test_project_worked_example": {"worked"}, "test_project_shapes": {"shapes"},
    "test_project_random": {"random"}, "test_project_gradients_and_inputs": {"grads"},
}
SCORES_CELLS = {
    "test_scores_worked_example": {"worked"}, "test_scores_batched": {"batched"},
    "test_scores_random": {"random"}, "test_scores_gradients_and_inputs": {"grads"},
}
QKV = "qkv/queries_keys_values.ipynb"

test_project_qkv_agrees = agreement_test(
    QKV, "project_qkv", PROJECT_CELLS, Q.CORRECT["project_qkv"], _piece(Q.VARIANTS, "project_qkv"),
    {"dot_product_scores": Q.scores_correct},
    differences={"hard-coded worked example": _everywhere(PROJECT_CELLS, HARD_CODED)})
test_dot_product_scores_agrees = agreement_test(
    QKV, "dot_product_scores", SCORES_CELLS, Q.CORRECT["dot_product_scores"], _piece(Q.VARIANTS, "dot_product_scores"),
    {"project_qkv": Q.project_correct},
    differences={"hard-coded worked example": _everywhere(SCORES_CELLS, HARD_CODED)})


# ---------------------------------------------------------------- rnn
RNN_CELLS = {
    "test_worked_example": {"worked"}, "test_shapes_and_first_step": {"shapes"},
    "test_random_against_torch": {"random"}, "test_gradients_and_inputs": {"grads"},
}
test_rnn_forward_agrees = agreement_test(
    "rnn/rnn_forward.ipynb", "rnn_forward", RNN_CELLS, R.CORRECT, R.VARIANTS, {},
    differences={"hard-coded worked example": _everywhere(RNN_CELLS, HARD_CODED)})


# ---------------------------------------------------------------- causal_mask
MASK_CELLS = {"test_seed_mask": {"seed"}, "test_shapes_and_dtype": {"shapes"}, "test_values": {"values"}, "test_no_peeking": {"peek"}}
test_causal_mask_agrees = agreement_test(
    "causal_mask/causal_mask.ipynb", "causal_mask", MASK_CELLS, CM.CORRECT, CM.VARIANTS, {},
    differences={"always the 4 x 4 mask": _everywhere(MASK_CELLS, "the seed test is re-checked on another small T too: "
                                                      "a typed-in 4 x 4 matrix earns nothing there either")})


# ---------------------------------------------------------------- positional encodings
def _lazy(factory):
    """A correct answer built on first use (the seed's table skips its test where the seeds are missing)."""
    made = []

    def answer(*args, **kwargs):
        if not made:
            made.append(factory())
        return made[0](*args, **kwargs)

    return answer


POSITION = "positional_encoding/positional_encoding.ipynb"
TABLE_CELLS = {"test_sinusoidal_example": {"example"}, "test_sinusoidal_tables": {"tables"}}
ROPE_CELLS = {
    "test_rope_example": {"example"}, "test_rope_shapes": {"shapes"}, "test_rope_base": {"base"},
    "test_rope_relative_position": {"relative"}, "test_rope_gradients_and_inputs": {"grads"},
}
test_sinusoidal_encoding_agrees = agreement_test(
    POSITION, "sinusoidal_encoding", TABLE_CELLS, {name: _lazy(f) for name, f in P.TABLE_CORRECT.items()},
    P.TABLE_VARIANTS, {"apply_rope": P.correct_rope},
    differences={"hard-coded worked example": _everywhere(TABLE_CELLS, HARD_CODED)})
test_apply_rope_agrees = agreement_test(
    POSITION, "apply_rope", ROPE_CELLS, P.ROPE_CORRECT, P.ROPE_VARIANTS, {"sinusoidal_encoding": P.correct_table})


# ---------------------------------------------------------------- cross_attention
CROSS_CELLS = {
    "test_scaled_dot_product_attention": set(),  # another piece's recap: a cross_attention answer never fails it
    "test_worked_example": {"worked"}, "test_shapes": {"shapes"}, "test_roles": {"roles"},
    "test_against_torch": {"torch"}, "test_padding_mask": {"padding"}, "test_gradients_and_inputs": {"grads"},
}
test_cross_attention_agrees = agreement_test(
    "encoder_decoder/encoder_decoder.ipynb", "cross_attention", CROSS_CELLS, ED.CORRECT, ED.VARIANTS,
    {"scaled_dot_product_attention": reference.scaled_dot_product_attention.__wrapped__})
