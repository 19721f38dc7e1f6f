"""The trusted re-check of RMSNorm, SwiGLU and GroupedQueryAttention agrees with their checks.

For every correct answer and every variant of the tables in tests/test_checks_modern_block.py,
the test cells that the trusted re-check fails are exactly those whose checks the variant fails
(every correct answer on every seed of ``probetable.SEEDS``, each variant on one). The cell ->
check names maps are read off the notebook's test cells: each values and masks cell runs its
visible check and, hidden, the full one.
"""
from __future__ import annotations

from probetable import agreement_test

import test_checks_modern_block as M

NB = "modern_block/modern_block.ipynb"

test_rmsnorm_agrees = agreement_test(
    NB, "RMSNorm", {"test_rmsnorm_structure": {"structure"}, "test_rmsnorm_values": {"values", "values_visible"}},
    M.RMS_CORRECT, M.RMS_VARIANTS, {})
test_swiglu_agrees = agreement_test(
    NB, "SwiGLU", {"test_swiglu_structure": {"structure"}, "test_swiglu_values": {"values", "values_visible"}},
    M.SW_CORRECT, M.SW_VARIANTS, {})
test_gqa_agrees = agreement_test(
    NB, "GroupedQueryAttention",
    {"test_gqa_structure": {"structure"}, "test_gqa_values": {"values", "values_visible"},
     "test_gqa_masks": {"masks", "masks_visible"}},
    M.GQA_CORRECT, M.GQA_VARIANTS, {})
