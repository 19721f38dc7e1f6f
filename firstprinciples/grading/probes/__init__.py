"""Probes: what the trusted grader re-checks for each graded piece.

A probe names one object of the notebook (a function, a class, or a variable
such as the capstone's trained ``model``) and says

- ``cases(rng)``: fresh inputs, drawn in the trusted grader from a seed the
  student never sees (plain NumPy arrays and Python values);
- ``run(obj, case)``: how to exercise the object on one case, returning named
  results (tensors, numbers). The *same* function runs twice: inside the
  student's sandboxed kernel on the student's object, and in the trusted grader
  on the course's reference. Only plain data crosses (``wire``), and the
  comparison is made in the trusted grader (``firstprinciples.grading.trusted``);
- ``forbidden``: the built-ins the piece must not call (as in its checks);
- optionally ``judge(case, results)`` instead of a reference, for results that
  have no reference to compare with (a trained model's accuracy);
- ``cells``: for a test cell (by grade_id) that grades only part of the piece,
  which cases (by their ``tags``) it stands for and how they are compared
  (``Aspect``): so partial credit stays partial. A test cell not listed stands
  for every case, compared in full;
- optionally ``needs``: the names of other objects of the notebook that ``run``
  uses with the probed one (``cached_attention_step`` needs the notebook's own
  ``KVCache``, so that a step may call helper methods of the student's cache;
  ``generate_cached`` needs ``StudentGPT`` and ``KVCache``). A probe with
  ``needs`` is run with a third argument, a namespace: on the student's side
  ``run(obj, case, namespace)`` with the notebook's namespace (``needed(probe,
  namespace)``, the needed names it defines, is enough), on the reference side
  ``run(probe.reference, case, reference_namespace(probe))``, each needed name
  bound to the course's object (the reference of that name's own probe). The
  run must also work with the namespace omitted or lacking a name: it then
  looks the name up in the probed function's ``__globals__`` (the notebook's
  namespace when the function was defined there), else uses the course's
  object. A needed object is not re-checked for the test cells of the probed
  one: it has its own probe and test cells.
- optionally ``rebuild``: for an object that the notebook *trains* (the capstone's ``model``),
  ``rebuild(namespace, state) -> object``: the object built again in the runner from the
  notebook's own class (``rebuilt_from``, a name the runner loads with its dependencies) and the
  parameters the kernel ended with (its ``state_dict``, shipped as plain data: ``kernelstate``).
  The re-check then probes that object instead of loading the cells that train it, so the model
  is trained once per submission, not twice; where the kernel's parameters are missing, do not
  fit the class or fail a test, the object is re-checked as before, trained by its own cells
  again, and the better verdict stands (``trusted.recheck``).

Probe modules register their probes in ``REGISTRY``; ``load()`` imports them all.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ... import exercises
from .. import wire

MODULES = ("capstone",)  # (the trained model of the capstone: the last exercise not wholly declared)

REGISTRY: dict[str, "Probe"] = {}


@dataclass(frozen=True)
class Aspect:
    """The part of a probe that one test cell grades.

    ``tags``: the cases whose ``tags`` share one of these (None: every case).
    ``mode``: "values" compares everything with the reference (type, dtype,
    shape, requires_grad, NaN and infinities, values within the dtype's
    tolerance); "structure" only type, dtype, shape and requires_grad (for a
    test of shapes or of a property, where the reference's values do not matter).
    ``also``: a function ``also(case, got, want) -> reason or None`` that judges
    a property of the results after the comparison passed, such as
    ``honest_gradients``. ``got`` and ``want`` are the encoded results
    (``arrays`` turns them into NumPy arrays).
    """
    tags: frozenset | None = None
    mode: str = "values"
    also: Callable | None = None
    test: Any = None  # a declared exercise's ``Test``: judged by ``declared.judge`` instead


def aspect(*tags: str, mode: str = "values", also: Callable | None = None) -> Aspect:
    return Aspect(frozenset(tags) if tags else None, mode, also)


@dataclass(frozen=True)
class Probe:
    name: str
    cases: Callable[[np.random.Generator], list]
    run: Callable[[Any, dict], dict]
    reference: Any = None
    forbidden: dict = field(default_factory=dict)
    judge: Callable | None = None
    tolerance: dict = field(default_factory=dict)  # dtype name -> (atol, rtol), overrides the default
    # (case, result name) -> {dtype name: (atol, rtol)} or None: a tolerance that depends on
    # the case's inputs (softmax: the rounding of x - logsumexp(x) grows with max|x|)
    case_tolerance: Callable | None = None
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


def looked_up(fn, name: str, namespace: dict | None = None):
    """Another notebook object for a run (``Probe.needs``): ``namespace[name]`` when given, else
    ``name`` in the globals of ``fn`` (the notebook's, for a function defined there), else None."""
    if isinstance(namespace, dict) and name in namespace:
        return namespace[name]
    import inspect

    try:
        fn = inspect.unwrap(fn)
    except Exception:  # a broken __wrapped__ chain
        pass
    g = getattr(fn, "__globals__", None)
    return g.get(name) if isinstance(g, dict) else None


def register(*probes: Probe) -> None:
    for p in probes:
        REGISTRY[p.name] = p


def load() -> dict:
    """Every probe module of ``MODULES`` imported (a name misspelt there is an error, not a probe
    silently missing: ``tests/test_trusted.py`` also checks that every module file is listed), and
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
    cells = {gid: Aspect(frozenset(t.tags), "values" if t.values else "structure", None, t)
             for gid, t in {**exercise.elsewhere, **exercise.tests}.items()}
    return Probe(exercise.piece, exercise.secret, exercise.adapter,
                 reference=exercise.reference_piece() if resolve else None,
                 forbidden=dict(exercise.forbidden), cells=cells, memory=exercise.memory, needs=tuple(exercise.needs),
                 declared=exercise)


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


# ---------------------------------------------------------------- a runner for plain functions
# (the generic adapters live with the declarations, which use them too)
from ...exercises.adapters import FD_STEP, call_runner, vector_jacobian  # noqa: E402,F401


def arrays(encoded: dict) -> dict:
    """The arrays among encoded results, by name."""
    return {k: wire.array(v) for k, v in encoded.items() if wire.is_array(v)}


def honest_gradients(case, got, want):
    """The answer's gradients agree with its own outputs (whatever their values), and its
    inputs are unchanged: the directional derivative from the gradients matches the central
    finite difference ``fd`` to 1e-6 relative (float64: the difference's truncation error is
    about 1e-12 and its rounding error about 1e-10 with a step of 1e-6)."""
    a, w = arrays(got), arrays(want)
    for k in a:
        if k.endswith(" after the call") and not np.array_equal(a[k], w[k], equal_nan=True):
            return f"it changes its input {k.split()[0]} in place"
    if "fd" not in a:
        return None
    analytic = sum(float((a[k] * case["dir_" + k[5:]].numpy()).sum()) for k in a if k.startswith("grad_"))
    fd = float(a["fd"])
    if not np.isfinite(analytic) or abs(analytic - fd) > 1e-6 * (1 + abs(fd)):
        return (f"its gradients do not match its own outputs: along a random direction they give {analytic:.6g}, "
                f"finite differences of the outputs give {fd:.6g}")
    return None


def with_directions(rng, case: dict, names) -> dict:
    """Add a random direction ``dir_<name>`` per gradient input (for ``honest_gradients``)."""
    for n in names:
        case[f"dir_{n}"] = rng.standard_normal(case[n].shape).astype(case[n].dtype)
    return case


def normal(rng: np.random.Generator, shape, dtype="float64", scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)
