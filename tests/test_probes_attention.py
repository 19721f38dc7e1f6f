"""The trusted re-check of scaled dot-product attention agrees with its checks (softmax is declared:
tests/exercises/test_declarations.py runs it through both runners)."""
from __future__ import annotations

from probetable import agreement_test

import test_checks_attention as A

ATTENTION_CELLS = {
    "test_worked_example": {"worked"}, "test_batched_shapes": {"shapes"}, "test_masks": {"causal", "masks"},
    "test_random_against_torch": {"random"}, "test_gradients_and_inputs": {"grads"},
}

test_attention_agrees = agreement_test(
    "attention/scaled_dot_product_attention.ipynb", "scaled_dot_product_attention", ATTENTION_CELLS,
    A.CORRECT, A.VARIANTS, {},
    differences={
        # The checks grant the worked-example test to typed-in weights; the re-check draws
        # fresh inputs of the same sizes, so hard-coding earns nothing there either.
        "hard-coded worked example": (set(ATTENTION_CELLS), "fresh inputs"),
    })
