"""Sphinx extension: the attention explorer's files, written at build time.

At the end of an HTML build, ``export.write_explorer_assets`` writes into
``_static/explorer/`` of the output: ``explorer.js`` and ``explorer.css`` (from
the package), and ``model.js`` / ``model.json``, the trained model's weights,
vocabulary, example sentences and the "Cat sat mat" numbers, exported from
``load_trained()`` (so the book never retrains). Only the pages that hold the
explorer's markup (a raw HTML element with ``data-fp-explorer`` or
``data-fp-cat-sat-mat``, as ``chapters/explorer.md`` does) load ``model.js``,
``explorer.js`` and ``explorer.css``; nothing comes from another host.

Enable it in ``_config.yml`` under ``sphinx.extra_extensions``:
``firstprinciples.capstone.sphinx_explorer``.
"""
from __future__ import annotations

from pathlib import Path

from docutils import nodes
from sphinx.util import logging

STATIC_SUBDIR = "explorer"
MARKERS = ("data-fp-explorer", "data-fp-cat-sat-mat")
logger = logging.getLogger(__name__)


def has_explorer(doctree):
    if doctree is None:
        return False
    return any(any(m in node.astext() for m in MARKERS) for node in doctree.findall(nodes.raw))


def add_assets_to_page(app, pagename, templatename, context, doctree):
    if not has_explorer(doctree):
        return
    # Called during html-page-context, these add the files to this page only.
    app.add_css_file(f"{STATIC_SUBDIR}/explorer.css")
    app.add_js_file(f"{STATIC_SUBDIR}/model.js")
    app.add_js_file(f"{STATIC_SUBDIR}/explorer.js")


def write_assets(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    from .export import write_explorer_assets

    outdir = Path(app.outdir) / "_static" / STATIC_SUBDIR
    files = write_explorer_assets(outdir)
    logger.info(f"attention explorer: wrote {', '.join(f.name for f in files)} to {outdir}")


def setup(app):
    app.connect("html-page-context", add_assets_to_page)
    app.connect("build-finished", write_assets)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
