"""scaled_dot_product_attention(Q, K, V, mask=None) -> (output, weights): the exercise's tests, declared once.

softmax(Q K^T / sqrt(d_k) + mask) V over any leading (batch, head) dimensions. Decisions stated once:

- ``mask`` is additive (0 where a query may look, -inf where it may not, or any finite bias) and
  broadcasts to (..., T_q, T_k). No case masks a whole row: that row has no valid answer (NaN).
- ``test_batched_shapes`` judges the structure (types, dtypes, shapes) and that every row of the
  weights is a probability distribution; ``test_gradients_and_inputs`` judges that honest gradients
  reach Q, K and V (against finite differences of the answer's own output) and that the outputs
  have the right shapes. Neither compares values with the reference: the other three tests do.
- Every test fails an answer that changes its inputs, or calls PyTorch's attention or the course's.
- Values are compared with the defaults of ``grading.compare``: correct answers written otherwise
  (einsum, logsumexp, a loop over the keys, baddbmm, Q and K each scaled by d_k^-1/4) stay within a
  quarter of them on the secret cases of 40 seeds, large float32 scores included.
- Later notebooks run ``test_scaled_dot_product_attention``, a one-point recap of this piece, with
  the cases of ``RECAP`` below (the worked example inside a batch of heads, without and with the
  causal mask), declared in each of those notebooks with ``exercises.recap``.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .. import examples
from . import Exercise, Mistake, Test, case, causal_mask_array
from .adapters import grad_case, honest_gradients, runner

# ---------------------------------------------------------------- typical mistakes


def _scores(Q, K):
    return Q @ K.transpose(-2, -1)


def _plus(s, mask):
    return s if mask is None else s + mask


def _no_scaling(Q, K, V, mask=None):
    w = torch.softmax(_plus(_scores(Q, K), mask), dim=-1)
    return w @ V, w


def _scaled_by_dk(Q, K, V, mask=None):
    w = torch.softmax(_plus(_scores(Q, K) / Q.shape[-1], mask), dim=-1)
    return w @ V, w


def _scaled_by_dv(Q, K, V, mask=None):
    w = torch.softmax(_plus(_scores(Q, K) / math.sqrt(V.shape[-1]), mask), dim=-1)
    return w @ V, w


def _scaled_by_tk(Q, K, V, mask=None):
    w = torch.softmax(_plus(_scores(Q, K) / math.sqrt(K.shape[-2]), mask), dim=-1)
    return w @ V, w


def _softmax_wrong_axis(Q, K, V, mask=None):
    w = torch.softmax(_plus(_scores(Q, K) / math.sqrt(Q.shape[-1]), mask), dim=-2)
    return w @ V, w


def _mask_after_softmax(Q, K, V, mask=None):
    w = torch.softmax(_scores(Q, K) / math.sqrt(Q.shape[-1]), dim=-1)
    w = _plus(w, mask)
    return w @ V, w


def _mask_ignored(Q, K, V, mask=None):
    w = torch.softmax(_scores(Q, K) / math.sqrt(Q.shape[-1]), dim=-1)
    return w @ V, w


def _mask_before_scaling(Q, K, V, mask=None):
    w = torch.softmax(_plus(_scores(Q, K), mask) / math.sqrt(Q.shape[-1]), dim=-1)
    return w @ V, w


def _keys_as_values(Q, K, V, mask=None):
    w = torch.softmax(_plus(_scores(Q, K) / math.sqrt(Q.shape[-1]), mask), dim=-1)
    return w @ K, w


def _scores_as_weights(Q, K, V, mask=None):
    s = _plus(_scores(Q, K) / math.sqrt(Q.shape[-1]), mask)
    return torch.softmax(s, dim=-1) @ V, s


def _naive_exp(Q, K, V, mask=None):
    e = torch.exp(_plus(_scores(Q, K) / math.sqrt(Q.shape[-1]), mask))
    w = e / e.sum(dim=-1, keepdim=True)
    return w @ V, w


WORKED, SHAPES, MASKS, RANDOM, GRADS = ("test_worked_example", "test_batched_shapes", "test_masks",
                                        "test_random_against_torch", "test_gradients_and_inputs")
ALL = frozenset({WORKED, SHAPES, MASKS, RANDOM, GRADS})
VALUES = frozenset({WORKED, MASKS, RANDOM})  # the tests that compare values with the reference

MISTAKES = (
    Mistake("no scaling", "the scores were not divided by sqrt(d_k).", _no_scaling, VALUES),
    Mistake("scaled by d_k", "divide the scores by sqrt(d_k), not by d_k.", _scaled_by_dk, VALUES),
    # the worked example and the causal case have d_v == d_k; the random case does not
    Mistake("scaled by sqrt(d_v)", "d_k is the last dimension of Q (and K), not of V.", _scaled_by_dv,
            frozenset({RANDOM}), frozenset({MASKS})),
    Mistake("scaled by sqrt(T_k)", "d_k is the last dimension of Q, not the number of keys: use Q.shape[-1].",
            _scaled_by_tk, VALUES),
    Mistake("softmax over the wrong axis", "each query's row of scores (dim=-1, over the keys) must sum to 1.",
            _softmax_wrong_axis, VALUES | {SHAPES}),
    # the weights plus -inf are -inf: no gradient survives the masked entries' NaN
    Mistake("mask added after the softmax", "add the mask to the scaled scores, then take the softmax.",
            _mask_after_softmax, frozenset({MASKS}), frozenset({GRADS})),
    Mistake("mask ignored", "add `mask` to the scaled scores when it is not None.", _mask_ignored, frozenset({MASKS})),
    # a causal mask of 0 and -inf is the same divided by sqrt(d_k): only a finite bias tells them apart
    Mistake("mask added before the scaling",
            "scale the scores first, then add the mask: the mask must not be divided by sqrt(d_k).",
            _mask_before_scaling, frozenset(), frozenset({MASKS})),
    # no gradient reaches V
    Mistake("keys used as values", "the output is the weighted sum of V, not of K.", _keys_as_values, ALL),
    Mistake("scores returned as weights", "return the softmax weights, not the scores.", _scores_as_weights,
            VALUES | {SHAPES}),
    Mistake("softmax overflows",
            "exp() of a large score is inf; subtract the row's max before exp (or use torch.softmax).",
            _naive_exp, frozenset(), frozenset({RANDOM})),
)

# ---------------------------------------------------------------- properties (plain data)


def output_order(case, out, want):
    """The two results in the contract's order: (output, weights), not (weights, output)."""
    got_o, got_w, want_o, want_w = (d.get(k) for d in (out, want) for k in ("output", "weights"))
    if any(a is None or not hasattr(a, "shape") for a in (got_o, got_w, want_o, want_w)):
        return None
    swapped = got_o.shape == want_w.shape and got_w.shape == want_o.shape
    if swapped and want_o.shape == want_w.shape:  # (the same shapes: told apart by their values)
        swapped = all(np.allclose(a, b, atol=1e-5, equal_nan=True) for a, b in ((got_o, want_w), (got_w, want_o)))
    if swapped:
        return ("it returned its two results in the wrong order: (weights, output) instead of (output, weights). "
                "Return `weights @ V, weights`.")
    return None


def printed_figures(case, out, want):
    """Cat's weights and new representation are the book's printed figures, each rounded to three
    decimals: a correct answer is within 1e-3 of every one (0.2666 is printed 0.267)."""
    if "printed" not in case["tags"]:
        return None
    o, w = out["output"], out["weights"]
    if w.shape != (1, 3) or o.shape != (1, 2):
        return (f"for Q of shape (1, 2) and K, V of shape (3, 2), the weights should have shape (1, 3) and the output "
                f"(1, 2); got weights {w.shape} and output {o.shape}.")
    for j, token in enumerate(examples.TOKENS):
        got, shown = float(w[0, j]), examples.WEIGHTS[j]
        if not abs(got - shown) <= 1e-3:
            return (f"Cat's weight on '{token}' is {got:.4f} but should be {shown:.3f} "
                    f"(scores {examples.RAW_SCORES}, scaled {examples.SCALED_SCORES}).")
    for j in range(2):
        got, shown = float(o[0, j]), examples.OUTPUT[j]
        if not abs(got - shown) <= 1e-3:
            return f"Cat's new representation[{j}] is {got:.4f} but should be {shown:.3f}."
    return None


def distributions_over(what: str):
    """The property that every weight is finite and non-negative and each row (a query's weights
    over ``what``, "the keys") sums to 1 within 1e-5: float32 sums of a few terms are exact to
    about 1e-6."""

    def rows_are_distributions(case, out, want):
        w = out["weights"].astype(np.float64)
        if not np.isfinite(w).all() or (w < 0).any():
            return "the weights should all be finite and non-negative (they come out of a softmax)."
        worst = float(np.abs(w.sum(-1) - 1).max()) if w.size else 0.0
        if worst <= 1e-5:
            return None
        return f"each row of the weights should sum to 1 (over {what}, dim=-1); one is off by {worst:.6g}."

    return rows_are_distributions


rows_are_distributions = distributions_over("the keys")


def cat_attends_to_itself(case, out, want):
    """With the causal mask, Cat (the first token) sees only itself: its weights are exactly
    [1, 0, 0] (the masked scores are -inf, whose exp is exactly 0)."""
    if "causal worked" not in case["tags"] or out["weights"].shape != (3, 3):
        return None  # (a wrong shape: the comparison says so)
    row = out["weights"][0]
    if row[0] == 1.0 and not np.abs(row[1:]).max() > 0:
        return None
    return ("with the causal mask, Cat (the first token) can only attend to itself: its weights should be "
            f"[1, 0, 0], got {[float(v) for v in row]}.")


# ---------------------------------------------------------------- the adapter
_run = runner(("Q", "K", "V"), ("mask",), outputs=("output", "weights"), grad=("Q", "K", "V"), loss_outputs=1,
              missing_as_none=True)


def adapter(piece, case):
    """Call the answer on one case. A gradient case (``loss_seed``) back-propagates from the output
    alone, as a loss would; its two results are reported as well (detached), so that the gradient
    test judges their shapes and order, not their values."""
    returned = []

    def answer(*args, **kwargs):
        result = piece(*args, **kwargs)
        returned.append(result)
        return result

    res = _run(answer, case)
    if "loss_seed" in case and returned:
        res.update({name: value.detach() for name, value in zip(("output", "weights"), returned[0])})
    return res


# ---------------------------------------------------------------- the cases
NAMES = ("Q", "K", "V")


def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _qkv(rng, lead, T_q, T_k, d_k, d_v, dtype, scale=1.0):
    return {"Q": _normal(rng, (*lead, T_q, d_k), dtype, scale), "K": _normal(rng, (*lead, T_k, d_k), dtype, scale),
            "V": _normal(rng, (*lead, T_k, d_v), dtype)}


def _label(inputs, extra=""):
    Q, K, V = (inputs[n] for n in NAMES)
    mask = inputs.get("mask")
    at = f", mask {mask.shape}" if mask is not None else ""
    return f"for Q {Q.shape}, K {K.shape}, V {V.shape}, {Q.dtype}{at}{extra}"


def _case(tags, inputs, extra="", grads=False, rng=None):
    c = case(_label(inputs, extra + (", with the gradients" if grads else "")), tags, **inputs)
    return grad_case(rng, c, NAMES) if grads else c


def _worked(all_queries=False):
    return dict(zip(NAMES, (m.numpy() for m in examples.cat_sat_mat(torch.float64, all_queries=all_queries))))


# (leading dims, T_q, T_k, d_k, d_v)
BATCHED = (((), 4, 4, 8, 8), ((2,), 3, 5, 4, 6), ((2, 3), 5, 2, 8, 3))
MORE_SHAPES = (((), 1, 1, 1, 1), ((), 6, 6, 16, 16), ((3,), 7, 4, 8, 5), ((2, 4), 5, 5, 16, 16),
               ((2, 2, 3), 4, 9, 4, 12))


def _visible() -> tuple:
    g = np.random.default_rng(1)
    worked = "in the worked example (\"Cat sat mat\": Q (1, 2), K and V (3, 2), float64)"
    causal = "in the worked example with all three queries (Q, K, V (3, 2), float64) and the causal mask (3, 3)"
    return (
        case(worked, ("worked", "printed"), **_worked()),
        *(_case("shapes", _qkv(g, *sizes, dtype)) for dtype in ("float32", "float64") for sizes in BATCHED),
        case(causal, ("mask", "causal worked"), **_worked(all_queries=True), mask=causal_mask_array(3, "float64")),
        _case("random", _qkv(g, (2,), 4, 6, 8, 5, "float32")),
        _case("grads", _qkv(g, (2,), 4, 4, 3, 2, "float64"), grads=True, rng=g),
    )


def worked_example_in_a_batch(dtype="float64") -> dict:
    """Q, K, V of shape (B=2, H=2, T=3, d=2): batch 0, head 0 is "Cat sat mat" with all three
    queries; the other sequences and heads are seeded random. As multi-head attention calls it."""
    g = np.random.default_rng(3)
    inputs = {n: g.standard_normal((2, 2, 3, 2)).astype(dtype) for n in NAMES}
    for n, m in _worked(all_queries=True).items():
        inputs[n][0, 0] = m
    return inputs


def _recap_visible() -> tuple:
    where = "for Q, K, V of shape (B=2, H=2, T=3, d=2), float64 (entry [0, 0] is the worked example)"
    inputs = worked_example_in_a_batch()
    return (case(where, "recap", **inputs),
            case(where + " with the causal mask of shape (3, 3)", "recap", **inputs, mask=causal_mask_array(3, "float64")))


def _sizes(rng, n_lead):
    return (tuple(int(v) for v in rng.integers(1, 4, size=n_lead)), *(int(v) for v in rng.integers(1, 9, size=4)))


def _mask_cases(rng, dtype):
    cases = []
    lead, T = (2, 3), 6
    qkv = _qkv(rng, lead, T, T, 8, 8, dtype)
    cases.append(_case("mask", {**qkv, "mask": causal_mask_array(T, dtype)}, ", a causal mask"))
    pad = np.zeros((2, 1, 1, T), dtype)  # the last keys of one sequence hidden from every query
    pad[int(rng.integers(0, 2)), ..., int(rng.integers(2, T)):] = -np.inf
    cases.append(_case("mask", {**qkv, "mask": pad}, ", a padding mask"))
    qkv = _qkv(rng, (3,), 4, 7, 8, 5, dtype)  # a finite bias, one per (query, key) pair
    cases.append(_case("mask", {**qkv, "mask": _normal(rng, (4, 7), dtype, 2.0)}, ", a finite additive bias"))
    bias = _normal(rng, (4, 6), dtype)
    hide = rng.random((4, 6)) < 0.3
    hide[np.arange(4), rng.integers(0, 6, size=4)] = False  # never a whole row
    bias[hide] = -np.inf
    cases.append(_case("mask", {**_qkv(rng, (2,), 4, 6, 4, 5, dtype), "mask": bias}, ", a bias with -inf entries"))
    return cases


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases, drawn in the grader: the worked example's sizes with fresh numbers,
    the batched shapes and more (one token, three leading dims, random sizes), large scores, causal,
    padding and additive masks broadcast over leading dims, and gradients with and without a mask,
    all in float32 and float64."""
    cases = [_case("worked", _qkv(rng, (), T_q, 3, 2, 2, dtype)) for T_q, dtype in
             ((1, "float64"), (3, "float64"), (1, "float32"))]
    for dtype in ("float32", "float64"):
        cases += [_case("shapes", _qkv(rng, *sizes, dtype)) for sizes in (*BATCHED, MORE_SHAPES[0], MORE_SHAPES[-1])]
        cases += [_case("shapes", _qkv(rng, *_sizes(rng, n), dtype)) for n in (0, 2)]
        cases += [_case("random", _qkv(rng, *sizes, dtype)) for sizes in MORE_SHAPES]
        cases += [_case("random", _qkv(rng, *_sizes(rng, n), dtype)) for n in (1, 3)]
        # large scores (std 100 after scaling, 400 in float64): exp() overflows unless the softmax is stable
        for sizes, scale in ((((2,), 5, 5, 16, 8), 10.0), (((2,), 3, 5, 8, 4), 20.0 if dtype == "float64" else 10.0)):
            cases.append(_case("random", _qkv(rng, *sizes, dtype, scale), f", entries of scale {scale:g}"))
        cases += _mask_cases(rng, dtype)
    worked = _qkv(rng, (), 3, 3, 2, 2, "float64")
    cases.append(_case("mask", {**worked, "mask": causal_mask_array(3, "float64")}, ", a causal mask"))
    # (a finite bias, not a padding mask: a key hidden from every query makes a softmax over the
    # wrong axis NaN, and this test judges gradients, not values)
    for mask in (None, causal_mask_array(4, "float64"), _normal(rng, (2, 1, 4), "float64")):
        qkv = _qkv(rng, (2,), 4, 4, 3, 2, "float64")
        cases.append(_case("grads", qkv if mask is None else {**qkv, "mask": mask}, grads=True, rng=rng))
    cases.append(_case("grads", _qkv(rng, *_sizes(rng, 2), "float64"), grads=True, rng=rng))
    cases.append(_case("grads", _qkv(rng, (3,), 5, 2, 4, 3, "float32"), grads=True, rng=rng))
    return cases


EXERCISE = Exercise(
    name="attention",
    piece="scaled_dot_product_attention",
    call="scaled_dot_product_attention(Q, K, V, mask)",
    adapter=adapter,
    reference="firstprinciples.reference:scaled_dot_product_attention",
    names={**{f"grad_{n}": f"the gradient with respect to {n}" for n in NAMES}},
    visible=_visible(),
    secret=secret,
    tests={
        WORKED: Test(2, frozenset({"worked"}), first=(output_order, printed_figures)),
        SHAPES: Test(2, frozenset({"shapes"}), first=(output_order,), then=(rows_are_distributions,), values=False),
        MASKS: Test(2, frozenset({"mask"}), first=(output_order, cat_attends_to_itself)),
        RANDOM: Test(2, frozenset({"random"}), first=(output_order,)),
        GRADS: Test(2, frozenset({"grads"}), first=(output_order, honest_gradients), values=False),
    },
    forbidden=dict(torch_patterns=("scaled_dot_product_attention", "multi_head_attention"),
                   pieces=("scaled_dot_product_attention",), what="scaled dot-product attention"),
    mistakes=MISTAKES,
    hints=(
        ("cannot be multiplied", "Q is (..., T_q, d_k) and K is (..., T_k, d_k): Q @ K.transpose(-2, -1) pairs their "
                                 "last dimensions, and the weights (..., T_q, T_k) multiply V (..., T_k, d_v)."),
        ("Dimension out of range", "Use negative dimensions, K.transpose(-2, -1): the inputs may have no leading "
                                   "dimension, or several."),
        ("modified by an inplace operation", "An in-place operation (s /= ..., s += mask) on a tensor that autograd "
                                             "still needs breaks the backward pass: write s = s / ... instead."),
    ),
)

# The later notebooks' one-point recap (their cell test_scaled_dot_product_attention): this piece as
# multi-head attention calls it, the worked example inside a batch of two sequences of two heads,
# without a mask and with the causal mask, which broadcasts over the batch and the heads (the
# later notebooks' declarations make their recaps from it).
# In the re-check, their cell is judged on the secret worked-example-sized cases, as before the
# declaration (``elsewhere``).
RECAP_ID = "test_scaled_dot_product_attention"
RECAP = dataclasses.replace(EXERCISE, visible=_recap_visible(),
                            tests={RECAP_ID: Test(1, frozenset({"recap"}), first=(output_order,))})
EXERCISE = dataclasses.replace(EXERCISE, elsewhere={RECAP_ID: Test(1, frozenset({"worked"}), first=(output_order,))})
