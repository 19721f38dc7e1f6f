"""Checks for ``softmax(x, dim=-1)``.

Visible checks (the student runs them): the worked example, large inputs,
``-inf`` entries, several ``dim`` on a 3-D input, gradients. Hidden checks
(added at grading, ``full=True``): the same on more seeded inputs, shapes and
both float dtypes, against ``torch.softmax`` and the reference.

Every check runs the answer under ``call_without`` so that an answer which
calls any of PyTorch's softmaxes (their names contain "softmax"; softmin is a
softmax of ``-x``) or the course's reference scores 0.

Decisions stated once:

- ``-inf`` entries must get weight exactly 0, and a row whose only finite entry
  is ``x_j`` must give weight exactly 1 to ``j``. An answer that first replaces
  ``-inf`` by a very negative finite number is accepted when ``exp`` of it
  underflows to exactly 0 (-1e9 does, in float32 and float64); one that leaves
  a tiny weight (-100 gives e^-100 ~ 4e-44) is not.
- A row that is entirely ``-inf`` has no valid answer (torch returns NaN);
  it is never tested.
"""
from __future__ import annotations

import math

import torch

from .. import examples
from ..guard import ForbiddenCall
from ..reference import softmax as reference
from ._student import describe, wrap_checks
from ._core import Mistake, assert_matches, call_answer, exact, fmt, tolerance, with_diagnosis

FORBIDDEN = dict(
    torch_patterns=("softmax", "softmin"),
    pieces=("softmax",),
    what="the softmax",
)


# ---------------------------------------------------------------- mistakes
def _no_max(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def _global_max(x, dim=-1):
    e = torch.exp(x - x.max())  # one max for the whole tensor
    return e / e.sum(dim=dim, keepdim=True)


def _mean_shift(x, dim=-1):
    e = torch.exp(x - x.mean(dim=dim, keepdim=True))
    return e / e.sum(dim=dim, keepdim=True)


def _dim_ignored(x, dim=-1):
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def _sum_wrong_dim(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)  # the max follows dim, the sum does not


def _sum_whole_tensor(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / e.sum()


def _keepdim_forgotten(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim))  # (..., ) broadcasts against the wrong axis
    return e / e.sum(dim=dim)


def _no_exp_in_denominator(x, dim=-1):
    shifted = x - x.amax(dim=dim, keepdim=True)
    return torch.exp(shifted) / shifted.sum(dim=dim, keepdim=True)


MISTAKES = (
    Mistake(
        "no max subtracted",
        "exp() of an entry above about 89 (float32) or 710 (float64) is inf, and inf/inf is NaN. "
        "Subtract each slice's max along dim before exp: the result is the same, and exp never exceeds 1.",
        _no_max,
    ),
    Mistake(
        "max over the whole tensor",
        "x.max() without dim takes one max for the whole tensor; a row far below it underflows "
        "to exp() = 0 everywhere and gives 0/0. Take the max along dim: x.amax(dim=dim, keepdim=True).",
        _global_max,
    ),
    Mistake(
        "shifted by the mean, not the max",
        "any shift leaves the softmax unchanged on paper, but only the max guarantees that no shifted "
        "entry is above 0, so that exp() cannot overflow.",
        _mean_shift,
    ),
    Mistake(
        "dim ignored",
        "the max and the sum always run along the last axis; use the `dim` argument for both.",
        _dim_ignored,
    ),
    Mistake(
        "sum over the wrong dim",
        "the sum must run along `dim`, the same axis as the max, so that each slice along dim sums to 1.",
        _sum_wrong_dim,
    ),
    Mistake(
        "sum over the whole tensor",
        "e.sum() without dim adds up every entry; sum along dim (with keepdim=True) so that each slice sums to 1.",
        _sum_whole_tensor,
    ),
    Mistake(
        "keepdim forgotten",
        "a max or sum along dim drops that axis, and the result then broadcasts against the wrong axis; "
        "pass keepdim=True.",
        _keepdim_forgotten,
    ),
    Mistake(
        "exp missing in the denominator",
        "divide exp(x - max) by the sum of the same exponentials, not by the sum of the shifted scores.",
        _no_exp_in_denominator,
    ),
)


# ---------------------------------------------------------------- helpers
def _label(x, dim=None):
    d = "" if dim is None else f", dim={dim}"
    return f"for x of shape {tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}{d}"


def _run(fn, x, dim=None):
    """Call the answer on a copy of x (``dim`` omitted when None: the default)."""
    kwargs = {} if dim is None else {"dim": dim}
    try:
        return call_answer(fn, (x,), kwargs, names=("softmax(x)",), forbidden=FORBIDDEN)[0]
    except (AssertionError, NotImplementedError):
        raise
    except (RuntimeError, TypeError, IndexError) as err:
        text = str(err)
        hint = ""
        if "must match the size" in text or "shape" in text and "broadcast" in text:
            hint = (" A size mismatch usually means that a max or a sum along dim lost that axis: "
                    "pass keepdim=True so that it broadcasts back along dim.")
        elif "return_types" in text:
            hint = " x.max(dim=...) returns (values, indices): use x.amax(dim=...) or x.max(dim=...).values."
        elif "unexpected keyword argument 'dim'" in text:
            hint = " The contract is softmax(x, dim=-1): the second argument must be called dim."
        raise AssertionError(f"softmax {_label(x, dim)} {describe(err)}{hint}") from None


def rounding_slack(x) -> float:
    """How far a correct softmax may stray from the reference because of the size of x.

    In exact arithmetic ``exp(x - logsumexp(x))`` is the softmax, and it is a textbook way
    to write it. In floating point it rounds ``x - logsumexp(x)``, a difference of two
    numbers of size max|x|, to a unit in the last place of max|x|: every weight moves by up
    to that amount, relatively (the max-subtracted form forms ``x - max`` exactly and does
    not). For float32 entries near 1000 that is about 6e-5, close to the default rtol of
    1e-4, so such a correct answer failed the gradient test about once in eight random
    inputs. The slack is one unit of the dtype times max|x| (1.2e-4 near 1000 in float32,
    2e-13 in float64); the worst measured error of correct forms (logsumexp, a hand-written
    log-sum-exp, log-softmax then exp) is 0.35 of it on 3000 random inputs. It is added to
    rtol for the weights and, times max|u|, to atol for the gradient of sum(u * softmax(x)).
    Every typical mistake moves values by more than 1e-3."""
    finite = x.detach()[torch.isfinite(x.detach())]
    return torch.finfo(x.dtype).eps * float(finite.abs().max()) if finite.numel() else 0.0


def _compare(fn, x, dim=None, *, label=""):
    """Compare with the reference and torch.softmax; name the mistake on failure."""
    got = _run(fn, x, dim)
    d = -1 if dim is None else dim
    want = reference(x, dim=d)
    kwargs = {} if dim is None else {"dim": dim}
    label = label or _label(x, dim)

    rtol = tolerance(x.dtype)[1] + rounding_slack(x)

    def check():
        assert_matches("softmax(x)", got, want, context=label, rtol=rtol)
        assert_matches("softmax(x)", got, torch.softmax(x, dim=d), context=label + " (against torch.softmax)", rtol=rtol)

    with_diagnosis(check, (got,), (x,), MISTAKES, reference, kwargs)
    return got


def _exact_at_minus_inf(got, x, dim, label):
    """-inf entries get exactly 0; slices with a single finite entry give it exactly 1."""
    g = got.detach()
    masked = torch.isneginf(x)
    if masked.any():
        bad = masked & (g != 0)
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(
                f"softmax(x){list(idx)} = {exact(g[idx].item())} {label} where x{list(idx)} = -inf; it must be exactly 0 "
                "(exp(-inf) = 0). If you replaced -inf by a finite number, exp() of it is not 0: "
                "keep -inf as it is (subtracting a finite max leaves it -inf)."
            )
    single = (~masked).sum(dim=dim, keepdim=True) == 1  # slices with one finite entry
    lone = single.expand_as(masked) & ~masked
    if lone.any():
        bad = lone & (g != 1)
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            raise AssertionError(
                f"softmax(x){list(idx)} = {exact(g[idx].item())} {label}, but x{list(idx)} is the only finite entry "
                f"of its slice along dim={dim}: its weight must be exactly 1 (yours is off by "
                f"{exact(1 - g[idx].item())}). A small number added to the sum (an epsilon) moves it; "
                "the max-subtracted sum is at least 1, so it never needs one."
            )


def _random(g, shape, dtype, scale=1.0):
    return scale * torch.randn(*shape, generator=g, dtype=dtype)


# ---------------------------------------------------------------- visible
def check_worked_example(fn):
    """Cat's scaled scores [0.778, 0.707, 0.424] give the weights [0.380, 0.354, 0.267];
    then the 3 x 3 scaled scores of all three queries, one softmax per row."""
    raw = torch.tensor(examples.RAW_SCORES, dtype=torch.float64)
    x = raw / math.sqrt(2)  # Cat's scaled scores, (3,)
    got = _run(fn, x)
    if tuple(got.shape) != (3,):
        raise AssertionError(f"softmax of a vector of 3 scores should have shape (3,), got {tuple(got.shape)}.")

    def check():
        # The book prints each weight rounded to three decimals (0.2666 is printed
        # 0.267), so a correct answer is within 1e-3 of every printed figure; the
        # exact check follows.
        for j, tok in enumerate(examples.TOKENS):
            value, printed = got[j].item(), examples.WEIGHTS[j]
            assert abs(value - printed) <= 1e-3, (
                f"Cat's weight on '{tok}' is {value:.4f} but should be about {printed:.3f} "
                f"(the softmax of the scaled scores {examples.SCALED_SCORES})."
            )
        assert_matches("softmax(x)", got, reference(x), context="for Cat's scaled scores")

    with_diagnosis(check, (got,), (x,), MISTAKES, reference)

    Q, K, _ = examples.cat_sat_mat(torch.float64, all_queries=True)
    scores = Q @ K.T / math.sqrt(2)  # (3, 3): one row per query
    got = _compare(fn, scores, label="for the (3, 3) scaled scores of Cat, sat and mat (one softmax per row)")
    worst = (got.detach().sum(-1) - 1).abs().max().item()
    assert worst <= 1e-12, f"each row of the (3, 3) result should sum to 1; one is off by {fmt(worst)}."


def check_large_inputs(fn, full=True):
    """Entries of 1000 and more, in float32 and float64: no overflow, no 0/0.

    The visible part is one (3, 3) input per dtype whose rows are [1000, 1001, 1002]
    (exp overflows), [0, 1, 2] (far below the first row) and [-1000, 0, 1000]
    (a wide row). ``full`` adds seeded rows around +-1000 (float32) and up to
    +-10000 (float64), and dims 0 and 2 of a 3-D input.
    """
    rows = [[1000.0, 1001.0, 1002.0], [0.0, 1.0, 2.0], [-1000.0, 0.0, 1000.0]]
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor(rows, dtype=dtype)
        _compare(fn, x, label=_label(x) + " with rows [1000, 1001, 1002], [0, 1, 2], [-1000, 0, 1000]")
    if not full:
        return
    g = torch.Generator().manual_seed(31)
    # Near 1e4 a float32 is only known to 1e-3, and a correct answer that computes
    # x - logsumexp(x) (rather than x - max) loses that much: float32 stays within +-1000.
    spread = {torch.float32: (-1000.0, -500.0, 0.0, 500.0, 1000.0), torch.float64: (-1e4, -1000.0, 0.0, 1000.0, 1e4)}
    for dtype in (torch.float32, torch.float64):
        offsets = torch.tensor(spread[dtype], dtype=dtype)
        # Each row around its own offset: rows far above and far below the others.
        x = _random(g, (5, 7), dtype, 3.0) + offsets[:, None]
        _compare(fn, x, label=_label(x) + f", rows around {', '.join(f'{o:g}' for o in spread[dtype])}")
        # The same along dim 0 and dim 1 of a 3-D input.
        x = _random(g, (4, 5, 3), dtype, 3.0) + offsets[None, :, None]
        for dim in (0, 2):
            _compare(fn, x, dim)
        # One huge entry per row among ordinary ones: the row spans more than 1000.
        x = _random(g, (2, 3, 6), dtype)
        x[..., 2] = 1500.0
        _compare(fn, x, -1, label=_label(x, -1) + ", one entry of 1500 per row")


def check_minus_inf(fn, full=True):
    """-inf entries get exactly 0; a row whose only finite entry is x_j gives it exactly 1."""
    inf = float("-inf")
    x = torch.tensor([[0.0, inf, inf], [2.0, 1.0, inf], [1000.0, inf, 999.0]], dtype=torch.float64)
    label = _label(x) + " with rows [0, -inf, -inf], [2, 1, -inf], [1000, -inf, 999]"
    got = _compare(fn, x, label=label)
    _exact_at_minus_inf(got, x, -1, label)
    if not full:
        return
    g = torch.Generator().manual_seed(47)
    for dtype in (torch.float32, torch.float64):
        for shape, dim in (((6, 5), -1), ((3, 4, 5), 0), ((3, 4, 5), 1), ((3, 4, 5), -1), ((2, 3, 4, 5), 2)):
            x = _random(g, shape, dtype, 2.0)
            hide = torch.rand(shape, generator=g) < 0.5
            # Keep one finite entry per slice along dim; make some slices have exactly one.
            keep = torch.randint(0, shape[dim], [s for i, s in enumerate(shape) if i != dim % len(shape)], generator=g)
            hide.scatter_(dim % len(shape), keep.unsqueeze(dim % len(shape)), False)
            lone = torch.rand(keep.shape, generator=g) < 0.3
            only = torch.ones(shape, dtype=torch.bool).scatter_(dim % len(shape), keep.unsqueeze(dim % len(shape)), False)
            hide = torch.where(lone.unsqueeze(dim % len(shape)), only, hide)
            for offset in (0.0, 1000.0):
                xi = (x + offset).masked_fill(hide, inf)
                label = _label(xi, dim) + (", entries around 1000" if offset else "") + ", random -inf entries"
                got = _compare(fn, xi, dim, label=label)
                _exact_at_minus_inf(got, xi, dim, label)


def _sums_to_one_along(t):
    """The dims along which every slice of t sums to 1 (to 1e-5)."""
    t = t.detach().to(torch.float64)
    return [d for d in range(t.dim()) if bool(((t.sum(d) - 1).abs() <= 1e-5).all())]


def check_dims(fn, full=True):
    """A 3-D input along dim 0, 1, 2 and -1 (visible: float32); at grading more shapes and dims, float64."""
    g = torch.Generator().manual_seed(5)
    cases = [((2, 3, 4), dim, torch.float32) for dim in (0, 1, -1)]
    if full:
        cases += [((5,), 0, torch.float64), ((5,), -1, torch.float32)]
        for dtype in (torch.float32, torch.float64):
            cases += [((3, 4), d, dtype) for d in (0, 1, -2)]
            cases += [((2, 3, 4), d, dtype) for d in (0, 1, 2, -1, -2, -3)]
            cases += [((2, 3, 4, 5), d, dtype) for d in (0, 1, 2, 3, -1)]
    for shape, dim, dtype in cases:
        x = _random(g, shape, dtype, 2.0)
        got = _run(fn, x, dim)
        label = _label(x, dim)
        if tuple(got.shape) != tuple(x.shape):
            raise AssertionError(f"softmax(x) {label} has shape {tuple(got.shape)}; it should keep x's shape.")
        along = _sums_to_one_along(got)
        if dim % x.dim() not in along:
            where = f"; it sums to 1 along dim {along[0]} instead" if along else ""
            raise AssertionError(
                f"softmax(x) {label}: each slice along dim={dim} should sum to 1, but they do not{where}."
                + _diagnosis_lines(got, x, dim)
            )
        _compare(fn, x, dim, label=label)


def _diagnosis_lines(got, x, dim):
    from ._core import diagnose

    found = diagnose((got,), (x,), MISTAKES, reference, {"dim": dim})
    if not found:
        return ""
    return "\nYour output matches a typical mistake:\n" + "\n".join(f"  - {m.label}: {m.hint}" for m in found)


def check_gradients_and_inputs(fn, full=True):
    """Gradients reach x and equal those of torch.softmax; x is left untouched.

    Checks the values first (gradients can only agree once they do); then, for a
    seeded upstream gradient u, compares d(sum(u * softmax(x)))/dx with the same
    for torch.softmax. Visible: one float64 case along dim=-1. ``full`` adds
    dims 0 and 1 of a 3-D input, float32, -inf entries and entries around 1000.
    """
    g = torch.Generator().manual_seed(13)
    cases = [((3, 5), -1, torch.float64, 0.0, False)]
    if full:
        for dtype in (torch.float32, torch.float64):
            cases += [((2, 3, 4), 0, dtype, 0.0, False), ((2, 3, 4), 1, dtype, 0.0, False)]
            cases += [((4, 6), -1, dtype, 1000.0, False), ((4, 6), -1, dtype, 0.0, True)]
    for shape, dim, dtype, offset, with_inf in cases:
        x = _random(g, shape, dtype) + offset
        if with_inf:
            x[..., 1::2] = float("-inf")  # every other column hidden; column 0 stays finite
        u = torch.randn(*shape, generator=g, dtype=dtype)
        label = _label(x, dim) + (", entries around 1000" if offset else "") + (", with -inf entries" if with_inf else "")
        # The values first (and x left untouched): gradients can only match once they do.
        _compare(fn, x, dim, label=label)
        leaf = x.clone().requires_grad_(True)
        try:
            out = call_answer(fn, (leaf,), {"dim": dim}, names=("softmax(x)",), forbidden=FORBIDDEN)[0]
        except ForbiddenCall:
            raise
        except RuntimeError as err:
            raise AssertionError(
                f"softmax {label} failed on an input that requires grad: {err}. "
                "Do not modify x in place (x -= ..., x.sub_(...), x[...] = ...)."
            ) from err
        if not out.requires_grad:
            raise AssertionError(
                "The output does not require grad although x does: gradients cannot flow back. "
                "Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() "
                "inside the function."
            )
        try:
            (grad,) = torch.autograd.grad((out * u).sum(), leaf, allow_unused=True)
        except RuntimeError as err:
            raise AssertionError(
                f"The backward pass through your softmax failed {label}: {err}. An in-place operation "
                "(e /= s, e.div_(s), e[...] = ...) on a tensor that autograd still needs breaks it: "
                "write e = e / s instead."
            ) from err
        if grad is None:
            raise AssertionError("No gradient reaches x: is x used in the computation?")
        leaf_t = x.clone().requires_grad_(True)
        (want,) = torch.autograd.grad((torch.softmax(leaf_t, dim=dim) * u).sum(), leaf_t)
        atol = tolerance(x.dtype)[0] + rounding_slack(x) * float(u.abs().max())
        assert_matches("the gradient with respect to x", grad, want, context=label + " (against torch.softmax's)",
                       atol=atol)


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
