"""Probes for ``softmax`` and ``scaled_dot_product_attention``.

Each case carries tags naming the test cell it stands for, so that a test of
one property (shapes, masks, gradients) is re-checked on that property only.
"""
from __future__ import annotations

import numpy as np

from ...checks import attention as attention_checks
from ...checks import softmax as softmax_checks
from ...checks._core import tolerance
from ...reference import scaled_dot_product_attention, softmax
from . import Probe, arrays, aspect, call_runner, honest_gradients, normal, register, with_directions


# ---------------------------------------------------------------- softmax
def softmax_cases(rng: np.random.Generator) -> list:
    cases = []
    for dtype, shape in (("float64", (3,)), ("float64", (3, 3))):  # the worked example's sizes
        cases.append({"label": f"a small {dtype} input of shape {shape}", "tags": ("small",),
                      "x": normal(rng, shape, dtype), "dim": -1})
    for i in range(6):  # 1-D to 4-D, any dim, both dtypes
        dtype = "float64" if i % 2 else "float32"
        ndim = 1 + i % 4
        shape = tuple(int(s) for s in rng.integers(2, 6, size=ndim))
        dim = int(rng.integers(-ndim, ndim))
        cases.append({"label": f"a {dtype} input of shape {shape} along dim {dim}", "tags": ("dims",),
                      "x": normal(rng, shape, dtype, 3.0), "dim": dim})
    for dtype, scale, dim in (("float32", 1000.0, -1), ("float64", 1000.0, 0), ("float64", 10000.0, -2)):
        shape = (3, int(rng.integers(3, 7)))
        cases.append({"label": f"{dtype} entries around +-{scale:g} along dim {dim}", "tags": ("large",),
                      "x": normal(rng, shape, dtype, scale), "dim": dim})
    for dtype, dim in (("float32", -1), ("float64", -1), ("float64", 0)):
        x = _with_minus_inf(rng, normal(rng, (4, 5), dtype, 1000.0), dim)
        cases.append({"label": f"{dtype} slices with -inf entries along dim {dim}", "tags": ("inf",), "x": x, "dim": dim})
    for dtype, dim, scale, inf in (("float64", -1, 2.0, False), ("float32", 0, 2.0, False),
                                   ("float32", -1, 1000.0, False), ("float64", 1, 1.0, True)):
        x = normal(rng, (4, 6), dtype, 2.0) + (scale if scale > 100 else 0.0)  # all near +1000: exp overflows unshifted
        if inf:
            x = _with_minus_inf(rng, x, dim)
        what = ("entries near 1000" if scale > 100 else "small entries") + (" and -inf entries" if inf else "")
        cases.append({"label": f"the gradient of a {dtype} input of shape (4, 6) along dim {dim}, {what}",
                      "tags": ("grad",), "x": x, "dim": dim, "grad_out": normal(rng, (4, 6), dtype)})
    return cases


def _with_minus_inf(rng, x, dim):
    """-inf at random places, never a whole slice along ``dim``; the first slice keeps one finite entry."""
    x = np.moveaxis(x.copy(), dim, -1)
    n = x.shape[-1]
    hide = rng.random(x.shape) < 0.4
    hide[np.arange(x.shape[0]), rng.integers(0, n, size=x.shape[0])] = False
    hide[0, :] = True
    hide[0, int(rng.integers(0, n))] = False  # a lone finite entry: its weight is exactly 1
    x[hide] = -np.inf
    return np.moveaxis(x, -1, dim)


def exact_zeros_and_ones(case, got, want):
    """-inf entries get weight exactly 0 and a lone finite entry exactly 1 (as the test says)."""
    out, ref = arrays(got)["output"], arrays(want)["output"]
    for value in (0.0, 1.0):
        where = ref == value
        if not np.array_equal(out[where], ref[where]):
            return f"a weight that must be exactly {value:g} is {float(out[where][out[where] != value][0])!r}"
    return None


def float64_sums_to_one(case, got, want):
    """As the worked-example test: in float64 each slice sums to 1 within 1e-12 (a correct
    softmax is within a few 1e-16; an epsilon added "to be safe" is not)."""
    out = arrays(got)["output"]
    if out.dtype != np.float64 or not out.size:
        return None
    worst = float(np.abs(out.sum(case["dim"]) - 1).max())
    return None if worst <= 1e-12 else f"a slice sums to 1 {'+-'} {worst!r}, not 1 (within 1e-12 in float64)"


SOFTMAX_CELLS = {
    "test_worked_example": aspect("small", also=float64_sums_to_one),
    "test_large_inputs": aspect("large"),
    "test_minus_inf": aspect("inf", also=exact_zeros_and_ones),
    "test_dims": aspect("dims"),
    "test_gradients_and_inputs": aspect("grad"),
}


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

def softmax_tolerance(case, key):
    """As the checks (``softmax_checks.rounding_slack``): a correct softmax may round
    x - logsumexp(x) to a unit of max|x|, so the weights get that much more rtol and the
    gradient that much times max|grad_out| more atol."""
    import torch

    if key != "output" and not key.startswith("grad_"):
        return None
    x = torch.as_tensor(case["x"])  # a tensor when decoded, an array when drawn
    atol, rtol = tolerance(x.dtype)
    slack = softmax_checks.rounding_slack(x)
    dtype = str(x.dtype).removeprefix("torch.")  # the results' dtype name, as the wire spells it
    if key == "output":
        return {dtype: (atol, rtol + slack)}
    return {dtype: (atol + slack * float(torch.as_tensor(case["grad_out"]).abs().max()), rtol)}


register(
    Probe("softmax", softmax_cases, call_runner(("x",), ("dim",), grad=("x",)), reference=softmax,
          forbidden=softmax_checks.FORBIDDEN, cells=SOFTMAX_CELLS, case_tolerance=softmax_tolerance),
    Probe("scaled_dot_product_attention", attention_cases,
          call_runner(("Q", "K", "V"), ("mask",), outputs=("output", "weights"), grad=("Q", "K", "V")),
          reference=scaled_dot_product_attention, forbidden=attention_checks.FORBIDDEN, cells=ATTENTION_CELLS),
)
