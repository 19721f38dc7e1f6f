"""Broken submissions are graded as far as possible, with a note per student.

A grading round with the plain `nbgrader autograde` / `nbgrader export` and the
repo's config on the `softmax` assignment (one answer cell, five test cells of
2 points: 10). Every student but ``correct`` hands in something broken:

=====================  =====  ===================================================
student                grade  why
=====================  =====  ===================================================
correct                10
invalid_json           0      the file is not a notebook: graded as the release
                              with answers that raise, so every test fails
missing_notebook       0      folder without a notebook: autograde skips it, the
                              export lists it with 0 and a note
renamed_notebook       10     the only notebook in the folder is graded
deleted_test_cell      10     the instructor's test is put back
duplicated_test_cell   10     the last copy is graded (stock: aborts the batch)
stripped_metadata      10     tests recognised by their content; the answer runs
                              as a plain cell, so it is still tested
test_cell_to_markdown  10     turned back into code (as stock nbgrader does)
numpy_beside           10     the sandboxed kernel does not see the submission's
                              files; the export notes the extra file
=====================  =====  ===================================================

Measured stock behaviour (nbgrader 0.9.6, the config before this change):
correct 10, deleted_test_cell 8, duplicated_test_cell aborted the whole batch
(SchemaTooOldError: no student after it was graded), invalid_json and
renamed_notebook failed that student with exit code 1 and kept the
gradebook's earlier score, missing_notebook was skipped (no row in the export).

The batch must not abort (exit code 0), every repair is in the log and in the
``notes`` column of grades.csv, and a later unreadable resubmission
(``stale``) replaces an earlier 10 with 0.
"""
import csv

import nbformat
import pytest

from course import SOLUTIONS, fill, make_course, nbgrader, nbgrader_meta, solution_answers

ASSIGNMENT = NOTEBOOK = "softmax"

EXPECTED = {
    "correct": 10, "invalid_json": 0, "missing_notebook": 0, "renamed_notebook": 10,
    "deleted_test_cell": 10, "duplicated_test_cell": 10, "stripped_metadata": 10,
    "test_cell_to_markdown": 10, "numpy_beside": 10,
}
NOTES = {  # a piece of the student's note in grades.csv
    "invalid_json": "not a readable notebook",
    "missing_notebook": "no notebook in the submission folder",
    "renamed_notebook": "graded 'softmax-Copy1.ipynb'",
    "deleted_test_cell": "put back from the source: test_dims",
    "duplicated_test_cell": "'test_minus_inf' was there twice",
    "stripped_metadata": "recognised by their content",
    "test_cell_to_markdown": "'test_large_inputs' had been turned into markdown",
    "numpy_beside": "numpy.py",
}


def _cell(nb, grade_id):
    return next(i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == grade_id)


def _submit(course, student, nb=None, name=f"{NOTEBOOK}.ipynb", text=None, timestamp=None):
    folder = course / "submitted" / student / ASSIGNMENT
    folder.mkdir(parents=True, exist_ok=True)
    if text is not None:
        (folder / name).write_text(text)
    elif nb is not None:
        nbformat.write(nb, folder / name)
    if timestamp:
        (folder / "timestamp.txt").write_text(timestamp)
    return folder


def _export(course):
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        return {r["student_id"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("broken"))
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    release = nbformat.read(course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    good = fill(release, solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)))

    _submit(course, "correct", good)
    _submit(course, "stale", good, timestamp="2024-01-01 10:00:00")
    _submit(course, "invalid_json", text='{"cells": [ this is not JSON')
    _submit(course, "missing_notebook")
    _submit(course, "renamed_notebook", good, name=f"{NOTEBOOK}-Copy1.ipynb")

    nb = nbformat.from_dict(good)
    del nb.cells[_cell(nb, "test_dims")]
    _submit(course, "deleted_test_cell", nb)

    nb = nbformat.from_dict(good)
    copy = nbformat.from_dict(nb.cells[_cell(nb, "test_minus_inf")])
    copy.id = "a-copy"
    nb.cells.append(copy)
    _submit(course, "duplicated_test_cell", nb)

    nb = nbformat.from_dict(good)
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    _submit(course, "stripped_metadata", nb)

    nb = nbformat.from_dict(good)
    i = _cell(nb, "test_large_inputs")
    nb.cells[i] = nbformat.v4.new_markdown_cell(nb.cells[i].source, metadata=nb.cells[i].metadata)
    _submit(course, "test_cell_to_markdown", nb)

    folder = _submit(course, "numpy_beside", good)
    (folder / "numpy.py").write_text("raise ImportError('shadowed')\n")

    first = nbgrader(course, "autograde", ASSIGNMENT, timeout=1800,  # asserts exit code 0
                     env={"FP_GRADING_VERBOSE": "1"})  # (the log tests read the detailed log)
    rows = _export(course)

    # The stale scenario: a later, unreadable resubmission (newer timestamp, as
    # `nbgrader collect` writes it); a plain autograde regrades only that one.
    _submit(course, "stale", text="not a notebook", timestamp="2024-01-02 10:00:00")
    second = nbgrader(course, "autograde", ASSIGNMENT)
    return course, rows, _export(course), first, second


@pytest.mark.parametrize("student", sorted(EXPECTED))
def test_grade(graded, student):
    rows = graded[1]
    assert student in rows, f"{student} is missing from grades.csv"
    assert float(rows[student]["score"]) == EXPECTED[student], rows[student]
    assert float(rows[student]["max_score"]) == 10


@pytest.mark.parametrize("student", sorted(NOTES))
def test_note_in_export(graded, student):
    assert NOTES[student] in graded[1][student]["notes"], graded[1][student]


def test_correct_has_no_note(graded):
    assert graded[1]["correct"]["notes"] == ""


@pytest.mark.parametrize("student", ["invalid_json", "renamed_notebook", "deleted_test_cell",
                                     "duplicated_test_cell", "stripped_metadata"])
def test_log_names_the_student(graded, student):
    log = graded[3].stderr
    assert any(f"student '{student}'" in line for line in log.splitlines()), log[-3000:]


def test_missing_notebook_in_log(graded):
    assert "submitted/missing_notebook/softmax" in graded[3].stderr


def test_unreadable_feedback_says_why(graded):
    nb = nbformat.read(graded[0] / "autograded" / "invalid_json" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    assert "not a readable notebook" in nb.cells[0].source


def test_no_stale_score(graded):
    before, after = graded[1], graded[2]
    assert float(before["stale"]["score"]) == 10
    assert float(after["stale"]["score"]) == 0, after["stale"]
    assert "not a readable notebook" in after["stale"]["notes"]
    # the others were left as they were
    assert {s: r["score"] for s, r in after.items() if s != "stale"} == \
        {s: r["score"] for s, r in before.items() if s != "stale"}


def test_a_course_folder_with_another_copy_of_the_package_is_a_setup_error(tmp_path):
    """A course folder whose firstprinciples/ is not the installed copy (copied elsewhere, or the
    package installed from another clone) stops every grading command before it grades anything,
    saying why: no student scores 0 for it, whatever the order of grading."""
    import shutil

    from course import ROOT, make_course, nbgrader

    course = make_course(tmp_path)
    shutil.copytree(ROOT / "firstprinciples", course / "firstprinciples",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    result = nbgrader(course, "generate_assignment", "softmax", "--force", check=False)
    assert result.returncode != 0
    assert "grading setup error" in result.stdout + result.stderr
    assert not (course / "exercises").exists() and not (course / "gradebook.db").exists()


def test_a_submission_whose_grading_failed_keeps_no_earlier_score(graded, tmp_path):
    """nbgrader removes a submission's autograded folder when grading it fails (a crash on the
    grader's side): the export then gives it 0 with a note, never the score an earlier run left in
    the gradebook."""
    import shutil

    course = tmp_path / "course"
    shutil.copytree(graded[0], course, ignore=shutil.ignore_patterns("tmp"))
    assert float(_export(course)["correct"]["score"]) == 10
    shutil.rmtree(course / "autograded" / "correct" / ASSIGNMENT)  # what nbgrader's failure handler does
    row = _export(course)["correct"]
    assert float(row["score"]) == 0 and "not graded: the grader stopped on this submission" in row["notes"], row
    assert float(_export(course)["renamed_notebook"]["score"]) == 10  # (the others are untouched)


def test_the_grading_summary_names_each_kind_and_its_students():
    """A kernel death, a cell Python cannot read and an untouched answer are each called what they
    are (they counted as "repaired"), and each entry names the student and the assignment."""
    from firstprinciples.grading import gradelog

    results = [
        {"student": "ada", "assignment": "softmax", "score": 0, "max_score": 10,
         "notes": ["test_dims: the kernel died (it crashed, exited, or went over the memory or CPU limit)"]},
        {"student": "bob", "assignment": "qkv", "score": 0, "max_score": 12,
         "notes": ["syntax error in softmax, line 3: '(' was never closed", "unanswered: softmax (still as released)"]},
        {"student": "cy", "assignment": "softmax", "score": 10, "max_score": 10,
         "notes": ["missing cells put back from the source: test_dims"]},
        # as the log has them (gradelog.notes_of): after the notebook's name
        {"student": "di", "assignment": "softmax", "score": 0, "max_score": 10,
         "notes": ["softmax: unanswered: softmax (still as released)"]},
        {"student": "ed", "assignment": "softmax", "score": 0, "max_score": 10,
         "notes": ["softmax: forbidden call: softmax: it calls torch.softmax (cell 'softmax', line 4), a built-in "
                   "that this piece must not use (you are asked to write it yourself)"]},
        {"student": "fay", "assignment": "qkv", "score": 0, "max_score": 12,
         "notes": ["queries_keys_values: syntax error in qkv, line 2: incomplete input"]},
    ]
    text = gradelog.summary(results, 6)
    rows = {line.split("  ")[1].strip(): line for line in text.splitlines()[1:]}
    assert "ada (softmax)" in rows["kernel died"] and "bob (qkv)" in rows["unreadable cell"]
    assert "bob (qkv)" in rows["unanswered"] and rows["repaired"].split()[-2:] == ["cy", "(softmax)"]
    assert "di (softmax)" in rows["unanswered"] and "fay (qkv)" in rows["unreadable cell"], text
    assert "ed (softmax)" in rows["forbidden call"], text
