"""Failures told in terms of the student's own code.

When a check fails because the student's code raised, the student needs the
cell and line that raised, not a traceback through the checks, the guard and
torch's internals. ``student_facing`` wraps each public check so that

- an exception raised by the student's code is re-raised (same type) with a
  message that starts with the student's cell, line and source text, then the
  original error, the shapes of the tensors named on that line and, for a
  known mistake (``if mask:``, ``.T`` on four dimensions, ``.view`` after a
  transpose, a matmul of mismatched shapes, a missing ``super().__init__()``),
  a one-line hint (``HINTS``: each row fires only on the error it describes);
- the traceback of any failure keeps only the student's frames (the check's
  own frames, the guard's and the libraries' are cut). The one frame left of
  the course's is marked ``__tracebackhide__``; where no frame of the student's is left,
  the test cell is shown once (``_caller_tb``).

A frame is the student's when its code was not loaded from the course package,
the standard library or an installed package: notebook cells
(``/tmp/ipykernel_*/...py``, ``<ipython-input-...>``), and any file of the
student's own. In IPython a cell's file is mapped to its execution count
(``In[13]``), as IPython's own tracebacks do.
"""
from __future__ import annotations

import functools
import linecache
import os
import re
import site
import sys
import sysconfig
import types

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # firstprinciples/
_GUARD = os.path.join(_PACKAGE, "guard.py")


def _library_dirs():
    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except Exception:  # a virtualenv without these
        pass
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))))
    return tuple(os.path.abspath(d) + os.sep for d in dirs if d)


_LIBRARIES = _library_dirs()


def _kind(filename: str) -> str:
    """'student', 'course' (the course package, the guard excepted) or 'library'."""
    if filename.startswith("<"):
        return "library" if filename.startswith("<frozen") or filename == "<string>" else "student"
    path = os.path.abspath(filename)
    if path == _GUARD:
        return "library"  # the guard only passes calls on: an error there is the callee's
    if path.startswith(_PACKAGE + os.sep):
        return "course"
    if path.startswith(_LIBRARIES):
        return "library"
    return "student"


def _entries(tb):
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def _origin(err):
    """'student' when the innermost frame that is not a library's is the student's."""
    for tb in reversed(_entries(err.__traceback__)):
        kind = _kind(tb.tb_frame.f_code.co_filename)
        if kind != "library":
            return kind
    return "library"


def _student_tb(tb):
    """A new traceback holding only the student's entries of ``tb``, in order."""
    keep = [t for t in _entries(tb) if _kind(t.tb_frame.f_code.co_filename) == "student"]
    new = None
    for t in reversed(keep):
        new = types.TracebackType(new, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return new


def _cell_name(filename: str) -> str:
    try:
        ip = get_ipython()  # noqa: F821 - defined in IPython only
        number = ip.compile._filename_map.get(filename)
    except Exception:
        number = None
    if number is not None:
        return f"cell In[{number}]"
    if filename.startswith("<ipython-input-"):
        m = re.match(r"<ipython-input-(\d+)-", filename)
        if m:
            return f"cell In[{m.group(1)}]"
    return f"file {filename}"


def _where(tb) -> str:
    code = tb.tb_frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    return f"{_cell_name(code.co_filename)}, line {tb.tb_lineno}, in {name}"


def _line(tb) -> str:
    return linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_globals).strip()


def _tensors_on(line: str, frame) -> list[tuple[str, torch.Tensor]]:
    """The tensors named on ``line``: plain names, and ``self.name`` (looked up without running code)."""
    found, seen = [], set()
    for m in re.finditer(r"\b(self\.)?([A-Za-z_]\w*)\b", line):
        attr, name = m.group(1), m.group(2)
        key = (attr or "") + name
        if key in seen:
            continue
        seen.add(key)
        if attr:
            owner = frame.f_locals.get("self")
            value = getattr(owner, "__dict__", {}).get(name) if owner is not None else None
        elif name in frame.f_locals:
            value = frame.f_locals[name]
        else:
            value = frame.f_globals.get(name)
        if isinstance(value, torch.Tensor):
            found.append((key, value))
    return found


# The hint table: each row names one error and fires only on it (tests/grading/test_checks_hints.py tests every
# row on an error it must fire on and on one it must not). A row is ``fn(err, text, line, tensors, params)``,
# returning the hint or ''; ``tensors``: the tensors named on the line, ``params``: the parameter names
# of the student's function that raised.
_MATMUL_ERRORS = ("cannot be multiplied", "Expected size for first two dimensions", "Expected batch2",
                  "size mismatch, got input")
_BROADCAST_ERROR = re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at "
                              r"non-singleton dimension (-?\d+)")
_TRANSPOSED = r"(\.transpose\(\s*-2\s*,\s*-1\s*\)|\.transpose\(\s*-1\s*,\s*-2\s*\)|\.mT\b|\.T\b)?"
_OPERAND = r"(?<![\w.])([A-Za-z_][\w.]*?)" + _TRANSPOSED
_END = r"(?![\w.(\[])"  # (a right operand ends there: ``K.transpose(1, 2)`` or ``x[0]`` is not a name)
_PRODUCT = re.compile(_OPERAND + r"\s*@\s*" + _OPERAND + _END
                      + r"|\bmatmul\(\s*" + _OPERAND + r"\s*,\s*" + _OPERAND + r"\s*\)")


def _products(line: str, tensors) -> list:
    """The matrix products ``A @ B`` (or ``matmul(A, B)``) of named tensors on ``line``, as
    (text of A, its shape, text of B, its shape), the shapes after any ``.T``/``.mT``/``.transpose(-2, -1)``
    written on them. Products of expressions (``(x @ W) @ V``) are not seen."""
    known = dict(tensors)
    found = []
    for m in _PRODUCT.finditer(line):
        groups = m.groups()
        a, ta, b, tb = groups[:4] if groups[0] else groups[4:]
        if a not in known or b not in known:
            continue
        shapes = []
        for name, suffix in ((a, ta), (b, tb)):
            shape = tuple(known[name].shape)
            if suffix == ".T":
                shape = tuple(reversed(shape))
            elif suffix and len(shape) >= 2:
                shape = shape[:-2] + (shape[-1], shape[-2])
            shapes.append(shape)
        if len(shapes[0]) >= 2 and len(shapes[1]) >= 2:
            found.append((a + (ta or ""), shapes[0], b + (tb or ""), shapes[1]))
    return found


def _broadcasts(a: tuple, b: tuple) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _shapes_where(tensors) -> str:
    return "compare the shapes above" if tensors else "print the shapes of the tensors on that line"


def _hint_if_tensor(err, text, line, tensors, params):
    """``if mask:`` on a tensor argument that defaults to None."""
    if "Boolean value of Tensor with more than one value is ambiguous" not in text:
        return ""
    m = re.search(r"\b(?:if|elif|while)\s+(?:not\s+)?([A-Za-z_]\w*)\s*(?::|else\b)", line)
    if m and m.group(1) in params:
        name = m.group(1)
        return (f"`if {name}:` asks whether a whole tensor is true, which has no answer. To test whether the "
                f"optional argument was given, write `if {name} is not None:`.")
    return ""


def _hint_truth_value(err, text, line, tensors, params):
    """A tensor of several values used as one True/False, other than an optional argument's test."""
    if "Boolean value of Tensor with more than one value is ambiguous" not in text:
        return ""
    return ("Python asked a tensor of several values for one True or False (an `if`, `while`, `and`, `or`, "
            "`not` or `assert` on it): say which you mean, `(...).any()` or `(...).all()`.")


def _hint_view(err, text, line, tensors, params):
    if "view size is not compatible with input tensor's size and stride" not in text or ".view(" not in line:
        return ""
    return ("`.view` needs a tensor laid out in memory in its order, and a transposed tensor is not: use "
            "`.reshape(...)` (or `.contiguous().view(...)`).")


def _hint_super_init(err, text, line, tensors, params):
    if "before Module.__init__() call" in text or re.search(r"object has no attribute '_(modules|parameters|buffers)'", text):
        return ("your class's `__init__` must call `super().__init__()` first, before it creates any layer: "
                "that is what makes it an nn.Module.")
    return ""


def _hint_placeholder(err, text, line, tensors, params):
    if isinstance(err, NotImplementedError) and "raise NotImplementedError" in line:
        return "this is the exercise's placeholder: replace `raise NotImplementedError()` with your code."
    return ""


def _hint_T(err, text, line, tensors, params):
    """``x.T`` on a tensor of more than two dimensions, on a line that failed on a shape."""
    if not (any(s in text for s in _MATMUL_ERRORS) or _BROADCAST_ERROR.search(text)):
        return ""
    big = {n: t for n, t in tensors if t.dim() > 2}
    transposed = [n for n in re.findall(r"([\w.]+)\.T\b", line) if n in big]
    if not transposed:
        return ""
    n = transposed[0]
    shape = tuple(big[n].shape)
    return (f"`{n}.T` reverses every dimension of a tensor with more than two ({n} is {shape}, so "
            f"{n}.T is {tuple(reversed(shape))}); to swap the last two, write `{n}.transpose(-2, -1)`.")


def _hint_reshape(err, text, line, tensors, params):
    if "invalid for input of size" not in text:
        return ""
    return "a reshape keeps the number of entries: the sizes you ask for must multiply to the tensor's size."


def _hint_matmul(err, text, line, tensors, params):
    """A product whose inner dimensions differ: (..., n, k) @ (..., k, m)."""
    if not any(s in text for s in _MATMUL_ERRORS):
        return ""
    rule = "`A @ B` multiplies (..., n, k) by (..., k, m): A's last dimension must equal B's second-to-last"
    for a, sa, b, sb in _products(line, tensors):
        if sa[-1] == sb[-2]:
            continue
        if sb[-1] == sa[-1] and sb[-1] != sb[-2] and not b.endswith((".T", ".mT", ")")):
            return (f"{rule}. {a} is {sa} and {b} is {sb}: {b}'s last dimension is the one that fits, so "
                    f"transpose its last two, `{a} @ {b}.transpose(-2, -1)` (as in Q K^T).")
        return f"{rule}. {a} is {sa} and {b} is {sb}: {sa[-1]} against {sb[-2]}."
    layer = "" if re.search(r"@|matmul|\bmm\(|bmm\(", line) else (
        "; a layer nn.Linear(in_features, out_features) takes inputs whose last dimension is in_features")
    return f"{rule} ({_shapes_where(tensors)}{layer})."


def _hint_matmul_batch(err, text, line, tensors, params):
    """A product whose dimensions before the last two do not broadcast (heads, batch)."""
    if not _BROADCAST_ERROR.search(text):
        return ""
    for a, sa, b, sb in _products(line, tensors):
        if not _broadcasts(sa[:-2], sb[:-2]):
            return (f"`A @ B` pairs up the dimensions before the last two (batch, heads) as an elementwise "
                    f"operation does: each pair must be equal, or one of them 1. {a} is {sa} and {b} is {sb}, so "
                    f"{sa[:-2]} meets {sb[:-2]}.")
    return ""


def _hint_broadcast(err, text, line, tensors, params):
    """Two tensors broadcast together (elementwise, or the leading dimensions of a product) that do not fit."""
    m = _BROADCAST_ERROR.search(text)
    if not m:
        return ""
    a, b, dim = m.groups()
    return (f"two tensors on this line are combined entry by entry (an elementwise +, *, masked_fill..., or the "
            f"dimensions before the last two of a @), which lines up their dimensions from the right: each pair "
            f"must be equal, or one of them 1, and here {a} meets {b} (at dimension {dim} of the result); "
            f"{_shapes_where(tensors)}.")


def _hint_shapes(err, text, line, tensors, params):
    if not any(s in text for s in ("size mismatch", "shape mismatch", "not broadcastable", "inconsistent tensor size",
                                   "Sizes of tensors must match")):
        return ""
    return f"the shapes do not fit together: {_shapes_where(tensors)} to see which one is not what you expect."


HINTS = (
    ("optional tensor tested with if", _hint_if_tensor),
    ("tensor as a truth value", _hint_truth_value),
    ("view of a transposed tensor", _hint_view),
    ("no super().__init__()", _hint_super_init),
    ("the placeholder", _hint_placeholder),
    (".T on more than two dimensions", _hint_T),
    ("reshape to another size", _hint_reshape),
    ("matmul inner dimensions", _hint_matmul),
    ("matmul leading dimensions", _hint_matmul_batch),
    ("broadcasting", _hint_broadcast),
    ("shapes that do not fit", _hint_shapes),
)


def which_hint(err, line: str = "", tensors=(), params=()) -> tuple[str, str]:
    """(the hint row's name, its text) for the first row that fires on ``err``, or ('', '')."""
    text = str(err)
    for name, row in HINTS:
        h = row(err, text, line, tensors, tuple(params))
        if h:
            return name, h
    return "", ""


def hint(err, line: str = "", tensors=(), params=()) -> str:
    """A one-line hint for a known error, or ''."""
    return which_hint(err, line, tensors, params)[1]


def _hint_at(err, tb, line, tensors) -> tuple[str, str]:
    code = tb.tb_frame.f_code
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return which_hint(err, line, tensors, params)


def student_hint(err) -> tuple[str, str]:
    """(hint row, hint) for ``err`` at the student's innermost line, as ``explain`` gives it; ('', '')
    when ``err`` was not raised by the student's code."""
    if _origin(err) != "student":
        return "", ""
    inner = [t for t in _entries(err.__traceback__) if _kind(t.tb_frame.f_code.co_filename) == "student"][-1]
    line = _line(inner)
    return _hint_at(err, inner, line, _tensors_on(line, inner.tb_frame) if line else [])


def explain(err, typed: bool = False) -> str:
    """The student's cell and line that raised ``err``, the error, the shapes on that line and a hint;
    '' when ``err`` was not raised by the student's code. ``typed``: the first line names the
    error's type ("raised RuntimeError in your code at ..."), for a message of another type."""
    if _origin(err) != "student":
        return ""
    frames = [t for t in _entries(err.__traceback__) if _kind(t.tb_frame.f_code.co_filename) == "student"]
    inner = frames[-1]
    line = _line(inner)
    tensors = _tensors_on(line, inner.tb_frame) if line else []
    lines = [f"raised {type(err).__name__} in your code at {_where(inner)}:" if typed
             else f"raised by your code at {_where(inner)}:"]
    if line:
        lines.append(f"    {line}")
    if str(err):
        lines.append(str(err))
    if tensors:
        lines.append("Shapes on this line: " + ", ".join(f"{n} {tuple(t.shape)}" for n, t in tensors) + ".")
    h = _hint_at(err, inner, line, tensors)[1]
    if h:
        lines.append(f"Hint: {h}")
    for outer in reversed(frames[:-1][-3:]):
        lines.append(f"  (called from {_where(outer)}: {_line(outer)})")
    return "\n".join(lines)


def describe(err) -> str:
    """``err`` for a check's own message: "raised <type> in your code at <cell, line>: ..." with the
    line, shapes and hint when the student's code raised it, else "raised <type>: <message>"."""
    return explain(err, typed=True) or f"raised {type(err).__name__}: {err}"


class YourCodeFailed(Exception):
    """Raised instead of an error of the student's code whose type cannot carry a new message."""


def _retyped(err, message):
    """An exception of ``err``'s type (a subclass of it) whose text is ``message``."""
    cls = type(err)
    try:
        new_cls = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__str__": lambda self: message})
        new = new_cls(message)
    except Exception:
        new = YourCodeFailed(message)
    new._fp_explained = True
    return new


def student_facing(check):
    """Wrap a check: student-code errors name the student's line; tracebacks keep the student's frames only."""

    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 - read by IPython's traceback display
        try:
            return check(*args, **kwargs)
        except Exception as err:
            tb = err.__traceback__
            if not getattr(err, "_fp_explained", False):
                message = explain(err)
                if message:
                    new = _retyped(err, message)
                    raise new.with_traceback(_student_tb(tb) or _caller_tb(new)) from None
                err._fp_explained = True
            raise err.with_traceback(_student_tb(tb) or _caller_tb(err)) from None

    wrapper._fp_student_facing = True
    return wrapper


class _HiddenWhileItsCheckFails:
    """The ``__tracebackhide__`` of a notebook's namespace (that of its module-level cell frames): true
    only while IPython shows the failure of a check whose traceback ends with the test cell's frame
    again (``_caller_tb``); false for every other error, and in a debugger after the fact."""

    def __bool__(self):
        return bool(getattr(sys.exc_info()[1], "_fp_repeats_caller", False))

    def __repr__(self):
        return "<true while a course check's failure is shown>"


_HIDE_REPEATED_CALLER = _HiddenWhileItsCheckFails()


def _caller_tb(err=None):
    """A traceback entry for the caller of the check (the test cell): the last frame shown.

    Raised from the wrapper, the error's traceback is then (test cell, wrapper, test cell again):
    IPython 9 shows the last frame even when it is marked hidden, so the wrapper cannot be last,
    and the test cell would be shown twice around "[... skipping hidden 1 frame]". The first of the
    two is hidden instead: ``err`` is marked, and the cell's namespace gets a ``__tracebackhide__``
    that is true only while such an error is shown (IPython reads it from the frame's locals, which
    for a cell are the notebook's namespace)."""
    frame = sys._getframe(2)
    while frame is not None and getattr(frame.f_code, "co_name", "") == "wrapper" and frame.f_locals.get("__tracebackhide__"):
        frame = frame.f_back
    if frame is None:
        return None
    if err is not None and frame.f_code.co_name == "<module>" and _kind(frame.f_code.co_filename) == "student":
        try:
            err._fp_repeats_caller = True
            frame.f_globals.setdefault("__tracebackhide__", _HIDE_REPEATED_CALLER)
        except (AttributeError, TypeError):  # an error type that takes no attributes: shown twice
            pass
    return types.TracebackType(None, frame, frame.f_lasti, frame.f_lineno)


def wrap_checks(namespace: dict) -> None:
    """Wrap every public ``check_*`` function defined in a checks module (its globals)."""
    module = namespace.get("__name__")
    for name, value in list(namespace.items()):
        if (name.startswith("check_") and isinstance(value, types.FunctionType) and value.__module__ == module
                and not getattr(value, "_fp_student_facing", False)):
            namespace[name] = student_facing(value)


__all__ = ["describe", "explain", "hint", "student_hint", "which_hint", "student_facing", "wrap_checks", "YourCodeFailed"]
