"""Transformers from First Principles: the course's importable package.

- ``firstprinciples.reference``: one reference implementation of each concept;
- ``firstprinciples.examples``: the worked examples shared by chapters and checks;
- ``firstprinciples.checks``: the checks that the exercise notebooks run;
- ``firstprinciples.plots``: figures for the chapters.
"""

import os as _os

__version__ = "0.1.0"
# A student bundle (``firstprinciples.bundle``): no reference implementations, stored results instead
BUNDLED = _os.path.exists(_os.path.join(_os.path.dirname(__file__), "_bundle.py"))
