"""alibi_bias(n_heads, T, dtype=torch.float32): the exercise's tests, declared once.

-> (n_heads, T, T): bias[h, i, j] = -m_h * (i - j) for j <= i and 0 for j > i, with the slopes
m_h = 2^(-8 (h + 1) / n_heads), h = 0 .. n_heads - 1 (heads counted from 0, the steepest first).

Decisions stated once:

- **Exact zeros.** On and above the diagonal every entry must be exactly 0 (-0.0 counts as 0):
  the causal mask, added to the bias, hides the future, and a -inf or NaN in the bias would turn
  0 + -inf into -inf (harmless) but -inf + inf or NaN into NaN.
- **dtype.** float32 and float64 are graded (the default and dtype=torch.float64); half precision
  is not: in float16 the product m_h (i - j) rounds differently depending on the order of the
  operations, by more than any tolerance that would still be a test.
- The contract's slope rule holds for any n_heads; the ALiBi paper uses another one when n_heads
  is not a power of two (the slopes of the power of two below, then every other slope of the one
  above). An answer with the paper's rule fails for 3, 5, 6 and 12 heads with a message naming it.
- The reference is computed in float64 and rounded once to the dtype asked for.
- The course's ``alibi_bias`` and its helper ``alibi_slopes`` are forbidden: an answer that calls
  them scores 0 in every test.
- The test "in attention" judges the attention weights that the answer's bias gives (with the
  causal mask, on the case's queries and keys), computed here in float64 from the returned bias:
  the student's runner only builds the bias. As before, an upper triangle of -inf passes it (the
  mask hides those keys anyway) and fails the upper-triangle test.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import given
from ..examples.alibi import paper_slopes
from . import Exercise, Mistake, Test, case

WORKED_SLOPES = (0.25, 0.0625, 0.015625, 0.00390625)  # 4 heads: 1/4, 1/16, 1/64, 1/256
WORKED_LAST_ROW = (-1.0, -0.75, -0.5, -0.25, 0.0)  # head 0, query 4, for T = 5
LONGER = "bias for a longer T"  # the result of the same call with a larger T (the "corner" cases)

# ---------------------------------------------------------------- typical mistakes


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


ALL = frozenset({"test_worked_example", "test_shapes", "test_slopes", "test_upper_triangle",
                 "test_against_definition", "test_in_attention"})
VALUES = ALL - {"test_shapes", "test_upper_triangle"}  # the tests that read the slopes
MISTAKES = (
    Mistake("slopes 2^(-8h/n_heads)",
            "heads are counted from 0 but the exponent uses h + 1: m_h = 2^(-8 (h + 1) / n_heads), so head 0 "
            "has slope 2^(-8/n_heads) (1/4 for 4 heads), not 1.", _variant(rule="from 0"), VALUES),
    Mistake("no factor 8",
            "the exponent is -8 (h + 1) / n_heads: the slopes run from 2^(-8/n_heads) down to 2^(-8) = 1/256.",
            _variant(rule="no 8"), VALUES),
    Mistake("slopes in reverse order",
            "head 0 has the steepest slope, 2^(-8/n_heads), and the last head the gentlest, 2^(-8).",
            _variant(rule="reversed"), VALUES),
    # (the notebook's attention cases have 4 heads, where the paper's rule is the contract's)
    Mistake("the paper's rule for n_heads not a power of two",
            "the ALiBi paper picks other slopes when n_heads is not a power of two; the course's contract "
            "uses m_h = 2^(-8 (h + 1) / n_heads) for every n_heads.", _variant(rule="paper"),
            frozenset({"test_slopes", "test_against_definition"}), frozenset({"test_in_attention"})),
    Mistake("sign flipped",
            "the bias is a penalty: -m_h * (i - j), negative below the diagonal, so far keys score lower.",
            _variant(sign=1.0), VALUES),
    Mistake("j - i instead of i - j",
            "query i looks back at key j <= i, at distance i - j >= 0: the bias is -m_h * (i - j) below the "
            "diagonal and 0 above it.", _variant(distance="j - i"), ALL - {"test_shapes"}),
    Mistake("|i - j| in the upper triangle",
            "above the diagonal (j > i) the bias is 0: the causal mask hides those keys, and the contract "
            "wants exact zeros there, not -m_h * |i - j|.", _variant(distance="abs"),
            frozenset({"test_worked_example", "test_upper_triangle", "test_against_definition"})),
    Mistake("queries and keys swapped",
            "the first T index is the query i, the second the key j: the nonzero entries are below the "
            "diagonal, bias[h, i, j] = -m_h * (i - j) for j < i.", _variant(distance="swapped"), ALL - {"test_shapes"}),
    Mistake("-inf in the upper triangle",
            "leave the upper triangle at 0: hiding the future is the causal mask's job, added separately.",
            _variant(upper=float("-inf")),
            frozenset({"test_worked_example", "test_upper_triangle", "test_against_definition"})),
    Mistake("heads last, (T, T, n_heads)",
            "put the head first: shape (n_heads, T, T), so that bias[h] is head h's (T, T) table and it "
            "broadcasts against scores of shape (B, n_heads, T, T).", _variant(layout="heads last"), ALL),
    Mistake("a batch dimension added, (1, n_heads, T, T)",
            "return (n_heads, T, T): attention broadcasts it against scores of shape (B, n_heads, T, T) by itself.",
            _variant(layout="batch"), ALL),
    Mistake("one table for all heads, (T, T)",
            "every head has its own slope: return all n_heads tables, shape (n_heads, T, T), not head 0's alone.",
            _variant(layout="one head"), ALL),
    Mistake("dtype ignored",
            "build the result in the dtype argument (torch.arange(..., dtype=dtype), or .to(dtype) at the end).",
            _variant(cast=False), frozenset({"test_shapes", "test_against_definition"}),
            frozenset({"test_slopes", "test_upper_triangle", "test_in_attention"})),  # (float64 cases there are secret)
)

# ---------------------------------------------------------------- properties (plain data)


def _bias(case, out):
    """The answer's bias as a NumPy array when it has the contract's shape, else None (the
    comparison, or ``structure``, says what is wrong)."""
    got = out.get("bias")
    n, T = int(case["n_heads"]), int(case["T"])
    return got if isinstance(got, np.ndarray) and got.shape == (n, T, T) else None


def _shown(case) -> bool:
    """Whether a message may show values computed from the case (not for the re-check's secret cases)."""
    return "secret" not in case["tags"]


def _fmt(values) -> str:
    return ", ".join(f"{float(v):.6g}" for v in values)


def structure(case, out, want):
    """Shape (n_heads, T, T) and the dtype asked for (float32 by default), with a hint for the
    layouts that students reach for: heads last, one table, a batch dimension."""
    got = out.get("bias")
    if not isinstance(got, np.ndarray):
        return None  # not an array: the comparison names the type
    n, T = int(case["n_heads"]), int(case["T"])
    dtype = case["dtype"] or "float32"
    if got.shape != (n, T, T):
        hint = ""
        if got.shape == (T, T, n) and T != n:
            hint = " The head comes first: bias[h] is head h's (T, T) table (use .permute(2, 0, 1), or build it so)."
        elif got.shape == (T, T):
            hint = " Each head has its own slope and its own (T, T) table: stack all n_heads of them."
        elif got.shape == (1, n, T, T):
            hint = " Leave out the leading 1: attention broadcasts (n_heads, T, T) over the batch."
        return f"the bias has shape {got.shape} but should have shape {(n, T, T)}.{hint}"
    if got.dtype.name != dtype:
        how = (" (the default of the dtype argument)." if not case["dtype"] else
               ": build it in the dtype argument, or .to(dtype) at the end.")
        return f"the bias has dtype torch.{got.dtype.name} but should have dtype torch.{dtype}{how}"
    return None


def worked_row_and_slopes(case, out, want):
    """The chapter's figures: with 4 heads the slopes (minus bias[h, 1, 0]) are 1/4, 1/16, 1/64 and
    1/256, and head 0's last row for T = 5 is (-1, -0.75, -0.5, -0.25, 0), within 1e-6."""
    got = _bias(case, out)
    if "printed" not in case["tags"] or got is None:
        return None
    row = got[0, -1].astype(np.float64)
    if np.abs(row - WORKED_LAST_ROW).max() > 1e-6:
        return f"head 0's last row should be (-1, -0.75, -0.5, -0.25, 0), got ({_fmt(row)})."
    slopes = -got[:, 1, 0].astype(np.float64)
    if np.abs(slopes - WORKED_SLOPES).max() > 1e-6 * max(WORKED_SLOPES):
        return f"the slopes (minus bias[h, 1, 0]) should be (0.25, 0.0625, 0.015625, 0.00390625), got ({_fmt(slopes)})."
    return None


def slopes_of_the_contract(case, out, want):
    """-bias[h, 1, 0] is m_h = 2^(-8 (h + 1) / n_heads), within the comparison's tolerance (the
    slopes depend on n_heads only, shown in every case's label: nothing secret is printed)."""
    got = _bias(case, out)
    if got is None or int(case["T"]) < 2:
        return None
    slopes, right = -got[:, 1, 0].astype(np.float64), -want["bias"][:, 1, 0].astype(np.float64)
    atol, rtol = TOLERANCE[got.dtype.name]
    if np.all(np.abs(slopes - right) <= atol + rtol * np.abs(right)):
        return None
    more = ", ..." if len(slopes) > 8 else ""
    return (f"the slopes (minus bias[h, 1, 0]) are ({_fmt(slopes[:8])}{more}) but should be ({_fmt(right[:8])}{more}): "
            "m_h = 2^(-8 (h + 1) / n_heads) for h = 0 .. n_heads - 1.")


def zeros_on_and_above_the_diagonal(case, out, want):
    """Every entry with j >= i is exactly 0: no -inf, no NaN, no -m_h * |i - j| (-0.0 counts as 0)."""
    got = _bias(case, out)
    if got is None:
        return None
    T = got.shape[-1]
    bad = np.triu(np.ones((T, T), dtype=bool))[None] & ~(got == 0)
    if not bad.any():
        return None
    h, i, j = (int(v) for v in np.argwhere(bad)[0])
    where = "on the diagonal" if i == j else "above the diagonal"
    return (f"bias[{h}, {i}, {j}] = {float(got[h, i, j])!r} {where}; every entry with j >= i must be exactly 0 "
            f"({int(bad.sum())} entries are not).")


def all_zeros_for_one_position(case, out, want):
    """T = 1: a query attends only to itself, at distance 0, so the bias is all zeros."""
    got = _bias(case, out)
    if got is None or int(case["T"]) != 1 or bool((got == 0).all()):
        return None
    return (f"the bias should be all zeros for T=1 (a query attends only to itself, at distance 0), got "
            f"{got.flatten().tolist()}.")


def a_corner_of_the_longer_bias(case, out, want):
    """The bias for T is the top-left corner of the bias for a longer T, exactly: it depends on
    i - j only, so a longer sequence only adds rows and columns."""
    got, longer = _bias(case, out), out.get(LONGER)
    if got is None or not isinstance(longer, np.ndarray) or longer.ndim != 3:
        return None
    T = got.shape[-1]
    if longer.shape[-1] >= T and np.array_equal(longer[:, :T, :T], got):
        return None
    return (f"the bias for T={T} is not the top-left corner of the one for T={int(case['longer'])}: the bias "
            "depends on i - j only, so a longer sequence only adds rows and columns.")


def _attention_weights(Q, K, bias):
    """softmax(Q K^T / sqrt(d_k) + causal mask + bias) over the keys, in float64: (B, n_heads, T, T)."""
    T = bias.shape[-1]
    Q, K = (torch.from_numpy(np.asarray(t, dtype=np.float64)) for t in (Q, K))
    mask = given.causal_mask(T, torch.float64) + torch.from_numpy(np.asarray(bias, dtype=np.float64))
    return given.attention(Q, K, K, mask)[1].numpy()  # (PyTorch's own attention: no answer written here)


def weights_in_attention(case, out, want):
    """With the causal mask, the attention weights of the case's queries and keys with the answer's
    bias are those with the ALiBi bias, within 1e-5 + 1e-4 |w| (a bias within its tolerance moves
    them by less than 1e-6)."""
    got = _bias(case, out)
    if got is None:
        return None
    w_got = _attention_weights(case["Q"], case["K"], got)
    w_want = _attention_weights(case["Q"], case["K"], want["bias"])
    err = np.nan_to_num(np.abs(w_got - w_want), nan=np.inf)
    if np.all(err <= 1e-5 + 1e-4 * np.abs(w_want)):
        return None
    b, h, i, j = (int(v) for v in np.argwhere(err == err.max())[0])
    if not np.any(case["Q"]) and not np.any(case["K"]):  # zero scores: the bias alone
        return (f"with zero scores, head {h}'s query {i} should spread its weight over keys 0..{i}, more on the nearer "
                f"ones, but puts {[round(float(w), 3) for w in w_got[b, h, i, :i + 1]]} on them: the bias is "
                "-m_h * (i - j), negative for far keys.")
    if _shown(case):
        what = f"puts weight {float(w_got[b, h, i, j]):.6g} on key {j}, but {float(w_want[b, h, i, j]):.6g} with the ALiBi bias"
    else:
        what = f"puts a weight on key {j} that is off by {float(err.max()):.3g} from the ALiBi bias's"
    return (f"with your bias added to the scores and the causal mask, head {h}'s query {i} {what}. The bias penalises "
            "a key by m_h times its distance i - j: nearer keys lose less.")


# float32: the slopes are powers of two when n_heads divides 8 and the products are then exact;
# otherwise a slope computed in float32 (2 ** x, torch.exp2, torch.logspace, exp of a log) is off
# by at most about 1 unit in the last place (1.2e-7 relative) and its product with an integer
# distance by one more, so a correct float32 answer is within 3e-7 relative of the float64 value
# rounded once. float64: an answer that computes in float32 and casts the result to float64 is
# correct by the contract (it fixes the formula, not how the slopes are computed) and is within
# 3e-7; one computed in float64 is within 1e-15. Every named mistake of value moves some entry by
# more than 9% (the smallest: slopes off by one head with 64 heads, a factor 2^(1/8)).
TOLERANCE = {"float32": (1e-6, 1e-6), "float64": (1e-12, 1e-6)}


def tolerance(case, key):
    """float32 atol 1e-6, rtol 1e-6; float64 atol 1e-12, rtol 1e-6: see ``TOLERANCE``."""
    return TOLERANCE


# ---------------------------------------------------------------- the cases


def _case(label, tags, n_heads, T, dtype="", **more):
    label = label or f"for n_heads={n_heads}, T={T}" + (f", dtype={dtype}" if dtype else "")
    return case(label, tags, n_heads=int(n_heads), T=int(T), dtype=dtype, **more)


def _attention(label, tags, rng, n_heads, T, dtype="float32", B=2, d_k=8, zeros=False):
    shape = (B, n_heads, T, d_k)
    Q, K, V = (np.zeros(shape, dtype) if zeros else rng.standard_normal(shape).astype(dtype) for _ in range(3))
    return _case(label, tags, n_heads, T, dtype, Q=Q, K=K, V=V)


def _visible() -> tuple:
    g = np.random.default_rng(41)
    return (
        _case("for the worked example (n_heads=4, T=5)", ("worked", "printed"), 4, 5),
        *(_case("", "shapes", n, T, dt) for n, T, dt in ((4, 1, ""), (2, 7, ""), (3, 4, "float64"), (1, 3, "float32"))),
        *(_case("", "slopes", n, 3) for n in (1, 2, 4, 8, 3, 6)),
        _case("", "upper", 4, 6),
        *(_case("", "definition", n, T, dt) for n, T, dt in ((4, 32, ""), (3, 11, "float64"), (2, 9, "float32"))),
        _case("for n_heads=4, T=8 and T=24", "definition", 4, 8, longer=24),
        _attention("for n_heads=4, T=10, dtype=float32, queries and keys of shape (2, 4, 10, 8)", "attention",
                   g, 4, 10),
        _attention("for n_heads=4, T=5, with zero scores (the bias alone)", "attention",
                   g, 4, 5, B=1, d_k=2, zeros=True),
    )


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases: every visible situation, the old hidden tier's head counts and lengths
    (1 to 64 heads, T up to 128, float64 everywhere) and fresh head counts and lengths."""
    r = lambda lo, hi: int(rng.integers(lo, hi))  # noqa: E731
    tag = lambda t: (t, "secret")  # noqa: E731
    dt = lambda: ("", "float32", "float64")[r(0, 3)]  # noqa: E731
    fresh = [int(v) for v in rng.choice([5, 7, 9, 10, 11, 12, 24], size=3, replace=False)]
    cases = [_case("", ("worked", "printed", "secret"), 4, 5), _case("", tag("worked"), 4, r(6, 12)),
             _case("", tag("worked"), 4, r(2, 5))]  # (the default dtype: dtypes are the other tests')
    cases += [_case("", tag("shapes"), n, T, d) for n, T, d in (
        (4, 1, ""), (2, r(2, 9), ""), (3, 4, "float64"), (1, 3, "float32"), (8, 1, "float64"), (6, 2, ""),
        (16, 9, "float64"), (5, 12, "float32"), (r(5, 13), r(2, 12), dt()), (r(1, 9), 1, dt()))]
    cases += [_case("", tag("slopes"), n, T, d) for n, T, d in (
        (1, 3, ""), (2, 3, ""), (4, 3, ""), (8, 3, ""), (3, 3, ""), (6, 3, ""), (5, 3, "float64"), (12, 3, ""),
        (16, 3, "float64"), (64, 3, ""), (fresh[0], 3, ""), (fresh[1], r(2, 7), "float64"), (fresh[2], r(2, 7), ""))]
    cases += [_case("", tag("upper"), n, T, d) for n, T, d in (
        (4, 6, ""), (3, 17, "float64"), (8, 10, "float32"), (r(1, 13), r(2, 20), dt()))]
    cases += [_case("", tag("definition"), n, T, d) for n, T, d in (
        (4, 32, ""), (3, r(5, 16), "float64"), (2, 9, "float32"), (8, 128, ""), (12, 20, "float64"),
        (16, 40, "float32"), (1, 16, "float64"), (5, 33, ""), (r(9, 17), r(16, 48), "float64"),
        (r(1, 8), r(2, 24), dt()))]
    for n, T, d in ((4, r(4, 12), ""), (r(3, 9), r(4, 12), "float64")):
        longer = T + r(1, 20)
        cases.append(_case(f"for n_heads={n}, T={T} and T={longer}" + (f", dtype={d}" if d else ""), tag("definition"),
                           n, T, d, longer=longer))
    for n, T, d in ((4, 10, "float32"), (3, 16, "float32"), (8, 12, "float64"), (3, r(8, 20), "float32"),
                    (r(5, 13), r(4, 24), "float64")):
        cases.append(_attention(f"for n_heads={n}, T={T}, dtype={d}, fresh queries and keys", tag("attention"), rng,
                                n, T, d))
    cases.append(_attention("for n_heads=6, T=7, with zero scores (the bias alone)", tag("attention"), rng, 6, 7,
                            B=1, d_k=2, zeros=True))
    return cases


def adapter(fn, case):
    """alibi_bias(n_heads, T) (dtype left at its default when the case has none), and for the
    "corner" cases the same call with a longer T."""
    import torch

    kwargs = {"dtype": getattr(torch, case["dtype"])} if case.get("dtype") else {}
    res = {"bias": fn(int(case["n_heads"]), int(case["T"]), **kwargs)}
    if case.get("longer"):
        res[LONGER] = fn(int(case["n_heads"]), int(case["longer"]), **kwargs)
    return res


EXERCISE = Exercise(
    name="alibi",
    piece="alibi_bias",
    call="alibi_bias(n_heads, T)",
    adapter=adapter,
    reference="firstprinciples.reference:alibi_bias",
    names={"bias": "bias", LONGER: "the bias for the longer T"},
    visible=_visible(),
    secret=secret,
    tests={
        "test_worked_example": Test(2, frozenset({"worked"}), first=(structure, worked_row_and_slopes)),
        "test_shapes": Test(1, frozenset({"shapes"}), first=(structure,), then=(all_zeros_for_one_position,),
                            values=False),
        "test_slopes": Test(2, frozenset({"slopes"}), first=(structure,), then=(slopes_of_the_contract,), values=False),
        "test_upper_triangle": Test(1, frozenset({"upper"}), first=(structure,),
                                    then=(zeros_on_and_above_the_diagonal,), values=False),
        "test_against_definition": Test(2, frozenset({"definition"}), first=(structure,),
                                        then=(a_corner_of_the_longer_bias,)),
        "test_in_attention": Test(2, frozenset({"attention"}), first=(structure,), then=(weights_in_attention,),
                                  values=False),
    },
    forbidden=dict(pieces=("alibi_bias", "alibi_slopes"), what="the ALiBi bias"),
    mistakes=MISTAKES,
    tolerance=tolerance,
)
