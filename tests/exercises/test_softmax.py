"""softmax: what the generic harness does not cover, the messages a student reads for each mistake."""
from __future__ import annotations

import pytest

from exercises import softmax_answers as A
from firstprinciples import exercises
from firstprinciples.grading import declared

EXERCISE = exercises.load("softmax")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("softmax")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the stability mistakes fail in the notebook already, not only at grading
    ("test_large_inputs", MISTAKES["no max subtracted"], ["non-finite", "NaN", "no max subtracted"]),
    ("test_large_inputs", MISTAKES["max over the whole tensor"], ["max over the whole tensor"]),
    ("test_large_inputs", MISTAKES["shifted by the mean, not the max"], ["shifted by the mean"]),
    ("test_worked_example", MISTAKES["exp missing in the denominator"], ["Cat's weight on 'Cat'", "0.380"]),
    ("test_dims", MISTAKES["dim ignored"], ["sums to 1 along dim 2 instead", "dim ignored"]),
    ("test_dims", MISTAKES["keepdim forgotten"], ["keepdim=True"]),
    ("test_worked_example", A.max_namedtuple, [".values", "amax"]),
    ("test_gradients_and_inputs", A.divides_in_place, ["in-place", "e = e / s"]),
    ("test_gradients_and_inputs", A.WRONG["detached"][0], ["does not require grad", ".detach()"]),
    ("test_large_inputs", A.shifts_in_place, ["modified its input x in place"]),
    ("test_large_inputs", A.WRONG["returns numpy"][0], ["NumPy array", "torch.Tensor"]),
    ("test_large_inputs", A.WRONG["casts to float32"][0], ["dtype float32", "float64"]),
    # values that must be exactly 0 or 1 are printed exactly (0.999999999, not a rounded "1")
    ("test_minus_inf", A.epsilon_in_the_sum, ["= 0.9999999989999999,", "must be exactly 1", "off by 1.000000082740371e-09",
                                              "epsilon"]),
    ("test_minus_inf", A.minus_inf_as_minus_100, ["e-44", "-inf", "must be exactly 0"]),
    ("test_worked_example", A.WRONG["calls F.softmax"][0], ["torch.nn.functional.softmax", "scores 0"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_a_misspelt_test_name_is_a_clear_error():
    with pytest.raises(KeyError, match="test_large_inputs"):
        declared.check_for("softmax")("test_large_input", A.correct)


def test_the_recheck_names_the_mistake_without_showing_secret_values():
    from exercises.harness import recheck_failures

    failed = recheck_failures(EXERCISE, MISTAKES["no max subtracted"], seed=4)
    text = failed["test_large_inputs"]
    assert "no max subtracted" in text and "Your results match a typical mistake" in text, text
    assert "should be" not in text, text  # (no expected value of a secret case)
