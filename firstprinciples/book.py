"""A small Sphinx extension for the book.

- Every exercise page gets a box that says how to work on the notebook locally,
  with a download link to the .ipynb.
- Chapters are executed in parallel, one process per core, before Sphinx reads
  them (myst-nb executes them one after the other): the results go into the
  same execution cache that myst-nb then reads, so the pages are the same and
  a chapter whose code did not change is not run again.
- Inline scripts that the theme's extensions add twice (sphinx-thebe declares
  ``const THEBE_JS_URL`` twice, a console error in every browser) are kept once.
- The book's stylesheet (``book_static/book.css``: long code and output lines
  wrap inside their box) is added to every page.
- Two bits of markup that other extensions write and accessibility checkers
  (axe-core) flag are rewritten in each page's body: the folded code cells'
  ``<summary aria-label="Toggle hidden content">`` (myst-nb), whose label hides
  its visible text "Show code cell source", and the bibliography's
  ``role="doc-biblioentry"`` entries (Sphinx), a deprecated role inside a
  ``role="list"``: they become list items.
- A table whose header row is entirely empty (a Markdown table written
  ``| | |`` over ``|---|---|``, as the exercise notebooks' headers are) loses
  that header: an empty grey bar on screen, and an ``empty-table-header``
  failure for screen readers.

- The kernels that run the chapters write their own log (ipykernel's start-up warning
  "Kernel is running over TCP without encryption", once a chapter, and the rare shutdown race
  "Socket operation on non-socket") to ``kernels.log`` beside the build's doctrees, not into
  the build's log, where they buried what a reader needs (a cell's error still reaches the
  page and the build's log through nbclient). A kernel spec for this interpreter that does so
  is written into the build folder and put first on ``JUPYTER_PATH`` for the build.

- Launch buttons (Binder, Colab, JupyterHub) open notebooks: on a chapter, whose source is
  a Markdown notebook that Colab cannot open, they open the chapter's exercise notebook
  (the first ``exercises/...`` the chapter links to) and say so; a page with no exercise
  has none.

Enabled in ``_config.yml`` (``sphinx.extra_extensions``). The box is added to
the page, not to the notebook, so the released notebook stays exactly what
nbgrader generates.
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from docutils import nodes
from sphinx import addnodes

EXERCISE_PREFIX = "exercises/"
STATIC = Path(__file__).with_name("book_static")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _text(*parts):
    para = nodes.paragraph()
    for part in parts:
        para += part if isinstance(part, nodes.Node) else nodes.Text(part)
    return para


def add_local_work_box(app, doctree):
    docname = app.env.docname
    if not docname.startswith(EXERCISE_PREFIX):
        return
    filename = PurePosixPath(docname).name + ".ipynb"
    download = addnodes.download_reference(
        "", "", nodes.literal(text=filename), reftarget=filename, refdoc=docname, refexplicit=True,
        classes=["exercise-download"],
    )
    box = nodes.admonition(classes=["tip", "exercise-local-work"])
    box += nodes.title(text="How to work on this exercise locally")
    steps = nodes.enumerated_list()
    for item in (
        _text("Download the notebook: ", download, "."),
        _text("In a clone of the course repository, install the student set once. On Linux, PyTorch's "
              "CPU build first (PyPI's default there is the CUDA build, several GB): ",
              nodes.literal(text="pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"),
              "; then, on every system: ", nodes.literal(text="pip install -r requirements-student.txt"),
              " (the README's Students section also switches nbgrader's instructor extensions off)."),
        _text("Open the notebook in Jupyter, fill in every cell marked ",
              nodes.literal(text="YOUR CODE HERE"), ", then restart the kernel and run all cells. "
              "Run All stops at the first failing cell."),
        _text("To run every test at once, as the grader does: run the notebook's last cell, or ",
              nodes.literal(text=f"python -m firstprinciples.grading.check {filename}"),
              ". The grader runs the same tests plus hidden ones, and re-checks each piece outside your notebook."),
    ):
        steps += nodes.list_item("", item)
    box += steps
    section = next(iter(doctree.findall(nodes.section)), None)
    parent = section if section is not None else doctree
    index = 1 if section is not None else 0  # just below the page title
    parent.insert(index, box)


def drop_empty_table_headers(app, doctree):
    for thead in list(doctree.findall(nodes.thead)):
        if not thead.astext().strip():
            thead.parent.remove(thead)


ACCESSIBLE_MARKUP = (
    ('<summary aria-label="Toggle hidden content">', "<summary>"),
    ('role="doc-biblioentry"', 'role="listitem"'),
)


def accessible_markup(app, pagename, templatename, context, doctree):
    body = context.get("body")
    if body:
        for old, new in ACCESSIBLE_MARKUP:
            body = body.replace(old, new)
        context["body"] = body


def add_static(app, config):
    config.html_static_path = [*config.html_static_path, str(STATIC)]


def dedupe_scripts(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not scripts:
        return
    seen, kept = set(), []
    for js in scripts:
        # The same script at two priorities is still the same script.
        key = (str(getattr(js, "filename", js) or ""),
               tuple(sorted((k, str(v)) for k, v in getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    scripts[:] = kept


def execute_in_parallel(app, env, docnames):
    """Fill the execution cache for the chapters about to be read, in parallel."""
    config = app.env.config
    if config.nb_execution_mode != "cache":
        return
    from jupyter_cache import get_cache
    from jupyter_cache.executors import load_executor

    cache = get_cache(config.nb_execution_cache_path or ".jupyter_cache")
    uris = []
    for docname in sorted(docnames):
        path = Path(env.doc2path(docname))
        if path.suffix != ".md" or any(PurePosixPath(path.as_posix()).match(p) for p in config.nb_execution_excludepatterns):
            continue
        text = path.read_text(encoding="utf-8")
        if "```{code-cell}" not in text:
            continue  # plain Markdown page, nothing to run
        record = cache.add_nb_to_project(str(path), read_data={"name": "myst_nb_md", "type": "plugin"})
        uris.append(record.uri)
    if len(uris) < 2:
        return  # nothing to gain; myst-nb runs a single notebook itself
    # Notebooks already cached (same code) are skipped by the executor; one that
    # fails is left uncached, so myst-nb runs it again and reports the error.
    executor = load_executor("local-parallel", cache, logger=_quiet_logger())
    # One process per core, so one thread per process: torch's default (a thread
    # per core in every kernel) oversubscribes the cores and slows the build.
    saved = {k: os.environ.get(k) for k in THREAD_VARIABLES}
    os.environ.update({k: "1" for k in THREAD_VARIABLES})
    try:
        executor.run_and_cache(filter_uris=uris, timeout=config.nb_execution_timeout,
                               allow_errors=config.nb_execution_allow_errors)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _quiet_logger():
    import logging

    log = logging.getLogger("firstprinciples.book.execute")
    log.setLevel(logging.WARNING)
    return log


EXERCISE_LINK = re.compile(r"exercises/([A-Za-z0-9_]+)/([A-Za-z0-9_]+)")


def exercise_of(srcdir, pagename: str) -> str | None:
    """The exercise notebook a Markdown page links to first (``exercises/a/nb.ipynb``), or None."""
    source = Path(srcdir) / f"{pagename}.md"
    if not source.is_file():
        return None
    m = EXERCISE_LINK.search(source.read_text(encoding="utf-8"))
    if m is None or not (Path(srcdir) / f"{m.group(0)}.ipynb").is_file():
        return None
    return f"{m.group(0)}.ipynb"


def launch_exercises(app, pagename, templatename, context, doctree):
    """Point a Markdown page's launch buttons at its exercise notebook (or drop them)."""
    if not str(context.get("sourcename", "")).endswith((".md", ".md.txt")):
        return
    buttons = context.get("header_buttons") or []
    group = next((b for b in buttons if b.get("label") == "launch-buttons"), None)
    if group is None:
        return
    target = exercise_of(app.srcdir, pagename)
    if target is None:
        buttons.remove(group)
        return
    for button in group["buttons"]:
        url = button.get("url", "")
        for ext in (".md", ".ipynb"):
            url = url.replace(f"{pagename}{ext}", target)
        button["url"] = url
        button["text"] = f"{button['text']}: the exercise"
        button["tooltip"] = f"Open this chapter's exercise notebook on {button['text'].split(':')[0]}"
    group["tooltip"] = "Open this chapter's exercise notebook"


# The kernel's own stderr (not its cells' output, which goes to the notebook) appended to a file.
_KERNEL_MAIN = ("import os, sys; fd = os.open(sys.argv.pop(1), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600); "
                "os.dup2(fd, 2); from ipykernel.kernelapp import launch_new_instance; launch_new_instance()")


def quiet_kernels(app, config):
    """Run the chapters in this interpreter's ``python3`` kernel, its own log kept in a file."""
    import json
    import sys

    home = Path(app.doctreedir).parent / "kernelspec"
    spec = home / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-c", _KERNEL_MAIN, str(home / "kernels.log"), "-f", "{connection_file}"],
        "display_name": "Python 3 (the book's build)", "language": "python",
    }, indent=1))
    paths = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p and p != str(home)]
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(home), *paths])


def setup(app):
    # Before Sphinx's download collector (priority 500) so that it registers the file.
    app.connect("doctree-read", add_local_work_box, priority=400)
    app.connect("doctree-read", drop_empty_table_headers)
    app.connect("config-inited", add_static)
    app.connect("config-inited", quiet_kernels)
    app.add_css_file("book.css")
    app.connect("html-page-context", dedupe_scripts, priority=900)
    app.connect("html-page-context", accessible_markup)
    app.connect("html-page-context", launch_exercises, priority=600)  # after the theme's (501)
    app.connect("env-before-read-docs", execute_in_parallel, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
