"""The rendered book for the tests that read it (tests/book/test_book.py, tests/book/test_book_reader.py):
one build per test session, shared by every pytest-xdist worker, and a Chromium to look at it.

The build is the README's, with warnings as errors: ``jupyter-book build . -W -n --keep-going``
into a temporary folder (the execution cache in ``_build/.jupyter_cache`` is reused). Under
xdist the first worker to get there builds while the others wait on a lock; the tests only read
the HTML, so they can share it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

from course import ROOT

# The jupyter-book script installed beside this Python (the package has no __main__).
_SCRIPT = Path(sys.executable).parent / "jupyter-book"
JUPYTER_BOOK = str(_SCRIPT) if _SCRIPT.exists() else shutil.which("jupyter-book")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [ch["file"] for part in toc["parts"] for ch in part["chapters"]]


def built_book(tmp_path_factory) -> Path:
    """The book's HTML folder, built once for the whole session (all workers)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "book"
    with FileLock(str(shared / "book.lock")):
        done = out / "built"
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            proc = subprocess.run(
                [JUPYTER_BOOK, "build", ".", "-W", "-n", "--keep-going", "--path-output", str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=1800,
            )
            if proc.returncode != 0:  # every test that reads the book fails with the build's output
                (out / "failed").write_text(f"book build failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-8000:]}")
            done.write_text("")
    failed = out / "failed"
    assert not failed.exists(), failed.read_text()
    return out / "_build" / "html"


def settle(page) -> None:
    """Wait, after the load event, until the page is as a reader sees it: MathJax's first
    typesetting done (on pages that load MathJax; its script is deferred, so it has run by the
    load event) and every web font the page asked for loaded. Playwright's "networkidle"
    instead waits for 500 ms without a request on every page (0.5 s of the 1.2 s a visit takes)."""
    page.evaluate("""async () => {
        if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
        await document.fonts.ready;
    }""")


@contextmanager
def browser_on(html: Path):
    """(Chromium, the address of ``html`` served over HTTP on the loopback)."""
    if not CHROMIUM:
        msg = "Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    import http.server
    import threading
    from functools import partial

    from playwright.sync_api import sync_playwright

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b, f"http://127.0.0.1:{server.server_port}"
        finally:
            b.close()
            server.shutdown()
