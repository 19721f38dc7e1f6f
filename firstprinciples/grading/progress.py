"""Every exercise notebook of a folder with its visible score: where a student stands.

    python -m firstprinciples.grading.progress            # exercises/
    python -m firstprinciples.grading.progress my-work/   # any folder of exercise notebooks

Runs each saved notebook (``<folder>/<exercise>/<notebook>.ipynb``), one after another, exactly as
the check command does (``check.load``, ``check.execute``, ``check.scores``: a fresh kernel per
notebook, the grader's executor and the trusted re-check), and prints one row per notebook: the
points of the visible tests that pass over all the points, the tests that fail, and the rough time
its header gives; then a total. A notebook that cannot be read or run is a row that says why. The
grader adds hidden tests to some cells, so a visible score is what can still be lost, not a grade.
Exit status: 0 when every visible test of every notebook passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

from . import check

ROUGH_TIME = re.compile(r"\*\*Rough time\*\*\s*\|\s*(\d+)\s*minutes")
TOC_ENTRY = re.compile(r"file:\s*exercises/(\S+)")


@dataclasses.dataclass
class Row:
    notebook: str  # its path in the folder
    minutes: int | None = None  # the header's rough time
    earned: float = 0.0
    total: float = 0.0
    failing: tuple[str, ...] = ()  # grade ids of the visible tests that fail
    tests: int = 0  # how many visible tests it has
    problem: str = ""  # why it could not be run ('' when it ran)


def notebooks(folder: Path) -> list[Path]:
    """The exercise notebooks of ``folder``, in the book's order when a ``_toc.yml`` beside the folder
    lists them (the course's repository), the others after them by name."""
    found = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    toc = folder.resolve().parent / "_toc.yml"
    order = TOC_ENTRY.findall(toc.read_text()) if folder.name == "exercises" and toc.is_file() else []
    rank = {name: i for i, name in enumerate(order)}
    return sorted(found, key=lambda p: (rank.get(p.relative_to(folder).with_suffix("").as_posix(), len(rank)),
                                        p.as_posix()))


def rough_minutes(nb) -> int | None:
    """The minutes of the "Rough time" row of the notebook's header, if it has one."""
    for cell in nb.cells[:3]:
        if cell.cell_type == "markdown":
            m = ROUGH_TIME.search(cell.source)
            if m:
                return int(m.group(1))
    return None


def progress(path: Path, name: str, timeout: int = 120, imported=None) -> Row:
    """One notebook's row: run as the check command runs it; any failure to run is the row's problem."""
    row = Row(name)
    try:
        nb = check.load(path)
    except check.Unreadable as err:
        row.problem = str(err).split(": ", 1)[-1]
        return row
    row.minutes = rough_minutes(nb)
    try:
        check.execute(nb, path, timeout, imported)
        results = check.scores(nb)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 (a kernel that cannot start, ...: the row says so)
        row.problem = f"could not be run: {type(err).__name__}: {err}".splitlines()[0]
        return row
    row.earned = sum(r[1] for r in results)
    row.total = sum(r[2] for r in results)
    row.failing = tuple(gid for gid, score, points, _ in results if score < points)
    row.tests = len(results)
    return row


def table(rows: list[Row]) -> str:
    """The rows as the command prints them, with a total line."""
    width = max([len(r.notebook) for r in rows] + [len("notebook")])
    lines = [f"  {'notebook':<{width}}  {'score':>7}  {'time':>7}  tests that fail"]
    for r in rows:
        time = f"{r.minutes} min" if r.minutes is not None else ""
        if r.problem:
            lines.append(f"  {r.notebook:<{width}}  {'-':>7}  {time:>7}  {r.problem}")
            continue
        score = f"{r.earned:g}/{r.total:g}"
        failing = "all" if len(r.failing) == r.tests > 1 else ", ".join(r.failing) or "none"
        lines.append(f"  {r.notebook:<{width}}  {score:>7}  {time:>7}  {failing}")
    ran = [r for r in rows if not r.problem]
    earned, total = sum(r.earned for r in ran), sum(r.total for r in ran)
    done = sum(1 for r in ran if r.earned == r.total)
    minutes = sum(r.minutes for r in rows if r.minutes is not None)
    unrun = len(rows) - len(ran)
    lines.append(f"Total: {earned:g}/{total:g} visible points; {done} of {len(rows)} notebooks pass every visible test"
                 + (f"; {unrun} could not be run" if unrun else "")
                 + (f"; rough time of all: {minutes} minutes." if minutes else "."))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstprinciples.grading.progress",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", default=Path("exercises"),
                        help="a folder of exercise notebooks (default: exercises/)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per cell (the grader's default: 120)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"{args.folder}: no such folder", file=sys.stderr)
        return 2
    found = notebooks(args.folder)
    if not found:
        print(f"{args.folder}: no notebooks in it", file=sys.stderr)
        return 2
    check._one_thread_each()
    imported = check._prestart()
    print(f"Running the {len(found)} notebooks of {args.folder} one after another, each in a fresh kernel...",
          flush=True)
    rows = []
    try:
        for path in found:
            name = path.relative_to(args.folder).as_posix()
            rows.append(progress(path, name, args.timeout, imported))
            r = rows[-1]
            print(f"  {name}: " + (r.problem if r.problem else f"{r.earned:g}/{r.total:g}"), flush=True)
    except KeyboardInterrupt:
        print("Interrupted: the notebooks run so far are below.", file=sys.stderr)
    if rows:
        print(table(rows))
        print("The grader adds hidden tests to some of these cells; `python -m firstprinciples.grading.check "
              "<notebook>` says why a test fails.")
    return 0 if rows and len(rows) == len(found) and all(not r.problem and r.earned == r.total for r in rows) else 1


if __name__ == "__main__":
    status = main()
    # (as the check command: the kernels, re-checks and template are done; skip the interpreter's teardown)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
