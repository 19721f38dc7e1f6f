"""The trusted re-check's runner: a fresh interpreter that loads only the graded code.

    python -m firstprinciples.grading.recheck      (the grader starts it, sandboxed)

It reads one job (JSON) on standard input, before any student code runs: the
cells to load, in notebook order (the course's setup cells as the instructor
wrote them and the student cells that the graded pieces depend on, already turned
into plain Python), the pieces to probe and their secret cases, and a nonce. Then:

1. it imports torch, numpy and the probes, takes a ``snapshot`` of everything a
   cell could replace, and moves the report channel (standard output) to a private
   descriptor: whatever the student's code prints goes nowhere. Before any student code, it
   takes what it will use later (the probes, copied; the report function; the channel) and
   sends the ``baseline``: the identities of the functions each piece must not call, as this
   process holds them (the grader keeps them: nothing the student's code does later can change
   them);
2. it runs each cell in one namespace, as a kernel would (a cell that raises is
   reported and the next one runs; magics run their code once or do nothing), and
   records what each cell changed (``observe.changes``; these snapshots trust the dicts'
   version tags, so one more after the last cell reads every namespace: a write that put a
   tag back is seen there, before any piece runs. After a piece, such a write is missed: what
   a piece's run changes is only flagged for an instructor, it never voids a result);
3. it probes each piece (``runtime.report``: every case in its own watched window; a piece
   given the ``state`` its kernel ended with is first rebuilt from it, ``kernelstate``)
   and writes one line per piece as soon as it is done, so that a piece that hangs
   costs only itself (the grader kills the runner and starts another for the rest). Cases
   the job marks ``watched: false`` run without the watch, first, under a name of their own
   (``as``): the grader measures their memory from outside this process;
4. it ends with ``os._exit``: no ``atexit`` handler or finaliser of the student's runs.

Each line is ``MARK nonce JSON``. Nothing here is trusted and nothing here decides: the
runner reports what each case returned and what the watch saw, raw; the grader reads plain
data, refuses duplicates and malformed lines, judges which calls were forbidden with its own
tables, and compares results with its own reference (``trusted``). What code in this process
can still do (rewrite the report) is in docs/design/threat-model.md.
"""
from __future__ import annotations

import os
import signal
import sys

import gc

# What some notebooks' first calls import, too costly for the template's start (the check
# command's one notebook mostly never needs it): torch._dynamo, 0.9-1.3 s and 300 modules,
# imported by the first call of any torch function wrapped by ``torch._disable_dynamo`` (an
# optimizer's step: the capstone's kernels), or by a student's cell that imports it (the course's
# own dispatch mode, tiled attention's memory measure, opts out: ``memory.StorageSizes``).
# A grading process's trusted service that needed one asks the template to import it between
# two requests (``Template.preload``), so that every child forked after has it, as children
# have torch.
LAZY = ("torch._dynamo",)

_write, _exit, _dup, _dup2, _open, _fstat = os.write, os._exit, os.dup, os.dup2, os.open, os.fstat
_gc_disable = gc.disable


class Shell:
    """The little of IPython that a cell's Python needs (``%time``, ``%timeit``, ``!ls``)."""

    RUN_ONCE = ("time", "timeit", "prun", "capture")  # magics whose cell or line is run once

    def __init__(self, namespace):
        self.user_ns = namespace

    def _run(self, code: str):
        exec(compile(code, "<magic>", "exec"), self.user_ns)

    def run_line_magic(self, name, line, _stack_depth=1):
        if name in self.RUN_ONCE:
            self._run(_strip_options(line))
        return None

    def run_cell_magic(self, name, line, cell):
        if name in self.RUN_ONCE:
            self._run(cell)
        return None

    def system(self, *_a, **_k):
        return None

    def getoutput(self, *_a, **_k):
        return []

    def __getattr__(self, name):  # anything else a cell asks of the shell does nothing
        return lambda *a, **k: None


def _display(*objs, **kwargs):
    """IPython's ``display``: shows nothing here (the runner's output goes nowhere) and returns
    what IPython's does, None (a display handle only when asked for one, ``display_id``)."""
    return None


def ipython_names(shell) -> dict:
    """What a kernel's cell can use without importing it, so that an answer cell that uses it
    runs here as it ran in the kernel: IPython's builtins (``display``, ``get_ipython``) and the
    user namespace's history (``In``, ``Out``, ``_``, ``_i``... empty here: no cell of the
    runner is an input of IPython's)."""
    out: dict = {}
    names = {"display": _display, "get_ipython": lambda: shell,
             "In": [""], "Out": {}, "_ih": None, "_oh": None, "_dh": [os.getcwd()],
             "_": "", "__": "", "___": "", "_i": "", "_ii": "", "_iii": ""}
    names["_ih"], names["_oh"] = names["In"], names["Out"]
    out.update(names)
    return out


# ---------------------------------------------------------------- no new process
# A runner needs no process of its own: a child made by fork() would run what it likes unseen
# by the watch (which observes this process). A seccomp filter, set before any student code,
# refuses every new process and keeps threads (torch's, Python's): fork and vfork, and clone
# without CLONE_THREAD, fail with EPERM; clone3, whose flags a filter cannot read, fails with
# ENOSYS, so that glibc falls back to clone for its threads.
_ARCHES = {  # machine -> (AUDIT_ARCH_*, syscalls refused, clone, clone3)
    "x86_64": (0xC000003E, (57, 58), 56, 435),
    "aarch64": (0xC00000B7, (), 220, 435),
}
_CLONE_THREAD = 0x00010000


def allocate_plainly() -> bool:
    """Make the C allocator give large blocks back as soon as they are freed, so that the memory the
    grader reads from outside this process (``grading/resident.py``) is what the code holds, not what
    the allocator kept: glibc otherwise raises its threshold for mapping a block of its own after the
    first large block is freed, and then serves later large blocks from a heap that small blocks kept
    alive between them cannot shrink (measured: a correct tiled attention that keeps each key block's
    small partial result until the end grew by 173 MB without this, 25 MB with it). False where there is no glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 128 * 1024)) and bool(mallopt(M_TRIM_THRESHOLD, 128 * 1024))


def refuse_new_processes() -> bool:
    """Install the filter in this process (and every thread it starts later); False where the
    machine's architecture or kernel has no seccomp filter (then nothing changes: not Linux, or
    another architecture; docs/design/threat-model.md says so)."""
    import ctypes
    import platform
    import struct

    arch = _ARCHES.get(platform.machine())
    if arch is None or not sys.platform.startswith("linux"):
        return False
    audit, refused, clone, clone3 = arch
    ld_w_abs, jeq_k, jge_k, jset_k, ret_k = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(ld_w_abs, 0, 0, 4)]  # the architecture
    body = [(ld_w_abs, 0, 0, 0)]  # the system call's number
    body.append((jge_k, 0, 0, 0x40000000))  # x32's numbers: refused (jt patched below)
    for nr in refused:
        body.append((jeq_k, 0, 0, nr))  # -> EPERM
    body.append((jeq_k, 0, 0, clone3))  # -> ENOSYS
    body.append((jeq_k, 0, 0, clone))  # -> the flags
    # layout: prog[0], arch check, body..., [flags] ld args[0]; jset THREAD; ret ALLOW; ret EPERM; ret ENOSYS
    out = list(prog)
    n_body = len(body)
    base = 2  # after ld arch and its jeq
    flags_at = base + n_body
    allow_at, eperm_at, enosys_at = flags_at + 2, flags_at + 3, flags_at + 4
    out.append((jeq_k, 0, allow_at - 2, audit))  # another architecture's call: allowed as it is
    for i, (code, jt, jf, k) in enumerate(body):
        at = base + i
        if code == jge_k or (code == jeq_k and k in refused):
            jt, jf = eperm_at - at - 1, 0
        elif code == jeq_k and k == clone3:
            jt, jf = enosys_at - at - 1, 0
        elif code == jeq_k and k == clone:
            jt, jf = flags_at - at - 1, allow_at - at - 1
        out.append((code, jt, jf, k))
    out.append((ld_w_abs, 0, 0, 16))  # args[0], its low 32 bits: clone's flags
    out.append((jset_k, allow_at - (flags_at + 1) - 1, eperm_at - (flags_at + 1) - 1, _CLONE_THREAD))
    out += [(ret_k, 0, 0, allow), (ret_k, 0, 0, eperm), (ret_k, 0, 0, enosys)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in out)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fprog = Prog(len(out), ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.cast(ctypes.pointer(fprog), ctypes.c_void_p), 0, 0) == 0  # PR_SET_SECCOMP, FILTER


# The course's own implementations, never part of an answer: the reference, the checks, the models
# of the capstone and of the lengths chapter (the capstone's corpus and training loop are the
# notebook's to use: they import no model). A runner needs none of them (its probes are the
# declarations' adapters), so it refuses them: they are taken out of ``sys.modules`` and of their
# parent packages, and importing one raises ImportError. (Objects that other modules still hold,
# reached through ``gc`` or a module's attribute, are recognised when called: ``observe``'s tables
# hold their identities and places.)
COURSE_IMPLEMENTATIONS = ("firstprinciples.reference", "firstprinciples.checks", "firstprinciples.grading.probes.",
                          "firstprinciples.capstone.model", "firstprinciples.capstone.export",
                          "firstprinciples.capstone.sphinx_explorer", "firstprinciples.lengths")
# What the declared notebooks still import from those packages: the student-facing failure messages
# (``grading.declared`` uses them for the test cells' ``check``; no implementation of a piece).
STILL_IMPORTABLE = ("firstprinciples.checks", "firstprinciples.checks._student")


def refused(name: str) -> bool:
    if name in STILL_IMPORTABLE:
        return False
    return any(name == c or name.startswith(c if c.endswith(".") else c + ".") for c in COURSE_IMPLEMENTATIONS)


class _Refuse:
    """A finder first on ``sys.meta_path``: importing a course implementation raises ImportError."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if refused(name):
            raise ImportError(f"{name} is not available in the grader's re-check: the course's own implementations "
                              "are not part of an answer")
        return None


def refuse_course_implementations() -> list:
    """Take the course's implementations out of reach of ``import`` (see COURSE_IMPLEMENTATIONS);
    return the names taken out."""
    gone = sorted(n for n in list(sys.modules) if refused(n))
    for name in gone:
        sys.modules.pop(name, None)
        parent, _, attr = name.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], attr, None) is not None:
            try:
                delattr(sys.modules[parent], attr)
            except AttributeError:
                pass
    sys.meta_path.insert(0, _Refuse)
    return gone


class CellInterrupted(BaseException):
    """A loaded cell ran past its time limit (raised by the SIGALRM handler)."""


def _interrupt(signum, frame):
    raise CellInterrupted()


def _strip_options(line: str) -> str:
    """``-n 10 -r 3 f(x)`` -> ``f(x)`` (the options of %time and %timeit)."""
    parts = line.strip().split()
    i = 0
    while i < len(parts) and parts[i].startswith("-"):
        i += 1
        if i < len(parts) and parts[i - 1] in ("-n", "-r", "-p", "-o") and parts[i].isdigit():
            i += 1
    return " ".join(parts[i:]) if i else line


def main() -> None:
    import builtins
    import json
    from copy import copy as _copy

    import torch  # (imported before any student code)
    import torch.overrides

    from .. import exercises
    from . import observe, probes, runtime, wire

    job = json.loads(sys.stdin.buffer.read())
    refuse_new_processes()  # (before any student code: see above)
    allocate_plainly()
    nonce = str(job["nonce"])
    out = _dup(1)
    null = _open(os.devnull, os.O_RDWR)
    _dup2(null, 0)
    _dup2(null, 1)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    out_id = (_fstat(out).st_dev, _fstat(out).st_ino)

    mark, dumps = runtime.MARK, wire.dumps  # (taken before any student code, as everything below)

    def send(event: dict) -> None:
        st = _fstat(out)
        if (st.st_dev, st.st_ino) != out_id:
            _exit(3)  # the report channel was replaced: say nothing more
        data = ("\n" + mark + nonce + dumps(event) + "\n").encode()
        while data:
            data = data[_write(out, data):]

    names = [p["name"] for p in job["pieces"]]
    declared = exercises.by_piece()
    # Every piece's probe is its declaration's adapter (no reference: the runner never computes an
    # expected result); a name no declaration has is not run.
    registry = {n: probes.from_declaration(declared[n], resolve=False) for n in names if n in declared}
    # What the runner uses after student code has run, taken now, before: the probes themselves
    # (replacing an entry of the registry, or the module's ``report``, afterwards changes nothing
    # here), in a tuple (no item of it can be replaced).
    # (copies: no object a student's import can reach is used)
    pieces = tuple((p["name"], _copy(registry[p["name"]]), p["cases"], p.get("state"), str(p.get("as") or p["name"]),
                    p.get("watched", True) is not False) for p in job["pieces"] if p["name"] in registry)
    report = runtime.report
    # Before any student code: the identities of the functions each piece must not call, as this
    # process holds them. The grader keeps them; what the runner reports later is only what it
    # saw, matched there (a table emptied here afterwards changes nothing).
    send({"event": "baseline", "ids": {name: observe.identities(observe.forbidden_python(**probe.watch()))
                                       for name, probe, *_rest in pieces}})
    refuse_course_implementations()  # (after the baseline, which holds the forbidden functions' identities)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    shell = Shell(namespace)
    namespace.update(ipython_names(shell))

    def snapshot(previous=None):
        try:
            return observe.snapshot(previous if isinstance(previous, observe.Snapshot) else None)
        except Exception as e:  # the shared modules were changed into something that cannot be read
            return e

    def changes(before, after):
        try:
            if isinstance(after, Exception):
                raise after
            return observe.changes(before, after) if isinstance(before, observe.Snapshot) else []
        except Exception as e:
            return [f"sys.modules could not be read any more ({type(e).__name__})"]

    errors, changed = [], []
    # torch's table of its functions' names (the watch's patterns are matched against it) is built
    # at its first use: here, from torch's own namespaces, before any student's code could change
    # them (a warm runner has it from the template already)
    torch.overrides.resolve_name(torch.add)
    before = snapshot(observe.BASELINE)  # (before any student code: what the template left, re-read where it changed)
    for cell in job["cells"]:
        limit = cell.get("timeout")
        try:
            # as the kernel interrupts a cell that runs past its timeout: what it defined before stays
            if isinstance(limit, (int, float)) and limit > 0:
                signal.signal(signal.SIGALRM, _interrupt)
                signal.setitimer(signal.ITIMER_REAL, float(limit))
            try:
                exec(compile(cell["source"], f"{observe.CELL_PREFIX}{cell['label']}>", "exec"), namespace)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except CellInterrupted:
            errors.append({"cell": cell["label"], "error": f"it did not finish within {limit:g} s and was interrupted"})
        except BaseException as e:  # noqa: B036 (a cell's SystemExit or KeyboardInterrupt too)
            errors.append({"cell": cell["label"], "error": f"{type(e).__name__}: {str(e)[:300]}"})
        after = snapshot(before)
        found = changes(before, after)
        if found:
            changed.append({"cell": cell["label"], "changes": found[:20]})
        before = after
    # Once more, reading every namespace (no dict's version tag trusted): a write that put a
    # dict's tag back (ctypes) is seen here, if not in the cell that made it.
    after = snapshot(None)
    found = changes(before, after)
    if found:
        changed.append({"cell": "a loaded cell (by a write hidden from the interpreter)", "changes": found[:20]})
    before = after
    send({"event": "loaded", "errors": errors, "changes": changed, "imported": [m for m in LAZY if m in sys.modules]})
    _gc_disable()  # from here on, finalisers run only inside the watched windows (runtime.report collects there)

    for name, probe, cases, state, as_, watched in pieces:
        try:
            result = report(namespace, name, cases, state, probe, watched)
        except BaseException as e:  # noqa: B036 (the runner itself was broken by the student's code)
            result = {"name": name, "broken": f"{type(e).__name__}: {str(e)[:300]}"}
        result["name"] = as_  # (a piece's cases run apart, ``alone``, are reported under a name of their own)
        after = snapshot(before)
        found = changes(before, after)
        before = after
        result["changes"] = found[:20]
        send({"event": "piece", **result})
    send({"event": "done"})
    _exit(0)


if __name__ == "__main__":
    main()
