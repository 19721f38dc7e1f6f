"""Warm kernels: Python and torch are started once per grading process, not once per notebook.

Starting an interpreter and importing torch, numpy, IPython and the course package
costs about two seconds of CPU; the cells of a solution notebook take a tenth of
that. So each grading command (shared by all its workers, each with a connection of its
own) and each student's check command starts one
**template** (``python -m firstprinciples.grading.warm``): a process that does those
imports and then only waits for requests. It never runs student code, never
creates a thread, a zmq context or an event loop, and never sees a notebook.

For each notebook's kernel, and for each run of the trusted re-check, the grader:

1. starts the sandbox exactly as the cold path does (``sandbox.bwrap_command``: the
   same bubblewrap namespaces, binds, read-only system, new empty ``/tmp``, no
   network), but with a placeholder command inside (``sh`` that says it is ready and
   then waits on a pipe), and creates the sandbox's cgroups (memory, processes);
2. asks the template to fork. The child joins the sandbox's cgroups, then every
   namespace of the placeholder (user, mount, network, IPC, UTS, cgroup, PID: its
   root becomes the sandbox's root) and forks once more, so that the grandchild is
   inside the sandbox's PID namespace. The grandchild sets the sandbox's
   environment, working folder and rlimits, drops every capability (as
   bubblewrap does, with ``no_new_privs``), gives Python's ``random`` and numpy a
   fresh seed, closes every descriptor but the ones it was handed, and becomes the
   kernel (``ipykernel``) or the re-check's runner (``recheck.main``);
3. holds the sandbox open for as long as the kernel lives: the placeholder reads a
   pipe whose only writer is the kernel. When the kernel ends, the placeholder
   ends, the sandbox's PID 1 ends and the kernel takes every process in the
   sandbox with it, exactly as a cold kernel's sandbox does. Killing it (nbclient's
   "immediate" shutdown, a hang) kills the sandbox and the kernel.

A grading process (a grading command's worker, the students' check command) asks for one more
kind of child, never sandboxed, once: its trusted re-check's side (``verdicts.serve``), which
runs no student code, serves that process's notebooks one after another, and gets a connection
of its own to the template, to ask for the re-check's runners in turn (``CONNECTED``). What a
kernel's start does not need the template does when it is idle, one step at a time, answering
any request between two steps, so a kernel asked for at once does not wait for it: first what
only the re-check's children need (the probes' registry, a first snapshot, which a runner's own
first snapshot starts from), then, once a re-check's runner has been forked, what some of torch's
own code imports at its first call (``FIRST_BACKWARD``) and what IPython's first traceback in a
kernel reads and compiles (``_prepare_tracebacks``: most of a failing notebook's first traceback,
0.2 s). A service may also ask it to import a module of ``LAZY`` (torch._dynamo,
which the capstone's optimizer imports at its first step: 0.9-1.3 s in every kernel and
runner that needs it) once a re-check of its needed it: the template imports it between two
requests and forks nothing for it, and every child forked after has it. The check command's
template (``one_notebook``) serves one kernel, one service and its runner: it does only the
first of those steps, once the service is forked, and none that only later children would use
(they took a core from the runner, the check's last step).

So a kernel starts from the template's clean state (the modules imported, nothing
run), in a sandbox of its own: one student's kernel shares no process, no
``/tmp``, no socket folder and no memory with another's (a fork copies memory;
nothing is shared back). What differs from a cold start, and why it does not
matter: the modules are already imported (a cold kernel imports the same ones
at its first cell) and some of their caches filled (the files IPython's first traceback reads,
parsed; torch's table of function names), ``hash()``'s seed is the template's (fixed per grading
command instead of per notebook), ``sys.flags.safe_path`` is set, and the objects
the template made are frozen out of the garbage collector's generations
(``gc.freeze``: a collection walks only what the kernel made; ``gc.get_objects()``
does not list them).

Where it cannot be used the cold path is taken, per kernel, with a line in the log:
no ``fork`` (Windows), not Linux (macOS forbids much after a fork), or the template
could not join a sandbox's namespaces (a setuid bubblewrap). ``FP_GRADING_COLD=1``
forces the cold path (the benchmark compares both).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from traitlets import default

COLD_ENV = "FP_GRADING_COLD"
# What torch imports at the first backward pass handed an explicit output gradient
# (``out.backward(g)``, ``torch.autograd.gradcheck``) and at the first ``Module.to_empty`` (sympy
# among it: 0.3-0.9 s). The course's checks, probes and reference results do neither any more
# (``exercises.adapters.vector_jacobian``); a student's own ``backward(g)``
# still does.
FIRST_BACKWARD = "torch.fx.experimental.symbolic_shapes"


def preload_first_backward() -> None:
    """Import ``FIRST_BACKWARD`` (in the template once it is idle: a failure only means it is
    imported later, where it is needed)."""
    try:
        __import__(FIRST_BACKWARD)
    except Exception:  # noqa: BLE001
        pass

# What the template imports once, before it answers its first request: what every kernel and
# every re-check imports anyway. (Not matplotlib: its backend is chosen at import time, and a
# kernel sets it first.)
PRELOAD = ("torch", "numpy", "numpy.random", "IPython", "ipykernel.kernelapp", "ipykernel.ipkernel",
           "ipykernel.debugger", "tornado.queues", "tornado.locks", "firstprinciples.checks",
           "firstprinciples.grading.declared",
           "firstprinciples.reference", "firstprinciples.grading.recheck")
# Not ``FIRST_BACKWARD`` (0.3-0.5 s), which a kernel's start does not need: the template imports it
# when no request is waiting (``main``), last, and only once a re-check's runner has been forked.
# So the check command's kernel, service and runner are forked without waiting for it; a child
# forked before imports it itself where it needs it, as a cold one does.
from .recheck import LAZY  # noqa: E402 (what the template imports on request: see there)
# The kinds of child that get a connection of their own to the template, to ask for children in
# turn: a grading process's trusted re-check service (``verdicts``; never sandboxed, it runs no
# student code), which starts the re-check's runners.
CONNECTED = ("verdicts",)
HOLD = ["/bin/sh", "-c", "echo ready; exec cat >/dev/null"]  # the sandbox's placeholder
ONE_NOTEBOOK = "--one-notebook"  # the template's option: it serves one notebook's children only (``main``)
PRELOAD_REQUEST = "preload"  # a request that forks nothing: the template imports modules of LAZY
READY_TIMEOUT = 60  # seconds for a sandbox to be set up (normally milliseconds)

_NS = (("user", 0x10000000), ("cgroup", 0x02000000), ("ipc", 0x08000000), ("uts", 0x04000000),
       ("net", 0x40000000), ("pid", 0x20000000), ("mnt", 0x00020000))
_PR_SET_PDEATHSIG, _PR_SET_NAME, _PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER = 1, 15, 38, 24, 36


class WarmError(RuntimeError):
    """The template could not start a child (the caller falls back to the cold path)."""


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork") and not os.environ.get(COLD_ENV)


@functools.lru_cache(maxsize=None)
def _libc():
    """The C library's functions (prctl), loaded once per process: the symbols this process
    already has (``dlopen(NULL)``), not ``ctypes.util.find_library``, which runs ``ldconfig -p``
    each time (three runs a notebook, in processes that hold torch)."""
    lib = ctypes.CDLL(None, use_errno=True)
    if not hasattr(lib, "prctl"):  # (not Linux: nothing here calls it there)
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return lib


# ================================================================ the grader's side
class Template:
    """The grading process's template (started on first use; dies with this process)."""

    _current: dict = {}  # (pid of the owning process, sandboxed) -> Template
    _ahead: list = []  # started ahead for the workers this process forks next (``start_ahead``)

    @classmethod
    def get(cls, sandboxed: bool, one_notebook: bool = False) -> "Template":
        """This process's template (started now if it has none, or its last one died).
        ``one_notebook``: a new one serves the children of one notebook only (the check command's),
        and so does nothing for later ones when it is idle (``main``)."""
        key = (os.getpid(), sandboxed)
        t = cls._current.get(key)
        if t is None or not t.alive():
            t = cls._current[key] = cls(sandboxed, one_notebook=one_notebook)
        return t

    @classmethod
    def start_ahead(cls, count: int, sandboxed: bool, env: dict) -> None:
        """Start one template now for the ``count`` workers this process is about to fork, with
        ``env`` set as the workers will have it: its imports then overlap this process's own,
        instead of following them. It has a socket for each worker (each takes its own with
        ``adopt``) and serves them all: one interpreter's start-up for the whole command,
        not one per worker. It ends when the last of its workers has."""
        cls._ahead = cls(sandboxed, env, connections=count).handles

    @classmethod
    def adopt(cls, index: int) -> None:
        """In worker ``index``, just forked: its connection to the template started ahead is its
        own; its copies of the other workers' sockets are closed."""
        ahead, cls._ahead = cls._ahead, []
        for i, t in enumerate(ahead):
            if i == index:
                t._child = False  # (a child of the forking process, not of this one)
                cls._current[(os.getpid(), t.sandboxed)] = t
            else:
                t.sock.close()

    @classmethod
    def hand_over(cls) -> list:
        """In the forking process, once the workers are forked: close its copies of the
        sockets of the template started ahead; return its process (to be reaped)."""
        ahead, cls._ahead = cls._ahead, []
        for t in ahead:
            t.sock.close()
        return list({id(t.proc): t.proc for t in ahead}.values())

    def alive(self) -> bool:
        if self._child:
            return self.proc.poll() is None
        try:  # not a child of this process: poll() cannot see it; a dead one is a zombie
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def __init__(self, sandboxed: bool, env: dict | None = None, connections: int = 1, _proc=None, _sock=None,
                 one_notebook: bool = False):
        """Start a template with ``connections`` sockets: this object uses the first, and
        ``handles`` lists one object per socket, all of the same process."""
        self.sandboxed = sandboxed
        self._child = True
        self._lock = threading.Lock()
        if _proc is not None:  # another connection to a template already started
            self.proc, self.sock, self.handles = _proc, _sock, [self]
            return
        from .sandbox import sandbox_env

        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(max(1, connections))]
        parent = os.getpid()
        # The template's environment is the sandbox's own (with ``env``: what the grader's workers
        # set), so that whatever torch reads from it at import is what a cold kernel would read.
        env = {**(sandbox_env() if sandboxed else os.environ), **(env or {})}
        theirs = [t.fileno() for _, t in pairs]
        env.update({"PATH": os.environ.get("PATH", os.defpath), "FP_WARM_SOCKET": ",".join(map(str, theirs)),
                    "PYDEVD_DISABLE_FILE_VALIDATION": "1"})  # (the debugger's banner, printed at its import)
        if sandboxed:
            env.pop("FP_SANDBOXED", None)  # the template itself is not in a sandbox
        libc = _libc()

        def bind():
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)

        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "firstprinciples.grading.warm",
                                      *([ONE_NOTEBOOK] if one_notebook else [])],
                                     stdin=subprocess.DEVNULL, pass_fds=theirs, env=env, cwd="/",
                                     preexec_fn=bind if threading.current_thread() is threading.main_thread()
                                     else None, start_new_session=True)
        for _, t in pairs:
            t.close()
        self.sock = pairs[0][0]
        self.handles = [self] + [Template(sandboxed, _proc=self.proc, _sock=ours) for ours, _ in pairs[1:]]

    def spawn(self, request: dict, fds: list[int], timeout: float = 120) -> int:
        """Fork a child of the template that becomes ``request["kind"]``; return its pid."""
        reply = self._ask(request, fds, timeout)
        if "error" in reply:
            raise WarmError(reply["error"])
        return int(reply["pid"])

    def preload(self, modules: list) -> list:
        """Ask the template to import ``modules`` (those of ``LAZY`` only) before its next child;
        return the ones it has now."""
        reply = self._ask({"kind": PRELOAD_REQUEST, "modules": list(modules)}, [], READY_TIMEOUT)
        return list(reply.get("preloaded", []))

    def _ask(self, request: dict, fds: list[int], timeout: float) -> dict:
        """Send one request (with descriptors ``fds``) and return the template's reply."""
        with self._lock:
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
                ready, _, _ = select.select([self.sock], [], [], timeout)
                data = self.sock.recv(1 << 16) if ready else None
            except OSError as e:
                data, why = None, f"the template is gone ({e})"
            else:
                why = "the template is gone" if ready else f"the template did not answer within {timeout:g} s"
            if not data:
                # (a late answer would be taken for the next request's: this template is done)
                self.close()
                raise WarmError(why)
        return json.loads(data)

    def close(self) -> None:
        """Close this connection; a template that is still alive is killed (it did not answer,
        or its process is done with it), even when other workers share it: they start
        their own on their next request."""
        try:
            self.sock.close()
        finally:
            if self.alive():
                self.proc.kill()
                if self._child:
                    self.proc.wait()
            for key, t in list(Template._current.items()):
                if t is self:
                    del Template._current[key]


class WarmProcess:
    """What jupyter_client (and the re-check) hold as "the kernel's process": the sandbox's
    placeholder (a child of the grader) and the forked kernel inside it (a pidfd)."""

    def __init__(self, holder: subprocess.Popen, pid: int, groups=()):
        self.holder, self.pid_inside, self.groups = holder, pid, list(groups)
        self.pid = holder.pid
        self.stdin = self.stdout = self.stderr = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # already gone
            self._pidfd = None

    def poll(self):
        return self.holder.poll()

    def wait(self, timeout=None):
        code = self.holder.wait(timeout)
        self._release()
        return code

    def _release(self) -> None:
        """Remove the sandbox's cgroups once everything in them has ended (the kernel ends with
        the sandbox's PID 1, a moment after the placeholder; what is still busy now is
        removed by this process's next sweep)."""
        for attempt in range(20):
            self.groups = [g for g in self.groups if os.path.isdir(g) and not _rmdir(g)]
            if not self.groups:
                return
            time.sleep(0.005 * (attempt + 1))

    def send_signal(self, signum: int) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
                os.killpg(self.pid_inside, signum)  # what the kernel started (its process group)
            except OSError:
                pass
        if self.holder.poll() is None:
            try:
                os.killpg(self.holder.pid, signum)
            except OSError:
                self.holder.send_signal(signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self):
        if getattr(self, "_pidfd", None) is not None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


def launch(kind: str, *, sandboxed: bool, fds: list[int], argv: list[str] | None = None, cwd: str = "/tmp",
           binds=(), ro_binds=(), env: dict | None = None, preexec=None, template: bool | None = None) -> WarmProcess:
    """Start a warm ``kind`` ("kernel", "recheck", or unsandboxed "verdicts") with standard input, output and error
    ``fds``: in a new sandbox (``sandboxed``) or as a plain process, forked by this process's
    template for sandboxed or for plain children (``template``; default: ``sandboxed``). Raises
    WarmError when the template cannot do it (the caller starts a cold one instead). ``preexec``:
    run in a plain child's placeholder before its exec (a sandbox dies with this process by
    bubblewrap's own --die-with-parent)."""
    from . import sandbox

    hold_r, hold_w = os.pipe()
    ready_r, ready_w = os.pipe()
    # Bubblewrap's info goes to a file in memory, not a pipe: its outer process writes it before it
    # lets the sandbox's side go on, and a write to a pipe whose reader (this process) has died kills
    # it there, leaving the other side waiting for ever. (A file takes the write whoever is gone.)
    info_r = info_w = os.memfd_create("fp-sandbox-info", os.MFD_CLOEXEC) if sandboxed else None
    groups: list = []
    holder = None
    try:
        if sandboxed:
            name = sandbox.group_name()
            groups, rlimits = sandbox.make_cgroups(name)
            cmd = sandbox.bwrap_command(HOLD, binds=list(binds), ro_binds=list(ro_binds))
            cmd[1:1] = ["--info-fd", str(info_w)]
            child_env = sandbox.sandbox_env()
        else:
            cmd, rlimits, child_env = HOLD, [], dict(env if env is not None else os.environ)
            if kind == "kernel":  # its parent, which jupyter_client's launcher names in JPY_PARENT_PID (read by
                # ipykernel at its import, in the template): without it, ipykernel prints its console banner
                argv = [*(argv or []), f"--IPKernelApp.parent_handle={Template.get(False).proc.pid}"]

        if sandboxed:
            # The placeholder joins the sandbox's cgroups (the sandbox's cgroup namespace is rooted
            # there) from a shell that then becomes bubblewrap, which dies with this process
            # (--die-with-parent): no Python code runs between fork and exec, so the holder is
            # started with vfork, not a fork that copies this process's page tables (a grading
            # process that holds torch: about 10 ms and thousands of page faults a sandbox).
            cmd = _joining(groups, os.getpid(), cmd)
            before = None
        else:
            before = preexec

        holder = subprocess.Popen(cmd, stdin=hold_r, stdout=ready_w, stderr=subprocess.DEVNULL,
                                  pass_fds=[info_w] if sandboxed else [], preexec_fn=before,
                                  start_new_session=True, close_fds=True)
        for fd in (hold_r, ready_w):
            os.close(fd)
        hold_r = ready_w = None
        ns_pid = _read_ready(ready_r, info_r if sandboxed else None, holder)
        request = {"kind": kind, "ns_pid": ns_pid, "cgroups": groups, "env": child_env, "cwd": cwd,
                   "argv": argv or [], "rlimits": rlimits, "drop_caps": sandboxed}
        pid = Template.get(sandboxed if template is None else template).spawn(request, [*fds, hold_w])
        return WarmProcess(holder, pid, groups)
    except BaseException:
        if holder is not None and holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        raise
    finally:
        if groups:
            sandbox._PENDING.discard(os.path.basename(groups[0]))
        for fd in (hold_r, hold_w, ready_w, ready_r, info_r):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _joining(groups: list, parent: int, cmd: list) -> list:
    """``cmd`` run by a shell that first checks that its parent is still ``parent`` and writes its
    own pid into each of ``groups``' ``cgroup.procs`` (a failure: it exits instead)."""
    import shlex

    steps = [f'[ "$PPID" = {int(parent)} ]'] + [f"echo $$ > {shlex.quote(os.path.join(g, 'cgroup.procs'))}"
                                                for g in groups]
    return ["/bin/sh", "-c", " && ".join(steps) + ' && exec "$@"', "sh", *cmd]


def kernel_request(kernel_cmd: list[str]) -> dict | None:
    """How to start ``kernel_cmd`` warm (the sandboxed course kernel, or a plain ipykernel),
    or None for a command this module does not know (it is started as it is)."""
    if "-f" not in kernel_cmd or kernel_cmd.index("-f") + 1 >= len(kernel_cmd):
        return None
    i = kernel_cmd.index("-f")
    connection_file, extra = kernel_cmd[i + 1], kernel_cmd[i + 2:]
    if kernel_cmd[1:3] == ["-m", "firstprinciples.grading.sandbox"] and i == 3:
        with open(connection_file) as f:
            info = json.load(f)
        if info.get("transport") != "ipc" or not os.path.isabs(info.get("ip", "")):
            return None  # the cold launcher explains what is wrong
        from .sandbox import KERNEL_OPTIONS

        return {"sandboxed": True, "binds": [os.path.dirname(info["ip"])],
                "ro_binds": [os.path.realpath(connection_file)],
                "argv": ["-f", connection_file, *KERNEL_OPTIONS, *extra]}
    if kernel_cmd[1:3] == ["-m", "ipykernel_launcher"] and i == 3 and os.path.realpath(kernel_cmd[0]) == \
            os.path.realpath(sys.executable):
        return {"sandboxed": False, "binds": [], "ro_binds": [], "argv": ["-f", connection_file, *extra]}
    return None


try:
    from jupyter_client.asynchronous import AsyncKernelClient
    from jupyter_client.manager import AsyncKernelManager
except ImportError:  # pragma: no cover (jupyter_client comes with nbclient)
    AsyncKernelClient = AsyncKernelManager = object


class ReadyKernelClient(AsyncKernelClient):
    """jupyter_client's kernel client, ready as soon as its kernel is.

    jupyter_client's ``wait_for_ready`` asks for ``kernel_info`` until the reply comes and IOPub
    carries a message, then empties IOPub until it has been silent for 0.2 s: every kernel
    start waited those 0.2 s (a warm kernel is up in 60 ms). Here the wait ends at the last
    message the kernel sends for that request, its "idle" status on IOPub, which also shows
    that IOPub is connected; as there, a request without it within 0.2 s (IOPub not
    subscribed yet) is asked again."""

    async def wait_for_ready(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
        while True:
            msg_id = self.kernel_info()
            reply = await self._message_for(self.shell_channel, msg_id, 1.0, lambda m: m["msg_type"] == "kernel_info_reply")
            # Its idle status; or ipykernel's greeting of a new IOPub subscriber (ipykernel 7),
            # after which the statuses cannot be missed: the request is then asked again at once.
            seen = reply and await self._message_for(self.iopub_channel, None, 0.2, lambda m: (
                m["msg_type"] == "status" and m["content"].get("execution_state") == "idle"
                and m.get("parent_header", {}).get("msg_id") == msg_id) or m["msg_type"] == "iopub_welcome")
            if seen and seen["msg_type"] == "status":
                self._handle_kernel_info_reply(reply)
                return
            if not await self._async_is_alive():
                raise RuntimeError("Kernel died before replying to kernel_info")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kernel didn't respond in {timeout:g} seconds")

    @staticmethod
    async def _message_for(channel, msg_id: str, wait: float, wanted):
        """The first message on ``channel`` answering ``msg_id`` (None: any) that is ``wanted``
        (others are dropped, as jupyter_client's wait drops them), or None after ``wait``
        seconds without one."""
        from queue import Empty

        end = time.monotonic() + wait
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            try:
                msg = await channel.get_msg(timeout=left)
            except Empty:
                return None
            if (msg_id is None or msg.get("parent_header", {}).get("msg_id") == msg_id) and wanted(msg):
                return msg


class WarmKernelManager(AsyncKernelManager):
    """A kernel manager whose kernels are forked from the template (``launch``); any other
    kernel, or when the template cannot, is started cold, as jupyter_client does. Its clients
    are ``ReadyKernelClient`` objects."""

    @default("client_factory")
    def _ready_clients(self):
        return ReadyKernelClient

    async def _async_wait(self, pollinterval: float = 0.1) -> None:
        # jupyter_client looks every 0.1 s whether a kernel it stopped has ended; one ends
        # milliseconds after its shutdown request, so every notebook waited ~0.1 s for nothing.
        await super()._async_wait(pollinterval=min(pollinterval, 0.005))

    def _warm_preexec(self):
        return None

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        request = kernel_request(kernel_cmd) if available() else None
        if request is not None:
            null = os.open(os.devnull, os.O_RDONLY)
            sink = os.open(os.devnull, os.O_WRONLY)
            try:
                # A sandboxed kernel's own stdout and stderr (where ipykernel echoes what reaches
                # its file descriptors, os.write and C code included, besides sending it to the
                # notebook) go nowhere: inherited, they were the grader's log, which a fork
                # bomb's children or a loop of os.write could flood. (Writable: a write there
                # must succeed, not fail with EBADF.)
                out = [sink, sink] if request["sandboxed"] else [1, 2]
                proc = launch("kernel", sandboxed=request["sandboxed"], fds=[null, *out], argv=request["argv"],
                              cwd="/tmp" if request["sandboxed"] else str(kw.get("cwd") or os.getcwd()),
                              binds=request["binds"], ro_binds=request["ro_binds"], env=kw.get("env"),
                              preexec=self._warm_preexec())
            except WarmError as e:
                _cold_note(e)
            else:
                prov = self.provisioner
                prov.process, prov.pid, prov.pgid = proc, proc.pid, None
                prov.cwd = kw.get("cwd") or os.getcwd()
                self._reconcile_connection_info(prov.connection_info)
                return
            finally:
                os.close(null)
                os.close(sink)
        return await super()._async_launch_kernel(kernel_cmd, **kw)


class Runner:
    """The trusted re-check's runner, warm: a callable for ``trusted.run_runner`` that forks it
    from the template (in a new sandbox when ``sandboxed``), or starts ``cold`` (an argument
    list) where the template cannot."""

    def __init__(self, cold: list, sandboxed: bool):
        self.cold, self.sandboxed = cold, sandboxed

    def __call__(self):
        from .trusted import start_runner

        if not available():
            return start_runner(self.cold)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        null = os.open(os.devnull, os.O_WRONLY)
        env = {**os.environ, "KINETO_LOG_LEVEL": "5", "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = launch("recheck", sandboxed=self.sandboxed, fds=[in_r, out_w, null], env=env,
                          cwd="/tmp" if self.sandboxed else os.getcwd())
        except WarmError as e:
            os.close(in_w)
            os.close(out_r)
            _cold_note(e)
            return start_runner(self.cold)
        finally:
            for fd in (in_r, out_w, null):
                os.close(fd)
        proc.stdin, proc.stdout = os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb")
        return proc


_NOTED: set = set()


def _cold_note(error) -> None:
    """Say once per process why the cold path was taken."""
    text = str(error)
    if text not in _NOTED:
        _NOTED.add(text)
        print(f"firstprinciples.grading.warm: starting cold instead ({text})", file=sys.stderr)


def _read_ready(ready: int, info: int | None, holder) -> int | None:
    """Wait for the placeholder's "ready" (the sandbox is set up); return the host pid of a
    process inside the sandbox (bubblewrap's info), or None without a sandbox."""
    deadline = time.monotonic() + READY_TIMEOUT
    out = b""
    while not out.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([ready], [], [], left)[0]:
            raise WarmError("the sandbox was not ready in time")
        chunk = os.read(ready, 64)
        if not chunk:
            raise WarmError(f"the sandbox did not start (exit code {holder.wait()})")
        out += chunk
    if info is None:
        return None
    # Complete by now: bubblewrap writes it before its sandbox's side goes on to run the placeholder.
    text, chunk = b"", b"."
    while chunk:
        chunk = os.pread(info, 1 << 16, len(text))
        text += chunk
    try:
        return int(json.loads(text)["child-pid"])
    except (ValueError, KeyError, TypeError):
        raise WarmError("bubblewrap did not say where the sandbox is") from None


# ================================================================ the template's side
def _serve(socks: list, later=()) -> None:
    """Answer the requests of every connection (one per grading worker), one at a time; end
    when the last connection is closed (its worker, or the grader, is gone). ``later``: what
    to do when no request is waiting, one step at a time and each once, in order (what a
    kernel's start does not need: a kernel requested at once does not wait for it, nor does
    a request that comes between two steps). A step ``(kinds, f)`` (and every step after it)
    waits until a child of one of those kinds has been forked."""
    libc = _libc()
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of unsandboxed kernels are reaped here
    signal.signal(signal.SIGCHLD, _reap)
    open_socks = list(socks)
    later = [step if isinstance(step, tuple) else ((None,), step) for step in later]
    forked: set = {None}  # the kinds of child forked so far
    while open_socks:
        try:
            due = bool(later) and not forked.isdisjoint(later[0][0])
            ready, _, _ = select.select(open_socks, [], [], 0 if due else None)
            if not ready and due:
                try:
                    later.pop(0)[1]()
                except Exception:  # noqa: BLE001 (then each child does it itself, as a cold one does)
                    pass
                continue
        except InterruptedError:  # (a SIGCHLD: Python retries select itself; kept for clarity)
            continue
        for sock in ready:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 16)
            except OSError:
                msg, fds = b"", []
            if not msg:  # this worker is gone
                open_socks.remove(sock)
                continue
            try:
                request = json.loads(msg)
                if request.get("kind") == PRELOAD_REQUEST:
                    reply, connection = {"preloaded": _preload(request.get("modules"))}, None
                else:
                    reply, connection = _fork(socks, request, fds, libc)
                    forked.add(request.get("kind"))
                if connection is not None:  # a child that asks for children of its own
                    socks.append(connection)
                    open_socks.append(connection)
            except Exception as e:  # noqa: BLE001 (a request that cannot be served is refused, not fatal)
                reply = {"error": f"{type(e).__name__}: {e}"}
            finally:
                for fd in fds:
                    os.close(fd)
            try:
                sock.send(json.dumps(reply).encode())
            except OSError:
                open_socks.remove(sock)
    os._exit(0)


def _fork(socks: list, request: dict, fds: list[int], libc) -> tuple[dict, socket.socket | None]:
    """Fork the child of ``request``; return (the reply for the requester, a new connection of
    this template's for the child when its kind asks for one, else None)."""
    sandboxed = request.get("ns_pid") is not None
    template = os.getpid()
    mine = theirs = None
    if request.get("kind") in CONNECTED and not sandboxed:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    back_r, back_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            set_name(f"fp-{request.get('kind', 'child')}", libc)  # (before its pid is known: ps never sees it unnamed)
            os.close(back_r)
            if theirs is not None:  # kept at fd 4 by _adopt
                mine.detach()
                fds = [*fds, theirs.detach()]
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _enter(request, libc)
            if sandboxed:  # once more, into the sandbox's PID namespace (whose PID 1 ends it)
                inner = os.fork()
                if inner == 0:
                    os.close(back_w)
                    _become(socks, request, fds, libc)  # never returns
                os.write(back_w, json.dumps({"pid": inner}).encode())
            else:  # a plain process: it dies with the template, which dies with the grader
                libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != template:
                    os._exit(1)
                os.write(back_w, json.dumps({"pid": os.getpid()}).encode())
                os.close(back_w)
                _become(socks, request, fds, libc)  # never returns
        except BaseException as e:  # noqa: BLE001
            try:
                os.write(back_w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            except OSError:
                pass
        os._exit(0)
    os.close(back_w)
    if theirs is not None:
        theirs.close()
    with os.fdopen(back_r, "rb") as f:
        data = f.read(1 << 16)
    if sandboxed:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # (reaped by the SIGCHLD handler)
    reply = json.loads(data) if data else {"error": "the template's child died before it could start"}
    if "error" in reply and mine is not None:
        mine.close()
        mine = None
    return reply, mine


def _preload(modules) -> list:
    """Import the modules of ``LAZY`` that ``modules`` names; return those of LAZY now imported.
    (Trusted code only: the course's list, never a name the request chose.)"""
    import importlib

    wanted = [m for m in LAZY if isinstance(modules, list) and m in modules and m not in sys.modules]
    for name in wanted:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (each child then imports it itself, where it needs it)
            pass
    if wanted:
        _settle()
    return [m for m in LAZY if m in sys.modules]


def _settle() -> None:
    """After imports done between requests: the re-check's baseline taken again, if there is one
    (a runner's first snapshot then reads none of the namespaces those imports wrote: 63 of 2,443
    after ``FIRST_BACKWARD``), and everything made so far frozen out of the collector (a child's
    collections never walk it)."""
    from . import observe

    if observe.BASELINE is not None:
        observe.BASELINE = observe.snapshot(observe.BASELINE)
    gc.freeze()


def _reap(*_args) -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _enter(request: dict, libc) -> None:
    for group in request.get("cgroups") or []:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    target = request.get("ns_pid")
    if target is None:
        return
    opened = []
    for name, flag in _NS:  # open them all first: after joining the mount namespace /proc is the sandbox's
        path = f"/proc/{target}/ns/{name}"
        try:
            if os.stat(path).st_ino == os.stat(f"/proc/self/ns/{name}").st_ino:
                continue  # bubblewrap did not make this one
        except FileNotFoundError:
            continue
        opened.append((name, flag, os.open(path, os.O_RDONLY | os.O_CLOEXEC)))
    # A privileged bubblewrap makes the other namespaces from outside its user namespace:
    # they are joined first, with the grader's rights, and the user namespace last. An
    # unprivileged one makes them inside it: the user namespace gives the rights to join.
    user = [o for o in opened if o[0] == "user"]
    rest = [o for o in opened if o[0] != "user"]
    refused = []
    for entry in rest:
        if libc.setns(entry[2], entry[1]) != 0:
            refused.append(entry)
    for name, flag, fd in user + refused:
        if libc.setns(fd, flag) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"could not join the sandbox's {name} namespace: {os.strerror(err)}")
    for _name, _flag, fd in opened:
        os.close(fd)


def set_name(name: str, libc=None) -> None:
    """The process's name as ``ps``, ``top`` and ``perf`` show it (Linux: at most 15 bytes)."""
    try:
        (libc or _libc()).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _become(socks: list, request: dict, fds: list[int], libc) -> None:
    code = 1
    try:
        keep = _adopt(socks, fds)
        os.setsid()  # a session and process group of its own, as a cold kernel has
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import resource

        for kind, value in request.get("rlimits") or []:
            try:
                resource.setrlimit(kind, (value, value))
            except (ValueError, OSError):
                pass
        if request.get("drop_caps"):
            _drop_capabilities(libc)
        _fresh_randomness()
        os.set_inheritable(keep, False)  # the sandbox stays open while this process (or a fork) lives
        code = _run(request)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _adopt(socks: list, fds: list[int]) -> int:
    """Standard input, output and error from the request; the hold pipe at 3; for a kind in
    ``CONNECTED``, its own connection to the template at 4; nothing else open (no worker's
    connection to the template either)."""
    import fcntl

    stdin, stdout, stderr, hold, *connection = fds
    if connection:  # out of the way of the numbers it is about to take
        connection = [fcntl.fcntl(connection[0], fcntl.F_DUPFD, 64)]
    for target, fd in enumerate((stdin, stdout, stderr)):
        os.dup2(fd, target)
    os.dup2(hold, 3)
    if connection:
        os.dup2(connection[0], 4)
    for sock in socks:
        sock.detach()  # (so that no finaliser closes a descriptor number that is reused later)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > (4 if connection else 3):
            try:
                os.close(fd)
            except OSError:
                pass
    return 3


def _drop_capabilities(libc) -> None:
    """As bubblewrap does for its command: no capability left, and no way to gain one."""
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == 22:  # EINVAL: past the last
            break

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "could not drop the capabilities")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "could not set no_new_privs")


def _fresh_randomness() -> None:
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _run(request: dict) -> int:
    if request["kind"] == "kernel":
        import importlib.util

        sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *request["argv"]]
        sys.path.insert(0, request["cwd"])
        from ipykernel import kernelapp

        kernelapp.launch_new_instance()
        return 0
    if request["kind"] == "recheck":
        from . import recheck

        sys.argv = [recheck.__file__]
        sys.path.insert(0, request["cwd"])
        recheck.main()
        return 0
    if request["kind"] == "verdicts" and request.get("ns_pid") is None:
        # the service's entry point, by name: the fork server does not import the side it serves
        import importlib

        module, function = SERVICE_ENTRY.split(":")
        getattr(importlib.import_module(module), function)(socket.socket(fileno=4))
        return 0
    raise ValueError(f"unknown kind {request['kind']!r}")


# The trusted re-check's service, started in a "verdicts" child (``verdicts.serve``).
SERVICE_ENTRY = "firstprinciples.grading.verdicts:serve"


def main() -> None:
    socks = [socket.socket(fileno=int(fd)) for fd in os.environ.pop("FP_WARM_SOCKET").split(",")]
    one_notebook = ONE_NOTEBOOK in sys.argv[1:]
    del sys.argv[1:]  # (its children see the template's clean state)
    set_name("fp-template")
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            if not name.startswith("firstprinciples."):  # (a student bundle has no reference: nothing to preload)
                raise
    # Everything imported so far is moved out of the collector's generations: a child's
    # collections then walk only the objects it made itself, not torch's 270,000 (a full
    # collection: 150 ms before, 2 ms after), and do not write to the pages it shares
    # with the template. (Python's advice for a process that forks without exec.)
    gc.freeze()
    if one_notebook:
        # The check command's: one kernel, its service, then the service's runner. What the runner
        # needs, once the service is forked (asked for just after the kernel: neither waits for
        # it), and nothing more: what only later children would have from the template would take
        # a core from the runner, the last step of the check (a solved attention notebook's check:
        # 1.48 x the floor with them, 1.18 x without; medians of 8 runs, each beside its floor).
        _serve(socks, later=[(("verdicts", "recheck"), _prepare_recheck)])
    else:
        # (what torch's own code imports at a first call, and what a kernel's first traceback reads,
        # only once a re-check's runner has been forked: a grading worker's later kernels, services
        # and runners have them)
        _serve(socks, later=[_prepare_recheck, (("recheck",), preload_first_backward), _prepare_tracebacks,
                             _settle])


def _prepare_tracebacks() -> None:
    """What IPython's first traceback in a process costs, done once here for every kernel forked
    after: ``inspect.getmodule``'s first walk of every imported module's file, the course's checks'
    sources, IPython's ``run_code`` (the outermost frame of every cell's traceback) and torch's
    ``nn.Module`` parsed by stack_data, pygments' Python lexer compiled (a failing test's cell
    took 0.2 s in a fresh kernel, 0.01 s after this). Caches only, of files
    every kernel may read anyway: a traceback reads the same lines and prints the same text."""
    import glob
    import inspect

    import stack_data
    import torch.nn.modules.module
    from IPython.core import interactiveshell, ultratb

    from .. import checks

    inspect.getmodule(None, "<no module's file>")  # (a file no module has: every module is walked)
    for path in [*sorted(glob.glob(os.path.join(os.path.dirname(checks.__file__), "*.py"))),
                 os.path.join(os.path.dirname(__file__), "declared.py"),
                 interactiveshell.__file__, torch.nn.modules.module.__file__]:
        stack_data.Source.for_filename(path)
    try:
        raise RuntimeError("a traceback formatted once, for its caches")
    except RuntimeError:
        _kernel_formatter(ultratb, interactiveshell).structured_traceback(*sys.exc_info())


def _kernel_formatter(ultratb, interactiveshell):
    """IPython's traceback formatter as a kernel's shell makes it, in its default colours. The
    pinned IPython (constraints.txt: 9.x) takes ``theme_name`` (lower case, "neutral"); IPython 8
    took ``color_scheme`` ("Neutral"): both are supported."""
    colours = interactiveshell.InteractiveShell.colors.default_value
    try:
        return ultratb.AutoFormattedTB(mode="Context", theme_name=colours)
    except TypeError:  # IPython 8
        return ultratb.AutoFormattedTB(mode="Context", color_scheme=colours)


def _prepare_recheck() -> None:
    """What the re-check does first in every runner, done once here: the probes' registry, the
    code each piece may not call, and a first snapshot (it loads torch's lazy submodules). Done
    when the template is first idle: a kernel asked for at once (the check command's) does not
    wait for it, and a child forked before has it done by itself, as a cold one does."""
    import torch.overrides

    from . import observe, probes

    # torch's table of the overridable functions' names, built at its first use (``functools.cache``):
    # here from torch's own namespaces, before any student's code could have changed them
    torch.overrides.resolve_name(torch.add)
    for probe in probes.load().values():
        watch = probe.watch()
        observe.forbidden_python(**watch)
    observe.BASELINE = observe.snapshot()  # (a runner's first snapshot then reads only what changed since)
    gc.freeze()


if __name__ == "__main__":
    main()
