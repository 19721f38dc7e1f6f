"""Formgrader's autograde button, off the server's event loop and with a readable result.

Stock nbgrader 0.9.6 (``nbgrader/server_extensions/formgrader/apihandlers.py``,
``AutogradeHandler.post``) calls ``NbGraderAPI.autograde`` (``nbgrader/apps/api.py``)
synchronously inside the Jupyter server's tornado handler: the whole server
(formgrader, JupyterLab, kernels' websockets) stops answering while one
submission is graded, two minutes for a student whose answer hangs. That call
also runs nbgrader's stock ``Autograde`` converter (``nbgrader.apps.api``'s
own name for it, not the ``ParallelAutograde`` that ``nbgrader_config.py``
puts in place for the command line), and returns the whole captured log at the
server's log level (INFO lines of every step, no score; with a DEBUG level, base64
data too), which the dialog (``static/js/manage_submissions.js``,
``autograde_success`` -> ``createLogModal``) prints under "Log Output".

``AutogradeHandler`` here replaces it (``install``, called by ``nbgrader_config.py``
when the formgrader loads the config): the POST runs the instructor's own command,
``nbgrader autograde <assignment> --student <id> --force --create``, in a
subprocess from the server's working folder (so with the same config, sandbox and
notes as on the command line) at a lower CPU priority than the server (``NICENESS``),
waited for in a worker thread, so the event loop keeps serving every other request.
One autograde runs at a time per server (the gradebook is a single SQLite file by
default); a second click waits its turn without blocking anything. The answer keeps
nbgrader's shape (``success``, ``log``, ``error``) so the stock dialog shows it, with
``log`` a short summary: the score in total and per notebook, the tests that lost
points and the grader's notes for that student (``grading_notes/``, see
``sanitize``); ``error`` (on failure) is the tail of the command's stderr.
``score``, ``max_score`` and ``notes`` are also given as fields.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.server_extensions.formgrader import apihandlers
from nbgrader.server_extensions.formgrader.base import BaseApiHandler, check_notebook_dir, check_xsrf
from tornado import web

from .sanitize import NOTES_DIRECTORY

ROUTE = r"/formgrader/api/submission/([^/]+)/([^/]+)/autograde"
# Seconds one autograde may take before it is killed (its kernels die with it).
AUTOGRADE_TIMEOUT = 3600
# How much lower than the server's the grading subprocess's CPU priority is (nice increment).
NICENESS = 10
# One grading at a time, in a thread that only waits for the subprocess.
_GRADER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp-formgrader-autograde")


def _short(line: str, width: int = 300) -> str:
    return line if len(line) <= width else line[:width] + " ..."


def notes_of(root: str, assignment: str, student: str) -> list[str]:
    """The grader's notes on one student's submission, ``<notebook>.ipynb: <note>``."""
    folder = os.path.join(root, NOTES_DIRECTORY, assignment, student)
    notes = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".txt"):
            with open(os.path.join(folder, name)) as f:
                notes += [f"{name[:-4]}.ipynb: {line.strip()}" for line in f if line.strip()]
    return notes


def summary(db_url: str, root: str, assignment: str, student: str) -> dict:
    """Score, tests that lost points and notes of one graded submission, as text and fields."""
    lines, score, max_score = [], None, None
    with Gradebook(db_url) as gb:
        try:
            sub = gb.find_submission(assignment, student)
        except MissingEntry:
            lines.append(f"'{student}' has no graded submission of '{assignment}' in the gradebook.")
        else:
            score, max_score = sub.score, sub.max_score
            lines.append(f"Score: {score:g} / {max_score:g}")
            for nb in sorted(sub.notebooks, key=lambda n: n.name):
                lost = [f"{g.name} ({g.score:g}/{g.max_score:g})" for g in sorted(nb.grades, key=lambda g: g.name)
                        if g.score is not None and g.score < g.max_score]
                text = f"  {nb.name}.ipynb: {nb.score:g} / {nb.max_score:g}"
                lines.append(text + (f"; lost points: {', '.join(lost)}" if lost else ""))
    notes = notes_of(root, assignment, student)
    lines += ["Notes:", *(f"  - {_short(n)}" for n in notes)] if notes else ["Notes: none"]
    return {"log": "\n".join(lines), "score": score, "max_score": max_score, "notes": notes}


def autograde(cwd: str, root: str, db_url: str, assignment: str, student: str,
              timeout: float = AUTOGRADE_TIMEOUT) -> dict:
    """Run ``nbgrader autograde`` for one submission (blocking) and describe the outcome
    in nbgrader's API shape: ``success``, ``log`` (the summary), ``error`` on failure."""
    cmd = [sys.executable, "-m", "nbgrader", "autograde", assignment, f"--student={student}", "--force",
           "--create", f"--CourseDirectory.root={root}"]
    with subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace") as proc:
        try:  # below the server, so that its pages keep their share of the cores (the kernel inherits it)
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + NICENESS))
        except OSError:
            pass
        try:
            _, stderr = proc.communicate(timeout=timeout)
            failed = proc.returncode != 0
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            failed = True
            stderr += f"\nnbgrader autograde did not finish within {timeout:g} s and was stopped"
    result = {"success": not failed, **summary(db_url, root, assignment, student)}
    if failed:
        tail = [_short(line) for line in stderr.splitlines() if line.strip()][-40:]
        result["error"] = "\n".join([f"$ {' '.join(cmd[1:])}", *tail])
    return result


class AutogradeHandler(BaseApiHandler):
    """``POST /formgrader/api/submission/<assignment>/<student>/autograde``, graded in a
    subprocess while the server goes on serving."""

    @web.authenticated
    @check_xsrf
    @check_notebook_dir
    async def post(self, assignment_id, student_id):
        cd = self.coursedir
        cd.parent.load_config_file()  # as nbgrader's handler does: the config may have changed
        self.log.info("formgrader: autograding '%s' for student '%s' (in the background)", assignment_id, student_id)
        result = await asyncio.get_running_loop().run_in_executor(
            _GRADER, autograde, os.getcwd(), os.path.abspath(cd.root), cd.db_url, assignment_id, student_id)
        self.log.info("formgrader: autograded '%s' for student '%s': %s", assignment_id, student_id,
                      result["log"].splitlines()[0])
        self.write(json.dumps(result))


def install() -> None:
    """Put ``AutogradeHandler`` in nbgrader's formgrader routes (before the
    formgrader registers them; a no-op once done)."""
    routes = apihandlers.default_handlers
    for i, route in enumerate(routes):
        if route[0] == ROUTE:
            routes[i] = (ROUTE, AutogradeHandler, *route[2:])
    apihandlers.AutogradeHandler = AutogradeHandler
