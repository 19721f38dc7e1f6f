"""A grading log an instructor can read.

``nbgrader autograde`` logs every step of every notebook (converting, sanitizing,
writing, a timeout's "Interrupting kernel") at INFO and WARNING. For a class that is
hundreds of lines in which the one thing an instructor needs, how each student did,
is missing. With the course's config (``ParallelAutograde``) the log is instead:

- one line per submission when it is done: progress, student, score, time and the
  grader's notes for it (the same notes as in ``grades.csv``);
- errors (a submission that could not be graded at all), as nbgrader logs them;
- a summary at the end: graded, already graded (by another grader or an earlier
  run), full marks, zero, timed out, repaired, flagged.

``--Autograde.verbose=True`` (or ``--log-level=DEBUG``) brings back nbgrader's
whole log. Workers print a result as one marked line (``RESULT_MARK`` + JSON); the
command that started them counts them, so the progress is the whole class's.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

RESULT_MARK = "\x1eFP-RESULT "


class QuietFilter(logging.Filter):
    """Keeps errors, the per-submission results, the summary and the lines that say
    how the round is run; drops nbgrader's step-by-step INFO and WARNING lines (the
    notes among them are in the result lines) and nbclient's timeout lines (the notes
    say which cell and which piece timed out)."""

    KEEP = ("Grading ", "Sharing ", "Interrupted", "Stopped")
    DROP = ("Timeout waiting for execute reply", "Interrupting kernel", "Kernel died while waiting for execute reply")

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "fp_result", False):
            return True
        message = record.getMessage()
        if message.startswith(self.DROP):
            return False
        return record.levelno >= logging.ERROR or message.startswith(self.KEEP)


def _consoles(log: logging.Logger) -> list:
    """The handlers of ``log`` that print to the terminal (not nbgrader's log file)."""
    return [h for h in (log.handlers or logging.getLogger().handlers)
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


def detailed(log: logging.Logger) -> bool:
    """True when the terminal is asked for DEBUG lines (``--log-level=DEBUG``)."""
    return any(max(h.level, log.getEffectiveLevel()) <= logging.DEBUG for h in _consoles(log))


def quiet(log: logging.Logger) -> None:
    """Install the filter on the terminal handlers of ``log`` (nbgrader's log file, when it
    writes one, keeps every line)."""
    for handler in _consoles(log):
        if not any(isinstance(f, QuietFilter) for f in handler.filters):
            handler.addFilter(QuietFilter())
    # nbgrader's own use of its ORM warns ("... will not be part of the operation. Consider
    # using no_autoflush ..."): nothing an instructor can act on
    import warnings

    from sqlalchemy.exc import SAWarning

    warnings.filterwarnings("ignore", category=SAWarning)


def notes_of(root: str, assignment: str, student: str) -> list[str]:
    """The grader's notes on a submission (``grading_notes/``, as in ``grades.csv``)."""
    from .notes import NOTES_DIRECTORY

    out = []
    for path in sorted((Path(root) / NOTES_DIRECTORY / assignment / student).glob("*.txt")):
        out += [f"{path.stem}: {line}" for line in path.read_text().splitlines() if line.strip()]
    return out


def result(assignment: str, student: str, score: float | None, max_score: float | None, seconds: float,
           notes: list[str]) -> dict:
    return {"assignment": assignment, "student": student, "score": score, "max_score": max_score,
            "seconds": round(seconds, 1), "notes": notes}


def encode(res: dict) -> str:
    return RESULT_MARK + json.dumps(res)


def decode(line: str) -> dict | None:
    if not line.startswith(RESULT_MARK):
        return None
    try:
        res = json.loads(line[len(RESULT_MARK):])
    except ValueError:
        return None
    return res if isinstance(res, dict) else None


def _points(x) -> str:
    return "?" if x is None else f"{float(x):g}"


def line(done: int, total: int, res: dict) -> str:
    width = len(str(total))
    text = (f"[{done:>{width}}/{total}] {res.get('student', '?')}  {res.get('assignment', '?')}  "
            f"{_points(res.get('score'))}/{_points(res.get('max_score'))}  {res.get('seconds', 0):.1f} s")
    notes = res.get("notes") or []
    if notes:
        text += "  notes: " + " | ".join(notes)
    return text


KINDS = ("timed out", "kernel died", "unreadable cell", "unanswered", "forbidden call", "repaired", "flagged")


def kinds(res: dict) -> set[str]:
    """What the notes of a result say happened (``KINDS``): a note is "repaired" only when it is
    none of the others (a kernel death, a cell Python cannot read or an untouched answer is not a
    repair). A note may start with its notebook's name (``notes_of``: "softmax: unanswered: ...")."""
    out = set()
    for note in res.get("notes") or []:
        said = note.split(": ", 1)[1] if ": " in note else note  # (what follows the notebook's name)
        if "timed out" in note or "did not finish within" in note or "did not return within" in note:
            out.add("timed out")
        elif "FLAGGED" in note:
            out.add("flagged")
        elif "the kernel died" in note:
            out.add("kernel died")
        elif note.startswith("syntax error in ") or said.startswith("syntax error in "):
            out.add("unreadable cell")
        elif note.startswith("unanswered: ") or said.startswith("unanswered: "):
            out.add("unanswered")
        elif note.startswith("forbidden call: ") or said.startswith("forbidden call: "):
            out.add("forbidden call")
        elif "failed at once" not in note:
            out.add("repaired")
    return out


def summary(results: list[dict], total: int, failed: list[str] = (), missing: list[str] = (),
            elsewhere: list[str] = ()) -> str:
    """The table printed at the end of a round: ``results`` are the submissions this run graded,
    ``elsewhere`` those of the round that another grader or an earlier run graded (their scores
    are not in this table), ``missing`` those graded by no one."""
    full = [r for r in results if r.get("score") is not None and r.get("max_score")
            and float(r["score"]) >= float(r["max_score"])]
    zero = [r for r in results if r.get("score") is not None and float(r["score"]) == 0]
    rows = [("graded", len(results), f"of {total}")]
    if elsewhere:  # by another grader sharing the class (one killed since included), or an earlier run
        rows.append(("already graded", len(elsewhere), "(by another grader or an earlier run) "
                     + ", ".join(elsewhere[:10]) + (" ..." if len(elsewhere) > 10 else "")))
    rows += [("full marks", len(full), ""), ("zero", len(zero), "")]
    for kind in KINDS:
        who = [f"{r['student']} ({r.get('assignment', '?')})" for r in results if kind in kinds(r)]
        if who or kind in ("timed out", "repaired", "flagged"):
            rows.append((kind, len(who), ", ".join(who[:10]) + (" ..." if len(who) > 10 else "")))
    if missing:  # skipped (no notebook in the folder) or stopped by an error: see the lines above
        rows.append(("not graded", len(missing), ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")))
    if failed:
        rows.append(("errors", len(failed), "; ".join(failed)[:300]))
    seconds = sum(float(r.get("seconds") or 0) for r in results)
    if results:
        rows.append(("time per submission", f"{seconds / len(results):.1f} s", "(worker time)"))
    width = max(len(r[0]) for r in rows)
    return "Summary:\n" + "\n".join(f"  {name:<{width}}  {count!s:>6}  {who}".rstrip() for name, count, who in rows)
