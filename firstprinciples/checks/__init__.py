"""What a notebook's failing test shows the student (``_student``): the student's own line first,
their frames only, and a hint where the error is a usual one. The tests themselves are declared in
``firstprinciples.exercises`` and run by ``grading.declared``.
"""
