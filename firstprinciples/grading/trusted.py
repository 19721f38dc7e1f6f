"""Verdicts that no student code can forge: the trusted half of grading.

nbgrader scores a test cell by whether it raised inside the student's kernel,
and the student's code runs first in that kernel: it can patch numpy, torch or
the checks, strip ``assert`` statements with an input transformer, return a
tensor subclass that claims to equal anything, or read the hidden tests. So a
point here needs two things:

1. the test cell passed in the kernel (the visible and hidden checks, with
   their explanations for the student), and
2. the *trusted re-check* of every graded object the test cell uses passes.

The trusted re-check (``RobustExecute`` runs it after the last cell):

- ``scan``: the grader reads the student's cells as text before trusting any
  result: code that reaches into the grading machinery voids every verdict of
  the notebook; a forbidden built-in voids the verdict of its piece;
- for each probe (``firstprinciples.grading.probes``), fresh inputs are drawn in
  the grader from a secret seed (an HMAC of a course secret that the sandbox
  cannot read, the student, the assignment and the notebook: unknown to the
  student, the same on every re-run); one probe cell runs in the student's
  kernel and prints its results as plain data (JSON; tensors as dtype, shape and
  bytes); the grader runs the same probe on the reference, in its own process,
  and compares: exact type, dtype, shape, ``requires_grad``, the positions of
  NaN and infinities, and the values within the tolerance of the dtype;
- a test cell that passed in the kernel but whose objects fail the re-check
  gets an error output ``TrustedCheckFailed`` with the reason: nbgrader then
  scores it 0 and the feedback says why.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from nbformat import NotebookNode

from . import probes, scan, wire
from .runtime import MARK

FAILED = "TrustedCheckFailed"
SECRET_FILE = ".fp_grading_secret"  # in the course root; never inside a sandbox
DEFAULT_TOLERANCE = {"float32": (1e-5, 1e-4), "float64": (1e-10, 1e-8), "float16": (1e-2, 1e-2)}


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
    source: str  # the probe cell sent to the kernel
    expected: list = field(default_factory=list)  # the reference's encoded results, per case


@dataclass
class Plan:
    checks: list
    scan: scan.ScanResult
    graded: dict  # grade cell index -> names of probed objects it uses

    @property
    def tamper(self) -> list:
        return self.scan.tamper


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


def probe_source(name: str, cases_encoded: list) -> str:
    spec = json.dumps(wire.dumps({"name": name, "cases": cases_encoded}))
    return ('__import__("firstprinciples.grading.runtime", fromlist=["run_probe"])'
            f".run_probe(globals(), {spec})")


def make_plan(nb, seed: int, course_sources: set | None = None) -> Plan:
    registry = probes.load()
    result = scan.scan(nb, course_sources)
    graded = grade_cell_names(nb, registry)
    names = sorted({n for ns in graded.values() for n in ns})
    checks = []
    for name in names:
        probe = registry[name]
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        cases = probe.cases(rng)
        encoded = [probes.encode_case(c) for c in cases]
        checks.append(Check(name, probe, encoded, probe_source(name, encoded)))
    return Plan(checks, result, graded)


def reference_results(check: Check) -> list:
    """The reference's results on the check's cases, computed here (in the trusted grader)."""
    out = []
    for enc in check.cases:
        res = check.probe.run(check.probe.reference, probes.decode_case(enc))
        out.append({k: wire.encode(v) for k, v in res.items()})
    return out


# ---------------------------------------------------------------- reading the kernel's report
def read_report(outputs, name: str) -> dict | None:
    text = "".join(o.get("text", "") for o in outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    for line in reversed(text.splitlines()):
        if line.startswith(MARK):
            try:
                report = wire.loads(line[len(MARK):])
            except (ValueError, wire.WireError):
                return None
            return report if isinstance(report, dict) and report.get("name") == name else None
    return None


# ---------------------------------------------------------------- comparison
def _describe(d: dict) -> str:
    t = d.get("type", "?")
    if wire.is_array(d):
        return f"a {t} of dtype {d.get('dtype')} and shape {tuple(d.get('shape', ()))}"
    return f"a {t}"


def compare(got: dict, want: dict, where: str, tolerance: dict, values: bool = True) -> str | None:
    """None when ``got`` matches ``want``, else what differs (``values=False``: only
    type, dtype, shape and requires_grad)."""
    if not isinstance(got, dict) or got.get("type") != want.get("type"):
        return f"{where} is {_describe(got) if isinstance(got, dict) else 'missing'}, expected {_describe(want)}"
    if wire.is_array(want):
        if not wire.is_array(got):
            return f"{where} holds no data"
        if got.get("dtype") != want["dtype"]:
            return f"{where} has dtype {got.get('dtype')}, expected {want['dtype']}"
        if list(got.get("shape", [])) != list(want["shape"]):
            return f"{where} has shape {tuple(got.get('shape', []))}, expected {tuple(want['shape'])}"
        if bool(got.get("requires_grad")) != bool(want.get("requires_grad")):
            return (f"{where} has requires_grad={bool(got.get('requires_grad'))}, expected "
                    f"{bool(want.get('requires_grad'))}")
        if not values:
            return None
        try:
            g = wire.array(got)
        except wire.WireError as e:
            return f"{where}: {e}"
        w = wire.array(want)
        if w.dtype.kind in "fc":
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            if not np.array_equal(np.isnan(g64), np.isnan(w64)):
                return f"{where} has NaN where the reference has none (or the reverse)"
            if not np.array_equal(np.isinf(g64) * np.sign(np.nan_to_num(g64)),
                                  np.isinf(w64) * np.sign(np.nan_to_num(w64))):
                return f"{where} has infinities where the reference has none (or the reverse)"
            finite = np.isfinite(w64)
            atol, rtol = tolerance.get(want["dtype"], DEFAULT_TOLERANCE.get(want["dtype"], (1e-5, 1e-4)))
            diff = np.abs(g64[finite] - w64[finite])
            allowed = (atol + rtol * np.abs(w64))[finite]
            if diff.size and np.any(diff > allowed):
                return (f"{where} differs from the reference by up to {diff.max():.3g} "
                        f"(allowed: {atol:g} + {rtol:g}·|reference|)")
        elif not np.array_equal(g, w):
            return f"{where} differs from the reference"
        return None
    if "items" in want:
        items = got.get("items")
        if not isinstance(items, list) or len(items) != len(want["items"]):
            return f"{where} has {len(items) if isinstance(items, list) else 'no'} items, expected {len(want['items'])}"
        if want.get("keys") is not None and got.get("keys") != want["keys"]:
            return f"{where} has keys {got.get('keys')}, expected {want['keys']}"
        for i, (g, w) in enumerate(zip(items, want["items"])):
            reason = compare(g, w, f"{where}[{i}]", tolerance, values)
            if reason:
                return reason
        return None
    gv, wv = wire.scalar(got), wire.scalar(want)
    if not values:
        return None
    if isinstance(wv, float) and isinstance(gv, float):
        if math.isclose(gv, wv, rel_tol=1e-8, abs_tol=1e-10) or (math.isnan(gv) and math.isnan(wv)):
            return None
        return f"{where} is {gv!r}, expected {wv!r}"
    if gv != wv:
        return f"{where} is {gv!r}, expected {wv!r}"
    return None


@dataclass
class Outcome:
    """What the re-check found for one object: a reason that voids every case
    (``overall``), or per case the kernel's results and the reference's (or why
    the case failed outright)."""
    overall: str | None = None
    cases: list = field(default_factory=list)  # per case: {"error": reason} or {"got": ..., "want": ...}

    def reason(self, check: Check, aspect: probes.Aspect) -> str | None:
        if self.overall:
            return self.overall
        for i, (enc, found) in enumerate(zip(check.cases, self.cases)):
            tags = set(wire.scalar(t) for t in enc["tags"]["items"]) if "tags" in enc else set()
            if aspect.tags is not None and not (tags & aspect.tags):
                continue
            why = found.get("error") or judge_case(check, aspect, enc, found["got"], found.get("want"))
            if why:
                return f"on {_label(enc, i)}: {why}"
        return None


def _label(enc: dict, i: int) -> str:
    return wire.scalar(enc["label"]) if "label" in enc else f"case {i + 1}"


def judge_case(check: Check, aspect: probes.Aspect, enc: dict, got: dict, want: dict | None) -> str | None:
    """Why the kernel's results ``got`` fail the aspect on this case (None: they pass)."""
    if check.probe.judge is not None:
        return check.probe.judge(probes.decode_case(enc), got)
    if set(got) != set(want):
        return f"it returned {', '.join(sorted(got)) or 'nothing'}, expected {', '.join(sorted(want))}"
    for key in want:
        # an input after the call is always compared exactly: no test lets an answer change its inputs
        values = aspect.mode == "values" or key.endswith(" after the call")
        reason = compare(got[key], want[key], key, check.probe.tolerance, values=values)
        if reason:
            return reason
    if aspect.also is not None:  # a property of the results
        return aspect.also(probes.decode_case(enc), got, want)
    return None


def outcome(check: Check, report: dict | None) -> Outcome:
    """Collect the kernel's report next to the reference's results, case by case."""
    if report is None:
        return Outcome("the re-check produced no readable result (the object's output was lost or cut)")
    if report.get("missing"):
        return Outcome(f"{check.name} is not defined when the notebook has run")
    results = report.get("results")
    if not isinstance(results, list) or len(results) != len(check.cases):
        return Outcome("the re-check's result is incomplete")
    if check.probe.judge is None and not check.expected:
        check.expected = reference_results(check)
    found = []
    for i, res in enumerate(results):
        if not isinstance(res, dict):
            found.append({"error": "unreadable result"})
        elif res.get("hits"):
            found.append({"error": f"it calls {', '.join(map(str, res['hits'][:3]))}, which this piece must not use"})
        elif not isinstance(res.get("outputs"), dict):
            found.append({"error": f"it raised {str(res.get('error', '?'))[:300]}"})
        else:
            found.append({"got": res["outputs"], "want": check.expected[i] if check.expected else None})
    return Outcome(None, found)


# ---------------------------------------------------------------- verdicts into the notebook
def _failed(cell) -> bool:
    return any(o.get("output_type") == "error" for o in cell.get("outputs", []))


def failure_output(reason: str) -> NotebookNode:
    text = (f"The trusted re-check (run by the grader outside your notebook, on new inputs) failed: {reason}. "
            "This test scores 0.")
    return NotebookNode(output_type="error", ename=FAILED, evalue=text, traceback=[f"\x1b[0;31m{FAILED}\x1b[0m: {text}"])


def apply(nb, plan: Plan, outcomes: dict) -> dict:
    """Fail every test cell that uses an object that failed the re-check for what the cell
    grades (or any test cell, if the notebook tampers); a cell that already failed in the
    kernel gets the reason too, for the feedback. Returns grade cell index -> reason."""
    failed = {}
    tamper = plan.tamper
    checks = {c.name: c for c in plan.checks}
    for index, names in plan.graded.items():
        cell = nb.cells[index]
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")
        reason = None
        if tamper:
            f = tamper[0]
            more = f" (and {len(tamper) - 1} more)" if len(tamper) > 1 else ""
            reason = f"{f.describe(plan.scan.label(f))}{more}"
        else:
            for name in names:
                found = outcomes.get(name)
                aspect = checks[name].probe.cells.get(grade_id, probes.Aspect())
                why = found.reason(checks[name], aspect) if found else "it was not re-checked"
                if why:
                    reason = f"{name}: {why}"
                    break
        if reason:
            cell.setdefault("outputs", []).append(failure_output(reason))
            failed[index] = reason
    return failed


def static_verdicts(plan: Plan) -> dict:
    """Reasons from the scan alone (forbidden built-ins, local escapes), by object name."""
    out = {}
    for check in plan.checks:
        patterns = check.probe.watch()["torch_patterns"]
        found = plan.scan.findings_for(check.name, patterns)
        if found:
            f = found[0]
            out[check.name] = Outcome(f.describe(plan.scan.label(f)))
    return out


def local_verdicts(nb, namespace: dict, seed: int = 0, sources: set | None = None) -> dict:
    """Per test cell (grade_id): the trusted re-check's reason for failing it, or None.

    The probes run in this process on the objects of ``namespace`` instead of in a
    kernel (for tests of the probes); results still go through the wire format.
    The in-kernel outcome is ignored: every test cell is treated as passed.
    """
    import copy

    from .runtime import report

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    plan = make_plan(nb, seed, sources)
    outcomes = static_verdicts(plan)
    for check in plan.checks:
        if check.name not in outcomes and not plan.tamper:
            outcomes[check.name] = outcome(check, wire.loads(wire.dumps(report(namespace, check.name, check.cases))))
    failed = apply(nb, plan, outcomes)
    return {nb.cells[i].metadata["nbgrader"]["grade_id"]: failed.get(i) for i in plan.graded}


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


__all__ = ["make_plan", "outcome", "Outcome", "apply", "static_verdicts", "seed_for", "course_sources", "read_report", "FAILED"]
