"""The book builds with warnings as errors, chapters executed, exercises shown as released."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from course import ROOT, released_notebooks


# The jupyter-book script installed beside this Python (the package has no __main__).
JUPYTER_BOOK = str(Path(sys.executable).parent / "jupyter-book") if (Path(sys.executable).parent / "jupyter-book").exists() else shutil.which("jupyter-book")


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    proc = subprocess.run(
        [JUPYTER_BOOK, "build", str(ROOT), "-W", "-n", "--keep-going", "--path-output", str(out)],
        capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, f"book build failed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"
    return out / "_build" / "html"


def _toc_files():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [ch["file"] for part in toc["parts"] for ch in part["chapters"]]


def test_every_toc_entry_is_a_page(html):
    for f in _toc_files():
        assert (html / f"{f}.html").is_file(), f

def test_every_exercise_is_in_the_book():
    files = set(_toc_files())
    for nb in released_notebooks():
        assert nb.relative_to(ROOT).with_suffix("").as_posix() in files


def test_chapter_numbers_were_computed_at_build_time(html):
    page = (html / "chapters" / "attention.html").read_text()
    # Outputs of the worked example's code cells, not the prose.
    outputs = " ".join(re.findall(r'<div class="cell_output docutils container">(.*?)</div>\s*</div>', page, flags=re.S))
    for number in ("1.10", "0.778", "0.707", "0.424", "0.380", "0.354", "0.2666", "1.026", "0.974"):
        assert number in outputs, number
    assert re.search(r'<img[^>]+src="[^"]+\.png"', page), "no figure"


def test_exercise_pages_are_not_executed(html):
    for nb in released_notebooks():
        page = (html / nb.relative_to(ROOT).with_suffix(".html")).read_text()
        assert "NotImplementedError" in page  # the stub is shown...
        assert "most recent call last" not in page and 'class="cell_output' not in page  # ...never run
        for marker in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS"):
            assert marker not in page
