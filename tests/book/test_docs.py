"""The documentation: a short README over docs/, every link in it resolves, every page is
reachable, the configuration table matches the code, and docs/ stays out of the book."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

import docpages
from course import ROOT

CONFIGURATION = docpages.DOCS / "instructors" / "configuration.md"
README_MAX_LINES = 150
# FP_ names in the course package that are not environment variables.
NOT_VARIABLES = {"FP_EXPLORER_DATA"}  # a JavaScript global of the explorer's page


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, outside code."""
    kept = []
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        if docpages._in_code(lines, i) or line.lstrip().startswith("```"):
            continue
        line = re.sub(r"``.*?``|`[^`]*`", "", line)  # inline code
        kept += re.findall(r"\]\(([^)\s]+)\)", line)
    return kept


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    lines = page.read_text().splitlines()
    return {anchor(re.sub(r"^#+ ", "", line).replace("`", "")) for i, line in enumerate(lines)
            if re.match(r"#+ ", line) and not docpages._in_code(lines, i)}


def local_links(page: Path) -> list[tuple[str, Path, str]]:
    """(link, file it names, anchor) for every link that is not to another site."""
    found = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, fragment = target.partition("#")
        found.append((target, (page.parent / path).resolve() if path else page, fragment))
    return found


def test_the_readme_is_a_front_page():
    lines = docpages.README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def test_every_relative_link_resolves():
    broken = []
    for page in docpages.pages():
        for target, path, fragment in local_links(page):
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {path.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_doc_page_is_reachable_from_the_readme():
    seen, todo = set(), [docpages.README.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.is_file():
            continue
        seen.add(page)
        todo += [path for _, path, _ in local_links(page)]
    orphans = [p.relative_to(ROOT).as_posix() for p in docpages.pages() if p.resolve() not in seen]
    assert not orphans, f"doc pages no page links to, from the README on: {orphans}"


def test_the_docs_are_not_part_of_the_book():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert {"docs", "README.md"} <= set(config["exclude_patterns"])
    toc = (ROOT / "_toc.yml").read_text()
    assert not re.search(r"file:\s*(docs/|README)", toc), "_toc.yml names a doc page"


# ---- the configuration table against the code ----

def table() -> dict[str, str]:
    """First column of the configuration table (each name in backticks) -> its default."""
    rows = {}
    for line in CONFIGURATION.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def python_files():
    return [*sorted((ROOT / "firstprinciples").rglob("*.py")), ROOT / "nbgrader_config.py"]


def course_traits() -> dict[tuple[str, str], tuple[list[str], object]]:
    """(class, trait) -> (the names it may be set under: the class's and its bases', the default
    given in the code or None), for every ``.tag(config=True)`` trait the course package declares."""
    traits = {}
    for path in python_files():
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            owners = [cls.name] + [b.id for b in cls.bases if isinstance(b, ast.Name)]
            for stmt in cls.body:
                value = getattr(stmt, "value", None)
                if not (isinstance(stmt, ast.Assign) and isinstance(value, ast.Call)
                        and isinstance(value.func, ast.Attribute) and value.func.attr == "tag"
                        and any(k.arg == "config" for k in value.keywords)):
                    continue
                trait = value.func.value
                default = None
                if isinstance(trait, ast.Call) and trait.args and isinstance(trait.args[0], ast.Constant):
                    default = trait.args[0].value
                traits[(cls.name, stmt.targets[0].id)] = (owners, default)
    return traits


def course_variables() -> dict[str, object]:
    """Every FP_ environment variable the code reads -> its default where the code states one."""
    found = {}
    for path in python_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"FP_[A-Z_]+", node.value) and node.value not in NOT_VARIABLES:
                found.setdefault(node.value, None)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and len(node.args) == 2 and all(isinstance(a, ast.Constant) for a in node.args)
                    and str(node.args[0].value).startswith("FP_")):
                found[node.args[0].value] = node.args[1].value
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for name in re.findall(r"environ(?:\.get\(|\[)\s*[\"'](FP_[A-Z_]+)", path.read_text()):
            found.setdefault(name, None)
    return found


def nbgrader_traits() -> set[tuple[str, str]]:
    import nbgrader.apps  # noqa: F401  (imports nbgrader's configurable classes)
    import nbgrader.exchange  # noqa: F401
    import nbgrader.plugins  # noqa: F401
    import nbgrader.preprocessors  # noqa: F401
    from traitlets.config import Configurable

    known, todo = set(), [Configurable]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        known |= {(cls.__name__, t) for t in cls.class_traits(config=True)}
    return known


def shown(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def test_every_setting_and_variable_is_in_the_configuration_table():
    rows = table()
    missing = [f"c.{cls}.{trait}" for (cls, trait), (owners, _) in sorted(course_traits().items())
               if not any(f"c.{owner}.{trait}" in rows for owner in owners)]
    missing += sorted(v for v in course_variables() if v not in rows)
    # What nbgrader_config.py sets or offers (commented out) is named on the page, in the table or
    # in its list of what the course sets for good.
    page = CONFIGURATION.read_text()
    config_py = (ROOT / "nbgrader_config.py").read_text()
    missing += sorted({f"c.{m}" for m in re.findall(r"\bc\.(\w+\.\w+)", config_py) if f"`c.{m}`" not in page})
    assert not missing, f"not in docs/instructors/configuration.md (as the class or a base class): {missing}"


def test_every_name_in_the_configuration_table_exists_with_its_default():
    rows = table()
    traits, variables = course_traits(), course_variables()
    defaults = {(owner, trait): default for (_, trait), (owners, default) in traits.items() for owner in owners}
    known = set(defaults) | nbgrader_traits()
    wrong = []
    for name, default in rows.items():
        if name.startswith("c."):
            key = tuple(name[2:].split(".", 1))
            if key not in known:
                wrong.append(f"{name}: no such setting")
            elif defaults.get(key) is not None and shown(defaults[key]) not in default:
                wrong.append(f"{name}: the code's default is {defaults[key]!r}, the table says {default!r}")
        elif name.startswith("FP_"):
            if name not in variables:
                wrong.append(f"{name}: no code reads it")
            elif variables[name] is not None and shown(variables[name]) not in default:
                wrong.append(f"{name}: the code's default is {variables[name]!r}, the table says {default!r}")
    assert not wrong, "docs/instructors/configuration.md:\n" + "\n".join(wrong)
