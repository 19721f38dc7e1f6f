"""The grader's reading of a runner's memory from outside it (``grading/resident.py``): it sees memory
the process's own measures cannot (an anonymous map, a file in memory), counts only what holds data
(not a library's pages), and follows a cold runner's children."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from firstprinciples.grading import resident

MB = 2**20
# A child that waits for a line, then holds N MB of the given kind until the next line.
HOLDER = r"""
import mmap, os, sys
kind, n = sys.argv[1], int(sys.argv[2]) * 2**20
sys.stdin.readline()
if kind == "anonymous":
    held = bytearray(n)
    held[::4096] = b"x" * len(held[::4096])
elif kind == "memory map":
    held = mmap.mmap(-1, n)
    for i in range(0, n, 4096):
        held[i] = 1
elif kind == "memory file":
    fd = os.memfd_create("held")
    os.ftruncate(fd, n)
    held = mmap.mmap(fd, n)
    for i in range(0, n, 4096):
        held[i] = 1
print("held", flush=True)
sys.stdin.readline()
"""


def _hold(kind: str, mb: int, through_shell: bool = False) -> int | None:
    """The growth the watch reads while a child holds ``mb`` MB of ``kind``."""
    cmd = [sys.executable, "-c", HOLDER, kind, str(mb)]
    if through_shell:  # a cold runner in a sandbox: the interpreter is a child of the process started
        cmd = ["sh", "-c", '"$@"; exit 0', "sh", *cmd]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # (the interpreter has started)
        with resident.Watch(proc) as watch:
            watch.mark()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "held"
            time.sleep(0.05)
            growth = watch.growth()
        proc.stdin.write("end\n")
        proc.stdin.flush()
        proc.wait(10)
        return growth
    finally:
        proc.kill()


@pytest.mark.parametrize("kind", ["anonymous", "memory map", "memory file"])
def test_memory_held_is_read_from_outside(kind):
    assert _hold(kind, 64) >= 60 * MB


def test_a_process_that_holds_nothing_grows_little():
    assert _hold("anonymous", 0) < 8 * MB


def test_a_cold_runners_children_are_counted():
    assert _hold("anonymous", 64, through_shell=True) >= 60 * MB


def test_a_process_that_cannot_be_read_measures_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert resident.resident(resident.processes(proc)) is None
    with resident.Watch(proc) as watch:
        time.sleep(0.01)
    assert watch.growth() is None
