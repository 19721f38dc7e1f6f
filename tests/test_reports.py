"""The class reports (``python -m firstprinciples.grading.reports``) on a simulated softmax class.

The class, graded once with the plain nbgrader commands and the repo's config (plus a
late policy of 20 % per started day, read from docs/instructors/reports.md):

- ``correct``: the solution's code; ``indep``: another short correct answer, written
  independently (both must NOT be flagged: a three-line softmax is the reference's
  token stream, too short to tell);
- ``noshift_a``, ``noshift_b``: the naive ``exp(x) / sum(exp(x))`` in two spellings
  (overflow on large inputs: one reason, two students);
- ``wrongdim``: ``dim`` ignored, always the last axis;
- ``twin_a``, ``twin_b``: the same long, unusual answer, renamed and reformatted
  (must be flagged as a pair);
- ``pastes_ref``: the course's reference module pasted (must be flagged against
  ``firstprinciples/reference/attention.py``);
- ``late``: the solution's code, submitted 1.5 days late (penalty 40 % in lms.csv);
- ``broken``: graded, then its autograded and submitted notebooks became unreadable
  (reported, never a crash);
- ``absent``: in the gradebook, no submission (0 in lms.csv).
"""
from __future__ import annotations

import csv
import datetime
import os
import subprocess
import sys
import time

import nbformat
import pytest

import docpages
from course import SOLUTIONS, make_course, nbgrader
from test_instructor_roundtrip import fill, solution_answers

STUB_HEAD = '''def softmax(x, dim=-1):
    """Softmax of x along dim."""
'''
INDEP = '''import torch

def softmax(x, dim=-1):
    m = x.max(dim=dim, keepdim=True).values
    return torch.exp(x - m) / torch.exp(x - m).sum(dim, keepdim=True)
'''
NOSHIFT_A = STUB_HEAD + "    return torch.exp(x) / torch.exp(x).sum(dim=dim, keepdim=True)\n"
NOSHIFT_B = '''def softmax(x, dim=-1):
    num = torch.exp(x)
    den = torch.sum(num, dim=dim, keepdim=True)
    return num / den
'''
WRONGDIM = STUB_HEAD + '''    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)
'''
TWIN_A = '''def softmax(x, dim=-1):
    """Row by row: move the axis last, then one slice at a time."""
    moved = x.movedim(dim, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    rows = []
    for row in flat:
        finite = torch.isfinite(row)
        top = row[finite].max() if finite.any() else row.new_tensor(0.0)
        ex = torch.where(finite, torch.exp(row - top), torch.zeros_like(row))
        rows.append(ex / ex.sum())
    out = torch.stack(rows).reshape(moved.shape)
    return out.movedim(-1, dim)
'''
TWIN_B = '''def softmax(x,dim=-1):
    t = x.movedim(dim,-1)   # the axis goes last
    f = t.reshape(-1,t.shape[-1])
    acc = []
    for r in f:
        ok = torch.isfinite(r)
        big = r[ok].max() if ok.any() else r.new_tensor(0.0)
        w = torch.where(ok, torch.exp(r-big), torch.zeros_like(r))
        acc.append(w/w.sum())
    res = torch.stack(acc).reshape(t.shape)
    return res.movedim(-1,dim)
'''
# The late policy the class is graded with: docs/instructors/reports.md's, as written there
# (20 % of the score per started day late).
LATE_POLICY = "\n" + docpages.code_blocks(docpages.section("## A late policy"), "python")[0]
DUE = datetime.datetime(2030, 1, 1)


def pasted_reference() -> str:
    """The course's reference module, pasted without its decorators and imports."""
    import firstprinciples.reference.attention as attention

    lines = open(attention.__file__).read().splitlines()
    return "\n".join(l for l in lines if not l.startswith(("@reference_piece", "from ..", "from __future__")))


def students(solution: str) -> dict:
    return {"correct": solution, "indep": INDEP, "noshift_a": NOSHIFT_A, "noshift_b": NOSHIFT_B,
            "wrongdim": WRONGDIM, "twin_a": TWIN_A, "twin_b": TWIN_B, "pastes_ref": pasted_reference(),
            "late": solution, "broken": NOSHIFT_A}


def run_reports(course, *args, assignment="softmax", ok=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBGRADER", "FP_GRADEBOOK"))}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "firstprinciples.grading.reports", assignment,
                           "--course", str(course), *args], capture_output=True, text=True, env=env, timeout=300)
    assert (proc.returncode == 0) is ok, proc.stdout + proc.stderr
    return proc, time.monotonic() - started


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    from nbgrader.api import Gradebook

    course = make_course(tmp_path_factory.mktemp("reports"))
    with open(course / "nbgrader_config.py", "a") as f:
        f.write(LATE_POLICY)
    nbgrader(course, "generate_assignment", "softmax", "--force")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        gb.update_or_create_assignment("softmax", duedate=DUE)
        gb.update_or_create_student("absent", first_name="Ab", last_name="Sent")
    release = nbformat.read(course / "exercises" / "softmax" / "softmax.ipynb", as_version=4)
    solution = solution_answers(nbformat.read(SOLUTIONS / "softmax" / "softmax.ipynb", as_version=4))["softmax"]
    for student, answer in students(solution).items():
        target = course / "submitted" / student / "softmax"
        target.mkdir(parents=True)
        nbformat.write(fill(release, {"softmax": answer}), target / "softmax.ipynb")
        stamp = DUE + (datetime.timedelta(days=1.5) if student == "late" else -datetime.timedelta(hours=1))
        (target / "timestamp.txt").write_text(stamp.strftime("%Y-%m-%d %H:%M:%S.%f UTC"))
    nbgrader(course, "autograde", "softmax", timeout=1800)
    for folder in ("autograded", "submitted"):
        (course / folder / "broken" / "softmax" / "softmax.ipynb").write_text("{ not a notebook")
    proc, seconds = run_reports(course)
    out = course / "reports"

    def rows(name):
        with open(out / name, newline="") as f:
            return list(csv.DictReader(f))

    return {"course": course, "stdout": proc.stdout, "seconds": seconds, "tests": rows("softmax-tests.csv"),
            "lms": rows("lms.csv"), "per_test": rows("per-test.csv"), "similarity": rows("softmax-similarity.csv"),
            "md": (out / "softmax-tests.md").read_text()}


def test_per_test_table_counts_and_reasons(graded):
    tests = {r["grade_id"]: r for r in graded["tests"]}
    assert list(tests) == ["test_worked_example", "test_large_inputs", "test_minus_inf", "test_dims",
                           "test_gradients_and_inputs"], "one row per graded test cell, in notebook order"
    assert all(r["points"] == "2" and r["graded"] == "10" for r in tests.values())
    assert tests["test_worked_example"]["failed"] == "0" and tests["test_worked_example"]["top_reason"] == ""
    # the hidden tests and the re-check use other dims: wrongdim fails all but the worked example;
    # noshift_a, noshift_b and broken overflow (NaN) on large entries, -inf entries and their gradients
    for gid in ("test_large_inputs", "test_minus_inf", "test_gradients_and_inputs"):
        row = tests[gid]
        assert row["failed"] == "4", row
        assert row["top_reason_count"] == "2", f"the two naive spellings give one reason: {row}"
        assert row["top_reason"].startswith("trusted re-check: softmax: on float") or "gradient" in row["top_reason"]
        assert "NaN" in row["top_reason"] and not any(ch.isdigit() for ch in row["top_reason"].replace("float32", ""))
        assert row["other_reasons"] == "2", "wrongdim's reason, and broken's unreadable notebook"
        assert (row["top_mistake"], row["top_mistake_count"]) == ("no max subtracted", "2"), row
    assert tests["test_dims"]["failed"] == "1" and tests["test_dims"]["top_reason_count"] == "1"
    assert tests["test_dims"]["top_mistake"] == "dim ignored"
    assert "differs from the reference" in tests["test_dims"]["top_reason"]
    assert "broken: autograded notebook softmax.ipynb unreadable" in graded["md"]


def test_lms_export_applies_the_late_penalty(graded):
    lms = {r["student_id"]: r for r in graded["lms"]}
    assert set(lms) == set(students("")) | {"absent"}, "one row per student of the gradebook"
    assert list(graded["lms"][0]) == ["student_id", "last_name", "first_name", "email", "softmax", "total"]
    assert lms["correct"]["softmax"] == "10" and lms["correct"]["total"] == "10"
    assert lms["late"]["softmax"] == "6", "1.5 days late: two started days, 40 % off"
    assert lms["absent"]["softmax"] == "0" and lms["absent"]["first_name"] == "Ab"


def test_per_test_csv(graded):
    rows = graded["per_test"]
    assert len(rows) == 10 * 5, "10 graded students x 5 test cells"
    mine = {r["grade_id"]: (r["score"], r["max_score"]) for r in rows if r["student_id"] == "wrongdim"}
    assert mine["test_dims"] == ("0", "2") and mine["test_worked_example"] == ("2", "2")
    late = {r["grade_id"]: r["score"] for r in rows if r["student_id"] == "late"}
    assert set(late.values()) == {"2"}, "per-test scores are before the (per-notebook) late penalty"


def test_similarity_flags_copies_not_independent_answers(graded):
    pairs = {(r["student"], r["other"]): r for r in graded["similarity"]}
    assert set(pairs) == {("twin_a", "twin_b"), ("pastes_ref", "reference:firstprinciples/reference/attention.py")}
    assert all(r["grade_id"] == "softmax" and float(r["score"]) >= 0.8 and int(r["matched"]) >= 100
               for r in pairs.values())
    assert "softmax: 9 answers, 2 pairs listed, 3 alike but too short to judge" in graded["stdout"]
    assert "not compared: broken: softmax.ipynb unreadable" in graded["stdout"]


def test_similarity_minimum_size_is_what_spares_short_answers(graded, tmp_path):
    """Without the minimum size, the solution's three lines (correct, late) match the reference;
    the independent short answer stays below the threshold even then."""
    proc, _ = run_reports(graded["course"], "--out", str(tmp_path), "--min-size", "0")
    with open(tmp_path / "softmax-similarity.csv", newline="") as f:
        pairs = {(r["student"], r["other"]) for r in csv.DictReader(f)}
    assert ("correct", "solution:solutions/softmax/softmax.ipynb") in pairs
    assert ("correct", "late") in pairs
    assert not {p for p in pairs if "indep" in p}, pairs
    assert not {p for p in pairs if "noshift_a" in p and "noshift_b" in p}


def test_reports_are_fast(graded):
    assert graded["seconds"] < 30, graded["seconds"]


def test_reasons_are_normalised(tmp_path):
    from firstprinciples.grading.reports import cell_reason, normalise_reason, read_notebook

    recheck = ("The trusted re-check (run by the grader outside your notebook, on new inputs) failed: softmax: "
               "on a float64 input of shape ({}) along dim {}: output differs from the reference by up to {} "
               "(allowed: 1e-10 + 1e-08·|reference|). This test scores 0.")
    one, two = normalise_reason(recheck.format("3, 5", -2, 0.913)), normalise_reason(recheck.format("2, 3, 4", 1, 7))
    assert one == two == ("trusted re-check: softmax: on a float64 input of shape (#) along dim #: output differs "
                          "from the reference by up to # (allowed: # + #·|reference|)")
    tensors = "got tensor([[0.1, 0.2], [0.3, 0.4]]) for {} rows, expected tensor([0.5, 0.5, 0.25])"
    assert normalise_reason(tensors.format(2)) == normalise_reason(tensors.format(17)) == \
        "got tensor([#]) for # rows, expected tensor([#])"
    assert "\x1b" not in normalise_reason("\x1b[0;31mAssertionError\x1b[0m: x")
    cell = nbformat.v4.new_code_cell("check()", outputs=[
        nbformat.v4.new_output("error", ename="AssertionError", evalue="wrong by 0.5\nYour output matches a "
                               "typical mistake:\n  - dim ignored: the sum runs along the last axis", traceback=[])])
    assert cell_reason(cell) == ("wrong by # Your output matches a typical mistake: - dim ignored: the sum runs "
                                 "along the last axis", "dim ignored")
    assert read_notebook(tmp_path / "nope.ipynb") == (None, "missing")



def test_reports_take_a_pattern_as_autograde_does(graded, tmp_path):
    """``"*"`` (every assignment of the gradebook), as ``nbgrader autograde "*"`` takes it; a
    pattern that names nothing is refused with the reason."""
    course = graded["course"]
    out = tmp_path / "all"
    proc, _ = run_reports(course, "--out", str(out), assignment="*")
    assert (out / "softmax-tests.csv").exists() and (out / "lms.csv").exists(), proc.stdout
    assert "wrote softmax-tests.csv" in proc.stdout
    proc, _ = run_reports(course, "--out", str(tmp_path / "none"), assignment="nothing*", ok=False)
    assert "no assignment 'nothing*'" in proc.stderr
