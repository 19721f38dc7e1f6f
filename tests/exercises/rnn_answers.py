"""rnn: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes: unusual correct answers, which must pass everywhere, and wrong answers that no mistake
names (PyTorch's RNN called, a wrong type or dtype, an input changed, values wrong but gradients
honest), each with the test cells it fails in the notebook (its visible cases) and in the trusted
re-check (the secret ones)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course import as_student_code
from firstprinciples import reference
from firstprinciples.examples.rnn import worked_example

correct = as_student_code(reference.rnn_forward)  # what a correct student writes


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


def recursive(x, h0, W_xh, W_hh, b):
    # the states of the first t tokens, then one more step: no loop
    if x.shape[1] == 0:
        return x.new_zeros(x.shape[0], 0, W_hh.shape[0])
    before = recursive(x[:, :-1], h0, W_xh, W_hh, b)
    h = before[:, -1] if before.shape[1] else h0
    return torch.cat([before, torch.tanh(x[:, -1] @ W_xh + h @ W_hh + b).unsqueeze(1)], dim=1)


def addmm_steps(x, h0, W_xh, W_hh, b):
    # b + x_t W_xh, then + h W_hh, each by torch.addmm
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.addmm(torch.addmm(b, x[:, t], W_xh), h, W_hh).tanh()
        states.append(h)
    return torch.stack(states, dim=1)


def time_major(x, h0, W_xh, W_hh, b):
    # time first, as torch.nn.RNN without batch_first, and back
    h, states = h0, []
    for xt in x.transpose(0, 1):  # (B, d_in) per step
        h = torch.tanh(xt @ W_xh + h @ W_hh + b)
        states.append(h)
    return torch.stack(states).transpose(0, 1)


def linear_with_transposes(x, h0, W_xh, W_hh, b):
    # F.linear(v, W) computes v @ W.T + bias: hand it the transposes
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(F.linear(x[:, t], W_xh.T, b) + F.linear(h, W_hh.T))
        states.append(h)
    return torch.stack(states, dim=1)


CORRECT = {"reference": correct, "precomputed input projection": precomputed_input_projection,
           "einsum": einsum_and_unbind, "recursive": recursive, "addmm": addmm_steps, "time-major": time_major,
           "F.linear with transposes": linear_with_transposes}


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


_EXAMPLE_STATES = correct(*worked_example(torch.float64)).tolist()


def hard_coded_example(x, h0, W_xh, W_hh, b):
    return torch.tensor(_EXAMPLE_STATES, dtype=x.dtype)  # the chapter's states, typed in


def later_states_off(x, h0, W_xh, W_hh, b):
    # the first state right, every later one scaled by 0.9
    h, states = h0, []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ W_xh + h @ W_hh + b) * (1.0 if t == 0 else 0.9)
        states.append(h)
    return torch.stack(states, dim=1)


def doubled(x, h0, W_xh, W_hh, b):
    # wrong values, honest gradients (of the doubled states)
    return 2 * einsum_and_unbind(x, h0, W_xh, W_hh, b)


ALL = {"test_worked_example", "test_shapes_and_first_step", "test_random_against_torch", "test_gradients_and_inputs"}
VALUES = ALL - {"test_gradients_and_inputs"}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
WRONG = {
    "calls torch.nn.RNN": (calls_nn_rnn, ALL, ALL),
    "calls torch.rnn_tanh_cell": (calls_rnn_cell, ALL, ALL),
    "calls torch._VF.rnn_tanh": (calls_vf_directly, ALL, ALL),
    "calls the reference": (calls_reference, ALL, ALL),
    "calls the built-in and hides it": (calls_builtin_but_hides_it, ALL, ALL),
    "modifies its inputs": (modifies_h0, ALL, ALL),
    "detached": (detached, {"test_gradients_and_inputs"}, {"test_gradients_and_inputs"}),
    "returns numpy": (via_numpy, ALL, ALL),
    # (the notebook's random case is float32; the re-check's are float64 too)
    "casts to float32": (casts_to_float32, ALL - {"test_random_against_torch"}, ALL),
    "returns (states, h_T)": (returns_states_and_last, ALL, ALL),
    "relu instead of tanh": (relu_instead_of_tanh, VALUES, VALUES),
    "bias added twice": (bias_twice, VALUES, VALUES),
    # the re-check draws fresh numbers of the worked example's sizes: a typed-in result earns nothing there
    "hard-coded worked example": (hard_coded_example, ALL - {"test_worked_example"}, ALL),
    # test_shapes_and_first_step compares shapes and the first state only
    "later states off": (later_states_off, {"test_worked_example", "test_random_against_torch"},
                         {"test_worked_example", "test_random_against_torch"}),
    # test_gradients_and_inputs compares the gradients with the answer's own states
    "doubled states": (doubled, VALUES, VALUES),
}
