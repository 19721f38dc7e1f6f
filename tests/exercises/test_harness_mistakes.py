"""The generic harness (``test_declarations.py``): every declared mistake fails exactly its cells, named."""
from __future__ import annotations

import pytest

from exercises.harness import SEEDS, _params, kernel_failures, recheck_failures


@pytest.mark.parametrize("exercise, mistake", _params("mistake"))
def test_every_mistake_fails_exactly_its_cells_and_is_named(exercise, mistake):
    failed = kernel_failures(exercise, mistake.fn)
    assert set(failed) == mistake.fails, f"in the kernel: failed {sorted(failed)}"
    for gid, message in failed.items():
        assert mistake.label in message or " raised " in message, f"{gid} does not name it:\n{message}"
    seed = SEEDS[exercise.mistakes.index(mistake) % len(SEEDS)]
    failed = recheck_failures(exercise, mistake.fn, seed)
    assert set(failed) == (mistake.fails - mistake.missed) | mistake.hidden, \
        f"in the re-check (seed {seed}): failed {sorted(failed)}"
