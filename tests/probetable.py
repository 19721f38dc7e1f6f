"""Agreement between the trusted re-check and the in-kernel checks.

The trusted re-check (firstprinciples.grading.trusted) must give every honest
answer the same verdict per test cell as the notebook's own checks: a correct
answer passes everywhere, and each typical wrong answer fails exactly the test
cells whose checks it fails. Otherwise it would take away points the tests
grant (too strict) or let a forged in-kernel pass through (too lax).

The probes run in this process (``trusted.local_verdicts``) on the same
answers as the table-driven check tests (tests/test_checks_*.py), with a few
seeds for the probes' secret inputs (``agreement_params``).
"""
from __future__ import annotations

import nbformat
import pytest

from course import SOLUTIONS
from firstprinciples.grading import trusted

SEEDS = (0, 1, 2)


def trusted_failures(notebook: str, namespace: dict, seed: int, cells) -> set:
    """The test cells (among ``cells``) that the trusted re-check fails for ``namespace``."""
    nb = nbformat.read(SOLUTIONS / notebook, as_version=4)
    verdicts = trusted.local_verdicts(nb, namespace, seed)
    missing = set(cells) - set(verdicts)
    assert not missing, f"test cells not re-checked: {sorted(missing)}"
    return {gid for gid in cells if verdicts[gid]}


def expected_failures(cells: dict, failed_checks: set) -> set:
    """``cells``: test cell grade_id -> the check names it runs; a cell fails if any of them fails."""
    return {gid for gid, checks in cells.items() if checks & failed_checks}


def agreement_params(correct: dict, variants: dict) -> list:
    """(answer, the checks it fails, name, seed): every correct answer with every seed (a
    seed that fails a right answer would cost a student points), and each wrong answer
    with one seed, in turn (every seed is used, and the suite stays fast)."""
    params = [pytest.param(answer, set(), name, seed, id=f"correct:{name}-{seed}")
              for name, answer in correct.items() for seed in SEEDS]
    params += [pytest.param(answer, fails, name, SEEDS[i % len(SEEDS)], id=f"variant:{name}-{SEEDS[i % len(SEEDS)]}")
               for i, (name, (answer, fails)) in enumerate(variants.items())]
    return params


def agreement_test(notebook: str, piece: str, cells: dict, correct: dict, variants: dict, base: dict,
                   differences: dict | None = None):
    """A pytest test over every correct answer and variant of ``piece`` and every seed.

    ``cells``: grade_id -> set of check names (the table's names) that cell runs;
    ``correct``: name -> answer; ``variants``: name -> (answer, the set of checks it fails);
    ``base``: the correct objects of the notebook's other pieces;
    ``differences``: variant name -> (cells the trusted re-check fails instead, why) for the
    few documented cases where it is deliberately different.
    """
    differences = differences or {}

    @pytest.mark.parametrize("answer, fails, name, seed", agreement_params(correct, variants))
    def test(answer, fails, name, seed):
        namespace = {**base, piece: answer}
        got = trusted_failures(notebook, namespace, seed, cells)
        want = differences[name][0] if name in differences else expected_failures(cells, fails)
        assert got == want, f"{name} (seed {seed}): trusted re-check fails {sorted(got)}, the checks fail {sorted(want)}"

    return test
