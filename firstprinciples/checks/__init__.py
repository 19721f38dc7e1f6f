"""Checks used by the exercise notebooks, one module per exercise.

A check takes the student's function (or class) and raises ``AssertionError``
with a message that says what is wrong and, where possible, names the mistake.
"""
