"""The trusted re-check of the "Beyond the block" pieces agrees with their checks.

sample_next_token and tiled_attention: for every correct answer and every variant of their check
tables (tests/test_checks_sampling.py, tests/test_checks_tiled.py), the test cells that the trusted
re-check fails are exactly those whose checks the variant fails, on several seeds (alibi_bias is
declared: tests/exercises/ runs it through both runners).
The sampling probe judges draws, not tokens: the correct answers there draw differently from
the reference (inverse CDF, Gumbel-max, a draw among sorted probabilities) and must all pass.
"""
from __future__ import annotations

from probetable import agreement_test

import test_checks_sampling as S
import test_checks_tiled as T

SAMPLING_CELLS = {
    "test_greedy": {"greedy"}, "test_shapes": {"shapes"}, "test_generator": {"generator"},
    "test_temperature": {"temperature"}, "test_top_k": {"top_k"}, "test_top_p": {"top_p"},
}
test_sample_next_token_agrees = agreement_test(
    "sampling/sampling.ipynb", "sample_next_token", SAMPLING_CELLS, S.CORRECT, S.VARIANTS, {})

TILED_CELLS = {
    "test_worked_example": {"worked"}, "test_against_attention": {"random"}, "test_causal": {"causal"},
    "test_large_scores": {"large"}, "test_memory": {"memory"},
}
test_tiled_attention_agrees = agreement_test(
    "tiled_attention/tiled_attention.ipynb", "tiled_attention", TILED_CELLS, T.CORRECT, T.VARIANTS, {})
