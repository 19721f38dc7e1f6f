"""The trusted half of grading: what the re-check loads, what its watch sees, the wire
format, the comparison and the final verdict.

End-to-end, with nbgrader and sandboxed kernels, the red-team suite
(tests/grading/test_grading_redteam.py) grades cheating submissions; here each part is
tested on its own, quickly.
"""
from __future__ import annotations

import base64
import os
import subprocess
import sys

import nbformat
import numpy as np
import pytest
import torch

from course import ROOT, SOLUTIONS, nbgrader_meta, source_notebooks
from firstprinciples.grading import compare, probes, scan, trusted, wire

SOFTMAX = SOLUTIONS / "softmax" / "softmax.ipynb"
CORRECT = '''
import torch

def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)
'''

def _infos(*cells):
    nb = nbformat.read(SOFTMAX, as_version=4)
    for source in cells:
        nb.cells.append(nbformat.v4.new_code_cell(source))
    return nb


def _loaded(nb, name="softmax"):
    plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
    return [c["label"] for c in trusted.job_cells(plan, [name])]


def test_the_re_check_loads_what_a_piece_depends_on_and_nothing_else():
    nb = _infos("EPS = 0.0\ndef _shift(x, dim):\n    return x - x.amax(dim=dim, keepdim=True) + EPS",
                "%timeit softmax(torch.ones(3))",
                "torch.testing.assert_close(softmax(torch.ones(3)), torch.softmax(torch.ones(3), -1))",
                "softmax.__doc__ = 'mine'")
    for cell in nb.cells:
        if nbgrader_meta(cell).get("grade_id") == "softmax":
            cell.source = "def softmax(x, dim=-1):\n    e = torch.exp(_shift(x, dim))\n    return e / e.sum(dim, keepdim=True)"
    labels = _loaded(nb)
    assert "cell 'imports'" in labels and "cell 'softmax'" in labels
    n = len([c for c in nb.cells if c.cell_type == "code"])
    assert f"code cell {n - 3}" in labels, labels  # the helper cell, added by the student
    assert f"code cell {n}" in labels  # sets an attribute of softmax
    assert f"code cell {n - 2}" not in labels and f"code cell {n - 1}" not in labels  # the self-tests
    assert not any("test_" in label for label in labels)  # test cells never run in the re-check


def _cell(outputs):
    cell = nbformat.v4.new_code_cell("checks.check_dims(softmax)")
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": "test_dims", "points": 2, "solution": False}
    cell.outputs = [nbformat.from_dict(o) for o in outputs]
    return cell


def test_the_verdict_is_final_whatever_the_kernel_printed():
    from nbgrader.utils import determine_grade

    nb = nbformat.read(SOFTMAX, as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == "test_dims")
    plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
    score = {"output_type": "execute_result", "data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1}
    warning = {"output_type": "stream", "name": "stderr", "text": "UserWarning: careful\n"}
    nb.cells[index] = _cell([score])
    trusted.apply(nb, plan, {"softmax": trusted.Outcome("it raised ValueError")})
    assert determine_grade(nb.cells[index])[0] == 0  # a displayed number is no longer a score
    assert nb.cells[index].outputs[0]["ename"] == trusted.FAILED  # the re-check's reason comes first
    nb.cells[index] = _cell([score])
    trusted.apply(nb, plan, {"softmax": trusted.Outcome(None, [])})
    assert determine_grade(nb.cells[index])[0] == 2  # a displayed "0.5" would have been half marks
    nb.cells[index] = _cell([warning])
    trusted.apply(nb, plan, {"softmax": trusted.Outcome(None, [])})
    assert determine_grade(nb.cells[index])[0] == 2  # a warning on stderr no longer costs the cell
    assert "careful" in nb.cells[index].outputs[0]["text"]


@pytest.mark.parametrize("report", [
    {"results": "all good"}, {"results": [None] * 18}, {"results": [{"outputs": 3, "hits": "x"}] * 18},
    {"results": [{"outputs": {"output": {"type": "torch.Tensor", "data": 5}}}] * 18},
    {"results": [{"outputs": {"output": {"type": "torch.Tensor", "dtype": [], "shape": "ab", "data": "!!"}}}] * 18},
    {"results": [{"hits": [[1, 2, 3]], "tampered": 7, "threads": None}] * 18}, {"missing": []}, {"broken": {}},
    {"results": [{"outputs": {"output": {"items": 3, "type": "builtins.list"}}}] * 18}, {"results": [[]] * 18},
])
def test_a_forged_report_fails_and_never_crashes(report):
    nb = nbformat.read(SOFTMAX, as_version=4)
    plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
    (check,) = plan.checks
    found = trusted.outcome(check, report)
    failed, _ = trusted.apply(nb, plan, {"softmax": found})
    assert len(failed) == len(plan.graded), failed


# ---------------------------------------------------------------- what the watch sees
HIT = {  # a forbidden call, however it is spelled: each is seen
    "torch.softmax": "torch.softmax(x, -1)",
    "the tensor method": "x.softmax(-1)",
    "F.softmax under another name": "import torch.nn.functional as G\nf = G.softmax\nf(x, -1)",
    "nn.Softmax": "torch.nn.Softmax(dim=-1)(x)",
    "torch.ops.aten": "torch.ops.aten._softmax(x, 1, False)",
    "torch._C": "torch._C._VariableFunctions.softmax(x, -1)",
    "DisableTorchFunction": "with torch._C.DisableTorchFunction():\n    torch.softmax(x, -1)",
    "a thread": "import threading\nt = threading.Thread(target=lambda: torch.softmax(x, -1))\nt.start(); t.join()",
    "a raw thread": "import _thread, time\ndone = []\n_thread.start_new_thread(lambda: done.append(torch.softmax(x, -1)), ())\n"
                    "while not done:\n    time.sleep(0.001)",
    "a finaliser": "class D:\n    def __del__(self):\n        torch.softmax(x, -1)\nD()",
    "the reference": "from firstprinciples.reference import softmax\nsoftmax(x)",
    "the reference unwrapped": "from firstprinciples.reference import softmax\nsoftmax.__wrapped__(x)",
    "the reference's code under another name": "import types\nfrom firstprinciples.reference import softmax\n"
        "f = softmax.__wrapped__\ng = types.FunctionType(f.__code__.replace(co_name='mine'), f.__globals__)\ng(x, -1)",
    "the reference's code with its first line moved": "import types\nfrom firstprinciples.reference import softmax\n"
        "f = softmax.__wrapped__\nc = f.__code__\n"
        "g = types.FunctionType(c.replace(co_firstlineno=c.co_firstlineno + 1), f.__globals__)\ng(x, -1)",
    "the reference's code in another file": "import types\nfrom firstprinciples.reference import softmax\n"
        "f = softmax.__wrapped__\n"
        "g = types.FunctionType(f.__code__.replace(co_filename='<cell softmax>'), f.__globals__)\ng(x, -1)",
    "a softmax kernel of another name": "torch.ops.aten._safe_softmax(x, -1)",
}
CLEAN_CALLS = {
    "exp and sum": "e = torch.exp(x - x.amax(-1, keepdim=True))\ne / e.sum(-1, keepdim=True)",
    "logsumexp": "torch.exp(x - torch.logsumexp(x, -1, keepdim=True))",
    "code written exactly like the reference": "def s(x, dim=-1):\n    shifted = x - x.amax(dim=dim, keepdim=True)\n"
        "    e = torch.exp(shifted)\n    return e / e.sum(dim=dim, keepdim=True)\ns(x)",
}


def _watch(code):
    import gc

    from firstprinciples.grading import observe

    ns = {"torch": torch, "x": torch.randn(2, 3, dtype=torch.float64)}
    compiled = compile(code, f"{observe.CELL_PREFIX}cell 'softmax'>", "exec")
    with observe.Watch(("softmax", "softmin"), ("softmax",)) as seen:
        exec(compiled, ns)
        gc.collect()
    return seen


@pytest.mark.parametrize("name", sorted(HIT))
def test_the_watch_sees_a_forbidden_call(name):
    seen = _watch(HIT[name])
    assert seen.hits and not seen.tampered, (seen.hits, seen.tampered)


def test_the_watch_sees_torch_work_done_in_another_thread():
    """Not a forbidden call, but out of the watched thread (joined before the case ends, so only
    the operators' events show it): flagged, without a hit."""
    seen = _watch("import threading\nt = threading.Thread(target=lambda: torch.exp(x))\nt.start(); t.join()")
    assert any("torch's operator aten::exp ran in another thread" in t for t in seen.threads), seen.threads
    assert not seen.hits and not seen.tampered, (seen.hits, seen.tampered)


@pytest.mark.parametrize("name", sorted(CLEAN_CALLS))
def test_the_watch_sees_nothing_in_an_honest_call(name):
    seen = _watch(CLEAN_CALLS[name])
    assert not seen.hits and not seen.tampered and not seen.threads


def test_the_watch_names_the_students_line():
    seen = _watch("y = 1\nz = torch.softmax(x, -1)")
    assert ("torch.softmax", "cell 'softmax', line 2") in seen.hits


@pytest.mark.parametrize("code", ["torch.autograd._disable_profiler()", "import sys\nsys.setprofile(None)"])
def test_an_observer_switched_off_is_seen(code):
    seen = _watch(code)
    assert seen.tampered


def _watch_memory(code):
    import numpy as np

    from firstprinciples.grading import observe

    ns = {"torch": torch, "np": np}
    with observe.Watch(memory=True) as seen:
        exec(compile(code, f"{observe.CELL_PREFIX}cell 'tiled_attention'>", "exec"), ns)
    return seen


def test_the_memory_watch_counts_what_torch_never_allocates():
    """A NumPy array of 8 MB, made and dropped: torch's allocator saw nothing of it, Python's
    allocation tracer its peak; a tensor of 8 MB the other way round."""
    numpy_made = _watch_memory("a = np.ones((1024, 1024))\ndel a")
    assert numpy_made.python_peak >= 8 * 2**20 and numpy_made.largest_allocation < 2**20, numpy_made
    torch_made = _watch_memory("t = torch.ones(1024, 1024, dtype=torch.float64)\ndel t")
    assert torch_made.largest_allocation >= 8 * 2**20 and torch_made.python_peak < 2**20, torch_made
    assert not numpy_made.tampered and not torch_made.tampered


def test_the_allocation_tracer_switched_off_is_seen():
    import tracemalloc

    seen = _watch_memory("import tracemalloc\ntracemalloc.stop()\na = np.ones((1024, 1024))")
    assert any("allocation tracer was stopped" in t for t in seen.tampered), seen.tampered
    assert seen.python_peak is None and not tracemalloc.is_tracing()


def test_changes_to_shared_code_are_seen_by_their_effect():
    import numpy
    from firstprinciples.grading import observe

    before = observe.snapshot()
    saved = numpy.allclose
    try:
        numpy.allclose = lambda *a, **k: True
        torch.Tensor.__eq__ = lambda a, b: True
        torch.manual_seed(0)  # torch's own lazy wrapping is not a change
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
        found = observe.changes(before, observe.snapshot())
    finally:
        numpy.allclose = saved
        del torch.Tensor.__eq__
    assert "numpy.allclose was replaced" in found
    assert any("Tensor.__eq__" in f for f in found), found
    assert not any("manual_seed" in f or "AdamW" in f for f in found), found


class _EqualToEverything:
    """A stand-in that says it equals whatever it is compared with."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__

    def __call__(self, *a, **k):
        return True


def test_snapshots_taken_one_after_another_see_what_changed_in_between():
    """The re-check takes each snapshot from the one before (classes of an unchanged module
    are not looked for again): a class added later is watched from then on, and a stand-in
    that claims to equal everything is still a replacement (identities are compared)."""
    import numpy
    from firstprinciples.grading import observe

    first = observe.snapshot()
    saved = numpy.allclose
    numpy.Planted = type("Planted", (), {"__module__": "numpy", "method": lambda self: 1})
    try:
        second = observe.snapshot(first)
        assert "numpy.Planted was added" in observe.changes(first, second)
        numpy.Planted.method = lambda self: 2
        numpy.allclose = _EqualToEverything()
        third = observe.snapshot(second)
        found = observe.changes(second, third)
        assert "numpy.Planted.method was replaced" in found, found
        assert "numpy.allclose was replaced" in found, found
        assert observe.changes(third, observe.snapshot(third)) == []  # nothing since
    finally:
        numpy.allclose = saved
        del numpy.Planted


# Ways to change a watched namespace, from Python and from C, each undone afterwards.
def _set_module_attr(numpy):
    numpy.allclose = _EqualToEverything()


def _through_vars(numpy):
    vars(numpy)["allclose"] = _EqualToEverything()


def _dict_update(numpy):
    numpy.__dict__.update(allclose=_EqualToEverything())


def _exec_in_module(numpy):
    exec("allclose = lambda *a, **k: True", numpy.__dict__)


def _setattr_builtin(numpy):
    setattr(numpy, "allclose", _EqualToEverything())


def _class_attribute(numpy):
    type.__setattr__(torch.nn.Linear, "forward", lambda self, x: x)


def _the_same_value_put_back(numpy):
    # written to, but every identity is the same: nothing was replaced
    numpy.__dict__["allclose"] = numpy.__dict__["allclose"]


@pytest.mark.parametrize("change", [_set_module_attr, _through_vars, _dict_update, _exec_in_module,
                                    _setattr_builtin, _class_attribute, _the_same_value_put_back])
def test_snapshots_that_skip_unwritten_namespaces_see_what_full_ones_see(change, monkeypatch):
    """A namespace whose dict keeps its version tag is not read again (CPython 3.11-3.13): after
    any write, from Python or C, the next snapshot reports exactly what one that reads every
    namespace reports, and an unwritten namespace's entry is the previous one's."""
    import numpy
    from firstprinciples.grading import observe

    if sys.implementation.name == "cpython" and (3, 11) <= sys.version_info[:2] <= (3, 13):
        assert observe._read_tag is not None  # the fast path is in use where it can be
    saved_allclose, saved_forward = numpy.allclose, torch.nn.Linear.__dict__["forward"]
    first = observe.snapshot()
    second = observe.snapshot(first)
    assert second.spaces["numpy"] is first.spaces["numpy"]  # not written to: not read again
    assert observe.changes(first, second) == []
    try:
        change(numpy)
        fast = observe.changes(second, observe.snapshot(second))
        monkeypatch.setattr(observe, "_read_tag", None)
        full = [f for f in observe.changes(second, observe.snapshot()) if "observe._read_tag" not in f]  # (this switch)
    finally:
        numpy.allclose = saved_allclose
        torch.nn.Linear.forward = saved_forward
    assert fast == full
    if change is _the_same_value_put_back:
        assert fast == []
    else:
        assert any(f in ("numpy.allclose was replaced", "torch.nn.modules.linear.Linear.forward was replaced")
                   for f in fast), fast


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the template's baseline is for forked runners")
@pytest.mark.parametrize("change", [_set_module_attr, _class_attribute, _the_same_value_put_back])
def test_a_snapshot_from_before_a_fork_is_a_baseline_for_the_child(change):
    """A warm runner's first snapshot starts from the template's (``observe.BASELINE``, taken
    before the fork): a write in the child after the fork, and one in the parent before it,
    are reported exactly as by a snapshot that reads every namespace."""
    import json

    import numpy
    from firstprinciples.grading import observe

    baseline = observe.snapshot()
    saved = numpy.__dict__["allclose"]
    numpy.fft_before_fork = lambda: None  # (a write in the parent between its snapshot and the fork)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            change(numpy)
            fast = observe.changes(baseline, observe.snapshot(baseline))
            observe._read_tag = None
            full = [f for f in observe.changes(baseline, observe.snapshot()) if "observe._read_tag" not in f]
            os.write(write, json.dumps([fast, full]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        fast, full = json.loads(f.read() or "[null, null]")
    os.waitpid(pid, 0)
    del numpy.fft_before_fork
    assert numpy.__dict__["allclose"] is saved
    assert fast is not None and fast == full
    assert "numpy.fft_before_fork was added" in fast, fast
    if change is not _the_same_value_put_back:
        assert any(f.endswith("was replaced") for f in fast), fast


# Names a course cell binds that are still the student's work: the capstone's `model` is built
# and trained by a locked cell from the student's StudentGPT.
PROBED_COURSE_NAMES = {"capstone": {"model"}}


@pytest.mark.parametrize("path", source_notebooks(), ids=lambda p: p.parent.name)
def test_every_graded_piece_is_re_checked_and_only_there(path):
    """Probes are found by the names the test cells use: in each notebook, every answer a
    test cell names has a probe, and no probe lands on a name that the notebook's course
    cells define (a course variable that happens to share a probe's name)."""
    nb = nbformat.read(path, as_version=4)
    infos = scan.cell_infos(nb, trusted.course_sources(path))
    registry = probes.load()
    written = {n for c in infos if c.student for n in c.defines}
    probed = {n for names in trusted.grade_cell_names(nb, registry).values() for n in names}
    allowed = written | PROBED_COURSE_NAMES.get(path.parent.name, set())
    assert probed <= allowed, f"probes on names the course defines: {sorted(probed - allowed)}"
    tested = {n for names in trusted.grade_cell_names(nb, written).values() for n in names}
    assert tested <= probed, f"graded answers without a probe: {sorted(tested - probed)}"


# ---------------------------------------------------------------- wire and comparison
def _enc(value):
    return wire.loads(wire.dumps(wire.encode(value)))


def test_a_tensor_round_trips_exactly():
    t = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    d = _enc(t)
    assert d["type"] == "torch.Tensor" and d["dtype"] == "float64" and d["shape"] == [3, 4]
    assert np.array_equal(wire.array(d), t.numpy())


@pytest.mark.parametrize("breakage", ["short data", "bad dtype", "negative shape", "huge shape", "not base64"])
def test_malformed_data_is_refused(breakage):
    d = _enc(torch.zeros(2, 2))
    if breakage == "short data":
        d["data"] = base64.b64encode(b"\0" * 4).decode()
    elif breakage == "bad dtype":
        d["data_dtype"] = "object"
    elif breakage == "negative shape":
        d["shape"] = [-1, 2]
    elif breakage == "huge shape":
        d["shape"] = [10**6, 10**6]
    else:
        d["data"] = "!!!"
    with pytest.raises(wire.WireError):
        wire.array(d)


def test_pickle_never_crosses():
    with pytest.raises(wire.WireError):
        wire.loads('{"x": NaN}')
    assert wire.encode(object())["type"] == "builtins.object" and "data" not in wire.encode(object())


class Liar(torch.Tensor):
    def __eq__(self, other):
        return True


REF = torch.tensor([[0.5, 0.25], [0.125, 0.0625]], dtype=torch.float32)
WRONG = {
    "numpy instead of torch": REF.numpy(),
    "a lying subclass": REF.as_subclass(Liar),
    "a parameter": torch.nn.Parameter(REF.clone()),
    "float64 instead of float32": REF.double(),
    "a shape that broadcasts": REF[:, :1],
    "a transposed shape": REF.T.contiguous().reshape(1, 4),
    "NaN": torch.where(REF > 0.2, REF, torch.tensor(float("nan"))),
    "inf": REF / torch.tensor([1.0, 0.0]),
    "requires grad": REF.clone().requires_grad_(True),
    "off by 1e-3": REF + 1e-3,
    "a list": REF.tolist(),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_compare_rejects(name):
    assert compare.compare("output", _enc(WRONG[name]), _enc(REF), show=False) is not None


def test_compare_accepts_float32_rounding():
    assert compare.compare("output", _enc(REF * (1 + 3e-7)), _enc(REF), show=False) is None
    assert compare.compare("output", _enc(REF.tolist()), _enc(REF.tolist()), show=False) is None


def test_the_seed_is_secret_but_stable(tmp_path):
    info = {"nbgrader": {"assignment": "softmax", "student": "ada", "notebook": "softmax"}}
    a = trusted.seed_for(info, tmp_path)
    assert (tmp_path / trusted.SECRET_FILE).stat().st_mode & 0o077 == 0  # only the grader may read it
    assert a == trusted.seed_for(info, tmp_path)
    assert a != trusted.seed_for({"nbgrader": {**info["nbgrader"], "student": "bob"}}, tmp_path)
    (tmp_path / trusted.SECRET_FILE).write_text("another course")
    assert a != trusted.seed_for(info, tmp_path)


def test_correct_and_wrong_answers_in_process():
    nb = nbformat.read(SOFTMAX, as_version=4)
    ns = {}
    exec(CORRECT, ns)
    assert not any(trusted.local_verdicts(nb, ns, seed=5).values())
    verdicts = trusted.local_verdicts(nb, {"softmax": lambda x, dim=-1: x}, seed=5)
    assert all(verdicts.values()) and "differs from the reference" in verdicts["test_large_inputs"]
    assert "should sum to 1" in verdicts["test_dims"]


def test_an_object_equal_to_a_forbidden_function_does_not_hide_it():
    """The torch-function observer remembers what each torch function is. An object of the
    student's that claims to equal a forbidden function (its own __eq__ and __hash__), sent
    through torch's function dispatch first, must not make the real function look harmless."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import handle_torch_function

    from firstprinciples.grading import observe

    class LookAlike:  # unequal while its own name is looked up, then equal to the forbidden function
        __name__ = "harmless"
        armed = False

        def __hash__(self):
            return hash(F.scaled_dot_product_attention)

        def __eq__(self, other):
            return LookAlike.armed and other is F.scaled_dot_product_attention

        def __call__(self, *args, **kwargs):
            return None

    class Dispatches:  # makes handle_torch_function hand LookAlike() to the active mode
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return None

    q = torch.randn(1, 2, 3)
    with observe.Watch(("scaled_dot_product_attention",)) as seen:
        handle_torch_function(LookAlike(), (Dispatches(),), Dispatches())
        LookAlike.armed = True
        F.scaled_dot_product_attention(q, q, q)
    assert any(name.startswith("torch.nn.functional.scaled_dot") for name, _ in seen.hits), seen.hits


# ---------------------------------------------------------------- second tries
# A softmax that reaches its helper only through globals(): the name analysis cannot see the
# helper's cell, so the first runner (the piece's dependencies) raises KeyError; the second try,
# with every non-test cell, loads the helper and passes.
HIDDEN_HELPER = ('def softmax(x, dim=-1):\n    e = globals()["_shifted_exp"](x, dim)\n'
                 '    return e / e.sum(dim=dim, keepdim=True)')
HELPER = "def _shifted_exp(x, dim):\n    return torch.exp(x - x.amax(dim=dim, keepdim=True))"
ERROR = {"output_type": "error", "ename": "AssertionError", "evalue": "wrong", "traceback": []}


def _executed(failing=()):
    """The softmax notebook with the hidden helper, as its kernel ran it: the test cells of ``failing``
    (grade ids) with an error among their outputs, the others with none."""
    nb = _infos(HELPER)
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if meta.get("grade_id") == "softmax":
            cell.source = HIDDEN_HELPER
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(ERROR)] if meta.get("grade_id") in failing else []
    return nb


TESTS = ("test_worked_example", "test_large_inputs", "test_minus_inf", "test_dims", "test_gradients_and_inputs")


@pytest.mark.parametrize("failing, second", [
    ((), True),  # every test cell passed in the kernel: the re-check alone could cost the points
    (TESTS[:-1], True),  # one passed: its points depend on the second try
    (TESTS, False),  # every one failed in the kernel: they score 0 whatever the re-check finds
], ids=["none failed in the kernel", "one passed in the kernel", "all failed in the kernel"])
def test_a_second_try_is_made_only_where_a_point_depends_on_it(failing, second, monkeypatch):
    from firstprinciples.grading import sandbox

    nb = _executed(failing)
    plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
    runs = []
    real = trusted.run_runner

    def run_runner(command, cells, checks, *args, **kwargs):
        runs.append([c["label"] for c in cells])
        return real(command, cells, checks, *args, **kwargs)

    monkeypatch.setattr(trusted, "run_runner", run_runner)
    outcomes, _ = trusted.recheck(plan, sandbox.recheck_command(False), trusted.Limits())
    n = len([c for c in nb.cells if c.cell_type == "code"])
    assert f"code cell {n}" not in runs[0]  # the helper: not a dependency the analysis can see
    failures = trusted.apply(nb, plan, outcomes)[0]
    if second:
        assert len(runs) == 2 and f"code cell {n}" in runs[1], runs
        assert failures == {}, failures  # the second try's verdict stands: the helper was loaded
    else:
        assert len(runs) == 1, runs  # no runner for a verdict that cannot change a score
        assert len(failures) == len(TESTS) and all("KeyError" in why for why in failures.values()), failures


def test_second_tries_made_later_are_the_ones_made_at_once(monkeypatch):
    """The re-check started ahead of the kernel (``verdicts.Ahead``) leaves its second tries for
    when the cells are done (``second=False``), then makes them (``more_tries``): the same outcomes
    as one re-check made with the executed notebook."""
    from firstprinciples.grading import sandbox

    command = sandbox.recheck_command(False)
    for failing in ((), TESTS):
        nb = _executed(failing)
        sources = trusted.course_sources(SOFTMAX)
        at_once, flags = trusted.recheck(trusted.make_plan(nb, 0, sources), command, trusted.Limits())
        plan = trusted.make_plan(nb, 0, sources)
        first = trusted.recheck(plan, command, trusted.Limits(), second=False)
        assert first[0]["softmax"].retry()  # the first runner's KeyError
        later, later_flags = trusted.more_tries(plan, command, first, trusted.Limits())
        assert later_flags == flags
        assert {k: (v.overall, v.cases) for k, v in later.items()} == {
            k: (v.overall, v.cases) for k, v in at_once.items()}


def test_second_tries_made_later_keep_the_first_runners_word_on_the_graders_tools():
    """A change to the grader's own tools seen by the first runners voids every later try in one
    re-check (``outcome``'s ``machinery``). Made later, the tries are given that word too: the
    first runners' flags keep their mark until ``more_tries`` has judged its runners with it,
    and come out of it as those of one re-check made at once."""
    from firstprinciples.grading import sandbox

    nb = _executed()
    for cell in nb.cells:
        if nbgrader_meta(cell).get("grade_id") == "softmax":
            cell.source = ("import firstprinciples.grading.wire as _w\n"
                           "_w.scalar = _w.scalar.__class__(_w.scalar.__code__, _w.scalar.__globals__)\n"
                           + cell.source)
    command, sources = sandbox.recheck_command(False), trusted.course_sources(SOFTMAX)
    plan = trusted.make_plan(nb, 0, sources)
    first = trusted.recheck(plan, command, trusted.Limits(), second=False)
    assert first[1] and all(f.startswith("!") for f in first[1]), first[1]
    later = trusted.more_tries(plan, command, first, trusted.Limits())
    at_once = trusted.recheck(trusted.make_plan(nb, 0, sources), command, trusted.Limits())
    assert later[1] == at_once[1] and not any(f.startswith("!") for f in later[1])
    assert later[0]["softmax"].overall == at_once[0]["softmax"].overall
    assert "grader's own tools were changed" in later[0]["softmax"].overall


# A runner that reports in awkward pieces: a line before its first mark, a piece's event of
# megabytes written a few kilobytes at a time (one line over hundreds of reads), then its last
# events in one write, cut in two; with "twice", the piece is reported a second time there.
CHUNKED_RUNNER = r'''
import json, sys, time
from firstprinciples.grading import wire
nonce = json.loads(sys.stdin.read())["nonce"]
mark = wire.MARK + nonce
def line(event):
    return ("\n" + mark + wire.dumps(event) + "\n").encode()
out = sys.stdout.buffer
out.write(b"something the cells printed\n" + line({"event": "loaded", "errors": [], "changes": []}))
out.flush()
big = line({"event": "piece", "name": "softmax", "results": [{"payload": "0123456789" * 300_000}]})
for i in range(0, len(big), 4096):
    out.write(big[i:i + 4096])
    out.flush()
    if i % (64 * 4096) == 0:
        time.sleep(0.01)  # (so that the grader reads it in many pieces)
last = (line({"event": "piece", "name": "softmax", "results": []}) if sys.argv[1] == "twice" else b"") + line({"event": "done"})
out.write(last[:7])
out.flush()
time.sleep(0.05)
out.write(last[7:])
out.flush()
'''


@pytest.mark.parametrize("reports", ["once", "twice"])
def test_a_report_read_in_many_pieces_is_read_whole(reports):
    """The grader reads a runner's report as it comes: a line of megabytes over hundreds of reads
    is taken whole, lines that share a read are each taken (the last one cut across two reads),
    and a piece reported twice is still refused. (That the pieces are joined once, not at every
    read, is a matter of time, measured by the check command's timeline: docs/design/processes.md.)"""
    import time

    check = trusted.Check("softmax", probes.load()["softmax"], [])
    loaded, results = trusted.run_runner([sys.executable, "-c", CHUNKED_RUNNER, reports], [], [check],
                                         trusted.Limits(), time.monotonic() + 120)
    assert loaded.get("event") == "loaded"
    if reports == "twice":
        assert results["softmax"] == "the re-check reported this piece twice (its report was forged)"
    else:
        assert results["softmax"]["results"] == [{"payload": "0123456789" * 300_000}]


@pytest.mark.parametrize("call", [
    "F.scaled_dot_product_attention(q, q, q)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)",
    "torch.ops.aten._scaled_dot_product_attention_math(q, q, q)",
    "torch._C._nn.scaled_dot_product_attention(q, q, q)",
])
def test_every_kernel_of_a_forbidden_family_is_seen(call):
    """A forbidden pattern stands for its whole family of operators: PyTorch's attention reached
    through a kernel whose name adds words ("flash", "_for_cpu", "_math") is seen as a hit."""
    import torch.nn.functional as F

    from firstprinciples.grading import observe

    ns = {"torch": torch, "F": F, "q": torch.randn(1, 2, 4, 8)}
    compiled = compile(call, f"{observe.CELL_PREFIX}cell 'attention'>", "exec")
    with observe.Watch(("scaled_dot_product_attention", "multi_head_attention"), ()) as seen:
        exec(compiled, ns)
    assert seen.hits and not seen.tampered, (seen.hits, seen.tampered)


@pytest.mark.parametrize("name, hit", [
    ("aten::_scaled_dot_product_flash_attention_for_cpu", True), ("aten::_scaled_dot_product_efficient_attention", True),
    ("aten::_native_multi_head_attention", True), ("torch.nn.functional.multi_head_attention_forward", True),
    ("aten::_fused_rms_norm", True), ("aten::bmm", False), ("aten::_softmax_backward_data", False),
    ("aten::scaled_product_dot_attention", False), ("aten::dot", False),
])
def test_a_family_is_its_words_in_order(name, hit):
    from firstprinciples.grading import observe

    assert observe.in_family(name, ("scaled_dot_product_attention", "multi_head_attention", "rms_norm"),
                             ignore_case=name.startswith("aten::")) is hit


@pytest.mark.parametrize("name, hit", [
    ("torch.nn.modules.rnn.RNN.forward", True), ("torch.nn.utils._expanded_weights.expanded_weights_impl.setup_rnn", False),
    ("torch.nn.modules.normalization.RMSNorm.forward", True), ("torch.nn.functional.rms_norm", True),
])
def test_a_python_name_keeps_its_case(name, hit):
    """The class pattern "RNN" is not torch's helper ``setup_rnn`` (a correct RNN's gradient check
    reached it and was flagged on one seed in 60)."""
    from firstprinciples.grading import observe

    assert observe.in_family(name, ("RNN", "RMSNorm", "rms_norm")) is hit


FFN_OWN = '''
import torch.nn as nn
class FeedForward(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
    def forward(self, x):
        return self.net(x)
FeedForward(4)(torch.randn(2, 4))
'''
FFN_COPIED = '''
import types
import torch.nn as nn
from firstprinciples.reference import FeedForward as Ref
f = Ref.forward.__wrapped__  # (the reference's own forward, under the course's marking wrapper)
moved = types.FunctionType(f.__code__.replace(co_firstlineno=f.__code__.co_firstlineno + 1), f.__globals__)
class Mine(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 4)
moved(Mine(), torch.randn(2, 4))
'''


@pytest.mark.parametrize("code, hit", [(FFN_OWN, False), (FFN_COPIED, True)])
def test_a_one_line_method_like_the_references_is_the_students_own(code, hit):
    """``return self.net(x)`` is the reference's FeedForward.forward to the letter, and what an
    honest student writes: only code made from the reference's own code object (here with its
    first line moved) is the reference."""
    from firstprinciples.grading import observe

    compiled = compile(code, f"{observe.CELL_PREFIX}cell 'FeedForward'>", "exec")
    with observe.Watch((), ("FeedForward",)) as seen:
        exec(compiled, {"torch": torch})
    assert bool([h for h in seen.hits if "FeedForward" in h[0]]) is hit, seen.hits


def test_every_phase_of_a_notebooks_recheck_shares_one_budget():
    """The re-check started ahead, its second tries and a rebuilt piece's runner are separate
    ``_Recheck``s: each gets what the notebook's budget has left, not a fresh ``Limits.total`` (a
    capstone's re-check used to take 2.5-3 times its budget)."""
    import time

    nb = nbformat.read(SOFTMAX, as_version=4)
    plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
    limits = trusted.Limits(total=10.0)
    first = trusted._Recheck(plan, [], limits, None, None)
    assert 9.9 < first.deadline - first.started <= 10.0
    first.started -= 7.5  # (as if its runners had taken 7.5 s)
    first.result([])
    assert 7.4 < plan.spent < 7.7
    second = trusted._Recheck(plan, [], limits, None, None)
    assert 2.2 < second.deadline - second.started <= 2.5
    second.started -= 5.0
    outcomes, _ = second.result(plan.checks)
    third = trusted._Recheck(plan, [], limits, None, None)
    assert third.deadline <= time.monotonic() and not third.in_time()


@pytest.mark.parametrize("deep", ["x = " + "+".join(["1"] * 100_000), "x = " + "-" * 100_000 + "1"],
                         ids=["a sum 100,000 long", "100,000 minus signs"])
def test_a_cell_too_deep_to_parse_defines_nothing_and_stops_nothing(deep):
    """An expression nested 100,000 deep (RecursionError, or MemoryError from the parser): the
    kernel cannot compile it either; the trusted analysis keeps going without it (it stopped the
    notebook's grading: "not graded", and the earlier score kept)."""
    from firstprinciples.grading import scan

    nb = nbformat.read(SOFTMAX, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(deep))
    infos = scan.cell_infos(nb)
    assert infos[-1].tree is None and not infos[-1].defines
    assert any("softmax" in i.defines for i in infos)
    plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
    assert plan.checks


NO_PROCESS = r"""
import os, subprocess, threading, torch
from firstprinciples.grading import recheck
print("installed", recheck.refuse_new_processes())
done = []
t = threading.Thread(target=lambda: done.append(1)); t.start(); t.join()
torch.set_num_threads(2); (torch.randn(300, 300) @ torch.randn(300, 300)).sum().item()
print("threads", done == [1])
for name, make in [("fork", os.fork), ("subprocess", lambda: subprocess.run(["true"]))]:
    try:
        if make() == 0:
            os._exit(0)
        print(name, "made")
    except PermissionError:
        print(name, "refused")
"""


def test_a_runner_makes_no_process_but_keeps_its_threads():
    """The re-check's runner refuses fork, vfork and spawn (a child would run unwatched), and keeps
    threads working (torch's and Python's)."""
    out = subprocess.run([sys.executable, "-c", NO_PROCESS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    assert lines[:4] == ["installed True", "threads True", "fork refused", "subprocess refused"], out.stdout


def test_the_reference_run_in_a_thread_is_named_with_its_line():
    """A thread started during the case that calls the course's reference: the hit names the
    reference and the student's line (before, only its operators were seen: "aten::... ran in
    another thread")."""
    code = ("import threading\nfrom firstprinciples.reference import softmax\nout = []\n"
            "t = threading.Thread(target=lambda: out.append(softmax(x)))\nt.start(); t.join()")
    seen = _watch(code)
    assert ("firstprinciples.reference.softmax", "cell 'softmax', line 4") in seen.hits, seen.hits


# ---------------------------------------------------------------- the runner decides nothing
def test_a_table_cleared_after_the_baseline_changes_nothing():
    """The grader matches what a case called against the identities taken before any student code
    (the runner's baseline event): clearing the process's own table afterwards, as a student's
    code in the runner could, does not hide a call of the reference's code, moved to another file."""
    import types

    from firstprinciples.grading import observe
    import firstprinciples.reference as R

    table = observe.forbidden_python(("softmax",), ("softmax",))
    baseline = dict(table.ids)  # (what the runner sends before any student code)
    inner = R.softmax.__wrapped__
    moved = types.FunctionType(inner.__code__.replace(co_filename="mine.py", co_firstlineno=1), inner.__globals__)
    with observe.Watch() as seen:
        moved(torch.randn(3), -1)
    raw = seen.raw()
    emptied = observe.Table()  # the process's table, emptied by the student's code
    assert observe.judge(raw, ("softmax",), emptied, baseline), raw["codes"][:3]
    assert not observe.judge(raw, ("softmax",), emptied, {})  # (the match was the identity, as said)


def test_a_module_imported_again_is_still_the_course():
    """A second copy of the reference's module (new objects from the same file) is recognised by
    its place: the file inside firstprinciples/ and the function's qualified name."""
    import importlib.util

    from firstprinciples.grading import observe
    import firstprinciples.reference.attention as A

    spec = importlib.util.spec_from_file_location("firstprinciples.reference.fresh_copy", A.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    with observe.Watch(("softmax",), ("softmax",)) as seen:
        fresh.softmax(torch.randn(3), -1)
    assert any(h[0] == "firstprinciples.reference.softmax" for h in seen.hits), seen.hits


@pytest.mark.parametrize("code, found", [
    ("import gc\nobjs = gc.get_objects()", "import gc"),
    ("import sys\nf = sys._getframe(1).f_locals", "_getframe"),
    ("g = softmax.__globals__", "__globals__"),
    ("from firstprinciples.grading import probes", "import firstprinciples.grading"),
    ("import sys\nname = 'mod' + 'ules'\nm = getattr(sys, name)", "getattr with a computed name"),
    ("x = eval('1 + 1')", "eval"),
    ("import importlib\nm = importlib.import_module('firstprinciples.reference')", "import importlib"),
    # honest code: none of these is flagged
    ("class M:\n    def __init__(self):\n        for i in range(3):\n            setattr(self, f'h{i}', i)\n"
     "    def get(self, i):\n        return getattr(self, f'h{i}')", None),
    ("import torch\nimport torch.nn.functional as F\ny = F.gelu(torch.randn(3))\nz = torch.compile", None),
    ("import types\nns = types.SimpleNamespace(a=1)", None),
])
def test_the_scan_flags_code_that_reaches_into_internals(code, found):
    import ast

    from firstprinciples.grading import scan

    got = [what for _line, what in scan.internals(ast.parse(code))]
    if found is None:
        assert not got, got
    else:
        assert any(found in w for w in got), got


# ---------------------------------------------------------------- the watch's cost is budgeted
SLOW_SOFTMAX = '''
import time
import torch

def softmax(x, dim=-1):
    time.sleep(0.05)  # a correct answer, slow in the kernel too
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)
'''


def test_a_slow_piece_gets_as_much_more_time_as_it_took_in_the_kernel():
    """A correct answer that is slow in the kernel is not failed by the re-check's limit: its piece
    gets ``WATCH_FACTOR`` times what its test cells took there (within ``PIECE_MAX``). Without that,
    the same answer runs past a tight limit."""
    from firstprinciples.grading import sandbox

    nb = nbformat.read(SOFTMAX, as_version=4)
    for cell in nb.cells:
        if nbgrader_meta(cell).get("grade_id") == "softmax":
            cell.source = SLOW_SOFTMAX
    tight = trusted.Limits(piece=0.5, total=120.0)
    given = trusted.Limits(piece=0.5, total=120.0, kernel={"softmax": 0.5})
    assert given.piece_for("softmax") == 0.5 * trusted.WATCH_FACTOR and given.total_for() > tight.total_for()
    found = {}
    for name, limits in (("tight", tight), ("budgeted", given)):
        plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
        outcomes, _ = trusted.recheck(plan, sandbox.recheck_command(False), limits, second=False)
        found[name] = outcomes["softmax"]
    assert found["tight"].overall and "did not finish" in found["tight"].overall, found["tight"]
    assert found["budgeted"].overall is None and not any(c.get("error") for c in found["budgeted"].cases), \
        found["budgeted"]


def test_which_pieces_get_more_time():
    """Only pieces whose test cells took long enough that the watch could push them past the limit."""
    tested = {3: ["softmax"], 5: ["softmax"], 7: ["scaled_dot_product_attention"]}
    seconds = {3: 2.5, 5: 2.0, 7: 0.3}
    assert trusted.slow_in_kernel(seconds, tested, 120.0) == {"softmax": 4.5}
    assert trusted.slow_in_kernel({3: 0.1}, tested, 120.0) == {}


def test_the_executor_hands_the_kernels_times_to_the_recheck():
    """What the executor measured of each test cell reaches the re-check's limits for the pieces
    those cells use (and nothing does when every test was quick: the guess made ahead holds)."""
    from firstprinciples.grading.execute import RobustExecute

    ex = RobustExecute(recheck_piece_timeout=10.0)
    ex._tested = lambda: {4: ["project_qkv"], 6: ["project_qkv"], 8: ["dot_product_scores"]}
    ex._seconds = {4: 0.25, 6: 0.25, 8: 0.01}
    assert ex._limits().kernel == {"project_qkv": 0.5}
    ex._seconds = {4: 0.01, 6: 0.01, 8: 0.01}
    assert ex._limits().kernel == {}


def test_every_probe_module_is_loaded():
    """A probe module that ``probes.MODULES`` does not name would never be registered (its pieces
    not re-checked), and a misspelt name there is an import error, not a silent gap."""
    from pathlib import Path

    folder = Path(probes.__file__).parent
    files = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert files == set(probes.MODULES), (files ^ set(probes.MODULES))
    assert len(probes.MODULES) == len(set(probes.MODULES))


# ---------------------------------------------------------------- the adapter-only runner
REACHES_FOR_THE_COURSE = '''
import importlib
import firstprinciples

def softmax(x, dim=-1):
    for name in ("firstprinciples.reference", "firstprinciples.reference.attention", "firstprinciples.checks.attention",
                 "firstprinciples.grading.probes.attention", "firstprinciples.capstone.model", "firstprinciples.lengths"):
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        raise RuntimeError("importable: " + name)
    capstone = vars(firstprinciples).get("capstone")  # (its corpus and training loop are the notebook's)
    if hasattr(firstprinciples, "reference") or (capstone is not None and "model" in vars(capstone)):
        raise RuntimeError("reachable as an attribute of the package")
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)
'''


@pytest.mark.parametrize("sandboxed", [False, True], ids=["plain", "sandboxed"])
def test_a_declared_pieces_runner_holds_no_course_implementation(sandboxed):
    """The re-check's runner of a declared piece (softmax) loads the adapter only: the reference,
    the checks and probes of the other exercises and the course's models cannot be imported there,
    nor reached as attributes of the package (an answer that could would pass this re-check only
    if they were missing; the same answer in a runner that holds them fails)."""
    from firstprinciples.grading import recheck, sandbox

    nb = nbformat.read(SOFTMAX, as_version=4)
    for cell in nb.cells:
        if nbgrader_meta(cell).get("grade_id") == "softmax":
            cell.source = REACHES_FOR_THE_COURSE
    plan = trusted.make_plan(nb, 0, trusted.course_sources(SOFTMAX))
    outcomes, _ = trusted.recheck(plan, sandbox.recheck_command(sandboxed), trusted.Limits())
    assert trusted.apply(nb, plan, outcomes)[0] == {}
    assert recheck.refused("firstprinciples.reference") and recheck.refused("firstprinciples.checks.attention")
    assert not recheck.refused("firstprinciples.checks._student") and not recheck.refused("firstprinciples.grading.probes")
