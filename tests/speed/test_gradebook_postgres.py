"""A PostgreSQL gradebook, shared by two grading machines grading at once.

The fixture starts a real PostgreSQL server (Debian's ``postgresql`` package:
initdb / pg_ctl) in a temporary folder, reachable only over a Unix socket in
that folder, and stops it afterwards, also when a test fails. Two course
folders stand for two grading machines: each has its own students, runs the
plain `nbgrader` commands with ``FP_GRADEBOOK_URL`` pointing at the server
(``nbgrader_config.py`` turns that into ``CourseDirectory.db_url``), and both
grade at the same time, each with two workers. The export (from either machine)
must hold every student of both, once, with the right grade, and no SQLite
gradebook may appear.

Without the PostgreSQL binaries or psycopg2 the tests are skipped, except under
CI (``CI`` set), where that is a failure (.ci/run installs ``postgresql``).
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from course import make_course, nbgrader, scratch
from test_grading_parallel import (ASSIGNMENT, COURSE_ID, GRADES, answers_of, read_export,
                                   submit, unfinished)

MACHINES = {
    "machine_a": {"a_correct": "correct", "a_naive": "naive", "a_untouched": "untouched"},
    "machine_b": {"b_correct": "correct", "b_detached": "detached", "b_last_dim": "last_dim_only"},
}
PORT = 5432  # only names the socket file, in a private folder: no TCP port is opened


def _missing(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the PostgreSQL tests: .ci/run installs postgresql)")
    pytest.skip(reason)


def _postgres_bin() -> Path | None:
    for candidate in [shutil.which("pg_ctl"), *sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                                                      key=lambda p: int(p.split("/")[4]), reverse=True)]:
        if candidate and os.path.exists(os.path.join(os.path.dirname(os.path.realpath(candidate)), "initdb")):
            return Path(os.path.realpath(candidate)).parent
    return None


def _as_server_user() -> tuple[list[str], str]:
    """PostgreSQL refuses to run as root: as root, run it as the `postgres` (else `nobody`) user."""
    if os.geteuid() != 0:
        return [], pwd.getpwuid(os.geteuid()).pw_name
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            continue
        if shutil.which("runuser"):
            return ["runuser", "-u", user, "--"], user
        return ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups"], user
    _missing("running as root and no unprivileged user to run PostgreSQL as")


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server for this module: yields its SQLAlchemy URL."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        _missing("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    try:
        import psycopg2
    except ImportError:
        _missing("psycopg2 is not installed (pip install -r requirements.txt)")
    prefix, user = _as_server_user()
    # Not under pytest's tmp folder: that one is private to root, the server user could not enter it.
    home = Path(tempfile.mkdtemp(prefix="fp-postgres-"))
    data, sockets = home / "data", home / "sockets"
    sockets.mkdir()
    if prefix:
        uid, gid = pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid
        for path in (home, sockets):
            os.chown(path, uid, gid)

    def run(*cmd):
        proc = subprocess.run([*prefix, *cmd], check=False, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}\n{proc.stderr}"

    started = False
    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", "grader", "-A", "trust", "--no-sync")
        run(str(bin_dir / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(data), "-l", str(home / "server.log"),
            "-o", f"-c listen_addresses='' -c unix_socket_directories='{sockets}' -p {PORT} -c fsync=off")
        started = True
        conn = psycopg2.connect(host=str(sockets), port=PORT, user="grader", dbname="postgres")
        conn.autocommit = True
        conn.cursor().execute("CREATE DATABASE gradebook")
        conn.close()
        # (as docs/instructors/scaling.md writes it: no driver named; firstprinciples.grading.gradebook_url adds the installed one)
        yield f"postgresql://grader@/gradebook?host={sockets}&port={PORT}"
    finally:
        if started:
            stop = subprocess.run([*prefix, str(bin_dir / "pg_ctl"), "stop", "-D", str(data), "-m", "fast",
                                   "-w", "-t", "60"], check=False, capture_output=True, text=True)
            if stop.returncode != 0:  # still there: the postmaster's pid is on the first line of its pid file
                try:
                    pid = int((data / "postmaster.pid").read_text().split()[0])
                    os.kill(pid, signal.SIGKILL)
                    time.sleep(1)
                except (OSError, ValueError, IndexError):
                    pass
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def two_machines(postgres, tmp_path_factory):
    env = {"FP_GRADEBOOK_URL": postgres, "FP_GRADING_WORKERS": "2"}
    courses = {}
    for machine, students in MACHINES.items():
        course = make_course(tmp_path_factory.mktemp(machine))
        nbgrader(course, "generate_assignment", ASSIGNMENT, "--force", env=env)
        for student, kind in students.items():
            submit(course, student, answers_of(kind))
        courses[machine] = course
    # Both machines grade at the same time, into the same gradebook.
    procs = {m: _popen_nbgrader(c, env) for m, c in courses.items()}
    results = {m: p.communicate(timeout=1800) for m, p in procs.items()}
    codes = {m: p.returncode for m, p in procs.items()}
    rows = {m: read_export(c, env=env) for m, c in courses.items()}
    return postgres, courses, codes, results, rows


def _popen_nbgrader(course, env, *extra, log=None):
    scratch(course).mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("NBGRADER")}
    full.update(env, TMPDIR=str(scratch(course)))
    out = subprocess.PIPE if log is None else log
    return subprocess.Popen([sys.executable, "-m", "nbgrader", "autograde", ASSIGNMENT, *extra], cwd=course,
                            env=full, stdout=out, stderr=subprocess.STDOUT if log is not None else subprocess.PIPE,
                            text=True)


def _expected():
    return {s: GRADES[kind] for students in MACHINES.values() for s, kind in students.items()}


def test_both_machines_graded_in_parallel(two_machines):
    _, _, codes, results, _ = two_machines
    for machine, (_, stderr) in results.items():
        assert codes[machine] == 0, stderr[-4000:]
        assert "Sharing 3 submission(s) out through the gradebook" in stderr and "with 2 worker(s)" in stderr


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_export_has_every_student_of_both_machines(two_machines, machine):
    rows = two_machines[4][machine]
    assert sorted(r["student_id"] for r in rows) == sorted(_expected()), "missing or duplicated students"
    assert {r["student_id"]: float(r["score"]) for r in rows} == _expected()


def test_grades_are_in_postgresql_not_sqlite(two_machines):
    url, courses, _, _, _ = two_machines
    for course in courses.values():
        assert not (course / "gradebook.db").exists()
        assert unfinished(course) == []
    from firstprinciples.grading import gradebook_url

    with Gradebook(gradebook_url(url), COURSE_ID) as gb:
        assert gb.engine.dialect.name == "postgresql"
        scores = {s.student.id: s.score for s in gb.find_assignment(ASSIGNMENT).submissions}
    assert scores == _expected()


# ------------------------------------------------------------------ one class, three graders
GRADERS = 3
LEASE = 8  # seconds: a dead grader's student is taken over this long after its last renewal
CLASS = {f"{kind}_{i}": kind for kind in ("correct", "naive", "untouched", "last_dim_only") for i in range(3)}


def _database(url: str, name: str) -> str:
    import psycopg2
    from sqlalchemy.engine import make_url

    u = make_url(url)
    conn = psycopg2.connect(host=u.query["host"], port=int(u.query["port"]), user=u.username, dbname="postgres")
    conn.autocommit = True
    conn.cursor().execute(f"CREATE DATABASE {name}")
    conn.close()
    return str(u.set(database=name))


def _claims(url: str) -> list[dict]:
    import sqlalchemy

    from firstprinciples.grading import gradebook_url

    engine = sqlalchemy.create_engine(gradebook_url(url))
    try:
        with engine.connect() as db:
            rows = db.execute(sqlalchemy.text("SELECT * FROM fp_grading_claims ORDER BY id")).mappings().all()
            return [dict(r) for r in rows]
    except sqlalchemy.exc.ProgrammingError:
        return []  # (the table is made by the first grader)
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def three_graders(postgres, tmp_path_factory):
    """One course folder, shared by three `nbgrader autograde` runs started at once (one worker
    each, as three machines would); the first is killed (SIGKILL) while it grades a student."""
    url = _database(postgres, "shared_class")
    env = {"FP_GRADEBOOK_URL": url, "FP_GRADING_WORKERS": "1"}
    course = make_course(tmp_path_factory.mktemp("shared"))
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force", env=env)
    for student, kind in CLASS.items():
        submit(course, student, answers_of(kind))
    logs = [open(course.parent / f"grader{i}.log", "w") for i in range(GRADERS)]
    procs = [_popen_nbgrader(course, env, f"--Autograde.lease_seconds={LEASE}", log=logs[i]) for i in range(GRADERS)]
    victim = procs[0]
    killed_at = killed_claim = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and killed_at is None:
        mine = [c for c in _claims(url) if c["owner"].endswith(f":{victim.pid}")]
        # once it has finished one student and is in the middle of the next
        if any(c["finished_at"] for c in mine) and mine and mine[-1]["finished_at"] is None:
            time.sleep(0.5)
            victim.kill()
            killed_at, killed_claim = time.time(), mine[-1]
        elif victim.poll() is not None:
            break
        time.sleep(0.2)
    codes = [p.wait(timeout=900) for p in procs]
    for f in logs:
        f.close()
    texts = [(course.parent / f"grader{i}.log").read_text() for i in range(GRADERS)]
    return {"url": url, "env": env, "course": course, "codes": codes, "logs": texts, "killed_at": killed_at,
            "killed_claim": killed_claim, "claims": _claims(url), "rows": read_export(course, env=env)}


def test_the_kill_landed_in_the_middle_of_a_student(three_graders):
    assert three_graders["killed_claim"] is not None, "the first grader finished before it could be killed:\n" + \
        three_graders["logs"][0][-3000:]
    assert three_graders["codes"][0] == -signal.SIGKILL
    for code, log in zip(three_graders["codes"][1:], three_graders["logs"][1:]):
        assert code == 0, log[-4000:]


def test_every_student_is_graded_once_with_the_right_grade(three_graders):
    rows = three_graders["rows"]
    assert sorted(r["student_id"] for r in rows) == sorted(CLASS)
    assert {r["student_id"]: float(r["score"]) for r in rows} == {s: GRADES[k] for s, k in CLASS.items()}
    assert unfinished(three_graders["course"]) == []


def test_the_graders_shared_the_class(three_graders):
    done = [c for c in three_graders["claims"] if c["outcome"] == "done"]
    owners = {c["owner"] for c in done}
    assert len(owners) == GRADERS, f"not every grader graded: {owners}"
    assert sorted(c["student"] for c in done) == sorted(CLASS), "a student was finished twice, or never"


def test_no_student_was_graded_twice_at_once(three_graders):
    by_student: dict = {}
    for c in three_graders["claims"]:
        by_student.setdefault(c["student"], []).append(c)
    victim = three_graders["killed_claim"]
    for student, claims in by_student.items():
        claims.sort(key=lambda c: c["started_at"])
        for earlier, later in zip(claims, claims[1:]):
            if earlier["id"] == victim["id"]:
                # the dead grader's student: taken over only once its lease had expired
                assert later["started_at"].timestamp() >= three_graders["killed_at"] + LEASE * 0.5, \
                    f"{student} was taken over before the dead grader's lease expired"
                continue
            assert earlier["finished_at"] is not None and earlier["finished_at"] <= later["started_at"], \
                f"{student} was graded by {earlier['owner']} and {later['owner']} at once"


def test_the_dead_graders_student_was_taken_over(three_graders):
    victim = three_graders["killed_claim"]
    later = [c for c in three_graders["claims"] if c["student"] == victim["student"] and c["id"] > victim["id"]]
    assert later and later[-1]["outcome"] == "done" and later[-1]["owner"] != victim["owner"]


def test_what_the_killed_grader_finished_counts_as_graded(three_graders):
    """Each surviving grader's summary accounts for the whole class: what it graded, and what the
    others finished (the killed one included) as "already graded"; none is "not graded" (the
    students the killed grader had finished were reported as not graded)."""
    import re

    victim = three_graders["killed_claim"]
    finished_by_victim = {c["student"] for c in three_graders["claims"]
                          if c["owner"] == victim["owner"] and c["outcome"] == "done"}
    assert finished_by_victim, "the killed grader had finished no one: this test checks nothing"
    for log in three_graders["logs"][1:]:
        summary = log[log.index("Summary:"):]
        assert "not graded" not in summary, summary
        graded = re.search(r"^\s+graded\s+(\d+)\s+of (\d+)$", summary, flags=re.MULTILINE)
        already = re.search(r"^\s+already graded\s+(\d+)\s+\(by another grader or an earlier run\) (.*)$", summary,
                            flags=re.MULTILINE)
        assert graded and already, summary
        assert int(graded[1]) + int(already[1]) == int(graded[2]) == len(CLASS), summary
        named = set(re.findall(r"(\w+) \(softmax\)", already[2]))
        assert finished_by_victim <= named or already[2].endswith("..."), (finished_by_victim, summary)
