"""Every RNN check accepts right answers and rejects typical wrong ones.

Each check is run against the reference and other correct implementations
(all must pass) and against a catalogue of buggy variants: the package's named
mistakes plus wrong answers that cannot be "named" (calls torch's RNN, detached,
numpy, in-place, ...). The table says exactly which checks each variant must
fail; every check must reject at least five variants. The source material has
no RNN code, so there is no seed implementation to run here.
"""
from __future__ import annotations

import pytest
import torch

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import rnn as R
from checktable import correct_answers_test, expectations_test, naming_test, outcome, rejections_test, variants_test

CHECKS = {
    "worked": R.check_worked_example,
    "shapes": R.check_shapes_and_first_step,
    "random": R.check_random_against_torch,
    "grads": R.check_gradients_and_inputs,
}
ALL = set(CHECKS)

# The reference, unwrapped, is what a correct student would write.
correct = as_student_code(reference.rnn_forward)


# ---------------------------------------------------------------- other correct answers
def precomputed_input_projection(x, h0, W_xh, W_hh, b):
    """One product for the input terms of every step, then the loop; writes into a new tensor."""
    xw = x @ W_xh + b  # (B, T, d_h)
    out = x.new_empty(x.shape[0], x.shape[1], W_hh.shape[0])
    h = h0
    for t in range(x.shape[1]):
        h = torch.tanh(xw[:, t] + h @ W_hh)
        out[:, t] = h
    return out


def einsum_and_unbind(x, h0, W_xh, W_hh, b):
    h, states = h0, []
    for xt in x.unbind(dim=1):
        h = (torch.einsum("bi,ih->bh", xt, W_xh) + torch.einsum("bh,hk->bk", h, W_hh) + b).tanh()
        states.append(h.unsqueeze(1))
    return torch.cat(states, dim=1)


CORRECT = {"reference": correct, "precomputed input projection": precomputed_input_projection, "einsum": einsum_and_unbind}


# ---------------------------------------------------------------- wrong answers
def _torch_module(W_xh, W_hh, b):
    d_in, d_h = W_xh.shape
    rnn = torch.nn.RNN(d_in, d_h, batch_first=True, dtype=W_xh.dtype)
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(W_xh.T)
        rnn.weight_hh_l0.copy_(W_hh.T)
        rnn.bias_ih_l0.copy_(b)
        rnn.bias_hh_l0.zero_()
    return rnn


def calls_nn_rnn(x, h0, W_xh, W_hh, b):
    return _torch_module(W_xh, W_hh, b)(x, h0.unsqueeze(0))[0]


def calls_rnn_cell(x, h0, W_xh, W_hh, b):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.rnn_tanh_cell(x[:, t], h, W_xh.T, W_hh.T, b, torch.zeros_like(b))
        states.append(h)
    return torch.stack(states, dim=1)


def calls_vf_directly(x, h0, W_xh, W_hh, b):
    params = [W_xh.T, W_hh.T, b, torch.zeros_like(b)]
    return torch._VF.rnn_tanh(x, h0.unsqueeze(0), params, True, 1, 0.0, False, False, True)[0]


def calls_reference(x, h0, W_xh, W_hh, b):
    return reference.rnn_forward(x, h0, W_xh, W_hh, b)


def calls_builtin_but_hides_it(x, h0, W_xh, W_hh, b):
    try:
        calls_nn_rnn(x, h0, W_xh, W_hh, b)
    except Exception:
        pass
    return correct(x, h0, W_xh, W_hh, b)


def modifies_h0(x, h0, W_xh, W_hh, b):
    states = []
    for t in range(x.shape[1]):
        h0.copy_(torch.tanh(x[:, t] @ W_xh + h0 @ W_hh + b))  # overwrites the caller's h0
        states.append(h0.clone())
    return torch.stack(states, dim=1)


def detached(x, h0, W_xh, W_hh, b):
    return correct(*(t.detach() for t in (x, h0, W_xh, W_hh, b)))


def via_numpy(x, h0, W_xh, W_hh, b):
    return correct(*(t.detach() for t in (x, h0, W_xh, W_hh, b))).numpy()


def casts_to_float32(x, h0, W_xh, W_hh, b):
    return correct(x, h0, W_xh, W_hh, b).float()


def returns_states_and_last(x, h0, W_xh, W_hh, b):
    states = correct(x, h0, W_xh, W_hh, b)
    return states, states[:, -1]  # nn.RNN's (output, h_n), not this exercise's contract


def relu_instead_of_tanh(x, h0, W_xh, W_hh, b):
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.relu(x[:, t] @ W_xh + h @ W_hh + b)
        states.append(h)
    return torch.stack(states, dim=1)


def bias_twice(x, h0, W_xh, W_hh, b):
    # torch.nn.RNN has two biases; using b for both adds it twice.
    return correct(x, h0, W_xh, W_hh, 2 * b)


_EXAMPLE_STATES = correct(*R.worked_example(torch.float64)).tolist()


def hard_coded_example(x, h0, W_xh, W_hh, b):
    return torch.tensor(_EXAMPLE_STATES, dtype=x.dtype)  # the chapter's states, typed in


OTHER_VARIANTS = {
    # name: (function, the checks it must fail)
    "calls torch.nn.RNN": (calls_nn_rnn, ALL),
    "calls torch.rnn_tanh_cell": (calls_rnn_cell, ALL),
    "calls torch._VF.rnn_tanh": (calls_vf_directly, ALL),
    "calls the reference": (calls_reference, ALL),
    "calls the built-in and hides it": (calls_builtin_but_hides_it, ALL),
    "modifies its inputs": (modifies_h0, ALL),
    "detached": (detached, {"grads"}),
    "returns numpy": (via_numpy, ALL),
    "casts to float32": (casts_to_float32, ALL),
    "returns (states, h_T)": (returns_states_and_last, ALL),
    "relu instead of tanh": (relu_instead_of_tanh, {"worked", "shapes", "random"}),
    "bias added twice": (bias_twice, {"worked", "shapes", "random"}),
    "hard-coded worked example": (hard_coded_example, ALL - {"worked"}),
}

# Which checks each named mistake must fail.
MISTAKE_FAILS = {
    "tanh forgotten": {"worked", "shapes", "random"},
    # No gradient reaches W_hh (or h0) when the term is missing.
    "h_{t-1} term missing": ALL,
    # h0 = 0 in the worked example, where ignoring it changes nothing.
    "h0 ignored": {"shapes", "random", "grads"},
    # The first step is right; only later steps go wrong.
    "state never updated": {"worked", "random"},
    "last hidden state only": {"worked", "shapes", "random"},
    "weights transposed": {"worked", "shapes", "random"},
    "W_hh transposed": {"worked", "shapes", "random"},
    "bias added after tanh": {"worked", "shapes", "random"},
    "states stacked along the wrong dimension": {"worked", "shapes", "random"},
    "states off by one": {"worked", "shapes", "random"},
}

VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in R.MISTAKES}
VARIANTS.update(OTHER_VARIANTS)


test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, R.MISTAKES))
test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)


@pytest.mark.parametrize("name", ["random", "grads"])
def test_visible_parts_pass_the_reference(name):
    ok, err = outcome(lambda fn: CHECKS[name](fn, full=False), correct)
    assert ok, err


test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)
test_failure_names_the_mistake = naming_test(
    CHECKS,
    VARIANTS,
    [
        ("tanh forgotten", "worked"),
        ("h_{t-1} term missing", "worked"),
        ("h0 ignored", "shapes"),
        ("state never updated", "worked"),
        ("last hidden state only", "worked"),
        ("weights transposed", "worked"),
        ("weights transposed", "shapes"),
        ("W_hh transposed", "worked"),
        ("bias added after tanh", "worked"),
        ("states stacked along the wrong dimension", "worked"),
        ("states stacked along the wrong dimension", "random"),
        ("states off by one", "shapes"),
    ],
)


def test_visible_random_case_names_transposed_weights():
    # The visible part of the torch comparison has d_in == d_h, so torch's
    # transposed layout runs there and is named.
    ok, err = outcome(lambda fn: R.check_random_against_torch(fn, full=False), VARIANTS["weights transposed"][0])
    assert not ok and "weights transposed" in str(err), str(err)


def test_h0_ignored_is_not_named_where_it_is_right():
    # In the worked example h0 = 0, so "h0 ignored" equals the right answer there.
    ok, err = outcome(R.check_worked_example, VARIANTS["h_{t-1} term missing"][0])
    assert not ok and "h0 ignored" not in str(err)


def test_forbidden_call_message_is_clear():
    ok, err = outcome(R.check_worked_example, calls_nn_rnn)
    assert "torch.rnn_tanh" in str(err) and "scores 0" in str(err)


def test_worked_example_reports_the_token():
    ok, err = outcome(R.check_worked_example, VARIANTS["state never updated"][0])
    assert "h_2" in str(err) and "'cat'" in str(err), str(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_rnn_helper_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(5)
    args = R._random_case(g, 3, 7, 4, 5, dtype)
    torch.testing.assert_close(R.torch_rnn(*args), reference.rnn_forward(*args))


def test_torch_rnn_helper_leaves_the_global_generator_alone():
    state = torch.random.get_rng_state()
    R.torch_rnn(*R.worked_example())
    assert torch.equal(state, torch.random.get_rng_state())


def test_worked_example_numbers():
    # The numbers the chapter prints (four decimals), computed by hand:
    # h_1 = tanh([1, 0] W_xh + b) = tanh([0.6, -0.4]).
    states = reference.rnn_forward(*R.worked_example())
    assert states[0, 0].tolist() == pytest.approx([0.5370, -0.3799], abs=1e-4)
    assert states[0, 2].tolist() == pytest.approx([0.8635, 0.7763], abs=1e-4)
