"""Probes for ``FeedForward`` and ``TransformerBlock``.

The run builds the answer's class (seeded, as the checks build it), draws the
parameters from a seed of the case with the checks' own ``random_ffn_parameters``
/ ``random_block_parameters`` (so the large blocks need not travel as data),
loads them with ``load_ffn`` / ``load_block`` and calls ``forward`` in eval
mode; the dropout case also runs train mode under a seed of the case.

``test_feed_forward`` grades structure, values and gradients in one cell, so its
cases are all compared in "values" mode (the gradient of x against the
reference's: within that one cell an answer whose gradients are honest but whose
values are wrong fails on the values anyway). In the capstone, test cells that
pass ``TransformerBlock`` along as a type (``test_model_structure``,
``test_trained``, ``test_resolves_it``) stand for no case: the model's own probe
re-checks what they grade.
"""
from __future__ import annotations

import numpy as np

from ...checks import block as bk_checks
from ...checks import multihead as mh_checks
from ...reference import FeedForward, TransformerBlock
from . import Probe, aspect, normal, register, vector_jacobian, with_directions
from .multihead import (build_module, causal, forward_and_gradients, masked_weights_are_zero, nothing, returned_pair,
                        scalars_and_honest_gradients, try_forward)


def _torch_dtype(name):
    import torch

    return getattr(torch, name)


def _generator(case):
    import torch

    return torch.Generator().manual_seed(int(case["seed"]))


def _seed(rng):
    return int(rng.integers(0, 2**31 - 1))


# ---------------------------------------------------------------- FeedForward
def ffn_cases(rng: np.random.Generator) -> list:
    cases = []
    for d in (8, 16, 32):
        cases.append({"label": f"FeedForward({d})", "tags": ("structure",), "kind": "structure", "d_model": d,
                      "x": normal(rng, (2, 3, d), "float32")})
    for dtype in ("float64", "float32"):
        for shape in bk_checks.FFN_SHAPES:
            # the visible test (check_ffn_values(full=False)) runs the first shape in float64
            visible = ("visible",) if (shape, dtype) == (bk_checks.FFN_SHAPES[0], "float64") else ()
            cases.append({"label": f"x of shape {shape}, {dtype}, seeded parameters", "tags": ("values", *visible),
                          "kind": "forward", "seed": _seed(rng), "dtype": dtype, "x": normal(rng, shape, dtype)})
    cases.append({"label": "the gradients for x of shape (2, 3, 4), float64", "tags": ("grad",), "kind": "forward",
                  "seed": _seed(rng), "dtype": "float64", "x": normal(rng, (2, 3, 4)), "grad_out": normal(rng, (2, 3, 4))})
    return cases


def _linears(module):
    from torch import nn

    return sorted((int(m.in_features), int(m.out_features), m.bias is not None)
                  for m in module.modules() if isinstance(m, nn.Linear))


def ffn_run(cls, case):
    import torch

    if case["kind"] == "structure":
        m = build_module(cls, case["d_model"])
        out = {"linear layers (in, out, bias)": _linears(m), "parameters": int(sum(p.numel() for p in m.parameters()))}
        try_forward(m, case["x"].clone())
        return out
    dtype = _torch_dtype(case["dtype"])
    d = case["x"].shape[-1]
    params = bk_checks.random_ffn_parameters(_generator(case), d, dtype)
    m = build_module(cls, d).to(dtype).eval()
    bk_checks.load_ffn(m, params)
    x = case["x"].clone()
    if "grad_out" not in case:
        m.requires_grad_(False)
        return {"output": m(x), "x unchanged": bool(torch.equal(x, case["x"]))}
    leaf = x.requires_grad_(True)
    out = m(leaf)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise AssertionError("the output is not connected to the gradients of x")
    named = list(m.parameters())
    grads = vector_jacobian(out, [leaf, *named], case["grad_out"].to(out.dtype))
    return {"output": out.detach(), "grad_x": grads[0], "parameters without a gradient": sum(g is None for g in grads[1:]),
            "x unchanged": bool(torch.equal(leaf.detach(), case["x"]))}


FFN_CELLS = {
    "test_feed_forward": aspect(),  # transformer_block: structure, values, gradients
    "recap_feed_forward": aspect("visible"),  # the capstone's 1-point recap: the visible float64 case
}


# ---------------------------------------------------------------- TransformerBlock
def _block_case(rng, tag, B, T, d, H, dtype, mask=None, what="", x=None):
    case = {"label": f"x of shape {(B, T, d)}, n_heads={H}, {dtype}, seeded parameters, eval mode{what}",
            "tags": (tag,), "kind": "forward", "seed": _seed(rng), "dtype": dtype, "n_heads": H,
            "x": normal(rng, (B, T, d), dtype) if x is None else x}
    if mask is not None:
        case["mask"] = mask.astype(dtype)
    return case


def _sinusoidal(T, d):
    pos = np.arange(T)[:, None]
    i = np.arange(0, d, 2)[None, :]
    angle = pos / 10000.0 ** (i / d)
    pe = np.zeros((T, d))
    pe[:, 0::2], pe[:, 1::2] = np.sin(angle), np.cos(angle)
    return pe


def block_cases(rng: np.random.Generator) -> list:
    cases = []
    for d, H in ((bk_checks.SEED_D_MODEL, bk_checks.SEED_N_HEADS), (32, 4), (16, 2)):
        cases.append({"label": f"TransformerBlock({d}, {H})", "tags": ("structure",), "kind": "structure",
                      "d_model": d, "n_heads": H, "x": normal(rng, (2, 3, d), "float32")})
    # eval mode against the reference: the visible test's sizes, one token, two random others; causal masks
    cases.append(_block_case(rng, "reference", 2, 5, 16, 4, "float64"))
    for dtype in ("float32", "float64"):
        cases.append(_block_case(rng, "reference", 1, 1, 8, 2, dtype))
        B, T, d, H = bk_checks.BLOCK_SHAPES[int(rng.choice([0, 2, 3]))]
        cases.append(_block_case(rng, "reference", B, T, d, H, dtype))
        B, T, d, H = bk_checks.BLOCK_SHAPES[int(rng.choice([0, 3]))]
        cases.append(_block_case(rng, "reference_mask", B, T, d, H, dtype, causal(T), ", causal mask"))
    # the seed's sanity check: d_model 128, 4 heads, 16 positions with sinusoidal positions, causal mask, float32
    B, T, d, H = 2, bk_checks.SEED_T, bk_checks.SEED_D_MODEL, bk_checks.SEED_N_HEADS
    x = (rng.standard_normal((B, T, d)) + _sinusoidal(T, d)).astype("float32")
    cases.append(_block_case(rng, "causal", B, T, d, H, "float32", causal(T), ", causal mask (the sanity check)", x=x))
    # dropout: eval mode, train mode, dropout=1.0
    case = _block_case(rng, "dropout", 2, 5, 16, 4, "float64", what=", dropout 0.5 then 1.0")
    case["kind"] = "dropout"
    cases.append(case)
    # gradients (float64), with and without a causal mask
    for masked in (False, True):
        case = _block_case(rng, "grad", 2, 3, 8, 2, "float64", causal(3) if masked else None,
                           ", the gradients" + (" with a causal mask" if masked else ""))
        case["grad_out"] = normal(rng, (2, 3, 8))
        cases.append(with_directions(rng, case, ("x",)))
    return cases


def _block_structure(cls, case):
    from torch import nn

    d, H = case["d_model"], case["n_heads"]
    m = build_module(cls, d, H)
    out = {}
    for name in ("ln1", "ln2"):
        ln = getattr(m, name, None)
        out[name] = ((type(ln).__name__, tuple(int(s) for s in ln.normalized_shape), ln.weight is not None)
                     if isinstance(ln, nn.LayerNorm) else (type(ln).__name__, None, None))
    out["ln1 is ln2"] = getattr(m, "ln1", None) is getattr(m, "ln2", None)
    attn = getattr(m, "attn", None)
    out["attn layers"] = tuple(
        (lambda layer: ("Linear", tuple(int(s) for s in layer.weight.shape), layer.bias is not None)
         if isinstance(layer, nn.Linear) else (type(layer).__name__, None, None))(getattr(attn, n, None))
        for n in mh_checks.PROJECTIONS)
    ffn = getattr(m, "ffn", None)
    out["ffn linear layers (in, out, bias)"] = _linears(ffn) if isinstance(ffn, nn.Module) else None
    out["parameters"] = int(sum(p.numel() for p in m.parameters()))
    try_forward(m.eval(), case["x"].clone())
    return out


def _built_block(cls, case, **kwargs):
    dtype = _torch_dtype(case["dtype"])
    P = bk_checks.random_block_parameters(_generator(case), case["x"].shape[-1], dtype)
    m = build_module(cls, case["x"].shape[-1], case["n_heads"], **kwargs).to(dtype)
    bk_checks.load_block(m, P)
    return m.eval()


def _dropout(cls, case):
    """Dropout off in eval mode, on in train mode, on the two branches only (dropout=1.0)."""
    import torch

    inputs = [case["x"].clone() for _ in range(3)]
    m = _built_block(cls, case, dropout=0.5).requires_grad_(False)
    eval_out, _ = returned_pair(m(inputs[0]))
    m.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(case["seed"]))
        train_out, _ = returned_pair(m(inputs[1]))
    differs = bool((torch.as_tensor(train_out).detach() - torch.as_tensor(eval_out).detach()).abs().max() >= 1e-3)
    m = _built_block(cls, case, dropout=1.0).requires_grad_(False).train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(case["seed"]) + 1)
        dropped, _ = returned_pair(m(inputs[2]))
    unchanged = all(bool(torch.equal(x, case["x"])) for x in inputs)
    # dropout's distribution (checks.block.DROPOUT_P): a branch of ones becomes 0 or 1 / (1 - p)
    g = torch.Generator().manual_seed(int(case["seed"]) + 2)
    x = torch.randn(*bk_checks.DROPOUT_SHAPE, generator=g, dtype=torch.float64)
    P = bk_checks.random_block_parameters(g, bk_checks.DROPOUT_SHAPE[-1], torch.float64)
    m = build_module(cls, bk_checks.DROPOUT_SHAPE[-1], case["n_heads"], dropout=bk_checks.DROPOUT_P).double()
    inverted = bk_checks.dropout_is_inverted(*bk_checks.dropout_distribution(m, x, P, int(case["seed"]) + 3))
    return {"eval output (dropout 0.5)": eval_out, "train output differs from eval (dropout 0.5)": differs,
            "train output (dropout 1.0)": dropped, "x unchanged": unchanged,
            "dropout zeroes about p of a branch and scales the rest by 1/(1-p)": inverted}


def block_run(cls, case):
    if case["kind"] == "structure":
        return _block_structure(cls, case)
    if case["kind"] == "dropout":
        return _dropout(cls, case)
    return forward_and_gradients(_built_block(cls, case), case, lambda mod: list(mod.parameters()))


def _exact_zeros_and_rows(case, got, want):
    """The sanity check: no weight on a later position, and each row of the weights sums to 1."""
    from . import arrays

    why = masked_weights_are_zero(case, got, want)
    if why:
        return why
    w = arrays(got)["weights"].astype(np.float64)
    worst = float(np.abs(w.sum(-1) - 1).max()) if w.size else 0.0
    return None if worst <= 1e-5 else f"a row of the weights sums to 1 +- {worst:.3g}, not 1"


BLOCK_CELLS = {
    "test_block_structure": aspect("structure"),
    "test_block_against_reference": aspect("reference", "reference_mask"),
    "test_block_causal": aspect("causal", also=_exact_zeros_and_rows),
    "test_block_dropout": aspect("dropout"),
    "test_block_gradients_and_inputs": aspect("grad", mode="structure", also=scalars_and_honest_gradients),
    # the capstone: the 1-point recap (eval mode, no mask), and cells that use the class as a type
    "test_transformer_block": aspect("reference"),
    "test_model_structure": nothing,
    "test_trained": nothing,
    "test_resolves_it": nothing,
}

register(
    Probe("FeedForward", ffn_cases, ffn_run, reference=FeedForward, forbidden=bk_checks.FORBIDDEN_FFN, cells=FFN_CELLS),
    Probe("TransformerBlock", block_cases, block_run, reference=TransformerBlock,
          forbidden=bk_checks.FORBIDDEN_BLOCK, cells=BLOCK_CELLS),
)
