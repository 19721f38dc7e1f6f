"""Benchmark: how long the book takes to build, against what it cannot go below.

Prints
- the floor: a bare Jupyter kernel start plus `import torch` (median of 3),
  the cost every executed chapter pays at least once;
- the clean build time (empty execution cache, every chapter executed), and the
  same divided by the number of executed notebooks;
- the rebuild time after editing one chapter's text (execution cache hit);
- whether the targets hold: clean build <= 2 x (executed notebooks x floor),
  text-edit rebuild < clean build / 4.

Run from the repository root: python tests/benchmarks/book_build.py
It works on a copy of the book in a temporary folder; the repository is untouched.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from jupyter_client.manager import start_new_kernel

ROOT = Path(__file__).resolve().parents[2]
BOOK_FILES = ["_config.yml", "_toc.yml", "intro.md", "chapters", "exercises"]
_SCRIPT = Path(sys.executable).parent / "jupyter-book"
JUPYTER_BOOK = str(_SCRIPT) if _SCRIPT.exists() else shutil.which("jupyter-book")


def floor_seconds(runs=3):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        km, kc = start_new_kernel(kernel_name="python3")
        try:
            kc.execute_interactive("import torch", timeout=120)
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(book: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([JUPYTER_BOOK, "build", ".", "-W", "-n", "--keep-going"], cwd=book,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return elapsed


def executed_notebooks():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [ch["file"] for part in toc["parts"] for ch in part["chapters"]]
    return [f for f in files if f.startswith("chapters/")]


def main():
    floor = floor_seconds()
    chapters = executed_notebooks()
    with tempfile.TemporaryDirectory() as tmp:
        book = Path(tmp)
        for name in BOOK_FILES:
            src = ROOT / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, book / name)
        clean = build(book)
        page = book / f"{chapters[0]}.md"
        page.write_text(page.read_text() + "\nOne more sentence of text, and no code.\n")
        rebuild = build(book)
    n = len(chapters)
    print(f"floor (kernel start + import torch): {floor:6.2f} s")
    print(f"clean build, {n} executed notebooks:   {clean:6.2f} s  ({clean / n:.2f} s per notebook)")
    print(f"target: clean <= 2 x {n} x floor =     {2 * n * floor:6.2f} s  -> {'met' if clean <= 2 * n * floor else 'NOT met'}")
    print(f"rebuild after a one-page text edit:   {rebuild:6.2f} s  ({rebuild / clean:.0%} of clean)")
    print(f"target: rebuild < clean / 4 =         {clean / 4:6.2f} s  -> {'met' if rebuild < clean / 4 else 'NOT met'}")


if __name__ == "__main__":
    main()
