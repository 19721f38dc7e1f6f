"""nbgrader configuration of the course (used by instructors and by the tests).

Layout: solutions/<assignment>/<notebook>.ipynb are the source notebooks,
exercises/<assignment>/<notebook>.ipynb the released ones (generated, never
edited by hand). Run nbgrader commands from the repository root.
"""

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)

c.CourseDirectory.course_id = "transformers-from-first-principles"
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"

# What a student sees in place of a solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Grading: a notebook that takes longer than this per cell is stopped, and its
# remaining cells fail (import torch alone takes a few seconds on a cold cache).
c.Execute.timeout = 120
c.Execute.interrupt_on_timeout = True
