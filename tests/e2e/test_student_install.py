"""The student install: requirements-student.txt alone, in a fresh virtualenv, is enough to
check a solved notebook, and installs none of the instructor's or the tests' tools.

What it proves: ``pip install -r requirements-student.txt`` (the README's command) resolves
and installs in an empty virtualenv with nothing from this interpreter's site-packages, and
``python -m firstprinciples.grading.check`` then passes a solved notebook, quietly. To stay
offline and fast (about a minute), pip installs from a wheel cache built once, with no index:

    pip download -r requirements-student.txt setuptools wheel -d .student-wheels

(``FP_STUDENT_WHEELS`` names another folder). Without the cache the test is skipped, except
under CI, where it fails. It does not prove that PyTorch's CPU index serves torch 2.13.0 for
a student's platform: that is PyTorch's, and this machine cannot reach it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import docpages
from course import EXERCISES, ROOT, SOLUTIONS, fill, solution_answers

WHEELS = Path(os.environ.get("FP_STUDENT_WHEELS", ROOT / ".student-wheels"))
NOT_FOR_STUDENTS = ("jupyter-book", "pytest", "playwright", "psycopg2", "psycopg2-binary", "sphinx")
NBGRADER_SERVER_EXTENSIONS = ("formgrader", "assignment_list", "course_list", "validate_assignment")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    if not WHEELS.is_dir() or not any(WHEELS.glob("torch-*.whl")):
        msg = f"no wheel cache for the student install at {WHEELS} (see this file's docstring)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    folder = tmp_path_factory.mktemp("student-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    leftover = ROOT / "build"  # setuptools builds the course package in the tree: remove what it leaves
    existed = leftover.exists()
    proc = subprocess.run(
        [str(folder / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(WHEELS),
         "-r", "requirements-student.txt"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    if not existed:
        shutil.rmtree(leftover, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return folder, env


def test_only_the_student_set_is_installed(venv):
    folder, env = venv
    listing = subprocess.run([str(folder / "bin" / "pip"), "list", "--format=freeze"], env=env,
                             capture_output=True, text=True, check=True).stdout.lower()
    names = {line.split("==")[0] for line in listing.splitlines()}
    for wanted in ("torch", "numpy", "matplotlib", "jupyterlab", "ipykernel", "firstprinciples"):
        assert wanted in names, f"{wanted} is not installed: {sorted(names)}"
    assert not names & set(NOT_FOR_STUDENTS), sorted(names & set(NOT_FOR_STUDENTS))


def test_check_command_passes_a_solved_notebook(venv, tmp_path):
    folder, env = venv
    release = nbformat.read(EXERCISES / "attention" / "scaled_dot_product_attention.ipynb", as_version=4)
    answers = solution_answers(nbformat.read(SOLUTIONS / "attention" / "scaled_dot_product_attention.ipynb",
                                             as_version=4))
    path = tmp_path / "scaled_dot_product_attention.ipynb"
    nbformat.write(fill(release, answers), path)
    # Run from outside the repository: the venv's own course package is the one imported.
    proc = subprocess.run([str(folder / "bin" / "python"), "-m", "firstprinciples.grading.check", str(path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Visible score: 10/10" in proc.stdout
    assert not proc.stderr.strip(), proc.stderr  # no TCP warning, no traceback


def test_readme_command_switches_nbgrader_extensions_off(venv):
    """The README's student command turns nbgrader's server extensions off in the virtualenv
    (they are for instructors; at `jupyter lab`'s start they log warnings and errors)."""
    folder, env = venv
    command = docpages.line_with("jupyter server extension disable")
    args = command.strip().strip("`").split("&&")[1].split()
    assert args[:4] == ["jupyter", "server", "extension", "disable"], command
    subprocess.run([str(folder / "bin" / args[0]), *args[1:]], env=env, check=True, capture_output=True)
    listing = subprocess.run([str(folder / "bin" / "jupyter"), "server", "extension", "list"], env=env,
                             capture_output=True, text=True, check=True)
    text = listing.stdout + listing.stderr
    for ext in NBGRADER_SERVER_EXTENSIONS:
        line = next(ln for ln in text.splitlines() if f"nbgrader.server_extensions.{ext} " in ln)
        assert "disabled" in line, line
