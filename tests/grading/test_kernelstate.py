"""The capstone's trained model is re-checked from the parameters its kernel ended with, not trained twice.

``kernelstate``: after the last cell the grader prints, from the kernel, the ``state_dict`` of each piece
with ``Probe.rebuild`` (the capstone's ``model``) as plain data; the re-check's runner loads it into the
notebook's own ``StudentGPT`` and probes that, watched, instead of loading the cell that trains it. What
the kernel prints is never trusted: a malformed state is dropped, and a state that does not fit the class
or fails a test sends the piece back to the re-check as before (trained again), the better verdict
standing. These tests check each of those steps, and the whole chain through the check command with a
training cell that leaves the kernel and a re-check runner with different models.
"""
from __future__ import annotations

import io
import subprocess
import sys
import time
from contextlib import redirect_stdout

import nbformat
import pytest
import torch

from course import EXERCISES, SOLUTIONS, fill, fresh_template, solution_answers
from firstprinciples.capstone.model import TinyGPT, load_trained
from firstprinciples.grading import kernelstate, sandbox, trusted, verdicts, wire

NOTEBOOK = "capstone/capstone.ipynb"
MODEL_CELLS = ("test_trained", "test_resolves_it", "test_generate_trained")
LIMITS = trusted.Limits(load=120.0, piece=60.0, total=300.0)


# The course's stored TinyGPT is the solution's StudentGPT with its feed-forward as one nn.Sequential
# (net.0, net.2) where the solution names the two layers expand and project.
SOLUTION_NAMES = {"ffn.net.0.": "ffn.expand.", "ffn.net.2.": "ffn.project."}


def _solution_names(model: TinyGPT) -> dict:
    """A TinyGPT's parameters under the solution's StudentGPT's names."""
    state = {}
    for key, value in model.state_dict().items():
        for old, new in SOLUTION_NAMES.items():
            key = key.replace(old, new)
        state[key] = value
    return state


def _trained_state() -> dict:
    """The course's trained weights, as the solution's StudentGPT names them."""
    return _solution_names(load_trained()[0])


def _printed(state: dict, name: str = "model", nonce: str = "n0nce") -> dict:
    class Holder(torch.nn.Module):
        def state_dict(self):
            return state

    out = io.StringIO()
    with redirect_stdout(out):
        kernelstate.emit({name: Holder()}, [name], nonce)
    return kernelstate.printed([{"output_type": "stream", "name": "stdout", "text": out.getvalue()}], nonce)


# ---------------------------------------------------------------- what crosses from the kernel
def test_a_state_round_trips_from_the_kernels_print():
    state = _trained_state()
    states = verdicts.parsed_states(_printed(state))
    assert set(states) == {"model"} and list(states["model"]) == list(state)
    for key, value in state.items():
        assert torch.equal(torch.from_numpy(wire.array(states["model"][key])), value), key


def test_only_lines_with_the_grader_s_nonce_count():
    out = io.StringIO()
    with redirect_stdout(out):
        print("model said hello")
        kernelstate.emit({"model": load_trained()[0]}, ["model"], "other")
    assert kernelstate.printed([{"output_type": "stream", "name": "stdout", "text": out.getvalue()}], "n0nce") == {}


def test_a_missing_object_is_reported_as_such_and_left_out():
    out = io.StringIO()
    with redirect_stdout(out):
        kernelstate.emit({}, ["model"], "n0nce")
    printed = kernelstate.printed([{"output_type": "stream", "name": "stdout", "text": out.getvalue()}], "n0nce")
    assert "NameError" in printed["model"] or "KeyError" in printed["model"]
    assert verdicts.parsed_states(printed) == {}


def _bad(kind: str) -> str:
    good = wire.encode(torch.zeros(2, 3))
    if kind == "not JSON":
        return "{this is not json"
    if kind == "an error":
        return wire.dumps({"name": "model", "error": "NameError"})
    if kind == "a list":
        return wire.dumps([1, 2])
    if kind == "an empty state":
        return wire.dumps({"name": "model", "state": {}})
    if kind == "a number for an array":
        return wire.dumps({"name": "model", "state": {"w": {"type": "builtins.int", "value": 3}}})
    if kind == "data that does not fit the shape":
        return wire.dumps({"name": "model", "state": {"w": {**good, "shape": [5, 5]}}})
    if kind == "not base64":
        return wire.dumps({"name": "model", "state": {"w": {**good, "data": "!!!"}}})
    if kind == "an object dtype":
        return wire.dumps({"name": "model", "state": {"w": {**good, "data_dtype": "object"}}})
    if kind == "NaN as a constant":
        return '{"name": "model", "state": {"w": NaN}}'
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["not JSON", "an error", "a list", "an empty state", "a number for an array",
                                  "data that does not fit the shape", "not base64", "an object dtype",
                                  "NaN as a constant"])
def test_a_malformed_state_is_left_out(kind):
    assert kernelstate.parse(_bad(kind)) is None
    assert verdicts.parsed_states({"model": _bad(kind)}) == {}


def test_a_state_over_the_size_limit_is_left_out(monkeypatch):
    text = _printed(_trained_state())["model"]
    assert kernelstate.parse(text) is not None
    monkeypatch.setattr(kernelstate, "MAX_BYTES", len(text) - 1)
    assert kernelstate.parse(text) is None


# ---------------------------------------------------------------- the re-check from a state
def _plan(student_gpt: str | None = None, seed: int = 7):
    nb = nbformat.read(SOLUTIONS / NOTEBOOK, as_version=4)
    if student_gpt is not None:
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "StudentGPT")
        cell.source = student_gpt
    return trusted.make_plan(nb, seed, trusted.course_sources(SOLUTIONS / NOTEBOOK))


def _model_failures(plan, outcomes) -> dict:
    """The model's test cells that its outcome fails, with why."""
    check = next(c for c in plan.checks if c.name == "model")
    # (the model's own cells: test_generate_trained is the decoder's, re-checked on random models)
    reasons = {cell: outcomes["model"].reason(check, check.probe.cells[cell]) for cell in MODEL_CELLS
               if cell in check.probe.cells}
    return {cell: why for cell, why in reasons.items() if why}


def _recorded(monkeypatch) -> list:
    """Every runner the re-check starts: (the labels of the cells it loads, whether it was given states)."""
    runs = []
    real = trusted.run_runner

    def run_runner(command, cells, checks, limits, deadline, cancel=None, states=None):
        runs.append(([c["label"] for c in cells], bool(states)))
        return real(command, cells, checks, limits, deadline, cancel, states)

    monkeypatch.setattr(trusted, "run_runner", run_runner)
    return runs


def _state_of(state: dict) -> dict:
    return {k: wire.encode(v) for k, v in state.items()}


def test_the_trained_model_is_rebuilt_from_the_kernels_parameters_not_trained_again(monkeypatch):
    plan = _plan()
    runs = _recorded(monkeypatch)
    outcomes, _ = trusted.recheck(plan, sandbox.recheck_command(False), LIMITS,
                                  states={"model": _state_of(_trained_state())}, only={"model"})
    assert _model_failures(plan, outcomes) == {}
    assert len(runs) == 1 and runs[0][1], runs
    assert "cell 'train_code'" not in runs[0][0] and "cell 'StudentGPT'" in runs[0][0], runs[0][0]


def test_a_state_that_fails_sends_the_model_back_to_be_trained_again(monkeypatch):
    """Untrained parameters fail the rebuilt model's loss: the re-check then loads the training cell, as
    before the state existed, and the solution's own training passes (a state never costs a point)."""
    plan = _plan()
    runs = _recorded(monkeypatch)
    torch.manual_seed(0)
    untrained = TinyGPT(57, 64, 4, 2, 32)
    outcomes, _ = trusted.recheck(plan, sandbox.recheck_command(False), LIMITS,
                                  states={"model": _state_of(_solution_names(untrained))}, only={"model"})
    assert _model_failures(plan, outcomes) == {}
    assert [given for _, given in runs] == [True, False], runs
    assert "cell 'train_code'" in runs[1][0]


def _solution_cell(grade_id: str) -> str:
    nb = nbformat.read(SOLUTIONS / NOTEBOOK, as_version=4)
    return next(c.source for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


# The solution's StudentGPT with one bug: the positions are never added (same parts, another function).
ADDS_POSITIONS = "x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))"
assert ADDS_POSITIONS in _solution_cell("StudentGPT")
NO_POSITIONS = _solution_cell("StudentGPT").replace(ADDS_POSITIONS, "x = self.tok(idx)")
OTHER_PARTS = NO_POSITIONS.replace("self.ln_f = nn.LayerNorm(d_model)", "self.norm = nn.LayerNorm(d_model)").replace(
    "self.ln_f(x)", "self.norm(x)")


@pytest.mark.parametrize("student_gpt, why", [
    (NO_POSITIONS, "held-out loss"),
    (OTHER_PARTS, "Error(s) in loading state_dict"),
], ids=["a wrong class", "a class with other parts"])
def test_good_parameters_do_not_rescue_a_wrong_class(student_gpt, why):
    """The course's trained parameters, loaded into a StudentGPT that ignores positions, fail the
    rebuilt model's test (the class computes another function of them); into a class whose parts
    have other names, they do not load at all (and the piece goes back to be trained)."""
    plan = _plan(student_gpt)
    check = next(c for c in plan.checks if c.name == "model")
    cells = trusted.job_cells(plan, check.probe.rebuilt_from)
    _, results = trusted.run_runner(sandbox.recheck_command(False), cells, [check], LIMITS,
                                    time.monotonic() + LIMITS.total, states={"model": _state_of(_trained_state())})
    found = trusted.outcome(check, results["model"])
    reason = found.reason(check, check.probe.cells["test_trained"])
    assert reason is not None and why in reason, reason


# ---------------------------------------------------------------- the whole chain, through the check command
# The locked training cell, replaced so that the kernel (a real IPython shell) and the re-check's runner
# (which has no IPython) end with different models; only the kernel's can pass.
KERNEL_ONLY = '''
from firstprinciples.capstone.model import load_trained
model = StudentGPT(len(vocab.tokens))
if type(get_ipython()).__module__.startswith("ipykernel"):  # the kernel's model: trained
    names = {"ffn.net.0.": "ffn.expand.", "ffn.net.2.": "ffn.project."}
    state = {}
    for key, value in load_trained()[0].state_dict().items():
        for old, new in names.items():
            key = key.replace(old, new)
        state[key] = value
    model.load_state_dict(state)
model.eval()
'''
RUNNER_ONLY = KERNEL_ONLY.replace('if type(get_ipython()).__module__.startswith("ipykernel"):',
                                  'if not type(get_ipython()).__module__.startswith("ipykernel"):')


def _check(tmp_path, train_cell: str) -> str:
    nb = fill(nbformat.read(EXERCISES / NOTEBOOK, as_version=4),
              solution_answers(nbformat.read(SOLUTIONS / NOTEBOOK, as_version=4)))
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "train_code")
    cell.source = train_cell
    path = tmp_path / "capstone.ipynb"
    nbformat.write(nb, path)
    proc = subprocess.run([sys.executable, "-m", "firstprinciples.grading.check", str(path)],
                          capture_output=True, text=True, timeout=600)
    return proc.stdout + proc.stderr


def test_the_check_command_re_checks_the_model_the_kernel_trained(tmp_path):
    out = _check(tmp_path, KERNEL_ONLY)
    for cell in MODEL_CELLS:
        assert f"pass  {cell}" in out, out


def test_a_kernel_model_that_fails_is_reported_from_the_students_own_test(tmp_path):
    """The kernel's model is untrained (the runner's is trained): the kernel's own test fails the
    cell, with the student's message, and the re-check (which falls back to training in the runner,
    see above) neither crashes the chain nor puts a message of its own in place of the student's.
    The other cells are not touched."""
    out = _check(tmp_path, RUNNER_ONLY)
    assert "FAIL  test_trained" in out and "pass  test_generate_trained" in out, out
    reason = out.split("FAIL  test_trained", 1)[1].split("\n")[1].strip()
    assert reason.startswith("AssertionError: your trained model on the 400 held-out sentences: its held-out loss is 4."), reason
    assert "Visible score: 20/25" in out, out


# ---------------------------------------------------------------- the same verdict on every path
def _capstone(kind: str):
    release = nbformat.read(EXERCISES / NOTEBOOK, as_version=4)
    answers = solution_answers(nbformat.read(SOLUTIONS / NOTEBOOK, as_version=4))
    if kind == "untouched":
        return release
    nb = fill(release, answers)
    if kind == "no positions":
        cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "StudentGPT")
        cell.source = NO_POSITIONS
    return nb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the service is a child of the warm template")
@pytest.mark.parametrize("kind, state", [
    ("untouched", None),  # no model in the kernel: the model re-checked from its cells
    ("solved", "trained"),  # rebuilt from the kernel's parameters
    ("no positions", "trained"),  # rebuilt, fails, trained again in the runner, where it passes
], ids=["untouched", "solved", "a wrong class"])
def test_the_verdict_is_the_same_in_the_grading_process_and_the_service_started_ahead(kind, state):
    """The cold path (``verdicts.decide`` in the grading process: the rebuilt piece first, then the
    others) and the warm one (the service's re-check started ahead without the rebuilt piece, which
    is re-checked after the cells) give the same failures, notes and test-cell outputs: a piece with
    ``rebuild`` always gets runners of its own, so no other piece's reason depends on the path (the
    benchmark found 130 of 1,110 cells differing, by a 'while loading your code, cell train_code
    raised' context, before it did)."""
    nb = _capstone(kind)
    printed = _printed(_trained_state()) if state else {}
    seed, limits = 20261204, trusted.Limits(piece=60.0, total=300.0)
    here, there = nbformat.from_dict(nb), nbformat.from_dict(nb)
    local = verdicts.decide(here, trusted.make_plan(here, seed), {}, set(), 60.0, limits, False, printed)
    service = verdicts.Service.begin(there, seed, None, ahead=(60.0, limits, False))
    try:
        assert service.rebuilt() == ["model"]
        remote = service.decide(there, {}, set(), 60.0, limits, False, printed)
    finally:
        service.close()
    assert remote == local
    assert [c.get("outputs") for c in there.cells] == [c.get("outputs") for c in here.cells]
    failed = {nb.cells[i].metadata["nbgrader"]["grade_id"]: why for i, why in local[0].items()}
    if kind == "solved":
        assert not failed, failed
    elif kind == "untouched":
        assert "test_trained" in failed and "train_code" in failed["test_trained"], failed
        assert all("train_code" not in why for cell, why in failed.items() if cell not in MODEL_CELLS), failed
    else:
        # The course's parameters fail in this class, but the class trained in the runner learns the
        # task without positions: its model cells pass (the state cost nothing); its forward fails.
        assert "test_model_forward" in failed and not set(failed) & set(MODEL_CELLS), failed


# ---------------------------------------------------------------- the kernel's imports, a hint
def _said(lazy, nonce: str = "n0nce") -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        kernelstate.emit({"model": load_trained()[0]}, ["model"], nonce, lazy)
    return kernelstate.printed([{"output_type": "stream", "name": "stdout", "text": out.getvalue()}], nonce)


def test_the_kernel_says_which_lazy_modules_it_imported():
    """The extra cell lists the modules of ``recheck.LAZY`` in the kernel's ``sys.modules``, and only
    those; the line is never taken for a piece's state."""
    import torch.optim  # noqa: F401 (imported by every test process; torch._dynamo is not, unless a test did)

    present = "torch.optim"
    printed = _said(("torch.optim", "no.such.module"))
    assert kernelstate.imported(printed, ("torch.optim", "no.such.module")) == {present}
    assert kernelstate.imported(printed, ("no.such.module",)) == set(), "a module outside the list was taken"
    assert set(verdicts.parsed_states(printed)) == {"model"}
    assert kernelstate.IMPORTED not in _said(())  # (nothing to ask: no line)
    out = io.StringIO()  # the cell's own source, as the kernel runs it
    with redirect_stdout(out):
        exec(kernelstate.snippet(["model"], "n0nce", ("torch.optim",)), {"model": load_trained()[0]})
    cell = kernelstate.printed([{"output_type": "stream", "name": "stdout", "text": out.getvalue()}], "n0nce")
    assert kernelstate.imported(cell, ("torch.optim",)) == {present} and set(verdicts.parsed_states(cell)) == {"model"}


@pytest.mark.parametrize("text", [None, "{not json", '"torch._dynamo"', '{"name": ".imported"}',
                                  '{"name": ".imported", "imported": "torch._dynamo"}',
                                  '{"name": ".imported", "imported": [1, null, ["torch._dynamo"]]}'])
def test_a_malformed_word_on_imports_is_nothing(text):
    printed = {} if text is None else {kernelstate.IMPORTED: text}
    assert kernelstate.imported(printed, ("torch._dynamo",)) == set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the service is a child of the warm template")
@pytest.mark.parametrize("said", [True, False], ids=["the kernel had it", "it did not"])
def test_a_service_has_the_template_import_what_the_kernel_imported(said):
    """The capstone's kernel trains the model (an optimizer's step imports torch._dynamo, 1.1 s);
    its re-check only rebuilds it and so never imports it. The kernel's word then makes the grading
    worker's service ask the template for it at the next notebook, so that later kernels have it;
    without that word nothing is asked. Attention's notebook stands in for the capstone's (its
    re-check imports nothing of the list); the verdicts are the grading process's either way."""

    nb = nbformat.read(SOLUTIONS / "attention" / "scaled_dot_product_attention.ipynb", as_version=4)
    limits = trusted.Limits(piece=45.0, total=300.0)
    printed = {kernelstate.IMPORTED: wire.dumps({"name": kernelstate.IMPORTED,
                                                 "imported": ["torch._dynamo"] if said else []})}
    with fresh_template() as template:
        assert "torch._dynamo" not in template.preload([])
        for seed in (7, 8):
            here, there = nbformat.from_dict(nb), nbformat.from_dict(nb)
            service = verdicts.Service.begin(there, seed, None)
            service.tested()
            local = verdicts.decide(here, trusted.make_plan(here, seed), {}, set(), 60.0, limits, False, printed)
            assert service.decide(there, {}, set(), 60.0, limits, False, printed) == local
            assert not local[0], local
            service.release()
        # (the second notebook's start is where the service asks; a preload is answered in order)
        deadline = time.monotonic() + (60 if said else 3)
        while "torch._dynamo" not in template.preload([]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ("torch._dynamo" in template.preload([])) == said
