"""One class, any number of grading machines: the submissions are shared out through the gradebook.

When the gradebook is a PostgreSQL database (``FP_GRADEBOOK_URL``), every
``nbgrader autograde`` run, on any machine that shares the course folder and that
database, takes its submissions one at a time from a table in the same database,
``fp_grading_queue``: one row per (assignment, student).

- **Claim.** A grading process takes the next row that is free
  (``SELECT ... FOR UPDATE SKIP LOCKED``: a row another process is taking at this
  instant is skipped, never waited for) and marks it ``grading``, with its name
  and a lease (``lease_until``, ``Autograde.lease_seconds`` from now). Free means:
  never graded, or finished before this run started (nbgrader's own rules then
  decide whether it is graded again: ``--force``, a newer submission, a half-graded
  folder), or ``grading`` under a lease that has expired.
- **Lease.** While it grades, a thread renews the lease of what the process holds,
  every ``lease_seconds / 4``. A machine that dies (power, ``kill -9``, the network)
  stops renewing; once its lease has expired its student is free again, and the
  next process takes it over. The half-graded ``autograded/`` folder it left has
  the marker of ``parallel.py``, so the new grader grades that student afresh.
- **Done.** Once every notebook of the submission is written, the row is ``done``
  (or ``failed``), with the time (the database's clock, the only clock all machines
  share). A row finished after a run started is not graded again by that run, so
  machines that start a ``--force`` round together grade each student once.
- **The end.** A run ends when nothing of its submissions is free and nothing is being
  graded by another process under a live lease: it waits for those (polling), so
  that a machine that dies at the end of a class still has its students taken over.

Every claim is recorded in ``fp_grading_claims`` (who, when it started, when it
finished): the tests read it to check that no student was graded twice at once.
"""
from __future__ import annotations

import os
import socket
import threading

import sqlalchemy
from sqlalchemy import text

SCHEMA = """
CREATE TABLE IF NOT EXISTS fp_grading_queue (
    assignment text NOT NULL,
    student text NOT NULL,
    state text NOT NULL DEFAULT 'pending',
    owner text,
    lease_until timestamptz,
    finished_at timestamptz,
    claims integer NOT NULL DEFAULT 0,
    PRIMARY KEY (assignment, student)
);
CREATE TABLE IF NOT EXISTS fp_grading_claims (
    id bigserial PRIMARY KEY,
    assignment text NOT NULL,
    student text NOT NULL,
    owner text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz,
    outcome text
);
"""
_FREE = """(q.state = 'pending'
            OR (q.state = 'grading' AND q.lease_until < clock_timestamp())
            OR (q.state IN ('done', 'failed') AND q.finished_at < :run_started))"""


def shared(db_url: str) -> bool:
    """Is this gradebook one that several machines can share out a class through?"""
    return db_url.startswith(("postgresql", "postgres://"))


def owner_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class SharedQueue:
    """The queue of one run (one process; a forked worker makes its own with ``reopen``)."""

    def __init__(self, db_url: str, lease_seconds: float = 120.0, run_started=None):
        self.db_url, self.lease = db_url, float(lease_seconds)
        self.engine = sqlalchemy.create_engine(db_url, poolclass=sqlalchemy.pool.NullPool)
        self.owner = owner_name()
        with self.engine.begin() as db:
            db.execute(text("SELECT pg_advisory_xact_lock(20261201)"))  # one CREATE at a time
            db.execute(text(SCHEMA))
        self.run_started = run_started if run_started is not None else self.now()
        self._held: dict = {}  # (assignment, student) -> claim id
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = None

    def reopen(self) -> "SharedQueue":
        """The same run's queue in a forked worker (its own connections, its own name)."""
        return SharedQueue(self.db_url, self.lease, self.run_started)

    def now(self):
        with self.engine.connect() as db:
            return db.execute(text("SELECT clock_timestamp()")).scalar()

    def add(self, keys) -> None:
        """Make sure every (assignment, student) of this run has a row."""
        with self.engine.begin() as db:
            for a, s in keys:
                db.execute(text("INSERT INTO fp_grading_queue (assignment, student) VALUES (:a, :s) "
                                "ON CONFLICT DO NOTHING"), {"a": a, "s": s})

    def claim(self, keys) -> tuple[tuple | None, int]:
        """Take the next free one of ``keys``: return it (or None) and how many of ``keys`` are
        still unfinished by others (free ones another process is taking at this instant, and
        those graded under a live lease): while there are, the run must not end."""
        pairs = {"a": [a for a, _s in keys], "s": [s for _a, s in keys], "run_started": self.run_started,
                 "owner": self.owner}
        mine = None
        with self.engine.begin() as db:
            row = db.execute(text(f"""
                SELECT q.assignment, q.student FROM fp_grading_queue q
                WHERE (q.assignment, q.student) IN (SELECT * FROM unnest(CAST(:a AS text[]), CAST(:s AS text[])))
                  AND {_FREE}
                ORDER BY q.assignment, q.student
                LIMIT 1 FOR UPDATE SKIP LOCKED"""), pairs).fetchone()
            if row is not None:
                mine = (row[0], row[1])
                db.execute(text("""UPDATE fp_grading_queue SET state = 'grading', owner = :owner,
                                   lease_until = clock_timestamp() + make_interval(secs => :lease),
                                   claims = claims + 1
                                   WHERE assignment = :a AND student = :s"""),
                           {"owner": self.owner, "lease": self.lease, "a": mine[0], "s": mine[1]})
                claim_id = db.execute(text("INSERT INTO fp_grading_claims (assignment, student, owner) "
                                           "VALUES (:a, :s, :owner) RETURNING id"),
                                      {"a": mine[0], "s": mine[1], "owner": self.owner}).scalar()
        if mine is not None:
            with self._lock:
                self._held[mine] = claim_id
            self._start_heartbeat()
            return mine, 0
        with self.engine.connect() as db:  # (a plain read: it never waits for a row lock)
            busy = db.execute(text(f"""
                SELECT count(*) FROM fp_grading_queue q
                WHERE (q.assignment, q.student) IN (SELECT * FROM unnest(CAST(:a AS text[]), CAST(:s AS text[])))
                  AND ({_FREE} OR (q.state = 'grading' AND q.owner <> :owner))"""), pairs).scalar()
        return None, int(busy)

    def finish(self, key: tuple, ok: bool) -> None:
        with self._lock:
            claim_id = self._held.pop(key, None)
        outcome = "done" if ok else "failed"
        with self.engine.begin() as db:
            db.execute(text("""UPDATE fp_grading_queue SET state = :outcome, finished_at = clock_timestamp(),
                               lease_until = NULL WHERE assignment = :a AND student = :s AND owner = :owner"""),
                       {"outcome": outcome, "a": key[0], "s": key[1], "owner": self.owner})
            if claim_id is not None:
                db.execute(text("UPDATE fp_grading_claims SET finished_at = clock_timestamp(), outcome = :o "
                                "WHERE id = :id"), {"o": outcome, "id": claim_id})

    def _start_heartbeat(self) -> None:
        if self._beat is None or not self._beat.is_alive():
            self._beat = threading.Thread(target=self._heartbeat, name="fp-lease", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease / 4):
            with self._lock:
                held = list(self._held)
            if not held:
                continue
            try:
                with self.engine.begin() as db:
                    for a, s in held:
                        db.execute(text("""UPDATE fp_grading_queue
                                           SET lease_until = clock_timestamp() + make_interval(secs => :lease)
                                           WHERE assignment = :a AND student = :s AND owner = :owner
                                             AND state = 'grading'"""),
                                   {"lease": self.lease, "a": a, "s": s, "owner": self.owner})
            except Exception:  # noqa: BLE001 (the database is away: try again at the next beat)
                pass

    def close(self) -> None:
        self._stop.set()
        self.engine.dispose()
