"""The trusted re-check's decisions, made in the grading process or in a service beside it.

``decide`` is the re-check's trusted side: the plan's pieces run in a runner (``trusted.recheck``),
their results compared with the course's reference, the verdict made final in every test cell
(``trusted.apply``). Where it runs:

- **grading** (``nbgrader autograde``): in the grader's worker itself, which imported torch before
  it forked (the reference's results need it);
- **the students' check command**: its process never imports torch. Its kernel and its runner are
  forked from the template (``warm``), which has torch imported, and so is its trusted side: a
  third child of the template, ``serve``, started beside the kernel (``Service``). It is trusted
  code only (the template's clean state, then this module; it never runs a cell of the notebook
  and never loads the student's code) and it asks the template for the runner as the grader does.
  While the kernel runs the cells it makes the plan and computes the reference's results, on the
  other core; when the cells are done it gets the executed notebook, decides, and sends back the
  test cells' final outputs. The check command's process thus imports neither torch (1.4 s) nor
  what torch's first backward pass imports, and its verdicts come from the same functions as the
  grader's.

Where the template cannot be used (no fork, not Linux, ``FP_GRADING_COLD``), the check decides in
its own process, as the grader does.

The service's protocol, one JSON document a line on its standard input and output: the check
sends ``{"nb", "seed", "sources"}`` and the service answers ``{"tested"}`` (test cell index ->
the pieces it tests); then the check sends ``{"nb" (executed), "hung", "slow", "cell_limit",
"limits", "sandboxed"}`` and the service answers ``{"outputs" (test cell index -> outputs),
"failed" (index -> reason), "notes"}``. A service that dies, answers nonsense or stays silent
(``ANSWER_WAIT`` beyond the re-check's own limit) raises ``ServiceError``: the check then decides
in its own process.
"""
from __future__ import annotations

import json
import os
import socket
import sys

from . import probes, sandbox, trusted, warm


def tested_pieces(nb) -> dict:
    """Test cell index -> the graded pieces it tests (names that have a probe)."""
    return trusted.grade_cell_names(nb, probes.load())


def decide(nb, plan, hung: dict, slow, cell_limit: float, limits, sandboxed: bool) -> tuple[dict, list]:
    """Run the re-check of ``plan`` and make its verdict final in ``nb``'s test cells.

    ``hung``: piece -> where it did not return in the kernel (it is not run again); ``slow``:
    indices of cells that ran past their timeout; ``cell_limit``: the kernel's seconds per cell.
    Returns (test cell index -> why it fails, the notes for an instructor)."""
    plan.hung = {p: f"it did not return within {cell_limit} s in {where} in your notebook, so it was not "
                    "run again" for p, where in hung.items()}
    plan.slow, plan.cell_timeout = set(slow), float(cell_limit)
    command = warm.Runner(sandbox.recheck_command(sandboxed), sandboxed)
    outcomes, flags = trusted.recheck(plan, command, limits)
    failed, flagged = trusted.apply(nb, plan, outcomes)
    notes = sorted(set(flags) | {f for fs in flagged.values() for f in fs})
    return failed, notes


def reference_ahead(plan) -> None:
    """Compute the reference's results of every piece that is compared with them now (``decide``
    would compute them when it first needs them)."""
    for check in plan.checks:
        if check.probe.judge is None and not check.expected:
            check.expected = trusted.reference_results(check)


# ================================================================ the check command's side
ANSWER_WAIT = 120.0  # seconds the service may take to answer, beyond the re-check's own limit


class ServiceError(RuntimeError):
    """The service could not be started, died, answered nonsense or stayed silent."""


class Service:
    """The trusted side of one notebook's check, in a child of the template (``serve``)."""

    def __init__(self, nb, seed: int, sources: set | None):
        import nbformat

        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.proc = warm.launch("verdicts", sandboxed=False, fds=[in_r, out_w, 2], cwd=os.getcwd(),
                                    env={**os.environ, "KINETO_LOG_LEVEL": "5", "PYTHONDONTWRITEBYTECODE": "1"})
        except warm.WarmError as e:
            os.close(in_w)
            os.close(out_r)
            raise ServiceError(str(e)) from e
        finally:
            os.close(in_r)
            os.close(out_w)
        self._to, self._from = os.fdopen(in_w, "w"), os.fdopen(out_r, "r")
        self._tested = None
        self._send({"nb": nbformat.writes(nb), "seed": seed, "sources": sorted(sources) if sources else None})

    def _send(self, doc: dict) -> None:
        try:
            self._to.write(json.dumps(doc) + "\n")
            self._to.flush()
        except OSError as e:
            raise ServiceError(f"the re-check's service is gone ({e})") from e

    def _receive(self, *keys: str, wait: float = ANSWER_WAIT) -> dict:
        import select

        if not select.select([self._from], [], [], wait)[0]:  # (one line per request: nothing is buffered)
            raise ServiceError(f"the re-check's service did not answer within {wait:g} s")
        line = self._from.readline()
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or any(k not in doc for k in keys):
            raise ServiceError("the re-check's service ended without an answer" if not line else
                               f"the re-check's service answered {line[:200]!r}")
        return doc

    def tested(self) -> dict:
        if self._tested is None:
            self._tested = {int(k): v for k, v in self._receive("tested")["tested"].items()}
        return self._tested

    def decide(self, nb, hung: dict, slow, cell_limit: float, limits, sandboxed: bool) -> tuple[dict, list]:
        """As ``decide``, in the service: the test cells' outputs of ``nb`` are replaced by its."""
        import nbformat

        self.tested()
        self._send({"nb": nbformat.writes(nb), "hung": hung, "slow": sorted(slow), "cell_limit": cell_limit,
                    "limits": vars(limits), "sandboxed": sandboxed})
        doc = self._receive("outputs", "failed", "notes", wait=limits.total + ANSWER_WAIT)
        for index, outputs in doc["outputs"].items():
            nb.cells[int(index)]["outputs"] = [nbformat.from_dict(o) for o in outputs]
        return {int(k): v for k, v in doc["failed"].items()}, list(doc["notes"])

    def close(self) -> None:
        for f in (self._to, self._from):
            try:
                f.close()
            except OSError:
                pass
        self.proc.kill()
        self.proc.wait()


# ================================================================ the service's side
class _Parent:
    """The template, seen from a child of its own: what ``warm.Template`` needs of its process."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except OSError:
            pass

    def wait(self, timeout=None):
        return None


def serve(template: socket.socket) -> None:
    """The service (a child of the template, with ``template`` its own connection to it)."""
    import nbformat

    t = warm.Template(False, _proc=_Parent(os.getppid()), _sock=template)
    t._child = False  # (its parent: alive() looks at /proc)
    warm.Template._current[(os.getpid(), False)] = t
    first = json.loads(sys.stdin.readline())
    nb = nbformat.reads(first["nb"], as_version=4)
    _answer({"tested": tested_pieces(nb)})
    plan = trusted.make_plan(nb, int(first["seed"]), set(first["sources"]) if first["sources"] else None)
    reference_ahead(plan)
    line = sys.stdin.readline()
    if not line:
        return  # (the check ended first)
    second = json.loads(line)
    nb = nbformat.reads(second["nb"], as_version=4)
    plan.nb = nb
    failed, notes = decide(nb, plan, second["hung"], second["slow"], second["cell_limit"],
                           trusted.Limits(**second["limits"]), bool(second["sandboxed"]))
    _answer({"outputs": {i: nb.cells[i].get("outputs", []) for i in plan.graded}, "failed": failed, "notes": notes})


def _answer(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
