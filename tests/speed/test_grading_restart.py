"""Killing `nbgrader autograde` at any point and running it again loses nothing.

The `softmax` assignment, five students of known grades (see
``test_grading_parallel``), graded by two workers with the repo's config.

1. The first `nbgrader autograde softmax` is killed (SIGKILL to its whole
   process group: the command and its workers) once at least one student is
   finished and while another is half graded. Nothing of it may keep running
   (the sandboxed kernels included), and a plain rerun must grade the
   half-graded and the missing students, not the finished ones, and give
   every student exactly once, with the grade a clean run gives.
2. Then `nbgrader autograde softmax --force` (grading everyone again) is
   killed the same way, and a plain (not forced) rerun must again end with
   every grade right and nothing half graded.
3. A plain ``kill`` (SIGTERM) of the command alone, while its workers grade,
   must stop the workers and their kernels too (the signal reaches only the
   command), and a rerun again ends with every grade right.

And a sandboxed kernel waiting for its next cell dies with the grader that
started it (``GraderBoundKernelManager``).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course import make_course, nbgrader, scratch
from test_grading_parallel import ASSIGNMENT, GRADES, NOTEBOOK, answers_of, read_export, submit, unfinished

STUDENTS = {s: GRADES[s.rsplit("_", 1)[0]] for s in ("correct_0", "correct_1", "naive_0", "untouched_0", "naive_1")}
ENV = {"FP_GRADING_WORKERS": "2", "FP_GRADING_VERBOSE": "1"}  # (this test reads nbgrader's detailed log)


def _live_processes(course, pgid=None):
    """Live processes of this course's grading: the killed command's process group and
    anything (kernels, sandboxes) whose command line names the course's scratch folder.
    Zombies (dead, waiting for this machine's init to collect them) are not counted."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,pgid,stat,args"], check=False, capture_output=True, text=True).stdout
    live = []
    for line in out.splitlines()[1:]:
        pid, group, stat, args = line.split(None, 3)
        if stat.startswith("Z") or int(pid) == os.getpid():
            continue
        if str(scratch(course)) in args or (pgid is not None and int(group) == pgid):
            live.append(line)
    return live


def _finished(course):
    """Students whose grading is complete (notebook written, no marker)."""
    done = []
    for folder in (course / "autograded").glob(f"*/{ASSIGNMENT}"):
        if (folder / f"{NOTEBOOK}.ipynb").exists() and not (folder / ".fp-grading-incomplete").exists():
            done.append(folder.parent.name)
    return sorted(done)


def _start(course, *args):
    scratch(course).mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBGRADER")}
    env.update(ENV, TMPDIR=str(scratch(course)))
    log = open(course.parent / f"killed-run-{len(list(course.parent.glob('killed-run-*')))}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "nbgrader", "autograde", ASSIGNMENT, *args], cwd=course,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _kill_when(proc, log, ready, timeout=600):
    """SIGKILL the command's whole process group as soon as ``ready()`` holds."""
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"the run ended (exit code {proc.returncode}) before the moment to kill it:\n"
                            + Path(log.name).read_text()[-3000:])
            if time.monotonic() > deadline:
                pytest.fail("the moment to kill the run never came")
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def _wait_until_gone(course, pgid, timeout=60):
    deadline = time.monotonic() + timeout
    while _live_processes(course, pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _live_processes(course, pgid)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("restart"))
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    for student in STUDENTS:
        submit(course, student, answers_of(student.rsplit("_", 1)[0]))
    out = {"course": course}

    # 1. the first run, killed with one student done and another half graded
    proc, log = _start(course)
    _kill_when(proc, log, lambda: _finished(course) and unfinished(course)
               and len(_finished(course)) < len(STUDENTS))
    out["done_at_kill"], out["half_at_kill"] = _finished(course), unfinished(course)
    out["left_running"] = _wait_until_gone(course, proc.pid)
    rows = read_export(course)
    out["export_after_kill"] = {r["student_id"]: float(r["score"]) for r in rows}
    out["flagged_after_kill"] = sorted(r["student_id"] for r in rows if r["notes"].startswith("NOT FINISHED"))
    out["sockets_after_kill"] = sorted(p.name for p in scratch(course).glob("fp-grade-*"))
    out["rerun"] = nbgrader(course, "autograde", ASSIGNMENT, env=ENV)
    out["sockets_after_rerun"] = sorted(p.name for p in scratch(course).glob("fp-grade-*"))
    out["rows"] = read_export(course)

    # 2. grading everyone again (--force), killed in the middle; then a plain rerun
    proc, log = _start(course, "--force")
    _kill_when(proc, log, lambda: unfinished(course) and
               "Setting destination file permissions" in Path(log.name).read_text())
    out["half_at_second_kill"] = unfinished(course)
    out["left_running_2"] = _wait_until_gone(course, proc.pid)
    out["rerun_2"] = nbgrader(course, "autograde", ASSIGNMENT, env=ENV)
    out["rows_2"] = read_export(course)
    out["left_running_3"] = _live_processes(course)

    # 3. SIGTERM to the command alone, in the middle of a forced run
    proc, log = _start(course, "--force")
    deadline = time.monotonic() + 600
    while "Autograding" not in Path(log.name).read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        out["sigterm_code"] = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out["sigterm_code"] = f"still running 60 s after SIGTERM (exit code {proc.wait()} after SIGKILL)"
    log.close()
    out["sigterm_log"] = Path(log.name).read_text()
    out["left_running_4"] = _wait_until_gone(course, proc.pid)
    out["rerun_3"] = nbgrader(course, "autograde", ASSIGNMENT, env=ENV)
    out["rows_3"] = read_export(course)
    return out


def _graded_in(proc):
    return sorted(re.findall(rf"Autograding .*autograded/([^/]+)/{ASSIGNMENT}/", proc.stderr))


def test_killed_in_the_middle(restarted):
    assert restarted["done_at_kill"] and restarted["half_at_kill"]


def test_nothing_keeps_running_after_the_kill(restarted):
    assert restarted["left_running"] == [], restarted["left_running"]
    assert restarted["left_running_2"] == [], restarted["left_running_2"]
    assert restarted["left_running_3"] == [], restarted["left_running_3"]


def test_the_rerun_removes_the_socket_folders_of_the_killed_graders(restarted):
    """Killed with SIGKILL, the workers could not remove their kernels' socket folders; the
    next grading command does (their owners are gone)."""
    assert restarted["sockets_after_kill"], "the kill left no socket folder: this test checks nothing"
    assert restarted["sockets_after_rerun"] == [], restarted["sockets_after_rerun"]


def test_finished_students_keep_their_grade_after_the_kill(restarted):
    export = restarted["export_after_kill"]
    for student in restarted["done_at_kill"]:
        assert export[student] == STUDENTS[student], (student, export[student])


def test_an_export_after_the_kill_flags_the_half_graded_students(restarted):
    """Their score is not final until the rerun: grades.csv lists them (even one that the
    gradebook did not know yet) and says so in its notes column."""
    assert restarted["flagged_after_kill"] == restarted["half_at_kill"]
    assert not any(r["notes"].startswith("NOT FINISHED") for r in restarted["rows"])


def test_rerun_grades_exactly_the_unfinished_students(restarted):
    graded_again = _graded_in(restarted["rerun"])
    assert graded_again == sorted(set(STUDENTS) - set(restarted["done_at_kill"])), graded_again
    for student in restarted["half_at_kill"]:
        assert re.search(rf"Removing existing assignment \(an earlier run stopped in the middle of it\): "
                         rf".*autograded/{student}/{ASSIGNMENT}", restarted["rerun"].stderr)


@pytest.mark.parametrize("rows", ["rows", "rows_2", "rows_3"])
def test_every_student_once_with_the_clean_grade(restarted, rows):
    rows = restarted[rows]
    assert sorted(r["student_id"] for r in rows) == sorted(STUDENTS), "missing or duplicated students"
    assert {r["student_id"]: float(r["score"]) for r in rows} == STUDENTS


def test_plain_rerun_after_a_killed_forced_run(restarted):
    assert restarted["half_at_second_kill"]
    graded_again = _graded_in(restarted["rerun_2"])
    assert set(restarted["half_at_second_kill"]) <= set(graded_again), graded_again
    course = restarted["course"]
    assert unfinished(course) == []
    assert not list((course / "autograded").glob("*/.fp-discarded-*"))
    assert sorted(p.parent.name for p in (course / "autograded").glob(f"*/{ASSIGNMENT}")) == sorted(STUDENTS)


def test_sigterm_stops_the_workers_and_their_kernels(restarted):
    assert restarted["sigterm_code"] == 128 + signal.SIGTERM, restarted["sigterm_log"][-3000:]
    assert "Stopped (signal 15): stopping the graders" in restarted["sigterm_log"]
    assert restarted["left_running_4"] == [], restarted["left_running_4"]
    assert unfinished(restarted["course"]) == []  # the rerun finished what the stopped run had started


KERNEL_HOLDER = """
import asyncio, os, sys
import firstprinciples.grading
from firstprinciples.grading.parallel import GraderBoundKernelManager

os.environ["JUPYTER_PATH"] = os.path.dirname(firstprinciples.grading.__file__)

async def main():
    km = GraderBoundKernelManager(kernel_name="fp-sandbox", transport="ipc", ip=os.path.join(sys.argv[1], "kernel"),
                                  connection_file=os.path.join(sys.argv[1], "kernel.json"))
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=120)
    proc = km.provisioner.process  # a warm kernel's process is forked from the template, inside the sandbox
    print("ready", getattr(proc, "pid_inside", proc.pid), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap (the sandboxed kernel)")
def test_an_idle_sandboxed_kernel_dies_with_its_grader(tmp_path):
    """With jupyter_client's own kernel manager, a sandboxed kernel waiting for its next
    cell outlives a grader killed with SIGKILL and waits forever (this test fails then)."""
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    holder = subprocess.Popen([sys.executable, "-c", KERNEL_HOLDER, str(sockets)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    kernel_pid = None
    try:
        ready = next((line.split() for line in holder.stdout if line.startswith("ready")), None)
        assert ready, "the kernel did not start"
        kernel_pid = int(ready[1])
        assert _alive(kernel_pid), "the kernel's process is not running"
        assert _processes_naming(tmp_path), "no sandbox found for the kernel"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 30
    while (_processes_naming(tmp_path) or _alive(kernel_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_naming(tmp_path) + ([f"{kernel_pid} (the kernel)"] if _alive(kernel_pid) else [])
    for line in left:  # do not leave them behind even when the test fails
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert left == []


def _alive(pid) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _processes_naming(folder):
    out = subprocess.run(["ps", "-ww", "-eo", "pid,stat,args"], check=False, capture_output=True, text=True).stdout
    return [line for line in out.splitlines()[1:] if str(folder) in line and not line.split()[1].startswith("Z")]
