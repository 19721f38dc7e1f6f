"""Benchmark: grading a class, the course's `nbgrader autograde` against stock nbgrader.

Builds a temporary course (the repo's nbgrader_config.py and solutions/),
releases every assignment and simulates a class: per assignment, ``--students``
submissions (default 30), a third each correct, partly wrong and untouched.
Then, in the same run, it measures

- the floor: a bare Jupyter kernel start plus ``import torch``, the least any
  grader pays per notebook: the median of 3 at the start and one before each
  assignment's grading (the machine's speed drifts within the run);
- serial STOCK nbgrader: the same submissions in a second course folder whose
  nbgrader_config.py only names the source and release folders (nbgrader's own
  preprocessors, no sandbox, no parallel workers);
- the course's config: sandboxed kernels, RobustExecute, broken-submission
  repairs, parallel workers (``--workers``; default: the config's,
  ``parallel.default_workers()``), cold kernels and warm ones;

running, assignment by assignment, stock first and then the course's config
cold (``FP_GRADING_COLD=1``) and warm (so that a change in the machine's load
hits all three alike), and prints seconds per notebook for each, the floor, the
speedup over stock and whether warm grading meets the course's target (at most
0.35 x the floor per notebook on two cores). It checks that warm and cold gave
the same scores, notes and outputs, and that stock gave the same scores; then
it times the students' check command on solved notebooks (the first assignment's
and attention's), five runs cold and
five warm, each beside a floor measured just before it (target: under 1.5 x the
floor) and, unless ``--no-hang``, a multi_head_attention class graded again with three
students whose merge_heads hangs (it never returns, it fills the memory, it kills its kernel):
the target is at most one cell timeout more per hanging student, and the notes must name the piece.

Run from the repository root:
    python tests/benchmarks/grading.py                          # the full class: 30 students, every assignment
    python tests/benchmarks/grading.py --students 8 --assignments softmax,causal_mask   # a quick run
    python tests/benchmarks/grading.py --hang-only              # only the class with three hanging students
It works in a temporary folder; the repository is untouched.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from course import (NO_SCALING, SOLUTIONS, answer_cells, assignments, fill, make_course, nbgrader, nbgrader_meta,
                    solution_answers)

sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
from book_build import floor_seconds  # noqa: E402 (the same floor as the book build's benchmark)

WARM_TARGET = 0.35  # x floor per notebook, on two cores
TRAINS = "capstone"  # the assignment whose notebook trains a model: its grading cost is that training
CHECK_TARGET = 1.5  # x floor, the check command on a solved notebook
# The check command is timed on the first assignment's solved notebook and on these, when chosen:
# attention's cells take a gradient check (the first imports sympy: 0.45 s), alibi's take none.
ALSO_CHECKED = ("attention",)
STOCK_CONFIG = '''c = get_config()  # noqa: F821
# Stock nbgrader: only where the course's notebooks are.
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
'''
# A plausible mistake in each single-answer assignment (partial marks).
MISTAKES = {
    "attention": {"scaled_dot_product_attention": NO_SCALING},
    "softmax": {"softmax": "def softmax(x, dim=-1):\n    e = torch.exp(x)\n    return e / e.sum(dim=dim, keepdim=True)\n"},
}
EDITS = {  # (answer cell, text, replaced by)
    "causal_mask": ("causal_mask", 'float("-inf")', "-1e9"),
    "rnn": ("rnn_forward", "torch.tanh(", "torch.sigmoid("),
}


def partly_wrong(assignment: str, correct: dict, released) -> dict:
    if assignment in MISTAKES:
        return {**correct, **MISTAKES[assignment]}
    if assignment in EDITS:
        cell, old, new = EDITS[assignment]
        return {**correct, cell: correct[cell].replace(old, new)}
    ids = [nbgrader_meta(c)["grade_id"] for c in answer_cells(released)]
    return {k: v for k, v in correct.items() if k != ids[-1]}  # the last piece left as released


def run(course: Path, *args: str, env: dict | None = None) -> float:
    """Run a plain nbgrader command in ``course`` (it must succeed); return its wall-clock seconds."""
    t0 = time.perf_counter()
    nbgrader(course, *args, env=env, timeout=None)
    return time.perf_counter() - t0


def export(course: Path) -> dict:
    """(assignment, student) -> (score, notes), from nbgrader's own export."""
    run(course, "export")
    with open(course / "grades.csv", newline="") as f:
        return {(r["assignment"], r["student_id"]): (float(r["score"]), r.get("notes", "")) for r in csv.DictReader(f)}


# what the capstone's training cell and kv_cache's "try it" cell print of their own wall time
WALL_TIME = re.compile(r"(trained in|generate:) \d+(?:\.\d+)? s")


def graded_outputs(course: Path, assignment: str) -> dict:
    """(student, notebook, cell id) -> what the student sees of each cell: its outputs' text,
    without execution counts or timings (the feedback is generated from exactly this).

    Consecutive outputs of one stream are joined, as nbconvert's ``coalesce_streams`` joins
    them and as the feedback shows them: how a kernel splits what a cell prints into
    messages depends on timing (ipykernel sends what was printed every 0.2 s), not on the
    cell (a cell that prints for seconds, the capstone's training, comes in one or more
    pieces from run to run). The wall times that cells print of themselves are left out too
    (the capstone's training, "trained in 7.8 s"; kv_cache's "generate: 0.03 s for 120
    vectors"): they differ by nature."""
    out = {}
    for path in sorted((course / "autograded").glob(f"*/{assignment}/*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            key = (path.parts[-3], path.stem, cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", i))
            seen = []
            for o in cell.get("outputs", []):
                o = {k: v for k, v in o.items() if k not in ("execution_count", "metadata")}
                if (o.get("output_type") == "stream" and seen and seen[-1].get("output_type") == "stream"
                        and seen[-1].get("name") == o.get("name")):
                    seen[-1] = {**seen[-1], "text": seen[-1].get("text", "") + o.get("text", "")}
                else:
                    seen.append(o)
            out[key] = [{**o, "text": WALL_TIME.sub(r"\1 (seconds)", o.get("text", ""))}
                        if o.get("output_type") == "stream" else o for o in seen]
    return out


def check_seconds(notebook: Path, env: dict) -> float:
    """Wall time of one run of the students' check command on ``notebook`` (it must pass)."""
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "firstprinciples.grading.check", str(notebook)],
                          capture_output=True, text=True, env={**os.environ, **env})
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"the check command failed on a solved notebook:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return elapsed


def check_against_floor(notebook: Path, runs: int = 5) -> dict:
    """The check command, cold and warm, each run beside a floor measured just before it (this
    machine's speed drifts by a fifth within minutes, so a ratio is taken from measurements a few
    seconds apart): per kind, the median wall time and the median of the runs' ratios."""
    got = {"floor": [], "cold": [], "warm": [], "cold x": [], "warm x": []}
    for _ in range(runs):
        for kind, env in (("cold", {"FP_GRADING_COLD": "1"}), ("warm", {})):
            floor = floor_seconds(1)
            t = check_seconds(notebook, env)
            got["floor"].append(floor)
            got[kind].append(t)
            got[f"{kind} x"].append(t / floor)
    return {k: statistics.median(v) for k, v in got.items()} | {"runs": runs, "warm all": got["warm"]}


HANG_ASSIGNMENT, HANG_PIECE = "multi_head_attention", "merge_heads"
# Three ways a piece can hang, each at the top of merge_heads's body (every call): it never returns
# (interrupted at the cell timeout), it fills the memory until the kernel's limit kills it, it kills
# its kernel. The later MultiHeadAttention cells call merge_heads: they must fail at once, not wait.
HANGS = {
    "never_returns": "while True:\n    pass",
    "exhausts_memory": "hog = []\nwhile True:\n    hog.append(torch.ones(2**25))",
    "kills_its_kernel": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
}


def _hanging(source: str, snippet: str) -> str:
    """``source`` with ``snippet`` put at the top of merge_heads's body (after its one-line docstring)."""
    lines = source.splitlines()
    d = next(i for i, line in enumerate(lines) if line.startswith("def merge_heads")) + 1
    assert lines[d].strip().startswith('"""') and lines[d].count('"""') == 2, lines[d]  # the docstring
    return "\n".join(lines[: d + 1] + ["    " + line for line in snippet.splitlines()] + lines[d + 1:]) + "\n"


def hang_cost(tmp: Path, students: int, env: dict) -> dict:
    """A multi_head_attention class of ``students`` (a third each correct, partly wrong, untouched)
    graded twice: as it is, then with three correct students replaced by three whose merge_heads
    hangs, each in one way of ``HANGS``. Returns both wall times, the cell timeout and what
    grades.csv's notes say of each hanging student."""
    (tmp / "hang").mkdir()
    course = make_course(tmp / "hang")
    run(course, "generate_assignment", HANG_ASSIGNMENT, "--force")
    (release,) = sorted((course / "exercises" / HANG_ASSIGNMENT).glob("*.ipynb"))
    released = nbformat.read(release, as_version=4)
    correct = solution_answers(nbformat.read(SOLUTIONS / HANG_ASSIGNMENT / release.name, as_version=4))
    kinds = [correct, partly_wrong(HANG_ASSIGNMENT, correct, released), None]

    def submit(i, nb):
        target = course / "submitted" / f"student{i:03d}" / HANG_ASSIGNMENT
        target.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target / release.name)

    for i in range(students):
        submit(i, released if kinds[i % 3] is None else fill(released, kinds[i % 3]))
    without = run(course, "autograde", HANG_ASSIGNMENT, env=env)
    hanging = {}
    for n, (kind, snippet) in enumerate(HANGS.items()):  # students 0, 3, 6: correct ones
        submit(3 * n, fill(released, {**correct, HANG_PIECE: _hanging(correct[HANG_PIECE], snippet)}))
        hanging[f"student{3 * n:03d}"] = kind
    with_hang = run(course, "autograde", HANG_ASSIGNMENT, "--force", env=env)
    graded = export(course)
    notes = {kind: graded[(HANG_ASSIGNMENT, student)] for student, kind in hanging.items()}
    timeout = int(re.search(r"^c\.Execute\.timeout = (\d+)", (course / "nbgrader_config.py").read_text(), re.M)[1])
    return {"without": without, "with": with_hang, "timeout": timeout, "notes": notes}


def print_hang(hang: dict, students: int) -> None:
    extra, allowed = hang["with"] - hang["without"], len(HANGS) * hang["timeout"]
    print(f"{HANG_ASSIGNMENT} class of {students}: {hang['without']:.1f} s; with {len(HANGS)} students whose "
          f"{HANG_PIECE} hangs {hang['with']:.1f} s (+{extra:.1f} s; target at most one cell timeout a hanging "
          f"student, +{allowed} s: {'met' if extra <= allowed else 'NOT met'})")
    for kind, (score, notes) in hang["notes"].items():
        named = HANG_PIECE in notes
        print(f"  {kind}: {score:g} points; notes {'name' if named else 'do NOT name'} {HANG_PIECE}: {notes[:300]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=30, help="students per assignment (default 30)")
    parser.add_argument("--assignments", default="", help="comma-separated (default: every assignment)")
    parser.add_argument("--workers", type=int, default=None,
                        help="grading workers of the course's config (default: its own, parallel.default_workers())")
    parser.add_argument("--no-stock", action="store_true", help="skip stock nbgrader (its time is then not shown)")
    parser.add_argument("--no-hang", action="store_true",
                        help=f"skip the {HANG_ASSIGNMENT} class graded again with {len(HANGS)} hanging answers")
    parser.add_argument("--hang-only", action="store_true", help="only that class (with and without the hangs)")
    args = parser.parse_args()
    chosen = [a for a in args.assignments.split(",") if a] or assignments()
    unknown = set(chosen) - set(assignments())
    if unknown:
        sys.exit(f"unknown assignments: {', '.join(sorted(unknown))}")
    env = {"FP_GRADING_WORKERS": str(args.workers)} if args.workers else {}
    if args.hang_only:
        with tempfile.TemporaryDirectory(prefix="fp-grading-bench-") as tmp:
            print_hang(hang_cost(Path(tmp), args.students, env), args.students)
        return
    cold = {**env, "FP_GRADING_COLD": "1"}

    print(f"floor: starting a kernel and importing torch ({os.cpu_count()} cores) ...", flush=True)
    floors = [floor_seconds(1) for _ in range(3)]  # and one more before each assignment's grading
    with tempfile.TemporaryDirectory(prefix="fp-grading-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "config").mkdir()
        ours = make_course(tmp / "config")
        stock = tmp / "stock" / "course"
        stock.mkdir(parents=True)
        (stock / "nbgrader_config.py").write_text(STOCK_CONFIG)
        shutil.copytree(SOLUTIONS, stock / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))

        counts = {}  # assignment -> notebooks graded
        solved = {}  # assignment -> its solved notebook, for the check command
        for a in chosen:
            run(ours, "generate_assignment", a, "--force")
            run(stock, "generate_assignment", a, "--force")
            for release in sorted((ours / "exercises" / a).glob("*.ipynb")):
                released = nbformat.read(release, as_version=4)
                correct = solution_answers(nbformat.read(SOLUTIONS / a / release.name, as_version=4))
                kinds = [correct, partly_wrong(a, correct, released), None]
                if not solved or (a in ALSO_CHECKED and a not in solved):
                    solved[a] = tmp / "check" / a / release.name
                    solved[a].parent.mkdir(parents=True)
                    nbformat.write(fill(released, correct), solved[a])
                for i in range(args.students):
                    nb = released if kinds[i % 3] is None else fill(released, kinds[i % 3])
                    for course in (ours, stock):
                        target = course / "submitted" / f"student{i:03d}" / a
                        target.mkdir(parents=True, exist_ok=True)
                        nbformat.write(nb, target / release.name)
                    counts[a] = counts.get(a, 0) + 1
        notebooks = sum(counts.values())

        # Per assignment: stock, then the course's config cold, then warm (--force: the same
        # submissions again), so that a change in the machine's load hits all three alike.
        t_stock = t_cold = t_warm = 0.0
        loads = [os.getloadavg()[0]]
        same_outputs = differing = 0
        got_cold, got_warm = {}, {}
        per_assignment = {}  # assignment -> (stock, cold, warm) seconds
        for a in chosen:
            floors.append(floor_seconds(1))
            print(f"grading {a} ({args.students} students; floor {floors[-1]:.2f} s):", end="", flush=True)
            if not args.no_stock:
                s = run(stock, "autograde", a)
                print(f" stock {s:.0f} s;", end="", flush=True)
                t_stock += s
            c = run(ours, "autograde", a, env=cold)
            got_cold.update(export(ours))
            before = graded_outputs(ours, a)
            print(f" cold {c:.0f} s;", end="", flush=True)
            w = run(ours, "autograde", a, "--force", env=env)
            got_warm.update(export(ours))
            after = graded_outputs(ours, a)
            print(f" warm {w:.0f} s", flush=True)
            t_cold, t_warm = t_cold + c, t_warm + w
            per_assignment[a] = (s if not args.no_stock else None, c, w)
            for key in sorted(set(before) | set(after)):
                if before.get(key) == after.get(key):
                    same_outputs += 1
                else:
                    differing += 1
                    if differing <= 5:
                        print(f"  outputs differ: {key}:\n    cold {before.get(key)}\n    warm {after.get(key)}")
            loads.append(os.getloadavg()[0])
        got_stock = {} if args.no_stock else {k: v[0] for k, v in export(stock).items()}

        print(f"the check command on {len(solved)} solved notebook(s), cold and warm, each run beside a floor "
              "(5 runs) ...", flush=True)
        checked = {path.name: check_against_floor(path) for path in solved.values()}
        hang = None
        if not args.no_hang:
            print(f"a {HANG_ASSIGNMENT} class of {args.students}, then the same with {len(HANGS)} hanging answers ...",
                  flush=True)
            hang = hang_cost(tmp, args.students, env)

    # The floor of the whole run: the median of every floor measured through it (the machine's
    # speed drifts within an hour; one measurement at the start was up to a third off).
    floor = statistics.median(floors)
    from firstprinciples.grading.parallel import default_workers

    workers = args.workers or default_workers()
    print()
    print(f"{notebooks} notebooks: {args.students} students x {len(chosen)} assignment(s) "
          f"({', '.join(chosen)}); {os.cpu_count()} cores")
    print(f"{'':52} {'total s':>9} {'s / notebook':>13} {'x floor':>8}")
    print(f"{'floor (kernel start + import torch)':52} {'':>9} {floor:13.2f} {1:8.2f}   "
          f"(median of {len(floors)} through the run, {min(floors):.2f}-{max(floors):.2f} s)")
    rows = [] if args.no_stock else [("serial stock nbgrader", t_stock)]
    rows += [(f"course config, cold kernels ({workers} worker(s), sandboxed)", t_cold),
             (f"course config, warm kernels ({workers} worker(s), sandboxed)", t_warm)]
    for label, t in rows:
        print(f"{label:52} {t:9.1f} {t / notebooks:13.2f} {t / notebooks / floor:8.2f}")
    if len(per_assignment) > 1:
        print("per assignment, s / notebook (x floor):")
        for a, (st, c, w) in per_assignment.items():
            per = counts[a]
            shown = "" if st is None else f"stock {st / per:5.2f} ({st / per / floor:4.2f}); "
            print(f"  {a:22} {shown}cold {c / per:5.2f} ({c / per / floor:4.2f}); warm {w / per:5.2f} ({w / per / floor:4.2f})")
    ratio = t_warm / notebooks / floor
    print(f"warm grading: {ratio:.2f} x floor per notebook (target <= {WARM_TARGET} x: "
          f"{'met' if ratio <= WARM_TARGET else 'NOT met'}); {t_cold / t_warm:.2f}x faster than cold")
    if TRAINS in per_assignment and len(per_assignment) > 1:
        # its kernel trains a model (8.6 s of its own compute), and so does its trusted re-check
        rest = [a for a in per_assignment if a != TRAINS]
        n, w = sum(counts[a] for a in rest), sum(per_assignment[a][2] for a in rest)
        print(f"warm grading of every assignment but {TRAINS} (whose kernel trains a model): "
              f"{w / n / floor:.2f} x floor per notebook (target <= {WARM_TARGET} x: "
              f"{'met' if w / n / floor <= WARM_TARGET else 'NOT met'})")
    if not args.no_stock:
        speedup = t_stock / t_warm
        print(f"speedup over serial stock nbgrader: {speedup:.2f}x")
    for name, c in checked.items():
        print(f"check command on {name} ({c['runs']} runs of each, every run beside a floor measured just "
              f"before it; medians): floor {c['floor']:.2f} s; cold {c['cold']:.2f} s ({c['cold x']:.2f} x floor), "
              f"warm {c['warm']:.2f} s ({c['warm x']:.2f} x floor; target < {CHECK_TARGET} x: "
              f"{'met' if c['warm x'] < CHECK_TARGET else 'NOT met'}); warm runs: "
              + ", ".join(f"{t:.2f}" for t in c["warm all"]) + " s")
    if hang is not None:
        print_hang(hang, args.students)
    # This run itself keeps about `workers` cores busy; much more means other work competed.
    load = statistics.median(loads)
    print(f"load average while grading (median of {len(loads)} samples): {load:.1f} on {os.cpu_count()} cores")
    if load > workers + 1:
        print("NOTE: other work was competing for the cores: the times are not representative")
    same = sum(got_cold.get(k) == v for k, v in got_warm.items())
    print(f"warm against cold: same score and notes for {same} of {len(got_warm)} submissions; "
          f"same outputs in {same_outputs} of {same_outputs + differing} cells")
    for key in sorted(set(got_cold) | set(got_warm)):
        if got_cold.get(key) != got_warm.get(key):
            print(f"  {key[0]} / {key[1]}: cold {got_cold.get(key)}, warm {got_warm.get(key)}")
    if got_stock:
        agree = sum(got_stock.get(k) == v[0] for k, v in got_warm.items())
        print(f"stock against warm: same score for {agree} of {len(got_warm)} submissions")


if __name__ == "__main__":
    main()
