"""The exchange, for a class whose submissions come by several paths, and the release they start from.

Submissions reach ``submitted/<student>/<assignment>/`` by hand, by
``nbgrader zip_collect`` or through the exchange (``nbgrader collect``). Only
the exchange leaves the two files that ``nbgrader release_feedback`` reads
(``NBGRADER_FILES``): ``nbgrader submit`` writes ``timestamp.txt`` and
``submission_secret.txt`` into the submission
(``nbgrader/exchange/default/submit.py``, ``ExchangeSubmit.copy_files``),
``zip_collect`` writes ``timestamp.txt`` when the file name carries a time
(``nbgrader/apps/zipcollectapp.py``, ``ZipCollectApp.transfer_files``), and
``autograde`` then ``generate_feedback`` copy both into
``feedback/<student>/<assignment>/``.

Stock nbgrader 0.9.6 opens both files unconditionally for every feedback file
(``nbgrader/exchange/default/release_feedback.py``,
``ExchangeReleaseFeedback.copy_files``: ``open(... 'timestamp.txt')`` and
``open(... "submission_secret.txt")``), so one submission collected by hand
raises ``FileNotFoundError`` and aborts the release for the whole class
(``ReleaseFeedbackApp.start`` only catches ``ExchangeError``), the students after
it in glob order included.

``TolerantReleaseFeedback`` (``c.ExchangeFactory.release_feedback`` in
``nbgrader_config.py``) releases the feedback of every submission that came
through the exchange, and names the others: without the secret, the name
under which ``nbgrader fetch_feedback`` looks for the file cannot be computed
(``notebook_hash(secret=..., notebook_id=...)``), so their feedback stays in
``feedback/<student>/<assignment>/`` to be handed out another way. A missing
``timestamp.txt`` beside a secret costs nothing (nbgrader only logs it).
"""
from __future__ import annotations

import glob
import os
import re
import shutil

from nbgrader.converters import GenerateAssignment
from nbgrader.exchange.default.release_feedback import ExchangeReleaseFeedback
from nbgrader.plugins import FileNameCollectorPlugin
from nbgrader.utils import notebook_hash

# Files nbgrader itself writes into a submission folder (see above); they are not
# the student's, and the sanitizer does not note them as extra files.
TIMESTAMP_FILE = "timestamp.txt"
SECRET_FILE = "submission_secret.txt"
NBGRADER_FILES = (TIMESTAMP_FILE, SECRET_FILE)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class TolerantReleaseFeedback(ExchangeReleaseFeedback):
    """``nbgrader release_feedback`` that releases what it can and names the rest.

    Same files, same names and the same atomic copy as nbgrader's
    ``ExchangeReleaseFeedback.copy_files``; a submission without
    ``submission_secret.txt`` (not submitted through the exchange) is skipped with
    a warning naming the student, and one line at the end counts both groups.
    """

    def copy_files(self):
        exclude = set(self.coursedir.student_id_exclude.split(",")) if self.coursedir.student_id_exclude else set()
        regexp = re.escape(os.path.sep).join([
            self.coursedir.format_path(self.coursedir.feedback_directory, "(?P<student_id>.*)",
                                       self.coursedir.assignment_id, escape=True),
            "(?P<notebook_id>.*).html",
        ])
        released, not_exchanged = set(), set()
        for html_file in sorted(glob.glob(os.path.join(self.src_path, "*.html"))):
            m = re.match(regexp, html_file)
            if m is None:
                self.log.error("Could not match '%s' with regexp '%s'", html_file, regexp)
                continue
            student_id, notebook_id = m.group("student_id"), m.group("notebook_id")
            if student_id in exclude:
                self.log.debug("Skipping student '%s'", student_id)
                continue
            feedback_dir = os.path.dirname(html_file)
            secret = _read(os.path.join(feedback_dir, SECRET_FILE))
            if secret is None:
                not_exchanged.add(student_id)
                self.log.warning(
                    "Not releasing feedback for student '%s' on '%s/%s' through the exchange: the submission "
                    "did not come through it (no %s; collected by hand or by zip_collect). The feedback is in %s",
                    student_id, self.coursedir.assignment_id, notebook_id, SECRET_FILE, html_file)
                continue
            timestamp = (_read(os.path.join(feedback_dir, TIMESTAMP_FILE)) or "no timestamp").strip()
            checksum = notebook_hash(secret=secret, notebook_id=notebook_id)
            tmp = os.path.join(self.dest_path, f"{checksum}-tmp.html")
            self.log.info("Releasing feedback for student '%s' on assignment '%s/%s/%s' (%s)", student_id,
                          self.coursedir.course_id, self.coursedir.assignment_id, notebook_id, timestamp)
            shutil.copy(html_file, tmp)
            shutil.move(tmp, os.path.join(self.dest_path, f"{checksum}.html"))
            released.add(student_id)
        line = f"Released feedback on '{self.coursedir.assignment_id}' for {len(released)} student(s)"
        if not_exchanged:
            self.log.warning("%s; not through the exchange (hand them their feedback folder): %s",
                             line, ", ".join(sorted(not_exchanged)))
        else:
            self.log.info(line)


# ---------------------------------------------------------------- zip_collect's time stamps
_STAMP = re.compile(r"^(\d{4})-(\d{1,2})-(\d{1,2})[-_ T](\d{1,2})[-_:](\d{1,2})(?:[-_:](\d{1,2}))?(?:[.,](\d+))?$")


def read_stamp(text: str):
    """The time a submission's file name says, as nbgrader writes it in ``timestamp.txt``, or
    None. An LMS writes ``2026-12-03-14-30-00`` (dashes between the time's parts too): nbgrader's
    parser (dateutil) reads that as 14:00 with a -30 h offset, or fails on ``23-59-59``, and a
    failure stopped ``nbgrader zip_collect`` for the whole class. Such a stamp is read part by
    part; any other is left to nbgrader's parser; one neither can read is None."""
    import datetime

    from nbgrader.utils import parse_utc

    m = _STAMP.match(text.strip())
    try:
        if m:
            parts = [int(p) for p in m.groups()[:6] if p is not None]
            return datetime.datetime(*parts).strftime("%Y-%m-%d %H:%M:%S")
        return parse_utc(text).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError):
        return None


class StampedFileNameCollector(FileNameCollectorPlugin):
    """nbgrader's file-name collector (``--FileNameCollectorPlugin.named_regexp`` configures it
    as before), with the time stamp read whole (``read_stamp``). A stamp that cannot be read
    costs that file its time stamp, with a warning naming it (lateness unknown: write
    ``timestamp.txt`` by hand), never the collection of the class."""

    def collect(self, submitted_file):
        info = super().collect(submitted_file)
        if info and isinstance(info.get("timestamp"), str):
            stamp = read_stamp(info["timestamp"])
            if stamp is None:
                self.log.warning("%s: its time stamp %r cannot be read; collected without one (its lateness is "
                                 "not known: write timestamp.txt in its submission folder)",
                                 submitted_file, info["timestamp"])
                info = {k: v for k, v in info.items() if k != "timestamp"}
            else:
                info["timestamp"] = stamp
        return info


class KeepReleasedGenerateAssignment(GenerateAssignment):
    """``nbgrader generate_assignment`` that never leaves a class without its released notebooks.

    nbgrader 0.9.6 removes an assignment's release folder before it generates it again (``--force``,
    or a source newer than the release: ``BaseConverter.init_destination``) and once more when that
    fails (``convert_notebooks``'s ``_handle_failure``). It fails, for instance, when a test cell is
    added to an assignment that has submissions (``SaveCells``: "Cannot add or remove cells ...
    because there are submissions associated with it"): the class was left with no released
    notebook at all. Here every release folder the command removed and could not write again is put
    back as it was, with a message that says so; the command still fails, with nbgrader's reason.
    Put in place of nbgrader's class by ``nbgrader_config.py``, as ``ParallelAutograde`` is.
    """

    def convert_notebooks(self) -> None:
        import tempfile

        release = os.path.join(self.coursedir.root, self.coursedir.release_directory)
        with tempfile.TemporaryDirectory(prefix="release-") as kept:
            saved = os.path.join(kept, "release")
            if os.path.isdir(release):
                shutil.copytree(release, saved, symlinks=True)
            try:
                super().convert_notebooks()
            finally:
                self._put_back(saved, release)

    def _put_back(self, saved: str, release: str) -> None:
        """Each assignment folder of ``saved`` that is no longer in ``release``, copied back."""
        if not os.path.isdir(saved):
            return
        for name in sorted(os.listdir(saved)):
            if os.path.exists(os.path.join(release, name)):
                continue
            shutil.copytree(os.path.join(saved, name), os.path.join(release, name), symlinks=True)
            self.log.error("%s was not generated again: the notebooks released before are kept as they were, in %s "
                           "(students still have what they were given). Fix the error above and run the command "
                           "again.", name, os.path.join(release, name))
