"""What a student sees in a notebook when a check fails or warns: the test cell once, their own line.

A tiny notebook runs in a real kernel (nbclient, IPython 9's traceback display): a check that
fails on its own assertion, one that fails on an error of the student's code (with a ``.T``
warning on the way), and a failing cell of the student's own.
"""
from __future__ import annotations

import re
import warnings

import nbformat
import pytest
import torch

from firstprinciples.guard import call_without

ANSI = re.compile(r"\x1b\[[0-9;]*m")

CELLS = [
    "import math, torch\n"
    "from firstprinciples.grading.declared import check_for\ncheck = check_for('attention')\n"
    "recap = check_for('capstone')",
    # In[2]: no 1/sqrt(d_k)
    "def no_scaling(Q, K, V, mask=None):\n"
    "    w = torch.softmax(Q @ K.transpose(-2, -1) + (0 if mask is None else mask), dim=-1)\n"
    "    return w @ V, w",
    'check("test_worked_example", no_scaling)',  # In[3]: the check's own AssertionError
    # In[4]: K.T on four dimensions: a warning, then a shape error
    "def dot_T(Q, K, V, mask=None):\n"
    "    scores = Q @ K.T / math.sqrt(Q.shape[-1])\n"
    "    w = torch.softmax(scores, dim=-1)\n"
    "    return w @ V, w",
    'recap("test_scaled_dot_product_attention", dot_T)',  # In[5]: the student's error
    "assert False, 'a test of my own'",  # In[6]: the student's own failing cell
]


@pytest.fixture(scope="module")
def outputs():
    """cell index -> (its traceback as text, its stderr)."""
    import nbclient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True).execute()
    out = {}
    for i, cell in enumerate(nb.cells):
        errors = ["\n".join(o.traceback) for o in cell.outputs if o.output_type == "error"]
        stderr = [o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stderr"]
        out[i] = (ANSI.sub("", "\n".join(errors)), "".join(stderr))
    return out


def test_a_failing_check_shows_the_test_cell_once(outputs):
    tb, _ = outputs[2]
    assert tb.count("Cell In[3]") == 1, tb
    assert "no scaling" in tb and "_student.py" not in tb, tb


def test_an_error_of_the_students_code_shows_the_test_cell_then_their_line(outputs):
    tb, _ = outputs[4]
    # (the check names the student's line in its message, with the shapes on it and a hint)
    assert tb.count("Cell In[5]") == 1 and "in your code at cell In[4], line 2, in dot_T" in tb, tb
    assert tb.index("Cell In[5]") < tb.index("cell In[4], line 2"), tb
    assert "scores = Q @ K.T / math.sqrt(Q.shape[-1])" in tb and "`K.T` reverses every dimension" in tb, tb


def test_the_students_own_errors_keep_their_cell(outputs):
    """The notebook's __tracebackhide__ hides a test cell only while a check's failure is shown."""
    tb, _ = outputs[5]
    assert "Cell In[6]" in tb and "skipping hidden" not in tb, tb


def test_a_torch_warning_points_at_the_students_line_in_the_kernel(outputs):
    _, stderr = outputs[4]
    assert "guard.py" not in stderr, stderr
    assert re.search(r"\.py:2: UserWarning: The use of `x\.T`", stderr), stderr
    assert "scores = Q @ K.T / math.sqrt(Q.shape[-1])" in stderr, stderr


def implicit_softmax_dim(x):
    return torch.nn.functional.softmax(x)  # warns: no dim given


def test_a_warning_under_the_guard_is_recorded_at_the_students_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call_without(implicit_softmax_dim, (torch.ones(2, 3),), {}, torch_patterns=("log_softmax",))
    lines = [(w.filename, w.lineno) for w in caught if "softmax" in str(w.message)]
    assert lines == [(__file__, implicit_softmax_dim.__code__.co_firstlineno + 1)], lines
