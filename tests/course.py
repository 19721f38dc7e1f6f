"""Helpers for tests that work on the course's notebooks and nbgrader."""
from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"


def source_notebooks():
    return sorted(SOLUTIONS.glob("*/*.ipynb"))


def released_notebooks():
    return sorted(EXERCISES.glob("*/*.ipynb"))


def assignments():
    return sorted(p.name for p in SOLUTIONS.iterdir() if p.is_dir() and list(p.glob("*.ipynb")))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def nbgrader_meta(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


def grade_cells(nb):
    return [c for c in nb.cells if nbgrader_meta(c).get("grade")]


def answer_cells(nb):
    return [c for c in nb.cells if nbgrader_meta(c).get("solution") and c.cell_type == "code"]


def defined_names(source: str):
    """Top-level function and class names defined by a cell."""
    tree = ast.parse(source)
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


# ---- submissions: a released notebook filled with answers ----

# An attention that forgets the 1/sqrt(d_k) scaling: a partially correct answer.
NO_SCALING = '''
import torch

def scaled_dot_product_attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return weights @ V, weights
'''


def solution_answers(source_nb):
    """The solution notebook's answer cells (by grade_id), without the solution markers."""
    return {
        nbgrader_meta(c)["grade_id"]: re.sub(r"^\s*### (BEGIN|END) SOLUTION\n", "", c.source, flags=re.M)
        for c in answer_cells(source_nb)
    }


def fill(released, answers):
    """A copy of the released notebook whose answer cells named in ``answers`` (by grade_id) hold them."""
    nb = nbformat.from_dict(released)
    for cell in answer_cells(nb):
        gid = nbgrader_meta(cell)["grade_id"]
        if gid in answers:
            cell.source = answers[gid]
    return nb


def make_course(tmp: Path) -> Path:
    """A fresh course folder: the repo's nbgrader_config.py and solutions/."""
    course = tmp / "course"
    course.mkdir()
    shutil.copy(ROOT / "nbgrader_config.py", course)
    shutil.copytree(SOLUTIONS, course / "solutions", ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return course


def scratch(course: Path) -> Path:
    """The temporary folder of this course's grading runs: the sandboxes' sockets and
    connection files live there, so this course's kernels can be told from others'."""
    return course.parent / "tmp"


def nbgrader(course: Path, *args: str, timeout: float = 900, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run a plain `nbgrader` command in the course folder, with extra environment
    variables ``env``; with ``check``, fail loudly unless it succeeds."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("NBGRADER")}
    scratch(course).mkdir(exist_ok=True)
    full["TMPDIR"] = str(scratch(course))
    full.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args],
        cwd=course, env=full, capture_output=True, text=True, timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc


def as_student_code(obj, _making=()):
    """A course reference as a student would have it: compiled from its source text in a
    notebook cell of its own (the trusted re-check recognises the reference by where its
    code comes from, so ``reference.X.__wrapped__`` counts as the course's own code)."""
    import inspect
    import textwrap

    target = inspect.unwrap(obj)
    lines = textwrap.dedent(inspect.getsource(target)).splitlines()
    # (a method's mark too: the reference KVCache marks its append)
    source = "\n".join(line for line in lines if not line.lstrip().startswith("@reference_piece"))
    namespace = dict(sys.modules[target.__module__].__dict__)
    # the course's other pieces that it uses, as a student would have them too (the KV cache's step
    # uses attention, split_heads, merge_heads; its generate uses KVCache and the step)
    # (``_making``: the pieces being copied already, so that two that use each other end)
    for name, value in list(namespace.items()):
        if (name != target.__name__ and _marked_piece(value) and inspect.unwrap(value) not in _making
                and re.search(rf"\b{name}\b", source)):
            namespace[name] = as_student_code(value, (*_making, target))
    exec(compile(source, f"<cell {target.__name__!r}>", "exec"), namespace)
    return namespace[target.__name__]


def _marked_piece(value) -> bool:
    """A function or class of ``firstprinciples.reference`` marked with ``reference_piece`` (a class
    through one of its methods)."""
    if not str(getattr(value, "__module__", "")).startswith("firstprinciples.reference"):
        return False
    if isinstance(value, type):
        return any(hasattr(v, "__wrapped__") for v in vars(value).values())
    return callable(value) and hasattr(value, "__wrapped__")


def _recoded(code):
    """``code`` as if compiled from a student's cell: another file name and constants of its own (a
    marker appended), nested code included; the bytecode and behaviour unchanged."""
    import types

    consts = tuple(_recoded(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename="<answer>", co_consts=(*consts, "<answer>"))


def as_answer(obj):
    """A declared mistake (a function or a class of a declaration, ``firstprinciples.exercises.<name>``)
    as a student's own code: the same behaviour, not the course's objects. The re-check forbids the
    declarations' own code (mistakes, and the correct helpers some are built on) except the adapters:
    an answer must not borrow them. The harness grades a mistake's behaviour, as a student who wrote
    it would be graded: so every function and class of its module, and of every other declaration
    module it reaches (the capstone's mistakes are built on transformer_block's correct attention), is
    copied, recoded (``_recoded``), into a namespace of copies per module, and the copy of ``obj`` is
    returned. Anything else is returned as it is."""
    import types

    prefix = "firstprinciples.exercises."
    if not str(getattr(obj, "__module__", "")).startswith(prefix) or not isinstance(obj, (type, types.FunctionType)):
        return obj
    namespaces: dict = {}  # module name -> the namespace of its copies
    copies: dict = {}

    def ours(value) -> bool:
        return isinstance(value, (type, types.FunctionType)) and str(getattr(value, "__module__", "")).startswith(prefix)

    def namespace_of(module: str) -> dict:
        if module not in namespaces:
            namespaces[module] = namespace = dict(sys.modules[module].__dict__)  # (first: a module reached again
            for key, value in list(namespace.items()):                          # while it is copied finds it)
                namespace[key] = copy(value)
        return namespaces[module]

    def function(f, class_cells=None):
        code = _recoded(f.__code__)
        cells = []
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            if name == "__class__" and class_cells is not None:  # (zero-argument super() finds the class here)
                cell = types.CellType()
                class_cells.append(cell)
            else:
                try:
                    inner = cell.cell_contents
                except ValueError:  # (an empty cell)
                    inner = None
                if ours(inner):
                    cell = types.CellType(copy(inner))
            cells.append(cell)
        new = types.FunctionType(code, namespace_of(f.__module__), f.__name__, f.__defaults__, tuple(cells) or None)
        new.__kwdefaults__ = f.__kwdefaults__
        return new

    def copy(value):
        if not ours(value):
            return value
        if value.__module__ not in namespaces:  # (its module's copies first: one copy of each object)
            namespace_of(value.__module__)
        if id(value) in copies:
            return copies[id(value)]
        if isinstance(value, types.FunctionType):
            copies[id(value)] = value  # (a closure that holds itself keeps the original)
            copies[id(value)] = function(value)
            return copies[id(value)]
        class_cells: list = []
        body = {k: function(v, class_cells) if isinstance(v, types.FunctionType) else v
                for k, v in vars(value).items() if k not in ("__dict__", "__weakref__")}
        new = type(value)(value.__name__, tuple(copy(b) for b in value.__bases__), body)
        for cell in class_cells:
            cell.cell_contents = new
        copies[id(value)] = new
        return new

    return copy(obj)


def with_answer(nb, grade_id: str, source: str):
    """A copy of ``nb`` whose answer cell ``grade_id`` holds ``source``."""
    nb = nbformat.from_dict(nb)
    cells = [c for c in answer_cells(nb) if nbgrader_meta(c)["grade_id"] == grade_id]
    assert len(cells) == 1, f"no single answer cell {grade_id}"
    cells[0].source = source
    return nb


@contextlib.contextmanager
def fresh_template():
    """A warm template of this process's own with nothing asked of it yet (the one before is put back
    after), and every trusted service closed at the end."""
    from firstprinciples.grading import verdicts, warm

    key = (os.getpid(), False)
    earlier = warm.Template._current.pop(key, None)
    template = warm.Template.get(False)
    try:
        yield template
    finally:
        for service in list(verdicts.Service._current.values()):
            service.close()
        template.close()
        if earlier is not None:
            warm.Template._current[key] = earlier
