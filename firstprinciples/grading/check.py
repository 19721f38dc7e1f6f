"""Check a saved exercise notebook the way the grader will, before submitting.

    python -m firstprinciples.grading.check exercises/attention/scaled_dot_product_attention.ipynb

Runs the saved notebook from top to bottom in a fresh kernel (the grader's
executor: a cell that hangs or crashes its kernel fails alone), then prints,
for every graded test, whether it passes, its points and, when it fails, why.
The grader also runs hidden tests, so the visible score is an upper bound
only in the sense that hidden tests can still fail.
Exit status: 0 when every visible test passes, 1 otherwise, 2 for a notebook
that cannot be read.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
from nbgrader import utils

from .execute import RobustExecute

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _reason(cell) -> str:
    """The test's own error first (it names the mistake), then the trusted re-check's, if any."""
    from .trusted import FAILED

    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    errors.sort(key=lambda o: o.get("ename") == FAILED)  # the test's own message first
    if not errors:
        return "the test cell failed"
    return "\n".join(ANSI.sub("", f"{o.get('ename', 'Error')}: {o.get('evalue', '')}").strip() for o in errors[:2])


def check(path: Path, timeout: int = 120) -> int:
    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        print(f"{path}: no such notebook", file=sys.stderr)
        return 2
    except Exception as err:  # invalid JSON, not a notebook
        print(f"{path}: this file is not a readable notebook ({err}). "
              "Download the exercise again and copy your answers into it.", file=sys.stderr)
        return 2
    graded = [c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    changed = [c for c in graded if c.cell_type != "code"]
    if not graded:
        print(f"{path}: no graded tests found: was the notebook's metadata removed? "
              "Work in the notebook as downloaded.", file=sys.stderr)
        return 2
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    print(f"Running {path} in a fresh kernel...", flush=True)
    RobustExecute(timeout=timeout).preprocess(nb, {"metadata": {"path": str(path.parent.resolve())}})
    total = earned = 0.0
    width = max(len(c.metadata.nbgrader["grade_id"]) for c in graded)
    for cell in graded:
        gid = cell.metadata.nbgrader["grade_id"]
        if cell.cell_type != "code":
            print(f"  FAIL  {gid:<{width}}  this test cell was turned into {cell.cell_type}: it scores 0")
            total += float(cell.metadata.nbgrader.get("points", 0))
            continue
        score, points = utils.determine_grade(cell)
        total += points
        earned += score
        status = "pass" if score == points else "FAIL"
        line = f"  {status}  {gid:<{width}}  {score:g}/{points:g}"
        if score < points:
            reason = _reason(cell).splitlines()
            line += "\n        " + "\n        ".join(reason[:8])
        print(line)
    print(f"Visible score: {earned:g}/{total:g}. The grader adds hidden tests to some of these cells.")
    return 0 if earned == total and not changed else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstprinciples.grading.check", description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per cell (the grader's default: 120)")
    args = parser.parse_args(argv)
    return check(args.notebook, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
