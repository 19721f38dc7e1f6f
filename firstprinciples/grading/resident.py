"""A runner's resident memory, watched from outside it.

Part of the grading core. The re-check's runner measures an answer's memory itself (torch's
allocator, Python's allocation tracer: ``observe``), but code in that process can switch off or
fool what runs there. This watch runs in the grader: a thread that reads, every millisecond, how
much memory the operating system has given the runner's processes (``/proc/<pid>/status``), and
keeps the most above what they held when it was started or last marked (``mark``: the grader marks
it when the runner says it has read its job, before any student code runs). The runner's own code cannot change that
number without giving the memory back, and a matrix as large as a memory case's full (T_q, T_k)
matrix takes far longer than a millisecond to fill. Linux only; elsewhere it measures nothing
(None), and the in-process measures stand alone."""
from __future__ import annotations

import os
import threading

INTERVAL = 0.001  # seconds between two readings


def _children(pid: int) -> list:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        pass
    return out


def processes(proc) -> list:
    """The host pids of a runner: a warm one's forked process (``pid_inside``), or a cold one's
    process and its descendants (a sandbox's bubblewrap and the interpreter inside it)."""
    inside = getattr(proc, "pid_inside", None)
    if inside:
        return [inside]
    todo, seen = [proc.pid], []
    while todo and len(seen) < 16:
        pid = todo.pop()
        seen.append(pid)
        todo += [c for c in _children(pid) if c not in seen]
    return seen


def resident(pids) -> int | None:
    """Bytes of memory of ``pids`` together that hold data, not code: anonymous pages (what an
    allocator gives out) and shared memory (a file in a memory file system, mapped), without the
    pages of files read from disk (libraries, which a forked runner maps again as it runs). None:
    none of them can be read."""
    total, read = 0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith((b"RssAnon:", b"RssShmem:")):
                        total += int(line.split()[1]) * 1024
            read = True
        except (OSError, ValueError, IndexError):
            pass
    return total if read else None


class Watch:
    """``with Watch(proc) as w:`` ... ``w.growth()``: the most the runner's resident memory has
    been above its first reading, in bytes, so far (None where it cannot be read)."""

    def __init__(self, proc, interval: float = INTERVAL):
        self.proc, self.interval = proc, interval
        self.first = self.most = None
        self._marks = 0  # (a reading taken before the latest mark is not counted after it)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp-resident-watch", daemon=True)

    def _run(self) -> None:
        pids, n = processes(self.proc), 0
        while not self._stop.is_set():
            n += 1
            if n % 50 == 0 and not getattr(self.proc, "pid_inside", None):
                pids = processes(self.proc)  # (a cold sandbox's interpreter starts a moment after bubblewrap)
            marks = self._marks
            now = resident(pids)
            with self._lock:
                if now is not None and marks == self._marks:
                    if self.first is None:
                        self.first = now
                    self.most = now if self.most is None else max(self.most, now)
            self._stop.wait(self.interval)

    def mark(self) -> None:
        """Measure from now on: growth is counted from this reading."""
        with self._lock:
            self._marks += 1
            self.first = self.most = resident(processes(self.proc))

    def growth(self) -> int | None:
        with self._lock:
            return None if self.first is None or self.most is None else self.most - self.first

    def __enter__(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading (what was read so far stays); again: nothing."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __exit__(self, *exc):
        self.stop()
        return False
