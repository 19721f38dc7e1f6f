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
