"""Nothing of a sandbox outlives the grader that started it, even a grader killed while
bubblewrap was still setting the sandbox up.

Bubblewrap's outer process lets the sandbox's side go on (an eventfd) only after it has
written its info; killed before that (by --die-with-parent, or by a write to a pipe that
nobody reads any more), it leaves the sandbox's side waiting on that eventfd for ever: a
process that no signal of the grader's reaches and that holds its cgroups. The first test
recreates that moment exactly (the grader dies while bubblewrap is stopped at its start); the
others check the sweep that removes whatever a dead owner's sandbox left running.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from firstprinciples.grading import sandbox, warm

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")
needs_linux = pytest.mark.skipif(not warm.available(), reason="warm sandboxes need Linux and fork")
needs_cgroups = pytest.mark.skipif(not os.access(sandbox.CGROUP_ROOT / "pids", os.W_OK),
                                   reason="needs a writable cgroup tree (run as root)")


def _naming(text: str) -> list[str]:
    """Live (not zombie) processes whose command line contains ``text``."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()[1:]
            if text in line and not line.split(None, 2)[1].startswith("Z") and "ps -ww" not in line]


def _wait_gone(text: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while _naming(text) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _naming(text)


def _kill_all(text: str) -> None:
    for line in _naming(text):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass


GRADER_DIES_AT_BWRAPS_START = """
import os, signal, subprocess, sys
from firstprinciples.grading import sandbox, warm

report = int(sys.argv[2])
real = subprocess.Popen

def popen_then_die(cmd, *a, **kw):
    # The placeholder's shell joins the cgroups, then becomes bubblewrap: here it stops itself
    # just before, and this grader dies while it is stopped.
    assert cmd[:2] == ["/bin/sh", "-c"] and cmd[2].endswith('exec "$@"'), cmd
    cmd = [*cmd[:2], cmd[2].replace('exec "$@"', 'kill -STOP $$ && exec "$@"'), *cmd[3:]]
    proc = real(cmd, *a, **kw)
    while True:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
    os.write(report, str(proc.pid).encode())
    os.kill(os.getpid(), signal.SIGKILL)

warm.subprocess.Popen = popen_then_die
# The sandbox's groups in the test's name (alive), not this grader's: another grader's sweep
# would otherwise kill the stopped placeholder as soon as this process is gone.
made = sandbox.group_name
sandbox.group_name = lambda owner=None: made(owner=os.getppid())
null = os.open(os.devnull, os.O_RDWR)
warm.launch("kernel", sandboxed=True, fds=[null, null, null], argv=["-c", "pass"], ro_binds=[sys.argv[1]])
"""


@needs_bwrap
@needs_linux
def test_a_sandbox_whose_grader_died_during_its_set_up_ends(tmp_path):
    """Fails when bubblewrap's info goes through a pipe: resumed with its reader gone, the outer
    process dies writing it, and the sandbox's side waits for ever."""
    marker = tmp_path / "marker-of-this-test"
    marker.write_text("")
    read, write = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", GRADER_DIES_AT_BWRAPS_START, str(marker), str(write)],
                             pass_fds=[write])
    os.close(write)
    try:
        assert child.wait(timeout=60) == -signal.SIGKILL
        with os.fdopen(read, "rb") as f:
            holder = int(f.read() or 0)
        assert holder, "the grader died before it started bubblewrap"
        assert _naming(str(marker)), "the placeholder is not there: this test checks nothing"
        os.kill(holder, signal.SIGCONT)  # the shell becomes bubblewrap, its grader gone
        assert _wait_gone(str(marker)) == []
    finally:
        _kill_all(str(marker))
        sandbox.sweep_cgroups()  # (the test's own leftovers, whatever happened)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _group_with_sleeper(name: str, marker: str) -> tuple[list[str], subprocess.Popen]:
    """Groups ``name`` with a shell (and its sleep) in them, as a sandbox's placeholder joins
    its groups. The groups stay this process's pending ones (never swept) until it is in them."""
    groups, _ = sandbox.make_cgroups(name)
    assert groups, "no cgroup could be made"
    proc = subprocess.Popen(warm._joining(groups, os.getpid(), ["sh", "-c", f"sleep 1000; : {marker}"]),
                            start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
            _naming(marker) and all((Path(g) / "cgroup.procs").read_text().strip() for g in groups)):
        time.sleep(0.02)
    sandbox._PENDING.discard(name)
    return groups, proc


@needs_cgroups
def test_the_sweep_ends_what_a_dead_owners_sandbox_left_running(tmp_path):
    marker = str(tmp_path / "orphan")
    name = sandbox.group_name(owner=_dead_pid())
    groups, proc = _group_with_sleeper(name, marker)
    try:
        assert _naming(marker), "the process did not start"
        sandbox.sweep_cgroups()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert _wait_gone(marker) == []
        sandbox.sweep_cgroups()  # (a killed process holds its group until it is reaped: here, by this test)
        assert not any(os.path.isdir(g) for g in groups), "the dead owner's groups are left"
    finally:
        _kill_all(marker)
        sandbox.sweep_cgroups()


@needs_cgroups
@pytest.mark.parametrize("whose", ["a live process", "this process", "another PID namespace"])
def test_the_sweep_leaves_a_group_that_is_not_a_dead_owners(tmp_path, whose):
    marker = str(tmp_path / "kept")
    keeper = subprocess.Popen(["sleep", "1000"]) if whose == "a live process" else None
    if whose == "another PID namespace":  # the same pid numbers, counted elsewhere: no owner here
        name = f"fp-sandbox-{_dead_pid()}-1-{os.urandom(6).hex()}"
    else:
        name = sandbox.group_name(owner=keeper.pid if keeper else None)
    groups, proc = _group_with_sleeper(name, marker)
    try:
        assert _naming(marker), "the process did not start"
        sandbox.sweep_cgroups()
        time.sleep(0.2)
        assert proc.poll() is None, ("the sweep killed a process of a group it does not own", proc.stderr.read(), groups)
        assert all(os.path.isdir(g) for g in groups)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # (the shell and its sleep)
        proc.wait()
        if keeper:
            keeper.kill()
            keeper.wait()
        for g in groups:
            for _ in range(50):
                try:
                    os.rmdir(g)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
