"""Benchmark: a class with one hanging student, two workers: fixed batches against turns.

A class of ``--students`` (default 30) on ``--assignment`` (default multi_head_attention),
every answer correct; the first student's first answer cell ends in a loop that never
returns (its pieces are defined, then the cell runs until its timeout). With two workers
it measures, in one run:

- the floor: the hanging student graded alone, and the class without that student (two
  workers); no schedule can beat the larger of the two;
- now: the whole class, where a free worker takes the next submission (``parallel.Turns``);
- before: the whole class dealt in fixed batches up front (sorted, round-robin), as the
  grader did until this change: the hanging student's worker had half the class dealt to
  it, and those students waited behind the hang while the other worker sat idle. The old
  schedule is put back for this run only (``FIXED_BATCHES``, a patch of ``_convert``).

The cost of fixed batches is the hanging student's worker's share of the rest of the class
(half of it, graded after the hang), so it grows with the class and with the time a notebook
takes. It prints the three wall times. Run from the repository root:
    python tests/benchmarks/hang_schedule.py
    python tests/benchmarks/hang_schedule.py --assignment softmax --students 8 --timeout 20   # quicker
It works in a temporary folder; the repository is untouched.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from course import SOLUTIONS, fill, make_course, nbgrader, scratch, solution_answers  # noqa: E402

WORKERS = 2
NEVER_RETURNS = "\n\nwhile True:  # (the cell's pieces are defined; the cell never ends)\n    pass\n"
# The schedule before turns: `nbgrader autograde` with the sorted submissions dealt round-robin
# to the workers before any is graded (worker w: the w-th, the w+N-th, ...).
FIXED_BATCHES = """
import os, sys
from firstprinciples.grading import parallel

convert = parallel.ParallelAutograde._convert

def fixed_batches(self, failed=None):
    workers = min(self.workers, len(self.assignments))
    if self.shared_queue or not self._can_fork(workers):
        return convert(self, failed)
    total = len(self.assignments)
    self._run_workers(workers, lambda: self._grade_turns(
        range(int(os.environ[parallel.SHARD_ENV].split("/")[0]) - 1, total, workers)))

parallel.ParallelAutograde._convert = fixed_batches
sys.argv = ["nbgrader", "autograde", *sys.argv[1:]]
from nbgrader.apps.nbgraderapp import main
main()
"""


def timed(course: Path, *args: str, fixed: bool = False) -> float:
    """Wall seconds of `nbgrader autograde ARGS` in ``course`` with two workers (it must succeed)."""
    env = {"FP_GRADING_WORKERS": str(WORKERS)}
    t0 = time.perf_counter()
    if fixed:
        full = {k: v for k, v in os.environ.items() if not k.startswith("NBGRADER")}
        full.update(env, TMPDIR=str(scratch(course)))
        proc = subprocess.run([sys.executable, "-c", FIXED_BATCHES, *args], cwd=course, env=full,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"autograde (fixed batches) failed:\n{proc.stderr[-4000:]}")
    else:
        nbgrader(course, "autograde", *args, env=env, timeout=None)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=30, help="students in the class (default 30)")
    parser.add_argument("--assignment", default="multi_head_attention",
                        help="the assignment (default multi_head_attention)")
    parser.add_argument("--timeout", type=int, default=None,
                        help="seconds before a cell is interrupted (default: the course's c.Execute.timeout)")
    args = parser.parse_args()
    extra = [] if args.timeout is None else [f"--Execute.timeout={args.timeout}"]

    tmp = Path(tempfile.mkdtemp(prefix="fp-hang-schedule-"))
    try:
        course = make_course(tmp)
        a = args.assignment
        nbgrader(course, "generate_assignment", a, "--force")
        (release_path,) = sorted((course / "exercises" / a).glob("*.ipynb"))
        release = nbformat.read(release_path, as_version=4)
        correct = solution_answers(nbformat.read(SOLUTIONS / a / release_path.name, as_version=4))
        first = next(iter(correct))  # (the first answer cell)

        def hand_in(student: str, answers: dict) -> None:
            folder = course / "submitted" / student / a
            folder.mkdir(parents=True, exist_ok=True)
            nbformat.write(fill(release, answers), folder / release_path.name)

        for i in range(1, args.students):
            hand_in(f"student{i:03d}", correct)
        timed(course, a, *extra)  # (warms the machine's caches; not counted)
        without = timed(course, a, "--force", *extra)
        hand_in("student000", {**correct, first: correct[first] + NEVER_RETURNS})  # sorted first
        alone = timed(course, a, "--force", "--student=student000", *extra)
        now = timed(course, a, "--force", *extra)
        before = timed(course, a, "--force", *extra, fixed=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    floor = max(alone, without)
    timeout = f"{args.timeout} s" if args.timeout else "the course's"
    print(f"{args.assignment}, a class of {args.students}; the first student's {first} cell never returns; "
          f"{WORKERS} workers; "
          f"cell timeout: {timeout}; {os.cpu_count()} cores; load average now {os.getloadavg()[0]:.1f}")
    print(f"  floor: the hanging student alone {alone:6.1f} s; the class without them {without:6.1f} s "
          f"-> {floor:.1f} s")
    print(f"  turns (now):            {now:6.1f} s  ({now - floor:+.1f} s over the floor)")
    print(f"  fixed batches (before): {before:6.1f} s  ({before - floor:+.1f} s over the floor)")


if __name__ == "__main__":
    main()
