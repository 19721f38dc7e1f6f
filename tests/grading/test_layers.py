"""The course package has no import circles: a module that imports another (at its top or inside a
function, by a static ``import``) never ends up imported back by it. The grading code is read as a
stack of layers (docs/design/declarations.md, section 5): the notes sit under both what writes and
what reads them, and the fork server starts the trusted re-check's service by its entry point's
name (``warm.SERVICE_ENTRY``) instead of importing it. A new circle fails here, with the path."""
from __future__ import annotations

import ast
from pathlib import Path

from course import ROOT

PACKAGE = ROOT / "firstprinciples"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set) -> set:
    """The package's modules that ``path`` imports statically, anywhere in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            root = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            targets = [root] + [f"{root}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # (a name imported from a module: that module)
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def circles(edges: dict) -> list:
    """Each cycle once, as the list of modules along it."""
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            # (a package's __init__ importing its own submodules is how a package is made, not a circle)
            if node.startswith(nxt + ".") or nxt.startswith(node + "."):
                continue
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_the_package_has_no_import_circle():
    edges = graph()
    assert len(edges) > 50 and any(edges.values())  # (the package was read)
    found = circles(edges)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_a_circle_is_found():
    """The finder itself: a -> b -> c -> a is reported; a package importing its submodule is not."""
    assert circles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}) == [["p.a", "p.b", "p.c", "p.a"]]
    assert circles({"p": {"p.a"}, "p.a": {"p"}}) == []
