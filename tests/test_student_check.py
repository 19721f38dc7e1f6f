"""The students' check command: run a saved notebook as the grader will, report per test."""
import re
import subprocess
import sys

import nbformat
import pytest

from course import EXERCISES, SOLUTIONS
from test_instructor_roundtrip import NO_SCALING, fill, solution_answers

ASSIGNMENT, NOTEBOOK = "attention", "scaled_dot_product_attention"

IF_MASK = '''
import math
import torch

def scaled_dot_product_attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return weights @ V, weights
'''


def run_check(path):
    return subprocess.run([sys.executable, "-m", "firstprinciples.grading.check", str(path)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("student")
    release = nbformat.read(EXERCISES / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    correct = solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4))
    paths = {}
    cases = {"correct": correct, "untouched": {}, "no_scaling": {NOTEBOOK: NO_SCALING}, "if_mask": {NOTEBOOK: IF_MASK}}
    for name, answers in cases.items():
        paths[name] = folder / f"{name}.ipynb"
        nbformat.write(fill(release, answers), paths[name])
    paths["broken"] = folder / "broken.ipynb"
    paths["broken"].write_text('{"cells": [ this is not json')
    return paths


def test_correct_notebook_passes_everything(notebooks):
    proc = run_check(notebooks["correct"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Visible score: 10/10" in proc.stdout
    assert "FAIL" not in proc.stdout
    # Quiet: no kernel warning about TCP (the kernel's sockets are Unix sockets), nothing on stderr.
    assert "TCP" not in proc.stderr and not proc.stderr.strip(), proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernels are forked warm on Linux only")
def test_the_kernel_is_forked_from_the_warm_template(notebooks, tmp_path):
    """The check's kernel starts with torch already imported (it is forked from the template,
    as the grader's are), and says nothing of its own on the console."""
    nb = nbformat.read(notebooks["correct"], as_version=4)
    probe = nbformat.v4.new_code_cell('import sys\nassert "torch" in sys.modules, "a cold kernel"')
    probe.metadata["nbgrader"] = {"grade": True, "grade_id": "started_warm", "points": 1, "solution": False,
                                  "locked": True, "schema_version": 3}
    nb.cells.insert(0, probe)
    path = tmp_path / "warm.ipynb"
    nbformat.write(nb, path)
    proc = run_check(path)
    assert "pass  started_warm" in proc.stdout, proc.stdout
    assert "Ctrl-C" not in proc.stdout and "connect another client" not in proc.stdout, proc.stdout


def test_error_in_the_students_code_names_their_cell_and_line(notebooks):
    proc = run_check(notebooks["if_mask"])
    assert proc.returncode == 1
    out = proc.stdout
    assert "FAIL  test_masks" in out and "pass  test_worked_example" in out, out
    # The student's cell (by its name in the notebook) and line first, then the error and the hint.
    assert "raised by your code at cell In[" in out and "(your `scaled_dot_product_attention` cell" in out, out
    assert re.search(r"line \d+, in scaled_dot_product_attention:\n +if mask:\n", out), out
    assert "Boolean value of Tensor" in out and "write `if mask is not None:`" in out, out
    assert "Traceback" not in out + proc.stderr and "_core.py" not in out and "TCP" not in proc.stderr


def test_untouched_release_fails_every_test_and_says_why(notebooks):
    proc = run_check(notebooks["untouched"])
    assert proc.returncode == 1
    assert "Visible score: 0/10" in proc.stdout
    assert proc.stdout.count("FAIL") == 5 and "NotImplementedError" in proc.stdout


def test_mistake_is_named(notebooks):
    proc = run_check(notebooks["no_scaling"])
    assert proc.returncode == 1
    assert "no scaling" in proc.stdout and "pass  test_batched_shapes" in proc.stdout


def test_unreadable_notebook_is_reported(notebooks):
    proc = run_check(notebooks["broken"])
    assert proc.returncode == 2 and "not a readable notebook" in proc.stderr
