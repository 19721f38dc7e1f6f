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
  (must be one cluster);
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
import re
import subprocess
import sys
import time

import nbformat
import pytest

import docpages
from course import SOLUTIONS, fill, make_course, nbgrader, solution_answers

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
            "pairs": rows("softmax-similarity-pairs.csv"), "md": (out / "softmax-tests.md").read_text()}


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
        assert row["top_reason"].startswith("trusted re-check: softmax: softmax(x) for a float") or "gradient" in row["top_reason"]
        assert "NaN" in row["top_reason"] and not any(ch.isdigit() for ch in row["top_reason"].replace("float32", ""))
        assert row["other_reasons"] == "2", "wrongdim's reason, and broken's unreadable notebook"
        assert (row["top_mistake"], row["top_mistake_count"]) == ("no max subtracted", "2"), row
    assert tests["test_dims"]["failed"] == "1" and tests["test_dims"]["top_reason_count"] == "1"
    assert tests["test_dims"]["top_mistake"] == "dim ignored"
    assert "it sums to # along dim # instead" in tests["test_dims"]["top_reason"]
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
    clusters = {r["students"]: r for r in graded["similarity"]}
    assert set(clusters) == {"twin_a twin_b", "pastes_ref"}, clusters
    twins, pasted = clusters["twin_a twin_b"], clusters["pastes_ref"]
    assert (twins["size"], twins["around"], twins["source"]) == ("2", "twin_a", "")
    assert pasted["around"] == pasted["source"] == "reference:firstprinciples/reference/attention.py"
    assert all(r["grade_id"] == "softmax" and float(r["alike_min"]) >= 0.8 for r in clusters.values())
    assert (twins["grade_min"], twins["grade_max"], twins["max_score"]) == ("10", "10", "10")
    pairs = {(r["students"], r["other"]): r for r in graded["pairs"]}
    assert set(pairs) == {("twin_a", "twin_b"), ("pastes_ref", "reference:firstprinciples/reference/attention.py")}
    assert all(int(r["matched"]) >= 100 for r in pairs.values())
    out = graded["stdout"]
    assert "softmax: 9 answers (8 distinct), 2 clusters of 3 students, 2 alike but too short to judge" in out, out
    assert "softmax  cluster 1: 2 students around twin_a  alike 0.92  grades 10 / 10: twin_a, twin_b" in out, out
    assert "not compared: broken: softmax.ipynb unreadable" in out


def test_similarity_minimum_size_is_what_spares_short_answers(graded, tmp_path):
    """Without the minimum size, the solution's three lines (correct, late: the same answer) join
    the course's code; the independent short answer stays below the threshold even then."""
    proc, _ = run_reports(graded["course"], "--out", str(tmp_path), "--min-size", "0")
    with open(tmp_path / "softmax-similarity.csv", newline="") as f:
        clusters = {r["students"]: r for r in csv.DictReader(f)}
    with open(tmp_path / "softmax-similarity-pairs.csv", newline="") as f:
        pairs = {(r["students"], r["other"]) for r in csv.DictReader(f)}
    copied = next(r for students, r in clusters.items() if "correct" in students.split())
    assert {"correct", "late"} <= set(copied["students"].split())
    assert "solution:solutions/softmax/softmax.ipynb" in copied["source"]
    assert ("correct late", "(each other)") in pairs and ("correct late", "solution:solutions/softmax/softmax.ipynb") in pairs
    assert not any("indep" in students.split() for students in clusters), clusters
    assert not any({"noshift_a", "noshift_b"} <= set(students.split()) for students in clusters)


def _leaked_class(n: int, seed: int = 0) -> dict:
    """n students: one in two hands in a leaked long answer (as is, renamed, re-commented, or
    with a line added), the others a short honest softmax of their own (different forms)."""
    import random

    rng = random.Random(seed)
    honest = ["m = {x}.amax(dim=dim, keepdim=True)", "m = {x}.max(dim=dim, keepdim=True).values"]
    norm = ["return e / e.sum(dim=dim, keepdim=True)", "return e / torch.sum(e, dim=dim, keepdim=True)"]
    out = {}
    for i in range(n):
        if rng.random() < 0.5:
            code = TWIN_A
            roll = rng.random()
            if roll < 0.3:  # renamed: the same answer once normalised
                for a, b in (("moved", "t"), ("flat", "f"), ("rows", "acc"), ("top", "big")):
                    code = re.sub(rf"\b{a}\b", b, code)
            elif roll < 0.5:
                code = code.replace("    return out", "    out = out.contiguous()\n    return out")
        else:
            x = rng.choice(["x", "t", "s"])
            code = (f"def softmax({x}, dim=-1):\n    " + rng.choice(honest).format(x=x)
                    + f"\n    e = torch.exp({x} - m)\n    " + rng.choice(norm) + "\n")
        out[f"s{i:03d}"] = code
    return out


def test_a_leaked_solution_is_one_cluster_whatever_the_class_size():
    """Students who share one leaked answer are one cluster (not n^2/2 pairs), and the copies
    cost one comparison each answer: the comparisons do not grow with the class."""
    from firstprinciples.grading.reports import cluster_answers, reference_files

    refs = reference_files()
    found = {n: cluster_answers(_leaked_class(n), refs) for n in (30, 120)}
    for n, f in found.items():
        leakers = sorted(s for s, code in _leaked_class(n).items() if "reshape" in code)
        assert [c["students"] for c in f["clusters"]] == [leakers], (n, f["clusters"])
        assert f["clusters"][0]["alike"][1] == 1.0 and f["clusters"][0]["alike"][0] >= 0.8
        assert len(f["pairs"]) <= 3, f["pairs"]  # as is and renamed (one answer), a line added, and the two
        assert f["distinct"] <= 3 + 4, f["distinct"]  # three leaked forms, four honest ones
    assert found[120]["comparisons"] == found[30]["comparisons"], {n: f["comparisons"] for n, f in found.items()}
    # the clusters of students who are alike without the course's code: built around the most common answer
    twins = cluster_answers({"a": TWIN_A, "b": TWIN_B, "c": TWIN_A, "d": INDEP}, {})
    assert [(c["students"], c["around"], c["source"]) for c in twins["clusters"]] == [(["a", "b", "c"], "a", "")]


def test_the_printed_report_is_one_line_per_cluster(graded, tmp_path):
    """About 30 more students hand in twin_a's answer: still two printed clusters, not 500 pairs."""
    import shutil

    course = tmp_path / "course"
    shutil.copytree(graded["course"], course, ignore=shutil.ignore_patterns("reports"))
    release = nbformat.read(course / "exercises" / "softmax" / "softmax.ipynb", as_version=4)
    for student, code in _leaked_class(80, seed=3).items():
        if "reshape" in code:
            (course / "submitted" / student / "softmax").mkdir(parents=True)
            nbformat.write(fill(release, {"softmax": code}), course / "submitted" / student / "softmax" / "softmax.ipynb")
    leakers = len(list((course / "submitted").glob("s0*")))
    assert leakers >= 30, leakers
    proc, seconds = run_reports(course, "--out", str(tmp_path / "out"))
    lines = proc.stdout.split("similarity (alike:")[1].splitlines()
    clusters = [l for l in lines if re.search(r" cluster \d+: ", l)]
    assert len(clusters) == 2, lines
    big = next(l for l in clusters if "s0" in l)
    # built around the answer most of them handed in as is; twin_a and twin_b (graded) are in it
    assert re.search(rf"{leakers + 2} students around s0\d\d  alike 0\.8\d-1\.00  grades 10 / 10 \(2 graded\): ", big), big
    assert big.endswith(f"and {leakers + 2 - 12} more"), big
    with open(tmp_path / "out" / "softmax-similarity.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["size"] == str(leakers + 2))
    assert {"twin_a", "twin_b"} <= set(row["students"].split()) and row["graded"] == "2"
    with open(tmp_path / "out" / "softmax-similarity-pairs.csv", newline="") as f:
        # four forms of the leaked answer (as is or renamed, a line added, twin_a, twin_b): at most 6 pairs
        # between them, 2 rows of identical copies, and pastes_ref's, however many hand them in
        assert len(list(csv.DictReader(f))) <= 9


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
    """``"*"`` (every assignment of the gradebook), as ``nbgrader autograde "*"`` takes it: every
    report for every assignment, also one that nobody has submitted yet; a pattern that names
    nothing is refused with the reason."""
    import shutil

    from nbgrader.api import Gradebook

    course = tmp_path / "course"  # (a copy: the class's gradebook gets a second assignment)
    shutil.copytree(graded["course"], course, ignore=shutil.ignore_patterns("reports"))
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        gb.update_or_create_assignment("qkv")
    out = tmp_path / "all"
    proc, _ = run_reports(course, "--out", str(out), assignment="*")
    for assignment in ("softmax", "qkv"):
        for report in ("tests.csv", "tests.md", "similarity.csv", "similarity-pairs.csv"):
            assert (out / f"{assignment}-{report}").exists(), (assignment, report, proc.stdout)
        assert f"wrote {assignment}-tests.csv" in proc.stdout or f"; {assignment}-tests.csv" in proc.stdout
    with open(out / "lms.csv", newline="") as f:
        lms = list(csv.DictReader(f))
    assert {"softmax", "qkv"} <= set(lms[0]) and all(r["qkv"] == "0" for r in lms)
    assert (out / "per-test.csv").exists()
    proc, _ = run_reports(course, "--out", str(tmp_path / "none"), assignment="nothing*", ok=False)
    assert "no assignment 'nothing*'" in proc.stderr


def test_the_documented_commands_run_as_written(graded):
    """docs/instructors/reports.md's commands, run as written in the course folder (the default
    --course), "*" included."""
    import shlex

    page = docpages.section("# Instructors: class reports")
    commands = [shlex.split(line, comments=True) for line in docpages.code_blocks(page, "bash")[0].splitlines()]
    commands = [c for c in commands if c]
    assert [c[-1] for c in commands] == ["softmax", "*"], commands
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBGRADER", "FP_GRADEBOOK"))}
    for command in commands:
        assert command[:3] == ["python", "-m", "firstprinciples.grading.reports"], command
        proc = subprocess.run([sys.executable, *command[1:]], cwd=graded["course"], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "wrote softmax-tests.csv" in proc.stdout and "softmax-similarity-pairs.csv" in proc.stdout, proc.stdout
        assert (graded["course"] / "reports" / "softmax-similarity.csv").exists()
