"""Checks for ``induction_score(weights, period)``.

weights (..., T, T), the attention weights (queries as rows, keys as columns) for one sequence
of ``period`` tokens repeated twice (T = 2 * period) -> (...): the mean over the queries
i = period .. T - 1 of weights[..., i, i - period + 1], the weight that query i puts on the
token that followed the first occurrence of its own token.

Visible checks (the student runs them): the chapter's worked example (score 0.7), the shape and
dtype for several leading dimensions, random causal attention weights, and four heads whose
scores are known (a perfect induction head 1, a previous-token head and a duplicate-token head 0,
a uniform head the mean of 1 / (i + 1)). Hidden checks (``full=True``): more periods (1 and 2
included), more leading dimensions, float64.

Decisions stated once:

- **Values**: the tolerances of ``_core`` (float32 atol 1e-5, rtol 1e-4; float64 1e-10, 1e-8).
  A mean of at most 24 weights in another order (a loop, a sum divided by the count) moves a
  float32 result by about 1e-7; every named mistake moves the scores of these cases by more
  than 1e-2.
- **Type and shape**: a tensor of shape ``weights.shape[:-2]`` in the weights' dtype; a Python
  float (``.item()``) is refused even for a single head, as the contract asks for a tensor.
- Random weights are causal (a softmax of random scores under the causal mask), like every
  attention map of the chapter's model: the transposed entry weights[..., i - period + 1, i]
  is then 0, and the score of a random head is far from 0.
- The course's reference ``induction_score`` is forbidden: an answer that calls it scores 0.
"""
from __future__ import annotations

import torch

from ..induction.data import worked_example
from ..reference import induction_score as reference
from ._core import Mistake, assert_matches, call_answer, close, tolerance, with_diagnosis
from ._student import wrap_checks

FORBIDDEN = dict(pieces=("induction_score",), what="the induction score")
WORKED_SCORE = 0.7


# ---------------------------------------------------------------- inputs
def causal_weights(g, lead, T, dtype=torch.float32, scale=2.0):
    """(*lead, T, T): a softmax of random scores under the causal mask, seeded by ``g``."""
    scores = torch.randn(*lead, T, T, generator=g, dtype=torch.float64) * scale
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1).to(dtype)


def known_heads(period, dtype=torch.float32):
    """(4, T, T): a perfect induction head, a previous-token head, a duplicate-token head and a
    uniform causal head, for ``period`` tokens repeated twice; and their scores (4,). For
    period >= 3 (with period 2 the token after the earlier copy is the previous token)."""
    T = 2 * period
    i = torch.arange(T)
    first = i < period  # the first copy has no earlier occurrence: those rows look at themselves
    induction = torch.where(first, i, i - period + 1)
    duplicate = torch.where(first, i, i - period)
    previous = (i - 1).clamp(min=0)
    heads = torch.stack([torch.nn.functional.one_hot(t, T) for t in (induction, previous, duplicate)]).to(dtype)
    uniform = torch.ones(T, T, dtype=dtype).tril() / (i + 1).to(dtype)[:, None]
    heads = torch.cat([heads, uniform[None]])  # (4, T, T)
    expected = torch.tensor([1.0, 0.0, 0.0, (1.0 / (i[period:] + 1).double()).mean().item()], dtype=dtype)
    return heads, expected


HEAD_NAMES = ("a perfect induction head", "a previous-token head", "a duplicate-token head", "a uniform causal head")


# ---------------------------------------------------------------- mistakes
def _entries(weights, period, offset=1, start=0):
    """weights[..., i, i - period + offset] for i = period + start .. T - 1: (..., n)."""
    q = torch.arange(period + start, weights.shape[-1])
    return weights[..., q, q - period + offset]


MISTAKES = (
    Mistake("the duplicate token",
            "weights[..., i, i - period] is the weight on the earlier copy of token i itself; an induction head "
            "looks one further, at the token that came after it: weights[..., i, i - period + 1].",
            lambda w, p: _entries(w, p, offset=0).mean(-1)),
    Mistake("query period - 1 included",
            "the second copy starts at position period: average over i = period .. T - 1 only (torch.diagonal "
            "with offset -(period - 1) also returns the row i = period - 1, the last of the first copy).",
            lambda w, p: _entries(w, p, start=-1).mean(-1)),
    Mistake("query period left out",
            "the second copy starts at position period (0-based): average over i = period .. T - 1, "
            "period queries in all.",
            lambda w, p: _entries(w, p, start=1).mean(-1)),
    Mistake("divided by T",
            "the mean is over the period queries of the second copy, not over all T positions.",
            lambda w, p: _entries(w, p).sum(-1) / w.shape[-1]),
    Mistake("sum instead of mean",
            "take the mean over the queries i = period .. T - 1, not their sum (a perfect induction head scores 1).",
            lambda w, p: _entries(w, p).sum(-1)),
    Mistake("rows and columns swapped",
            "the query is the row and the key the column: weights[..., i, i - period + 1], not "
            "weights[..., i - period + 1, i] (with a causal mask that entry is always 0).",
            lambda w, p: (lambda q: w[..., q - p + 1, q])(torch.arange(p, w.shape[-1])).mean(-1)),
    Mistake("the share of rows whose largest weight is there",
            "the score is the mean weight on key i - period + 1, not how often it is the largest weight of its row.",
            lambda w, p: (w[..., torch.arange(p, w.shape[-1]), :].argmax(-1)
                          == torch.arange(1, w.shape[-1] - p + 1)).to(w.dtype).mean(-1)),
    Mistake("averaged over the leading dimensions too",
            "return one score per leading index (per layer and head): average over the queries only, "
            "with .mean(-1) on the (..., period) entries.",
            lambda w, p: _entries(w, p).mean()),
)


# ---------------------------------------------------------------- calling and comparing
def _call(fn, weights, period):
    try:
        return call_answer(fn, (weights, period), names=("induction_score(weights, period)",),
                           forbidden=FORBIDDEN)[0]
    except AssertionError as err:
        kind = next((k for k in ("float", "int", "list") if f"but it is a {k}." in str(err)), None)
        if kind is None:
            raise
        raise AssertionError(
            f"induction_score(weights, period) returned a Python {kind} {_label(weights, period)}. Return a "
            "tensor of shape weights.shape[:-2] (one score per leading index): leave out .item(), float() "
            "and .tolist().") from None


def _other_period(got, weights, period):
    """The period (other than ``period``) whose score ``got`` equals, or None: a hard-coded period."""
    for other in range(1, weights.shape[-1]):
        q = torch.arange(other, weights.shape[-1])
        if other != period and close(got, weights[..., q, q - other + 1].mean(-1), *tolerance(weights.dtype)):
            return other
    return None


def _label(weights, period):
    return f"for {str(weights.dtype).replace('torch.', '')} weights of shape {tuple(weights.shape)}, period={period}"


def _compare(fn, weights, period, label=None, expected=None):
    got = _call(fn, weights, period)
    want = reference(weights, period) if expected is None else expected
    name = "induction_score(weights, period)"
    try:
        with_diagnosis(lambda: assert_matches(name, got, want, context=label or _label(weights, period)),
                       (got,), (weights, period), MISTAKES, reference.__wrapped__)
    except AssertionError as err:
        other = _other_period(got, weights, period) if expected is None else None
        if other is None:
            raise
        raise AssertionError(f"{err}\nYour scores are those of period={other}: use the period argument, "
                             "not a fixed number.") from None
    return got


def _score_of(fn, heads, period, h):
    """Head h's score by ``fn`` rounded to 6 digits, or None where it has no such entry."""
    try:
        out = fn(heads, period)
        return round(float(out[h]), 6) if out.shape == (len(heads),) else None
    except Exception:
        return None


# ---------------------------------------------------------------- visible
def check_worked_example(fn):
    """The chapter's example: "A B C A B C" (period 3); queries 3, 4 and 5 put 0.5, 0.7 and 0.9 on
    keys 1, 2 and 3, so the score is 0.7 (in float32 and float64)."""
    for dtype in (torch.float32, torch.float64):
        _, w, period = worked_example(dtype)
        got = _compare(fn, w, period, label=f"for the worked example ({str(dtype).replace('torch.', '')}, T = 6, "
                                            "period=3)")
        assert abs(got.item() - WORKED_SCORE) < 1e-6, f"the worked example's score is 0.7, got {got.item()}"


def check_shapes(fn, full=True):
    """One score per leading index: weights of shape (*lead, T, T) give a tensor of shape lead, in the
    weights' dtype, for lead = (), (3,) and (2, 2) (at grading also three and four leading
    dimensions, float64 and other periods)."""
    g = torch.Generator().manual_seed(31)
    cases = [((), 4, torch.float32), ((3,), 5, torch.float32), ((2, 2), 3, torch.float32)]
    if full:
        cases += [((1, 2, 3), 6, torch.float32), ((2, 1, 1, 2), 4, torch.float64), ((5,), 2, torch.float64),
                  ((2, 3), 12, torch.float32)]
    for lead, period, dtype in cases:
        w = causal_weights(g, lead, 2 * period, dtype)
        got = _call(fn, w, period)
        if tuple(got.shape) != lead:
            hint = ""
            if got.dim() == 0 and lead:
                hint = (" You average over the leading dimensions too: reduce the (..., period) entries with "
                        ".mean(-1), over the queries only.")
            raise AssertionError(f"induction_score(weights, period) {_label(w, period)} has shape {tuple(got.shape)} "
                                 f"but should have shape {lead}: one score per leading index (per layer and head)."
                                 f"{hint} Index the last two dimensions with weights[..., rows, columns].")
        if got.dtype != dtype:
            raise AssertionError(f"induction_score(weights, period) {_label(w, period)} has dtype {got.dtype} but "
                                 f"should keep the weights' dtype {dtype}.")


def check_random(fn, full=True):
    """Random causal attention weights against the definition: (2, 3) heads with period 5 in float32,
    one head with period 8 in float64 (at grading also periods 1, 2, 16 and 24 and other shapes)."""
    g = torch.Generator().manual_seed(32)
    cases = [((2, 3), 5, torch.float32), ((), 8, torch.float64)]
    if full:
        cases += [((4,), 1, torch.float32), ((2,), 2, torch.float64), ((2, 2), 16, torch.float32),
                  ((1, 3), 24, torch.float64), ((3, 1, 2), 7, torch.float32)]
    for lead, period, dtype in cases:
        _compare(fn, causal_weights(g, lead, 2 * period, dtype), period)


def check_known_heads(fn, full=True):
    """Four heads stacked as (4, T, T), period 6: a perfect induction head scores 1, a previous-token
    head and a duplicate-token head (the earlier copy of the token itself) 0, and a uniform causal
    head the mean of 1 / (i + 1) over i = period .. T - 1 (at grading also periods 3, 10 and 24,
    float64)."""
    cases = [(6, torch.float32)]
    if full:
        cases += [(3, torch.float64), (10, torch.float64), (24, torch.float32)]
    for period, dtype in cases:
        heads, expected = known_heads(period, dtype)
        got = _call(fn, heads, period)
        for h, name in enumerate(HEAD_NAMES):
            if tuple(got.shape) == (4,) and abs(got[h].item() - expected[h].item()) > 1e-5:
                found = [m for m in MISTAKES if _score_of(m.fn, heads, period, h) == round(got[h].item(), 6)]
                hint = "".join(f"\n  - {m.label}: {m.hint}" for m in found)
                raise AssertionError(
                    f"{name.capitalize()} (period={period}, T = {2 * period}) should score {expected[h].item():.6g}, "
                    f"but induction_score gives {got[h].item():.6g}."
                    + (f"\nYour output matches a typical mistake:{hint}" if hint else ""))
        _compare(fn, heads, period, label=f"for the four known heads, period={period}", expected=expected)


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
