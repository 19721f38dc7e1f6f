"""attention: what the generic harness does not cover: the messages a student reads (in the notebook
and in the re-check), the seed's own attention, the tests that judge no values, and the recap that
later notebooks run (``attention.RECAP``, which their declarations recap)."""
from __future__ import annotations

import math

import pytest
import torch

from exercises import attention_answers as A
from firstprinciples import exercises
from firstprinciples.grading import declared

EXERCISE = exercises.load("attention")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def failure(check, *args) -> Exception:
    with pytest.raises(Exception) as err:
        check(*args)
    return err.value


def message(grade_id: str, answer) -> str:
    return str(failure(declared.check_for("attention"), grade_id, answer))


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the worked example says which entry is wrong, and what it should be
    ("test_worked_example", MISTAKES["no scaling"], ["Cat's weight on 'Cat'", "0.380", "no scaling"]),
    ("test_worked_example", MISTAKES["scaled by d_k"], ["Cat's weight on", "scaled by d_k"]),
    ("test_worked_example", MISTAKES["softmax over the wrong axis"], ["softmax over the wrong axis"]),
    ("test_worked_example", MISTAKES["keys used as values"], ["Cat's new representation[0]", "keys used as values"]),
    ("test_batched_shapes", MISTAKES["softmax over the wrong axis"], ["should sum to 1 (over the keys, dim=-1)",
                                                                      "softmax over the wrong axis"]),
    ("test_masks", MISTAKES["mask added after the softmax"], ["mask added after the softmax"]),
    ("test_masks", MISTAKES["mask ignored"], ["Cat (the first token) can only attend to itself", "mask ignored"]),
    ("test_random_against_torch", MISTAKES["scaled by sqrt(d_v)"], ["scaled by sqrt(d_v)", "V (2, 6, 5)"]),
    # an error of the student's code: their line, the shapes on it, and what to write instead
    ("test_batched_shapes", A.dot_T, ["raised RuntimeError in your code at", "attention_answers.py", "in dot_T",
                                      "scores = Q @ K.T / math.sqrt(Q.shape[-1])", "Shapes on this line: Q (2, 3, 4)",
                                      "`K.T` reverses every dimension", "`K.transpose(-2, -1)`"]),
    ("test_masks", A.if_mask, ["in if_mask", "if mask:", "Boolean value of Tensor", "write `if mask is not None:`"]),
    # the structure
    ("test_worked_example", A.returned_in_the_wrong_order,
     ["wrong order: (weights, output) instead of (output, weights)"]),
    ("test_gradients_and_inputs", A.returned_in_the_wrong_order, ["wrong order"]),
    ("test_worked_example", A.output_only, ["expected a tuple (output, weights)"]),
    ("test_batched_shapes", A.via_numpy, ["NumPy array", "torch.Tensor"]),
    ("test_worked_example", A.casts_to_float32, ["dtype float32", "float64"]),
    ("test_random_against_torch", A.weights_transposed, ["weights for Q (2, 4, 8)", "shape (2, 6, 4)", "(2, 4, 6)"]),
    ("test_worked_example", A.inplace_scale, ["modified its input Q in place"]),
    ("test_gradients_and_inputs", A.detached, ["does not require grad", ".detach()"]),
    ("test_gradients_and_inputs", MISTAKES["keys used as values"], ["no gradient reaches V"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_a_correct_answer_is_not_diagnosed_with_a_mistake_that_equals_it():
    # Without a mask, "mask ignored" gives the right answer; naming it would mislead.
    assert "mask ignored" not in message("test_worked_example", MISTAKES["no scaling"])


def test_forbidden_call_messages_are_clear():
    from firstprinciples.guard import ForbiddenCall

    for answer in (A.calls_torch_builtin, A.calls_reference):
        err = failure(declared.check_for("attention"), "test_worked_example", answer)
        assert isinstance(err, ForbiddenCall), err
        assert "scaled_dot_product_attention" in str(err) and "scores 0" in str(err)


def test_a_failure_shows_no_frame_of_the_course_but_the_one_hidden_wrapper():
    """The traceback a student sees: the test cell, the one frame of the wrapper (hidden in the
    notebook), no torch; the student's own line is in the message."""
    err = failure(declared.check_for("attention"), "test_batched_shapes", A.dot_T)
    files = []
    tb = err.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    assert [f for f in files if "firstprinciples" in f] == [files[1]] and files[1].endswith("_student.py"), files
    assert "torch" not in "".join(files), files
    assert f"{A.__file__}, line" in str(err), err


@pytest.mark.parametrize("mistake, grade_id, seed", [
    # only the secret cases catch these: the re-check names them, without showing its inputs' values
    ("mask added before the scaling", "test_masks", 0),
    ("softmax overflows", "test_random_against_torch", 1),
    ("scaled by sqrt(d_v)", "test_masks", 2),
])
def test_the_recheck_names_the_mistakes_only_it_catches(mistake, grade_id, seed):
    from exercises.harness import recheck_failures

    text = recheck_failures(EXERCISE, MISTAKES[mistake], seed)[grade_id]
    assert mistake in text and "Your results match a typical mistake" in text, text
    assert "should be" not in text, text


def test_the_seeds_attention_passes_every_test():
    from seeds import seed_namespace
    from exercises.harness import kernel_failures, recheck_failures

    seed = seed_namespace("scaled_dot_product_attention")["scaled_dot_product_attention"]
    assert kernel_failures(EXERCISE, seed) == {}
    assert recheck_failures(EXERCISE, seed, 5) == {}


def _sharp(Q, K, V, mask=None):
    """Rows that are distributions, of the right shapes: the scores scaled twice too little."""
    w = torch.softmax(Q @ K.transpose(-2, -1) * 2 / math.sqrt(Q.shape[-1]) + (0 if mask is None else mask), dim=-1)
    return w @ V, w


def _doubled(Q, K, V, mask=None):
    """Honest gradients of wrong values."""
    out, w = A.einsum_logsumexp(Q, K, V, mask)
    return 2 * out, w


@pytest.mark.parametrize("answer, kept", [(_sharp, "test_batched_shapes"), (_doubled, "test_gradients_and_inputs")])
def test_the_tests_that_judge_no_values_keep_wrong_values(answer, kept):
    """test_batched_shapes judges structure and rows summing to 1, test_gradients_and_inputs the
    gradients against the answer's own outputs (as their checks always did): wrong values keep them,
    in the kernel and in the re-check, and lose the tests that compare values."""
    from exercises.harness import kernel_failures, recheck_failures

    failed = kernel_failures(EXERCISE, answer)
    assert kept not in failed and "test_random_against_torch" in failed, failed
    failed = recheck_failures(EXERCISE, answer, seed=3)
    assert kept not in failed and "test_random_against_torch" in failed, failed


# ---------------------------------------------------------------- the later notebooks' recap
def recap_cell(answer):
    """The later notebooks' recap cell (transformer_block's and the capstone's, both declared)."""
    declared.check_for("capstone")("test_scaled_dot_product_attention", answer)


@pytest.mark.parametrize("answer", list(A.CORRECT.values()), ids=list(A.CORRECT))
def test_the_recap_passes_correct_answers(answer):
    recap_cell(answer)


@pytest.mark.parametrize("answer, phrases", [
    (MISTAKES["no scaling"], ["no scaling", "entry [0, 0] is the worked example"]),
    (MISTAKES["mask ignored"], ["with the causal mask of shape (3, 3)", "mask ignored"]),
    (A.dot_T, ["raised RuntimeError in your code at", "in dot_T", "Shapes on this line: Q (2, 2, 3, 2)",
               "`K.T` reverses every dimension"]),
    (A.if_mask, ["in if_mask", "write `if mask is not None:`"]),
    (A.calls_torch_builtin, ["scaled_dot_product_attention", "scores 0"]),
])
def test_the_recap_fails_wrong_answers_and_says_why(answer, phrases):
    text = str(failure(recap_cell, answer))
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_the_later_notebooks_recap_is_re_checked():
    """multi_head_attention's recap cell is re-checked on the declaration's secret cases: a correct
    attention passes it, one without the scaling fails it (with the course's multi-head attention)."""
    from course import SOLUTIONS
    from test_probes_seeds import solution_namespace

    from firstprinciples.grading import trusted

    nb, namespace = solution_namespace(SOLUTIONS / "multi_head_attention" / "multi_head_attention.ipynb")
    for answer, fails in ((A.online_softmax_over_keys, False), (MISTAKES["no scaling"], True)):
        verdicts = trusted.local_verdicts(nb, {**namespace, "scaled_dot_product_attention": answer}, 0)
        assert bool(verdicts["test_scaled_dot_product_attention"]) == fails, verdicts
