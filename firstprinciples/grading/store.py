"""Writes the stored expected results of the declared exercises' visible cases (``exercises.expected``).

    python -m firstprinciples.grading.store [assignment ...]     # every declared assignment by default

Run it after changing a declaration's visible cases or the reference: ``tests/exercises/
test_declarations.py`` fails until the stored files are the reference's results again.
"""
from __future__ import annotations

import json
import sys

from ..exercises import NAMES, expected, pieces
from . import declared


def compute(assignment: str) -> dict:
    """piece -> grade_id -> the reference's encoded results on each visible case, in order, as stored
    (``declared.stored_form``: what the test judges). A piece without a reference (a trained model)
    stores nothing: its tests judge the answer's results by their properties."""
    out: dict = {}
    for exercise in pieces(assignment):
        if not exercise.reference:
            continue
        reference = exercise.reference_piece()
        out.setdefault(exercise.piece, {}).update({
            gid: [declared.stored_form(exercise, gid, case, exercise.adapter(reference, declared.tensors(case)))
                  for case in exercise.cases(gid)]
            for gid in exercise.tests})
    return out


def write(assignment: str):
    expected.FOLDER.mkdir(exist_ok=True)
    path = expected.path(assignment)
    path.write_text(json.dumps(compute(assignment), indent=0, sort_keys=True) + "\n")
    return path


def main(argv=None) -> None:
    for name in (argv if argv else NAMES):
        print(write(name).relative_to(expected.FOLDER.parent.parent.parent))


if __name__ == "__main__":
    main(sys.argv[1:])
