"""nbgrader configuration of the course (used by instructors and by the tests).

Layout: solutions/<assignment>/<notebook>.ipynb are the source notebooks,
exercises/<assignment>/<notebook>.ipynb the released ones (generated, never
edited by hand). Run nbgrader commands from the repository root.

Grading is hardened here, with nbgrader's own commands:
- every notebook runs in a sandboxed kernel (``firstprinciples.grading.sandbox``:
  bubblewrap, no network, read-only system, no course files, capped memory,
  processes, file size and CPU time), talking to the grader over Unix sockets;
- ``RobustExecute`` replaces nbgrader's ``Execute``: a cell that hangs or kills
  its kernel scores 0 with the reason in the feedback, and grading goes on
  from the next cell in a fresh kernel; a cell's output is capped.
"""
import os
import shutil
import sys
import tempfile

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, ClearOutput, DeduplicateIds, IgnorePattern,
                                    LimitOutput, OverwriteCells, OverwriteKernelspec, SaveAutoGrades)

import firstprinciples.grading
from firstprinciples.grading.execute import RobustExecute
from firstprinciples.grading.sanitize import CsvExportWithNotes, MatchNotebooks, RestoreCells, TolerantNotebookExporter

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)

c.CourseDirectory.course_id = "transformers-from-first-principles"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"

# What a student sees in place of a solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Execution: a cell that runs longer than this is interrupted (import torch
# alone takes a few seconds on a cold cache; the slowest test cell takes ~10 s).
c.Execute.timeout = 120
c.Execute.interrupt_on_timeout = True
# Broken submissions (unreadable, missing or renamed notebook, deleted,
# duplicated or retyped test cells, stripped metadata) are graded as far as
# possible, with a note per student in the log and in grades.csv
# (firstprinciples.grading.sanitize).
c.Autograde.sanitize_preprocessors = [
    RestoreCells, ClearOutput, DeduplicateIds, OverwriteKernelspec, OverwriteCells, CheckCellMetadata,
]
c.Autograde.exporter_class = TolerantNotebookExporter
c.Autograde.pre_convert_hook = MatchNotebooks(c.CourseDirectory.source_directory)
c.ExportApp.plugin_class = CsvExportWithNotes
c.Autograde.autograde_preprocessors = [
    RobustExecute, IgnorePattern, ClearMetadataPreprocessor, LimitOutput,
    SaveAutoGrades, AssignLatePenalties, CheckCellMetadata,
]

# The sandboxed kernel (needs bubblewrap: apt-get install bubblewrap).
if shutil.which("bwrap") and not os.environ.get("FP_GRADING_UNSANDBOXED"):
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        [os.path.dirname(firstprinciples.grading.__file__), os.environ.get("JUPYTER_PATH", "")]
    )
    c.Execute.kernel_name = "fp-sandbox"
    c.AsyncKernelManager.transport = "ipc"
    # The kernel's sockets live in a folder private to this grading process.
    c.AsyncKernelManager.ip = os.path.join(tempfile.mkdtemp(prefix="fp-grade-"), "kernel")
else:
    print("nbgrader_config.py: WARNING: grading WITHOUT the sandbox "
          "(bubblewrap missing or FP_GRADING_UNSANDBOXED set)", file=sys.stderr)
