"""Probe for ``rnn_forward(x, h0, W_xh, W_hh, b) -> states``.

Tags name the test cell each case stands for: ``worked`` (the worked example's
sizes, h0 = 0 as there, fresh numbers), ``shapes`` (the shapes test: shapes,
dtypes and the first state from a non-zero h0 only), ``random`` (everything
against the reference), ``grads`` (honest gradients, d_in == d_h as in the check).
"""
from __future__ import annotations

import numpy as np

from ...checks import rnn as rnn_checks
from ...reference import rnn_forward
from . import Probe, arrays, aspect, honest_gradients, normal, register
from ...exercises.adapters import grad_case, runner

NAMES = ("x", "h0", "W_xh", "W_hh", "b")


def _case(rng, B, T, d_in, d_h, dtype, zero_h0=False):
    """As the checks' ``_random_case``: weights of scale 1/sqrt(fan-in) keep tanh's inputs of order 1."""
    h0 = np.zeros((B, d_h), dtype) if zero_h0 else normal(rng, (B, d_h), dtype, 0.5)
    return {"x": normal(rng, (B, T, d_in), dtype), "h0": h0,
            "W_xh": normal(rng, (d_in, d_h), dtype, d_in ** -0.5), "W_hh": normal(rng, (d_h, d_h), dtype, d_h ** -0.5),
            "b": normal(rng, (d_h,), dtype, 0.5)}


def _label(dtype, B, T, d_in, d_h, extra=""):
    return f"{dtype} inputs with B={B}, T={T}, d_in={d_in}, d_h={d_h}{extra}"


def cases(rng: np.random.Generator) -> list:
    out = []
    # the worked example's sizes (B=1, T=3, d_in=d_h=2, h0 = 0), fresh numbers
    for _ in range(2):
        out.append({"label": _label("float64", 1, 3, 2, 2, ", h0 = 0"), "tags": ("worked",),
                    **_case(rng, 1, 3, 2, 2, "float64", zero_h0=True)})
    # the shapes test's sizes (the square one first), a non-zero h0, both dtypes
    for dtype in ("float32", "float64"):
        for sizes in ((1, 6, 2, 2), (2, 4, 3, 5), (3, 1, 4, 2)):
            out.append({"label": _label(dtype, *sizes), "tags": ("shapes",), **_case(rng, *sizes, dtype)})
    # against the reference: one square, one B == T, one long, two random; both dtypes
    for dtype in ("float32", "float64"):
        d = int(rng.integers(1, 6))
        t = int(rng.integers(2, 6))
        drawn = [(int(rng.integers(1, 4)), int(rng.integers(2, 9)), d, d), (t, t, int(rng.integers(2, 7)), int(rng.integers(2, 7))),
                 (2, int(rng.integers(20, 41)), int(rng.integers(2, 9)), int(rng.integers(2, 9)))]
        drawn += [tuple(int(v) for v in (rng.integers(1, 5), rng.integers(1, 13), rng.integers(1, 8), rng.integers(1, 8)))
                  for _ in range(2)]
        for sizes in drawn:
            out.append({"label": _label(dtype, *sizes), "tags": ("random",), **_case(rng, *sizes, dtype)})
    # gradients: d_in == d_h (as the check: transposed weights still run), float64
    for sizes in ((2, 3, 2, 2), (1, 5, 3, 3)):
        case = {"label": "the gradients for " + _label("float64", *sizes), "tags": ("grads",), **_case(rng, *sizes, "float64")}
        out.append(grad_case(rng, case, NAMES))
    return out


def first_state(case, got, want):
    """The shapes test: the first state h_1 = tanh(x_1 W_xh + h0 W_hh + b) is right (later
    states are graded by the other tests)."""
    g, w = arrays(got)["states"], arrays(want)["states"]
    g1, w1 = g[:, 0].astype(np.float64), w[:, 0].astype(np.float64)
    atol, rtol = (1e-10, 1e-8) if w.dtype == np.float64 else (1e-5, 1e-4)
    if not np.array_equal(np.isfinite(g1), np.isfinite(w1)) or np.any(np.abs(g1 - w1) > atol + rtol * np.abs(w1)):
        return (f"the first state states[:, 0] differs from tanh(x_1 W_xh + h0 W_hh + b) by up to "
                f"{float(np.nanmax(np.abs(g1 - w1))):.3g}")
    return None


CELLS = {
    "test_worked_example": aspect("worked"),
    "test_shapes_and_first_step": aspect("shapes", mode="structure", also=first_state),
    "test_random_against_torch": aspect("random"),
    "test_gradients_and_inputs": aspect("grads", mode="structure", also=honest_gradients),
}

register(Probe("rnn_forward", cases, runner(NAMES, outputs=("states",), grad=NAMES), reference=rnn_forward,
               forbidden=rnn_checks.FORBIDDEN, cells=CELLS))
