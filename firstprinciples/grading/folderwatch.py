"""The one host folder a sandboxed kernel can write to, watched from outside.

A kernel talks to the grader over Unix sockets in a folder of its own on the host
(``parallel.GraderBoundKernelManager``): the kernel must be able to create its sockets there, so
the folder is writable to it. Nothing else belongs there. A kernel that writes anything else (a
file, a folder, a link: files are capped at ``FP_SANDBOX_FILE_MB`` each, but not in number, so a
loop of them could fill the host's disk) is killed at once by this watcher, which runs in the
grading process, outside the sandbox: Linux's inotify tells it of every entry made in a watched
folder as it is made, and an entry that is not a socket costs the kernel its life (the notebook
goes on in a fresh kernel, with a note saying why). What was written is removed.

Linux only (inotify); elsewhere there is no sandbox either.
"""
from __future__ import annotations

import ctypes
import os
import select
import shutil
import stat
import struct
import sys
import threading

IN_MODIFY, IN_CREATE, IN_MOVED_TO = 0x2, 0x100, 0x80
IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, padded with NULs

_WATCHERS: dict = {}  # pid -> this process's watcher (a forked worker makes its own)


class FolderWatch:
    def __init__(self):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._lock = threading.Lock()
        self._folders: dict = {}  # watch descriptor -> (folder, kill)
        self.reasons: dict = {}  # folder -> why its kernel was killed
        threading.Thread(target=self._run, name="fp-folderwatch", daemon=True).start()

    def watch(self, folder: str, kill) -> None:
        """Kill (``kill()``) whatever writes into ``folder`` anything but a socket."""
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(folder), IN_CREATE | IN_MOVED_TO | IN_MODIFY)
        if wd < 0:
            return
        with self._lock:
            self._folders[wd] = (folder, kill)
        for name in os.listdir(folder):  # (what was made before the watch began)
            self._check(folder, name, kill)

    def forget(self, folder: str) -> None:
        with self._lock:
            for wd, (f, _kill) in list(self._folders.items()):
                if f == folder:
                    del self._folders[wd]
                    self._libc.inotify_rm_watch(self._fd, wd)

    def _run(self) -> None:
        while True:
            select.select([self._fd], [], [], 1.0)
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:  # pragma: no cover (the descriptor is gone)
                return
            at = 0
            while at + _EVENT.size <= len(data):
                wd, _mask, _cookie, size = _EVENT.unpack_from(data, at)
                name = data[at + _EVENT.size: at + _EVENT.size + size].rstrip(b"\0").decode(errors="replace")
                at += _EVENT.size + size
                with self._lock:
                    entry = self._folders.get(wd)
                if entry is not None and name:
                    self._check(entry[0], name, entry[1])

    def _check(self, folder: str, name: str, kill) -> None:
        path = os.path.join(folder, name)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                return
        except FileNotFoundError:
            return
        if folder not in self.reasons:
            self.reasons[folder] = (f"it wrote {name[:80]!r} into the folder the grader keeps for its sockets, "
                                    "where nothing else may be written")
        try:
            kill()
        except Exception:  # (the kernel was already gone)
            pass
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
        except OSError:
            pass


def watcher() -> FolderWatch | None:
    """This process's watcher (None where inotify is not available)."""
    if not sys.platform.startswith("linux"):
        return None
    pid = os.getpid()
    if pid not in _WATCHERS:
        try:
            _WATCHERS[pid] = FolderWatch()
        except OSError:
            _WATCHERS[pid] = None
    return _WATCHERS[pid]


def reason(folder: str | None) -> str | None:
    """Why the kernel of ``folder`` was killed by this process's watcher, if it was (said once)."""
    w = _WATCHERS.get(os.getpid())
    return w.reasons.pop(folder, None) if w is not None and folder else None
