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
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from . import here

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CELL = re.compile(r"cell In\[(\d+)\]")


MAX_REASON_LINES = 60  # lines of a failing test's reason shown (12 cut off a diagnosis before its mistake)


def _cells_by_count(nb) -> dict:
    """Execution count -> how the student finds that cell in their notebook."""
    names, position = {}, 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        position += 1
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if cell.get("execution_count") is not None:
            first = next((ln.strip() for ln in cell.source.splitlines() if ln.strip()), "")
            what = f"your `{gid}` cell" if gid and cell.metadata.nbgrader.get("solution") else (
                f"the cell starting `{first[:40]}`" if first else "an empty cell")
            names[cell.execution_count] = f"{what}, code cell {position} of the notebook"
    return names


def _kernel_config():
    """The kernel's sockets as Unix sockets in a private folder (POSIX): no TCP port, so no
    "running over TCP without encryption" warning. Windows keeps TCP (no Unix sockets for
    zmq there) and the kernel's log level is raised past that one warning."""
    from traitlets.config import Config

    config = Config()
    if os.name == "posix":
        folder = tempfile.mkdtemp(prefix="fp-check-")
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = os.path.join(folder, "kernel")
        return config, folder, []
    return config, None, ["--IPKernelApp.log_level=ERROR"]


def _where(nb, index: int) -> str:
    """How the student finds cell ``index``: ``your `softmax` cell (code cell 4)``."""
    cell = nb.cells[index]
    position = sum(1 for c in nb.cells[:index + 1] if c.cell_type == "code")
    meta = cell.get("metadata", {}).get("nbgrader", {})
    if meta.get("solution") and meta.get("grade_id"):
        return f"your `{meta['grade_id']}` cell (code cell {position})"
    first = next((ln.strip() for ln in cell.source.splitlines() if ln.strip()), "")
    return f"code cell {position}" + (f" (it starts `{first[:40]}`)" if first else "")


def syntax_errors(nb) -> list[str]:
    """A line for each code cell that Python cannot compile (``scan.unreadable_cells``), with its
    line: an unbalanced parenthesis gave five NameErrors and no line."""
    from .scan import unreadable_cells

    out = []
    for i, line, msg, text in unreadable_cells(nb):
        out.append(f"{_where(nb, i)}" + (f", line {line}" if line else "") + f": {msg}"
                   + (f"\n          {text}" if text else ""))
    return out


def failed_cells(nb) -> list[str]:
    """A line for each cell that is not a test and raised when it ran: not graded, but what the
    tests after it need may be missing."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            continue
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error" and o.get("ename") != "SyntaxError":
                value = ANSI.sub("", str(o.get("evalue", ""))).strip().splitlines()
                out.append(f"{_where(nb, i)} raised {o.get('ename', 'an error')}" + (f": {value[0][:160]}" if value else ""))
                break
    return out


def _reason(cell) -> str:
    """The test's own error first (it names the mistake), then the trusted re-check's, if any."""
    from .trusted import FAILED

    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    errors.sort(key=lambda o: o.get("ename") == FAILED)  # the test's own message first
    if not errors:
        return "the test cell failed"
    return "\n".join(ANSI.sub("", f"{o.get('ename', 'Error')}: {o.get('evalue', '')}").strip() for o in errors[:2])


def _import_quietly(name: str) -> None:
    try:
        __import__(name)
    except Exception:  # noqa: BLE001 (imported again where it is needed, with its real error)
        pass


def _one_thread_each() -> None:
    """torch's threads: one a process, as in the grader's kernels and re-checks with its default
    number of workers (at least one a core: ``parallel.threads_per_worker`` gives each one thread).
    So a notebook computes here with the grader's number of threads, and the kernel, the
    re-check's service and its runner, which run at once, do not each spread small operations
    over every core: on two cores, the service's reference results for transformer_block took
    0.6 s instead of 0.05 (a layer norm of a few rows 5 ms: one process's threads waiting for
    cores that the others held). Set before anything starts, so that every child has it."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"


def _prestart() -> threading.Thread:
    """Start what takes longest first, so that it overlaps with this command's own imports: the
    template that the kernel and the re-check are forked from (``warm``) imports torch once.
    Returns the thread importing IPython: join it before anything else imports IPython."""
    from . import warm

    if warm.available():
        try:
            warm.Template.get(False, one_notebook=True)
        except OSError:
            pass  # (the kernel then starts cold)
    # IPython, which jupyter_client imports to find the kernel's spec (0.25 s), while this process
    # would otherwise wait for the template. Only this thread may import it until it is joined:
    # two threads importing IPython at once can each see the other's half-initialised modules
    # (IPython.paths and IPython.core.profiledir import each other), and the check then failed
    # with "KeyError: 'IPython'".
    ipython = threading.Thread(target=_import_quietly, args=("IPython",), daemon=True)
    ipython.start()
    # jsonschema (imported by nbformat) compiles 38 grammars of rfc3987-syntax, when that is
    # installed (jupyterlab brings it), for URI formats that notebooks never use: 2 s of a check.
    sys.modules.setdefault("rfc3987_syntax", None)
    return ipython


class Unreadable(Exception):
    """A file that is not an exercise notebook as downloaded; the message says why and what to do."""


def load(path: Path):
    """The notebook at ``path``, its outputs cleared; raises ``Unreadable``."""
    import nbformat

    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise Unreadable(f"{path}: no such notebook") from None
    except Exception as err:  # invalid JSON, not a notebook
        raise Unreadable(f"{path}: this file is not a readable notebook ({err}). "
                         "Download the exercise again and copy your answers into it.") from None
    if not graded_cells(nb):
        raise Unreadable(f"{path}: no graded tests found: was the notebook's metadata removed? "
                         "Work in the notebook as downloaded.")
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def graded_cells(nb) -> list:
    return [c for c in nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade")]


def execute(nb, path: Path, timeout: int = 120, imported: threading.Thread | None = None) -> None:
    """Run ``nb`` (read from ``path``) from top to bottom in a fresh kernel, as the grader does; its
    outputs are filled in. ``imported``: a thread still importing what the kernel's start imports
    (``_prestart``), joined before it starts."""
    from . import warm
    from .execute import RobustExecute

    # Where the template can be used, the re-check's trusted side runs in a child of it
    # (``verdicts.Service``): this process never imports torch. Elsewhere the reference's results
    # are computed here, after the cells.
    service = warm.available()
    config, folder, extra = _kernel_config()
    if imported is not None:
        imported.join()
    try:
        # (named here: nbgrader's Execute passes jupyter_client's own manager to its base class,
        # which outranks any default of a subclass)
        # The kernel is stopped at once when its cells are done, as the grader's are
        # (``shutdown_kernel``; nbgrader_config.py): asked to shut down, ipykernel 7 could close its
        # output's sockets while its control thread still flushed to them, and said so on the
        # student's terminal ("Socket operation on non-socket").
        RobustExecute(timeout=timeout, config=config, extra_arguments=extra, recheck_service=service,
                      kernel_manager_class=warm.WarmKernelManager, shutdown_kernel="immediate").preprocess(
            nb, {"metadata": {"path": str(path.parent.resolve())}})
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def scores(nb) -> list[tuple[str, float, float, str]]:
    """(grade id, score, points, why it failed: '' when it passed) for each graded test of the run ``nb``,
    as the grader scores it (``nbgrader.utils.determine_grade``)."""
    from nbgrader import utils

    cells = _cells_by_count(nb)
    out = []
    for cell in graded_cells(nb):
        gid = cell.metadata.nbgrader["grade_id"]
        if cell.cell_type != "code":
            out.append((gid, 0.0, float(cell.metadata.nbgrader.get("points", 0)),
                        f"this test cell was turned into {cell.cell_type}: it scores 0"))
            continue
        score, points = utils.determine_grade(cell)
        reason = ""
        if score < points:
            reason = CELL.sub(lambda m: f"{m.group(0)} ({cells[int(m.group(1))]})" if int(m.group(1)) in cells
                              else m.group(0), _reason(cell))
        out.append((gid, float(score), float(points), reason))
    return out


def check(path: Path, timeout: int = 120, imported: threading.Thread | None = None) -> int:
    """Run and report ``path``; ``imported``: as for ``execute``."""
    try:
        nb = load(path)
    except Unreadable as err:
        print(err, file=sys.stderr)
        return 2
    changed = [c for c in graded_cells(nb) if c.cell_type != "code"]
    print(f"Running {path} in a fresh kernel...", flush=True)
    broken = syntax_errors(nb)
    if broken:
        print("Python cannot read these cells: they define nothing, and the tests that need them fail.")
        for line in broken:
            print(f"  SyntaxError in {line}")
    execute(nb, path, timeout, imported)
    rows = scores(nb)
    width = max(len(gid) for gid, *_ in rows)
    for gid, score, points, reason in rows:
        if reason and not score and reason.startswith("this test cell was turned into"):
            print(f"  FAIL  {gid:<{width}}  {reason}")
            continue
        line = f"  {'pass' if score == points else 'FAIL'}  {gid:<{width}}  {score:g}/{points:g}"
        if reason:
            reason = reason.splitlines()
            if len(reason) > MAX_REASON_LINES:  # (a diagnosis is never cut: only a very long traceback is)
                reason = reason[:MAX_REASON_LINES] + [f"... {len(reason) - MAX_REASON_LINES} more lines: "
                                                      "run the test cell in the notebook to see them all"]
            line += "\n        " + "\n        ".join(reason)
        print(line)
    others = [f for f in failed_cells(nb) if not any(f.startswith(b.split(",")[0]) for b in broken)]
    if others:
        print("Cells that are not tests but failed (not graded; the tests after them may miss what they define):")
        for line in others:
            print(f"  {line}")
    earned, total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"Visible score: {earned:g}/{total:g}. The grader adds hidden tests to some of these cells.")
    return 0 if earned == total and not changed else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstprinciples.grading.check", description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per cell (the grader's default: 120)")
    args = parser.parse_args(argv)
    _one_thread_each()
    here.mark_grading()  # (before any kernel or template starts: the notebook's last cell then does nothing)
    imported = _prestart()
    try:
        return check(args.notebook, args.timeout, imported)
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    except Exception as err:  # the kernel could not start, ...: one line, not the machinery's traceback
        print(f"The check could not run {args.notebook}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    status = main()
    # Everything is done and shut down (kernel, re-check, temporary folder; the template dies with
    # this process): the interpreter's own teardown of some 1,500 modules and zmq's context would
    # only add 0.2-0.3 s to every check.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
