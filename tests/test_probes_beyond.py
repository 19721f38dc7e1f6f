"""The trusted re-check of the "Beyond the block" pieces agrees with their checks.

sample_next_token: for every correct answer and every variant of its check table
(tests/test_checks_sampling.py), the test cells that the trusted re-check fails are exactly those
whose checks the variant fails, on several seeds (alibi_bias and tiled_attention are declared:
tests/exercises/ runs them through both runners).
The sampling probe judges draws, not tokens: the correct answers there draw differently from
the reference (inverse CDF, Gumbel-max, a draw among sorted probabilities) and must all pass.
"""
from __future__ import annotations

from probetable import agreement_test

import test_checks_sampling as S

SAMPLING_CELLS = {
    "test_greedy": {"greedy"}, "test_shapes": {"shapes"}, "test_generator": {"generator"},
    "test_temperature": {"temperature"}, "test_top_k": {"top_k"}, "test_top_p": {"top_p"},
}
test_sample_next_token_agrees = agreement_test(
    "sampling/sampling.ipynb", "sample_next_token", SAMPLING_CELLS, S.CORRECT, S.VARIANTS, {})
