"""FeedForward and TransformerBlock: the exercise's tests, declared once.

- ``FeedForward(d_model)``: an ``nn.Module`` with two ``nn.Linear`` layers with biases,
  d_model -> 4 d_model -> d_model, and an exact GELU between them; ``forward(x)`` keeps x's shape;
- ``TransformerBlock(d_model, n_heads, dropout=0.1)``: attributes ``ln1``, ``attn`` (the student's
  ``MultiHeadAttention``), ``ln2``, ``ffn`` (their ``FeedForward``); pre-LN:
  ``a, w = attn(ln1(x), mask); x = x + drop(a); x = x + drop(ffn(ln2(x))); return x, w``.

Decisions stated once:

- Both pieces are classes: the adapters build them with the case's sizes (``multi_head_attention.build``:
  a fixed seed, the caller's random state left alone), report their structure as plain data, or load
  the case's seeded weights into their parameters by name and call them. The names: ``ln1.weight``,
  ``ln1.bias``, ``attn.W_q.weight`` ... ``attn.W_o.weight``, ``ln2.weight``, ``ln2.bias`` and, for
  the feed-forward network, ``up.weight``, ``up.bias``, ``down.weight``, ``down.bias`` (``ffn.`` in
  front inside the block): the network's two nn.Linear layers are found wherever it keeps them (the
  one that widens is ``up``), since the notebook leaves their names to the student. The LayerNorm
  scales and shifts are random (around 1 and 0) and differ between ln1 and ln2, so that a LayerNorm
  used in the wrong place changes the output.
- Values are compared in eval mode (the block is called twice: dropout must do nothing there), with
  the defaults of ``grading.compare``: LayerNorm, a d_model-term attention and a 4 d_model-term
  feed-forward network in float32 move a correct answer by a few units of 1e-7 relative.
- The old hidden comparison with ``nn.TransformerEncoderLayer(norm_first=True, activation="gelu")``
  is the comparison with the reference, which ``tests/material/test_reference_modules.py`` holds equal to it.
- ``test_block_dropout`` judges dropout by its behaviour (issue 38), with dropout=0.5 (and, secretly,
  0.25): off in eval mode (the output is the reference's), on in train mode (the output differs),
  on the two branches only (with dropout=1.0 in train mode the block returns x), and its
  distribution: with W_o = 0 the attention branch is 0, with the feed-forward network's last layer 0
  and its bias 1 that branch is 1 everywhere, so the block's output minus its input is what dropout
  made of a tensor of ones: each entry 0 with probability p, else 1 / (1 - p). On 4 x 64 x 16 =
  4,096 entries the fraction of zeros is within ``DROPOUT_SLACK`` = 0.05 of p except with
  probability below 1e-9 (0.05 is 6.4 standard deviations at p = 0.5, 7.4 at p = 0.25): a right
  answer fails this test falsely with probability below 1e-9 per case. A "dropout" that only scales
  by (1 - p) gives no zeros, one that zeroes without scaling gives survivors of 1: both fail.
- The gradient tests judge that honest gradients reach x and every parameter (against finite
  differences of the answer's own output, x and the weights moving together), not the values:
  the other tests do. ``test_feed_forward`` grades structure, values and gradients in one cell:
  its gradient cases are compared with the reference's gradients (values).
- Every test fails an answer that calls PyTorch's transformer layers or attention, or the course's
  pieces; every test that calls forward, an answer that changes its input, its mask or its weights.
- The capstone runs recaps of both pieces (``exercises/capstone.py``, from the
  visible cases of ``FFN_RECAP`` and ``BLOCK_RECAP``); the re-check judges its cells by ``elsewhere``
  below (``recap_feed_forward``, ``test_transformer_block``; its cells that only pass
  TransformerBlock along as a part of the model judge no case of it: ``AS_A_PART``).
- This notebook's recaps of the earlier pieces are those exercises' (``exercises.recap``).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import Exercise, Mistake, Test, attention, case, causal_mask_array, multi_head_attention as mha, recap
from .adapters import _weighted, FD_STEP, grad_case, honest_gradients
from .multi_head_attention import build, describe_layer, output_order, weights_left_alone

NAME = "transformer_block"
TORCH_PATTERNS = ("TransformerEncoder", "transformer_encoder", "multi_head_attention", "scaled_dot_product_attention",
                  "MultiheadAttention")
PIECE_NAMES = ("TransformerBlock", "FeedForward", "MultiHeadAttention", "split_heads", "merge_heads",
               "scaled_dot_product_attention")

FFN = "test_feed_forward"
STRUCTURE, VALUES, CAUSAL, DROPOUT, GRADS = ("test_block_structure", "test_block_against_reference",
                                             "test_block_causal", "test_block_dropout",
                                             "test_block_gradients_and_inputs")
# the capstone's cells: its recaps, and the cells that pass TransformerBlock along
RECAP_FFN, RECAP_BLOCK = "recap_feed_forward", "test_transformer_block"
AS_A_PART = ("test_model_structure", "test_trained", "test_resolves_it")

FFN_PARAMS = ("up.weight", "up.bias", "down.weight", "down.bias")
ATTN_PARAMS = tuple(f"attn.{n}" for n in mha.PARAMS)
BLOCK_PARAMS = ("ln1.weight", "ln1.bias", *ATTN_PARAMS, "ln2.weight", "ln2.bias", *(f"ffn.{n}" for n in FFN_PARAMS))

# The seed's sanity check: a block of width 128 with 4 heads and 16 positions.
SEED_D_MODEL, SEED_N_HEADS, SEED_T = 128, 4, 16
# dropout's distribution (see the docstring)
DROPOUT_P, DROPOUT_SHAPE, DROPOUT_SLACK = 0.5, (4, 64, 16), 0.05


def block_parameter_count(d_model):
    """Attention 4 d**2, feed-forward 8 d**2 + 5 d, two LayerNorms 4 d."""
    return 12 * d_model**2 + 9 * d_model


# ================================================================ correct pieces, and the mistakes
class _FeedForward(nn.Module):
    """A correct feed-forward network, one step per method so that each mistake changes one."""

    def __init__(self, d_model):
        super().__init__()
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)

    def activation(self, h):
        return F.gelu(h)

    def forward(self, x):
        return self.down(self.activation(self.up(x)))


class _FFNReLU(_FeedForward):
    def activation(self, h):
        return torch.relu(h)


class _FFNTanhGELU(_FeedForward):
    def activation(self, h):
        return F.gelu(h, approximate="tanh")


class _FFNNoActivation(_FeedForward):
    def activation(self, h):
        return h


class _FFNGELUAtTheEndToo(_FeedForward):
    def forward(self, x):
        return F.gelu(super().forward(x))


class _FFNNarrow(_FeedForward):
    def __init__(self, d_model):
        nn.Module.__init__(self)
        self.up = nn.Linear(d_model, d_model)  # the hidden layer d_model wide, not 4 d_model
        self.down = nn.Linear(d_model, d_model)


FFN_MISTAKES = (
    Mistake("ReLU instead of GELU", "the activation between the two layers is GELU (nn.GELU()), not ReLU.",
            _FFNReLU, frozenset({FFN})),
    Mistake("tanh approximation of GELU",
            "use the exact GELU, nn.GELU() with its default approximate='none' (x times the normal CDF of x).",
            _FFNTanhGELU, frozenset({FFN})),
    Mistake("no activation", "put a GELU between the two linear layers; without it they collapse into one.",
            _FFNNoActivation, frozenset({FFN})),
    Mistake("activation after the second layer too",
            "the GELU goes between the two linear layers only; the second layer's output is returned as it is.",
            _FFNGELUAtTheEndToo, frozenset({FFN})),
    Mistake("hidden layer d_model wide", "the hidden layer is 4 * d_model wide: Linear(d_model, 4 * d_model), then "
                                         "Linear(4 * d_model, d_model).", _FFNNarrow, frozenset({FFN})),
)


class _Attention(nn.Module):
    """A correct multi-head attention (the block's mistakes change the block, not this)."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        B, T, d = x.shape
        Q, K, V = (W(x).reshape(B, T, self.n_heads, -1).transpose(1, 2) for W in (self.W_q, self.W_k, self.W_v))
        s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
        if mask is not None:
            s = s + mask
        w = torch.softmax(s, dim=-1)
        return self.W_o((w @ V).transpose(1, 2).reshape(B, T, d)), w


class _Block(nn.Module):
    """A correct pre-LN block, one step per method so that each mistake changes one."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = _FeedForward(d_model)
        self.p = dropout

    def drop(self, t):
        return F.dropout(t, self.p, self.training)

    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln2(x))), w


class _PostLN(_Block):
    def forward(self, x, mask=None):
        a, w = self.attn(x, mask)
        x = self.ln1(x + self.drop(a))
        return self.ln2(x + self.drop(self.ffn(x))), w


class _NoAttentionResidual(_Block):
    def forward(self, x, mask=None):
        x, w = self.attn(self.ln1(x), mask)
        return x + self.drop(self.ffn(self.ln2(x))), w


class _NoFFNResidual(_Block):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        return self.drop(self.ffn(self.ln2(x))), w


class _BlockReLU(_Block):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ffn = _FFNReLU(d_model)


class _LN1Twice(_Block):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln1(x))), w


class _LN2Twice(_Block):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln2(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln2(x))), w


class _MaskDropped(_Block):
    def forward(self, x, mask=None):
        return super().forward(x)


class _Parallel(_Block):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        return x + self.drop(a) + self.drop(self.ffn(self.ln2(x))), w


class _ResidualFromNormalised(_Block):
    def forward(self, x, mask=None):
        h = self.ln1(x)
        a, w = self.attn(h, mask)
        h = self.ln2(h + self.drop(a))
        return h + self.drop(self.ffn(h)), w


class _DropoutOnlyScales(_Block):
    def drop(self, t):
        return t * (1 - self.p) if self.training else t  # scales, never zeroes


class _DropoutNotScaledUp(_Block):
    def drop(self, t):
        return F.dropout(t, self.p, True) * (1 - self.p) if self.training else t  # the survivors left at their size


class _DropoutNever(_Block):
    def drop(self, t):
        return t


class _DropoutOnTheSum(_Block):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = self.drop(x + a)
        return self.drop(x + self.ffn(self.ln2(x))), w


VALUE_TESTS = frozenset({VALUES, CAUSAL, DROPOUT})
BLOCK_MISTAKES = (
    Mistake("post-LN instead of pre-LN",
            "this block normalises before each sub-layer: x = x + drop(attn(ln1(x))), then "
            "x = x + drop(ffn(ln2(x))). Normalising after the residual addition is the original (post-LN) layout.",
            _PostLN, VALUE_TESTS),
    Mistake("attention residual forgotten",
            "add the attention output to x (x = x + drop(a)) instead of replacing x with it.",
            _NoAttentionResidual, VALUE_TESTS),
    Mistake("feed-forward residual forgotten",
            "add the feed-forward output to x (x = x + drop(ffn(ln2(x)))) instead of returning it alone.",
            _NoFFNResidual, VALUE_TESTS),
    Mistake("ReLU instead of GELU", "the feed-forward network's activation is GELU, not ReLU.", _BlockReLU,
            VALUE_TESTS),
    Mistake("ln1 used before the feed-forward network too",
            "each sub-layer has its own LayerNorm: ln1 before attention, ln2 before the feed-forward network.",
            _LN1Twice, VALUE_TESTS | {GRADS}),
    Mistake("ln2 used before attention too (one LayerNorm shared)",
            "each sub-layer has its own LayerNorm with its own parameters: ln1 before attention, ln2 before "
            "the feed-forward network. Are ln1 and ln2 the same module?",
            _LN2Twice, VALUE_TESTS | {GRADS}),
    Mistake("mask not passed to attention", "call self.attn(self.ln1(x), mask): the mask must reach the attention.",
            _MaskDropped, frozenset({CAUSAL}), frozenset({VALUES})),
    Mistake("feed-forward applied to the block's input",
            "the feed-forward network reads x after the attention residual has been added: "
            "x = x + drop(a) first, then x = x + drop(ffn(ln2(x))).",
            _Parallel, VALUE_TESTS),
    Mistake("residual taken from the normalised input",
            "the residual path carries x itself, not ln1(x): x = x + drop(attn(ln1(x))), not ln1(x) + ...",
            _ResidualFromNormalised, VALUE_TESTS),
    Mistake("dropout that only scales by (1 - p)",
            "dropout sets each entry to 0 with probability p and multiplies the others by 1 / (1 - p); multiplying "
            "everything by (1 - p) zeroes nothing. Use nn.Dropout(dropout).",
            _DropoutOnlyScales, frozenset({DROPOUT})),
    Mistake("survivors of dropout not scaled up",
            "inverted dropout multiplies the entries it keeps by 1 / (1 - p), so that the expected value is "
            "unchanged: nn.Dropout(dropout) does it.",
            _DropoutNotScaledUp, frozenset({DROPOUT})),
    Mistake("dropout never applied",
            "apply dropout to each branch's output before adding it to x: self.drop = nn.Dropout(dropout), "
            "x = x + self.drop(a).",
            _DropoutNever, frozenset({DROPOUT})),
    Mistake("dropout applied to the residual sum",
            "apply dropout to the attention output and to the feed-forward output only (x = x + self.drop(a)), "
            "never to x itself or to the sum.",
            _DropoutOnTheSum, frozenset({DROPOUT})),
)


# ================================================================ the adapters
def ffn_linears(module, owner="FeedForward"):
    """The feed-forward network's two nn.Linear layers wherever it keeps them: (up, down), up the
    one that widens (registered in either order)."""
    layers = [m for m in module.modules() if isinstance(m, nn.Linear)] if isinstance(module, nn.Module) else []
    if len(layers) != 2:
        raise AssertionError(f"{owner} should contain exactly two nn.Linear layers (d_model -> 4 * d_model -> "
                             f"d_model); it has {len(layers)}.")
    up, down = layers
    if up.out_features < up.in_features and down.out_features > down.in_features:
        up, down = down, up
    return up, down


def _layer_norm(module, name):
    ln = getattr(module, name, None)
    if not isinstance(ln, nn.LayerNorm):
        raise AssertionError(f"TransformerBlock should have an attribute {name} that is an nn.LayerNorm(d_model); "
                             + ("it has none." if ln is None else f"yours is a {type(ln).__name__}."))
    return ln


def _part(module, name, what):
    part = getattr(module, name, None)
    if part is None:
        raise AssertionError(f"TransformerBlock should have an attribute {name}: {what}.")
    return part


def ffn_parameter(module, name, owner="FeedForward"):
    """``up.weight``, ``up.bias``, ``down.weight`` or ``down.bias`` of a feed-forward network."""
    layer, _, attr = name.partition(".")
    found = getattr(ffn_linears(module, owner)[layer == "down"], attr)
    if found is None:
        raise AssertionError(f"The {'second' if layer == 'down' else 'first'} Linear of {owner} should have a bias "
                             "(the default).")
    return found


def block_parameter(module, name):
    """A block's parameter by its name (see the docstring)."""
    first, _, rest = name.partition(".")
    if first in ("ln1", "ln2"):
        found = getattr(_layer_norm(module, first), rest)
        if found is None:
            raise AssertionError(f"{first} should be nn.LayerNorm(d_model), with a scale and a shift.")
        return found
    if first == "attn":
        return mha.parameter(_part(module, "attn", "your MultiHeadAttention(d_model, n_heads)"), rest,
                             owner="TransformerBlock.attn")
    return ffn_parameter(_part(module, "ffn", "your FeedForward(d_model)"), rest, owner="TransformerBlock.ffn")


def load(module, weights: dict, find) -> None:
    """Copy each tensor of ``weights`` (name -> tensor) into the module's parameter ``find(module, name)``."""
    with torch.no_grad():
        for name, W in weights.items():
            p = find(module, name)
            if tuple(p.shape) != tuple(W.shape):
                raise AssertionError(f"{name} has shape {tuple(p.shape)} but should be {tuple(W.shape)}.")
            p.copy_(W)


def _ffn_find(module, name):
    return ffn_parameter(module, name)


def _listing(module, names, find) -> str:
    """The module's parameters (name and shape, sorted by name), each one that ``find`` knows under
    its name of ``names`` ("ffn.up.weight"), wherever the module keeps it, so that a right answer's
    list is the reference's."""
    known = {}
    for n in names:
        try:
            known[id(find(module, n))] = n
        except Exception:  # (a part missing: the structure test says which)
            pass
    return ", ".join(sorted(f"{known.get(id(p), k)} {tuple(p.shape)}" for k, p in module.named_parameters()))


def _output(result, owner):
    if not isinstance(result, torch.Tensor):
        raise AssertionError(f"{owner} returned a {type(result).__name__}, not a torch.Tensor")
    return result


def _forward(module, case, names, find, call):
    """Load the case's weights (``names``), call ``call(module, x) -> (output, *others)``, and report
    what the tests judge: in a value case the outputs (parameters frozen); in a gradient case
    (``loss_seed``) the output weighted by seeded random numbers and back-propagated to x and each
    parameter (None where none reaches it), the other outputs' type and dtype, and, in float64, the
    central finite difference ``fd`` when x and the weights move together along the case's
    directions; always x (and the mask) after the call and the parameters the call changed."""
    x = case["x"].clone()
    load(module, {n: case[n] for n in names}, find)
    params = [find(module, n) for n in names]
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if "loss_seed" not in case:
        module.requires_grad_(False)
        res = call(module, x)
    else:
        x.requires_grad_(True)
        res = call(module, x)
        out = res["output"]
        if not out.requires_grad:
            raise AssertionError(
                "the output does not require grad although x and the weights do: gradients cannot flow back. Avoid "
                ".detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside forward.")
        grads = torch.autograd.grad(_weighted([out], case["loss_seed"]), [x, *params], allow_unused=True)
        res = {"grad_x": grads[0], **{f"grad_{n}": g for n, g in zip(names, grads[1:])},
               **{k: v.detach().reshape(-1)[:0] if isinstance(v, torch.Tensor) else v for k, v in res.items()},
               "output": out.detach()}
    res["x after the call"] = x.detach()
    after = module.state_dict()
    res["changed by the call"] = ", ".join(k for k, v in before.items() if not torch.equal(v, after[k].detach()))
    if "mask" in case:
        res["mask after the call"] = case["mask"]
    if "loss_seed" in case and all(f"dir_{n}" in case for n in ("x", *names)):
        def scalar(sign):
            load(module, {n: case[n] + sign * FD_STEP * case[f"dir_{n}"] for n in names}, find)
            with torch.no_grad():
                moved = call(module, case["x"] + sign * FD_STEP * case["dir_x"])["output"]
            return _weighted([moved], case["loss_seed"]).to(torch.float64)

        res["fd"] = (scalar(1.0) - scalar(-1.0)) / (2 * FD_STEP)
    return res


def ffn_structure_data(module) -> dict:
    layers = sorted(describe_layer(m) for m in module.modules() if isinstance(m, nn.Linear))
    return {"linear layers": ", ".join(layers) or "none",
            "parameters": int(sum(p.numel() for p in module.parameters())),
            "parameter list": _listing(module, FFN_PARAMS, _ffn_find)}


def ffn_adapter(piece, case):
    """Build ``FeedForward(d_model)``; a structure case (``d_model``): its layers and parameters as
    plain data, after one forward pass whose errors do not matter (what it calls is still watched);
    else its weights loaded by name, eval mode, ``forward(x)`` (``_forward``)."""
    if "d_model" in case:
        module = build(piece, case["d_model"], owner="FeedForward")
        try:
            module(case["x"].clone())
        except Exception:
            pass
        return ffn_structure_data(module)
    module = build(piece, case["x"].shape[-1], owner="FeedForward").to(case["x"].dtype).eval()
    return _forward(module, case, FFN_PARAMS, _ffn_find,
                    lambda m, x: {"output": _output(m(x), "FeedForward.forward")})


def _describe_norm(ln) -> str:
    if ln is None:
        return "missing"
    if not isinstance(ln, nn.LayerNorm):
        return type(ln).__name__
    return f"nn.LayerNorm({', '.join(str(int(s)) for s in ln.normalized_shape)}" + \
        (")" if ln.weight is not None else ", elementwise_affine=False)")


def block_structure_data(module) -> dict:
    ln1, ln2 = getattr(module, "ln1", None), getattr(module, "ln2", None)
    out = {"ln1": _describe_norm(ln1), "ln2": _describe_norm(ln2), "ln1 is ln2": ln1 is not None and ln1 is ln2}
    attn, ffn = getattr(module, "attn", None), getattr(module, "ffn", None)
    for n in mha.PROJECTIONS:
        out[f"attn.{n}"] = "no attn" if attn is None else describe_layer(getattr(attn, n, None))
    out["ffn linear layers"] = ("no ffn" if ffn is None else
                                ", ".join(sorted(describe_layer(m) for m in ffn.modules() if isinstance(m, nn.Linear)))
                                if isinstance(ffn, nn.Module) else type(ffn).__name__)
    out["parameters"] = int(sum(p.numel() for p in module.parameters()))
    out["parameter list"] = _listing(module, BLOCK_PARAMS, block_parameter)
    return out


def _pair(result):
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        what = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise AssertionError(f"it returned a {what}, expected a tuple (output, weights)")
    return tuple(result)


def _block_call(kwargs):
    def call(module, x):
        out, w = _pair(module(x, **kwargs))
        again = _pair(module(x, **kwargs))[0]  # eval mode: the same output twice
        same = isinstance(out, torch.Tensor) and isinstance(again, torch.Tensor) and torch.equal(out, again)
        return {"weights": w, "output": out, "the same output twice in eval mode": bool(same)}

    return call


def _dropout_run(piece, case):
    """Dropout's behaviour (see the docstring): eval and train outputs at dropout=p, the train
    output at dropout=1.0 minus x, and the distribution of what dropout made of a branch of ones."""
    x, n_heads, p = case["x"], case["n_heads"], float(case["p"])
    weights = {n: case[n] for n in BLOCK_PARAMS}

    def made(dropout, train, seed, weights=weights, x=x):
        module = build(piece, x.shape[-1], n_heads, dropout, owner="TransformerBlock").to(x.dtype)
        load(module, weights, block_parameter)
        module.requires_grad_(False).train(train)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return _pair(module(x.clone()))[0]

    seed = int(case["seed"])
    eval_out = made(p, False, seed)
    train_out = made(p, True, seed)
    all_dropped = made(1.0, True, seed + 1)
    ones = dict(weights)  # the attention branch 0, the feed-forward branch 1 everywhere
    ones["attn.W_o.weight"] = torch.zeros_like(ones["attn.W_o.weight"])
    ones["ffn.down.weight"] = torch.zeros_like(ones["ffn.down.weight"])
    ones["ffn.down.bias"] = torch.ones_like(ones["ffn.down.bias"])
    branch = (torch.as_tensor(made(p, True, seed + 2, ones, case["x_ones"])).detach().double()
              - case["x_ones"].double()).flatten()
    zero = branch.abs() < 1e-9
    return {
        "output in eval mode": eval_out,
        "train output differs from eval output": bool((torch.as_tensor(train_out).detach() - eval_out.detach())
                                                      .abs().max() >= 1e-3),
        "largest change of x with dropout=1.0 in train mode": float(
            (torch.as_tensor(all_dropped).detach() - x).abs().max()),
        "fraction of a branch of ones dropped": float(zero.double().mean()),
        # (the first five distinct values, to 10 digits: 1 / (1 - p) is rarely a short decimal)
        "values kept of a branch of ones": ", ".join(f"{v:.10g}" for v in sorted({round(v, 9) for v in
                                                                                 branch[~zero].tolist()})[:5]) or "none",
    }


def block_adapter(piece, case):
    """Build ``TransformerBlock(d_model, n_heads)``; a structure case (``d_model``): its parts as
    plain data, after one forward pass in eval mode whose errors do not matter; a dropout case
    (``p``): ``_dropout_run``; else its weights loaded by name, eval mode, ``forward(x[, mask])``
    twice (``_forward``)."""
    if "d_model" in case:
        module = build(piece, case["d_model"], case["n_heads"], owner="TransformerBlock")
        try:
            module.eval()(case["x"].clone())
        except Exception:
            pass
        return block_structure_data(module)
    if "p" in case:
        return _dropout_run(piece, case)
    x = case["x"]
    module = build(piece, x.shape[-1], case["n_heads"], owner="TransformerBlock").to(x.dtype).eval()
    kwargs = {"mask": case["mask"].clone()} if "mask" in case else {}
    return _forward(module, case, BLOCK_PARAMS, block_parameter, _block_call(kwargs))


# ================================================================ properties (plain data)
def ffn_structure(case, out, want):
    """Two nn.Linear layers with biases, d_model -> 4 d_model -> d_model: 8 d**2 + 5 d parameters."""
    if "d_model" not in case:
        return None
    d = case["d_model"]
    if out.get("linear layers") != want["linear layers"]:
        return (f"FeedForward({d}) should have two nn.Linear layers with biases, {d} -> {4 * d} (the hidden layer is "
                f"4 * d_model wide) and {4 * d} -> {d}: {want['linear layers']}. Yours: {out.get('linear layers')}.")
    if out.get("parameters") != want["parameters"]:
        return (f"FeedForward({d}) has {out.get('parameters'):,} parameters but should have 8 * d_model**2 + 5 * "
                f"d_model = {want['parameters']:,} (two Linear layers with biases, nothing else). Yours: "
                f"{out.get('parameter list')}.")
    return None


def block_structure(case, out, want):
    """ln1 and ln2 two distinct nn.LayerNorm(d_model), attn's four projections, ffn's two layers, and
    the parameter count 12 d**2 + 9 d."""
    if "d_model" not in case:
        return None
    d, H = case["d_model"], case["n_heads"]
    for name in ("ln1", "ln2"):
        got = out.get(name)
        if got != want[name]:
            return (f"TransformerBlock should have an attribute {name} that is an nn.LayerNorm(d_model) = "
                    f"{want[name]}; " + ("it has none." if got == "missing" else f"yours is {got}."))
    if out.get("ln1 is ln2"):
        return "ln1 and ln2 are the same module: each sub-layer needs its own LayerNorm (two nn.LayerNorm(d_model))."
    for n in mha.PROJECTIONS:
        got = out.get(f"attn.{n}")
        if got == "no attn":
            return "TransformerBlock should have an attribute attn: your MultiHeadAttention(d_model, n_heads)."
        if got != want[f"attn.{n}"]:
            return f"TransformerBlock.attn.{n} should be nn.Linear(d_model, d_model, bias=False); yours is {got}."
    got = out.get("ffn linear layers")
    if got == "no ffn":
        return "TransformerBlock should have an attribute ffn: your FeedForward(d_model)."
    if got != want["ffn linear layers"]:
        return (f"TransformerBlock.ffn should have two nn.Linear layers with biases, d_model -> 4 * d_model -> "
                f"d_model: {want['ffn linear layers']}. Yours: {got}.")
    if out.get("parameters") != want["parameters"]:
        return (f"TransformerBlock({d}, {H}) has {out.get('parameters'):,} parameters but should have "
                f"{want['parameters']:,}: attention 4 * d_model**2 = {4 * d * d:,}, feed-forward 8 * d_model**2 + 5 * "
                f"d_model = {8 * d * d + 5 * d:,}, two LayerNorms 4 * d_model = {4 * d:,}. Yours: "
                f"{out.get('parameter list')}.")
    return None


def eval_repeatable(case, out, want):
    """In eval mode the block gives the same output twice: dropout is off."""
    if out.get("the same output twice in eval mode", True):
        return None
    return ("in eval mode your block gives different outputs for the same input: dropout must do nothing in eval "
            "mode. Use nn.Dropout (it follows module.train() / module.eval()), or pass training=self.training to "
            "F.dropout.")


def masked_weights_are_zero(case, out, want):
    """With the causal mask every weight above the diagonal is exactly 0, and each row sums to 1
    (float32 sums of 16 weights are exact to about 1e-6: 1e-5)."""
    w = out.get("weights")
    if case.get("mask") is None or not isinstance(w, np.ndarray) or w.shape != want["weights"].shape:
        return None  # (a wrong shape: the comparison says so)
    hidden = np.broadcast_to(np.isneginf(case["mask"]), w.shape)
    if np.any(w[hidden] != 0):
        reach = f"; yours reach {float(np.abs(w[hidden]).max()):.6g}" if case["show"] else ""
        return ("with the causal mask every weight above the diagonal must be exactly 0" + reach + ". Does the block "
                "pass the mask on to self.attn?")
    worst = float(np.abs(w.astype(np.float64).sum(-1) - 1).max()) if w.size else 0.0
    if not worst <= 1e-5:
        return "each row of the weights should sum to 1" + (f"; one is off by {worst:.3g}." if case["show"] else ".")
    return None


def dropout_behaviour(case, out, want):
    """Off in eval mode (the reference's output, at the comparison's tolerance), on in train mode,
    on the branches only (dropout=1.0 gives x back), inverted (see the docstring)."""
    if "p" not in case:
        return None
    p = float(case["p"])
    d, H = case["x"].shape[-1], case["n_heads"]
    got, expected = out.get("output in eval mode"), want["output in eval mode"]
    atol, rtol = (1e-10, 1e-8) if expected.dtype == np.float64 else (1e-5, 1e-4)
    if not (isinstance(got, np.ndarray) and got.shape == expected.shape
            and np.allclose(got.astype(np.float64), expected, atol=atol, rtol=rtol)):
        return (f"TransformerBlock({d}, {H}, dropout={p:g}) in eval mode (dropout off) should give the reference's "
                "output, and does not. Dropout must do nothing in eval mode, and the block's values must be right "
                "(test_block_against_reference says where they are not).")
    if not out.get("train output differs from eval output"):
        return (f"in train mode, TransformerBlock({d}, {H}, dropout={p:g}) gives the same output as in eval mode: "
                "dropout is not applied. Build self.drop = nn.Dropout(dropout) and apply it to each branch's output "
                "before adding it to x.")
    moved = float(out.get("largest change of x with dropout=1.0 in train mode", np.inf))
    if not moved <= 1e-10:  # (x + 0 + 0 is x exactly, in float64: 1e-10 allows a sum done otherwise)
        shown = f" (it moves an entry of x by {moved:.3g})" if case["show"] else ""
        return ("with dropout=1.0 in train mode, dropout zeroes both branches entirely, so the block should return "
                f"its input unchanged: x + 0 + 0{shown}. Apply dropout to the attention output and to the "
                "feed-forward output only (x = x + self.drop(a)), never to x itself or to the sum, and use the "
                "dropout argument.")
    fraction = float(out.get("fraction of a branch of ones dropped", -1))
    kept = str(out.get("values kept of a branch of ones", ""))
    keep = 1 / (1 - p)
    right = kept != "none" and all(abs(float(v) - keep) <= 1e-6 for v in kept.split(", "))
    if abs(fraction - p) <= DROPOUT_SLACK and right:
        return None
    seen = (f" Your block gives 0 in {fraction:.1%} of the {int(np.prod(DROPOUT_SHAPE)):,} entries and these other "
            f"values: {kept}." if case["show"] else "")
    return (f"with dropout={p:g} in train mode, a feed-forward branch that outputs 1 everywhere (W_o = 0, the last "
            f"layer's weight 0 and bias 1) should come out of dropout as 0 in about {p:.0%} of the entries and as "
            f"1 / (1 - p) = {keep:g} in the others (inverted dropout: the survivors are scaled up so that the "
            f"expected value is unchanged).{seen} Use nn.Dropout(dropout) or F.dropout(t, p, self.training) on each "
            "branch's output.")


# ================================================================ the cases
def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _ffn_weights(rng, d, dtype, prefix=""):
    """W1 (4d, d), b1, W2 (d, 4d), b2: each layer's outputs have variance about 1 for unit inputs."""
    return {f"{prefix}up.weight": _normal(rng, (4 * d, d), dtype, 1 / math.sqrt(d)),
            f"{prefix}up.bias": _normal(rng, (4 * d,), dtype, 0.5),
            f"{prefix}down.weight": _normal(rng, (d, 4 * d), dtype, 1 / math.sqrt(4 * d)),
            f"{prefix}down.bias": _normal(rng, (d,), dtype, 0.5)}


def _block_weights(rng, d, dtype):
    """Every parameter of a block, the LayerNorms' random around 1 and 0 and different for ln1 and ln2."""
    w = {}
    for ln in ("ln1", "ln2"):
        w[f"{ln}.weight"] = (1 + _normal(rng, (d,), "float64", 0.3)).astype(dtype)
        w[f"{ln}.bias"] = _normal(rng, (d,), dtype, 0.3)
    w.update({n: _normal(rng, (d, d), dtype, 1 / math.sqrt(d)) for n in ATTN_PARAMS})
    w.update(_ffn_weights(rng, d, dtype, "ffn."))
    return {n: w[n] for n in BLOCK_PARAMS}


def _by_position(T, d):
    """(T, d): a smooth pattern that changes along the sequence, added to a case's random tokens as
    positions are to embeddings (not the course's sinusoidal table: that is an exercise's answer)."""
    return np.cos(np.outer(np.arange(T), np.linspace(0.1, 1.0, d)))


def _ffn_structure_case(d, x):
    return case(f"for FeedForward({d})", "ffn", d_model=d, x=x)


def _ffn_case(rng, shape, dtype, grads=False, tags=("ffn",)):
    label = f"for x of shape {shape}, {dtype}, seeded parameters" + (", with the gradients" if grads else "")
    c = case(label, tags, x=_normal(rng, shape, dtype), **_ffn_weights(rng, shape[-1], dtype))
    return grad_case(rng, c, ("x", *FFN_PARAMS)) if grads else c


FFN_STRUCTURE_SIZES = (8, 16, 128)
FFN_SHAPES = ((2, 5, 8), (1, 1, 4), (3, 4, 16), (6, 12))


def _ffn_visible() -> tuple:
    g = np.random.default_rng(201)
    return (*(_ffn_structure_case(d, _normal(np.random.default_rng(d), (2, 3, d), "float32"))
              for d in FFN_STRUCTURE_SIZES),
            _ffn_case(g, (2, 5, 8), "float64", tags=("ffn", "small")))


def ffn_secret(rng: np.random.Generator) -> list:
    """The structure at the visible sizes and a random one; values at every shape of the old hidden
    tests in both dtypes (the visible shape also tagged "small", the capstone's recap); gradients in
    float64 (with finite differences) and float32."""
    sizes = (*FFN_STRUCTURE_SIZES, int(rng.integers(1, 40)))
    cases = [_ffn_structure_case(d, _normal(rng, (2, 3, d), "float32")) for d in sizes]
    for dtype in ("float64", "float32"):
        for shape in FFN_SHAPES:
            cases.append(_ffn_case(rng, shape, dtype, tags=("ffn", "small") if shape == FFN_SHAPES[0] else ("ffn",)))
    cases.append(_ffn_case(rng, (2, 3, 4), "float64", grads=True))
    cases.append(_ffn_case(rng, (2, 3, 8), "float32", grads=True))
    return cases


def _block_structure_case(d, H, x):
    return case(f"for TransformerBlock({d}, {H})", "structure", d_model=d, n_heads=H, x=x)


def _block_case(rng, tags, B, T, d, H, dtype, mask=None, what="", x=None, grads=False):
    label = (f"for x of shape {(B, T, d)}, n_heads={H}, {dtype}, seeded parameters, eval mode{what}"
             + (", with the gradients" if grads else ""))
    c = case(label, tags, x=_normal(rng, (B, T, d), dtype) if x is None else x, n_heads=H,
             **_block_weights(rng, d, dtype))
    if mask is not None:
        c["mask"] = mask.astype(dtype)
    return grad_case(rng, c, ("x", *BLOCK_PARAMS)) if grads else c


def _sanity_case(rng):
    """The seed's sanity check: d_model 128, 4 heads, 2 sequences of 16 positions with a pattern by
    position added (the seed adds the sinusoidal table, which is an exercise's answer, so not here),
    a causal mask, float32."""
    B, T, d, H = 2, SEED_T, SEED_D_MODEL, SEED_N_HEADS
    x = (rng.standard_normal((B, T, d)) + _by_position(T, d)).astype("float32")
    return _block_case(rng, "causal", B, T, d, H, "float32", causal_mask_array(T, "float32"),
                       ", causal mask (the seed's sanity check)", x=x)


def _dropout_case(rng, p):
    d, H = DROPOUT_SHAPE[-1], 4
    c = case(f"for TransformerBlock({d}, {H}, dropout={p:g}) with seeded parameters, x of shape (2, 5, {d}), float64, "
             "in eval and train mode", "dropout", x=_normal(rng, (2, 5, d), "float64"), n_heads=H, p=p,
             seed=int(rng.integers(0, 2**31 - 1)), x_ones=_normal(rng, DROPOUT_SHAPE, "float64"),
             **_block_weights(rng, d, "float64"))
    return c


STRUCTURE_SIZES = ((SEED_D_MODEL, SEED_N_HEADS), (32, 4), (16, 2))
BLOCK_SHAPES = ((2, 5, 16, 4), (1, 1, 8, 2), (3, 6, 32, 4), (2, 7, 24, 3))  # (B, T, d_model, n_heads)


def _block_visible() -> tuple:
    return (
        *(_block_structure_case(d, H, _normal(np.random.default_rng(d), (2, 3, d), "float32"))
          for d, H in STRUCTURE_SIZES),
        _block_case(np.random.default_rng(211), ("reference", "small"), 2, 5, 16, 4, "float64"),
        _sanity_case(np.random.default_rng(213)),
        _dropout_case(np.random.default_rng(217), DROPOUT_P),
        _block_case(np.random.default_rng(219), "grads", 2, 3, 8, 2, "float64", grads=True),
    )


def block_secret(rng: np.random.Generator) -> list:
    """The structure at the visible sizes and a random one; values at every shape of the old hidden
    tests in both dtypes, without and with a causal mask (the visible shape without a mask also tagged
    "small", the capstone's recap); the sanity check with fresh numbers; dropout at p = 0.5 and 0.25;
    gradients in float64 without and with a causal mask and in float32 (they must exist)."""
    H = int(rng.integers(1, 5))
    sizes = (*STRUCTURE_SIZES, (H * int(rng.integers(1, 9)), H))
    cases = [_block_structure_case(d, H, _normal(rng, (2, 3, d), "float32")) for d, H in sizes]
    for dtype in ("float64", "float32"):
        for B, T, d, H in BLOCK_SHAPES:
            tags = ("reference", "small") if (B, T, d, H) == BLOCK_SHAPES[0] else "reference"
            cases.append(_block_case(rng, tags, B, T, d, H, dtype))
            cases.append(_block_case(rng, "reference", B, T, d, H, dtype, causal_mask_array(T, dtype), ", causal mask"))
    cases.append(_sanity_case(rng))
    cases += [_dropout_case(rng, p) for p in (DROPOUT_P, 0.25)]
    cases.append(_block_case(rng, "grads", 2, 3, 8, 2, "float64", grads=True))
    cases.append(_block_case(rng, "grads", 2, 3, 8, 2, "float64", causal_mask_array(3, "float64"), ", causal mask", grads=True))
    cases.append(_block_case(rng, "grads", 2, 4, 8, 4, "float32", grads=True))
    return cases


# ================================================================ the declaration
FORBIDDEN = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECE_NAMES)
FFN_NAMES = {"grad_x": "the gradient with respect to x",
             **{f"grad_{n}": f"the gradient with respect to {n}" for n in FFN_PARAMS},
             "linear layers": "the Linear layers", "parameters": "the number of parameters",
             "parameter list": "the parameters (name and shape)"}
BLOCK_NAMES = {"grad_x": "the gradient with respect to x",
               **{f"grad_{n}": f"the gradient with respect to {n}" for n in BLOCK_PARAMS},
               "parameters": "the number of parameters", "parameter list": "the parameters (name and shape)"}
HINTS = (
    ("modified by an inplace operation", "An in-place operation on a tensor that autograd still needs breaks the "
                                         "backward pass: build new tensors instead."),
)

FFN_EXERCISE = Exercise(
    name=NAME,
    piece="FeedForward",
    call="FeedForward(d_model)(x)",
    adapter=ffn_adapter,
    reference="firstprinciples.reference:FeedForward",
    names=FFN_NAMES,
    visible=_ffn_visible(),
    secret=ffn_secret,
    tests={FFN: Test(3, frozenset({"ffn"}), first=(ffn_structure, weights_left_alone))},
    forbidden=dict(FORBIDDEN, what="the feed-forward network"),
    mistakes=FFN_MISTAKES,
    hints=HINTS,
    elsewhere={RECAP_FFN: Test(1, frozenset({"small"}), first=(weights_left_alone,))},
)

BLOCK_EXERCISE = Exercise(
    name=NAME,
    piece="TransformerBlock",
    call="TransformerBlock(d_model, n_heads)(x, mask)",
    adapter=block_adapter,
    reference="firstprinciples.reference:TransformerBlock",
    names=BLOCK_NAMES,
    visible=_block_visible(),
    secret=block_secret,
    tests={
        STRUCTURE: Test(2, frozenset({"structure"}), first=(block_structure,)),
        VALUES: Test(3, frozenset({"reference"}), first=(weights_left_alone, output_order, eval_repeatable)),
        CAUSAL: Test(2, frozenset({"causal"}), first=(weights_left_alone, output_order, eval_repeatable,
                                                      masked_weights_are_zero)),
        DROPOUT: Test(2, frozenset({"dropout"}), first=(dropout_behaviour,), values=False),
        GRADS: Test(1, frozenset({"grads"}), first=(weights_left_alone, output_order, eval_repeatable,
                                                    honest_gradients), values=False),
    },
    forbidden=dict(FORBIDDEN, what="the transformer block"),
    mistakes=BLOCK_MISTAKES,
    hints=HINTS,
    elsewhere={RECAP_BLOCK: Test(1, frozenset({"small"}), first=(weights_left_alone, output_order, eval_repeatable)),
               # cells that pass TransformerBlock along as a part of the model: no case of it (the model's
               # probe re-checks what they grade)
               **{gid: Test(0, frozenset(), values=False) for gid in AS_A_PART}},
)


# ================================================================ this notebook's recaps of earlier pieces
# scaled_dot_product_attention (the attention exercise's recap, as multi_head_attention declares it)
_ATTENTION_TEST = attention.EXERCISE.elsewhere[attention.RECAP_ID]
ATTENTION_RECAP = recap(
    attention.EXERCISE, NAME, {attention.RECAP_ID: _ATTENTION_TEST},
    visible=tuple({**c, "tags": tuple(sorted(_ATTENTION_TEST.tags))} for c in attention.RECAP.visible),
    mistakes={label: ({attention.RECAP_ID}, ()) for label in (
        "no scaling", "scaled by d_k", "scaled by sqrt(T_k)", "softmax over the wrong axis", "keys used as values",
        "scores returned as weights")},
)


# split_heads, merge_heads and MultiHeadAttention: the recaps multi_head_attention declares for the later
# notebooks (their visible cases); this notebook's merge cell keeps the name test_merge_heads, judged in
# the re-check as in its own notebook (its tags), for 1 point here
SPLIT_RECAP = recap(mha.SPLIT_RECAP, NAME, dict(mha.SPLIT_RECAP.tests), visible=mha.SPLIT_RECAP.visible,
                    mistakes={m.label: ({mha.RECAP_SPLIT}, ()) for m in mha.SPLIT_MISTAKES})
_MERGE_TEST = mha.MERGE_EXERCISE.tests[mha.MERGE]
MERGE_RECAP = recap(mha.MERGE_RECAP, NAME, {mha.MERGE: dataclasses.replace(_MERGE_TEST, points=1)},
                    visible=mha.MERGE_RECAP.visible, mistakes={m.label: ({mha.MERGE}, ()) for m in mha.MERGE_MISTAKES})
MHA_RECAP = recap(mha.MHA_RECAP, NAME, dict(mha.MHA_RECAP.tests), visible=mha.MHA_RECAP.visible,
                  mistakes={m.label: ({mha.RECAP_MHA}, ()) for m in mha.MHA_MISTAKES if mha.VALUES in m.fails})

PIECES = (ATTENTION_RECAP, SPLIT_RECAP, MERGE_RECAP, MHA_RECAP, FFN_EXERCISE, BLOCK_EXERCISE)

# What the capstone's recaps are made from (exercises/capstone.py): the
# visible cases of this notebook's tests tagged "small", judged as its cells are in the re-check.
FFN_RECAP = dataclasses.replace(FFN_EXERCISE, visible=tuple(c for c in FFN_EXERCISE.visible if "small" in c["tags"]),
                                tests={RECAP_FFN: FFN_EXERCISE.elsewhere[RECAP_FFN]})
BLOCK_RECAP = dataclasses.replace(BLOCK_EXERCISE,
                                  visible=tuple(c for c in BLOCK_EXERCISE.visible if "small" in c["tags"]),
                                  tests={RECAP_BLOCK: BLOCK_EXERCISE.elsewhere[RECAP_BLOCK]})
