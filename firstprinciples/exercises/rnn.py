"""rnn_forward(x, h0, W_xh, W_hh, b) -> states: the exercise's tests, declared once.

x: (B, T, d_in), h0: (B, d_h), W_xh: (d_in, d_h), W_hh: (d_h, d_h), b: (d_h,); states: (B, T, d_h),
with h_t = tanh(x_t W_xh + h_{t-1} W_hh + b). Decisions stated once:

- The expected states are the course's reference; ``tests/exercises/test_rnn.py`` shows that it
  equals ``torch.nn.RNN`` with the same weights (its weights are our transposes, its second bias 0)
  on every case of ``test_random_against_torch``, so that test compares with torch's RNN too.
- ``test_shapes_and_first_step`` grades shapes, dtypes and the first state only (from a non-zero
  h0): an answer whose later steps go wrong keeps it, and loses the tests that compare every state.
- ``test_gradients_and_inputs`` grades the answer's gradients against its own outputs, not the
  reference's: the states, whatever their values and shape, are weighted by random numbers drawn
  for their own shape (``loss_seed``), that sum is back-propagated, and its derivative along a
  random direction of the inputs must equal the central finite difference of the same sum (float64).
  So an answer with wrong values but honest gradients keeps that test; one that detaches, leaves
  torch, changes its inputs or leaves an input out of the computation does not.
- Weights of scale 1/sqrt(fan-in) keep tanh's inputs of order 1, where every mistake (a missing
  tanh, a missing term) changes the states visibly.
- Every case runs the answer with PyTorch's RNN out of reach (``nn.RNN`` and ``nn.RNNCell`` reach
  ``torch.rnn_tanh`` / ``torch.rnn_tanh_cell`` or the relu versions through ``torch._VF``) and the
  course's reference; calling either scores 0.
"""
from __future__ import annotations

import numpy as np
import torch

from ..examples.rnn import TOKENS, worked_example
from . import Exercise, Mistake, Test, case
from .adapters import FD_STEP, call_runner

NAMES = ("x", "h0", "W_xh", "W_hh", "b")
FORBIDDEN = dict(torch_patterns=("rnn_tanh", "rnn_relu", "RNN", "_VF"), pieces=("rnn_forward",),
                 what="the RNN's forward pass")

# ---------------------------------------------------------------- the adapter
_values = call_runner(NAMES, outputs=("states",))


def _fresh(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _weighted(states, seed):
    """sum(states * w), w random numbers of the states' own shape (seeded: the same in every process)."""
    g = torch.Generator().manual_seed(int(seed))
    return (states * torch.randn(tuple(states.shape), generator=g, dtype=torch.float64).to(states.dtype)).sum()


def adapter(fn, case):
    """The states and the inputs after the call; for a case holding ``loss_seed``, instead the gradient
    of the weighted sum of the states (``_weighted``) for each input (None where none reaches it), the states' type and dtype (as an
    empty tensor), the central finite difference ``fd`` of that sum along the directions ``dir_<name>``,
    and the inputs after the call."""
    if "loss_seed" not in case:
        return _values(fn, case)
    inputs = {n: _fresh(case[n]).requires_grad_(True) for n in NAMES}
    states = fn(*(inputs[n] for n in NAMES))
    if not isinstance(states, torch.Tensor):
        raise AssertionError(f"rnn_forward returned a {type(states).__name__}, not a torch.Tensor")
    if not states.requires_grad:
        raise AssertionError("the states do not require grad although the inputs do: gradients cannot flow back. "
                             "Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() "
                             "inside the function.")
    # (an input that the states do not depend on gets None: reported as such)
    grads = torch.autograd.grad(_weighted(states, case["loss_seed"]), [inputs[n] for n in NAMES], allow_unused=True)

    def moved(sign):
        with torch.no_grad():
            again = fn(*(_fresh(case[n]) + sign * FD_STEP * case[f"dir_{n}"] for n in NAMES))
        return _weighted(again, case["loss_seed"]).to(torch.float64)

    return {**{f"grad_{n}": g for n, g in zip(NAMES, grads)},
            "states (its type and dtype)": states.detach().reshape(-1)[:0],
            "fd": (moved(1.0) - moved(-1.0)) / (2 * FD_STEP),
            **{f"{n} after the call": inputs[n].detach() for n in NAMES}}


# ---------------------------------------------------------------- typical mistakes
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


VALUES = frozenset({"test_worked_example", "test_shapes_and_first_step", "test_random_against_torch"})
GRADS = frozenset({"test_gradients_and_inputs"})
MISTAKES = (
    Mistake("tanh forgotten", "h_t = tanh(x_t W_xh + h_{t-1} W_hh + b): apply torch.tanh to the sum.", _no_tanh, VALUES),
    # no gradient reaches W_hh (nor h0) when the term is missing
    Mistake("h_{t-1} term missing",
            "each step must add h_{t-1} @ W_hh, the previous state: that term is the network's memory.",
            _no_recurrence, VALUES | GRADS),
    # h0 = 0 in the worked example, where ignoring it changes nothing
    Mistake("h0 ignored", "start the recurrence from the given h0, not from zeros.", _h0_ignored,
            frozenset({"test_shapes_and_first_step", "test_random_against_torch"}) | GRADS),
    # the first step is right; only later steps go wrong
    Mistake("state never updated",
            "every step used h0 as the previous state; assign the new state to the variable the next step reads.",
            _state_never_updated, frozenset({"test_worked_example", "test_random_against_torch"})),
    Mistake("last hidden state only", "return every state h_1 ... h_T stacked into (B, T, d_h), not just h_T.",
            _last_state_only, VALUES),
    Mistake("weights transposed",
            "W_xh is (d_in, d_h) and W_hh is (d_h, d_h) here: compute x_t @ W_xh and h @ W_hh, without .T "
            "(torch.nn.RNN stores the transposes, this exercise does not).",
            _weights_transposed, VALUES),
    Mistake("W_hh transposed",
            "the recurrent term is h_{t-1} @ W_hh, not h_{t-1} @ W_hh.T (W_hh is square, so both run).",
            _W_hh_transposed, VALUES),
    Mistake("bias added after tanh", "b belongs inside the tanh: tanh(x_t W_xh + h_{t-1} W_hh + b).", _bias_after_tanh,
            VALUES),
    Mistake("states stacked along the wrong dimension",
            "the result is batch-first, (B, T, d_h): stack the states along dim=1, not dim=0.", _time_first, VALUES),
    Mistake("states off by one",
            "the output at position t is the state *after* reading x_t: return h_1 ... h_T, not h_0 ... h_{T-1}.",
            _off_by_one, VALUES),
)


# ---------------------------------------------------------------- properties (plain data)
def _shown(case) -> bool:
    return "shown" in case["tags"]


def chapter_states(case, out, want):
    """"The cat sat": each state the chapter prints (four decimals) is right to 1e-4, half a unit of
    the last decimal."""
    if "chapter" not in case["tags"]:
        return None
    got, right = out.get("states"), want["states"]
    if got is None or got.shape != right.shape or got.dtype != right.dtype:
        return None  # (the comparison says what the shape or dtype should be)
    for t, token in enumerate(TOKENS):
        for j in range(right.shape[-1]):
            g, w = float(got[0, t, j]), float(right[0, t, j])
            if not abs(g - w) <= 1e-4:
                return f"h_{t + 1}[{j}], the state after reading '{token}', is {g:.4f} but should be {w:.4f}."
    return None


def first_state(case, out, want):
    """The first state h_1 = tanh(x_1 W_xh + h0 W_hh + b) is right, within the dtype's tolerance
    (later states are graded by the other tests)."""
    from . import tolerance

    got, right = out.get("states"), want["states"]
    if got is None or got.shape != right.shape:
        return None
    g1, w1 = got[:, 0].astype(np.float64), right[:, 0].astype(np.float64)
    atol, rtol = tolerance(right.dtype.name)
    err = np.abs(g1 - w1)
    bad = ~(err <= atol + rtol * np.abs(w1))  # (NaN counts as wrong)
    if not bad.any():
        return None
    i, j = (int(v) for v in np.argwhere(bad)[0])
    what = "the first state h_1 = tanh(x_1 W_xh + h0 W_hh + b), from a non-zero h0,"
    if _shown(case):
        return (f"{what} is wrong: states[{i}, 0, {j}] = {g1[i, j]:.6g} but should be {w1[i, j]:.6g} "
                f"(tolerance atol={atol:g}, rtol={rtol:g}).")
    return f"{what} differs from the reference by up to {float(np.nanmax(err)) if np.isfinite(err).any() else err.max():.3g}."


def every_input_reached(case, out, want):
    """A gradient reaches each of the five inputs (autograd gives None for an input the states do not
    depend on)."""
    for n in NAMES:
        if f"grad_{n}" not in out:
            return f"no gradient reaches {n}: is {n} used in the computation?"
    return None


def honest_gradients(case, out, want):
    """The answer's gradients agree with its own outputs: the derivative of the weighted sum of the
    states along the case's random direction equals the central finite difference ``fd`` to 1e-6
    relative (float64, step 1e-6: truncation error about 1e-12, rounding about 1e-10)."""
    analytic = sum(float((out[f"grad_{n}"].astype(np.float64) * case[f"dir_{n}"]).sum()) for n in NAMES)
    fd = float(out["fd"])
    if np.isfinite(analytic) and abs(analytic - fd) <= 1e-6 * (1 + abs(fd)):
        return None
    return ("the gradients of your states do not match what small changes of the inputs produce (along a random "
            f"direction: {analytic:.6g} from the gradients, {fd:.6g} from the states themselves): some step breaks "
            "autograd (a detach, a round trip through NumPy or Python numbers, or an in-place change).")


# ---------------------------------------------------------------- the cases
def _inputs(rng, B, T, d_in, d_h, dtype, zero_h0=False) -> dict:
    def normal(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    return {"x": normal((B, T, d_in)), "h0": np.zeros((B, d_h), dtype) if zero_h0 else normal((B, d_h), 0.5),
            "W_xh": normal((d_in, d_h), d_in ** -0.5), "W_hh": normal((d_h, d_h), d_h ** -0.5), "b": normal((d_h,), 0.5)}


def _label(dtype, B, T, d_in, d_h, extra=""):
    return f"for B={B}, T={T}, d_in={d_in}, d_h={d_h}, {dtype}{extra}"


def _grad_case(rng, tags, B, T, d_in, d_h) -> dict:
    c = case(_label("float64", B, T, d_in, d_h, " (the gradients)"), tags, **_inputs(rng, B, T, d_in, d_h, "float64"))
    c["loss_seed"] = int(rng.integers(0, 2**31 - 1))
    for n in NAMES:
        c[f"dir_{n}"] = rng.standard_normal(c[n].shape)
    return c


def _visible() -> tuple:
    example = {n: t.numpy() for n, t in zip(NAMES, worked_example(torch.float64))}
    cases = [case('for "The cat sat" (B=1, T=3, d_in=d_h=2, h0 = 0), float64', ("worked", "chapter", "shown"), **example)]
    rng = np.random.default_rng(1)
    for dtype in ("float32", "float64"):
        # the square case first: there a transposed weight runs, and is named
        for sizes in ((1, 6, 2, 2), (2, 4, 3, 5), (3, 1, 4, 2)):
            cases.append(case(_label(dtype, *sizes), ("shapes", "shown"), **_inputs(rng, *sizes, dtype)))
    # d_in == d_h: torch.nn.RNN's transposed layout runs, and is named
    cases.append(case(_label("float32", 2, 6, 3, 3), ("random", "shown"), **_inputs(np.random.default_rng(2024), 2, 6, 3, 3, "float32")))
    # d_in == d_h, so that an answer with transposed weights still runs and is judged on its gradients alone
    cases.append(_grad_case(np.random.default_rng(11), ("grads", "shown"), 2, 3, 2, 2))
    return tuple(cases)


RANDOM_SHAPES = (  # (B, T, d_in, d_h)
    (1, 1, 1, 1),
    (2, 6, 3, 3),
    (3, 8, 4, 4),  # square W_xh: torch's transposed layout runs and is named
    (2, 5, 3, 4),
    (4, 4, 6, 3),  # B == T
    (2, 40, 8, 8),  # a longer sequence
    (5, 12, 2, 7),
)


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases: the worked example's sizes with fresh numbers (h0 = 0, as there), the
    shapes test's sizes, the random test's shapes and drawn ones (square, B == T, long) in both
    dtypes, and gradients for three shapes (d_in == d_h, float64)."""
    cases = [case(_label("float64", 1, 3, 2, 2, ", h0 = 0"), "worked", **_inputs(rng, 1, 3, 2, 2, "float64", zero_h0=True))
             for _ in range(2)]
    for dtype in ("float32", "float64"):
        for sizes in ((1, 6, 2, 2), (2, 4, 3, 5), (3, 1, 4, 2), (int(rng.integers(1, 5)), int(rng.integers(1, 9)),
                                                                  int(rng.integers(1, 7)), int(rng.integers(1, 7)))):
            cases.append(case(_label(dtype, *sizes), "shapes", **_inputs(rng, *sizes, dtype)))
    for dtype in ("float32", "float64"):
        d, t = int(rng.integers(1, 6)), int(rng.integers(2, 6))
        drawn = [(int(rng.integers(1, 4)), int(rng.integers(2, 9)), d, d), (t, t, int(rng.integers(2, 7)), int(rng.integers(2, 7))),
                 (2, int(rng.integers(20, 41)), int(rng.integers(2, 9)), int(rng.integers(2, 9)))]
        for sizes in (*RANDOM_SHAPES, *drawn):
            cases.append(case(_label(dtype, *sizes), "random", **_inputs(rng, *sizes, dtype)))
    d = int(rng.integers(2, 6))
    for sizes in ((2, 3, 2, 2), (1, 5, 3, 3), (int(rng.integers(1, 4)), int(rng.integers(2, 7)), d, d)):
        cases.append(_grad_case(rng, "grads", *sizes))
    return cases


EXERCISE = Exercise(
    name="rnn",
    piece="rnn_forward",
    call="rnn_forward(x, h0, W_xh, W_hh, b)",
    adapter=adapter,
    reference="firstprinciples.reference:rnn_forward",
    names={**{f"grad_{n}": f"the gradient of the weighted states with respect to {n}" for n in NAMES},
           "states (its type and dtype)": "states", "fd": "the finite difference"},
    visible=_visible(),
    secret=secret,
    tests={
        "test_worked_example": Test(2, frozenset({"worked"}), first=(chapter_states,)),
        "test_shapes_and_first_step": Test(2, frozenset({"shapes"}), then=(first_state,), values=False),
        "test_random_against_torch": Test(3, frozenset({"random"})),
        "test_gradients_and_inputs": Test(2, frozenset({"grads"}), first=(every_input_reached,), then=(honest_gradients,),
                                          values=False),
    },
    forbidden=FORBIDDEN,
    mistakes=MISTAKES,
    hints=(
        ("cannot be multiplied", "x[:, t] is (B, d_in) and multiplies W_xh (d_in, d_h) from the right, h (B, d_h) "
                                 "multiplies W_hh (d_h, d_h): check which slice of x you take and that no weight is "
                                 "transposed."),
        ("must match the size", "Each step's terms are (B, d_h): check the slice x[:, t] (one token of every "
                                "sequence) and the shape of h0."),
    ),
)
