"""Verdicts that no student code can forge: the trusted half of grading.

nbgrader scores a test cell by what the student's kernel printed, and the
student's code runs first in that kernel: it can patch numpy, torch or the
checks, rebind ``checks``, print a value that nbgrader takes for a score, or read
the hidden tests. So the kernel's verdict can only take points away: a point
needs both

1. the test cell passed in the kernel (the visible and hidden checks, with their
   explanations for the student), and
2. the *trusted re-check* of every graded piece the test cell uses passed.

The trusted re-check (``RobustExecute`` runs it after the last cell):

- **a fresh interpreter** (``recheck``, sandboxed like the kernel) loads only the
  code the graded pieces depend on: the course's setup cells as the instructor
  wrote them and the student cells that define the pieces and, transitively, what
  they use (``scan.dependencies``). Test cells never run there, nor any other
  cell: a cell the student added cannot change a verdict (a piece that fails
  with only its dependencies is tried once more with every non-test cell when a
  test cell that uses it passed in the kernel, so a dependency that the name
  analysis missed costs nothing);
- **secret inputs**: each piece is called on fresh inputs drawn here from a seed
  (an HMAC of a course secret that the sandbox cannot read, the student, the
  assignment and the notebook: unknown to the student, the same on every re-run);
  they never enter the student's kernel, the notebook or the feedback;
- **behaviour, watched** (``observe``): every case runs in a window in which
  torch's operators (every thread), Python calls by code and torch functions by
  name are recorded; a forbidden built-in that runs there costs the case, with
  the cell and line; an observer switched off is seen by its missing canary and
  costs the case too; what a cell or a call changed in torch, numpy, the course's
  modules, builtins or the interpreter's hooks is flagged for the instructor
  (and costs the piece when it is the grader's own tools);
- **plain data back** (``wire``): the runner prints one line per piece (exact
  type, dtype, shape, bytes; no pickle); the grader runs the same probe on the
  course's reference in its own process and compares. A malformed, duplicated or
  missing report fails the piece; it never stops grading;
- **the verdict is final** (``apply``): each test cell's outputs are rewritten so
  that nbgrader can only score what was decided here: the re-check's failure comes
  first, a value the cell displayed is no longer a score, and a warning printed to
  stderr no longer costs the cell.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import selectors
import signal
import subprocess
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from nbformat import NotebookNode

import firstprinciples

from . import declared, probes, resident, scan, wire
from .wire import MARK

FAILED = "TrustedCheckFailed"
SECRET_FILE = ".fp_grading_secret"  # in the course root; never inside a sandbox
# changes to these mean the grader's own tools were touched: what they observed cannot be trusted
MACHINERY = ("firstprinciples.grading", "firstprinciples.guard", "torch.autograd.profiler", "torch.profiler",
             "sys.", "builtins.__import__", "builtins.exec", "builtins.compile")


# ---------------------------------------------------------------- seeds
def course_secret(root: Path) -> bytes:
    path = Path(root) / SECRET_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        return path.read_bytes()
    except FileExistsError:  # pragma: no cover (a parallel worker made it first)
        return path.read_bytes()


def seed_for(resources: dict | None, root: Path | None) -> int:
    """The secret seed of one student's notebook (random when not grading a course)."""
    info = (resources or {}).get("nbgrader", {})
    if root is None or not info.get("student"):
        return secrets.randbits(63)
    key = course_secret(root)
    msg = "\0".join(str(info.get(k, "")) for k in ("assignment", "student", "notebook")).encode()
    return int.from_bytes(hmac.new(key, msg, hashlib.sha256).digest()[:8], "big") >> 1


# ---------------------------------------------------------------- the plan
@dataclass
class Check:
    name: str
    probe: probes.Probe
    cases: list
    expected: list = field(default_factory=list)  # the reference's encoded results, per case
    apart: tuple = ()  # the indices of the cases that run apart (``alone``: run_runner)


@dataclass
class Plan:
    checks: list
    infos: list  # scan.CellInfo of every code cell
    graded: dict  # grade cell index -> names of probed objects it uses
    nb: object = None
    # what the kernel's run showed: pieces that did not return there (name -> why; not run
    # again, they fail with that reason) and cells that ran past their timeout (indices;
    # loaded with a short limit, so that a `while True:` after a def costs seconds, not minutes)
    hung: dict = field(default_factory=dict)
    slow: set = field(default_factory=set)
    cell_timeout: float = 60.0  # seconds each loaded cell may run before it is interrupted
    # the modules of warm.LAZY that its runners said they had imported once the cells were loaded
    # (a hint for the template's imports only: it decides nothing)
    imported: set = field(default_factory=set)
    # seconds the re-check's runners of this notebook have used so far, in every phase (the
    # re-check started ahead, its second tries, a rebuilt piece after the cells): all of them
    # share one budget, ``Limits.total``
    spent: float = 0.0


def grade_cell_names(nb, known) -> dict:
    out = {}
    for i, cell in enumerate(nb.cells):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
            continue
        tree = scan.parse(cell.source)
        names = scan.loaded_names(tree) if tree is not None else set()
        out[i] = sorted(names & set(known))
    return out


def make_plan(nb, seed: int, course_sources: set | None = None) -> Plan:
    registry = probes.load()
    infos = scan.cell_infos(nb, course_sources)
    graded = grade_cell_names(nb, registry)
    names = sorted({n for ns in graded.values() for n in ns})
    checks = []
    for name in names:
        probe = registry[name]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        cases = probe.cases(rng)
        checks.append(Check(name, probe, [probes.encode_case(c) for c in cases],
                            apart=tuple(i for i, c in enumerate(cases) if c.get("alone") is True)))
    return Plan(checks, infos, graded, nb)


def reference_results(check: Check) -> list:
    """The reference's results on the check's cases, computed here (in the trusted grader); None for
    each case of a declared piece that has no reference (a trained model: its tests' properties judge)."""
    if check.probe.declared is not None and not check.probe.declared.reference:
        return [None] * len(check.cases)
    if firstprinciples.BUNDLED:  # a student bundle: the visible cases' stored results (``probes._bundled_cases``)
        stored = declared.stored_by_label(check.probe.declared)
        return [stored[wire.scalar(enc["label"])] for enc in check.cases]
    out = []
    for enc in check.cases:
        case = probes.decode_case(enc)
        if getattr(check.probe, "needs", ()):
            res = check.probe.run(check.probe.reference, case, probes.reference_namespace(check.probe))
        else:
            res = check.probe.run(check.probe.reference, case)
        out.append({k: wire.encode(v) for k, v in res.items()})
    return out


def job_cells(plan: Plan, names, everything: bool = False) -> list:
    """The cells the re-check loads for ``names``, in notebook order, as plain Python:
    the non-test cells they depend on (``everything``: every non-test cell)."""
    candidates = [c for c in plan.infos if c.index not in plan.graded]
    if everything:
        chosen = candidates  # a cell that does not parse is sent too: its SyntaxError is the explanation
    else:
        registry = probes.load()
        wanted = set(names) | {m for n in names if n in registry for m in getattr(registry[n], "needs", ())}
        picked = {c.index for n in wanted for c in scan.dependencies(candidates, n)}
        chosen = [c for c in candidates if c.index in picked]
    return [{"label": c.label, "source": c.python,
             "timeout": min(SLOW_CELL_TIMEOUT, plan.cell_timeout) if c.index in plan.slow else plan.cell_timeout}
            for c in chosen]


SLOW_CELL_TIMEOUT = 5.0  # seconds for a cell that ran past its timeout in the kernel (what it defines
# before it hangs is defined within this; the time beyond only repeats the hang)


# ---------------------------------------------------------------- running the re-check
# Watching every torch call makes a loop of small calls up to about 17 times slower than in the
# kernel (a sampler drawing one row at a time: 2.9 s plain, 48.6 s watched; the operator profiler
# is most of it). A piece whose test cells were slow in the kernel gets that many times their time
# in the re-check, within PIECE_MAX, and the notebook's budget grows by as much, within TOTAL_MAX:
# an answer that passes in the kernel is not failed by the watch's own cost.
WATCH_FACTOR = 30.0
PIECE_MAX = 900.0
TOTAL_MAX = 1800.0


@dataclass
class Limits:
    load: float = 120.0  # seconds to load the cells (the capstone trains its model there: ~10 s)
    piece: float = 120.0  # seconds for one piece's cases, at least (``piece_for``)
    total: float = 300.0  # seconds for the whole re-check of a notebook, at least (``total_for``)
    output: int = 64 * 2**20  # bytes of report at most
    # piece -> seconds its test cells took in the kernel, for the pieces slow enough to need more
    # than ``piece`` watched (``slow_in_kernel``)
    kernel: dict = field(default_factory=dict)

    def piece_for(self, name: str) -> float:
        seconds = self.kernel.get(name, 0.0) if isinstance(self.kernel, dict) else 0.0
        return max(self.piece, min(PIECE_MAX, WATCH_FACTOR * float(seconds or 0.0)))

    def total_for(self) -> float:
        extra = sum(self.piece_for(n) - self.piece for n in (self.kernel if isinstance(self.kernel, dict) else ()))
        return max(self.total, min(TOTAL_MAX, self.total + extra))


def slow_in_kernel(seconds: dict, tested: dict, piece: float) -> dict:
    """piece -> seconds its test cells took in the kernel, for the pieces whose cells took long
    enough that the watch's cost could make them run past ``piece`` (``seconds``: cell index ->
    seconds; ``tested``: test cell index -> the pieces it uses)."""
    out: dict = {}
    for index, names in tested.items():
        for name in names:
            out[name] = out.get(name, 0.0) + float(seconds.get(index, 0.0))
    return {n: round(t, 1) for n, t in sorted(out.items()) if WATCH_FACTOR * t > piece}


def run_runner(command: list, cells: list, checks: list, limits: Limits, deadline: float,
               cancel=None, states: dict | None = None) -> tuple[dict, dict]:
    """Run one re-check runner; return (loaded event or {}, name -> piece event or a failure reason str).
    ``cancel``: a ``threading.Event`` that, once set, stops it within a tenth of a second (what it
    returns then is incomplete). ``states``: name -> the parameters its kernel ended with, for
    pieces the runner rebuilds from them (``Probe.rebuild``)."""
    nonce = secrets.token_hex(16)
    # The cases marked ``alone`` run first, unwatched, before any other case has run in the runner;
    # the grader reads how much the process grew meanwhile (``resident``: from outside it).
    apart = {c.name: list(c.apart) for c in checks}
    state = {c.name: {"state": states[c.name]} if states and c.name in states else {} for c in checks}
    first = [{"name": c.name, "as": c.name + ALONE, "watched": False, "cases": [c.cases[i] for i in apart[c.name]],
              **state[c.name]} for c in checks if apart[c.name]]
    job = {"nonce": nonce, "cells": cells,
           "pieces": first + [{"name": c.name, "cases": [e for i, e in enumerate(c.cases) if i not in apart[c.name]],
                               **state[c.name]} for c in checks]}
    prefix = MARK + nonce
    proc = start_runner(command)
    watch = resident.Watch(proc).__enter__() if first else None
    results: dict = {}
    loaded: dict = {}
    baseline = None
    pending = [p.get("as", p["name"]) for p in job["pieces"]]
    try:
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        parts, size = [], 0  # what was read since the last whole line (joined only once a line ends)
        step_started, phase_limit = time.monotonic(), limits.load
        done = False
        while not done and not (cancel is not None and cancel.is_set()):
            now = time.monotonic()
            left = min(step_started + phase_limit, deadline) - now
            if left <= 0:
                what = ("loading your code" if not loaded else
                        f"{pending[0].removesuffix(ALONE)} within {phase_limit:g} s on its own inputs (the grader "
                        "watches every torch call your code makes, which makes code with many small calls, a Python "
                        f"loop over rows or tokens, up to {WATCH_FACTOR:g} times slower than in your notebook: "
                        "vectorise the loop)")
                if now >= deadline:
                    what += "; the re-check of this notebook ran out of time"
                # a piece that hung is failed; a load that hung fails the pieces only when they
                # were run alone (together, each gets a runner of its own with its own cells)
                for n in pending[:1] if loaded else (pending if len(checks) == 1 else []):
                    results[n.removesuffix(ALONE)] = f"the re-check did not finish {what}"
                break
            if not sel.select(timeout=min(left, 1.0 if cancel is None else 0.1)):
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > limits.output:
                for n in pending:
                    results[n] = "the re-check's report was larger than the grader accepts"
                break
            parts.append(chunk)
            lines = []
            if b"\n" in chunk:  # (a report of megabytes comes in many reads: joined and split once, not at each)
                *lines, rest = b"".join(parts).split(b"\n")
                parts = [rest]
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                if not line.startswith(prefix):
                    continue
                try:
                    event = wire.loads(line[len(prefix):])
                except (ValueError, wire.WireError):
                    continue
                if not isinstance(event, dict):
                    continue
                kind = event.get("event")
                if kind == "baseline" and baseline is None and not loaded:
                    baseline = event.get("ids") if isinstance(event.get("ids"), dict) else {}
                    if watch is not None:
                        watch.mark()  # (read the job, imported what it needs; no student code has run yet)
                elif kind == "loaded" and not loaded:
                    loaded = event
                elif kind == "piece" and isinstance(event.get("name"), str):
                    name = event["name"]
                    if name in results:
                        results[name] = "the re-check reported this piece twice (its report was forged)"
                    elif name in pending:
                        # (the identities sent before any student code ran, never what the piece's event says)
                        event["baseline"] = identities((baseline or {}).get(name))
                        event["resident"] = watch.growth() if watch is not None and name.endswith(ALONE) else None
                        results[name] = event
                        if watch is not None and not any(n.endswith(ALONE) for n in pending):
                            watch.stop()  # (the cases run apart are done: nothing more to read)
                        pending.remove(name)
                elif kind == "done":
                    done = True
                if loaded:  # (the baseline comes before the cells are loaded: the load keeps its limit)
                    step_started = time.monotonic()
                    phase_limit = limits.piece_for(pending[0].removesuffix(ALONE)) if pending else limits.piece
    finally:
        if watch is not None:
            watch.stop()
        _kill(proc)
    for c in checks:
        if apart[c.name]:
            _rejoin(results, c.name, apart[c.name], len(c.cases))
    return loaded, results  # a piece missing here was not reached: the runner died or stopped before it


ALONE = "#alone"


def _rejoin(results: dict, name: str, apart: list, n: int) -> None:
    """Put the results of a piece's cases run apart back among its others, in the cases' order,
    each with the runner's growth as the grader read it (``resident``). A part missing or
    malformed leaves those cases unreadable (they fail); a failure of either part is the piece's."""
    alone, rest = results.pop(name + ALONE, None), results.get(name)
    if isinstance(alone, str) and not isinstance(rest, str):
        results[name] = alone  # (it hung or broke the runner while running apart)
        return
    if not isinstance(rest, dict) or not isinstance(rest.get("results"), list):
        return
    got = alone.get("results") if isinstance(alone, dict) else None
    if not isinstance(got, list) or len(got) != len(apart):
        got = [None] * len(apart)
    others = iter(rest["results"])
    by_index = dict(zip(apart, got))
    merged = []
    for i in range(n):
        if i in by_index:
            res = by_index[i]
            merged.append({**res, "resident": alone.get("resident")} if isinstance(res, dict) else res)
        else:
            merged.append(next(others, None))
    rest["results"] = merged if len(rest["results"]) == n - len(apart) else rest["results"]
    if isinstance(alone, dict) and isinstance(alone.get("changes"), list):
        rest["changes"] = list(alone["changes"]) + list(rest.get("changes") or [])


def identities(pairs) -> dict:
    """consts identity -> name, from the runner's baseline event (malformed entries dropped)."""
    out = {}
    for item in pairs if isinstance(pairs, list) else ():
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], str):
            out[item[0]] = item[1]
    return out


def start_runner(command) -> subprocess.Popen:
    """Start a runner: ``command`` is an argument list (a cold interpreter), or a callable that
    starts one and returns it with ``stdin`` and ``stdout`` pipes (``warm.Runner``)."""
    if callable(command):
        return command()
    env = {**os.environ, "KINETO_LOG_LEVEL": "5", "PYTHONDONTWRITEBYTECODE": "1"}  # the profiler's banners: off
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()
    for f in (proc.stdout, proc.stdin):
        try:
            if f:
                f.close()
        except OSError:
            pass


def rebuilt(plan: Plan) -> list:
    """The names of the plan's pieces that can be rebuilt from the state their kernel ended with
    (``Probe.rebuild``: the capstone's trained ``model``)."""
    return [c.name for c in plan.checks if c.probe.rebuild is not None]


def recheck(plan: Plan, command: list, limits: Limits | None = None, cancel=None, states: dict | None = None,
            only=None, second: bool = True) -> tuple[dict, list]:
    """Run the re-check of every piece of the plan; return (name -> Outcome, notebook flags).

    All pieces go to one runner with the cells they depend on. A piece that the runner
    did not reach (it died, e.g. ``os._exit`` in another piece's cell, or stopped at a
    piece that hung) gets a runner of its own with only its own dependencies, so one
    piece's fault costs only that piece. A piece that was missing or raised gets one more
    try with every non-test cell loaded, the better verdict standing, when a point still
    depends on it (``second_tries``; ``second=False``: not now, the caller makes them later with
    ``more_tries``, and the flags keep the mark of a change to the grader's own tools, which those
    tries are judged with). ``cancel``: as in ``run_runner`` (a cancelled re-check's outcomes are
    incomplete: only for throwing away).

    ``states``: name -> the parameters the kernel's object ended with (``kernelstate.parse``), for
    pieces with ``rebuild``. Such a piece is first probed rebuilt from them, in a runner that loads
    only what ``rebuilt_from`` needs (not the cells that train it); when that passes every test cell
    of the piece, that is its verdict. Otherwise (or with no state) it is re-checked as any piece,
    its own cells loaded, and the better verdict stands: the state can only spare the second
    training, never cost a point. ``only``: the names to re-check (None: every piece of the plan)."""
    run = _Recheck(plan, command, limits, cancel, states)
    wanted = [c for c in plan.checks if only is None or c.name in only]
    for name, why in plan.hung.items():
        if only is None or name in only:
            run.outcomes[name] = Outcome(why)
    from_state = [c for c in wanted if c.name not in plan.hung and c.probe.rebuild is not None
                  and states and states.get(c.name) is not None]
    if from_state and run.in_time():
        run.runner(from_state, False, with_states=True)
    run.settled = {c.name for c in from_state if c.name in run.outcomes and not _failing(plan, c, run.outcomes[c.name])}
    # A rebuilt piece that fails is re-checked as any piece; its rebuilt outcome stands only if it fails
    # fewer cells (a tie keeps the normal path's reason, which is what the student's cells did).
    run.tried = {c.name: run.outcomes.pop(c.name) for c in from_state if c.name in run.outcomes
                 and c.name not in run.settled}
    run.runners([c for c in wanted if c.name not in plan.hung and c.name not in run.settled], False)
    if not second:
        return run.result(wanted, marked=True)
    run.runners(second_tries(plan, wanted, run.outcomes, run.settled), True)
    return run.result(wanted)


def second_tries(plan: Plan, checks: list, outcomes: dict, settled=()) -> list:
    """Those of ``checks`` worth a second try with every non-test cell loaded: the piece was missing
    or raised (a dependency the name analysis did not see, perhaps: ``Outcome.retry``) and some
    test cell that uses it passed in the kernel (``plan.nb``: the executed notebook). A test cell
    that failed there scores 0 whatever the re-check finds (a point needs both), so a second try
    for a piece whose every test cell failed cannot change a score: it is not made. (It was the
    capstone's costliest runner: a decoder left unwritten, tried again with every cell, trained
    the model again, 4-6 s, for no point.)"""
    passed = {i for i in plan.graded if not kernel_failed(plan.nb.cells[i])}
    return [c for c in checks if c.name in outcomes and c.name not in settled and outcomes[c.name].retry()
            and any(c.name in plan.graded[i] for i in passed)]


def kernel_failed(cell) -> bool:
    """The kernel's run already fails this test cell: an error among its outputs (what nbgrader
    scores 0 once ``apply`` has made stderr and displayed values neutral)."""
    return any(isinstance(o, dict) and o.get("output_type") == "error" for o in cell.get("outputs", []))


def more_tries(plan: Plan, command: list, found: tuple, limits: Limits | None = None, cancel=None,
               only=None) -> tuple[dict, list]:
    """``found`` (outcomes, flags) of a ``recheck(..., second=False)`` of ``only`` (None: every piece),
    with the second tries it left made now, as ``recheck`` would have made them with ``plan.nb``
    executed: the same runners, in the same order, judged with the same flags (a change to the
    grader's own tools that its first runners saw voids these tries too), so the same outcomes."""
    run = _Recheck(plan, command, limits, cancel, None)
    run.outcomes, run.flags = dict(found[0]), list(found[1])
    wanted = [c for c in plan.checks if only is None or c.name in only]
    run.runners(second_tries(plan, wanted, run.outcomes), True)
    return run.result(wanted)


class _Recheck:
    """One re-check's runners and what they found (``recheck``, ``more_tries``)."""

    def __init__(self, plan: Plan, command: list, limits: Limits | None, cancel, states: dict | None):
        self.plan, self.command, self.cancel, self.states = plan, command, cancel, states
        self.limits = limits or Limits()
        # one budget for the whole re-check of a notebook, whatever the phases it is made in
        self.started = time.monotonic()
        self.deadline = self.started + max(0.0, self.limits.total_for() - plan.spent)
        self.outcomes: dict = {}
        self.flags: list = []
        self.settled: set = set()
        self.tried: dict = {}  # rebuilt outcomes that did not settle their piece

    def in_time(self) -> bool:
        return time.monotonic() < self.deadline and not (self.cancel is not None and self.cancel.is_set())

    def runner(self, checks: list, everything: bool, with_states: bool = False) -> list:
        """Run ``checks`` in one runner; record their outcomes; return the ones not reached."""
        plan = self.plan
        names = [n for c in checks for n in c.probe.rebuilt_from] if with_states else [c.name for c in checks]
        cells = job_cells(plan, names, everything)
        loaded, results = run_runner(self.command, cells, checks, self.limits, self.deadline, self.cancel,
                                     self.states if with_states else None)
        context = _load_context(loaded)
        said = loaded.get("imported") if isinstance(loaded, dict) else None
        if isinstance(said, list):
            plan.imported.update(m for m in said if isinstance(m, str))
        for change in (loaded.get("changes") or []) if isinstance(loaded, dict) else []:
            self.flags.extend(_change_flags(change))
        machinery = [f for f in self.flags if f.startswith("!")]
        missed = []
        for check in checks:
            res = results.get(check.name)
            if res is None:
                missed.append(check)
                continue
            found = outcome(check, res, machinery) if isinstance(res, dict) else Outcome(res)
            found.context = context
            old = self.outcomes.get(check.name)
            if old is None or _failing(plan, check, found) < _failing(plan, check, old):
                self.outcomes[check.name] = found
        return missed

    def runners(self, todo: list, everything: bool) -> None:
        """``todo`` in one runner (the pieces rebuilt from a state in runners of their own), and what
        it did not reach each in a runner of its own."""
        if not todo or not self.in_time():
            return
        # A piece with ``rebuild`` always has runners of its own: the same runners, and so the same
        # outcomes and context, whether or not the re-check was started ahead (``verdicts.Ahead``
        # leaves it out) and whether or not its kernel's state was usable.
        rest = [c for c in todo if c.probe.rebuild is None]
        missed = (self.runner(rest, everything) if len(rest) > 1 else rest) + [c for c in todo if c.probe.rebuild]
        for check in missed:  # each on its own
            if not self.in_time():
                break
            if self.runner([check], everything):
                self.outcomes.setdefault(check.name, Outcome("the re-check ended before it reported this piece "
                                                             "(the code it loads crashed or ended the process)"))

    def result(self, wanted: list, marked: bool = False) -> tuple[dict, list]:
        """(name -> Outcome, flags): the flags without their marks unless ``marked`` (for ``more_tries``)."""
        outcomes, plan = self.outcomes, self.plan
        if not (self.cancel is not None and self.cancel.is_set()):  # (a cancelled run is thrown away)
            plan.spent += time.monotonic() - self.started
            self.started = time.monotonic()
        for check in wanted:
            outcomes.setdefault(check.name, Outcome(
                f"the re-check of this notebook ran out of time (it may use {self.limits.total:g} s in all, "
                "for every piece and every try; a piece that needs more than that in the grader's runner "
                "is not given more)"))
            if check.name in self.tried and _failing(plan, check, self.tried[check.name]) < _failing(
                    plan, check, outcomes[check.name]):
                outcomes[check.name] = self.tried[check.name]
        return outcomes, sorted(set(self.flags if marked else (f.lstrip("!") for f in self.flags)))


def _failing(plan: Plan, check: Check, found: Outcome) -> int:
    """How many test cells this outcome fails."""
    n = 0
    for index, names in plan.graded.items():
        if check.name in names:
            grade_id = plan.nb.cells[index].get("metadata", {}).get("nbgrader", {}).get("grade_id", "")
            n += bool(found.reason(check, check.probe.cells.get(grade_id, probes.Aspect())))
    return n


def _load_context(loaded: dict) -> str:
    errors = loaded.get("errors") if isinstance(loaded, dict) else None
    if not isinstance(errors, list) or not errors:
        return ""
    parts = [wire.capped(f"{e.get('cell')} raised {e.get('error')}", 300) for e in errors[:3] if isinstance(e, dict)]
    return "; while loading your code, " + "; ".join(parts)


def _change_flags(change) -> list:
    if not isinstance(change, dict):
        return []
    cell = str(change.get("cell", "a cell"))
    out = []
    for what in (change.get("changes") or [])[:20]:
        what = wire.capped(what, 200)  # (a name in it is the student's: any length)
        mark = "!" if what.startswith(MACHINERY) else ""
        out.append(f"{mark}{cell} changes the shared code: {what}")
    return out


def outcome(check: Check, report: dict, machinery: list = ()) -> Outcome:
    """Collect the runner's report next to the reference's results, case by case. Any
    malformed part fails (as a reason), never raises."""
    try:
        return _outcome(check, report, machinery)
    except Exception as e:  # forged or broken report
        return Outcome(f"the re-check's result could not be read ({type(e).__name__})")


def _outcome(check: Check, report: dict, machinery) -> Outcome:
    if machinery:
        return Outcome(f"the grader's own tools were changed ({machinery[0].lstrip('!')}), so your code could not be "
                       "re-checked", flags=[m.lstrip("!") for m in machinery])
    if report.get("missing"):
        return Outcome(f"{check.name} is not defined when the code it needs has run")
    if report.get("broken"):
        return Outcome(f"the re-check was broken by the code it ran ({str(report['broken'])[:200]})",
                       flags=[f"{check.name}: the re-check's runner was broken while it ran this piece"])
    results = report.get("results")
    if not isinstance(results, list) or len(results) != len(check.cases):
        return Outcome("the re-check's result is incomplete")
    if not check.expected:
        check.expected = reference_results(check)
    flags = [f"{check.name}: {wire.capped(c, 200)}" for c in (report.get("changes") or [])[:5]]
    from . import observe  # (torch: only where a re-check's results are judged, never in the check command's own process)

    watch = check.probe.watch()
    table = observe.forbidden_python(**watch)
    ids = report.get("baseline") if isinstance(report.get("baseline"), dict) else None
    found = []
    for i, res in enumerate(results):
        if not isinstance(res, dict):
            found.append({"error": "unreadable result"})
            continue
        seen = res.get("seen") if isinstance(res.get("seen"), dict) else {}
        raw_hits = observe.judge(observe.expand(seen, report.get("codes")), watch["torch_patterns"], table, ids)
        hits = [[wire.capped(w, 120), wire.capped(l, 120) if l else ""] for w, l in raw_hits[:50]]
        tampered = [wire.capped(t, 200) for t in (res.get("tampered") or [])[:5]]
        threads = [wire.capped(t, 200) for t in (res.get("threads") or [])[:5]]
        if threads:
            flags.append(f"{check.name}: {threads[0]} (its operators are watched there, and its Python calls when it was started with threading)")
        if tampered:
            flags.append(f"{check.name}: {tampered[0]}")
            found.append({"error": f"the grader could not watch your code: {tampered[0]}", "tamper": True})
        elif hits:
            located = next((h for h in hits if h[1]), None)
            names = sorted({str(h[0]) for h in hits}, key=lambda n: (n.startswith(("aten::", "autograd::")), n))
            where = f" ({located[1]})" if located else ""
            what = located[0] if located else names[0]
            kind = ("the course's own code (kept for its tests)" if what.startswith("firstprinciples.exercises.")
                    else "the course's reference" if what.startswith("firstprinciples.") else "a built-in")
            found.append({"error": f"it calls {what}{where}, {kind} that this piece must not use (you are asked to "
                                   "write it yourself)", "forbidden": True})
        elif not isinstance(res.get("outputs"), dict):
            if res.get("secret") and not firstprinciples.BUNDLED:  # (a bundle re-checks the visible inputs)
                found.append({"error": f"it raised {wire.capped(res.get('error', '?'), 120)} on one of the re-check's "
                                       "own inputs (the error's message is not shown: it could hold those inputs; "
                                       "run the notebook's tests to see it on theirs)"})
            else:  # (raised before any case was given to it: rebuilding it from the kernel's parameters)
                found.append({"error": f"it raised {wire.capped(res.get('error', '?'), 300)}"})
        elif (why := _over_memory(check, i, res)) is not None:
            found.append({"error": why})
        else:
            found.append({"got": res["outputs"], "want": check.expected[i] if check.expected else None})
    return Outcome(None, found, sorted(set(flags)))


# Memory outside torch (NumPy arrays, Python objects) is counted by Python's allocation tracer as the
# most held at once, not tensor by tensor, so it gets room for several blocks at once: 4 times the
# bound. Measured on the secret memory cases (tests/exercises/test_tiled_attention.py): correct answers
# held 0.1-0.6 times the bound; the whole (T_q, T_k) matrix built in NumPy, 12-25 times (in float32 it
# alone is at least 4 times the float64 bound, and its softmax's temporaries add twice as much again).
PYTHON_PEAK_ALLOWANCE = 4
# On a case run ``alone`` (tiled attention's largest: (2048, 8192) scores), the most the runner's data
# memory (anonymous and shared pages, read by the grader from outside: ``resident``) may grow between the
# moment the runner has read its job and the end of that case, before any other case has run (its C
# allocator gives large blocks back at once: ``recheck.allocate_plainly``). Measured (2-core VM, torch
# 2.13, warm sandboxed runners): an answer that returns zeros at once, 13.4 MB (the runner's own loading
# of the cells); correct answers 14.3-17.6 MB, 25.4 MB for one that keeps every block's partial result in
# float64 until the end; the whole matrix in NumPy in float16, 50.7 MB; in torch in float16, 64.0 MB; in
# an anonymous memory map (seen by no measure inside the runner), 80.2 MB.
RESIDENT_ALLOWANCE = 40 * 2**20


def _over_memory(check: Check, i: int, res: dict) -> str | None:
    """Why case ``i`` held more at once than its piece may (``Probe.memory``), as the watch recorded
    it in the runner: the largest tensor torch's allocator gave out, and the most Python's allocator
    (NumPy's arrays included) held at once (None: within the bound, or not measured there)."""
    seen = res.get("seen") if isinstance(res.get("seen"), dict) else {}
    if check.probe.memory is None:
        return None
    allowed = check.probe.memory(probes.decode_case(check.cases[i]))
    if allowed is None:
        return None
    largest, peak = (seen.get(k) for k in ("largest_allocation", "python_peak"))
    growth = res.get("resident")
    bound = (f"the {allowed:,} allowed (the largest of a (..., T_q, block_size) block, the output and an input, "
             "even in float64): something as large as the whole (T_q, T_k) matrix was built")
    if isinstance(largest, int) and not isinstance(largest, bool) and largest > allowed:
        return (f"it allocated {largest:,} bytes at once, more than {bound} (counted at torch's allocator, "
                "whatever mode was switched off)")
    if isinstance(peak, int) and not isinstance(peak, bool) and peak > PYTHON_PEAK_ALLOWANCE * allowed:
        return (f"it held {peak:,} bytes at once outside torch (NumPy arrays, Python objects), more than "
                f"{PYTHON_PEAK_ALLOWANCE} times {bound} (counted by Python's allocation tracer)")
    if i in check.apart and isinstance(growth, int) and not isinstance(growth, bool) and growth > RESIDENT_ALLOWANCE:
        return (f"while it ran, the memory the operating system gave the process running your code grew by "
                f"{growth:,} bytes, more than the {RESIDENT_ALLOWANCE:,} allowed on this case: something as large as "
                "the whole (T_q, T_k) matrix was built (measured from outside the process, whatever it switched off)")
    return None


@dataclass
class Outcome:
    """What the re-check found for one object: a reason that voids every case
    (``overall``), or per case the kernel's results and the reference's (or why
    the case failed outright)."""
    overall: str | None = None
    cases: list = field(default_factory=list)  # per case: {"error": reason} or {"got": ..., "want": ...}
    flags: list = field(default_factory=list)  # what an instructor should look at (graded on behaviour)
    context: str = ""  # what went wrong while loading the code, shown with a failure

    def retry(self) -> bool:
        """Worth a second try with every non-test cell loaded: the piece was missing or raised
        (perhaps a dependency the name analysis did not see), not caught doing something."""
        if self.overall:
            return "not defined" in self.overall or "incomplete" in self.overall
        return any("error" in c and not c.get("forbidden") and not c.get("tamper") for c in self.cases)

    def reason(self, check: Check, aspect: probes.Aspect) -> str | None:
        if self.overall:
            return self.overall
        for i, (enc, found) in enumerate(zip(check.cases, self.cases)):
            tags = set(wire.scalar(t) for t in enc["tags"]["items"]) if "tags" in enc else set()
            if aspect.tags is not None and not (tags & aspect.tags):
                continue
            try:
                why = found.get("error") or judge_case(check, aspect, enc, found["got"], found.get("want"))
            except Exception as e:  # a malformed result (wrong types): it fails, it never stops grading
                why = f"its result could not be read ({type(e).__name__})"
            if why and check.probe.declared is not None:  # (a declared exercise's reason names its case itself)
                return why if "error" not in found else f"{check.probe.declared.call} {_label(enc, i)}: {why}"
            if why:
                return f"on {_label(enc, i)}: {why}"
        return None


def _label(enc: dict, i: int) -> str:
    return wire.scalar(enc["label"]) if "label" in enc else f"case {i + 1}"


def judge_case(check: Check, aspect: probes.Aspect, enc: dict, got: dict, want: dict | None) -> str | None:
    """Why the kernel's results ``got`` fail the aspect on this case (None: they pass): the declared
    test's own judgement (``declared.judge``), with the declared mistakes it matches named. A test
    cell that is none of the piece's declared tests (its locked one-line call names the piece it
    tests) has nothing to judge here."""
    if aspect.test is None or check.probe.declared is None:
        return None
    exercise, case = check.probe.declared, declared.plain_case(probes.decode_case(enc))
    why = declared.judge(exercise, aspect.test, case, got, want, show=False)
    return why and why + declared.named(declared.diagnose(exercise, case, got, want), "Your results match", why)


# ---------------------------------------------------------------- verdicts into the notebook
RECHECK_RUN = ("run by the grader outside your notebook, on new inputs" if not firstprinciples.BUNDLED else
               "run outside your notebook as the grader runs it, here on the notebook's own inputs: the grader's are new")


def failure_output(reason: str) -> NotebookNode:
    text = f"The trusted re-check ({RECHECK_RUN}) failed: {reason.rstrip('.')}. This test scores 0."
    return NotebookNode(output_type="error", ename=FAILED, evalue=text, traceback=[f"\x1b[0;31m{FAILED}\x1b[0m: {text}"])


def note_output(text: str) -> NotebookNode:
    text = wire.capped(text)
    return NotebookNode(output_type="stream", name="stdout",
                        text=f"Note from the grader: {text}. This test was graded on what your code does; "
                             "an instructor will look at it.\n")


def _neutral(output) -> NotebookNode:
    """An output that nbgrader cannot read as a score: a displayed value stays visible but is
    no longer a partial grade, and stderr (a warning) no longer fails the cell."""
    if output.get("output_type") == "execute_result":
        return NotebookNode(output_type="display_data", data=output.get("data", {}), metadata=output.get("metadata", {}))
    if output.get("output_type") == "stream" and output.get("name") == "stderr":
        return NotebookNode(output_type="stream", name="stdout", text=output.get("text", ""))
    return output


def apply(nb, plan: Plan, outcomes: dict) -> tuple[dict, dict]:
    """Make the verdict final in every test cell: the re-check's failure first, the kernel's
    own errors kept (a test that failed in the kernel still scores 0), nothing else that
    nbgrader could score. Returns (grade cell index -> reason, grade cell index -> flags)."""
    failed, flagged = {}, {}
    checks = {c.name: c for c in plan.checks}
    for index, names in plan.graded.items():
        cell = nb.cells[index]
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")
        reason, flags = None, []
        for name in names:
            found = outcomes.get(name)
            flags += found.flags if found else []
            aspect = checks[name].probe.cells.get(grade_id, probes.Aspect())
            why = found.reason(checks[name], aspect) if found else "it was not re-checked"
            if why and reason is None:
                reason = f"{name}: {why}{found.context if found else ''}"
        outputs = [_neutral(o) for o in cell.get("outputs", [])]
        if reason:
            outputs.insert(0, failure_output(reason))
            failed[index] = reason
        flags = sorted(set(flags))
        if flags:
            outputs.append(note_output("; ".join(flags[:3]) + (f" (and {len(flags) - 3} more)" if len(flags) > 3 else "")))
            flagged[index] = flags
        cell["outputs"] = outputs
    return failed, flagged


def local_verdicts(nb, namespace: dict, seed: int = 0, sources: set | None = None, only: set | None = None) -> dict:
    """Per test cell (grade_id): the trusted re-check's reason for failing it, or None.

    The probes run in this process on the objects of ``namespace`` instead of in the
    re-check's runner (for tests of the probes); results still go through the wire
    format and the same watch. The in-kernel outcome is ignored: every test cell is
    treated as passed. ``only``: the verdicts of the cells that test these pieces only (and of
    the pieces those cells test besides).
    """
    import copy

    from .runtime import report

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    plan = make_plan(nb, seed, sources)
    cells = {i: names for i, names in plan.graded.items() if only is None or set(names) & set(only)}
    wanted = {n for names in cells.values() for n in names}  # (with the pieces those cells also test)
    outcomes = {}
    for c in plan.checks:
        if c.name in wanted:
            rest = [e for i, e in enumerate(c.cases) if i not in c.apart]
            results = {c.name: report(namespace, c.name, rest)}
            if c.apart:  # (unwatched, as in a runner; their memory is measured only from outside a runner)
                results[c.name + ALONE] = report(namespace, c.name, [c.cases[i] for i in c.apart], watched=False)
                _rejoin(results, c.name, list(c.apart), len(c.cases))
            outcomes[c.name] = outcome(c, wire.loads(wire.dumps(results[c.name])))
    failed, _ = apply(nb, plan, outcomes)
    return {nb.cells[i].metadata["nbgrader"]["grade_id"]: failed.get(i) for i in cells}


def course_sources(source_notebook: Path) -> set | None:
    """The sources of the locked and test cells of the instructor's notebook."""
    import nbformat

    try:
        nb = nbformat.read(source_notebook, as_version=4)
    except (OSError, ValueError):
        return None
    out = set()
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and (meta.get("locked") or meta.get("grade")) and not meta.get("solution"):
            out.add(cell.source)
    return out


__all__ = ["make_plan", "recheck", "outcome", "Outcome", "apply", "seed_for", "course_sources", "FAILED", "Limits"]
