"""Checks for the positional-encoding exercise.

Two functions:

- ``sinusoidal_encoding(max_len, d_model) -> table``: the (max_len, d_model)
  float32 table with sin at even columns 2i and cos at odd columns 2i + 1 of
  pos * 10000^(-2i/d_model), positions 0..max_len-1, d_model even;
- ``apply_rope(x, base=10000.0) -> rotated``: x (..., T, d), d even; each
  interleaved pair (x[..., 2i], x[..., 2i+1]) at position p (0..T-1) rotated
  by the angle p * base^(-2i/d).

Visible checks: a small worked example of each, batched shapes and both
dtypes, the ``base`` argument, the relative-position property of RoPE and its
gradients. Hidden checks (``full=True``) add more shapes, long tables and an
independent complex-number formulation of RoPE. Every call of the answer runs
under ``call_without``: an answer that calls the course's reference pieces
scores 0 (PyTorch has no built-in for either, so nothing else is forbidden).
"""
from __future__ import annotations

import math

import torch

from .. import examples
from ..guard import call_without
from ..reference import apply_rope as reference_rope, sinusoidal_encoding as reference_table
from ._student import wrap_checks
from ._core import Mistake, assert_gradcheck, assert_matches, call_answer, fmt, unpack, with_diagnosis

FORBIDDEN_TABLE = dict(
    torch_patterns=(),
    pieces=("sinusoidal_encoding", "apply_rope"),
    what="the sinusoidal table",
)
FORBIDDEN_ROPE = dict(
    torch_patterns=(),
    pieces=("apply_rope", "sinusoidal_encoding"),
    what="rotary position embeddings",
)


# ================================================================ the sinusoidal table
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


TABLE_MISTAKES = (
    Mistake("sin and cos swapped", "sin goes in the even columns (0, 2, 4, ...) and cos in the odd ones.", _sin_cos_swapped),
    Mistake(
        "frequencies 10000^(-i/d_model)",
        "the pair (2i, 2i+1) uses 10000^(-2i/d_model): the exponent is the even column index 2i, not i.",
        _pair_index_exponent,
    ),
    Mistake("positions start at 1", "positions run 0, 1, ..., max_len - 1: row 0 is sin(0), cos(0), ... = 0, 1, 0, 1, ...", _positions_from_one),
    Mistake(
        "frequencies 10000^(+2i/d_model)",
        "the frequencies must fall with i: multiply pos by 10000^(-2i/d_model) (equivalently, divide by 10000^(2i/d_model)).",
        _positive_exponent,
    ),
    Mistake(
        "cos columns use their own index",
        "both columns of a pair share one frequency: column 2i+1 uses 10000^(-2i/d_model), not 10000^(-(2i+1)/d_model).",
        _column_index_exponent,
    ),
    Mistake(
        "sin and cos in two halves",
        "interleave them: sin in columns 0, 2, 4, ... and cos in columns 1, 3, 5, ..., not sin in the first half and cos in the second.",
        _sin_cos_halves,
    ),
)


def _expected_table(max_len, d_model):
    # The reference computes in float64 and rounds once to float32: the most
    # accurate float32 table there is.
    return reference_table(max_len, d_model, dtype=torch.float64).to(torch.float32)


def _table_reference(max_len, d_model):
    return reference_table(max_len, d_model)


def _table_atol(max_len):
    # A table computed in float32 throughout (as the source's is) rounds both
    # pos * freq and freq to about 6e-8 relative, so the angle at position p may
    # be off by about 1.2e-7 * p; sin and cos pass that error on. 1e-5 + 2e-7 * max_len
    # covers every correct float32 route, and each known mistake moves some entry
    # by more than 0.1.
    return 1e-5 + 2e-7 * max_len


def _run_table(fn, max_len, d_model):
    (table,) = call_answer(fn, (max_len, d_model), names=("table",), forbidden=FORBIDDEN_TABLE)
    shape = (max_len, d_model)
    if tuple(table.shape) != shape:
        hint = ""
        if tuple(table.shape) == (1, *shape):
            hint = " Drop the leading batch dimension (the source's module keeps one for broadcasting)."
        elif tuple(table.shape) == shape[::-1]:
            hint = " Rows are positions and columns are dimensions: (max_len, d_model)."
        raise AssertionError(
            f"sinusoidal_encoding({max_len}, {d_model}) has shape {tuple(table.shape)} but should have shape {shape}.{hint}"
        )
    if table.dtype != torch.float32:
        raise AssertionError(
            f"sinusoidal_encoding({max_len}, {d_model}) has dtype {table.dtype}; the table should be float32."
        )
    return table


def _assert_table_values(table, max_len, d_model):
    """Compare with the reference; explain the worst entry with its formula."""
    expected = _expected_table(max_len, d_model)
    atol = _table_atol(max_len)
    err = (table.detach().double() - expected.double()).abs().nan_to_num(nan=float("inf"))
    worst = err.max().item()
    if worst <= atol:
        return
    pos, col = (int(v) for v in torch.nonzero(err == worst)[0])
    i = col // 2
    f = "sin" if col % 2 == 0 else "cos"
    angle = pos * 10000.0 ** (-2 * i / d_model)
    raise AssertionError(
        f"In sinusoidal_encoding({max_len}, {d_model}), table[{pos}, {col}] = {fmt(table[pos, col].item())} "
        f"but should be {f}({pos} * 10000^(-{2 * i}/{d_model})) = {f}({fmt(angle)}) = {fmt(expected[pos, col].item())} "
        f"(off by {fmt(worst)}; tolerance {atol:.3g}). "
        f"Column {col} is the {'first' if col % 2 == 0 else 'second'} column of pair i = {i}."
    )


def _compare_table(fn, max_len, d_model):
    table = _run_table(fn, max_len, d_model)
    with_diagnosis(
        lambda: _assert_table_values(table, max_len, d_model),
        (table,), (max_len, d_model), TABLE_MISTAKES, _table_reference,
    )
    return table


def check_sinusoidal_example(fn):
    """The worked example: sinusoidal_encoding(6, 4), entry by entry.

    With d_model = 4 the two pairs turn at 1 and 10000^(-2/4) = 0.01 radians per
    position, so row 1 is [sin 1, cos 1, sin 0.01, cos 0.01].
    """
    table = _run_table(fn, 6, 4)

    def check():
        row0 = [round(v, 6) for v in table[0].tolist()]
        assert all(abs(a - b) <= 1e-6 for a, b in zip(row0, (0.0, 1.0, 0.0, 1.0))), (
            "Row 0 (position 0) should be [0, 1, 0, 1]: every angle is 0, so sin gives 0 and cos gives 1. "
            f"Yours is {row0}."
        )
        _assert_table_values(table, 6, 4)

    with_diagnosis(check, (table,), (6, 4), TABLE_MISTAKES, _table_reference)


TABLE_SHAPES = [
    # (max_len, d_model); d_model is always even (the contract).
    (1, 2),
    (3, 2),
    (10, 6),
    (17, 10),
    (50, 16),
    (128, 64),
    (512, 128),
    (4096, 128),  # the source's default max_len
]


def check_sinusoidal_tables(fn, full=True):
    """Tables of several sizes against the reference (float32, even d_model).

    ``full=False`` checks the (50, 16) table only (the visible part of the test).
    """
    for max_len, d_model in TABLE_SHAPES if full else [(50, 16)]:
        _compare_table(fn, max_len, d_model)


# ================================================================ RoPE
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


ROPE_MISTAKES = (
    Mistake(
        "pairs taken as halves",
        "rotate the interleaved pairs (x[..., 2i], x[..., 2i+1]), i.e. x[..., 0::2] with x[..., 1::2], "
        "not the first half of the features with the second half.",
        _halves,
    ),
    Mistake(
        "rotated pairs not interleaved back",
        "after rotating x[..., 0::2] and x[..., 1::2], put the results back in the interleaved order "
        "(stack them on a new last axis and flatten), not one block after the other.",
        _not_reinterleaved,
    ),
    Mistake(
        "rotation in the wrong direction",
        "rotate by +angle: x'[2i] = x[2i] cos - x[2i+1] sin and x'[2i+1] = x[2i] sin + x[2i+1] cos.",
        _wrong_direction,
    ),
    Mistake("base ignored", "use the `base` argument in base^(-2i/d), not a hard-coded 10000.", _base_ignored),
    Mistake(
        "positions along the wrong axis",
        "positions run along the second-to-last axis, x.shape[-2] (T), whatever the number of leading "
        "dimensions; x.shape[0] is the batch when there are leading dimensions.",
        _positions_first_axis,
    ),
    Mistake(
        "frequencies base^(-i/d)",
        "the pair (2i, 2i+1) turns at base^(-2i/d): the exponent is the even column index 2i, not i.",
        _rope_pair_index_exponent,
    ),
    Mistake("positions start at 1", "positions run 0, 1, ..., T - 1: the first vector is not rotated at all.", _rope_positions_from_one),
    Mistake(
        "not a rotation (sign error)",
        "the second component is x[2i] sin + x[2i+1] cos; with a minus sign the map is not a rotation "
        "and changes the lengths of the vectors.",
        _sign_error,
    ),
)


def _rope_complex(x, base=10000.0):
    """An independent formulation: pair i is the complex number x[2i] + j x[2i+1],
    multiplied by exp(j * pos * theta_i). Computed in float64."""
    x64 = x.detach().to(torch.float64)
    T, d = x.shape[-2], x.shape[-1]
    z = torch.view_as_complex(x64.reshape(*x.shape[:-1], d // 2, 2).contiguous())  # (..., T, d/2)
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta  # (T, d/2)
    turned = z * torch.polar(torch.ones_like(angle), angle)
    return torch.view_as_real(turned).reshape(x.shape).to(x.dtype)


def _rope_label(x, base=None):
    s = f"for x of shape {tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}"
    return s + (f", base={base:g}" if base is not None else "")


def _run_rope(fn, x, base=None):
    kwargs = {} if base is None else {"base": base}
    (out,) = call_answer(fn, (x,), kwargs, names=("output",), forbidden=FORBIDDEN_ROPE)
    label = _rope_label(x, base)
    if tuple(out.shape) != tuple(x.shape):
        raise AssertionError(f"apply_rope output {label} has shape {tuple(out.shape)}; it should keep x's shape.")
    if out.dtype != x.dtype:
        raise AssertionError(f"apply_rope output {label} has dtype {out.dtype}; keep the input's dtype {x.dtype}.")
    return out


def _float32_precision_hint(out, expected):
    """For float64 inputs: a result right to float32 precision only."""
    if expected.dtype != torch.float64:
        return ""
    err = (out.detach().double() - expected).abs().max().item()
    if err < 1e-4:
        return (
            "\nYour float64 result is right to about float32 precision only: build the positions and "
            "frequencies in x's dtype (for example torch.arange(T, dtype=x.dtype)); "
            "torch.arange(T) / d or base ** (...) of an int tensor gives float32."
        )
    return ""


def _compare_rope(fn, x, base=None, *, label="", against_complex=False):
    out = _run_rope(fn, x, base)
    b = 10000.0 if base is None else base
    # The reference computed in float64, rounded once to x's dtype.
    expected = reference_rope(x.to(torch.float64), base=b).to(x.dtype)
    what = label or _rope_label(x, base)

    def check():
        try:
            assert_matches("output", out, expected, context=what)
            if against_complex:
                assert_matches("output", out, _rope_complex(x, b), context=what + " (against complex rotation)")
        except AssertionError as err:
            hint = _float32_precision_hint(out, expected)
            if hint:
                raise AssertionError(f"{err}{hint}") from None
            raise

    kwargs = {} if base is None else {"base": base}
    with_diagnosis(check, (out,), (x,), ROPE_MISTAKES, reference_rope, kwargs)
    return out


def check_rope_example(fn):
    """The worked example, in float64.

    1. The keys of "Cat sat mat" (d = 2, so the single pair turns 1 radian per
       position): Cat's key stays put, sat's turns by 1 radian, mat's by 2.
    2. Three positions of x = [1, 0, 1, 0] (d = 4): pair i at position p must end
       at (cos(p theta_i), sin(p theta_i)) with theta = (1, 0.01).
    """
    _, K, _ = examples.cat_sat_mat(torch.float64)  # (3, 2)
    out = _run_rope(fn, K)

    def check():
        for p, tok in enumerate(examples.TOKENS):
            a, b = K[p].tolist()
            want = (a * math.cos(p) - b * math.sin(p), a * math.sin(p) + b * math.cos(p))
            got = out[p].tolist()
            off = max(abs(u - w) for u, w in zip(got, want))
            assert off <= 1e-10, (
                f"{tok}'s key {[a, b]} sits at position {p}, so it should turn by {p} radian(s) "
                f"to [{want[0]:.6f}, {want[1]:.6f}]; yours is [{got[0]:.6f}, {got[1]:.6f}] "
                f"(off by {fmt(off)}; tolerance 1e-10 in float64)."
                + _float32_precision_hint(out, reference_rope(K))
            )

    with_diagnosis(check, (out,), (K,), ROPE_MISTAKES, reference_rope)

    x = torch.tensor([[1.0, 0.0, 1.0, 0.0]] * 3, dtype=torch.float64)  # (3, 4)
    out = _run_rope(fn, x)

    def check4():
        for p in range(3):
            for i, theta in enumerate((1.0, 0.01)):
                want = (math.cos(p * theta), math.sin(p * theta))
                got = (out[p, 2 * i].item(), out[p, 2 * i + 1].item())
                off = max(abs(u - w) for u, w in zip(got, want))
                assert off <= 1e-10, (
                    f"For x = [1, 0, 1, 0] at position {p}, pair i = {i} (columns {2 * i}, {2 * i + 1}) "
                    f"turns at theta_{i} = 10000^(-{2 * i}/4) = {theta:g} rad per position and should be "
                    f"(cos {p * theta:g}, sin {p * theta:g}) = ({want[0]:.6f}, {want[1]:.6f}); "
                    f"yours is ({got[0]:.6f}, {got[1]:.6f}) (off by {fmt(off)}; tolerance 1e-10 in float64). "
                    f"Your whole output, rounded: {[[round(v, 4) for v in row] for row in out.tolist()]}"
                    + _float32_precision_hint(out, reference_rope(x))
                )

    with_diagnosis(check4, (out,), (x,), ROPE_MISTAKES, reference_rope)


ROPE_SHAPES = [
    # x.shape: (..., T, d). The first axis differs from T whenever there are leading dims.
    (1, 2),
    (5, 2),
    (7, 8),
    (2, 6, 4),
    (3, 10, 16),
    (2, 4, 9, 6),  # batch x heads
    (2, 3, 2, 5, 12),  # three leading dims
    (1, 64, 64),  # longer sequence: angles up to 63 radians
]


def check_rope_shapes(fn, full=True):
    """Leading dimensions, both dtypes: shapes, dtypes and values against the reference;
    with ``full=True`` also against an independent complex-number formulation.

    ``full=False`` runs one float32 and one float64 case (the visible part).
    """
    g = torch.Generator().manual_seed(25)
    if full:
        cases = [(shape, dtype) for dtype in (torch.float32, torch.float64) for shape in ROPE_SHAPES]
    else:
        cases = [((2, 5, 8), torch.float32), ((3, 2, 4, 6), torch.float64)]
    for shape, dtype in cases:
        x = torch.randn(*shape, generator=g, dtype=dtype)
        _compare_rope(fn, x, against_complex=full)


def check_rope_base(fn):
    """The ``base`` argument is honoured (100 and 500000, as well as the default)."""
    g = torch.Generator().manual_seed(26)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    for base in (100.0, 500000.0, 10000.0):
        _compare_rope(fn, x, base)


def _diagonal_report(S, tol):
    """The first pair of entries with the same offset m - n that differ, or None."""
    T = S.shape[-1]
    for offset in range(-(T - 1), T):
        diag = torch.diagonal(S, offset=-offset, dim1=-2, dim2=-1)  # entries with m - n = offset
        spread = (diag - diag[..., :1]).abs()
        if spread.max().item() > tol:
            idx = tuple(int(v) for v in torch.nonzero(spread == spread.max())[0])
            k = idx[-1]
            lead = list(idx[:-1])
            m0, n0 = max(offset, 0), max(-offset, 0)
            m1, n1 = m0 + k, n0 + k
            return (offset, lead, (m0, n0, S[(*idx[:-1], m0, n0)].item()), (m1, n1, S[(*idx[:-1], m1, n1)].item()))
    return None


def _relative_case(fn, q, k, label):
    """q, k: (..., d). Score of rotated q at position m with rotated k at n, for all m, n."""
    T = 12
    Xq = q.unsqueeze(-2).expand(*q.shape[:-1], T, q.shape[-1]).clone()  # (..., T, d): q at every position
    Xk = k.unsqueeze(-2).expand(*k.shape[:-1], T, k.shape[-1]).clone()
    Rq, Rk = _run_rope(fn, Xq), _run_rope(fn, Xk)
    with_diagnosis(lambda: _assert_relative(Xq, Xk, Rq, Rk, q, k, label), (Rq,), (Xq,), ROPE_MISTAKES, reference_rope)


def _assert_relative(Xq, Xk, Rq, Rk, q, k, label):
    D = Rq.detach().double()

    # Position 0: the angle is 0, nothing turns.
    moved = (D[..., 0, :] - Xq[..., 0, :].double()).abs().amax(dim=-1)  # (...)
    if moved.max().item() > 1e-6:
        idx = tuple(int(v) for v in torch.nonzero(moved == moved.max())[0])
        where = f" (leading index {list(idx)})" if idx else ""
        raise AssertionError(
            f"At position 0 every angle is 0, so apply_rope must leave the vector unchanged {label}{where}; "
            f"q = {[round(v, 4) for v in Xq[idx][0].tolist()]} became {[round(v, 4) for v in D[idx][0].tolist()]}."
        )
    if torch.allclose(D[..., 1, :], D[..., 0, :], atol=1e-6, rtol=0):
        raise AssertionError(
            f"The same vector at positions 0 and 1 comes out unchanged {label}: apply_rope must rotate "
            "each pair by an angle that grows with the position."
        )
    # A rotation keeps lengths. float64 inputs: 1e-6 relative is far above rounding
    # and far below what a non-rotation changes.
    for X, R, name in ((Xq, Rq, "q"), (Xk, Rk, "k")):
        n_in, n_out = X.double().norm(dim=-1), R.detach().double().norm(dim=-1)
        rel = ((n_out - n_in).abs() / n_in).max().item()
        if rel > 1e-6:
            raise AssertionError(
                f"apply_rope changed the length of {name} {label} (by a factor up to {1 + rel:.4f}); "
                "rotating each pair must keep every vector's length."
            )
    S = Rq.detach().double() @ Rk.detach().double().transpose(-2, -1)  # (..., T, T): S[m, n]
    tol = 1e-6 * (q.double().norm(dim=-1) * k.double().norm(dim=-1)).max().item()
    bad = _diagonal_report(S, tol)
    if bad is not None:
        offset, lead, (m0, n0, s0), (m1, n1, s1) = bad
        where = f" (leading index {lead})" if lead else ""
        raise AssertionError(
            f"The score between the rotated q at position m and the rotated k at position n should depend "
            f"only on m - n {label}{where}: with m - n = {offset}, score(m={m0}, n={n0}) = {s0:.6f} but "
            f"score(m={m1}, n={n1}) = {s1:.6f}. Each pair must turn by pos * theta_i, the same theta_i "
            "for q and k."
        )


def check_rope_relative_position(fn, full=True):
    """RoPE's defining property, on the answer alone: position 0 is unchanged, lengths
    are kept, and q at position m against k at position n scores the same for every
    (m, n) with the same m - n (12 positions, float64).

    ``full=False`` runs one pair of 8-dimensional vectors; ``full=True`` adds
    several widths, leading (batch, head) dimensions, and float32.
    """
    g = torch.Generator().manual_seed(27)
    cases = [((), 8, torch.float64)]
    if full:
        cases += [((), 2, torch.float64), ((), 32, torch.float64), ((3,), 6, torch.float64), ((2, 4), 16, torch.float64)]
    for lead, d, dtype in cases:
        q = torch.randn(*lead, d, generator=g, dtype=dtype)
        k = torch.randn(*lead, d, generator=g, dtype=dtype)
        _relative_case(fn, q, k, f"(d = {d}{', leading dims ' + str(lead) if lead else ''})")
    if full:
        # float32: the same property, to float32 precision (scores of size ~d agree to ~1e-5).
        q = torch.randn(2, 16, generator=g, dtype=torch.float32)
        k = torch.randn(2, 16, generator=g, dtype=torch.float32)
        T = 12
        Xq = q.unsqueeze(-2).expand(2, T, 16).clone()
        Xk = k.unsqueeze(-2).expand(2, T, 16).clone()
        S = _run_rope(fn, Xq).double() @ _run_rope(fn, Xk).double().transpose(-2, -1)
        bad = _diagonal_report(S, 1e-4 * 16)
        if bad is not None:
            raise AssertionError(
                f"In float32, the score between rotated q at m and rotated k at n depends on more than m - n "
                f"(offset {bad[0]}: {bad[2][2]:.5f} vs {bad[3][2]:.5f})."
            )


def check_rope_gradients_and_inputs(fn, full=True):
    """Gradients flow back to x (float64, checked against finite differences of the
    answer itself with ``assert_gradcheck``) and x is left untouched.

    ``full=False`` checks one (2, 4, 6) input; ``full=True`` adds two leading
    dimensions and a float32 input.
    """
    g = torch.Generator().manual_seed(28)
    shapes = [(2, 4, 6)] + ([(2, 3, 5, 4)] if full else [])
    for shape in shapes:
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        _gradients_case(fn, x)
    if full:
        x = torch.randn(3, 5, 8, generator=g, dtype=torch.float32)
        _run_rope(fn, x)
        (out,) = unpack(call_without(fn, (x.clone().requires_grad_(True),), {}, **FORBIDDEN_ROPE), ("output",))
        if not out.requires_grad:
            raise AssertionError("For a float32 x that requires grad, the output does not: gradients cannot flow back.")


def _gradients_case(fn, x):
    label = _rope_label(x)
    _run_rope(fn, x)  # also checks that the input is untouched
    leaf = x.clone().requires_grad_(True)
    (out,) = unpack(call_without(fn, (leaf,), {}, **FORBIDDEN_ROPE), ("output",))
    if not out.requires_grad:
        raise AssertionError(
            f"The output {label} does not require grad although x does: gradients cannot flow back. Avoid "
            ".detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside the function."
        )
    (grad,) = torch.autograd.grad(out.sum(), (leaf,), allow_unused=True)
    if grad is None:
        raise AssertionError("No gradient reaches x: is x used in the computation?")

    def output_only(t):
        return unpack(call_without(fn, (t,), {}, **FORBIDDEN_ROPE), ("output",))[0]

    assert_gradcheck(output_only, (x.clone().requires_grad_(True),), what=f"your output with respect to x {label}")


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
