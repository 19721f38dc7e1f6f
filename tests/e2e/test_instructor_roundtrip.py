"""An instructor's grading round with the plain nbgrader commands and the repo's config.

In a fresh course folder: `nbgrader generate_assignment "*"` (every assignment), then
submissions from several students to every assignment, `nbgrader autograde "*"`,
`nbgrader generate_feedback "*"` and `nbgrader export`; the test reads grades.csv.

Students:
- ``correct``: every answer cell holds the solution's code;
- ``untouched``: the release as downloaded;
- ``seed``: the source material's own code pasted into the matching answer cells
  (where the source has code for the piece; the rest from the solution);
- ``no_scaling`` (attention only): the 1/sqrt(d_k) scaling forgotten.
"""
import csv
import shutil

import nbformat
import pytest

from course import (EXERCISES, NO_SCALING, SOLUTIONS, assignments, fill, make_course, nbgrader, nbgrader_meta,
                    solution_answers)
from seeds import seed_code

SEED_SINUSOIDAL = '''
{seed}

def sinusoidal_encoding(max_len, d_model):
    return SinusoidalPE(d_model, max_len).pe[0]
'''


def seed_answers():
    """Answer cells (by grade_id) that the source material's code fills."""
    answers = {name: seed_code(name) for name in
               ("scaled_dot_product_attention", "MultiHeadAttention", "FeedForward", "TransformerBlock")}
    answers["sinusoidal_encoding"] = SEED_SINUSOIDAL.format(seed=seed_code("SinusoidalPE"))
    return answers


def max_points(source_nb):
    return sum(nbgrader_meta(c).get("points", 0) for c in source_nb.cells if nbgrader_meta(c).get("grade"))


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("roundtrip"))
    seeds = seed_answers()
    expected = {}  # (student, assignment) -> "full" | "zero" | "partial"
    # Each command once for the whole course ("*": every assignment), as an instructor grading
    # a term's work at once would run it; the tests of one assignment at a time are elsewhere.
    nbgrader(course, "generate_assignment", "*", "--force")
    for assignment in assignments():
        uses_seed = False
        for release in sorted((course / "exercises" / assignment).glob("*.ipynb")):
            # What nbgrader released here is what the repo ships to students.
            assert release.read_text() == (EXERCISES / assignment / release.name).read_text()
            released = nbformat.read(release, as_version=4)
            source = nbformat.read(SOLUTIONS / assignment / release.name, as_version=4)
            correct = solution_answers(source)
            students = {"correct": correct, "untouched": None}
            if set(seeds) & set(correct):
                uses_seed = True
                students["seed"] = {**correct, **{k: v for k, v in seeds.items() if k in correct}}
            if assignment == "attention":
                students["no_scaling"] = {**correct, "scaled_dot_product_attention": NO_SCALING}
            for student, answers in students.items():
                target = course / "submitted" / student / assignment
                target.mkdir(parents=True, exist_ok=True)
                if answers is None:
                    shutil.copy(release, target / release.name)
                else:
                    nbformat.write(fill(released, answers), target / release.name)
        expected[("correct", assignment)] = "full"
        expected[("untouched", assignment)] = "zero"
        if uses_seed:
            expected[("seed", assignment)] = "full"
        if assignment == "attention":
            expected[("no_scaling", assignment)] = "partial"
    nbgrader(course, "autograde", "*", timeout=3000)
    nbgrader(course, "generate_feedback", "*")
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        rows = {(r["student_id"], r["assignment"]): r for r in csv.DictReader(f)}
    return course, rows, expected


CASES = [(a, s) for a in assignments() for s in ("correct", "untouched", "seed", "no_scaling")]


@pytest.mark.parametrize("assignment, student", CASES)
def test_exported_grade(round_trip, assignment, student):
    _, rows, expected = round_trip
    want = expected.get((student, assignment))
    if want is None:
        assert (student, assignment) not in rows or float(rows[(student, assignment)]["score"]) == 0
        return
    row = rows[(student, assignment)]
    score, top = float(row["score"]), float(row["max_score"])
    source = nbformat.read(next((SOLUTIONS / assignment).glob("*.ipynb")), as_version=4)
    assert top == max_points(source) > 0
    if want == "full":
        assert score == top, f"{student} scored {score}/{top} on {assignment}"
    elif want == "zero":
        assert score == 0, f"{student} scored {score}/{top} on {assignment}"
    else:
        assert 0 < score < top, f"{student} scored {score}/{top} on {assignment}"


def test_feedback_names_the_mistake(round_trip):
    course, _, _ = round_trip
    html = (course / "feedback" / "no_scaling" / "attention" / "scaled_dot_product_attention.html").read_text()
    assert "no scaling" in html and "sqrt(d_k)" in html
