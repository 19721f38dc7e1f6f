"""Checks for ``split_heads``, ``merge_heads`` and ``MultiHeadAttention``.

- ``split_heads(x, n_heads)``: (B, T, d_model) -> (B, n_heads, T, d_k), d_k = d_model // n_heads;
- ``merge_heads(x)``: (B, n_heads, T, d_k) -> (B, T, n_heads * d_k), the inverse;
- ``MultiHeadAttention(d_model, n_heads)``: an ``nn.Module`` with bias-free
  ``nn.Linear`` layers ``W_q``, ``W_k``, ``W_v``, ``W_o``; ``forward(x, mask=None)``
  returns (output (B, T, d_model), weights (B, n_heads, T, T)).

Visible checks: the worked split of a (1, 2, 6) tensor into 3 heads, the module's
structure, one seeded case against the reference, the causal mask. Hidden checks:
more shapes, both float dtypes, masks, and PyTorch's ``nn.MultiheadAttention``
with the same weights. The student's module is built and called under
``call_without``: an answer that uses PyTorch's attention or the course's
reference scores 0. Every weight is seeded: the module is built under a fixed
seed (without touching the caller's random state) and its four weight matrices
are then overwritten with seeded random ones.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..examples.multihead import EXAMPLE_HEADS, split_example
from ..guard import ForbiddenCall, call_without
from ..reference import causal_mask
from ..reference import merge_heads as ref_merge_heads
from ..reference import scaled_dot_product_attention as ref_attention
from ..reference import split_heads as ref_split_heads
from ._student import wrap_checks
from ._core import Mistake, assert_gradcheck, assert_matches, call_answer, exact, fmt, unpack, with_diagnosis

TORCH_PATTERNS = ("multi_head_attention", "scaled_dot_product_attention", "MultiheadAttention")
PIECES = ("split_heads", "merge_heads", "MultiHeadAttention", "scaled_dot_product_attention")

FORBIDDEN_SPLIT = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECES, what="split_heads")
FORBIDDEN_MERGE = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECES, what="merge_heads")
FORBIDDEN_MHA = dict(torch_patterns=TORCH_PATTERNS, pieces=PIECES, what="multi-head attention")

PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")


# ---------------------------------------------------------------- mistakes: split and merge
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
    Mistake(
        "transpose forgotten",
        "after reshaping to (B, T, n_heads, d_k), swap axes 1 and 2 (.transpose(1, 2)) so that the heads "
        "come before the time axis: (B, n_heads, T, d_k).",
        _split_no_transpose,
    ),
    Mistake(
        "reshaped straight to (B, n_heads, T, d_k)",
        "a reshape keeps the order of the entries in memory, so this cuts the sequence of tokens into pieces, "
        "not each token's features. Reshape to (B, T, n_heads, d_k) first, then .transpose(1, 2).",
        _split_reshape_directly,
    ),
    Mistake(
        "d_k and n_heads in the wrong order",
        "reshape to (B, T, n_heads, d_k), not (B, T, d_k, n_heads): head h owns the d_k consecutive features "
        "h*d_k ... (h+1)*d_k - 1, not every n_heads-th feature.",
        _split_wrong_order,
    ),
    Mistake(
        "n_heads and d_k swapped",
        "there are n_heads heads, each of width d_k = d_model // n_heads; the result has shape (B, n_heads, T, d_k).",
        _split_heads_and_dk_swapped,
    ),
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
    Mistake(
        "merged without transposing back",
        "the input is (B, n_heads, T, d_k): first .transpose(1, 2) to (B, T, n_heads, d_k), then reshape to "
        "(B, T, n_heads * d_k). Reshaping directly mixes different tokens into one row.",
        _merge_no_transpose,
    ),
    Mistake(
        "heads interleaved",
        "head h's d_k features must end up side by side, at positions h*d_k ... (h+1)*d_k - 1: transpose to "
        "(B, T, n_heads, d_k) and reshape; do not move d_k before n_heads.",
        _merge_wrong_order,
    ),
    Mistake(
        "heads not flattened",
        "after the transpose, reshape (B, T, n_heads, d_k) into (B, T, n_heads * d_k).",
        _merge_not_flattened,
    ),
    Mistake(
        "heads added instead of concatenated",
        "merging puts the heads' outputs side by side (a concatenation), it does not sum them.",
        _merge_summed,
    ),
)


# ---------------------------------------------------------------- mistakes: the module
# Each takes (x, W_q, W_k, W_v, W_o, n_heads, mask), the weights in nn.Linear's
# convention (a layer computes x @ W.T), and returns (output, weights).
def _attend(Q, K, V, mask, scale):
    s = Q @ K.transpose(-2, -1) / scale
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def _mha(x, W_q, W_k, W_v, W_o, n_heads, mask=None, *, split=None, merge=None, scale=None,
         use_mask=True, project_out=True, swap_qk=False):
    split = split or ref_split_heads.__wrapped__
    merge = merge or ref_merge_heads.__wrapped__
    Q, K, V = (split(x @ W.T, n_heads) for W in (W_q, W_k, W_v))  # (B, H, T, d_k)
    if swap_qk:
        Q, K = K, Q
    scale = math.sqrt(Q.shape[-1]) if scale is None else scale
    out, w = _attend(Q, K, V, mask if use_mask else None, scale)
    out = merge(out)  # (B, T, d_model)
    return (out @ W_o.T if project_out else out), w


def reference_mha(x, W_q, W_k, W_v, W_o, n_heads, mask=None):
    """The reference module's computation, as a function of its weights."""
    Q, K, V = (ref_split_heads(x @ W.T, n_heads) for W in (W_q, W_k, W_v))  # (B, H, T, d_k)
    out, w = ref_attention(Q, K, V, mask)
    return ref_merge_heads(out) @ W_o.T, w


def _m_split_no_transpose(x, *W, mask=None):
    return _mha(x, *W, mask, split=_split_reshape_directly, merge=lambda t: t.reshape(t.shape[0], t.shape[2], -1))


def _m_wrong_order(x, *W, mask=None):
    return _mha(x, *W, mask, split=_split_wrong_order, merge=_merge_wrong_order)


def _m_merge_no_transpose(x, *W, mask=None):
    return _mha(x, *W, mask, merge=_merge_no_transpose)


def _m_no_w_o(x, *W, mask=None):
    return _mha(x, *W, mask, project_out=False)


def _m_sqrt_d_model(x, *W, mask=None):
    return _mha(x, *W, mask, scale=math.sqrt(x.shape[-1]))


def _m_no_scaling(x, *W, mask=None):
    return _mha(x, *W, mask, scale=1.0)


def _m_mask_ignored(x, *W, mask=None):
    return _mha(x, *W, mask, use_mask=False)


def _m_weights_averaged(x, *W, mask=None):
    out, w = _mha(x, *W, mask)
    return out, w.mean(dim=1)  # (B, T, T), what nn.MultiheadAttention returns by default


def _m_qk_swapped(x, *W, mask=None):
    return _mha(x, *W, mask, swap_qk=True)


def _with_mask(fn):
    def wrapped(x, W_q, W_k, W_v, W_o, n_heads, mask=None):
        return fn(x, W_q, W_k, W_v, W_o, n_heads, mask=mask)

    return wrapped


MHA_MISTAKES = (
    Mistake(
        "heads split without the transpose",
        "viewing (B, T, d_model) directly as (B, n_heads, T, d_k) cuts the sequence, not each token's "
        "features, into heads. View as (B, T, n_heads, d_k), then .transpose(1, 2).",
        _with_mask(_m_split_no_transpose),
    ),
    Mistake(
        "heads cut in the wrong order",
        "view as (B, T, n_heads, d_k), not (B, T, d_k, n_heads): each head owns d_k consecutive features.",
        _with_mask(_m_wrong_order),
    ),
    Mistake(
        "heads merged without transposing back",
        "the attention output is (B, n_heads, T, d_k): .transpose(1, 2) to (B, T, n_heads, d_k) before "
        "reshaping to (B, T, d_model).",
        _with_mask(_m_merge_no_transpose),
    ),
    Mistake(
        "W_o forgotten",
        "after merging the heads, apply the output projection self.W_o: it is what mixes the heads.",
        _with_mask(_m_no_w_o),
    ),
    Mistake(
        "scaled by sqrt(d_model)",
        "each head compares vectors of width d_k = d_model // n_heads, so its scores are divided by "
        "sqrt(d_k), not sqrt(d_model) (your attention function does this if it uses Q.shape[-1]).",
        _with_mask(_m_sqrt_d_model),
    ),
    Mistake(
        "scores not scaled",
        "the attention inside each head divides the scores by sqrt(d_k).",
        _with_mask(_m_no_scaling),
    ),
    Mistake("mask ignored", "pass `mask` on to the attention function.", _with_mask(_m_mask_ignored)),
    Mistake(
        "weights averaged over heads",
        "return every head's weights, shape (B, n_heads, T, T), not their mean.",
        _with_mask(_m_weights_averaged),
    ),
    Mistake(
        "queries and keys swapped",
        "queries come from W_q and keys from W_k; swapping them transposes every head's score matrix.",
        _with_mask(_m_qk_swapped),
    ),
)


# ---------------------------------------------------------------- split and merge


def _call_with_hints(fn, args, kwargs=None, *, names, forbidden, shapes=None):
    """``call_answer`` (an error of the answer names its line, see ``_student``)."""
    return call_answer(fn, args, kwargs, names=names, forbidden=forbidden, shapes=shapes)


def _run_piece(fn, args, forbidden):
    return _call_with_hints(fn, args, names=("output",), forbidden=forbidden)[0]


def _compare_piece(fn, args, expected, mistakes, reference, forbidden, name, label):
    got = _run_piece(fn, args, forbidden)
    with_diagnosis(
        lambda: assert_matches(name, got, expected, context=label),
        (got,), args, mistakes, reference,
    )
    return got


def _check_piece_gradient(fn, args, forbidden, adjoint, what):
    """The gradient of sum(out * R) with respect to x must be adjoint(R): split and merge only move entries."""
    x = args[0].clone().requires_grad_(True)
    out = unpack(call_without(fn, (x, *args[1:]), **forbidden), ("output",))[0]
    if not out.requires_grad:
        raise AssertionError(
            f"The output of {what} does not require grad although its input does: gradients cannot flow back. "
            "Use tensor operations only (no .detach(), .numpy(), torch.tensor(...) of results)."
        )
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)
    (grad,) = torch.autograd.grad((out * R).sum(), x, allow_unused=True)
    if grad is None:
        raise AssertionError(f"No gradient reaches the input of {what}.")
    assert_matches(f"the gradient through {what}", grad, adjoint(R))


SPLIT_SHAPES = [  # (B, T, d_model, n_heads)
    (2, 5, 12, 3),
    (1, 1, 4, 4),
    (3, 7, 16, 1),
    (2, 4, 32, 8),
    (1, 6, 6, 2),
]


def check_split_heads(fn, full=True):
    """The worked example (3 heads of width 2), then seeded random shapes and the gradient.

    ``full=False`` runs the worked example and one float32 case.
    """
    x = split_example(torch.float64)
    _compare_piece(
        fn, (x, EXAMPLE_HEADS), ref_split_heads.__wrapped__(x, EXAMPLE_HEADS), SPLIT_MISTAKES,
        ref_split_heads.__wrapped__, FORBIDDEN_SPLIT, "split_heads(x, 3)",
        "for the worked example x = torch.arange(12.).reshape(1, 2, 6) (head h holds features 2h, 2h+1 of each token)",
    )
    g = torch.Generator().manual_seed(31)
    cases = [(torch.float32, SPLIT_SHAPES[0])] if not full else [
        (dtype, s) for dtype in (torch.float32, torch.float64) for s in SPLIT_SHAPES
    ]
    for dtype, (B, T, d, H) in cases:
        x = torch.randn(B, T, d, generator=g, dtype=dtype)
        _compare_piece(
            fn, (x, H), ref_split_heads.__wrapped__(x, H), SPLIT_MISTAKES, ref_split_heads.__wrapped__,
            FORBIDDEN_SPLIT, f"split_heads(x, {H})", f"for x of shape {(B, T, d)}, {str(dtype).replace('torch.', '')}",
        )
    if full:
        x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
        _check_piece_gradient(fn, (x, 4), FORBIDDEN_SPLIT, ref_merge_heads.__wrapped__, "split_heads")


def check_merge_heads(fn, full=True):
    """The worked example backwards, merge_heads(split_heads(x)) == x, random shapes, the gradient.

    ``full=False`` runs the worked example and one float32 case.
    """
    x = split_example(torch.float64)
    heads = ref_split_heads.__wrapped__(x, EXAMPLE_HEADS).contiguous()  # (1, 3, 2, 2)
    _compare_piece(
        fn, (heads,), x, MERGE_MISTAKES, ref_merge_heads.__wrapped__, FORBIDDEN_MERGE, "merge_heads(heads)",
        "for the worked example's three heads [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]] "
        "(it should give back torch.arange(12.).reshape(1, 2, 6))",
    )
    g = torch.Generator().manual_seed(37)
    cases = [(torch.float32, SPLIT_SHAPES[0])] if not full else [
        (dtype, s) for dtype in (torch.float32, torch.float64) for s in SPLIT_SHAPES
    ]
    for dtype, (B, T, d, H) in cases:
        heads = torch.randn(B, H, T, d // H, generator=g, dtype=dtype)
        _compare_piece(
            fn, (heads,), ref_merge_heads.__wrapped__(heads), MERGE_MISTAKES, ref_merge_heads.__wrapped__,
            FORBIDDEN_MERGE, "merge_heads(heads)",
            f"for heads of shape {(B, H, T, d // H)}, {str(dtype).replace('torch.', '')}",
        )
    if full:
        # The inverse of a split, whose result is a transposed (non-contiguous) view.
        x = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
        _compare_piece(
            fn, (ref_split_heads.__wrapped__(x, 3),), x, MERGE_MISTAKES, ref_merge_heads.__wrapped__,
            FORBIDDEN_MERGE, "merge_heads(split_heads(x, 3))", "for x of shape (2, 5, 12) (it should give back x)",
        )
        heads = torch.randn(2, 4, 3, 2, generator=g, dtype=torch.float64)
        _check_piece_gradient(
            fn, (heads,), FORBIDDEN_MERGE, lambda R: ref_split_heads.__wrapped__(R, 4), "merge_heads"
        )


# ---------------------------------------------------------------- the module
def build(cls, *args, forbidden=FORBIDDEN_MHA, seed=0, **kwargs):
    """``cls(*args, **kwargs)`` under the guard and a fixed seed; the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = call_without(lambda: cls(*args, **kwargs), (), **forbidden)
    if not isinstance(module, nn.Module):
        raise AssertionError(
            f"{getattr(cls, '__name__', cls)}{tuple(args)} should build an nn.Module (a class that subclasses nn.Module "
            f"and calls super().__init__()), but it built a {type(module).__name__}."
        )
    return module


def forbidden_in_forward(module, x, forbidden):
    """Run one forward pass under the guard: a structure check must also score 0 for an
    answer whose forward calls a forbidden built-in. Other errors are left to the value checks."""
    try:
        call_without(module, (x,), **forbidden)
    except ForbiddenCall:
        raise
    except Exception:
        pass


def linear_layer(module, name, owner="MultiHeadAttention"):
    layer = getattr(module, name, None)
    if not isinstance(layer, nn.Linear):
        raise AssertionError(
            f"{owner} should have an attribute {name} that is an nn.Linear "
            f"(self.{name} = nn.Linear(d_model, d_model, bias=False)); "
            + ("it has none." if layer is None else f"yours is a {type(layer).__name__}.")
        )
    return layer


def random_weights(g, d_model, dtype):
    """Four (d_model, d_model) matrices, std 1/sqrt(d_model): projected features have variance about 1."""
    return tuple(torch.randn(d_model, d_model, generator=g, dtype=dtype) / math.sqrt(d_model) for _ in PROJECTIONS)


def load_mha_weights(module, mats, owner="MultiHeadAttention"):
    """Copy the four matrices into W_q, W_k, W_v, W_o (whose dtype is already that of the matrices)."""
    with torch.no_grad():
        for name, W in zip(PROJECTIONS, mats):
            layer = linear_layer(module, name, owner)
            if tuple(layer.weight.shape) != tuple(W.shape):
                raise AssertionError(
                    f"{owner}.{name}.weight has shape {tuple(layer.weight.shape)} but should be {tuple(W.shape)} "
                    "(d_model x d_model)."
                )
            layer.weight.copy_(W)


def _mha_label(x, n_heads, mask_name=""):
    s = f"for x of shape {tuple(x.shape)}, n_heads={n_heads}, {str(x.dtype).replace('torch.', '')}"
    return s + (f", {mask_name}" if mask_name else "")


def run_module(module, x, mask, forbidden, names=("output", "weights")):
    """Call the module on copies; fail if it changes its inputs or its own parameters, or
    returns (weights, output) instead of (output, weights): the output has x's shape."""
    before = {k: v.clone() for k, v in module.state_dict().items()}
    kwargs = {} if mask is None else {"mask": mask}
    shapes = (tuple(x.shape), None) if names == ("output", "weights") else None
    outputs = _call_with_hints(module, (x,), kwargs, names=names, forbidden=forbidden, shapes=shapes)
    for k, v in module.state_dict().items():
        if k in before and not torch.equal(before[k], v):
            raise AssertionError(f"Calling the module changed its own parameter {k}: forward must not modify weights.")
    return outputs


def _torch_mha(x, mats, n_heads, mask):
    """PyTorch's nn.MultiheadAttention with the same weights (built outside the guard)."""
    d_model = x.shape[-1]
    with torch.random.fork_rng(devices=[]):
        theirs = nn.MultiheadAttention(d_model, n_heads, bias=False, batch_first=True).to(x.dtype)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat(mats[:3]))
        theirs.out_proj.weight.copy_(mats[3])
        out, w = theirs(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
    return out, w


def _compare_mha(cls, g, B, T, d_model, n_heads, dtype, mask=None, mask_name="", against_torch=False):
    mats = random_weights(g, d_model, dtype)
    x = torch.randn(B, T, d_model, generator=g, dtype=dtype)
    module = build(cls, d_model, n_heads).to(dtype)
    load_mha_weights(module, mats)
    out, w = run_module(module, x, mask, FORBIDDEN_MHA)
    exp_out, exp_w = reference_mha(x, *mats, n_heads, mask)
    label = _mha_label(x, n_heads, mask_name)

    def check():
        assert_matches("weights", w, exp_w, context=label)
        assert_matches("output", out, exp_out, context=label)
        if against_torch:
            t_out, t_w = _torch_mha(x, mats, n_heads, mask)
            assert_matches("weights", w, t_w, context=label + " (against nn.MultiheadAttention)")
            assert_matches("output", out, t_out, context=label + " (against nn.MultiheadAttention)")

    with_diagnosis(check, (out, w), (x, *mats, n_heads, mask), MHA_MISTAKES, reference_mha)
    return out, w


def check_mha_structure(cls):
    """Four bias-free (d_model, d_model) nn.Linear layers W_q, W_k, W_v, W_o and nothing else:
    4 * d_model**2 parameters, whatever the number of heads. (One forward pass runs under the
    guard, so that an answer calling PyTorch's attention scores 0 here too.)"""
    for d_model, n_heads in [(16, 4), (12, 3), (8, 1), (128, 4), (32, 8)]:
        m = build(cls, d_model, n_heads)
        layers = [linear_layer(m, name) for name in PROJECTIONS]
        for name, layer in zip(PROJECTIONS, layers):
            if layer.bias is not None:
                raise AssertionError(f"{name} should have no bias: nn.Linear(d_model, d_model, bias=False).")
            if tuple(layer.weight.shape) != (d_model, d_model):
                raise AssertionError(
                    f"For d_model={d_model}, n_heads={n_heads}, {name}.weight has shape {tuple(layer.weight.shape)} "
                    f"but should be ({d_model}, {d_model}): every projection maps d_model features to d_model "
                    "features (all heads at once)."
                )
        x = torch.randn(2, 3, d_model, generator=torch.Generator().manual_seed(d_model))
        forbidden_in_forward(m, x, FORBIDDEN_MHA)
        if len({id(layer) for layer in layers}) < 4:
            raise AssertionError("W_q, W_k, W_v and W_o should be four different nn.Linear layers, not one shared layer.")
        count = sum(p.numel() for p in m.parameters())
        if count != 4 * d_model**2:
            listing = ", ".join(f"{k} {tuple(p.shape)}" for k, p in m.named_parameters())
            raise AssertionError(
                f"MultiHeadAttention({d_model}, {n_heads}) has {count:,} parameters but should have "
                f"4 * d_model**2 = {4 * d_model**2:,} (four d_model x d_model matrices, no biases). "
                f"Yours: {listing}."
            )


MHA_SHAPES = [  # (B, T, d_model, n_heads)
    (2, 5, 8, 2),
    (1, 1, 4, 1),
    (3, 6, 16, 4),
    (2, 7, 12, 3),
    (1, 4, 32, 8),
    (2, 3, 8, 8),  # d_k = 1
]


def check_mha_against_reference(cls, full=True):
    """Seeded weights and inputs against the reference and ``nn.MultiheadAttention``, no mask.

    ``full=False`` runs one float64 case against the reference only.
    """
    g = torch.Generator().manual_seed(101)
    if not full:
        _compare_mha(cls, g, 2, 5, 8, 2, torch.float64)
        return
    for dtype in (torch.float32, torch.float64):
        for B, T, d_model, n_heads in MHA_SHAPES:
            _compare_mha(cls, g, B, T, d_model, n_heads, dtype, against_torch=True)


def check_mha_causal(cls):
    """A causal mask: weights exactly 0 above the diagonal, values as the reference's."""
    g = torch.Generator().manual_seed(103)
    B, T, d_model, n_heads = 2, 5, 8, 2
    mask = causal_mask(T, torch.float64)
    mats = random_weights(g, d_model, torch.float64)
    x = torch.randn(B, T, d_model, generator=g, dtype=torch.float64)
    module = build(cls, d_model, n_heads).to(torch.float64)
    load_mha_weights(module, mats)
    out, w = run_module(module, x, mask, FORBIDDEN_MHA)
    label = _mha_label(x, n_heads, "causal mask")

    def check():
        if tuple(w.shape) == (B, n_heads, T, T):
            above = torch.triu(w.detach(), diagonal=1).abs().max().item()
            assert above == 0.0, (
                f"With the causal mask, every weight above the diagonal (a token looking at a later one) must be "
                f"exactly 0; yours reach {exact(above)}. Is the mask passed on to the attention of every head?"
            )
        assert_matches("weights", w, reference_mha(x, *mats, n_heads, mask)[1], context=label)
        assert_matches("output", out, reference_mha(x, *mats, n_heads, mask)[0], context=label)

    with_diagnosis(check, (out, w), (x, *mats, n_heads, mask), MHA_MISTAKES, reference_mha)


def check_mha_masks(cls):
    """Causal, additive-bias and padding masks, several shapes, both dtypes, against torch and the reference."""
    g = torch.Generator().manual_seed(107)
    for dtype in (torch.float32, torch.float64):
        for B, T, d_model, n_heads in MHA_SHAPES[2:5]:
            _compare_mha(cls, g, B, T, d_model, n_heads, dtype, causal_mask(T, dtype), "causal mask", against_torch=True)
        bias = torch.randn(6, 6, generator=g, dtype=dtype)
        _compare_mha(cls, g, 2, 6, 16, 4, dtype, bias, "an additive (6, 6) bias", against_torch=True)
        # Padding: the last two tokens of the second sequence are hidden from every query of every head.
        pad = torch.zeros(2, 1, 1, 6, dtype=dtype)
        pad[1, ..., 4:] = float("-inf")
        _compare_mha(cls, g, 2, 6, 16, 4, dtype, pad, "a (2, 1, 1, 6) padding mask")


def check_mha_gradients_and_inputs(cls, full=True):
    """Gradients reach x and all four weight matrices, agree with finite differences, and the
    input is left untouched. ``full=False`` skips the masked case.

    The gradient with respect to x is compared with central differences of the
    answer itself (``assert_gradcheck``, float64), so an answer with wrong
    values but honest gradients passes this check.
    """
    g = torch.Generator().manual_seed(109)
    for mask in (None, causal_mask(3, torch.float64)) if full else (None,):
        B, T, d_model, n_heads = 2, 3, 4, 2
        mats = random_weights(g, d_model, torch.float64)
        x = torch.randn(B, T, d_model, generator=g, dtype=torch.float64)
        module = build(cls, d_model, n_heads).to(torch.float64)
        load_mha_weights(module, mats)
        run_module(module, x, mask, FORBIDDEN_MHA)  # also checks that x is untouched
        kwargs = {} if mask is None else {"mask": mask}
        leaf = x.clone().requires_grad_(True)
        out = unpack(call_without(module, (leaf,), kwargs, **FORBIDDEN_MHA), ("output", "weights"))[0]
        if not out.requires_grad:
            raise AssertionError(
                "The output does not require grad although x does: gradients cannot flow back. Avoid .detach(), "
                ".numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside forward."
            )
        named = [("x", leaf)] + [(f"{n}.weight", getattr(module, n).weight) for n in PROJECTIONS]
        grads = torch.autograd.grad(out.sum(), [t for _, t in named], allow_unused=True)
        for (name, _), gr in zip(named, grads):
            if gr is None:
                raise AssertionError(f"No gradient reaches {name}: is it used in forward (and not detached)?")

        def output_only(inp):
            return unpack(call_without(module, (inp,), kwargs, **FORBIDDEN_MHA), ("output", "weights"))[0]

        assert_gradcheck(output_only, (leaf,), what="your output with respect to x", fast=True)


__all__ = [
    "FORBIDDEN_MHA",
    "MHA_MISTAKES",
    "MERGE_MISTAKES",
    "SPLIT_MISTAKES",
    "check_merge_heads",
    "check_mha_against_reference",
    "check_mha_causal",
    "check_mha_gradients_and_inputs",
    "check_mha_masks",
    "check_mha_structure",
    "check_split_heads",
    "reference_mha",
    "split_example",
]


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
