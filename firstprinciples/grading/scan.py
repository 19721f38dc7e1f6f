"""Reading a notebook's cells, done by the trusted grader: who owns each cell, and
which cells a graded piece depends on.

Nothing here decides a grade. Grades are decided by what the code does
(``observe``, ``recheck``, ``trusted``); this module only chooses *which* code
the trusted re-check loads: for a piece such as ``softmax``, the cells that
define it and, transitively, every name they use (helpers in cells of their own,
constants, the course's imports), plus the cells that set attributes on those
names (``MyAttention.helper = helper``). The choice is generous on purpose: a
missed dependency costs a second run with every non-test cell (when a test cell
that uses the piece passed in the kernel: else no point depends on it), never a point.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field


@dataclass
class CellInfo:
    index: int
    label: str
    student: bool
    tree: ast.AST | None
    python: str = ""  # the Python that IPython would run for the cell
    defines: set = field(default_factory=set)
    loads: set = field(default_factory=set)
    mutates: set = field(default_factory=set)  # names whose attributes or items the cell sets at top level


def python_source(source: str) -> str:
    """The Python that IPython runs for a cell (magics and ``!`` become ``get_ipython()`` calls)."""
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        return TransformerManager().transform_cell(source)
    except Exception:  # an unusual cell IPython cannot transform: it fails as it would in a kernel
        return source


# What ast and symtable raise for a cell that Python cannot compile: a syntax error, a NUL byte, an
# expression nested too deeply (RecursionError, or MemoryError from the parser itself). The kernel
# cannot run such a cell either; here it defines and reads nothing, and the analysis goes on.
UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)


def parse(source: str) -> ast.AST | None:
    try:
        return ast.parse(python_source(source))
    except UNPARSABLE:
        return None  # it cannot run in the kernel either


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def top_level_names(tree: ast.AST) -> set:
    """Names a cell binds in the notebook's namespace (also inside top-level if/for/while/with/try)."""
    names = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
                continue
            for child in ast.walk(node):
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    names.add(child.id)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(child.name)
                elif isinstance(child, ast.Global):
                    names.update(child.names)

    visit(getattr(tree, "body", []))
    return names


def mutated_names(tree: ast.AST) -> set:
    """Names whose attributes or items a cell sets outside its functions (``Cls.attr = ...``,
    ``setattr(Cls, ...)``, ``table[k] = ...``)."""
    out = set()
    for node in getattr(tree, "body", []):
        for child in ast.walk(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, (ast.Attribute, ast.Subscript)) and isinstance(child.ctx, (ast.Store, ast.Del)):
                root = _root(child)
                if root:
                    out.add(root)
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                  and child.func.id in ("setattr", "delattr") and child.args):
                root = _root(child.args[0])
                if root:
                    out.add(root)
    return out


def loaded_names(tree: ast.AST) -> set:
    """Every name the cell's code reads, in any scope."""
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def global_uses(source: str, tree: ast.AST) -> set:
    """The names a cell reads from the notebook's namespace: at its top level, and inside its
    functions and classes the names that are not their own parameters or locals."""
    import symtable

    try:
        table = symtable.symtable(source, "<cell>", "exec")
    except UNPARSABLE:
        return loaded_names(tree)
    out = set()
    todo = [table]
    while todo:
        scope = todo.pop()
        todo.extend(scope.get_children())
        for sym in scope.get_symbols():
            if not sym.is_referenced():
                continue
            if scope.get_type() == "module" or sym.is_global() or (scope.get_type() == "class" and not sym.is_assigned()):
                out.add(sym.get_name())
    return out


def cell_infos(nb, course_sources: set | None = None) -> list[CellInfo]:
    """Every code cell, parsed, and whether the student controls it.

    A cell is the course's when its source is one of ``course_sources`` (the
    locked and test cells of the instructor's source notebook); without them, the
    notebook's own nbgrader metadata decides (for a student checking their work).
    """
    infos = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if not isinstance(meta, dict):
            meta = {}
        if course_sources is not None:
            student = cell.source not in course_sources
        else:
            student = bool(meta.get("solution")) or not (meta.get("locked") or meta.get("grade"))
        number = sum(1 for c in nb.cells[:i + 1] if c.cell_type == "code")
        label = f"cell {meta['grade_id']!r}" if meta.get("grade_id") else f"code cell {number}"
        python = python_source(cell.source)
        try:
            tree = ast.parse(python)
        except UNPARSABLE:
            tree = None
        info = CellInfo(i, label, student, tree, python)
        if tree is not None:
            try:
                info.defines = top_level_names(tree)
                info.loads = global_uses(python, tree)
                info.mutates = mutated_names(tree)
            except UNPARSABLE:  # (a tree too deep to walk: the cell cannot be compiled either)
                info.tree = None
                info.defines, info.loads, info.mutates = set(), set(), set()
        infos.append(info)
    return infos


# What reaches into the interpreter's own state or the grader's code. The re-check's runner runs the
# student's code in its own process (it must, to call it): code that walks frames, the garbage
# collector's objects or code objects, or imports the grader, can in principle rewrite what the
# runner reports. Such code is rare in an answer and is flagged for an instructor to read (never
# scored down here: a grade is what the code does). See docs/design/threat-model.md.
INTERNAL_MODULES = ("gc", "ctypes", "inspect", "importlib", "marshal", "dis", "code", "codeop", "mmap",
                    "firstprinciples.grading", "firstprinciples.reference", "firstprinciples.checks")
INTERNAL_ATTRIBUTES = frozenset({
    "__code__", "__globals__", "__closure__", "__defaults__", "__kwdefaults__", "__builtins__",
    "__subclasses__", "__traceback__", "__wrapped__", "tb_frame", "tb_next", "f_back", "f_locals", "f_globals",
    "f_code", "gi_frame", "cr_frame", "ag_frame", "cell_contents", "_getframe", "_current_frames", "setprofile",
    "settrace", "FunctionType", "CodeType", "_disable_profiler", "_DisableTorchDispatch", "DisableTorchFunction",
    "_DisableTorchFunction", "_DisableTorchFunctionSubclass", "fork", "forkpty", "dup2"})
INTERNAL_NAMES = frozenset({"__import__", "exec", "eval", "globals", "breakpoint"})


def internals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each construct of the cell that reaches the interpreter's or the grader's
    internals (``INTERNAL_*``): an import of such a module, such an attribute or name, and
    ``getattr``/``setattr``/``delattr`` of a module with a name that is not written out."""
    out = []
    modules = {"sys", "os", "builtins", "__builtins__", "torch"}  # (and every name the cell imports)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules |= {(a.asname or a.name).partition(".")[0] for a in node.names}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.module in ("firstprinciples", "sys", "torch.autograd"):
                modules += [f"{node.module}.{a.name}" for a in node.names]
            for m in modules:
                if any(m == r or m.startswith(r + ".") for r in INTERNAL_MODULES) or m in ("sys._getframe",):
                    out.append((line, f"import {m}"))
        elif isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRIBUTES:
            out.append((line, node.attr))
        elif isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            out.append((line, "sys.modules"))
        elif isinstance(node, ast.Name) and node.id in INTERNAL_NAMES:
            out.append((line, node.id))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "delattr") and len(node.args) >= 2 and \
                not isinstance(node.args[1], ast.Constant) and isinstance(node.args[0], ast.Name) and \
                node.args[0].id in modules:  # (a module's attribute by a computed name; an object's is common)
            out.append((line, f"{node.func.id} with a computed name"))
    return sorted(set(out))


def internals_flags(infos: list[CellInfo]) -> list[str]:
    """A flag for each student cell that reaches into internals (``internals``), naming what and where."""
    flags = []
    for info in infos:
        if not info.student or info.tree is None:
            continue
        try:
            found = internals(info.tree)
        except RecursionError:  # pragma: no cover (a tree too deep to walk)
            continue
        if found:
            what = "; ".join(f"{w}, line {n}" for n, w in found[:4]) + ("; ..." if len(found) > 4 else "")
            flags.append(f"{info.label} reaches into the interpreter's or the grader's internals ({what}): its "
                         "code runs in the re-check's own process, so an instructor should read it (not scored down)")
    return flags


def dependencies(infos: list[CellInfo], name: str) -> list[CellInfo]:
    """The cells among ``infos`` that define ``name`` or set its attributes and, transitively,
    those of every name they use, in notebook order."""
    usable = [c for c in infos if c.tree is not None]
    todo, seen, out = [name], set(), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for c in usable:
            if (n in c.defines or n in c.mutates) and c.index not in out:
                out.add(c.index)
                todo.extend(c.loads - seen)
    return [c for c in usable if c.index in out]


def unreadable_cells(nb) -> list[tuple[int, int | None, str, str]]:
    """(cell index, line, message, the line's text) for each code cell Python cannot compile: it
    defines nothing, and the tests that need what it should define fail with a NameError that
    does not say why."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        try:
            compile(python_source(cell.source), "<cell>", "exec")
        except SyntaxError as err:
            out.append((i, err.lineno, str(err.msg), (err.text or "").rstrip()))
        except (ValueError, RecursionError, MemoryError) as err:
            out.append((i, None, f"Python cannot compile it ({type(err).__name__})", ""))
    return out
