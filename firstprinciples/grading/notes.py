"""What grading writes about a student beside the score, and where: the notes of a submission
(``grading_notes/<assignment>/<student>/<notebook>.txt``; exported to ``grades.csv``, shown in
the feedback and the grading log), each capped (``wire.capped``: parts of a note can come from
the student's code), and the marker of a submission whose grading stopped half-way.

A leaf of the core layer: it imports nothing of the grader but ``wire``, so that the modules
which write notes (``execute``, ``sanitize``) and those which read them (``gradelog``,
``feedback``, ``formgrader``, ``parallel``) depend on it and not on each other.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import wire

NOTES_DIRECTORY = "grading_notes"
# Written into a submission's autograded folder while it is being graded, removed when it is
# done: a run killed in the middle leaves it (``parallel``), and the export flags the submission.
MARKER = ".fp-grading-incomplete"
NOTE_MAX = wire.NOTE_MAX
capped = wire.capped


def notes_path(root: str, assignment: str, student: str, notebook: str) -> Path:
    return Path(root) / NOTES_DIRECTORY / assignment / student / f"{notebook}.txt"


def add_note(log, resources, text: str, *, error: bool = False) -> None:
    """Log ``text`` for this student and keep it for the export (capped: ``NOTE_MAX``)."""
    text = capped(text)
    info = resources["nbgrader"]
    who = f"student '{info['student']}', {info['assignment']}/{info['notebook']}.ipynb"
    (log.error if error else log.warning)("%s: %s", who, text)
    path = notes_path(resources["nbgrader"].get("course_root", os.getcwd()),
                      info["assignment"], info["student"], info["notebook"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text + "\n")
