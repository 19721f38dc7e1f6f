"""Declarations: each exercise's tests, written once.

One module per assignment, named exactly as its folder ``solutions/<assignment>/``, holds an
``EXERCISE`` (or, for a notebook of several graded pieces, ``PIECES``, one per piece): data and
small pure functions, no grading machinery.

- ``piece``: the notebook object graded, and ``adapter(piece, case) -> {name: result}``, the only
  course code that calls it;
- ``visible``: the cases the notebook's test cells run in the student's kernel (what they say,
  literally or from a fixed seed); ``secret(rng)``: the cases the trusted re-check runs, drawn in
  the grader from a seed no student sees (they never enter the notebook);
- ``tests``: grade_id -> ``Test`` (points, which cases by tag, the properties judged besides the
  comparison);
- ``tolerance``: the comparison's (atol, rtol) where the defaults of ``grading.compare`` do not
  fit, with the reason; ``forbidden``: the built-ins the piece must not call;
- ``mistakes``: typical wrong answers, each with its message and the test cells it must fail;
- ``reference``: where the course's implementation lives ("module:name"), resolved only where
  expected results are computed (the grader, or the student's kernel), never in the re-check's
  runner; "" for a piece that has none (the capstone's trained model): its tests judge the answer's
  results by their properties alone;
- ``rebuild``: for an object the notebook trains (the capstone's ``model``), how the re-check builds
  it again from the notebook's own class and the parameters the kernel ended with, instead of
  training it a second time.

Two runners read a declaration: ``kernel.check(grade_id, piece)`` (the one line of a test cell)
and the trusted re-check (``probe(exercise)`` gives the grader its probe). ``cases`` are plain
dicts: ``label``, ``tags`` and the inputs as NumPy arrays or Python values.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# Modules of this package that are not declarations.
NOT_DECLARATIONS = ("adapters", "expected")
# The assignments declared here, found, not registered: every other module of this package is one
# (the other assignments are still graded by checks/ and grading/probes/). tests/exercises/
# test_declarations.py checks that each is named exactly as its folder in solutions/.
NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                     if m.name not in NOT_DECLARATIONS and not m.name.startswith("_")))


# The comparison's default (atol, rtol) by dtype (``grading.compare``). float32 keeps about 7
# significant digits: a correct answer may order its sums differently from the reference (a d_k-term
# dot product, a T-term softmax sum), which moves results by a few units of 1e-7 relative; 1e-5 / 1e-4
# leaves room for any correct order, while every named mistake of the course moves values by more
# than 1e-3. float64 keeps about 16 digits, so 1e-10 / 1e-8 is as generous there. float16 keeps about 3.
TOLERANCE = {"float32": (1e-5, 1e-4), "float64": (1e-10, 1e-8), "float16": (1e-2, 1e-2)}


def tolerance(dtype: str, override: dict | None = None) -> tuple:
    """(atol, rtol) for a dtype name: ``override``'s, else the default table's, else float32's."""
    return (override or {}).get(dtype) or TOLERANCE.get(dtype, TOLERANCE["float32"])


@dataclass(frozen=True)
class Test:
    """One graded test cell: its points, the cases it runs (those whose tags share one of
    ``tags``) and the properties judged on them, each ``(case, out, want) -> reason or None`` on
    plain data (NumPy arrays by result name, and numbers, strings and flags as
    themselves; ``case["show"]`` is False for the secret cases, whose
    values a message must not print): ``first`` before the comparison with the reference
    (their message is the more useful one), ``then`` after it. ``values=False``: compare type,
    dtype and shape only (a test of shapes or of a property). ``structure_only`` (with
    ``values=False``, where no property reads the reference's numbers): the stored expected results
    of its visible cases keep type, dtype and shape only (sampling's 10,000 tokens a case)."""

    points: int
    tags: frozenset
    first: tuple = ()
    then: tuple = ()
    values: bool = True
    structure_only: bool = False
    # (case, out) -> a line the kernel prints when the case passes (the trained model's loss), or None
    says: Callable | None = None


@dataclass(frozen=True)
class Mistake:
    """A typical wrong answer, with the piece's signature; named when an answer's results equal its
    results (and differ from the reference's). ``fails``: the test cells whose visible cases it fails
    (in the notebook); ``hidden``: the further test cells that only the secret cases catch (in the
    re-check); ``missed``: the cells of ``fails`` that the re-check does not fail (a recap cell, judged
    there by its exercise's secret cases, which may lack the visible case that catches it)."""

    label: str
    hint: str
    fn: Callable
    fails: frozenset = frozenset()
    hidden: frozenset = frozenset()
    missed: frozenset = frozenset()


@dataclass(frozen=True)
class Exercise:
    name: str
    piece: str
    adapter: Callable
    reference: str
    visible: tuple  # (or a function returning them, for cases read from data when first used)
    secret: Callable
    tests: dict
    call: str = ""  # how the piece is called, for messages: "softmax(x)"
    names: dict = field(default_factory=dict)  # result name -> how messages name it
    forbidden: dict = field(default_factory=dict)  # guard.call_without's torch_patterns, pieces, what
    mistakes: tuple = ()
    tolerance: Callable | None = None  # (case, result name) -> {dtype: (atol, rtol)} or None
    hints: tuple = ()  # (text in an error the answer raised, what to do about it)
    # grade_id -> Test: tests of this piece in other (later) notebooks, a recap; the re-check judges
    # their cells by these (their notebooks' own checks run them in the kernel)
    elsewhere: dict = field(default_factory=dict)
    # (case) -> the most bytes one tensor may take at torch's allocator on a case tagged "memory",
    # or None: the re-check's watch records every allocation there (grading.probes.Probe.memory)
    memory: Callable | None = None
    # the assignment whose exercise this piece is (a recap in a later notebook: ``recap``), or ""
    recap_of: str = ""
    # names of other notebook objects the adapter uses with the piece (the KV-cache step: the notebook's
    # own KVCache): the re-check's runner loads their cells and calls ``adapter(piece, case, namespace)``;
    # without a namespace (the kernel), the adapter looks them up in the piece's globals
    needs: tuple = ()
    # an object the notebook trains (the capstone's ``model``): ``rebuild(namespace, state) -> object``
    # builds it again in the re-check's runner from the notebook's own classes (``rebuilt_from``, loaded
    # there with their dependencies) and the kernel's parameters (``grading.kernelstate``)
    rebuild: Callable | None = None
    rebuilt_from: tuple = ()

    def reference_piece(self):
        if not self.reference:
            return None
        module, _, attr = self.reference.partition(":")
        return getattr(importlib.import_module(module), attr)

    def cases(self, grade_id: str, which: str = "visible", rng=None) -> list:
        """The cases of one test: the visible ones, or the secret ones drawn from ``rng``."""
        tags = self.tests[grade_id].tags
        visible = self.visible() if callable(self.visible) else self.visible  # (a function: cases read from data when first used)
        pool = visible if which == "visible" else self.secret(rng)
        return [c for c in pool if set(c["tags"]) & tags]

    def named(self, key: str) -> str:
        return self.names.get(key, key)


def case(label: str, tags, **inputs) -> dict:
    """A case: its label (the end of a sentence: "for x of shape (3, 3)"), tags and inputs."""
    return {"label": label, "tags": tuple(sorted({tags} if isinstance(tags, str) else set(tags))), **inputs}


def pieces(name: str) -> tuple:
    """Every piece declared for one assignment: its module's ``PIECES``, or its one ``EXERCISE``
    (a name not declared is an error)."""
    if name not in NAMES:
        raise KeyError(f"no declaration for {name!r}: declared are {', '.join(NAMES)}")
    module = importlib.import_module(f"{__name__}.{name}")
    found = tuple(getattr(module, "PIECES", None) or (module.EXERCISE,))
    for exercise in found:
        if exercise.name != name:
            raise ValueError(f"{module.__name__} declares {exercise.piece} for {exercise.name!r}, not {name!r}")
    return found


def load(name: str) -> Exercise:
    """The declaration of an assignment of one piece."""
    (exercise,) = pieces(name)
    return exercise


def all_pieces() -> tuple:
    """Every declared piece of every assignment (recaps included)."""
    return tuple(e for name in NAMES for e in pieces(name))


def by_piece() -> dict:
    """piece name -> its exercise, the one that declares it first (recaps left out: the re-check
    judges every cell of a piece, a recap's included, by its exercise's probe)."""
    found = {}
    for e in all_pieces():
        if not e.recap_of:
            found.setdefault(e.piece, e)
    return found


def recap(source: Exercise, assignment: str, tests: dict, visible: tuple | None = None,
          mistakes: dict | None = None) -> Exercise:
    """A later notebook's test of an earlier exercise's piece (a recap cell), declared as a piece
    of that notebook's assignment: ``source``'s piece, adapter, reference, secret cases and
    forbidden built-ins, with this notebook's test cells ``tests`` (grade_id -> Test; each also in
    ``source.tests`` or ``source.elsewhere`` under the same grade_id, with the same tags: the
    re-check judges every cell of a piece by its exercise's probe, and the harness checks they
    agree), its visible cases (default: the source's) and the mistakes these cells catch:
    ``mistakes`` maps a source mistake's label to (fails, hidden) or (fails, hidden, missed),
    grade_ids of ``tests`` (``Mistake``); a mistake not listed is not named here."""
    mistakes = mistakes or {}
    picked = tuple(dataclasses.replace(m, fails=frozenset(mistakes[m.label][0]), hidden=frozenset(mistakes[m.label][1]),
                                       missed=frozenset(mistakes[m.label][2] if len(mistakes[m.label]) > 2 else ()))
                   for m in source.mistakes if m.label in mistakes)
    unknown = set(mistakes) - {m.label for m in source.mistakes}
    if unknown:
        raise KeyError(f"{source.name} declares no mistake {sorted(unknown)}")
    return dataclasses.replace(source, name=assignment, tests=dict(tests), elsewhere={}, mistakes=picked,
                               visible=tuple(source.visible if visible is None else visible), recap_of=source.name)


def globals_of(obj) -> dict:
    """The namespace where a function, a class or an object's class was defined (the notebook's, for a
    piece of the notebook; {} where none is found)."""
    import inspect

    try:
        obj = inspect.unwrap(obj)
    except Exception:  # a broken __wrapped__ chain
        pass
    if not isinstance(obj, type) and not inspect.isfunction(obj) and not inspect.ismethod(obj):
        obj = type(obj)  # an instance (a trained model): where its class was defined
    if isinstance(obj, type):
        for value in vars(obj).values():
            if inspect.isfunction(value):
                return value.__globals__
        module = inspect.getmodule(obj)
        return vars(module) if module is not None else {}
    found = getattr(obj, "__globals__", None)
    return found if isinstance(found, dict) else {}


def plain(value):
    """A result or input as plain data: tensors become NumPy arrays (detached), the rest as is."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return value


def causal_mask_array(T: int, dtype: str = "float64") -> np.ndarray:
    """The additive causal mask (T, T) as a NumPy array, for building cases: 0 on and below the
    diagonal, -inf above. PyTorch's own (``firstprinciples.given``), not an answer of the causal-mask
    exercise written out here (the student bundle keeps what builds the visible cases)."""
    import torch

    from ..given import causal_mask

    return causal_mask(T, torch.float64).numpy().astype(dtype)


def rounding_slack(x: np.ndarray) -> float:
    """One unit of x's dtype times max|x| over its finite entries (0 for none): how far a correct
    answer that forms a difference of two numbers of size max|x| may round (softmax via logsumexp)."""
    x = np.asarray(x)
    finite = x[np.isfinite(x)]
    return float(np.finfo(x.dtype).eps * np.abs(finite).max()) if finite.size else 0.0
