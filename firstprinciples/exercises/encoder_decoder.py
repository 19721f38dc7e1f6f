"""cross_attention(x, context, W_q, W_k, W_v, mask=None) -> (output, weights): the exercise's tests, declared once.

Queries from x (B, T_q, d_model), keys and values from context (B, T_k, d_ctx): W_q is
(d_model, d_k), W_k (d_ctx, d_k), W_v (d_ctx, d_v). The output is (B, T_q, d_v) and the weights
(B, T_q, T_k); ``mask`` is an additive float tensor broadcastable to (B, T_q, T_k) (in practice it
hides padding in the context). Decisions stated once:

- Values are compared with the course's results (``reference``), with the defaults of
  ``grading.compare``: a correct answer differs from them only by the order of its sums. The
  reference itself agrees with ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention``
  (one head, the same weights, no output projection): ``tests/material/test_reference_decoding.py`` shows it,
  so ``test_against_torch`` compares the answer with the reference only.
- ``test_shapes`` judges types, dtypes, shapes and that every row of the weights is a probability
  distribution over the context; ``test_gradients_and_inputs`` judges that honest gradients reach
  x, context, W_q, W_k and W_v (against finite differences of the answer's own output). Neither
  compares values with the reference: the other four tests do.
- ``test_roles`` also judges what defines cross-attention, on x and context of equal shapes (so
  that every mix-up of the two sequences runs): output row i depends on x only through x[:, i],
  and on every position of the context. The adapter reports, per output row, how far it moves
  when one token of x changes and when the last position of the context changes.
- Every test fails an answer that changes its inputs, or calls PyTorch's attention or the
  course's cross_attention, scaled_dot_product_attention or MultiHeadAttention.
- The notebook also runs ``test_scaled_dot_product_attention``, the attention exercise's one-point
  recap of the student's own attention (``attention.RECAP``), declared below as ``RECAP``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import examples
from ..examples.encoder_decoder import worked_example
from . import Exercise, Mistake, Test, attention, case, recap
from .adapters import grad_case, honest_gradients, runner

NAMES = ("x", "context", "W_q", "W_k", "W_v")


# ---------------------------------------------------------------- typical mistakes
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


WORKED, SHAPES, ROLES, TORCH, PADDING, GRADS = ("test_worked_example", "test_shapes", "test_roles",
                                                "test_against_torch", "test_padding_mask",
                                                "test_gradients_and_inputs")
ALL = frozenset({WORKED, SHAPES, ROLES, TORCH, PADDING, GRADS})

MISTAKES = (
    # (x and context of different shapes make the three mix-ups raise; test_roles's equal shapes let them run)
    Mistake("queries taken from the context (roles swapped)",
            "the queries come from x, the sequence being produced (Q = x @ W_q); the keys and values "
            "from context, the sequence being read.", _roles_swapped, ALL),
    Mistake("keys from x",
            "the keys must come from the context (K = context @ W_k): each query of x is compared "
            "with the positions of the context.", _keys_from_x, ALL),
    Mistake("values from x",
            "the values must come from the context (V = context @ W_v): cross-attention carries "
            "information from the context into x.", _values_from_x, ALL),
    # rows that are still distributions, and honest gradients: test_shapes and the gradients pass
    Mistake("causal mask applied to cross-attention",
            "cross-attention needs no causal mask: the whole context (the source sentence) is known "
            "in advance, and the (T_q, T_k) scores are not a square matrix anyway. Add only the mask "
            "you are given.", _causal_mask_applied, ALL - {SHAPES, GRADS}),
    Mistake("mask ignored", "add `mask` to the scaled scores when it is not None.", _mask_ignored,
            frozenset({PADDING})),
    Mistake("softmax over the queries",
            "each query's row of weights (dim=-1, over the T_k context positions) must sum to 1.",
            _softmax_over_queries, ALL - {GRADS}),
)


# ---------------------------------------------------------------- properties (plain data)
def _fmt(v: float) -> str:
    return "NaN" if v != v else f"{v:.6g}"


def chapter_figures(case, out, want):
    """The worked example's first query is Cat's of the attention chapter over the chapter's keys and
    values: its weights and output are the chapter's printed figures, each rounded to three decimals
    (a correct answer is within 1e-3 of every one: 0.2666 is printed 0.267)."""
    if "printed" not in case["tags"]:
        return None
    o, w = out["output"], out["weights"]
    if w.shape != (1, 2, 3) or o.shape != (1, 2, 2):
        return ("for x of shape (1, 2, 2) (two queries) and a context of shape (1, 3, 4) (three tokens), the "
                f"weights should be (1, 2, 3) and the output (1, 2, 2); got weights {w.shape} and output {o.shape}.")
    for j, token in enumerate(examples.TOKENS):
        got, shown = float(w[0, 0, j]), examples.WEIGHTS[j]
        if not abs(got - shown) <= 1e-3:
            return (f"the first query (Cat's, [1.0, 0.5]) puts weight {got:.4f} on '{token}' but should put "
                    f"{shown:.3f}: the same numbers as in the attention chapter, since the keys are the context's "
                    "key halves.")
    for j in range(2):
        got, shown = float(o[0, 0, j]), examples.OUTPUT[j]
        if not abs(got - shown) <= 1e-3:
            return f"the first query's output[{j}] is {got:.4f} but should be {shown:.3f}."
    return None


def one_row_per_query(case, out, want):
    """The output is (B, T_q, d_v) and the weights (B, T_q, T_k), said in terms of the two roles
    (the comparison would say only that the shapes differ)."""
    for name in ("output", "weights"):
        got, expected = out.get(name), want.get(name)
        if got is None or expected is None or got.shape == expected.shape:
            continue
        return (f"{name} has shape {got.shape}, expected {expected.shape} (one row per query of x, one column "
                "per position of the context).")
    return None


rows_are_distributions = attention.distributions_over("the context positions")


BY_X, BY_CONTEXT = "moved_by_x", "moved_by_context"


def reads_its_own_query_and_the_whole_context(case, out, want):
    """Output row i moves when x[:, i] changes and no other row does (more than 1e-12: float64, and
    each row is computed from its own query alone); every output row moves (by more than 1e-6)
    when the last position of the context changes."""
    if not isinstance(out.get(BY_X), np.ndarray) or not isinstance(out.get(BY_CONTEXT), np.ndarray):
        return None  # (the comparison says what was returned instead)
    by_x, by_context, row = out[BY_X], out[BY_CONTEXT], int(case["row"])
    if by_x.shape != want[BY_X].shape or by_context.shape != want[BY_CONTEXT].shape:
        return None  # (a wrong shape: the comparison says so)
    others = float(np.delete(by_x, row).max()) if by_x.size > 1 else 0.0
    if not (others <= 1e-12 and by_x[row] > 1e-6):
        largest = f" Largest change of the other rows: {_fmt(others)}." if case["show"] else ""
        return (f"changing x at position {row} should change output row {row}, and only that row: each query "
                f"reads the context independently of the other queries.{largest}")
    if not float(by_context.min()) > 1e-6:
        return ("changing the last position of the context should change every output row: every query may read "
                "the whole context (no causal mask in cross-attention).")
    return None


def masked_positions_get_zero(case, out, want):
    """Where the mask is -inf (a padded context position), the weight is exactly 0: exp(-inf) is 0,
    and a weight of 1e-30 would still let the padding in."""
    mask = case.get("mask")
    w = out["weights"]
    if mask is None or not np.isneginf(mask).any():
        return None
    try:
        hidden = np.broadcast_to(np.isneginf(mask), w.shape)
    except ValueError:
        return None  # (a wrong shape: the comparison says so)
    if np.any(w[hidden] != 0):
        return "padded context positions (where the mask is -inf) must get exactly zero weight."
    return None


# ---------------------------------------------------------------- the adapter
_run = runner(NAMES, ("mask",), outputs=("output", "weights"), grad=NAMES, loss_outputs=1, missing_as_none=True)


def _rows_moved(piece, case) -> dict:
    """For a case with ``row`` (test_roles): how far each output row moves (its largest change over
    the batch and the features) when x[:, row] changes by 1, and when the last position of the
    context does. Fresh copies each time; None where the output is not a (B, T_q, d_v)-like tensor
    (the comparison then says what it is)."""
    weights = [case[n] for n in ("W_q", "W_k", "W_v")]

    def output(x, context):
        result = piece(x, context, *(w.clone() for w in weights))
        return result[0] if isinstance(result, (tuple, list)) else result

    x, context, row = case["x"], case["context"], int(case["row"])
    base = output(x.clone(), context.clone())
    if type(base) is not torch.Tensor or base.dim() != 3:
        return {BY_X: None, BY_CONTEXT: None}
    x2, context2 = x.clone(), context.clone()
    x2[:, row] += 1.0  # one token of x changes
    context2[:, -1] += 1.0  # the last position of the context changes
    moved = {BY_X: output(x2, context.clone()), BY_CONTEXT: output(x.clone(), context2)}
    return {k: (v.detach() - base.detach()).abs().amax(dim=(0, 2)) if type(v) is torch.Tensor and v.shape == base.shape
            else None for k, v in moved.items()}


def adapter(piece, case):
    """Call the answer on one case. A gradient case (``loss_seed``) back-propagates from the output
    alone, as a loss would; its two results are reported as well (detached), so that the gradient
    test judges their shapes and order, not their values. A case with ``row`` (test_roles) also
    reports how far each output row moves (``_rows_moved``)."""
    returned = []

    def answer(*args, **kwargs):
        result = piece(*args, **kwargs)
        returned.append(result)
        return result

    res = _run(answer, case)
    if "loss_seed" in case and returned:
        res.update({name: value.detach() for name, value in zip(("output", "weights"), returned[0])})
    if "row" in case:
        res.update(_rows_moved(piece, case))
    return res


# ---------------------------------------------------------------- the cases
# (B, T_q, T_k, d_model, d_ctx, d_k, d_v)
SHAPES_SIZES = ((1, 2, 5, 4, 4, 4, 4), (2, 4, 3, 6, 10, 8, 5), (3, 1, 7, 8, 8, 4, 4), (2, 6, 2, 4, 12, 6, 3))
MORE_SIZES = (
    (1, 1, 1, 2, 2, 2, 2),
    (2, 4, 6, 8, 8, 8, 8),
    (3, 7, 3, 8, 5, 8, 8),  # a context narrower than x
    (2, 3, 9, 6, 12, 4, 10),  # d_model != d_k != d_v
    (4, 5, 5, 16, 16, 16, 16),
)
WORKED_SIZES = (1, 2, 3, 2, 4, 2, 2)
GRAD_SIZES = (2, 3, 4, 3, 5, 2, 3)


def _inputs(rng, B, T_q, T_k, d_model, d_ctx, d_k, d_v, dtype):
    """x and context of unit entries, each W scaled by 1/sqrt(its input width) (scores of order 1)."""
    def normal(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    return {"x": normal((B, T_q, d_model)), "context": normal((B, T_k, d_ctx)),
            "W_q": normal((d_model, d_k), d_model ** -0.5), "W_k": normal((d_ctx, d_k), d_ctx ** -0.5),
            "W_v": normal((d_ctx, d_v), d_ctx ** -0.5)}


def _label(inputs, extra=""):
    x, context, W_q, W_k, W_v = (inputs[n] for n in NAMES)
    mask = inputs.get("mask")
    at = f", mask {mask.shape}" if mask is not None else ""
    return (f"for x {x.shape}, context {context.shape}, W_q {W_q.shape}, W_k {W_k.shape}, W_v {W_v.shape}, "
            f"{x.dtype}{at}{extra}")


def _case(tags, inputs, extra="", grads=False, rng=None):
    c = case(_label(inputs, extra + (", with the gradients" if grads else "")), tags, **inputs)
    return grad_case(rng, c, NAMES) if grads else c


def _roles(rng, B, T, d, row):
    inputs = _inputs(rng, B, T, T, d, d, d, d, "float64")
    return case(_label(inputs, f" (x and context of equal shapes; x[:, {row}] and the context's last position "
                               "then changed by 1)"), "roles", **inputs, row=int(row))


def _padding(B, T_q, T_k, padded, dtype):
    """A (B, 1, T_k) padding mask: sequence b's last ``padded[b]`` context positions hidden from every query."""
    pad = np.zeros((B, 1, T_k), dtype)
    for b, n in enumerate(padded):
        if n:
            pad[b, :, T_k - n:] = -np.inf
    return pad


def _large(rng, sizes, dtype, top):
    """Inputs whose largest scaled score is ``top`` (an unshifted exp overflows above 88.7 in float32,
    709.8 in float64)."""
    inputs = _inputs(rng, *sizes, dtype)
    x, context = (inputs[n].astype(np.float64) for n in ("x", "context"))
    scores = (x @ inputs["W_q"]) @ (context @ inputs["W_k"]).swapaxes(-1, -2) / math.sqrt(sizes[5])
    scale = math.sqrt(top / max(float(scores.max()), 1e-3))
    inputs["x"] = (inputs["x"] * scale).astype(dtype)
    inputs["context"] = (inputs["context"] * scale).astype(dtype)
    return inputs


def _visible() -> tuple:
    g = np.random.default_rng(5)
    worked = ("in the worked example (\"Cat sat mat\" as the context: x (1, 2, 2) with Cat's and mat's queries, "
              "context (1, 3, 4), W_q (2, 2), W_k and W_v (4, 2), float64)")
    pad_inputs = _inputs(g, 2, 3, 5, 8, 8, 8, 8, "float64")
    return (
        case(worked, ("worked", "printed"), **dict(zip(NAMES, (t.numpy() for t in worked_example())))),
        *(_case("shapes", _inputs(g, *sizes, dtype)) for dtype in ("float32", "float64") for sizes in SHAPES_SIZES),
        _roles(g, 2, 5, 6, row=3),
        _case("torch", _inputs(g, 2, 4, 6, 8, 8, 8, 8, "float32")),
        # the second source sentence has 2 padding tokens
        _case("padding", {**pad_inputs, "mask": _padding(2, 3, 5, (0, 2), "float64")}, " (padding)"),
        _case("grads", _inputs(g, *GRAD_SIZES, "float64"), grads=True, rng=g),
    )


def _sizes(rng):
    """Random sizes: B in 1..3, T_q and T_k in 1..8, widths in 1..10."""
    B = int(rng.integers(1, 4))
    T_q, T_k = (int(v) for v in rng.integers(1, 9, size=2))
    return (B, T_q, T_k, *(int(v) for v in rng.integers(1, 11, size=4)))


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases, drawn in the grader: the worked example's sizes with fresh numbers, the
    shapes test's sizes and random ones, x and context of equal shapes (random sizes, a random token
    of x changed), more shapes and scores large enough that an unshifted exp overflows, padding
    masks, arbitrary additive masks and masks with -inf entries of every broadcast shape, and
    gradients with and without a mask; float32 and float64."""
    cases = [_case("worked", _inputs(rng, *WORKED_SIZES, dtype)) for dtype in ("float64", "float64", "float32")]
    for dtype in ("float32", "float64"):
        cases += [_case("shapes", _inputs(rng, *sizes, dtype)) for sizes in (*SHAPES_SIZES, _sizes(rng))]
    for B, T, d in ((2, 5, 6), (int(rng.integers(1, 4)), int(rng.integers(2, 8)), int(rng.integers(2, 9)))):
        cases.append(_roles(rng, B, T, d, row=int(rng.integers(0, T))))
    for dtype in ("float32", "float64"):
        cases += [_case("torch", _inputs(rng, *sizes, dtype)) for sizes in (*MORE_SIZES, _sizes(rng))]
        top = 120.0 if dtype == "float32" else 800.0
        cases.append(_case("torch", _large(rng, (2, 3, 4, 8, 8, 8, 8), dtype, top), f", scores up to {top:g}"))
    for dtype in ("float64", "float32"):
        B, T_q, T_k = 2, 3, 5
        inputs = _inputs(rng, B, T_q, T_k, 8, 8, 8, 8, dtype)
        padded = (int(rng.integers(0, 3)), int(rng.integers(1, T_k)))
        cases.append(_case("padding", {**inputs, "mask": _padding(B, T_q, T_k, padded, dtype)}, " (padding)"))
        bias = (rng.standard_normal((T_q, T_k)) * 2.0).astype(dtype)
        cases.append(_case("padding", {**_inputs(rng, B, T_q, T_k, 6, 10, 4, 5, dtype), "mask": bias},
                           " (an additive bias)"))
        # -inf entries in a full (B, T_q, T_k) mask, never a whole row
        hide = rng.random((B, T_q, T_k)) < 0.4
        hide[..., int(rng.integers(0, T_k))] = False
        full = np.where(hide, -np.inf, rng.standard_normal((B, T_q, T_k))).astype(dtype)
        cases.append(_case("padding", {**_inputs(rng, B, T_q, T_k, 4, 7, 6, 3, dtype), "mask": full},
                           " (a mask with -inf entries)"))
    # (-inf entries, but the first context position seen by every query and no position hidden from
    # every query: an added causal mask or a softmax over the queries would otherwise make a row or a
    # column NaN, and this test judges gradients, not values)
    hide = rng.random((2, 3, 4)) < 0.3
    hide[..., 0] = False
    hide[:, int(rng.integers(0, 3)), :] = False
    for mask in (None, np.where(hide, -np.inf, 0.0), rng.standard_normal((3, 4))):
        inputs = _inputs(rng, *GRAD_SIZES, "float64")
        cases.append(_case("grads", inputs if mask is None else {**inputs, "mask": mask}, grads=True, rng=rng))
    cases.append(_case("grads", _inputs(rng, *_sizes(rng), "float64"), grads=True, rng=rng))
    cases.append(_case("grads", _inputs(rng, 2, 4, 3, 6, 5, 4, 3, "float32"), grads=True, rng=rng))
    return cases


EXERCISE = Exercise(
    name="encoder_decoder",
    piece="cross_attention",
    call="cross_attention(x, context, W_q, W_k, W_v, mask)",
    adapter=adapter,
    reference="firstprinciples.reference:cross_attention",
    names={**{f"grad_{n}": f"the gradient with respect to {n}" for n in NAMES},
           BY_X: "how far each output row moves when one token of x changes",
           BY_CONTEXT: "how far each output row moves when the last position of the context changes"},
    visible=_visible(),
    secret=secret,
    tests={
        WORKED: Test(2, frozenset({"worked"}), first=(attention.output_order, chapter_figures)),
        SHAPES: Test(1, frozenset({"shapes"}), first=(attention.output_order, one_row_per_query),
                     then=(rows_are_distributions,), values=False),
        ROLES: Test(2, frozenset({"roles"}), first=(attention.output_order, reads_its_own_query_and_the_whole_context)),
        TORCH: Test(2, frozenset({"torch"}), first=(attention.output_order,)),
        PADDING: Test(1, frozenset({"padding"}), first=(attention.output_order,), then=(masked_positions_get_zero,)),
        GRADS: Test(1, frozenset({"grads"}), first=(attention.output_order, honest_gradients), values=False),
    },
    forbidden=dict(torch_patterns=("scaled_dot_product_attention", "multi_head_attention"),
                   pieces=("cross_attention", "scaled_dot_product_attention", "MultiHeadAttention"),
                   what="cross-attention (with your own scaled_dot_product_attention)"),
    mistakes=MISTAKES,
    hints=(
        ("cannot be multiplied", "Queries come from x (x @ W_q), keys and values from context (context @ W_k, "
                                 "context @ W_v); the scores are (B, T_q, T_k), not square. Does your code mix up the "
                                 "two sequences?"),
        ("Expected size for first two dimensions", "Queries come from x (x @ W_q), keys and values from context "
                                                   "(context @ W_k, context @ W_v): the weights (B, T_q, T_k) multiply "
                                                   "V (B, T_k, d_v). Does your code mix up the two sequences?"),
        ("must match the size", "The scores are (B, T_q, T_k), not square: queries come from x, keys and values from "
                                "context. Does your code mix up the two sequences, or add a causal mask that does not "
                                "fit?"),
        ("modified by an inplace operation", "An in-place operation on a tensor that autograd still needs breaks the "
                                             "backward pass: build new tensors instead."),
    ),
)


# ---------------------------------------------------------------- the recap of the student's attention
# The notebook's cell test_scaled_dot_product_attention runs the attention exercise's recap (its
# cases: "Cat sat mat" inside a batch of 2 sequences of 2 heads, without and with the causal mask).
# The re-check judges it by the attention exercise's probe, on its secret worked-example-sized cases
# (``attention.EXERCISE.elsewhere``, tagged "worked"): the visible cases carry that tag too.
# Those secret cases have no mask, so the mistakes of the mask are named in the notebook only
# (``missed``: caught by the visible causal case, not re-checked).
_RECAP_TEST = attention.EXERCISE.elsewhere[attention.RECAP_ID]
_ONE = {attention.RECAP_ID}
RECAP = recap(
    attention.EXERCISE, "encoder_decoder", {attention.RECAP_ID: _RECAP_TEST},
    visible=tuple({**c, "tags": tuple(sorted(set(c["tags"]) | _RECAP_TEST.tags))} for c in attention.RECAP.visible),
    mistakes={
        **{label: (_ONE, ()) for label in ("no scaling", "scaled by d_k", "scaled by sqrt(T_k)",
                                           "softmax over the wrong axis", "keys used as values",
                                           "scores returned as weights")},
        **{label: (_ONE, (), _ONE) for label in ("mask added after the softmax", "mask ignored")},
    },
)

PIECES = (RECAP, EXERCISE)
