"""Checks for ``project_qkv(x, W_q, W_k, W_v) -> (Q, K, V)`` and
``dot_product_scores(Q, K) -> scores``.

project_qkv: x (B, T, d_model), W_q and W_k (d_model, d_k), W_v (d_model, d_v);
Q, K: (B, T, d_k), V: (B, T, d_v).
dot_product_scores: Q (..., T_q, d_k), K (..., T_k, d_k) -> Q K^T, (..., T_q, T_k).

Visible checks: the worked example of the chapter ("Cat sat mat": embeddings
projected into exactly the Q, K, V of the attention chapter, then their scores)
and batched shapes chosen so that the typical mistakes run and can be named.
Hidden checks: seeded random inputs against the reference and torch, gradients
and untouched inputs. Nothing from torch is forbidden here (these are one or
two matrix products), but an answer that calls the course's reference scores 0.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import examples
from ..examples.qkv import worked_projection
from ..guard import call_without
from ..reference import dot_product_scores as reference_scores
from ..reference import project_qkv as reference_project
from ._student import wrap_checks
from ._core import Mistake, assert_gradcheck, assert_matches, call_answer, unpack, with_diagnosis

FORBIDDEN_PROJECT = dict(torch_patterns=(), pieces=("project_qkv",), what="the query, key and value projections")
FORBIDDEN_SCORES = dict(torch_patterns=(), pieces=("dot_product_scores",), what="the dot-product scores")

# ---------------------------------------------------------------- mistakes: project_qkv
def _wq_for_all(x, W_q, W_k, W_v):
    return x @ W_q, x @ W_q, x @ W_q


def _k_v_swapped(x, W_q, W_k, W_v):
    return x @ W_q, x @ W_v, x @ W_k


def _q_k_swapped(x, W_q, W_k, W_v):
    return x @ W_k, x @ W_q, x @ W_v


def _project_transposed(x, W_q, W_k, W_v):
    # nn.Linear's convention (y = x W^T); runs only when the weights are square.
    return x @ W_q.T, x @ W_k.T, x @ W_v.T


PROJECT_MISTAKES = (
    Mistake("W_q used for all three", "Q, K and V each have their own weights: Q = x W_q, K = x W_k, V = x W_v.", _wq_for_all),
    Mistake("K and V projections swapped", "K = x @ W_k and V = x @ W_v; return them in the order (Q, K, V).", _k_v_swapped),
    Mistake("Q and K projections swapped", "Q = x @ W_q and K = x @ W_k; return them in the order (Q, K, V).", _q_k_swapped),
    Mistake(
        "weights transposed",
        "each W is (d_model, d_out) here, so compute x @ W, not x @ W.T "
        "(nn.Linear stores the transpose; this exercise does not).",
        _project_transposed,
    ),
)


# ---------------------------------------------------------------- mistakes: dot_product_scores
def _reversed_T(Q, K):
    # K.T reverses *all* dimensions: right for (T, d), wrong once there is a batch.
    return Q @ K.permute(*reversed(range(K.dim())))


def _qt_k(Q, K):
    return Q.transpose(-2, -1) @ K  # (..., d_k, d_k)


def _dims_1_2(Q, K):
    return Q @ K.transpose(1, 2)  # right for (B, T, d) only


def _k_qt(Q, K):
    return K @ Q.transpose(-2, -1)  # (..., T_k, T_q)


def _q_qt(Q, K):
    return Q @ Q.transpose(-2, -1)


def _same_position_only(Q, K):
    return (Q * K).sum(-1)


def _scaled(Q, K):
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])


SCORES_MISTAKES = (
    Mistake(
        "K.T on batched input",
        "K.T reverses all the dimensions of K, batch ones included; use K.transpose(-2, -1) (or K.mT) "
        "to swap only the last two.",
        _reversed_T,
    ),
    Mistake(
        "Q^T K instead of Q K^T",
        "transpose K, not Q: Q @ K.transpose(-2, -1) pairs every query with every key, (T_q, T_k); "
        "Q^T K sums over the tokens instead and gives (d_k, d_k).",
        _qt_k,
    ),
    Mistake(
        "scores over the wrong pair of dims",
        "K.transpose(1, 2) is right only for (B, T, d_k); with more leading dims (B, H, T, d_k) it swaps "
        "H and T. Use K.transpose(-2, -1): the last two dimensions, whatever comes before them.",
        _dims_1_2,
    ),
    Mistake(
        "scores transposed (K Q^T)",
        "rows are queries and columns keys: compute Q @ K^T, of shape (..., T_q, T_k).",
        _k_qt,
    ),
    Mistake("queries compared with queries", "the scores compare each query with the keys: Q @ K^T, not Q @ Q^T.", _q_qt),
    Mistake(
        "same-position pairs only",
        "(Q * K).sum(-1) compares query i with key i only; the scores need every (query, key) pair: Q @ K^T.",
        _same_position_only,
    ),
    Mistake(
        "scaled by 1/sqrt(d_k)",
        "this function returns the raw scores Q K^T; the division by sqrt(d_k) belongs to attention itself.",
        _scaled,
    ),
)


# ---------------------------------------------------------------- helpers
def _dt(dtype):
    return str(dtype).replace("torch.", "")


def _run_project(fn, x, W_q, W_k, W_v):
    return call_answer(fn, (x, W_q, W_k, W_v), names=("Q", "K", "V"), forbidden=FORBIDDEN_PROJECT)


def _run_scores(fn, Q, K):
    return call_answer(fn, (Q, K), names=("scores",), forbidden=FORBIDDEN_SCORES)[0]


def _project_label(x, W_q, W_v):
    B, T, d_model = x.shape
    return f"for B={B}, T={T}, d_model={d_model}, d_k={W_q.shape[1]}, d_v={W_v.shape[1]}, {_dt(x.dtype)}"


def _scores_label(Q, K):
    return f"for Q {tuple(Q.shape)}, K {tuple(K.shape)}, {_dt(Q.dtype)}"


def _compare_project(fn, args, *, against_torch=False, label=""):
    outs = _run_project(fn, *args)
    expected = reference_project(*args)

    def check():
        for name, got, want in zip("QKV", outs, expected):
            assert_matches(name, got, want, context=label)
        if against_torch:
            x, *Ws = args
            for name, got, W in zip("QKV", outs, Ws):
                # F.linear is nn.Linear's computation, x W'^T with W' = W^T.
                assert_matches(name, got, F.linear(x, W.T), context=label + " (against torch's linear)")

    with_diagnosis(check, outs, args, PROJECT_MISTAKES, reference_project)
    return outs


def _compare_scores(fn, Q, K, *, against_torch=False, label=""):
    scores = _run_scores(fn, Q, K)
    expected = reference_scores(Q, K)

    def check():
        assert_matches("scores", scores, expected, context=label)
        if against_torch:
            assert_matches("scores", scores, torch.einsum("...qd,...kd->...qk", Q, K), context=label + " (against torch.einsum)")

    with_diagnosis(check, (scores,), (Q, K), SCORES_MISTAKES, reference_scores)
    return scores


def _random_project(g, B, T, d_model, d_k, d_v, dtype):
    x = torch.randn(B, T, d_model, generator=g, dtype=dtype)
    Ws = [torch.randn(d_model, d, generator=g, dtype=dtype) / d_model**0.5 for d in (d_k, d_k, d_v)]
    return (x, *Ws)


def _random_scores(g, lead, T_q, T_k, d_k, dtype):
    Q = torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype)
    K = torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype)
    return Q, K


def _gradcheck(fn, leaves, names, outputs, forbidden, what):
    """Gradients reach every input, and autograd agrees with finite differences."""
    result = unpack(call_without(fn, leaves, **forbidden), outputs)
    if not all(r.requires_grad for r in result):
        raise AssertionError(
            f"{what[0].upper() + what[1:]} do not require grad although the inputs do: gradients cannot flow back. "
            "Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() "
            "inside the function."
        )
    grads = torch.autograd.grad(sum(r.sum() for r in result), leaves, allow_unused=True)
    for name, gr in zip(names, grads):
        if gr is None:
            raise AssertionError(f"No gradient reaches {name}: is {name} used in the computation?")

    def wrapped(*inputs):
        return unpack(call_without(fn, inputs, **forbidden), outputs)

    assert_gradcheck(wrapped, tuple(leaves), what=what)


# ================================================================ project_qkv
def check_projection_worked_example(fn):
    """"Cat sat mat": the embeddings projected into the attention chapter's Q, K and V."""
    args = worked_projection(torch.float64)
    outs = _run_project(fn, *args)
    expected = reference_project(*args)
    examples_qkv = examples.cat_sat_mat(torch.float64, all_queries=True)  # (3, 2) each

    def check():
        for name, got, want, shown in zip("QKV", outs, expected, examples_qkv):
            if tuple(got.shape) != (1, 3, 2):
                raise AssertionError(
                    f"{name} should have shape (B, T, d) = (1, 3, 2) for x of shape (1, 3, 3) and "
                    f"W_{name.lower()} of shape (3, 2), but it has shape {tuple(got.shape)}."
                )
            if got.dtype != torch.float64:
                raise AssertionError(f"{name} has dtype {got.dtype}; keep the input's dtype torch.float64.")
            for t, tok in enumerate(examples.TOKENS):
                row, ok_row = got[0, t], shown[t]
                # The chapter prints one decimal, and these are exact up to float64 rounding.
                assert torch.allclose(row.detach().to(torch.float64), ok_row, atol=1e-9), (
                    f"{name}[0, {t}], the {dict(Q='query', K='key', V='value')[name]} of '{tok}', is "
                    f"{[round(v, 4) for v in row.tolist()]} but should be {ok_row.tolist()}."
                )
            assert_matches(name, got, want, context="in the worked example")

    with_diagnosis(check, outs, args, PROJECT_MISTAKES, reference_project)


PROJECT_SHAPES = [
    # (B, T, d_model, d_k, d_v); the first is square, so transposed weights run and are named.
    (2, 4, 3, 3, 3),
    (3, 5, 6, 4, 2),  # d_k != d_v: swapped projections give the wrong shapes
    (1, 1, 4, 2, 5),
]


def check_projection_shapes(fn):
    """Several (B, T, d_model, d_k, d_v), both float dtypes: shapes, dtypes and values."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        for B, T, d_model, d_k, d_v in PROJECT_SHAPES:
            args = _random_project(g, B, T, d_model, d_k, d_v, dtype)
            label = _project_label(args[0], args[1], args[3])
            outs = _run_project(fn, *args)

            def check():
                for name, got, d in zip("QKV", outs, (d_k, d_k, d_v)):
                    if tuple(got.shape) != (B, T, d):
                        raise AssertionError(f"{name} {label} has shape {tuple(got.shape)}, expected {(B, T, d)}.")
                    if got.dtype != dtype:
                        raise AssertionError(f"{name} {label} has dtype {got.dtype}; keep the input's dtype {dtype}.")
                for name, got, want in zip("QKV", outs, reference_project(*args)):
                    assert_matches(name, got, want, context=label)

            with_diagnosis(check, outs, args, PROJECT_MISTAKES, reference_project)


PROJECT_HIDDEN_SHAPES = [
    (1, 1, 1, 1, 1),
    (2, 5, 4, 4, 4),  # square weights
    (3, 7, 8, 4, 6),
    (2, 1, 5, 3, 3),
    (4, 6, 16, 8, 8),
    (1, 9, 2, 7, 1),
]


def check_projection_random(fn, full=True):
    """Seeded random inputs against torch's linear layer and the reference.

    ``full=False`` runs one float32 case with square weights (the visible part of the test).
    """
    g = torch.Generator().manual_seed(2024)
    if not full:
        args = _random_project(g, 2, 3, 4, 4, 4, torch.float32)
        _compare_project(fn, args, against_torch=True, label=_project_label(args[0], args[1], args[3]))
        return
    for dtype in (torch.float32, torch.float64):
        for shape in PROJECT_HIDDEN_SHAPES:
            args = _random_project(g, *shape, dtype)
            _compare_project(fn, args, against_torch=True, label=_project_label(args[0], args[1], args[3]))


def check_projection_gradients_and_inputs(fn, full=True):
    """Gradients flow back to x, W_q, W_k and W_v, and the inputs are left untouched.

    Compares the answer's own autograd gradients with finite differences of the
    answer itself (``assert_gradcheck``, float64): wrong values with
    honest gradients pass, a detach or a round trip through numpy does not.
    """
    g = torch.Generator().manual_seed(11)
    # Square weights, so that an answer with transposed weights still runs and
    # is judged here on its gradients alone.
    shapes = [(2, 2, 3, 3, 3), (1, 3, 2, 2, 2)] if full else [(2, 2, 3, 3, 3)]
    for shape in shapes:
        args = _random_project(g, *shape, torch.float64)
        _run_project(fn, *args)  # also checks that the inputs are untouched
        leaves = [t.clone().requires_grad_(True) for t in args]
        _gradcheck(fn, leaves, ("x", "W_q", "W_k", "W_v"), ("Q", "K", "V"), FORBIDDEN_PROJECT, "Q, K and V")


# ================================================================ dot_product_scores
def check_scores_worked_example(fn):
    """"Cat sat mat": the 3 x 3 scores of the attention chapter's queries and keys.

    Cat's row is the source's 1.10, 1.00, 0.60.
    """
    Q, K, _ = examples.cat_sat_mat(torch.float64, all_queries=True)  # (3, 2) each
    scores = _run_scores(fn, Q, K)
    expected = reference_scores(Q, K)

    def check():
        if tuple(scores.shape) != (3, 3):
            raise AssertionError(
                f"For Q and K of shape (3, 2) (3 tokens, d_k = 2) the scores should have shape "
                f"(T_q, T_k) = (3, 3), one per (query, key) pair, but they have shape {tuple(scores.shape)}."
            )
        if scores.dtype != torch.float64:
            raise AssertionError(f"The scores have dtype {scores.dtype}; keep the input's dtype torch.float64.")
        for j, tok in enumerate(examples.TOKENS):
            got, want = scores[0, j].item(), examples.RAW_SCORES[j]
            # Exact up to float64 rounding: 1.0 x 1.0 + 0.5 x 0.2 = 1.10, and so on.
            assert abs(got - want) <= 1e-9, (
                f"Cat's score for '{tok}' is {got:.4f} but should be {want:.2f} "
                f"(the dot product of Cat's query {list(examples.ALL_QUERIES[0])} with the key "
                f"{list(examples.KEYS[j])} of '{tok}')."
            )
        assert_matches("scores", scores, expected, context="in the worked example")

    with_diagnosis(check, (scores,), (Q, K), SCORES_MISTAKES, reference_scores)


SCORES_SHAPES = [
    # (leading dims, T_q, T_k, d_k)
    # B == T == d_k: K.T and Q^T K run, with the right shape and the wrong values.
    ((3,), 3, 3, 3),
    # H == T_k == d_k: K.transpose(1, 2) runs (and is wrong).
    ((2, 4), 3, 4, 4),
    # T_q != T_k, two leading dims.
    ((2, 3), 5, 2, 4),
]


def check_scores_batched(fn):
    """Leading batch and head dimensions, T_q != T_k, both float dtypes: shapes and values.

    The shapes are chosen so that the typical batching mistakes run without an
    error, and can be named.
    """
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        for lead, T_q, T_k, d_k in SCORES_SHAPES:
            Q, K = _random_scores(g, lead, T_q, T_k, d_k, dtype)
            label = _scores_label(Q, K)
            scores = _run_scores(fn, Q, K)

            def check():
                shape = (*lead, T_q, T_k)
                if tuple(scores.shape) != shape:
                    raise AssertionError(f"scores {label} have shape {tuple(scores.shape)}, expected (..., T_q, T_k) = {shape}.")
                if scores.dtype != dtype:
                    raise AssertionError(f"scores {label} have dtype {scores.dtype}; keep the input's dtype {dtype}.")
                assert_matches("scores", scores, reference_scores(Q, K), context=label)

            with_diagnosis(check, (scores,), (Q, K), SCORES_MISTAKES, reference_scores)


SCORES_HIDDEN_SHAPES = [
    ((), 1, 1, 1),
    ((), 4, 6, 3),
    ((3,), 3, 3, 3),
    ((2,), 7, 4, 16),
    ((2, 4), 6, 6, 8),
    ((2, 2, 3), 4, 9, 5),
]


def check_scores_random(fn, full=True):
    """Seeded random inputs of several shapes against torch (einsum) and the reference.

    ``full=False`` runs one float32 case with batch and head dimensions.
    """
    g = torch.Generator().manual_seed(2024)
    if not full:
        Q, K = _random_scores(g, (2, 3), 4, 5, 8, torch.float32)
        _compare_scores(fn, Q, K, against_torch=True, label=_scores_label(Q, K))
        return
    for dtype in (torch.float32, torch.float64):
        for lead, T_q, T_k, d_k in SCORES_HIDDEN_SHAPES:
            Q, K = _random_scores(g, lead, T_q, T_k, d_k, dtype)
            _compare_scores(fn, Q, K, against_torch=True, label=_scores_label(Q, K))


def check_scores_gradients_and_inputs(fn, full=True):
    """Gradients flow back to Q and K, and the inputs are left untouched (``assert_gradcheck``, float64)."""
    g = torch.Generator().manual_seed(11)
    # Every size equal, so that the batching mistakes still run and are judged
    # here on their gradients alone.
    shapes = [((3,), 3, 3, 3), ((2, 2), 2, 2, 2)] if full else [((3,), 3, 3, 3)]
    for lead, T_q, T_k, d_k in shapes:
        Q, K = _random_scores(g, lead, T_q, T_k, d_k, torch.float64)
        _run_scores(fn, Q, K)  # also checks that the inputs are untouched
        leaves = [Q.clone().requires_grad_(True), K.clone().requires_grad_(True)]
        _gradcheck(fn, leaves, ("Q", "K"), ("scores",), FORBIDDEN_SCORES, "the scores")


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
