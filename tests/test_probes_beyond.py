"""The trusted re-check of the "Beyond the block" pieces agrees with their checks.

tiled_attention: for every correct answer and every variant of its check table
(tests/test_checks_tiled.py), the test cells that the trusted re-check fails are exactly those whose
checks the variant fails, on several seeds (alibi_bias and sample_next_token are declared:
tests/exercises/ runs them through both runners).
"""
from __future__ import annotations

from probetable import agreement_test

import test_checks_tiled as T

TILED_CELLS = {
    "test_worked_example": {"worked"}, "test_against_attention": {"random"}, "test_causal": {"causal"},
    "test_large_scores": {"large"}, "test_memory": {"memory"},
}
test_tiled_attention_agrees = agreement_test(
    "tiled_attention/tiled_attention.ipynb", "tiled_attention", TILED_CELLS, T.CORRECT, T.VARIANTS, {})
