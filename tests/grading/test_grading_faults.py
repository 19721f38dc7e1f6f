"""Faults in a submission cost only the faulty item, and nothing outlives grading.

A grading round with the plain `nbgrader autograde` and the repo's config on
the two-piece `qkv` assignment (6 points for `project_qkv`, 6 for
`dot_product_scores`). Each student breaks `project_qkv` in one nasty way and
answers `dot_product_scores` correctly, so the expected grade is 6/12: the
fault costs the piece it is in, the rest of the notebook is still graded, and
the batch goes on. The cell timeout is lowered to keep the test short.
"""
import csv
import re
import socket
import subprocess

import nbformat
import pytest

from course import SOLUTIONS, answer_cells, fill, make_course, nbgrader, nbgrader_meta, scratch, solution_answers

ASSIGNMENT, NOTEBOOK = "qkv", "queries_keys_values"
TIMEOUT = 10  # seconds per cell in this test (the course uses 60; a cell of qkv takes well under 1 s)
BUDGET = 200  # seconds of cells per notebook in this test (the course uses 300)

# Appended to the correct project_qkv: runs when the answer cell runs.
AT_DEFINITION = {
    "exits": "import os\nos._exit(3)",
    # (a kill by SIGSEGV is the crash that ctypes would cause, seen from the grader)
    "segfaults": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
    "ignores_interrupts": "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
}
# Put at the top of project_qkv's body: runs every time a test calls it.
IN_BODY = {
    "memory_bomb": "hog = bytearray(8 * 2**30)",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "system_exit": "raise SystemExit('bye')",
    # kills its kernel on every call (as a piece that fills the memory does, only faster): the
    # first course cell that calls it dies, every later test of it fails at once, saying why
    "dies_every_call": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    # hangs on every call, deaf to interrupts: the notebook's time budget and the re-check's
    # per-piece limit bound what it costs, and the other piece is still graded
    "hangs_every_call": "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
    # hangs on every call, interruptible: the first course cell that calls it waits its
    # timeout, every later test of it fails at once, and the re-check does not run it again
    "hangs_in_body": "while True:\n    pass",
}
# A correct def, then an interruptible endless loop in the same answer cell: the cell is
# interrupted, what it defined is graded (full marks), with a note.
LOOPS_AFTER_DEF = "while True:\n    pass"
HUGE_OUTPUT = "print('x' * 60_000_000)"  # 60 MB on one line

SNOOP = """
import os, socket, sys
os.write(1, b"FP-KERNEL-STDOUT" * 1000 + b"\\n")  # past IPython, into the kernel's own streams
os.write(2, b"FP-KERNEL-STDERR" * 1000 + b"\\n")
print("FP-KERNEL-ORIGINAL", file=sys.__stdout__, flush=True)
_escaped = [p for p in {paths!r} if os.path.exists(p)]
try:
    open({pwned!r}, "w").write("x")
    _escaped.append("write")
except OSError:
    pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).sendall(b"hello")
    _escaped.append("network")
except OSError:
    pass
print("escaped:", _escaped)
"""


def _in_body(source, snippet):
    lines = source.splitlines()
    i = next(i for i, line in enumerate(lines) if line.strip().startswith('"""') and i > 0)
    j = next(k for k in range(i + 1, len(lines)) if lines[k].strip().endswith('"""')) if not lines[i].strip().endswith('"""') or lines[i].strip() == '"""' else i
    body = "\n".join("    " + line for line in snippet.splitlines())
    return "\n".join(lines[: j + 1] + [body] + lines[j + 1:])


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("faults"))
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    release = nbformat.read(course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    correct = solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4))
    students = {"correct": correct}
    for name, snippet in AT_DEFINITION.items():
        students[name] = {**correct, "project_qkv": correct["project_qkv"] + "\n\n" + snippet + "\n"}
    for name, snippet in IN_BODY.items():
        students[name] = {**correct, "project_qkv": _in_body(correct["project_qkv"], snippet)}
    students["huge_output"] = {**correct, "project_qkv": correct["project_qkv"] + "\n\n" + HUGE_OUTPUT + "\n"}
    students["loops_after_def"] = {**correct, "project_qkv": correct["project_qkv"] + "\n\n" + LOOPS_AFTER_DEF + "\n"}
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.1)
    snoop = SNOOP.format(
        paths=[str(course / "solutions"), str(course / "gradebook.db"), str(course / "submitted"), str(course / "nbgrader_config.py")],
        pwned=str(course / "pwned.txt"), port=server.getsockname()[1],
    )
    students["snoops"] = correct
    for student, answers in students.items():
        target = course / "submitted" / student / ASSIGNMENT
        target.mkdir(parents=True)
        nb = fill(release, answers)
        if student == "snoops":  # in a cell of its own, which no graded piece uses
            nb.cells.append(nbformat.v4.new_code_cell(snoop))
        nbformat.write(nb, target / f"{NOTEBOOK}.ipynb")
    proc = nbgrader(course, "autograde", ASSIGNMENT, f"--Execute.timeout={TIMEOUT}",
                    "--RobustExecute.probe_timeout=5", f"--RobustExecute.notebook_timeout={BUDGET}",
                    "--RobustExecute.recheck_piece_timeout=10", timeout=1800)
    after = _sandbox_processes(scratch(course))
    calls = []
    try:
        while True:
            calls.append(server.accept())
    except OSError:
        pass
    server.close()
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        table = list(csv.DictReader(f))
    rows = {r["student_id"]: float(r["score"]) for r in table}
    notes = {r["student_id"]: r.get("notes", "") for r in table}
    return course, rows, proc, after, calls, notes


def _sandbox_processes(folder):
    """Live processes of this course's sandboxes (their command lines name its
    scratch folder; other tests may be grading at the same time). Zombies
    (state Z: dead, waiting for this machine's init to collect them) hold
    nothing and are not counted."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return sorted(
        line for line in out.splitlines()[1:]
        if str(folder) in line and not line.split()[1].startswith("Z")
    )


def test_correct_answer_gets_full_marks(graded):
    assert graded[1]["correct"] == 12


@pytest.mark.parametrize("student", sorted([*AT_DEFINITION, *IN_BODY]))
def test_fault_costs_only_its_piece(graded, student):
    assert graded[1][student] == 6, f"{student}: {graded[1][student]}/12"


def test_huge_output_is_cut_and_costs_nothing(graded):
    course, rows = graded[0], graded[1]
    assert rows["huge_output"] == 12
    nb = nbformat.read(course / "autograded" / "huge_output" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    cell = next(c for c in answer_cells(nb) if nbgrader_meta(c)["grade_id"] == "project_qkv")
    text = "".join(str(o.get("text", "")) for o in cell.outputs)
    assert "output cut" in text and len(text) < 300_000


@pytest.mark.parametrize("student, reason", [
    ("exits", "kernel died"), ("segfaults", "kernel died"), ("ignores_interrupts", "did not stop when interrupted"),
])
def test_feedback_says_what_happened(graded, student, reason):
    course = graded[0]
    nb = nbformat.read(course / "autograded" / student / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    cell = next(c for c in answer_cells(nb) if nbgrader_meta(c)["grade_id"] == "project_qkv")
    errors = [o for o in cell.outputs if o.get("output_type") == "error"]
    assert errors and errors[-1]["ename"] == "GradingFault" and reason in errors[-1]["evalue"], cell.outputs


def test_a_notebook_that_hangs_everywhere_costs_at_most_its_budget(graded):
    course = graded[0]
    nb = nbformat.read(course / "autograded" / "hangs_every_call" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    test_cells = [c for c in nb.cells if nbgrader_meta(c).get("grade")]
    # each test of the hanging piece either waited for its timeout or, once the piece was
    # seen hanging (here already in the locked "try it" cell), failed at once saying so
    timed_out = [c for c in test_cells if any("did not finish" in str(o.get("evalue", "")) or
                                              "fails at once" in str(o.get("evalue", "")) for o in c.outputs)]
    assert timed_out, "no test cell says that the piece hung"
    assert graded[1]["correct"] == 12 and graded[1]["hangs_every_call"] == 6


def test_no_process_outlives_grading(graded):
    after = graded[3]
    assert after == [], f"left running: {after}"


def test_sandbox_hides_the_course_the_network_and_the_disk(graded):
    """The "snoops" student, in a cell of its own, looks for the course's files, writes
    beside them and calls a server on the host's loopback, and prints what worked."""
    course, rows = graded[0], graded[1]
    assert rows["snoops"] == 12  # the cell is used by no graded piece: its imports cost nothing
    nb = nbformat.read(course / "autograded" / "snoops" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    text = "".join(str(o.get("text", "")) for o in nb.cells[-1].outputs)
    assert "escaped: []" in text, f"the submission reached something it should not have: {text!r}"
    # what it wrote to the kernel's own streams reaches its notebook (not the grading log)
    for marker in ("FP-KERNEL-STDOUT", "FP-KERNEL-STDERR", "FP-KERNEL-ORIGINAL"):
        assert marker in text, f"{marker} is missing from the notebook: {text[-300:]!r}"
    assert not (course / "pwned.txt").exists()
    assert graded[4] == [], "the sandboxed kernel reached a server on the host"


def test_a_piece_that_hangs_fails_its_later_tests_at_once(graded):
    """One wait for the piece, not one per test: the first course cell that calls project_qkv
    times out, each later test of it fails at once and says why, the notes name both."""
    course, rows, notes = graded[0], graded[1], graded[5]
    assert rows["hangs_in_body"] == 6
    nb = nbformat.read(course / "autograded" / "hangs_in_body" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    waited = [nbgrader_meta(c).get("grade_id") for c in nb.cells
              if any(o.get("ename") == "CellTimeoutError" for o in c.get("outputs", []))]
    at_once = [nbgrader_meta(c).get("grade_id") for c in nb.cells
               if any("fails at once" in str(o.get("evalue", "")) for o in c.get("outputs", []))]
    assert len(waited) == 1, f"cells that waited for their timeout: {waited}"
    assert at_once, "no later test failed at once"
    assert f"timed out: project_qkv did not return within {TIMEOUT} s" in notes["hangs_in_body"], notes["hangs_in_body"]
    assert "failed at once" in notes["hangs_in_body"]
    recheck = [str(o.get("evalue", "")) for c in nb.cells for o in c.get("outputs", [])
               if o.get("ename") == "TrustedCheckFailed"]
    assert recheck and all("not run again" in r for r in recheck if "project_qkv" in r), recheck


def test_an_answer_cell_that_loops_after_its_def_keeps_the_def_with_a_note(graded):
    rows, notes = graded[1], graded[5]
    assert rows["loops_after_def"] == 12
    assert f"project_qkv did not finish within {TIMEOUT} s and was interrupted" in notes["loops_after_def"]


def test_the_log_is_one_line_per_student_and_a_summary(graded):
    """The default log: per submission one line with progress, score, time and notes; a
    summary; no kernel banners, no false checksum warnings, no per-step lines."""
    proc, rows = graded[2], graded[1]
    log = proc.stderr
    total = len(rows)
    for student, score in rows.items():
        line = next((x for x in log.splitlines() if re.search(rf"\[ ?\d+/{total}\] {student}  {ASSIGNMENT}  ", x)), None)
        assert line is not None, f"no result line for {student}:\n{log[-3000:]}"
        assert f"  {score:g}/12  " in line, line
    done = sorted(int(n) for n in re.findall(rf"\[ ?(\d+)/{total}\]", log))
    assert done == list(range(1, total + 1)), done
    assert "Summary:" in log and re.search(r"timed out\s+\d+\s+.*hangs_in_body", log), log[-2000:]
    for noise in ("--existing", "Ctrl-C will not work", "Attribute 'checksum'", "Converting notebook", "Writing ",
                  "FP-KERNEL-STD"):  # (what a student's process writes to its own streams, bypassing IPython)
        assert noise not in log and noise not in proc.stdout, f"{noise!r} in the log"
    assert len(log.splitlines()) <= total + 40, f"{len(log.splitlines())} lines for {total} students"


@pytest.mark.parametrize("student, note", [
    ("exits", "the kernel died"), ("segfaults", "the kernel died"),
    ("ignores_interrupts", "did not stop when interrupted; grading went on in a fresh kernel without it"),
])
def test_grades_csv_notes_say_what_happened(graded, student, note):
    assert note in graded[5][student], graded[5][student]


def test_a_piece_that_kills_its_kernel_is_named_and_not_run_again(graded):
    course = graded[0]
    nb = nbformat.read(course / "autograded" / "dies_every_call" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    test_cells = [c for c in nb.cells if nbgrader_meta(c).get("grade") and "project" in nbgrader_meta(c)["grade_id"]]
    at_once = [c for c in test_cells if any("killed the kernel" in str(o.get("evalue", "")) and "fails at once"
                                            in str(o.get("evalue", "")) for o in c.outputs)]
    assert at_once, [o.get("evalue") for c in test_cells for o in c.outputs]
    notes = graded[5]["dies_every_call"]
    assert notes.count("the kernel died") == 1 and "in project_qkv" in notes, notes
    assert graded[1]["dies_every_call"] == 6


# ---------------------------------------------------------------- a piece that hangs inside another one
# multi_head_attention: MultiHeadAttention's forward calls merge_heads. A merge_heads that never returns
# waits for the cell timeout once, in its own test; the first course cell that calls MultiHeadAttention
# ("try it") then runs with the shorter dependent_timeout, times out there, and every later test of
# MultiHeadAttention fails at once: two waits, not one per cell (issue 43: 193 s for one student).
MHA, MHA_NB = "multi_head_attention", "multi_head_attention"
MHA_TIMEOUT, DEPENDENT = 20, 8
MERGE_HANGS = '''def merge_heads(x):
    """(B, n_heads, T, d_k) -> (B, T, n_heads * d_k)."""
    while True:
        pass
'''
# names merge_heads (kept as an attribute) but merges on its own: it never calls the hanging piece, so
# it runs within the shorter limit and keeps every point (what the code does decides, not its names)
OWN_MERGE = ("\n    merge = staticmethod(merge_heads)  # (kept, never called)\n",
             "self.W_o(merge_heads(out))", "self.W_o(out.transpose(1, 2).flatten(2))")
MHA_CELLS = ("test_mha_structure", "test_mha_against_reference", "test_mha_masks", "test_mha_gradients_and_inputs")


@pytest.fixture(scope="module")
def merge_hangs(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("merge-hangs"))
    nbgrader(course, "generate_assignment", MHA, "--force")
    release = nbformat.read(course / "exercises" / MHA / f"{MHA_NB}.ipynb", as_version=4)
    correct = solution_answers(nbformat.read(SOLUTIONS / MHA / f"{MHA_NB}.ipynb", as_version=4))
    extra, old, new = OWN_MERGE
    own = correct["MultiHeadAttention"].replace(old, new)
    own = own.replace('    """\n\n    def __init__', '    """\n' + extra + '\n    def __init__', 1)
    assert own.count("staticmethod(merge_heads)") == 1 and new in own
    for student, answers in {"calls_it": {**correct, "merge_heads": MERGE_HANGS},
                             "merges_on_its_own": {**correct, "merge_heads": MERGE_HANGS, "MultiHeadAttention": own}
                             }.items():
        target = course / "submitted" / student / MHA
        target.mkdir(parents=True)
        nbformat.write(fill(release, answers), target / f"{MHA_NB}.ipynb")
    nbgrader(course, "autograde", MHA, f"--Execute.timeout={MHA_TIMEOUT}", "--RobustExecute.probe_timeout=5",
             f"--RobustExecute.dependent_timeout={DEPENDENT}", "--RobustExecute.recheck_piece_timeout=10", timeout=1800)
    nbgrader(course, "export")
    with open(course / "grades.csv", newline="") as f:
        table = list(csv.DictReader(f))
    notebooks = {s: nbformat.read(course / "autograded" / s / MHA / f"{MHA_NB}.ipynb", as_version=4)
                 for s in ("calls_it", "merges_on_its_own")}
    return ({r["student_id"]: float(r["score"]) for r in table}, {r["student_id"]: r.get("notes", "") for r in table},
            notebooks)


def _waited(nb) -> list:
    return [nbgrader_meta(c).get("grade_id") for c in nb.cells
            if any(o.get("ename") == "CellTimeoutError" for o in c.get("outputs", []))]


def test_a_piece_that_hangs_inside_another_costs_two_waits(merge_hangs):
    rows, notes, nbs = merge_hangs
    nb = nbs["calls_it"]
    assert _waited(nb) == ["test_merge_heads", "try_mha"], _waited(nb)
    for cell in nb.cells:
        if nbgrader_meta(cell).get("grade_id") in MHA_CELLS:
            text = " ".join(str(o.get("evalue", "")) for o in cell.outputs)
            assert f"MultiHeadAttention did not return within {DEPENDENT} s in try_mha" in text, text
            assert "fails at once" in text, text
    assert rows["calls_it"] == 3  # the attention recap and split_heads
    assert f"merge_heads did not return within {MHA_TIMEOUT} s" in notes["calls_it"], notes["calls_it"]
    assert f"within {DEPENDENT} s (a shorter limit: it calls merge_heads, which had hung)" in notes["calls_it"], notes


def test_a_piece_that_names_a_hung_one_without_calling_it_keeps_its_points(merge_hangs):
    rows, notes, nbs = merge_hangs
    assert _waited(nbs["merges_on_its_own"]) == ["test_merge_heads"]
    assert rows["merges_on_its_own"] == 11, notes["merges_on_its_own"]  # all but merge_heads's 2
