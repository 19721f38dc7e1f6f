"""The trusted half of grading: the static scan, the wire format and the comparison.

End-to-end, with nbgrader and sandboxed kernels, the red-team suite
(tests/test_grading_redteam.py) grades cheating submissions; here each part is
tested on its own, quickly.
"""
from __future__ import annotations

import base64

import nbformat
import numpy as np
import pytest
import torch

from course import SOLUTIONS, source_notebooks
from firstprinciples.grading import probes, scan, trusted, wire

SOFTMAX = SOLUTIONS / "softmax" / "softmax.ipynb"
CORRECT = '''
import torch

def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)
'''

# Student code that reaches into the machinery: each voids every verdict of the notebook.
TAMPER = {
    "patches numpy": "import numpy as np\nnp.allclose = lambda *a, **k: True",
    "patches torch.testing": "import torch\ntorch.testing.assert_close = lambda *a, **k: None",
    "patches a torch function": "import torch\ntorch.exp = torch.sigmoid",
    "patches a tensor method": "import torch\ntorch.Tensor.__eq__ = lambda a, b: True",
    "deletes from a module": "import torch\ndel torch.allclose",
    "patches the checks": "checks.check_dims = lambda *a, **k: None",
    "reaches the reference through the checks": "ref = checks.reference\ndef softmax(x, dim=-1):\n    return ref(x, dim)",
    "imports the reference": "from firstprinciples.reference import softmax",
    "imports sys": "import sys\nsys.modules['numpy'].allclose = None",
    "imports builtins": "import builtins",
    "imports importlib": "import importlib\nm = importlib.import_module('firstprinciples.reference')",
    "imports ctypes": "import ctypes",
    "imports inspect": "import inspect",
    "imports IPython": "from IPython import get_ipython",
    "input transformer": "get_ipython().input_transformers_post.append(lambda lines: lines)",
    "ast transformer": "ip = get_ipython()\nip.ast_transformers.append(None)",
    "a magic": "%load_ext something",
    "a shell command": "!cat /etc/passwd",
    "eval": "eval('1')",
    "exec": "exec('x = 1')",
    "getattr of a built-in": "import torch\nf = getattr(torch, 'soft' + 'max')",
    "setattr": "import torch\nsetattr(torch, 'exp', None)",
    "globals": "globals()['softmax'] = None",
    "__import__": "__import__('os')",
    "__builtins__": "__builtins__.print = None",
    "dunder attribute": "f = softmax.__globals__",
    "class dunder": "t = (1).__class__",
    "private torch": "import torch\nm = torch._C",
    "torch.overrides": "import torch.overrides",
    "torch.utils dispatch": "from torch.utils._python_dispatch import TorchDispatchMode",
    "lying tensor subclass": "import torch\nclass Liar(torch.Tensor):\n    pass",
    "ndarray subclass": "import numpy as np\nclass A(np.ndarray):\n    pass",
    "__eq__ override": "class A:\n    def __eq__(self, other):\n        return True",
    "__torch_function__": "class A:\n    def __torch_function__(self, *a):\n        return 1",
    "threading": "import threading",
    "sys through torch": "import torch\nmods = torch.sys.modules",
    "sys through os": "import os\nm = os.sys",
    "sys through an aliased import": "import os as np\nm = np.sys",
}

LOCAL = {
    "imports os": "import os",
    "imports signal": "import signal",
    "imports socket": "import socket",
    "opens a file": "text = open('/etc/hostname').read()",
    "exits the kernel": "import os\nos._exit(3)",
    "a private attribute of a local module": "import signal\nh = signal._int_to_enum",
    "a path module": "import os\np = os.path.join('a', 'b')",
}

# Ordinary answers: nothing to report.
CLEAN = {
    "plain": CORRECT,
    "math and numpy": "import math\nimport numpy as np\nimport torch.nn.functional as F\nfrom torch import nn\nx = math.sqrt(2)",
    "a module class": "import torch\nfrom torch import nn\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                      "        self._cache = None\n    def forward(self, x):\n        return x\n    def __len__(self):\n        return 0",
    "typing and dataclasses": "from dataclasses import dataclass\nfrom typing import Optional\n@dataclass\nclass C:\n    x: Optional[int] = None",
    "a check called in a scratch cell": "checks.check_dims(softmax, full=False)",
    "submodules of allowed modules": "import torch\nimport numpy as np\nn = np.linalg.norm([1.0])\ny = torch.nn.functional.relu(torch.ones(1))",
}


def _notebook_with(answer: str):
    nb = nbformat.read(SOFTMAX, as_version=4)
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "softmax":
            cell.source = CORRECT + "\n" + answer
    return nb


def _scan(answer):
    return scan.scan(_notebook_with(answer), trusted.course_sources(SOFTMAX))


@pytest.mark.parametrize("name", sorted(TAMPER))
def test_tampering_is_flagged(name):
    result = _scan(TAMPER[name])
    assert result.tamper, f"{name}: not flagged"
    assert "softmax" in result.label(result.tamper[0])


@pytest.mark.parametrize("name", sorted(LOCAL))
def test_leaving_the_exercise_voids_only_its_piece(name):
    result = _scan(LOCAL[name])
    assert not result.tamper and result.local, (result.tamper, result.local)
    assert result.findings_for("softmax", ()), "the piece defined in that cell is not voided"


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_ordinary_code_is_not_flagged(name):
    result = _scan(CLEAN[name])
    assert not result.tamper and not result.local and not result.findings_for("softmax", ("softmax",)), \
        (result.tamper, result.local)


@pytest.mark.parametrize("code", ["import torch\ndef softmax(x, dim=-1):\n    return x.softmax(dim)",
                                  "from torch.nn.functional import softmax as sm\ndef softmax(x, dim=-1):\n    return sm(x, dim)",
                                  "import torch\ndef softmax(x, dim=-1):\n    return torch.nn.Softmax(dim)(x)"])
def test_the_built_in_of_the_piece_is_flagged_for_that_piece(code):
    nb = nbformat.read(SOFTMAX, as_version=4)
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "softmax":
            cell.source = code
    result = scan.scan(nb, trusted.course_sources(SOFTMAX))
    found = result.findings_for("softmax", ("softmax", "softmin"))
    assert found and found[0].kind == "builtin"


def test_a_flagged_helper_voids_the_pieces_that_use_it():
    nb = nbformat.read(SOFTMAX, as_version=4)
    for cell in nb.cells:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "softmax":
            cell.source = "def softmax(x, dim=-1):\n    return helper(x, dim)"
    nb.cells.append(nbformat.v4.new_code_cell("import torch\ndef helper(x, dim):\n    return torch.softmax(x, dim)"))
    nb.cells.append(nbformat.v4.new_code_cell("import os\nunrelated = 1"))
    result = scan.scan(nb, trusted.course_sources(SOFTMAX))
    found = result.findings_for("softmax", ("softmax",))
    assert [f.kind for f in found] == ["builtin"], found  # the helper's built-in, not the unrelated import


@pytest.mark.parametrize("path", source_notebooks(), ids=lambda p: p.parent.name)
def test_the_solutions_are_clean(path):
    nb = nbformat.read(path, as_version=4)
    result = scan.scan(nb, trusted.course_sources(path))
    registry = probes.load()
    names = {n for c in result.infos if c.student for n in c.defines}
    assert not result.tamper and not result.local
    for name in names & set(registry):
        assert not result.findings_for(name, registry[name].watch()["torch_patterns"]), name


# Names a course cell binds that are still the student's work: the capstone's `model` is built
# and trained by a locked cell from the student's StudentGPT.
PROBED_COURSE_NAMES = {"capstone": {"model"}}


@pytest.mark.parametrize("path", source_notebooks(), ids=lambda p: p.parent.name)
def test_every_graded_piece_is_re_checked_and_only_there(path):
    """Probes are found by the names the test cells use: in each notebook, every answer a
    test cell names has a probe, and no probe lands on a name that the notebook's course
    cells define (a course variable that happens to share a probe's name)."""
    nb = nbformat.read(path, as_version=4)
    result = scan.scan(nb, trusted.course_sources(path))
    registry = probes.load()
    written = {n for c in result.infos if c.student for n in c.defines}
    probed = {n for names in trusted.grade_cell_names(nb, registry).values() for n in names}
    allowed = written | PROBED_COURSE_NAMES.get(path.parent.name, set())
    assert probed <= allowed, f"probes on names the course defines: {sorted(probed - allowed)}"
    tested = {n for names in trusted.grade_cell_names(nb, written).values() for n in names}
    assert tested <= probed, f"graded answers without a probe: {sorted(tested - probed)}"


# ---------------------------------------------------------------- wire and comparison
def _enc(value):
    return wire.loads(wire.dumps(wire.encode(value)))


def test_a_tensor_round_trips_exactly():
    t = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    d = _enc(t)
    assert d["type"] == "torch.Tensor" and d["dtype"] == "float64" and d["shape"] == [3, 4]
    assert np.array_equal(wire.array(d), t.numpy())


@pytest.mark.parametrize("breakage", ["short data", "bad dtype", "negative shape", "huge shape", "not base64"])
def test_malformed_data_is_refused(breakage):
    d = _enc(torch.zeros(2, 2))
    if breakage == "short data":
        d["data"] = base64.b64encode(b"\0" * 4).decode()
    elif breakage == "bad dtype":
        d["data_dtype"] = "object"
    elif breakage == "negative shape":
        d["shape"] = [-1, 2]
    elif breakage == "huge shape":
        d["shape"] = [10**6, 10**6]
    else:
        d["data"] = "!!!"
    with pytest.raises(wire.WireError):
        wire.array(d)


def test_pickle_never_crosses():
    with pytest.raises(wire.WireError):
        wire.loads('{"x": NaN}')
    assert wire.encode(object())["type"] == "builtins.object" and "data" not in wire.encode(object())


class Liar(torch.Tensor):
    def __eq__(self, other):
        return True


REF = torch.tensor([[0.5, 0.25], [0.125, 0.0625]], dtype=torch.float32)
WRONG = {
    "numpy instead of torch": REF.numpy(),
    "a lying subclass": REF.as_subclass(Liar),
    "a parameter": torch.nn.Parameter(REF.clone()),
    "float64 instead of float32": REF.double(),
    "a shape that broadcasts": REF[:, :1],
    "a transposed shape": REF.T.contiguous().reshape(1, 4),
    "NaN": torch.where(REF > 0.2, REF, torch.tensor(float("nan"))),
    "inf": REF / torch.tensor([1.0, 0.0]),
    "requires grad": REF.clone().requires_grad_(True),
    "off by 1e-3": REF + 1e-3,
    "a list": REF.tolist(),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_compare_rejects(name):
    assert trusted.compare(_enc(WRONG[name]), _enc(REF), "output", {}) is not None


def test_compare_accepts_float32_rounding():
    assert trusted.compare(_enc(REF * (1 + 3e-7)), _enc(REF), "output", {}) is None
    assert trusted.compare(_enc(REF.tolist()), _enc(REF.tolist()), "output", {}) is None


def test_the_seed_is_secret_but_stable(tmp_path):
    info = {"nbgrader": {"assignment": "softmax", "student": "ada", "notebook": "softmax"}}
    a = trusted.seed_for(info, tmp_path)
    assert (tmp_path / trusted.SECRET_FILE).stat().st_mode & 0o077 == 0  # only the grader may read it
    assert a == trusted.seed_for(info, tmp_path)
    assert a != trusted.seed_for({"nbgrader": {**info["nbgrader"], "student": "bob"}}, tmp_path)
    (tmp_path / trusted.SECRET_FILE).write_text("another course")
    assert a != trusted.seed_for(info, tmp_path)


def test_correct_and_wrong_answers_in_process():
    nb = nbformat.read(SOFTMAX, as_version=4)
    ns = {}
    exec(CORRECT, ns)
    assert not any(trusted.local_verdicts(nb, ns, seed=5).values())
    verdicts = trusted.local_verdicts(nb, {"softmax": lambda x, dim=-1: x}, seed=5)
    assert all(verdicts.values()) and "differs from the reference" in verdicts["test_dims"]
