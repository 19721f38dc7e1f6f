"""Every test of a notebook, from inside it: the check command run on the notebook itself.

Each exercise notebook ends with a cell that calls ``every_test()``, so that a student sees every
visible test and the trusted re-check's verdict without a terminal, in any notebook front end:

- it finds the notebook: JupyterLab and Jupyter Notebook name its file in the kernel's
  environment (``JPY_SESSION_NAME``; the saved file, so save first), VS Code in the namespace
  (``__vsc_ipynb_file__``), Colab gives the notebook's current contents (``google.colab``);
- it runs ``python -m firstprinciples.grading.check`` on it, in a fresh kernel: the cells above and
  the state they left do not matter, so the cell can be run on its own at any time;
- it prints what the check command prints (every test, pass or FAIL with the reason, the visible
  score) and never raises, so *Run All* goes on past it;
- where the notebook is being graded or checked (``GRADING``, set by the grader and by the check
  command for the kernels they start; ``FP_SANDBOXED``, set in the grader's sandbox) it does
  nothing: the grader runs every test itself.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GRADING = "FP_GRADING"  # set by the grader and the check command: the notebook is being run by them
TIMEOUT = 1800  # seconds the whole check may take (the capstone trains a model)

NOT_FOUND = ("every_test() could not find this notebook's file (JupyterLab, Jupyter Notebook, VS Code and Colab "
             "say where it is; this front end does not). Save the notebook and run, in a terminal:\n"
             "    python -m firstprinciples.grading.check <path of this notebook>")


def mark_grading() -> None:
    """Say, for every kernel this process starts from now on, that the grader (or the check command)
    runs it."""
    os.environ[GRADING] = "1"


def being_graded() -> bool:
    return bool(os.environ.get(GRADING) or os.environ.get("FP_SANDBOXED"))


def _colab_notebook() -> dict | None:
    """The notebook's current contents on Colab (its front end answers ``get_ipynb``), else None."""
    if "google.colab" not in sys.modules:
        return None
    try:
        from google.colab import _message  # noqa: PLC0415 (only on Colab)

        found = _message.blocking_request("get_ipynb", timeout_sec=60)
    except Exception:  # noqa: BLE001 (an older Colab, or no answer: the path is not known)
        return None
    nb = found.get("ipynb") if isinstance(found, dict) else None
    return nb if isinstance(nb, dict) and "cells" in nb else None


def notebook_path(namespace: dict | None = None) -> Path | None:
    """This notebook's saved file, where the front end says it (None where it does not)."""
    candidates = [os.environ.get("JPY_SESSION_NAME", "")]
    if namespace is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
            namespace = shell.user_ns if shell is not None else {}
        except ImportError:
            namespace = {}
    candidates.append(str(namespace.get("__vsc_ipynb_file__", "")))
    for candidate in candidates:
        if candidate.endswith(".ipynb") and Path(candidate).is_file():
            return Path(candidate)
    return None


def every_test(namespace: dict | None = None) -> int | None:
    """Run the check command on this notebook and print what it says; the check's exit status (0:
    every visible test passes), or None where it did not run. Never raises."""
    if being_graded():
        return None
    try:
        path = notebook_path(namespace)
        with tempfile.TemporaryDirectory(prefix="fp-every-test-") as folder:
            which = "the saved notebook: save it first"
            if path is None:
                contents = _colab_notebook()
                if contents is None:
                    print(NOT_FOUND)
                    return None
                path = Path(folder) / "this_notebook.ipynb"
                path.write_text(json.dumps(contents))
                which = "the notebook as it is now"
            print(f"Running every test of {path.name} from the top, in a fresh kernel, as the grader does "
                  f"({which})...", flush=True)
            done = subprocess.run([sys.executable, "-m", "firstprinciples.grading.check", str(path)],
                                  capture_output=True, text=True, timeout=TIMEOUT, cwd=path.parent)
        lines = done.stdout.splitlines()
        print("\n".join(lines[1:] if lines and lines[0].startswith("Running ") else lines))
        if done.stderr.strip():
            print(done.stderr.strip()[-2000:])
        return done.returncode
    except subprocess.TimeoutExpired:
        print(f"every_test() stopped after {TIMEOUT} s: run the check command in a terminal to see where it waits.")
    except Exception as err:  # noqa: BLE001 (never stops Run All)
        print(f"every_test() could not run the check: {type(err).__name__}: {err}")
    return None
