"""Checks for ``alibi_bias(n_heads, T, dtype=torch.float32)``.

-> (n_heads, T, T): bias[h, i, j] = -m_h * (i - j) for j <= i and 0 for j > i, with the slopes
m_h = 2^(-8 (h + 1) / n_heads), h = 0 .. n_heads - 1 (heads counted from 0, the steepest first).

Visible checks (the student runs them): the chapter's worked example (4 heads, T = 5: slopes
1/4, 1/16, 1/64, 1/256), shapes and dtypes, the slopes for several head counts, the upper
triangle, random sizes against the definition, and the bias inside the course's attention.
Hidden checks (``full=True``): more head counts (1, 3, 5, 6, 12, 16 and 64), longer sequences,
float64 everywhere.

Decisions stated once:

- **Tolerances.** float32: atol 1e-6, rtol 1e-6. The slopes are powers of two when n_heads
  divides 8 and the products are then exact; otherwise a slope computed in float32 (2 ** x,
  torch.exp2, torch.logspace, exp of a log) is off by at most about 1 unit in the last place
  (1.2e-7 relative) and its product with an integer distance by one more, so a correct float32
  answer is within 3e-7 relative of the float64 value rounded once. float64: atol 1e-12, rtol 1e-6:
  an answer that computes in float32 and casts the result to float64 is correct by the contract
  (it fixes the formula, not how the slopes are computed) and is within 3e-7; an answer computed in
  float64 is within 1e-15. Every named mistake of value moves some entry by more than 9% (the smallest:
  slopes off by one head with 64 heads, a factor 2^(1/8)), far outside both.
- **Exact zeros.** Above the diagonal every entry must be exactly 0 (-0.0 counts as 0), and the
  diagonal too: the causal mask, added to the bias, hides the future, and a -inf or NaN in the
  bias would turn 0 + -inf into -inf (harmless) but -inf + inf or NaN into NaN.
- **dtype.** float32 and float64 are graded (the default and dtype=torch.float64); half precision
  is not: in float16 the product m_h (i - j) rounds differently depending on the order of the
  operations, by more than any tolerance that would still be a test.
- The contract's slope rule holds for any n_heads; the ALiBi paper uses another one when n_heads
  is not a power of two (the slopes of the power of two below, then every other slope of the one
  above). An answer with the paper's rule fails for 3, 5, 6 and 12 heads with a message naming it.
- The course's reference ``alibi_bias`` (and its helper ``alibi_slopes``) are forbidden: an answer
  that calls them scores 0 in every test.
"""
from __future__ import annotations

import torch

from ..examples.alibi import paper_slopes
from ..reference import alibi_bias as reference
from ..reference import causal_mask, scaled_dot_product_attention
from ._core import Mistake, call_answer, fmt, with_diagnosis
from ._student import wrap_checks

FORBIDDEN = dict(pieces=("alibi_bias", "alibi_slopes"), what="the ALiBi bias")
TOLERANCES = {torch.float32: (1e-6, 1e-6), torch.float64: (1e-12, 1e-6)}
NAME = "alibi_bias(n_heads, T)"
WORKED = (4, 5)  # the chapter's example: 4 heads, 5 positions
WORKED_SLOPES = (0.25, 0.0625, 0.015625, 0.00390625)


# ---------------------------------------------------------------- mistakes
def _slopes(n_heads, rule):
    h = torch.arange(n_heads, dtype=torch.float64)
    if rule == "from 0":
        return torch.exp2(-8.0 * h / n_heads)
    if rule == "no 8":
        return torch.exp2(-(h + 1) / n_heads)
    if rule == "reversed":
        return torch.exp2(-8.0 * (h + 1) / n_heads).flip(0)
    if rule == "paper":
        return torch.tensor(paper_slopes(n_heads), dtype=torch.float64)
    return torch.exp2(-8.0 * (h + 1) / n_heads)


def alibi_bias_slopes(n_heads):
    """The contract's slopes in float64: m_h = 2^(-8 (h + 1) / n_heads)."""
    return _slopes(n_heads, "contract")


def _variant(rule="contract", distance="causal", upper=0.0, sign=-1.0, layout="heads first", cast=True):
    def alibi(n_heads, T, dtype=torch.float32):
        i = torch.arange(T, dtype=torch.float64)[:, None]
        j = torch.arange(T, dtype=torch.float64)[None, :]
        d = {"causal": (i - j).clamp(min=0), "abs": (i - j).abs(), "j - i": j - i,
             "swapped": (j - i).clamp(min=0)}[distance]
        bias = sign * _slopes(n_heads, rule)[:, None, None] * d  # (n_heads, T, T)
        if upper != 0.0:
            bias = bias.masked_fill(j > i, upper)
        if layout == "heads last":
            bias = bias.permute(1, 2, 0)  # (T, T, n_heads)
        elif layout == "batch":
            bias = bias[None]  # (1, n_heads, T, T)
        elif layout == "one head":
            bias = bias[0]  # (T, T)
        return (bias.to(dtype) if cast else bias.float()) + 0.0

    return alibi


MISTAKES = (
    Mistake("slopes 2^(-8h/n_heads)",
            "heads are counted from 0 but the exponent uses h + 1: m_h = 2^(-8 (h + 1) / n_heads), so head 0 "
            "has slope 2^(-8/n_heads) (1/4 for 4 heads), not 1.", _variant(rule="from 0")),
    Mistake("no factor 8",
            "the exponent is -8 (h + 1) / n_heads: the slopes run from 2^(-8/n_heads) down to 2^(-8) = 1/256.",
            _variant(rule="no 8")),
    Mistake("slopes in reverse order",
            "head 0 has the steepest slope, 2^(-8/n_heads), and the last head the gentlest, 2^(-8).",
            _variant(rule="reversed")),
    Mistake("the paper's rule for n_heads not a power of two",
            "the ALiBi paper picks other slopes when n_heads is not a power of two; the course's contract "
            "uses m_h = 2^(-8 (h + 1) / n_heads) for every n_heads.", _variant(rule="paper")),
    Mistake("sign flipped",
            "the bias is a penalty: -m_h * (i - j), negative below the diagonal, so far keys score lower.",
            _variant(sign=1.0)),
    Mistake("j - i instead of i - j",
            "query i looks back at key j <= i, at distance i - j >= 0: the bias is -m_h * (i - j) below the "
            "diagonal and 0 above it.", _variant(distance="j - i")),
    Mistake("|i - j| in the upper triangle",
            "above the diagonal (j > i) the bias is 0: the causal mask hides those keys, and the contract "
            "wants exact zeros there, not -m_h * |i - j|.", _variant(distance="abs")),
    Mistake("queries and keys swapped",
            "the first T index is the query i, the second the key j: the nonzero entries are below the "
            "diagonal, bias[h, i, j] = -m_h * (i - j) for j < i.", _variant(distance="swapped")),
    Mistake("-inf in the upper triangle",
            "leave the upper triangle at 0: hiding the future is the causal mask's job, added separately.",
            _variant(upper=float("-inf"))),
    Mistake("heads last, (T, T, n_heads)",
            "put the head first: shape (n_heads, T, T), so that bias[h] is head h's (T, T) table and it "
            "broadcasts against scores of shape (B, n_heads, T, T).", _variant(layout="heads last")),
    Mistake("a batch dimension added, (1, n_heads, T, T)",
            "return (n_heads, T, T): attention broadcasts it against scores of shape (B, n_heads, T, T) by itself.",
            _variant(layout="batch")),
    Mistake("one table for all heads, (T, T)",
            "every head has its own slope: return all n_heads tables, shape (n_heads, T, T), not head 0's alone.",
            _variant(layout="one head")),
    Mistake("dtype ignored",
            "build the result in the dtype argument (torch.arange(..., dtype=dtype), or .to(dtype) at the end).",
            _variant(cast=False)),
)


# ---------------------------------------------------------------- calling and comparing
def _dt(dtype):
    return str(dtype).replace("torch.", "")


def _label(n_heads, T, dtype):
    return f"for n_heads={n_heads}, T={T}" + (f", dtype={_dt(dtype)}" if dtype is not None else "")


def _call(fn, n_heads, T, dtype=None):
    """The answer's bias; dtype None: the argument left at its default."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    return call_answer(fn, (n_heads, T), kwargs, names=(NAME,), forbidden=FORBIDDEN)[0]


def expected(n_heads, T, dtype=torch.float32):
    """The reference, computed in float64 and rounded once to ``dtype``."""
    return reference.__wrapped__(n_heads, T, torch.float64).to(dtype)


def _assert_close(got, want, label):
    atol, rtol = TOLERANCES[want.dtype]
    g, e = got.detach().double(), want.double()
    if torch.isnan(g).any() or torch.isinf(g).any():
        idx = tuple(int(v) for v in (~torch.isfinite(g)).nonzero()[0])
        raise AssertionError(f"{NAME} {label} has a non-finite entry: bias{list(idx)} = {g[idx].item()} where "
                             f"{fmt(e[idx].item())} was expected.")
    err = (g - e).abs()
    excess = err - (atol + rtol * e.abs())
    if (excess > 0).any():
        idx = tuple(int(v) for v in (excess == excess.max()).nonzero()[0])
        h, i, j = idx
        raise AssertionError(
            f"{NAME} {label} is wrong: bias{list(idx)} = {fmt(g[idx].item())} but should be {fmt(e[idx].item())} "
            + (f"(head {h}, query {i}, key {j}: above the diagonal, where the bias is 0" if j > i else
               f"(head {h}, query {i}, key {j}: -m_{h} * ({i} - {j}) with m_{h} = {fmt(2 ** (-8 * (h + 1) / g.shape[0]))}")
            + f"; tolerance atol={atol:g}, rtol={rtol:g}). "
            f"Largest difference over all entries: {fmt(err.max().item())}.")


def _structure(got, n_heads, T, dtype, label):
    want = (n_heads, T, T)
    if tuple(got.shape) != want:
        hint = ""
        if tuple(got.shape) == (T, T, n_heads) and T != n_heads:
            hint = " The head comes first: bias[h] is head h's (T, T) table (use .permute(2, 0, 1), or build it so)."
        elif tuple(got.shape) == (T, T):
            hint = " Each head has its own slope and its own (T, T) table: stack all n_heads of them."
        elif tuple(got.shape) == (1, n_heads, T, T):
            hint = " Leave out the leading 1: attention broadcasts (n_heads, T, T) over the batch."
        raise AssertionError(f"{NAME} {label} has shape {tuple(got.shape)} but should have shape {want}.{hint}")
    if got.dtype != dtype:
        raise AssertionError(f"{NAME} {label} has dtype {got.dtype} but should have dtype {dtype}"
                             + (" (the default of the dtype argument)." if dtype == torch.float32 and "dtype="
                                not in label else ": build it in the dtype argument, or .to(dtype) at the end."))


def _compare(fn, n_heads, T, dtype=None, label=None):
    got = _call(fn, n_heads, T, dtype)
    want_dtype = torch.float32 if dtype is None else dtype
    label = label or _label(n_heads, T, dtype)
    want = expected(n_heads, T, want_dtype)
    kwargs = {} if dtype is None else {"dtype": dtype}

    def check():
        _structure(got, n_heads, T, want_dtype, label)
        _assert_close(got, want, label)

    with_diagnosis(check, (got,), (n_heads, T), MISTAKES, reference.__wrapped__, kwargs)
    return got


# ---------------------------------------------------------------- visible
def check_worked_example(fn):
    """The chapter's example: 4 heads and 5 positions. The slopes are 1/4, 1/16, 1/64 and 1/256, so
    head 0's last row is (-1, -0.75, -0.5, -0.25, 0), and above the diagonal every entry is 0."""
    n_heads, T = WORKED
    got = _compare(fn, n_heads, T, label="for the worked example (n_heads=4, T=5)")
    row = [round(v, 4) for v in got[0, 4].tolist()]
    assert row == [-1.0, -0.75, -0.5, -0.25, 0.0], f"head 0's last row should be (-1, -0.75, -0.5, -0.25, 0), got {row}"
    slopes = [-got[h, 1, 0].item() for h in range(n_heads)]
    assert slopes == list(WORKED_SLOPES), f"the slopes (minus bias[h, 1, 0]) should be {WORKED_SLOPES}, got {slopes}"


def check_shapes(fn, full=True):
    """A tensor of shape (n_heads, T, T) in the dtype asked for: float32 by default, float64 with
    dtype=torch.float64; T = 1 gives zeros of shape (n_heads, 1, 1) (at grading more sizes)."""
    cases = [(4, 1, None), (2, 7, None), (3, 4, torch.float64), (1, 3, torch.float32)]
    if full:
        cases += [(8, 1, torch.float64), (6, 2, None), (16, 9, torch.float64), (5, 12, torch.float32)]
    for n_heads, T, dtype in cases:
        got = _call(fn, n_heads, T, dtype)
        want = torch.float32 if dtype is None else dtype
        _structure(got, n_heads, T, want, _label(n_heads, T, dtype))
        if T == 1 and not bool((got == 0).all()):
            raise AssertionError(f"{NAME} {_label(n_heads, T, dtype)} should be all zeros (a query attends only to "
                                 f"itself, at distance 0), got {got.flatten().tolist()}.")


def check_slopes(fn, full=True):
    """The slope of head h, minus bias[h, i, i - 1], is 2^(-8 (h + 1) / n_heads), for 1, 2, 4 and 8 heads
    and for 3 and 6 (not powers of two: the contract's rule, not the ALiBi paper's), at grading also
    5, 12, 16 and 64 heads and float64."""
    cases = [(1, None), (2, None), (4, None), (8, None), (3, None), (6, None)]
    if full:
        cases += [(5, torch.float64), (12, None), (16, torch.float64), (64, None)]
    for n_heads, dtype in cases:
        got = _call(fn, n_heads, 3, dtype)
        want_dtype = torch.float32 if dtype is None else dtype
        label = _label(n_heads, 3, dtype)
        _structure(got, n_heads, 3, want_dtype, label)
        slopes = -got[:, 1, 0].double()
        want = torch.exp2(-8.0 * torch.arange(1, n_heads + 1, dtype=torch.float64) / n_heads)
        atol, rtol = TOLERANCES[want_dtype]
        if not torch.allclose(slopes, want, atol=atol, rtol=rtol):
            found = diagnose_slopes(slopes, n_heads)
            shown = ", ".join(fmt(v) for v in slopes[:8].tolist()) + (", ..." if n_heads > 8 else "")
            right = ", ".join(fmt(v) for v in want[:8].tolist()) + (", ..." if n_heads > 8 else "")
            hint = "".join(f"\n  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"The slopes of {NAME} {label} (minus bias[h, 1, 0]) are ({shown}) but should be "
                                 f"({right}): m_h = 2^(-8 (h + 1) / n_heads) for h = 0 .. n_heads - 1."
                                 + (f"\nYour output matches a typical mistake:{hint}" if hint else ""))


def diagnose_slopes(slopes, n_heads):
    """The slope mistakes whose slopes equal ``slopes`` (float64, (n_heads,))."""
    right = _slopes(n_heads, "contract")
    found = []
    for m, rule in zip(MISTAKES[:4], ("from 0", "no 8", "reversed", "paper")):
        theirs = _slopes(n_heads, rule)
        if torch.allclose(slopes, theirs, rtol=1e-6, atol=0) and not torch.allclose(theirs, right, rtol=1e-6, atol=0):
            found.append(m)
    return found


def check_upper_triangle(fn, full=True):
    """Above the diagonal (key j after query i) and on it, every entry is exactly 0: no -inf, no
    NaN, no -m_h * |i - j| (the causal mask hides the future; the bias does not). 4 heads, T = 6
    (at grading also 3 heads, T = 17, float64)."""
    cases = [(4, 6, None)]
    if full:
        cases += [(3, 17, torch.float64), (8, 10, torch.float32)]
    for n_heads, T, dtype in cases:
        got = _call(fn, n_heads, T, dtype)
        label = _label(n_heads, T, dtype)
        _structure(got, n_heads, T, torch.float32 if dtype is None else dtype, label)
        upper = torch.ones(T, T, dtype=torch.bool).triu(0).expand(n_heads, T, T)  # the diagonal included
        bad = upper & ~(got == 0)
        if bad.any():
            h, i, j = (int(v) for v in bad.nonzero()[0])
            where = "on the diagonal" if i == j else "above the diagonal"
            found = [m for m in MISTAKES if _same_upper(m.fn(n_heads, T), got)]
            hint = "".join(f"\n  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(
                f"{NAME} {label} has bias[{h}, {i}, {j}] = {got[h, i, j].item()} {where}; every entry with j >= i "
                f"must be exactly 0 ({int(bad.sum())} entries are not)." +
                (f"\nYour output matches a typical mistake:{hint}" if hint else ""))


def _same_upper(theirs, got):
    if theirs.shape != got.shape:
        return False
    T = got.shape[-1]
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    a, b = theirs[..., upper].double(), got[..., upper].double()
    return bool(torch.equal(a.isinf(), b.isinf()) and torch.allclose(a.nan_to_num(0, 0, 0), b.nan_to_num(0, 0, 0)))


def check_against_definition(fn, full=True):
    """Every entry against the definition, for 4 heads and T = 32 and 3 heads and T = 11, and with
    dtype=torch.float64 (at grading also T = 128 with 8 heads, 12 and 16 heads, 1 head). Also: the bias
    for T is the top-left corner of the bias for a longer T (it depends on i - j only)."""
    cases = [(4, 32, None), (3, 11, torch.float64), (2, 9, torch.float32)]
    if full:
        cases += [(8, 128, None), (12, 20, torch.float64), (16, 40, torch.float32), (1, 16, torch.float64),
                  (5, 33, None)]
    for n_heads, T, dtype in cases:
        _compare(fn, n_heads, T, dtype)
    short, long = _call(fn, 4, 8), _call(fn, 4, 24)
    if tuple(long.shape) == (4, 24, 24) and tuple(short.shape) == (4, 8, 8) and not torch.equal(long[:, :8, :8], short):
        raise AssertionError(f"{NAME} for T=8 is not the top-left corner of the one for T=24: the bias depends on "
                             "i - j only, so a longer sequence only adds rows and columns.")


def check_in_attention(fn, full=True):
    """Inside attention: with the causal mask added, softmax(Q K^T / sqrt(d_k) + mask + bias) gives the
    course's attention weights with the ALiBi bias, for queries and keys of shape (2, n_heads, T, 8)
    (4 heads, T = 10; at grading also 3 heads, T = 16, and float64). Zero scores then show the bias
    alone: query i spreads its weight over keys 0..i, more on the nearer ones."""
    cases = [(4, 10, torch.float32)]
    if full:
        cases += [(3, 16, torch.float32), (8, 12, torch.float64)]
    g = torch.Generator().manual_seed(41)
    for n_heads, T, dtype in cases:
        got = _call(fn, n_heads, T, dtype)
        label = _label(n_heads, T, dtype)
        _structure(got, n_heads, T, dtype, label)
        Q, K, V = (torch.randn(2, n_heads, T, 8, generator=g, dtype=dtype) for _ in range(3))
        mask = causal_mask(T, dtype)  # (T, T)
        w_got = scaled_dot_product_attention(Q, K, V, mask + got)[1]  # (2, n_heads, T, T)
        w_want = scaled_dot_product_attention(Q, K, V, mask + expected(n_heads, T, dtype))[1]
        if not torch.allclose(w_got.double(), w_want.double(), atol=1e-5, rtol=1e-4, equal_nan=False):
            err = (w_got.double() - w_want.double()).abs().nan_to_num(nan=float("inf"))
            b, h, i, j = (int(v) for v in (err == err.max()).nonzero()[0])
            raise AssertionError(
                f"With your bias added to the scores and the causal mask {label}, head {h}'s query {i} puts weight "
                f"{fmt(w_got[b, h, i, j].item())} on key {j}, but {fmt(w_want[b, h, i, j].item())} with the ALiBi "
                "bias. The bias penalises a key by m_h times its distance i - j: nearer keys lose less.")
    zeros = torch.zeros(1, 4, 5, 2)
    w = scaled_dot_product_attention(zeros, zeros, zeros, causal_mask(5) + _call(fn, 4, 5))[1][0, 0]
    if not bool((w[4, 1:] > w[4, :-1]).all()):
        raise AssertionError(f"With zero scores, head 0's last query should put more weight on nearer keys, got "
                             f"{[round(v, 3) for v in w[4].tolist()]}: the bias is -m_h * (i - j), negative for far keys.")


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
