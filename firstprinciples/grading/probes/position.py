"""Probes for ``sinusoidal_encoding`` and ``apply_rope``.

sinusoidal_encoding: ``example`` (small tables of the worked example's kind, at
fresh sizes) and ``tables`` (more sizes); compared with the reference computed in
float64 and rounded once to float32, as in the checks, within 4e-5 (the checks
allow 1e-5 + 2e-7 max_len for tables up to 128 rows; every mistake moves an entry
by more than 0.1).

apply_rope: ``example`` (2-D inputs of the worked example's sizes, default base),
``shapes`` (leading dimensions, both dtypes), ``base`` (base = 100, 500000, 10000),
``relative`` (RoPE's defining property on the answer alone, judged with the
check's own assertion: position 0 unchanged, lengths kept, scores that depend
only on m - n) and ``grads`` (honest gradients; float32 gradients must exist).
The reference is computed in float64 and rounded once to x's dtype, as in the checks.
"""
from __future__ import annotations

import numpy as np

from ...checks import position as position_checks
from ...reference import apply_rope, sinusoidal_encoding
from . import Probe, arrays, aspect, call_runner, honest_gradients, normal, register
from ...exercises.adapters import grad_case, runner


# ---------------------------------------------------------------- sinusoidal_encoding
def reference_table(max_len, d_model):
    import torch

    return sinusoidal_encoding(max_len, d_model, dtype=torch.float64).to(torch.float32)


def table_cases(rng: np.random.Generator) -> list:
    cases = []
    # the worked example is (6, 4); fresh small sizes of its kind (one with d_model = 4)
    for d_model in (4, int(rng.choice([2, 6, 8]))):
        max_len = int(rng.integers(3, 10))
        cases.append({"label": f"sinusoidal_encoding({max_len}, {d_model})", "tags": ("example",),
                      "max_len": max_len, "d_model": d_model})
    sizes = [(1, 2), (3, 2), (10, 6), (17, 10), (50, 16), (128, 32)]
    sizes.append((int(rng.integers(20, 100)), 2 * int(rng.integers(2, 13))))
    for max_len, d_model in sizes:
        cases.append({"label": f"sinusoidal_encoding({max_len}, {d_model})", "tags": ("tables",),
                      "max_len": max_len, "d_model": d_model})
    return cases


TABLE_CELLS = {
    "test_sinusoidal_example": aspect("example"),
    "test_sinusoidal_tables": aspect("tables"),
}


# ---------------------------------------------------------------- apply_rope
def reference_rope(x, base=10000.0):
    """The reference computed in float64, rounded once to x's dtype (the checks' expectation)."""
    import torch

    return apply_rope(x.to(torch.float64), base=base).to(x.dtype)


def _label(dtype, shape, extra=""):
    return f"{dtype} x of shape {tuple(shape)}{extra}"


def rope_cases(rng: np.random.Generator) -> list:
    cases = []
    # the worked example: Cat sat mat's keys (3, 2) and a (3, 4) input, float64, the default base
    for shape in ((3, 2), (3, 4)):
        cases.append({"label": _label("float64", shape), "tags": ("example",), "x": normal(rng, shape, "float64")})
    # leading dimensions (the first axis differs from T), both dtypes
    shapes = [(1, 2), (5, 2), (7, 8), (2, 6, 4), (3, 10, 6), (2, 4, 9, 6), (2, 3, 2, 5, 4), (1, 32, 8)]
    for dtype in ("float32", "float64"):
        for shape in shapes:
            cases.append({"label": _label(dtype, shape), "tags": ("shapes",), "x": normal(rng, shape, dtype)})
    # the base argument
    x = normal(rng, (2, 5, 8), "float64")
    for base in (100.0, 500000.0, 10000.0):
        cases.append({"label": _label("float64", x.shape, f" and base={base:g}"), "tags": ("base",), "x": x, "base": base})
    # the relative-position property: q and k repeated over 12 positions
    for lead, d, dtype in (((), 8, "float64"), ((), 2, "float64"), ((3,), 6, "float64"), ((2, 2), 6, "float64"),
                           ((2,), 8, "float32")):
        cases.append({"label": f"{dtype} q and k of shape {(*lead, d)} at positions 0..11", "tags": ("relative",),
                      "q": normal(rng, (*lead, d), dtype), "k": normal(rng, (*lead, d), dtype)})
    # gradients: float64 (finite differences) and float32 (they must exist)
    for shape, dtype in (((2, 4, 6), "float64"), ((2, 3, 5, 4), "float64"), ((3, 5, 8), "float32")):
        case = {"label": "the gradients for " + _label(dtype, shape), "tags": ("grads",), "x": normal(rng, shape, dtype)}
        cases.append(grad_case(rng, case, ("x",)))
    return cases


POSITIONS = 12
_values = runner(("x",), ("base",), grad=("x",))


def rope_run(fn, case):
    if "q" not in case:
        return _values(fn, case)
    q, k = case["q"], case["k"]
    Xq = q.unsqueeze(-2).expand(*q.shape[:-1], POSITIONS, q.shape[-1]).clone()  # q at every position
    Xk = k.unsqueeze(-2).expand(*k.shape[:-1], POSITIONS, k.shape[-1]).clone()
    Rq, Rk = fn(Xq), fn(Xk)
    return {"rotated q": Rq, "rotated k": Rk, "q after the call": Xq, "k after the call": Xk}


def relative_position(case, got, want):
    """The relative-position test: position 0 unchanged, lengths kept, and the score of the
    rotated q at m with the rotated k at n depends only on m - n (the check's own assertion;
    float32: the scores' property only, to 1e-4 d)."""
    import torch

    a = arrays(got)
    q, k = case["q"], case["k"]
    Xq, Xk = (t.unsqueeze(-2).expand(*t.shape[:-1], POSITIONS, t.shape[-1]) for t in (q, k))
    Rq, Rk = torch.from_numpy(a["rotated q"]), torch.from_numpy(a["rotated k"])
    if q.dtype == torch.float32:
        S = Rq.double() @ Rk.double().transpose(-2, -1)
        bad = position_checks._diagonal_report(S, 1e-4 * q.shape[-1])
        if bad is not None:
            return (f"in float32, the score between the rotated q at m and the rotated k at n depends on more than m - n "
                    f"(offset {bad[0]}: {bad[2][2]:.5f} vs {bad[3][2]:.5f})")
        return None
    try:
        lead = tuple(q.shape[:-1])
        label = f"(d = {q.shape[-1]}{', leading dims ' + str(lead) if lead else ''})"
        position_checks._assert_relative(Xq, Xk, Rq, Rk, q, k, label)
    except AssertionError as err:
        return str(err).rstrip(".")
    return None


ROPE_CELLS = {
    "test_rope_example": aspect("example"),
    "test_rope_shapes": aspect("shapes"),
    "test_rope_base": aspect("base"),
    "test_rope_relative_position": aspect("relative", mode="structure", also=relative_position),
    "test_rope_gradients_and_inputs": aspect("grads", mode="structure", also=honest_gradients),
}

register(
    Probe("sinusoidal_encoding", table_cases, call_runner(("max_len", "d_model"), outputs=("table",)),
          reference=reference_table, forbidden=position_checks.FORBIDDEN_TABLE, tolerance={"float32": (4e-5, 0.0)},
          cells=TABLE_CELLS),
    Probe("apply_rope", rope_cases, rope_run, reference=reference_rope, forbidden=position_checks.FORBIDDEN_ROPE,
          cells=ROPE_CELLS),
)
