"""Checks for ``FeedForward`` and ``TransformerBlock``.

- ``FeedForward(d_model)``: Linear(d_model, 4 d_model), GELU, Linear(4 d_model, d_model), with biases;
- ``TransformerBlock(d_model, n_heads, dropout=0.1)``: attributes ``ln1``, ``attn`` (the
  student's ``MultiHeadAttention``), ``ln2``, ``ffn``; pre-LN:
  ``a, w = attn(ln1(x), mask); x = x + drop(a); x = x + drop(ffn(ln2(x))); return x, w``.

Values are compared in eval mode, after seeded parameters have been copied into
the student's module (LayerNorm scales and shifts too, different for ln1 and
ln2, so that a shared or misplaced LayerNorm shows), against the reference and,
in the hidden checks, against ``nn.TransformerEncoderLayer(norm_first=True,
activation="gelu")`` given the same parameters. Dropout is checked by its
behaviour: off in eval mode, on in train mode, and with ``dropout=1.0`` in train
mode both branches vanish, so the block returns its input unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..guard import call_without
from ..reference import causal_mask, sinusoidal_encoding
from ._student import wrap_checks
from ._core import Mistake, assert_gradcheck, assert_matches, exact, fmt, unpack, with_diagnosis
from .multihead import build, forbidden_in_forward, linear_layer, load_mha_weights, reference_mha, run_module

TORCH_PATTERNS = (
    "TransformerEncoder",
    "transformer_encoder",
    "multi_head_attention",
    "scaled_dot_product_attention",
    "MultiheadAttention",
)
PIECES = ("TransformerBlock", "FeedForward", "MultiHeadAttention", "split_heads", "merge_heads",
          "scaled_dot_product_attention")
FORBIDDEN_FFN = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECES, what="the feed-forward network")
FORBIDDEN_BLOCK = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECES, what="the transformer block")

# The seed's sanity check: a block of width 128 with 4 heads has
# 4 * 128**2 (attention) + 8 * 128**2 + 5 * 128 (feed-forward) + 4 * 128 (two LayerNorms) parameters.
SEED_D_MODEL, SEED_N_HEADS, SEED_T = 128, 4, 16
SEED_PARAMETERS = 197_760


def block_parameter_count(d_model):
    return 12 * d_model**2 + 9 * d_model


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- reference computations
def reference_ffn(x, W1, b1, W2, b2):
    """GELU(x W1^T + b1) W2^T + b2, the reference FeedForward as a function of its parameters."""
    return F.gelu(x @ W1.T + b1) @ W2.T + b2  # (..., d_model)


def _ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)  # eps 1e-5, as nn.LayerNorm


def reference_block(x, P, n_heads, mask=None):
    """The reference pre-LN block (eval mode) as a function of its parameters
    P = (ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2)."""
    ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2 = P
    a, w = reference_mha(_ln(x, ln1_w, ln1_b), W_q, W_k, W_v, W_o, n_heads, mask)
    x = x + a
    x = x + reference_ffn(_ln(x, ln2_w, ln2_b), W1, b1, W2, b2)
    return x, w


# ---------------------------------------------------------------- mistakes: feed-forward
def _ffn_relu(x, W1, b1, W2, b2):
    return torch.relu(x @ W1.T + b1) @ W2.T + b2


def _ffn_tanh_gelu(x, W1, b1, W2, b2):
    return F.gelu(x @ W1.T + b1, approximate="tanh") @ W2.T + b2


def _ffn_no_activation(x, W1, b1, W2, b2):
    return (x @ W1.T + b1) @ W2.T + b2


def _ffn_gelu_at_the_end_too(x, W1, b1, W2, b2):
    return F.gelu(reference_ffn(x, W1, b1, W2, b2))


FFN_MISTAKES = (
    Mistake("ReLU instead of GELU", "the activation between the two layers is GELU (nn.GELU()), not ReLU.", _ffn_relu),
    Mistake(
        "tanh approximation of GELU",
        "use the exact GELU, nn.GELU() with its default approximate='none' (x times the normal CDF of x).",
        _ffn_tanh_gelu,
    ),
    Mistake("no activation", "put a GELU between the two linear layers; without it they collapse into one.", _ffn_no_activation),
    Mistake(
        "activation after the second layer too",
        "the GELU goes between the two linear layers only; the second layer's output is returned as it is.",
        _ffn_gelu_at_the_end_too,
    ),
)


# ---------------------------------------------------------------- mistakes: the block
def _attn(h, P, n_heads, mask):
    return reference_mha(h, *P[2:6], n_heads, mask)


def _ffn(h, P):
    return reference_ffn(h, *P[8:12])


def _ln1(x, P):
    return _ln(x, P[0], P[1])


def _ln2(x, P):
    return _ln(x, P[6], P[7])


def _b_post_ln(x, P, n_heads, mask=None):
    a, w = _attn(x, P, n_heads, mask)
    x = _ln1(x + a, P)
    return _ln2(x + _ffn(x, P), P), w


def _b_no_attn_residual(x, P, n_heads, mask=None):
    x, w = _attn(_ln1(x, P), P, n_heads, mask)
    return x + _ffn(_ln2(x, P), P), w


def _b_no_ffn_residual(x, P, n_heads, mask=None):
    a, w = _attn(_ln1(x, P), P, n_heads, mask)
    x = x + a
    return _ffn(_ln2(x, P), P), w


def _b_relu(x, P, n_heads, mask=None):
    a, w = _attn(_ln1(x, P), P, n_heads, mask)
    x = x + a
    return x + _ffn_relu(_ln2(x, P), *P[8:12]), w


def _b_ln1_twice(x, P, n_heads, mask=None):
    a, w = _attn(_ln1(x, P), P, n_heads, mask)
    x = x + a
    return x + _ffn(_ln1(x, P), P), w


def _b_ln2_twice(x, P, n_heads, mask=None):
    a, w = _attn(_ln2(x, P), P, n_heads, mask)
    x = x + a
    return x + _ffn(_ln2(x, P), P), w


def _b_mask_dropped(x, P, n_heads, mask=None):
    return reference_block(x, P, n_heads, None)


def _b_parallel(x, P, n_heads, mask=None):
    a, w = _attn(_ln1(x, P), P, n_heads, mask)
    return x + a + _ffn(_ln2(x, P), P), w


def _b_residual_from_normalised(x, P, n_heads, mask=None):
    h = _ln1(x, P)
    a, w = _attn(h, P, n_heads, mask)
    x = h + a
    h = _ln2(x, P)
    return h + _ffn(h, P), w


BLOCK_MISTAKES = (
    Mistake(
        "post-LN instead of pre-LN",
        "this block normalises before each sub-layer: x = x + drop(attn(ln1(x))), then "
        "x = x + drop(ffn(ln2(x))). Normalising after the residual addition is the original (post-LN) layout.",
        _b_post_ln,
    ),
    Mistake(
        "attention residual forgotten",
        "add the attention output to x (x = x + drop(a)) instead of replacing x with it.",
        _b_no_attn_residual,
    ),
    Mistake(
        "feed-forward residual forgotten",
        "add the feed-forward output to x (x = x + drop(ffn(ln2(x)))) instead of returning it alone.",
        _b_no_ffn_residual,
    ),
    Mistake("ReLU instead of GELU", "the feed-forward network's activation is GELU, not ReLU.", _b_relu),
    Mistake(
        "ln1 used before the feed-forward network too",
        "each sub-layer has its own LayerNorm: ln1 before attention, ln2 before the feed-forward network.",
        _b_ln1_twice,
    ),
    Mistake(
        "ln2 used before attention too (one LayerNorm shared)",
        "each sub-layer has its own LayerNorm with its own parameters: ln1 before attention, ln2 before "
        "the feed-forward network. Are ln1 and ln2 the same module?",
        _b_ln2_twice,
    ),
    Mistake("mask not passed to attention", "call self.attn(self.ln1(x), mask): the mask must reach the attention.", _b_mask_dropped),
    Mistake(
        "feed-forward applied to the block's input",
        "the feed-forward network reads x after the attention residual has been added: "
        "x = x + drop(a) first, then x = x + drop(ffn(ln2(x))).",
        _b_parallel,
    ),
    Mistake(
        "residual taken from the normalised input",
        "the residual path carries x itself, not ln1(x): x = x + drop(attn(ln1(x))), not ln1(x) + ...",
        _b_residual_from_normalised,
    ),
)


# ---------------------------------------------------------------- structure helpers
def ffn_linears(module, owner="FeedForward"):
    layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if len(layers) != 2:
        raise AssertionError(
            f"{owner} should contain exactly two nn.Linear layers (d_model -> 4 * d_model -> d_model); "
            f"it has {len(layers)}."
        )
    up, down = layers
    if up.out_features < up.in_features and down.out_features > down.in_features:
        up, down = down, up  # registered in the other order
    return up, down


def _check_ffn_layers(module, d_model, owner):
    l1, l2 = ffn_linears(module, owner)
    if (l1.in_features, l1.out_features) != (d_model, 4 * d_model):
        wide = " (the hidden layer should be 4 * d_model wide, not d_model)" if l1.out_features == d_model else ""
        raise AssertionError(
            f"For d_model={d_model}, the first Linear of {owner} maps {l1.in_features} -> {l1.out_features} features "
            f"but should map {d_model} -> {4 * d_model}{wide}."
        )
    if (l2.in_features, l2.out_features) != (4 * d_model, d_model):
        raise AssertionError(
            f"For d_model={d_model}, the second Linear of {owner} maps {l2.in_features} -> {l2.out_features} "
            f"features but should map {4 * d_model} -> {d_model}."
        )
    for i, layer in enumerate((l1, l2)):
        if layer.bias is None:
            raise AssertionError(f"The {'first' if i == 0 else 'second'} Linear of {owner} should have a bias (the default).")
    return l1, l2


def _count(module):
    return sum(p.numel() for p in module.parameters())


def _listing(module):
    return ", ".join(f"{k} {tuple(p.shape)}" for k, p in module.named_parameters())


def random_ffn_parameters(g, d_model, dtype):
    """W1 (4d, d), b1, W2 (d, 4d), b2: each layer's outputs have variance about 1 for unit inputs."""
    W1 = torch.randn(4 * d_model, d_model, generator=g, dtype=dtype) / math.sqrt(d_model)
    b1 = 0.5 * torch.randn(4 * d_model, generator=g, dtype=dtype)
    W2 = torch.randn(d_model, 4 * d_model, generator=g, dtype=dtype) / math.sqrt(4 * d_model)
    b2 = 0.5 * torch.randn(d_model, generator=g, dtype=dtype)
    return W1, b1, W2, b2


def load_ffn(module, params, owner="FeedForward"):
    W1, b1, W2, b2 = params
    l1, l2 = ffn_linears(module, owner)
    with torch.no_grad():
        for layer, W, b in ((l1, W1, b1), (l2, W2, b2)):
            if tuple(layer.weight.shape) != tuple(W.shape) or layer.bias is None:
                raise AssertionError(
                    f"{owner}'s Linear layers should be Linear(d_model, 4 * d_model) and Linear(4 * d_model, d_model), "
                    f"with biases; one has weight {tuple(layer.weight.shape)}"
                    + ("" if layer.bias is not None else " and no bias") + "."
                )
            layer.weight.copy_(W)
            layer.bias.copy_(b)


def random_block_parameters(g, d_model, dtype):
    """P = (ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2), seeded.

    The LayerNorm scales and shifts are random (around 1 and 0) and differ between
    ln1 and ln2, so that a LayerNorm used in the wrong place changes the output.
    """
    def ln():
        return (1 + 0.3 * torch.randn(d_model, generator=g, dtype=dtype), 0.3 * torch.randn(d_model, generator=g, dtype=dtype))

    ln1 = ln()
    mha = tuple(torch.randn(d_model, d_model, generator=g, dtype=dtype) / math.sqrt(d_model) for _ in range(4))
    ln2 = ln()
    return (*ln1, *mha, *ln2, *random_ffn_parameters(g, d_model, dtype))


def _layer_norm(module, name):
    ln = getattr(module, name, None)
    if not isinstance(ln, nn.LayerNorm):
        raise AssertionError(
            f"TransformerBlock should have an attribute {name} that is an nn.LayerNorm(d_model); "
            + ("it has none." if ln is None else f"yours is a {type(ln).__name__}.")
        )
    return ln


def load_block(module, P):
    ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, *ffn = P
    attn = getattr(module, "attn", None)
    if attn is None:
        raise AssertionError("TransformerBlock should have an attribute attn: your MultiHeadAttention(d_model, n_heads).")
    ffn_module = getattr(module, "ffn", None)
    if ffn_module is None:
        raise AssertionError("TransformerBlock should have an attribute ffn: your FeedForward(d_model).")
    with torch.no_grad():
        for name, w, b in (("ln1", ln1_w, ln1_b), ("ln2", ln2_w, ln2_b)):
            ln = _layer_norm(module, name)
            if ln.weight is None or tuple(ln.weight.shape) != tuple(w.shape):
                raise AssertionError(f"{name} should be nn.LayerNorm(d_model), with a scale and a shift of d_model entries.")
            ln.weight.copy_(w)
            ln.bias.copy_(b)
    load_mha_weights(attn, (W_q, W_k, W_v, W_o), owner="TransformerBlock.attn")
    load_ffn(ffn_module, ffn, owner="TransformerBlock.ffn")


def build_block(cls, d_model, n_heads, P, **kwargs):
    """Build the student's block (seeded, under the guard), load P, switch to eval mode."""
    module = build(cls, d_model, n_heads, forbidden=FORBIDDEN_BLOCK, **kwargs).to(P[0].dtype)
    load_block(module, P)
    return module.eval()


def _torch_block(x, P, n_heads, mask):
    """nn.TransformerEncoderLayer (pre-LN, GELU, no dropout) with the same parameters, outside the guard."""
    d_model = x.shape[-1]
    ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2 = P
    with torch.random.fork_rng(devices=[]):
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        ).to(x.dtype).eval()
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(torch.cat([W_q, W_k, W_v]))
        layer.self_attn.in_proj_bias.zero_()
        layer.self_attn.out_proj.weight.copy_(W_o)
        layer.self_attn.out_proj.bias.zero_()
        for lin, W, b in ((layer.linear1, W1, b1), (layer.linear2, W2, b2)):
            lin.weight.copy_(W)
            lin.bias.copy_(b)
        for norm, w, b in ((layer.norm1, ln1_w, ln1_b), (layer.norm2, ln2_w, ln2_b)):
            norm.weight.copy_(w)
            norm.bias.copy_(b)
        # A float mask with -inf entries; is_causal is left False so that the mask itself is used.
        return layer(x, src_mask=mask)


# ---------------------------------------------------------------- feed-forward checks
def check_ffn_structure(cls):
    """Two Linear layers d_model -> 4 d_model -> d_model with biases: 8 d_model**2 + 5 d_model parameters."""
    for d_model in (8, 16, 128):
        m = build(cls, d_model, forbidden=FORBIDDEN_FFN)
        forbidden_in_forward(m, torch.randn(2, 3, d_model, generator=torch.Generator().manual_seed(d_model)), FORBIDDEN_FFN)
        _check_ffn_layers(m, d_model, "FeedForward")
        want = 8 * d_model**2 + 5 * d_model
        if _count(m) != want:
            raise AssertionError(
                f"FeedForward({d_model}) has {_count(m):,} parameters but should have 8 * d_model**2 + 5 * d_model "
                f"= {want:,} (two Linear layers with biases, nothing else). Yours: {_listing(m)}."
            )


def _compare_ffn(cls, g, shape, dtype):
    d_model = shape[-1]
    params = random_ffn_parameters(g, d_model, dtype)
    x = torch.randn(*shape, generator=g, dtype=dtype)
    module = build(cls, d_model, forbidden=FORBIDDEN_FFN).to(dtype).eval()
    load_ffn(module, params)
    (out,) = run_module(module, x, None, FORBIDDEN_FFN, names=("output",))
    label = f"for x of shape {tuple(shape)}, {_dtype_name(dtype)}"
    with_diagnosis(
        lambda: assert_matches("output", out, reference_ffn(x, *params), context=label),
        (out,), (x, *params), FFN_MISTAKES, reference_ffn,
    )


FFN_SHAPES = [(2, 5, 8), (1, 1, 4), (3, 4, 16), (6, 12)]


def check_ffn_values(cls, full=True):
    """Seeded parameters and inputs against the reference; ``full=False``: one float64 case."""
    g = torch.Generator().manual_seed(201)
    if not full:
        _compare_ffn(cls, g, (2, 5, 8), torch.float64)
        return
    for dtype in (torch.float32, torch.float64):
        for shape in FFN_SHAPES:
            _compare_ffn(cls, g, shape, dtype)


def _gradient_check(module, x, kwargs, forbidden, names, what):
    """Output requires grad, every parameter and x receive a gradient, and autograd agrees with
    central differences with respect to x (float64 ``assert_gradcheck``)."""
    leaf = x.clone().requires_grad_(True)
    out = unpack(call_without(module, (leaf,), kwargs, **forbidden), names)[0]
    if not out.requires_grad:
        raise AssertionError(
            f"The output of {what} does not require grad although x does: gradients cannot flow back. Avoid "
            ".detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside forward."
        )
    named = [("x", leaf)] + list(module.named_parameters())
    grads = torch.autograd.grad(out.sum(), [t for _, t in named], allow_unused=True)
    for (name, _), gr in zip(named, grads):
        if gr is None:
            raise AssertionError(f"No gradient reaches {name}: is it used in forward (and not detached)?")

    def output_only(inp):
        return unpack(call_without(module, (inp,), kwargs, **forbidden), names)[0]

    assert_gradcheck(output_only, (leaf,), what=f"the output of {what} with respect to x", fast=True)


def check_ffn_gradients_and_inputs(cls):
    """Gradients reach x and the four parameters; the input is left untouched."""
    g = torch.Generator().manual_seed(203)
    params = random_ffn_parameters(g, 4, torch.float64)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    module = build(cls, 4, forbidden=FORBIDDEN_FFN).to(torch.float64).eval()
    load_ffn(module, params)
    run_module(module, x, None, FORBIDDEN_FFN, names=("output",))  # also checks that x is untouched
    _gradient_check(module, x, {}, FORBIDDEN_FFN, ("output",), "FeedForward")


# ---------------------------------------------------------------- block checks
def check_block_structure(cls):
    """ln1, attn, ln2, ffn; two distinct LayerNorms; the seed's parameter count (197,760 for 128 / 4).
    (One forward pass runs under the guard, so that an answer calling PyTorch's layers scores 0 here too.)"""
    for d_model, n_heads in [(SEED_D_MODEL, SEED_N_HEADS), (32, 4), (16, 2)]:
        m = build(cls, d_model, n_heads, forbidden=FORBIDDEN_BLOCK)
        x = torch.randn(2, 3, d_model, generator=torch.Generator().manual_seed(d_model))
        forbidden_in_forward(m.eval(), x, FORBIDDEN_BLOCK)
        ln1, ln2 = _layer_norm(m, "ln1"), _layer_norm(m, "ln2")
        if ln1 is ln2:
            raise AssertionError(
                "ln1 and ln2 are the same module: each sub-layer needs its own LayerNorm (two nn.LayerNorm(d_model))."
            )
        for name, ln in (("ln1", ln1), ("ln2", ln2)):
            if tuple(ln.normalized_shape) != (d_model,) or ln.weight is None:
                raise AssertionError(f"{name} should be nn.LayerNorm(d_model) = nn.LayerNorm({d_model}).")
        attn = getattr(m, "attn", None)
        if attn is None:
            raise AssertionError("TransformerBlock should have an attribute attn: your MultiHeadAttention(d_model, n_heads).")
        for name in ("W_q", "W_k", "W_v", "W_o"):
            layer = linear_layer(attn, name, owner="TransformerBlock.attn")
            if tuple(layer.weight.shape) != (d_model, d_model) or layer.bias is not None:
                raise AssertionError(f"TransformerBlock.attn.{name} should be nn.Linear(d_model, d_model, bias=False).")
        ffn = getattr(m, "ffn", None)
        if ffn is None:
            raise AssertionError("TransformerBlock should have an attribute ffn: your FeedForward(d_model).")
        _check_ffn_layers(ffn, d_model, "TransformerBlock.ffn")
        want = block_parameter_count(d_model)
        if _count(m) != want:
            raise AssertionError(
                f"TransformerBlock({d_model}, {n_heads}) has {_count(m):,} parameters but should have {want:,}: "
                f"attention 4 * d_model**2 = {4 * d_model**2:,}, feed-forward 8 * d_model**2 + 5 * d_model = "
                f"{8 * d_model**2 + 5 * d_model:,}, two LayerNorms 4 * d_model = {4 * d_model:,}. Yours: {_listing(m)}."
            )


def _run_block(module, x, mask):
    out, w = run_module(module, x, mask, FORBIDDEN_BLOCK)
    again = run_module(module, x, mask, FORBIDDEN_BLOCK)[0]
    if not torch.equal(out, again):
        raise AssertionError(
            "In eval mode your block gives different outputs for the same input: dropout must do nothing in eval "
            "mode. Use nn.Dropout (it follows module.train() / module.eval()), or pass training=self.training "
            "to F.dropout."
        )
    return out, w


def _compare_block(cls, g, B, T, d_model, n_heads, dtype, mask=None, mask_name="", against_torch=False, x=None):
    P = random_block_parameters(g, d_model, dtype)
    if x is None:
        x = torch.randn(B, T, d_model, generator=g, dtype=dtype)
    module = build_block(cls, d_model, n_heads, P)
    out, w = _run_block(module, x, mask)
    exp_out, exp_w = reference_block(x, P, n_heads, mask)
    label = f"for x of shape {tuple(x.shape)}, n_heads={n_heads}, {_dtype_name(dtype)}" + (f", {mask_name}" if mask_name else "")

    def check():
        assert_matches("output", out, exp_out, context=label)
        assert_matches("weights", w, exp_w, context=label)
        if against_torch:
            assert_matches("output", out, _torch_block(x, P, n_heads, mask), context=label + " (against nn.TransformerEncoderLayer)")

    with_diagnosis(check, (out, w), (x, P, n_heads, mask), BLOCK_MISTAKES, reference_block)
    return x, out, w


BLOCK_SHAPES = [  # (B, T, d_model, n_heads)
    (2, 5, 16, 4),
    (1, 1, 8, 2),
    (3, 6, 32, 4),
    (2, 7, 24, 3),
]


def check_block_against_reference(cls, full=True):
    """Eval mode, seeded parameters: against the reference and, when ``full``, against
    ``nn.TransformerEncoderLayer`` for several shapes, both dtypes, with and without a causal mask.
    ``full=False`` runs one float64 case without a mask against the reference only."""
    g = torch.Generator().manual_seed(211)
    if not full:
        _compare_block(cls, g, 2, 5, 16, 4, torch.float64)
        return
    for dtype in (torch.float32, torch.float64):
        for B, T, d_model, n_heads in BLOCK_SHAPES:
            _compare_block(cls, g, B, T, d_model, n_heads, dtype, against_torch=True)
            _compare_block(cls, g, B, T, d_model, n_heads, dtype, causal_mask(T, dtype), "causal mask", against_torch=True)


def check_block_causal(cls):
    """The seed's sanity check: d_model 128, 4 heads, 2 sequences of 16 positions with sinusoidal
    positions added and a causal mask. Shapes, weights exactly 0 above the diagonal, rows summing to
    1, and output and weights equal to the reference's."""
    g = torch.Generator().manual_seed(213)
    B, T, d, H = 2, SEED_T, SEED_D_MODEL, SEED_N_HEADS
    x = torch.randn(B, T, d, generator=g) + sinusoidal_encoding(T, d)
    P = random_block_parameters(g, d, torch.float32)
    module = build_block(cls, d, H, P)
    mask = causal_mask(T)
    out, w = _run_block(module, x, mask)
    label = "in the seed's sanity check (d_model 128, 4 heads, T 16, causal mask)"

    def check():
        if tuple(out.shape) != (B, T, d) or tuple(w.shape) != (B, H, T, T):
            raise AssertionError(
                f"Output and weights {label} should have shapes {(B, T, d)} and {(B, H, T, T)}; "
                f"got {tuple(out.shape)} and {tuple(w.shape)}."
            )
        above = torch.triu(w.detach(), diagonal=1).abs().max().item()
        assert above == 0.0, (
            f"With the causal mask every weight above the diagonal must be exactly 0; yours reach {exact(above)}. "
            "Does the block pass the mask on to self.attn?"
        )
        # float32 sums of 16 weights are exact to about 1e-6.
        worst = (w.detach().double().sum(-1) - 1).abs().max().item()
        assert worst <= 1e-5, f"Each row of the weights should sum to 1; one is off by {fmt(worst)}."
        exp_out, exp_w = reference_block(x, P, H, mask)
        assert_matches("output", out, exp_out, context=label)
        assert_matches("weights", w, exp_w, context=label)

    with_diagnosis(check, (out, w), (x, P, H, mask), BLOCK_MISTAKES, reference_block)


# Dropout's distribution, on the feed-forward branch alone: with W_o = 0 the attention branch is
# 0, with the feed-forward's last layer 0 and its bias 1 that branch is 1 everywhere, so the
# block's output minus its input is what dropout made of a tensor of ones: each entry 0 with
# probability p, else 1 / (1 - p). On 4 x 64 x 16 = 4,096 entries at p = 0.5, the fraction of
# zeros is within 0.05 of p except with probability below 1e-9 (0.05 is 6.4 standard deviations).
DROPOUT_P, DROPOUT_SHAPE, DROPOUT_SLACK = 0.5, (4, 64, 16), 0.05


def dropout_distribution(module, x, P, seed: int) -> tuple[float, list]:
    """(fraction of zeros, the distinct other values) of what the block's dropout made of a branch
    of ones (see ``DROPOUT_P``): ``module`` is the block built with dropout=DROPOUT_P, ``P`` its
    parameters (``random_block_parameters``), loaded here with that branch's changes."""
    P = list(P)
    P[5] = torch.zeros_like(P[5])  # W_o: the attention branch is 0
    P[10], P[11] = torch.zeros_like(P[10]), torch.ones_like(P[11])  # W2 = 0, b2 = 1: the branch is 1
    load_block(module, P)
    module.train()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = module(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    d = (torch.as_tensor(out).detach().double() - x.double()).flatten()
    zero = d.abs() < 1e-9
    survivors = sorted({round(v, 6) for v in d[~zero].tolist()})[:5]
    return float(zero.double().mean()), survivors


def dropout_is_inverted(fraction: float, survivors: list) -> bool:
    """Whether ``dropout_distribution`` is inverted dropout's: zeros about p of the time, every
    other entry 1 / (1 - p)."""
    keep = 1 / (1 - DROPOUT_P)
    return abs(fraction - DROPOUT_P) <= DROPOUT_SLACK and all(abs(v - keep) <= 1e-6 for v in survivors)


def check_block_dropout(cls):
    """Dropout is off in eval mode, on in train mode, and sits on the two branches only: with
    dropout=1.0 in train mode both branches are zeroed, so the block returns x unchanged."""
    g = torch.Generator().manual_seed(217)
    d_model, n_heads, B, T = 16, 4, 2, 5
    P = random_block_parameters(g, d_model, torch.float64)
    x = torch.randn(B, T, d_model, generator=g, dtype=torch.float64)
    expected, _ = reference_block(x, P, n_heads)

    module = build_block(cls, d_model, n_heads, P, dropout=0.5)  # eval mode
    out, _ = _run_block(module, x, None)
    assert_matches("output", out, expected, context="of TransformerBlock(16, 4, dropout=0.5) in eval mode (dropout off)")

    module.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        train_out, _ = run_module(module, x, None, FORBIDDEN_BLOCK)
    if (train_out.detach() - expected).abs().max().item() < 1e-3:
        raise AssertionError(
            "In train mode, TransformerBlock(16, 4, dropout=0.5) gives the same output as in eval mode: dropout is "
            "not applied. Build self.drop = nn.Dropout(dropout) and apply it to each branch's output before adding it to x."
        )

    module = build_block(cls, d_model, n_heads, P, dropout=1.0).train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dropped, _ = run_module(module, x, None, FORBIDDEN_BLOCK)
    try:
        assert_matches("output", dropped, x, context="of TransformerBlock(16, 4, dropout=1.0) in train mode")
    except AssertionError as err:
        raise AssertionError(
            f"{err}\nWith dropout=1.0 in train mode, dropout zeroes both branches entirely, so the block should "
            "return its input unchanged: x + 0 + 0. Apply dropout to the attention output and to the feed-forward "
            "output only (x = x + self.drop(a)), never to x itself or to the sum, and use the dropout argument."
        ) from None

    x = torch.randn(*DROPOUT_SHAPE, generator=g, dtype=torch.float64)
    P = random_block_parameters(g, DROPOUT_SHAPE[-1], torch.float64)
    module = build_block(cls, DROPOUT_SHAPE[-1], n_heads, P, dropout=DROPOUT_P)
    fraction, survivors = dropout_distribution(module, x, P, seed=1)
    if not dropout_is_inverted(fraction, survivors):
        shown = ", ".join(f"{v:g}" for v in survivors) or "none"
        raise AssertionError(
            f"With dropout={DROPOUT_P} in train mode, a feed-forward branch that outputs 1 everywhere (W_o = 0, the "
            "last layer's weight 0 and bias 1) should come out of dropout as 0 in about half of the entries and as "
            f"1 / (1 - p) = {1 / (1 - DROPOUT_P):g} in the others (inverted dropout: the survivors are scaled up so "
            f"that the expected value is unchanged). Your block gives 0 in {fraction:.1%} of the "
            f"{x.numel():,} entries and these other values: {shown}. Use nn.Dropout(dropout) or F.dropout(t, p, "
            "self.training) on each branch's output."
        )


def check_block_gradients_and_inputs(cls, full=True):
    """Eval mode, float64: gradients reach x and every parameter and agree with finite differences;
    the input is left untouched. ``full=False`` skips the masked case."""
    g = torch.Generator().manual_seed(219)
    for mask in (None, causal_mask(3, torch.float64)) if full else (None,):
        P = random_block_parameters(g, 8, torch.float64)
        x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
        module = build_block(cls, 8, 2, P)
        run_module(module, x, mask, FORBIDDEN_BLOCK)  # also checks that x is untouched
        kwargs = {} if mask is None else {"mask": mask}
        _gradient_check(module, x, kwargs, FORBIDDEN_BLOCK, ("output", "weights"), "TransformerBlock")


__all__ = [
    "BLOCK_MISTAKES",
    "FFN_MISTAKES",
    "SEED_PARAMETERS",
    "block_parameter_count",
    "check_block_against_reference",
    "check_block_causal",
    "check_block_dropout",
    "check_block_gradients_and_inputs",
    "check_block_structure",
    "check_ffn_gradients_and_inputs",
    "check_ffn_structure",
    "check_ffn_values",
    "reference_block",
    "reference_ffn",
]


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
