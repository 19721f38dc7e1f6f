"""Checks for ``rnn_forward(x, h0, W_xh, W_hh, b) -> states``.

x: (B, T, d_in), h0: (B, d_h), W_xh: (d_in, d_h), W_hh: (d_h, d_h), b: (d_h,);
states: (B, T, d_h), with h_t = tanh(x_t W_xh + h_{t-1} W_hh + b).

Visible checks: the three-step worked example of the chapter, shapes and the
first step from a non-zero h0. Hidden checks: seeded random inputs against
``torch.nn.RNN`` and the reference, gradients and untouched inputs. Every check
runs the answer under ``call_answer`` so that an answer which calls PyTorch's
RNN (``nn.RNN``, ``nn.RNNCell``, ``torch.rnn_tanh``, ...) or the course's
reference scores 0.
"""
from __future__ import annotations

import torch

from ..examples.rnn import TOKENS, worked_example
from ..guard import call_without
from ..reference import rnn_forward as reference
from ._student import wrap_checks
from ._core import Mistake, assert_gradcheck, assert_matches, call_answer, unpack, with_diagnosis

FORBIDDEN = dict(
    # nn.RNN and nn.RNNCell reach torch.rnn_tanh / torch.rnn_tanh_cell (or the
    # relu versions) through torch._VF; the torch function mode sees those names.
    torch_patterns=("rnn_tanh", "rnn_relu", "RNN", "_VF"),
    pieces=("rnn_forward",),
    what="the RNN's forward pass",
)

# ---------------------------------------------------------------- mistakes
def _loop(x, h0, step, keep_h0=False):
    h, states = h0, []
    for t in range(x.shape[1]):
        if keep_h0:
            states.append(h)
        h = step(x[:, t], h)
        if not keep_h0:
            states.append(h)
    return states


def _no_tanh(x, h0, W_xh, W_hh, b):
    return torch.stack(_loop(x, h0, lambda xt, h: xt @ W_xh + h @ W_hh + b), dim=1)


def _no_recurrence(x, h0, W_xh, W_hh, b):
    return torch.stack(_loop(x, h0, lambda xt, h: torch.tanh(xt @ W_xh + b)), dim=1)


def _states(x, h0, W_xh, W_hh, b):
    """The right recurrence, for the mistakes built on it (written here, not taken from the
    reference: the trusted re-check counts a call of the reference's own code as using it)."""
    return torch.stack(_loop(x, h0, lambda xt, h: torch.tanh(xt @ W_xh + h @ W_hh + b)), dim=1)


def _h0_ignored(x, h0, W_xh, W_hh, b):
    return _states(x, torch.zeros_like(h0), W_xh, W_hh, b)


def _state_never_updated(x, h0, W_xh, W_hh, b):
    return torch.stack([torch.tanh(x[:, t] @ W_xh + h0 @ W_hh + b) for t in range(x.shape[1])], dim=1)


def _last_state_only(x, h0, W_xh, W_hh, b):
    return _states(x, h0, W_xh, W_hh, b)[:, -1]


def _weights_transposed(x, h0, W_xh, W_hh, b):
    # torch.nn.RNN's layout (weight_ih is (d_h, d_in)); runs only when d_in == d_h.
    return torch.stack(_loop(x, h0, lambda xt, h: torch.tanh(xt @ W_xh.T + h @ W_hh.T + b)), dim=1)


def _W_hh_transposed(x, h0, W_xh, W_hh, b):
    return torch.stack(_loop(x, h0, lambda xt, h: torch.tanh(xt @ W_xh + h @ W_hh.T + b)), dim=1)


def _bias_after_tanh(x, h0, W_xh, W_hh, b):
    return torch.stack(_loop(x, h0, lambda xt, h: torch.tanh(xt @ W_xh + h @ W_hh) + b), dim=1)


def _time_first(x, h0, W_xh, W_hh, b):
    return _states(x, h0, W_xh, W_hh, b).transpose(0, 1)


def _off_by_one(x, h0, W_xh, W_hh, b):
    return torch.stack(_loop(x, h0, lambda xt, h: torch.tanh(xt @ W_xh + h @ W_hh + b), keep_h0=True), dim=1)


MISTAKES = (
    Mistake("tanh forgotten", "h_t = tanh(x_t W_xh + h_{t-1} W_hh + b): apply torch.tanh to the sum.", _no_tanh),
    Mistake(
        "h_{t-1} term missing",
        "each step must add h_{t-1} @ W_hh, the previous state: that term is the network's memory.",
        _no_recurrence,
    ),
    Mistake("h0 ignored", "start the recurrence from the given h0, not from zeros.", _h0_ignored),
    Mistake(
        "state never updated",
        "every step used h0 as the previous state; assign the new state to the variable the next step reads.",
        _state_never_updated,
    ),
    Mistake(
        "last hidden state only",
        "return every state h_1 ... h_T stacked into (B, T, d_h), not just h_T.",
        _last_state_only,
    ),
    Mistake(
        "weights transposed",
        "W_xh is (d_in, d_h) and W_hh is (d_h, d_h) here: compute x_t @ W_xh and h @ W_hh, without .T "
        "(torch.nn.RNN stores the transposes, this exercise does not).",
        _weights_transposed,
    ),
    Mistake(
        "W_hh transposed",
        "the recurrent term is h_{t-1} @ W_hh, not h_{t-1} @ W_hh.T (W_hh is square, so both run).",
        _W_hh_transposed,
    ),
    Mistake("bias added after tanh", "b belongs inside the tanh: tanh(x_t W_xh + h_{t-1} W_hh + b).", _bias_after_tanh),
    Mistake(
        "states stacked along the wrong dimension",
        "the result is batch-first, (B, T, d_h): stack the states along dim=1, not dim=0.",
        _time_first,
    ),
    Mistake(
        "states off by one",
        "the output at position t is the state *after* reading x_t: return h_1 ... h_T, not h_0 ... h_{T-1}.",
        _off_by_one,
    ),
)


# ---------------------------------------------------------------- helpers
def _run(fn, x, h0, W_xh, W_hh, b):
    """Call the answer on copies of the inputs; return its states."""
    return call_answer(fn, (x, h0, W_xh, W_hh, b), names=("states",), forbidden=FORBIDDEN)[0]


def torch_rnn(x, h0, W_xh, W_hh, b):
    """The same RNN computed by ``torch.nn.RNN``: its weights are the transposes of ours.

    Built on the meta device and then materialised, so it does not draw from
    the global random generator for an initialisation that is overwritten anyway.
    """
    d_in, d_h = W_xh.shape
    rnn = torch.nn.RNN(d_in, d_h, batch_first=True, nonlinearity="tanh", dtype=x.dtype, device="meta")
    rnn = rnn.to_empty(device=x.device)
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(W_xh.T)
        rnn.weight_hh_l0.copy_(W_hh.T)
        rnn.bias_ih_l0.copy_(b)
        rnn.bias_hh_l0.zero_()
        out, _ = rnn(x, h0.unsqueeze(0))  # (B, T, d_h); h0 gains a layer dimension
    return out


def _label(x, W_hh):
    B, T, d_in = x.shape
    return f"for B={B}, T={T}, d_in={d_in}, d_h={W_hh.shape[0]}, {str(x.dtype).replace('torch.', '')}"


def _random_case(g, B, T, d_in, d_h, dtype):
    # Weights of scale 1/sqrt(fan-in) keep tanh's inputs of order 1, where
    # every mistake (a missing tanh, a missing term) changes the states visibly.
    x = torch.randn(B, T, d_in, generator=g, dtype=dtype)
    h0 = 0.5 * torch.randn(B, d_h, generator=g, dtype=dtype)
    W_xh = torch.randn(d_in, d_h, generator=g, dtype=dtype) / d_in**0.5
    W_hh = torch.randn(d_h, d_h, generator=g, dtype=dtype) / d_h**0.5
    b = 0.5 * torch.randn(d_h, generator=g, dtype=dtype)
    return x, h0, W_xh, W_hh, b


def _compare(fn, args, *, against_torch=False, label=""):
    states = _run(fn, *args)
    expected = reference(*args)

    def check():
        assert_matches("states", states, expected, context=label)
        if against_torch:
            assert_matches("states", states, torch_rnn(*args), context=label + " (against torch.nn.RNN)")

    with_diagnosis(check, (states,), args, MISTAKES, reference)
    return states


def _expect_shape(states, shape, dtype, label):
    if tuple(states.shape) != shape:
        raise AssertionError(f"states {label} has shape {tuple(states.shape)}, expected (B, T, d_h) = {shape}.")
    if states.dtype != dtype:
        raise AssertionError(f"states {label} has dtype {states.dtype}; keep the input's dtype {dtype}.")


# ---------------------------------------------------------------- visible
def check_worked_example(fn):
    """"The cat sat": the three hidden states of the chapter, entry by entry."""
    args = worked_example(torch.float64)
    states = _run(fn, *args)
    expected = reference(*args)  # (1, 3, 2)

    def check():
        _expect_shape(states, (1, 3, 2), torch.float64, "in the worked example (B=1, T=3, d_h=2)")
        for t, tok in enumerate(TOKENS):
            for j in range(2):
                got, want = states[0, t, j].item(), expected[0, t, j].item()
                # The chapter prints four decimals; 1e-4 is half a unit of the last one.
                assert abs(got - want) <= 1e-4, (
                    f"h_{t + 1}[{j}], the state after reading '{tok}', is {got:.4f} but should be {want:.4f}."
                )
        assert_matches("states", states, expected, context="in the worked example")

    with_diagnosis(check, (states,), args, MISTAKES, reference)


def check_shapes_and_first_step(fn):
    """Batch-first shapes for several (B, T, d_in, d_h), both float dtypes, and the
    first state computed from a non-zero h0: h_1 = tanh(x_1 W_xh + h0 W_hh + b).

    Later steps are compared in the other checks, so an answer whose first
    step and shapes are right earns this one on its own.
    """
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        # The square case comes first: there a transposed weight runs, and is named.
        for B, T, d_in, d_h in [(1, 6, 2, 2), (2, 4, 3, 5), (3, 1, 4, 2)]:
            args = _random_case(g, B, T, d_in, d_h, dtype)
            x, h0, W_xh, W_hh, b = args
            label = _label(x, W_hh)
            states = _run(fn, *args)
            first = torch.tanh(x[:, 0] @ W_xh + h0 @ W_hh + b)  # (B, d_h)

            def check():
                _expect_shape(states, (B, T, d_h), dtype, label)
                assert_matches(
                    "states[:, 0]", states[:, 0], first,
                    context=f"(h_1 = tanh(x_1 W_xh + h0 W_hh + b), from a non-zero h0) {label}",
                )

            with_diagnosis(check, (states,), args, MISTAKES, reference)


# ---------------------------------------------------------------- hidden
HIDDEN_SHAPES = [
    # (B, T, d_in, d_h)
    (1, 1, 1, 1),
    (3, 8, 4, 4),  # square W_xh: torch's transposed layout runs and is named
    (2, 5, 3, 4),
    (4, 4, 6, 3),  # B == T
    (2, 40, 8, 8),  # a longer sequence
    (5, 12, 2, 7),
]


def check_random_against_torch(fn, full=True):
    """Seeded random inputs against ``torch.nn.RNN`` (same weights) and the reference.

    ``full=False`` runs one float32 case with d_in == d_h (the visible part of the test).
    """
    g = torch.Generator().manual_seed(2024)
    if not full:
        args = _random_case(g, 2, 6, 3, 3, torch.float32)
        _compare(fn, args, against_torch=True, label=_label(args[0], args[3]))
        return
    for dtype in (torch.float32, torch.float64):
        for B, T, d_in, d_h in HIDDEN_SHAPES:
            args = _random_case(g, B, T, d_in, d_h, dtype)
            _compare(fn, args, against_torch=True, label=_label(args[0], args[3]))


def check_gradients_and_inputs(fn, full=True):
    """Gradients flow back to x, h0, W_xh, W_hh and b, and the inputs are left untouched.

    Compares the answer's own autograd gradients with finite differences of the
    answer itself (``assert_gradcheck``, float64): an answer with wrong
    values but honest gradients passes; one that detaches, leaves torch or
    modifies its inputs does not. ``full=False`` runs the smallest case only.
    """
    g = torch.Generator().manual_seed(11)
    # d_in == d_h, so that an answer with transposed weights still runs and is
    # judged here on its gradients alone.
    shapes = [(2, 3, 2, 2), (1, 5, 3, 3)] if full else [(2, 3, 2, 2)]
    names = ("x", "h0", "W_xh", "W_hh", "b")
    for B, T, d_in, d_h in shapes:
        args = _random_case(g, B, T, d_in, d_h, torch.float64)
        _run(fn, *args)  # also checks that the inputs are untouched
        leaves = [t.clone().requires_grad_(True) for t in args]
        (states,) = unpack(call_without(fn, leaves, **FORBIDDEN), ("states",))
        if not states.requires_grad:
            raise AssertionError(
                "The states do not require grad although the inputs do: gradients cannot flow back. "
                "Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() "
                "inside the function."
            )
        grads = torch.autograd.grad(states.sum(), leaves, allow_unused=True)
        for name, gr in zip(names, grads):
            if gr is None:
                raise AssertionError(f"No gradient reaches {name}: is {name} used in the computation?")

        def states_only(*inputs):
            return unpack(call_without(fn, inputs, **FORBIDDEN), ("states",))[0]

        assert_gradcheck(states_only, tuple(leaves), what="your states with respect to the inputs")


__all__ = [
    "FORBIDDEN",
    "MISTAKES",
    "check_gradients_and_inputs",
    "check_random_against_torch",
    "check_shapes_and_first_step",
    "check_worked_example",
    "torch_rnn",
    "worked_example",
]


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
