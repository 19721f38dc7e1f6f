"""The install a newcomer gets: every package pinned by the lock, and a book build that reads
only the book.

- ``constraints.txt`` is the lock (made by ``uv pip compile``; its header says the command, and
  ``docs/contributors/dependencies.md`` how to update it): ``requirements.txt`` and
  ``requirements-student.txt`` use it, and every package that their requirements pull into this
  environment, however deep, is pinned there at the version installed. So the README's first
  command gives the same environment next month as today.
- The book build skips folders that are not the book's: a virtualenv or tool folder inside the
  clone (``.venv`` most of all, which ``.ci/run`` makes) holds other projects' notebooks.
- The chapters' kernels keep their own log out of the build's log.

``.ci/run`` is the end-to-end test of all three: it makes ``.venv`` inside a clean clone, runs the
README's first command there, fails on kernel noise in the build's log, then runs the suite.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement

from course import ROOT

LOCK = ROOT / "constraints.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    """The lock's pins that apply to this interpreter and platform: name -> version."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate():
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonical(req.name)] = spec.version
    return pins


def direct_requirements(path) -> list[str]:
    """A requirements file's requirement lines (not options, comments or the course's own folder)."""
    lines = []
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-") and line != ".":
            lines.append(line)
    return lines


@pytest.mark.parametrize("path", ["requirements.txt", "requirements-student.txt"])
def test_both_requirement_files_install_under_the_lock(path):
    lines = (ROOT / path).read_text().splitlines()
    assert "-c constraints.txt" in lines
    pins = lock_pins()
    for line in direct_requirements(path):
        req = Requirement(line)
        assert canonical(req.name) in pins, f"{path}: {req.name} is not in the lock"
        assert req.specifier.contains(pins[canonical(req.name)], prereleases=True), (
            f"{path} asks for {line}, the lock pins {pins[canonical(req.name)]}")


def test_every_package_the_requirements_pull_in_is_pinned_at_the_installed_version():
    """Walks the requirements, as installed here, down to the last dependency (markers and extras
    evaluated as pip does): each package must be in the lock, at the version installed. Fails on a
    new dependency the lock lacks, and on an environment installed without the lock."""
    pins = lock_pins()
    own = metadata.distribution("firstprinciples")
    todo = [(Requirement(r), "requirements.txt") for r in direct_requirements("requirements.txt")]
    todo += [(Requirement(r), "firstprinciples") for r in own.requires or []]
    seen, problems = set(), []
    while todo:
        req, parent = todo.pop()
        env = default_environment()
        extras = sorted(req.extras) or [""]
        if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in extras):
            continue
        name = canonical(req.name)
        if (name, tuple(sorted(req.extras))) in seen:
            continue
        seen.add((name, tuple(sorted(req.extras))))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name} (needed by {parent}) is not installed")
            continue
        installed = dist.version.split("+")[0]  # (torch's local label: 2.13.0+cpu is 2.13.0)
        if name not in pins:
            problems.append(f"{req.name} {dist.version} (needed by {parent}) is not pinned in the lock")
        elif pins[name] != installed:
            problems.append(f"{req.name} is {dist.version} here, the lock pins {pins[name]}")
        for sub in dist.requires or []:
            sub = Requirement(sub)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in [""] + sorted(req.extras)):
                todo.append((sub, req.name))
    assert len(seen) > 100  # (the walk reached the transitive set, not only the direct one)
    assert not problems, "\n".join(problems)


def test_the_lock_says_how_it_is_made():
    header = LOCK.read_text().splitlines()[:2]
    assert header[0].startswith("# This file was autogenerated by uv"), header
    command = header[1].lstrip("# ").strip()
    assert command.startswith("uv pip compile ") and "-o constraints.txt" in command
    assert "requirements.txt requirements-student.txt" in command
    assert command in (ROOT / "docs" / "contributors" / "dependencies.md").read_text()


@pytest.mark.parametrize("folder", [".venv", "venv", "env", ".tox", ".nox", "node_modules",
                                    "chapters/.venv", "my-env-with-any-name/.hidden"])
def test_the_book_reads_no_page_inside_a_tool_folder(tmp_path, folder):
    """Sphinx's own file discovery with the book's exclude_patterns, on a copy of the book's layout
    with notebooks and pages inside a virtualenv or tool folder: only the book's pages are found."""
    from sphinx.project import Project

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    for page in ("intro.md", "chapters/softmax.md", f"{folder}/share/doc/nbgrader/loop.ipynb",
                 f"{folder}/lib/site-packages/pkg/README.md"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("# page\n")
    found = Project(str(tmp_path), {".md": "myst-nb", ".ipynb": "myst-nb"}).discover(
        exclude_paths=config["exclude_patterns"])
    assert found == {"intro", "chapters/softmax"}


def test_the_books_kernel_writes_its_own_log_to_a_file(tmp_path):
    """The kernel spec the book's extension writes (``firstprinciples.book.quiet_kernels``) starts a
    working kernel whose own stderr (ipykernel's transport warning among it) lands in
    ``kernels.log``, while a cell's output still reaches the notebook."""
    import nbformat
    from nbclient import NotebookClient

    from firstprinciples import book

    class App:
        doctreedir = str(tmp_path / "_build" / ".doctrees")

    saved = os.environ.get("JUPYTER_PATH")
    try:
        book.quiet_kernels(App, None)
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
            "import sys; print('to the page'); print('to the page too', file=sys.stderr)")])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    finally:
        if saved is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = saved
    texts = [o.get("text", "") for o in nb.cells[0].outputs]
    assert "to the page\n" in "".join(texts) and "to the page too\n" in "".join(texts)
    spec = json.loads((tmp_path / "_build" / "kernelspec" / "kernels" / "python3" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    log = (tmp_path / "_build" / "kernelspec" / "kernels.log").read_text()
    assert "without encryption" in log  # (what the build's log no longer shows)


def test_ci_runs_the_readme_commands_in_a_virtualenv_inside_the_clone():
    script = (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .venv" in script and ". .venv/bin/activate" in script
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\s+#", readme, re.S).group(1).strip()
    assert first == "pip install -r requirements.txt && jupyter-book build ."
    assert f"\n{first} " in script
    assert script.index(". .venv/bin/activate") < script.index(first) < script.index("python3 -m pytest")


@pytest.mark.parametrize("url, opened", [
    ("postgresql://grader:secret@dbhost/course", "postgresql+psycopg2://grader:secret@dbhost/course"),
    ("postgres://grader@/db?host=/tmp/s&port=5433", "postgresql+psycopg2://grader@/db?host=/tmp/s&port=5433"),
    ("postgresql+psycopg2://grader@dbhost/course", "postgresql+psycopg2://grader@dbhost/course"),
    ("sqlite:///gradebook.db", "sqlite:///gradebook.db"),
])
def test_the_documented_postgresql_address_opens_with_the_installed_driver(url, opened):
    """The documented ``postgresql://...`` (docs/instructors/scaling.md) names no driver; SQLAlchemy 2.1 would pick psycopg 3,
    which is not installed: the address gets the installed psycopg2, and SQLAlchemy accepts it."""
    import sqlalchemy

    from firstprinciples.grading import gradebook_url

    assert gradebook_url(url) == opened
    assert sqlalchemy.engine.make_url(gradebook_url(url)).get_dialect() is not None
