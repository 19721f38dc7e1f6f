"""The sandbox's limits hold whichever way they are set: each cgroup controller on its own,
and an rlimit for a resource whose cgroup could not be set up.

Graders sweep the empty ``fp-sandbox-*`` cgroups (those of killed kernels) while other
sandboxes start, so a new group can vanish between its creation and the moment the
launcher moves into it. These tests use a fake cgroup tree in a temporary folder; the
rlimits are set in a child process, never in the test's own.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from firstprinciples.grading import sandbox


@pytest.fixture
def fake_cgroups(tmp_path, monkeypatch):
    for controller in ("pids", "memory"):
        (tmp_path / controller).mkdir()
    monkeypatch.setattr(sandbox, "CGROUP_ROOT", tmp_path)
    return tmp_path


def test_both_controllers_take_effect(fake_cgroups):
    assert sandbox.enter_cgroups("fp-sandbox-t1") == ["pids", "memory"]
    assert (fake_cgroups / "pids" / "fp-sandbox-t1" / "pids.max").read_text() == str(sandbox.PIDS)
    assert (fake_cgroups / "memory" / "fp-sandbox-t1" / "memory.limit_in_bytes").read_text() == str(
        sandbox.MEMORY_MB * 2**20)


def test_a_missing_controller_leaves_the_other(fake_cgroups):
    (fake_cgroups / "memory").rmdir()
    assert sandbox.enter_cgroups("fp-sandbox-t2") == ["pids"]


def test_a_group_swept_before_the_launcher_moved_in_is_left_out(fake_cgroups, monkeypatch):
    made = sandbox._cgroup

    def swept_memory_group(controller, name):
        group = made(controller, name)
        if controller == "memory":
            group.rmdir()  # another grader's sweep_cgroups found it empty
        return group

    monkeypatch.setattr(sandbox, "_cgroup", swept_memory_group)
    assert sandbox.enter_cgroups("fp-sandbox-t3") == ["pids"]


def _limits_after(controllers):
    code = (f"import json, resource; from firstprinciples.grading import sandbox; sandbox.set_rlimits({controllers!r}); "
            "print(json.dumps([resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_NPROC)[0]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_rlimits_cap_what_no_cgroup_caps():
    unlimited_as, default_nproc = resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_NPROC)[0]
    assert _limits_after([]) == [2 * sandbox.MEMORY_MB * 2**20, sandbox.PIDS]
    assert _limits_after(["pids"]) == [2 * sandbox.MEMORY_MB * 2**20, default_nproc]
    assert _limits_after(["memory"]) == [unlimited_as, sandbox.PIDS]
    assert _limits_after(["pids", "memory"]) == [unlimited_as, default_nproc]
