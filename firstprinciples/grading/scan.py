"""Static scan of the code a student wrote, done by the trusted grader.

The trusted re-check (``firstprinciples.grading.trusted``) recomputes every
graded comparison outside the student's kernel, on fresh inputs. What it cannot
see from outside is *how* an answer got its numbers: by doing the work, or by
reaching into the grader's tools. This scan reads the source of every cell the
student controls (answer cells and cells they added) before anything runs and
reports two kinds of finding:

``tamper``
    code that can change what *other* code computes: imports of the
    interpreter's machinery (``firstprinciples``, ``sys``, ``builtins``,
    ``importlib``, ``ctypes``, ``inspect``, ``gc``, ``IPython``, ...); the
    dynamic escapes ``eval``, ``exec``, ``compile``, ``__import__``,
    ``getattr``, ``setattr``, ``delattr``, ``globals``, ``locals``, ``vars`` and
    ``get_ipython`` (which IPython magics and ``!`` commands become); dunder
    attributes other than a few harmless ones; private (``_``) attributes of
    modules; assignment to or deletion of a module's attributes
    (``np.allclose = ...``); classes derived from ``Tensor``, ``ndarray`` or a
    torch function/dispatch mode; attributes of the course's check modules that
    are modules or private. One such finding voids every trusted verdict of the
    notebook: patching a shared tool can change any result.
``local``
    code that leaves the exercise without patching anything: other imports
    outside the allow-list (``os``, ``signal``, ``socket``, ``subprocess``, ...)
    and ``open``. It voids the verdicts of the pieces whose code uses that cell
    (so ``os._exit`` in one answer costs that answer, not the notebook).
``builtin``
    use of the built-in a piece must not call (``torch.softmax`` in the softmax
    exercise: an attribute or imported name containing one of the piece's
    patterns). It voids the verdict of that piece and of the pieces built on it.

The scan is deliberately strict and simple: legitimate answers to these
exercises need none of the flagged constructs. A flagged answer gets the exact
line and reason in its feedback, and an instructor can always grade it by hand.
"""
from __future__ import annotations

import ast
import importlib
import types
from dataclasses import dataclass, field

ALLOWED_IMPORTS = ("torch", "numpy", "math", "cmath", "typing", "dataclasses", "__future__", "collections",
                   "functools", "itertools", "operator", "abc", "random", "time", "string", "enum",
                   "matplotlib", "statistics", "fractions", "decimal", "copy", "heapq", "bisect", "numbers")
# torch submodules that reach under the dispatcher or replace functions
FORBIDDEN_MODULE_PARTS = ("overrides", "library", "_C", "_dynamo", "_prims", "fx", "jit", "utils", "testing",
                          "_python_dispatch", "_subclasses", "compiler", "export")
# modules whose import can change what other code computes (anything else outside the allow-list is "local")
MACHINERY = ("firstprinciples", "sys", "builtins", "importlib", "ctypes", "inspect", "gc", "IPython", "ipykernel",
             "types", "marshal", "pickle", "copyreg", "code", "codeop", "runpy", "site", "sysconfig", "atexit",
             "traceback", "weakref", "_thread", "threading", "multiprocessing", "unittest", "pytest", "imp", "zipimport",
             "pkgutil", "torch", "numpy", "cffi", "faulthandler", "trace", "tracemalloc", "dis", "ast", "tokenize",
             "linecache", "contextvars", "asyncio", "concurrent")
ESCAPES = ("eval", "exec", "compile", "__import__", "getattr", "setattr", "delattr", "globals", "locals", "vars",
           "get_ipython", "breakpoint", "input", "__builtins__", "__loader__", "__spec__", "memoryview",
           "exit", "quit")
LOCAL_ESCAPES = ("open",)
ALLOWED_DUNDERS = ("__init__", "__call__", "__repr__", "__str__", "__len__", "__name__", "__doc__",
                   "__future__", "__iter__", "__next__", "__contains__", "__post_init__")
# course modules whose objects are the grader's own (reached through a check module's attributes)
INTERNALS = ("firstprinciples.reference", "firstprinciples.guard", "firstprinciples.grading", "firstprinciples.checks._core")
SUSPECT_BASES = ("Tensor", "ndarray", "TorchFunctionMode", "TorchDispatchMode", "Parameter", "ModuleType")


@dataclass
class Finding:
    cell: int  # index of the cell in the notebook
    line: int
    kind: str  # "tamper", "local" or "builtin"
    message: str
    pattern: str = ""  # for "builtin": the forbidden pattern seen

    def describe(self, label: str) -> str:
        return f"{label}, line {self.line}: {self.message}"


@dataclass
class CellInfo:
    index: int
    label: str
    student: bool
    tree: ast.AST | None
    defines: set = field(default_factory=set)
    loads: set = field(default_factory=set)


def python_source(source: str) -> str:
    """The Python that IPython runs for a cell (magics and ``!`` become ``get_ipython()`` calls)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def parse(source: str) -> ast.AST | None:
    try:
        return ast.parse(python_source(source))
    except (SyntaxError, ValueError):
        return None  # it cannot run in the kernel either


def _root(node):
    """The name an attribute chain starts from, and the chain's attribute names."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), list(reversed(chain))


def _module_allowed(name: str) -> bool:
    top = name.split(".")[0]
    if top not in ALLOWED_IMPORTS:
        return False
    return not any(part in FORBIDDEN_MODULE_PARTS for part in name.split(".")[1:])


def top_level_names(tree: ast.AST) -> set:
    """Names a cell binds in the notebook's namespace (also inside top-level if/for/while/with/try)."""
    names = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
                continue
            for child in ast.walk(node):
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    names.add(child.id)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(child.name)

    visit(getattr(tree, "body", []))
    return names


def loaded_names(tree: ast.AST) -> set:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def course_bindings(trees) -> dict:
    """Names that the course's own cells bind to ``firstprinciples`` modules or objects: name -> (module, attr)."""
    out = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("firstprinciples"):
                for a in node.names:
                    out[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("firstprinciples"):
                        out[a.asname or a.name.split(".")[0]] = (a.name, None)
    return out


def _course_object(binding):
    module, attr = binding
    try:
        mod = importlib.import_module(module)
        if attr is None:
            return mod
        try:
            return importlib.import_module(f"{module}.{attr}")
        except ImportError:
            return getattr(mod, attr)
    except (ImportError, AttributeError):
        return None


def module_aliases(trees) -> dict:
    """Names bound to modules by any cell's imports (``torch``, ``np``, ``F``, ``nn``, ...): name -> module names."""
    names = {"torch": {"torch"}, "np": {"numpy"}, "numpy": {"numpy"}, "math": {"math"},
             "F": {"torch.nn.functional"}, "nn": {"torch.nn"}}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    names.setdefault(a.asname or a.name.split(".")[0], set()).add(a.name if a.asname else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    try:
                        if isinstance(getattr(importlib.import_module(node.module), a.name, None), types.ModuleType):
                            names.setdefault(a.asname or a.name, set()).add(f"{node.module}.{a.name}")
                    except ImportError:
                        pass
    return names


def _reach_kind(modules: set, chain: list) -> str | None:
    """What reaching ``<module>.<chain>`` is: None (fine), "local" or "tamper".

    Private and forbidden attributes are tamper, unless every module the name may be is
    itself a local one (``os._exit`` leaves the exercise but patches nothing). A chain that
    lands on a module outside the allow-list is judged like importing it: ``torch.sys`` is
    ``import sys``, ``os.path`` is a local import.
    """
    local_root = all(m.split(".")[0] not in ALLOWED_IMPORTS and m.split(".")[0] not in MACHINERY for m in modules)
    if any(a.startswith("_") for a in chain) or any(a in FORBIDDEN_MODULE_PARTS for a in chain):
        return "local" if local_root else "tamper"
    for module in modules:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        for attr in chain:
            obj = getattr(obj, attr, None)
            if isinstance(obj, types.ModuleType) and not _module_allowed(obj.__name__):
                return "tamper" if obj.__name__.split(".")[0] in MACHINERY else "local"
    return None


def tamper_findings(info: CellInfo, aliases: dict, course: dict) -> list[Finding]:
    out = []

    def flag(node, message):
        out.append(Finding(info.index, getattr(node, "lineno", 0), "tamper", message))

    def flag_import(node, name, message):
        top = name.split(".")[0]
        kind = "tamper" if (top in MACHINERY or not top) else "local"
        out.append(Finding(info.index, getattr(node, "lineno", 0), kind, message))

    for node in ast.walk(info.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not _module_allowed(a.name):
                    flag_import(node, a.name, f"imports {a.name}, which graded code may not import")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level or not _module_allowed(mod):
                flag_import(node, "" if node.level else mod, f"imports from {mod or '.'}, which graded code may not import")
            else:
                for a in node.names:
                    if a.name.startswith("_") or a.name in FORBIDDEN_MODULE_PARTS:
                        flag(node, f"imports {a.name} from {mod}, which graded code may not import")
        elif isinstance(node, ast.Name) and node.id in LOCAL_ESCAPES:
            out.append(Finding(info.index, node.lineno, "local", f"uses {node.id}, which graded code may not use"))
        elif isinstance(node, ast.Name) and node.id in ESCAPES:
            flag(node, f"uses {node.id}, which graded code may not use")
        elif isinstance(node, ast.Attribute):
            root, chain = _root(node)
            if node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in ALLOWED_DUNDERS:
                flag(node, f"uses the attribute {node.attr}, which graded code may not use")
            if root in aliases and root not in course:
                kind = _reach_kind(aliases[root], chain)
                if kind:
                    out.append(Finding(info.index, node.lineno, kind,
                                       f"reaches into {root}.{'.'.join(chain)}, which graded code may not use"))
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    flag(node, f"changes {root}.{'.'.join(chain)}: graded code may not modify a module")
            if root in course and chain and node.value is not None and isinstance(node.value, ast.Name):
                obj = _course_object(course[root])
                attr = chain[0]
                target = getattr(obj, attr, None) if obj is not None else None
                inner = getattr(target, "__module__", "") or ""
                if (attr.startswith("_") or isinstance(target, types.ModuleType) or isinstance(node.ctx, (ast.Store, ast.Del))
                        or inner.startswith(INTERNALS)):
                    flag(node, f"reaches into {root}.{attr}, part of the course's grading tools")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                text = ast.unparse(base)
                if any(s in text for s in SUSPECT_BASES):
                    flag(node, f"derives the class {node.name} from {text}, which graded code may not subclass")
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("__")
                        and item.name.endswith("__") and item.name not in ALLOWED_DUNDERS):
                    flag(item, f"defines {node.name}.{item.name}, which graded code may not define")
    return out


def builtin_findings(info: CellInfo, patterns) -> list[Finding]:
    if not patterns:
        return []
    out = []
    for node in ast.walk(info.tree):
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names] + [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:  # case-insensitive: torch.softmax, nn.Softmax
            hit = next((p for p in patterns if p.lower() in name.lower()), None)
            if hit:
                out.append(Finding(info.index, getattr(node, "lineno", 0), "builtin",
                                   f"uses {name}, the built-in this piece asks you to write yourself", hit))
                break
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
        if course_sources is not None:
            student = cell.source not in course_sources
        else:
            student = bool(meta.get("solution")) or not (meta.get("locked") or meta.get("grade"))
        label = f"cell {meta['grade_id']!r}" if meta.get("grade_id") else f"code cell {sum(1 for c in nb.cells[:i + 1] if c.cell_type == 'code')}"
        tree = parse(cell.source)
        info = CellInfo(i, label, student, tree)
        if tree is not None:
            info.defines = top_level_names(tree)
            info.loads = loaded_names(tree)
        infos.append(info)
    return infos


def dependencies(infos: list[CellInfo], name: str) -> list[CellInfo]:
    """The student cells that define ``name`` and, transitively, the names those use."""
    student = [c for c in infos if c.student and c.tree is not None]
    todo, seen, out = [name], set(), []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for c in student:
            if n in c.defines and c not in out:
                out.append(c)
                todo.extend(c.loads - seen)
    return out


@dataclass
class ScanResult:
    infos: list
    tamper: list  # findings that void every verdict
    local: list = field(default_factory=list)  # findings that void the pieces using their cell

    def findings_for(self, name: str, patterns) -> list[Finding]:
        """The local and builtin findings in the cells that ``name`` depends on."""
        cells = dependencies(self.infos, name)
        indices = {c.index for c in cells}
        return ([f for f in self.local if f.cell in indices]
                + [f for c in cells for f in builtin_findings(c, patterns)])

    def label(self, finding: Finding) -> str:
        return next(c.label for c in self.infos if c.index == finding.cell)


def scan(nb, course_sources: set | None = None) -> ScanResult:
    infos = cell_infos(nb, course_sources)
    trees = [c.tree for c in infos if c.tree is not None]
    course = course_bindings([c.tree for c in infos if not c.student and c.tree is not None])
    aliases = module_aliases(trees)
    found = [f for c in infos if c.student and c.tree is not None for f in tamper_findings(c, aliases, course)]
    return ScanResult(infos, [f for f in found if f.kind == "tamper"], [f for f in found if f.kind == "local"])
