"""The trusted re-check's decisions, made in the grading process or in a service beside it.

``decide`` is the re-check's trusted side: the plan's pieces run in a runner (``trusted.recheck``),
their results compared with the course's reference, the verdict made final in every test cell
(``trusted.apply``). Where it runs:

- **wherever kernels are warm** (``nbgrader autograde``'s workers, the students' check command):
  in a service. The grading process never imports torch: its kernels and runners are forked
  from the template (``warm``), which has torch imported, and so is its trusted side: one more
  child of the template, ``serve`` (``Service``), started beside the process's first kernel and
  kept for its later notebooks (every one a grading worker grades). It is trusted code only (the
  template's clean state, then this module; it never runs a cell of a notebook and never loads
  a student's code) and it asks the template for the runners as the grader would. While a
  kernel runs the cells it makes the plan and computes the reference's results, on the other
  core; when the cells are done it gets the executed notebook, decides, and sends back the test
  cells' final outputs. So the check command's process imports neither torch (1.4 s) nor what
  torch's first backward pass imports, the grading command forks its workers without them
  (about 1.4 s sooner; 16 attention notebooks took 1.7 CPU-seconds less), and the verdicts come
  from the same functions as where kernels are cold;
- **where the template cannot be used** (no fork, not Linux, ``FP_GRADING_COLD``, or
  ``c.RobustExecute.recheck_service = False``): in the grading process itself (the grading command
  then imports torch once, before it forks its workers).

The service's protocol, one JSON document a line on its standard input and output, for each
notebook in turn: the grading process sends ``{"nb", "seed", "sources", "ahead"}`` and the service
answers ``{"tested", "rebuilt"}`` (test cell index -> the pieces it tests; the pieces whose state the
grading process reads from the kernel after the last cell, ``kernelstate``); with ``ahead`` (``{"cell_limit",
"limits", "sandboxed"}``) it then starts the re-check at once, beside the cells, on the guess that
none will time out (``Ahead``), and ``{"abandon": true}`` (sent at the kernel's first cell past its
timeout) stops it; then the grading process sends ``{"nb" (executed), "hung", "slow", "cell_limit",
"limits", "sandboxed", "printed"}`` (``printed``: name -> what the kernel printed of that state)
and the service answers ``{"outputs"`` (test cell index -> outputs), ``"failed"`` (index -> reason),
``"notes"}``: from the re-check started ahead where the kernel's
run showed what it guessed, else from one run now. A notebook that ends without
asking for its decision stops the service (the next one gets a new one). When a later notebook
comes to a service whose re-checks imported a module of ``warm.LAZY`` (its reference results, or a
runner that said so), it asks the template, once, to import that module too (``Template.preload``:
a speed hint, never part of a verdict). A service that dies,
answers nonsense or stays silent (``ANSWER_WAIT`` beyond the re-check's own limit) raises
``ServiceError``: the grading process then decides that notebook in its own process.
"""
from __future__ import annotations

import json
import os
import socket
import sys

from . import kernelstate, probes, sandbox, scan, trusted, warm


def tested_pieces(nb) -> dict:
    """Test cell index -> the graded pieces it tests (names that have a probe)."""
    return trusted.grade_cell_names(nb, probes.load())


def rebuilt_pieces(nb) -> list:
    """The graded pieces whose state the grader reads from the kernel after the last cell, so that
    the re-check rebuilds them instead of training them again (``Probe.rebuild``)."""
    registry = probes.load()
    return sorted({n for ns in tested_pieces(nb).values() for n in ns if registry[n].rebuild is not None})


def parsed_states(printed: dict | None) -> dict:
    """name -> state, from what the kernel printed (``kernelstate.printed``); the malformed are left out."""
    out = {}
    for name, text in (printed or {}).items():
        state = kernelstate.parse(text)
        if isinstance(name, str) and state is not None:
            out[name] = state
    return out


def decide(nb, plan, hung: dict, slow, cell_limit: float, limits, sandboxed: bool,
           printed: dict | None = None) -> tuple[dict, list]:
    """Run the re-check of ``plan`` and make its verdict final in ``nb``'s test cells.

    ``hung``: piece -> where it did not return in the kernel (it is not run again); ``slow``:
    indices of cells that ran past their timeout; ``cell_limit``: the kernel's seconds per cell;
    ``printed``: what the kernel printed of the state of ``rebuilt_pieces`` (name -> text).
    Returns (test cell index -> why it fails, the notes for an instructor)."""
    return _final(nb, plan, *_recheck(plan, hung, slow, cell_limit, limits, sandboxed,
                                      states=parsed_states(printed)))


def _recheck(plan, hung: dict, slow, cell_limit: float, limits, sandboxed: bool, cancel=None, states=None,
             only=None, second=True) -> tuple[dict, list]:
    """The re-check's outcomes for what the kernel's run showed (``decide``): (name -> Outcome, flags).
    ``second``: as in ``trusted.recheck`` (False: no second tries; ``plan.nb`` is not executed yet)."""
    plan.hung = {p: f"it did not return within {within} s in {where} in your notebook, so it was not run again"
                 for p, at in hung.items()
                 for where, within in ((at if isinstance(at, list) and len(at) == 2 else [at, cell_limit]),)}
    plan.slow, plan.cell_timeout = set(slow), float(cell_limit)
    return trusted.recheck(plan, _command(sandboxed), limits, cancel, states, only, second)


def _command(sandboxed: bool):
    return warm.Runner(sandbox.recheck_command(sandboxed), sandboxed)


def _merged(first: tuple, second: tuple) -> tuple[dict, list]:
    return {**first[0], **second[0]}, sorted(set(first[1]) | set(second[1]))


FORBIDDEN_NOTE = "forbidden call: "  # the start of a note that names what a piece must not call


def _final(nb, plan, outcomes: dict, flags: list) -> tuple[dict, list]:
    """(test cell index -> why it fails, the notes): the flags for an instructor, then one note per
    piece that the re-check caught calling what it must not use (``FORBIDDEN_NOTE``, the piece and
    the re-check's own words: which call, and where), so that its zero says why in grades.csv."""
    failed, flagged = trusted.apply(nb, plan, outcomes)
    reaching = scan.internals_flags(plan.infos)  # (first: an instructor reads the notes' start)
    notes = reaching + sorted((set(flags) | {f for fs in flagged.values() for f in fs}) - set(reaching))
    for name, found in sorted(outcomes.items()):
        calls = [c["error"] for c in (found.cases if found else []) if isinstance(c, dict) and c.get("forbidden")]
        if calls:
            notes.append(f"{FORBIDDEN_NOTE}{name}: {calls[0]}")
    return failed, notes


class Ahead:
    """The re-check started as soon as its plan is made, beside the kernel's cells, on the guess
    that the kernel's run will show nothing that changes it: no piece that did not return, no
    cell past its timeout (``decide``'s ``hung`` and ``slow`` empty), with the limits given here.
    Its runner is given exactly what ``decide``'s would be given then, so its outcomes are the
    same; when the guess is wrong they are thrown away (``take``: the runner is stopped) and the
    re-check runs again with what the kernel showed. On a machine that is not busy (the check
    command's: one notebook, two cores) the re-check's runner then costs no time after the last
    cell; a busy one (a grading worker's) does the same work, only sooner.

    A piece rebuilt from its kernel's state (``trusted.rebuilt``: the capstone's trained model) is
    left out of the guess: its state exists only once the cells are done, so ``take`` re-checks it
    then, from that state (else by training it again, as ``trusted.recheck`` does). The second
    tries (``trusted.second_tries``) wait for the cells too: whether a piece gets one depends on
    the test cells that passed in the kernel."""

    def __init__(self, plan, cell_limit: float, limits, sandboxed: bool):
        import threading

        self.plan, self.given = plan, (float(cell_limit), dict(vars(limits)), bool(sandboxed))
        self.cancel = threading.Event()
        self.result = None
        self.thread = threading.Thread(target=self._run, name="fp-recheck-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cell_limit, limits, sandboxed = self.given
        later = set(trusted.rebuilt(self.plan))
        try:
            result = _recheck(self.plan, {}, (), cell_limit, trusted.Limits(**limits), sandboxed, self.cancel,
                              only={c.name for c in self.plan.checks} - later, second=False)
        except Exception:  # noqa: BLE001 (then the re-check runs again, after the cells, as without it)
            return
        if not self.cancel.is_set():
            self.result = result

    def stop(self) -> None:
        """Stop it (its runner is killed) and wait until it has."""
        self.cancel.set()
        self.thread.join()

    def take(self, hung: dict, slow, cell_limit: float, limits, sandboxed: bool, printed: dict | None = None):
        """Its (outcomes, flags) when the kernel's run showed what it guessed, else None (it is stopped);
        with its second tries made now (``plan.nb``: the executed notebook) and the pieces it left out
        re-checked now, from what the kernel ``printed`` of their state."""
        given_cell, given_limits, given_sandboxed = self.given
        now = {k: v for k, v in vars(limits).items() if k != "kernel"}
        before = {k: v for k, v in given_limits.items() if k != "kernel"}
        if hung or slow or (float(cell_limit), now, bool(sandboxed)) != (given_cell, before, given_sandboxed):
            self.stop()
            return None
        self.thread.join()
        if self.result is None:
            return None
        # More time for a piece whose tests were slow in the kernel (``Limits.kernel``) matters only
        # where the guess ran out of it: then the re-check runs again with that time.
        slow_pieces = set(getattr(limits, "kernel", None) or ())
        if any(name in slow_pieces and found is not None and "did not finish" in (found.overall or "")
               for name, found in self.result[0].items()):
            return None
        later = set(trusted.rebuilt(self.plan))
        found = trusted.more_tries(self.plan, _command(sandboxed), self.result, limits,
                                   only={c.name for c in self.plan.checks} - later)
        if not later:
            return found
        return _merged(found, _recheck(self.plan, {}, (), cell_limit, limits, sandboxed,
                                       states=parsed_states(printed), only=later))


def reference_ahead(plan) -> None:
    """Compute the reference's results of every piece that is compared with them now (``decide``
    would compute them when it first needs them)."""
    for check in plan.checks:
        if not check.expected:
            check.expected = trusted.reference_results(check)


# ================================================================ the grading process's side
ANSWER_WAIT = 120.0  # seconds the service may take to answer, beyond the re-check's own limit


class ServiceError(RuntimeError):
    """The service could not be started, died, answered nonsense or stayed silent."""


class Service:
    """The trusted side of this process's checks, in a child of the template (``serve``): one a
    process, given one notebook after another (every one a grading worker grades)."""

    _current: dict = {}  # (pid of the owning process, template) -> Service

    @classmethod
    def begin(cls, nb, seed: int, sources: set | None, template: bool = False, ahead=None) -> "Service":
        """This process's service, started on first use (or when the last one is gone, or was
        left in the middle of a notebook), making ``nb``'s plan and reference results now.
        ``template``: which of this process's templates forks it (the one for sandboxed
        children, or for plain ones: the one its kernels come from). ``ahead``: (the kernel's
        seconds per cell, the re-check's ``Limits``, sandboxed): the service then starts the
        re-check beside the cells, on the guess that none will time out (``Ahead``)."""
        key = (os.getpid(), template)
        service = cls._current.pop(key, None)
        if service is not None and (service._busy or not service.alive()):
            service.close()
            service = None
        if service is not None:
            try:
                service._start(nb, seed, sources, ahead)
            except ServiceError:  # it ended since its last notebook: a new one
                service.close()
                service = None
        if service is None:
            service = cls(template)
            service._start(nb, seed, sources, ahead)
        cls._current[key] = service
        return service

    def __init__(self, template: bool = False):
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.proc = warm.launch("verdicts", sandboxed=False, fds=[in_r, out_w, 2], cwd=os.getcwd(),
                                    env={**os.environ, "KINETO_LOG_LEVEL": "5", "PYTHONDONTWRITEBYTECODE": "1"},
                                    template=template)
        except warm.WarmError as e:
            os.close(in_w)
            os.close(out_r)
            raise ServiceError(str(e)) from e
        finally:
            os.close(in_r)
            os.close(out_w)
        self._to, self._from = os.fdopen(in_w, "w"), os.fdopen(out_r, "r")
        self._tested, self._rebuilt = None, []
        self._busy = False  # a notebook was given and its decision not yet received

    def _start(self, nb, seed: int, sources: set | None, ahead=None) -> None:
        import nbformat

        self._tested, self._busy = None, True
        guess = None if ahead is None else {"cell_limit": float(ahead[0]), "limits": vars(ahead[1]),
                                            "sandboxed": bool(ahead[2])}
        self._send({"nb": nbformat.writes(nb), "seed": seed, "sources": sorted(sources) if sources else None,
                    "ahead": guess})

    def abandon(self) -> None:
        """The kernel's run showed what changes the re-check (a cell past its timeout): the one
        started ahead is stopped now, not when the cells are done."""
        self._send({"abandon": True})

    def alive(self) -> bool:
        return self.proc.poll() is None

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
            doc = self._receive("tested", "rebuilt")
            self._tested = {int(k): v for k, v in doc["tested"].items()}
            self._rebuilt = [n for n in doc["rebuilt"] if isinstance(n, str)]
        return self._tested

    def rebuilt(self) -> list:
        """``rebuilt_pieces`` of this notebook: what the grader reads from the kernel after the cells."""
        self.tested()
        return self._rebuilt

    def decide(self, nb, hung: dict, slow, cell_limit: float, limits, sandboxed: bool,
               printed: dict | None = None) -> tuple[dict, list]:
        """As ``decide``, in the service: the test cells' outputs of ``nb`` are replaced by its."""
        import nbformat

        self.tested()
        self._send({"nb": nbformat.writes(nb), "hung": hung, "slow": sorted(slow), "cell_limit": cell_limit,
                    "limits": vars(limits), "sandboxed": sandboxed, "printed": printed or {}})
        # (the pieces rebuilt from the kernel's state are re-checked after the cells, on top of the
        # re-check started ahead: each within the re-check's limit)
        doc = self._receive("outputs", "failed", "notes", wait=2 * limits.total + ANSWER_WAIT)
        self._busy = False
        for index, outputs in doc["outputs"].items():
            nb.cells[int(index)]["outputs"] = [nbformat.from_dict(o) for o in outputs]
        return {int(k): v for k, v in doc["failed"].items()}, list(doc["notes"])

    def release(self) -> None:
        """The notebook is done: the service is kept for the next one if it has answered all it
        was asked, else it is stopped (the next notebook gets a new one)."""
        if self._busy or not self.alive():
            self.close()

    def close(self) -> None:
        for f in (self._to, self._from):
            try:
                f.close()
            except OSError:
                pass
        self.proc.kill()
        self.proc.wait()
        for key, service in list(Service._current.items()):
            if service is self:
                del Service._current[key]


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
    """The service (a child of the template, with ``template`` its own connection to it): the
    notebooks of its process, one after another, until that process closes its input."""
    import nbformat

    t = warm.Template(False, _proc=_Parent(os.getppid()), _sock=template)
    t._child = False  # (its parent: alive() looks at /proc)
    for sandboxed in (False, True):  # its runners, sandboxed or not, come from the template it came from
        warm.Template._current[(os.getpid(), sandboxed)] = t
    had = {m for m in warm.LAZY if m in sys.modules}  # (what the template had when it forked this)
    imported: set = set()  # what this service's re-checks imported, or their runners said they had
    asked = False
    while True:
        line = sys.stdin.readline()
        if not line:
            return  # (its process is done)
        first = json.loads(line)
        nb = nbformat.reads(first["nb"], as_version=4)
        _answer({"tested": tested_pieces(nb), "rebuilt": rebuilt_pieces(nb)})
        wanted = sorted((imported | set(sys.modules)) & (set(warm.LAZY) - had))
        if wanted and not asked:
            # An earlier notebook's re-check imported one (its reference results, or its runner
            # while loading the cells; its kernel did too): so will this one's, and the next's.
            # Asked once there is a next notebook (never in the check command's one), so that the
            # children forked after have it.
            asked = True
            try:
                t.preload(wanted)
            except warm.WarmError:
                pass  # (the next request for a runner says so, and is answered as without a template)
        plan = trusted.make_plan(nb, int(first["seed"]), set(first["sources"]) if first["sources"] else None)
        reference_ahead(plan)
        given = first.get("ahead")
        guess = None if not given else Ahead(plan, given["cell_limit"], trusted.Limits(**given["limits"]),
                                            bool(given["sandboxed"]))
        while True:
            line = sys.stdin.readline()
            if not line:
                if guess is not None:
                    guess.stop()
                return
            second = json.loads(line)
            if not second.get("abandon"):
                break
            if guess is not None:
                guess.stop()
                guess = None
        nb = nbformat.reads(second["nb"], as_version=4)
        plan.nb = nb
        args = (second["hung"], second["slow"], second["cell_limit"], trusted.Limits(**second["limits"]),
                bool(second["sandboxed"]))
        printed = second.get("printed") if isinstance(second.get("printed"), dict) else None
        found = guess.take(*args, printed) if guess is not None else None
        failed, notes = _final(nb, plan, *(found if found is not None else
                                           _recheck(plan, *args, states=parsed_states(printed))))
        imported |= plan.imported | kernelstate.imported(printed, warm.LAZY)  # (the kernel's word: a hint)
        _answer({"outputs": {i: nb.cells[i].get("outputs", []) for i in plan.graded}, "failed": failed,
                 "notes": notes})


def _answer(doc: dict) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
