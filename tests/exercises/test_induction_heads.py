"""induction_heads: what the generic harness does not cover, the messages a student reads, and the
worked example and known heads against the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from exercises import induction_heads_answers as A
from firstprinciples import exercises, reference
from firstprinciples.exercises import induction_heads as D
from firstprinciples.grading import declared
from firstprinciples.induction import worked_example

EXERCISE = exercises.load("induction_heads")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("induction_heads")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the mistake is named in the notebook's message
    ("test_worked_example", MISTAKES["the duplicate token"], ["the duplicate token"]),
    ("test_worked_example", MISTAKES["query period - 1 included"], ["query period - 1 included"]),
    ("test_random", MISTAKES["query period left out"], ["query period left out"]),
    ("test_known_heads", MISTAKES["sum instead of mean"], ["sum instead of mean"]),
    ("test_random", MISTAKES["rows and columns swapped"], ["rows and columns swapped"]),
    ("test_worked_example", MISTAKES["the share of rows whose largest weight is there"], ["the share of rows"]),
    # what it says
    ("test_worked_example", A.python_float, ["Python float", "tensor of shape"]),
    ("test_shapes", MISTAKES["averaged over the leading dimensions too"], ["should have shape (3,)", ".mean(-1)"]),
    ("test_known_heads", MISTAKES["the duplicate token"], ["a perfect induction head", "should score 1"]),
    ("test_worked_example", A.calls_reference, ["scores 0"]),
    ("test_random", A.period_hard_coded, ["period=3", "use the period argument"]),
    ("test_shapes", A.python_float, ["Python float", ".item()"]),
    ("test_shapes", lambda w, p: A.correct(w, p).double(), ["dtype torch.float64", "the weights' dtype torch.float32"]),
    ("test_random", A.clamps_in_place, ["modified its input weights in place"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_the_recheck_fails_a_typed_in_score_on_fresh_weights_of_its_size():
    from exercises.harness import recheck_failures

    failed = recheck_failures(EXERCISE, A.typed_in, seed=5)
    assert "test_worked_example" in failed and "period=3" in failed["test_worked_example"], failed
    assert "the worked example" not in failed["test_worked_example"], failed  # (fresh weights, not the chapter's)


def test_worked_example_is_the_chapters():
    tokens, weights, period = worked_example()
    assert tokens == ["A", "B", "C", "A", "B", "C"] and period == 3
    assert torch.allclose(weights.sum(-1), torch.ones(6)) and bool((weights.triu(1) == 0).all())
    assert abs(reference.induction_score(weights, period).item() - D.WORKED_SCORE) < 1e-6


def test_known_heads_have_their_scores():
    for period in (3, 6, 24):
        heads, expected = D.known_heads(period, "float64")
        assert np.allclose(heads.sum(-1), 1.0)
        assert np.allclose(reference.induction_score(torch.from_numpy(heads), period).numpy(), expected, atol=1e-12)
