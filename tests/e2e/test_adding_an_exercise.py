"""docs/contributors/adding-an-exercise.md, followed in a scratch copy of the course.

The small exercise of ``tests/exercises/template/`` (``clip_scores(x, limit)``) is added the way
the page says, file by file, to a copy of the repository's tracked files; then, in that copy (its
package first on the path), the generic harness passes on it, the release is generated and
matches, and a grading round with the course's own configuration scores a correct answer 2/2, a
declared mistake 0/2 and an untouched notebook 0/2. The page's file list is also checked: a new
plain-function exercise is at most 3 files besides the notebook (and 350 lines).
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course import ROOT, fill, solution_answers

TEMPLATE = ROOT / "tests" / "exercises" / "template"
NAME = "clip_scores"
# where the page puts each file of the template (its section: 1, 2, 3 and 4)
PLACES = {
    "clip.py": "firstprinciples/reference/clip.py",
    f"{NAME}.py": f"firstprinciples/exercises/{NAME}.py",
    f"{NAME}.ipynb": f"solutions/{NAME}/{NAME}.ipynb",
    f"{NAME}_answers.py": f"tests/exercises/{NAME}_answers.py",
}


def _tracked_copy(target: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = ROOT / name
        if src.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target / name)
    return target


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    root = _tracked_copy(tmp_path_factory.mktemp("added") / "course")
    for name, place in PLACES.items():  # sections 1 to 4 of the page
        (root / place).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TEMPLATE / name, root / place)
    with open(root / "firstprinciples/reference/__init__.py", "a") as f:
        f.write("from .clip import clip_scores  # noqa: E402,F401\n")
    return root


@pytest.fixture(scope="module")
def python(course) -> str:
    """An interpreter whose ``firstprinciples`` is the copy's, as if it were installed there (the
    grader refuses a course folder whose package is not the environment's), with every other
    package this environment has."""
    import site

    env = course.parent / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    (lib,) = (env / "lib").glob("python3*")
    paths = [str(course), *site.getsitepackages()]
    (lib / "site-packages" / "course_copy.pth").write_text("\n".join(paths) + "\n")
    return str(env / "bin" / "python")


def _run(course: Path, python: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBGRADER", "PYTHONPATH"))}
    env["TMPDIR"] = str(course.parent / "tmp")
    env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    os.makedirs(env["TMPDIR"], exist_ok=True)
    proc = subprocess.run([python, *args], cwd=course, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_the_page_names_every_file_the_template_adds():
    page = (ROOT / "docs" / "contributors" / "adding-an-exercise.md").read_text()
    for place in ("firstprinciples/reference/", "firstprinciples/exercises/<assignment>.py",
                  "solutions/<assignment>/<notebook>.ipynb", "tests/exercises/<assignment>_answers.py"):
        assert place in page, place
    files = [p for p in TEMPLATE.iterdir() if p.suffix == ".py"]
    assert len(files) <= 3 and sum(len(p.read_text().splitlines()) for p in files) <= 350


def test_the_generic_harness_passes_on_the_new_exercise(course, python):
    page = (ROOT / "docs" / "contributors" / "adding-an-exercise.md").read_text()
    store = f"python -m firstprinciples.grading.store {NAME}"
    assert store in page
    _run(course, python, *store.split()[1:])
    assert (course / "firstprinciples" / "exercises" / "expected" / f"{NAME}.json").is_file()
    out = _run(course, python, "-m", "pytest", "-n0", "-q", "-p", "no:cacheprovider", "tests/exercises", "-k", NAME)
    assert " passed" in out.stdout and "failed" not in out.stdout, out.stdout[-2000:]


def test_the_release_and_a_grading_round_pass_on_it(course, python):
    _run(course, python, "-m", "nbgrader", "generate_assignment", NAME, "--force")
    release = nbformat.read(course / "exercises" / NAME / f"{NAME}.ipynb", as_version=4)
    assert "torch.where" not in "".join(c.source for c in release.cells)  # no solution in the release
    solution = nbformat.read(course / "solutions" / NAME / f"{NAME}.ipynb", as_version=4)
    answers = {"ada": solution_answers(solution), "bob": {NAME: "def clip_scores(x, limit):\n    return torch.minimum("
                                                                  "x, torch.full_like(x, limit))\n"}, "cy": {}}
    for student, given in answers.items():
        target = course / "submitted" / student / NAME
        target.mkdir(parents=True)
        nbformat.write(fill(release, given), target / f"{NAME}.ipynb")
    _run(course, python, "-m", "nbgrader", "autograde", NAME)
    _run(course, python, "-m", "nbgrader", "export")
    with open(course / "grades.csv", newline="") as f:
        scores = {r["student_id"]: float(r["score"]) for r in csv.DictReader(f) if r["assignment"] == NAME}
    assert scores == {"ada": 2.0, "bob": 0.0, "cy": 0.0}
