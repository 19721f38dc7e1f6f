"""project_qkv(x, W_q, W_k, W_v) and dot_product_scores(Q, K): the exercise's tests, declared once.

project_qkv: x (B, T, d_model), W_q and W_k (d_model, d_k), W_v (d_model, d_v) -> (Q, K, V) of shapes
(B, T, d_k), (B, T, d_k), (B, T, d_v). dot_product_scores: Q (..., T_q, d_k), K (..., T_k, d_k) ->
Q K^T, (..., T_q, T_k).

Decisions stated once:

- Nothing of PyTorch's is forbidden (these are one or two matrix products); an answer that calls the
  course's own ``project_qkv`` or ``dot_product_scores`` scores 0.
- The worked example is the chapter's "Cat sat mat": embeddings projected into exactly the queries,
  keys and values of the attention chapter, then their scores (``examples.qkv``, ``examples``).
- Sizes are chosen so that typical mistakes *run* and can be named: square weights (transposed
  weights run), B == T == d_k (K.T and Q^T K run), H == T_k == d_k (K.transpose(1, 2) runs).
- The gradient tests judge an answer's gradients against its own outputs (``adapters.runner``'s
  gradient mode, ``adapters.honest_gradients``), not against the reference: wrong values with honest
  gradients keep that test and lose the ones that compare values. Their sizes are all equal, so that
  the batching mistakes run there too and are judged on their gradients alone.
- Values are compared with the defaults of ``grading.compare``: a correct answer may order its
  d_model-term sums differently from the reference, a few units of 1e-7 in float32.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import examples
from ..examples import qkv as worked
from . import Exercise, Mistake, Test, case
from .adapters import grad_case, honest_gradients, runner

# ---------------------------------------------------------------- typical mistakes: project_qkv


def _wq_for_all(x, W_q, W_k, W_v):
    return x @ W_q, x @ W_q, x @ W_q


def _k_v_swapped(x, W_q, W_k, W_v):
    return x @ W_q, x @ W_v, x @ W_k


def _q_k_swapped(x, W_q, W_k, W_v):
    return x @ W_k, x @ W_q, x @ W_v


def _project_transposed(x, W_q, W_k, W_v):
    return x @ W_q.T, x @ W_k.T, x @ W_v.T  # nn.Linear's convention; runs only for square weights


P_ALL = frozenset({"test_project_worked_example", "test_project_shapes", "test_project_random",
                   "test_project_gradients_and_inputs"})
P_VALUES = P_ALL - {"test_project_gradients_and_inputs"}
PROJECT_MISTAKES = (
    # no gradient reaches W_k or W_v
    Mistake("W_q used for all three", "Q, K and V each have their own weights: Q = x W_q, K = x W_k, V = x W_v.",
            _wq_for_all, P_ALL),
    Mistake("K and V projections swapped", "K = x @ W_k and V = x @ W_v; return them in the order (Q, K, V).",
            _k_v_swapped, P_VALUES),
    Mistake("Q and K projections swapped", "Q = x @ W_q and K = x @ W_k; return them in the order (Q, K, V).",
            _q_k_swapped, P_VALUES),
    # in the worked example (3 x 2 weights) x @ W.T cannot run: an error there, a name elsewhere
    Mistake("weights transposed",
            "each W is (d_model, d_out) here, so compute x @ W, not x @ W.T (nn.Linear stores the transpose; this "
            "exercise does not).",
            _project_transposed, P_VALUES),
)

# ---------------------------------------------------------------- typical mistakes: dot_product_scores


def _reversed_T(Q, K):
    return Q @ K.permute(*reversed(range(K.dim())))  # K.T: right for (T, d), wrong once there is a batch


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


S_ALL = frozenset({"test_scores_worked_example", "test_scores_batched", "test_scores_random",
                   "test_scores_gradients_and_inputs"})
S_VALUES = S_ALL - {"test_scores_gradients_and_inputs"}
SCORES_MISTAKES = (
    # right for the worked example's (T, d) inputs
    Mistake("K.T on batched input",
            "K.T reverses all the dimensions of K, batch ones included; use K.transpose(-2, -1) (or K.mT) to swap "
            "only the last two.",
            _reversed_T, S_VALUES - {"test_scores_worked_example"}),
    Mistake("Q^T K instead of Q K^T",
            "transpose K, not Q: Q @ K.transpose(-2, -1) pairs every query with every key, (T_q, T_k); Q^T K sums "
            "over the tokens instead and gives (d_k, d_k).",
            _qt_k, S_VALUES),
    # raises an IndexError on the worked example's (T, d) inputs
    Mistake("scores over the wrong pair of dims",
            "K.transpose(1, 2) is right only for (B, T, d_k); with more leading dims (B, H, T, d_k) it swaps H and T. "
            "Use K.transpose(-2, -1): the last two dimensions, whatever comes before them.",
            _dims_1_2, S_VALUES),
    Mistake("scores transposed (K Q^T)",
            "rows are queries and columns keys: compute Q @ K^T, of shape (..., T_q, T_k).", _k_qt, S_VALUES),
    # no gradient reaches K
    Mistake("queries compared with queries", "the scores compare each query with the keys: Q @ K^T, not Q @ Q^T.",
            _q_qt, S_ALL),
    Mistake("same-position pairs only",
            "(Q * K).sum(-1) compares query i with key i only; the scores need every (query, key) pair: Q @ K^T.",
            _same_position_only, S_VALUES),
    Mistake("scaled by 1/sqrt(d_k)",
            "this function returns the raw scores Q K^T; the division by sqrt(d_k) belongs to attention itself.",
            _scaled, S_VALUES),
)

# ---------------------------------------------------------------- properties (plain data)
ROLE = {"Q": "query", "K": "key", "V": "value"}


def chapter_vectors(case, out, want):
    """The worked example gives the attention chapter's queries, keys and values, token by token:
    exact up to float64 rounding (1e-9)."""
    if "printed" not in case["tags"]:
        return None
    chapter = [np.array(m, dtype=np.float64) for m in (examples.ALL_QUERIES, examples.KEYS, examples.VALUES)]
    for name, shown in zip("QKV", chapter):
        got = out.get(name)
        if got is None or got.shape != (1, 3, 2):
            shape = "no array" if got is None else f"shape {got.shape}"
            return (f"{name} should have shape (B, T, d) = (1, 3, 2) for x of shape (1, 3, 3) and W_{name.lower()} of "
                    f"shape (3, 2), but it has {shape}.")
        if got.dtype != np.float64:
            return None  # (the comparison says that the dtype should stay float64)
        for t, token in enumerate(examples.TOKENS):
            row = got[0, t].astype(np.float64)
            if not np.all(np.abs(row - shown[t]) <= 1e-9):
                return (f"{name}[0, {t}], the {ROLE[name]} of '{token}', is {[round(float(v), 4) for v in row]} but "
                        f"should be {shown[t].tolist()}.")
    return None


def cat_scores(case, out, want):
    """The worked example's scores are the chapter's: Cat's row is 1.10, 1.00, 0.60, exact up to
    float64 rounding (1.0 x 1.0 + 0.5 x 0.2 = 1.10, and so on)."""
    if "printed" not in case["tags"]:
        return None
    got = out.get("scores")
    if got is None or got.shape != (3, 3):
        shape = "no array" if got is None else f"shape {got.shape}"
        return ("for Q and K of shape (3, 2) (3 tokens, d_k = 2) the scores should have shape (T_q, T_k) = (3, 3), "
                f"one per (query, key) pair, but they have {shape}.")
    if got.dtype != np.float64:
        return None  # (the comparison says that the dtype should stay float64)
    for j, token in enumerate(examples.TOKENS):
        value, shown = float(got[0, j]), examples.RAW_SCORES[j]
        if abs(value - shown) > 1e-9:
            return (f"Cat's score for '{token}' is {value:.4f} but should be {shown:.2f} (the dot product of Cat's query "
                    f"{list(examples.ALL_QUERIES[0])} with the key {list(examples.KEYS[j])} of '{token}').")
    return None


# ---------------------------------------------------------------- the cases
PROJECT_NAMES = ("x", "W_q", "W_k", "W_v")
SCORES_NAMES = ("Q", "K")

# (B, T, d_model, d_k, d_v); the first is square, so transposed weights run and are named; the
# second has d_k != d_v, so swapped projections give the wrong shapes
PROJECT_SHAPES = ((2, 4, 3, 3, 3), (3, 5, 6, 4, 2), (1, 1, 4, 2, 5))
# (leading dims, T_q, T_k, d_k): B == T == d_k (K.T and Q^T K run with the right shape), H == T_k == d_k
# (K.transpose(1, 2) runs), T_q != T_k with two leading dims
SCORES_SHAPES = (((3,), 3, 3, 3), ((2, 4), 3, 4, 4), ((2, 3), 5, 2, 4))


def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _projection(rng, B, T, d_model, d_k, d_v, dtype):
    return {"x": _normal(rng, (B, T, d_model), dtype),
            **{n: _normal(rng, (d_model, d), dtype, d_model ** -0.5) for n, d in (("W_q", d_k), ("W_k", d_k), ("W_v", d_v))}}


def _project_label(B, T, d_model, d_k, d_v, dtype, extra=""):
    return f"for B={B}, T={T}, d_model={d_model}, d_k={d_k}, d_v={d_v}, {dtype}{extra}"


def _project_case(rng, tags, sizes, dtype, grads=False):
    label = _project_label(*sizes, dtype, ", with the gradients" if grads else "")
    c = case(label, tags, **_projection(rng, *sizes, dtype))
    return grad_case(rng, c, PROJECT_NAMES) if grads else c


def _scores(rng, lead, T_q, T_k, d_k, dtype):
    return {"Q": _normal(rng, (*lead, T_q, d_k), dtype), "K": _normal(rng, (*lead, T_k, d_k), dtype)}


def _scores_case(rng, tags, sizes, dtype, grads=False):
    lead, T_q, T_k, d_k = sizes
    label = f"for Q {(*lead, T_q, d_k)}, K {(*lead, T_k, d_k)}, {dtype}" + (", with the gradients" if grads else "")
    c = case(label, tags, **_scores(rng, lead, T_q, T_k, d_k, dtype))
    return grad_case(rng, c, SCORES_NAMES) if grads else c


def _project_visible() -> tuple:
    x, W_q, W_k, W_v = (t.numpy() for t in worked.worked_projection(torch.float64))
    g = np.random.default_rng(1)
    return (
        case("in the worked example (\"Cat sat mat\": x (1, 3, 3), each W (3, 2), float64)", ("worked", "printed"),
             x=x, W_q=W_q, W_k=W_k, W_v=W_v),
        *(_project_case(g, "shapes", sizes, dtype) for dtype in ("float32", "float64") for sizes in PROJECT_SHAPES),
        _project_case(g, "random", (2, 3, 4, 4, 4), "float32"),
        _project_case(g, "grads", (2, 2, 3, 3, 3), "float64", grads=True),
    )


def _scores_visible() -> tuple:
    Q, K, _ = (m.numpy() for m in examples.cat_sat_mat(torch.float64, all_queries=True))
    g = np.random.default_rng(1)
    return (
        case("in the worked example (\"Cat sat mat\": Q and K (3, 2), float64)", ("worked", "printed"), Q=Q, K=K),
        *(_scores_case(g, "batched", sizes, dtype) for dtype in ("float32", "float64") for sizes in SCORES_SHAPES),
        _scores_case(g, "random", ((2, 3), 4, 5, 8), "float32"),
        _scores_case(g, "grads", ((3,), 3, 3, 3), "float64", grads=True),
    )


def _draw(rng, low, high, n):
    return tuple(int(v) for v in rng.integers(low, high, size=n))


def project_secret(rng: np.random.Generator) -> list:
    """The re-check's cases: the worked example's sizes and the shapes test's with fresh numbers,
    fixed and random sizes (one square, one of a single token) in both dtypes, and gradients of
    square weights in float64 (with finite differences) and float32 (they must exist)."""
    cases = [_project_case(rng, "worked", (1, 3, 3, 2, 2), "float64") for _ in range(2)]
    cases += [_project_case(rng, "shapes", sizes, dtype) for dtype in ("float32", "float64") for sizes in PROJECT_SHAPES]
    for dtype in ("float32", "float64"):
        d = int(rng.integers(2, 9))
        drawn = [(1, 1, 1, 1, 1), (int(rng.integers(1, 4)), int(rng.integers(1, 8)), d, d, d),
                 (int(rng.integers(1, 4)), 1, *_draw(rng, 1, 10, 3)), (4, 6, 16, 8, 8)]
        drawn += [(*_draw(rng, 1, 5, 1), *_draw(rng, 1, 10, 4)) for _ in range(3)]
        cases += [_project_case(rng, "random", sizes, dtype) for sizes in drawn]
    for sizes in ((2, 2, 3, 3, 3), (1, 3, 2, 2, 2), (3, 4, 5, 5, 5)):
        cases.append(_project_case(rng, "grads", sizes, "float64", grads=True))
    cases.append(_project_case(rng, "grads", (2, 3, 4, 4, 4), "float32", grads=True))
    return cases


def scores_secret(rng: np.random.Generator) -> list:
    """The re-check's cases: the worked example's sizes and the batched test's with fresh numbers,
    random sizes from no leading dimension to three in both dtypes (with T_q == T_k == 1 and
    d_k == 1 among them), and gradients with every size equal in float64 and float32."""
    cases = [_scores_case(rng, "worked", ((), 3, 3, 2), "float64") for _ in range(2)]
    cases += [_scores_case(rng, "batched", sizes, dtype) for dtype in ("float32", "float64") for sizes in SCORES_SHAPES]
    for dtype in ("float32", "float64"):
        drawn = [((), 1, 1, 1), ((2, 4), 6, 6, 8), ((2, 2, 3), 4, 9, 5)]
        for n_lead in (0, 1, 2, 3):
            drawn.append((_draw(rng, 1, 4, n_lead), *_draw(rng, 1, 10, 3)))
        cases += [_scores_case(rng, "random", sizes, dtype) for sizes in drawn]
    for sizes in (((3,), 3, 3, 3), ((2, 2), 2, 2, 2), ((4,), 4, 4, 4)):
        cases.append(_scores_case(rng, "grads", sizes, "float64", grads=True))
    cases.append(_scores_case(rng, "grads", ((2,), 2, 2, 2), "float32", grads=True))
    return cases


GRAD_NAMES = {f"grad_{n}": f"the gradient with respect to {n}" for n in (*PROJECT_NAMES, *SCORES_NAMES)}

PIECES = (
    Exercise(
        name="qkv",
        piece="project_qkv",
        call="project_qkv(x, W_q, W_k, W_v)",
        adapter=runner(PROJECT_NAMES, outputs=("Q", "K", "V"), grad=PROJECT_NAMES, missing_as_none=True),
        reference="firstprinciples.reference:project_qkv",
        names=GRAD_NAMES,
        visible=_project_visible(),
        secret=project_secret,
        tests={
            "test_project_worked_example": Test(2, frozenset({"worked"}), first=(chapter_vectors,)),
            "test_project_shapes": Test(1, frozenset({"shapes"})),
            "test_project_random": Test(2, frozenset({"random"})),
            "test_project_gradients_and_inputs": Test(1, frozenset({"grads"}), first=(honest_gradients,), values=False),
        },
        forbidden=dict(torch_patterns=(), pieces=("project_qkv",), what="the query, key and value projections"),
        mistakes=PROJECT_MISTAKES,
        hints=(
            ("cannot be multiplied", "Each W is (d_model, d_out) and multiplies from the right: x @ W."),
            ("modified by an inplace operation", "An in-place operation on a tensor that autograd still needs breaks "
                                                 "the backward pass: build new tensors instead."),
        ),
    ),
    Exercise(
        name="qkv",
        piece="dot_product_scores",
        call="dot_product_scores(Q, K)",
        adapter=runner(SCORES_NAMES, outputs=("scores",), grad=SCORES_NAMES, missing_as_none=True),
        reference="firstprinciples.reference:dot_product_scores",
        names=GRAD_NAMES,
        visible=_scores_visible(),
        secret=scores_secret,
        tests={
            "test_scores_worked_example": Test(2, frozenset({"worked"}), first=(cat_scores,)),
            "test_scores_batched": Test(2, frozenset({"batched"})),
            "test_scores_random": Test(1, frozenset({"random"})),
            "test_scores_gradients_and_inputs": Test(1, frozenset({"grads"}), first=(honest_gradients,), values=False),
        },
        forbidden=dict(torch_patterns=(), pieces=("dot_product_scores",), what="the dot-product scores"),
        mistakes=SCORES_MISTAKES,
        hints=(
            ("Dimension out of range", "Use negative dimensions, K.transpose(-2, -1): the inputs may have no leading "
                                       "dimension, or several."),
            ("cannot be multiplied", "Q is (..., T_q, d_k) and K is (..., T_k, d_k): Q @ K.transpose(-2, -1) pairs "
                                     "their last dimensions."),
        ),
    ),
)
