"""softmax(x, dim=-1): the exercise's tests, declared once.

Decisions stated once:

- ``-inf`` entries must get weight exactly 0, and a slice whose only finite entry is ``x_j`` must
  give weight exactly 1 to ``j``. An answer that first replaces ``-inf`` by a very negative finite
  number is accepted when exp of it underflows to exactly 0 (-1e9 does, in float32 and float64);
  one that leaves a tiny weight (-100 gives e^-100 ~ 4e-44) is not.
- A slice that is entirely ``-inf`` has no valid answer (torch returns NaN): never tested.
- Every case runs the answer with no softmax of PyTorch's within reach (their names contain
  "softmax"; softmin is a softmax of ``-x``) nor the course's own.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import examples
from . import Exercise, Mistake, Test, case, rounding_slack
from .adapters import call_runner

# ---------------------------------------------------------------- typical mistakes


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


ALL = frozenset({"test_worked_example", "test_large_inputs", "test_minus_inf", "test_dims",
                 "test_gradients_and_inputs"})
MISTAKES = (
    Mistake("no max subtracted",
            "exp() of an entry above about 89 (float32) or 710 (float64) is inf, and inf/inf is NaN. Subtract each "
            "slice's max along dim before exp: the result is the same, and exp never exceeds 1.",
            _no_max, frozenset({"test_large_inputs", "test_minus_inf"}), frozenset({"test_gradients_and_inputs"})),
    Mistake("max over the whole tensor",
            "x.max() without dim takes one max for the whole tensor; a row far below it underflows to exp() = 0 "
            "everywhere and gives 0/0. Take the max along dim: x.amax(dim=dim, keepdim=True).",
            _global_max, frozenset({"test_large_inputs", "test_minus_inf"})),
    Mistake("shifted by the mean, not the max",
            "any shift leaves the softmax unchanged on paper, but only the max guarantees that no shifted entry is "
            "above 0, so that exp() cannot overflow.",
            _mean_shift, frozenset({"test_large_inputs", "test_minus_inf"}), frozenset({"test_gradients_and_inputs"})),
    Mistake("dim ignored", "the max and the sum always run along the last axis; use the `dim` argument for both.",
            _dim_ignored, frozenset({"test_dims"}), frozenset({"test_large_inputs", "test_minus_inf", "test_gradients_and_inputs"})),
    Mistake("sum over the wrong dim",
            "the sum must run along `dim`, the same axis as the max, so that each slice along dim sums to 1.",
            _sum_wrong_dim, frozenset({"test_dims"}), frozenset({"test_large_inputs", "test_minus_inf", "test_gradients_and_inputs"})),
    Mistake("sum over the whole tensor",
            "e.sum() without dim adds up every entry; sum along dim (with keepdim=True) so that each slice sums to 1.",
            _sum_whole_tensor, ALL),
    Mistake("keepdim forgotten",
            "a max or sum along dim drops that axis, and the result then broadcasts against the wrong axis; pass "
            "keepdim=True.",
            _keepdim_forgotten, ALL),
    Mistake("exp missing in the denominator",
            "divide exp(x - max) by the sum of the same exponentials, not by the sum of the shifted scores.",
            _no_exp_in_denominator, ALL),
)

# ---------------------------------------------------------------- properties (plain data)


def printed_weights(case, out, want):
    """Cat's weights are the book's printed figures, each rounded to three decimals: a correct
    answer is within 1e-3 of every one (0.2666 is printed 0.267)."""
    if "printed" not in case["tags"]:
        return None
    got = out["output"]
    if got.shape != (3,):
        return f"the softmax of a vector of 3 scores should have shape (3,), got {got.shape}."
    for j, token in enumerate(examples.TOKENS):
        if abs(float(got[j]) - examples.WEIGHTS[j]) > 1e-3:
            return (f"Cat's weight on '{token}' is {float(got[j]):.4f} but should be about {examples.WEIGHTS[j]:.3f} "
                    f"(the softmax of the scaled scores {examples.SCALED_SCORES}).")
    return None


def float64_sums_to_one(case, out, want):
    """In float64 each slice sums to 1 within 1e-12: a correct softmax is within a few 1e-16; an
    epsilon added to the sum "to be safe" is not."""
    got = out["output"]
    if got.dtype != np.float64 or not got.size:
        return None
    worst = float(np.abs(got.sum(case.get("dim", -1)) - 1).max())
    return None if worst <= 1e-12 else f"each slice should sum to 1 in float64 (within 1e-12); one is off by {worst:.6g}."


def exact_at_minus_inf(case, out, want):
    """-inf entries get exactly 0 (exp(-inf) = 0); a slice's only finite entry gets exactly 1."""
    x, got, dim = case["x"], out["output"], case.get("dim", -1)
    masked = np.isneginf(x)
    bad = masked & (got != 0)
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        return (f"softmax(x){idx} = {float(got[tuple(idx)])!r} where x{idx} = -inf; it must be exactly 0 "
                "(exp(-inf) = 0). If you replaced -inf by a finite number, exp() of it is not 0: keep -inf as it is "
                "(subtracting a finite max leaves it -inf).")
    lone = np.broadcast_to((~masked).sum(axis=dim, keepdims=True) == 1, x.shape) & ~masked
    bad = lone & (got != 1)
    if bad.any():
        idx = [int(i) for i in np.argwhere(bad)[0]]
        value = float(got[tuple(idx)])
        return (f"softmax(x){idx} = {value!r}, but x{idx} is the only finite entry of its slice along dim={dim}: "
                f"its weight must be exactly 1 (yours is off by {1 - value!r}). A small number added to the sum (an "
                "epsilon) moves it; the max-subtracted sum is at least 1, so it never needs one.")
    return None


def sums_to_one_along_dim(case, out, want):
    """The shape is x's, and each slice along ``dim`` (not another axis) sums to 1 (to 1e-5)."""
    x, got, dim = case["x"], out["output"], case.get("dim", -1)
    if got.shape != x.shape:
        return f"the result has shape {got.shape}; it should keep x's shape {x.shape}."
    along = [d for d in range(got.ndim) if np.all(np.abs(got.astype(np.float64).sum(d) - 1) <= 1e-5)]
    if dim % x.ndim in along:
        return None
    where = f"; it sums to 1 along dim {along[0]} instead" if along else ""
    return f"each slice along dim={dim} should sum to 1, but they do not{where}."


def tolerance(case, key):
    """A correct softmax written as exp(x - logsumexp(x)) rounds x - logsumexp(x), a difference of
    two numbers of size max|x|, to a unit of max|x|: every weight may move by that much, relatively
    (the max-subtracted form does not). For float32 entries near 1000 that is 6e-5, close to the
    default rtol of 1e-4, so such a correct answer failed about once in eight inputs. The slack,
    one unit of the dtype times max|x| (1.2e-4 near 1000 in float32), is added to rtol for the
    weights and, times max|u|, to atol for the gradient of sum(u * softmax(x)); the worst measured
    error of correct forms (logsumexp, a hand-written log-sum-exp, log-softmax then exp) is 0.35 of
    it over 3000 random inputs, and every named mistake moves values by more than 1e-3."""
    x = np.asarray(case["x"])
    dtype = x.dtype.name
    from . import tolerance as default

    atol, rtol = default(dtype)
    slack = rounding_slack(x)
    if key == "output":
        return {dtype: (atol, rtol + slack)}
    if key == "grad_x":
        return {dtype: (atol + slack * float(np.abs(case["grad_out"]).max()), rtol)}
    return None


# ---------------------------------------------------------------- the cases
def _rows(rows, dtype):
    return np.array(rows, dtype=dtype)


def _visible() -> tuple:
    cat = np.array(examples.RAW_SCORES, dtype=np.float64) / math.sqrt(2)
    q, k, _ = (m.numpy() for m in examples.cat_sat_mat(torch.float64, all_queries=True))
    inf = -np.inf
    big = [[1000.0, 1001.0, 1002.0], [0.0, 1.0, 2.0], [-1000.0, 0.0, 1000.0]]
    g = np.random.default_rng(5)
    cases = [
        case("for Cat's scaled scores", ("worked", "printed"), x=cat),
        case("for the (3, 3) scaled scores of Cat, sat and mat (one softmax per row)", "worked",
             x=q @ k.T / math.sqrt(2)),
        *(case(f"for x of shape (3, 3), {dt} with rows [1000, 1001, 1002], [0, 1, 2], [-1000, 0, 1000]", "large",
               x=_rows(big, dt)) for dt in ("float32", "float64")),
        case("for x of shape (3, 3), float64 with rows [0, -inf, -inf], [2, 1, -inf], [1000, -inf, 999]", "inf",
             x=_rows([[0.0, inf, inf], [2.0, 1.0, inf], [1000.0, inf, 999.0]], "float64")),
        *(case(f"for x of shape (2, 3, 4), float32, dim={d}", "dims", x=(2 * g.standard_normal((2, 3, 4))).astype("float32"),
               dim=d) for d in (0, 1, -1)),
        case("for x of shape (3, 5), float64, dim=-1, with an upstream gradient u", "grad",
             x=g.standard_normal((3, 5)), dim=-1, grad_out=g.standard_normal((3, 5))),
    ]
    return tuple(cases)


def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _with_minus_inf(rng, x, dim, lone=True):
    """-inf at random places, never a whole slice along ``dim``; with ``lone``, the first slice
    keeps a single finite entry (whose weight is exactly 1)."""
    x = np.moveaxis(x.copy(), dim, -1)
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[-1]
    hide = rng.random(flat.shape) < 0.4
    hide[np.arange(flat.shape[0]), rng.integers(0, n, size=flat.shape[0])] = False
    if lone:
        hide[0, :] = True
        hide[0, int(rng.integers(0, n))] = False
    flat[hide] = -np.inf
    return np.moveaxis(flat.reshape(x.shape), -1, dim)


def _label(x, dim, extra=""):
    return f"for a {x.dtype} input of shape {x.shape} along dim {dim}{extra}"


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases, drawn in the grader: every test's visible situations and more sizes,
    dims, dtypes and magnitudes."""
    cases = [case(_label(x, -1), "worked", x=x, dim=-1)
             for x in (_normal(rng, (3,), "float64"), _normal(rng, (3, 3), "float64"))]
    for i in range(8):  # 1-D to 4-D, any dim, both dtypes
        dtype = "float64" if i % 2 else "float32"
        ndim = 1 + i % 4
        shape = tuple(int(s) for s in rng.integers(2, 6, size=ndim))
        dim = int(rng.integers(-ndim, ndim))
        x = _normal(rng, shape, dtype, 3.0)
        cases.append(case(_label(x, dim), "dims", x=x, dim=dim))
    # rows far above and below each other, as far as each dtype can hold them exactly enough:
    # near 1e4 a float32 is only known to 1e-3, so float32 stays within +-1000
    for dtype, spread in (("float32", 1000.0), ("float64", 1e4)):
        offsets = np.linspace(-spread, spread, 5).astype(dtype)
        x = _normal(rng, (5, 7), dtype, 3.0) + offsets[:, None]
        cases.append(case(_label(x, -1, f", rows around {', '.join(f'{o:g}' for o in offsets)}"), "large", x=x, dim=-1))
        x = _normal(rng, (4, 5, 3), dtype, 3.0) + offsets[None, :, None]
        cases += [case(_label(x, d, ", slices far apart"), "large", x=x, dim=d) for d in (0, 2)]
        x = _normal(rng, (2, 3, 6), dtype)
        x[..., int(rng.integers(0, 6))] = 1500.0
        cases.append(case(_label(x, -1, ", one entry of 1500 per row"), "large", x=x, dim=-1))
    for dtype in ("float32", "float64"):
        for shape, dim in (((6, 5), -1), ((3, 4, 5), 0), ((3, 4, 5), 1), ((2, 3, 4, 5), 2)):
            for offset in (0.0, 1000.0):
                x = _with_minus_inf(rng, _normal(rng, shape, dtype, 2.0) + np.asarray(offset, dtype), dim)
                cases.append(case(_label(x, dim, ", random -inf entries" + (", entries around 1000" if offset else "")),
                                  "inf", x=x, dim=dim))
        # rows far apart, as the notebook's case: one max for the whole tensor leaves a row all 0/0
        x = _with_minus_inf(rng, _normal(rng, (4, 5), dtype) + np.array([[0.0], [1000.0], [-1000.0], [500.0]], dtype), -1)
        cases.append(case(_label(x, -1, ", random -inf entries, rows around 0, 1000, -1000 and 500"), "inf", x=x, dim=-1))
    for dtype, shape, dim, offset, inf in (("float64", (4, 6), -1, 0.0, False), ("float32", (2, 3, 4), 0, 0.0, False),
                                           ("float64", (2, 3, 4), 1, 0.0, False), ("float32", (4, 6), -1, 1000.0, False),
                                           ("float64", (4, 6), -1, 1000.0, False), ("float64", (4, 6), 1, 0.0, True),
                                           ("float32", (4, 6), 0, 0.0, True)):
        x = _normal(rng, shape, dtype) + np.asarray(offset, dtype)
        if inf:
            x = _with_minus_inf(rng, x, dim, lone=False)
        extra = (", entries around 1000" if offset else "") + (", -inf entries" if inf else "") + ", with an upstream gradient"
        cases.append(case(_label(x, dim, extra), "grad", x=x, dim=dim, grad_out=_normal(rng, shape, dtype)))
    return cases


EXERCISE = Exercise(
    name="softmax",
    piece="softmax",
    call="softmax(x)",
    adapter=call_runner(("x",), ("dim",), grad=("x",)),
    reference="firstprinciples.reference:softmax",
    names={"output": "softmax(x)", "grad_x": "the gradient of sum(u * softmax(x)) with respect to x"},
    visible=_visible(),
    secret=secret,
    tests={
        "test_worked_example": Test(2, frozenset({"worked"}), first=(printed_weights,), then=(float64_sums_to_one,)),
        "test_large_inputs": Test(2, frozenset({"large"})),
        "test_minus_inf": Test(2, frozenset({"inf"}), then=(exact_at_minus_inf,)),
        "test_dims": Test(2, frozenset({"dims"}), first=(sums_to_one_along_dim,)),
        "test_gradients_and_inputs": Test(2, frozenset({"grad"})),
    },
    forbidden=dict(torch_patterns=("softmax", "softmin"), pieces=("softmax",), what="the softmax"),
    mistakes=MISTAKES,
    tolerance=tolerance,
    hints=(
        ("must match the size", "A size mismatch usually means that a max or a sum along dim lost that axis: pass "
                                "keepdim=True so that it broadcasts back along dim."),
        ("return_types", "x.max(dim=...) returns (values, indices): use x.amax(dim=...) or x.max(dim=...).values."),
        ("unexpected keyword argument 'dim'", "The contract is softmax(x, dim=-1): the second argument must be called dim."),
        ("modified by an inplace operation", "An in-place operation (e /= s, e.div_(s), e[...] = ...) on a tensor that "
                                             "autograd still needs breaks the backward pass: write e = e / s instead."),
    ),
)
