"""Running one probe on a notebook's object, watched: the core of the re-check's runner.

``report(namespace, name, cases)`` looks the probe's object up in ``namespace``,
runs the probe's ``run`` on every case inside a ``observe.Watch`` and returns plain
data only (``wire``): the outputs and what the watch saw (operators, torch functions,
Python functions, switched-off observers, threads), raw. Nothing here decides: which
calls are forbidden is judged by the grader (``trusted``), with its own tables.
It runs in the re-check's fresh interpreter (``recheck``) and, for the tests of
the probes, in the test process itself (``trusted.local_verdicts``).
"""
from __future__ import annotations

import gc

from . import observe, probes, wire

MARK = wire.MARK
# captured when the runner starts, before any student code: rebinding these later changes nothing here
_gc_disable, _gc_enable, _gc_isenabled, _gc_collect = gc.disable, gc.enable, gc.isenabled, gc.collect
_CELL_PREFIX = observe.CELL_PREFIX
_Watch, _Codes, _load, _decode_case, _encode = (observe.Watch, observe.Codes, probes.load, probes.decode_case,
                                                wire.encode)
_decode_array = probes._decode


class _Unwatched:
    """In place of the watch, for a case measured from outside the runner (``watched=False``)."""

    tampered = threads = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def measured(self):
        pass

    def raw(self, codes):
        return {}


def report(namespace: dict, name: str, cases: list, state: dict | None = None, probe=None,
           watched: bool = True) -> dict:
    """Run probe ``name`` on ``namespace[name]`` for every encoded case: plain data only.
    ``watched=False``: without the watch (the grader measures these cases' memory from outside, and
    they can only fail a test: trusted.run_runner).

    ``state`` (key -> encoded array: the parameters the kernel's object ended with): the object is
    instead ``probe.rebuild(namespace, state)``, built inside the first case's watched window (a
    rebuild that raises is that case's error, and every later case's)."""
    probe = _load()[name] if probe is None else probe  # (the runner hands the probe it took before any student code)
    built: dict = {}
    if state is not None:
        if probe.rebuild is None:
            return {"name": name, "broken": "this piece is not rebuilt from a kernel's state"}

        def target():
            if "obj" not in built:
                built["obj"] = None  # (a rebuild that raised is not tried again)
                params = {k: _decode_array(v) for k, v in state.items()}
                built["obj"] = probe.rebuild(namespace, params)
            if built["obj"] is None:
                raise RuntimeError("the trained object could not be rebuilt from the kernel's parameters")
            return built["obj"]
    elif name not in namespace:
        return {"name": name, "missing": True}
    else:
        obj = namespace[name]

        def target():
            return obj
    codes = _Codes()
    results = []
    for enc in cases:
        case = _decode_case(enc)
        was_enabled = _gc_isenabled()
        _gc_disable()  # no __del__ of student objects runs outside a watched window
        kept = []
        try:
            watch = (_Watch(memory="memory" in case.get("tags", ()) and probe.memory is not None) if watched
                     else _Unwatched())
            with watch as seen:
                try:
                    obj = target()
                except (Exception, SystemExit) as e:  # the object could not be had (a rebuild from the
                    # kernel's parameters failed): no secret input was involved, so its message is kept
                    entry = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                else:
                    try:
                        out = probe.run(obj, case, namespace) if getattr(probe, "needs", ()) else probe.run(obj, case)
                        kept.append(out)
                        watch.measured()  # (the memory the piece held; not the encoding's below)
                        entry = {"outputs": {k: _encode(v) for k, v in out.items()}}
                    except (Exception, SystemExit) as e:  # the answer's fault on a secret case: graded 0
                        entry = {"error": _raised(e), "secret": True}
                _gc_collect(0)  # finalisers of this case's objects run now, watched (with gc off, all are young)
        finally:
            if was_enabled:
                _gc_enable()
        entry["seen"] = seen.raw(codes)
        entry["tampered"] = sorted(set(seen.tampered))
        entry["threads"] = sorted(set(seen.threads))[:5]
        results.append(entry)
    return {"name": name, "results": results, "codes": codes.table}


def _raised(e: BaseException) -> str:
    """What the report says of an error raised on a secret case: the exception's class (a
    built-in's or torch's by name, a class the answer made as such: its name could be made of the
    inputs) and the answer's innermost line, never its message, which the answer controls and
    which could carry the secret inputs into the feedback."""
    cls = type(e)
    module = getattr(cls, "__module__", "") or ""
    if module == "builtins" or module == "torch" or module.startswith("torch."):
        what = f"{module}.{cls.__qualname__}".removeprefix("builtins.")
    else:
        what = "an exception of a class of your code's"
    line = None
    tb = e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith(_CELL_PREFIX):
            line = f"{name[len(_CELL_PREFIX):-1]}, line {tb.tb_lineno}"
        tb = tb.tb_next
    return f"{what[:80]}" + (f" ({line})" if line else "")
