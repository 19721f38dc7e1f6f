"""encoder_decoder: what the generic harness does not cover: the messages a student reads (in the
notebook and in the re-check), the worked example the notebook prints, the seed's own attention, the
tests that judge no values, and the notebook's recap of the student's attention."""
from __future__ import annotations

import pytest
import torch

from exercises import attention_answers as A
from exercises import encoder_decoder_answers as T
from firstprinciples import exercises, reference
from firstprinciples.examples.encoder_decoder import worked_example
from firstprinciples.grading import declared

RECAP, EXERCISE = exercises.pieces("encoder_decoder")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}
ATTENTION_MISTAKES = {m.label: m.fn for m in exercises.load("attention").mistakes}


def failure(check, *args) -> Exception:
    with pytest.raises(Exception) as err:
        check(*args)
    return err.value


def message(grade_id: str, answer) -> str:
    return str(failure(declared.check_for("encoder_decoder"), grade_id, answer))


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # each mix-up of the two sequences, where it runs (x and context of equal shapes), is named
    ("test_roles", MISTAKES["queries taken from the context (roles swapped)"],
     ["changing x at position 3 should change output row 3, and only that row", "Largest change of the other rows",
      "queries taken from the context (roles swapped)"]),
    ("test_roles", MISTAKES["keys from x"], ["changing x at position 3", "keys from x"]),
    ("test_roles", MISTAKES["values from x"], ["changing x at position 3", "values from x"]),
    ("test_roles", MISTAKES["causal mask applied to cross-attention"],
     ["changing the last position of the context should change every output row",
      "no causal mask in cross-attention", "causal mask applied to cross-attention"]),
    ("test_roles", MISTAKES["softmax over the queries"], ["changing x at position 3", "softmax over the queries"]),
    # the worked example says which entry is wrong, and what it should be
    ("test_worked_example", MISTAKES["causal mask applied to cross-attention"],
     ["the first query (Cat's, [1.0, 0.5]) puts weight 1.0000 on 'Cat' but should put 0.380",
      "causal mask applied to cross-attention"]),
    ("test_worked_example", MISTAKES["softmax over the queries"], ["puts weight", "softmax over the queries"]),
    ("test_worked_example", T.attention_without_scaling, ["the first query (Cat's, [1.0, 0.5]) puts weight"]),
    ("test_shapes", MISTAKES["softmax over the queries"],
     ["should sum to 1 (over the context positions, dim=-1)", "softmax over the queries"]),
    ("test_padding_mask", MISTAKES["mask ignored"], ["mask (2, 1, 5)", "mask ignored"]),
    ("test_padding_mask", T.mask_clamped, ["padded context positions (where the mask is -inf) must get exactly zero "
                                           "weight"]),
    ("test_against_torch", MISTAKES["causal mask applied to cross-attention"],
     ["output for x (2, 4, 8), context (2, 6, 8)", "causal mask applied to cross-attention"]),
    # a shape error is explained in terms of the two roles, with the case's shapes
    ("test_worked_example", MISTAKES["keys from x"],
     ["Queries come from x", "context (1, 3, 4)", "cannot be multiplied"]),
    ("test_against_torch", T.square_causal_mask, ["raised RuntimeError in your code at", "in square_causal_mask",
                                                 "Shapes on this line: s (2, 4, 6), mask (4, 4)",
                                                 "add a causal mask that does not fit"]),
    ("test_padding_mask", T.if_mask, ["in if_mask", "if mask:", "write `if mask is not None:`"]),
    # the structure
    ("test_shapes", T.transpose_with_T, ["in transpose_with_T", "Shapes on this line"]),
    ("test_shapes", T.returned_in_the_wrong_order, ["wrong order: (weights, output) instead of (output, weights)"]),
    ("test_worked_example", T.output_only, ["expected a tuple (output, weights)"]),
    ("test_worked_example", T.via_numpy, ["NumPy array", "torch.Tensor"]),
    ("test_roles", T.casts_to_float32, ["dtype float32", "float64"]),
    ("test_worked_example", T.modifies_inputs, ["modified its input W_q in place"]),
    ("test_gradients_and_inputs", T.detached, ["does not require grad", ".detach()"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_a_wrong_shape_is_said_in_terms_of_the_roles():
    def weights_transposed(x, context, W_q, W_k, W_v, mask=None):
        out, w = T.plain(x, context, W_q, W_k, W_v, mask)
        return out, w.transpose(-2, -1)

    text = message("test_shapes", weights_transposed)
    assert "weights has shape (1, 5, 2), expected (1, 2, 5)" in text, text
    assert "one row per query of x, one column per position of the context" in text, text


@pytest.mark.parametrize("answer", [T.calls_torch_sdpa, T.calls_reference, T.calls_reference_attention,
                                    T.calls_torch_mha_and_hides_it])
def test_forbidden_call_messages_are_clear(answer):
    from firstprinciples.guard import ForbiddenCall

    err = failure(declared.check_for("encoder_decoder"), "test_worked_example", answer)
    assert isinstance(err, ForbiddenCall), err
    assert "scores 0" in str(err) and "cross-attention (with your own scaled_dot_product_attention)" in str(err), err


def test_the_worked_example_reproduces_the_attention_chapter():
    """What the notebook's try-it cell prints: the first query's weights and output are the
    attention chapter's."""
    out, w = reference.cross_attention(*worked_example())
    assert (tuple(w.shape), tuple(out.shape)) == ((1, 2, 3), (1, 2, 2))
    torch.testing.assert_close(w[0, 0], torch.tensor([0.380, 0.354, 0.266], dtype=torch.float64), atol=1e-3, rtol=0)
    torch.testing.assert_close(out[0, 0], torch.tensor([1.026, 0.974], dtype=torch.float64), atol=1e-3, rtol=0)


@pytest.mark.parametrize("answer, grade_id, seed", [
    # only the secret cases catch these: the re-check says so without showing its inputs' values
    (T.naive_softmax, "test_against_torch", 0),
    (T.scaled_by_d_model, "test_padding_mask", 1),
])
def test_the_recheck_fails_what_only_it_catches_without_showing_values(answer, grade_id, seed):
    from exercises.harness import recheck_failures

    text = recheck_failures(EXERCISE, answer, seed)[grade_id]
    assert "differs from the reference" in text or "non-finite" in text, text
    assert "should be" not in text, text


def test_the_recheck_names_a_mistake_without_showing_values():
    from exercises.harness import recheck_failures

    text = recheck_failures(EXERCISE, MISTAKES["causal mask applied to cross-attention"], 2)["test_roles"]
    assert "no causal mask in cross-attention" in text and "causal mask applied to cross-attention" in text, text
    assert "Largest change" not in text, text  # (a number computed from the secret inputs)


def test_the_seeds_attention_passes_every_test():
    from seeds import seed_namespace
    from exercises.harness import kernel_failures, recheck_failures

    seed = seed_namespace("scaled_dot_product_attention")["scaled_dot_product_attention"]
    assert kernel_failures(RECAP, seed) == {}
    assert recheck_failures(RECAP, seed, 5) == {}


def _sharp(x, context, W_q, W_k, W_v, mask=None):
    """Rows that are distributions, of the right shapes: the scores scaled twice too little."""
    return A._softmax_attn(x @ W_q * 2, context @ W_k, context @ W_v, mask)


def _doubled(x, context, W_q, W_k, W_v, mask=None):
    """Honest gradients of wrong values."""
    out, w = T.einsum_cross_attention(x, context, W_q, W_k, W_v, mask)
    return 2 * out, w


@pytest.mark.parametrize("answer, kept", [(_sharp, "test_shapes"), (_doubled, "test_gradients_and_inputs")])
def test_the_tests_that_judge_no_values_keep_wrong_values(answer, kept):
    """test_shapes judges structure and rows summing to 1, test_gradients_and_inputs the gradients
    against the answer's own output (as their checks always did): wrong values keep them, in the
    kernel and in the re-check, and lose the tests that compare values."""
    from exercises.harness import kernel_failures, recheck_failures

    failed = kernel_failures(EXERCISE, answer)
    assert kept not in failed and "test_against_torch" in failed, failed
    failed = recheck_failures(EXERCISE, answer, seed=3)
    assert kept not in failed and "test_against_torch" in failed, failed


def test_an_answer_whose_queries_read_each_other_fails_the_roles_test():
    """The property of test_roles, on the answer's own further calls: an answer that mixes its output
    rows (a little of the mean over the queries added to each) is told so, in the kernel and in the
    re-check, without a named mistake."""
    from exercises.harness import kernel_failures, recheck_failures

    def rows_mixed(x, context, W_q, W_k, W_v, mask=None):
        out, w = T.plain(x, context, W_q, W_k, W_v, mask)
        return out + 1e-3 * out.mean(dim=1, keepdim=True), w

    text = kernel_failures(EXERCISE, rows_mixed)["test_roles"]
    assert "changing x at position 3 should change output row 3, and only that row" in text, text
    assert "typical mistake" not in text, text
    assert "should change output row" in recheck_failures(EXERCISE, rows_mixed, 4)["test_roles"]


# ---------------------------------------------------------------- the recap of the student's attention
@pytest.mark.parametrize("answer, phrases", [
    (ATTENTION_MISTAKES["no scaling"], ["no scaling", "entry [0, 0] is the worked example"]),
    # (named in the notebook: the re-check of this cell has no mask)
    (ATTENTION_MISTAKES["mask ignored"], ["with the causal mask of shape (3, 3)", "mask ignored"]),
    (ATTENTION_MISTAKES["mask added after the softmax"], ["mask added after the softmax"]),
    (A.dot_T, ["raised RuntimeError in your code at", "in dot_T", "Shapes on this line: Q (2, 2, 3, 2)",
               "`K.T` reverses every dimension"]),
    (A.if_mask, ["in if_mask", "write `if mask is not None:`"]),
    (A.calls_torch_builtin, ["scaled_dot_product_attention", "scores 0"]),
])
def test_the_recap_fails_wrong_answers_and_says_why(answer, phrases):
    text = message("test_scaled_dot_product_attention", answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_the_recap_is_the_attention_exercises_recap():
    """The cell runs the cases of the attention exercise's recap (which the later notebooks'
    declarations recap too), and is re-checked by the attention exercise's probe."""
    attention = exercises.load("attention")
    from firstprinciples.exercises.attention import RECAP as ATTENTION_RECAP

    assert [c["label"] for c in RECAP.visible] == [c["label"] for c in ATTENTION_RECAP.visible]
    assert RECAP.recap_of == "attention" and exercises.by_piece()["scaled_dot_product_attention"] is attention


def test_a_cross_attention_answer_never_fails_the_recap():
    """The recap cell is re-checked on the notebook's attention only: a wrong cross_attention leaves it
    alone, a wrong attention fails it."""
    from course import as_answer, as_student_code
    from exercises.harness import notebook

    from firstprinciples.grading import trusted

    base = {e.piece: as_student_code(e.reference_piece()) for e in exercises.pieces("encoder_decoder")}
    nb = notebook("encoder_decoder")
    for answers, fails in (({"cross_attention": as_answer(MISTAKES["keys from x"])}, False),
                           ({"scaled_dot_product_attention": as_answer(ATTENTION_MISTAKES["no scaling"])}, True)):
        verdicts = trusted.local_verdicts(nb, {**base, **answers}, 0)
        assert bool(verdicts["test_scaled_dot_product_attention"]) == fails, verdicts
