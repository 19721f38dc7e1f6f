"""The generic harness (``test_declarations.py``): every wrong answer of the tables fails exactly its cells."""
from __future__ import annotations

import pytest

from exercises.harness import SEEDS, _line, _params, kernel_failures, recheck_failures


@pytest.mark.parametrize("exercise, answer, in_kernel, in_recheck", _params("wrong"))
def test_every_wrong_answer_fails_exactly_its_cells(exercise, answer, in_kernel, in_recheck):
    assert set(kernel_failures(exercise, answer)) == set(in_kernel), "in the kernel"
    seed = SEEDS[_line(answer) % len(SEEDS)]
    assert set(recheck_failures(exercise, answer, seed)) == set(in_recheck), f"in the re-check (seed {seed})"
