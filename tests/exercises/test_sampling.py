"""sampling: what the generic harness does not cover: the messages a student reads, the statistics
of the frequency tests, and that a mistake is named by its draws, not by its code."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from exercises import sampling_answers as A
from firstprinciples import exercises, reference
from firstprinciples.examples.sampling import DELTA, allowed_deviation
from firstprinciples.exercises import sampling as S
from firstprinciples.grading import declared

EXERCISE = exercises.load("sampling")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("sampling")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # a mistake's draws are recognised by their frequencies, whatever the code that drew them
    ("test_temperature", MISTAKES["temperature applied to the probabilities"],
     ["temperature applied to the probabilities"]),
    ("test_temperature", MISTAKES["logits multiplied by the temperature"], ["logits multiplied by the temperature"]),
    ("test_top_k", MISTAKES["top-k keeps k + 1 tokens"], ["top-k keeps k + 1 tokens"]),
    ("test_top_p", MISTAKES["top-p drops the token that crosses the threshold"], ["crosses the threshold"]),
    ("test_top_p", MISTAKES["top-p on the probabilities before top-k"], ["top-p on the probabilities before top-k"]),
    ("test_top_p", MISTAKES["top-p chosen before the temperature"], ["top-p chosen before the temperature"]),
    ("test_greedy", MISTAKES["greedy draws a random number"], ["drew a random number"]),
    ("test_generator", MISTAKES["generator ignored"], ["global random state"]),
    ("test_shapes", MISTAKES["an extra last dimension of size 1"], ["(N, 1)"]),
    ("test_top_k", MISTAKES["top-k sets the other logits to 0"],
     ["must never be drawn", "Your counts against the probabilities", "steep: drawn", "(allowed: never)"]),
    ("test_greedy", A.calls_reference, ["scores 0"]),
    # torch's own error at temperature 0 comes with the mistake that causes it
    ("test_greedy", A.divides_by_zero, ["with temperature 0", "raised RuntimeError in your code",
                                        "temperature 0 divides the logits"]),
    ("test_greedy", A.stops_on_non_finite, ["the probabilities are not finite",
                                            "It runs with temperature 1 on the same logits"]),
    ("test_top_p", A.top_p_before_top_k, ["top-p on the probabilities before top-k"]),
    ("test_temperature", A.first_row_only,
     ["was drawn", "a correct sampler lands that far off with probability below 1e-09"]),
    ("test_temperature", A.scales_in_place, ["changed the logits in place", "x = x / t"]),
    ("test_shapes", A.float_tokens, ["dtype float32", "torch.int64"]),
    ("test_generator", A.always_greedy, ["different seeds gave exactly the same 1000 tokens"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_top_p_before_top_k_is_not_called_top_k_keeping_k_plus_1():
    """With top_k=3, top_p=0.85 both keep the same 3 tokens; the student's top_k alone is right."""
    text = message("test_top_p", A.top_p_before_top_k)
    assert "k + 1" not in text, text
    # nor a sampler that draws, 177 times in 10,000, tokens this one never draws
    assert "inverse CDF" not in text, text


def test_top_k_keeping_k_plus_1_is_still_named_in_the_top_p_test():
    assert "top-k keeps k + 1 tokens" in message("test_top_p", MISTAKES["top-k keeps k + 1 tokens"])


def test_a_correct_sampler_is_not_named_as_a_mistake_where_a_mistake_is_right():
    """A mistake that is right on a case (k - 1 without top_k) is never offered as the explanation."""
    text = message("test_top_k", MISTAKES["top-k keeps k - 1 tokens"])
    assert "top-k keeps k - 1 tokens" in text and "k + 1" not in text, text


def test_the_recheck_names_the_mistake_without_showing_secret_values():
    from exercises.harness import recheck_failures

    failed = recheck_failures(EXERCISE, MISTAKES["top-p drops the token that crosses the threshold"], seed=4)
    text = failed["test_top_p"]
    assert "top-p drops the token that crosses the threshold" in text, text
    assert "Your counts against the probabilities" not in text and "its probability is" not in text, text


def test_bound_is_bernstein():
    t = allowed_deviation(10_000, 0.3)
    assert 300 < t < 350  # about 6.6 standard deviations of 45.8
    assert math.isclose(2 * math.exp(-t * t / (2 * (10_000 * 0.21 + t / 3))), DELTA, rel_tol=1e-9)


def test_reference_matches_an_independent_filter():
    g = torch.Generator().manual_seed(0)
    for kwargs in (*S.TEMPERATURE_CASES, *S.TOP_K_CASES, *S.TOP_P_CASES):
        logits = torch.randn(5, 9, generator=g, dtype=torch.float64)
        want = A._filtered(logits, kwargs.get("temperature", 1.0), kwargs.get("top_k"), kwargs.get("top_p"))
        assert torch.allclose(reference.next_token_probabilities(logits, **kwargs), want, atol=1e-12)


def test_the_stored_probabilities_of_the_example_are_the_references():
    example = torch.tensor(S.LOGITS, dtype=torch.float64)
    assert len(S.EXAMPLE_PROBABILITIES) == len((*S.TEMPERATURE_CASES, *S.TOP_K_CASES, *S.TOP_P_CASES))
    for kwargs in (*S.TEMPERATURE_CASES, *S.TOP_K_CASES, *S.TOP_P_CASES):
        want = reference.next_token_probabilities(example, **kwargs).numpy()
        got = np.array(S.EXAMPLE_PROBABILITIES[tuple(sorted(kwargs.items()))])
        assert np.array_equal(got == 0, want == 0) and np.allclose(got, want, rtol=0, atol=1e-15), kwargs


def test_the_notebooks_frequency_checks_import_no_implementation_of_the_sampler():
    """The visible cases judge their draws with the stored probabilities: checking the chapter's
    cases never calls next_token_probabilities (the re-check's secret cases do, in the grader)."""
    from unittest import mock

    with mock.patch.object(S, "probabilities", side_effect=AssertionError("computed, not stored")):
        for gid in ("test_temperature", "test_top_k", "test_top_p"):
            declared.check_for("sampling")(gid, A.correct)
            text = message(gid, MISTAKES["temperature applied to the probabilities"])
            assert "Your counts against the probabilities" in text and "computed, not stored" not in text, text


@pytest.mark.parametrize("which", ["visible", "secret"])
def test_every_frequency_case_draws_from_distinct_rows(which):
    """Issue 38: a sampler that reads only the first row must meet rows that differ from it."""
    rng = np.random.default_rng(0)
    cases = [c for gid in ("test_temperature", "test_top_k", "test_top_p", "test_generator")
             for c in EXERCISE.cases(gid, which, rng)]
    for c in cases:
        batch, perms = S.batch_of(declared.tensors(c))
        flat = batch.reshape(-1, batch.shape[-1])
        assert flat.shape[0] == math.prod(c["batch"]) and perms is not None
        assert (flat != flat[:1]).any(-1).float().mean() > 0.5, c["label"]  # most rows differ from the first


def test_the_top_p_thresholds_are_away_from_every_cumulative_probability():
    """Correct answers that sum in another order keep the same tokens: every threshold of a secret
    case is at least 0.009 from a cumulative probability (0.01 for the random rows; the chapter's
    top_k=3, top_p=0.85 is 0.0098 below 0.8598; top_p = 1 keeps everything)."""
    for seed in range(5):
        for c in EXERCISE.cases("test_top_p", "secret", np.random.default_rng(seed)):
            if c["top_p"] >= 1:
                continue
            kw = {k: c[k] for k in ("temperature", "top_k") if k in c}
            p = np.sort(S.probabilities(c["logits"], kw))[::-1]
            assert np.abs(np.cumsum(p) - c["top_p"]).min() >= 0.009, c["label"]
