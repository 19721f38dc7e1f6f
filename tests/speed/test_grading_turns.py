"""A grading round never stalls behind one student, and its log shows no false alarm.

1. No fixed batches: two workers, a class of six on `softmax` whose first student (in the
   order the workers take them) takes long (a cell that sleeps ``SLOW_SECONDS``). The worker
   that grades that student grades no one else: the other takes every later submission as it
   frees up. (With fixed batches, the slow student's worker had half the class dealt to it,
   and those students waited behind the slow one while the other worker sat idle.) Who graded
   what is read from the detailed log (``[grader i/2] ... Autograding .../<student>/...``).
2. No false tracebacks: `nbgrader autograde "*"` on a gradebook that knows no student yet,
   three assignments a student, three workers. The workers start on a student's assignments
   together, and each used to insert the student: all but one insert failed on the unique
   id, and each failure printed a database traceback (a screenful a student, before the first
   result, with correct grades and exit code 0). The log must hold no traceback at all.
"""
from __future__ import annotations

import re

import nbformat
import pytest

from course import SOLUTIONS, fill, make_course, nbgrader, solution_answers
from test_grading_parallel import answers_of, read_export, submit

SLOW_SECONDS = 25  # the slow student's answer cell; the five others take about a second each
SLOW = ("import time\nimport torch\n\ntime.sleep(%d)\n\n" % SLOW_SECONDS
        + "def softmax(x, dim=-1):\n    e = torch.exp(x - x.amax(dim=dim, keepdim=True))\n"
        "    return e / e.sum(dim=dim, keepdim=True)\n")


@pytest.fixture(scope="module")
def slow_first(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("slow-first"))
    nbgrader(course, "generate_assignment", "softmax", "--force")
    submit(course, "a_slow", {**answers_of("correct"), "softmax": SLOW})  # sorted first: taken first
    others = [f"b_{i}" for i in range(5)]
    for student in others:
        submit(course, student, answers_of("correct"))
    proc = nbgrader(course, "autograde", "softmax", timeout=1800,
                    env={"FP_GRADING_WORKERS": "2", "FP_GRADING_VERBOSE": "1"})
    rows = {r["student_id"]: float(r["score"]) for r in read_export(course)}
    graded_by: dict = {}
    for worker, student in re.findall(r"^\[grader (\d)/2\] .*Autograding .*autograded/([^/]+)/softmax/",
                                      proc.stderr, flags=re.MULTILINE):
        graded_by.setdefault(worker, []).append(student)
    return others, graded_by, rows, proc


def test_the_other_worker_grades_everyone_after_the_slow_student(slow_first):
    others, graded_by, _, proc = slow_first
    slow_worker = [w for w, students in graded_by.items() if "a_slow" in students]
    assert len(slow_worker) == 1, (graded_by, proc.stderr[-3000:])
    (w,) = slow_worker
    assert graded_by[w] == ["a_slow"], f"the slow student's worker also graded {graded_by[w][1:]}"
    (other,) = set(graded_by) - {w}
    assert sorted(graded_by[other]) == others, graded_by


def test_every_student_graded_once_with_the_right_grade(slow_first):
    others, graded_by, rows, _ = slow_first
    assert sorted(sum(graded_by.values(), [])) == ["a_slow", *others]
    assert rows == {s: 10.0 for s in ["a_slow", *others]}, rows


# ------------------------------------------------------------------ a fresh gradebook
ASSIGNMENTS = ("softmax", "causal_mask", "qkv")
STUDENTS = 6


@pytest.fixture(scope="module")
def fresh_class(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("fresh-gradebook"))
    full = {}
    for assignment in ASSIGNMENTS:
        nbgrader(course, "generate_assignment", assignment, "--force")
        for release_path in sorted((course / "exercises" / assignment).glob("*.ipynb")):
            release = nbformat.read(release_path, as_version=4)
            solved = solution_answers(nbformat.read(SOLUTIONS / assignment / release_path.name, as_version=4))
            for i in range(STUDENTS):
                folder = course / "submitted" / f"s{i}" / assignment
                folder.mkdir(parents=True, exist_ok=True)
                nbformat.write(fill(release, solved), folder / release_path.name)
    proc = nbgrader(course, "autograde", "*", timeout=1800, env={"FP_GRADING_WORKERS": "3"})
    rows = read_export(course)
    return proc, rows


def test_a_fresh_gradebook_graded_by_three_workers_logs_no_traceback(fresh_class):
    proc, _ = fresh_class
    assert "with 3 workers" in proc.stderr, proc.stderr[-3000:]
    for alarm in ("Traceback", "IntegrityError", "Rolling back"):
        assert alarm not in proc.stderr, proc.stderr[:4000]


def test_the_fresh_class_is_graded_in_full(fresh_class):
    proc, rows = fresh_class
    assert len(rows) == STUDENTS * len(ASSIGNMENTS)
    assert all(float(r["score"]) == float(r["max_score"]) > 0 for r in rows), rows
    n = STUDENTS * len(ASSIGNMENTS)
    assert re.search(rf"^\s+graded\s+{n}\s+of {n}$", proc.stderr, flags=re.MULTILINE), proc.stderr[-2000:]
