"""The student bundle: what a student downloads, with no answer in it.

    python -m firstprinciples.bundle OUT          # writes OUT/ (it must not exist yet, or be empty)

``OUT`` holds the released exercise notebooks (``exercises/``, made by ``nbgrader generate_assignment``)
and an installable ``firstprinciples`` package (``pip install OUT``) with everything a notebook
imports and its checks need, and no implementation of a graded piece:

- **left out:** the course's reference implementations (``reference/``), the trained models' own
  code (the capstone's ``TinyGPT``, the lengths chapter's models), the book's machinery, the
  store that computes expected results, and this command;
- **data instead of code:** a notebook's test compares the student's results with the stored
  expected results of its visible cases (``exercises/expected/``, as in the course); the
  declared mistakes (wrong answers, some built on correct pieces of the course) are replaced by
  their results on the visible cases, stored beside them (``<assignment>.mistakes.json.gz``), so that a
  failing test still names the mistake;
- **stubbed:** in the declarations, every function that a check does not run (references,
  mistakes, correct helpers they are built on, the secret cases' generators) keeps its name and
  docstring, and its body becomes ``raise NotImplementedError``. What a check runs (adapters,
  properties, tolerances, visible cases), found by following the names its code uses, stays;
- **stand-ins** (``STAND_INS`` of a declaration: a correct piece an adapter hands to a student's
  answer when the notebook's own does not work) are stubbed too, with a message that asks for the
  student's own piece first;
- **the re-check** of the check command runs the grader's runner on the visible cases against the
  stored results (the grader's secret cases stay the grader's).

``tests/tools/test_bundle.py`` builds it, finds no solution of an answer cell and no reference body in it,
and checks solved notebooks with it alone.
"""
from __future__ import annotations

import ast
import gzip
import importlib
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent
MARKER = "_bundle.py"  # written into the bundle's package: ``firstprinciples.BUNDLED`` reads it

# Package paths (relative to the package) a bundle leaves out.
LEFT_OUT = (
    "reference",  # the course's implementations of every graded piece
    "lengths",  # the lengths chapter's models (built on the reference; no notebook imports them)
    "capstone/model.py", "capstone/export.py", "capstone/sphinx_explorer.py", "capstone/explorer",
    "capstone/weights.pt",  # the trained TinyGPT: the capstone's answer
    "induction/train.py",  # (trains the given model; imports the reference's induction score)
    "book.py", "book_static",  # the book's build
    "grading/store.py",  # computes expected results with the reference
    "bundle.py",
)
STUB = "raise NotImplementedError({!r})"
STUBBED = "not in the student bundle: the course's own code (references, mistakes, secret cases)"


def _left_out(rel: Path) -> bool:
    text = rel.as_posix()
    return any(text == x or text.startswith(x + "/") for x in LEFT_OUT) or "__pycache__" in rel.parts


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(obj):
    obj = getattr(obj, "__wrapped__", obj)  # (a cached function: the code it wraps)
    if isinstance(obj, type):
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)
            if isinstance(value, property):
                yield from (f for f in (value.fget, value.fset, value.fdel) if f is not None)
            elif isinstance(value, (types.FunctionType, type)):
                yield from _functions(value)
    elif isinstance(obj, types.FunctionType):
        yield obj


def _inside(value, depth: int = 0):
    """The functions and classes a value holds: itself, or those in a container it is (nested; not
    the fields of a declaration's objects: a ``Mistake``'s function is not run by a check)."""
    if isinstance(value, (types.FunctionType, type)) or hasattr(value, "__wrapped__"):
        yield value
    elif isinstance(value, dict) and depth < 4:
        for v in value.values():
            yield from _inside(v, depth + 1)
    elif isinstance(value, (tuple, list, set, frozenset)) and depth < 4:
        for v in value:
            yield from _inside(v, depth + 1)


def _reach(obj, seen: set, prefix: str, visited: set, stops: frozenset = frozenset()) -> None:
    """Every code object ``obj`` may run among the modules under ``prefix`` (into ``seen``): its code,
    the functions in its closure, and the functions and classes its code names (as globals, or as
    attributes of a module of ``prefix`` that it names), transitively; not the code of ``stops``.
    Static: a name used is a name that may run. ``visited``: the functions followed (not their code:
    closures of one code hold different tables)."""
    for f in list(_functions(obj)):
        if f.__code__ in stops or id(f) in visited:
            continue
        visited.add(id(f))
        codes = list(_codes(f.__code__))
        seen.update(codes)
        held = [*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values()]
        for cell in f.__closure__ or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:
                continue
        names = {n for c in codes for n in c.co_names}
        for name in names:
            value = f.__globals__.get(name)
            if isinstance(value, types.ModuleType) and value.__name__.startswith(prefix):
                held += [getattr(value, attr, None) for attr in names]
            else:
                held.append(value)
        for value in held:
            for inner in _inside(value):
                if str(getattr(inner, "__module__", "")).startswith(prefix):
                    _reach(inner, seen, prefix, visited, stops)
    for base in getattr(obj, "__mro__", ())[1:]:  # (a class's own bases of the package)
        if str(base.__module__).startswith(prefix) and id(base) not in visited:
            visited.add(id(base))
            _reach(base, seen, prefix, visited, stops)


def kept_code() -> set:
    """(file, qualname) of every function of the declarations that a check runs: in the kernel
    (adapters, the tests' properties and ``says``, tolerances, visible cases) or in the bundle's
    re-check (the same, and a trained piece's rebuild and the memory bounds), minus the stand-ins."""
    from . import exercises

    prefix = exercises.__name__
    # (a stand-in's code is not followed: what only a stand-in uses goes with it)
    stand_ins = frozenset(c for obj, _ in _stand_ins().values() for f in _functions(obj) for c in _codes(f.__code__))
    seen: set = set()
    visited: set = set()
    for exercise in exercises.all_pieces():
        roots = [exercise.adapter, exercise.tolerance, exercise.memory, exercise.rebuild]
        roots += [exercise.visible] if callable(exercise.visible) else []
        for test in (*exercise.tests.values(), *exercise.elsewhere.values()):
            roots += [*test.first, *test.then, test.says]
        for root in roots:
            if root is not None:
                _reach(root, seen, prefix, visited, stand_ins)
    kept = {(c.co_filename, c.co_qualname) for c in seen - stand_ins}
    return kept | (run_at_import() - {(c.co_filename, c.co_qualname) for c in stand_ins})


IMPORT_TRACE = """
import json, sys
folder = sys.argv[1]
called = set()
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(folder):
        called.add((frame.f_code.co_filename, frame.f_code.co_qualname))
sys.setprofile(profile)
import firstprinciples.exercises as exercises
for name in exercises.NAMES:
    __import__(f"firstprinciples.exercises.{name}")
sys.setprofile(None)
print(json.dumps(sorted(called)))
"""


def run_at_import() -> set:
    """(file, qualname) of every function of the declarations that runs when they are imported
    (mistakes made by a factory, cases built by a helper): traced in a fresh interpreter."""
    from . import exercises

    folder = str(Path(exercises.__file__).parent)
    out = subprocess.run([sys.executable, "-c", IMPORT_TRACE, folder], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return {tuple(pair) for pair in json.loads(out.stdout)}


class _Stubber(ast.NodeTransformer):
    """Replaces the body of every function whose (file, qualname) is not kept by a ``raise`` (its
    docstring kept; the functions nested in it go with the body)."""

    def __init__(self, path: str, keep: set, messages: dict):
        self.path, self.keep, self.messages, self.prefix = path, keep, messages, []

    def _function(self, node):
        qual = ".".join(self.prefix + [node.name])
        if (self.path, qual) not in self.keep:
            message = self.messages.get(qual.split(".")[0])
            error = ast.parse(f"raise AssertionError({message!r})" if message else STUB.format(STUBBED)).body
            doc = node.body[:1] if ast.get_docstring(node, clean=False) is not None else []
            node.body = doc + error
            return node
        self.prefix += [node.name, "<locals>"]
        self.generic_visit(node)
        del self.prefix[-2:]
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node):
        self.prefix.append(node.name)
        self.generic_visit(node)
        self.prefix.pop()
        return node


def stubbed_source(path: Path, keep: set, messages: dict | None = None) -> str:
    """``path``'s code with the body of every function not in ``keep`` ((file, qualname) pairs)
    replaced by a ``raise`` (its docstring kept; comments go: the code is written out again);
    ``messages``: a top-level name -> the AssertionError its stub raises (a stand-in's: the check
    shows it as the test's reason)."""
    tree = _Stubber(str(path), keep, messages or {}).visit(ast.parse(path.read_text()))
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def mistake_results(assignment: str) -> dict:
    """piece -> visible case label -> mistake label -> the mistake's encoded results, on the visible
    cases of the cells it is declared to fail (left out where it raises, where they are the
    reference's, or where the piece has no reference: the trained decoder's mistakes decode the
    student's own model, which is not known here)."""
    import torch

    from . import exercises
    from .grading import declared

    out: dict = {}
    for exercise in exercises.pieces(assignment):
        if not exercise.reference or not exercise.mistakes:
            continue
        reference = exercise.reference_piece()
        by_label = out.setdefault(exercise.piece, {})
        cases = {c["label"]: c for gid in exercise.tests for c in exercise.cases(gid)}
        for label, case in cases.items():
            want = declared._results(reference, exercise, case)
            for m in exercise.mistakes:
                # (the cases of the cells it fails: where a student's answer that is this mistake fails)
                if not any(set(case["tags"]) & exercise.tests[g].tags for g in m.fails if g in exercise.tests):
                    continue
                with torch.random.fork_rng():  # (a mistake that ignores the case's generator: the same bundle every time)
                    torch.manual_seed(0)
                    theirs = declared._results(m.fn, exercise, case)
                if theirs is None or theirs == want:
                    continue
                by_label.setdefault(label, {})[m.label] = theirs
    return out


def _stand_ins() -> dict:
    """(declaration module's file name, name) -> (the stand-in, the message its stub raises in a bundle),
    from each declaration's ``STAND_INS``."""
    from . import exercises

    out = {}
    for name in exercises.NAMES:
        module = importlib.import_module(f"{exercises.__name__}.{name}")
        for attr, message in getattr(module, "STAND_INS", {}).items():
            out[(f"{name}.py", attr)] = (getattr(module, attr), message)
    return out


def build(out: Path) -> Path:
    """Write the bundle into ``out`` (new or empty); returns ``out``."""
    from . import __version__, exercises

    out = Path(out)
    if not (ROOT / "exercises").is_dir() or not (ROOT / "README.md").is_file():
        raise FileNotFoundError(f"{ROOT} is not the course's repository: run the command from a checkout of it")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: give a new folder")
    package = out / "firstprinciples"
    keep = kept_code()
    messages = {key: message for key, (_, message) in _stand_ins().items()}
    declarations = Path(exercises.__file__).parent
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE)
        if path.is_dir() or _left_out(rel) or path.suffix == ".pyc":
            continue
        target = package / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".py" and path.parent == declarations and (path.stem in exercises.NAMES or path.stem == "adapters"):
            target.write_text(stubbed_source(path, keep, {a: m for (f, a), m in messages.items() if f == path.name}))
        else:
            shutil.copy2(path, target)
    (package / MARKER).write_text('"""Present only in a student bundle (``firstprinciples.bundle``)."""\n')
    for name in exercises.NAMES:
        found = mistake_results(name)
        if found:
            # (sampling's 10,000 tokens a case compress well; mtime 0: the same bytes every build)
            with gzip.GzipFile(package / "exercises" / "expected" / f"{name}.mistakes.json.gz", "wb", mtime=0) as f:
                f.write((json.dumps(found, sort_keys=True) + "\n").encode())
    released = ROOT / "exercises"
    for path in sorted(released.rglob("*")):
        rel = path.relative_to(released)
        if path.is_file() and "__pycache__" not in rel.parts and ".ipynb_checkpoints" not in rel.parts:
            (out / "exercises" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, out / "exercises" / rel)
    for name in ("requirements-student.txt", "constraints.txt"):
        shutil.copy2(ROOT / name, out / name)
    (out / "pyproject.toml").write_text(_pyproject(__version__))
    (out / "README.md").write_text(README.format(version=__version__, install=_install_block()))
    return out


def _pyproject(version: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    text = text[:text.index("[tool.pytest")].rstrip() + "\n"
    text = text.replace('"firstprinciples.capstone" = ["weights.pt", "explorer/*.js", "explorer/*.css"]\n', "")
    text = text.replace('"firstprinciples.lengths" = ["weights.pt"]\n', "")
    text = text.replace('"firstprinciples.exercises" = ["expected/*.json"]',
                        '"firstprinciples.exercises" = ["expected/*.json", "expected/*.mistakes.json.gz"]')
    text = text.replace("Reference implementations, checks and plots for the course",
                        "The exercises and their checks (the student bundle) of the course")
    assert f'version = "{version}"' in text
    return text


def _install_block() -> str:
    """The student install block of the course's README (its Students section's first bash block)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Students"):]
    start = section.index("```bash")
    return "\n".join(line.strip() for line in section[start:section.index("```", start + 7) + 3].splitlines())


README = """# Transformers from First Principles: the exercises (version {version})

The exercise notebooks (`exercises/`) and what they need to run and check themselves: the
`firstprinciples` package without the course's solutions, reference implementations or hidden
tests. Install, in a virtual environment, from this folder (Linux: PyTorch's CPU build first):

{install}

Open a notebook (`jupyter lab exercises/softmax/softmax.ipynb`), fill in the cells marked
`YOUR CODE HERE`, then run its last cell to see every test at once, or check it as the grader will:

    python -m firstprinciples.grading.check exercises/softmax/softmax.ipynb

Every exercise's visible score: `python -m firstprinciples.grading.progress`.
"""


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m firstprinciples.bundle", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a new (or empty) folder")
    args = parser.parse_args(argv)
    try:
        print(build(args.out))
    except (FileExistsError, FileNotFoundError) as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
