"""Grading support: a sandboxed Jupyter kernel for nbgrader, and the students'
`check` command.

- ``firstprinciples.grading.sandbox``: runs an IPython kernel inside bubblewrap
  (no network, read-only system, no access to the course folder, capped memory,
  processes, file size and CPU time; every process it started dies with it).
  ``nbgrader_config.py`` selects it for ``nbgrader autograde``.
- ``firstprinciples.grading.check``: runs a saved notebook in a clean kernel as
  the grader will and prints, per test, what passes, what fails and why.
- ``firstprinciples.grading.parallel``: ``nbgrader autograde`` grades with
  several worker processes (``FP_GRADING_WORKERS``), a run killed at any point
  can simply be run again, kernels die with the grader that started them, and
  several processes (or, with ``FP_GRADEBOOK_URL``, machines sharing a
  PostgreSQL gradebook) write the gradebook at once.
"""


def require_one_copy(course_root) -> None:
    """Stop a grading command whose course folder holds a ``firstprinciples/`` that is not the
    copy this environment has installed (a course folder copied elsewhere, the package installed
    from a wheel or another clone). nbgrader puts the course folder first on ``sys.path``, so its
    processes would import one copy while others import the other; the first notebooks of a
    command then failed the locked ``imports`` cell and scored 0, later ones passed: a
    grading-setup error, charged to students, that depended on the order of grading. It is the
    instructor's to fix, before any notebook is graded."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(course_root) / "firstprinciples"
    if not (here / "__init__.py").is_file():
        return
    # where the environment's own copy is, seen from outside the course folder (no import is run)
    out = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('firstprinciples'); "
                          "print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')"],
                         cwd=os.path.expanduser("~") if os.path.isdir(os.path.expanduser("~")) else "/",
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    installed = out.stdout.strip()
    copies = {os.path.realpath(here), os.path.realpath(os.path.dirname(__file__) + "/..")}
    if installed:
        copies.add(os.path.realpath(installed))
    if len(copies) > 1:
        raise SystemExit(
            "grading setup error: this course folder's firstprinciples/ is not the copy of the package that this "
            f"environment uses ({', '.join(sorted(copies))}). Nothing was graded. Install the course folder's "
            f"package (pip install -e {os.path.realpath(course_root)}), or run from the folder it was installed "
            "from.")


def gradebook_url(url: str) -> str:
    """``$FP_GRADEBOOK_URL`` as SQLAlchemy should open it. A PostgreSQL address written the usual
    way, ``postgresql://user:password@host/dbname`` (the docs'), names no driver, and SQLAlchemy
    2.1 then picks psycopg 3, which the course does not install (``No module named 'psycopg'``):
    such an address gets the installed driver, psycopg2 (``postgresql+psycopg2://``). An address
    that names its driver is kept as written."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            import importlib.util

            if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
                return "postgresql+psycopg2://" + url[len(plain):]
    return url
