"""Parallel, restartable ``nbgrader autograde``.

nbgrader 0.9.6 grades the submissions of an assignment one after the other in
one process, and its converter class is not configurable: ``AutogradeApp.start``
builds ``nbgrader.apps.autogradeapp.Autograde``. ``nbgrader_config.py`` puts
``ParallelAutograde`` (a subclass, so every ``c.Autograde.*`` setting still
applies) in that name. The instructor keeps typing ``nbgrader autograde ps1``.

Parallel
    With ``workers`` > 1 (``c.Autograde.workers``; default: the environment
    variable ``FP_GRADING_WORKERS``, else two a core where the memory allows it: see
    ``default_workers``) and more than one
    submission to grade, the command forks that many workers, once it has loaded
    nbgrader, its configuration and the trusted grader (so a worker starts
    grading at once). There are no fixed batches: a worker that is free takes the
    next submission (in sorted order) from a counter shared by the workers
    (``Turns``), so a student who holds a worker for minutes (a hang, a timeout)
    holds only that worker, and the others grade the rest of the class. A
    worker grades each submission with nbgrader's own loop and dies with the
    command (``PR_SET_PDEATHSIG``); if it dies, the others take what is left. Each worker's
    log is streamed to this command's stderr, prefixed ``[grader i/N]``; when a
    worker fails, the command fails (exit code 1) naming the students
    concerned. Each worker gets ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` =
    cores // workers (at least 1) so that the workers' kernels do not fight over
    the cores (the sandbox passes them on to the kernel). Called through
    nbgrader's Python API (formgrader, a threaded server that must not be
    forked) instead of the command line, grading stays serial.

Restartable
    Stock nbgrader skips a submission whose ``autograded/`` folder exists, so a
    run killed in the middle of a student leaves a half-graded student that a
    plain rerun skips. Here a marker file (``MARKER``) is written into that
    folder before anything else of the submission is graded and removed once
    all its notebooks are written (``set_permissions``, which nbgrader calls
    then). A folder that still has the marker is graded again by the next run,
    ``--force`` or not. An existing folder that has to be replaced (``--force``,
    a newer submission, a marker) is first renamed away atomically and then
    deleted, so a kill during the deletion cannot leave a partial folder that
    looks finished. The marker is in ``CourseDirectory.ignore``
    (``nbgrader_config.py``), so ``generate_feedback`` does not copy it.
    Stopping a parallel run (Ctrl-C, ``kill``, a hang-up) kills its workers at
    once; what they were grading keeps its marker.

Gradebook
    Grades are written by several processes at once. For SQLite (the default
    ``gradebook.db``) every connection waits for a lock up to
    ``SQLITE_BUSY_TIMEOUT_MS`` instead of failing with "database is locked"
    (``_sqlite_busy_timeout``). Several grading machines can share a PostgreSQL
    gradebook: ``nbgrader_config.py`` sets ``CourseDirectory.db_url`` from
    ``FP_GRADEBOOK_URL``.

Kernels
    A sandboxed kernel does not notice that its grader died (``kill -9``, the
    OOM killer, a closed terminal): it would wait forever for the next
    cell. ``GraderBoundKernelManager`` (``c.Execute.kernel_manager_class``)
    starts every kernel so that the kernel's launcher gets SIGKILL when the
    grading process that started it dies (``PR_SET_PDEATHSIG``); the sandbox
    takes everything inside it down with its launcher. Each grading process
    keeps its kernels' sockets in a folder of its own (``fp-grade-<pid>-*`` in
    the temporary folder), removed when it ends; the next grading command
    removes those of processes that were killed before they could.

Grades an instructor entered by hand (``manual_score``) are never touched:
nbgrader's ``SaveAutoGrades`` only writes ``auto_score``.
"""
from __future__ import annotations

import asyncio
import atexit
import fcntl
import gc
import glob
import importlib
import os
import re
import shutil
import signal
import socket
import sqlite3
import sys
import tempfile
import threading
import time
import traceback
import uuid

import jupyter_core.utils

from nbgrader.converters import Autograde
from nbgrader.converters.base import NbGraderException
from nbgrader.utils import remove, rmtree
from sqlalchemy import event
from sqlalchemy.engine import Engine
from traitlets import Bool, Float, Integer, default

from . import folderwatch, gradelog, sharedqueue
from .notes import MARKER
from .sandbox import sweep_cgroups
from .warm import Template as WarmTemplate
from .warm import WarmKernelManager
from .warm import _libc as warm_libc
from .warm import available as warm_available
from .warm import set_name

SHARD_ENV = "FP_GRADING_SHARD"
WORKERS_ENV = "FP_GRADING_WORKERS"
SQLITE_BUSY_TIMEOUT_MS = 120_000
_DISCARDED = ".fp-discarded-"  # prefix of a folder renamed away before its deletion
_ERROR_LINE = re.compile(r"There was an error processing assignment '(.*)' for student '(.*)'")


# --------------------------------------------------------------- gradebook
@event.listens_for(Engine, "connect")
def _sqlite_busy_timeout(dbapi_connection, _record):
    """Several graders write the same gradebook.db: wait for the lock, do not fail.

    (The rollback journal is kept: nbgrader's transactions are short, and WAL
    would add -wal/-shm files beside gradebook.db, so that copying the file
    while grading no longer gives a complete backup.)
    """
    if isinstance(dbapi_connection, sqlite3.Connection):
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()


class _EngineCache:
    """One database engine per grading process, not one per ``Gradebook()``.

    nbgrader opens the gradebook a dozen times per notebook (``with Gradebook(url)``), and
    each time makes a new SQLAlchemy engine, lists the tables, runs ``create_all`` and
    compiles every query afresh (an engine's compiled-query cache dies with it). While an
    ``nbgrader autograde`` grades, the first ``Gradebook`` of a process does all that; the
    later ones of the same process reuse its engine (its connection pool and compiled
    queries), each with a session of its own, and ``close`` returns their connections to the
    pool instead of disposing of the engine. A forked worker never uses its parent's engine
    (the cache is per process id) and drops its inherited copies without closing their
    connections (which are the parent's: closing a PostgreSQL one would end its session)."""

    _engines: dict = {}  # (pid, url) -> engine
    _original = None

    @classmethod
    def install(cls) -> None:
        import nbgrader.api as api

        if cls._original is not None:
            return
        cls._original = (api.Gradebook.__init__, api.Gradebook.close)
        original_init, original_close = cls._original
        os.register_at_fork(after_in_child=cls._forget_inherited)

        def init(gb, db_url, course_id="default_course", authenticator=None):
            key = (os.getpid(), db_url)
            engine = cls._engines.get(key)
            if engine is None:
                original_init(gb, db_url, course_id=course_id, authenticator=authenticator)
                cls._engines[key] = gb.engine
                return
            from sqlalchemy.orm import scoped_session, sessionmaker

            gb.engine = engine
            gb.db = scoped_session(sessionmaker(autoflush=True, bind=engine, future=True))
            gb.check_course(course_id=course_id)
            gb.course_id = course_id
            gb.authenticator = authenticator

        def close(gb):
            if any(engine is gb.engine for engine in cls._engines.values()):
                gb.db.remove()  # the connection goes back to the pool; the engine stays
            else:
                original_close(gb)

        api.Gradebook.__init__, api.Gradebook.close = init, close

    @classmethod
    def _forget_inherited(cls) -> None:
        for engine in cls._engines.values():
            engine.dispose(close=False)  # (the parent's connections: never closed from here)
        cls._engines = {}


class _CellSchema:
    """What nbgrader's cell-metadata check calls as ``jsonschema``, with ``validate`` made once
    per schema. ``jsonschema.validate`` checks the schema itself against its meta-schema and
    builds a validator on every call: nbgrader calls it for every cell of every notebook,
    twice per notebook (37 ms a notebook). Here the schema (nbgrader's own file) is checked
    once and its validator kept; each cell's metadata is validated and the same error
    (``best_match``) raised as before. Everything else is jsonschema's own."""

    def __init__(self, module):
        self._module = module
        self._validators: dict = {}  # id(schema) -> (schema, validator): the schema is held

    def __getattr__(self, name):
        return getattr(self._module, name)

    def validate(self, instance, schema, cls=None, *args, **kwargs):
        if cls is not None or args or kwargs:
            return self._module.validate(instance, schema, cls, *args, **kwargs)
        held = self._validators.get(id(schema))
        if held is None or held[0] is not schema:
            kind = self._module.validators.validator_for(schema)
            kind.check_schema(schema)
            held = self._validators[id(schema)] = (schema, kind(schema))
        error = self._module.exceptions.best_match(held[1].iter_errors(instance))
        if error is not None:
            raise error

    @classmethod
    def install(cls) -> None:
        import nbgrader.nbgraderformat.common as common

        if not isinstance(common.jsonschema, cls):
            common.jsonschema = cls(common.jsonschema)


# ---------------------------------------------------------------- kernels
_PR_SET_PDEATHSIG = 1


def _die_with(parent: int):
    """A ``preexec_fn``: the child gets SIGKILL when ``parent`` (this process) dies."""
    libc = warm_libc()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the grader died before prctl took effect
            os._exit(1)
    return preexec


_SOCKETS: dict = {}  # pid -> this process's kernel socket folder
_KERNEL_FOLDERS: set = set()  # (pid, folder) of this process's kernels not yet cleaned up
_SOCKET_PREFIX = "fp-grade-"  # then the pid of the process that made the folder


def socket_folder() -> str:
    """A folder private to this process (a forked worker gets its own) for its kernels' sockets."""
    pid = os.getpid()
    if pid not in _SOCKETS:
        _sweep_socket_folders()
        _SOCKETS[pid] = tempfile.mkdtemp(prefix=f"{_SOCKET_PREFIX}{pid}-")
        atexit.register(remove_socket_folder)
    return _SOCKETS[pid]


def _sweep_socket_folders() -> None:
    """Remove the socket folders of grading processes that are gone (killed with SIGKILL, they
    could not remove their own). Their kernels died with them (``PR_SET_PDEATHSIG``)."""
    for folder in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{_SOCKET_PREFIX}*-*")):
        owner = os.path.basename(folder)[len(_SOCKET_PREFIX):].split("-", 1)[0]
        if not owner.isdigit():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:  # gone (a live process of another user raises PermissionError)
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass


def remove_socket_folder() -> None:
    """This process's socket folder, and those of its kernels that were never cleaned up (a
    kernel whose notebook was abandoned: its manager's cleanup never ran)."""
    pid = os.getpid()
    folder = _SOCKETS.pop(pid, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    for owner, kernel_folder in list(_KERNEL_FOLDERS):
        if owner == pid:
            _KERNEL_FOLDERS.discard((owner, kernel_folder))
            shutil.rmtree(kernel_folder, ignore_errors=True)


class GraderBoundKernelManager(WarmKernelManager):
    """``AsyncKernelManager`` whose kernels die with the process that started them, whose
    ``ipc`` sockets live in a folder of their own (``fp-grade-<pid>-*``, the only host folder
    a sandboxed kernel can write to, so one student's kernel never sees another's files),
    removed with the kernel, and whose sandboxes' cgroups are removed once the kernel is gone."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._own_folder = None
        if self.transport == "ipc":
            socket_folder()  # (sweeps the folders that killed graders left behind)
            # at the top of the temporary folder, named after this process (so a sweep finds it if
            # this process is killed), and short: a Unix socket's path has at most 107 characters
            self._own_folder = tempfile.mkdtemp(prefix=f"{_SOCKET_PREFIX}{os.getpid()}-")
            _KERNEL_FOLDERS.add((os.getpid(), self._own_folder))
            self.ip = os.path.join(self._own_folder, "kernel")

    def _warm_preexec(self):
        # PR_SET_PDEATHSIG fires when the launching *thread* ends: only bind kernels started by
        # the main thread (nbgrader's command line), never by some short-lived thread.
        if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
            return _die_with(os.getpid())
        return None

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        if "preexec_fn" not in kw and self._warm_preexec() is not None:
            kw["preexec_fn"] = self._warm_preexec()
        out = await super()._async_launch_kernel(kernel_cmd, **kw)
        watch = folderwatch.watcher() if self._own_folder else None
        proc = getattr(self.provisioner, "process", None)
        if watch is not None and proc is not None:
            # the folder is writable to the kernel for its sockets only: anything else kills it
            watch.watch(self._own_folder, proc.kill)
        return out

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        if not restart and self._own_folder and folderwatch.watcher() is not None:
            folderwatch.watcher().forget(self._own_folder)
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self._own_folder:
            shutil.rmtree(self._own_folder, ignore_errors=True)  # whatever the kernel left there
            _KERNEL_FOLDERS.discard((os.getpid(), self._own_folder))
        # A kernel shut down at once (c.Execute.shutdown_kernel = "immediate") takes its
        # sandbox's launcher with it before the launcher can remove its (now empty) cgroups.
        sweep_cgroups()


# ---------------------------------------------------------------- helpers
class Turns:
    """Which submission a free worker grades next: 0, 1, 2, ... up to ``total`` - 1, each given once.

    The count is kept in a small file made before the workers are forked (in this process's
    socket folder, which the next grading command sweeps if this one is killed). A worker
    takes a turn under an exclusive ``flock`` on its own opening of the file (a lock that the
    system drops when the process holding it dies, so a worker killed at that instant blocks
    no one), reads the count and writes it back one higher. Works wherever ``fork`` does
    (Linux, macOS)."""

    def __init__(self, total: int):
        fd, self.path = tempfile.mkstemp(prefix="turns-", dir=socket_folder())
        os.close(fd)
        self.total = total

    def __iter__(self):
        fd = os.open(self.path, os.O_RDWR)  # (opened here, after the fork: a lock of this process's own)
        try:
            while (turn := self._take(fd)) is not None:
                yield turn
        finally:
            os.close(fd)

    def _take(self, fd: int) -> int | None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            turn = int(os.pread(fd, 32, 0) or b"0")
            if turn >= self.total:
                return None
            os.pwrite(fd, b"%d" % (turn + 1), 0)  # (the count only grows: no shorter text to cut)
            return turn
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


def default_workers(cores: int | None = None, memory: int | None = None) -> int:
    """Two workers a core where the memory allows it, else one a core.

    A worker spends part of each notebook waiting, not computing: for its sandbox to be set up,
    its kernel to answer, its re-check's runner to start. A second worker a core fills those
    gaps (16 attention notebooks on two cores: 8.7 s with two workers, 7.9 s with four; 48:
    22.1 s and 19.6 s; six workers were no faster). Each worker may hold a kernel and a
    re-check's runner at once, each capped at the sandbox's memory (``sandbox.MEMORY_MB``):
    the extra workers are only added while that worst case fits in the machine's memory
    (``memory``, bytes; default: the physical memory)."""
    from .sandbox import MEMORY_MB

    cores = cores or os.cpu_count() or 1
    if memory is None:
        try:
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # (not POSIX)
            memory = 0
    fits = memory // (2 * MEMORY_MB * 2**20)
    return max(cores, min(2 * cores, fits))


def threads_per_worker(workers: int, cores: int | None = None, limit: str | None = None) -> int:
    """Threads for each worker's torch: the cores shared out, but never more than an
    ``OMP_NUM_THREADS`` the grader was started with (``limit``; default: the environment's)."""
    cores = cores or os.cpu_count() or 1
    share = max(1, cores // max(1, workers))
    limit = os.environ.get("OMP_NUM_THREADS", "") if limit is None else limit
    return min(share, int(limit)) if limit.strip().isdigit() and int(limit) > 0 else share


def looks_like_cli(argv: list[str]) -> bool:
    """Was this process started as ``nbgrader autograde ...`` (script or ``-m nbgrader``)?"""
    if len(argv) < 2 or argv[1] != "autograde":
        return False
    name = os.path.basename(argv[0])
    return name in ("nbgrader", "nbgrader.exe", "jupyter-nbgrader") or (
        name == "__main__.py" and os.path.basename(os.path.dirname(argv[0])) == "nbgrader")


def _discard(path: str) -> None:
    """Delete a folder so that no kill can leave part of it in place: rename, then delete."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f"{_DISCARDED}{name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    rmtree(doomed)


def _sweep_discarded(dest: str) -> None:
    """Remove what a killed run left of a folder it was deleting."""
    parent, name = os.path.split(dest)
    for leftover in glob.glob(os.path.join(glob.escape(parent), f"{_DISCARDED}{glob.escape(name)}-*")):
        rmtree(leftover)


# ---------------------------------------------------------------- converter
class ParallelAutograde(Autograde):
    """nbgrader's ``Autograde``, graded by several processes and safe to kill and rerun."""

    workers = Integer(
        help="Grading processes (each takes the next submission as it frees up, one notebook at a time). "
             f"Default: ${WORKERS_ENV}, else two a core where the memory holds every sandbox at its cap "
             "(default_workers), else one a core. 1: grade serially as stock nbgrader does."
    ).tag(config=True)

    @default("workers")
    def _workers_default(self) -> int:
        value = os.environ.get(WORKERS_ENV, "").strip()
        if not value:
            return default_workers()
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"{WORKERS_ENV} must be a whole number of grading processes, not {value!r}") from None

    shared_queue = Bool(
        help="Share the submissions out through the gradebook (sharedqueue.py): any number of "
             "`nbgrader autograde` runs, on any machines sharing the course folder and the database, "
             "take students one at a time under a lease. Default: on for a PostgreSQL gradebook."
    ).tag(config=True)
    lease_seconds = Float(120.0, help="Seconds a student stays with a grader that stops renewing its lease "
                                      "(a dead machine) before another takes it over.").tag(config=True)

    @default("shared_queue")
    def _shared_queue_default(self) -> bool:
        return sharedqueue.shared(self.coursedir.db_url or "")

    verbose = Bool(help="Log every step of every notebook, as stock nbgrader does (also with "
                        "--log-level=DEBUG); by default the log is one line per submission, errors "
                        "and a summary (gradelog.py). Default: on when $FP_GRADING_VERBOSE is set.").tag(config=True)

    @default("verbose")
    def _verbose_default(self) -> bool:
        return bool(os.environ.get("FP_GRADING_VERBOSE"))

    # ---------------------------------------------------------- the log (gradelog.py)
    def _start_log(self) -> None:
        self._results: list = []
        self._total = len(self.assignments)
        self._results_lock = threading.Lock()
        if not self.verbose and not gradelog.detailed(self.log):
            gradelog.quiet(self.log)

    def _record(self, res: dict) -> None:
        with self._results_lock:
            self._results.append(res)
            done = len(self._results)
        self.log.info(gradelog.line(done, self._total, res), extra={"fp_result": True})

    def _end_log(self, failed=()) -> None:
        """The summary. A submission this run did not grade is "already graded" when its graded
        folder is complete (written, without the marker of a grading in progress): another grader
        sharing the class finished it (one killed later included: what it finished counts), or an
        earlier run did (a plain rerun skips it); else it is "not graded"."""
        done = {(r.get("assignment"), r.get("student")) for r in self._results}
        missing, elsewhere = [], []
        for submission in sorted(self.assignments):
            ids = self._ids(submission)
            if ids is not None and ids not in done:
                (elsewhere if self._finished(submission) else missing).append(f"{ids[1]} ({ids[0]})")
        self.log.info(gradelog.summary(self._results, self._total, list(failed), sorted(missing), sorted(elsewhere)),
                      extra={"fp_result": True})

    # ---------------------------------------------------------- the batch
    def _can_fork(self, workers: int) -> bool:
        return workers > 1 and not os.environ.get(SHARD_ENV) and looks_like_cli(sys.argv) and hasattr(os, "fork")

    def convert_notebooks(self) -> None:
        _EngineCache.install()
        _CellSchema.install()
        if os.environ.get(SHARD_ENV):  # a worker of this round (forked): the command keeps the log
            return self._convert()
        self._start_log()
        failed: list = []
        try:
            self._convert(failed)
        except NbGraderException as e:
            failed.append(str(e).removeprefix("Grading failed for: "))
            raise
        finally:
            self._end_log(failed)

    def _convert(self, failed: list | None = None) -> None:
        workers = min(self.workers, len(self.assignments))
        if self.shared_queue and self.assignments:
            return self._convert_shared(workers)
        if not self._can_fork(workers):
            return super().convert_notebooks()
        turns = Turns(len(self.assignments))
        try:
            self._run_workers(workers, lambda: self._grade_turns(turns))
        finally:
            turns.close()

    def _grade_turns(self, turns) -> None:
        """In a worker: grade the submissions (by their index in sorted order) that ``turns``
        gives, one at a time, each with nbgrader's own loop; fail at the end if any failed."""
        everything = dict(self.assignments)
        order = sorted(everything)
        graded, failed = 0, []
        try:
            for turn in turns:
                submission = order[turn]
                self.assignments = {submission: everything[submission]}
                try:
                    Autograde.convert_notebooks(self)  # (it logs which student failed, and why)
                except NbGraderException:
                    failed.append(submission)
                graded += 1
        finally:
            self.assignments = everything
        self.log.info("Grader %s: %d submission(s)", os.environ.get(SHARD_ENV, ""), graded)
        if failed:
            raise NbGraderException("Grading failed for: " + ", ".join(failed))

    # ------------------------------------------------- a class shared out through the database
    def _convert_shared(self, workers: int) -> None:
        queue = sharedqueue.SharedQueue(self.coursedir.db_url, self.lease_seconds)
        keys = {}
        for submission in self.assignments:
            ids = self._ids(submission)
            if ids is not None:
                keys[ids] = submission
        queue.add(keys)
        self.log.info("Sharing %d submission(s) out through the gradebook (lease %g s) with %d worker(s) here",
                      len(keys), self.lease_seconds, max(1, workers))
        if not self._can_fork(workers):
            return self._drain(queue, keys)
        queue.close()  # (no connection crosses a fork: each worker opens its own)
        self._run_workers(workers, lambda: self._drain(queue.reopen(), keys))

    def _ids(self, submission: str) -> tuple | None:
        m = re.match(self._format_source("(?P<assignment_id>.*)", "(?P<student_id>.*)", escape=True), submission)
        return None if m is None else (m["assignment_id"], m["student_id"])

    def _drain(self, queue, keys: dict) -> None:
        """Grade what the queue gives this process until nothing of this run is left anywhere."""
        everything = dict(self.assignments)
        order = sorted(keys)
        failed = []
        poll = max(0.5, min(5.0, self.lease_seconds / 4))
        try:
            while True:
                key, busy = queue.claim(order)
                if key is None:
                    if busy == 0:
                        break
                    time.sleep(poll)  # others are grading the rest: take over what they leave
                    continue
                self.assignments = {keys[key]: everything[keys[key]]}
                ok = False
                try:
                    Autograde.convert_notebooks(self)
                    ok = True
                except NbGraderException:
                    failed.append(key)
                finally:
                    queue.finish(key, ok)
        finally:
            queue.close()
            self.assignments = everything
        if failed:
            raise NbGraderException("Grading failed for: " + ", ".join(f"{s} ({a})" for a, s in failed))

    def _run_workers(self, workers: int, target) -> None:
        """Fork ``workers`` workers, each running ``target()`` (which grades until nothing is left),
        stream their logs, wait for them; fail naming the students that could not be graded."""
        submissions = sorted(self.assignments)
        threads = str(threads_per_worker(workers))
        self.log.info("Grading %d submissions with %d workers (%s thread(s) each)",
                      len(submissions), workers, threads)
        # The workers' template (warm.py) starts now, so that its imports overlap these: what
        # every worker needs is loaded once, here, and shared by fork, so that a worker starts
        # grading at once instead of paying for `python -m nbgrader` again. Where the workers'
        # re-check decides in a service forked from the template (verdicts.Service), this
        # process never needs torch; elsewhere each worker would import it: it is imported here.
        if not (self._start_templates(workers, threads) and self._decides_in_service()):
            from . import probes, trusted  # noqa: F401

            probes.load()
        import IPython  # noqa: F401 (jupyter_client's kernel-spec lookup imports it: 0.44 s in each worker)
        # What this process has made so far is moved out of the collector's generations: the
        # workers' collections then walk only what each makes itself, not nbgrader's objects (nor
        # torch's, where it is imported here), which they would also copy, page by page, by
        # writing their collector's marks (with torch: 0.5 s and 0.7 CPU-s less for 16 notebooks
        # on two workers).
        gc.freeze()
        pids, pipes, pumps, errors, previous, templates = [], [], [], {}, {}, []
        try:
            # A plain `kill` (SIGTERM) or a hang-up of this process stops the workers too.
            for sig in (signal.SIGTERM, signal.SIGHUP):
                previous[sig] = signal.signal(sig, self._stop_workers(pids))
            sys.stdout.flush()
            sys.stderr.flush()
            for w in range(workers):  # every fork before any thread starts here
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:  # the worker: never returns
                    os.close(read)
                    self._work(w, workers, write, threads, target)
                os.close(write)
                pids.append(pid)
                pipes.append(read)
            templates = WarmTemplate.hand_over()
            for w, read in enumerate(pipes):
                errors[w] = []
                pump = threading.Thread(target=self._pump, args=(read, f"[grader {w + 1}/{workers}] ", errors[w],
                                                                 self._record), daemon=True)
                pump.start()
                pumps.append(pump)
            codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        except BaseException as exc:  # Ctrl-C, a signal (see _stop_workers)
            if isinstance(exc, KeyboardInterrupt):
                self.log.error("Interrupted: stopping the graders")
            self._terminate(pids)
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for pump in pumps:
                pump.join(timeout=10)
            self._reap_templates(templates or WarmTemplate.hand_over())
            # What a stopped worker's sandboxes left running (one it was still setting up: see
            # sandbox.sweep_cgroups) goes now, not at the next grader's first sandbox.
            sweep_cgroups()

        failed = [w for w, code in enumerate(codes) if code != 0]
        if not failed:
            return
        students = []
        said = {(a, s) for w in errors for a, s in errors[w]}
        for w in failed:
            named = [f"{student} ({assignment})" for assignment, student in errors[w]]
            if not named:  # the worker died before it could say: name what no one finished
                named = [f"{os.path.basename(os.path.dirname(s))} ({os.path.basename(s)})" for s in submissions
                         if not self._finished(s) and self._ids(s) not in said]
                said.update(self._ids(s) for s in submissions if not self._finished(s))
            students += named or [f"grader {w + 1} (exit code {codes[w]})"]
        msg = "Grading failed for: " + ", ".join(students)
        self.log.error(msg)
        raise NbGraderException(msg)

    def _start_templates(self, workers: int, threads: str) -> bool:
        """The workers' template, of the kind their kernels need, started ahead (True: it was)."""
        if not warm_available():
            return False
        sandboxed = self.config.get("Execute", {}).get("kernel_name") == "fp-sandbox"
        try:
            WarmTemplate.start_ahead(workers, sandboxed, {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        except OSError as e:  # (each worker then starts its own when it needs it)
            self.log.warning("Could not start the kernels' templates ahead: %s", e)
            return False
        return True

    def _decides_in_service(self) -> bool:
        """Will the workers' RobustExecute make the re-check's decisions in the template's service?"""
        from .execute import RobustExecute

        execute = RobustExecute(config=self.config)  # (a value from the command line is parsed by its trait)
        return bool(execute.trusted_verdicts) and execute.recheck_service is not False

    @staticmethod
    def _reap_templates(procs) -> None:
        """Stop the templates started ahead and reap them, once their workers are gone. A
        template would end by itself when its last connection closes, but only after the step
        of its idle work it is in (``warm._serve``: up to 0.6 s of imports and compiling for
        kernels that will never come); it runs no student code and holds nothing to save."""
        for proc in procs:
            proc.kill()
            proc.wait()

    def _work(self, w: int, workers: int, output: int, threads: str, target) -> None:
        """In a forked worker: grade (``target()``), log into ``output``, exit."""
        code = 1
        try:
            WarmTemplate.adopt(w)
            set_name(f"fp-grader-{w + 1}")  # (as ps, top and perf show it)
            if sys.platform.startswith("linux"):  # die with the command, even on kill -9
                _die_with(os.getppid())()
            for sig in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.close(output)
            os.environ.update({SHARD_ENV: f"{w + 1}/{workers}", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
            if "torch" in sys.modules:  # (else torch reads OMP_NUM_THREADS where it is first imported)
                sys.modules["torch"].set_num_threads(int(threads))
            asyncio.set_event_loop(None)  # kernels are driven by an event loop of this process's own
            jupyter_core.utils._loop.set(None)
            target()
            code = 0
        except NbGraderException:
            pass  # nbgrader has logged which students failed
        except BaseException:  # noqa: BLE001 (anything: report it, never return into the parent's code)
            traceback.print_exc()
        finally:
            try:
                remove_socket_folder()  # (os._exit skips atexit)
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    @staticmethod
    def _pump(read: int, prefix: str, errors: list, record=None) -> None:
        with os.fdopen(read, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                res = gradelog.decode(line.rstrip("\n"))
                if res is not None and record is not None:
                    record(res)  # a submission is done: one line, counted for the whole class
                    continue
                m = _ERROR_LINE.search(line)
                if m:
                    errors.append(m.groups())
                sys.stderr.write(prefix + line)
                sys.stderr.flush()

    def _stop_workers(self, pids):
        def handler(signum, _frame):
            # No waiting here: the handler may run inside os.waitpid.
            self.log.error("Stopped (signal %d): stopping the graders", signum)
            self._kill(pids)
            raise SystemExit(128 + signum)
        return handler

    @staticmethod
    def _kill(pids) -> None:
        """Stop the workers at once. Nothing is lost: their kernels die with them, and the
        submissions they were grading keep the marker, so the next run grades them again.
        (A gentler signal would not stop them: nbclient takes SIGINT and SIGTERM during a
        notebook for that notebook's failure, and nbgrader goes on with the next student.)"""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # already reaped

    @classmethod
    def _terminate(cls, pids) -> None:
        cls._kill(pids)
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    def _finished(self, submission: str) -> bool:
        m = re.match(self._format_source("(?P<assignment_id>.*)", "(?P<student_id>.*)", escape=True), submission)
        if m is None:
            return False
        dest = self._format_dest(m["assignment_id"], m["student_id"])
        return os.path.isdir(dest) and not os.path.exists(os.path.join(dest, MARKER))

    # ------------------------------------------------- one submission, restartable
    def init_destination(self, assignment_id: str, student_id: str) -> bool:
        if self.coursedir.student_id_exclude and student_id in self.coursedir.student_id_exclude.split(","):
            return False
        dest = os.path.normpath(self._format_dest(assignment_id, student_id))
        _sweep_discarded(dest)
        marker = os.path.join(dest, MARKER)
        if self.coursedir.notebook_id != "*":  # --notebook: nbgrader replaces single files
            if os.path.exists(marker):
                self.log.warning("Grading again (an earlier run stopped in the middle of it): %s", dest)
                for notebook in self.notebooks:
                    name = os.path.splitext(os.path.basename(notebook))[0] + self.exporter.file_extension
                    if os.path.exists(os.path.join(dest, name)):
                        remove(os.path.join(dest, name))
                return True
            return super().init_destination(assignment_id, student_id)

        if not os.path.exists(dest):
            return True
        if os.path.exists(marker):
            reason = "an earlier run stopped in the middle of it"
        elif self.force:
            reason = "--force"
        else:
            new = self.coursedir.get_existing_timestamp(self._format_source(assignment_id, student_id))
            old = self.coursedir.get_existing_timestamp(dest)
            reason = "newer submission" if new is not None and old is not None and new > old else None
        if reason is None:
            self.log.info("Skipping existing assignment: %s", dest)
            return False
        self.log.warning("Removing existing assignment (%s): %s", reason, dest)
        _discard(dest)
        return True

    def init_assignment(self, assignment_id: str, student_id: str) -> None:
        self._submission_started = time.monotonic()
        dest = self._format_dest(assignment_id, student_id)
        os.makedirs(dest, exist_ok=True)
        marker = os.path.join(dest, MARKER)
        # A marker left by an earlier run stays when this one (--notebook) grades only some of
        # the submission's notebooks: the others may be the half-graded ones.
        submitted = {os.path.basename(p) for p in glob.glob(os.path.join(
            glob.escape(self._format_source(assignment_id, student_id)), "*.ipynb"))}
        self._marker_kept = os.path.exists(marker) and not submitted <= {os.path.basename(n) for n in self.notebooks}
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(f"being graded by {socket.gethostname()} pid {os.getpid()} since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._create_student(student_id)
        super().init_assignment(assignment_id, student_id)

    def _create_student(self, student_id: str) -> None:
        """Add the student to the gradebook before nbgrader does, so that no two workers (or
        machines) race to insert them. Workers that take the next submission as they free up
        start on a student's assignments together; on a gradebook that does not know the
        student yet, nbgrader's ``update_or_create_student`` (look up, then insert) fails on the
        unique id for all but one of them, and logs a database traceback for each (a screenful
        per student, before the first result, with nothing wrong). Here the row is inserted
        only if it is absent, in one statement (``INSERT ... ON CONFLICT DO NOTHING``: SQLite
        and PostgreSQL); nbgrader's own call then finds the student. Another database: nbgrader's
        insert, tried again when another process was first."""
        from nbgrader.api import Gradebook, InvalidEntry, Student

        if not self.create_student:
            return
        for attempt in range(5):
            try:
                with Gradebook(self.coursedir.db_url, self.coursedir.course_id) as gb:
                    dialect = gb.engine.dialect.name
                    if dialect not in ("sqlite", "postgresql"):
                        gb.update_or_create_student(student_id)
                        return
                    insert = importlib.import_module(f"sqlalchemy.dialects.{dialect}").insert
                    gb.db.execute(insert(Student.__table__).values(id=student_id).on_conflict_do_nothing())
                    gb.db.commit()
                return
            except InvalidEntry:  # another process inserted them first: the next try finds them
                time.sleep(0.05 * (attempt + 1))

    def _report(self, assignment_id: str, student_id: str) -> None:
        """One result for the log: score (from the gradebook), time and the grader's notes."""
        from nbgrader.api import Gradebook

        score = max_score = None
        try:
            with Gradebook(self.coursedir.db_url) as gb:
                sub = gb.find_submission(assignment_id, student_id)
                score, max_score = float(sub.score), float(sub.max_score)
        except Exception as e:  # noqa: BLE001 (the log must never stop grading)
            self.log.debug("no score for %s/%s: %s", assignment_id, student_id, e)
        res = gradelog.result(assignment_id, student_id, score, max_score,
                              time.monotonic() - getattr(self, "_submission_started", time.monotonic()),
                              gradelog.notes_of(self.coursedir.root, assignment_id, student_id))
        if os.environ.get(SHARD_ENV):  # a worker: the command that started it counts and prints
            sys.stderr.write(gradelog.encode(res) + "\n")
            sys.stderr.flush()
        elif hasattr(self, "_results"):
            self._record(res)

    def set_permissions(self, assignment_id: str, student_id: str) -> None:
        super().set_permissions(assignment_id, student_id)
        self._report(assignment_id, student_id)
        # nbgrader calls this once every notebook of the submission is written.
        if not getattr(self, "_marker_kept", False):
            marker = os.path.join(self._format_dest(assignment_id, student_id), MARKER)
            if os.path.exists(marker):
                os.remove(marker)
