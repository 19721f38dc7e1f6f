"""The generic harness (``test_declarations.py``): every unusual correct answer of the tables passes both runners."""
from __future__ import annotations

import pytest

from exercises.harness import SEEDS, _params, kernel_failures, recheck_failures


@pytest.mark.parametrize("exercise, answer", _params("correct"))
def test_every_correct_answer_passes_both_runners(exercise, answer):
    assert kernel_failures(exercise, answer) == {}
    for seed in SEEDS:
        assert recheck_failures(exercise, answer, seed) == {}, seed
