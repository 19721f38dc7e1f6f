"""split_heads, merge_heads and MultiHeadAttention: the exercise's tests, declared once.

- ``split_heads(x, n_heads)``: (B, T, d_model) -> (B, n_heads, T, d_k), d_k = d_model // n_heads,
  head h holding features h*d_k ... (h+1)*d_k - 1 of every token;
- ``merge_heads(x)``: (B, n_heads, T, d_k) -> (B, T, n_heads * d_k), the inverse;
- ``MultiHeadAttention(d_model, n_heads)``: an ``nn.Module`` with four bias-free
  ``nn.Linear(d_model, d_model)`` layers ``W_q``, ``W_k``, ``W_v``, ``W_o`` and the integer attributes
  ``n_heads`` and ``d_k`` (d_model // n_heads); ``forward(x, mask=None)`` returns (output (B, T, d_model),
  weights (B, n_heads, T, T)).

Decisions stated once:

- The module is a class: its adapter (``module_adapter``) builds it with the case's sizes (under a
  fixed seed, the caller's random state left alone), reports its structure as plain data (each
  projection described as a string, the number of distinct layers, the parameter count and list,
  the attributes ``n_heads`` and ``d_k`` as integers or as what they are instead),
  or loads the case's seeded weights into its parameters by name and calls it. The weights are in
  nn.Linear's convention (a layer computes x @ W.T), as the reference module's are.
- ``test_mha_structure`` judges the structure only (``mha_structure``: four bias-free
  (d_model, d_model) nn.Linear layers, distinct, 4 * d_model**2 parameters, and the contract below);
  one forward pass runs too, whose errors do not matter, so that an answer that calls PyTorch's
  attention scores 0 there as well.
- The contract with the later exercises (issue 42), stated in the notebook's task and checked by
  ``test_mha_structure``: besides the four layers, the KV-cache exercise's
  ``cached_attention_step(x_new, cache, mha)`` reads ``mha.n_heads`` and ``mha.d_k`` (its text offers
  both), and the capstone runs the student's own step on the student's own MultiHeadAttention. The
  transformer block and the capstone read nothing else of it (the block calls it, their adapters load
  weights into its four layers by name and hook ``attn.W_k``); the modern block and encoder-decoder
  exercises build attentions of their own. Each attribute is judged by the value read
  from the built instance (a property, a ``setattr``, a class attribute: all the same), as an
  integer: anything Python accepts where an integer is needed (``operator.index``: an int, a NumPy
  integer, a one-element integer tensor), which is what reshaping by it requires; a float (4.0,
  d_model / n_heads) is not, and ``view(B, T, H, d_k)`` refuses it.
- ``test_mha_gradients_and_inputs`` judges that honest gradients reach x and the four weight
  matrices (against finite differences of the answer's own output, moving x and the weights
  together) and that the output keeps x's shape and dtype; not the values, nor the weights' shape:
  the other tests do.
- Every test fails an answer that calls PyTorch's or the course's attention (any of the four
  pieces); every test that calls forward, an answer that changes its input, its mask or its own
  weights.
- The old checks' hidden comparison with PyTorch's ``nn.MultiheadAttention`` is the comparison with
  the reference, which ``tests/material/test_reference_modules.py`` holds equal to it.
- Values are compared with the defaults of ``grading.compare``: four d_model-term products and a
  T-term softmax in float32 move a correct answer by a few units of 1e-7 relative.
- The later notebooks (transformer_block, capstone) run recaps of the three pieces
  (their declarations' ``exercises.recap``, from the visible cases of ``SPLIT_RECAP``, ``MERGE_RECAP``,
  ``MHA_RECAP``); the re-check judges their cells by ``elsewhere`` below (``test_split_heads`` and
  ``test_merge_heads`` keep their names there and are judged as here).
- This notebook's own recap of ``scaled_dot_product_attention`` (``test_scaled_dot_product_attention``)
  is the attention exercise's (``exercises.recap``).
"""
from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np
import torch
from torch import nn

from ..examples.multihead import EXAMPLE_HEADS, split_example
from . import Exercise, Mistake, Test, attention, case, causal_mask_array, recap
from .adapters import _weighted, FD_STEP, call_runner, grad_case, honest_gradients

NAME = "multi_head_attention"
TORCH_PATTERNS = ("multi_head_attention", "scaled_dot_product_attention", "MultiheadAttention")
PIECE_NAMES = ("split_heads", "merge_heads", "MultiHeadAttention", "scaled_dot_product_attention")
PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")
PARAMS = tuple(f"{n}.weight" for n in PROJECTIONS)  # the parameters loaded by name, in nn.Linear's convention
# The integer attributes later exercises read from the module besides its four layers (the contract the
# notebook states): name -> (what it is, the line that sets it). The KV-cache exercise's
# cached_attention_step(x_new, cache, mha) reads them, and the capstone runs it on the student's own module.
CONTRACT = {"n_heads": ("the number of heads", "self.n_heads = n_heads"),
            "d_k": ("the width of each head, d_model // n_heads", "self.d_k = d_model // n_heads")}

SPLIT, MERGE = "test_split_heads", "test_merge_heads"
STRUCTURE, VALUES, MASKS, GRADS = ("test_mha_structure", "test_mha_against_reference", "test_mha_masks",
                                   "test_mha_gradients_and_inputs")
# the later notebooks' recap cells (transformer_block, capstone)
RECAP_SPLIT, RECAP_MERGE, RECAP_MHA = "recap_split_heads", "recap_merge_heads", "test_multi_head_attention"


# ================================================================ split_heads and merge_heads
def _split(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, T, n_heads, d // n_heads).transpose(1, 2)


def _merge(x):
    B, H, T, d_k = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d_k)


def _split_no_transpose(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, T, n_heads, d // n_heads)  # (B, T, H, d_k): heads not moved before time


def _split_reshape_directly(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, n_heads, T, d // n_heads)  # cuts memory in the wrong places


def _split_wrong_order(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, T, d // n_heads, n_heads).permute(0, 3, 1, 2)  # head h gets features h, h+H, ...


def _split_heads_and_dk_swapped(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, T, d // n_heads, n_heads).transpose(1, 2)  # (B, d_k, T, H)


SPLIT_MISTAKES = (
    Mistake("transpose forgotten",
            "after reshaping to (B, T, n_heads, d_k), swap axes 1 and 2 (.transpose(1, 2)) so that the heads come "
            "before the time axis: (B, n_heads, T, d_k).",
            _split_no_transpose, frozenset({SPLIT})),
    Mistake("reshaped straight to (B, n_heads, T, d_k)",
            "a reshape keeps the order of the entries in memory, so this cuts the sequence of tokens into pieces, "
            "not each token's features. Reshape to (B, T, n_heads, d_k) first, then .transpose(1, 2).",
            _split_reshape_directly, frozenset({SPLIT})),
    Mistake("d_k and n_heads in the wrong order",
            "reshape to (B, T, n_heads, d_k), not (B, T, d_k, n_heads): head h owns the d_k consecutive features "
            "h*d_k ... (h+1)*d_k - 1, not every n_heads-th feature.",
            _split_wrong_order, frozenset({SPLIT})),
    Mistake("n_heads and d_k swapped",
            "there are n_heads heads, each of width d_k = d_model // n_heads; the result has shape "
            "(B, n_heads, T, d_k).",
            _split_heads_and_dk_swapped, frozenset({SPLIT})),
)


def _merge_no_transpose(x):
    B, H, T, d_k = x.shape
    return x.reshape(B, T, H * d_k)  # mixes tokens: the heads were never moved back behind T


def _merge_wrong_order(x):
    B, H, T, d_k = x.shape
    return x.permute(0, 2, 3, 1).reshape(B, T, H * d_k)  # interleaves the heads' features


def _merge_not_flattened(x):
    return x.transpose(1, 2)  # (B, T, H, d_k)


def _merge_summed(x):
    return x.sum(dim=1)  # (B, T, d_k): heads added instead of concatenated


MERGE_MISTAKES = (
    Mistake("merged without transposing back",
            "the input is (B, n_heads, T, d_k): first .transpose(1, 2) to (B, T, n_heads, d_k), then reshape to "
            "(B, T, n_heads * d_k). Reshaping directly mixes different tokens into one row.",
            _merge_no_transpose, frozenset({MERGE})),
    Mistake("heads interleaved",
            "head h's d_k features must end up side by side, at positions h*d_k ... (h+1)*d_k - 1: transpose to "
            "(B, T, n_heads, d_k) and reshape; do not move d_k before n_heads.",
            _merge_wrong_order, frozenset({MERGE})),
    Mistake("heads not flattened", "after the transpose, reshape (B, T, n_heads, d_k) into (B, T, n_heads * d_k).",
            _merge_not_flattened, frozenset({MERGE})),
    Mistake("heads added instead of concatenated",
            "merging puts the heads' outputs side by side (a concatenation), it does not sum them.",
            _merge_summed, frozenset({MERGE})),
)


def _rows(a) -> list:
    """A (rows, columns) array as lists, whole numbers written as such (the worked example's are)."""
    return [[int(v) if float(v).is_integer() else round(float(v), 4) for v in row] for row in a]


def worked_split(case, out, want):
    """The worked example: head h of arange(12).reshape(1, 2, 6) is [[2h, 2h+1], [6+2h, 7+2h]], exactly."""
    if "printed" not in case["tags"]:
        return None
    got = out.get("output")
    if not isinstance(got, np.ndarray):
        return None  # (not a tensor: the comparison says what it is)
    if got.shape != (1, 3, 2, 2):
        return (f"split_heads(x, 3) should have shape (B, n_heads, T, d_k) = (1, 3, 2, 2), but it has shape "
                f"{got.shape}.")
    for h in range(3):
        shown = [[2 * h, 2 * h + 1], [6 + 2 * h, 7 + 2 * h]]
        if not np.array_equal(got[0, h].astype(np.float64), np.array(shown, dtype=np.float64)):
            return (f"split_heads(x, 3)[0, {h}] (head {h}) is {_rows(got[0, h])} but should be {shown}: head h "
                    "holds features 2h and 2h+1 of both tokens.")
    return None


def worked_merge(case, out, want):
    """The worked example backwards: the three heads merge back into arange(12).reshape(1, 2, 6), exactly."""
    if "printed" not in case["tags"]:
        return None
    got = out.get("output")
    if not isinstance(got, np.ndarray):
        return None  # (not a tensor: the comparison says what it is)
    if got.shape != (1, 2, 6):
        return (f"merge_heads(heads) should have shape (B, T, n_heads * d_k) = (1, 2, 6), but it has shape "
                f"{got.shape}.")
    for t in range(2):
        shown = list(range(6 * t, 6 * t + 6))
        if not np.array_equal(got[0, t].astype(np.float64), np.array(shown, dtype=np.float64)):
            return (f"merge_heads(heads)[0, {t}] (token {t}) is {_rows(got[0:1, t])[0]} but should be {shown}: "
                    "head h's two features go back to positions 2h and 2h+1 of each token.")
    return None


def merge_adapter(piece, case):
    """As ``call_runner``; for a case marked ``transposed``, x (B, T, n_heads, d_k) holds each token's heads
    and the input is its transposed (non-contiguous) view (B, n_heads, T, d_k), as ``split_heads`` hands
    heads over."""
    if "transposed" not in case:
        return _merge_run(piece, case)
    x = case["x"].clone()
    return {"output": piece(x.transpose(1, 2)), "x after the call": x}


_merge_run = call_runner(("x",), grad=("x",))

# (B, T, d_model, n_heads): heads of width 1 and of the whole width, one token, d_k = 4
SPLIT_SHAPES = ((2, 5, 12, 3), (1, 1, 4, 4), (3, 7, 16, 1), (2, 4, 32, 8), (1, 6, 6, 2))


def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _split_visible() -> tuple:
    g = np.random.default_rng(31)
    return (
        case("for the worked example x = torch.arange(12.).reshape(1, 2, 6) (head h holds features 2h, 2h+1 of each "
             "token)", ("split", "small", "printed"), x=split_example(torch.float64).numpy(), n_heads=EXAMPLE_HEADS),
        case("for x of shape (2, 5, 12), float32, n_heads=3", ("split", "small"), x=_normal(g, (2, 5, 12), "float32"),
             n_heads=3),
    )


def split_secret(rng: np.random.Generator) -> list:
    """The worked example's sizes with fresh numbers, the visible float32 sizes, every shape of the
    old hidden tests in both dtypes, random sizes, and the gradient (whose reference value is the
    merge of the upstream gradient)."""
    cases = [case("for x of shape (1, 2, 6), float64, n_heads=3", ("split", "small"),
                  x=_normal(rng, (1, 2, 6), "float64"), n_heads=3),
             case("for x of shape (2, 5, 12), float32, n_heads=3", ("split", "small"),
                  x=_normal(rng, (2, 5, 12), "float32"), n_heads=3)]
    sizes = [*SPLIT_SHAPES]
    for _ in range(2):
        H, d_k = (int(v) for v in rng.integers(1, 6, size=2))
        sizes.append((int(rng.integers(1, 4)), int(rng.integers(1, 8)), H * d_k, H))
    for dtype in ("float32", "float64"):
        for B, T, d, H in sizes:
            cases.append(case(f"for x of shape {(B, T, d)}, {dtype}, n_heads={H}", "split",
                              x=_normal(rng, (B, T, d), dtype), n_heads=H))
    for (B, T, d, H), dtype in (((2, 3, 8, 4), "float64"), ((1, 4, 6, 3), "float32")):
        cases.append(case(f"for x of shape {(B, T, d)}, {dtype}, n_heads={H}, with the gradient", "split",
                          x=_normal(rng, (B, T, d), dtype), n_heads=H, grad_out=_normal(rng, (B, H, T, d // H), dtype)))
    return cases


def _merge_visible() -> tuple:
    g = np.random.default_rng(37)
    x = split_example(torch.float64).numpy()  # (1, 2, 6)
    worked = np.array([[[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]], dtype=x.dtype)  # its 3 heads
    return (
        case("for the worked example's three heads [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]] (it "
             "should give back torch.arange(12.).reshape(1, 2, 6))", ("merge", "small", "printed"), x=worked),
        case("for heads of shape (2, 3, 5, 4), float32", ("merge", "small"), x=_normal(g, (2, 3, 5, 4), "float32")),
    )


def merge_secret(rng: np.random.Generator) -> list:
    """The worked example's sizes with fresh numbers, the visible float32 sizes, every shape of the
    old hidden tests in both dtypes, random sizes, the inverse of a split (a transposed view) and
    the gradient (whose reference value is the split of the upstream gradient)."""
    cases = [case("for heads of shape (1, 3, 2, 2), float64", ("merge", "small"),
                  x=_normal(rng, (1, 3, 2, 2), "float64")),
             case("for heads of shape (2, 3, 5, 4), float32", ("merge", "small"),
                  x=_normal(rng, (2, 3, 5, 4), "float32"))]
    sizes = [(B, H, T, d // H) for B, T, d, H in SPLIT_SHAPES]
    sizes += [tuple(int(v) for v in rng.integers(1, 6, size=4)) for _ in range(2)]
    for dtype in ("float32", "float64"):
        cases += [case(f"for heads of shape {s}, {dtype}", "merge", x=_normal(rng, s, dtype)) for s in sizes]
    for (B, T, d, H), dtype in (((2, 5, 12, 3), "float64"), ((3, 2, 8, 2), "float32")):
        cases.append(case(f"for heads given as a transposed view (B, n_heads, T, d_k) of x of shape "
                          f"{(B, T, H, d // H)}, {dtype}, as split_heads hands them over (it should give back x "
                          "with its last two axes as one)", "merge", x=_normal(rng, (B, T, H, d // H), dtype),
                          transposed=True))
    for (B, H, T, d_k), dtype in (((2, 4, 3, 2), "float64"), ((1, 2, 5, 3), "float32")):
        cases.append(case(f"for heads of shape {(B, H, T, d_k)}, {dtype}, with the gradient", "merge",
                          x=_normal(rng, (B, H, T, d_k), dtype), grad_out=_normal(rng, (B, T, H * d_k), dtype)))
    return cases


# ================================================================ MultiHeadAttention
class _MHA(nn.Module):
    """A correct multi-head attention, written step by step so that each mistake below changes one step."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def split(self, t):
        return _split(t, self.n_heads)

    def merge(self, t):
        return _merge(t)

    def scale(self, Q):
        return math.sqrt(Q.shape[-1])

    def attend(self, Q, K, V, mask):
        s = Q @ K.transpose(-2, -1) / self.scale(Q)
        if mask is not None:
            s = s + mask
        w = torch.softmax(s, dim=-1)
        return w @ V, w

    def project_out(self, t):
        return self.W_o(t)

    def forward(self, x, mask=None):
        Q, K, V = (self.split(W(x)) for W in (self.W_q, self.W_k, self.W_v))
        out, w = self.attend(Q, K, V, mask)
        return self.project_out(self.merge(out)), w


class _HeadsSplitWithoutTranspose(_MHA):
    def split(self, t):
        return _split_reshape_directly(t, self.n_heads)

    def merge(self, t):
        return t.reshape(t.shape[0], t.shape[2], -1)  # its inverse, in memory order


class _HeadsCutInWrongOrder(_MHA):
    def split(self, t):
        return _split_wrong_order(t, self.n_heads)

    def merge(self, t):
        return _merge_wrong_order(t)


class _MergedWithoutTransposingBack(_MHA):
    def merge(self, t):
        return t.reshape(t.shape[0], t.shape[2], -1)


class _NoWo(_MHA):
    def project_out(self, t):
        return t


class _ScaledBySqrtDModel(_MHA):
    def scale(self, Q):
        return math.sqrt(Q.shape[-1] * self.n_heads)


class _NotScaled(_MHA):
    def scale(self, Q):
        return 1.0


class _MaskIgnored(_MHA):
    def forward(self, x, mask=None):
        return super().forward(x)


class _WeightsAveraged(_MHA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out, w.mean(dim=1)  # (B, T, T), what nn.MultiheadAttention returns by default


class _QueriesAndKeysSwapped(_MHA):
    def forward(self, x, mask=None):
        Q, K, V = (self.split(W(x)) for W in (self.W_k, self.W_q, self.W_v))
        out, w = self.attend(Q, K, V, mask)
        return self.W_o(self.merge(out)), w


class _HeadCountNamedH(_MHA):
    """The head count kept as self.h (the Annotated Transformer's name), d_k as asked: no n_heads."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.n_heads
        self.h = n_heads

    def split(self, t):
        return _split(t, self.h)


MHA_VALUES = frozenset({VALUES, MASKS})
MHA_MISTAKES = (
    Mistake("heads split without the transpose",
            "viewing (B, T, d_model) directly as (B, n_heads, T, d_k) cuts the sequence, not each token's features, "
            "into heads. View as (B, T, n_heads, d_k), then .transpose(1, 2).",
            _HeadsSplitWithoutTranspose, MHA_VALUES),
    Mistake("heads cut in the wrong order",
            "view as (B, T, n_heads, d_k), not (B, T, d_k, n_heads): each head owns d_k consecutive features.",
            _HeadsCutInWrongOrder, MHA_VALUES),
    Mistake("heads merged without transposing back",
            "the attention output is (B, n_heads, T, d_k): .transpose(1, 2) to (B, T, n_heads, d_k) before reshaping "
            "to (B, T, d_model).",
            _MergedWithoutTransposingBack, MHA_VALUES),
    # no gradient reaches W_o
    Mistake("W_o forgotten",
            "after merging the heads, apply the output projection self.W_o: it is what mixes the heads.", _NoWo,
            MHA_VALUES | {GRADS}),
    Mistake("scaled by sqrt(d_model)",
            "each head compares vectors of width d_k = d_model // n_heads, so its scores are divided by sqrt(d_k), not "
            "sqrt(d_model) (your attention function does this if it uses Q.shape[-1]).",
            _ScaledBySqrtDModel, MHA_VALUES),
    Mistake("scores not scaled", "the attention inside each head divides the scores by sqrt(d_k).", _NotScaled,
            MHA_VALUES),
    Mistake("mask ignored", "pass `mask` on to the attention function.", _MaskIgnored, frozenset({MASKS})),
    Mistake("weights averaged over heads", "return every head's weights, shape (B, n_heads, T, T), not their mean.",
            _WeightsAveraged, MHA_VALUES),
    Mistake("queries and keys swapped",
            "queries come from W_q and keys from W_k; swapping them transposes every head's score matrix.",
            _QueriesAndKeysSwapped, MHA_VALUES),
    # (its values are right: only the structure test reads the attribute)
    Mistake("head count kept under another name",
            "keep the number of heads as self.n_heads (and each head's width as self.d_k = d_model // n_heads), "
            "whatever you call them inside forward: the KV-cache and capstone exercises read mha.n_heads and "
            "mha.d_k from your module.",
            _HeadCountNamedH, frozenset({STRUCTURE})),
)


# ---------------------------------------------------------------- the module's adapter
def build(piece, *sizes, owner="MultiHeadAttention"):
    """``piece(*sizes)`` under a fixed seed (the caller's random state is left as it was): an nn.Module."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = piece(*sizes)
    if not isinstance(module, nn.Module):
        raise AssertionError(
            f"{owner}{tuple(sizes)} should build an nn.Module (a class that subclasses nn.Module and calls "
            f"super().__init__()), but it built a {type(module).__name__}.")
    return module


def describe_layer(layer) -> str:
    """A layer as plain data: "nn.Linear(16, 16, bias=False)" (sizes read off its weight), "missing",
    or its type's name."""
    if layer is None:
        return "missing"
    if not isinstance(layer, nn.Linear):
        return type(layer).__name__
    out_features, in_features = (int(s) for s in layer.weight.shape)
    return f"nn.Linear({in_features}, {out_features}, bias={layer.bias is not None})"


def describe_integer(module, name):
    """An attribute that later code uses as an integer, as plain data: its value as an int where
    Python accepts it as one (``operator.index``: an int, a NumPy integer, a one-element integer
    tensor), "missing", or what it is instead ("a float, 4.0"). Read from the instance, so a
    property, a ``setattr`` or a class attribute count alike."""
    try:
        value = getattr(module, name)
    except AttributeError:  # (nn.Module's own error for a name it does not hold)
        return "missing"
    try:
        return int(operator.index(value))
    except TypeError:
        pass
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"a {type(value).__name__}, {shown}"


def module_structure(module, layers, integers=()) -> dict:
    """What a structure test judges, as plain data: each named layer described, how many distinct
    layers they are, the number of parameters and their list (name and shape, sorted by name), and
    each attribute of ``integers`` (``describe_integer``). A parameter of a named layer is listed
    under that layer's name ("W_q.weight"), wherever the module keeps it (an nn.ModuleDict behind a
    property, say), so that a right answer's list is the reference's."""
    found = [getattr(module, n, None) for n in layers]
    out = {n: describe_layer(layer) for n, layer in zip(layers, found)}
    out["distinct layers"] = len({id(layer) for layer in found if layer is not None})
    out["parameters"] = int(sum(p.numel() for p in module.parameters()))
    known = {id(p): f"{n}.{k}" for n, layer in zip(layers, found) if isinstance(layer, nn.Module)
             for k, p in layer.named_parameters()}
    listed = sorted(f"{known.get(id(p), k)} {tuple(p.shape)}" for k, p in module.named_parameters())
    out["parameter list"] = ", ".join(listed)
    out.update({n: describe_integer(module, n) for n in integers})
    return out


def parameter(module, name, owner="MultiHeadAttention"):
    """The parameter ``name`` ("W_q.weight") of the module: its layer must be an nn.Linear."""
    layer_name, _, attr = name.rpartition(".")
    layer = getattr(module, layer_name, None)
    if not isinstance(layer, nn.Linear):
        raise AssertionError(
            f"{owner} should have an attribute {layer_name} that is an nn.Linear "
            f"(self.{layer_name} = nn.Linear(d_model, d_model, bias=False)); "
            + ("it has none." if layer is None else f"yours is a {type(layer).__name__}."))
    return getattr(layer, attr)


def load(module, weights: dict, owner="MultiHeadAttention") -> None:
    """Copy each tensor of ``weights`` (parameter name -> tensor) into the module's parameter of that name."""
    with torch.no_grad():
        for name, W in weights.items():
            p = parameter(module, name, owner)
            if tuple(p.shape) != tuple(W.shape):
                raise AssertionError(f"{owner}.{name} has shape {tuple(p.shape)} but should be {tuple(W.shape)} "
                                     "(d_model x d_model).")
            p.copy_(W)


def _pair(result):
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        what = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise AssertionError(f"it returned a {what}, expected a tuple (output, weights)")
    return tuple(result)


def module_adapter(piece, case):
    """Build the answer's class with the case's sizes, then

    - a structure case (``d_model``): its structure (``module_structure``: the four layers and the
      contract's attributes), after one forward pass whose errors do not matter (what it calls is
      still watched);
    - a value case: the case's weights loaded by name, the parameters frozen, ``forward(x[, mask])``:
      the output, the weights, x and the mask as they are after the call, and the names of the
      module's parameters and buffers that the call changed (none, for a right answer);
    - a gradient case (``loss_seed``): the same with the parameters trainable, the output weighted by
      seeded random numbers of its own shape and back-propagated: the gradients of x and of each
      parameter (None where none reaches it), the output (detached), the weights' type and dtype, the
      inputs after the call and, in float64, the central finite difference ``fd`` of that scalar when
      x and the weights move together along the case's directions (``honest_gradients``).
    """
    if "d_model" in case:
        module = build(piece, case["d_model"], case["n_heads"])
        try:
            module(case["x"].clone())
        except Exception:
            pass
        return module_structure(module, PROJECTIONS, tuple(CONTRACT))
    x = case["x"].clone()
    module = build(piece, x.shape[-1], case["n_heads"]).to(x.dtype)
    load(module, {n: case[n] for n in PARAMS})
    kwargs = {"mask": case["mask"].clone()} if "mask" in case else {}
    params = [parameter(module, n) for n in PARAMS]
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if "loss_seed" not in case:
        module.requires_grad_(False)
        out, w = _pair(module(x, **kwargs))
        res = {"weights": w, "output": out}  # (the weights compared first: they say more about what went wrong)
    else:
        x.requires_grad_(True)
        out, w = _pair(module(x, **kwargs))
        if type(out) is not torch.Tensor:
            raise AssertionError(f"the output is a {type(out).__name__}, not a torch.Tensor")
        if not out.requires_grad:
            raise AssertionError(
                "the output does not require grad although x and the weights do: gradients cannot flow back. Avoid "
                ".detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside forward.")
        grads = torch.autograd.grad(_weighted([out], case["loss_seed"]), [x, *params], allow_unused=True)
        res = {"grad_x": grads[0], **{f"grad_{n}": g for n, g in zip(PARAMS, grads[1:])},
               "output": out.detach(), "weights (its type and dtype)": w.detach().reshape(-1)[:0]
               if isinstance(w, torch.Tensor) else w}
    res["x after the call"] = x.detach()
    after = module.state_dict()
    res["changed by the call"] = ", ".join(k for k, v in before.items() if not torch.equal(v, after[k].detach()))
    if kwargs:
        res["mask after the call"] = kwargs["mask"]
    if "loss_seed" in case and all(f"dir_{n}" in case for n in ("x", *PARAMS)):
        def scalar(sign):
            load(module, {n: case[n] + sign * FD_STEP * case[f"dir_{n}"] for n in PARAMS})
            with torch.no_grad():
                moved = _pair(module(case["x"] + sign * FD_STEP * case["dir_x"], **kwargs))[0]
            return _weighted([moved], case["loss_seed"]).to(torch.float64)

        res["fd"] = (scalar(1.0) - scalar(-1.0)) / (2 * FD_STEP)
    return res


# ---------------------------------------------------------------- properties (plain data)
def mha_structure(case, out, want):
    """Four bias-free (d_model, d_model) nn.Linear layers W_q, W_k, W_v, W_o, four distinct ones, and
    nothing else: 4 * d_model**2 parameters, whatever the number of heads; then the contract's
    integer attributes n_heads and d_k, equal to the reference's."""
    if "d_model" not in case:
        return None
    d, H = case["d_model"], case["n_heads"]
    for n in PROJECTIONS:
        got = out.get(n)
        if got == want[n]:
            continue
        if got == "missing":
            return (f"MultiHeadAttention should have an attribute {n} that is an nn.Linear "
                    f"(self.{n} = nn.Linear(d_model, d_model, bias=False)); it has none.")
        if not str(got).startswith("nn.Linear("):
            return (f"MultiHeadAttention should have an attribute {n} that is an nn.Linear "
                    f"(self.{n} = nn.Linear(d_model, d_model, bias=False)); yours is a {got}.")
        if str(got).endswith("bias=True)"):
            return f"{n} should have no bias: nn.Linear(d_model, d_model, bias=False)."
        return (f"for d_model={d}, n_heads={H}, {n} is {got} but should be {want[n]}: every projection maps "
                "d_model features to d_model features (all heads at once).")
    if out.get("distinct layers") != want["distinct layers"]:
        return "W_q, W_k, W_v and W_o should be four different nn.Linear layers, not one shared layer."
    if out.get("parameters") != want["parameters"]:
        return (f"MultiHeadAttention({d}, {H}) has {out.get('parameters'):,} parameters but should have "
                f"4 * d_model**2 = {want['parameters']:,} (four d_model x d_model matrices, no biases). "
                f"Yours: {out.get('parameter list')}.")
    # the contract with the later exercises: the values read from the built instance (an int, or what
    # the attribute is instead: ``describe_integer``)
    for n, (what, line) in CONTRACT.items():
        got = out.get(n)
        if got == want[n]:
            continue
        read = (f"the KV-cache and capstone exercises read mha.{n} from your module (in "
                "cached_attention_step(x_new, cache, mha)).")
        if got == "missing":
            return (f"MultiHeadAttention({d}, {H}) should have an attribute {n}, {what}: here {want[n]} "
                    f"({line}); it has none. This exercise asks for it because {read}")
        if isinstance(got, str):
            return (f"MultiHeadAttention({d}, {H}).{n} should be the integer {want[n]}, {what} ({line}), but "
                    f"yours is {got}, which cannot size a tensor (view and reshape take integers): {read}")
        return (f"MultiHeadAttention({d}, {H}).{n} is {got} but should be {want[n]}, {what} ({line}): {read}")
    return None


def weights_left_alone(case, out, want):
    """Calling the module leaves its own parameters and buffers as they were."""
    changed = out.get("changed by the call")
    if not changed:
        return None
    return f"calling the module changed its own parameter {changed}: forward must not modify the weights."


def output_order(case, out, want):
    """(output, weights), not (weights, output): the output has x's shape, the weights (B, n_heads, T, T)."""
    got = out.get("output")
    if "x" not in case or not isinstance(got, np.ndarray):
        return None
    B, T, _ = case["x"].shape
    if got.shape == (B, case["n_heads"], T, T) != case["x"].shape:
        return (f"it returned its two results in the wrong order: (weights, output) instead of (output, weights). "
                f"The output has x's shape, here output {tuple(case['x'].shape)}, and the weights "
                f"(B, n_heads, T, T) = {(B, case['n_heads'], T, T)}.")
    return None


def masked_weights_are_zero(case, out, want):
    """Where the mask is -inf (a causal mask above the diagonal, a padded key), every head's weight is exactly 0."""
    w = out.get("weights")
    if case.get("mask") is None or not isinstance(w, np.ndarray) or w.shape != want["weights"].shape:
        return None  # (a wrong shape: the comparison says so)
    hidden = np.broadcast_to(np.isneginf(case["mask"]), w.shape)
    if not np.any(w[hidden] != 0):
        return None
    if "causal" in case["tags"]:
        reach = f"; yours reach {float(np.abs(w[hidden]).max()):.6g}" if case["show"] else ""
        return ("with the causal mask, every weight above the diagonal (a token looking at a later one) must be "
                f"exactly 0{reach}. Is the mask passed on to the attention of every head?")
    return ("a weight on a masked (-inf) position is not exactly 0. Is the mask passed on to the attention of every "
            "head?")


# ---------------------------------------------------------------- the cases
def _weights(rng, d, dtype):
    """The four matrices, std 1/sqrt(d_model): projected features have variance about 1."""
    return {n: _normal(rng, (d, d), dtype, 1 / math.sqrt(d)) for n in PARAMS}


def _mha_case(rng, tags, B, T, d, H, dtype, mask=None, what="", grads=False):
    label = f"for x of shape {(B, T, d)}, n_heads={H}, {dtype}{what}" + (", with the gradients" if grads else "")
    c = case(label, tags, x=_normal(rng, (B, T, d), dtype), n_heads=H, **_weights(rng, d, dtype))
    if mask is not None:
        c["mask"] = mask.astype(dtype)
    return grad_case(rng, c, ("x", *PARAMS)) if grads else c


def _structure_case(d, H, x):
    return case(f"for MultiHeadAttention({d}, {H})", "structure", d_model=d, n_heads=H, x=x)


STRUCTURE_SIZES = ((16, 4), (12, 3), (8, 1), (128, 4), (32, 8))  # (d_model, n_heads)
# (B, T, d_model, n_heads): a single head and token, heads of width 1
MHA_SHAPES = ((2, 5, 8, 2), (1, 1, 4, 1), (3, 6, 16, 4), (2, 7, 12, 3), (1, 4, 32, 8), (2, 3, 8, 8))


def _mha_visible() -> tuple:
    structure = [_structure_case(d, H, np.random.default_rng(d).standard_normal((2, 3, d)).astype("float32"))
                 for d, H in STRUCTURE_SIZES]
    return (
        *structure,
        _mha_case(np.random.default_rng(101), "reference", 2, 5, 8, 2, "float64"),
        _mha_case(np.random.default_rng(103), ("mask", "causal"), 2, 5, 8, 2, "float64", causal_mask_array(5, "float64"),
                  ", causal mask"),
        _mha_case(np.random.default_rng(109), "grads", 2, 3, 4, 2, "float64", grads=True),
    )


def mha_secret(rng: np.random.Generator) -> list:
    """The structure at the visible sizes and random ones; values at every shape of the old hidden
    tests (one token, one head, heads of width 1) in both dtypes and a random one; causal masks,
    additive biases and padding masks at several shapes in both dtypes; gradients with and without
    a causal mask and a padding mask (float64, with finite differences) and in float32 (they must
    exist)."""
    cases = []
    sizes = [*STRUCTURE_SIZES]
    for _ in range(2):
        H = int(rng.integers(1, 6))
        sizes.append((H * int(rng.integers(1, 9)), H))
    cases += [_structure_case(d, H, _normal(rng, (2, 3, d), "float32")) for d, H in sizes]
    H = int(rng.integers(1, 5))
    drawn = (int(rng.integers(1, 4)), int(rng.integers(1, 8)), H * int(rng.integers(1, 6)), H)
    for dtype in ("float32", "float64"):
        cases += [_mha_case(rng, "reference", *s, dtype) for s in (*MHA_SHAPES, drawn)]
        for B, T, d, H in MHA_SHAPES[2:5]:
            cases.append(_mha_case(rng, ("mask", "causal"), B, T, d, H, dtype, causal_mask_array(T, dtype), ", causal mask"))
        bias = _normal(rng, (6, 6), dtype)
        cases.append(_mha_case(rng, "mask", 2, 6, 16, 4, dtype, bias, ", an additive (6, 6) bias"))
        pad = np.zeros((2, 1, 1, 6))  # the last keys of one sequence hidden from every query of every head
        pad[int(rng.integers(0, 2)), ..., int(rng.integers(2, 6)):] = -np.inf
        cases.append(_mha_case(rng, "mask", 2, 6, 16, 4, dtype, pad, ", a (2, 1, 1, 6) padding mask"))
    cases.append(_mha_case(rng, ("mask", "causal"), 2, 5, 8, 2, "float64", causal_mask_array(5, "float64"), ", causal mask"))
    cases.append(_mha_case(rng, "grads", 2, 3, 4, 2, "float64", grads=True))
    cases.append(_mha_case(rng, "grads", 2, 3, 4, 2, "float64", causal_mask_array(3, "float64"), ", causal mask", grads=True))
    pad = np.zeros((2, 1, 1, 4))
    pad[1, ..., 3:] = -np.inf
    cases.append(_mha_case(rng, "grads", 2, 4, 6, 3, "float64", pad, ", a padding mask", grads=True))
    cases.append(_mha_case(rng, "grads", 3, 2, 8, 4, "float32", grads=True))
    return cases


# ================================================================ the declaration
FORBIDDEN = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECE_NAMES)
GRAD_NAMES = {f"grad_{n}": f"the gradient with respect to {n}" for n in ("x", *PARAMS)}

SPLIT_EXERCISE = Exercise(
    name=NAME,
    piece="split_heads",
    call="split_heads(x, n_heads)",
    adapter=call_runner(("x", "n_heads"), grad=("x",)),
    reference="firstprinciples.reference:split_heads",
    names=GRAD_NAMES,
    visible=_split_visible(),
    secret=split_secret,
    tests={SPLIT: Test(2, frozenset({"split"}), first=(worked_split,))},
    forbidden=dict(FORBIDDEN, what="split_heads"),
    mistakes=SPLIT_MISTAKES,
    hints=(
        ("shape '[", "Reshape x (B, T, d_model) to (B, T, n_heads, d_k) with d_k = d_model // n_heads, then "
                     ".transpose(1, 2)."),
    ),
    elsewhere={RECAP_SPLIT: Test(1, frozenset({"small"}), first=(worked_split,))},
)

MERGE_EXERCISE = Exercise(
    name=NAME,
    piece="merge_heads",
    call="merge_heads(heads)",
    adapter=merge_adapter,
    reference="firstprinciples.reference:merge_heads",
    names=GRAD_NAMES,
    visible=_merge_visible(),
    secret=merge_secret,
    tests={MERGE: Test(2, frozenset({"merge"}), first=(worked_merge,))},
    forbidden=dict(FORBIDDEN, what="merge_heads"),
    mistakes=MERGE_MISTAKES,
    elsewhere={RECAP_MERGE: Test(1, frozenset({"small"}), first=(worked_merge,))},
)

MHA_EXERCISE = Exercise(
    name=NAME,
    piece="MultiHeadAttention",
    call="MultiHeadAttention(d_model, n_heads)(x, mask)",
    adapter=module_adapter,
    reference="firstprinciples.reference:MultiHeadAttention",
    names={**GRAD_NAMES, "distinct layers": "the number of distinct layers among W_q, W_k, W_v, W_o",
           "parameters": "the number of parameters", "parameter list": "the parameters (name and shape)",
           **{n: f"the attribute {n}" for n in CONTRACT}},
    visible=_mha_visible(),
    secret=mha_secret,
    tests={
        STRUCTURE: Test(2, frozenset({"structure"}), first=(mha_structure,)),
        VALUES: Test(3, frozenset({"reference"}), first=(weights_left_alone, output_order)),
        MASKS: Test(2, frozenset({"mask"}), first=(weights_left_alone, output_order, masked_weights_are_zero)),
        GRADS: Test(1, frozenset({"grads"}), first=(weights_left_alone, output_order, honest_gradients), values=False),
    },
    forbidden=dict(FORBIDDEN, what="multi-head attention"),
    mistakes=MHA_MISTAKES,
    hints=(
        ("cannot be multiplied", "Each head's Q and K are (B, n_heads, T, d_k): Q @ K.transpose(-2, -1) pairs their "
                                 "last dimensions."),
        ("modified by an inplace operation", "An in-place operation on a tensor that autograd still needs breaks the "
                                             "backward pass: build new tensors instead."),
    ),
    elsewhere={RECAP_MHA: Test(1, frozenset({"reference"}), first=(weights_left_alone, output_order))},
)

# This notebook's recap of the attention exercise (its cell test_scaled_dot_product_attention): the
# worked example inside a batch of heads, without and with the causal mask (attention.RECAP's cases),
# judged in the re-check as the attention exercise judges this cell (its ``elsewhere``: the secret
# worked-example-sized cases, which have no mask, so only the mistakes they catch are named here).
_RECAP_TEST = attention.EXERCISE.elsewhere[attention.RECAP_ID]
ATTENTION_RECAP = recap(
    attention.EXERCISE, NAME, {attention.RECAP_ID: _RECAP_TEST},
    visible=tuple({**c, "tags": tuple(sorted(_RECAP_TEST.tags))} for c in attention.RECAP.visible),
    mistakes={label: ({attention.RECAP_ID}, ()) for label in (
        "no scaling", "scaled by d_k", "scaled by sqrt(T_k)", "softmax over the wrong axis", "keys used as values",
        "scores returned as weights")},
)

PIECES = (ATTENTION_RECAP, SPLIT_EXERCISE, MERGE_EXERCISE, MHA_EXERCISE)

# What the later notebooks' recaps (transformer_block, capstone) are made from: the visible cases of this
# notebook's tests, judged as their cells are in the re-check (``elsewhere`` above).
SPLIT_RECAP = dataclasses.replace(SPLIT_EXERCISE, tests={RECAP_SPLIT: SPLIT_EXERCISE.elsewhere[RECAP_SPLIT]})
MERGE_RECAP = dataclasses.replace(MERGE_EXERCISE, tests={RECAP_MERGE: MERGE_EXERCISE.elsewhere[RECAP_MERGE]})
MHA_RECAP = dataclasses.replace(MHA_EXERCISE, tests={RECAP_MHA: MHA_EXERCISE.elsewhere[RECAP_MHA]})
