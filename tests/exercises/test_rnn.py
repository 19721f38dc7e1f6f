"""rnn: what the generic harness does not cover: the messages a student reads, the chapter's numbers,
and that the expected states (the course's reference) are torch.nn.RNN's on every random case."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from exercises import rnn_answers as A
from firstprinciples import exercises, reference
from firstprinciples.examples.rnn import worked_example
from firstprinciples.grading import declared

EXERCISE = exercises.load("rnn")
MISTAKES = {m.label: m.fn for m in EXERCISE.mistakes}


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        declared.check_for("rnn")(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    ("test_worked_example", A.calls_nn_rnn, ["torch.rnn_tanh", "scores 0"]),
    ("test_worked_example", A.calls_reference, ["firstprinciples.reference.rnn_forward", "scores 0"]),
    # the worked example names the state and the token
    ("test_worked_example", MISTAKES["state never updated"], ["h_2", "'cat'", "state never updated"]),
    ("test_worked_example", MISTAKES["tanh forgotten"], ["h_1[0], the state after reading 'The'", "tanh forgotten"]),
    ("test_worked_example", MISTAKES["last hidden state only"], ["shape (1, 2)", "(1, 3, 2)", "last hidden state only"]),
    # the visible random case has d_in == d_h: torch's transposed layout runs there, and is named
    ("test_random_against_torch", MISTAKES["weights transposed"], ["weights transposed"]),
    ("test_random_against_torch", MISTAKES["states stacked along the wrong dimension"], ["shape (6, 2, 3)", "dim=1"]),
    ("test_shapes_and_first_step", MISTAKES["h0 ignored"], ["the first state h_1", "non-zero h0", "h0 ignored"]),
    ("test_shapes_and_first_step", MISTAKES["states off by one"], ["states off by one"]),
    ("test_shapes_and_first_step", A.casts_to_float32, ["dtype float32", "float64"]),
    ("test_gradients_and_inputs", A.detached, ["do not require grad", ".detach()"]),
    ("test_gradients_and_inputs", MISTAKES["h_{t-1} term missing"], ["no gradient reaches h0"]),
    ("test_gradients_and_inputs", A.modifies_h0, ["in-place"]),
    ("test_random_against_torch", A.modifies_h0, ["modified its input h0 in place"]),
    ("test_random_against_torch", A.via_numpy, ["NumPy array", "torch.Tensor"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_h0_ignored_is_not_named_where_it_is_right():
    # in the worked example h0 = 0, so "h0 ignored" equals the right answer there
    text = message("test_worked_example", MISTAKES["h_{t-1} term missing"])
    assert "h_{t-1} term missing" in text and "h0 ignored" not in text, text


def test_dishonest_gradients_are_named_without_secret_values():
    from exercises.harness import recheck_failures

    def rounds_through_python(x, h0, W_xh, W_hh, b):
        # right values, but the last state goes through Python numbers: no gradient from it
        states = A.correct(x, h0, W_xh, W_hh, b)
        last = torch.tensor(states[:, -1].tolist(), dtype=states.dtype)
        return torch.cat([states[:, :-1], last.unsqueeze(1)], dim=1)

    failed = recheck_failures(EXERCISE, rounds_through_python, seed=3)
    assert set(failed) == {"test_gradients_and_inputs"}, failed
    assert "do not match what small changes of the inputs produce" in failed["test_gradients_and_inputs"]


def test_the_chapters_numbers():
    # the numbers the chapter prints (four decimals), computed by hand:
    # h_1 = tanh([1, 0] W_xh + b) = tanh([0.6, -0.4])
    states = reference.rnn_forward(*worked_example())
    assert states[0, 0].tolist() == pytest.approx([0.5370, -0.3799], abs=1e-4)
    assert states[0, 2].tolist() == pytest.approx([0.8635, 0.7763], abs=1e-4)


def torch_rnn(x, h0, W_xh, W_hh, b):
    """The same RNN computed by ``torch.nn.RNN``: its weights are the transposes of ours, its second
    bias 0. Built on the meta device and then materialised, so that it draws nothing from the global
    random generator."""
    d_in, d_h = W_xh.shape
    rnn = torch.nn.RNN(d_in, d_h, batch_first=True, nonlinearity="tanh", dtype=x.dtype, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(W_xh.T)
        rnn.weight_hh_l0.copy_(W_hh.T)
        rnn.bias_ih_l0.copy_(b)
        rnn.bias_hh_l0.zero_()
        return rnn(x, h0.unsqueeze(0))[0]  # (B, T, d_h); h0 gains a layer dimension


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_expected_states_are_torch_rnns(seed):
    """On every case of test_random_against_torch, visible and secret, the reference's states are
    torch.nn.RNN's within the comparison's tolerance."""
    from firstprinciples.grading import compare, wire

    for case in EXERCISE.cases("test_random_against_torch") + \
            EXERCISE.cases("test_random_against_torch", "secret", np.random.default_rng(seed)):
        args = [torch.from_numpy(case[n]) for n in ("x", "h0", "W_xh", "W_hh", "b")]
        ours, torchs = reference.rnn_forward(*args), torch_rnn(*args)
        assert compare.compare("states", wire.encode(torchs), wire.encode(ours), context=case["label"]) is None
