"""Probes for ``scaled_dot_product_attention`` (softmax is declared: ``firstprinciples.exercises``).

Each case carries tags naming the test cell it stands for, so that a test of
one property (shapes, masks, gradients) is re-checked on that property only.
"""
from __future__ import annotations

import numpy as np

from ...checks import attention as attention_checks
from ...reference import scaled_dot_product_attention
from . import Probe, arrays, aspect, call_runner, honest_gradients, normal, register, with_directions


# ---------------------------------------------------------------- attention
def _qkv(rng, batch, tq, tk, dk, dv, dtype, scale=1.0):
    return {"Q": normal(rng, (*batch, tq, dk), dtype, scale), "K": normal(rng, (*batch, tk, dk), dtype, scale),
            "V": normal(rng, (*batch, tk, dv), dtype)}


def _label(dtype, batch, tq, tk, dk, dv, extra=""):
    return f"{dtype} Q {(*batch, tq, dk)}, K {(*batch, tk, dk)}, V {(*batch, tk, dv)}{extra}"


def attention_cases(rng: np.random.Generator) -> list:
    cases = []
    # the worked example's sizes: three tokens of width 2
    cases.append({"label": _label("float64", (), 3, 3, 2, 2), "tags": ("small",), **_qkv(rng, (), 3, 3, 2, 2, "float64")})
    cases.append({"label": _label("float64", (), 1, 3, 2, 2), "tags": ("small",), **_qkv(rng, (), 1, 3, 2, 2, "float64")})
    # leading batch and head dimensions, T_q != T_k, d_v != d_k
    for dtype in ("float32", "float64"):
        for batch, tq, tk, dk, dv in (((), 4, 4, 8, 8), ((2,), 3, 5, 4, 6), ((2, 3), 5, 2, 8, 3)):
            cases.append({"label": _label(dtype, batch, tq, tk, dk, dv), "tags": ("batched",),
                          **_qkv(rng, batch, tq, tk, dk, dv, dtype)})
    # random inputs against the reference, also large scores
    for dtype, batch, tq, tk, dk, dv, scale in (("float32", (2,), 5, 5, 8, 4, 1.0), ("float64", (1, 2), 4, 6, 16, 8, 1.0),
                                                ("float32", (2,), 4, 4, 8, 8, 10.0), ("float64", (2,), 3, 5, 8, 4, 40.0)):
        cases.append({"label": _label(dtype, batch, tq, tk, dk, dv, f", entries of scale {scale:g}"), "tags": ("random",),
                      **_qkv(rng, batch, tq, tk, dk, dv, dtype, scale)})
    # masks: causal, padding, arbitrary additive (never a whole row masked)
    for dtype, batch, t, dk, dv in (("float64", (), 3, 2, 2), ("float32", (2, 2), 6, 4, 3)):
        case = {"label": _label(dtype, batch, t, t, dk, dv, " with a causal mask"), "tags": ("mask",),
                **_qkv(rng, batch, t, t, dk, dv, dtype)}
        case["mask"] = np.triu(np.full((t, t), -np.inf), k=1).astype(dtype)
        cases.append(case)
    pad = np.zeros((2, 1, 1, 5), "float64")
    pad[0, ..., 3:] = -np.inf
    cases.append({"label": _label("float64", (2, 2), 4, 5, 4, 4, " with a padding mask"), "tags": ("mask",),
                  **_qkv(rng, (2, 2), 4, 5, 4, 4, "float64"), "mask": pad})
    mask = normal(rng, (4, 6), "float32")
    hide = rng.random((4, 6)) < 0.3
    hide[:, int(rng.integers(0, 6))] = False
    mask[hide] = -np.inf
    cases.append({"label": _label("float32", (2,), 4, 6, 4, 5, " with an additive mask"), "tags": ("mask",),
                  **_qkv(rng, (2,), 4, 6, 4, 5, "float32"), "mask": mask})
    # gradients (float64, for finite differences), with and without a mask
    for masked in (False, True):
        case = {"label": _label("float64", (2,), 4, 4, 3, 2, " with a causal mask" if masked else ""), "tags": ("grad",),
                **_qkv(rng, (2,), 4, 4, 3, 2, "float64")}
        if masked:
            case["mask"] = np.triu(np.full((4, 4), -np.inf), k=1)
        case["grad_out"] = normal(rng, (2, 4, 2), "float64")
        cases.append(with_directions(rng, case, ("Q", "K", "V")))
    return cases


def rows_are_distributions(case, got, want):
    """The batched-shapes test: the weights are finite, non-negative and each row sums to 1
    (to 1e-5: float32 sums of a few terms are exact to about 1e-6)."""
    w = arrays(got)["weights"].astype(np.float64)
    if not np.isfinite(w).all() or (w < 0).any():
        return "the weights should all be finite and non-negative"
    worst = float(np.abs(w.sum(-1) - 1).max()) if w.size else 0.0
    return None if worst <= 1e-5 else f"a row of the weights sums to 1 {'+-'} {worst:.3g}, not 1"


ATTENTION_CELLS = {
    "test_worked_example": aspect("small"),
    "test_scaled_dot_product_attention": aspect("small"),  # the later notebooks' 1-point recap test
    "test_batched_shapes": aspect("batched", mode="structure", also=rows_are_distributions),
    "test_masks": aspect("mask"),
    "test_random_against_torch": aspect("random"),
    "test_gradients_and_inputs": aspect("grad", mode="structure", also=honest_gradients),
}

register(
    Probe("scaled_dot_product_attention", attention_cases,
          call_runner(("Q", "K", "V"), ("mask",), outputs=("output", "weights"), grad=("Q", "K", "V")),
          reference=scaled_dot_product_attention, forbidden=attention_checks.FORBIDDEN, cells=ATTENTION_CELLS),
)
