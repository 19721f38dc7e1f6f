"""Probes for ``RMSNorm``, ``SwiGLU`` and ``GroupedQueryAttention``.

Each module is re-checked the way its checks exercise it: the run builds the answer's class with
the case's sizes (seeded, the caller's random state left alone), copies the case's weights into it
with the checks' own loaders (``load_rms_weight``, ``load_swiglu``, ``load_gqa_weights``) and calls
``forward``; the reference's run builds the reference class the same way. Nothing here calls a
reference piece: the same run executes in the student's kernel under the probe's watcher.

Tags name the test cell a case stands for: ``structure`` (layers, shapes, the weight as built, the
count of parameters; one forward pass whose errors do not matter, so that a forbidden call is seen),
``values`` (everything the values cell grades, its hidden part included: shapes, both dtypes, eps,
the module as built, and one gradient case compared with the reference's gradient of x), and for
the attention ``mask`` (causal, additive and padding masks; masked weights exactly 0).
"""
from __future__ import annotations

import numpy as np

from ...checks import modern_block as C
from ...checks import multihead as mh_checks
from ...reference import GroupedQueryAttention, RMSNorm, SwiGLU
from . import Probe, aspect, normal, register, vector_jacobian
from .multihead import build_module, causal, masked_weights_are_zero, returned_pair, try_forward


def _gradients(m, case, forward):
    """Backpropagate ``grad_out`` through ``forward(leaf)``: the output, the gradient of x, how many
    parameters get none, and whether x was left alone."""
    import torch

    leaf = case["x"].clone().requires_grad_(True)
    out = forward(leaf)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise AssertionError("the output is not connected to the gradients of x")
    params = list(m.parameters())
    grads = vector_jacobian(out, [leaf, *params], case["grad_out"].to(out.dtype))
    return {"output": out.detach(), "grad_x": grads[0], "parameters without a gradient": sum(g is None for g in grads[1:]),
            "x unchanged": bool(torch.equal(leaf.detach(), case["x"]))}


def _plain(m, case, forward):
    import torch

    m.requires_grad_(False)
    x = case["x"].clone()
    res = forward(x)
    res = dict(res) if isinstance(res, dict) else {"output": res}
    res["x unchanged"] = bool(torch.equal(x, case["x"]))
    return res


def _linear_summary(layer):
    from torch import nn

    if not isinstance(layer, nn.Linear):
        return (type(layer).__name__, None, None)
    return ("Linear", tuple(int(s) for s in layer.weight.shape), layer.bias is not None)


# ====================================================================== RMSNorm
def rms_cases(rng: np.random.Generator) -> list:
    cases = [{"label": f"RMSNorm({d})", "tags": ("structure",), "kind": "structure", "d_model": d,
              "x": normal(rng, (2, 3, d), "float32")} for d in (4, 8, 64)]

    def values(label, x, eps=None, weight=True, **extra):
        case = {"label": label, "tags": ("values",), "kind": "forward", "x": x, **extra}
        if eps is not None:
            case["eps"] = float(eps)
        if weight:
            case["weight"] = (1 + 0.5 * rng.standard_normal(x.shape[-1])).astype(x.dtype)
        return case

    # the module as built (weight ones), the default eps, at the worked example's size and 1e-3 of it
    cases.append(values("x of shape (1, 4), float64, the module as built", normal(rng, (1, 4)), weight=False))
    cases.append(values("x of shape (1, 4) of size 1e-3, float64, default eps, the module as built",
                        normal(rng, (1, 4), scale=1e-3), weight=False))
    cases.append(values("x of shape (2, 5, 8), float32, seeded weight", normal(rng, (2, 5, 8), "float32")))
    cases.append(values("x of shape (2, 5, 8), float64, eps=0.5", normal(rng, (2, 5, 8), scale=0.5), eps=0.5))
    for dtype in ("float32", "float64"):
        shape = C.RMS_SHAPES[int(rng.integers(0, len(C.RMS_SHAPES)))]
        cases.append(values(f"x of shape {shape}, {dtype}", normal(rng, shape, dtype)))
        cases.append(values(f"x of shape {shape}, {dtype}, eps=0.01", normal(rng, shape, dtype, 0.1), eps=1e-2))
    cases.append(values("x of shape (3, 8) of size 1e-3, float32", normal(rng, (3, 8), "float32", 1e-3)))
    x = normal(rng, (3, 8))
    x[int(rng.integers(0, 3))] = 0.0
    cases.append(values("x of shape (3, 8), float64, one row of zeros", x))
    cases.append(values("the gradients for x of shape (2, 3, 5), float64, eps=0.1", normal(rng, (2, 3, 5)), eps=0.1,
                        grad_out=normal(rng, (2, 3, 5))))
    return cases


def rms_run(cls, case):
    if case["kind"] == "structure":
        m = build_module(cls, case["d_model"])
        w = getattr(m, "weight", None)
        out = {"weight is a": type(w).__name__, "parameters": int(sum(p.numel() for p in m.parameters()))}
        import torch

        out["weight as built"] = w.detach().clone() if isinstance(w, torch.Tensor) else None
        try_forward(m, case["x"].clone())
        return out
    x = case["x"]
    kwargs = {"eps": case["eps"]} if "eps" in case else {}
    m = build_module(cls, x.shape[-1], **kwargs).to(x.dtype)
    if "weight" in case:
        C.load_rms_weight(m, case["weight"])
    if "grad_out" in case:
        return _gradients(m, case, m)
    return _plain(m, case, m)


RMS_CELLS = {"test_rmsnorm_structure": aspect("structure"), "test_rmsnorm_values": aspect("values")}


# ====================================================================== SwiGLU
def swiglu_cases(rng: np.random.Generator) -> list:
    cases = [{"label": f"SwiGLU({d}, {h})", "tags": ("structure",), "kind": "structure", "d_model": d, "d_hidden": h,
              "x": normal(rng, (2, 3, d), "float32")} for d, h in C.SWIGLU_SIZES]

    def values(shape, h, dtype, **extra):
        d = shape[-1]
        W = tuple(normal(rng, s, dtype, 1 / np.sqrt(s[1])) for s in ((h, d), (h, d), (d, h)))
        return {"label": f"x of shape {shape}, d_hidden={h}, {dtype}", "tags": ("values",), "kind": "forward",
                "W": W, "x": normal(rng, shape, dtype), **extra}

    cases.append(values((2, 5, 8), 12, "float64"))
    for dtype in ("float32", "float64"):
        for shape, h in C.SWIGLU_SHAPES[1:3]:
            cases.append(values(shape, h, dtype))
        shape, h = C.SWIGLU_SHAPES[int(rng.choice([0, 3]))]
        cases.append(values(shape, h, dtype))
    case = values((2, 3, 4), 6, "float64", grad_out=normal(rng, (2, 3, 4)))
    case["label"] = "the gradients for x of shape (2, 3, 4), d_hidden=6, float64"
    cases.append(case)
    return cases


def swiglu_run(cls, case):
    from torch import nn

    if case["kind"] == "structure":
        m = build_module(cls, case["d_model"], case["d_hidden"])
        layers = [getattr(m, n, None) for n in C.SWIGLU_LAYERS]
        out = {n: _linear_summary(layer) for n, layer in zip(C.SWIGLU_LAYERS, layers)}
        out["distinct layers"] = len({id(layer) for layer in layers if isinstance(layer, nn.Module)})
        out["parameters"] = int(sum(p.numel() for p in m.parameters()))
        try_forward(m, case["x"].clone())
        return out
    W = case["W"]
    m = build_module(cls, W[0].shape[1], W[0].shape[0]).to(W[0].dtype)
    C.load_swiglu(m, W)
    if "grad_out" in case:
        return _gradients(m, case, m)
    return _plain(m, case, m)


SWIGLU_CELLS = {"test_swiglu_structure": aspect("structure"), "test_swiglu_values": aspect("values")}


# ====================================================================== GroupedQueryAttention
def _gqa_case(rng, tag, B, T, d, H, H_kv, dtype, mask=None, what=""):
    kv = H_kv * (d // H)
    W = tuple(normal(rng, s, dtype, 1 / np.sqrt(d)) for s in ((d, d), (kv, d), (kv, d), (d, d)))
    case = {"label": f"x of shape {(B, T, d)}, n_heads={H}, n_kv_heads={H_kv}, {dtype}{what}", "tags": (tag,),
            "kind": "forward", "n_heads": H, "n_kv_heads": H_kv, "W": W, "x": normal(rng, (B, T, d), dtype)}
    if mask is not None:
        case["mask"] = mask.astype(dtype)
    return case


def gqa_cases(rng: np.random.Generator) -> list:
    cases = [{"label": f"GroupedQueryAttention({d}, {H}, {H_kv})", "tags": ("structure",), "kind": "structure",
              "d_model": d, "n_heads": H, "n_kv_heads": H_kv, "x": normal(rng, (2, 3, d), "float32")}
             for d, H, H_kv in C.GQA_SIZES]
    # no mask: the visible test's sizes; grouped, multi-query, multi-head and width-1 heads in both dtypes
    cases.append(_gqa_case(rng, "values", 2, 5, 16, 4, 2, "float64"))
    for dtype in ("float32", "float64"):
        for i in (2, 3, 5):
            cases.append(_gqa_case(rng, "values", *C.GQA_SHAPES[i], dtype))
        cases.append(_gqa_case(rng, "values", *C.GQA_SHAPES[int(rng.choice([1, 4, 6]))], dtype))
    # the gradients, without a mask: the values cell's own masked gradient test compares the answer
    # with itself (finite differences), so an answer that ignores masks passes it
    case = _gqa_case(rng, "values", 2, 3, 8, 4, 2, "float64", what=", the gradients")
    case["grad_out"] = normal(rng, (2, 3, 8))
    cases.append(case)
    # masks: causal, an additive bias, padding
    cases.append(_gqa_case(rng, "mask", 2, 5, 16, 4, 2, "float64", causal(5), ", causal mask"))
    for dtype in ("float32", "float64"):
        B, T, d, H, H_kv = C.GQA_SHAPES[int(rng.choice([2, 3, 6]))]
        cases.append(_gqa_case(rng, "mask", B, T, d, H, H_kv, dtype, causal(T), ", causal mask"))
        cases.append(_gqa_case(rng, "mask", 2, 6, 16, 4, 2, dtype, normal(rng, (6, 6), dtype), ", an additive (6, 6) bias"))
    pad = np.zeros((2, 1, 1, 6))
    pad[int(rng.integers(0, 2)), ..., 4:] = -np.inf
    cases.append(_gqa_case(rng, "mask", 2, 6, 16, 4, 2, "float64", pad, ", a (2, 1, 1, 6) padding mask"))
    return cases


def gqa_run(cls, case):
    if case["kind"] == "structure":
        m = build_module(cls, case["d_model"], case["n_heads"], case["n_kv_heads"])
        layers = [getattr(m, n, None) for n in C.PROJECTIONS]
        out = {n: _linear_summary(layer) for n, layer in zip(C.PROJECTIONS, layers)}
        out["distinct layers"] = len({id(layer) for layer in layers if layer is not None})
        out["parameters"] = int(sum(p.numel() for p in m.parameters()))
        try_forward(m, case["x"].clone())
        return out
    W = case["W"]
    m = build_module(cls, W[0].shape[0], case["n_heads"], case["n_kv_heads"]).to(W[0].dtype)
    C.load_gqa_weights(m, W)
    kwargs = {"mask": case["mask"]} if "mask" in case else {}
    if "grad_out" in case:
        return _gradients(m, case, lambda t: returned_pair(m(t, **kwargs))[0])

    def forward(t):
        out, w = returned_pair(m(t, **kwargs))
        return {"output": out, "weights": w}

    return _plain(m, case, forward)


GQA_CELLS = {
    "test_gqa_structure": aspect("structure"),
    "test_gqa_values": aspect("values"),
    "test_gqa_masks": aspect("mask", also=masked_weights_are_zero),
}

register(
    Probe("RMSNorm", rms_cases, rms_run, reference=RMSNorm, forbidden=C.FORBIDDEN_RMS, cells=RMS_CELLS),
    Probe("SwiGLU", swiglu_cases, swiglu_run, reference=SwiGLU, forbidden=C.FORBIDDEN_SWIGLU, cells=SWIGLU_CELLS),
    Probe("GroupedQueryAttention", gqa_cases, gqa_run, reference=GroupedQueryAttention, forbidden=C.FORBIDDEN_GQA,
          cells=GQA_CELLS),
)

assert mh_checks.PROJECTIONS == C.PROJECTIONS  # the two attention probes name the same four layers
