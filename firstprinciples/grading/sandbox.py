"""Launch an IPython kernel, or the trusted re-check's runner, inside a bubblewrap sandbox.

Used as a Jupyter kernel (see ``kernels/fp-sandbox/kernel.json``)::

    python -m firstprinciples.grading.sandbox -f CONNECTION_FILE

and by the trusted grader for its re-check (``python -m firstprinciples.grading.sandbox
--recheck``: the same sandbox and caps, talking over standard input and output, with
no host folder writable at all).

The kernel talks to the grader over Unix sockets: the grader's kernel manager
uses ``transport = "ipc"`` with an absolute ``ip`` in a folder private to the
grading process, one per kernel (``nbgrader_config.py`` sets both). That folder and the
connection file (read-only) are the only host paths the kernel can reach
besides the read-only system; its ``/tmp`` is new and empty. Inside the sandbox:

- no network (its own network namespace: not even the host's loopback);
- the system, the Python installation and the course package are read-only;
  the rest of the course folder (``solutions/``, ``gradebook.db``,
  ``submitted/``, ``autograded/``, the notebook file itself) is not there;
- its own process namespace: when the kernel ends, every process it started
  ends with it (``--die-with-parent``, ``--unshare-pid``);
- limits: memory and number of processes (cgroups, when the grader may create
  them, else rlimits), file size, CPU seconds, no core dumps.

The limits are set by environment variables (``FP_SANDBOX_MEMORY_MB``,
``FP_SANDBOX_PIDS``, ``FP_SANDBOX_FILE_MB``, ``FP_SANDBOX_CPU_SECONDS``), with
defaults below that fit one student's notebook on the course's exercises.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
import uuid
from pathlib import Path

import firstprinciples

MEMORY_MB = int(os.environ.get("FP_SANDBOX_MEMORY_MB", 3072))
PIDS = int(os.environ.get("FP_SANDBOX_PIDS", 256))
FILE_MB = int(os.environ.get("FP_SANDBOX_FILE_MB", 64))
CPU_SECONDS = int(os.environ.get("FP_SANDBOX_CPU_SECONDS", 600))

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSTEM_DIRS = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys"]
KEEP_ENV = ("PATH", "LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TZ")


def package_dir() -> Path:
    return Path(firstprinciples.__file__).resolve().parent


def python_dirs() -> list[str]:
    """The installation's folders that the kernel needs, read-only."""
    import site

    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    # Site folders only: never sys.path's current folder (the submission's own folder). Besides the
    # interpreter's own, the site folders a .pth file put on sys.path (an environment layered on
    # another's packages).
    layered = [p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")]
    dirs.update(p for p in [*site.getsitepackages(), site.getusersitepackages(), *layered] if os.path.isdir(p))
    # Keep only the outermost folders.
    out = []
    for d in sorted(os.path.realpath(d) for d in dirs):
        if not any(d == o or d.startswith(o + os.sep) for o in out):
            out.append(d)
    return out


def _cgroup(controller: str, name: str) -> Path | None:
    base = CGROUP_ROOT / controller
    if not base.is_dir() or not os.access(base, os.W_OK):
        return None
    group = base / name
    try:
        group.mkdir(exist_ok=True)
    except OSError:
        return None
    return group


_PENDING: set = set()  # this process's groups made and not yet entered (never swept)


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def group_name(owner: int | None = None) -> str:
    """A fresh sandbox cgroup's name, with the pid of the process that removes it when done and
    the PID namespace that pid is counted in (a grader in another container sees the same
    cgroups, not the same processes: it leaves this one's groups alone)."""
    return f"fp-sandbox-{owner or os.getpid()}-{_pid_namespace()}-{uuid.uuid4().hex[:12]}"


def _owner(group: Path) -> str:
    """Whose ``group`` is: "mine" (this process's), "live" (a live process's, or another PID
    namespace's: never touched), "gone" (its owner has died), or "unknown" (a name without its
    owner: anybody's to remove once it is empty)."""
    parts = group.name[len("fp-sandbox-"):].split("-")
    if len(parts) < 2 or not parts[0].isdigit():
        return "unknown"
    if len(parts) >= 3 and parts[1] != _pid_namespace():
        return "live"
    owner = int(parts[0])
    if owner == os.getpid():
        return "live" if group.name in _PENDING else "mine"
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return "gone"
    except OSError:
        pass
    return "live"


def _kill_members(group: Path, rounds: int = 50) -> None:
    """SIGKILL every process in ``group`` until it is empty (a process that forks in between is
    found again in the next round)."""
    import signal

    for _ in range(rounds):
        try:
            pids = [int(x) for x in (group / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return
        pids = [pid for pid in pids if pid > 0]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def sweep_cgroups() -> None:
    """Remove the groups of sandboxes whose owner is gone (a killed kernel's launcher, a killed
    grader), and this process's own empty ones (rmdir fails on a busy one). What still runs
    in a group whose owner is gone is killed first: a sandbox is meant to die with its owner
    (bubblewrap's --die-with-parent), but one whose owner died while bubblewrap was still
    setting it up can be left waiting for ever. A live owner's groups are never swept by
    another process: it may have made them a moment ago and not yet put a process in them."""
    for controller in ("pids", "memory"):
        for group in (CGROUP_ROOT / controller).glob("fp-sandbox-*"):
            owner = _owner(group)
            if owner == "live":
                continue
            if owner == "gone":
                _kill_members(group)
            for attempt in range(5 if owner == "gone" else 1):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if owner == "gone":
                        time.sleep(0.005 * (attempt + 1))


def make_cgroups(name: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Fresh cgroups ``name`` with the sandbox's limits (memory, processes): return the groups
    that took effect and the rlimits that cap the rest. Each controller stands alone: one
    whose group could not be set up (no rights, or a grader's sweep removed the group while it
    was still empty) is left out, and an rlimit caps that resource instead."""
    sweep_cgroups()
    _PENDING.add(name)
    mem_limit = str(MEMORY_MB * 2**20)
    limits = {"pids": [("pids.max", str(PIDS))],
              "memory": [("memory.limit_in_bytes", mem_limit), ("memory.memsw.limit_in_bytes", mem_limit)]}
    groups, active = [], []
    for controller, settings in limits.items():
        group = _cgroup(controller, name)
        if group is None:
            continue
        try:
            for i, (setting, value) in enumerate(settings):
                if i == 0 or (group / setting).exists():  # the swap limit exists only with swap accounting
                    (group / setting).write_text(value)
            groups.append(str(group))
            active.append(controller)
        except OSError:
            try:
                group.rmdir()
            except OSError:
                pass
    return groups, rlimits(active)


def rlimits(controllers: list[str]) -> list[tuple[int, int]]:
    """File size, CPU time, no core dumps; memory and processes when no cgroup caps them."""
    out = [(resource.RLIMIT_FSIZE, FILE_MB * 2**20), (resource.RLIMIT_CPU, CPU_SECONDS), (resource.RLIMIT_CORE, 0)]
    if "memory" not in controllers:
        out.append((resource.RLIMIT_AS, 2 * MEMORY_MB * 2**20))
    if "pids" not in controllers:
        out.append((resource.RLIMIT_NPROC, PIDS))
    return out


def enter_cgroups(name: str) -> list[str]:
    """Put this process (and so the whole sandbox) into fresh cgroups with limits; return the
    controllers that took effect (``set_rlimits`` caps the rest)."""
    groups, _ = make_cgroups(name)
    _PENDING.discard(name)
    active = []
    for group in groups:
        try:
            (Path(group) / "cgroup.procs").write_text(str(os.getpid()))
            active.append(Path(group).parent.name)
        except OSError:
            try:
                os.rmdir(group)
            except OSError:
                pass
    return active


def set_rlimits(controllers: list[str]) -> None:
    for kind, value in rlimits(controllers):
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):
            pass


def sandbox_env() -> dict:
    """The environment inside the sandbox: nothing of the grader's but these."""
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    env.update({"HOME": "/tmp", "IPYTHONDIR": "/tmp/.ipython", "MPLCONFIGDIR": "/tmp/.matplotlib",
                "JUPYTER_RUNTIME_DIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "FP_SANDBOXED": "1",
                "KINETO_LOG_LEVEL": "5"})
    return env


def bwrap_command(kernel_argv: list[str], binds: list[str] = (), ro_binds: list[str] = ()) -> list[str]:
    """The bubblewrap command that runs ``kernel_argv`` in the sandbox, with the host
    folders ``binds`` (writable) and files ``ro_binds`` (read-only) visible at their paths."""
    pkg = str(package_dir())
    cmd = ["bwrap", "--unshare-all", "--uid", "65534", "--gid", "65534", "--die-with-parent", "--new-session",
           "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for d in SYSTEM_DIRS:
        if os.path.exists(d):
            cmd += ["--ro-bind", d, d] if not os.path.islink(d) else ["--symlink", os.readlink(d), d]
    for d in python_dirs():
        cmd += ["--ro-bind", d, d]
    cmd += ["--ro-bind", pkg, pkg]  # the course package, not the rest of the course folder
    for d in binds:
        cmd += ["--bind", d, d]
    for f in ro_binds:
        cmd += ["--ro-bind", f, f]
    cmd += ["--chdir", "/tmp", "--clearenv"]
    for k, v in sandbox_env().items():
        cmd += ["--setenv", k, v]
    cmd += ["--"]
    return cmd + kernel_argv


def run_sandboxed(cmd: list[str]) -> None:
    """Cap this process (cgroups, else rlimits), then run ``cmd`` in it; exits with its status."""
    name = group_name()
    controllers = enter_cgroups(name)
    set_rlimits(controllers)
    groups = [CGROUP_ROOT / c / name for c in controllers]
    if not groups:
        os.execvp(cmd[0], cmd)
    # With cgroups, stay as the parent so that the (empty) groups can be removed afterwards.
    import signal
    import subprocess

    proc = subprocess.Popen(cmd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    code = proc.wait()
    for g in groups:
        try:
            g.rmdir()
        except OSError:
            pass
    sys.exit(code)


def recheck_command(sandboxed: bool = True) -> list[str]:
    """How the grader starts the trusted re-check's runner (``firstprinciples.grading.recheck``):
    in the sandbox (its own caps, no socket folder: it talks over standard input and output),
    or as a plain process where there is no sandbox (a student's own check)."""
    runner = [sys.executable, "-m", "firstprinciples.grading.recheck"]
    if not sandboxed:
        return runner
    return [sys.executable, "-m", "firstprinciples.grading.sandbox", "--recheck"]


# The grading kernel's options: no history file, and no banner ("NOTE: When using the
# `ipython kernel` entry point, Ctrl-C will not work ... --existing kernel-....json"),
# which ipykernel prints on every start unless its log level is CRITICAL: 10 lines per
# notebook in the grading log.
KERNEL_OPTIONS = ("--HistoryManager.hist_file=:memory:", "--IPKernelApp.log_level=CRITICAL")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-f", dest="connection_file")
    parser.add_argument("--recheck", action="store_true", help="run the trusted re-check's runner instead of a kernel")
    args = parser.parse_args(argv)
    if shutil.which("bwrap") is None:
        sys.exit("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    if args.recheck:
        run_sandboxed(bwrap_command([sys.executable, "-m", "firstprinciples.grading.recheck"]))
    if not args.connection_file:
        parser.error("-f CONNECTION_FILE is required")
    with open(args.connection_file) as f:
        info = json.load(f)
    if info.get("transport") != "ipc" or not os.path.isabs(info.get("ip", "")):
        sys.exit("the sandboxed kernel needs the ipc transport with an absolute ip: set "
                 "c.AsyncKernelManager.transport = 'ipc' and c.AsyncKernelManager.ip (nbgrader_config.py does)")
    socket_dir = os.path.dirname(info["ip"])
    if socket_dir in ("/", "/tmp") or not os.path.isdir(socket_dir):
        sys.exit(f"the kernel's socket folder {socket_dir!r} must be a private, existing folder")
    kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", args.connection_file, *KERNEL_OPTIONS]
    connection_file = os.path.realpath(args.connection_file)
    run_sandboxed(bwrap_command(kernel, binds=[socket_dir], ro_binds=[connection_file]))


if __name__ == "__main__":
    main()
