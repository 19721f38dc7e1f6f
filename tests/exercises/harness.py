"""The generic harness's helpers (``test_declarations.py`` and the ``test_harness_*.py`` files: one
harness, in several files so that the suite's workers, a test file each, share it)."""
from __future__ import annotations

import importlib

import nbformat
import pytest

from course import SOLUTIONS, as_answer, as_student_code
from firstprinciples import exercises
from firstprinciples.grading import declared, trusted

SEEDS = (0, 1, 2)
MIN_REJECTIONS = 5


def answers(name: str):
    return importlib.import_module(f"exercises.{name}_answers")


def notebook(name: str):
    paths = sorted((SOLUTIONS / name).glob("*.ipynb"))
    assert len(paths) == 1, paths
    return nbformat.read(paths[0], as_version=4)


def kernel_failures(exercise, piece) -> dict:
    """grade_id -> the message of its failure in the kernel's runner (passing tests left out)."""
    failed = {}
    for gid in exercise.tests:
        try:
            declared.run_test(exercise, gid, piece)
        except Exception as err:  # any exception fails a test cell
            failed[gid] = str(err)
    return failed


def recheck_failures(exercise, piece, seed: int) -> dict:
    """grade_id -> the trusted re-check's reason for failing it, among this piece's tests (the
    notebook's other pieces are the course's, written as a student would; a declared mistake is
    graded as the student's own code: ``as_answer``)."""
    namespace = {other.piece: as_student_code(other.reference_piece()) for other in exercises.pieces(exercise.name)
                 if other.reference}
    verdicts = trusted.local_verdicts(notebook(exercise.name), {**namespace, exercise.piece: as_answer(piece)}, seed)
    return {gid: why for gid, why in verdicts.items() if why and gid in exercise.tests}


def _id(exercise) -> str:
    return exercise.name if len(exercises.pieces(exercise.name)) == 1 else f"{exercise.name}.{exercise.piece}"


def harnessed() -> list:
    """The declared pieces this harness runs: all but those without a reference (the capstone's trained
    model and its decoding, objects of a kernel: tests/exercises/test_capstone_trained.py runs them)."""
    return [ex for ex in exercises.all_pieces() if ex.reference]


def _params(kind: str) -> list:
    out = []
    for ex in harnessed():
        table = answers(ex.name)
        if kind == "correct":
            correct = table.CORRECT.get(ex.piece, {}) if hasattr(table, "PIECES") else table.CORRECT
            out += [pytest.param(ex, fn, id=f"{_id(ex)}:{label}") for label, fn in correct.items()]
        elif kind == "mistake":
            out += [pytest.param(ex, m, id=f"{_id(ex)}:{m.label}") for m in ex.mistakes]
        elif kind == "wrong":
            wrong = table.WRONG.get(ex.piece, {}) if hasattr(table, "PIECES") else table.WRONG
            out += [pytest.param(ex, *row, id=f"{_id(ex)}:{label}") for label, row in wrong.items()]
        else:
            out += [pytest.param(ex, id=_id(ex))]
    return out


def _line(answer) -> int:
    """The line where an answer is written: a function's, or a class's (a module piece) first method's
    (0 for a class that defines none)."""
    code = getattr(answer, "__code__", None)
    if code is None:  # a class
        code = next((f.__code__ for f in vars(answer).values() if hasattr(f, "__code__")), None)
    return code.co_firstlineno if code is not None else 0
