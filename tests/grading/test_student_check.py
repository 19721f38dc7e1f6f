"""The students' check command: run a saved notebook as the grader will, report per test."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from corpus.attacks import ATTACKS
from course import EXERCISES, NO_SCALING, SOLUTIONS, fill, fresh_template, solution_answers

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


def with_test_cell(path, index: int, grade_id: str, source: str, folder) -> Path:
    """A copy of notebook ``path`` (in ``folder``) with a graded test cell of one point inserted at ``index``."""
    nb = nbformat.read(path, as_version=4)
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": grade_id, "points": 1, "solution": False,
                                 "locked": True, "schema_version": 3}
    nb.cells.insert(index, cell)
    out = Path(folder) / f"{grade_id}.ipynb"
    nbformat.write(nb, out)
    return out


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
    path = with_test_cell(notebooks["correct"], 0, "started_warm",
                          'import sys\nassert "torch" in sys.modules, "a cold kernel"', tmp_path)
    proc = run_check(path)
    assert "pass  started_warm" in proc.stdout, proc.stdout
    assert "Ctrl-C" not in proc.stdout and "connect another client" not in proc.stdout, proc.stdout


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch has one thread anyway")
def test_the_kernel_computes_with_one_thread_as_the_graders_do(notebooks, tmp_path):
    """The grader's kernels compute with one thread each (its default workers are at least one a
    core); so do the check's, whatever the student's environment says, and the re-check's."""
    path = with_test_cell(notebooks["correct"], 1, "one_thread",
                          "import torch\nassert torch.get_num_threads() == 1, torch.get_num_threads()", tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-m", "firstprinciples.grading.check", str(path)],
                          capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "4"})
    assert proc.returncode == 0 and "pass  one_thread" in proc.stdout, proc.stdout + proc.stderr


def test_error_in_the_students_code_names_their_cell_and_line(notebooks):
    proc = run_check(notebooks["if_mask"])
    assert proc.returncode == 1
    out = proc.stdout
    assert "FAIL  test_masks" in out and "pass  test_worked_example" in out, out
    # The student's cell (by its name in the notebook) and line first, then the error and the hint.
    assert "raised RuntimeError in your code at cell In[" in out, out
    assert "(your `scaled_dot_product_attention` cell" in out, out
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


# ---------------------------------------------------------------- the re-check's service
# passes the kernel's visible tests; the re-check sees the forbidden built-in (from the attack corpus)
ALIAS = next(a for a in ATTACKS if a["id"] == "atk_attention_sdpa_alias")["answers"][NOTEBOOK]
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the service is a child of the warm template")


@LINUX
@pytest.mark.parametrize("answers, hung, slow", [
    ("correct", {}, []),
    ("no_scaling", {}, []),
    ("untouched", {}, []),
    ("alias", {}, []),
    ("correct", {"scaled_dot_product_attention": "test_masks"}, []),  # hung in the kernel: not run again
    ("correct", {}, ["first code cell"]),  # a cell that ran past its timeout: loaded with a short limit
])
@pytest.mark.parametrize("ahead", [False, True], ids=["after the cells", "ahead"])
def test_the_service_decides_exactly_as_the_grading_process(notebooks, answers, hung, slow, ahead):
    """The check command's trusted side (a child of the template) and the grader's (this process)
    give the same failures, notes and test-cell outputs for the same notebook and seed; also
    when the service started the re-check ahead, beside the cells, on the guess that none would
    time out (``verdicts.Ahead``: its outcomes are taken, or, where the guess was wrong, thrown
    away and the re-check run again)."""
    from firstprinciples.grading import trusted, verdicts

    path = notebooks[answers] if answers != "alias" else None
    if path is None:
        release = nbformat.read(EXERCISES / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
        nb = fill(release, {**solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb",
                                                                as_version=4)), NOTEBOOK: ALIAS})
    else:
        nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    slow = {code[0]} if slow else set()
    seed, limits = 20261202, trusted.Limits(piece=45.0, total=300.0)
    here, there = nbformat.from_dict(nb), nbformat.from_dict(nb)
    local = verdicts.decide(here, trusted.make_plan(here, seed), hung, slow, 60.0, limits, False)
    service = verdicts.Service.begin(there, seed, None, ahead=(60.0, limits, False) if ahead else None)
    try:
        assert service.tested() == verdicts.tested_pieces(there)
        remote = service.decide(there, hung, slow, 60.0, limits, False)
    finally:
        service.close()
    assert remote == local
    assert [c.get("outputs") for c in there.cells] == [c.get("outputs") for c in here.cells]
    failed = local[0]
    if answers == "correct" and not hung:
        assert not failed
    else:  # each of these fails somewhere, with the re-check's reason
        assert failed, local
        if answers == "alias":
            assert any("scaled_dot_product_attention" in r for r in failed.values()), failed
        if hung:
            assert all("did not return within 60.0 s in test_masks" in r for r in failed.values()), failed


@LINUX
def test_a_re_check_started_ahead_is_stopped_when_a_cell_times_out(notebooks):
    """A cell that never ends: the re-check started ahead would load it for the kernel's whole
    limit per cell (60 s here). The kernel's run tells the service at the first timeout
    (``abandon``), which stops that runner at once; the decision then loads the cell with the
    short limit of a cell that ran past its timeout, and is the grading process's own."""
    from firstprinciples.grading import trusted, verdicts, warm

    nb = nbformat.read(notebooks["correct"], as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.source += "\nwhile True:\n    pass\n"
    slow = {nb.cells.index(first)}
    seed, limits = 20261203, trusted.Limits(piece=45.0, total=300.0)
    here, there = nbformat.from_dict(nb), nbformat.from_dict(nb)
    local = verdicts.decide(here, trusted.make_plan(here, seed), {}, slow, 60.0, limits, False)
    template = warm.Template.get(False).proc.pid

    def runners() -> set:  # the template's live re-check runners (by the name it gives them; not zombies)
        found = set()
        for entry in Path("/proc").iterdir():
            try:
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
                if (entry.name.isdigit() and (entry / "comm").read_text().strip() == "fp-recheck"
                        and int(ppid) == template and state != "Z"):
                    found.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
        return found - earlier

    def wait_until(condition, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        return condition()

    earlier: set = set()
    earlier = runners()  # (another test's, still ending)
    service = verdicts.Service.begin(there, seed, None, ahead=(60.0, limits, False))
    try:
        service.tested()
        assert wait_until(lambda: bool(runners()), 30), "no re-check was started ahead"
        service.abandon()
        assert wait_until(lambda: not runners(), 10), "the re-check started ahead went on after abandon"
        started = time.monotonic()
        remote = service.decide(there, {}, slow, 60.0, limits, False)
        took = time.monotonic() - started
    finally:
        service.close()
    assert remote == local
    assert [c.get("outputs") for c in there.cells] == [c.get("outputs") for c in here.cells]
    assert took < 40, f"the decision took {took:.0f} s: a cell past its timeout was loaded with the full limit"


@LINUX
def test_one_service_decides_notebook_after_notebook_as_the_grading_process(notebooks):
    """A grading worker keeps its service for its whole shard: given a correct, a wrong and an
    untouched notebook in turn (each with its own seed), it decides each as the grading process
    does; one left in the middle of a notebook (no decision asked) is replaced, and the next
    notebook's verdict is still right."""
    from firstprinciples.grading import trusted, verdicts

    limits = trusted.Limits(piece=45.0, total=300.0)
    pids = []
    try:
        for seed, answers in enumerate(["correct", "no_scaling", "untouched", "correct"], start=7):
            nb = nbformat.read(notebooks[answers], as_version=4)
            here, there = nbformat.from_dict(nb), nbformat.from_dict(nb)
            local = verdicts.decide(here, trusted.make_plan(here, seed), {}, set(), 60.0, limits, False)
            service = verdicts.Service.begin(there, seed, None)
            pids.append(service.proc.pid)
            assert service.decide(there, {}, set(), 60.0, limits, False) == local, answers
            assert [c.get("outputs") for c in there.cells] == [c.get("outputs") for c in here.cells]
            service.release()
            assert bool(local[0]) == (answers != "correct")
        assert len(set(pids)) == 1, "the service was not kept from one notebook to the next"
        abandoned = verdicts.Service.begin(nbformat.read(notebooks["correct"], as_version=4), 1, None)
        abandoned.release()  # (its notebook ended without a decision: it is stopped)
        assert not abandoned.alive()
        nb = nbformat.read(notebooks["no_scaling"], as_version=4)
        here, there = nbformat.from_dict(nb), nbformat.from_dict(nb)
        fresh = verdicts.Service.begin(there, 3, None)
        assert fresh is not abandoned
        assert fresh.decide(there, {}, set(), 60.0, limits, False) == verdicts.decide(
            here, trusted.make_plan(here, 3), {}, set(), 60.0, limits, False)
    finally:
        for service in list(verdicts.Service._current.values()):
            service.close()


@LINUX
def test_a_service_has_the_template_import_what_its_re_checks_needed():
    """A re-check whose runner imported torch._dynamo (0.9-1.3 s: here the answer's own cell imports
    it, as the capstone's optimizer does at its first step) says so. A grading worker's service
    whose re-check imported it asks the template for it when its next notebook comes, so that the
    children forked after have it; after its one notebook (the check command's) it never asks.
    Either way the verdicts are the grading process's own."""
    from firstprinciples.grading import trusted, verdicts

    nb = nbformat.read(SOLUTIONS / "softmax" / "softmax.ipynb", as_version=4)
    answer = next(c for c in nb.cells if "def softmax" in c.source)
    answer.source = "import torch._dynamo\n" + answer.source
    limits = trusted.Limits(piece=45.0, total=300.0)
    with fresh_template() as template:
        for seed in (7, 8):
            here, there = nbformat.from_dict(nb), nbformat.from_dict(nb)
            service = verdicts.Service.begin(there, seed, None)
            service.tested()
            if seed == 7:
                assert "torch._dynamo" not in template.preload([])
            else:  # (asked by the service once it has answered which pieces are tested)
                deadline = time.monotonic() + 60
                while "torch._dynamo" not in template.preload([]) and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert "torch._dynamo" in template.preload([]), "the service did not ask for it"
            local = verdicts.decide(here, trusted.make_plan(here, seed), {}, set(), 60.0, limits, False)
            assert service.decide(there, {}, set(), 60.0, limits, False) == local
            assert not local[0], local
            service.release()
            if seed == 7:  # one notebook done: nothing asked
                assert "torch._dynamo" not in template.preload([])


@LINUX
def test_the_check_process_never_imports_torch(notebooks):
    """Its kernel, runner and trusted side are children of the template: the check's own
    process imports neither torch nor what its first backward pass imports (the 1.4 s it
    would add to every check), and still gives the re-check's verdict."""
    script = ("import sys\nfrom firstprinciples.grading import check\n"
              f"code = check.main([{str(notebooks['no_scaling'])!r}])\n"
              "print('imported:', sorted(m for m in ('torch', 'sympy') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "imported: []" in proc.stdout, proc.stdout + proc.stderr
    assert "no scaling" in proc.stdout and "FAIL" in proc.stdout, proc.stdout


@LINUX
def test_the_check_never_imports_ipython_in_two_threads_at_once(notebooks):
    """The check imports IPython in a thread while it waits for the template, and starting the
    kernel imports it too: the kernel starts only once that thread is done. (Two threads that
    import IPython at once can see each other's half-initialised modules: a check failed so,
    "The check could not run ...: KeyError: 'IPython'", in four of six runs one afternoon.)
    Here the thread's import is made slow, and the kernel's start must come after it."""
    code = ("import os, sys, time\n"
            "from firstprinciples.grading import check, execute\n"
            "done = []\n"
            "def slow(name):\n"
            "    time.sleep(2); __import__(name); done.append(name)\n"
            "check._import_quietly = slow\n"
            "preprocess = execute.RobustExecute.preprocess\n"
            "def started(self, *a, **k):\n"
            "    print('IPython imported before the kernel started:', done == ['IPython'], flush=True)\n"
            "    return preprocess(self, *a, **k)\n"
            "execute.RobustExecute.preprocess = started\n"
            "status = check.main([sys.argv[1]])\n"
            "sys.stdout.flush(); os._exit(status)")
    proc = subprocess.run([sys.executable, "-c", code, str(notebooks["correct"])],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Visible score: 10/10" in proc.stdout, proc.stdout + proc.stderr
    assert "IPython imported before the kernel started: True" in proc.stdout, proc.stdout


def test_a_service_that_dies_leaves_the_verdict_to_the_check_itself(notebooks):
    """The service is killed before the decision: the check decides in its own process (with a
    line saying so) and the verdict is the same, with the re-check's reason."""
    script = ("import sys\nfrom firstprinciples.grading import check, verdicts\n"
              "decide = verdicts.Service.decide\n"
              "def dying(self, *a, **k):\n    self.proc.kill()\n    self.proc.wait()\n    return decide(self, *a, **k)\n"
              "verdicts.Service.decide = dying\n"
              f"sys.exit(check.main([{str(notebooks['no_scaling'])!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no scaling" in proc.stdout and "pass  test_batched_shapes" in proc.stdout, proc.stdout
    assert "starting cold instead (the re-check's service" in proc.stderr, proc.stderr


def test_a_service_that_does_not_answer_is_given_up():
    """A service that stays silent costs the check a bounded wait, then a ServiceError (the
    check then decides in its own process), not a hang."""
    import os
    import time

    from firstprinciples.grading import verdicts

    read, write = os.pipe()
    service = verdicts.Service.__new__(verdicts.Service)
    service._from = os.fdopen(read, "r")
    try:
        start = time.monotonic()
        with pytest.raises(verdicts.ServiceError, match="did not answer within 0.2 s"):
            service._receive("tested", wait=0.2)
        assert time.monotonic() - start < 5
        os.write(write, b'{"tested": {}}\n')  # an answer that comes is taken
        assert service._receive("tested", wait=5) == {"tested": {}}
    finally:
        service._from.close()
        os.close(write)


def test_a_syntax_error_and_a_failing_added_cell_are_shown_where_they_are(notebooks, tmp_path):
    """An unbalanced parenthesis in the answer cell: named with its cell and line (it gave five
    NameErrors and no line); a cell the student added that raises: reported, not hidden."""
    nb = nbformat.read(notebooks["correct"], as_version=4)
    answer = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == NOTEBOOK)
    answer.source = answer.source.replace("math.sqrt(", "math.sqrt((", 1)
    nb.cells.append(nbformat.v4.new_code_cell("mine = [1, 2, 3]\nmine[7]\n"))
    path = tmp_path / "syntax.ipynb"
    nbformat.write(nb, path)
    out = run_check(path).stdout
    assert re.search(rf"SyntaxError in your `{NOTEBOOK}` cell \(code cell \d+\), line \d+: ", out), out
    assert re.search(r"code cell \d+ \(it starts `mine = \[1, 2, 3\]`\) raised IndexError: list index out of range", out), out


# ---------------------------------------------------------------- the progress view
def test_progress_lists_every_notebook_with_its_visible_score(notebooks, tmp_path):
    """A folder laid out as exercises/: a solved copy, one with a mistake, an untouched one and an
    unreadable one, run one after another; each is a row, the unreadable one says why, and the
    scores are those the check command gives the same notebooks (10/10, 0/10 in the tests above)."""
    import shutil

    folder = tmp_path / "mine"
    for case in ("correct", "no_scaling", "untouched", "broken"):
        (folder / case).mkdir(parents=True)
        shutil.copy(notebooks[case], folder / case / f"{NOTEBOOK}.ipynb")
    proc = subprocess.run([sys.executable, "-m", "firstprinciples.grading.progress", str(folder)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and not proc.stderr.strip(), proc.stdout + proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ") and "/" in line.split()[0]
            and not line.split()[0].endswith(":")}
    name = f"{NOTEBOOK}.ipynb"
    assert set(rows) == {f"{case}/{name}" for case in ("correct", "no_scaling", "untouched", "broken")}, proc.stdout
    assert re.search(r"10/10 +30 min +none$", rows[f"correct/{name}"]), proc.stdout
    assert re.search(r" [1-9]/10 +30 min +test_worked_example", rows[f"no_scaling/{name}"]), proc.stdout
    assert re.search(r" 0/10 +30 min +all$", rows[f"untouched/{name}"]), proc.stdout
    assert "not a readable notebook" in rows[f"broken/{name}"], proc.stdout
    total = re.search(r"Total: (\d+)/30 visible points; 1 of 4 notebooks pass every visible test; 1 could not be run; "
                      r"rough time of all: 90 minutes\.", proc.stdout)
    assert total and 10 < int(total.group(1)) < 20, proc.stdout


def test_a_notebook_that_cannot_be_run_is_a_row(notebooks, monkeypatch):
    from firstprinciples.grading import check, progress

    def no_kernel(*args, **kwargs):
        raise RuntimeError("Kernel died before replying to kernel_info")

    monkeypatch.setattr(check, "execute", no_kernel)
    row = progress.progress(notebooks["correct"], "correct.ipynb")
    assert row.problem == "could not be run: RuntimeError: Kernel died before replying to kernel_info", row
    table = progress.table([row])
    assert "could not be run" in table and "Total: 0/0 visible points; 0 of 1 notebooks" in table, table
