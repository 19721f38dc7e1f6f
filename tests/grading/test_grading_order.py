"""No grade depends on the order of grading or on the number of workers.

The same nine softmax submissions (right, wrong, forbidden, untouched, crashing, slow, unreadable,
and honest but unusual) are graded twice, in two course folders: once by one worker in
one order, once by three workers in the reverse order (the students' ids are renamed so that
nbgrader's sorted order is reversed). Every submission must get the same score and the same
notes both times. A grade that depended on what a worker graded before (a template that had
preloaded a module, a cache left by an earlier notebook) shows up here as a difference.
"""
from __future__ import annotations

import csv

import nbformat
import pytest

from course import SOLUTIONS, fill, make_course, nbgrader, solution_answers

ASSIGNMENT = NOTEBOOK = "softmax"
ANSWERS = {
    "right": None,  # the solution's own answer
    "wrong": "import torch\n\ndef softmax(x, dim=-1):\n    return x.exp() / x.exp().sum()\n",
    "forbidden": "import torch\n\ndef softmax(x, dim=-1):\n    return torch.softmax(x, dim)\n",
    "untouched": "# YOUR CODE HERE\nraise NotImplementedError()\n",
    "crashing": "import os\n\ndef softmax(x, dim=-1):\n    os._exit(3)\n",
    "slowish": "import time, torch\n\ndef softmax(x, dim=-1):\n    time.sleep(0.05)\n"
               "    e = torch.exp(x - x.amax(dim=dim, keepdim=True))\n    return e / e.sum(dim=dim, keepdim=True)\n",
    "display": "def softmax(x, dim=-1):\n    e = (x - x.amax(dim=dim, keepdim=True)).exp()\n"
               "    return e / e.sum(dim=dim, keepdim=True)\n\ndisplay(softmax(torch.zeros(3)))\n",
    "wrong_dim": "import torch\n\ndef softmax(x, dim=-1):\n    e = torch.exp(x - x.amax(-1, keepdim=True))\n"
                 "    return e / e.sum(-1, keepdim=True)\n",
    "syntax": "def softmax(x, dim=-1):\n    return (x.exp()\n",
}


def _grade(tmp, ids: dict, workers: int) -> dict:
    """Grade the submissions under the student ids ``ids`` (kind -> id); kind -> (score, notes)."""
    course = make_course(tmp)
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    release = nbformat.read(course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    solved = solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4))
    for kind, student in ids.items():
        answers = dict(solved)
        if ANSWERS[kind] is not None:
            answers[ASSIGNMENT] = ANSWERS[kind]
        folder = course / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        nbformat.write(fill(release, answers), folder / f"{NOTEBOOK}.ipynb")
    nbgrader(course, "autograde", ASSIGNMENT, timeout=1800, env={"FP_GRADING_WORKERS": str(workers)})
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    return {kind: (float(rows[student]["score"]), rows[student]["notes"]) for kind, student in ids.items()}


@pytest.fixture(scope="module")
def two_gradings(tmp_path_factory):
    kinds = sorted(ANSWERS)
    forward = {kind: f"s{i}_{kind}" for i, kind in enumerate(kinds)}  # graded in this order
    backward = {kind: f"s{len(kinds) - i}_{kind}" for i, kind in enumerate(kinds)}  # and in the reverse
    one = _grade(tmp_path_factory.mktemp("order-one-worker"), forward, 1)
    three = _grade(tmp_path_factory.mktemp("order-three-workers"), backward, 3)
    return one, three


def test_the_same_grades_and_notes_in_either_order_and_any_number_of_workers(two_gradings):
    one, three = two_gradings
    assert one == three, {k: (one[k], three[k]) for k in one if one[k] != three[k]}


def test_the_grades_are_the_expected_ones(two_gradings):
    """(So that the comparison above is of real grades: the right answers score 10, the rest less.)"""
    one, _ = two_gradings
    assert one["right"][0] == one["display"][0] == one["slowish"][0] == 10, one
    assert all(one[k][0] < 10 for k in ("wrong", "forbidden", "untouched", "crashing", "wrong_dim", "syntax")), one


def test_a_zero_says_why_in_the_notes(two_gradings):
    """An untouched answer, a cell Python cannot read and a forbidden built-in each get a reason in
    grades.csv's notes (they had an empty notes column); the forbidden one names the call."""
    one, _ = two_gradings
    assert "forbidden call: softmax: it calls torch.softmax" in one["forbidden"][1], one["forbidden"]
    assert "FLAGGED" not in one["forbidden"][1], one["forbidden"]  # (a reason for its zero, not a flag)
    assert "unanswered: softmax" in one["untouched"][1], one["untouched"]
    # (the kernel's own words, as the notebook shows them: IPython says "incomplete input" here)
    assert "syntax error in softmax, line 2: incomplete input" in one["syntax"][1], one["syntax"]
    assert one["right"][1] == "", one["right"]
