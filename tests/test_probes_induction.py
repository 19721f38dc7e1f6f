"""The trusted re-check of induction_score agrees with its checks.

For every correct answer and every variant of tests/test_checks_induction.py, the test cells that
the trusted re-check fails are exactly those whose checks the variant fails, on several seeds.
The one deliberate difference: a typed-in worked example (0.7) passes the worked-example test in
the notebook, while the re-check draws fresh weights of the same size and fails it there too.
"""
from __future__ import annotations

from probetable import agreement_test

import test_checks_induction as I

CELLS = {"test_worked_example": {"worked"}, "test_shapes": {"shapes"}, "test_random": {"random"},
         "test_known_heads": {"heads"}}
test_induction_score_agrees = agreement_test(
    "induction_heads/induction_heads.ipynb", "induction_score", CELLS, I.CORRECT, I.VARIANTS, {},
    differences={"hard-coded worked example": (set(CELLS), "fresh weights of the worked example's size: "
                                                           "a typed-in 0.7 earns nothing there either")})
