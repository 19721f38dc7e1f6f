"""Benchmark: grading a class, the course's `nbgrader autograde` against stock nbgrader.

Builds a temporary course (the repo's nbgrader_config.py and solutions/),
releases every assignment and simulates a class: per assignment, ``--students``
submissions (default 30), a third each correct, partly wrong and untouched.
Then, in the same run, it measures

- the floor: a bare Jupyter kernel start plus ``import torch`` (median of 3),
  the least any grader pays per notebook;
- serial STOCK nbgrader: the same submissions in a second course folder whose
  nbgrader_config.py only names the source and release folders (nbgrader's own
  preprocessors, no sandbox, no parallel workers);
- the course's config: sandboxed kernels, RobustExecute, broken-submission
  repairs, parallel workers (``--workers``; default: the config's, the number
  of cores);

running, assignment by assignment, stock first and then the course's config
(so that a change in the machine's load hits both alike), and prints seconds
per notebook for both, the floor, the speedup (stock / course) and whether it
meets the course's target (>= 1.7x on two cores). It also checks that both
graders gave the same grades.

Run from the repository root:
    python tests/benchmarks/grading.py                          # the full class: 30 students, every assignment
    python tests/benchmarks/grading.py --students 8 --assignments softmax,causal_mask   # a quick run
It works in a temporary folder; the repository is untouched.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from course import SOLUTIONS, answer_cells, assignments, make_course, nbgrader, nbgrader_meta
from test_instructor_roundtrip import NO_SCALING, fill, solution_answers

sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
from book_build import floor_seconds  # noqa: E402 (the same floor as the book build's benchmark)

TARGET = 1.7
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


def scores(course: Path) -> dict:
    run(course, "export")
    with open(course / "grades.csv", newline="") as f:
        return {(r["assignment"], r["student_id"]): float(r["score"]) for r in csv.DictReader(f)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=30, help="students per assignment (default 30)")
    parser.add_argument("--assignments", default="", help="comma-separated (default: every assignment)")
    parser.add_argument("--workers", type=int, default=None,
                        help="grading workers of the course's config (default: its own, the number of cores)")
    args = parser.parse_args()
    chosen = [a for a in args.assignments.split(",") if a] or assignments()
    unknown = set(chosen) - set(assignments())
    if unknown:
        sys.exit(f"unknown assignments: {', '.join(sorted(unknown))}")
    env = {"FP_GRADING_WORKERS": str(args.workers)} if args.workers else {}

    print(f"floor: starting a kernel and importing torch ({os.cpu_count()} cores) ...", flush=True)
    floor = floor_seconds()
    with tempfile.TemporaryDirectory(prefix="fp-grading-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "config").mkdir()
        ours = make_course(tmp / "config")
        stock = tmp / "stock" / "course"
        stock.mkdir(parents=True)
        (stock / "nbgrader_config.py").write_text(STOCK_CONFIG)
        shutil.copytree(SOLUTIONS, stock / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))

        notebooks = 0
        for a in chosen:
            run(ours, "generate_assignment", a, "--force")
            run(stock, "generate_assignment", a, "--force")
            for release in sorted((ours / "exercises" / a).glob("*.ipynb")):
                released = nbformat.read(release, as_version=4)
                correct = solution_answers(nbformat.read(SOLUTIONS / a / release.name, as_version=4))
                kinds = [correct, partly_wrong(a, correct, released), None]
                for i in range(args.students):
                    nb = released if kinds[i % 3] is None else fill(released, kinds[i % 3])
                    for course in (ours, stock):
                        target = course / "submitted" / f"student{i:03d}" / a
                        target.mkdir(parents=True, exist_ok=True)
                        nbformat.write(nb, target / release.name)
                    notebooks += 1

        t_stock = t_ours = 0.0
        loads = [os.getloadavg()[0]]
        for a in chosen:
            print(f"grading {a} ({args.students} students): stock ...", end="", flush=True)
            s = run(stock, "autograde", a)
            print(f" {s:.0f} s; course config ...", end="", flush=True)
            o = run(ours, "autograde", a, env=env)
            print(f" {o:.0f} s", flush=True)
            t_stock, t_ours = t_stock + s, t_ours + o
            loads.append(os.getloadavg()[0])
        got_stock, got_ours = scores(stock), scores(ours)

    same = sum(got_stock.get(k) == v for k, v in got_ours.items())
    speedup = t_stock / t_ours
    workers = args.workers or os.cpu_count()
    print()
    print(f"{notebooks} notebooks: {args.students} students x {len(chosen)} assignment(s) "
          f"({', '.join(chosen)}); {os.cpu_count()} cores")
    print(f"{'':46} {'total s':>9} {'s / notebook':>13} {'x floor':>8}")
    print(f"{'floor (kernel start + import torch, median of 3)':46} {'':>9} {floor:13.2f} {1:8.2f}")
    print(f"{'serial stock nbgrader':46} {t_stock:9.1f} {t_stock / notebooks:13.2f} {t_stock / notebooks / floor:8.2f}")
    print(f"{f'course config ({workers} worker(s), sandboxed)':46} {t_ours:9.1f} {t_ours / notebooks:13.2f} "
          f"{t_ours / notebooks / floor:8.2f}")
    print(f"speedup over serial stock nbgrader: {speedup:.2f}x  (target >= {TARGET}x: "
          f"{'met' if speedup >= TARGET else 'NOT met'})")
    # This run itself keeps about `workers` cores busy; much more means other work competed.
    load = statistics.median(loads)
    print(f"load average while grading (median of {len(loads)} samples): {load:.1f} on {os.cpu_count()} cores")
    if load > workers + 1:
        print("NOTE: other work was competing for the cores: the times, and the speedup, are not representative")
    print(f"same grades from both: {same} of {len(got_ours)} submissions")
    for key in sorted(set(got_ours) | set(got_stock)):
        if got_ours.get(key) != got_stock.get(key):
            print(f"  {key[0]} / {key[1]}: stock {got_stock.get(key)}, course config {got_ours.get(key)}")


if __name__ == "__main__":
    main()
