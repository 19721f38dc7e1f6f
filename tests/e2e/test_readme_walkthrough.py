"""The README's instructor walkthrough, run as written.

The bash block under "Instructors: a grading round" is read from the docs (the README) and
its commands are run one by one in a fresh course folder (a copy of the repo's
config and solutions), with two submissions placed where the README says
("collect submissions into submitted/..."): the grades and the feedback it
promises must appear.
"""
import csv
import os
import shlex
import subprocess
import sys

import nbformat
import pytest

import docpages
from course import SOLUTIONS, fill, make_course, scratch, solution_answers


def walkthrough_commands():
    block = docpages.code_blocks(docpages.section("## Instructors: a grading round"), "bash")[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [c for c in commands if c]


def test_walkthrough_is_what_the_tests_expect():
    commands = walkthrough_commands()
    assert [shlex.split(c)[:2] for c in commands] == [
        ["nbgrader", "generate_assignment"], ["nbgrader", "autograde"],
        ["nbgrader", "generate_feedback"], ["nbgrader", "export"],
    ], commands


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("walkthrough"))
    scratch(course).mkdir(exist_ok=True)
    assignment, notebook = "attention", "scaled_dot_product_attention"
    # The commands as a shell runs them, with this Python's scripts first on PATH.
    env = {**os.environ, "TMPDIR": str(scratch(course)),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    for command in walkthrough_commands():
        proc = subprocess.run(command, shell=True, cwd=course, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
        if "generate_assignment" in command:  # the "collect submissions" step
            release = nbformat.read(course / "exercises" / assignment / f"{notebook}.ipynb", as_version=4)
            correct = solution_answers(nbformat.read(SOLUTIONS / assignment / f"{notebook}.ipynb", as_version=4))
            for student, answers in {"ada": correct, "bob": {}}.items():
                target = course / "submitted" / student / assignment
                target.mkdir(parents=True)
                nbformat.write(fill(release, answers), target / f"{notebook}.ipynb")
    return course


def test_walkthrough_grades_and_gives_feedback(walked):
    with open(walked / "grades.csv", newline="") as f:
        scores = {r["student_id"]: float(r["score"]) for r in csv.DictReader(f) if r["assignment"] == "attention"}
    assert scores == {"ada": 10.0, "bob": 0.0}
    for student in ("ada", "bob"):
        assert (walked / "feedback" / student / "attention" / "scaled_dot_product_attention.html").is_file()


def test_the_documented_roster_loads(tmp_path):
    """The roster as the grading-round page writes it, imported with its command: the names are in
    the gradebook (an instructor who never loads one gets "None, None" in grades.csv)."""
    import shlex

    from docpages import code_blocks, section

    from course import make_course, nbgrader

    text = section("## 0. The class")
    csv_text, command = code_blocks(text, "text")[0], code_blocks(text, "bash")[0].strip()
    course = make_course(tmp_path)
    (course / "roster.csv").write_text(csv_text)
    args = shlex.split(command)
    assert args[:1] == ["nbgrader"], command
    nbgrader(course, *args[1:])
    listed = nbgrader(course, "db", "student", "list")
    out = listed.stdout + listed.stderr
    for line in csv_text.strip().splitlines()[1:]:
        sid, first, last = line.split(",")[:3]
        assert sid in out and first in out and last in out, out
