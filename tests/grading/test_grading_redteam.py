"""Subtly wrong softmax answers, graded with the plain `nbgrader autograde` and the
repo's config, each with the score it must get, twice, with nothing left running.

The exercise is softmax (10 points: worked example 2, large inputs 2, -inf
entries 2, dims 2, gradients and inputs 2). The wrong answers get the same partial
credit as their honest in-kernel tests give: the trusted re-check
(firstprinciples.grading.trusted) is as strict as each test, no stricter. The
cheats are in tests/corpus/attacks.py, graded by tests/grading/test_grading_corpus.py.

Together with tests/grading/test_grading_faults.py (crashes, hangs, bombs, a gigabyte of
output, a snooping cell) and tests/grading/test_grading_broken.py (broken files and
metadata) this is the red-team suite of the grading issue.
"""
from __future__ import annotations

import csv
import time

import nbformat
import pytest

from course import SOLUTIONS, fill, make_course, nbgrader, nbgrader_meta, scratch, solution_answers
from test_grading_faults import _sandbox_processes

ASSIGNMENT = NOTEBOOK = "softmax"

BODY = '''
import torch

def softmax(x, dim=-1):
{body}
'''


def answer(body: str, extra: str = "") -> str:
    return BODY.format(body="\n".join("    " + line for line in body.strip().splitlines())) + extra


CORRECT_BODY = """
e = torch.exp(x - x.amax(dim=dim, keepdim=True))
return e / e.sum(dim=dim, keepdim=True)
"""
WRONG_BODY = "return x"  # passes nothing honestly

# student: (answer cell, extra cell or None, expected score, a phrase the feedback must contain)
STUDENTS = {
    "correct": (answer(CORRECT_BODY), None, 10, None),
    # the cheats (patched modules, stripped asserts, lying subclasses, the built-in however it is
    # spelled, the re-check's own machinery...) are in tests/corpus/attacks.py (test_grading_corpus.py)
    "hard_codes_the_worked_example": (answer("""
if x.shape == (3,) and abs(float(x[0]) - 0.7778) < 1e-3:  # Cat's scaled scores
    return torch.tensor([0.3797, 0.3537, 0.2666], dtype=x.dtype)
e = torch.exp(x)
return e / e.sum(dim=dim, keepdim=True)
"""), None, 2, None),  # only the honest dims test (as "no max subtracted")
    # wrong answers: partial credit as the honest tests give it
    "numpy_instead_of_torch": (answer("""
import numpy as np
a = x.detach().numpy()
e = np.exp(a - a.max(axis=dim, keepdims=True))
return e / e.sum(axis=dim, keepdims=True)
"""), None, 0, None),
    "computes_in_float64": (answer("x = x.double()\n" + CORRECT_BODY.strip()), None, 2, "dtype"),
    "keepdim_forgotten_broadcasts": (answer("""
e = torch.exp(x - x.amax(dim=dim))
return e / e.sum(dim=dim)
"""), None, 0, None),
    "nan_for_large_inputs": (answer("""
e = torch.exp(x)
return e / e.sum(dim=dim, keepdim=True)
"""), None, 4, "NaN"),
    "modifies_its_input": (answer("""
x -= x.amax(dim=dim, keepdim=True)
e = torch.exp(x)
return e / e.sum(dim=dim, keepdim=True)
"""), None, 0, None),
    "detaches": (answer("x = x.detach()\n" + CORRECT_BODY.strip()), None, 8, None),
    "minus_inf_as_minus_100": (answer("x = torch.where(torch.isneginf(x), torch.full_like(x, -100.0), x)\n"
                                      + CORRECT_BODY.strip()), None, 8, None),
    "output_requires_grad": (answer("""
e = torch.exp(x - x.amax(dim=dim, keepdim=True))
one = torch.ones((), dtype=x.dtype, requires_grad=True)
return e / e.sum(dim=dim, keepdim=True) * one
"""), None, 2, "requires_grad"),
    # a correct answer with a cell that starts a process meant to outlive grading and write the gradebook
    "leaves_a_process": (answer(CORRECT_BODY), """
import subprocess
subprocess.Popen(["sh", "-c", "sleep 20; for f in ../../gradebook.db /course/gradebook.db; do echo x >> $f; done"],
                 start_new_session=True)
""", 10, None),
    # an honest answer whose helper, in a cell of its own before the tests, is reached only through
    # globals(): the re-check's first runner (the name analysis's dependencies) raises KeyError; its
    # tests pass in the kernel, so a second try with every non-test cell is made, after the cells
    # (the re-check started ahead leaves it for then), and passes
    "helper_seen_only_at_run_time": (answer('e = globals()["_shifted_exp"](x, dim)\n'
                                            'return e / e.sum(dim=dim, keepdim=True)'), None, 10, None),
}
# a cell inserted right after the answer cell, before the tests
BEFORE_TESTS = {"helper_seen_only_at_run_time": "def _shifted_exp(x, dim):\n"
                                                "    return torch.exp(x - x.amax(dim=dim, keepdim=True))\n"}


def _grade(course):
    nbgrader(course, "autograde", ASSIGNMENT, "--force", timeout=1800)
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        return {r["student_id"]: float(r["score"]) for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("redteam"))
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    release = nbformat.read(course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    base = solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4))
    for student, (code, extra, _, _) in STUDENTS.items():
        nb = fill(release, {**base, "softmax": code})
        if extra:
            nb.cells.append(nbformat.v4.new_code_cell(extra))
        if student in BEFORE_TESTS:
            at = next(i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == "softmax") + 1
            nb.cells.insert(at, nbformat.v4.new_code_cell(BEFORE_TESTS[student]))
        target = course / "submitted" / student / ASSIGNMENT
        target.mkdir(parents=True)
        nbformat.write(nb, target / f"{NOTEBOOK}.ipynb")
    db_before = (course / "gradebook.db").stat().st_mtime
    first = _grade(course)
    after = _sandbox_processes(scratch(course))
    time.sleep(1)
    second = _grade(course)
    return course, first, second, after, db_before


def test_every_student_is_graded_once(graded):
    assert sorted(graded[1]) == sorted(STUDENTS)


@pytest.mark.parametrize("student", sorted(STUDENTS))
def test_expected_score(graded, student):
    assert graded[1][student] == STUDENTS[student][2], f"{student}: {graded[1][student]}/10"


@pytest.mark.parametrize("student", sorted(s for s, v in STUDENTS.items() if v[3]))
def test_feedback_gives_the_reason(graded, student):
    course = graded[0]
    nb = nbformat.read(course / "autograded" / student / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    text = " ".join(str(o.get("evalue", "")) for c in nb.cells if nbgrader_meta(c).get("grade")
                    for o in c.get("outputs", []) if o.get("output_type") == "error")
    assert STUDENTS[student][3] in text, text[:2000]


def test_a_second_run_gives_identical_grades(graded):
    assert graded[2] == graded[1]


def test_no_process_outlives_grading(graded):
    assert graded[3] == [], f"left running: {graded[3]}"


def test_the_gradebook_holds_only_what_the_grader_wrote(graded):
    """Every grade is an automatic one (no manual score appeared), every score is one the
    grader computed (it matches the export), and nothing else wrote to the file after the run."""
    from nbgrader.api import Gradebook

    course = graded[0]
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student in STUDENTS:
            sub = gb.find_submission(ASSIGNMENT, student)
            assert all(g.manual_score is None for g in sub.notebooks[0].grades), student
            assert sub.score == graded[2][student]
        assert sorted(s.id for s in gb.students) == sorted(STUDENTS)
