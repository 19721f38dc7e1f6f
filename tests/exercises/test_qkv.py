"""qkv: what the generic harness does not cover: the messages a student reads, the seed's own
projections, the gradient tests' judging of gradients alone, and the worked example's numbers."""
from __future__ import annotations

import pytest
import torch

from exercises import qkv_answers as A
from firstprinciples import examples, exercises, reference
from firstprinciples.examples.qkv import worked_projection
from firstprinciples.grading import declared

PROJECT, SCORES = exercises.pieces("qkv")
MISTAKES = {m.label: m.fn for m in (*PROJECT.mistakes, *SCORES.mistakes)}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("qkv")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the worked examples say which token's vector or score is wrong, and what it should be
    ("test_project_worked_example", MISTAKES["K and V projections swapped"], ["the key of 'Cat'", "[1.0, 0.2]",
                                                                              "K and V projections swapped"]),
    ("test_project_worked_example", MISTAKES["Q and K projections swapped"], ["the query of 'Cat'",
                                                                              "Q and K projections swapped"]),
    ("test_project_worked_example", MISTAKES["W_q used for all three"], ["the key of 'Cat'", "W_q used for all three"]),
    ("test_scores_worked_example", MISTAKES["scaled by 1/sqrt(d_k)"], ["Cat's score for 'Cat'", "1.10", "0.7778",
                                                                       "scaled by 1/sqrt(d_k)"]),
    ("test_scores_worked_example", MISTAKES["Q^T K instead of Q K^T"], ["(T_q, T_k) = (3, 3)", "shape (2, 2)"]),
    ("test_scores_worked_example", MISTAKES["same-position pairs only"], ["shape (3,)", "every (query, key) pair"]),
    # the batching mistakes run on the shapes chosen for them, and are named
    ("test_scores_batched", MISTAKES["K.T on batched input"], ["K.transpose(-2, -1)", "K.T on batched input"]),
    ("test_scores_batched", MISTAKES["scores over the wrong pair of dims"], ["(2, 4, 3, 4)", "wrong pair of dims"]),
    ("test_project_shapes", MISTAKES["weights transposed"], ["weights transposed", "x @ W, not x @ W.T"]),
    ("test_project_shapes", MISTAKES["K and V projections swapped"], ["K and V projections swapped"]),
    # the random test's visible case has square weights: transposed weights run there and are named
    ("test_project_random", MISTAKES["weights transposed"], ["weights transposed"]),
    # an error says what to do
    ("test_project_worked_example", MISTAKES["weights transposed"], ["raised RuntimeError", "x @ W"]),
    ("test_scores_worked_example", MISTAKES["scores over the wrong pair of dims"], ["raised IndexError",
                                                                                    "K.transpose(-2, -1)"]),
    # gradients
    ("test_project_gradients_and_inputs", MISTAKES["W_q used for all three"], ["no gradient reaches W_k",
                                                                               "W_q used for all three"]),
    ("test_scores_gradients_and_inputs", MISTAKES["queries compared with queries"], ["no gradient reaches K"]),
    ("test_project_gradients_and_inputs", A.project_detached, ["does not require grad", ".detach()"]),
    ("test_scores_gradients_and_inputs", A.scores_detached, ["does not require grad", ".detach()"]),
    # types, dtypes, inputs
    ("test_project_shapes", A.project_q_only, ["expected a tuple (Q, K, V)"]),
    ("test_project_shapes", A.project_numpy, ["NumPy array", "torch.Tensor"]),
    ("test_scores_batched", A.scores_casts, ["dtype float32", "float64"]),
    ("test_project_worked_example", A.project_casts, ["dtype float32", "float64"]),
    ("test_scores_worked_example", A.scores_casts, ["dtype float32", "float64"]),
    ("test_scores_batched", A.scores_in_place, ["modified its input K in place"]),
    ("test_project_random", A.project_in_place, ["modified its input x in place"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_forbidden_call_messages_are_clear():
    from firstprinciples.guard import ForbiddenCall

    for grade_id, answer, name in (("test_project_worked_example", A.project_calls_reference, "project_qkv"),
                                   ("test_scores_worked_example", A.scores_calls_reference, "dot_product_scores")):
        with pytest.raises(ForbiddenCall) as err:
            declared.check_for("qkv")(grade_id, answer)
        assert f"firstprinciples.reference.{name}" in str(err.value) and "scores 0" in str(err.value)


def test_a_misspelt_test_name_is_a_clear_error():
    with pytest.raises(KeyError, match="test_project_shapes"):
        declared.check_for("qkv")("test_project_shape", A.project_correct)


def _doubled(fn):
    """The answer's outputs times 2: honest gradients of wrong values."""
    def answer(*args):
        out = fn(*args)
        return tuple(2 * t for t in out) if isinstance(out, tuple) else 2 * out

    return answer


@pytest.mark.parametrize("exercise, answer, values_cell", [
    (PROJECT, _doubled(A.project_with_einsum), "test_project_random"),
    (SCORES, _doubled(A.scores_with_einsum), "test_scores_random"),
])
def test_the_gradient_tests_judge_gradients_not_values(exercise, answer, values_cell):
    """A gradient test compares no values with the reference (as its checks never did): wrong values
    with honest gradients keep it, in the kernel and in the re-check, and lose the value tests."""
    from exercises.harness import kernel_failures, recheck_failures

    grads = next(gid for gid in exercise.tests if gid.endswith("gradients_and_inputs"))
    assert grads not in kernel_failures(exercise, answer) and values_cell in kernel_failures(exercise, answer)
    failed = recheck_failures(exercise, answer, seed=3)
    assert grads not in failed and values_cell in failed, failed


def test_dishonest_gradients_fail_the_gradient_test():
    """Gradients that do not belong to the outputs (a custom backward that doubles them) fail."""
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    def answer(Q, K):
        return Twice.apply(Q @ K.transpose(-2, -1))

    text = message("test_scores_gradients_and_inputs", answer)
    assert "do not match its own outputs" in text, text


def test_the_recheck_names_the_mistake_without_showing_secret_values():
    from exercises.harness import recheck_failures

    failed = recheck_failures(SCORES, MISTAKES["K.T on batched input"], seed=4)
    text = failed["test_scores_batched"]
    assert "K.T on batched input" in text and "Your results match a typical mistake" in text, text
    assert "should be" not in text, text


def test_the_seeds_projections_pass_but_the_gradient_test():
    """The seed's MultiHeadAttention projects with nn.Linear(bias=False): given this exercise's
    (d_model, d_out) weights, its projections pass every test but the gradient one (its layers hold
    weights of their own, so no gradient reaches the W_q, W_k, W_v passed in)."""
    from seeds import seed_namespace
    from exercises.harness import kernel_failures

    seed = seed_namespace("MultiHeadAttention")["MultiHeadAttention"]

    def project_like_the_seed(x, W_q, W_k, W_v):
        mha = seed(x.shape[-1], 1).to(x.dtype)
        out = []
        for layer, W in ((mha.W_q, W_q), (mha.W_k, W_k), (mha.W_v, W_v)):
            layer.weight = torch.nn.Parameter(W.T, requires_grad=False)  # nn.Linear stores (d_out, d_model)
            out.append(layer(x))
        return tuple(out)

    assert set(kernel_failures(PROJECT, project_like_the_seed)) == {"test_project_gradients_and_inputs"}


def test_worked_projection_reproduces_the_attention_chapters_vectors():
    Q, K, V = reference.project_qkv(*worked_projection())
    for got, want in zip((Q, K, V), examples.cat_sat_mat(torch.float64, all_queries=True)):
        torch.testing.assert_close(got[0], want, atol=1e-12, rtol=0)


def test_scores_are_zero_for_perpendicular_and_negative_for_opposite_vectors():
    q = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    K = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    assert reference.dot_product_scores(q, K).tolist() == [[2.0, 0.0, -2.0]]
