"""exercises/ is exactly what nbgrader generates from solutions/, and leaks nothing."""
import json

import pytest

from course import EXERCISES, make_course, nbgrader, rel, released_notebooks

LEAKS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("release"))
    # One command for every assignment ("*" is a glob over solutions/), as an instructor may run it.
    nbgrader(course, "generate_assignment", "*", "--force", "--no-db")
    return course / "exercises"


def test_exercises_match_a_fresh_generate_assignment(generated):
    fresh = sorted(p.relative_to(generated).as_posix() for p in generated.glob("*/*.ipynb"))
    committed = sorted(p.relative_to(EXERCISES).as_posix() for p in EXERCISES.glob("*/*.ipynb"))
    assert fresh == committed, "regenerate exercises/ (docs/instructors/grading-round.md: 'Changing an exercise') and commit it"
    for name in fresh:
        a = json.loads((generated / name).read_text())
        b = json.loads((EXERCISES / name).read_text())
        assert a == b, f"exercises/{name} differs from what nbgrader generates from solutions/{name}"


@pytest.mark.parametrize("path", released_notebooks(), ids=rel)
def test_release_contains_no_solution_or_hidden_test(path):
    text = path.read_text()
    for marker in LEAKS:
        assert marker not in text, f"{rel(path)} contains '{marker}'"
