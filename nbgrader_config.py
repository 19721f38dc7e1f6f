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
  from the next cell in a fresh kernel; a cell's output is capped; a notebook has
  a time budget (``c.RobustExecute.notebook_timeout``); then the trusted re-check
  (``firstprinciples.grading.trusted``) re-runs every graded piece in a fresh
  sandboxed interpreter on secret inputs and its verdict is final;
- ``nbgrader autograde`` grades in parallel (``c.Autograde.workers``, default
  ``$FP_GRADING_WORKERS``, else two a core as the memory allows), and a run killed at any point
  can simply be run again (``firstprinciples.grading.parallel``);
- the gradebook is ``gradebook.db`` (SQLite) in the course folder, or the
  database that ``$FP_GRADEBOOK_URL`` names (e.g. PostgreSQL, shared by several
  grading machines: ``postgresql://user:password@host/dbname``).

Every setting and environment variable, with its default: docs/instructors/configuration.md.
"""
import os
import shutil
import sys

from nbconvert.preprocessors import ClearMetadataPreprocessor
from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, ClearOutput, DeduplicateIds, IgnorePattern,
                                    LimitOutput, OverwriteKernelspec, SaveAutoGrades)

import nbgrader.apps.autogradeapp
import nbgrader.apps.generateassignmentapp
from nbgrader.coursedir import CourseDirectory

import firstprinciples.grading
import firstprinciples.grading.here

# One copy of the course package for every process of a command (a grading-setup error otherwise).
firstprinciples.grading.require_one_copy(os.getcwd())
# Every kernel an nbgrader command starts runs a notebook for the grader: its every_test() cell does nothing.
firstprinciples.grading.here.mark_grading()
from firstprinciples.grading.exchange import KeepReleasedGenerateAssignment
from firstprinciples.grading.execute import RobustExecute
from firstprinciples.grading.parallel import MARKER, GraderBoundKernelManager, ParallelAutograde
from firstprinciples.grading.sanitize import (CsvExportWithNotes, MatchNotebooks, OverwriteCellsQuietly, RestoreCells,
                                              TolerantNotebookExporter)

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)

c.CourseDirectory.course_id = "transformers-from-first-principles"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"

# The gradebook: gradebook.db (SQLite) in the course folder unless FP_GRADEBOOK_URL
# names another database (e.g. postgresql://grader:secret@dbhost/course, for several
# grading machines; needs psycopg2, see requirements.txt).
if os.environ.get("FP_GRADEBOOK_URL"):
    c.CourseDirectory.db_url = firstprinciples.grading.gradebook_url(os.environ["FP_GRADEBOOK_URL"])

# Parallel, restartable autograding. nbgrader 0.9.6's AutogradeApp.start builds its
# converter as `Autograde(coursedir=..., parent=self)` from the module global
# nbgrader.apps.autogradeapp.Autograde; the class is not a configurable trait, so the
# subclass is put in that name here. Every c.Autograde.* setting applies to it, and
# the instructor still types `nbgrader autograde <assignment>`.
nbgrader.apps.autogradeapp.Autograde = ParallelAutograde
# `nbgrader generate_assignment` that puts a released assignment back when it cannot generate it
# again (a test cell added once there are submissions, say): nbgrader deletes it first, and the class
# was left without its notebooks (firstprinciples.grading.exchange).
nbgrader.apps.generateassignmentapp.GenerateAssignment = KeepReleasedGenerateAssignment
# c.Autograde.workers = 2  # grading processes; default: $FP_GRADING_WORKERS, else two a core as the memory allows
# A kernel dies with the grading process that started it (even on kill -9), so a
# killed run leaves no kernel waiting forever.
c.Execute.kernel_manager_class = GraderBoundKernelManager
# The marker of a submission still being graded is not copied into feedback.
c.CourseDirectory.ignore = [*CourseDirectory.class_traits()["ignore"].default(), MARKER]

# What a student sees in place of a solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Execution: a cell that runs longer than this is interrupted (import torch
# alone takes a few seconds on a cold cache; the slowest test cell takes ~10 s on a
# quiet machine, so 60 s leaves room for a busy one). A graded piece that did not
# return within it in a course cell (a test, or a locked "try it" cell) is not waited
# for again: every later test of it fails at once, with the reason and a note.
c.Execute.timeout = 60
c.Execute.interrupt_on_timeout = True
# c.RobustExecute.notebook_timeout = 300  # seconds of cell execution per notebook; later cells are not run
# c.RobustExecute.recheck_timeout = 300  # seconds for the trusted re-check of one notebook
# c.RobustExecute.recheck_piece_timeout = 120  # seconds for the re-check of one piece
# Once a notebook has run, its kernel is killed at once: nothing in it is needed any
# more, and the polite shutdown (request, then wait for the exit) cost 0.85 s of idle
# waiting per notebook, a fifth of the grading time.
c.Execute.shutdown_kernel = "immediate"
# Broken submissions (unreadable, missing or renamed notebook, deleted,
# duplicated or retyped test cells, stripped metadata) are graded as far as
# possible, with a note per student in the log and in grades.csv
# (firstprinciples.grading.sanitize).
c.Autograde.sanitize_preprocessors = [
    RestoreCells, ClearOutput, DeduplicateIds, OverwriteKernelspec, OverwriteCellsQuietly, CheckCellMetadata,
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
    # The kernel's sockets live in a folder private to each grading process, removed when
    # it ends (GraderBoundKernelManager sets the ip).
else:
    print("nbgrader_config.py: WARNING: grading WITHOUT the sandbox "
          "(bubblewrap missing or FP_GRADING_UNSANDBOXED set)", file=sys.stderr)

# ---- exchange and formgrader (firstprinciples.grading.exchange / .formgrader) ----
# `nbgrader release_feedback` releases the feedback of every submission that came through
# the exchange and names the others (collected by hand or by zip_collect: no
# submission_secret.txt), instead of aborting for the whole class at the first of them.
c.ExchangeFactory.release_feedback = "firstprinciples.grading.exchange.TolerantReleaseFeedback"
# zip_collect: an LMS's time stamps (2026-12-03-14-30-00) read whole, and one unreadable stamp
# costs that file its time stamp (with a warning), never the collection of the class.
c.ZipCollectApp.collector_plugin = "firstprinciples.grading.exchange.StampedFileNameCollector"
# The exchange folder (release_assignment, the students' fetch_assignment and submit, collect,
# release_feedback): one folder every student and instructor can write, set up once
# (docs/instructors/grading-round.md): $FP_EXCHANGE, else nbgrader's /srv/nbgrader/exchange.
if os.environ.get("FP_EXCHANGE"):
    c.Exchange.root = os.environ["FP_EXCHANGE"]
# Formgrader's autograde button grades in a subprocess (the same `nbgrader autograde` as on the
# command line) while the Jupyter server keeps answering, and its dialog shows the score and the
# notes. Only when the formgrader loads this file: the command line does not import the server.
if "nbgrader.server_extensions.formgrader.apihandlers" in sys.modules:
    import firstprinciples.grading.formgrader
    firstprinciples.grading.formgrader.install()

# ---- feedback (firstprinciples.grading.feedback) ----
# `nbgrader generate_feedback` writes pages a student can read: test cells named with their
# points, the reason of a failure first and wrapped, tracebacks cut to the student's own frames,
# the hidden tests' source removed (their results kept), the grader's notes on that notebook
# at the top, and math as MathML (no MathJax, no CDN, no script).
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor  # noqa: E402
from nbgrader.preprocessors import GetGrades  # noqa: E402

from firstprinciples.grading.feedback import FeedbackExporter, StudentFeedback  # noqa: E402

c.GenerateFeedback.exporter_class = FeedbackExporter
c.GenerateFeedback.preprocessors = [GetGrades, StudentFeedback, CSSHTMLHeaderPreprocessor]
# c.StudentFeedback.show_flags = True  # also show students the notes "FLAGGED for an instructor"
# ---- end feedback ----
