"""tiled_attention: what the generic harness does not cover: the messages a student reads, the
memory measure (its bound, and no compiler imported to take it) and the reference against torch's."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from exercises import tiled_attention_answers as A
from firstprinciples import exercises
from firstprinciples.exercises.tiled_attention import OVER, allowed_elements, memory_bound
from firstprinciples.grading import declared

EXERCISE = exercises.load("tiled_attention")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("tiled_attention")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases, absent", [
    ("test_against_attention", MISTAKES["the output not rescaled"], ["the output not rescaled"], []),
    ("test_against_attention", MISTAKES["the running sum not rescaled"], ["the running sum not rescaled"], []),
    ("test_worked_example", MISTAKES["no 1/sqrt(d_k)"], ["no 1/sqrt(d_k)"], []),
    ("test_causal", MISTAKES["the causal mask shows one future key"], ["the causal mask shows one future key"], []),
    ("test_causal", MISTAKES["causal ignored"], ["causal ignored"], []),
    ("test_against_attention", MISTAKES["the last partial block dropped"], ["the last partial block dropped"], []),
    # one key at a time, a key's position within its block is 0, as if causal were ignored: the
    # worked example's blocks of two keys (before the chapter's one key at a time) tell them apart
    ("test_worked_example", A.positions_within_the_block, ["key positions counted within each block"],
     ["causal ignored"]),
    ("test_causal", A.positions_within_the_block, ["key positions counted within each block"], ["causal ignored"]),
    ("test_worked_example", MISTAKES["causal ignored"], ["causal ignored"], ["key positions counted"]),
    ("test_memory", MISTAKES["the full score matrix"], ["131,072", "block_size", "(2, 256, 256)", "16,384"], []),
    ("test_memory", MISTAKES["the whole causal mask built first"], ["(256, 256)", "the whole causal mask built first"],
     []),
    ("test_memory", MISTAKES["block_size ignored"], ["(2, 256, 64)", "block_size ignored"], []),
    ("test_large_scores", MISTAKES["no running max"], ["non-finite", "overflows"], []),
    ("test_worked_example", A.calls_softmax, ["scores 0"], []),
    ("test_worked_example", A.scales_Q_in_place, ["modified its input Q in place"], []),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases, absent):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"
    for phrase in absent:
        assert phrase not in text, f"{phrase!r} in:\n{text}"


def test_cats_row_is_the_chapters():
    """The worked example's property holds Cat's row to the chapter's printed figures, and says them."""
    from firstprinciples.exercises.tiled_attention import cats_row

    case = {"tags": ("worked", "printed")}
    assert cats_row(case, {"output": torch.tensor([[1.026, 0.974]]).numpy()}, {}) is None
    assert "(1.026, 0.974)" in cats_row(case, {"output": torch.tensor([[1.0, 0.974]]).numpy()}, {})


def test_the_recheck_fails_a_full_matrix_without_showing_secret_values():
    """In the re-check, a full matrix is first what the allocator counted (whatever the dispatch mode saw)."""
    from exercises.harness import recheck_failures

    text = recheck_failures(EXERCISE, MISTAKES["the full score matrix"], seed=1)["test_memory"]
    assert "allocated" in text and "(..., T_q, block_size)" in text, text
    assert "should be" not in text, text


def test_the_recheck_counts_what_a_dispatch_mode_cannot_see():
    """An answer that switches dispatch modes off passes the notebook's memory test (the measure
    cannot see it) but not the re-check's, whose watch counts allocations at torch's allocator
    (the corpus's atk_tiled_full_matrix_unwatched)."""
    from exercises.harness import kernel_failures, recheck_failures

    assert kernel_failures(EXERCISE, A.full_matrix_unwatched) == {}
    text = recheck_failures(EXERCISE, A.full_matrix_unwatched, seed=0)["test_memory"]
    assert "allocated" in text and "allowed" in text, text


def test_the_recheck_counts_memory_held_outside_torch():
    """An answer that builds the whole matrix in NumPy creates no large tensor (neither measure of
    torch sees it) but fails the re-check's memory test, which also counts what Python's allocator
    held (the corpus's atk_tiled_full_matrix_in_numpy); the reference stays far below that allowance."""
    from exercises.harness import kernel_failures, recheck_failures

    assert kernel_failures(EXERCISE, A.full_matrix_in_numpy) == {}
    text = recheck_failures(EXERCISE, A.full_matrix_in_numpy, seed=2)["test_memory"]
    assert "outside torch" in text and "Python's allocation tracer" in text, text


def _plan(answer_source: str | None, seed: int = 3):
    """The re-check's plan of the solution notebook, its answer cell replaced by ``answer_source``."""
    import nbformat

    from course import SOLUTIONS, with_answer
    from firstprinciples.grading import trusted

    nb = nbformat.read(SOLUTIONS / "tiled_attention" / "tiled_attention.ipynb", as_version=4)
    if answer_source is not None:
        nb = with_answer(nb, "tiled_attention", answer_source)
    plan = trusted.make_plan(nb, seed)
    check = next(c for c in plan.checks if c.name == "tiled_attention")
    assert len(check.apart) == 1  # the one large case, run apart
    return plan, check


def _source(fn) -> str:
    import inspect
    import textwrap

    code = textwrap.dedent(inspect.getsource(fn)).replace(f"def {fn.__name__}(", "def tiled_attention(")
    return "import math\n\nimport numpy as np\nimport torch\n\n\n" + code


# A real runner process (cold, unsandboxed: the same job and the same reading from outside as a warm one)
COMMAND = [sys.executable, "-m", "firstprinciples.grading.recheck"]


def test_memory_no_measure_inside_the_runner_sees_is_seen_from_outside():
    """The corpus's atk_tiled_full_matrix_in_a_memory_map: a whole (T_q, T_k) matrix in an anonymous
    memory map, computed in place. Torch's allocator and Python's tracer see nothing, so inside the
    runner it passes every memory case (the in-process re-check: no failure). In a runner process, the
    grader reads the process's memory from outside on the case run apart, and test_memory fails with
    that reason, on that case only."""
    from corpus.attacks import ATTACKS
    from exercises.harness import recheck_failures
    from firstprinciples.grading import trusted

    source = next(e for e in ATTACKS if e["id"] == "atk_tiled_full_matrix_in_a_memory_map")["answers"]["tiled_attention"]
    namespace: dict = {}
    exec(compile(source, "<the attack>", "exec"), namespace)
    assert recheck_failures(EXERCISE, namespace["tiled_attention"], seed=3) == {}
    plan, check = _plan(source)
    found = trusted.recheck(plan, COMMAND)[0]["tiled_attention"]
    errors = {i: c["error"] for i, c in enumerate(found.cases) if "error" in c}
    assert list(errors) == list(check.apart), errors
    assert "measured from outside the process" in errors[check.apart[0]], errors


@pytest.mark.parametrize("answer", [None, A.query_tiles, A.partials_merged_at_the_end],
                         ids=["solution", "query tiles", "partials merged at the end"])
def test_correct_answers_grow_the_runner_far_less_than_allowed(answer):
    """The solution and unusual correct answers (tiles of queries too; every key block's partial
    result kept until the end, in float64) pass every case in a runner process, and the growth the
    grader read on the case run apart is well within the allowance. Without ``recheck.allocate_plainly``
    the last one grew by 173 MB (the allocator's heap, not the answer's tensors)."""
    from firstprinciples.grading import trusted

    plan, check = _plan(None if answer is None else _source(answer))
    _, results = trusted.run_runner(COMMAND, trusted.job_cells(plan, [check.name]), [check], trusted.Limits(),
                                    time.monotonic() + 300)
    res = results["tiled_attention"]["results"][check.apart[0]]
    assert "outputs" in res, res
    assert isinstance(res["resident"], int) and 0 <= res["resident"] < 0.8 * trusted.RESIDENT_ALLOWANCE, res["resident"]
    found = trusted.outcome(check, results["tiled_attention"])
    assert found.overall is None and not [c for c in found.cases if "error" in c], found


@pytest.mark.parametrize("causal", [False, True])
def test_reference_agrees_with_torch(causal):
    g = torch.Generator().manual_seed(0)
    reference = EXERCISE.reference_piece()
    for lead, T, d, block in (((2, 3), 37, 8, 8), ((1,), 100, 16, 64), ((), 5, 4, 1)):
        Q, K, V = (torch.randn(*lead, T, d, generator=g, dtype=torch.float64) for _ in range(3))
        want = torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal)
        assert torch.allclose(reference(Q, K, V, block, causal), want, atol=1e-12)


def test_the_reference_keeps_within_the_memory_bound():
    Q, K, V = (torch.randn(2, 512, 16) for _ in range(3))
    case = {"Q": Q, "K": K, "V": V, "block_size": 32, "causal": True}
    res = EXERCISE.adapter(A.correct, {**case, "measure": True})
    assert res[OVER].numel() == 0  # nothing above the bound
    assert allowed_elements(Q, K, V, 32) < 2 * 512 * 512 / 8
    res = EXERCISE.adapter(MISTAKES["the full score matrix"], {**case, "measure": True})
    assert res[OVER].tolist() == [2, 512, 512, 2 * 512 * 512]
    assert memory_bound(case) == 8 * allowed_elements(Q, K, V, 32)


MEASURE_IN_A_FRESH_PROCESS = """
import sys, torch
from firstprinciples import exercises
from firstprinciples.exercises.tiled_attention import OVER
from firstprinciples import reference
E = exercises.load("tiled_attention")
fn = reference.tiled_attention.__wrapped__
if sys.argv[1] == "compiled":
    fn = torch.compile(fn, backend="eager")
Q, K, V = (torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
from firstprinciples.memory import StorageSizes
sizes = StorageSizes()
with sizes:
    out = fn(Q, K, V, 16, True)
assert torch.allclose(out, reference.tiled_attention(Q, K, V, 16, True))
res = E.adapter(fn, {"Q": Q, "K": K, "V": V, "block_size": 16, "causal": True, "measure": True})
print(sizes.largest, res[OVER].numel(), "torch._dynamo" in sys.modules)
"""


def test_measuring_memory_needs_no_compiler_and_a_compiled_answer_is_measured_alike():
    """The memory measure (a dispatch mode) does not import torch._dynamo (0.7-1 s in every
    kernel, re-check and service that measures a tiled attention: torch's wrapper of a mode, kept
    for torch.compile, imports it at the mode's first operation); an answer run through
    torch.compile is still measured, with the same largest intermediate, and kept within the bound."""
    got = {kind: subprocess.run([sys.executable, "-c", MEASURE_IN_A_FRESH_PROCESS, kind], capture_output=True,
                                text=True, timeout=300) for kind in ("plain", "compiled")}
    for kind, proc in got.items():
        assert proc.returncode == 0, (kind, proc.stderr[-2000:])
    plain, compiled = (got[k].stdout.split() for k in ("plain", "compiled"))
    assert plain[2] == "False", "measuring a plain answer imported torch._dynamo"
    assert plain[:2] == compiled[:2] and plain[1] == "0", (plain, compiled)
