"""Warm kernels (``firstprinciples.grading.warm``): forked from a template, each in a sandbox of
its own that promises what a cold sandboxed kernel does.

Each test starts real kernels through the grader's own kernel manager and asks them, from
inside, what they can see and do: the user, the capabilities, the processes, ``/tmp``, the
network, the course files, the environment; then checks from outside that nothing of them
outlives their shutdown. Two kernels run at once in some tests, so that one can look for
the other.
"""
from __future__ import annotations

import ast
import asyncio
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from firstprinciples.grading import sandbox, warm
from firstprinciples.grading.parallel import GraderBoundKernelManager

ROOT = Path(__file__).resolve().parents[2]
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                 reason="bubblewrap is not installed (apt-get install bubblewrap)")
needs_linux = pytest.mark.skipif(not warm.available(), reason="warm kernels need Linux and fork")


@pytest.fixture(autouse=True)
def kernelspec(monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", os.path.dirname(sandbox.__file__))
    monkeypatch.delenv(warm.COLD_ENV, raising=False)


class Kernel:
    """A kernel started by the grader's kernel manager; ``run`` returns what a cell printed."""

    def __init__(self, name: str):
        self.km = GraderBoundKernelManager(kernel_name=name, transport="ipc" if name == "fp-sandbox" else "tcp")

    async def start(self):
        await self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        await self.kc.wait_for_ready(timeout=60)
        return self

    async def run(self, code: str, timeout: float = 60) -> str:
        msg_id = self.kc.execute(code)
        out = []
        while True:
            msg = await self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out).strip()

    async def stop(self):
        self.kc.stop_channels()
        await self.km.shutdown_kernel(now=True)


def _json(text: str):
    return json.loads(text.splitlines()[-1])


INSIDE = r"""
import json, os, random, socket, sys
def caps(field):
    return [l.split()[1] for l in open('/proc/self/status') if l.startswith(field)][0]
try:
    socket.create_connection(('127.0.0.1', 22), timeout=2)
    net = 'connected'
except OSError as e:
    net = type(e).__name__
print(json.dumps({
    'uid': os.getuid(), 'cwd': os.getcwd(), 'tmp': sorted(os.listdir('/tmp')),
    'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
    'caps': [caps(f) for f in ('CapEff:', 'CapPrm:', 'CapInh:', 'CapBnd:')], 'nnp': caps('NoNewPrivs:'),
    'net': net, 'course': os.path.exists(%r), 'env': dict(os.environ), 'random': random.random(),
    'torch_loaded': 'torch' in sys.modules, 'sid': os.getsid(0) == os.getpid(),
}))
""" % str(ROOT / "solutions")


@needs_bwrap
@needs_linux
def test_a_warm_sandboxed_kernel_is_confined_like_a_cold_one():
    async def main():
        a = await Kernel("fp-sandbox").start()
        b = await Kernel("fp-sandbox").start()
        try:
            assert isinstance(a.km.provisioner.process, warm.WarmProcess), "the kernel was not started warm"
            await a.run("open('/tmp/secret-of-a', 'w').write('x'); import subprocess; "
                        "p = subprocess.Popen(['sleep', '1000'])")
            seen_a, seen_b = _json(await a.run(INSIDE)), _json(await b.run(INSIDE))
        finally:
            await a.stop()
            await b.stop()
        return seen_a, seen_b

    a, b = asyncio.run(main())
    for seen in (a, b):
        assert seen["uid"] == 65534 and seen["cwd"] == "/tmp"
        assert seen["caps"] == ["0000000000000000"] * 4, "a capability is left"
        assert seen["nnp"] == "1"
        assert seen["net"] != "connected"
        assert not seen["course"], "the course's solutions are visible"
        assert seen["torch_loaded"], "not forked from the template"
        assert seen["sid"], "the kernel is not the leader of its own session"
        # the environment is the sandbox's own (plus what ipykernel sets)
        assert {k: v for k, v in seen["env"].items() if k in sandbox.sandbox_env()} == sandbox.sandbox_env()
        assert not {"TMPDIR", "PYTHONPATH", "VIRTUAL_ENV"} & set(seen["env"]) - set(sandbox.sandbox_env())
    # each has its own /tmp and sees only its own processes
    assert "secret-of-a" in a["tmp"] and "secret-of-a" not in b["tmp"]
    assert len(b["pids"]) < 6, f"the second kernel sees other processes: {b['pids']}"
    assert a["random"] != b["random"], "two kernels share Python's random state"


def _sleepers() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "^sleep 1000$"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@needs_bwrap
@needs_linux
def test_nothing_of_a_warm_kernel_outlives_its_shutdown():
    before = set(_sleepers())

    async def main():
        k = await Kernel("fp-sandbox").start()
        proc = k.km.provisioner.process
        await k.run("import subprocess, os\nfor _ in range(3):\n    subprocess.Popen(['sleep', '1000'], "
                    "start_new_session=True)\nif os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '1000'])")
        deadline = time.monotonic() + 10  # (the double-forked one execs sleep after the cell has returned)
        while len(set(_sleepers()) - before) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(set(_sleepers()) - before) == 4
        await k.stop()
        return proc

    proc = asyncio.run(main())
    deadline = time.monotonic() + 10
    while (set(_sleepers()) - before or proc.holder.poll() is None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_sleepers()) - before, "a process of the kernel outlived it"
    assert proc.holder.poll() is not None
    assert not list(Path(sandbox.CGROUP_ROOT / "pids").glob(f"fp-sandbox-{os.getpid()}-*")), "its cgroup is left"


@needs_bwrap
@needs_linux
def test_a_kernel_that_exits_is_seen_dead_and_cannot_touch_the_template():
    async def main():
        k = await Kernel("fp-sandbox").start()
        template = warm.Template.get(True).proc
        # kill(-1) signals every process it may: only those of its own sandbox
        k.kc.execute("import os, signal; os.kill(-1, signal.SIGKILL); os._exit(0)")
        deadline = time.monotonic() + 10
        while await k.km.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        alive = await k.km.is_alive()
        await k.stop()
        return alive, template

    alive, template = asyncio.run(main())
    assert not alive, "the kernel's death was not noticed"
    assert template.poll() is None, "a kernel killed the template"


@needs_bwrap
@needs_linux
def test_a_client_is_ready_at_once_and_misses_nothing_of_the_first_cell():
    """``ReadyKernelClient`` ends its wait at the kernel's idle status, not after 0.2 s of
    silence on IOPub: the first cell's output still arrives whole, start after start."""
    async def main():
        outputs = []
        for i in range(3):
            k = await Kernel("fp-sandbox").start()
            assert isinstance(k.kc, warm.ReadyKernelClient)
            outputs.append(await k.run(f"print('first', {i})\nprint('second', {i})"))
            await k.stop()
        return outputs

    assert asyncio.run(main()) == [f"first {i}\nsecond {i}" for i in range(3)]


def test_a_client_without_a_kernel_is_not_ready():
    """A kernel that never answers is reported, as jupyter_client reports it."""
    async def main():
        kc = warm.ReadyKernelClient(ip="127.0.0.1", shell_port=1, iopub_port=2, stdin_port=3, control_port=4,
                                    hb_port=5)
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=3)
        finally:
            kc.stop_channels()

    with pytest.raises(RuntimeError, match="Kernel died|didn't respond"):
        asyncio.run(main())


@needs_linux
def test_an_unsandboxed_warm_kernel_and_its_children_end_with_it(tmp_path):
    """The students' check command: no sandbox, but the same start and the same end."""
    before = set(_sleepers())

    async def main():
        k = await Kernel("python3").start()
        assert isinstance(k.km.provisioner.process, warm.WarmProcess)
        cwd = await k.run("import os, subprocess; subprocess.Popen(['sleep', '1000']); print(os.getcwd())")
        await k.stop()
        return cwd

    cwd = asyncio.run(main())
    assert cwd == os.getcwd()
    deadline = time.monotonic() + 10
    while set(_sleepers()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_sleepers()) - before, "a child of the kernel outlived it"


@needs_linux
def test_the_cold_path_is_taken_when_asked(monkeypatch):
    monkeypatch.setenv(warm.COLD_ENV, "1")

    async def main():
        k = await Kernel("python3").start()
        kind = type(k.km.provisioner.process).__name__
        await k.stop()
        return kind

    assert asyncio.run(main()) == "Popen"


@needs_bwrap
@needs_linux
@pytest.mark.parametrize("answer, passes", [
    ("def softmax(x, dim=-1):\n    e = torch.exp(x - x.amax(dim=dim, keepdim=True))\n"
     "    return e / e.sum(dim=dim, keepdim=True)", True),
    ("def softmax(x, dim=-1):\n    e = torch.exp(x)\n    return e / e.sum(dim=dim, keepdim=True)", False),
])
def test_a_warm_recheck_gives_the_cold_verdicts(answer, passes):
    """The re-check's runner, forked into a sandbox of its own: the same outcomes as a cold one."""
    import nbformat

    from firstprinciples.grading import trusted

    source = ROOT / "solutions" / "softmax" / "softmax.ipynb"
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "softmax":
            cell.source = answer
    plan = trusted.make_plan(nb, 7, trusted.course_sources(source))
    limits = trusted.Limits(piece=30, total=120)
    cold, cold_flags = trusted.recheck(plan, sandbox.recheck_command(True), limits)
    runner = warm.Runner(sandbox.recheck_command(True), True)
    hot, hot_flags = trusted.recheck(plan, runner, limits)
    assert cold and cold == hot, "the warm runner found something else than the cold one"
    assert cold_flags == hot_flags
    failed, _flagged = trusted.apply(copy.deepcopy(nb), plan, hot)
    assert bool(failed) != passes, failed


@needs_linux
def test_a_dead_template_is_replaced(tmp_path):
    """A template killed between two kernels (the OOM killer, a stray signal) costs nothing:
    the next kernel gets a new template, warm."""
    async def main():
        k = await Kernel("python3").start()
        await k.stop()
        first = warm.Template.get(False)
        first.proc.kill()
        first.proc.wait()
        k = await Kernel("python3").start()
        kind = type(k.km.provisioner.process).__name__
        out = await k.run("print(6 * 7)")
        await k.stop()
        return first, kind, out

    first, kind, out = asyncio.run(main())
    assert kind == "WarmProcess" and out == "42"
    assert warm.Template.get(False) is not first


@needs_linux
def test_the_template_imports_on_request_only_what_the_course_lists():
    """A request to import (a grading worker's service makes it: ``verdicts.serve``) is answered
    with only the modules of ``warm.LAZY`` imported, whatever else it names; they are then in
    every child forked after it, and were not in one forked before."""
    key = (os.getpid(), False)
    earlier = warm.Template._current.pop(key, None)
    template = warm.Template.get(False)  # (a fresh one: nothing asked of it yet)
    probe = "import sys; print(sorted(m for m in ('torch._dynamo', 'antigravity', 'this') if m in sys.modules))"

    async def seen():
        k = await Kernel("python3").start()
        out = await k.run(probe)
        await k.stop()
        return out

    try:
        before = asyncio.run(seen())
        got = template.preload(["antigravity", "torch._dynamo", "this", 42])
        after = asyncio.run(seen())
    finally:
        template.close()
        if earlier is not None:
            warm.Template._current[key] = earlier
    assert (before, got, after) == ("[]", ["torch._dynamo"], "['torch._dynamo']")


# Whether this process has what the template's ``_prepare_tracebacks`` leaves: the course's
# checks parsed for IPython's tracebacks (stack_data's cache of sources).
async def _in_a_new_kernel(code: str) -> str:
    """What ``code`` prints in a kernel of its own, started and stopped here."""
    k = await Kernel("python3").start()
    try:
        return await k.run(code)
    finally:
        await k.stop()


PREPARED = ("import sys; s = sys.modules.get('stack_data'); "
            "print(s is not None and any(k[0].endswith('checks/_student.py') "
            "for k in s.Source.__dict__.get('__source_cache_with_lines', {})))")
TRACEBACK = r'''
import io, sys, contextlib, executing
from firstprinciples.grading import warm
if sys.argv[1] == "prepared":
    warm._prepare_tracebacks()
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
# (in its default colours, as in a kernel: highlighted by pygments)
shell.run_cell("from firstprinciples.grading.declared import check_for\ncheck = check_for('softmax')\n"
               "def softmax(x, dim=-1):\n    e = x.exp()\n    return e / e.sum(dim=dim, keepdim=True)\n")
parsed, init = [], executing.Source.__init__
def counted(self, filename, lines):
    parsed.append(filename)
    init(self, filename, lines)
executing.Source.__init__ = counted
with contextlib.redirect_stdout(io.StringIO()) as out:
    shell.run_cell("check('test_large_inputs', softmax)")  # the check fails: no max subtracted
print(repr(out.getvalue()))
print([p for p in parsed if not p.startswith("<")])
'''


def test_the_templates_traceback_caches_change_nothing_a_traceback_shows():
    """``warm._prepare_tracebacks`` fills caches only: a failing check's traceback, formatted as a
    kernel formats it (IPython, with colours), is the same text with and without it, and with it no
    file on the traceback's path is parsed again (without it the course's checks are: with IPython
    8 and its own module, 0.2 s of a failing notebook's first traceback)."""
    runs = {}
    for mode in ("cold", "prepared"):
        out = subprocess.run([sys.executable, "-c", TRACEBACK, mode], capture_output=True, text=True,
                             timeout=240, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        text, parsed = out.stdout.strip().splitlines()[-2:]
        runs[mode] = (text, ast.literal_eval(parsed))
    assert "AssertionError" in runs["cold"][0] and "test_large_inputs" in runs["cold"][0]
    assert runs["prepared"][0] == runs["cold"][0]
    assert any("/firstprinciples/" in p for p in runs["cold"][1])  # (IPython 8 also parsed its
    # own interactiveshell.py; the pinned 9.x hides that frame without parsing it)
    assert runs["prepared"][1] == []


SETTLED = r"""
import importlib, json, sys
from firstprinciples.grading import observe, warm
for name in warm.PRELOAD:
    importlib.import_module(name)
warm._prepare_recheck()  # the baseline
warm.preload_first_backward()
warm._prepare_tracebacks()
if sys.argv[1] == "settled":
    warm._settle()
first = observe.snapshot(observe.BASELINE)  # what a runner's first snapshot reads again
print(json.dumps(sorted(str(k) for k, v in first.spaces.items() if v is not observe.BASELINE.spaces.get(k))))
"""


def test_the_baseline_is_taken_again_after_the_templates_idle_imports():
    """The imports the template does when idle (``FIRST_BACKWARD``, the traceback's caches) write
    to dozens of namespaces; ``warm._settle`` takes the re-check's baseline again after them, so a
    runner's first snapshot reads none of them again (without it: every one)."""
    reread = {}
    for mode in ("unsettled", "settled"):
        out = subprocess.run([sys.executable, "-c", SETTLED, mode], capture_output=True, text=True,
                             timeout=240, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        reread[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(reread["unsettled"]) > 20, reread["unsettled"]
    assert reread["settled"] == ["firstprinciples.grading.observe"]  # (where the baseline itself was written)


@needs_linux
def test_a_kernel_asked_for_at_once_does_not_wait_for_what_only_later_children_need():
    """The template answers a request that is waiting when its first imports are done, before
    what it does when idle; it imports ``warm.FIRST_BACKWARD`` (what torch imports at a first
    backward pass handed an output gradient) only once a re-check's runner has been forked. So
    the check command's kernel and runner never wait for it: a kernel asked for at once starts
    without it and imports it itself at its first such backward pass, which works as in a cold
    kernel; kernels forked while no runner has been are still without it; one forked after a
    runner (a grading worker's next notebook) has it."""
    from firstprinciples.grading import trusted

    key = (os.getpid(), False)
    earlier = warm.Template._current.pop(key, None)
    template = warm.Template.get(False)  # a fresh one, still importing: the kernel's request waits for it
    probe = f"import sys; print({warm.FIRST_BACKWARD!r} in sys.modules)"
    backward = ("import torch; x = torch.ones(3, requires_grad=True); (x * x).backward(torch.ones(3)); "
                "print(x.grad.tolist())")  # (a backward pass with a given gradient is what imports it)

    async def first():
        k = await Kernel("python3").start()
        try:
            return await k.run(probe), await k.run(backward), await k.run(probe)
        finally:
            await k.stop()

    def later(code=probe):
        return asyncio.run(_in_a_new_kernel(code))

    try:
        before, grad, after_backward = asyncio.run(first())
        without_runner = [later() for _ in range(3)]  # (the template idle in between)
        trusted._kill(warm.Runner(sandbox.recheck_command(False), False)())  # a runner: forked, then stopped
        deadline = time.monotonic() + 60
        seen = later()
        while seen != "True" and time.monotonic() < deadline:
            time.sleep(0.2)
            seen = later()
        prepared = later(PREPARED)  # (the step after it: _prepare_tracebacks)
        while prepared != "True" and time.monotonic() < deadline:
            time.sleep(0.2)
            prepared = later(PREPARED)
    finally:
        template.close()
        if earlier is not None:
            warm.Template._current[key] = earlier
    assert (before, grad, after_backward) == ("False", "[2.0, 2.0, 2.0]", "True")
    assert without_runner == ["False"] * 3
    assert seen == "True", "a kernel forked after a runner does not have it"
    assert prepared == "True", "a kernel forked after a runner does not have the traceback's caches"


@needs_linux
def test_the_check_commands_template_prepares_the_runner_and_nothing_for_later_children():
    """The check command's template (``one_notebook``) serves one kernel, its service and the
    service's runner. It prepares what a runner needs (the re-check's first snapshot, among
    others) only once a service or a runner has been forked, so that neither the kernel asked
    for first nor the service waits for it, and nothing that only later children would use
    (``FIRST_BACKWARD``, the traceback's caches), which would take a core from the runner: kernels
    forked while neither has been are without the preparation, one forked after a runner has it
    and still has neither of the others, however long the template was idle."""
    from firstprinciples.grading import trusted

    key = (os.getpid(), False)
    earlier = warm.Template._current.pop(key, None)
    template = warm.Template.get(False, one_notebook=True)
    state = (f"import sys; o = sys.modules.get('firstprinciples.grading.observe'); "
             f"print(o is not None and o.BASELINE is not None, {warm.FIRST_BACKWARD!r} in sys.modules)")

    def kernel(code):
        return asyncio.run(_in_a_new_kernel(code))

    try:
        before = [kernel(state) for _ in range(3)]  # (the template idle in between)
        trusted._kill(warm.Runner(sandbox.recheck_command(False), False)())  # a runner: forked, then stopped
        deadline = time.monotonic() + 60
        after = kernel(state)
        while after.startswith("False") and time.monotonic() < deadline:
            time.sleep(0.2)
            after = kernel(state)
        idle_until = time.monotonic() + 3  # (a grading command's template does the rest in about 1 s)
        later = []
        while time.monotonic() < idle_until:
            later.append(kernel(state + "; " + PREPARED))
    finally:
        template.close()
        if earlier is not None:
            warm.Template._current[key] = earlier
    assert before == ["False False"] * 3, "prepared for a runner before any service or runner was forked"
    assert after == "True False", "a kernel forked after a runner does not have the runner's preparation"
    assert set(later) == {"True False\nFalse"}, later


@needs_linux
def test_one_template_started_ahead_serves_every_worker():
    """The grader starts one template for all its workers before it forks them (its imports
    then overlap the grader's own, and the command pays one interpreter's start-up, not one
    per worker): each worker has a connection of its own to that one process and gets
    processes forked from it, the template outlives a worker that ends while another still
    uses it, a dead one is seen dead although it is not the worker's child and is replaced,
    and it ends with the last of its workers."""
    warm.Template.start_ahead(2, False, {"OMP_NUM_THREADS": "1"})
    (template,) = {t.proc.pid for t in warm.Template._ahead}
    workers = []
    for w in range(2):
        read, write = os.pipe()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a worker: report what it sees, never return into pytest
            code = 1
            try:
                warm.Template.adopt(w)
                mine = warm.Template.get(False)
                r, wr = os.pipe()
                child = warm.launch("recheck", sandboxed=False, fds=[r, wr, wr], env={"PATH": os.defpath})
                with open(f"/proc/{child.pid_inside}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in (template, child.pid_inside)]
                child.kill()
                child.wait(timeout=30)
                seen = [mine.proc.pid == template, mine.alive(), parent == template, names]
                os.write(write, (json.dumps(seen) + "\n").encode())
                if w == 1:  # once worker 0 has ended: the template killed, seen dead, replaced
                    os.read(go_r, 1)
                    seen = [mine.alive()]
                    os.kill(mine.proc.pid, signal.SIGKILL)
                    deadline = time.monotonic() + 10
                    while mine.alive() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    fresh = warm.Template.get(False)
                    seen += [not mine.alive(), fresh is not mine and fresh.alive() and fresh.proc.pid != template]
                    fresh.close()
                    os.write(write, (json.dumps(seen) + "\n").encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        os.close(go_r)
        workers.append((pid, os.fdopen(read), go_w))
    procs = warm.Template.hand_over()
    assert [p.pid for p in procs] == [template]
    first = [json.loads(f.readline() or "[]") for _, f, _ in workers]
    # named as ps and top show them, for an instructor who looks at a busy machine
    assert first == [[True, True, True, ["fp-template", "fp-recheck"]]] * 2, first
    assert os.waitstatus_to_exitcode(os.waitpid(workers[0][0], 0)[1]) == 0
    assert procs[0].poll() is None, "the template ended with its first worker while the second still used it"
    os.write(workers[1][2], b"x")
    second = json.loads(workers[1][1].readline() or "[]")
    assert second == [True, True, True], second
    assert os.waitstatus_to_exitcode(os.waitpid(workers[1][0], 0)[1]) == 0
    for _, f, go in workers:
        f.close()
        os.close(go)
    procs[0].wait(timeout=30)
    assert warm.Template._ahead == []
