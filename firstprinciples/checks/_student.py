"""Failures told in terms of the student's own code.

When a check fails because the student's code raised, the student needs the
cell and line that raised, not a traceback through the checks, the guard and
torch's internals. ``student_facing`` wraps each public check so that

- an exception raised by the student's code is re-raised (same type) with a
  message that starts with the student's cell, line and source text, then the
  original error, the shapes of the tensors named on that line and, for a
  known mistake (``if mask:``, ``.T`` on four dimensions, ``.view`` after a
  transpose, a matmul of mismatched shapes, a missing ``super().__init__()``),
  a one-line hint;
- the traceback of any failure keeps only the student's frames (the check's
  own frames, the guard's and the libraries' are cut). The one frame left of
  the course's is marked ``__tracebackhide__``, which IPython 8 hides.

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


_SHAPE_ERRORS = ("must match the size of tensor", "cannot be multiplied", "Expected size for first two dimensions",
                 "size mismatch", "shape mismatch", "not broadcastable", "Expected batch2", "inconsistent tensor size")


def hint(err, line: str = "", tensors=()) -> str:
    """A one-line hint for a known error, or ''."""
    text = str(err)
    if "Boolean value of Tensor with more than one value is ambiguous" in text:
        m = re.search(r"\b(?:if|elif|while)\s+(?:not\s+)?([\w.]+)\s*:", line)
        name = m.group(1) if m else "mask"
        return (f"`if {name}:` asks whether a whole tensor is true, which has no answer. To test whether the optional "
                f"argument was given, write `if {name} is not None:`.")
    if "view size is not compatible with input tensor's size and stride" in text:
        return ("`.view` needs a tensor laid out in memory in its order, and a transposed tensor is not: use "
                "`.reshape(...)` (or `.contiguous().view(...)`).")
    if "before Module.__init__() call" in text or re.search(r"object has no attribute '_(modules|parameters|buffers)'", text):
        return ("your class's `__init__` must call `super().__init__()` first, before it creates any layer: "
                "that is what makes it an nn.Module.")
    if isinstance(err, NotImplementedError) and "raise NotImplementedError" in line:
        return "this is the exercise's placeholder: replace `raise NotImplementedError()` with your code."
    if any(s in text for s in _SHAPE_ERRORS) or "invalid for input of size" in text:
        big = {n for n, t in tensors if t.dim() > 2}
        transposed = [n for n in re.findall(r"([\w.]+)\.T\b", line) if n in big]
        if transposed:
            n = transposed[0]
            shape = dict(tensors)[n].shape
            return (f"`{n}.T` reverses every dimension of a tensor with more than two ({n} is {tuple(shape)}, so "
                    f"{n}.T is {tuple(reversed(shape))}); to swap the last two, write `{n}.transpose(-2, -1)`.")
        if "invalid for input of size" in text:
            return "a reshape keeps the number of entries: the sizes you ask for must multiply to the tensor's size."
        if "@" in line or "matmul" in line or "bmm" in line:
            return ("`A @ B` multiplies the last two dimensions, (..., n, k) @ (..., k, m), and broadcasts the "
                    "leading ones (batch, heads): compare the shapes below. For Q K^T write `K.transpose(-2, -1)`.")
        return "the shapes below do not fit together; print them in your code to see which one is not what you expect."
    return ""


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
    h = hint(err, line, tensors)
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
                    raise new.with_traceback(_student_tb(tb) or _caller_tb()) from None
                err._fp_explained = True
            raise err.with_traceback(_student_tb(tb) or _caller_tb()) from None

    wrapper._fp_student_facing = True
    return wrapper


def _caller_tb():
    """A traceback entry for the caller of the check (the test cell): the last frame shown."""
    frame = sys._getframe(2)
    while frame is not None and getattr(frame.f_code, "co_name", "") == "wrapper" and frame.f_locals.get("__tracebackhide__"):
        frame = frame.f_back
    if frame is None:
        return None
    return types.TracebackType(None, frame, frame.f_lasti, frame.f_lineno)


def wrap_checks(namespace: dict) -> None:
    """Wrap every public ``check_*`` function defined in a checks module (its globals)."""
    module = namespace.get("__name__")
    for name, value in list(namespace.items()):
        if (name.startswith("check_") and isinstance(value, types.FunctionType) and value.__module__ == module
                and not getattr(value, "_fp_student_facing", False)):
            namespace[name] = student_facing(value)


__all__ = ["describe", "explain", "hint", "student_facing", "wrap_checks", "YourCodeFailed"]
