"""sinusoidal_encoding(max_len, d_model) and apply_rope(x, base=10000.0): the exercise's tests, declared once.

- ``sinusoidal_encoding(max_len, d_model) -> table``: the (max_len, d_model) float32 table with sin at
  even columns 2i and cos at odd columns 2i + 1 of pos * 10000^(-2i/d_model), positions 0..max_len-1,
  d_model even;
- ``apply_rope(x, base=10000.0) -> rotated``: x (..., T, d), d even; each interleaved pair
  (x[..., 2i], x[..., 2i+1]) at position p (0..T-1) rotated by the angle p * base^(-2i/d).

Decisions stated once:

- PyTorch has no built-in for either piece, so nothing of PyTorch's is forbidden; an answer that calls
  the course's ``sinusoidal_encoding`` or ``apply_rope`` (for either piece) scores 0.
- The expected table is the reference's, computed in float64 and rounded once to float32: the most
  accurate float32 table there is (``tolerance`` says how far a correct float32 route may be).
- RoPE's relative-position test judges a property of the answer alone (position 0 unchanged, lengths
  kept, scores that depend only on m - n), not values: an answer that is a rotation by the wrong
  angles per pair (halves, the wrong direction) keeps it and loses the tests that compare values.
- The gradient test judges the answer's gradients against its own outputs (``adapters.runner``'s
  gradient mode and ``adapters.honest_gradients``).
- A float64 input must give a result accurate to float64: an answer right only to float32 precision
  (positions or frequencies built in float32) fails, with a hint.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import examples
from . import Exercise, Mistake, Test, case
from .adapters import grad_case, honest_gradients, runner

# ================================================================ sinusoidal_encoding: mistakes


def _table(max_len, d_model, *, sin_even=True, pair_exp=2.0, first_pos=0, sign=-1.0, column_exp=False, halves=False):
    """A sinusoidal table with switchable mistakes (float64 maths, float32 result)."""
    pos = torch.arange(first_pos, first_pos + max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    i = torch.arange(d_model // 2, dtype=torch.float64)  # pair index, (d_model/2,)
    freq = 10000.0 ** (sign * pair_exp * i / d_model)
    even, odd = torch.sin(pos * freq), torch.cos(pos * freq)  # (max_len, d_model/2) each
    if column_exp:  # odd column 2i+1 uses its own index in the exponent
        odd = torch.cos(pos * 10000.0 ** (sign * (2 * i + 1) / d_model))
    if not sin_even:
        even, odd = odd, even
    if halves:
        table = torch.cat((even, odd), dim=-1)
    else:
        table = torch.stack((even, odd), dim=-1).flatten(-2)  # interleave: (max_len, d_model)
    return table.to(torch.float32)


def _sin_cos_swapped(max_len, d_model):
    return _table(max_len, d_model, sin_even=False)


def _pair_index_exponent(max_len, d_model):
    return _table(max_len, d_model, pair_exp=1.0)


def _positions_from_one(max_len, d_model):
    return _table(max_len, d_model, first_pos=1)


def _positive_exponent(max_len, d_model):
    return _table(max_len, d_model, sign=1.0)


def _column_index_exponent(max_len, d_model):
    return _table(max_len, d_model, column_exp=True)


def _sin_cos_halves(max_len, d_model):
    return _table(max_len, d_model, halves=True)


TABLE_ALL = frozenset({"test_sinusoidal_example", "test_sinusoidal_tables"})
TABLE_MISTAKES = (
    Mistake("sin and cos swapped", "sin goes in the even columns (0, 2, 4, ...) and cos in the odd ones.",
            _sin_cos_swapped, TABLE_ALL),
    Mistake("frequencies 10000^(-i/d_model)",
            "the pair (2i, 2i+1) uses 10000^(-2i/d_model): the exponent is the even column index 2i, not i.",
            _pair_index_exponent, TABLE_ALL),
    Mistake("positions start at 1",
            "positions run 0, 1, ..., max_len - 1: row 0 is sin(0), cos(0), ... = 0, 1, 0, 1, ...",
            _positions_from_one, TABLE_ALL),
    Mistake("frequencies 10000^(+2i/d_model)",
            "the frequencies must fall with i: multiply pos by 10000^(-2i/d_model) (equivalently, divide by "
            "10000^(2i/d_model)).",
            _positive_exponent, TABLE_ALL),
    Mistake("cos columns use their own index",
            "both columns of a pair share one frequency: column 2i+1 uses 10000^(-2i/d_model), not "
            "10000^(-(2i+1)/d_model).",
            _column_index_exponent, TABLE_ALL),
    Mistake("sin and cos in two halves",
            "interleave them: sin in columns 0, 2, 4, ... and cos in columns 1, 3, 5, ..., not sin in the first half "
            "and cos in the second.",
            _sin_cos_halves, TABLE_ALL),
)

# ================================================================ sinusoidal_encoding: properties


def table_atol(max_len: int) -> float:
    """A table computed in float32 throughout (as the source's is) rounds both pos * freq and freq to
    about 6e-8 relative, so the angle at position p may be off by about 1.2e-7 p; sin and cos pass
    that error on. 1e-5 + 2e-7 max_len covers every correct float32 route (the source's own table
    at its default length, 4096, is off by up to 2.5e-4), and each named mistake moves some entry by
    more than 0.1."""
    return 1e-5 + 2e-7 * max_len


def table_tolerance(case, key):
    return {"float32": (table_atol(case["max_len"]), 0.0)} if key == "table" else None


def table_shape(case, out, want):
    """The table is (max_len, d_model), float32; a leading batch dimension or swapped axes are named."""
    max_len, d_model = case["max_len"], case["d_model"]
    got, shape = out.get("table"), (max_len, d_model)
    if got is None:
        return None  # (not an array: the comparison says what it is)
    if got.shape != shape:
        hint = ""
        if got.shape == (1, *shape):
            hint = " Drop the leading batch dimension (the source's module keeps one for broadcasting)."
        elif got.shape == shape[::-1]:
            hint = " Rows are positions and columns are dimensions: (max_len, d_model)."
        return f"the table has shape {got.shape} but should have shape {shape}.{hint}"
    if got.dtype != np.float32:
        return f"the table has dtype {got.dtype}; it should be float32."
    return None


def row_zero(case, out, want):
    """Row 0 (position 0) is [0, 1, 0, 1, ...]: every angle is 0."""
    if "printed" not in case["tags"]:
        return None
    row = [round(float(v), 6) for v in out["table"][0]]
    ok = [0.0, 1.0] * (case["d_model"] // 2)
    if any(abs(a - b) > 1e-6 for a, b in zip(row, ok)):
        return (f"row 0 (position 0) should be {ok}: every angle is 0, so sin gives 0 and cos gives 1. "
                f"Yours is {row}.")
    return None


def table_formula(case, out, want):
    """Against the expected table, the worst entry explained with its formula."""
    max_len, d_model = case["max_len"], case["d_model"]
    got, expected = out["table"].astype(np.float64), want["table"].astype(np.float64)
    err = np.nan_to_num(np.abs(got - expected), nan=np.inf)
    worst, atol = float(err.max()) if err.size else 0.0, table_atol(max_len)
    if worst <= atol:
        return None
    pos, col = (int(v) for v in np.argwhere(err == worst)[0])
    i, f = col // 2, "sin" if col % 2 == 0 else "cos"
    angle = pos * 10000.0 ** (-2 * i / d_model)
    return (f"table[{pos}, {col}] = {got[pos, col]:.6g} but should be {f}({pos} * 10000^(-{2 * i}/{d_model})) = "
            f"{f}({angle:.6g}) = {expected[pos, col]:.6g} (off by {worst:.6g}; tolerance {atol:.3g}). Column {col} is "
            f"the {'first' if col % 2 == 0 else 'second'} column of pair i = {i}.")


# ================================================================ apply_rope: mistakes


def _rope(x, base=10000.0, *, layout="interleaved", pair_exp=2.0, direction=1.0, first_pos=0,
          pos_axis=-2, fixed_base=None, sign_error=False):
    """Rotary embeddings with switchable mistakes, computed in x's dtype."""
    base = base if fixed_base is None else fixed_base
    T, d = x.shape[pos_axis], x.shape[-1]
    pos = torch.arange(first_pos, first_pos + T, dtype=x.dtype)
    freq = base ** (-pair_exp * torch.arange(d // 2, dtype=x.dtype) / d)  # (d/2,)
    angle = direction * pos[:, None] * freq  # (T, d/2)
    if pos_axis != -2:  # positions read along axis 0 and broadcast along it
        angle = angle.reshape(T, *([1] * (x.dim() - 2)), d // 2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    if layout == "halves":
        a, b = x[..., : d // 2], x[..., d // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    first = a * cos - b * sin
    second = b * cos - a * sin if sign_error else a * sin + b * cos
    if layout == "interleaved":
        return torch.stack((first, second), dim=-1).flatten(-2)
    return torch.cat((first, second), dim=-1)


def _halves(x, base=10000.0):
    return _rope(x, base, layout="halves")


def _not_reinterleaved(x, base=10000.0):
    return _rope(x, base, layout="concatenated")


def _wrong_direction(x, base=10000.0):
    return _rope(x, base, direction=-1.0)


def _base_ignored(x, base=10000.0):
    return _rope(x, base, fixed_base=10000.0)


def _positions_first_axis(x, base=10000.0):
    return _rope(x, base, pos_axis=0)


def _rope_pair_index_exponent(x, base=10000.0):
    return _rope(x, base, pair_exp=1.0)


def _rope_positions_from_one(x, base=10000.0):
    return _rope(x, base, first_pos=1)


def _sign_error(x, base=10000.0):
    return _rope(x, base, sign_error=True)


EXAMPLE, SHAPES, BASE, RELATIVE, GRADS = ("test_rope_example", "test_rope_shapes", "test_rope_base",
                                          "test_rope_relative_position", "test_rope_gradients_and_inputs")
VALUES = frozenset({EXAMPLE, SHAPES, BASE})
ROPE_MISTAKES = (
    Mistake("pairs taken as halves",
            "rotate the interleaved pairs (x[..., 2i], x[..., 2i+1]), i.e. x[..., 0::2] with x[..., 1::2], not the "
            "first half of the features with the second half.",
            _halves, VALUES),
    Mistake("rotated pairs not interleaved back",
            "after rotating x[..., 0::2] and x[..., 1::2], put the results back in the interleaved order (stack them "
            "on a new last axis and flatten), not one block after the other.",
            _not_reinterleaved, VALUES | {RELATIVE}),
    Mistake("rotation in the wrong direction",
            "rotate by +angle: x'[2i] = x[2i] cos - x[2i+1] sin and x'[2i+1] = x[2i] sin + x[2i+1] cos.",
            _wrong_direction, VALUES),
    # right with the default base: only the base test catches it
    Mistake("base ignored", "use the `base` argument in base^(-2i/d), not a hard-coded 10000.", _base_ignored,
            frozenset({BASE})),
    # right for (T, d) inputs: the notebook's relative-position case has no leading dimension, the
    # re-check's have some
    Mistake("positions along the wrong axis",
            "positions run along the second-to-last axis, x.shape[-2] (T), whatever the number of leading "
            "dimensions; x.shape[0] is the batch when there are leading dimensions.",
            _positions_first_axis, frozenset({SHAPES, BASE}), frozenset({RELATIVE})),
    Mistake("frequencies base^(-i/d)",
            "the pair (2i, 2i+1) turns at base^(-2i/d): the exponent is the even column index 2i, not i.",
            _rope_pair_index_exponent, VALUES),
    Mistake("positions start at 1", "positions run 0, 1, ..., T - 1: the first vector is not rotated at all.",
            _rope_positions_from_one, VALUES | {RELATIVE}),
    Mistake("not a rotation (sign error)",
            "the second component is x[2i] sin + x[2i+1] cos; with a minus sign the map is not a rotation and "
            "changes the lengths of the vectors.",
            _sign_error, VALUES | {RELATIVE}),
)

# ================================================================ apply_rope: properties and tolerance


def rope_tolerance(case, key):
    """A correct answer computes the angle p * theta_i in x's dtype: in float32 it is off by up to
    about 1.2e-7 p radians (theta_i and the product each rounded), so an entry of a pair of length r
    moves by up to that times r, 1.5e-5 for p = 31 and r = 4: more than the default atol. The slack,
    2.4e-7 (T - 1) times the largest pair length, is added to atol for float32 outputs; every named
    mistake moves entries by more than 1e-2. float64 keeps the defaults (1e-10), so an answer right
    only to float32 precision fails there."""
    x = case.get("x")
    if key != "output" or x is None or x.dtype != np.float32 or x.shape[-1] < 2:
        return None
    from . import tolerance as default

    atol, rtol = default("float32")
    pairs = x.astype(np.float64).reshape(*x.shape[:-1], -1, 2)
    r = float(np.sqrt((pairs ** 2).sum(-1)).max()) if pairs.size else 0.0
    return {"float32": (atol + 2.4e-7 * max(x.shape[-2] - 1, 0) * r, rtol)}


def _float32_only(out, want) -> str:
    """For a float64 input, a result right to about float32 precision only (off by more than 1e-9
    but less than 1e-4): what to do about it ("" otherwise)."""
    got, expected = out.get("output"), want.get("output")
    if got is None or expected is None or expected.dtype != np.float64 or got.dtype != np.float64:
        return ""
    if got.shape != expected.shape or not got.size:
        return ""
    err = float(np.nan_to_num(np.abs(got - expected), nan=np.inf).max())
    if 1e-9 < err < 1e-4:
        return (f" Your float64 result is right to about float32 precision only (off by up to {err:.3g}): build the "
                "positions and frequencies in x's dtype (for example torch.arange(T, dtype=x.dtype)); "
                "torch.arange(T) / d or base ** (...) of an int tensor gives float32.")
    return ""


def float64_precision(case, out, want):
    """A float64 result right to float32 precision only fails with the hint (the comparison would
    say only by how much)."""
    hint = _float32_only(out, want)
    return hint.strip() or None


def _fmt(v: float) -> str:
    return f"{v:.6f}"


def worked_rotations(case, out, want):
    """The worked examples, to 1e-10 in float64: Cat sat mat's keys (d = 2, one pair turning 1 radian
    per position), and x = [1, 0, 1, 0] at positions 0..2 (d = 4, theta = (1, 0.01)), whose pair i at
    position p must end at (cos(p theta_i), sin(p theta_i))."""
    if "printed" not in case["tags"]:
        return None
    x, got = case["x"], out.get("output")
    if got is None or got.shape != x.shape or got.dtype != np.float64:
        return None  # (the comparison names the shape or the dtype)
    if x.shape[-1] == 2:
        for p, token in enumerate(examples.TOKENS):
            a, b = (float(v) for v in x[p])
            ok = (a * math.cos(p) - b * math.sin(p), a * math.sin(p) + b * math.cos(p))
            mine = [float(v) for v in got[p]]
            off = max(abs(u - w) for u, w in zip(mine, ok))
            if off > 1e-10:
                return (f"{token}'s key {[a, b]} sits at position {p}, so it should turn by {p} radian(s) to "
                        f"[{_fmt(ok[0])}, {_fmt(ok[1])}]; yours is [{_fmt(mine[0])}, {_fmt(mine[1])}] (off by {off:.3g}; "
                        "tolerance 1e-10 in float64)." + _float32_only(out, want))
        return None
    for p in range(x.shape[0]):
        for i, theta in enumerate((1.0, 0.01)):
            ok = (math.cos(p * theta), math.sin(p * theta))
            mine = (float(got[p, 2 * i]), float(got[p, 2 * i + 1]))
            off = max(abs(u - w) for u, w in zip(mine, ok))
            if off > 1e-10:
                whole = [[round(float(v), 4) for v in row] for row in got]
                return (f"for x = [1, 0, 1, 0] at position {p}, pair i = {i} (columns {2 * i}, {2 * i + 1}) turns at "
                        f"theta_{i} = 10000^(-{2 * i}/4) = {theta:g} rad per position and should be (cos {p * theta:g}, "
                        f"sin {p * theta:g}) = ({_fmt(ok[0])}, {_fmt(ok[1])}); yours is ({_fmt(mine[0])}, "
                        f"{_fmt(mine[1])}) (off by {off:.3g}; tolerance 1e-10 in float64). Your whole output, rounded: "
                        f"{whole}." + _float32_only(out, want))
    return None


POSITIONS = 12  # the relative-position cases put q and k at positions 0..11


def _diagonal_report(S: np.ndarray, tol: float):
    """The first pair of entries of S (..., T, T) with the same offset m - n that differ by more
    than ``tol``: (offset, leading index, (m0, n0, S0), (m1, n1, S1)), or None."""
    T = S.shape[-1]
    for offset in range(-(T - 1), T):
        diag = np.diagonal(S, offset=-offset, axis1=-2, axis2=-1)  # entries with m - n = offset
        spread = np.abs(diag - diag[..., :1])
        if spread.size and spread.max() > tol:
            idx = tuple(int(v) for v in np.argwhere(spread == spread.max())[0])
            k, lead = idx[-1], list(idx[:-1])
            m0, n0 = max(offset, 0), max(-offset, 0)
            m1, n1 = m0 + k, n0 + k
            return offset, lead, (m0, n0, float(S[(*idx[:-1], m0, n0)])), (m1, n1, float(S[(*idx[:-1], m1, n1)]))
    return None


def relative_position(case, out, want):
    """RoPE's defining property, on the answer alone: position 0 is unchanged, lengths are kept (to
    1e-6 relative: far above float64 rounding, far below what a non-rotation changes), and the score
    of the rotated q at position m with the rotated k at n is the same for every (m, n) with the same
    m - n (to 1e-6 |q| |k|). float32: the scores' property only, to 1e-4 d (scores of size about d
    agree to about 1e-5)."""
    q, k = case["q"].astype(np.float64), case["k"].astype(np.float64)
    Rq, Rk = out["rotated q"].astype(np.float64), out["rotated k"].astype(np.float64)
    d = q.shape[-1]
    S = Rq @ np.swapaxes(Rk, -1, -2)  # (..., T, T): S[m, n]
    if case["q"].dtype == np.float32:
        bad = _diagonal_report(S, 1e-4 * d)
        if bad is not None:
            return (f"in float32, the score between the rotated q at m and the rotated k at n depends on more than "
                    f"m - n (offset {bad[0]}: {bad[2][2]:.5f} vs {bad[3][2]:.5f}).")
        return None
    lead = tuple(q.shape[:-1])
    label = f"(d = {d}{', leading dims ' + str(lead) if lead else ''})"
    moved = np.abs(Rq[..., 0, :] - q).max(axis=-1)  # (...)
    if moved.max() > 1e-6:
        idx = tuple(int(v) for v in np.argwhere(moved == moved.max())[0])
        where = f" (leading index {list(idx)})" if idx else ""
        what = (f"q = {[round(float(v), 4) for v in q[idx]]} became {[round(float(v), 4) for v in Rq[idx][0]]}"
                if "shown" in case["tags"] else f"q moved by up to {float(moved.max()):.3g}")  # (no secret input shown)
        return f"at position 0 every angle is 0, so apply_rope must leave the vector unchanged {label}{where}; {what}."
    if np.allclose(Rq[..., 1, :], Rq[..., 0, :], atol=1e-6, rtol=0):
        return (f"the same vector at positions 0 and 1 comes out unchanged {label}: apply_rope must rotate each pair "
                "by an angle that grows with the position.")
    for v, R, name in ((q, Rq, "q"), (k, Rk, "k")):
        n_in, n_out = np.linalg.norm(v, axis=-1)[..., None], np.linalg.norm(R, axis=-1)
        rel = float((np.abs(n_out - n_in) / n_in).max())
        if rel > 1e-6:
            return (f"apply_rope changed the length of {name} {label} (by a factor up to {1 + rel:.4f}); rotating each "
                    "pair must keep every vector's length.")
    tol = 1e-6 * float((np.linalg.norm(q, axis=-1) * np.linalg.norm(k, axis=-1)).max())
    bad = _diagonal_report(S, tol)
    if bad is not None:
        offset, where, (m0, n0, s0), (m1, n1, s1) = bad
        where = f" (leading index {where})" if where else ""
        return (f"the score between the rotated q at position m and the rotated k at position n should depend only on "
                f"m - n {label}{where}: with m - n = {offset}, score(m={m0}, n={n0}) = {s0:.6f} but score(m={m1}, "
                f"n={n1}) = {s1:.6f}. Each pair must turn by pos * theta_i, the same theta_i for q and k.")
    return None


# ================================================================ the adapters
_rope_values = runner(("x",), ("base",), grad=("x",), missing_as_none=True)


def rope_run(fn, case):
    """apply_rope on one case: its output (a value or gradient case), or, for a relative-position case
    (``q`` and ``k``), q and k each repeated at positions 0..11 and rotated."""
    if "q" not in case:
        return _rope_values(fn, case)
    q, k = case["q"], case["k"]
    Xq = q.unsqueeze(-2).expand(*q.shape[:-1], POSITIONS, q.shape[-1]).clone()  # (..., 12, d): q at every position
    Xk = k.unsqueeze(-2).expand(*k.shape[:-1], POSITIONS, k.shape[-1]).clone()
    return {"rotated q": fn(Xq), "rotated k": fn(Xk), "q after the call": Xq, "k after the call": Xk}


# ================================================================ the cases


def _normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _table_case(tags, max_len, d_model):
    return case(f"for max_len={max_len}, d_model={d_model}", tags, max_len=max_len, d_model=d_model)


TABLE_SIZES = ((1, 2), (3, 2), (10, 6), (17, 10), (50, 16), (128, 64), (512, 128), (4096, 128))


def table_secret(rng: np.random.Generator) -> list:
    """Small tables of the worked example's kind at fresh sizes (one with d_model = 4), and tables
    from (1, 2) to (4096, 128), the source's default length, with one of a random size."""
    cases = [_table_case("example", int(rng.integers(3, 10)), d) for d in (4, int(rng.choice([2, 6, 8])))]
    sizes = [*TABLE_SIZES, (int(rng.integers(20, 100)), 2 * int(rng.integers(2, 13)))]
    return cases + [_table_case("tables", *s) for s in sizes]


def _rope_label(x, base=None, extra=""):
    return f"for x of shape {tuple(x.shape)}, {x.dtype}" + (f", base={base:g}" if base is not None else "") + extra


def _rope_case(rng, tags, shape, dtype, base=None, grads=False):
    x = _normal(rng, shape, dtype)
    inputs = {"x": x} if base is None else {"x": x, "base": base}
    c = case(_rope_label(x, base, ", with the gradients" if grads else ""), tags, **inputs)
    return grad_case(rng, c, ("x",)) if grads else c


def _relative_case(rng, lead, d, dtype, tags=("relative",)):
    q, k = _normal(rng, (*lead, d), dtype), _normal(rng, (*lead, d), dtype)
    return case(f"for {dtype} q and k of shape {(*lead, d)} at positions 0..{POSITIONS - 1}", tags, q=q, k=k)


def _rope_visible() -> tuple:
    _, K, _ = (m.numpy() for m in examples.cat_sat_mat(torch.float64))
    g = np.random.default_rng(25)
    x = g.standard_normal((2, 5, 8))
    return (
        case("for Cat sat mat's keys, x of shape (3, 2), float64", ("example", "printed"), x=K),
        case("for x = [1, 0, 1, 0] at positions 0..2, shape (3, 4), float64", ("example", "printed"),
             x=np.array([[1.0, 0.0, 1.0, 0.0]] * 3)),
        _rope_case(g, "shapes", (2, 5, 8), "float32"),
        _rope_case(g, "shapes", (3, 2, 4, 6), "float64"),
        *(case(_rope_label(x, b), "base", x=x, base=b) for b in (100.0, 500000.0, 10000.0)),
        _relative_case(g, (), 8, "float64", ("relative", "shown")),  # (its vectors may be shown in messages)
        _rope_case(g, "grads", (2, 4, 6), "float64", grads=True),
    )


ROPE_SHAPES = ((1, 2), (5, 2), (7, 8), (2, 6, 4), (3, 10, 16), (2, 4, 9, 6), (2, 3, 2, 5, 12), (1, 64, 64))


def rope_secret(rng: np.random.Generator) -> list:
    """Fresh inputs of the worked examples' sizes; shapes from (1, 2) to three leading dimensions and
    64 positions in both dtypes; the base test's bases and another, in both dtypes; the relative
    property at several widths, with leading dimensions and in float32; gradients with leading
    dimensions, in float64 (finite differences) and float32 (they must exist)."""
    cases = [_rope_case(rng, "example", shape, "float64") for shape in ((3, 2), (3, 4))]
    cases += [_rope_case(rng, "shapes", shape, dtype) for dtype in ("float32", "float64") for shape in ROPE_SHAPES]
    cases.append(_rope_case(rng, "shapes", (*(int(v) for v in rng.integers(1, 4, size=2)), int(rng.integers(2, 20)),
                                            2 * int(rng.integers(1, 9))), "float64"))
    for dtype in ("float64", "float32"):
        x = _normal(rng, (2, 5, 8), dtype)
        for base in (100.0, 500000.0, 10000.0, float(rng.choice([50.0, 1000.0, 1e6]))):
            cases.append(case(_rope_label(x, base), "base", x=x, base=base))
    for lead, d, dtype in (((), 8, "float64"), ((), 2, "float64"), ((), 32, "float64"), ((3,), 6, "float64"),
                           ((2, 4), 16, "float64"), ((2, 2), 6, "float64"), ((2,), 16, "float32")):
        cases.append(_relative_case(rng, lead, d, dtype))
    for shape, dtype in (((2, 4, 6), "float64"), ((2, 3, 5, 4), "float64"), ((3, 5, 8), "float32")):
        cases.append(_rope_case(rng, "grads", shape, dtype, grads=True))
    return cases


FORBIDDEN = ("sinusoidal_encoding", "apply_rope")

PIECES = (
    Exercise(
        name="positional_encoding",
        piece="sinusoidal_encoding",
        call="sinusoidal_encoding(max_len, d_model)",
        adapter=runner(("max_len", "d_model"), outputs=("table",)),
        reference="firstprinciples.reference:sinusoidal_encoding",
        visible=(_table_case(("example", "printed"), 6, 4), _table_case("tables", 50, 16)),
        secret=table_secret,
        tests={
            "test_sinusoidal_example": Test(2, frozenset({"example"}), first=(table_shape, row_zero, table_formula)),
            "test_sinusoidal_tables": Test(2, frozenset({"tables"}), first=(table_shape, table_formula)),
        },
        tolerance=table_tolerance,
        forbidden=dict(torch_patterns=(), pieces=FORBIDDEN, what="the sinusoidal table"),
        mistakes=TABLE_MISTAKES,
        hints=(
            ("must match the size", "Sin and cos each fill every other column: table[:, 0::2] and table[:, 1::2] "
                                    "hold d_model/2 columns each, one per frequency."),
        ),
    ),
    Exercise(
        name="positional_encoding",
        piece="apply_rope",
        call="apply_rope(x)",
        adapter=rope_run,
        reference="firstprinciples.reference:apply_rope",
        names={"grad_x": "the gradient with respect to x", "rotated q": "apply_rope(q at positions 0..11)",
               "rotated k": "apply_rope(k at positions 0..11)"},
        visible=_rope_visible(),
        secret=rope_secret,
        tests={
            EXAMPLE: Test(2, frozenset({"example"}), first=(worked_rotations, float64_precision)),
            SHAPES: Test(2, frozenset({"shapes"}), first=(float64_precision,)),
            BASE: Test(1, frozenset({"base"}), first=(float64_precision,)),
            RELATIVE: Test(2, frozenset({"relative"}), then=(relative_position,), values=False),
            GRADS: Test(1, frozenset({"grads"}), first=(honest_gradients,), values=False),
        },
        tolerance=rope_tolerance,
        forbidden=dict(torch_patterns=(), pieces=FORBIDDEN, what="rotary position embeddings"),
        mistakes=ROPE_MISTAKES,
        hints=(
            ("unexpected keyword argument 'base'", "The contract is apply_rope(x, base=10000.0): the second argument "
                                                  "must be called base."),
            ("must match the size", "Positions run along x.shape[-2] (T) and pairs along the last axis: the angles "
                                    "are (T, d/2), against x[..., 0::2] of shape (..., T, d/2)."),
        ),
    ),
)
