"""The expected results of the visible cases, stored as data beside the declarations.

A notebook's test cell compares the student's results with these (``grading.declared``), so the
student's kernel never needs the course's implementation of the piece it tests: what a student
downloads can leave the reference out. They are the reference's results on the declared visible
cases, encoded as the re-check's wire format (exact dtype, shape and bytes), one JSON file per
assignment in ``expected/``:

    python -m firstprinciples.exercises.expected            # writes every declared assignment's file

``tests/exercises/test_declarations.py`` fails when a file differs from what the reference gives
today (a declaration or the reference changed without the file).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "expected"


def path(assignment: str) -> Path:
    return FOLDER / f"{assignment}.json"


def compute(assignment: str) -> dict:
    """piece -> grade_id -> the reference's encoded results on each visible case, in order."""
    from ..grading import declared, wire
    from . import pieces

    out: dict = {}
    for exercise in pieces(assignment):
        reference = exercise.reference_piece()
        out[exercise.piece] = {
            gid: [{k: wire.encode(v) for k, v in exercise.adapter(reference, declared.tensors(case)).items()}
                  for case in exercise.cases(gid)]
            for gid in exercise.tests}
    return out


def stored(assignment: str) -> dict | None:
    """The stored file's contents (None where there is none)."""
    try:
        return json.loads(path(assignment).read_text())
    except FileNotFoundError:
        return None


def write(assignment: str) -> Path:
    FOLDER.mkdir(exist_ok=True)
    path(assignment).write_text(json.dumps(compute(assignment), indent=0, sort_keys=True) + "\n")
    return path(assignment)


def main(argv=None) -> None:
    from . import NAMES

    for name in (argv if argv else NAMES):
        print(write(name).relative_to(FOLDER.parent.parent.parent))


if __name__ == "__main__":
    main(sys.argv[1:])
