"""Checks for ``cross_attention(x, context, W_q, W_k, W_v, mask=None) -> (output, weights)``.

Queries come from x (B, T_q, d_model), keys and values from context
(B, T_k, d_ctx): W_q is (d_model, d_k), W_k (d_ctx, d_k), W_v (d_ctx, d_v).
The output is (B, T_q, d_v) and the weights (B, T_q, T_k); ``mask`` is an
additive float tensor broadcastable to (B, T_q, T_k) (in practice it hides
padding in the context).

Visible checks: the worked example ("Cat sat mat" as the context), shapes,
the roles of the two sequences, a comparison with PyTorch, gradients.
Hidden checks: more shapes, float64, padding masks and gradient checks.
Every check runs the answer under ``call_without``: calling PyTorch's
attention or the course's reference scores 0.

Tolerances are those of ``_core.TOLERANCES`` (float32 1e-5 + 1e-4 |value|,
float64 1e-10 + 1e-8 |value|): a correct answer differs from the reference
and from PyTorch only by the order of its sums.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import examples
from ..guard import call_without
from ..reference import cross_attention as reference
from ._student import describe, wrap_checks
from ._core import Mistake, assert_gradcheck, assert_matches, call_answer, fmt, unpack, with_diagnosis

FORBIDDEN = dict(
    torch_patterns=("scaled_dot_product_attention", "multi_head_attention"),
    pieces=("cross_attention", "scaled_dot_product_attention", "MultiHeadAttention"),
    what="cross-attention (with your own scaled_dot_product_attention)",
)


# ---------------------------------------------------------------- mistakes
def _attend(Q, K, V, mask=None, dim=-1):
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=dim)
    return w @ V, w


def _roles_swapped(x, context, W_q, W_k, W_v, mask=None):
    return _attend(context @ W_q, x @ W_k, x @ W_v, mask)


def _keys_from_x(x, context, W_q, W_k, W_v, mask=None):
    return _attend(x @ W_q, x @ W_k, context @ W_v, mask)


def _values_from_x(x, context, W_q, W_k, W_v, mask=None):
    return _attend(x @ W_q, context @ W_k, x @ W_v, mask)


def _causal_mask_applied(x, context, W_q, W_k, W_v, mask=None):
    T_q, T_k = x.shape[-2], context.shape[-2]
    causal = torch.triu(torch.full((T_q, T_k), float("-inf"), dtype=x.dtype), diagonal=1)
    return _attend(x @ W_q, context @ W_k, context @ W_v, causal if mask is None else causal + mask)


def _mask_ignored(x, context, W_q, W_k, W_v, mask=None):
    return _attend(x @ W_q, context @ W_k, context @ W_v)


def _softmax_over_queries(x, context, W_q, W_k, W_v, mask=None):
    return _attend(x @ W_q, context @ W_k, context @ W_v, mask, dim=-2)


MISTAKES = (
    Mistake("queries taken from the context (roles swapped)",
            "the queries come from x, the sequence being produced (Q = x @ W_q); the keys and values "
            "from context, the sequence being read.", _roles_swapped),
    Mistake("keys from x",
            "the keys must come from the context (K = context @ W_k): each query of x is compared "
            "with the positions of the context.", _keys_from_x),
    Mistake("values from x",
            "the values must come from the context (V = context @ W_v): cross-attention carries "
            "information from the context into x.", _values_from_x),
    Mistake("causal mask applied to cross-attention",
            "cross-attention needs no causal mask: the whole context (the source sentence) is known "
            "in advance, and the (T_q, T_k) scores are not a square matrix anyway. Add only the mask "
            "you are given.", _causal_mask_applied),
    Mistake("mask ignored", "add `mask` to the scaled scores when it is not None.", _mask_ignored),
    Mistake("softmax over the queries",
            "each query's row of weights (dim=-1, over the T_k context positions) must sum to 1.",
            _softmax_over_queries),
)


# ---------------------------------------------------------------- helpers
def _label(x, context, W_q, W_k, W_v, mask=None):
    s = (f"for x {tuple(x.shape)}, context {tuple(context.shape)}, W_q {tuple(W_q.shape)}, "
         f"W_k {tuple(W_k.shape)}, W_v {tuple(W_v.shape)}, {str(x.dtype).replace('torch.', '')}")
    return s + (f", mask {tuple(mask.shape)}" if mask is not None else "")


def _run(fn, x, context, W_q, W_k, W_v, mask=None):
    """Call the answer on copies; explain a shape error in terms of the two roles."""
    kwargs = {} if mask is None else {"mask": mask}
    try:
        return call_answer(fn, (x, context, W_q, W_k, W_v), kwargs, names=("output", "weights"), forbidden=FORBIDDEN)
    except (RuntimeError, ValueError) as err:
        raise AssertionError(
            f"Your function {describe(err)}\n"
            f"The inputs were {_label(x, context, W_q, W_k, W_v, mask)}. Queries come from x (x @ W_q), "
            "keys and values from context (context @ W_k, context @ W_v); the scores are (B, T_q, T_k), "
            "not square. Does your code mix up the two sequences, or add a causal mask that does not fit?"
        ) from None


def _compare(fn, x, context, W_q, W_k, W_v, mask=None, *, against_torch=False, label=""):
    out, w = _run(fn, x, context, W_q, W_k, W_v, mask)
    exp_out, exp_w = reference(x, context, W_q, W_k, W_v, mask)
    label = label or _label(x, context, W_q, W_k, W_v, mask)

    def check():
        assert_matches("weights", w, exp_w, context=label)
        assert_matches("output", out, exp_out, context=label)
        if against_torch:
            Q, K, V = x @ W_q, context @ W_k, context @ W_v
            torch_out = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
            assert_matches("output", out, torch_out, context=label + " (against F.scaled_dot_product_attention)")
            if W_q.shape[0] == W_q.shape[1] == W_v.shape[1]:  # nn.MultiheadAttention needs d_k = d_v = d_model
                torch_out, torch_w = _torch_mha(x, context, W_q, W_k, W_v, mask)
                assert_matches("output", out, torch_out, context=label + " (against nn.MultiheadAttention)")
                assert_matches("weights", w, torch_w, context=label + " (against nn.MultiheadAttention)")

    args = (x, context, W_q, W_k, W_v) if mask is None else (x, context, W_q, W_k, W_v, mask)
    with_diagnosis(check, (out, w), args, MISTAKES, reference)
    return out, w


def _torch_mha(x, context, W_q, W_k, W_v, mask=None):
    """PyTorch's one-head attention with these projection matrices and no output projection."""
    d_model, d_ctx = W_q.shape[0], W_k.shape[0]
    with torch.random.fork_rng(devices=[]):
        mha = torch.nn.MultiheadAttention(
            d_model, 1, bias=False, kdim=d_ctx, vdim=d_ctx, batch_first=True, dtype=x.dtype
        )
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat([W_q.T, W_k.T, W_v.T]))
        else:
            mha.q_proj_weight.copy_(W_q.T)
            mha.k_proj_weight.copy_(W_k.T)
            mha.v_proj_weight.copy_(W_v.T)
        mha.out_proj.weight.copy_(torch.eye(d_model, dtype=x.dtype))
        attn_mask = None
        if mask is not None:  # nn.MultiheadAttention takes (T_q, T_k) or (B * heads, T_q, T_k)
            attn_mask = mask.expand(x.shape[0], x.shape[1], context.shape[1])
        out, w = mha(x, context, context, attn_mask=attn_mask, need_weights=True)
    return out, w


def _random_case(g, B, T_q, T_k, d_model, d_ctx, d_k, d_v, dtype):
    x = torch.randn(B, T_q, d_model, generator=g, dtype=dtype)
    context = torch.randn(B, T_k, d_ctx, generator=g, dtype=dtype)
    W_q = torch.randn(d_model, d_k, generator=g, dtype=dtype) / math.sqrt(d_model)
    W_k = torch.randn(d_ctx, d_k, generator=g, dtype=dtype) / math.sqrt(d_ctx)
    W_v = torch.randn(d_ctx, d_v, generator=g, dtype=dtype) / math.sqrt(d_ctx)
    return x, context, W_q, W_k, W_v


# ---------------------------------------------------------------- the worked example
def worked_example(dtype=torch.float64):
    """"Cat sat mat" as the context: (x, context, W_q, W_k, W_v).

    Each context row is a token's key followed by its value, [k | v] (width 4);
    W_k picks the key half and W_v the value half. x holds two queries: Cat's
    [1.0, 0.5] and mat's [0.1, 0.9]; W_q is the identity. So the first query's
    weights and output are those of the attention chapter.
    """
    keys = torch.tensor(examples.KEYS, dtype=dtype)
    values = torch.tensor(examples.VALUES, dtype=dtype)
    context = torch.cat([keys, values], dim=-1)[None]  # (1, 3, 4)
    x = torch.tensor([examples.ALL_QUERIES[0], examples.ALL_QUERIES[2]], dtype=dtype)[None]  # (1, 2, 2)
    eye, zero = torch.eye(2, dtype=dtype), torch.zeros(2, 2, dtype=dtype)
    W_q = eye.clone()
    W_k = torch.cat([eye, zero])  # (4, 2): the key half of each context row
    W_v = torch.cat([zero, eye])  # (4, 2): the value half
    return x, context, W_q, W_k, W_v


def check_worked_example(fn):
    """Two queries over the three "Cat sat mat" tokens: the first row entry by entry."""
    args = worked_example()
    out, w = _run(fn, *args)
    if tuple(w.shape) != (1, 2, 3) or tuple(out.shape) != (1, 2, 2):
        raise AssertionError(
            f"For x of shape (1, 2, 2) (two queries) and a context of shape (1, 3, 4) (three tokens), the weights "
            f"should be (1, 2, 3) and the output (1, 2, 2); got weights {tuple(w.shape)} and output {tuple(out.shape)}."
        )

    def check():
        # The source prints three decimals from rounded steps: a correct answer is within 1e-3.
        for j, tok in enumerate(examples.TOKENS):
            got, want = w[0, 0, j].item(), examples.WEIGHTS[j]
            assert abs(got - want) <= 1e-3, (
                f"The first query (Cat's, [1.0, 0.5]) puts weight {got:.4f} on '{tok}' but should put {want:.3f}: "
                "the same numbers as in the attention chapter, since the keys are the context's key halves."
            )
        for j in range(2):
            got, want = out[0, 0, j].item(), examples.OUTPUT[j]
            assert abs(got - want) <= 1e-3, f"The first query's output[{j}] is {got:.4f} but should be {want:.3f}."
        assert_matches("weights", w, reference(*args)[1], context="in the worked example")
        assert_matches("output", out, reference(*args)[0], context="in the worked example")

    with_diagnosis(check, (out, w), args, MISTAKES, reference)


def check_shapes(fn):
    """T_q != T_k, context width != x width, d_v != d_k, batches, both dtypes:
    shapes, dtypes, and rows of weights that are distributions over the context."""
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        for B, T_q, T_k, d_model, d_ctx, d_k, d_v in [
            (1, 2, 5, 4, 4, 4, 4), (2, 4, 3, 6, 10, 8, 5), (3, 1, 7, 8, 8, 4, 4), (2, 6, 2, 4, 12, 6, 3),
        ]:
            args = _random_case(g, B, T_q, T_k, d_model, d_ctx, d_k, d_v, dtype)
            label = _label(*args)
            out, w = _run(fn, *args)
            for name, t, shape in (("output", out, (B, T_q, d_v)), ("weights", w, (B, T_q, T_k))):
                if tuple(t.shape) != shape:
                    raise AssertionError(f"{name} {label} has shape {tuple(t.shape)}, expected {shape} "
                                         "(one row per query of x, one column per position of the context).")
                if t.dtype != dtype:
                    raise AssertionError(f"{name} {label} has dtype {t.dtype}; keep the input's dtype {dtype}.")

            def check():
                wd = w.detach().to(torch.float64)
                assert bool(torch.isfinite(wd).all()) and bool((wd >= 0).all()), (
                    f"weights {label} should all be finite and non-negative (they come out of a softmax)."
                )
                worst = (wd.sum(-1) - 1).abs().max().item()  # float32 sums of a few terms: exact to ~1e-6
                assert worst <= 1e-5, (
                    f"Each row of weights {label} should sum to 1 over the context positions (dim=-1); "
                    f"one is off by {fmt(worst)}."
                )

            with_diagnosis(check, (out, w), args, MISTAKES, reference)


def check_roles(fn):
    """x and context of the same width and length, so that every mix-up runs and
    can be named; then the property that defines cross-attention: output row i
    depends on x only through x[:, i], and on every position of the context."""
    g = torch.Generator().manual_seed(8)
    args = _random_case(g, 2, 5, 5, 6, 6, 6, 6, torch.float64)
    _compare(fn, *args, label=_label(*args) + " (x and context of equal shapes)")
    x, context, W_q, W_k, W_v = args
    out, _ = _run(fn, *args)
    x2 = x.clone()
    x2[:, 3] += 1.0  # change one query token
    out2, _ = _run(fn, x2, context, W_q, W_k, W_v)
    moved = (out2 - out).detach().abs().amax(dim=(0, 2))  # per query position
    others = torch.cat([moved[:3], moved[4:]]).max().item()
    assert others <= 1e-12 and moved[3].item() > 1e-6, (
        "Changing x at position 3 should change output row 3 only: each query reads the context "
        f"independently of the other queries. Largest change of the other rows: {fmt(others)}."
    )
    c2 = context.clone()
    c2[:, 4] += 1.0  # change the last context token
    out3, _ = _run(fn, x, c2, W_q, W_k, W_v)
    assert (out3 - out).detach().abs().amax(dim=(0, 2)).min().item() > 1e-6, (
        "Changing the last position of the context should change every output row: every query may read "
        "the whole context (no causal mask in cross-attention)."
    )


HIDDEN_SHAPES = [
    # (B, T_q, T_k, d_model, d_ctx, d_k, d_v)
    (1, 1, 1, 2, 2, 2, 2),
    (2, 4, 6, 8, 8, 8, 8),  # nn.MultiheadAttention applies (d_k = d_v = d_model)
    (3, 7, 3, 8, 5, 8, 8),  # context narrower than x: kdim = vdim != embed_dim
    (2, 3, 9, 6, 12, 4, 10),
    (4, 5, 5, 16, 16, 16, 16),
]


def check_against_torch(fn, full=True):
    """Seeded inputs against the reference, F.scaled_dot_product_attention and
    nn.MultiheadAttention (one head, same weights, no output projection).
    ``full=False``: one float32 case with T_q=4, T_k=6."""
    g = torch.Generator().manual_seed(2025)
    if not full:
        args = _random_case(g, 2, 4, 6, 8, 8, 8, 8, torch.float32)
        _compare(fn, *args, against_torch=True)
        return
    for dtype in (torch.float32, torch.float64):
        for shape in HIDDEN_SHAPES:
            _compare(fn, *_random_case(g, *shape, dtype), against_torch=True)
        # Large scores: the softmax must be stable.
        x, context, W_q, W_k, W_v = _random_case(g, 2, 3, 4, 8, 8, 8, 8, dtype)
        _compare(fn, 10 * x, 10 * context, W_q, W_k, W_v, against_torch=True,
                 label=_label(x, context, W_q, W_k, W_v) + ", large scores")


def check_padding_mask(fn, full=True):
    """A padding mask on the context: padded positions get exactly zero weight.
    ``full=False``: one float64 case; the full check adds float32, masks of
    shape (B, 1, T_k) and (T_q, T_k), and a comparison with PyTorch."""
    g = torch.Generator().manual_seed(31)
    dtypes = (torch.float64, torch.float32) if full else (torch.float64,)
    for dtype in dtypes:
        x, context, W_q, W_k, W_v = _random_case(g, 2, 3, 5, 8, 8, 8, 8, dtype)
        pad = torch.zeros(2, 1, 5, dtype=dtype)
        pad[1, :, 3:] = float("-inf")  # the second source sentence has 2 padding tokens
        _, w = _compare(fn, x, context, W_q, W_k, W_v, pad, against_torch=full,
                        label=_label(x, context, W_q, W_k, W_v, pad) + " (padding)")
        assert w[1, :, 3:].abs().max().item() == 0.0, "Padded context positions must get exactly zero weight."
        if full:
            bias = torch.randn(3, 5, generator=g, dtype=dtype)
            _compare(fn, x, context, W_q, W_k, W_v, bias, against_torch=True,
                     label=_label(x, context, W_q, W_k, W_v, bias) + " (additive bias)")


def check_gradients_and_inputs(fn, full=True):
    """Gradients reach x, context, W_q, W_k and W_v, and the inputs are left untouched.

    The full check compares the answer's autograd gradients with finite
    differences of the answer itself (``assert_gradcheck``, float64,
    default tolerances atol 1e-5, rtol 1e-3, far above float64 rounding).
    """
    g = torch.Generator().manual_seed(13)
    args = _random_case(g, 2, 3, 4, 3, 5, 2, 3, torch.float64)
    _run(fn, *args)  # also checks that the inputs are untouched
    leaves = [t.clone().requires_grad_(True) for t in args]
    out, _ = unpack(call_without(fn, leaves, **FORBIDDEN), ("output", "weights"))
    if not out.requires_grad:
        raise AssertionError(
            "The output does not require grad although x, context and the weights do: gradients cannot flow back. "
            "Avoid .detach(), .numpy(), .item() and torch.no_grad() inside the function."
        )
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    for name, gr in zip(("x", "context", "W_q", "W_k", "W_v"), grads):
        if gr is None:
            raise AssertionError(f"No gradient reaches {name}: is {name} used in the computation?")
    if not full:
        return

    def output_only(*inputs):
        return unpack(call_without(fn, inputs, **FORBIDDEN), ("output", "weights"))[0]

    assert_gradcheck(output_only, tuple(leaves), what="your output")


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
