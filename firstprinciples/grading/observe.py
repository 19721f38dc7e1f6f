"""What a graded piece's code *does* while it is re-checked: the observers of the re-check.

The trusted re-check (``recheck``) calls each graded piece on secret inputs in a
fresh interpreter. While one case runs, ``Watch`` records, at three levels that a
student's code cannot switch off without the switch being seen:

- **torch's operators, in every thread**: the Kineto profiler (CPU activity,
  ``profile_all_threads``) records every operator that reaches the dispatcher
  (``aten::_softmax``, ``aten::scaled_dot_product_attention``, ``aten::rnn_tanh``,
  ...), whatever Python spelling reached it: ``torch.softmax``, ``Tensor.softmax``,
  ``F.softmax`` under another name, ``torch.ops.aten._softmax``, ``torch._C``
  functions, a module that wraps the built-in, a call inside
  ``torch._C.DisableTorchFunction()``, a thread, a ``__del__``, a patched encoder;
- **Python functions by their code**: a profile hook (``sys.setprofile``) sees
  every call of a forbidden Python function (``F.multi_head_attention_forward``,
  ``nn.MultiheadAttention``, ``nn.Transformer.generate_square_subsequent_mask``,
  the course's reference pieces), recognised by its bytecode and names, so a
  copy of its code object under another name is still seen;
- **torch functions by name, with the student's line**: a ``TorchFunctionMode``,
  which also finds the cell and line of the call for the feedback.

Each window starts with a marker and ends with a canary that all three observers
must have seen in order: an observer that student code turned off, restarted or
fooled misses one of them, and the case is void (``tampered``). Python threads
alive during the window, and operators run from another thread, are reported too
(``threads``): operators there are still seen, Python calls not, so the grader
flags them for the instructor.

``snapshot``/``changes`` detect tampering by its effect: what a cell or a call
changed in torch, numpy, the course's modules, builtins and the interpreter's hooks.
"""
from __future__ import annotations

import builtins
import gc
import hashlib
import os
import re
import sys
import threading
import tracemalloc as _tracemalloc
import types
from dataclasses import dataclass, field

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import (ProfilerActivity, ProfilerConfig, ProfilerState, _disable_profiler, _enable_profiler,
                            _prepare_profiler)
from torch.overrides import TorchFunctionMode, resolve_name

CELL_PREFIX = "<cell "  # the filename under which the re-check compiles a notebook cell
START_OP, END_OP = "aten::special_entr", "aten::special_erfcx"
_CONFIG = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False,
                         _ExperimentalConfig(profile_all_threads=True), "")
# Recording every allocation too (``Watch(memory=True)``): torch's profiler records allocations
# only without ``profile_all_threads`` (torch 2.13), so a case measured so has its operators seen in
# the thread that runs it and in threads started with ``threading`` (their Python calls, by the
# hook), not in raw ones; only the cases whose memory a test measures are watched so.
_MEMORY_CONFIG = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig(), "")
MEMORY_EVENT = "[memory]"
_ACTIVITIES = {ProfilerActivity.CPU}
# captured now, before any student code runs
_setprofile, _getprofile, _current_frames, _get_ident = sys.setprofile, sys.getprofile, sys._current_frames, threading.get_ident
_getframe = sys._getframe
_threading_setprofile = threading.setprofile  # (threads the student starts during a window get the hook too)
# threads alive before any student code could run (the runner has none; a test process may)
_BASELINE_THREADS = frozenset(_current_frames())


def family(pattern: str, ignore_case: bool = False):
    """The operators and functions a forbidden pattern stands for, as one compiled regex matched
    anywhere in a name: a snake_case pattern's words in order, with any words between them, so
    "scaled_dot_product_attention" is also ``aten::_scaled_dot_product_flash_attention_for_cpu``
    and ``_scaled_dot_product_efficient_attention`` (every kernel of the family, whatever its
    prefix or suffix), "rms_norm" ``aten::_fused_rms_norm``; a CamelCase one (a class: "RMSNorm")
    is matched as written. Python names are matched with their case (the class "RNN" is not the
    helper ``setup_rnn``); operator names, lower case, without (``ignore_case``)."""
    words = [re.escape(w) for w in pattern.split("_") if w]
    return re.compile(r"(?:_[a-z0-9]+)*_".join(words), re.IGNORECASE if ignore_case else 0)


_FAMILIES: dict = {}


def in_family(name: str, patterns, ignore_case: bool = False) -> bool:
    """Whether ``name`` (a function's qualified name; an operator's with ``ignore_case``) belongs to
    a forbidden family."""
    for p in patterns:
        rx = _FAMILIES.get((p, ignore_case))
        if rx is None:
            rx = _FAMILIES[(p, ignore_case)] = family(p, ignore_case)
        if rx.search(name):
            return True
    return False


# ---------------------------------------------------------------- what a Python call is
# The runner reports every Python function called during a case by three facts, and the grader
# (never the runner: no table that decides is in the student's process) matches them against the
# functions a piece must not call:
# - ``consts``: the identity of its code's constants tuple. Every code object derived from a
#   function's code (``code.replace``: its first line moved, another file, another name) shares
#   it (with the same bytecode and names: the pair is the key); code compiled from source never does. The runner sends the identities of the forbidden
#   functions it holds *before any student code runs* (``identities``), so a table emptied or
#   rewritten later changes nothing the grader holds;
# - ``place``: the file inside ``torch/`` or ``firstprinciples/`` and the qualified name, so a
#   module imported again (new objects, the same file) is still recognised.
# The reference's source typed or pasted into a cell and compiled there is new code (its bytecode
# even differs with the context it is compiled in): the watch does not call it the reference; the
# similarity report finds copies, and the student bundle (issue 42) holds no reference source.
_ROOTS = (os.sep + "firstprinciples" + os.sep, os.sep + "torch" + os.sep)


def digest(code) -> str:
    """The code's bytecode and names, without its name, file and line numbers."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((code.co_argcount, code.co_kwonlyargcount, code.co_names, code.co_varnames)).encode())
    h.update(code.co_code)
    return h.hexdigest()


def place(code) -> str:
    """``torch/nn/functional.py:softmax``: where a function of torch or of the course is defined,
    whatever folder holds that copy ("" for any other code)."""
    name = code.co_filename
    at = max(name.rfind(r) for r in _ROOTS)
    return "" if at < 0 else name[at + 1:].replace(os.sep, "/") + ":" + code.co_qualname


def facts(code) -> list:
    """What the runner reports of one Python function it saw called: [consts, digest, place]."""
    return [id(code.co_consts), digest(code), place(code)]


def _canary():
    """Called by the watch itself at the end of each window: the profile hook must see it."""
    return None


_CANARY_CODE = _canary.__code__


def _functions(obj, depth=0):
    """The Python functions of a function or a class (methods, unwrapped)."""
    import types

    out = []
    if isinstance(obj, (staticmethod, classmethod, property)):
        obj = obj.fget if isinstance(obj, property) else obj.__func__
    if isinstance(obj, types.FunctionType):
        seen = 0
        while isinstance(obj, types.FunctionType) and seen < 5:
            out.append(obj)
            obj = obj.__dict__.get("__wrapped__")
            seen += 1
        for f in list(out):  # the functions a decorator keeps in its closure (reference_piece)
            for cell in f.__closure__ or ():
                try:
                    inner = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(inner, types.FunctionType) and inner not in out:
                    out.append(inner)
    elif isinstance(obj, type) and depth == 0:
        for value in list(vars(obj).values()):
            out.extend(_functions(value, 1))
    return out


def _codes(code):
    """A code object and every code nested in it (its inner functions and classes)."""
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


@dataclass
class Table:
    """The Python functions a piece must not call, by the three facts above: consts identity ->
    name (of this process's objects; with the code's digest, since code without constants shares
    one empty tuple), place -> name."""
    ids: dict = field(default_factory=dict)
    places: dict = field(default_factory=dict)

    def add(self, code, name: str, nested: bool = True, unless: "Table | None" = None) -> None:
        """Add ``code`` (and, with ``nested``, the code nested in it) under ``name``, except the
        identities and places that ``unless`` holds."""
        for c in _codes(code) if nested else (code,):
            key = f"{id(c.co_consts)}:{digest(c)}"
            if c.co_consts and not (unless and key in unless.ids):  # (the empty tuple is shared by all code without constants)
                self.ids[key] = name
            if place(c) and not (unless and place(c) in unless.places):
                self.places[place(c)] = name


def forbidden_python(torch_patterns=(), pieces=(), declaration: str = "") -> Table:
    """Every Python function that a piece must not call: torch.nn's functions and classes whose
    qualified name holds one of ``torch_patterns``, the course's reference pieces named in
    ``pieces``, and every implementation the course keeps for its own tests (the checks' and the
    probes' reference functions and models, the declarations' code but the adapters of
    ``declaration``'s pieces, or of every declaration where none is named), whatever the piece
    (computed once per set of names)."""
    key = (tuple(torch_patterns), tuple(pieces), declaration)
    if key not in _FORBIDDEN:
        _FORBIDDEN[key] = _forbidden_python(*key)
    return _FORBIDDEN[key]


_FORBIDDEN: dict = {}
_NN_FUNCTIONS: dict = {}  # loaded torch.nn modules -> their functions


def _torch_nn_functions() -> list:
    """(function, qualified name) of every Python function that torch.nn's loaded modules
    (and torch.functional) define, their classes' methods included; looked for once for all
    the pieces' patterns, again only when another such module has been loaded."""
    names = tuple(n for n, m in list(sys.modules.items())
                  if m is not None and (n == "torch.functional" or n.startswith("torch.nn")))
    if names not in _NN_FUNCTIONS:
        found = []
        for name in names:
            for value in list(vars(sys.modules[name]).values()):
                for f in _functions(value):
                    if f.__module__ == name:
                        found.append((f, f"{f.__module__}.{f.__qualname__}"))
        _NN_FUNCTIONS.clear()
        _NN_FUNCTIONS[names] = found
    return _NN_FUNCTIONS[names]


# The course's own implementations, kept for its tests and never part of an answer: any piece
# that calls one is calling the course's work (the red team called ``checks.modern_block.reference_rmsnorm``
# in a modern block, and the capstone probe's attention module in multi-head attention; the
# declarations' own code is added below, ``_declarations_own_code``).
COURSE_IMPLEMENTATIONS = ("firstprinciples.checks", "firstprinciples.grading.probes", "firstprinciples.capstone.model",
                          "firstprinciples.lengths.model")


def _course_implementations() -> list:
    """(function or code, name) of every implementation the course keeps for itself: the model
    classes of its model files, the ``reference*`` functions of the checks' and probes' modules
    and the probes' own model classes (``Probe*``, defined inside a probe's functions)."""
    import importlib
    import pkgutil

    out = []
    for root in COURSE_IMPLEMENTATIONS:
        try:
            module = importlib.import_module(root)
        except ImportError:  # pragma: no cover (a course without that part)
            continue
        package = hasattr(module, "__path__")
        names = [f"{root}.{m.name}" for m in pkgutil.iter_modules(module.__path__)] if package else [root]
        for name in names:
            try:
                mod = importlib.import_module(name)
            except ImportError:  # pragma: no cover
                continue
            for attr, value in list(vars(mod).items()):
                if getattr(value, "__module__", None) != name:
                    continue
                if not package:  # a model file: its classes
                    if isinstance(value, type):
                        out.extend((f, f"{name}.{attr}") for f in _functions(value))
                elif attr.startswith(("reference", "_reference")):
                    out.extend((f, f"{name}.{attr}") for f in _functions(value))
                elif isinstance(value, types.FunctionType):
                    for c in _codes(value.__code__):
                        inner = c.co_qualname.split(".<locals>.")[-1]
                        if "<locals>" in c.co_qualname and inner.startswith("Probe"):
                            out.append((c, f"{name}.{inner}"))
    return out


def _reach(obj, seen: set, module_prefix: str) -> None:
    """Every code object that ``obj`` (a function or class) may run among the modules under
    ``module_prefix``: its own code and the code nested in it, the functions it keeps in its closure
    and the functions and classes of those modules that its code names as globals, transitively."""
    for f in _functions(obj) if isinstance(obj, type) else [obj]:
        if not isinstance(f, types.FunctionType) or f.__code__ in seen:
            continue
        codes = list(_codes(f.__code__))
        seen.update(codes)
        for cell in f.__closure__ or ():
            try:
                inner = cell.cell_contents
            except ValueError:
                continue
            if isinstance(inner, (types.FunctionType, type)):
                _reach(inner, seen, module_prefix)
        for name in {n for c in codes for n in c.co_names}:
            value = f.__globals__.get(name)
            if isinstance(value, (types.FunctionType, type)) and str(value.__module__).startswith(module_prefix):
                _reach(value, seen, module_prefix)


def _declarations_own_code(declaration: str = "") -> tuple:
    """(code, name) of every function the declarations define (``firstprinciples.exercises.<name>``,
    their classes' methods and the code nested in them) except what their adapters run: the
    declared mistakes, right on some inputs (softmax's "dim ignored" on the last dim), and the
    correct helpers some mistakes are built on (rnn's ``_states``, tiled attention's
    ``_correct_blocks``): an answer that calls one borrows the course's code. And the identities and
    places of the adapters' code (and a trained piece's ``rebuild``), which the runner calls around
    the piece (never forbidden, even
    where a forbidden code shares their constants): of ``declaration``'s pieces, or of every
    declaration where none is named (a runner of pieces not declared)."""
    import importlib

    from .. import exercises

    allowed: set = set()
    for exercise in exercises.pieces(declaration) if declaration else exercises.all_pieces():
        _reach(exercise.adapter, allowed, exercises.__name__)
        if exercise.rebuild is not None:  # (the runner rebuilds a trained piece around it too)
            _reach(exercise.rebuild, allowed, exercises.__name__)
    out, seen = [], set()
    for name in exercises.NAMES:
        module = importlib.import_module(f"{exercises.__name__}.{name}")
        roots = [v for v in vars(module).values() if getattr(v, "__module__", None) == module.__name__]
        roots += [m.fn for e in exercises.pieces(name) for m in e.mistakes]
        for root in roots:
            for f in _functions(root) if isinstance(root, (type, types.FunctionType)) else ():
                for c in _codes(f.__code__):
                    if c not in allowed and c not in seen and c.co_filename == module.__file__:
                        seen.add(c)
                        out.append((c, f"{module.__name__}.{c.co_qualname}"))
    return out, allowed


def _forbidden_python(torch_patterns, pieces, declaration) -> Table:
    try:
        import firstprinciples.reference as reference
    except ImportError:  # a student bundle (``firstprinciples.bundle``): no reference to refuse
        reference = None

    table = Table()
    if torch_patterns:
        for f, qual in _torch_nn_functions():
            if in_family(qual, torch_patterns):
                table.add(f.__code__, qual)
    folder = os.path.dirname(reference.__file__) + os.sep if reference is not None else None
    for piece in pieces if reference is not None else ():
        obj = getattr(reference, piece, None)
        for f in _functions(obj) if obj is not None else ():
            if f.__code__.co_filename.startswith(folder):  # not the marking wrapper that every piece shares
                table.add(f.__code__, f"firstprinciples.reference.{piece}")
    for f, qual in _course_implementations():
        code = f if isinstance(f, types.CodeType) else f.__code__
        module = sys.modules.get(qual.rpartition(".")[0]) or sys.modules.get(qual.rsplit(".", 2)[0])
        if module is not None and code.co_filename == getattr(module, "__file__", None):  # (not a shared wrapper)
            table.add(code, qual)
    own, allowed = _declarations_own_code(declaration)
    keep = Table()
    for code in allowed:
        keep.add(code, "", nested=False)
    for code, qual in own:
        table.add(code, qual, nested=False, unless=keep)
    return table


def identities(table: Table) -> list:
    """What the runner sends before any student code: [consts identity, name] of each forbidden
    function it holds (the grader matches the calls it reports later against these)."""
    return [[i, n] for i, n in table.ids.items()]


def judge(seen: dict, patterns, table: Table, ids: dict | None = None) -> list:
    """The hits, (what, where), of one case's raw observation ``seen`` (what ``Seen.raw`` gives, read
    back from the runner): every forbidden operator, torch function or Python function. ``ids``:
    the identities the runner sent before any student code (default: this process's)."""
    ids = table.ids if ids is None else ids
    hits = []
    for name in seen.get("ops") or ():
        if isinstance(name, str) and in_family(name, patterns, ignore_case=True):
            hits.append((name, None))
    for item in seen.get("functions") or ():
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and in_family(item[0], patterns):
            hits.append((item[0], item[1] if isinstance(item[1], str) else None))
    for item in seen.get("codes") or ():
        if not (isinstance(item, list) and len(item) == 4):
            continue
        consts, dig, where_, at = item
        name = ids.get(f"{consts}:{dig}") if isinstance(consts, int) and isinstance(dig, str) else None
        name = name or (table.places.get(at) if isinstance(at, str) and at else None)
        if name:
            hits.append((name, where_ if isinstance(where_, str) else None))
    return hits


def where(frame) -> str | None:
    """``cell 'softmax', line 3``: the innermost notebook cell on the stack, if any."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(CELL_PREFIX):
            return f"{name[len(CELL_PREFIX):-1]}, line {frame.f_lineno}"
        frame = frame.f_back
    return None


@dataclass
class Seen:
    hits: list = field(default_factory=list)  # (what, where or None), forbidden calls (with a table only)
    tampered: list = field(default_factory=list)  # why the observation cannot be trusted
    threads: list = field(default_factory=list)  # other threads that ran during the window
    ops: list = field(default_factory=list)  # every operator name the profiler recorded
    functions: dict = field(default_factory=dict)  # torch function name -> where it was first called
    calls: dict = field(default_factory=dict)  # id(code) -> (code, where it was first called)
    largest_allocation: int | None = None  # bytes, the largest tensor torch allocated (memory=True only)
    # bytes, the most that Python's allocator (NumPy's arrays included) held at once above what it held when
    # the window opened, as Python's allocation tracer counts it (memory=True only): memory torch never sees
    python_peak: int | None = None

    def raw(self, codes: "Codes | None" = None) -> dict:
        """The observation as plain data, nothing judged: the operators, the torch functions with
        their lines and the Python functions (their facts, or indices into ``codes``)."""
        out = {"ops": list(self.ops), "functions": [[n, w] for n, w in self.functions.items()]}
        if self.largest_allocation is not None:
            out["largest_allocation"] = int(self.largest_allocation)
        if self.python_peak is not None:
            out["python_peak"] = int(self.python_peak)
        if codes is None:
            out["codes"] = [[f[0], f[1], w, f[2]] for c, w in self.calls.values() for f in (facts(c),)]
        else:
            out["code_ids"] = [codes.index(c, w) for c, w in self.calls.values()]
        return out


class Codes:
    """The Python functions a piece's cases called, each reported once (its facts) and named by
    its index in each case (a model's forward calls the same hundred functions in every case)."""

    def __init__(self):
        self.table: list = []  # [consts, digest, where, place]
        self._index: dict = {}
        self._held: list = []  # (the code objects, so that no identity is reused while this lives)

    def index(self, code, where_) -> int:
        i = self._index.get(id(code))
        if i is None:
            consts, dig, at = facts(code)
            i = self._index[id(code)] = len(self.table)
            self.table.append([consts, dig, where_, at])
            self._held.append(code)
        return i


def expand(result: dict, table: list) -> dict:
    """A case's raw observation with its ``code_ids`` turned back into the facts of ``table``
    (read from the runner: anything malformed is dropped)."""
    out = {"ops": result.get("ops"), "functions": result.get("functions"),
           "largest_allocation": result.get("largest_allocation"), "python_peak": result.get("python_peak")}
    ids = result.get("code_ids")
    codes = []
    if isinstance(ids, list) and isinstance(table, list):
        for i in ids[:100_000]:
            if isinstance(i, int) and 0 <= i < len(table) and isinstance(table[i], list):
                codes.append(table[i])
    out["codes"] = codes
    return out


_MARKS = ("torch.special.entr", "torch.special.erfcx")
# What a torch function is, worked out once per watched window (resolving a name costs
# microseconds, and a case calls the same few dozen functions thousands of times). The cache
# lives and dies with its window: no module-level state that a student's import could reach
# between windows (their code runs in the same process). Only Python's own
# function and descriptor types are looked up or stored: their equality is Python's (a fresh
# ``Tensor.shape.__get__`` equals the last one), and an object of the student's, with an
# __eq__ and __hash__ of its own, never meets the cache, so it cannot pass for a function.
_PLAIN, _MARK = 0, 1
_KINDS_MAX = 20_000
_CACHEABLE = frozenset({types.BuiltinFunctionType, types.MethodDescriptorType, types.MethodWrapperType,
                        types.WrapperDescriptorType, types.FunctionType, types.GetSetDescriptorType,
                        types.ClassMethodDescriptorType, types.MemberDescriptorType})


class _Mode(TorchFunctionMode):
    def __init__(self, seen: Seen):
        super().__init__()
        self.seen, self.marks = seen, set()
        self.kinds: dict = {}  # func -> (kind, name), for this window only

    def _kind(self, func) -> tuple:
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        return (_MARK if name in _MARKS else _PLAIN), name

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if type(func) in _CACHEABLE:
            try:
                kind, name = self.kinds[func]
            except KeyError:
                kind, name = self._kind(func)
                if len(self.kinds) < _KINDS_MAX:  # (a case calls a few dozen distinct functions)
                    self.kinds[func] = kind, name
        else:
            kind, name = self._kind(func)
        if kind == _MARK:
            self.marks.add(name)
        elif name not in self.seen.functions and len(self.seen.functions) < _KINDS_MAX:
            self.seen.functions[str(name)] = where(_getframe(1))
        return func(*args, **(kwargs or {}))


class Watch:
    """``with Watch() as seen:`` run one case; ``seen`` is complete when the block ends. It
    records, and decides nothing: the operators, the torch functions and the Python functions
    called (``Seen.raw``), whether each observer stayed on, and other threads. Given the
    forbidden ``torch_patterns`` and reference ``pieces`` (a test, a check in this process),
    it also judges what it saw (``seen.hits``) with ``judge``, as the grader
    does with what a runner reports."""

    def __init__(self, torch_patterns=(), pieces=(), table: Table | None = None, memory: bool = False):
        self.patterns = tuple(torch_patterns)
        self.config = _MEMORY_CONFIG if memory else _CONFIG
        self.table = table if table is not None else (forbidden_python(self.patterns, pieces)
                                                      if (torch_patterns or pieces) else None)
        self.seen = Seen()

    def _hook(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls = self._calls
            if id(code) not in calls:
                calls[id(code)] = (code, where(frame.f_back))

    def __enter__(self) -> Seen:
        self._main = _get_ident()
        self._threads_before = set(_current_frames()) - {self._main}
        self._calls = self.seen.calls
        self._mode = _Mode(self.seen)
        _prepare_profiler(self.config, _ACTIVITIES)
        _enable_profiler(self.config, _ACTIVITIES)
        self._mode.__enter__()
        self._bound = self._hook
        _setprofile(self._bound)
        # a thread started with ``threading`` during the window calls the same hook: a forbidden
        # Python function run there is named with its cell and line, as in the main thread (its
        # torch operators are seen by the profiler in any case)
        _threading_setprofile(self._thread_hook)
        if self.config is _MEMORY_CONFIG:
            # memory that torch's allocator never sees (a NumPy array, Python lists) is counted by
            # Python's allocation tracer: NumPy reports its arrays' buffers to it
            self._was_tracing = _tracemalloc.is_tracing()  # (a test process may trace already)
            _tracemalloc.start()
            self._traced_before = _tracemalloc.get_traced_memory()[0]
            _tracemalloc.reset_peak()
        torch.special.entr(torch.zeros(1))
        return self.seen

    def measured(self) -> None:
        """With ``memory``: the most Python's allocator held so far in the window, above what it held
        when the window opened, is the case's ``python_peak`` (what runs after, the grader's own
        encoding of the outputs, is not counted)."""
        if self.config is _MEMORY_CONFIG and self.seen.python_peak is None and _tracemalloc.is_tracing():
            self.seen.python_peak = max(0, _tracemalloc.get_traced_memory()[1] - self._traced_before)

    def _thread_hook(self, frame, event, arg):
        if event == "call":
            self._hook(frame, event, arg)

    def __exit__(self, *exc) -> bool:
        try:
            torch.special.erfcx(torch.zeros(1))
            _canary()
        finally:
            if self.config is _MEMORY_CONFIG:
                if self.seen.python_peak is None:
                    self.measured()
                if not _tracemalloc.is_tracing():
                    self.seen.tampered.append("Python's allocation tracer was stopped while your code ran")
                if not self._was_tracing:
                    _tracemalloc.stop()
            hook = _getprofile()
            _setprofile(None)
            _threading_setprofile(None)
            try:
                self._mode.__exit__(None, None, None)
            except Exception as e:  # the mode stack was changed under it
                self.seen.tampered.append(f"torch's function-mode stack was changed ({type(e).__name__})")
            try:
                events = _disable_profiler().events()
            except Exception as e:  # pragma: no cover (no session: stopped by student code)
                events = []
                self.seen.tampered.append(f"the operator profiler was stopped ({type(e).__name__})")
        self._record(hook, events)
        if self.table is not None:
            self.seen.hits = judge(self.seen.raw(), self.patterns, self.table)
        return False

    def _record(self, hook, events) -> None:
        seen = self.seen
        canary = seen.calls.get(id(_CANARY_CODE))
        if hook is not self._bound or canary is None or canary[0] is not _CANARY_CODE:
            seen.tampered.append("the grader's profile hook was removed or replaced while your code ran")
        seen.calls.pop(id(_CANARY_CODE), None)
        if self._mode.marks != {"torch.special.entr", "torch.special.erfcx"}:
            seen.tampered.append("torch's function hooks were switched off while your code ran")
        # (A case of a model's forward passes records tens of thousands of events, of a few dozen
        # distinct operators in one thread: the events are walked one by one only when some ran
        # in another thread.)
        names = [(e.name(), e.start_thread_id()) for e in events]
        if self.config is _MEMORY_CONFIG:
            seen.largest_allocation = max((e.nbytes() for e in events if e.name() == MEMORY_EVENT), default=0)
            names = [(n, tid) for n, tid in names if n != MEMORY_EVENT]
        ops = [n for n, _ in names]
        main_tid = next((tid for name, tid in names if name == START_OP), None)
        if START_OP not in ops or END_OP not in ops or ops.index(START_OP) > len(ops) - 1 - ops[::-1].index(END_OP):
            seen.tampered.append("torch's operator profiler was stopped or restarted while your code ran")
        seen.ops = sorted({n for n in ops if n not in (START_OP, END_OP)})
        if main_tid is not None and any(tid != main_tid for tid in {tid for _, tid in names}):
            for name, tid in names:
                if tid != main_tid and "backward" not in name.lower() and name not in (START_OP, END_OP):
                    seen.threads.append(f"torch's operator {name} ran in another thread")
        others = (set(_current_frames()) | self._threads_before) - {self._main} - _BASELINE_THREADS
        if others:
            seen.threads.append(f"{len(others)} other Python thread(s) were alive while your code was graded")


# ---------------------------------------------------------------- tampering by its effect
WATCHED_ROOTS = ("torch", "numpy", "firstprinciples", "builtins", "math")
HOOKS = ("displayhook", "excepthook", "breakpointhook", "unraisablehook")


def _ident(value) -> tuple:
    """(identity, whether replacing it can change what code does): functions, classes and
    other callables can; counters, caches and flags that torch keeps for itself cannot."""
    kind = 2 if isinstance(value, types.ModuleType) else int(callable(value))
    return (id(value), kind)


def _watched(name: str) -> bool:
    return name.partition(".")[0] in WATCHED_ROOTS


class Snapshot:
    """What ``snapshot`` returns: for every watched namespace (a module's ``__dict__``, or a
    class's), its keys and values as they were, with their identities.

    The values are held (so that an identity cannot be reused by a new object while the
    snapshot lives), and two snapshots are compared by identities only: no ``==`` of an
    object that a student's code could have put there. A namespace whose identities did not
    change is passed over at C speed; only one that changed is looked at attribute by
    attribute (``changes``). A namespace whose dictionary was not written to since the
    previous snapshot (its version tag, below) is not even read again: its entry is the
    previous one. So a snapshot costs a few milliseconds, not a walk over the 54,000
    attributes of torch in Python, and the re-check takes one after every cell."""

    __slots__ = ("spaces", "classes", "extra", "tags")

    def __init__(self):
        self.spaces: dict = {}  # key -> (keys, values, identities of keys and values)
        self.classes: dict = {}  # module name -> [(name, class)] of the classes it defines
        self.extra: dict = {}  # "sys", "sys.modules" -> {name: (identity, kind)}
        self.tags: dict = {}  # key -> (the namespace's dict, its version tag) where the tag can be read

    def table(self, key) -> dict:
        """One namespace as {attribute: (identity, kind)}."""
        keys, values, _ids = self.spaces[key]
        return {k: _ident(v) for k, v in zip(keys, values)}


def _space(mapping) -> tuple:
    keys, values = tuple(mapping), tuple(mapping.values())
    return keys, values, (tuple(map(id, keys)), tuple(map(id, values)))


# ---- dictionary version tags (PEP 509): CPython gives every dict a tag that changes at each
# write (any insertion, replacement or deletion, from Python or C: its global-variable caches
# rely on it). Where the tag can be read and behaves so, a namespace whose dict still has the
# tag of the previous snapshot is unchanged and is not read again. Elsewhere (another
# Python, one without the field, a layout that does not match: checked once, below) every
# snapshot reads every namespace, as before.
def _tag_reader():
    import ctypes

    if sys.implementation.name != "cpython" or not (3, 11) <= sys.version_info[:2] <= (3, 13):
        return None
    header = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)  # PyObject_HEAD
    used, tag = header, header + ctypes.sizeof(ctypes.c_ssize_t)  # PyDictObject: ma_used, ma_version_tag
    read_used = lambda d: ctypes.c_ssize_t.from_address(id(d) + used).value  # noqa: E731
    read = lambda d: ctypes.c_uint64.from_address(id(d) + tag).value  # noqa: E731
    try:
        d = {"a": 1, "b": 2}
        if read_used(d) != 2 or read_used({}) != 0:
            return None  # not the layout this expects
        seen = [read(d)]
        d["a"] = 3  # a replacement
        seen.append(read(d))
        seen.append(read(d))  # (no write: the same)
        del d["b"]  # a deletion
        seen.append(read(d))
        d.update(c=4)  # an insertion, from C
        seen.append(read(d))
        owner = type("Probe", (), {})
        (inner,) = gc.get_referents(owner.__dict__)
        before = read(inner)
        owner.x = 1  # a class's attribute set
        if not (seen[0] != seen[1] == seen[2] != seen[3] != seen[4] and len(set(seen)) == 4 and read(inner) != before):
            return None
    except Exception:  # noqa: BLE001
        return None
    return read


_read_tag = _tag_reader()


def _dict_of(namespace):
    """The dict behind a module's ``__dict__`` or a class's mapping proxy (None: not found)."""
    if type(namespace) is dict:
        return namespace
    if type(namespace) is types.MappingProxyType:
        inner = gc.get_referents(namespace)
        if len(inner) == 1 and type(inner[0]) is dict:
            return inner[0]
    return None


def snapshot(previous: Snapshot | None = None) -> Snapshot:
    """Identities of everything a student's code could replace to change what other code
    computes: the attributes of every loaded torch, numpy, course and builtins module and of
    the classes they define, and the interpreter's hooks. Keys: a module's name, or
    ``(module, class name)`` for a class. ``previous``: an earlier snapshot of this process,
    whose lists of classes are reused for the modules that did not change since."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # looking at a deprecated attribute warns
        return _snapshot(previous)


def _snapshot(previous: Snapshot | None) -> Snapshot:
    collecting = gc.isenabled()
    gc.disable()  # (a snapshot makes thousands of tuples: collections of torch's heap would cost more than it)
    try:
        return _take(previous)
    finally:
        if collecting:
            gc.enable()


def _take(previous: Snapshot | None) -> Snapshot:
    state = Snapshot()
    spaces, tags, read = state.spaces, state.tags, _read_tag
    old_spaces = previous.spaces if previous is not None else {}
    old_tags = previous.tags if previous is not None else {}

    def space(key, namespace) -> bool:
        """The namespace's entry: the previous snapshot's if its dict was not written to since
        (then True), else read now."""
        d = _dict_of(namespace) if read is not None else None
        if d is not None:
            tag = read(d)
            tags[key] = (d, tag)  # (held: the dict's identity cannot be reused while this lives)
            was = old_tags.get(key)
            # (identities and integers only: no == of a dict whose values a student's code chose)
            if was is not None and was[0] is d and was[1] == tag and key in old_spaces:
                spaces[key] = old_spaces[key]
                return True
        spaces[key] = _space(namespace)
        return False

    loaded = {}
    for name, module in list(sys.modules.items()):
        watched = _WATCHED.get(name)
        if watched is None:
            watched = _WATCHED[name] = (_watched(name), name.startswith(VOLATILE))
        if not watched[0]:
            continue
        loaded[name] = (id(module), True)
        if watched[1]:  # (changes passes over the volatile ones)
            continue
        d = getattr(module, "__dict__", None) if module is not None else None
        if not isinstance(d, dict):
            continue
        unchanged = space(name, d)
        if name in old_spaces and (unchanged or old_spaces[name][2] == spaces[name][2]) and name in previous.classes:
            classes = previous.classes[name]  # the same objects under the same names
        else:
            classes = [(k, v) for k, v in zip(*spaces[name][:2])
                       if issubclass(type(v), type) and v.__dict__.get("__module__") == name]
        state.classes[name] = classes
        for k, cls in classes:
            space((name, k), cls.__dict__)
    hooks = {h: (id(getattr(sys, h, None)), True) for h in HOOKS}
    hooks.update(meta_path=(hash(tuple(map(id, sys.meta_path))), True),
                 path_hooks=(hash(tuple(map(id, sys.path_hooks))), True), __import__=(id(builtins.__import__), True))
    state.extra["sys"] = hooks
    state.extra["sys.modules"] = loaded
    return state


_WATCHED: dict = {}  # module name -> (watched, volatile): the same for a name at every snapshot
# A snapshot the warm template took before forking any re-check runner (its trusted, clean
# state): a runner's first snapshot reads again only the namespaces written to since (None:
# not a child of the template; its first snapshot reads every namespace).
BASELINE: Snapshot | None = None


# modules whose attributes torch or numpy rebind themselves while they work (never a student's doing)
VOLATILE = ("torch.nn.modules.module", "torch._tensor_str", "torch.random", "torch._C", "torch.overrides",
            "torch.utils._python_dispatch", "torch.autograd.grad_mode", "torch.backends", "numpy.random",
            "torch._dynamo", "torch.fx", "torch._guards", "torch._logging")


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """What was replaced, removed or added between two snapshots (``torch.exp was replaced``)."""
    import warnings

    collecting = gc.isenabled()
    gc.disable()  # (as in a snapshot: what it allocates would make the collector walk both snapshots)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # looking at a deprecated attribute warns
            return _changes(before, after)
    finally:
        if collecting:
            gc.enable()


def _changes(before: Snapshot, after: Snapshot) -> list[str]:
    out = []
    for key, attrs, now in _differing(before, after):
        shown = ".".join(key) if isinstance(key, tuple) else key
        for k, (ident, kind) in attrs.items():
            if k in ("__doc__", "__dict__", "__weakref__", "__annotations__", "__parameters__"):
                continue
            if k not in now:
                if kind == 1:
                    out.append(f"{shown}.{k} was removed")
            elif now[k][0] != ident and (kind == 1 or now[k][1] == 1) and not _torch_wrapper(key, k):
                out.append(f"{shown}.{k} was replaced")
        for k in now.keys() - attrs.keys():
            if key == "sys.modules" or isinstance(key, str) and k.startswith("__") and k.endswith("__"):
                continue  # a module imported, a module's own dunders
            if now[k][1] == 1 and not _torch_wrapper(key, k):  # a function or class put there
                out.append(f"{shown}.{k} was added")
    return out


def _differing(before: Snapshot, after: Snapshot):
    """(key, attributes before, attributes after) of each namespace whose identities changed
    (torch's own volatile modules aside)."""
    for key, (_keys, _values, ids) in before.spaces.items():
        module = key[0] if isinstance(key, tuple) else key
        now = after.spaces.get(key)
        if now is None or now[2] is ids or now[2] == ids or module.startswith(VOLATILE):
            continue
        yield key, before.table(key), after.table(key)
    for key, attrs in before.extra.items():
        now = after.extra.get(key)
        if now is not None and now != attrs:
            yield key, attrs, now


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _torch_wrapper(key, attr) -> bool:
    """torch wraps some of its own functions lazily (``torch.manual_seed`` on first use, an
    optimizer's ``step`` when one is built): a wrapper whose code is torch's and that wraps
    what was there is torch's doing. Private torch modules change their own state freely."""
    module = key[0] if isinstance(key, tuple) else key
    if isinstance(key, str) and module.startswith("torch.") and any(p.startswith("_") for p in module.split(".")[1:]):
        return True  # the module-level state of torch's private modules
    try:
        owner = sys.modules.get(module)
        if isinstance(key, tuple):
            owner = getattr(owner, key[1], None)
            value = owner.__dict__.get(attr) if owner is not None else None
        else:
            value = getattr(owner, attr, None)
        code = getattr(value, "__code__", None)
        return (getattr(value, "__wrapped__", None) is not None and code is not None
                and code.co_filename.startswith(_TORCH_DIR))
    except Exception:  # an attribute that cannot be looked at: not torch's own wrapper
        return False
