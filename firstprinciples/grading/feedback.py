"""Feedback a student can read, made by nbgrader's own ``nbgrader generate_feedback``.

Stock nbgrader 0.9.6 writes ``feedback/<student>/<assignment>/<notebook>.html``
with its ``feedback`` template: test cells listed as unnamed "Test cell" links,
tracebacks through the checks' internals, the hidden tests' source printed,
the reason of a failure on one unwrapped line, and MathJax loaded from a CDN
(raw LaTeX without internet). Wired in ``nbgrader_config.py``:

- ``StudentFeedback`` (in ``GenerateFeedback.preprocessors``, after nbgrader's
  ``GetGrades``): removes every ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN
  TESTS`` block from the cells and from the tracebacks (their results stay);
  cuts each traceback to the student's own frames (no frame of the course
  package, the standard library or an installed package; a test cell's frame
  keeps only the line that failed); hands the template the grader's notes
  for this student and notebook (``sanitize.notes_path``), grouped by what happened
  (``NOTE_KINDS``: not graded, time limit, kernel died, syntax error, unanswered,
  forbidden call, repaired), each group under its own heading; puts every error
  without a message in words (``explain_errors``: a cell interrupted at its time
  limit leaves an empty KeyboardInterrupt and an empty CellTimeoutError, shown as one
  "Time limit reached" that names the piece and the limit); and marks the test cells
  whose score an instructor set by hand (from the gradebook: a manual score that
  differs from the automatic one), so that the page shows that score as set by hand,
  beside the automatic one, and drops the automatic grading's "This test scores 0.".
- ``FeedbackExporter`` (``GenerateFeedback.exporter_class``): nbgrader's HTML
  exporter with the course's ``templates/student_feedback`` template, used
  wherever nbgrader asks for its own ``feedback`` template (so formgrader's
  "generate feedback" button uses it too), and LaTeX in markdown rendered to MathML at feedback time
  (``latex2mathml``): no script at all, nothing fetched.

The page: the notebook's score, the notes under their headings ("Your code ran past its time limit"),
a table of the tests by name (grade_id) with their points and
the first line of each failure's reason; then the notebook, each test cell
headed by its name and points, the reason first (wrapped), the test's source
and the student's frames folded below it.
"""
from __future__ import annotations

import copy
import html
import os
import re
import sysconfig

from jinja2 import pass_context
from latex2mathml.converter import convert as _latex_to_mathml
from nbconvert.exporters import HTMLExporter
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Bool, default, validate

from .execute import FAULT_NAME
from .sanitize import _coursedir, notes_path
from .verdicts import FORBIDDEN_NOTE

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
TEMPLATE_NAME = "student_feedback"  # (not "feedback": that is the name of nbgrader's output folder)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # firstprinciples/

BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"
HIDDEN_PLACEHOLDER = "# (hidden tests: the grader ran more checks here; their result is shown)"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A traceback's context line: "----> 5 source" (the line that raised) or "      4 source".
_CONTEXT = re.compile(r"^(-*>)?\s*(\d+)( ?)(.*)$")
FLAG_PREFIX = "FLAGGED for an instructor"
TEST_CELL = " (the test cell)"
# The trusted re-check's preamble, shortened in the table of tests (the cell shows it whole).
_RECHECK = re.compile(r"^The trusted re-check \(.*?\) failed: ")


# ------------------------------------------------------------------ math
def mathml(tex: str, display: bool) -> str:
    """``tex`` as MathML (block or inline); the TeX itself, in a <code>, if it cannot be converted."""
    try:
        return _latex_to_mathml(tex.strip(), display="block" if display else "inline")
    except Exception:  # a macro latex2mathml does not know: the TeX stays readable
        return f'<code class="fp-tex">{html.escape(tex)}</code>'


class MathMLRenderer(IPythonRenderer):
    """nbconvert's markdown renderer with math as MathML instead of TeX left for MathJax."""

    def block_math(self, body: str) -> str:
        return mathml(body, display=True)

    def inline_math(self, body: str) -> str:
        return mathml(body, display=False)

    def latex_environment(self, name: str, body: str) -> str:
        return mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True)


class FeedbackExporter(HTMLExporter):
    """HTMLExporter with the course's feedback template and math typeset offline."""

    @default("exclude_anchor_links")
    def _no_anchor_links(self):
        return True  # the headings' "¶" links are for a notebook's reader, not a feedback page

    def __init__(self, config=None, **kw):
        # nbgrader's GenerateFeedback asks for HTMLExporter.template_name = "feedback": this
        # exporter answers with the course's template instead (a section of its own name wins)
        if config is not None and config.get("HTMLExporter", {}).get("template_name") == "feedback":
            config = copy.deepcopy(config)
            config.FeedbackExporter.template_name = TEMPLATE_NAME
        super().__init__(config=config, **kw)

    @validate("extra_template_basedirs")
    def _course_templates_first(self, proposal):
        dirs = [d for d in proposal["value"] if os.path.abspath(d) != TEMPLATES]
        return [TEMPLATES, *dirs]

    @pass_context
    def markdown2html(self, context, source):
        cell = context.get("cell", {})
        renderer = MathMLRenderer(
            escape=False,
            attachments=cell.get("attachments", {}),
            embed_images=self.embed_images,
            path=context.get("resources", {}).get("metadata", {}).get("path", ""),
            anchor_link_text=self.anchor_link_text,
            exclude_anchor_links=self.exclude_anchor_links,
            **self.lexer_options,
        )
        return MarkdownWithMath(renderer=renderer).render(source)


# ------------------------------------------------------------------ hidden tests
def hidden_ranges(source: str) -> list[tuple[int, int]]:
    """1-based (first, last) line numbers of each hidden-tests block, markers included."""
    ranges, start = [], None
    for number, line in enumerate(source.splitlines(), 1):
        text = line.strip()
        if text.startswith(BEGIN_HIDDEN) and start is None:
            start = number
        elif text.startswith(END_HIDDEN) and start is not None:
            ranges.append((start, number))
            start = None
    if start is not None:  # an unclosed block hides everything after it
        ranges.append((start, len(source.splitlines())))
    return ranges


def strip_hidden(source: str) -> str:
    """``source`` with each hidden-tests block replaced by one placeholder comment."""
    lines = source.splitlines()
    out, hidden = [], [False] * len(lines)
    for first, last in hidden_ranges(source):
        for n in range(first, last + 1):
            hidden[n - 1] = True
    for i, line in enumerate(lines):
        if not hidden[i]:
            out.append(line)
        elif i == 0 or not hidden[i - 1]:
            out.append(line[: len(line) - len(line.lstrip())] + HIDDEN_PLACEHOLDER)
    return "\n".join(out)


# ------------------------------------------------------------------ tracebacks
def _library_prefixes() -> tuple[str, ...]:
    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.abspath(d) + os.sep for d in dirs if d)


_LIBRARIES = _library_prefixes()


def is_students_file(path: str) -> bool:
    """False for the course package, the standard library and installed packages."""
    if path.startswith("<"):
        return not (path.startswith("<frozen") or path == "<string>")
    path = os.path.abspath(path)
    parts = path.split(os.sep)
    if path.startswith(_PACKAGE + os.sep) or "firstprinciples" in parts:
        return False
    return not (path.startswith(_LIBRARIES) or "site-packages" in parts or "dist-packages" in parts)


def _frame_lines(entry: str) -> list[str]:
    return _ANSI.sub("", entry).rstrip("\n").splitlines()


def _context(lines: list[str]) -> list[tuple[bool, int, str]]:
    """(is the failing line, number, text) of each numbered source line of a frame."""
    out = []
    for line in lines:
        m = _CONTEXT.match(line)
        if m and (m.group(3) or not m.group(4)):
            out.append((bool(m.group(1)), int(m.group(2)), m.group(4)))
    return out


def _same_lines(context, source: str) -> bool:
    lines = source.splitlines()
    return bool(context) and all(0 < n <= len(lines) and lines[n - 1].rstrip() == text.rstrip()
                                 for _, n, text in context)


def student_frames(traceback: list[str], cell, cells, hidden_lines: set[str]) -> list[str]:
    """The frames of an IPython traceback that are the student's own, as plain text.

    A frame in a notebook cell ("Cell In[5], line 3") is kept; a test cell's frame shows
    only the line that failed, or "(a hidden test)" when that line is one; a frame in a
    file is kept only when the file is the student's; IPython's headers, "skipping hidden
    frames" lines and the final "Error: message" line (shown as the reason) are dropped.
    """
    kept = []
    for entry in traceback:
        lines = _frame_lines(entry)
        if not lines:
            continue
        head = lines[0].strip()
        if head.startswith("Cell In["):
            context = _context(lines[1:])
            owner = next((c for c in [cell, *cells] if c.cell_type == "code" and _same_lines(context, c.source)),
                         None)
            is_test = owner is not None and owner.get("metadata", {}).get("nbgrader", {}).get("grade") \
                and not owner.get("metadata", {}).get("nbgrader", {}).get("solution")
            ranges = hidden_ranges(owner.source) if owner is not None else []

            def hidden(n, text):
                return any(a <= n <= b for a, b in ranges) or text.strip() in hidden_lines \
                    or "HIDDEN TESTS" in text

            shown = []
            for failing, n, text in context:
                if is_test and not failing:
                    continue  # the test's source is shown above; here only the line that failed
                if hidden(n, text):
                    if failing:
                        shown.append(f"----> {n} (a hidden test)")
                    continue
                shown.append(f"{'---->' if failing else '     '} {n} {text}")
            title = head if not any(hidden(n, t) for f, n, t in context if f) else head.split(",")[0]
            frame = "\n".join([title + (TEST_CELL if is_test else ""), *shown])
            if not kept or kept[-1] != frame:  # the check's wrapper repeats the test cell's frame
                kept.append(frame)
        elif head.startswith("File "):
            m = re.match(r"File (.+?):(\d+)", head)
            if m and is_students_file(m.group(1)) and (not kept or kept[-1] != "\n".join(lines)):
                kept.append("\n".join(lines))
        # everything else: IPython's header and separators, hidden-frame counts, the message
    if all(frame.splitlines()[0].endswith(TEST_CELL) for frame in kept):
        return []  # only the test's own line: the reason says more
    return kept


# ------------------------------------------------------------------ notes
# The grader's notes (firstprinciples.grading.sanitize, execute, verdicts) are written for an
# instructor; the student reads the known ones in these words (any other note is shown as it is).
_NOTES_FOR_STUDENTS = [
    ("missing cells put back from the source: ",
     "cells missing from your notebook were put back from the course's copy and graded: "),
    ("cells with unknown ids graded as plain cells: ",
     "cells whose nbgrader id the course does not know were kept as ordinary cells: "),
    ("cells without nbgrader metadata recognised by their content: ",
     "cells that had lost their nbgrader metadata were recognised by their content: "),
    ("extra files beside the notebook (the sandboxed kernel does not see them): ",
     "files submitted beside the notebook were not used (the grader runs the notebook on its own): "),
]


def for_student(note: str) -> str:
    for prefix, words in _NOTES_FOR_STUDENTS:
        if note.startswith(prefix):
            return words + note[len(prefix):]
    return note


# Each kind of note under a heading of its own, in this order: (kind, heading, what it means).
NOTE_KINDS = [
    ("not graded", "Your notebook could not be graded",
     "The grader graded the course's notebook in its place, so every test scores 0."),
    ("timeout", "Your code ran past its time limit",
     "The grader stops a cell that is still running when its time is up. When a piece of yours did "
     "not return, it is not run again: the later tests that call it fail at once."),
    ("died", "The kernel died",
     "The Python process running your notebook stopped: your code crashed it, ended it, or used more "
     "memory or CPU time than allowed. Grading went on in a fresh kernel. A piece of yours that did "
     "this is not run again: the later tests that call it fail at once."),
    ("syntax", "Code Python could not read", "A cell with a syntax error defines nothing."),
    ("unanswered", "Unanswered", "These answer cells are still as they were released."),
    ("forbidden", "Calls your code must not make", "A test whose piece makes such a call scores 0."),
    ("repair", "Your notebook was repaired before grading",
     "The grader fixed these changes to the notebook's structure, then graded it as usual."),
    ("flag", "Flagged for your instructor", ""),
    ("other", "Also noted", ""),
]
_REPAIRS = re.compile(r"^(missing cells put back from the source: |cells with unknown ids graded as plain cells: "
                      r"|cells without nbgrader metadata recognised by their content: "
                      r"|extra files beside the notebook |cell '.*' (was there twice|had been turned into )"
                      r"|graded '.*' \(the only notebook submitted\) as )")
_AT_ONCE = re.compile(r"later test\(s\) that call (\w+) failed at once")


def note_kind(note: str) -> str:
    """Which of ``NOTE_KINDS`` a grader's note (as the grader wrote it) is."""
    if note.startswith("graded as 0: "):
        return "not graded"
    if note.startswith(FLAG_PREFIX):
        return "flag"
    if note.startswith(FORBIDDEN_NOTE):
        return "forbidden"
    if note.startswith("syntax error in "):
        return "syntax"
    if note.startswith("unanswered: "):
        return "unanswered"
    if "the kernel died" in note:
        return "died"
    if " timed out: " in note or "did not finish within" in note:
        return "timeout"
    if _REPAIRS.match(note):
        return "repair"
    return "other"


def group_notes(notes: list[str]) -> list[dict]:
    """The notes by kind, in ``NOTE_KINDS`` order: [{kind, heading, meaning, notes}], in the
    student's words. "N later tests that call P failed at once" goes with the note that says
    what P did (it hung, or it killed the kernel)."""
    kinds = [note_kind(n) for n in notes]
    for i, note in enumerate(notes):
        m = _AT_ONCE.search(note)
        if m and kinds[i] == "other":
            piece = re.compile(rf"\b{re.escape(m.group(1))}\b")
            kinds[i] = next((k for n, k in zip(notes, kinds) if k in ("timeout", "died") and piece.search(n)),
                            "timeout")
    groups = []
    for kind, heading, meaning in NOTE_KINDS:
        mine = [for_student(n) for n, k in zip(notes, kinds) if k == kind]
        if mine:
            groups.append({"kind": kind, "heading": heading, "meaning": meaning, "notes": mine})
    return groups


# ------------------------------------------------------------------ errors, in words
# The label above an error's message (any other error is labelled by its name).
LABELS = {
    "TrustedCheckFailed": "Failed the grader's re-check",
    "AssertionError": "Test failed",
    "YourCodeFailed": "Your code raised an error",
}
_TEMP_FILE = re.compile(r"\(\d+\.py, line (\d+)\)")  # IPython's "(1648086921.py, line 3)"
_WITHIN = re.compile(r"within (\d+(?:\.\d+)?) s")


def _fault_label(evalue: str) -> str:
    """The label of the grader's own error output (``execute.FAULT_NAME``), from what it says."""
    if "kernel died" in evalue or "killed the kernel" in evalue:
        return "The kernel died" if "fails at once" not in evalue else "Not run again"
    if "fails at once" in evalue:
        return "Not run again"
    if evalue.startswith("Not run"):
        return "Not run"
    if "did not finish within" in evalue:
        return "Time limit reached"
    return "Stopped by the grader"


def _timeout_words(where: str, notes: list[str]) -> str:
    """What a cell interrupted at its time limit says, with the limit and the piece when a note names them."""
    note = next((n for n in notes if n.startswith(where + " ") and note_kind(n) == "timeout"), "")
    limit = _WITHIN.search(note)
    piece = re.search(r" timed out: (.+?) did not return", note)
    if piece:
        did = f"Your {piece.group(1)} did not return" + (f" within {limit.group(1)} s" if limit else " in time")
    else:
        did = "This cell was still running " + (f"after {limit.group(1)} s" if limit else "when its time was up")
    return did + ", so the grader interrupted it."


def explain_errors(cell, where: str, notes: list[str]) -> None:
    """Give each error output of ``cell`` a label (``fp_label``) and a message in words.

    A cell stopped at its time limit leaves up to three error outputs that say the same: the
    KeyboardInterrupt of the interrupt (no message; its traceback shows where the code was),
    nbclient's CellTimeoutError (no message) and, when the interrupt did not stop it, the
    grader's own "did not finish within" fault. They become one "Time limit reached" box: the
    grader's words if it has them, else what ran out of time (from ``notes``: the piece and the
    limit), with the KeyboardInterrupt's traceback. Any other error without a message says so."""
    outputs = cell.get("outputs", [])
    errors = [o for o in outputs if o.get("output_type") == "error"]
    timed_out = any(o.get("ename") == "CellTimeoutError" for o in errors)
    stopped = [o for o in errors if o.get("ename") == "CellTimeoutError"
               or (o.get("ename") == "KeyboardInterrupt" and timed_out and not str(o.get("evalue") or "").strip())
               or (o.get("ename") == FAULT_NAME and "did not finish within" in str(o.get("evalue") or ""))]
    drop = set()
    if stopped:
        keep = next((o for o in stopped if o.get("ename") == FAULT_NAME), None) or \
            next((o for o in stopped if o.get("ename") == "KeyboardInterrupt"), stopped[0])
        where_it_was = next((o.get("traceback") for o in stopped if o.get("ename") == "KeyboardInterrupt"), None)
        if where_it_was and not keep.get("traceback"):
            keep["traceback"] = where_it_was
        keep["fp_label"] = "Time limit reached"
        if keep.get("ename") != FAULT_NAME:
            keep["evalue"] = _timeout_words(where, notes)
        drop = {id(o) for o in stopped if o is not keep}
    for o in errors:
        name, value = o.get("ename", ""), str(o.get("evalue") or "").strip()
        if any(o is x for x in stopped):
            continue
        if name == FAULT_NAME:
            o["fp_label"] = _fault_label(value)
            continue
        o["fp_label"] = LABELS.get(name, name)
        if name in ("SyntaxError", "IndentationError", "TabError"):
            o["evalue"] = _TEMP_FILE.sub(r"(line \1)", value)
        elif not value and name == "NotImplementedError":
            o["evalue"] = ("Raised without a message: this is the exercise's placeholder, "
                           "raise NotImplementedError(). Replace it with your code.")
        elif not value:
            o["evalue"] = f"{name or 'An error'} was raised without a message."
    cell["outputs"] = [o for o in outputs if id(o) not in drop]


# ------------------------------------------------------------------ the preprocessor
class StudentFeedback(NbGraderPreprocessor):
    """Prepares an autograded notebook for a student's eyes (see the module docstring)."""

    show_flags = Bool(False, help="Also show the notes flagged for an instructor "
                                  "(e.g. a patched torch.allclose) to the student.").tag(config=True)

    def preprocess(self, nb, resources):
        hidden_lines = set()
        for cell in nb.cells:
            lines = cell.source.splitlines()
            for first, last in hidden_ranges(cell.source):
                hidden_lines.update(l.strip() for l in lines[first - 1:last] if l.strip())
        raw = self._raw_notes(resources)
        notes = [n for n in raw if self.show_flags or not n.startswith(FLAG_PREFIX)]
        by_hand = self._set_by_hand(resources)
        for index, cell in enumerate(nb.cells):
            self._cell(cell, nb.cells, hidden_lines)
            if cell.cell_type == "code":
                explain_errors(cell, _grade_id(cell) or f"code cell {index + 1}", raw)
            auto = by_hand.get(_grade_id(cell))
            if auto is not None and cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
                self._by_hand(cell, auto)
        resources.setdefault("fp_feedback", {})["notes"] = [for_student(n) for n in notes]
        resources["fp_feedback"]["groups"] = group_notes(notes)
        resources["fp_feedback"]["tests"] = self._tests(nb)
        return nb, resources

    def _cell(self, cell, cells, hidden_lines):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                output["traceback"] = student_frames(output.get("traceback", []), cell, cells, hidden_lines)
                output["evalue"] = _ANSI.sub("", str(output.get("evalue", "")))
            elif output.get("output_type") == "stream" and BEGIN_HIDDEN in output.get("text", ""):
                output["text"] = strip_hidden(output["text"])
        if BEGIN_HIDDEN in cell.source:
            cell.source = strip_hidden(cell.source)

    def _raw_notes(self, resources) -> list[str]:
        """The grader's notes on this student's notebook, as the grader wrote them."""
        info = resources.get("nbgrader", {})
        if not info.get("student"):
            return []
        path = notes_path(_coursedir(self).root, info["assignment"], info["student"], info["notebook"])
        try:
            return [l.strip() for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
        except OSError:
            return []

    def _set_by_hand(self, resources) -> dict:
        """{grade_id: the automatic score} of the autograded cells whose score an instructor
        changed by hand (a manual score that differs from the automatic one)."""
        info = resources.get("nbgrader", {})
        if not (info.get("student") and info.get("db_url")):
            return {}
        from nbgrader.api import Gradebook, MissingEntry

        try:
            with Gradebook(info["db_url"]) as gb:
                notebook = gb.find_submission_notebook(info["notebook"], info["assignment"], info["student"])
                return {g.name: float(g.auto_score) for g in notebook.grades
                        if g.manual_score is not None and g.auto_score is not None
                        and float(g.manual_score) != float(g.auto_score)}
        except MissingEntry:
            return {}

    @staticmethod
    def _by_hand(cell, auto: float) -> None:
        """A test cell whose score an instructor set by hand: the page says so, and no message
        of the automatic grading claims a score ("This test scores 0.") that is no longer the one shown."""
        meta = cell.metadata.nbgrader
        meta["fp_auto_score"] = auto
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                o["evalue"] = re.sub(r"\s*This test scores 0\.\s*$", "", str(o.get("evalue", "")))

    @staticmethod
    def _tests(nb) -> list[dict]:
        """Every graded cell: name, score, points, the automatic score where an instructor set the
        score by hand, and the first line of each failure's reason."""
        tests = []
        for cell in nb.cells:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if not meta.get("grade"):
                continue
            reasons = [str(o.get("evalue") or o.get("ename") or "").strip().splitlines()
                       for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            tests.append({
                "name": meta.get("grade_id"),
                "kind": ("test" if not meta.get("solution") and cell.cell_type == "code" else
                         "answer" if cell.cell_type == "code" else "written answer"),
                "score": meta.get("score"),
                "points": meta.get("points"),
                "auto_score": meta.get("fp_auto_score"),
                "reason": _RECHECK.sub("re-check: ", next((r[0] for r in reasons if r), "")),
            })
        return tests


def _grade_id(cell) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "") or ""
