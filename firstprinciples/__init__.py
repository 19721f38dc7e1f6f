"""Transformers from First Principles: the course's importable package.

- ``firstprinciples.reference``: one reference implementation of each concept;
- ``firstprinciples.examples``: the worked examples shared by chapters and checks;
- ``firstprinciples.checks``: the checks that the exercise notebooks run;
- ``firstprinciples.plots``: figures for the chapters.
"""

__version__ = "0.1.0"
