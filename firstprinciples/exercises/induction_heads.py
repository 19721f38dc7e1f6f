"""induction_score(weights, period): the exercise's tests, declared once.

weights (..., T, T), the attention weights (queries as rows, keys as columns) for one sequence of
``period`` tokens repeated twice (T = 2 * period) -> (...): the mean over the queries
i = period .. T - 1 of weights[..., i, i - period + 1], the weight that query i puts on the token
that followed the first occurrence of its own token.

Decisions stated once:

- **Values**: the comparison's default tolerances (float32 atol 1e-5, rtol 1e-4; float64 1e-10,
  1e-8). A mean of at most 24 weights in another order (a loop, a sum divided by the count) moves
  a float32 result by about 1e-7; every named mistake moves the scores of these cases by more
  than 1e-2.
- **Type and shape**: a tensor of shape ``weights.shape[:-2]`` in the weights' dtype; a Python
  float (``.item()``) is refused even for a single head, as the contract asks for a tensor.
- Random weights are causal (a softmax of random scores under the causal mask), like every
  attention map of the chapter's model: the transposed entry weights[..., i - period + 1, i] is
  then 0, and the score of a random head is far from 0.
- The worked example is the chapter's (score 0.7); the re-check adds fresh weights of its size, so
  that a typed-in 0.7 earns nothing there.
- The course's ``induction_score`` is forbidden: an answer that calls it scores 0.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import given
from ..induction.data import worked_example
from . import Exercise, Mistake, Test, case
from .adapters import call_runner

WORKED_SCORE = 0.7
HEAD_NAMES = ("a perfect induction head", "a previous-token head", "a duplicate-token head", "a uniform causal head")

# ---------------------------------------------------------------- typical mistakes


def _entries(weights, period, offset=1, start=0):
    """weights[..., i, i - period + offset] for i = period + start .. T - 1: (..., n)."""
    q = torch.arange(period + start, weights.shape[-1])
    return weights[..., q, q - period + offset]


ALL = frozenset({"test_worked_example", "test_shapes", "test_random", "test_known_heads"})
VALUES = ALL - {"test_shapes"}
MISTAKES = (
    Mistake("the duplicate token",
            "weights[..., i, i - period] is the weight on the earlier copy of token i itself; an induction head "
            "looks one further, at the token that came after it: weights[..., i, i - period + 1].",
            lambda w, p: _entries(w, p, offset=0).mean(-1), VALUES),
    Mistake("query period - 1 included",
            "the second copy starts at position period: average over i = period .. T - 1 only (torch.diagonal "
            "with offset -(period - 1) also returns the row i = period - 1, the last of the first copy).",
            lambda w, p: _entries(w, p, start=-1).mean(-1), VALUES),
    Mistake("query period left out",
            "the second copy starts at position period (0-based): average over i = period .. T - 1, "
            "period queries in all.",
            lambda w, p: _entries(w, p, start=1).mean(-1), VALUES),
    Mistake("divided by T",
            "the mean is over the period queries of the second copy, not over all T positions.",
            lambda w, p: _entries(w, p).sum(-1) / w.shape[-1], VALUES),
    Mistake("sum instead of mean",
            "take the mean over the queries i = period .. T - 1, not their sum (a perfect induction head scores 1).",
            lambda w, p: _entries(w, p).sum(-1), VALUES),
    Mistake("rows and columns swapped",
            "the query is the row and the key the column: weights[..., i, i - period + 1], not "
            "weights[..., i - period + 1, i] (with a causal mask that entry is always 0).",
            lambda w, p: (lambda q: w[..., q - p + 1, q])(torch.arange(p, w.shape[-1])).mean(-1), VALUES),
    Mistake("the share of rows whose largest weight is there",
            "the score is the mean weight on key i - period + 1, not how often it is the largest weight of its row.",
            lambda w, p: (w[..., torch.arange(p, w.shape[-1]), :].argmax(-1)
                          == torch.arange(1, w.shape[-1] - p + 1)).to(w.dtype).mean(-1), VALUES),
    Mistake("averaged over the leading dimensions too",
            "return one score per leading index (per layer and head): average over the queries only, "
            "with .mean(-1) on the (..., period) entries.",
            lambda w, p: _entries(w, p).mean(), ALL - {"test_worked_example"}),
)

# ---------------------------------------------------------------- properties (plain data)


def _score(out):
    got = out.get("score")
    return got if isinstance(got, np.ndarray) else None


def structure(case, out, want):
    """One score per leading index: shape weights.shape[:-2], in the weights' dtype."""
    got, weights = _score(out), case["weights"]
    if got is None:
        return None  # not an array: the comparison names the type
    lead = weights.shape[:-2]
    if got.shape != lead:
        hint = ""
        if got.ndim == 0 and lead:
            hint = (" You average over the leading dimensions too: reduce the (..., period) entries with .mean(-1), "
                    "over the queries only.")
        return (f"the score has shape {got.shape} but should have shape {lead}: one score per leading index (per "
                f"layer and head).{hint} Index the last two dimensions with weights[..., rows, columns].")
    if got.dtype != weights.dtype:
        return (f"the score has dtype torch.{got.dtype.name} but should keep the weights' dtype "
                f"torch.{weights.dtype.name}.")
    return None


def known_head_scores(case, out, want):
    """The four heads of known score (``known_heads``), each named when its score is off by more
    than 1e-5 (their scores are public: 1, 0, 0 and the mean of 1 / (i + 1))."""
    got = _score(out)
    if "heads" not in case["tags"] or got is None or got.shape != (4,):
        return None
    period, right = int(case["period"]), want["score"]
    for h, name in enumerate(HEAD_NAMES):
        if abs(float(got[h]) - float(right[h])) > 1e-5:
            return (f"{name} (period={period}, T = {2 * period}) should score {float(right[h]):.6g}, but "
                    f"induction_score gives {float(got[h]):.6g}.")
    return None


def another_period(case, out, want):
    """An answer whose scores are those of another period (and not this one's) uses a fixed period
    instead of the argument: said before the comparison, whose message would not tell why."""
    got, weights, period = _score(out), case["weights"], int(case["period"])
    if got is None or got.shape != weights.shape[:-2] or "heads" in case["tags"]:
        return None
    from . import tolerance

    atol, rtol = tolerance(weights.dtype.name)
    T = weights.shape[-1]

    def close(a, b):
        return bool(np.all(np.abs(a.astype(np.float64) - b) <= atol + rtol * np.abs(b)))

    for other in range(1, T):
        q = np.arange(other, T)
        theirs = weights[..., q, q - other + 1].astype(np.float64).mean(-1)
        if other != period and close(got, theirs) and not close(want["score"], theirs):
            return f"your scores are those of period={other}: use the period argument, not a fixed number."
    return None


def printed_score(case, out, want):
    """The chapter's worked example scores 0.7 (within 1e-6)."""
    got = _score(out)
    if "printed" not in case["tags"] or got is None or got.size != 1:
        return None
    value = float(got.reshape(()))
    return None if abs(value - WORKED_SCORE) < 1e-6 else f"the worked example's score is 0.7, got {value!r}."


# ---------------------------------------------------------------- the cases


def causal_weights(rng, lead, T, dtype="float32", scale=2.0):
    """(*lead, T, T): a softmax of random scores under the causal mask, drawn from ``rng``."""
    scores = torch.from_numpy(rng.standard_normal((*lead, T, T)) * scale) + given.causal_mask(T, torch.float64)
    return torch.softmax(scores, dim=-1).numpy().astype(dtype)  # (PyTorch's softmax: no answer written here)


def known_heads(period, dtype="float32"):
    """(4, T, T): a perfect induction head, a previous-token head, a duplicate-token head and a
    uniform causal head, for ``period`` tokens repeated twice; and their scores (4,). For
    period >= 3 (with period 2 the token after the earlier copy is the previous token)."""
    T = 2 * period
    i = np.arange(T)
    first = i < period  # the first copy has no earlier occurrence: those rows look at themselves
    keys = (np.where(first, i, i - period + 1), (i - 1).clip(min=0), np.where(first, i, i - period))
    heads = [np.eye(T)[k] for k in keys]  # one-hot rows: each query on one key
    heads.append(np.tril(np.ones((T, T))) / (i + 1)[:, None])
    scores = np.array([1.0, 0.0, 0.0, (1.0 / (i[period:] + 1)).mean()])
    return np.stack(heads).astype(dtype), scores.astype(dtype)


def _label(weights, period):
    return f"for {weights.dtype} weights of shape {weights.shape}, period={period}"


def _case(tags, weights, period, label=""):
    return case(label or _label(weights, period), tags, weights=weights, period=int(period))


def _visible() -> tuple:
    g = np.random.default_rng(31)
    cases = [_case(("worked", "printed"), worked_example(dt)[1].numpy(), 3,
                   f"for the worked example ({str(dt).replace('torch.', '')}, T = 6, period=3)")
             for dt in (torch.float32, torch.float64)]
    cases += [_case("shapes", causal_weights(g, lead, 2 * p, dt), p)
              for lead, p, dt in (((), 4, "float32"), ((3,), 5, "float32"), ((2, 2), 3, "float32"))]
    cases += [_case("random", causal_weights(g, lead, 2 * p, dt), p)
              for lead, p, dt in (((2, 3), 5, "float32"), ((), 8, "float64"))]
    cases.append(_case("heads", known_heads(6)[0], 6, "for the four known heads, period=6"))
    return tuple(cases)


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases: the worked example and fresh weights of its size, the old hidden tier's
    leading dimensions and periods (1, 2, 16, 24; float64) and fresh ones."""
    r = lambda lo, hi: int(rng.integers(lo, hi))  # noqa: E731
    cases = [_case(("worked", "printed"), worked_example(dt)[1].numpy(), 3) for dt in (torch.float32, torch.float64)]
    cases += [_case("worked", causal_weights(rng, (), 6, dt), 3) for dt in ("float32", "float64")]
    cases += [_case("shapes", causal_weights(rng, lead, 2 * p, dt), p) for lead, p, dt in (
        ((), 4, "float32"), ((3,), 5, "float32"), ((2, 2), 3, "float32"), ((1, 2, 3), r(4, 9), "float32"),
        ((2, 1, 1, 2), 4, "float64"), ((5,), 2, "float64"), ((2, 3), r(10, 17), "float32"),
        ((r(1, 5), 2), r(3, 7), "float64"))]
    cases += [_case("random", causal_weights(rng, lead, 2 * p, dt), p) for lead, p, dt in (
        ((2, 3), 5, "float32"), ((), r(6, 11), "float64"), ((4,), 1, "float32"), ((2,), 2, "float64"),
        ((2, 2), r(12, 21), "float32"), ((1, 3), 24, "float64"), ((3, 1, 2), r(4, 9), "float32"),
        ((r(1, 4), r(1, 5)), r(3, 13), "float64"))]
    for p, dt in ((3, "float64"), (r(4, 9), "float32"), (10, "float64"), (r(9, 25), "float64"), (24, "float32")):
        cases.append(_case("heads", known_heads(p, dt)[0], p, f"for four heads of known score, period={p}, {dt}"))
    return cases


_call = call_runner(("weights", "period"), outputs=("score",))


def adapter(fn, case):
    """induction_score(weights, period), and the weights as they are after the call; a Python
    number or list returned is reported as such (the contract asks for a tensor)."""
    res = _call(fn, case)
    score = res.get("score")
    if isinstance(score, (float, int, list)) and not isinstance(score, bool):
        kind = "float" if isinstance(score, float) else type(score).__name__
        raise AssertionError(f"returned a Python {kind}. Return a tensor of shape weights.shape[:-2] (one score per "
                             "leading index): leave out .item(), float() and .tolist().")
    return res


EXERCISE = Exercise(
    name="induction_heads",
    piece="induction_score",
    call="induction_score(weights, period)",
    adapter=adapter,
    reference="firstprinciples.reference:induction_score",
    visible=_visible(),
    secret=secret,
    tests={
        "test_worked_example": Test(2, frozenset({"worked"}), first=(structure, another_period),
                                    then=(printed_score,)),
        "test_shapes": Test(2, frozenset({"shapes"}), first=(structure,), values=False),
        "test_random": Test(3, frozenset({"random"}), first=(structure, another_period)),
        "test_known_heads": Test(2, frozenset({"heads"}), first=(structure, known_head_scores)),
    },
    forbidden=dict(pieces=("induction_score",), what="the induction score"),
    mistakes=MISTAKES,
)
