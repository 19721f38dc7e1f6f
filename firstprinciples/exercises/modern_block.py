"""RMSNorm, SwiGLU and GroupedQueryAttention: the exercise's tests, declared once.

Three module classes:

- ``RMSNorm(d_model, eps=1e-6)``: a parameter ``weight`` (d_model,), ones as built;
  forward(x) = x / sqrt(mean(x^2 over the last dim) + eps) * weight;
- ``SwiGLU(d_model, d_hidden)``: bias-free ``W1``, ``W3`` (d_model -> d_hidden) and ``W2``
  (d_hidden -> d_model); forward(x) = W2(silu(W1 x) * W3 x);
- ``GroupedQueryAttention(d_model, n_heads, n_kv_heads)``: bias-free ``W_q``, ``W_o`` (d_model ->
  d_model), ``W_k``, ``W_v`` (d_model -> n_kv_heads * d_k), d_k = d_model // n_heads; query head h
  reads key/value head h // (n_heads // n_kv_heads); forward(x, mask=None) returns
  (output (B, T, d_model), weights (B, n_heads, T, T)).

Decisions stated once:

- **The adapter** (``module_adapter`` below, the only course code that runs beside the answer)
  builds the answer's class with the case's sizes under a fixed seed (the caller's random state is
  left alone). A structure case reports what the structure test judges as plain data (each named
  attribute's kind, shape and bias, the parameters' names and shapes, their count, the distinct
  layers) after one forward pass whose errors do not matter (so that a forbidden call is seen there
  too). A values case casts the module to the input's dtype, copies the case's seeded weights into
  its parameters by name, calls it and reports the outputs, the input after the call and which
  parameters the call changed; a gradient case (``grad_out``) also reports the gradients of x and
  of every loaded parameter, compared with the reference's.
- **Values**: the defaults of ``grading.compare`` (float32 atol 1e-5, rtol 1e-4; float64 1e-10,
  1e-8): a correct answer only reorders sums of d_model (RMSNorm, SwiGLU) or d_k and T terms
  (attention), which moves float32 results by a few 1e-7 relative; every named mistake moves them
  by more than 1e-2 on these inputs.
- **eps**: with eps = 1e-6 and entries of size 1, eps changes the result by 1e-6 relative, below
  the float32 tolerance. So the cases also use inputs of size 1e-3 (mean square 6e-6, comparable
  with the default eps) and larger eps (0.01 to 0.5): there eps inside or outside the sqrt, or
  ignored, changes the output by more than 5%.
- **Seeded weights**: RMSNorm's weight around 1 (1 + 0.5 N(0, 1)), so that a forgotten weight
  shows, except in the cases of the module as built (weight ones, as the worked example);
  the linear layers' weights with std 1/sqrt(fan_in), so that features have variance about 1.
- **Gradients** (secret cases of the values tests): the gradients of x and of every weight for an
  upstream gradient of the output, against the reference's; none with a mask (the masks test
  judges masks, and the values test must not fail an answer that only ignores masks).
- **Forbidden**: torch's RMSNorm (``nn.RMSNorm``, ``F.rms_norm``), its attention
  (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``) and the course's modules. The
  course's ``split_heads``, ``merge_heads`` and attention function are not named: the course's own
  GroupedQueryAttention is built on them, and the re-check's runner cannot import the course's
  reference at all (an answer that does loses every test there).
- The old hidden tier (more shapes, both dtypes, eps up to 0.5, a row of zeros, masks of every
  kind, the gradients) is folded into ``secret``; torch's ``nn.RMSNorm`` and
  ``scaled_dot_product_attention(..., enable_gqa=True)`` agree with the reference
  (tests/exercises/test_modern_block.py), so comparing with the reference compares with them.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..examples.modern_block import WORKED_X, gqa_parameter_count
from . import Exercise, Mistake, Test, case, causal_mask_array
from .adapters import vector_jacobian
from .attention import output_order

# ================================================================ the adapter: a module, run on one case
STRUCTURE = "structure"  # a case's tag: the structure test's cases
CHANGED = "parameters changed by the call"
COUNT = "number of parameters"
OTHERS = "other parameters"
DISTINCT = "distinct layers"
AS_BUILT = "weight as built"


def _fresh(value):
    """A torch copy of a case's input (a NumPy array in the kernel, a tensor in the re-check)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return torch.from_numpy(np.array(value))


def build(piece, case):
    """``piece(*case["sizes"], **case["options"])`` under a fixed seed, the caller's random state left alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = piece(*case["sizes"], **dict(case.get("options") or {}))
    if not isinstance(module, nn.Module):
        raise AssertionError(
            f"{getattr(piece, '__name__', piece)}{tuple(case['sizes'])} should build an nn.Module (a class that "
            f"subclasses nn.Module and calls super().__init__()), but it built a {type(module).__name__}.")
    return module


def summary(module, name):
    """What the attribute ``name`` of a module is, as plain data: (kind, shape, has a bias)."""
    value = getattr(module, name, None)
    if value is None:
        return ("missing", None, None)
    if isinstance(value, nn.Linear):
        return ("Linear", tuple(int(s) for s in value.weight.shape), value.bias is not None)
    if isinstance(value, nn.Parameter):
        return ("Parameter", tuple(int(s) for s in value.shape), None)
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(int(s) for s in value.shape), None)
    return (type(value).__name__, None, None)


def structure(module, names, x) -> dict:
    """The structure as plain data: each attribute of ``names`` summarised, how many distinct objects
    they are, the names and shapes of the parameters that belong to none of them (sorted: the order
    of registration does not matter) and the number of parameters; then one forward pass on x whose
    errors are left to the values tests (a forbidden call there is still seen)."""
    found = [getattr(module, n, None) for n in names]
    res = {n: summary(module, n) for n in names}
    res[DISTINCT] = len({id(v) for v in found if v is not None})
    own = set()
    for value in found:
        if isinstance(value, nn.Module):
            own.update(id(p) for p in value.parameters())
        elif isinstance(value, torch.Tensor):
            own.add(id(value))
    res[OTHERS] = tuple(sorted((k, tuple(int(s) for s in p.shape)) for k, p in module.named_parameters()
                               if id(p) not in own))
    res[COUNT] = int(sum(p.numel() for p in module.parameters()))
    try:
        module(x)
    except Exception:  # (the values tests report it; the forbidden call, if any, was recorded)
        pass
    return res


def load(module, weights: dict, owner: str, how: dict) -> dict:
    """Copy each of ``weights`` (parameter name -> values) into the module's parameter of that name
    (``W1.weight``: the attribute ``weight`` of the attribute ``W1``; it must be a parameter of the
    module, and not the same as another loaded one), in the module's dtype; return the parameters by
    name. A layer ``L`` whose ``L.weight`` is loaded must have no ``L.bias``. ``how``: what to write
    for a parameter that is missing or misshapen."""
    registered = {id(p) for p in module.parameters()}
    loaded: dict = {}
    for name, values in weights.items():
        layer, attr = module, module
        for part in name.split("."):
            layer, attr = attr, getattr(attr, part, None)
        if not isinstance(attr, nn.Parameter) or id(attr) not in registered:
            kind = "it has none" if attr is None else f"yours is a {type(attr).__name__}, not an nn.Parameter"
            raise AssertionError(f"{owner} should have a parameter {name}: {how[name]}; {kind}.")
        same = next((other for other, p in loaded.items() if p is attr), None)
        if same is not None:
            raise AssertionError(f"{owner}.{name} is the same parameter as {same}: each layer needs its own, "
                                 f"{how[name]}.")
        if layer is not module and getattr(layer, "bias", None) is not None:
            raise AssertionError(f"{owner}.{name.rpartition('.')[0]} should have no bias: nn.Linear(..., bias=False).")
        W = _fresh(values)
        if tuple(attr.shape) != tuple(W.shape):
            raise AssertionError(f"{owner}.{name} has shape {tuple(attr.shape)} but should have shape "
                                 f"{tuple(W.shape)}: {how[name]}.")
        with torch.no_grad():
            attr.copy_(W.to(attr.dtype))
        loaded[name] = attr
    return loaded


def module_adapter(owner: str, names: tuple, outputs: tuple, how: dict, built=None):
    """The adapter of a module piece: ``run(piece, case)`` (see the module's docstring).

    ``owner``: the class's name in messages; ``names``: the attributes a structure case reports;
    ``outputs``: the names of what forward returns (one tensor, or a tuple of these); ``how``:
    parameter name -> how to make it (for a message when it is missing or misshapen); ``built``:
    module -> more of its structure as built, reported in a structure case."""

    def run(piece, case):
        x = _fresh(case["x"])
        module = build(piece, case)
        if case.get("kind") == STRUCTURE:
            as_built = built(module) if built else {}  # (before the forward pass, which could change it)
            return {**structure(module, names, x), **as_built}
        module = module.to(x.dtype)
        params = load(module, case.get("weights") or {}, owner, how)
        before = {k: v.detach().clone() for k, v in module.state_dict().items()}
        kwargs = {"mask": _fresh(case["mask"])} if "mask" in case else {}
        backward = "grad_out" in case
        if backward:
            x.requires_grad_(True)
        result = module(x, **kwargs)
        if len(outputs) == 1:
            returned = {outputs[0]: result}
        elif isinstance(result, (tuple, list)) and len(result) == len(outputs):
            returned = dict(zip(outputs, result))
        else:
            kind = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
            raise AssertionError(f"forward returned a {kind}, expected a tuple ({', '.join(outputs)}).")
        # The outputs' values, detached: whether gradients flow is judged by the gradient cases, as
        # before the declaration (an answer that forgets the weight is right on the module as built,
        # weight ones, and its mistake is named on the seeded cases, not by a missing gradient).
        res = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in returned.items()}
        if backward:  # (an output not connected to x and the weights: no gradient reaches them, reported as None)
            first, leaves = returned[outputs[0]], [x, *params.values()]
            grads = [None] * len(leaves)
            if isinstance(first, torch.Tensor) and first.requires_grad:
                grads = vector_jacobian(first, leaves, _fresh(case["grad_out"]).to(first.dtype))
            res.update({f"grad_{n}": g for n, g in zip(("x", *params), grads)})
        after = module.state_dict()
        res[CHANGED] = tuple(sorted(k for k, v in before.items() if k in after and not torch.equal(v, after[k])))
        res["x after the call"] = x.detach()
        if kwargs:
            res["mask after the call"] = kwargs["mask"]
        return res

    return run


# ================================================================ properties shared by the three pieces


def parameters_kept(case, out, want):
    """forward leaves the module's own parameters as they were."""
    changed = out.get(CHANGED)
    if changed:
        return (f"calling the module changed its own parameter {changed[0]}: forward must not modify its weights "
                "(no in-place operation on self.weight or a layer's weight).")
    return None


def gradients_reach(case, out, want):
    """Every loaded parameter, and x, receives a gradient (a None gradient: the tensor was not used,
    or was detached)."""
    for key in want:
        if key.startswith("grad_") and out.get(key) is None:
            return (f"no gradient reaches {key[5:]}: is it used in forward, and is nothing detached? Avoid .detach(), "
                    ".numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside forward.")
    return None


def _others(out) -> str | None:
    """The parameters outside the expected attributes, for a message (None: there are none)."""
    others = out.get(OTHERS) or ()
    return (f"It has other parameters: {', '.join(f'{k} {tuple(s)}' for k, s in others)}.") if others else None


def _linear_layers(owner: str, sizes: str, layers: dict, count, count_formula: str):
    """The structure test's property for a module of bias-free nn.Linear layers: ``layers`` maps a
    layer's name to (its expected weight shape from the case, its constructor's text)."""

    def judged(case, out, want):
        for name, (shape_of, text) in layers.items():
            kind, shape, bias = out[name]
            if kind != "Linear":
                return (f"{owner} should have an attribute {name} that is an nn.Linear ({text}); "
                        + ("it has none." if kind == "missing" else f"yours is a {kind}."))
            want_shape = shape_of(case["sizes"])
            if tuple(shape) != want_shape:
                return (f"for {owner}{tuple(case['sizes'])}, {name}.weight has shape {tuple(shape)} but should have "
                        f"shape {want_shape}: {text}.")
            if bias:
                return f"{owner}.{name} should have no bias: nn.Linear(..., bias=False)."
        names = list(layers)
        if out[DISTINCT] < len(names):
            return f"{', '.join(names[:-1])} and {names[-1]} should be {len(names)} different nn.Linear layers."
        expected = count(*case["sizes"])
        if out[COUNT] != expected or _others(out):
            return (f"{owner}{tuple(case['sizes'])} has {out[COUNT]:,} parameters but should have {count_formula} = "
                    f"{expected:,} (the {len(names)} layers' weights only). {_others(out) or ''}").rstrip()
        return None

    judged.__doc__ = f"{owner}'s layers, {sizes}: named, bias-free nn.Linear of the right shapes, distinct, no others."
    return judged


def _normal(rng, shape, dtype="float64", scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _structure_case(owner, rng, sizes, d_model, **extra):
    return case(f"built as {owner}({', '.join(str(s) for s in sizes)})", STRUCTURE, kind=STRUCTURE, sizes=tuple(sizes),
                x=_normal(rng, (2, 3, d_model), "float32"), **extra)


def _dtype(x) -> str:
    return str(x.dtype)


# ================================================================ RMSNorm
RMS_STRUCTURE, RMS_VALUES = "test_rmsnorm_structure", "test_rmsnorm_values"


def _rms(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight, for the mistakes below to change one step each."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _RMSMistake(nn.Module):
    """RMSNorm's parameters, for the mistakes below (each gets forward wrong)."""

    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))


def _rms_mistake(normalise):
    """A mistaken RMSNorm whose forward is ``normalise(x, weight, eps)``."""

    class RMSNorm(_RMSMistake):
        def forward(self, x):
            return normalise(x, self.weight, self.eps)

    return RMSNorm


def _layer_norm(x, weight, eps):
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight


RMS_MISTAKES = tuple(Mistake(label, hint, _rms_mistake(fn), frozenset({RMS_VALUES})) for label, hint, fn in (
    ("mean subtracted (LayerNorm)",
     "RMSNorm does not centre: divide x itself by sqrt(mean(x**2) + eps); subtracting the mean is LayerNorm.",
     _layer_norm),
    ("eps outside the sqrt",
     "add eps under the square root: x / torch.sqrt(mean(x**2) + eps), not x / (torch.sqrt(mean(x**2)) + eps).",
     lambda x, w, eps: x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + eps) * w),
    ("mean over the wrong dimension",
     "each token is normalised over its own features: take the mean over the last dimension "
     "(dim=-1, keepdim=True), not over the tokens.",
     lambda x, w, eps: x / torch.sqrt(x.pow(2).mean(-2, keepdim=True) + eps) * w),
    ("sum instead of mean",
     "the root mean square divides the sum of squares by d_model: use .mean(dim=-1), not .sum(dim=-1).",
     lambda x, w, eps: x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps) * w),
    ("no square root", "divide by the square root of the mean square (the RMS), not by the mean square itself.",
     lambda x, w, eps: x / (x.pow(2).mean(-1, keepdim=True) + eps) * w),
    ("weight not applied", "multiply the normalised x by self.weight (one scale per feature).",
     lambda x, w, eps: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)),
    ("weight added", "self.weight is a scale: multiply by it, do not add it.",
     lambda x, w, eps: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) + w),
    ("divided by the standard deviation",
     "the RMS is sqrt(mean(x**2)), around 0, not the standard deviation around the mean.",
     lambda x, w, eps: x / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * w),
    ("eps argument ignored", "store the eps you are given (self.eps = eps) and use it; 1e-6 is only its default.",
     lambda x, w, eps: _rms(x, w, 1e-6)),
))


def rms_structure(case, out, want):
    """One parameter, ``weight``, an nn.Parameter of shape (d_model,), ones as built; nothing else."""
    (d,) = case["sizes"]
    kind, shape, _ = out["weight"]
    if kind != "Parameter":
        return ("RMSNorm should have a parameter named weight: self.weight = nn.Parameter(torch.ones(d_model)); "
                + ("it has none." if kind == "missing" else f"yours is a {kind}, not an nn.Parameter."))
    if tuple(shape) != (d,):
        return f"RMSNorm({d}).weight has shape {tuple(shape)} but should have shape ({d},) (one scale per feature)."
    built = out.get(AS_BUILT)
    if built is not None and not np.array_equal(built, np.ones_like(built)):
        return (f"RMSNorm({d}).weight should start as ones (torch.ones(d_model)), so that a new layer only "
                f"normalises; yours starts as {[round(float(v), 4) for v in built.reshape(-1)[:4]]}...")
    if out[COUNT] != d or _others(out):
        return (f"RMSNorm({d}) has {out[COUNT]:,} parameters but should have d_model = {d} (the weight only, no "
                f"bias). {_others(out) or ''}").rstrip()
    return None


def _weight_as_built(module) -> dict:
    """RMSNorm's weight as built (ones), in float32 whatever its dtype (the property says what differs)."""
    w = getattr(module, "weight", None)
    return {AS_BUILT: w.detach().float().clone() if isinstance(w, torch.Tensor) else None}


rms_adapter = module_adapter("RMSNorm", ("weight",), ("output",),
                             {"weight": "self.weight = nn.Parameter(torch.ones(d_model)), one scale per feature"},
                             built=_weight_as_built)


def _rms_case(rng, x, eps=None, weight=True, what=""):
    """A values case: x, eps (None: the default, not passed), a seeded weight around 1 (or the weight as built)."""
    d = x.shape[-1]
    options = {} if eps is None else {"eps": float(eps)}
    label = (f"for x of shape {x.shape}, {_dtype(x)}, eps={1e-6 if eps is None else eps:g}"
             + (", seeded weight" if weight else ", weight as built (ones)") + what)
    inputs = {"sizes": (d,), "options": options, "x": x}
    if weight:
        inputs["weights"] = {"weight": (1 + 0.5 * rng.standard_normal(d)).astype(x.dtype)}
    return case(label, "values", **inputs)


def _rms_visible() -> tuple:
    g = np.random.default_rng(301)
    worked = np.array([WORKED_X])  # (1, 4), float64
    return (
        *(_structure_case("RMSNorm", g, (d,), d) for d in (4, 8, 64)),
        case("for the worked example x = [[1., 2., 2., 4.]] (RMS 2.5), weight as built", "values",
             sizes=(4,), options={}, x=worked),
        case("for x = 1e-3 * [[1., 2., 2., 4.]] with the default eps = 1e-6 (the mean square 6.25e-6 is close "
             "to eps, so where eps goes shows)", "values", sizes=(4,), options={}, x=worked * 1e-3),
        _rms_case(g, _normal(g, (2, 5, 8), "float32")),
        _rms_case(g, _normal(g, (2, 5, 8), "float64", 0.5), eps=0.5),
    )


RMS_SHAPES = ((2, 5, 8), (3, 16), (2, 3, 4, 6), (1, 1, 4), (7,))


def rms_secret(rng: np.random.Generator) -> list:
    """Structure at three sizes and a random one; the module as built at the worked example's size
    (entries of size 1 and 1e-3, the default eps); seeded weights on every shape in both dtypes with
    the default eps and eps = 0.01 on entries of size 0.1, eps = 0.5 and 0.1; entries of size 1e-3 in
    float32; a row of zeros; the gradients of x and the weight in float64 and float32."""
    cases = [_structure_case("RMSNorm", rng, (d,), d) for d in (4, 8, 64, int(rng.integers(1, 100)))]
    cases += [_rms_case(rng, _normal(rng, (1, 4), "float64", s), weight=False) for s in (1.0, 1e-3)]
    cases.append(_rms_case(rng, _normal(rng, (2, 5, 8), "float32")))
    cases.append(_rms_case(rng, _normal(rng, (2, 5, 8), "float64", 0.5), eps=0.5))
    for dtype in ("float32", "float64"):
        for shape in RMS_SHAPES:
            cases.append(_rms_case(rng, _normal(rng, shape, dtype)))
            cases.append(_rms_case(rng, _normal(rng, shape, dtype, 0.1), eps=1e-2))
    cases.append(_rms_case(rng, _normal(rng, (3, 8), "float32", 1e-3)))
    cases.append(_rms_case(rng, _normal(rng, (2, 6), "float64"), eps=0.1))
    x = _normal(rng, (3, 8))
    x[int(rng.integers(0, 3))] = 0.0  # eps keeps 0 / sqrt(0 + eps) = 0
    cases.append(_rms_case(rng, x, what=", one row of zeros"))
    for shape, dtype, eps in (((2, 3, 5), "float64", 0.1), ((3, 6), "float32", None)):
        c = _rms_case(rng, _normal(rng, shape, dtype), eps=eps, what=", with the gradients")
        c["grad_out"] = _normal(rng, shape, dtype)
        cases.append(c)
    return cases


# ================================================================ SwiGLU
SW_STRUCTURE, SW_VALUES = "test_swiglu_structure", "test_swiglu_values"
SWIGLU_LAYERS = ("W1", "W3", "W2")


class _SwiGLUMistake(nn.Module):
    """SwiGLU's layers, for the mistakes below (each gets forward wrong)."""

    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.W1 = nn.Linear(d_model, d_hidden, bias=False)
        self.W3 = nn.Linear(d_model, d_hidden, bias=False)
        self.W2 = nn.Linear(d_hidden, d_model, bias=False)


def _swiglu_mistake(combine):
    """A mistaken SwiGLU whose forward is ``combine(x, W1, W3, W2)`` (the layers)."""

    class SwiGLU(_SwiGLUMistake):
        def forward(self, x):
            return combine(x, self.W1, self.W3, self.W2)

    return SwiGLU


SWIGLU_MISTAKES = tuple(Mistake(label, hint, _swiglu_mistake(fn), frozenset({SW_VALUES})) for label, hint, fn in (
    ("gate and up projection swapped",
     "W1 is the gate: silu goes on W1(x), and W3(x) is what it multiplies: W2(silu(W1(x)) * W3(x)).",
     lambda x, W1, W3, W2: W2(F.silu(W3(x)) * W1(x))),
    ("sigmoid instead of silu", "silu(z) = z * sigmoid(z) (F.silu): the gate keeps its own value times its sigmoid.",
     lambda x, W1, W3, W2: W2(torch.sigmoid(W1(x)) * W3(x))),
    ("ReLU instead of silu", "the gate's activation is silu (F.silu), not ReLU.",
     lambda x, W1, W3, W2: W2(torch.relu(W1(x)) * W3(x))),
    ("GELU instead of silu", "the gate's activation is silu (F.silu), not GELU (that would be GeGLU).",
     lambda x, W1, W3, W2: W2(F.gelu(W1(x)) * W3(x))),
    ("silu applied to the product",
     "apply silu to the gate W1(x) alone, then multiply by W3(x): W2(silu(W1(x)) * W3(x)).",
     lambda x, W1, W3, W2: W2(F.silu(W1(x) * W3(x)))),
    ("W2 applied before the product",
     "multiply the two d_hidden-wide branches first, then project back with W2 once.",
     lambda x, W1, W3, W2: W2(F.silu(W1(x))) * W2(W3(x))),
    ("W3 not used", "the gate multiplies a second projection: W2(silu(W1(x)) * W3(x)).",
     lambda x, W1, W3, W2: W2(F.silu(W1(x)))),
    ("branches added", "the gate multiplies W3(x) element by element (*), it is not added to it.",
     lambda x, W1, W3, W2: W2(F.silu(W1(x)) + W3(x))),
    ("silu after W2 too", "W2's output is returned as it is; silu is applied to the gate only.",
     lambda x, W1, W3, W2: F.silu(W2(F.silu(W1(x)) * W3(x)))),
))

_SW_TEXT = {"W1": "nn.Linear(d_model, d_hidden, bias=False) maps d_model features to d_hidden",
            "W3": "nn.Linear(d_model, d_hidden, bias=False) maps d_model features to d_hidden",
            "W2": "nn.Linear(d_hidden, d_model, bias=False) maps d_hidden features to d_model"}
swiglu_structure = _linear_layers(
    "SwiGLU", "W1, W3 (d_model -> d_hidden) and W2 (d_hidden -> d_model)",
    {"W1": (lambda s: (s[1], s[0]), _SW_TEXT["W1"]), "W3": (lambda s: (s[1], s[0]), _SW_TEXT["W3"]),
     "W2": (lambda s: (s[0], s[1]), _SW_TEXT["W2"])},
    lambda d, h: 3 * d * h, "3 * d_model * d_hidden")

swiglu_adapter = module_adapter("SwiGLU", SWIGLU_LAYERS, ("output",),
                                {f"{n}.weight": f"self.{n} = {_SW_TEXT[n]}" for n in SWIGLU_LAYERS})


def _swiglu_case(rng, shape, h, dtype, what=""):
    d = shape[-1]
    weights = {"W1.weight": _normal(rng, (h, d), dtype, 1 / math.sqrt(d)),
               "W3.weight": _normal(rng, (h, d), dtype, 1 / math.sqrt(d)),
               "W2.weight": _normal(rng, (d, h), dtype, 1 / math.sqrt(h))}
    return case(f"for x of shape {shape}, d_hidden={h}, {dtype}{what}", "values", sizes=(d, h), weights=weights,
                x=_normal(rng, shape, dtype))


SWIGLU_SIZES = ((8, 16), (16, 40), (12, 32), (64, 172))
SWIGLU_SHAPES = (((2, 5, 8), 12), ((6, 16), 40), ((1, 1, 4), 4), ((2, 3, 4, 8), 20))


def _swiglu_visible() -> tuple:
    g = np.random.default_rng(311)
    return (*(_structure_case("SwiGLU", g, s, s[0]) for s in SWIGLU_SIZES),
            _swiglu_case(g, (2, 5, 8), 12, "float64"))


def swiglu_secret(rng: np.random.Generator) -> list:
    """Structure at four sizes and a random one; seeded weights on every shape (one to three leading
    dimensions, d_hidden from d_model to 5 d_model) in both dtypes; the gradients of x and of the
    three weights in float64 and float32."""
    cases = [_structure_case("SwiGLU", rng, s, s[0]) for s in SWIGLU_SIZES]
    d = int(rng.integers(1, 40))
    cases.append(_structure_case("SwiGLU", rng, (d, int(rng.integers(1, 100))), d))
    cases.append(_swiglu_case(rng, (2, 5, 8), 12, "float64"))
    for dtype in ("float32", "float64"):
        cases += [_swiglu_case(rng, shape, h, dtype) for shape, h in SWIGLU_SHAPES]
    for shape, h, dtype in (((2, 3, 4), 6, "float64"), ((5, 8), 20, "float32")):
        c = _swiglu_case(rng, shape, h, dtype, ", with the gradients")
        c["grad_out"] = _normal(rng, shape, dtype)
        cases.append(c)
    return cases


# ================================================================ GroupedQueryAttention
GQA_STRUCTURE, GQA_VALUES, GQA_MASKS = "test_gqa_structure", "test_gqa_values", "test_gqa_masks"
PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")


class _GQAMistake(nn.Module):
    """Grouped-query attention with switchable mistakes (class attributes, set by ``_gqa_mistake``)."""

    share = "interleave"  # or "tile": head h reads kv head h % n_kv_heads
    scale = "d_k"  # or "none", "d_model"
    use_mask = True
    softmax_dim = -1
    project_out = True
    average_weights = False

    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_k = n_heads, n_kv_heads, d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
        self.W_v = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def heads(self, t, n):
        B, T, _ = t.shape
        return t.reshape(B, T, n, self.d_k).transpose(1, 2)  # (B, n, T, d_k)

    def forward(self, x, mask=None):
        B, T, d_model = x.shape
        group = self.n_heads // self.n_kv_heads
        Q = self.heads(self.W_q(x), self.n_heads)
        K, V = self.heads(self.W_k(x), self.n_kv_heads), self.heads(self.W_v(x), self.n_kv_heads)
        if self.share == "interleave":
            K, V = K.repeat_interleave(group, dim=1), V.repeat_interleave(group, dim=1)
        else:
            K, V = K.repeat(1, group, 1, 1), V.repeat(1, group, 1, 1)
        scale = {"d_k": math.sqrt(self.d_k), "none": 1.0, "d_model": math.sqrt(d_model)}[self.scale]
        scores = Q @ K.transpose(-2, -1) / scale
        if mask is not None and self.use_mask:
            scores = scores + mask
        weights = torch.softmax(scores, dim=self.softmax_dim)
        out = (weights @ V).transpose(1, 2).reshape(B, T, d_model)
        out = self.W_o(out) if self.project_out else out
        return out, (weights.mean(dim=1) if self.average_weights else weights)


def _gqa_mistake(**options):
    return type("GroupedQueryAttention", (_GQAMistake,), options)


GQA_BOTH = frozenset({GQA_VALUES, GQA_MASKS})
GQA_MISTAKES = (
    Mistake("query head h reads key/value head h % n_kv_heads",
            "consecutive query heads share a key/value head: head h reads kv head h // (n_heads // n_kv_heads). "
            "Repeat each kv head with .repeat_interleave(group, dim=1), not .repeat(1, group, 1, 1).",
            _gqa_mistake(share="tile"), GQA_BOTH),
    Mistake("scores not scaled", "divide the scores by sqrt(d_k), d_k = d_model // n_heads.",
            _gqa_mistake(scale="none"), GQA_BOTH),
    Mistake("scaled by sqrt(d_model)", "each head compares vectors of width d_k = d_model // n_heads: divide by "
            "sqrt(d_k), not sqrt(d_model).", _gqa_mistake(scale="d_model"), GQA_BOTH),
    Mistake("mask ignored", "add the mask to the scores of every head before the softmax.",
            _gqa_mistake(use_mask=False), frozenset({GQA_MASKS})),
    Mistake("softmax over the wrong dimension",
            "each query's weights sum to 1 over the keys: softmax over the last dimension (dim=-1).",
            _gqa_mistake(softmax_dim=-2), GQA_BOTH),
    Mistake("W_o forgotten", "after merging the heads, apply the output projection self.W_o.",
            _gqa_mistake(project_out=False), GQA_BOTH),
    Mistake("weights averaged over heads", "return every query head's weights, shape (B, n_heads, T, T).",
            _gqa_mistake(average_weights=True), GQA_BOTH),
)

_KV_TEXT = "nn.Linear(d_model, n_kv_heads * d_k, bias=False): the keys and values of the n_kv_heads shared heads only"
_Q_TEXT = "nn.Linear(d_model, d_model, bias=False)"


def _kv_shape(sizes):
    d, H, H_kv = sizes
    return (H_kv * (d // H), d)


gqa_structure = _linear_layers(
    "GroupedQueryAttention", "W_q, W_o (d_model -> d_model) and W_k, W_v (d_model -> n_kv_heads * d_k)",
    {"W_q": (lambda s: (s[0], s[0]), _Q_TEXT), "W_k": (_kv_shape, _KV_TEXT), "W_v": (_kv_shape, _KV_TEXT),
     "W_o": (lambda s: (s[0], s[0]), _Q_TEXT)},
    gqa_parameter_count, "2 * d_model**2 + 2 * d_model * n_kv_heads * d_k")

gqa_adapter = module_adapter(
    "GroupedQueryAttention", PROJECTIONS, ("output", "weights"),
    {f"{n}.weight": f"self.{n} = " + (_KV_TEXT if n in ("W_k", "W_v") else _Q_TEXT) for n in PROJECTIONS})


def masked_weights_are_zero(case, out, want):
    """Where the mask is -inf, every head's weight is exactly 0 (exp(-inf) is exactly 0)."""
    mask, w = case.get("mask"), out.get("weights")
    if mask is None or w is None or w.shape != want["weights"].shape:
        return None  # (no mask, or a wrong shape: the comparison says so)
    hidden = np.broadcast_to(np.isneginf(mask), w.shape)
    above = float(np.abs(w[hidden]).max()) if hidden.any() else 0.0
    if above == 0.0:
        return None
    reach = f"yours reach {above:.3g}" if case.get("show") else "some of yours are not"
    return (f"every weight where the mask is -inf must be exactly 0; {reach}. Is the mask added to the scores of "
            "every head before the softmax?")


def _gqa_case(rng, tag, B, T, d, H, H_kv, dtype, mask=None, what=""):
    kv = H_kv * (d // H)
    shapes = {"W_q.weight": (d, d), "W_k.weight": (kv, d), "W_v.weight": (kv, d), "W_o.weight": (d, d)}
    weights = {n: _normal(rng, s, dtype, 1 / math.sqrt(d)) for n, s in shapes.items()}
    inputs = {"sizes": (d, H, H_kv), "weights": weights, "x": _normal(rng, (B, T, d), dtype)}
    if mask is not None:
        inputs["mask"] = mask.astype(dtype)
    return case(f"for x of shape {(B, T, d)}, n_heads={H}, n_kv_heads={H_kv}, {dtype}{what}", tag, **inputs)


GQA_SIZES = ((16, 4, 2), (16, 4, 1), (16, 4, 4), (24, 6, 3), (32, 8, 2), (128, 8, 2))
GQA_SHAPES = (  # (B, T, d_model, n_heads, n_kv_heads)
    (2, 5, 16, 4, 2),
    (1, 1, 8, 2, 1),
    (3, 6, 16, 4, 1),  # multi-query
    (2, 7, 24, 6, 3),
    (2, 4, 32, 8, 2),
    (2, 3, 8, 8, 8),  # d_k = 1, multi-head
    (2, 5, 12, 3, 3),  # multi-head
)


def _gqa_visible() -> tuple:
    g = np.random.default_rng(321)
    return (*(_structure_case("GroupedQueryAttention", g, s, s[0]) for s in GQA_SIZES),
            _gqa_case(g, "values", 2, 5, 16, 4, 2, "float64"),
            _gqa_case(g, "mask", 2, 5, 16, 4, 2, "float64", causal_mask_array(5), ", causal mask"))


def gqa_secret(rng: np.random.Generator) -> list:
    """Structure at six sizes (multi-query and multi-head included) and a random one; no mask: every
    shape of ``GQA_SHAPES`` (grouped, multi-query, multi-head, heads of width 1) in both dtypes, and
    the gradients of x and the four weights in float64 and float32; masks: causal on three shapes,
    an additive (6, 6) bias and a (2, 1, 1, 6) padding mask, in both dtypes."""
    cases = [_structure_case("GroupedQueryAttention", rng, s, s[0]) for s in GQA_SIZES]
    H_kv, group, d_k = (int(v) for v in rng.integers(1, 5, size=3))
    cases.append(_structure_case("GroupedQueryAttention", rng, (H_kv * group * d_k, H_kv * group, H_kv),
                                 H_kv * group * d_k))
    for dtype in ("float32", "float64"):
        cases += [_gqa_case(rng, "values", *shape, dtype) for shape in GQA_SHAPES]
    for shape, dtype in (((2, 3, 8, 4, 2), "float64"), ((2, 4, 12, 6, 1), "float64"), ((1, 5, 16, 4, 2), "float32")):
        c = _gqa_case(rng, "values", *shape, dtype, what=", with the gradients")
        c["grad_out"] = _normal(rng, shape[:3], dtype)
        cases.append(c)
    cases.append(_gqa_case(rng, "mask", 2, 5, 16, 4, 2, "float64", causal_mask_array(5), ", causal mask"))
    for dtype in ("float32", "float64"):
        for B, T, d, H, H_kv in (GQA_SHAPES[2], GQA_SHAPES[3], GQA_SHAPES[6]):
            cases.append(_gqa_case(rng, "mask", B, T, d, H, H_kv, dtype, causal_mask_array(T), ", causal mask"))
        cases.append(_gqa_case(rng, "mask", 2, 6, 16, 4, 2, dtype, _normal(rng, (6, 6)), ", an additive (6, 6) bias"))
        pad = np.zeros((2, 1, 1, 6))
        pad[int(rng.integers(0, 2)), ..., int(rng.integers(2, 6)):] = -np.inf  # never a whole row
        cases.append(_gqa_case(rng, "mask", 2, 6, 16, 4, 2, dtype, pad, ", a (2, 1, 1, 6) padding mask"))
    return cases


# ================================================================ the three pieces
# The course's modules an answer must not build or call (the course's split_heads, merge_heads and
# attention function are left out: its GroupedQueryAttention is built on them, see the docstring).
COURSE_MODULES = ("RMSNorm", "SwiGLU", "GroupedQueryAttention", "MultiHeadAttention", "FeedForward", "TransformerBlock")
GRADIENT_NAMES = {f"grad_{n}": f"the gradient with respect to {n}"
                  for n in ("x", "weight", *(f"{layer}.weight" for layer in (*SWIGLU_LAYERS, *PROJECTIONS)))}
HINTS = (
    ("modified by an inplace operation", "An in-place operation (x /= ..., x.mul_(...)) on a tensor that autograd "
                                         "still needs breaks the backward pass: write x = x / ... instead."),
)

PIECES = (
    Exercise(
        name="modern_block",
        piece="RMSNorm",
        call="RMSNorm",
        adapter=rms_adapter,
        reference="firstprinciples.reference:RMSNorm",
        names={"output": "the output", **GRADIENT_NAMES},
        visible=_rms_visible(),
        secret=rms_secret,
        tests={
            RMS_STRUCTURE: Test(1, frozenset({STRUCTURE}), first=(rms_structure,)),
            RMS_VALUES: Test(2, frozenset({"values"}), first=(parameters_kept, gradients_reach)),
        },
        forbidden=dict(torch_patterns=("rms_norm", "RMSNorm"), pieces=COURSE_MODULES, what="RMSNorm"),
        mistakes=RMS_MISTAKES,
        hints=HINTS,
    ),
    Exercise(
        name="modern_block",
        piece="SwiGLU",
        call="SwiGLU",
        adapter=swiglu_adapter,
        reference="firstprinciples.reference:SwiGLU",
        names={"output": "the output", **GRADIENT_NAMES},
        visible=_swiglu_visible(),
        secret=swiglu_secret,
        tests={
            SW_STRUCTURE: Test(1, frozenset({STRUCTURE}), first=(swiglu_structure,)),
            SW_VALUES: Test(2, frozenset({"values"}), first=(parameters_kept, gradients_reach)),
        },
        forbidden=dict(torch_patterns=(), pieces=COURSE_MODULES, what="the SwiGLU feed-forward network"),
        mistakes=SWIGLU_MISTAKES,
        hints=(
            ("cannot be multiplied", "W1 and W3 map d_model features to d_hidden, W2 maps d_hidden back to d_model: "
                                     "call the layers, self.W1(x), rather than multiplying by their weights."),
            *HINTS,
        ),
    ),
    Exercise(
        name="modern_block",
        piece="GroupedQueryAttention",
        call="GroupedQueryAttention",
        adapter=gqa_adapter,
        reference="firstprinciples.reference:GroupedQueryAttention",
        names={"output": "the output", "weights": "the weights", **GRADIENT_NAMES},
        visible=_gqa_visible(),
        secret=gqa_secret,
        tests={
            GQA_STRUCTURE: Test(1, frozenset({STRUCTURE}), first=(gqa_structure,)),
            GQA_VALUES: Test(3, frozenset({"values"}), first=(output_order, parameters_kept, gradients_reach)),
            GQA_MASKS: Test(2, frozenset({"mask"}), first=(output_order, parameters_kept, masked_weights_are_zero)),
        },
        forbidden=dict(torch_patterns=("scaled_dot_product_attention", "multi_head_attention", "MultiheadAttention"),
                       pieces=COURSE_MODULES, what="grouped-query attention"),
        mistakes=GQA_MISTAKES,
        hints=(
            ("The size of tensor a", "K and V have n_kv_heads heads and Q has n_heads: repeat each key/value head for "
                                     "its group (.repeat_interleave(n_heads // n_kv_heads, dim=1)) before the scores."),
            *HINTS,
        ),
    ),
)
