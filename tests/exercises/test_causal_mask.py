"""causal_mask: what the generic harness does not cover, the messages a student reads for each mistake,
and the source's own mask (read from the seeds at test time) passing every test."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from exercises import causal_mask_answers as A
from firstprinciples import exercises
from firstprinciples.exercises import causal_mask as declaration
from firstprinciples.grading import declared
from seeds import SEED_DIRS

EXERCISE = exercises.load("causal_mask")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("causal_mask")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # a finite mask is rejected with the reason, in the notebook already
    *(("test_values", fn, ["not -inf", "exactly 0"]) for fn in
      (MISTAKES["large negative number instead of -inf"], A.minus_1e4, A.lowest_float)),
    ("test_shapes_and_dtype", MISTAKES["boolean mask instead of float"], ["boolean", "float"]),
    ("test_values", MISTAKES["-inf multiplied by a 0/1 matrix"], ["is NaN", "0 * -inf is NaN"]),
    ("test_seed_mask", A.calls_torch_mask, ["generate_square_subsequent_mask", "scores 0"]),
    ("test_seed_mask", A.calls_torch_mask_by_alias, ["generate_square_subsequent_mask", "scores 0"]),
    ("test_seed_mask", A.calls_reference, ["firstprinciples.reference.causal_mask", "scores 0"]),
    # the seed test prints both matrices
    ("test_seed_mask", MISTAKES["diagonal masked"], ["Yours:", "The source's mask for 4 tokens", "on the diagonal"]),
    ("test_values", MISTAKES["tril and triu swapped"], ["above the diagonal (the future) but should be -inf"]),
    ("test_no_peeking", MISTAKES["one future position visible"],
     ["changing the tokens after position 0 changed the output", "it must be exactly 0", "one future position visible"]),
    ("test_no_peeking", MISTAKES["diagonal masked"], ["not finite", "Every position must at least see itself"]),
    ("test_no_peeking", MISTAKES["shape (T + 1, T + 1)"], ["raised RuntimeError", "The mask must have shape (5, 5)"]),
    ("test_no_peeking", A.float64_mask, ["torch.float64", "Return a float32 mask"]),
    ("test_shapes_and_dtype", A.float64_mask, ["dtype torch.float64 but should be torch.float32"]),
    ("test_shapes_and_dtype", MISTAKES["extra leading dimension"], ["shape (1, 1, 1)", "No batch dimension"]),
    ("test_values", A.via_numpy, ["NumPy array", "torch.Tensor"]),
    ("test_no_peeking", A.as_list, ["returned a builtins.list, not a torch.Tensor"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_the_profile_hook_is_set_back():
    before = sys.getprofile()
    check = declared.check_for("causal_mask")
    check("test_seed_mask", A.correct)
    with pytest.raises(AssertionError):
        check("test_seed_mask", A.calls_torch_mask)
    assert sys.getprofile() is before


def test_the_recheck_names_the_mistake_without_showing_secret_values():
    from exercises.harness import recheck_failures

    failed = recheck_failures(EXERCISE, MISTAKES["0/1 mask instead of 0/-inf (1 = hidden)"], seed=4)
    text = failed["test_no_peeking"]
    assert "0/1 mask instead of 0/-inf (1 = hidden)" in text and "Your results match a typical mistake" in text, text
    assert "should be" not in text, text  # (no expected value of a secret case)


# ---------------------------------------------------------------- the source's own mask
def _seed_texts():
    for folder in SEED_DIRS:
        for f in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
            yield f.read_text(encoding="utf-8")


def _missing(what):
    msg = f"{what} was not found in the seeds ({', '.join(map(str, SEED_DIRS))})"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def seed_mask_line():
    """The source's own mask code (one expression of seq_len), as a function of T."""
    for text in _seed_texts():
        m = re.search(r"^mask\s*=\s*(torch\.triu\(.*\))\s*$", text, flags=re.M)
        if m:
            expr = compile(m.group(1), "<seed mask>", "eval")
            return lambda T: eval(expr, {"torch": torch, "seq_len": T})
    _missing("the source's mask line")


def seed_table():
    """The source's printed 4 x 4 mask, row by row."""
    for text in _seed_texts():
        rows = re.findall(r"^tok\d\s*\[([^\]]*)\]", text, flags=re.M)
        if len(rows) == 4:
            return tuple(tuple(float(v) for v in row.split(",")) for row in rows)
    _missing("the source's 4 x 4 mask table")


def test_the_declared_mask_is_the_sources_table():
    assert seed_table() == declaration.SEED_MASK_4
    assert torch.equal(A.correct(4), torch.tensor(seed_table()))


def test_the_sources_mask_line_passes_both_runners():
    from exercises.harness import kernel_failures, recheck_failures

    answer = seed_mask_line()
    assert kernel_failures(EXERCISE, answer) == {}
    assert recheck_failures(EXERCISE, answer, seed=0) == {}
