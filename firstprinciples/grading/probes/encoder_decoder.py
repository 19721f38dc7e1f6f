"""Probe for ``cross_attention(x, context, W_q, W_k, W_v, mask=None) -> (output, weights)``.

(``scaled_dot_product_attention``, which the notebook re-tests in a 1-point
cell, is declared: ``firstprinciples.exercises.attention``.)

Tags name the test cell each case stands for: ``worked`` (the worked example's
sizes, d_model = d_k as there, fresh numbers), ``shapes`` (type, dtype and shape
only, with rows of weights that are distributions), ``roles`` (x and context of
equal shapes, against the reference), ``torch`` (more shapes, d_model != d_k, and
scores large enough that an unshifted exp overflows), ``padding`` (padding and
additive masks; masked positions get exactly zero weight), ``grads`` (honest
gradients of the output).
"""
from __future__ import annotations

import math

import numpy as np

from ...checks import encoder_decoder as checks
from ...reference import cross_attention
from . import Probe, arrays, aspect, honest_gradients, normal, register
from ...exercises.adapters import grad_case, runner

NAMES = ("x", "context", "W_q", "W_k", "W_v")


def rows_are_distributions(case, got, want):
    """The shapes test: the weights are finite, non-negative and each row sums to 1
    (to 1e-5: float32 sums of a few terms are exact to about 1e-6)."""
    w = arrays(got)["weights"].astype(np.float64)
    if not np.isfinite(w).all() or (w < 0).any():
        return "the weights should all be finite and non-negative"
    worst = float(np.abs(w.sum(-1) - 1).max()) if w.size else 0.0
    return None if worst <= 1e-5 else f"a row of the weights sums to 1 {'+-'} {worst:.3g}, not 1"


def _case(rng, B, T_q, T_k, d_model, d_ctx, d_k, d_v, dtype):
    """As the checks' ``_random_case``."""
    return {"x": normal(rng, (B, T_q, d_model), dtype), "context": normal(rng, (B, T_k, d_ctx), dtype),
            "W_q": normal(rng, (d_model, d_k), dtype, d_model ** -0.5),
            "W_k": normal(rng, (d_ctx, d_k), dtype, d_ctx ** -0.5),
            "W_v": normal(rng, (d_ctx, d_v), dtype, d_ctx ** -0.5)}


def _label(dtype, B, T_q, T_k, d_model, d_ctx, d_k, d_v, extra=""):
    return (f"{dtype} x {(B, T_q, d_model)}, context {(B, T_k, d_ctx)}, W_q {(d_model, d_k)}, "
            f"W_k {(d_ctx, d_k)}, W_v {(d_ctx, d_v)}{extra}")


def _large(rng, sizes, dtype, top):
    """x and context scaled so that the largest score is ``top`` (an unshifted exp overflows)."""
    case = _case(rng, *sizes, dtype)
    scores = (case["x"].astype(np.float64) @ case["W_q"]) @ (case["context"].astype(np.float64) @ case["W_k"]).swapaxes(-1, -2)
    scale = math.sqrt(top / max(float(scores.max()) / math.sqrt(sizes[5]), 1e-3))
    case["x"] = (case["x"] * scale).astype(dtype)
    case["context"] = (case["context"] * scale).astype(dtype)
    return case


def cases(rng: np.random.Generator) -> list:
    out = []
    # the worked example's sizes: 2 queries of width 2 over 3 context tokens of width 4, d_k = d_v = 2
    for _ in range(2):
        sizes = (1, 2, 3, 2, 4, 2, 2)
        out.append({"label": _label("float64", *sizes), "tags": ("worked",), **_case(rng, *sizes, "float64")})
    # the shapes test's sizes, both dtypes
    for dtype in ("float32", "float64"):
        for sizes in ((1, 2, 5, 4, 4, 4, 4), (2, 4, 3, 6, 10, 8, 5), (3, 1, 7, 8, 8, 4, 4), (2, 6, 2, 4, 12, 6, 3)):
            out.append({"label": _label(dtype, *sizes), "tags": ("shapes",), **_case(rng, *sizes, dtype)})
    # roles: x and context of the same shape (every mix-up runs), float64
    for B, T, d in ((2, 5, 6), (int(rng.integers(1, 4)), int(rng.integers(2, 7)), int(rng.integers(2, 7)))):
        sizes = (B, T, T, d, d, d, d)
        out.append({"label": _label("float64", *sizes), "tags": ("roles",), **_case(rng, *sizes, "float64")})
    # against torch: more shapes (d_model != d_k among them), both dtypes, and large scores
    for dtype in ("float32", "float64"):
        for sizes in ((1, 1, 1, 2, 2, 2, 2), (2, 4, 6, 8, 8, 8, 8), (3, 7, 3, 8, 5, 8, 8), (2, 3, 9, 6, 12, 4, 10)):
            out.append({"label": _label(dtype, *sizes), "tags": ("torch",), **_case(rng, *sizes, dtype)})
        sizes = (2, 3, 4, 8, 8, 8, 8)
        top = 120.0 if dtype == "float32" else 800.0  # exp overflows above 88.7 (float32) and 709.8 (float64)
        out.append({"label": _label(dtype, *sizes, f", scores up to {top:g}"), "tags": ("torch",),
                    **_large(rng, sizes, dtype, top)})
    # padding masks (B, 1, T_k) and an additive (T_q, T_k) mask, both dtypes
    for dtype in ("float64", "float32"):
        sizes = (2, 3, 5, 8, 8, 8, 8)
        pad = np.zeros((2, 1, 5), dtype)
        pad[1, :, 3:] = -np.inf  # the second context has 2 padding tokens
        pad[0, :, int(rng.integers(2, 5)):] = -np.inf
        out.append({"label": _label(dtype, *sizes, ", a padding mask (2, 1, 5)"), "tags": ("padding",),
                    **_case(rng, *sizes, dtype), "mask": pad})
        out.append({"label": _label(dtype, *sizes, ", an additive mask (3, 5)"), "tags": ("padding",),
                    **_case(rng, *sizes, dtype), "mask": normal(rng, (3, 5), dtype)})
    # gradients of the output, float64 (the check's sizes)
    sizes = (2, 3, 4, 3, 5, 2, 3)
    case = {"label": "the gradients for " + _label("float64", *sizes), "tags": ("grads",), **_case(rng, *sizes, "float64")}
    out.append(grad_case(rng, case, NAMES))
    return out


def exact_zero_weights(case, got, want):
    """Padded positions (weight exactly 0 in the reference) get exactly zero weight."""
    w, ref = arrays(got)["weights"], arrays(want)["weights"]
    where = ref == 0
    if np.any(w[where] != 0):
        return f"a masked context position gets weight {float(w[where][w[where] != 0][0])!r}, not exactly 0"
    return None


CELLS = {
    "test_worked_example": aspect("worked"),
    "test_shapes": aspect("shapes", mode="structure", also=rows_are_distributions),
    "test_roles": aspect("roles"),
    "test_against_torch": aspect("torch"),
    "test_padding_mask": aspect("padding", also=exact_zero_weights),
    "test_gradients_and_inputs": aspect("grads", mode="structure", also=honest_gradients),
}

register(Probe("cross_attention", cases,
               runner(NAMES, ("mask",), outputs=("output", "weights"), grad=NAMES, loss_outputs=1),
               reference=cross_attention, forbidden=checks.FORBIDDEN, cells=CELLS))
