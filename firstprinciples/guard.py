"""Detect calls to built-ins that an exercise asks the student to write.

An exercise such as "implement softmax" is pointless if the answer calls
``torch.softmax``.  ``forbid`` watches a call to the student's code and records
every forbidden function it reaches:

* torch functions, methods and modules are seen through a ``TorchFunctionMode``
  (which catches ``torch.softmax``, ``Tensor.softmax``, ``F.softmax``,
  ``torch.ops.aten._softmax`` and ``nn.Softmax`` alike, however they are named);
* the course's own reference implementations are wrapped by ``reference_piece``
  and report themselves while a ``forbid`` naming them is active.

The record is kept outside the student's code, so an answer that catches the
resulting exception still fails the check that inspects the record.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings

from torch.overrides import TorchFunctionMode, resolve_name

_state = threading.local()


def _active_watchers():
    return getattr(_state, "watchers", [])


class _Watcher(TorchFunctionMode):
    def __init__(self, torch_patterns, pieces):
        super().__init__()
        self.torch_patterns = tuple(torch_patterns)
        self.pieces = frozenset(pieces)
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        if any(p in name for p in self.torch_patterns):
            self.hits.append(name)
        return func(*args, **(kwargs or {}))


class ForbiddenCall(AssertionError):
    """Raised when an answer calls what it was asked to implement."""


_HERE = os.path.abspath(__file__)
_PASSING_ON = (_HERE, os.path.abspath(warnings.__file__))  # frames that only pass a call or a warning on


def _torch_dir():
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _caller_of_torch():
    """The innermost frame that is neither this module's, the warnings module's nor torch's: the
    line that called torch (the student's, when the guard watches the student's code)."""
    torch_dir = _torch_dir()
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path not in _PASSING_ON and not path.startswith(torch_dir):
            return frame
        frame = frame.f_back
    return None


@contextlib.contextmanager
def _warnings_at_the_callers_line():
    """While the watcher runs torch's functions, a warning they raise (torch's ``x.T`` deprecation,
    "implicit dimension choice for softmax") is issued from the watcher's frame, here, and would be
    shown as this file's: it is shown at the line that called torch instead. Warnings go through
    ``warnings._showwarnmsg`` both to the screen (IPython's ``showwarning`` included) and to
    ``catch_warnings(record=True)``, so the place is changed there, before either sees it."""
    original = warnings._showwarnmsg

    def show(msg):
        if isinstance(msg.filename, str) and os.path.abspath(msg.filename) == _HERE:
            frame = _caller_of_torch()
            if frame is not None:
                msg.filename, msg.lineno, msg.line = frame.f_code.co_filename, frame.f_lineno, None
        original(msg)

    warnings._showwarnmsg = show
    try:
        yield
    finally:
        warnings._showwarnmsg = original


@contextlib.contextmanager
def forbid(torch_patterns=(), pieces=()):
    """Record calls to torch functions whose qualified name contains one of
    ``torch_patterns`` and to the course reference implementations in ``pieces``.

    Yields the list of hits; it is complete when the ``with`` block ends.
    """
    watcher = _Watcher(torch_patterns, pieces)
    _state.watchers = _active_watchers() + [watcher]
    try:
        with watcher, _warnings_at_the_callers_line():
            yield watcher.hits
    finally:
        _state.watchers = [w for w in _active_watchers() if w is not watcher]


def _record(name):
    for w in _active_watchers():
        if name in w.pieces:
            w.hits.append(f"firstprinciples.reference.{name}")


def reference_piece(name):
    """Mark a reference implementation so that ``forbid(pieces=[name])`` sees it.

    Decorates a function, or a class (an ``nn.Module``): for a class, building
    it or calling its ``forward`` while the watcher is active is reported.
    """

    def decorate(obj):
        if isinstance(obj, type):
            init, forward = obj.__init__, obj.forward

            @functools.wraps(init)
            def watched_init(self, *args, **kwargs):
                _record(name)
                init(self, *args, **kwargs)

            @functools.wraps(forward)
            def watched_forward(self, *args, **kwargs):
                _record(name)
                return forward(self, *args, **kwargs)

            obj.__init__, obj.forward = watched_init, watched_forward
            return obj

        @functools.wraps(obj)
        def wrapper(*args, **kwargs):
            _record(name)
            return obj(*args, **kwargs)

        return wrapper

    return decorate


def call_without(fn, args, kwargs=None, *, torch_patterns=(), pieces=(), what=""):
    """Call ``fn(*args, **kwargs)`` and fail if it used a forbidden built-in."""
    with forbid(torch_patterns, pieces) as hits:
        try:
            result = fn(*args, **(kwargs or {}))
        except ForbiddenCall:
            raise
        except Exception:
            if hits:
                _raise_forbidden(hits, what)
            raise
    if hits:
        _raise_forbidden(hits, what)
    return result


def _raise_forbidden(hits, what):
    seen = ", ".join(sorted(set(hits)))
    raise ForbiddenCall(
        f"Your answer calls {seen}. This exercise asks you to build {what or 'this piece'} "
        "yourself, so this check scores 0."
    )


__all__ = ["forbid", "reference_piece", "call_without", "ForbiddenCall"]
