"""Checks for ``scaled_dot_product_attention(Q, K, V, mask=None) -> (output, weights)``.

Visible checks (the student runs them): the worked example, batched shapes,
the causal mask. Hidden checks (added at grading): seeded random inputs against
PyTorch and the reference, arbitrary masks, gradients and untouched inputs.
Every check runs the answer under ``call_without`` so that an answer which
calls PyTorch's attention or the course's reference scores 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import examples
from ..reference import causal_mask, scaled_dot_product_attention as reference
from ..guard import call_without
from ._student import wrap_checks
from ._core import Mistake, assert_gradcheck, assert_matches, call_answer, fmt, unpack, with_diagnosis

FORBIDDEN = dict(
    torch_patterns=("scaled_dot_product_attention", "multi_head_attention"),
    pieces=("scaled_dot_product_attention",),
    what="scaled dot-product attention",
)


# ---------------------------------------------------------------- mistakes
def _scores(Q, K):
    return Q @ K.transpose(-2, -1)


def _no_scaling(Q, K, V, mask=None):
    s = _scores(Q, K) + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def _scaled_by_dk(Q, K, V, mask=None):
    s = _scores(Q, K) / Q.shape[-1] + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def _scaled_by_dv(Q, K, V, mask=None):
    s = _scores(Q, K) / math.sqrt(V.shape[-1]) + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def _scaled_by_tk(Q, K, V, mask=None):
    s = _scores(Q, K) / math.sqrt(K.shape[-2]) + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def _softmax_wrong_axis(Q, K, V, mask=None):
    s = _scores(Q, K) / math.sqrt(Q.shape[-1]) + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-2)
    return w @ V, w


def _mask_after_softmax(Q, K, V, mask=None):
    w = torch.softmax(_scores(Q, K) / math.sqrt(Q.shape[-1]), dim=-1)
    if mask is not None:
        w = w + mask
    return w @ V, w


def _mask_ignored(Q, K, V, mask=None):
    w = torch.softmax(_scores(Q, K) / math.sqrt(Q.shape[-1]), dim=-1)
    return w @ V, w


def _mask_before_scaling(Q, K, V, mask=None):
    s = _scores(Q, K) + (0 if mask is None else mask)
    w = torch.softmax(s / math.sqrt(Q.shape[-1]), dim=-1)
    return w @ V, w


def _keys_as_values(Q, K, V, mask=None):
    s = _scores(Q, K) / math.sqrt(Q.shape[-1]) + (0 if mask is None else mask)
    w = torch.softmax(s, dim=-1)
    return w @ K, w


def _scores_as_weights(Q, K, V, mask=None):
    s = _scores(Q, K) / math.sqrt(Q.shape[-1]) + (0 if mask is None else mask)
    return torch.softmax(s, dim=-1) @ V, s


def _naive_exp(Q, K, V, mask=None):
    s = _scores(Q, K) / math.sqrt(Q.shape[-1]) + (0 if mask is None else mask)
    e = torch.exp(s)
    w = e / e.sum(dim=-1, keepdim=True)
    return w @ V, w


MISTAKES = (
    Mistake("no scaling", "the scores were not divided by sqrt(d_k).", _no_scaling),
    Mistake("scaled by d_k", "divide the scores by sqrt(d_k), not by d_k.", _scaled_by_dk),
    Mistake("scaled by sqrt(d_v)", "d_k is the last dimension of Q (and K), not of V.", _scaled_by_dv),
    Mistake("scaled by sqrt(T_k)", "d_k is the last dimension of Q, not the number of keys: use Q.shape[-1].", _scaled_by_tk),
    Mistake("softmax over the wrong axis", "each query's row of scores (dim=-1, over the keys) must sum to 1.", _softmax_wrong_axis),
    Mistake("mask added after the softmax", "add the mask to the scaled scores, then take the softmax.", _mask_after_softmax),
    Mistake("mask ignored", "add `mask` to the scaled scores when it is not None.", _mask_ignored),
    Mistake("mask added before the scaling", "scale the scores first, then add the mask: the mask must not be divided by sqrt(d_k).", _mask_before_scaling),
    Mistake("keys used as values", "the output is the weighted sum of V, not of K.", _keys_as_values),
    Mistake("scores returned as weights", "return the softmax weights, not the scores.", _scores_as_weights),
    Mistake("softmax overflows", "exp() of a large score is inf; subtract the row's max before exp (or use torch.softmax).", _naive_exp),
)


# ---------------------------------------------------------------- helpers
def _run(fn, Q, K, V, mask=None):
    """Call the answer on copies of the inputs; return (output, weights)."""
    kwargs = {} if mask is None else {"mask": mask}
    shapes = ((*Q.shape[:-1], V.shape[-1]), (*Q.shape[:-1], K.shape[-2]))  # (..., T_q, d_v), (..., T_q, T_k)
    return call_answer(fn, (Q, K, V), kwargs, names=("output", "weights"), forbidden=FORBIDDEN, shapes=shapes)


def _compare(fn, Q, K, V, mask=None, *, against_torch=False, label=""):
    out, w = _run(fn, Q, K, V, mask)
    exp_out, exp_w = reference(Q, K, V, mask)

    def check():
        assert_matches("weights", w, exp_w, context=label)
        assert_matches("output", out, exp_out, context=label)
        if against_torch:
            torch_out = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
            assert_matches("output", out, torch_out, context=label + " (against torch)")

    args = (Q, K, V) if mask is None else (Q, K, V, mask)
    with_diagnosis(check, (out, w), args, MISTAKES, reference)
    return out, w


def _shape_label(Q, K, V, mask=None):
    s = f"for Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}, {str(Q.dtype).replace('torch.', '')}"
    return s + (f", mask {tuple(mask.shape)}" if mask is not None else "")


# ---------------------------------------------------------------- visible
def check_worked_example(fn):
    """"Cat sat mat": Cat's weights and new representation, entry by entry."""
    Q, K, V = examples.cat_sat_mat(torch.float64)
    out, w = _run(fn, Q, K, V)
    if tuple(w.shape) != (1, 3) or tuple(out.shape) != (1, 2):
        raise AssertionError(
            f"For Q of shape (1, 2) and K, V of shape (3, 2), weights should have shape (1, 3) "
            f"and output (1, 2); got weights {tuple(w.shape)} and output {tuple(out.shape)}."
        )

    def check():
        # The book prints each figure rounded once to three decimals (0.2666 is
        # printed 0.267), so a correct answer is within 1e-3 of every printed
        # figure; the exact check against the reference follows.
        for j, tok in enumerate(examples.TOKENS):
            got, want = w[0, j].item(), examples.WEIGHTS[j]
            assert abs(got - want) <= 1e-3, (
                f"Cat's weight on '{tok}' is {got:.4f} but should be {want:.3f} "
                f"(scores {examples.RAW_SCORES}, scaled {examples.SCALED_SCORES})."
            )
        for j in range(2):
            got, want = out[0, j].item(), examples.OUTPUT[j]
            assert abs(got - want) <= 1e-3, f"Cat's new representation[{j}] is {got:.4f} but should be {want:.3f}."
        assert_matches("weights", w, reference(Q, K, V)[1], context="in the worked example")

    with_diagnosis(check, (out, w), (Q, K, V), MISTAKES, reference)


def worked_example_in_a_batch(dtype=torch.float64):
    """Q, K, V of shape (B=2, H=2, T=3, d=2): batch 0, head 0 is "Cat sat mat" with all three
    queries; the other sequences and heads are seeded random. As multi-head attention calls it."""
    Q3, K3, V3 = examples.cat_sat_mat(dtype, all_queries=True)
    g = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(2, 2, 3, 2, generator=g, dtype=dtype) for _ in range(3))
    Q[0, 0], K[0, 0], V[0, 0] = Q3, K3, V3
    return Q, K, V


def check_batched_worked_example(fn):
    """Your attention as the later exercises call it: "Cat sat mat" inside a batch of 2 sequences
    of 2 heads each, Q, K, V of shape (2, 2, 3, 2), without a mask and with the causal mask (3, 3),
    which broadcasts over the batch and the heads. Values against the reference."""
    Q, K, V = worked_example_in_a_batch(torch.float64)
    where = "for Q, K, V of shape (B=2, H=2, T=3, d=2) (entry [0, 0] is the worked example)"
    _compare(fn, Q, K, V, label=where)
    _compare(fn, Q, K, V, causal_mask(3, torch.float64), label=where + " with the causal mask of shape (3, 3)")


def check_batched_shapes(fn):
    """Leading batch/head dimensions, T_q != T_k, d_v != d_k, both float dtypes:
    shapes, dtypes, and weights that are probability distributions over the keys.

    The values themselves are compared in the other checks, so an answer that
    gets the shapes and the softmax right earns this one on its own.
    """
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        for lead, T_q, T_k, d_k, d_v in [((), 4, 4, 8, 8), ((2,), 3, 5, 4, 6), ((2, 3), 5, 2, 8, 3)]:
            Q = torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype)
            K = torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype)
            V = torch.randn(*lead, T_k, d_v, generator=g, dtype=dtype)
            label = _shape_label(Q, K, V)
            out, w = _run(fn, Q, K, V)
            for name, t, shape in (("output", out, (*lead, T_q, d_v)), ("weights", w, (*lead, T_q, T_k))):
                if tuple(t.shape) != shape:
                    raise AssertionError(f"{name} {label} has shape {tuple(t.shape)}, expected {shape}.")
                if t.dtype != dtype:
                    raise AssertionError(f"{name} {label} has dtype {t.dtype}; keep the input's dtype {dtype}.")

            def check():
                wd = w.detach().to(torch.float64)
                assert bool(torch.isfinite(wd).all()) and bool((wd >= 0).all()), (
                    f"weights {label} should all be finite and non-negative (they come out of a softmax)."
                )
                # Each row is a probability distribution; float32 sums of a few
                # terms are exact to about 1e-6, so 1e-5 is a safe bound.
                worst = (wd.sum(-1) - 1).abs().max().item()
                assert worst <= 1e-5, (
                    f"Each row of weights {label} should sum to 1 (over the keys, dim=-1); "
                    f"one is off by {fmt(worst)}."
                )

            with_diagnosis(check, (out, w), (Q, K, V), MISTAKES, reference)


def check_causal_mask(fn):
    """The worked example with all three queries and the causal mask."""
    Q, K, V = examples.cat_sat_mat(torch.float64, all_queries=True)
    mask = causal_mask(3, torch.float64)
    out, w = _compare(fn, Q, K, V, mask, label="with the causal mask")
    assert w[0, 0].item() == 1.0 and w[0, 1:].abs().max().item() == 0.0, (
        "With the causal mask, Cat (the first token) can only attend to itself: "
        f"its weights should be [1, 0, 0], got {w[0].tolist()}."
    )


# ---------------------------------------------------------------- hidden
def _random_case(g, lead, T_q, T_k, d_k, d_v, dtype, scale=1.0):
    Q = scale * torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype)
    K = scale * torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype)
    V = torch.randn(*lead, T_k, d_v, generator=g, dtype=dtype)
    return Q, K, V


HIDDEN_SHAPES = [
    # (leading dims, T_q, T_k, d_k, d_v)
    ((), 1, 1, 1, 1),
    ((), 6, 6, 16, 16),
    ((3,), 7, 4, 8, 5),  # batched, T_q != T_k, d_v != d_k
    ((2, 4), 5, 5, 16, 16),  # batch x heads
    ((2, 2, 3), 4, 9, 4, 12),  # three leading dims
]


def check_random_against_torch(fn, full=True):
    """Seeded random inputs of several shapes and both dtypes, against torch and the reference.

    ``full=False`` runs one float32 case only (the visible part of the test).
    """
    g = torch.Generator().manual_seed(2024)
    if not full:
        Q, K, V = _random_case(g, (2,), 4, 6, 8, 8, torch.float32)
        _compare(fn, Q, K, V, against_torch=True, label=_shape_label(Q, K, V))
        return
    for dtype in (torch.float32, torch.float64):
        for lead, T_q, T_k, d_k, d_v in HIDDEN_SHAPES:
            Q, K, V = _random_case(g, lead, T_q, T_k, d_k, d_v, dtype)
            _compare(fn, Q, K, V, against_torch=True, label=_shape_label(Q, K, V))
        # Large scores (std ~ 100 after scaling): exp() overflows unless the softmax is stable.
        Q, K, V = _random_case(g, (2,), 5, 5, 16, 8, dtype, scale=10.0)
        _compare(fn, Q, K, V, against_torch=True, label=_shape_label(Q, K, V) + ", large scores")


def check_masks(fn):
    """Causal, padding and arbitrary additive masks, broadcast over leading dims."""
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float64):
        Q, K, V = _random_case(g, (2, 3), 6, 6, 8, 8, dtype)
        _compare(fn, Q, K, V, causal_mask(6, dtype), against_torch=True, label=_shape_label(Q, K, V) + " (causal)")
        # Padding: the last two keys of the second sequence are hidden from every query.
        pad = torch.zeros(2, 1, 1, 6, dtype=dtype)
        pad[1, ..., 4:] = float("-inf")
        _compare(fn, Q, K, V, pad, against_torch=True, label=_shape_label(Q, K, V, pad) + " (padding)")
        # An arbitrary finite additive bias, one per (query, key) pair.
        Q, K, V = _random_case(g, (3,), 4, 7, 8, 5, dtype)
        bias = torch.randn(4, 7, generator=g, dtype=dtype)
        _compare(fn, Q, K, V, bias, against_torch=True, label=_shape_label(Q, K, V, bias) + " (additive bias)")


def check_gradients_and_inputs(fn, full=True):
    """Gradients flow back to Q, K and V, and the inputs are left untouched.

    Compares the answer's own autograd gradients with finite differences of the
    answer itself (``assert_gradcheck``, float64): an answer with wrong
    values but honest gradients passes this check; one that detaches, leaves
    torch, or modifies its inputs does not. ``full=False`` skips the masked case.
    """
    g = torch.Generator().manual_seed(11)
    for mask in (None, causal_mask(4, torch.float64)) if full else (None,):
        Q, K, V = _random_case(g, (2,), 4, 4, 3, 2, torch.float64)
        kwargs = {} if mask is None else {"mask": mask}
        out, _ = _run(fn, Q, K, V, mask)  # also checks that the inputs are untouched
        leaves = [t.clone().requires_grad_(True) for t in (Q, K, V)]
        result = call_without(fn, leaves, kwargs, **FORBIDDEN)
        out, _ = unpack(result, ("output", "weights"))
        if not out.requires_grad:
            raise AssertionError(
                "The output does not require grad although Q, K and V do: gradients cannot flow back. "
                "Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() "
                "inside the function."
            )
        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        for name, gr in zip("QKV", grads):
            if gr is None:
                raise AssertionError(f"No gradient reaches {name}: is {name} used in the computation?")

        def output_only(q, k, v):
            return unpack(call_without(fn, (q, k, v), kwargs, **FORBIDDEN), ("output", "weights"))[0]

        assert_gradcheck(output_only, tuple(leaves), what="your output with respect to Q, K and V")


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
