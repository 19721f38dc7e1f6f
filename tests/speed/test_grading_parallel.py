"""`nbgrader autograde` grades in parallel, loses no write, keeps manual grades.

A grading round with the plain nbgrader commands and the repo's config
(``firstprinciples.grading.parallel``) on the `softmax` assignment (five tests
of 2 points: 10), with ``FP_GRADING_WORKERS=3`` so that three graders write the
SQLite gradebook at once (more workers than cores: the most contention).

Students, three of each kind (their grades are fixed by the course's checks):

==================  =====  ================================================
kind                grade  answer
==================  =====  ================================================
correct             10     the solution
detached            8      the solution on ``x.detach()``: no gradients
naive               4      ``exp(x) / sum``: overflows on large inputs
last_dim_only       2      ignores ``dim``
untouched           0      the release as downloaded
==================  =====  ================================================

plus ``threads`` (the solution, and prints how many threads torch got) and
``broken_dest``, whose ``autograded/broken_dest`` is a file, so grading that
student fails: the command must fail naming that student, and every other
student must still be graded.
"""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from course import SOLUTIONS, fill, make_course, nbgrader, scratch, solution_answers

ASSIGNMENT = NOTEBOOK = "softmax"
COURSE_ID = "transformers-from-first-principles"
WORKERS = 3

ANSWERS = {
    "detached": '''
def softmax(x, dim=-1):
    x = x.detach()
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)
''',
    "naive": '''
def softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)
''',
    "last_dim_only": '''
def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)
''',
}
GRADES = {"correct": 10, "detached": 8, "naive": 4, "last_dim_only": 2, "untouched": 0}
TEST_CELLS = 5


# ------------------------------------------------------------------ helpers
def answers_of(kind: str) -> dict | None:
    """The answer cells of a student of this kind (None: the untouched release)."""
    correct = solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4))
    if kind == "untouched":
        return None
    if kind == "correct":
        return correct
    return {**correct, "softmax": ANSWERS[kind]}


def submit(course: Path, student: str, answers: dict | None, assignment: str = ASSIGNMENT,
           notebook: str = NOTEBOOK) -> None:
    release = nbformat.read(course / "exercises" / assignment / f"{notebook}.ipynb", as_version=4)
    target = course / "submitted" / student / assignment
    target.mkdir(parents=True, exist_ok=True)
    nbformat.write(fill(release, answers or {}), target / f"{notebook}.ipynb")


def read_export(course: Path, env: dict | None = None) -> list[dict]:
    nbgrader(course, "export", env=env)
    with open(course / "grades.csv", newline="") as f:
        return list(csv.DictReader(f))


def class_of(kinds, per_kind: int) -> dict[str, int]:
    """Student id -> expected grade: ``per_kind`` students of each kind."""
    return {f"{kind}_{i}": GRADES[kind] for kind in kinds for i in range(per_kind)}


def db_url(course: Path) -> str:
    return f"sqlite:///{course / 'gradebook.db'}"


def unfinished(course: Path, assignment: str = ASSIGNMENT) -> list[str]:
    """Students whose autograded folder still has the marker of a grading in progress."""
    return sorted(p.parent.parent.name for p in (course / "autograded").glob(f"*/{assignment}/.fp-grading-incomplete"))


# ------------------------------------------------------------------ the round
@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("parallel"))
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    expected = class_of(GRADES, 3)
    for kind in GRADES:
        for i in range(3):
            submit(course, f"{kind}_{i}", answers_of(kind))
    threads = {**answers_of("correct")}
    threads["softmax"] += "\n\nprint('torch threads:', torch.get_num_threads())\n"
    submit(course, "threads", threads)
    expected["threads"] = 10
    submit(course, "broken_dest", answers_of("correct"))
    (course / "autograded").mkdir()
    (course / "autograded" / "broken_dest").write_text("a file where the student's folder should be")

    proc = nbgrader(course, "autograde", ASSIGNMENT, env={"FP_GRADING_WORKERS": str(WORKERS), "FP_GRADING_VERBOSE": "1"},
                        check=False, timeout=1800)
    rows = read_export(course)
    return course, expected, proc, rows


def test_every_grade_is_written_once(graded):
    _, expected, _, rows = graded
    students = [r["student_id"] for r in rows if r["student_id"] != "broken_dest"]
    assert sorted(students) == sorted(expected), "students missing or duplicated in grades.csv"
    got = {r["student_id"]: float(r["score"]) for r in rows}
    wrong = {s: (got[s], g) for s, g in expected.items() if got[s] != g}
    assert not wrong, f"(got, expected): {wrong}"


def test_every_test_cell_has_its_score_in_the_gradebook(graded):
    course, expected, _, _ = graded
    with Gradebook(db_url(course), COURSE_ID) as gb:
        for student in expected:
            submission = gb.find_submission(ASSIGNMENT, student)
            grades = submission.notebooks[0].grades
            assert len(grades) == TEST_CELLS
            assert all(g.auto_score is not None for g in grades), (student, [g.auto_score for g in grades])
            assert sum(g.auto_score for g in grades) == expected[student]


def test_graded_by_several_workers(graded):
    _, expected, proc, _ = graded
    log = proc.stderr
    assert f"Grading {len(expected) + 1} submissions with {WORKERS} workers" in log, log[-3000:]
    for w in range(1, WORKERS + 1):
        assert f"[grader {w}/{WORKERS}] " in log
    # each submission was graded by exactly one worker, once
    for student in expected:
        pattern = rf"^\[grader (\d)/{WORKERS}\] .*Autograding .*autograded/{student}/{ASSIGNMENT}/{NOTEBOOK}\.ipynb$"
        workers = re.findall(pattern, log, flags=re.MULTILINE)
        assert len(workers) == 1, (student, workers)


def test_a_failed_student_fails_the_command_and_only_that_student(graded):
    _, expected, proc, rows = graded
    assert proc.returncode == 1
    assert "Grading failed for: broken_dest (softmax)" in proc.stderr, proc.stderr[-3000:]
    assert all(s in {r["student_id"] for r in rows} for s in expected)


def test_workers_share_the_cores(graded):
    course = graded[0]
    nb = nbformat.read(course / "autograded" / "threads" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    text = "".join(str(o.get("text", "")) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    want = max(1, (os.cpu_count() or 1) // WORKERS)
    assert f"torch threads: {want}\n" in text, text[-500:]


@pytest.mark.parametrize("cores, gib, want", [
    (2, 24, 4),   # two a core: every worker's kernel and runner fit at their 3 GB cap
    (2, 23, 3),   # as many more as fit
    (2, 8, 2),    # never fewer than one a core (as before)
    (8, 16, 8),
    (8, 96, 16),  # never more than two a core
    (1, 0, 1),    # memory unknown
])
def test_default_workers_two_a_core_where_the_memory_holds_them(cores, gib, want, monkeypatch):
    from firstprinciples.grading import parallel, sandbox

    monkeypatch.setattr(sandbox, "MEMORY_MB", 3072)
    assert parallel.default_workers(cores, gib * 2**30) == want
    monkeypatch.delenv("FP_GRADING_WORKERS", raising=False)
    assert parallel.ParallelAutograde().workers == parallel.default_workers()
    monkeypatch.setenv("FP_GRADING_WORKERS", "5")
    assert parallel.ParallelAutograde().workers == 5


def test_nothing_left_in_progress(graded):
    course = graded[0]
    assert unfinished(course) == []
    assert not list((course / "autograded").glob("*/.fp-discarded-*"))
    # each nbgrader command (and each worker) removes its kernels' socket folder when it ends
    assert not list(scratch(course).glob("fp-grade-*")), list(scratch(course).iterdir())


# ------------------------------------------------------------------ manual grades
@pytest.fixture(scope="module")
def regraded(graded):
    """An instructor overrides two grades by hand (as formgrader does), then grades again:
    plainly (the failed student is fixed first), and with --force for the naive students."""
    course, expected, _, _ = graded
    with Gradebook(db_url(course), COURSE_ID) as gb:
        for student, cell, score in (("naive_0", "test_large_inputs", 2), ("correct_1", "test_dims", 0)):
            grade = gb.find_grade(cell, NOTEBOOK, ASSIGNMENT, student)
            grade.manual_score = score
            grade.needs_manual_grade = False
        gb.db.commit()
    (course / "autograded" / "broken_dest").unlink()
    plain = nbgrader(course, "autograde", ASSIGNMENT, env={"FP_GRADING_WORKERS": str(WORKERS), "FP_GRADING_VERBOSE": "1"})
    forced = nbgrader(course, "autograde", ASSIGNMENT, "--force", "--student=naive_*",
                          env={"FP_GRADING_WORKERS": str(WORKERS), "FP_GRADING_VERBOSE": "1"})
    rows = {r["student_id"]: r for r in read_export(course)}
    return course, expected, plain, forced, rows


def test_plain_rerun_grades_only_what_is_missing(regraded):
    _, _, plain, _, rows = regraded
    assert float(rows["broken_dest"]["score"]) == 10
    graded_now = re.findall(r"Autograding .*autograded/([^/]+)/softmax/", plain.stderr)
    assert graded_now == ["broken_dest"], graded_now


def test_forced_rerun_grades_again_in_parallel(regraded):
    _, _, _, forced, _ = regraded
    assert f"Grading 3 submissions with {WORKERS} workers" in forced.stderr
    assert sorted(re.findall(r"Autograding .*autograded/([^/]+)/softmax/", forced.stderr)) == \
        ["naive_0", "naive_1", "naive_2"]


def test_manual_grades_survive_regrading(regraded):
    course, expected, _, _, rows = regraded
    assert float(rows["naive_0"]["score"]) == expected["naive_0"] + 2  # large inputs given 2 by hand
    assert float(rows["correct_1"]["score"]) == expected["correct_1"] - 2  # dims taken away by hand
    assert float(rows["naive_1"]["score"]) == expected["naive_1"]
    with Gradebook(db_url(course), COURSE_ID) as gb:
        assert gb.find_grade("test_large_inputs", NOTEBOOK, ASSIGNMENT, "naive_0").manual_score == 2
        assert gb.find_grade("test_dims", NOTEBOOK, ASSIGNMENT, "correct_1").manual_score == 0
    assert len(rows) == len(expected) + 1


# ------------------------------------------------------------------ feedback
def test_feedback_leaves_the_marker_out(graded):
    """A student still marked as being graded: generate_feedback does not copy the marker."""
    course = graded[0]
    folder = course / "autograded" / "correct_2" / ASSIGNMENT
    (folder / "notes.txt").write_text("a file nbgrader copies into feedback")
    (folder / ".fp-grading-incomplete").write_text("being graded\n")
    try:
        nbgrader(course, "generate_feedback", ASSIGNMENT, "--student=correct_2", "--force")
    finally:
        (folder / ".fp-grading-incomplete").unlink()
    feedback = course / "feedback" / "correct_2" / ASSIGNMENT
    assert (feedback / f"{NOTEBOOK}.html").exists() and (feedback / "notes.txt").exists()
    assert not (feedback / ".fp-grading-incomplete").exists()


# ------------------------------------------------------------------ units
TORCH_PROBE = """
import json, os, sys
from firstprinciples.grading import parallel
from nbgrader.apps.nbgraderapp import main

grade = parallel.ParallelAutograde._grade_turns
def probed(self, turns):  # in each worker, after its turns: had this process imported torch?
    grade(self, turns)
    open(f"worker-{os.getpid()}.json", "w").write(json.dumps("torch" in sys.modules))
parallel.ParallelAutograde._grade_turns = probed
sys.argv = ["nbgrader", "autograde", "softmax", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print("command imported torch:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("service", [True, False])
def test_where_the_template_decides_no_grading_process_imports_torch(tmp_path, service):
    """With warm kernels, each worker's re-check decides in a service forked from the template
    (verdicts.Service): neither the command nor its workers import torch (the command forks
    its workers a second sooner). Without the service, the command imports it once before it
    forks, so that its workers do not each import it. The grades are the same."""
    import json
    import subprocess
    import sys

    course = make_course(tmp_path)
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    for kind in ("correct", "naive", "untouched"):
        submit(course, kind, answers_of(kind))
    (course / "probe.py").write_text(TORCH_PROBE)
    env = {**os.environ, "FP_GRADING_WORKERS": "2", "KINETO_LOG_LEVEL": "5"}
    env.pop("FP_GRADING_COLD", None)
    args = [] if service else ["--RobustExecute.recheck_service=False"]
    proc = subprocess.run([sys.executable, "probe.py", *args], cwd=course, env=env, capture_output=True,
                          text=True, timeout=600)
    assert f"command imported torch: {not service}" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    workers = [json.loads(p.read_text()) for p in course.glob("worker-*.json")]
    assert workers == [not service] * 2, workers
    grades = {r["student_id"]: float(r["score"]) for r in read_export(course)}
    assert grades == {k: GRADES[k] for k in ("correct", "naive", "untouched")}, grades


def test_only_the_command_line_fans_out():
    from firstprinciples.grading.parallel import looks_like_cli, threads_per_worker

    assert looks_like_cli(["/usr/local/bin/nbgrader", "autograde", "ps1"])
    assert looks_like_cli([os.path.join(os.path.dirname(__import__("nbgrader").__file__), "__main__.py"),
                           "autograde", "ps1", "--force"])
    assert not looks_like_cli(["/usr/bin/jupyter-lab"])  # formgrader: the Python API
    assert not looks_like_cli(["/usr/local/bin/nbgrader", "generate_feedback", "ps1"])
    assert threads_per_worker(2, cores=2, limit="") == 1 and threads_per_worker(3, cores=2, limit="") == 1
    assert threads_per_worker(2, cores=8, limit="") == 4
    # an OMP_NUM_THREADS the grader was started with caps each worker's share (never raises it)
    assert threads_per_worker(2, cores=8, limit="2") == 2 and threads_per_worker(2, cores=8, limit="16") == 4
    assert threads_per_worker(1, cores=2, limit="junk") == 2


def test_every_turn_is_given_once_among_forked_workers(tmp_path, monkeypatch):
    """``Turns``, made before the fork, gives each submission (its index) to exactly one of the
    workers, and every one of them to some worker, however the workers interleave (many turns,
    taken as fast as they can be: without the lock, two workers get the same turn)."""
    from firstprinciples.grading import parallel

    monkeypatch.setattr(parallel, "socket_folder", lambda: str(tmp_path))
    turns = parallel.Turns(3000)
    start, go = os.pipe()  # the workers start together: when the write end closes
    ready, told = os.pipe()  # each says it holds its first turn ...
    again, resume = os.pipe()  # ... and takes the rest when all three do (however busy the machine)
    pids = []
    for w in range(3):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(go)
                os.close(resume)
                os.read(start, 1)
                with open(tmp_path / f"taken-{w}", "w") as f:
                    mine = iter(turns)
                    f.write(f"{next(mine)}\n")
                    os.write(told, b"x")
                    os.read(again, 1)
                    for turn in mine:
                        f.write(f"{turn}\n")
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(go)
    os.close(told)
    held = b""
    while len(held) < 3 and (byte := os.read(ready, 1)):
        held += byte
    os.close(resume)
    assert all(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 for pid in pids)
    taken = [[int(x) for x in (tmp_path / f"taken-{w}").read_text().split()] for w in range(3)]
    assert sorted(sum(taken, [])) == list(range(3000))
    assert held == b"xxx" and all(taken), "a worker got no turn"  # (so all three ran at once)
    assert list(turns) == []  # (all taken)
    turns.close()
    assert not list(tmp_path.glob("turns-*"))


def test_a_student_inserted_by_another_worker_at_the_same_moment_is_found(tmp_path, caplog):
    """`nbgrader autograde "*"`: workers start on a student's assignments together, and on a fresh
    gradebook each looks the student up, finds no one and inserts them: all but the first insert
    failed on the unique id, each logging a database traceback (a screenful per student, with
    nothing wrong). Here another worker inserts the student just before this one's insert: the
    grader adds no second row, fails nothing and logs nothing."""
    import logging
    import sqlite3

    from nbgrader.coursedir import CourseDirectory
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from firstprinciples.grading.parallel import ParallelAutograde

    path = tmp_path / "gradebook.db"
    db = f"sqlite:///{path}"
    inserts = []

    def first_insert_loses(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO STUDENT") and not inserts:
            inserts.append(statement)
            other = sqlite3.connect(path)  # another worker, at this very moment
            other.execute("INSERT INTO student (id) VALUES ('ada')")
            other.commit()
            other.close()

    grader = ParallelAutograde(coursedir=CourseDirectory(root=str(tmp_path), db_url=db))
    with Gradebook(db):
        pass  # (the tables)
    caplog.set_level(logging.WARNING)
    event.listen(Engine, "before_cursor_execute", first_insert_loses)
    try:
        grader._create_student("ada")
        grader._create_student("bo")  # a student no one else inserts
    finally:
        event.remove(Engine, "before_cursor_execute", first_insert_loses)
    assert inserts, "the race never happened: this test checks nothing"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    with Gradebook(db) as gb:
        assert sorted(s.id for s in gb.students) == ["ada", "bo"]


ENGINE_CACHE_SCRIPT = r'''
import json, os, sys
import nbgrader.api as api
from firstprinciples.grading.parallel import _EngineCache

made = []
real = api.create_engine
api.create_engine = lambda *a, **k: made.append(a[0]) or real(*a, **k)
_EngineCache.install()
first, second = sys.argv[1], sys.argv[2]
with api.Gradebook(first) as gb:
    gb.add_student("ada")
    engine = gb.engine
with api.Gradebook(first) as gb, api.Gradebook(first) as nested:  # two sessions at once, one engine
    same = gb.engine is engine and nested.engine is engine
    gb.add_student("bob")
    seen_by_nested = sorted(s.id for s in nested.students)
with api.Gradebook(second) as gb:
    other = gb.engine is not engine
pid = os.fork()
if pid == 0:  # a forked worker: an engine of its own, and its writes reach the parent's
    code = 1
    try:
        before = len(made)
        with api.Gradebook(first) as gb:
            assert gb.engine is not engine and len(made) == before + 1
            gb.add_student("cy")
        code = 0
    finally:
        os._exit(code)
child_ok = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
with api.Gradebook(first) as gb:
    after_fork = gb.engine is engine
    students = sorted(s.id for s in gb.students)
print(json.dumps({"made": len(made), "same": same, "nested": seen_by_nested, "other": other,
                  "child_ok": child_ok, "after_fork": after_fork, "students": students}))
'''


def test_one_database_engine_per_grading_process(tmp_path):
    """While grading, a process's Gradebooks share one engine (nbgrader makes a dozen per
    notebook, each listing the tables and compiling its queries afresh): writes are seen by
    the next one, two at once work, another database gets its own, and a forked worker makes
    its own without touching its parent's connections (the parent keeps using its engine)."""
    import json
    import subprocess
    import sys

    urls = [f"sqlite:///{tmp_path / name}" for name in ("gradebook.db", "other.db")]
    proc = subprocess.run([sys.executable, "-c", ENGINE_CACHE_SCRIPT, *urls], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"made": 2, "same": True, "nested": ["ada", "bob"], "other": True, "child_ok": True,
                   "after_fork": True, "students": ["ada", "bob", "cy"]}, got


def test_cell_metadata_check_raises_what_jsonschema_raises(monkeypatch):
    """nbgrader's cell-metadata check with its schema's validator made once (while grading)
    accepts and refuses exactly what ``jsonschema.validate`` does, with the same message and
    path, and checks the schema only once."""
    import jsonschema
    import nbgrader.nbgraderformat.common as common
    from nbgrader.nbgraderformat.v3 import MetadataValidatorV3

    from firstprinciples.grading.parallel import _CellSchema

    validator = MetadataValidatorV3()
    good = {"grade": True, "grade_id": "test_dims", "locked": True, "points": 2, "schema_version": 3,
            "solution": False, "task": False}
    cases = [good, {**good, "points": "two"}, {**good, "grade": "yes"}, {**good, "extra": 1},
             {**good, "locked": None}, {k: v for k, v in good.items() if k != "solution"}]

    def verdicts(validate):
        out = []
        for meta in cases:
            try:
                validate(meta, validator.schema)
                out.append(None)
            except jsonschema.ValidationError as e:
                out.append((e.message, list(e.path)))
        return out

    expected = verdicts(jsonschema.validate)
    assert expected[0] is None and sum(v is not None for v in expected) >= 3  # the cases do differ
    checked = []
    kind = jsonschema.validators.validator_for(validator.schema)
    real_check = kind.check_schema
    monkeypatch.setattr(common, "jsonschema", _CellSchema(jsonschema))
    monkeypatch.setattr(kind, "check_schema", classmethod(lambda c, s: checked.append(1) or real_check(s)))
    assert verdicts(common.jsonschema.validate) == expected
    assert len(checked) == 1
    cell = {"metadata": {"nbgrader": {**good, "points": "two"}}, "cell_type": "code"}
    from nbformat import from_dict
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'number'"):
        validator.validate_cell(from_dict(cell))  # nbgrader's own method, through the cache
    assert len(checked) == 1
