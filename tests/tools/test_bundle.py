"""The student bundle (``firstprinciples.bundle``): no answer in it, and it works alone.

Built once into a temporary folder, then installed into a fresh virtualenv (``venv``: by the
students' own command where the student install's wheel cache is, as under CI) where every check
runs. Not this environment: the course's editable install would serve the left-out modules.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest

from course import ROOT, SOLUTIONS
from firstprinciples import bundle, exercises

WHEELS = Path(os.environ.get("FP_STUDENT_WHEELS", ROOT / ".student-wheels"))  # (test_student_install.py's)
REFERENCE_CODE = [ROOT / "firstprinciples" / "reference", ROOT / "firstprinciples" / "capstone" / "model.py",
                  ROOT / "firstprinciples" / "lengths"]


# ---------------------------------------------------------------- code compared without names
class _Anonymous(ast.NodeTransformer):
    """A function as a shape: names, arguments and docstrings gone, constants and attributes kept."""

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id="_", ctx=node.ctx), node)

    def visit_arg(self, node):
        return ast.copy_location(ast.arg(arg="_"), node)

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        node.name, node.decorator_list, node.returns = "_", [], None
        if ast.get_docstring(node, clean=False) is not None:
            node.body = node.body[1:] or [ast.Pass()]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef


def shapes(source: str, *, least: int = 2) -> dict:
    """Each function's shape -> its name, for functions of at least ``least`` statements (a one-line
    body such as ``return x`` is no answer to look for)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node, clean=False) is not None else node.body
            if sum(1 for _ in ast.walk(ast.Module(body=body, type_ignores=[])) if isinstance(_, ast.stmt)) >= least:
                out[ast.dump(_Anonymous().visit(ast.parse(ast.unparse(node))).body[0])] = node.name
    return out


def notebook_code(path: Path, *, answers_only: bool = False) -> str:
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"
             and (not answers_only or c.get("metadata", {}).get("nbgrader", {}).get("solution"))]
    return "\n\n".join("\n".join(line for line in c.source.splitlines()
                                 if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")) for c in cells)


def bundle_shapes(out: Path) -> dict:
    found = {}
    for path in out.rglob("*.py"):
        found.update({k: f"{path.relative_to(out)}:{v}" for k, v in shapes(path.read_text()).items()})
    for path in out.rglob("*.ipynb"):
        found.update({k: f"{path.relative_to(out)}:{v}" for k, v in shapes(notebook_code(path)).items()})
    return found


# ---------------------------------------------------------------- the bundle, installed
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return bundle.build(tmp_path_factory.mktemp("bundle") / "out")


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A fresh virtualenv with the bundle installed. Where the student install's wheel cache is
    (``tests/e2e/test_student_install.py``; CI fetches it), by the students' own command run in the bundle,
    ``pip install -r requirements-student.txt``, offline from that cache; elsewhere the bundle is
    pip-installed alone and the course's dependencies come from this environment (a ``.pth`` line)."""
    where = tmp_path_factory.mktemp("venv") / "env"
    python = where / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    built = Path(shutil.copytree(built, where.parent / "bundle"))  # (pip builds in the folder: not in the shared one)
    if WHEELS.is_dir() and any(WHEELS.glob("torch-*.whl")):
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
        proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(WHEELS),
                               "-r", "requirements-student.txt"], cwd=built, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
        return python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "course-dependencies.pth").write_text(ours + "\n")  # (a path line: its .pth files do not run)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", purelib, str(built)], check=True)
    return python


def run(python: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FP_GRADING", "FP_SANDBOXED")}
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)


def test_the_bundle_holds_no_solution_of_an_answer_cell(built):
    """No function of a solution notebook's answer cells (compared as shapes: names, arguments and
    docstrings aside) appears in the bundle's code or notebooks."""
    theirs = bundle_shapes(built)
    found = []
    for path in sorted(SOLUTIONS.glob("*/*.ipynb")):
        for shape, name in shapes(notebook_code(path, answers_only=True)).items():
            if shape in theirs:
                found.append(f"{path.parent.name}: {name} is {theirs[shape]}")
    assert not found, "\n".join(found)


def test_the_bundle_holds_no_reference_body(built):
    """No function of the course's reference implementations, of its trained models' code, or of the
    declarations' own code that the bundle stubs (references, mistakes, the correct helpers they are
    built on, the secret cases) appears in the bundle; and none of those files is there."""
    theirs = bundle_shapes(built)
    ours = {}
    for place in REFERENCE_CODE:
        for path in [place] if place.is_file() else sorted(place.rglob("*.py")):
            ours.update({k: f"{path.relative_to(ROOT)}:{v}" for k, v in shapes(path.read_text()).items()})
    declarations = Path(exercises.__file__).parent
    for name in exercises.NAMES:
        stubbed = shapes((built / "firstprinciples" / "exercises" / f"{name}.py").read_text(), least=1)
        course = shapes((declarations / f"{name}.py").read_text())
        ours.update({k: f"exercises/{name}.py:{v}" for k, v in course.items() if k not in stubbed})
    # (allowed: the given layer's constructor, whose parameters W_q, W_k, W_v, W_o, n_heads and d_k are the
    # contract the KV-cache step relies on; its forward is built on a refused built-in)
    leaked = sorted(f"{ours[k]} is {theirs[k]}" for k in set(ours) & set(theirs)
                    if theirs[k] != "firstprinciples/given.py:__init__")
    assert not leaked, "\n".join(leaked)
    assert ours, "nothing was compared"
    for left_out in ("reference", "lengths", "capstone/model.py", "capstone/weights.pt", "bundle.py"):
        assert not (built / "firstprinciples" / left_out).exists()


def test_the_bundle_holds_the_released_notebooks_as_they_are(built):
    """The notebooks are the released ones, byte for byte: their install line (Colab) names the
    package's version, which is the bundle's (``tests/material/test_notebooks.py`` checks the line)."""
    ours = sorted(p.relative_to(ROOT / "exercises") for p in (ROOT / "exercises").rglob("*.ipynb"))
    theirs = sorted(p.relative_to(built / "exercises") for p in (built / "exercises").rglob("*.ipynb"))
    assert ours == theirs and len(ours) == len(exercises.NAMES)
    assert all((ROOT / "exercises" / p).read_bytes() == (built / "exercises" / p).read_bytes() for p in ours)
    import firstprinciples

    assert f'version = "{firstprinciples.__version__}"' in (built / "pyproject.toml").read_text()


def test_a_stand_in_is_a_message_in_the_bundle(built):
    text = (built / "firstprinciples" / "exercises" / "kv_cache.py").read_text()
    tree = ast.parse(text)
    given = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GivenCache")
    for method in (n for n in given.body if isinstance(n, ast.FunctionDef)):
        assert isinstance(method.body[-1], ast.Raise) and "fix KVCache first" in ast.unparse(method.body[-1])


def solved(assignment: str, folder: Path, *, replace: dict | None = None) -> Path:
    """The released notebook of ``assignment`` with the solution's answer cells (``replace``: grade_id ->
    other source), and a first cell that fails unless the course package is the bundle's."""
    (released,) = sorted((ROOT / "exercises" / assignment).glob("*.ipynb"))
    solution = nbformat.read(SOLUTIONS / assignment / released.name, as_version=4)
    answers = {c.metadata.nbgrader["grade_id"]: c.source for c in solution.cells
               if c.get("metadata", {}).get("nbgrader", {}).get("solution")}
    nb = nbformat.read(released, as_version=4)
    for cell in nb.cells:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            source = (replace or {}).get(gid, answers[gid])
            cell.source = "\n".join(ln for ln in source.splitlines()
                                    if ln.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        "import firstprinciples\nassert firstprinciples.BUNDLED, firstprinciples.__file__"))
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / released.name
    nbformat.write(nb, out)
    return out


def check(python: Path, notebook: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FP_GRADING", "FP_SANDBOXED")}
    return subprocess.run([str(python), "-m", "firstprinciples.grading.check", str(notebook)], capture_output=True,
                          text=True, cwd=notebook.parent, env=env, timeout=900)


def test_the_installed_bundle_is_the_bundle_and_has_no_reference(venv, tmp_path):
    out = run(venv, "import firstprinciples, importlib.util as u; print(firstprinciples.__file__, firstprinciples.BUNDLED,"
                    " u.find_spec('firstprinciples.reference'), u.find_spec('firstprinciples.capstone.model'))", tmp_path)
    assert out.returncode == 0, out.stderr
    where, bundled, reference, model = out.stdout.split()
    assert str(tmp_path) not in where and "site-packages" in where and bundled == "True"
    assert reference == "None" and model == "None"


@pytest.mark.parametrize("assignment", ["softmax", "capstone"])
def test_a_solved_notebook_passes_its_check_with_the_bundle_alone(venv, tmp_path, assignment):
    """The check command of the installed bundle, on the released notebook with the solution's
    answers: every visible test and the re-check pass (the capstone trains its model there)."""
    result = check(venv, solved(assignment, tmp_path / assignment))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Visible score" in result.stdout and "FAIL" not in result.stdout


EVERY_CELL = """
import json, sys, traceback
from pathlib import Path
import nbformat
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
out = {}
for path in sorted(Path(sys.argv[1]).glob("*/*.ipynb")):
    shell.reset()
    failed = []
    for cell in nbformat.read(path, 4).cells:
        if cell.cell_type != "code" or "every_test()" in cell.source:
            continue
        result = shell.run_cell(cell.source, silent=True)
        error = result.error_in_exec or result.error_before_exec
        if error is not None:
            failed.append(f"{cell.metadata.get('nbgrader', {}).get('grade_id', '?')}: {type(error).__name__}: {error}")
    out[path.parent.name] = failed
print(json.dumps(out))
"""


def test_every_solved_notebook_runs_every_cell_with_the_bundle_alone(venv, tmp_path):
    """Every released notebook with the solution's answers, every cell run in one IPython namespace
    (as a kernel runs them, without the kernel): every test cell passes with the bundle's package,
    so no check reaches a function the bundle stubbed (its reach is found statically)."""
    for name in exercises.NAMES:
        solved(name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FP_GRADING", "FP_SANDBOXED")}
    env["MPLBACKEND"] = "Agg"
    result = subprocess.run([str(venv), "-c", EVERY_CELL, str(tmp_path)], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(failed) == set(exercises.NAMES)
    assert not any(failed.values()), json.dumps({k: v for k, v in failed.items() if v}, indent=1)


def test_a_mistake_is_named_in_the_bundle_from_its_stored_results(venv, tmp_path):
    """A declared mistake's code is not in the bundle: its stored results name it."""
    wrong = '''def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum()  # the whole tensor, not each slice along dim
'''
    result = check(venv, solved("softmax", tmp_path / "softmax", replace={"softmax": wrong}))
    assert result.returncode == 1
    assert "a typical mistake" in result.stdout, result.stdout[-3000:]
    assert "NotImplementedError" not in result.stdout + result.stderr


def test_a_broken_cache_gets_the_stand_ins_message_in_the_bundle(venv, tmp_path):
    """Where the course hands a correct cache to a student's step, the bundle asks for the student's own."""
    broken = '''class KVCache:
    def __init__(self):
        self.K = self.V = None

    def append(self, k, v):
        raise RuntimeError("not written yet")

    def __len__(self):
        return 0
'''
    result = check(venv, solved("kv_cache", tmp_path / "kv_cache", replace={"KVCache": broken}))
    assert result.returncode == 1
    assert "fix KVCache first" in result.stdout, result.stdout[-3000:]
    assert "NotImplementedError" not in result.stdout + result.stderr
    # (the bundle's re-check runs the notebook's own inputs, and says so: nothing of it is hidden)
    assert "here on the notebook's own inputs" in result.stdout and "on new inputs" not in result.stdout
    assert "the error's message is not shown" not in result.stdout


def test_the_given_layers_are_refused_as_answers():
    """The layers the bundle gives (``firstprinciples.given``) are built on built-ins that the multi-head
    attention and causal-mask tests (and attention's, the cache's and the block's) refuse: copied into an
    answer, they fail."""
    import torch

    from firstprinciples import given
    from firstprinciples.grading.declared import check_for

    class MultiHeadAttention(given.MultiHeadAttention):
        pass

    with pytest.raises(AssertionError, match="multi_head_attention"):
        check_for("multi_head_attention")("test_mha_against_reference", MultiHeadAttention)

    def scaled_dot_product_attention(Q, K, V, mask=None):
        return given.attention(Q, K, V, mask)

    with pytest.raises(AssertionError, match="multi_head_attention"):
        check_for("attention")("test_worked_example", scaled_dot_product_attention)

    def causal_mask(T, dtype=torch.float32):
        return given.causal_mask(T, dtype)

    with pytest.raises(AssertionError, match="generate_square_subsequent_mask"):
        check_for("causal_mask")("test_values", causal_mask)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("float64", 1e-14)])
def test_the_given_layer_is_the_references_layer(dtype, tol):
    """Same parameters, same results (within float rounding: PyTorch scales the queries, the reference
    the scores) for no mask, the causal mask and a per-head additive mask; the same causal mask."""
    import torch

    from firstprinciples import given, reference

    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    ours, theirs = reference.MultiHeadAttention(16, 4).to(dtype), given.MultiHeadAttention(16, 4).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 16, generator=gen, dtype=dtype)
    per_head = reference.causal_mask(5, dtype) + torch.randn(4, 5, 5, generator=gen, dtype=dtype)
    for mask in (None, reference.causal_mask(5, dtype), per_head):
        (o1, w1), (o2, w2) = ours(x, mask), theirs(x, mask)
        assert w2.shape == w1.shape == (2, 4, 5, 5)
        torch.testing.assert_close(o2, o1, atol=tol, rtol=tol)
        torch.testing.assert_close(w2, w1, atol=tol, rtol=tol)
    assert torch.equal(given.causal_mask(7, dtype), reference.causal_mask(7, dtype))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("float64", 1e-14)])
def test_given_attention_is_the_references_attention(dtype, tol):
    """``given.attention`` (what some checks apply a student's mask or bias in) gives the reference's output
    and weights for 3-D and 4-D inputs, with no mask and with an additive mask that hides keys."""
    import torch

    from firstprinciples import given, reference

    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(1)
    for lead in ((2,), (2, 3)):
        Q = torch.randn(*lead, 4, 5, generator=gen, dtype=dtype)
        K, V = (torch.randn(*lead, 6, 5, generator=gen, dtype=dtype) for _ in range(2))
        mask = torch.randn(4, 6, generator=gen, dtype=dtype)
        mask[0, 3:] = float("-inf")
        for m in (None, mask):
            (o1, w1), (o2, w2) = reference.scaled_dot_product_attention(Q, K, V, m), given.attention(Q, K, V, m)
            torch.testing.assert_close(o2, o1, atol=tol, rtol=tol)
            torch.testing.assert_close(w2, w1, atol=tol, rtol=tol)
        assert (given.attention(Q, K, V, mask)[1][..., 0, 3:] == 0).all()


def test_a_visible_case_is_known_by_its_label():
    """The bundle finds a visible case's stored results and its mistakes' results by the case's label
    (``declared.stored_by_label``, ``expected.mistakes``): within a piece, one label is one input."""
    from firstprinciples.grading import wire

    for exercise in exercises.all_pieces():
        pool = exercise.visible() if callable(exercise.visible) else exercise.visible
        seen: dict = {}
        for case in pool:
            inputs = {k: wire.encode(v) for k, v in case.items() if k != "tags"}
            assert seen.setdefault(case["label"], inputs) == inputs, f"{exercise.name}: two inputs for {case['label']!r}"


def test_building_again_gives_the_same_bytes(built, tmp_path):
    """A release's bundle can be rebuilt and compared: the same files with the same bytes (the stored
    mistakes' results too: a mistake that ignores the case's generator draws from a seeded one)."""
    again = bundle.build(tmp_path / "again")
    files = sorted(p.relative_to(built) for p in built.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert [p for p in files if (built / p).read_bytes() != (again / p).read_bytes()] == []
