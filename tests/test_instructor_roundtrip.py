"""An instructor's grading round with the plain nbgrader commands and the repo's config.

In a fresh course folder: generate the assignment, collect four students'
submissions (a correct answer, the untouched release, one with the 1/sqrt(d_k)
scaling forgotten, and the seed's own implementation pasted in), then
`nbgrader autograde` and `nbgrader export`, and read the grades.
"""
import csv
import re
import shutil

import nbformat
import pytest

from course import EXERCISES, make_course, nbgrader, with_answer
from seeds import seed_code

ASSIGNMENT = "attention"
NOTEBOOK = "scaled_dot_product_attention"

NO_SCALING = '''
def scaled_dot_product_attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return weights @ V, weights
'''


def _solution_source(course):
    nb = nbformat.read(course / "solutions" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    src = next(c.source for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == NOTEBOOK)
    return re.sub(r"^\s*### (BEGIN|END) SOLUTION\n", "", src, flags=re.M)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("roundtrip"))
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    release = course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    # What nbgrader released here is what the repo ships to students.
    assert release.read_text() == (EXERCISES / ASSIGNMENT / f"{NOTEBOOK}.ipynb").read_text()
    released = nbformat.read(release, as_version=4)
    answers = {
        "correct": _solution_source(course),
        "untouched": None,
        "no_scaling": NO_SCALING,
        "seed": seed_code("scaled_dot_product_attention"),
    }
    for student, source in answers.items():
        target = course / "submitted" / student / ASSIGNMENT
        target.mkdir(parents=True)
        if source is None:
            shutil.copy(release, target / f"{NOTEBOOK}.ipynb")
        else:
            nbformat.write(with_answer(released, NOTEBOOK, source), target / f"{NOTEBOOK}.ipynb")
    nbgrader(course, "autograde", ASSIGNMENT)
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    return course, rows


def test_every_student_is_exported(graded):
    _, rows = graded
    assert set(rows) == {"correct", "untouched", "no_scaling", "seed"}


def test_correct_answer_gets_full_marks(graded):
    _, rows = graded
    assert float(rows["correct"]["score"]) == float(rows["correct"]["max_score"]) == 10


def test_untouched_release_gets_zero(graded):
    _, rows = graded
    assert float(rows["untouched"]["score"]) == 0


def test_forgotten_scaling_gets_partial_marks(graded):
    _, rows = graded
    score = float(rows["no_scaling"]["score"])
    assert 0 < score < 10, score


def test_seed_implementation_gets_full_marks(graded):
    _, rows = graded
    assert float(rows["seed"]["score"]) == 10


def test_feedback_names_the_mistake(graded):
    course, _ = graded
    nbgrader(course, "generate_feedback", ASSIGNMENT)
    html = (course / "feedback" / "no_scaling" / ASSIGNMENT / f"{NOTEBOOK}.html").read_text()
    assert "no scaling" in html and "sqrt(d_k)" in html
