"""A correct notebook passes the trusted re-check whatever the secret seed.

Each student gets their own secret inputs, so a probe that fails a right answer
on one draw in twenty would take points from one student in twenty. The
agreement tests (tests/test_probes_*.py) run every answer of the check tables
on a few seeds; here each solution notebook, run in this process (every cell
but the tests), is re-checked on many more. (This found float32 generation in
the KV-cache probe drifting past its tolerance on about 6% of the seeds.)
"""
from __future__ import annotations

import contextlib
import io

import nbformat
import pytest

from course import source_notebooks
from firstprinciples.grading import trusted

# 24 seeds: a probe that fails a right answer on one draw in twenty fails here with
# probability 1 - 0.95^24 = 71% (one in ten: 92%); every grading test re-checks on seeds of
# its own besides. (40 seeds took 6 minutes of the suite's 2 cores; the capstone's alone, 2.)
SEEDS = range(100, 124)


def solution_namespace(path) -> dict:
    """The notebook's objects after running every cell except the test cells, quietly."""
    nb = nbformat.read(path, as_version=4)
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for cell in nb.cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell.cell_type == "code" and not (meta.get("grade") and not meta.get("solution")):
                exec(compile(cell.source, f"{path.parent.name}:{meta.get('grade_id', '?')}", "exec"), namespace)
    return nb, namespace


@pytest.mark.parametrize("path", source_notebooks(), ids=lambda p: p.parent.name)
def test_the_solution_passes_on_every_seed(path):
    nb, namespace = solution_namespace(path)
    failures = {}
    for seed in SEEDS:
        verdicts = trusted.local_verdicts(nb, namespace, seed)
        assert verdicts, "no test cell was re-checked"
        failures.update({(seed, cell): why for cell, why in verdicts.items() if why})
    assert not failures, "\n".join(f"seed {s}, {cell}: {why}" for (s, cell), why in sorted(failures.items())[:5])


def _correct_answers():
    import importlib

    from course import SOLUTIONS, as_student_code
    from firstprinciples import exercises

    out = []
    for assignment in exercises.NAMES:  # (the declared exercises' unusual correct answers, per piece)
        table = importlib.import_module(f"exercises.{assignment}_answers")
        (notebook,) = (p.relative_to(SOLUTIONS).as_posix() for p in sorted((SOLUTIONS / assignment).glob("*.ipynb")))
        pieces = exercises.pieces(assignment)
        for exercise in pieces:
            correct = table.CORRECT.get(exercise.piece, {}) if hasattr(table, "PIECES") else table.CORRECT
            # (the notebook's other pieces: the course's, written as a student would)
            others = {o.piece: as_student_code(o.reference_piece()) for o in pieces if o is not exercise and o.reference}
            out += [(notebook, exercise.piece, name, fn, others) for name, fn in correct.items()]
    return out


@pytest.mark.parametrize("notebook, piece, name, answer, others", _correct_answers(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_correct_answers_pass_on_every_seed(notebook, piece, name, answer, others):
    from course import SOLUTIONS

    nb = nbformat.read(SOLUTIONS / notebook, as_version=4)
    failures = {}
    for seed in SEEDS:
        # (only this piece is re-checked: the notebook's other pieces are the course's, re-checked on
        # every seed by the solution's test above)
        verdicts = trusted.local_verdicts(nb, {**others, piece: answer}, seed, only={piece})
        assert verdicts, "no test cell was re-checked"
        failures.update({(seed, cell): why for cell, why in verdicts.items() if why})
    assert not failures, f"{name}: " + "\n".join(f"seed {s}, {cell}: {why}" for (s, cell), why in sorted(failures.items())[:5])
