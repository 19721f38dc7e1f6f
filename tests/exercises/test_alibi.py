"""alibi: what the generic harness does not cover, the messages a student reads for each mistake,
and the reference against a loop and against the ALiBi paper's slopes."""
from __future__ import annotations

import pytest
import torch

from exercises import alibi_answers as A
from firstprinciples import exercises, reference
from firstprinciples.examples.alibi import paper_slopes
from firstprinciples.exercises import alibi as D
from firstprinciples.grading import declared

EXERCISE = exercises.load("alibi")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("alibi")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the mistake is named in the notebook's message
    ("test_worked_example", MISTAKES["slopes 2^(-8h/n_heads)"], ["slopes 2^(-8h/n_heads)", "head 0's last row"]),
    ("test_slopes", MISTAKES["no factor 8"], ["no factor 8"]),
    ("test_against_definition", MISTAKES["slopes in reverse order"], ["slopes in reverse order"]),
    ("test_worked_example", MISTAKES["sign flipped"], ["sign flipped"]),
    ("test_against_definition", MISTAKES["j - i instead of i - j"], ["j - i instead of i - j"]),
    ("test_upper_triangle", MISTAKES["|i - j| in the upper triangle"], ["|i - j| in the upper triangle"]),
    ("test_upper_triangle", MISTAKES["queries and keys swapped"], ["queries and keys swapped"]),
    ("test_against_definition", MISTAKES["heads last, (T, T, n_heads)"], ["heads last"]),
    # what it says
    ("test_slopes", MISTAKES["the paper's rule for n_heads not a power of two"],
     ["n_heads=3", "2^(-8 (h + 1) / n_heads)", "the paper's rule"]),
    ("test_upper_triangle", MISTAKES["-inf in the upper triangle"], ["-inf", "exactly 0", "-inf in the upper triangle"]),
    ("test_shapes", MISTAKES["heads last, (T, T, n_heads)"], ["(1, 1, 4)", "The head comes first"]),
    ("test_shapes", MISTAKES["dtype ignored"], ["dtype torch.float32", "torch.float64"]),
    ("test_worked_example", A.calls_reference, ["scores 0"]),
    ("test_shapes", MISTAKES["one table for all heads, (T, T)"], ["(4, 1, 1)", "its own slope"]),
    ("test_worked_example", A.WRONG["returns a NumPy array"][0], ["torch.Tensor", "NumPy array"]),
    ("test_in_attention", MISTAKES["sign flipped"], ["query", "with the ALiBi bias", "nearer keys lose less"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_zero_scores_show_the_bias_alone():
    def no_penalty_for_the_last_query(n_heads, T, dtype=torch.float32):
        bias = A.correct(n_heads, T, dtype)
        if T == 5:
            bias[:, 4] = 0.0  # the last query sees every key alike
        return bias

    case = next(c for c in EXERCISE.visible if "zero scores" in c["label"])
    got = {"bias": no_penalty_for_the_last_query(4, 5).numpy()}
    want = {"bias": A.correct(4, 5).numpy()}
    text = D.weights_in_attention(case, got, want)
    assert "with zero scores" in text and "[0.2, 0.2, 0.2, 0.2, 0.2]" in text, text


def test_the_recheck_names_the_mistake_without_showing_secret_weights():
    from exercises.harness import recheck_failures

    failed = recheck_failures(EXERCISE, MISTAKES["the paper's rule for n_heads not a power of two"], seed=3)
    text = failed["test_in_attention"]
    assert "the paper's rule" in text and "Your results match a typical mistake" in text, text
    assert "with the ALiBi bias" not in text and "off by" in text, text  # (no weight of secret queries)


def test_reference_matches_a_loop_and_the_paper_for_powers_of_two():
    for n_heads in (1, 2, 4, 8, 16):
        assert torch.allclose(D._slopes(n_heads, "contract"), torch.tensor(paper_slopes(n_heads), dtype=torch.float64))
    for n_heads, T in ((3, 7), (8, 20), (1, 1)):
        for dtype in (torch.float32, torch.float64):
            got = reference.alibi_bias(n_heads, T, dtype)
            assert got.dtype == dtype and torch.allclose(got.double(), A.loops(n_heads, T, torch.float64), atol=1e-7)
    assert not torch.signbit(reference.alibi_bias(4, 6).triu()).any()  # +0.0 above and on the diagonal


def test_the_paper_rule_differs_for_other_head_counts():
    for n_heads in (3, 5, 6, 12):
        assert not torch.allclose(D._slopes(n_heads, "contract"), torch.tensor(paper_slopes(n_heads), dtype=torch.float64))
