"""A grading round whose submissions come by every path nbgrader has, with the plain
commands and the repo's config (``firstprinciples.grading.exchange``).

One class on ``softmax``, with a temporary exchange root:

- ``alice``: fetches the release and submits through the exchange (``fetch_assignment``,
  ``submit``), correct;
- ``bob``: the same, with a file of his own beside the notebook (a real extra file);
- ``carol``: copied into ``submitted/`` by hand (no ``timestamp.txt``, no secret);
- ``dave``: downloaded from an LMS and collected by ``zip_collect`` (a timestamp, no secret).

Then ``collect``, ``zip_collect``, ``autograde``, ``generate_feedback``,
``release_feedback`` (stock nbgrader aborts here, see the first test),
``fetch_feedback`` on the students' side and ``export``.
"""
import csv
import re
import shutil
import zipfile

import nbformat
import pytest

import docpages
from course import SOLUTIONS, fill, make_course, nbgrader, solution_answers

ASSIGNMENT = NOTEBOOK = "softmax"
COURSE_ID = "transformers-from-first-principles"  # c.CourseDirectory.course_id in nbgrader_config.py
# zip_collect's file-name pattern, as docs/instructors/grading-round.md gives it to instructors.
ZIP_REGEXP = re.search(r"`'(.*?)'`", docpages.line_with("(?P<student_id>")).group(1)
STOCK = "--ExchangeFactory.release_feedback=nbgrader.exchange.default.ExchangeReleaseFeedback"


def student(home, exchange, *args, check=True):
    """An nbgrader command on a student's side: their own folder (no course config), HOME and cache."""
    return nbgrader(home, *args, f"--course={COURSE_ID}", f"--Exchange.root={exchange}",
                    f"--Exchange.cache={home / '.cache'}", env={"HOME": str(home)}, check=check)


@pytest.fixture(scope="module")
def class_round(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exchange")
    course = make_course(tmp)
    exchange = tmp / "exchange"
    root = f"--Exchange.root={exchange}"
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    nbgrader(course, "release_assignment", ASSIGNMENT, root)
    correct = solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4))
    released = nbformat.read(course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    answered = fill(released, correct)

    homes = {}
    for name in ("alice", "bob"):
        home = homes[name] = tmp / "home" / name
        home.mkdir(parents=True)
        student(home, exchange, "fetch_assignment", ASSIGNMENT)
        fetched = home / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
        assert nbformat.read(fetched, as_version=4) == released
        nbformat.write(answered, fetched)
        if name == "bob":
            (home / ASSIGNMENT / "scratch.py").write_text("print('my own notes')\n")
        student(home, exchange, "submit", ASSIGNMENT, f"--student={name}")

    carol = course / "submitted" / "carol" / ASSIGNMENT
    carol.mkdir(parents=True)
    nbformat.write(answered, carol / f"{NOTEBOOK}.ipynb")
    archive = course / "downloaded" / ASSIGNMENT / "archive"
    archive.mkdir(parents=True)
    with zipfile.ZipFile(archive / "lms_download.zip", "w") as z:  # as an LMS names what it hands out
        z.writestr(f"dave_attempt_2024-01-30-15-00-00_{NOTEBOOK}.ipynb", nbformat.writes(answered))

    collect = nbgrader(course, "collect", ASSIGNMENT, root)
    zip_collect = nbgrader(course, "zip_collect", ASSIGNMENT, f"--FileNameCollectorPlugin.named_regexp={ZIP_REGEXP}")
    nbgrader(course, "autograde", ASSIGNMENT)
    nbgrader(course, "generate_feedback", ASSIGNMENT)
    stock = nbgrader(course, "release_feedback", ASSIGNMENT, root, STOCK, check=False)
    # what stock nbgrader released before it stopped
    shutil.rmtree(exchange / COURSE_ID / "feedback", ignore_errors=True)
    released_feedback = nbgrader(course, "release_feedback", ASSIGNMENT, root)
    fetched = {name: student(home, exchange, "fetch_feedback", ASSIGNMENT, f"--student={name}")
               for name, home in homes.items()}
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        grades = {r["student_id"]: r for r in csv.DictReader(f) if r["assignment"] == ASSIGNMENT}
    return dict(course=course, exchange=exchange, homes=homes, collect=collect, zip_collect=zip_collect,
                stock=stock, released=released_feedback, fetched=fetched, grades=grades)


def test_every_path_reaches_submitted(class_round):
    submitted = class_round["course"] / "submitted"
    for name in ("alice", "bob", "carol", "dave"):
        assert (submitted / name / ASSIGNMENT / f"{NOTEBOOK}.ipynb").is_file(), name
    # what nbgrader itself leaves beside the notebook, by path
    assert {p.name for p in (submitted / "alice" / ASSIGNMENT).iterdir()} == {
        f"{NOTEBOOK}.ipynb", "timestamp.txt", "submission_secret.txt"}
    assert (submitted / "bob" / ASSIGNMENT / "scratch.py").is_file()
    assert (submitted / "dave" / ASSIGNMENT / "timestamp.txt").read_text().startswith("2024-01-30 15:00:00")
    assert not (submitted / "carol" / ASSIGNMENT / "timestamp.txt").exists()


def test_every_path_is_graded(class_round):
    grades = class_round["grades"]
    assert set(grades) == {"alice", "bob", "carol", "dave"}
    for name, row in grades.items():
        assert float(row["score"]) == float(row["max_score"]) > 0, f"{name}: {row['score']}/{row['max_score']}"


def test_stock_release_feedback_aborts_for_the_class(class_round):
    """The bug this config fixes: nbgrader's own release_feedback stops at the first
    submission that did not come through the exchange."""
    stock = class_round["stock"]
    assert stock.returncode != 0
    # which student it meets first depends on the file system's order; carol lacks both files, dave the secret
    assert "FileNotFoundError" in stock.stderr
    assert "carol/softmax/timestamp.txt" in stock.stderr or "dave/softmax/submission_secret.txt" in stock.stderr


def test_release_feedback_releases_for_everyone_it_can(class_round):
    proc, exchange = class_round["released"], class_round["exchange"]
    assert len(list((exchange / COURSE_ID / "feedback").glob("*.html"))) == 2  # alice, bob
    log = proc.stderr
    assert "Released feedback on 'softmax' for 2 student(s)" in log
    for name in ("carol", "dave"):  # named, with where their feedback is
        assert f"Not releasing feedback for student '{name}'" in log
        assert f"feedback/{name}/{ASSIGNMENT}/{NOTEBOOK}.html" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("name", ["alice", "bob"])
def test_fetch_feedback(class_round, name):
    course, home = class_round["course"], class_round["homes"][name]
    fetched = list((home / ASSIGNMENT / "feedback").glob(f"*/{NOTEBOOK}.html"))
    assert len(fetched) == 1, class_round["fetched"][name].stderr
    assert fetched[0].read_bytes() == (course / "feedback" / name / ASSIGNMENT / f"{NOTEBOOK}.html").read_bytes()


def test_no_false_notes(class_round):
    grades = class_round["grades"]
    for name in ("alice", "carol", "dave"):
        assert grades[name]["notes"] == "", f"{name}: {grades[name]['notes']}"
    for row in grades.values():
        assert "submission_secret" not in row["notes"] and "timestamp.txt" not in row["notes"]


def test_real_extra_file_is_noted(class_round):
    notes = class_round["grades"]["bob"]["notes"]
    assert "extra files beside the notebook" in notes and "scratch.py" in notes


def test_zip_collect_reads_an_lms_time_stamp_whole_and_never_stops_for_one_file(tmp_path):
    """The documented pattern (docs/instructors/grading-round.md) on an LMS's names: 14-30-00 is
    14:30 (stock nbgrader read 14:00), 23-59-59 is 23:59:59 (it stopped the whole collection), and a stamp no one can read costs only
    that file its time stamp, with a warning that names it."""
    course = make_course(tmp_path)
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    answered = nbformat.read(course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    archive = course / "downloaded" / ASSIGNMENT / "archive"
    archive.mkdir(parents=True)
    stamps = {"erin": "2024-01-30-14-30-00", "fay": "2024-01-30-23-59-59", "gus": "2024-13-45-99-99-99"}
    with zipfile.ZipFile(archive / "lms_download.zip", "w") as z:
        for name, stamp in stamps.items():
            z.writestr(f"{name}_attempt_{stamp}_{NOTEBOOK}.ipynb", nbformat.writes(answered))
    proc = nbgrader(course, "zip_collect", ASSIGNMENT, f"--FileNameCollectorPlugin.named_regexp={ZIP_REGEXP}")
    submitted = course / "submitted"
    assert (submitted / "erin" / ASSIGNMENT / "timestamp.txt").read_text().startswith("2024-01-30 14:30:00")
    assert (submitted / "fay" / ASSIGNMENT / "timestamp.txt").read_text().startswith("2024-01-30 23:59:59")
    assert (submitted / "gus" / ASSIGNMENT / f"{NOTEBOOK}.ipynb").exists()
    assert not (submitted / "gus" / ASSIGNMENT / "timestamp.txt").exists()
    assert "'2024-13-45-99-99-99' cannot be read" in proc.stdout + proc.stderr


def test_a_release_that_cannot_be_generated_again_is_kept(tmp_path):
    """Adding a test cell once an assignment has submissions is refused by nbgrader's gradebook; the
    release folder nbgrader removed first is put back as it was (stock nbgrader leaves the class
    without its notebook), the command fails and says why, and the other assignments are untouched."""
    from nbgrader.api import Gradebook

    course = make_course(tmp_path)
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    nbgrader(course, "generate_assignment", "causal_mask", "--force")
    released = course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    before = released.read_bytes()
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gb:
        gb.add_student("ada")
        gb.add_submission(ASSIGNMENT, "ada")
    source = course / "solutions" / ASSIGNMENT / f"{NOTEBOOK}.ipynb"
    nb = nbformat.read(source, as_version=4)
    test = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "test_dims")
    extra = nbformat.from_dict(test)
    extra.metadata["nbgrader"]["grade_id"], extra.metadata["nbgrader"]["points"] = "test_more", 1
    extra["id"] = "test-more"
    nb.cells.append(extra)
    nbformat.write(nb, source)

    for args in ((ASSIGNMENT, "--force"), ("*", "--force")):
        result = nbgrader(course, "generate_assignment", *args, check=False)
        log = result.stdout + result.stderr
        assert result.returncode != 0, log
        assert "Cannot add or remove cells" in log and "the notebooks released before are kept" in log, log
        assert released.read_bytes() == before, args
        assert (course / "exercises" / "causal_mask" / "causal_mask.ipynb").exists()
