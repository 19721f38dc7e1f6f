"""Broken submissions are graded as far as possible, with a note per student.

Stock nbgrader 0.9.6 (measured on the ``softmax`` assignment, see
``tests/grading/test_grading_broken.py``):

- a notebook that is not JSON fails that student's grading, the exit code is 1,
  and the gradebook keeps whatever score an earlier run left (a stale 10);
- a notebook under another name ("softmax-Copy1.ipynb") fails that student with
  a misleading "did you forget to run generate_assignment?";
- a deleted test cell scores 0 for that test (``OverwriteCells.add_missing_cells``
  exists but places cells by a rule that fails for a test after a markdown cell);
- a duplicated test cell *aborts the whole batch*: ``DeduplicateIds`` leaves the
  earlier copy with an empty ``nbgrader`` dict, which ``CheckCellMetadata``
  takes for an outdated schema (``SchemaTooOldError``); the same happens for
  any cell whose metadata a student edited by hand (missing or other
  ``schema_version``);
- a notebook with all nbgrader metadata stripped scores 0 (no test is found).

The pieces below, wired in ``nbgrader_config.py``, fix that with nbgrader's
own extension points:

- ``RestoreCells`` (first of ``Autograde.sanitize_preprocessors``): the
  nbgrader metadata of every cell is rebuilt from the gradebook (or dropped);
  cells without metadata are recognised by their content; duplicates keep the
  last copy; missing test and setup cells are put back from the gradebook at
  their place in the source order;
- ``TolerantNotebookExporter`` (``Autograde.exporter_class``): a submission
  that cannot be read (or is missing) is replaced by the released notebook whose
  answer cells raise an error saying why, so it is graded normally (0), its
  feedback says why, and any earlier score is overwritten;
- ``MatchNotebooks`` (``Autograde.pre_convert_hook``): a notebook under another
  name is graded as the expected one when that is unambiguous;
- ``CsvExportWithNotes`` (``ExportApp.plugin_class``): grades.csv gets a
  ``notes`` column with what was repaired or could not be graded, and a row
  (score 0) for a submission folder without any notebook, which nbgrader's
  autograde never looks at.

The notes of one student's notebook are kept in
``grading_notes/<assignment>/<student>/<notebook>.txt`` in the course folder
(outside anything a student submits); each grading of that notebook rewrites
them.
"""
from __future__ import annotations

import csv
import fnmatch
import glob
import os
import re
from pathlib import Path

import nbformat
from nbconvert.exporters import NotebookExporter
from nbformat import NotebookNode

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.coursedir import CourseDirectory
from nbgrader.plugins.export import CsvExportPlugin
from nbgrader.preprocessors import NbGraderPreprocessor, OverwriteCells

from .exchange import NBGRADER_FILES
from .notes import MARKER, NOTE_MAX, NOTES_DIRECTORY, add_note, capped, notes_path  # noqa: F401 (also read from here)

# Expected notebook path -> the file actually graded for it (None: nothing usable).
# Filled by MatchNotebooks, read by TolerantNotebookExporter (same process).
SUBSTITUTES: dict[str, str | None] = {}


# --------------------------------------------------------------------- helpers
def _coursedir(obj) -> CourseDirectory:
    """The converter's CourseDirectory (preprocessor -> exporter -> converter)."""
    while obj is not None:
        if getattr(obj, "coursedir", None) is not None:
            return obj.coursedir
        obj = getattr(obj, "parent", None)
    return CourseDirectory()


def _meta(cell) -> dict:
    m = cell.get("metadata", {}).get("nbgrader")
    return m if isinstance(m, dict) else {}


def _reference_notebook(cd: CourseDirectory, assignment: str, notebook: str):
    """The released notebook (what the student got), else the source one."""
    for step in (cd.release_directory, cd.source_directory):
        path = os.path.join(cd.format_path(step, ".", assignment), f"{notebook}.ipynb")
        if os.path.exists(path):
            try:
                return nbformat.read(path, as_version=4)
            except Exception:
                continue
    return None


# ------------------------------------------------------------ sanitize: cells
class RestoreCells(NbGraderPreprocessor):
    """Make the nbgrader metadata of a submission trustworthy before nbgrader's
    own sanitizing (``DeduplicateIds``, ``OverwriteCells``, ``CheckCellMetadata``).

    1. A cell whose ``grade_id`` the gradebook knows gets its nbgrader metadata
       rebuilt from the gradebook (a hand-edited schema_version, points or flag
       can no longer abort the batch); unknown ids and malformed metadata are
       dropped (the cell runs as a plain cell).
    2. A cell without metadata whose source equals a released cell that is
       absent from the submission gets that cell's metadata back (stripped
       metadata: the tests are found again by their content; an answer cell
       cannot be, since its content is the student's, but it still runs as a
       plain cell, so a correct answer still passes the tests).
    3. A ``grade_id`` present several times: the last copy keeps it (as
       ``DeduplicateIds`` would), the others become plain cells.
    4. A test cell or a locked code cell (setup) that is missing is put back
       from the gradebook, after the nearest cell before it in the release that
       is present (a deleted test runs the instructor's test on the answer).
    Every repair is logged for the student and noted for the export.
    """

    def preprocess(self, nb: NotebookNode, resources):
        info = resources["nbgrader"]
        cd = _coursedir(self)
        info.setdefault("course_root", cd.root)
        with Gradebook(info["db_url"]) as gb:
            try:
                notebook = gb.find_notebook(info["notebook"], info["assignment"])
            except MissingEntry:
                return nb, resources
            grades = {c.name: c.max_score for c in notebook.grade_cells}
            solutions = {c.name for c in notebook.solution_cells}
            tasks = {c.name for c in notebook.task_cells}
            sources = {c.name: (c.cell_type, c.source, c.locked) for c in notebook.source_cells}
            order = [c.name for c in notebook.source_cells]

        def metadata(name):
            m = {"grade": name in grades, "grade_id": name, "locked": sources[name][2],
                 "schema_version": 3, "solution": name in solutions, "task": name in tasks}
            if name in grades:
                m["points"] = grades[name]
            return m

        reference = _reference_notebook(cd, info["assignment"], info["notebook"])
        released = {}
        if reference is not None:
            ref_order = [_meta(c).get("grade_id") for c in reference.cells]
            order = [n for n in ref_order if n in sources] + [n for n in order if n not in ref_order]
            released = {_meta(c)["grade_id"]: c.source for c in reference.cells if _meta(c).get("grade_id") in sources}

        # 1. metadata from the gradebook, or none
        dropped = []
        for cell in nb.cells:
            raw = cell.get("metadata", {}).get("nbgrader")
            if raw is None:
                continue
            name = raw.get("grade_id") if isinstance(raw, dict) else None
            if name in sources:
                cell.metadata["nbgrader"] = metadata(name)
            else:
                del cell.metadata["nbgrader"]
                if name:
                    dropped.append(name)
        if dropped:
            add_note(self.log, resources, f"cells with unknown ids graded as plain cells: {', '.join(dropped)}")

        # 3. duplicates: the last copy keeps the id
        seen = set()
        for cell in reversed(nb.cells):
            name = _meta(cell).get("grade_id")
            if name is None:
                continue
            if name in seen:
                del cell.metadata["nbgrader"]
                add_note(self.log, resources, f"cell '{name}' was there twice: the last copy is graded, "
                                              "the other runs as a plain cell")
            seen.add(name)

        # 2. recognise cells without metadata by their content
        recognised = []
        for cell in nb.cells:
            if "nbgrader" in cell.get("metadata", {}):
                continue
            text = cell.get("source", "").strip()
            for name in order:
                if name in seen or not sources[name][2]:
                    continue  # present already, or not locked (an answer: content is the student's)
                if text and text in (sources[name][1].strip(), released.get(name, "").strip()):
                    cell.metadata["nbgrader"] = metadata(name)
                    seen.add(name)
                    recognised.append(name)
                    break
        if recognised:
            add_note(self.log, resources, "cells without nbgrader metadata recognised by their content: "
                                          + ", ".join(recognised))

        # Cell type changed (a test turned into markdown): OverwriteCells turns it back; say so.
        for cell in nb.cells:
            name = _meta(cell).get("grade_id")
            if name in sources and cell.cell_type != sources[name][0]:
                add_note(self.log, resources, f"cell '{name}' had been turned into {cell.cell_type}: "
                                              f"graded as {sources[name][0]} again")

        # 4. put back missing tests and setup cells, in the release's order
        restored = []
        for i, name in enumerate(order):
            if name in seen:
                continue
            cell_type, source, locked = sources[name]
            if not (name in grades and name not in solutions) and not (locked and cell_type == "code"):
                continue
            if cell_type == "code":
                cell = nbformat.v4.new_code_cell(source)
            else:
                cell = nbformat.v4.new_markdown_cell(source)
            cell.metadata["nbgrader"] = metadata(name)
            cell.metadata.update(editable=False, deletable=False)
            before = [n for n in order[:i] if n in seen]
            if before:
                at = max(k for k, c in enumerate(nb.cells) if _meta(c).get("grade_id") == before[-1]) + 1
            else:
                after = [k for k, c in enumerate(nb.cells) if _meta(c).get("grade_id") in order[i + 1:]]
                at = min(after) if after else len(nb.cells)
            nb.cells.insert(at, cell)
            seen.add(name)
            restored.append(name)
        if restored:
            add_note(self.log, resources, "missing cells put back from the source: " + ", ".join(restored))
        return nb, resources


# ------------------------------------------------------------ reading the file
_HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS.*?^[ \t]*### END HIDDEN TESTS[^\n]*\n?", re.M | re.S)


def released_source(source: str) -> str:
    """A test cell's source as nbgrader releases it (ClearHiddenTests drops the hidden block)."""
    return _HIDDEN.sub("", source)


class OverwriteCellsQuietly(OverwriteCells):
    """nbgrader's ``OverwriteCells``, without its false alarm: every test cell with hidden
    tests differs from the instructor's copy by exactly those tests, so nbgrader warned
    "Attribute 'checksum' for cell test_dims has changed!" for every such cell of every
    student (119 lines for 30 students). That case is logged at DEBUG; a locked cell the
    student really changed is still warned about (and restored, as before)."""

    def preprocess_cell(self, cell, resources, cell_index):
        self._cell = cell
        try:
            return super().preprocess_cell(cell, resources, cell_index)
        finally:
            self._cell = None

    def report_change(self, name, attr, old, new):
        cell = getattr(self, "_cell", None)
        if attr == "checksum" and cell is not None:
            try:
                source = self.gradebook.find_source_cell(name, self.notebook_id, self.assignment_id).source
            except Exception:  # noqa: BLE001 (then it is reported as nbgrader would)
                source = None
            if source is not None and source != cell.source and \
                    released_source(source).strip() == cell.source.strip():
                self.log.debug("cell %s: only its hidden tests differ from the instructor's copy", name)
                return
        super().report_change(name, attr, old, new)


class TolerantNotebookExporter(NotebookExporter):
    """``NotebookExporter`` that grades an unreadable or missing submission as 0.

    Only while sanitizing a submission (the file comes from the submitted
    folder, or stands for a missing one, see ``MatchNotebooks``): when the file
    cannot be read as a notebook, the released notebook is graded instead, with
    every answer cell replaced by ``raise RuntimeError(<why>)`` and a first
    markdown cell saying why. So the tests run and fail, the gradebook gets
    0 for every test (no stale score from an earlier run), the feedback and the
    log say why, and the batch goes on. It also starts the student's notes
    afresh and notes extra files found beside the notebook.
    """

    def from_filename(self, filename, resources=None, **kw):
        info = (resources or {}).get("nbgrader")
        cd = _coursedir(self)
        submitted = os.path.abspath(cd.format_path(cd.submitted_directory, ".", "."))
        key = os.path.abspath(filename)
        if info is None or not (key.startswith(submitted + os.sep) or key in SUBSTITUTES):
            return super().from_filename(filename, resources, **kw)
        info["course_root"] = cd.root
        notes = notes_path(cd.root, info["assignment"], info["student"], info["notebook"])
        notes.unlink(missing_ok=True)

        actual = SUBSTITUTES.get(key, filename)
        if actual is not None and actual != filename:
            add_note(self.log, resources, f"graded '{os.path.basename(actual)}' (the only notebook "
                                          f"submitted) as '{info['notebook']}.ipynb'")
        folder = os.path.dirname(filename)
        # nbgrader's own files (timestamp.txt, submission_secret.txt: see .exchange) are not the student's
        extra = sorted(f for f in os.listdir(folder) if not f.endswith(".ipynb") and f not in NBGRADER_FILES
                       and not any(fnmatch.fnmatch(f, p) for p in cd.ignore)) if os.path.isdir(folder) else []
        if extra:
            add_note(self.log, resources, "extra files beside the notebook (the sandboxed kernel does not see them): "
                                          + ", ".join(extra))
        reason = None
        if actual is None:
            reason = SUBSTITUTES.get(key + "#why") or f"no notebook named '{info['notebook']}.ipynb' was submitted"
        else:
            try:
                with open(actual, encoding="utf-8") as f:
                    nb = nbformat.read(f, as_version=4)
                if not isinstance(nb.get("cells"), list):
                    raise ValueError("it has no list of cells")
            except Exception as exc:  # not JSON, not UTF-8, not a notebook
                reason = (f"the submitted file '{os.path.basename(actual)}' is not a readable notebook "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})")
        if reason is not None:
            add_note(self.log, resources, f"graded as 0: {reason}", error=True)
            nb = self._stand_in(cd, info, reason)
        resources = resources if resources is not None else {}
        resources.setdefault("metadata", {})
        resources["metadata"]["name"] = info["notebook"]
        resources["metadata"]["path"] = folder
        return self.from_notebook_node(nb, resources, **kw)

    @staticmethod
    def _stand_in(cd, info, reason) -> NotebookNode:
        nb = _reference_notebook(cd, info["assignment"], info["notebook"]) or nbformat.v4.new_notebook()
        for cell in nb.cells:
            if _meta(cell).get("solution"):
                cell.source = f"raise RuntimeError({reason!r})" if cell.cell_type == "code" else reason
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(f"**Not graded: {reason}.**"))
        return nb


# ------------------------------------------------------------ renamed notebooks
class MatchNotebooks:
    """``Autograde.pre_convert_hook``: expected notebooks that are missing from a
    student's folder are graded anyway. When exactly one notebook is missing
    and exactly one submitted notebook has an unknown name, that one is graded
    under the expected name; otherwise the missing notebook is graded as 0 with
    a note (instead of nbgrader's "No notebooks found" error for the student).

    The hook gets nbgrader's list of the student's notebooks and edits it in
    place (it is the list the converter goes on with). ``source_directory`` is
    the course's ``CourseDirectory.source_directory`` (nbgrader runs the hook
    from the course root).
    """

    def __init__(self, source_directory: str):
        self.source_directory = source_directory

    def __call__(self, assignment=None, student=None, notebooks=None, **_):
        if not notebooks:
            return
        folder = os.path.dirname(os.path.abspath(notebooks[0]))
        assignment_id = os.path.basename(folder)
        expected = sorted(Path(p).stem for p in glob.glob(os.path.join(self.source_directory, assignment_id, "*.ipynb")))
        if not expected:
            return
        present = {Path(p).stem: p for p in notebooks}
        missing = [n for n in expected if n not in present]
        unknown = sorted(p for n, p in present.items() if n not in expected)
        if not missing:
            return
        keep = [p for n, p in present.items() if n in expected]
        for name in missing:
            path = os.path.join(folder, f"{name}.ipynb")
            if len(missing) == 1 and len(unknown) == 1:
                SUBSTITUTES[path] = unknown[0]
            else:
                SUBSTITUTES[path] = None
                found = ", ".join(os.path.basename(p) for p in unknown) or "none"
                SUBSTITUTES[path + "#why"] = (f"no notebook named '{name}.ipynb' was submitted "
                                              f"(other notebooks: {found})")
            keep.append(path)
        notebooks[:] = sorted(keep)


# ------------------------------------------------------------ export
UNFINISHED_NOTE = "NOT FINISHED: a grading run stopped in the middle of this submission; run nbgrader autograde again"


NOT_GRADED_NOTE = ("not graded: the grader stopped on this submission (its error is in the grading log); "
                   "no earlier score is kept. Grade it again once the error is fixed")


class CsvExportWithNotes(CsvExportPlugin):
    """nbgrader's CSV export plus a ``notes`` column: what grading repaired or
    could not grade for that student (from ``grading_notes/``). A submission
    folder that holds no notebook at all (nbgrader's autograde skips it with a
    warning) gets score 0 and a note, also when an earlier run had graded it.
    A submission whose grading was stopped half-way (its ``autograded/`` folder
    still has the ``notes.MARKER``) is flagged: its score is not final.
    """

    def export(self, gradebook: Gradebook) -> None:
        super().export(gradebook)
        dest = self.to or "grades.csv"
        cd = _coursedir(self)
        with open(dest, newline="") as f:
            rows = list(csv.DictReader(f))
        keys = list(rows[0].keys()) if rows else [
            "assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
            "raw_score", "late_submission_penalty", "score", "max_score"]
        index = {(r["assignment"], r["student_id"]): r for r in rows}
        for assignment in gradebook.assignments:
            if self.assignment and assignment.name not in [str(a) for a in self.assignment]:
                continue
            for folder in sorted(glob.glob(cd.format_path(cd.submitted_directory, "*", assignment.name))):
                student = os.path.basename(os.path.dirname(folder))
                if self.student and student not in [str(s) for s in self.student]:
                    continue
                if not os.path.isdir(folder) or glob.glob(os.path.join(folder, "*.ipynb")):
                    continue
                row = index.get((assignment.name, student))
                if row is None:
                    row = dict.fromkeys(keys, "")
                    row.update(assignment=assignment.name, student_id=student, max_score=str(assignment.max_score))
                    rows.append(row)
                    index[(assignment.name, student)] = row
                row.update(raw_score="0.0", late_submission_penalty="0.0", score="0.0")
                row["notes"] = "graded as 0: no notebook in the submission folder"
            for marker in sorted(glob.glob(os.path.join(cd.format_path(cd.autograded_directory, "*", assignment.name),
                                                        MARKER))):
                student = os.path.basename(os.path.dirname(os.path.dirname(marker)))
                if (assignment.name, student) in index or (self.student and student not in [str(s) for s in self.student]):
                    continue
                # stopped before the gradebook heard of it: listed all the same, with no points yet
                row = dict.fromkeys(keys, "")
                row.update(assignment=assignment.name, student_id=student, max_score=str(assignment.max_score),
                           raw_score="0.0", late_submission_penalty="0.0", score="0.0")
                rows.append(row)
                index[(assignment.name, student)] = row
        for row in rows:
            autograded = cd.format_path(cd.autograded_directory, row["student_id"], row["assignment"])
            submitted = cd.format_path(cd.submitted_directory, row["student_id"], row["assignment"])
            unfinished = os.path.exists(os.path.join(autograded, MARKER))
            if (row.get("score") not in (None, "") and not os.path.isdir(autograded)
                    and glob.glob(os.path.join(submitted, "*.ipynb"))):
                # nbgrader removes a submission's autograded folder when grading it failed: whatever
                # the gradebook still holds is an earlier run's score, never kept
                row.update(raw_score="0.0", late_submission_penalty="0.0", score="0.0")
                row["notes"] = NOT_GRADED_NOTE
                continue
            if row.get("notes") and not unfinished:
                continue
            files = sorted((Path(cd.root) / NOTES_DIRECTORY / row["assignment"] / row["student_id"]).glob("*.txt"))
            row["notes"] = " | ".join(
                f"{p.stem}.ipynb: " + "; ".join(line for line in p.read_text().splitlines() if line)
                for p in files if p.read_text().strip())
            if unfinished:  # a grading run was stopped in the middle of this submission
                row["notes"] = " | ".join(filter(None, [UNFINISHED_NOTE, row["notes"]]))
        with open(dest, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*keys, "notes"], lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
