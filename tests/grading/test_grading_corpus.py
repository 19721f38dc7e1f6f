"""Trust in the grade, both ways, graded by the plain `nbgrader autograde` and the repo's config.

- ``tests/corpus/honest.py``: honest but unusual correct answers for every
  assignment (setattr-built layers, magics, warnings, self-tests that call the
  built-in, helpers in added cells, einsum, dataclasses, a loop variable named
  ``input``, ...): each must get full marks, with no flag.
- ``tests/corpus/attacks.py``: attacks by a student who read the grading code:
  each must get the score it lists, with the reason in the feedback (and the flag in
  grades.csv where it lists one).

Besides scores, the files: the secret inputs of the re-check appear in no autograded
notebook and no feedback file; an output bomb is capped in the autograded notebook
whatever kind of output it uses; kernels of different students share no writable
folder and leave nothing on the host.
"""
from __future__ import annotations

import csv
import html
import json
import sys
from pathlib import Path

import nbformat
import pytest

from course import SOLUTIONS, fill, make_course, nbgrader, nbgrader_meta, scratch, solution_answers

sys.path.insert(0, str(Path(__file__).parents[1]))  # (tests/: the corpus)
from corpus.attacks import ATTACKS  # noqa: E402
from corpus.honest import HONEST  # noqa: E402

SOFTMAX_CORRECT = '''
import torch

def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)
'''
# submissions that test what the grading leaves in files (softmax, correct answers)
FILES = [
    # every kind of output nbgrader stores, far past the cap: text, an error's message, display
    # metadata, and display updates that rewrite an earlier output
    {"id": "files_output_bomb", "assignment": "softmax", "answers": {"softmax": SOFTMAX_CORRECT}, "extra": [
        ("after:try_it_code", "print('x' * 3_000_000)\n"),
        ("after:try_it_code", "from IPython.display import display\n"
                              "display({'text/plain': 'y'}, raw=True, metadata={'m': 'z' * 3_000_000})\n"),
        ("after:try_it_code", "from IPython.display import display, update_display\n"
                              "display('first', display_id='d')\nfor i in range(300):\n"
                              "    update_display('w' * 20_000, display_id='d')\n"),
        ("after:try_it_code", "try:\n    raise ValueError('v' * 3_000_000)\nexcept ValueError:\n    pass\n"
                              "raise ValueError('e' * 3_000_000)\n"),
    ]},
    # 100 added cells, each just under the per-cell cap: the notebook's own cap holds (20 MB before)
    {"id": "files_many_cells_bomb", "assignment": "softmax", "answers": {"softmax": SOFTMAX_CORRECT},
     "extra": [("after:try_it_code", "print('m' * 190_000)\n")] * 100},
    # an added cell nested 100,000 deep: it fails in the kernel; the notebook is graded
    {"id": "files_deep_expression", "assignment": "softmax", "answers": {"softmax": SOFTMAX_CORRECT},
     "extra": [("after:try_it_code", "x = " + "+".join(["1"] * 100_000) + "\n")]},
] + [
    # each leaves a file where its kernel may write, and lists what it can see there
    {"id": f"files_snoop_{i}", "assignment": "softmax", "answers": {"softmax": SOFTMAX_CORRECT}, "extra": [
        ("after:try_it_code", f'''
import glob, json, os, sys
conn = sys.argv[sys.argv.index("-f") + 1]
folder = os.path.dirname(json.load(open(conn))["ip"])
print("SEEN:", sorted(os.path.basename(p) for p in glob.glob(os.path.join(os.path.dirname(folder), "**"), recursive=True)),
      flush=True)
import time; time.sleep(0.5)  # (the output reaches the notebook before the write below, which kills the kernel)
for where in (folder, os.path.dirname(folder)):
    try:
        with open(os.path.join(where, "left-by-snoop-{i}"), "w") as f:
            f.write("hello")
    except OSError:
        pass
time.sleep(10)  # (the grader stops the kernel at the write: in this cell, however busy the machine is)
''')]} for i in range(3)
] + [
    # a loop of files into the one host folder the kernel can write to (its sockets' folder): each
    # file is capped in size, not in number; the grader kills the kernel at the first one
    {"id": "files_socket_folder_flood", "assignment": "softmax", "answers": {"softmax": SOFTMAX_CORRECT}, "extra": [
        ("after:try_it_code", '''
import json, os, sys
folder = os.path.dirname(json.load(open(sys.argv[sys.argv.index("-f") + 1]))["ip"])
for i in range(400):
    with open(os.path.join(folder, f"flood-{i}"), "wb") as f:
        f.write(b"x" * 2**20)
print("FLOOD DONE")
''')]},
]
ENTRIES = {e["id"]: e for e in HONEST + ATTACKS + FILES}
assert len(ENTRIES) == len(HONEST) + len(ATTACKS) + len(FILES), "duplicate ids in the corpora"


def build(release, source_nb, entry):
    nb = fill(release, {**solution_answers(source_nb), **entry["answers"]})
    for where, source in entry["extra"]:
        cell = nbformat.v4.new_code_cell(source)
        if where == "end":
            nb.cells.append(cell)
            continue
        gid = where.split(":", 1)[1]
        at = next(i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == gid)
        while at + 1 < len(nb.cells) and nb.cells[at + 1].get("metadata", {}).get("fp_added"):
            at += 1  # several cells after the same one keep their order
        cell.metadata["fp_added"] = True
        nb.cells.insert(at + 1, cell)
    return nb


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("corpus"))
    by_assignment: dict = {}
    for entry in ENTRIES.values():
        by_assignment.setdefault(entry["assignment"], []).append(entry)
    notebooks = {}
    nbgrader(course, "generate_assignment", "*", "--force")  # every assignment, one command
    for assignment, entries in sorted(by_assignment.items()):
        (release_path,) = (course / "exercises" / assignment).glob("*.ipynb")
        release = nbformat.read(release_path, as_version=4)
        source_nb = nbformat.read(SOLUTIONS / assignment / release_path.name, as_version=4)
        notebooks[assignment] = (release_path.stem, source_nb)
        for entry in entries:
            target = course / "submitted" / entry["id"] / assignment
            target.mkdir(parents=True)
            nbformat.write(build(release, source_nb, entry), target / release_path.name)
    nbgrader(course, "autograde", "*", timeout=3000)  # the whole corpus in one run, shared by its workers
    nbgrader(course, "generate_feedback", "*", timeout=900)
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)
                if r["assignment"] == ENTRIES.get(r["student_id"], {}).get("assignment")}
    return course, rows, notebooks


def _autograded(graded, entry):
    course, _, notebooks = graded
    stem = notebooks[entry["assignment"]][0]
    return nbformat.read(course / "autograded" / entry["id"] / entry["assignment"] / f"{stem}.ipynb", as_version=4)


def _feedback(graded, entry) -> str:
    course, _, notebooks = graded
    stem = notebooks[entry["assignment"]][0]
    return (course / "feedback" / entry["id"] / entry["assignment"] / f"{stem}.html").read_text()


def _max(graded, entry) -> float:
    source_nb = graded[2][entry["assignment"]][1]
    return sum(float(nbgrader_meta(c).get("points", 0)) for c in source_nb.cells if nbgrader_meta(c).get("grade"))


def _cell_scores(nb) -> dict:
    from nbgrader.utils import determine_grade

    return {nbgrader_meta(c)["grade_id"]: determine_grade(c)[0] for c in nb.cells
            if nbgrader_meta(c).get("grade") and c.cell_type == "code"}


@pytest.mark.parametrize("student", [e["id"] for e in HONEST])
def test_honest_answer_gets_full_marks(graded, student):
    entry = ENTRIES[student]
    row = graded[1][student]
    scores = _cell_scores(_autograded(graded, entry))
    lost = {g: s for g, s in scores.items() if s == 0}
    assert float(row["score"]) == _max(graded, entry), f"{student}: {row['score']}/{_max(graded, entry)}, lost {lost}"
    assert "FLAGGED" not in row.get("notes", ""), row["notes"]


@pytest.mark.parametrize("student", [e["id"] for e in ATTACKS])
def test_attack_loses_its_points_with_the_reason(graded, student):
    entry = ENTRIES[student]
    row = graded[1][student]
    nb = _autograded(graded, entry)
    if entry["score"] is None:  # the attacked piece's cells score 0, the other pieces keep theirs
        from firstprinciples.grading import probes, trusted

        (piece,) = entry["answers"]
        graded_names = trusted.grade_cell_names(nb, probes.load())
        scores = _cell_scores(nb)
        using = {nbgrader_meta(nb.cells[i])["grade_id"] for i, names in graded_names.items() if piece in names}
        assert using and all(scores[g] == 0 for g in using), f"{student}: {scores}"
        assert float(row["score"]) < _max(graded, entry)
    else:
        assert float(row["score"]) == entry["score"], f"{student}: {row['score']}, cells {_cell_scores(nb)}"
    errors = " ".join(str(o.get("evalue", "")) for c in nb.cells if nbgrader_meta(c).get("grade")
                      for o in c.get("outputs", []) if o.get("output_type") == "error")
    if entry["reason"] is None:  # a route the threat model says can only be flagged: it keeps its points
        assert entry.get("flag"), f"{student}: an attack that keeps its points must be flagged"
    else:
        assert entry["reason"] in errors, errors[:3000]
        assert entry["reason"] in html.unescape(_feedback(graded, entry))
    if entry.get("flag"):
        assert entry["flag"] in row["notes"] and "FLAGGED" in row["notes"], row["notes"]


def test_every_corpus_student_is_graded(graded):
    assert set(graded[1]) == set(ENTRIES)


def test_enough_cases_in_both_corpora():
    assert len(HONEST) >= 30 and len(ATTACKS) >= 30
    assert {e["assignment"] for e in HONEST} == {p.name for p in SOLUTIONS.iterdir() if list(p.glob("*.ipynb"))}


def _secret_case_bytes(course, student, assignment, notebook) -> list[str]:
    """The base64 data of the re-check's secret inputs for this student (what must not leak)."""
    from firstprinciples.grading import probes, trusted

    nb = nbformat.read(course / "autograded" / student / assignment / f"{notebook}.ipynb", as_version=4)
    seed = trusted.seed_for({"nbgrader": {"assignment": assignment, "student": student, "notebook": notebook}}, course)
    plan = trusted.make_plan(nb, seed)
    out = []
    for check in plan.checks:
        for case in check.cases:
            for value in case.values():
                if isinstance(value, dict) and value.get("data") and len(value["data"]) >= 24:
                    out.append(value["data"][:24])
    return out


def test_secret_inputs_appear_in_no_file(graded):
    course = graded[0]
    for student in ("files_snoop_0", "atk_rebinds_checks_class", HONEST[0]["id"], "atk_leaks_inputs_in_error"):
        entry = ENTRIES[student]
        stem = graded[2][entry["assignment"]][0]
        secrets = _secret_case_bytes(course, student, entry["assignment"], stem)
        assert secrets, "the secret cases were not found"
        texts = [json.dumps(nbformat.read(course / "autograded" / student / entry["assignment"] / f"{stem}.ipynb",
                                          as_version=4)), _feedback(graded, entry)]
        for text in texts:
            assert not any(s in text for s in secrets), f"{student}: a secret input leaked"


def test_no_text_the_grader_writes_grows_with_the_students_names(graded):
    """Three torch attributes with 4 MB names, each named in the grader's flags: the autograded
    notebook, the feedback and the student's grades.csv row stay small."""
    course, rows, _ = graded
    entry = ENTRIES["atk_huge_names"]
    stem = graded[2]["softmax"][0]
    notebook = course / "autograded" / entry["id"] / "softmax" / f"{stem}.ipynb"
    assert notebook.stat().st_size < 300_000, f"{notebook.stat().st_size:,} bytes"
    assert len(_feedback(graded, entry)) < 300_000
    assert len(rows[entry["id"]]["notes"]) <= 2_000, len(rows[entry["id"]]["notes"])
    assert "characters cut" in rows[entry["id"]]["notes"]
    assert max(len(line) for line in (course / "grades.csv").read_text().splitlines()) < 5_000


def test_a_notebooks_output_is_capped_in_all(graded):
    """100 cells each just under the per-cell cap: the notebook keeps at most the notebook's cap
    (2,000,000 characters for the cells that are not graded tests) and says where it cut; the
    graded tests keep their verdicts."""
    course = graded[0]
    path = course / "autograded" / "files_many_cells_bomb" / "softmax" / "softmax.ipynb"
    assert path.stat().st_size < 3_000_000, f"{path.stat().st_size:,} bytes"
    assert "printed more than 2,000,000 characters in all" in path.read_text()
    assert float(graded[1]["files_many_cells_bomb"]["score"]) == 10
    assert len(_feedback(graded, ENTRIES["files_many_cells_bomb"])) < 4_000_000


def test_a_cell_too_deep_to_parse_is_graded_around(graded):
    assert float(graded[1]["files_deep_expression"]["score"]) == 10, graded[1]["files_deep_expression"]


def test_output_of_every_kind_is_capped(graded):
    course = graded[0]
    path = course / "autograded" / "files_output_bomb" / "softmax" / "softmax.ipynb"
    size = path.stat().st_size
    assert size < 2_000_000, f"{size:,} bytes"  # the cap is 200,000 characters per cell, 4 bomb cells
    assert float(graded[1]["files_output_bomb"]["score"]) == 10


def test_a_kernel_that_writes_into_its_socket_folder_is_stopped(graded):
    """The socket folder is writable to the kernel for its sockets only: the grader, watching it
    from outside, kills the kernel at its first file (the flood never finishes), removes what it
    wrote, says why in the notes, and grades the rest of the notebook in a fresh kernel."""
    course = graded[0]
    entry = ENTRIES["files_socket_folder_flood"]
    nb = _autograded(graded, entry)
    text = " ".join(str(o.get("text", "")) for c in nb.cells for o in c.get("outputs", []))
    assert "FLOOD DONE" not in text
    row = graded[1][entry["id"]]
    assert float(row["score"]) == 10
    assert "folder the grader keeps for its sockets" in row["notes"], row["notes"]
    assert not [p for p in scratch(course).rglob("flood-*")]


def test_kernels_share_no_writable_folder_and_leave_nothing(graded):
    course = graded[0]
    for i in range(3):
        nb = _autograded(graded, ENTRIES[f"files_snoop_{i}"])
        seen = " ".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if "SEEN:" in o.get("text", ""))
        assert "SEEN:" in seen, "the snooping cell did not run"
        others = [f"left-by-snoop-{j}" for j in range(3) if j != i]
        assert not any(o in seen for o in others), seen
        assert float(graded[1][f"files_snoop_{i}"]["score"]) == 10
    left = [p for p in scratch(course).rglob("*") if "left-by-snoop" in p.name]
    assert not left, left
    assert not list(scratch(course).glob("fp-grade-*")), "socket folders left behind"
