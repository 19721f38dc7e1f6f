"""A small Sphinx extension for the book.

- Every exercise page gets a box that says how to work on the notebook locally,
  with a download link to the .ipynb.
- Inline scripts that the theme's extensions add twice (sphinx-thebe declares
  ``const THEBE_JS_URL`` twice, a console error in every browser) are kept once.

Enabled in ``_config.yml`` (``sphinx.extra_extensions``). The box is added to
the page, not to the notebook, so the released notebook stays exactly what
nbgrader generates.
"""
from __future__ import annotations

from pathlib import PurePosixPath

from docutils import nodes
from sphinx import addnodes

EXERCISE_PREFIX = "exercises/"


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
        _text("In a clone of the course repository, install the course once: ",
              nodes.literal(text="pip install -r requirements.txt"),
              " (the notebook's tests import the course package)."),
        _text("Open the notebook in Jupyter, fill in every cell marked ",
              nodes.literal(text="YOUR CODE HERE"), ", then restart the kernel and run all cells."),
        _text("A test cell that raises nothing has passed; a failing one says what is wrong. "
              "The grader runs the same tests plus hidden ones."),
    ):
        steps += nodes.list_item("", item)
    box += steps
    section = next(iter(doctree.findall(nodes.section)), None)
    parent = section if section is not None else doctree
    index = 1 if section is not None else 0  # just below the page title
    parent.insert(index, box)


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


def setup(app):
    # Before Sphinx's download collector (priority 500) so that it registers the file.
    app.connect("doctree-read", add_local_work_box, priority=400)
    app.connect("html-page-context", dedupe_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
