"""The expected results of the visible cases, stored as data beside the declarations (read here;
written by ``grading.store``).

A notebook's test cell compares the student's results with these (``grading.declared``), so the
student's kernel never needs the course's implementation of the piece it tests: what a student
downloads can leave the reference out. They are the reference's results on the declared visible
cases, encoded as the re-check's wire format (exact dtype, shape and bytes), one JSON file per
assignment in ``expected/``:

    python -m firstprinciples.grading.store            # writes every declared assignment's file

``tests/exercises/test_declarations.py`` fails when a file differs from what the reference gives
today (a declaration or the reference changed without the file).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "expected"


def path(assignment: str) -> Path:
    return FOLDER / f"{assignment}.json"


@functools.lru_cache(maxsize=None)
def mistakes(assignment: str) -> dict | None:
    """The declared mistakes' results on the visible cases, stored in a student bundle only
    (``firstprinciples.bundle``: piece -> case label -> mistake label -> encoded results), where the
    mistakes' code is not; None in the course (the kernel runs the mistakes there)."""
    import gzip

    try:
        with gzip.open(FOLDER / f"{assignment}.mistakes.json.gz", "rt") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def stored(assignment: str) -> dict | None:
    """The stored file's contents (None where there is none)."""
    try:
        return json.loads(path(assignment).read_text())
    except FileNotFoundError:
        return None
