"""The source and released notebooks: structure, and that the tests mean something.

- every solution notebook passes all its graded tests in a fresh kernel;
- every released notebook, as released, passes none of them;
both through nbgrader's Validator API (the `nbgrader validate` command always
exits 0, so it cannot be used to fail a test).
"""
import nbformat
import pytest
from nbgrader.preprocessors import Execute
from nbgrader.validator import Validator

from firstprinciples.grading import warm

from course import (
    answer_cells, defined_names, grade_cells, nbgrader_meta, rel, released_notebooks, source_notebooks,
)

SOURCES = source_notebooks()
RELEASED = released_notebooks()


def test_there_are_notebooks():
    assert SOURCES, "no source notebooks in solutions/"
    assert [p.relative_to(p.parents[1]) for p in RELEASED] == [p.relative_to(p.parents[1]) for p in SOURCES]


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_source_notebook_structure(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "outputs in git"
    ids = [nbgrader_meta(c).get("grade_id") for c in nb.cells if nbgrader_meta(c)]
    assert len(ids) == len(set(ids)), "duplicate grade_id"
    answers = answer_cells(nb)
    assert answers, "no answer cell"
    for cell in answers:
        names = defined_names(cell.source)
        gid = nbgrader_meta(cell)["grade_id"]
        assert names == [gid], f"answer cell {gid} must define exactly one function or class named {gid}, got {names}"
        assert "### BEGIN SOLUTION" in cell.source and "### END SOLUTION" in cell.source
    graded = grade_cells(nb)
    assert graded and all(c.cell_type == "code" and nbgrader_meta(c).get("points", 0) > 0 for c in graded)
    header = nb.cells[0].source
    for item in ("What you build", "Difficulty", "Rough time"):
        assert item in header, f"the exercise header lacks '{item}'"


class _WarmExecute(Execute):
    """nbgrader's Execute with kernels forked from the grader's warm template (a fresh
    interpreter each, with torch imported once per test process, as the check command has):
    named in ``__init__`` because Execute's own ``__init__`` names jupyter_client's manager."""

    def __init__(self, **kw):
        kw.setdefault("kernel_manager_class", warm.WarmKernelManager)
        super().__init__(**kw)


def _validate(path):
    validator = Validator(ignore_checksums=True)
    # nbgrader's own preprocessors, in its order, with its Execute warm
    validator.preprocessors = [_WarmExecute if p is Execute else p for p in validator.preprocessors]
    return validator.validate(str(path))


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_solution_passes_all_tests(path):
    results = _validate(path)
    assert not results.get("failed"), "\n\n".join(f["raw_error"][-2000:] for f in results["failed"])
    assert not results.get("type_changed")


@pytest.mark.parametrize("path", RELEASED, ids=rel)
def test_release_passes_no_test(path):
    nb = nbformat.read(path, as_version=4)
    results = _validate(path)
    failed = {f["source"] for f in results.get("failed", [])}
    graded = {c.source.strip() for c in grade_cells(nb)}
    assert graded and failed == graded, f"tests that pass on the untouched release: {sorted(graded - failed)}"


@pytest.mark.parametrize("path", RELEASED, ids=rel)
def test_first_cell_installs_the_course_from_the_repository(path):
    """Where the course package is missing (Colab), the setup cell installs it from the address
    set in _config.yml (repository.url), the one place it is written by hand, at the version the
    notebook was released with: the tag v<version> of the package's version (pyproject.toml), so that
    the notebook and the package it installs cannot drift apart."""
    import tomllib

    import yaml

    import firstprinciples
    from course import ROOT

    url = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version == firstprinciples.__version__
    setup = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    assert 'find_spec("firstprinciples") is None' in setup.source, "the setup cell does not install the course"
    assert f'"git+{url}@v{version}"' in setup.source, \
        f"the setup cell's address is not _config.yml's repository.url ({url}) at the tag v{version}"
