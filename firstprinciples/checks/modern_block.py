"""Checks for ``RMSNorm``, ``SwiGLU`` and ``GroupedQueryAttention``.

- ``RMSNorm(d_model, eps=1e-6)``: a parameter ``weight`` (d_model,), ones at first;
  forward(x) = x / sqrt(mean(x^2 over the last dim) + eps) * weight;
- ``SwiGLU(d_model, d_hidden)``: bias-free ``W1``, ``W3`` (d_model -> d_hidden) and ``W2``
  (d_hidden -> d_model); forward(x) = W2(silu(W1 x) * W3 x);
- ``GroupedQueryAttention(d_model, n_heads, n_kv_heads)``: bias-free ``W_q``, ``W_o`` (d_model ->
  d_model), ``W_k``, ``W_v`` (d_model -> n_kv_heads * d_k), d_k = d_model // n_heads; query head h
  reads key/value head h // (n_heads // n_kv_heads); forward(x, mask=None) returns
  (output (B, T, d_model), weights (B, n_heads, T, T)).

Decisions stated once:

- **Values**: the tolerances of ``_core`` (float32 atol 1e-5, rtol 1e-4; float64 1e-10, 1e-8): a
  correct answer only reorders sums of d_model (RMSNorm, SwiGLU) or d_k and T terms (attention),
  which moves float32 results by a few 1e-7 relative; every named mistake moves them by more than 1e-2
  on these inputs.
- **eps**: with eps = 1e-6 and entries of size 1, eps changes the result by 1e-6 relative, below the
  float32 tolerance. So the checks also use inputs of size 1e-3 (mean square 6e-6, comparable with
  the default eps) and larger eps (0.1, 0.5): there eps inside or outside the sqrt, or ignored,
  changes the output by more than 5%.
- **Seeded**: every module is built under a fixed seed (the caller's random state is left alone),
  then its parameters are overwritten with seeded random ones (RMSNorm's weight around 1, so that a
  forgotten weight shows), except in the worked example, which uses the module as built (weight ones).
- **Trusted comparisons** (hidden): ``torch.nn.RMSNorm`` with the same eps and weight;
  ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` with the same
  projections; and, with n_kv_heads == n_heads, the course's ``MultiHeadAttention`` given the same
  four matrices. The answers may not call any of them: ``torch.nn.RMSNorm`` / ``rms_norm``,
  ``scaled_dot_product_attention``, ``nn.MultiheadAttention`` and the course's references are
  forbidden (the check scores 0).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..examples.modern_block import WORKED_X, gqa_parameter_count
from ..reference import MultiHeadAttention, causal_mask
from ..reference import merge_heads as ref_merge_heads
from ..reference import scaled_dot_product_attention as ref_attention
from ..reference import split_heads as ref_split_heads
from ._core import Mistake, assert_matches, exact, with_diagnosis
from ._student import wrap_checks
from .block import _gradient_check as block_gradient_check
from .multihead import build, forbidden_in_forward, run_module

PIECES = ("RMSNorm", "SwiGLU", "GroupedQueryAttention", "MultiHeadAttention", "scaled_dot_product_attention",
          "split_heads", "merge_heads", "softmax", "FeedForward", "TransformerBlock")
FORBIDDEN_RMS = dict(torch_patterns=("rms_norm", "RMSNorm"), pieces=PIECES, what="RMSNorm")
FORBIDDEN_SWIGLU = dict(torch_patterns=(), pieces=PIECES, what="the SwiGLU feed-forward network")
FORBIDDEN_GQA = dict(torch_patterns=("scaled_dot_product_attention", "multi_head_attention", "MultiheadAttention"),
                     pieces=PIECES, what="grouped-query attention")

def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _count(module):
    return sum(p.numel() for p in module.parameters())


def _listing(module):
    return ", ".join(f"{k} {tuple(p.shape)}" for k, p in module.named_parameters()) or "no parameters"


# ====================================================================== RMSNorm
def reference_rmsnorm(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight, the mean over the last dimension."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rms_layer_norm(x, weight, eps):
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rms_eps_outside(x, weight, eps):
    return x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + eps) * weight


def _rms_wrong_dim(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-2, keepdim=True) + eps) * weight


def _rms_sum(x, weight, eps):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps) * weight


def _rms_no_sqrt(x, weight, eps):
    return x / (x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rms_no_weight(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rms_weight_added(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) + weight


def _rms_std(x, weight, eps):
    return x / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps) * weight


def _rms_eps_fixed(x, weight, eps):
    return reference_rmsnorm(x, weight, 1e-6)


RMS_MISTAKES = (
    Mistake("mean subtracted (LayerNorm)",
            "RMSNorm does not centre: divide x itself by sqrt(mean(x**2) + eps); subtracting the mean is LayerNorm.",
            _rms_layer_norm),
    Mistake("eps outside the sqrt",
            "add eps under the square root: x / torch.sqrt(mean(x**2) + eps), not x / (torch.sqrt(mean(x**2)) + eps).",
            _rms_eps_outside),
    Mistake("mean over the wrong dimension",
            "each token is normalised over its own features: take the mean over the last dimension "
            "(dim=-1, keepdim=True), not over the tokens.", _rms_wrong_dim),
    Mistake("sum instead of mean",
            "the root mean square divides the sum of squares by d_model: use .mean(dim=-1), not .sum(dim=-1).", _rms_sum),
    Mistake("no square root",
            "divide by the square root of the mean square (the RMS), not by the mean square itself.", _rms_no_sqrt),
    Mistake("weight not applied", "multiply the normalised x by self.weight (one scale per feature).", _rms_no_weight),
    Mistake("weight added", "self.weight is a scale: multiply by it, do not add it.", _rms_weight_added),
    Mistake("divided by the standard deviation",
            "the RMS is sqrt(mean(x**2)), around 0, not the standard deviation around the mean.", _rms_std),
    Mistake("eps argument ignored",
            "store the eps you are given (self.eps = eps) and use it; 1e-6 is only its default.", _rms_eps_fixed),
)


def rms_weight(module):
    w = getattr(module, "weight", None)
    if not isinstance(w, nn.Parameter):
        raise AssertionError(
            "RMSNorm should have a parameter named weight: self.weight = nn.Parameter(torch.ones(d_model)); "
            + ("it has none." if w is None else f"yours is a {type(w).__name__}, not an nn.Parameter.")
        )
    return w


def load_rms_weight(module, weight):
    w = rms_weight(module)
    if tuple(w.shape) != tuple(weight.shape):
        raise AssertionError(f"RMSNorm.weight has shape {tuple(w.shape)} but should have shape {tuple(weight.shape)} "
                             "(one scale per feature: (d_model,)).")
    with torch.no_grad():
        w.copy_(weight)


def _build_rms(cls, d, eps, dtype):
    kwargs = {} if eps is None else {"eps": eps}
    return build(cls, d, forbidden=FORBIDDEN_RMS, **kwargs).to(dtype)


def _compare_rms(cls, x, eps, weight=None, label=""):
    """``cls(d, eps=eps)`` (eps None: the default), weight loaded unless None, against the reference."""
    d, dtype = x.shape[-1], x.dtype
    module = _build_rms(cls, d, eps, dtype)
    if weight is not None:
        load_rms_weight(module, weight)
    (out,) = run_module(module, x, None, FORBIDDEN_RMS, names=("output",))
    w = torch.ones(d, dtype=dtype) if weight is None else weight
    e = 1e-6 if eps is None else eps
    label = label or (f"for x of shape {tuple(x.shape)}, {_dtype_name(dtype)}, eps={e:g}"
                      + (", weight as built (ones)" if weight is None else ", seeded weight"))
    with_diagnosis(lambda: assert_matches("output", out, reference_rmsnorm(x, w, e), context=label),
                   (out,), (x, w, e), RMS_MISTAKES, reference_rmsnorm)
    return module, out


def check_rmsnorm_structure(cls):
    """One parameter, ``weight`` of shape (d_model,), ones as built; d_model parameters in all.
    (One forward pass runs under the guard, so an answer calling torch's RMSNorm scores 0 here too.)"""
    for d in (4, 8, 64):
        m = build(cls, d, forbidden=FORBIDDEN_RMS)
        forbidden_in_forward(m, torch.randn(2, 3, d, generator=torch.Generator().manual_seed(d)), FORBIDDEN_RMS)
        w = rms_weight(m)
        if tuple(w.shape) != (d,):
            raise AssertionError(f"RMSNorm({d}).weight has shape {tuple(w.shape)} but should have shape ({d},).")
        if not torch.equal(w.detach(), torch.ones(d, dtype=w.dtype)):
            raise AssertionError(
                f"RMSNorm({d}).weight should start as ones (torch.ones(d_model)), so that a new layer only "
                f"normalises; yours starts as {[round(v, 4) for v in w.detach().flatten()[:4].tolist()]}...")
        if _count(m) != d:
            raise AssertionError(f"RMSNorm({d}) has {_count(m):,} parameters but should have d_model = {d} "
                                 f"(the weight only, no bias). Yours: {_listing(m)}.")


RMS_SHAPES = [(2, 5, 8), (3, 16), (2, 3, 4, 6), (1, 1, 4), (7,)]


def _rms_random_weight(g, d, dtype):
    return 1 + 0.5 * torch.randn(d, generator=g, dtype=dtype)


def check_rmsnorm_values(cls, full=True):
    """The worked example (1, 2, 2, 4) -> (0.4, 0.8, 0.8, 1.6) with the module as built; the same
    token times 1e-3, where the default eps = 1e-6 matters; a seeded random case; a larger eps.
    ``full``: also more shapes, float32 and float64, eps from 1e-6 to 0.5, a row of zeros,
    torch.nn.RMSNorm with the same eps and weight, and the gradients."""
    x = torch.tensor([WORKED_X], dtype=torch.float64)  # (1, 4)
    _compare_rms(cls, x, None, label="for the worked example x = [[1., 2., 2., 4.]] (RMS 2.5), weight as built")
    _compare_rms(cls, x * 1e-3, None, label="for x = 1e-3 * [[1., 2., 2., 4.]] with the default eps = 1e-6 "
                 "(the mean square 6.25e-6 is close to eps, so where eps goes shows)")
    g = torch.Generator().manual_seed(301)
    cases = [((2, 5, 8), torch.float32, None, 1.0), ((2, 5, 8), torch.float64, 0.5, 0.5)]
    if full:
        cases += [(s, dtype, eps, scale) for dtype in (torch.float32, torch.float64) for s in RMS_SHAPES
                  for eps, scale in ((None, 1.0), (1e-2, 0.1))]
        cases += [((3, 8), torch.float32, None, 1e-3), ((2, 6), torch.float64, 0.1, 1.0)]
    for shape, dtype, eps, scale in cases:
        x = torch.randn(*shape, generator=g, dtype=dtype) * scale
        weight = _rms_random_weight(g, shape[-1], dtype)
        module, out = _compare_rms(cls, x, eps, weight)
        if full:
            with torch.random.fork_rng(devices=[]):
                theirs = nn.RMSNorm(shape[-1], eps=1e-6 if eps is None else eps).to(dtype)
            with torch.no_grad():
                theirs.weight.copy_(weight)
                want = theirs(x)
            assert_matches("output", out, want, context=f"for x of shape {tuple(shape)}, {_dtype_name(dtype)} "
                           "(against torch.nn.RMSNorm with the same eps and weight)")
    if not full:
        return
    # A token of zeros: its mean square is 0, eps keeps the division finite and the output is 0.
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    x[1] = 0.0
    _compare_rms(cls, x, None, _rms_random_weight(g, 8, torch.float64),
                 label="for x of shape (3, 8) whose second row is all zeros (eps keeps 0 / sqrt(0 + eps) = 0)")
    # Gradients: reach x and the weight, and agree with finite differences.
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    module = _build_rms(cls, 5, 0.1, torch.float64)
    load_rms_weight(module, _rms_random_weight(g, 5, torch.float64))
    _gradient_check(module, x, FORBIDDEN_RMS, "RMSNorm")


def _gradient_check(module, x, forbidden, what, names=("output",), kwargs=None):
    """x is left untouched, then as the block's checks: the output requires grad, x and every
    parameter receive a gradient, autograd agrees with central differences (float64 ``assert_gradcheck``)."""
    kwargs = kwargs or {}
    run_module(module, x, kwargs.get("mask"), forbidden, names=names)  # x untouched
    block_gradient_check(module, x, kwargs, forbidden, names, what)


# ====================================================================== SwiGLU
SWIGLU_LAYERS = ("W1", "W3", "W2")


def reference_swiglu(x, W1, W3, W2):
    """W2(silu(W1 x) * W3 x), weights in nn.Linear's layout (a layer computes x @ W.T)."""
    return (F.silu(x @ W1.T) * (x @ W3.T)) @ W2.T


def _sw_swapped(x, W1, W3, W2):
    return (F.silu(x @ W3.T) * (x @ W1.T)) @ W2.T


def _sw_sigmoid(x, W1, W3, W2):
    return (torch.sigmoid(x @ W1.T) * (x @ W3.T)) @ W2.T


def _sw_relu(x, W1, W3, W2):
    return (torch.relu(x @ W1.T) * (x @ W3.T)) @ W2.T


def _sw_gelu(x, W1, W3, W2):
    return (F.gelu(x @ W1.T) * (x @ W3.T)) @ W2.T


def _sw_silu_of_product(x, W1, W3, W2):
    return F.silu((x @ W1.T) * (x @ W3.T)) @ W2.T


def _sw_w2_on_each(x, W1, W3, W2):
    return (F.silu(x @ W1.T) @ W2.T) * ((x @ W3.T) @ W2.T)


def _sw_no_w3(x, W1, W3, W2):
    return F.silu(x @ W1.T) @ W2.T


def _sw_sum(x, W1, W3, W2):
    return (F.silu(x @ W1.T) + (x @ W3.T)) @ W2.T


def _sw_silu_after(x, W1, W3, W2):
    return F.silu((F.silu(x @ W1.T) * (x @ W3.T)) @ W2.T)


SWIGLU_MISTAKES = (
    Mistake("gate and up projection swapped",
            "W1 is the gate: silu goes on W1(x), and W3(x) is what it multiplies: W2(silu(W1(x)) * W3(x)).", _sw_swapped),
    Mistake("sigmoid instead of silu",
            "silu(z) = z * sigmoid(z) (F.silu): the gate keeps its own value times its sigmoid.", _sw_sigmoid),
    Mistake("ReLU instead of silu", "the gate's activation is silu (F.silu), not ReLU.", _sw_relu),
    Mistake("GELU instead of silu", "the gate's activation is silu (F.silu), not GELU (that would be GeGLU).", _sw_gelu),
    Mistake("silu applied to the product",
            "apply silu to the gate W1(x) alone, then multiply by W3(x): W2(silu(W1(x)) * W3(x)).", _sw_silu_of_product),
    Mistake("W2 applied before the product",
            "multiply the two d_hidden-wide branches first, then project back with W2 once.", _sw_w2_on_each),
    Mistake("W3 not used", "the gate multiplies a second projection: W2(silu(W1(x)) * W3(x)).", _sw_no_w3),
    Mistake("branches added", "the gate multiplies W3(x) element by element (*), it is not added to it.", _sw_sum),
    Mistake("silu after W2 too", "W2's output is returned as it is; silu is applied to the gate only.", _sw_silu_after),
)


def _linear(module, name, owner, shape_text):
    layer = getattr(module, name, None)
    if not isinstance(layer, nn.Linear):
        raise AssertionError(
            f"{owner} should have an attribute {name} that is an nn.Linear ({shape_text}); "
            + ("it has none." if layer is None else f"yours is a {type(layer).__name__}."))
    return layer


def _swiglu_layer(module, name):
    text = {"W1": "nn.Linear(d_model, d_hidden, bias=False)", "W3": "nn.Linear(d_model, d_hidden, bias=False)",
            "W2": "nn.Linear(d_hidden, d_model, bias=False)"}[name]
    return _linear(module, name, "SwiGLU", text)


def random_swiglu_weights(g, d, h, dtype):
    """W1, W3 (h, d) with std 1/sqrt(d) and W2 (d, h) with std 1/sqrt(h): features of variance about 1."""
    W1 = torch.randn(h, d, generator=g, dtype=dtype) / math.sqrt(d)
    W3 = torch.randn(h, d, generator=g, dtype=dtype) / math.sqrt(d)
    W2 = torch.randn(d, h, generator=g, dtype=dtype) / math.sqrt(h)
    return W1, W3, W2


def load_swiglu(module, mats):
    with torch.no_grad():
        for name, W in zip(SWIGLU_LAYERS, mats):
            layer = _swiglu_layer(module, name)
            if tuple(layer.weight.shape) != tuple(W.shape):
                raise AssertionError(f"SwiGLU.{name}.weight has shape {tuple(layer.weight.shape)} but should have shape "
                                     f"{tuple(W.shape)}.")
            if layer.bias is not None:
                raise AssertionError(f"SwiGLU.{name} should have no bias: nn.Linear(..., bias=False).")
            layer.weight.copy_(W)


SWIGLU_SIZES = [(8, 16), (16, 40), (12, 32), (64, 172)]


def check_swiglu_structure(cls):
    """W1, W3: bias-free nn.Linear(d_model, d_hidden); W2: bias-free nn.Linear(d_hidden, d_model);
    three distinct layers, 3 * d_model * d_hidden parameters."""
    for d, h in SWIGLU_SIZES:
        m = build(cls, d, h, forbidden=FORBIDDEN_SWIGLU)
        forbidden_in_forward(m, torch.randn(2, 3, d, generator=torch.Generator().manual_seed(d)), FORBIDDEN_SWIGLU)
        layers = [_swiglu_layer(m, n) for n in SWIGLU_LAYERS]
        for name, layer in zip(SWIGLU_LAYERS, layers):
            want = (d, h) if name == "W2" else (h, d)
            if tuple(layer.weight.shape) != want:
                raise AssertionError(
                    f"For SwiGLU({d}, {h}), {name}.weight has shape {tuple(layer.weight.shape)} but should have shape "
                    f"{want}: {name} maps {want[1]} features to {want[0]}.")
            if layer.bias is not None:
                raise AssertionError(f"SwiGLU.{name} should have no bias: nn.Linear(..., bias=False).")
        if len({id(layer) for layer in layers}) < 3:
            raise AssertionError("W1, W3 and W2 should be three different nn.Linear layers.")
        if _count(m) != 3 * d * h:
            raise AssertionError(f"SwiGLU({d}, {h}) has {_count(m):,} parameters but should have 3 * d_model * d_hidden "
                                 f"= {3 * d * h:,}. Yours: {_listing(m)}.")


SWIGLU_SHAPES = [((2, 5, 8), 12), ((6, 16), 40), ((1, 1, 4), 4), ((2, 3, 4, 8), 20)]


def _compare_swiglu(cls, g, shape, h, dtype):
    d = shape[-1]
    mats = random_swiglu_weights(g, d, h, dtype)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    module = build(cls, d, h, forbidden=FORBIDDEN_SWIGLU).to(dtype)
    load_swiglu(module, mats)
    (out,) = run_module(module, x, None, FORBIDDEN_SWIGLU, names=("output",))
    label = f"for x of shape {tuple(shape)}, d_hidden={h}, {_dtype_name(dtype)}"
    with_diagnosis(lambda: assert_matches("output", out, reference_swiglu(x, *mats), context=label),
                   (out,), (x, *mats), SWIGLU_MISTAKES, reference_swiglu)


def check_swiglu_values(cls, full=True):
    """Seeded weights and input against W2(silu(W1 x) * W3 x): one float64 case (x (2, 5, 8),
    d_hidden 12). ``full``: more shapes, both dtypes, and the gradients."""
    g = torch.Generator().manual_seed(311)
    _compare_swiglu(cls, g, (2, 5, 8), 12, torch.float64)
    if not full:
        return
    for dtype in (torch.float32, torch.float64):
        for shape, h in SWIGLU_SHAPES:
            _compare_swiglu(cls, g, shape, h, dtype)
    module = build(cls, 4, 6, forbidden=FORBIDDEN_SWIGLU).to(torch.float64)
    load_swiglu(module, random_swiglu_weights(g, 4, 6, torch.float64))
    _gradient_check(module, torch.randn(2, 3, 4, generator=g, dtype=torch.float64), FORBIDDEN_SWIGLU, "SwiGLU")


# ====================================================================== GroupedQueryAttention
PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")


def _attend(Q, K, V, mask, scale, dim=-1):
    s = Q @ K.transpose(-2, -1) / scale
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=dim)
    return w @ V, w


def _gqa(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask=None, *, share="interleave", scale=None, use_mask=True,
         softmax_dim=-1, project_out=True):
    Q = ref_split_heads.__wrapped__(x @ W_q.T, n_heads)  # (B, H, T, d_k)
    K = ref_split_heads.__wrapped__(x @ W_k.T, n_kv_heads)  # (B, H_kv, T, d_k)
    V = ref_split_heads.__wrapped__(x @ W_v.T, n_kv_heads)
    group = n_heads // n_kv_heads
    if share == "interleave":
        K, V = K.repeat_interleave(group, dim=1), V.repeat_interleave(group, dim=1)
    else:  # head h reads kv head h % n_kv_heads
        K, V = K.repeat(1, group, 1, 1), V.repeat(1, group, 1, 1)
    scale = math.sqrt(Q.shape[-1]) if scale is None else scale
    out, w = _attend(Q, K, V, mask if use_mask else None, scale, softmax_dim)
    out = ref_merge_heads.__wrapped__(out)  # (B, T, d_model)
    return (out @ W_o.T if project_out else out), w


def reference_gqa(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask=None):
    """The reference module's computation, as a function of its weights."""
    Q = ref_split_heads(x @ W_q.T, n_heads)  # (B, H, T, d_k)
    K = ref_split_heads(x @ W_k.T, n_kv_heads).repeat_interleave(n_heads // n_kv_heads, dim=1)  # (B, H, T, d_k)
    V = ref_split_heads(x @ W_v.T, n_kv_heads).repeat_interleave(n_heads // n_kv_heads, dim=1)
    out, w = ref_attention(Q, K, V, mask)
    return ref_merge_heads(out) @ W_o.T, w


def _g(**options):
    def fn(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask=None):
        return _gqa(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask, **options)

    return fn


def _g_sqrt_d_model(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask=None):
    return _gqa(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask, scale=math.sqrt(x.shape[-1]))


def _g_averaged(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask=None):
    out, w = _gqa(x, W_q, W_k, W_v, W_o, n_heads, n_kv_heads, mask)
    return out, w.mean(dim=1)


GQA_MISTAKES = (
    Mistake("query head h reads key/value head h % n_kv_heads",
            "consecutive query heads share a key/value head: head h reads kv head h // (n_heads // n_kv_heads). "
            "Repeat each kv head with .repeat_interleave(group, dim=1), not .repeat(1, group, 1, 1).",
            _g(share="tile")),
    Mistake("scores not scaled", "divide the scores by sqrt(d_k), d_k = d_model // n_heads.", _g(scale=1.0)),
    Mistake("scaled by sqrt(d_model)", "each head compares vectors of width d_k = d_model // n_heads: divide by "
            "sqrt(d_k), not sqrt(d_model).", _g_sqrt_d_model),
    Mistake("mask ignored", "add the mask to the scores of every head before the softmax.", _g(use_mask=False)),
    Mistake("softmax over the wrong dimension",
            "each query's weights sum to 1 over the keys: softmax over the last dimension (dim=-1).", _g(softmax_dim=-2)),
    Mistake("W_o forgotten", "after merging the heads, apply the output projection self.W_o.", _g(project_out=False)),
    Mistake("weights averaged over heads", "return every query head's weights, shape (B, n_heads, T, T).", _g_averaged),
)


def _gqa_label(x, n_heads, n_kv, mask_name=""):
    s = f"for x of shape {tuple(x.shape)}, n_heads={n_heads}, n_kv_heads={n_kv}, {_dtype_name(x.dtype)}"
    return s + (f", {mask_name}" if mask_name else "")


def random_gqa_weights(g, d, n_heads, n_kv, dtype):
    """W_q, W_o (d, d) and W_k, W_v (n_kv * d_k, d), std 1/sqrt(d): projected features of variance about 1."""
    kv = n_kv * (d // n_heads)
    shapes = ((d, d), (kv, d), (kv, d), (d, d))
    return tuple(torch.randn(*s, generator=g, dtype=dtype) / math.sqrt(d) for s in shapes)


def _gqa_layer(module, name):
    text = "nn.Linear(d_model, n_kv_heads * d_k, bias=False)" if name in ("W_k", "W_v") else \
        "nn.Linear(d_model, d_model, bias=False)"
    return _linear(module, name, "GroupedQueryAttention", text)


def load_gqa_weights(module, mats):
    with torch.no_grad():
        for name, W in zip(PROJECTIONS, mats):
            layer = _gqa_layer(module, name)
            if tuple(layer.weight.shape) != tuple(W.shape):
                raise AssertionError(
                    f"GroupedQueryAttention.{name}.weight has shape {tuple(layer.weight.shape)} but should have shape "
                    f"{tuple(W.shape)}" + (" (n_kv_heads * d_k outputs: the keys and values of n_kv_heads heads only)."
                                           if name in ("W_k", "W_v") else "."))
            if layer.bias is not None:
                raise AssertionError(f"GroupedQueryAttention.{name} should have no bias: nn.Linear(..., bias=False).")
            layer.weight.copy_(W)


GQA_SIZES = [(16, 4, 2), (16, 4, 1), (16, 4, 4), (24, 6, 3), (32, 8, 2), (128, 8, 2)]


def check_gqa_structure(cls):
    """W_q, W_o: bias-free (d_model, d_model) nn.Linear; W_k, W_v: bias-free nn.Linear(d_model,
    n_kv_heads * d_k); 2 d_model^2 + 2 d_model n_kv_heads d_k parameters. Several sizes, multi-query
    (n_kv_heads = 1) and multi-head (n_kv_heads = n_heads) included."""
    for d, H, H_kv in GQA_SIZES:
        m = build(cls, d, H, H_kv, forbidden=FORBIDDEN_GQA)
        forbidden_in_forward(m, torch.randn(2, 3, d, generator=torch.Generator().manual_seed(d)), FORBIDDEN_GQA)
        kv = H_kv * (d // H)
        layers = [_gqa_layer(m, n) for n in PROJECTIONS]
        for name, layer in zip(PROJECTIONS, layers):
            want = (kv, d) if name in ("W_k", "W_v") else (d, d)
            if tuple(layer.weight.shape) != want:
                extra = (f": keys and values are computed for the n_kv_heads = {H_kv} shared heads only, "
                         f"n_kv_heads * d_k = {kv} features") if name in ("W_k", "W_v") else ""
                raise AssertionError(
                    f"For GroupedQueryAttention({d}, {H}, {H_kv}), {name}.weight has shape "
                    f"{tuple(layer.weight.shape)} but should have shape {want}{extra}.")
            if layer.bias is not None:
                raise AssertionError(f"GroupedQueryAttention.{name} should have no bias: nn.Linear(..., bias=False).")
        if len({id(layer) for layer in layers}) < 4:
            raise AssertionError("W_q, W_k, W_v and W_o should be four different nn.Linear layers.")
        want = gqa_parameter_count(d, H, H_kv)
        if _count(m) != want:
            raise AssertionError(
                f"GroupedQueryAttention({d}, {H}, {H_kv}) has {_count(m):,} parameters but should have "
                f"2 * d_model**2 + 2 * d_model * n_kv_heads * d_k = {want:,}. Yours: {_listing(m)}.")


def _torch_gqa(x, mats, n_heads, n_kv, mask):
    """torch's scaled_dot_product_attention(..., enable_gqa=True) on the same projections (outside the guard)."""
    W_q, W_k, W_v, W_o = mats
    Q = ref_split_heads.__wrapped__(x @ W_q.T, n_heads)
    K = ref_split_heads.__wrapped__(x @ W_k.T, n_kv)
    V = ref_split_heads.__wrapped__(x @ W_v.T, n_kv)
    out = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, enable_gqa=True)  # (B, H, T, d_k)
    return ref_merge_heads.__wrapped__(out) @ W_o.T


def _course_mha(x, mats, n_heads, mask):
    """The course's MultiHeadAttention given the same four matrices (n_kv_heads == n_heads)."""
    with torch.random.fork_rng(devices=[]):
        mha = MultiHeadAttention(x.shape[-1], n_heads).to(x.dtype)
    with torch.no_grad():
        for name, W in zip(PROJECTIONS, mats):
            getattr(mha, name).weight.copy_(W)
        return mha(x, mask)


def _compare_gqa(cls, g, B, T, d, H, H_kv, dtype, mask=None, mask_name="", trusted=False):
    mats = random_gqa_weights(g, d, H, H_kv, dtype)
    x = torch.randn(B, T, d, generator=g, dtype=dtype)
    module = build(cls, d, H, H_kv, forbidden=FORBIDDEN_GQA).to(dtype)
    load_gqa_weights(module, mats)
    out, w = run_module(module, x, mask, FORBIDDEN_GQA)
    exp_out, exp_w = reference_gqa(x, *mats, H, H_kv, mask)
    label = _gqa_label(x, H, H_kv, mask_name)

    def check():
        if mask is not None and tuple(w.shape) == tuple(exp_w.shape):
            hidden = torch.isneginf(mask).expand_as(w)
            above = w.detach()[hidden].abs().max().item() if hidden.any() else 0.0
            assert above == 0.0, (
                f"With the mask {label}, every weight where the mask is -inf must be exactly 0; yours reach "
                f"{exact(above)}. Is the mask added to the scores of every head before the softmax?")
        assert_matches("weights", w, exp_w, context=label)
        assert_matches("output", out, exp_out, context=label)
        if trusted:
            assert_matches("output", out, _torch_gqa(x, mats, H, H_kv, mask),
                           context=label + " (against torch's scaled_dot_product_attention with enable_gqa=True)")
            if H_kv == H:
                m_out, m_w = _course_mha(x, mats, H, mask)
                assert_matches("weights", w, m_w, context=label + " (against the course's MultiHeadAttention)")
                assert_matches("output", out, m_out, context=label + " (against the course's MultiHeadAttention)")

    with_diagnosis(check, (out, w), (x, *mats, H, H_kv, mask), GQA_MISTAKES, reference_gqa)
    return out, w


GQA_SHAPES = [  # (B, T, d_model, n_heads, n_kv_heads)
    (2, 5, 16, 4, 2),
    (1, 1, 8, 2, 1),
    (3, 6, 16, 4, 1),  # multi-query
    (2, 7, 24, 6, 3),
    (2, 4, 32, 8, 2),
    (2, 3, 8, 8, 8),  # d_k = 1, multi-head
    (2, 5, 12, 3, 3),  # multi-head
]


def check_gqa_values(cls, full=True):
    """Seeded weights and input, no mask, against the reference: x (2, 5, 16), 4 query heads sharing
    2 key/value heads, float64. ``full``: more shapes (multi-query, multi-head, heads of width 1), both
    dtypes, torch's scaled_dot_product_attention with enable_gqa=True, the course's MultiHeadAttention
    when n_kv_heads == n_heads, and the gradients."""
    g = torch.Generator().manual_seed(321)
    _compare_gqa(cls, g, 2, 5, 16, 4, 2, torch.float64)
    if not full:
        return
    for dtype in (torch.float32, torch.float64):
        for B, T, d, H, H_kv in GQA_SHAPES:
            _compare_gqa(cls, g, B, T, d, H, H_kv, dtype, trusted=True)
    for mask in (None, causal_mask(3, torch.float64)):
        module = build(cls, 8, 4, 2, forbidden=FORBIDDEN_GQA).to(torch.float64)
        load_gqa_weights(module, random_gqa_weights(g, 8, 4, 2, torch.float64))
        x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
        _gradient_check(module, x, FORBIDDEN_GQA, "GroupedQueryAttention", names=("output", "weights"),
                        kwargs={} if mask is None else {"mask": mask})


def check_gqa_masks(cls, full=True):
    """A causal mask (weights exactly 0 above the diagonal), x (2, 5, 16), 4 heads on 2, float64.
    ``full``: causal masks on more shapes and both dtypes, an additive (6, 6) bias and a padding mask,
    against the reference and torch's scaled_dot_product_attention with enable_gqa=True."""
    g = torch.Generator().manual_seed(331)
    _compare_gqa(cls, g, 2, 5, 16, 4, 2, torch.float64, causal_mask(5, torch.float64), "causal mask")
    if not full:
        return
    for dtype in (torch.float32, torch.float64):
        for B, T, d, H, H_kv in (GQA_SHAPES[2], GQA_SHAPES[3], GQA_SHAPES[6]):
            _compare_gqa(cls, g, B, T, d, H, H_kv, dtype, causal_mask(T, dtype), "causal mask", trusted=True)
        bias = torch.randn(6, 6, generator=g, dtype=dtype)
        _compare_gqa(cls, g, 2, 6, 16, 4, 2, dtype, bias, "an additive (6, 6) bias", trusted=True)
        pad = torch.zeros(2, 1, 1, 6, dtype=dtype)
        pad[1, ..., 4:] = float("-inf")
        _compare_gqa(cls, g, 2, 6, 16, 4, 2, dtype, pad, "a (2, 1, 1, 6) padding mask", trusted=True)


__all__ = [
    "FORBIDDEN_GQA", "FORBIDDEN_RMS", "FORBIDDEN_SWIGLU", "GQA_MISTAKES", "RMS_MISTAKES", "SWIGLU_MISTAKES",
    "check_gqa_masks", "check_gqa_structure", "check_gqa_values", "check_rmsnorm_structure", "check_rmsnorm_values",
    "check_swiglu_structure", "check_swiglu_values", "gqa_parameter_count", "load_gqa_weights", "load_rms_weight",
    "load_swiglu", "reference_gqa", "reference_rmsnorm", "reference_swiglu",
]


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
