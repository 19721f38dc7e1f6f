"""The trusted re-check of softmax and scaled dot-product attention agrees with their checks."""
from __future__ import annotations

from probetable import agreement_test

import test_checks_attention as A
import test_checks_softmax as S

SOFTMAX_CELLS = {
    "test_worked_example": {"worked"}, "test_large_inputs": {"large"}, "test_minus_inf": {"minus_inf"},
    "test_dims": {"dims"}, "test_gradients_and_inputs": {"grads"},
}
ATTENTION_CELLS = {
    "test_worked_example": {"worked"}, "test_batched_shapes": {"shapes"}, "test_masks": {"causal", "masks"},
    "test_random_against_torch": {"random"}, "test_gradients_and_inputs": {"grads"},
}

test_softmax_agrees = agreement_test("softmax/softmax.ipynb", "softmax", SOFTMAX_CELLS, S.CORRECT, S.VARIANTS, {})
test_attention_agrees = agreement_test(
    "attention/scaled_dot_product_attention.ipynb", "scaled_dot_product_attention", ATTENTION_CELLS,
    A.CORRECT, A.VARIANTS, {},
    differences={
        # The checks grant the worked-example test to typed-in weights; the re-check draws
        # fresh inputs of the same sizes, so hard-coding earns nothing there either.
        "hard-coded worked example": (set(ATTENTION_CELLS), "fresh inputs"),
    })
