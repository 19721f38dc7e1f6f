"""Probes for ``split_heads``, ``merge_heads`` and ``MultiHeadAttention``.

A module is re-checked the way its checks exercise it: the run builds the
answer's class with the case's sizes (seeded, the caller's random state left
alone), copies the case's weights into it with the checks' own helper
(``load_mha_weights``) and calls ``forward``. The reference's run builds the
reference class the same way. Nothing here calls a reference piece: the same
run executes in the student's kernel under the probe's watcher.

Each case carries tags naming the test cell it stands for (``cells``). The
later notebooks re-test these pieces in 1-point cells of their own grade_ids:
``recap_split_heads`` and ``recap_merge_heads`` grade the visible (small) cases
only, as their checks do; ``test_multi_head_attention`` is the recap of the
values without a mask.

The helpers at the end (``returned_pair``, ``scalars_and_honest_gradients``,
``masked_weights_are_zero``, ``nothing``) are shared with the block and KV-cache probes.
"""
from __future__ import annotations

import numpy as np

from ...checks import multihead as mh_checks
from ...reference import MultiHeadAttention, merge_heads, split_heads
from .. import wire
from . import (Probe, arrays, aspect, call_runner, honest_gradients, normal, register, vector_jacobian,
               with_directions)

FD_STEP = 1e-6


# ---------------------------------------------------------------- shared helpers
def returned_pair(result, names=("output", "weights")):
    """The two outputs of a forward that must return a tuple ``(output, weights)``."""
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        what = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise AssertionError(f"it should return a tuple ({', '.join(names)}), but it returned a {what}")
    return tuple(result)


def first_output(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def finite_difference(forward, x, direction, grad_out):
    """Central difference of ``forward`` at ``x`` along ``direction``, weighted by ``grad_out`` (float64)."""
    import torch

    with torch.no_grad():
        plus = first_output(forward(x + FD_STEP * direction))
        minus = first_output(forward(x - FD_STEP * direction))
    return ((plus - minus) / (2 * FD_STEP) * grad_out).sum().to(torch.float64)


def scalars_and_honest_gradients(case, got, want):
    """For a gradient test (compared in "structure" mode): the plain numbers and flags of the
    results (such as the count of parameters that get no gradient, or whether the input is
    unchanged) equal the reference's, and the gradients agree with the answer's own outputs."""
    for key, w in want.items():
        if wire.is_array(w) or "items" in w:
            continue
        g = got.get(key, {})
        if wire.scalar(g) != wire.scalar(w):
            return f"{key} is {wire.scalar(g)!r}, expected {wire.scalar(w)!r}"
    return honest_gradients(case, got, want)


def masked_weights_are_zero(case, got, want):
    """Where the mask is -inf, the weights are exactly 0 (as the causal tests demand)."""
    if "mask" not in case or "weights" not in want:
        return None
    w = arrays(got).get("weights")
    if w is None:
        return None
    hidden = np.broadcast_to(np.isneginf(case["mask"].numpy()), w.shape)
    if np.any(w[hidden] != 0):
        return f"a weight on a masked (-inf) position is {float(np.abs(w[hidden]).max())!r}, not exactly 0"
    return None


# A test cell that only passes the class along (as a type, or as a part of what it grades,
# which another probe re-checks): no case stands for it.
nothing = aspect("(no case: the cell only uses this object as a part of another)")


# ---------------------------------------------------------------- split_heads
SPLIT_SHAPES = mh_checks.SPLIT_SHAPES  # (B, T, d_model, n_heads)


def split_cases(rng: np.random.Generator) -> list:
    cases = [
        {"label": "x of shape (1, 2, 6), float64, 3 heads (the worked example's sizes, random entries)",
         "tags": ("small",), "x": normal(rng, (1, 2, 6)), "n_heads": 3},
        {"label": "x of shape (2, 5, 12), float32, 3 heads", "tags": ("small",),
         "x": normal(rng, (2, 5, 12), "float32"), "n_heads": 3},
    ]
    for dtype in ("float32", "float64"):
        for B, T, d, H in SPLIT_SHAPES:
            cases.append({"label": f"x of shape {(B, T, d)}, {dtype}, {H} heads", "tags": ("shapes",),
                          "x": normal(rng, (B, T, d), dtype), "n_heads": H})
    cases.append({"label": "the gradient for x of shape (2, 3, 8), float64, 4 heads", "tags": ("grad",),
                  "x": normal(rng, (2, 3, 8)), "n_heads": 4, "grad_out": normal(rng, (2, 4, 3, 2))})
    return cases


# ---------------------------------------------------------------- merge_heads
def merge_cases(rng: np.random.Generator) -> list:
    cases = [
        {"label": "heads of shape (1, 3, 2, 2), float64 (the worked example's sizes, random entries)",
         "tags": ("small",), "x": normal(rng, (1, 3, 2, 2))},
        {"label": "heads of shape (2, 3, 5, 4), float32", "tags": ("small",), "x": normal(rng, (2, 3, 5, 4), "float32")},
    ]
    for dtype in ("float32", "float64"):
        for B, T, d, H in SPLIT_SHAPES:
            cases.append({"label": f"heads of shape {(B, H, T, d // H)}, {dtype}", "tags": ("shapes",),
                          "x": normal(rng, (B, H, T, d // H), dtype)})
    cases.append({"label": "merge_heads of the split of x of shape (2, 5, 12) into 3 heads (a transposed view)",
                  "tags": ("shapes",), "x": normal(rng, (2, 5, 12)), "split_into": 3})
    cases.append({"label": "the gradient for heads of shape (2, 4, 3, 2), float64", "tags": ("grad",),
                  "x": normal(rng, (2, 4, 3, 2)), "grad_out": normal(rng, (2, 3, 8))})
    return cases


_merge_call = call_runner(("x",), grad=("x",))


def merge_run(fn, case):
    """As ``call_runner``; for a ``split_into`` case the input is the split of x as a
    transposed (non-contiguous) view, as ``merge_heads(split_heads(x))`` hands it over."""
    if "split_into" not in case:
        return _merge_call(fn, case)
    x = case["x"].clone()
    B, T, d = x.shape
    H = case["split_into"]
    heads = x.reshape(B, T, H, d // H).transpose(1, 2)
    return {"output": fn(heads), "x after the call": x}


# The recap cells of the later notebooks grade the visible part only: the small cases.
SPLIT_CELLS = {"test_split_heads": aspect(), "recap_split_heads": aspect("small")}
MERGE_CELLS = {"test_merge_heads": aspect(), "recap_merge_heads": aspect("small")}


# ---------------------------------------------------------------- MultiHeadAttention
def _weights(rng, d, dtype):
    return tuple(normal(rng, (d, d), dtype, 1 / np.sqrt(d)) for _ in mh_checks.PROJECTIONS)


def _mha_case(rng, tag, B, T, d, H, dtype, mask=None, what=""):
    case = {"label": f"x of shape {(B, T, d)}, n_heads={H}, {dtype}{what}", "tags": (tag,), "kind": "forward",
            "n_heads": H, "W": _weights(rng, d, dtype), "x": normal(rng, (B, T, d), dtype)}
    if mask is not None:
        case["mask"] = mask.astype(dtype)
    return case


def causal(T):
    return np.triu(np.full((T, T), -np.inf), k=1)


def mha_cases(rng: np.random.Generator) -> list:
    cases = []
    for d, H in ((16, 4), (12, 3), (8, 1), (32, 8), (128, 4)):
        cases.append({"label": f"MultiHeadAttention({d}, {H})", "tags": ("structure",), "kind": "structure",
                      "d_model": d, "n_heads": H, "x": normal(rng, (2, 3, d), "float32")})
    # no mask: the visible test's sizes, heads of width 1, a single head and token, a random one of the others
    cases.append(_mha_case(rng, "reference", 2, 5, 8, 2, "float64"))
    for dtype in ("float32", "float64"):
        cases.append(_mha_case(rng, "reference", 2, 3, 8, 8, dtype))
        cases.append(_mha_case(rng, "reference", 1, 1, 4, 1, dtype))
        B, T, d, H = mh_checks.MHA_SHAPES[int(rng.choice([0, 2, 3]))]
        cases.append(_mha_case(rng, "reference", B, T, d, H, dtype))
    # masks: causal, an additive bias, padding
    cases.append(_mha_case(rng, "mask", 2, 5, 8, 2, "float64", causal(5), ", causal mask"))
    cases.append(_mha_case(rng, "mask", 3, 6, 16, 4, "float32", causal(6), ", causal mask"))
    for dtype in ("float32", "float64"):
        cases.append(_mha_case(rng, "mask", 2, 6, 16, 4, dtype, normal(rng, (6, 6), dtype), ", an additive (6, 6) bias"))
    pad = np.zeros((2, 1, 1, 6))
    pad[int(rng.integers(0, 2)), ..., 4:] = -np.inf
    cases.append(_mha_case(rng, "mask", 2, 6, 16, 4, "float64", pad, ", a (2, 1, 1, 6) padding mask"))
    # gradients (float64, for finite differences), with and without a causal mask
    for masked in (False, True):
        case = _mha_case(rng, "grad", 2, 3, 4, 2, "float64", causal(3) if masked else None,
                         ", the gradients" + (" with a causal mask" if masked else ""))
        case["grad_out"] = normal(rng, (2, 3, 4))
        cases.append(with_directions(rng, case, ("x",)))
    return cases


def build_module(cls, *args, **kwargs):
    """The answer's (or the reference's) module, built as the checks build it (seed 0, the
    caller's random state untouched). The probe's own watcher sees what the build calls."""
    return mh_checks.build(cls, *args, forbidden={}, **kwargs)


def _linear_summary(layer):
    from torch import nn

    if not isinstance(layer, nn.Linear):
        return (type(layer).__name__, None, None)
    return ("Linear", tuple(int(s) for s in layer.weight.shape), layer.bias is not None)


def try_forward(module, x):
    """One forward pass whose errors do not matter (a structure test): the watcher still
    records a forbidden call made inside it."""
    try:
        module(x)
    except Exception:
        pass


def mha_structure(cls, case):
    d, H = case["d_model"], case["n_heads"]
    m = build_module(cls, d, H)
    layers = [getattr(m, name, None) for name in mh_checks.PROJECTIONS]
    out = {name: _linear_summary(layer) for name, layer in zip(mh_checks.PROJECTIONS, layers)}
    out["distinct layers"] = len({id(layer) for layer in layers if layer is not None})
    out["parameters"] = int(sum(p.numel() for p in m.parameters()))
    try_forward(m, case["x"].clone())
    return out


def forward_and_gradients(m, case, weight_layers):
    """Call ``m(x[, mask])``; for a case with ``grad_out`` also backpropagate it and report the
    gradient of x, the finite difference along ``dir_x``, and how many of ``weight_layers``'
    parameters get no gradient; otherwise the outputs (parameters frozen)."""
    import torch

    x = case["x"].clone()
    kwargs = {"mask": case["mask"]} if "mask" in case else {}
    if "grad_out" not in case:
        m.requires_grad_(False)
        out, w = returned_pair(m(x, **kwargs))
        return {"output": out, "weights": w, "x unchanged": bool(torch.equal(x, case["x"]))}
    leaf = x.clone().requires_grad_(True)
    out, _ = returned_pair(m(leaf, **kwargs))
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise AssertionError("the output is not connected to the gradients of x")
    params = [p for p in weight_layers(m)]
    grads = vector_jacobian(out, [leaf, *params], case["grad_out"].to(out.dtype))
    return {"output": out.detach(), "grad_x": grads[0],
            "parameters without a gradient": sum(g is None for g in grads[1:]),
            "x unchanged": bool(torch.equal(leaf.detach(), case["x"])),
            "fd": finite_difference(lambda t: m(t, **kwargs), case["x"].clone(), case["dir_x"], case["grad_out"])}


def mha_run(cls, case):
    if case["kind"] == "structure":
        return mha_structure(cls, case)
    W = case["W"]
    d = W[0].shape[0]
    m = build_module(cls, d, case["n_heads"]).to(W[0].dtype)
    mh_checks.load_mha_weights(m, W)
    return forward_and_gradients(
        m, case, lambda mod: [mh_checks.linear_layer(mod, n).weight for n in mh_checks.PROJECTIONS])


MHA_CELLS = {
    "test_mha_structure": aspect("structure"),
    "test_mha_against_reference": aspect("reference"),
    "test_mha_masks": aspect("mask", also=masked_weights_are_zero),
    "test_mha_gradients_and_inputs": aspect("grad", mode="structure", also=scalars_and_honest_gradients),
    "test_multi_head_attention": aspect("reference"),  # the later notebooks' 1-point recap (no mask)
}

register(
    Probe("split_heads", split_cases, call_runner(("x", "n_heads"), grad=("x",)), reference=split_heads,
          forbidden=mh_checks.FORBIDDEN_SPLIT, cells=SPLIT_CELLS),
    Probe("merge_heads", merge_cases, merge_run, reference=merge_heads,
          forbidden=mh_checks.FORBIDDEN_MERGE, cells=MERGE_CELLS),
    Probe("MultiHeadAttention", mha_cases, mha_run, reference=MultiHeadAttention,
          forbidden=mh_checks.FORBIDDEN_MHA, cells=MHA_CELLS),
)
