"""Every test at once from inside a notebook (issue 42): each exercise notebook's last cell runs the
check command on the notebook itself (``firstprinciples.grading.here``), in JupyterLab (the kernel's
``JPY_SESSION_NAME``), VS Code and Colab (the notebook's current contents), prints every test and
never raises; while the grader or the check command runs the notebook it does nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

from course import ROOT, SOLUTIONS, nbgrader_meta, source_notebooks, with_answer
from firstprinciples.grading import here

SOFTMAX = SOLUTIONS / "softmax" / "softmax.ipynb"
WRONG_SOFTMAX = "def softmax(x, dim=-1):\n    return torch.exp(x) / torch.exp(x).sum(dim=dim, keepdim=True)\n"


def _notebooks():
    released = sorted((ROOT / "exercises").glob("*/*.ipynb"))
    assert len(released) == len(source_notebooks()) == 16
    return [*source_notebooks(), *released]


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_every_notebook_ends_with_the_every_test_cell(path):
    nb = nbformat.read(path, as_version=4)
    last = nb.cells[-1]
    meta = nbgrader_meta(last)
    assert last.cell_type == "code" and meta.get("grade_id") == "every_test"
    assert meta.get("locked") and not meta.get("grade") and not meta.get("solution")
    assert last.source.rstrip().endswith("every_test()")
    header = nb.cells[0].source
    assert "**last cell**" in header and "python -m firstprinciples.grading.check" in header


def _run(script: str, tmp_path, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", here.GRADING, "FP_SANDBOXED")}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**clean, **env})


CALL = ("from firstprinciples.grading.here import every_test\n"
        "status = every_test({})\n"
        "print('returned', status)\n")


def test_in_jupyterlab_it_checks_the_saved_notebook(tmp_path):
    path = tmp_path / "softmax.ipynb"
    path.write_text(SOFTMAX.read_text())
    out = _run(CALL, tmp_path, {"JPY_SESSION_NAME": str(path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pass  test_large_inputs" in out.stdout and "Visible score: 10/10" in out.stdout, out.stdout
    assert "returned 0" in out.stdout


def test_a_failing_test_is_reported_and_nothing_raises(tmp_path):
    nb = with_answer(nbformat.read(SOFTMAX, as_version=4), "softmax", WRONG_SOFTMAX)
    path = tmp_path / "softmax.ipynb"
    nbformat.write(nb, path)
    out = _run(CALL, tmp_path, {"JPY_SESSION_NAME": str(path)})
    assert out.returncode == 0, out.stderr[-2000:]  # (every_test itself raised nothing)
    assert "FAIL  test_large_inputs" in out.stdout and "no max subtracted" in out.stdout, out.stdout
    assert "returned 1" in out.stdout


def test_on_colab_it_checks_the_notebooks_current_contents(tmp_path):
    """Colab has no file: its front end gives the notebook's contents (``get_ipynb``)."""
    fake = ("import sys, types, json\n"
            "colab = types.ModuleType('google.colab'); message = types.ModuleType('google.colab._message')\n"
            f"contents = json.loads(open({str(SOFTMAX)!r}).read())\n"
            "message.blocking_request = lambda kind, timeout_sec=None: {'ipynb': contents} if kind == 'get_ipynb' else None\n"
            "colab._message = message\n"
            "google = types.ModuleType('google'); google.colab = colab\n"
            "sys.modules.update({'google': google, 'google.colab': colab, 'google.colab._message': message})\n")
    out = _run(fake + CALL, tmp_path, {})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Visible score: 10/10" in out.stdout and "returned 0" in out.stdout, out.stdout


def test_where_the_notebook_cannot_be_found_it_says_what_to_do(tmp_path):
    out = _run(CALL, tmp_path, {"JPY_SESSION_NAME": str(tmp_path / "gone.ipynb")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "python -m firstprinciples.grading.check" in out.stdout and "returned None" in out.stdout, out.stdout


@pytest.mark.parametrize("variable", [here.GRADING, "FP_SANDBOXED"])
def test_while_graded_it_does_nothing(tmp_path, variable):
    path = tmp_path / "softmax.ipynb"
    path.write_text(SOFTMAX.read_text())
    out = _run(CALL, tmp_path, {"JPY_SESSION_NAME": str(path), variable: "1"})
    assert out.stdout.strip() == "returned None", out.stdout


def test_in_the_check_commands_kernel_the_cell_does_nothing(tmp_path):
    """The check command (and the grader: the same executor, and nbgrader's configuration) says so to
    its kernels: the last cell runs there and prints nothing, instead of running the check again."""
    from firstprinciples.grading import check

    path = tmp_path / "softmax.ipynb"
    path.write_text(SOFTMAX.read_text())
    nb = check.load(path)
    check.execute(nb, path)
    assert nbgrader_meta(nb.cells[-1])["grade_id"] == "every_test" and nb.cells[-1].execution_count
    assert nb.cells[-1].outputs == [], nb.cells[-1].outputs
    assert "firstprinciples.grading.here.mark_grading()" in (ROOT / "nbgrader_config.py").read_text()
