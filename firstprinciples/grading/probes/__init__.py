"""Probes: what the trusted grader re-checks for each graded piece, made from its declaration.

A probe (``from_declaration``) is a declared piece (``firstprinciples.exercises``) as the re-check
uses it:

- ``cases(rng)``: the declaration's secret cases, drawn in the trusted grader from a seed the
  student never sees (plain NumPy arrays and Python values);
- ``run(obj, case)``: the declaration's adapter, the only course code that runs beside the
  student's in the runner; only plain data crosses (``wire``), and the judgement is made in the
  trusted grader (``trusted.judge_case``, with ``declared.judge``) against the reference's results
  computed there (none for a piece without a reference: its tests' properties judge);
- ``forbidden``: the built-ins the piece must not call; ``memory``: the bound of a memory case;
- ``cells``: per test cell (grade_id, the piece's own and its ``elsewhere``), the cases it stands
  for (by their ``tags``) and the declared ``Test`` that judges them (``Aspect``): so partial credit
  stays partial;
- ``needs``: the names of other notebook objects the adapter uses with the piece (the KV-cache
  step's ``KVCache``): in the runner ``run(obj, case, namespace)`` with the notebook's namespace; on
  the reference side each needed name is bound to the course's object (``reference_namespace``);
- ``rebuild``: for an object the notebook *trains* (the capstone's ``model``), the object built
  again in the runner from the notebook's own class (``rebuilt_from``) and the parameters the kernel
  ended with (``kernelstate``), so that it is trained once per submission, not twice; where those
  parameters are missing, do not fit the class or fail a test, it is re-checked trained by its own
  cells again, and the better verdict stands (``trusted.recheck``).

``load()`` gives every declared piece's probe, by piece name (``REGISTRY``).
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ... import exercises
from .. import wire

MODULES = ()  # (every exercise is declared: its probes are made from the declarations)

REGISTRY: dict[str, "Probe"] = {}


@dataclass(frozen=True)
class Aspect:
    """The part of a probe that one test cell grades: the cases whose ``tags`` share one of ``tags``
    (None: every case), judged by the declared ``Test`` (``declared.judge``; None: a cell that is
    none of the piece's tests, which the re-check does not judge)."""
    tags: frozenset | None = None
    test: Any = None


@dataclass(frozen=True)
class Probe:
    name: str
    cases: Callable[[np.random.Generator], list]
    run: Callable[[Any, dict], dict]
    reference: Any = None
    forbidden: dict = field(default_factory=dict)
    cells: dict = field(default_factory=dict)  # test cell grade_id -> Aspect
    needs: tuple = ()  # names of other notebook objects run(obj, case, namespace) looks up in namespace
    rebuild: Callable | None = None  # (namespace, state: name -> tensor) -> the object, from the kernel's state
    rebuilt_from: tuple = ()  # the names rebuild uses (the runner loads them and their dependencies)
    # (case) -> the most bytes any one tensor that the piece allocates on a case tagged "memory" may
    # hold, or None: measured at torch's allocator (the operator profiler records every allocation,
    # whatever dispatch or function mode the student switches off)
    memory: Callable | None = None
    declared: Any = None  # the ``exercises.Exercise`` this probe was made from, if any

    def watch(self) -> dict:
        return {"torch_patterns": tuple(self.forbidden.get("torch_patterns", ())),
                "pieces": tuple(self.forbidden.get("pieces", ())),
                "declaration": self.declared.name if self.declared is not None else ""}


def needed(probe: Probe, namespace: dict) -> dict:
    """The part of a notebook's namespace that ``probe.run`` uses: each name of ``probe.needs``
    that it defines, with its object (a name it lacks is left out)."""
    return {n: namespace[n] for n in probe.needs if n in namespace}


def reference_namespace(probe: Probe) -> dict:
    """The namespace for the reference's run: each name of ``probe.needs`` bound to the course's
    object, the reference of that name's own probe (a name without one is left out)."""
    registry = load()
    return {n: registry[n].reference for n in probe.needs if n in registry and registry[n].reference is not None}


def register(*probes: Probe) -> None:
    for p in probes:
        REGISTRY[p.name] = p


def load() -> dict:
    """Every probe module of ``MODULES`` imported (a name misspelt there is an error, not a probe
    silently missing: ``tests/grading/test_trusted.py`` also checks that every module file is listed), and
    a probe made from each declared exercise (``exercises.NAMES``)."""
    for m in MODULES:
        importlib.import_module(f"{__name__}.{m}")
    for piece, exercise in exercises.by_piece().items():
        if piece not in REGISTRY:
            register(from_declaration(exercise))
    return REGISTRY


def from_declaration(exercise, resolve: bool = True) -> Probe:
    """The re-check's probe of a declared exercise: its secret cases, its adapter, its reference,
    and per test cell an aspect that ``declared.judge`` decides (``trusted.judge_case``).
    ``resolve=False``: without the reference (the runner's probe: the runner never computes an
    expected result, and holds no course implementation)."""
    import firstprinciples

    cells = {gid: Aspect(frozenset(t.tags), t) for gid, t in {**exercise.elsewhere, **exercise.tests}.items()}
    cases, reference = exercise.secret, exercise.reference_piece() if resolve and not firstprinciples.BUNDLED else None
    if firstprinciples.BUNDLED:  # a student bundle: no secret cases and no reference, the visible cases' stored results
        cases = functools.partial(_bundled_cases, exercise)
    return Probe(exercise.piece, cases, exercise.adapter,
                 reference=reference,
                 forbidden=dict(exercise.forbidden), cells=cells, memory=exercise.memory, needs=tuple(exercise.needs),
                 rebuild=exercise.rebuild, rebuilt_from=tuple(exercise.rebuilt_from), declared=exercise)


def _bundled_cases(exercise, rng=None) -> list:
    """A student bundle's re-check cases: the visible ones whose results are stored (every one, for a
    piece without a reference), each once."""
    from .. import declared

    pool = exercise.visible() if callable(exercise.visible) else exercise.visible
    if not exercise.reference:
        return list(pool)
    stored = declared.stored_by_label(exercise)
    seen: set = set()
    out = []
    for case in pool:
        if case["label"] in stored and case["label"] not in seen:
            seen.add(case["label"])
            out.append(case)
    return out


# ---------------------------------------------------------------- cases on the wire
def encode_case(case: dict) -> dict:
    return {k: wire.encode(v) for k, v in case.items()}


def _decode(d):
    import torch

    if wire.is_array(d):
        return torch.from_numpy(wire.array(d))
    if "items" in d and "keys" in d:
        return {k: _decode(v) for k, v in zip(d["keys"], d["items"])}
    if "items" in d:
        items = [_decode(v) for v in d["items"]]
        return tuple(items) if d["type"] == "builtins.tuple" else items
    return wire.scalar(d)


def decode_case(enc: dict) -> dict:
    """A case as the runners see it: arrays become torch tensors of the same dtype."""
    return {k: _decode(v) for k, v in enc.items()}
