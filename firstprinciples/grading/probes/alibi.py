"""Probe for ``alibi_bias(n_heads, T, dtype=torch.float32)``.

Tags name the test cell each case stands for: ``worked`` (4 heads at a fresh T, the default
dtype), ``shapes`` (type, dtype and shape only: T = 1 included, float32 by default or asked for,
float64), ``slopes`` (fresh head counts, powers of two and not, T = 3), ``upper`` and ``random``
(fresh sizes, both dtypes: ``upper`` reports the entries on and above the diagonal only, ``random``
every entry; ``slopes`` reports -bias[:, 1, 0], what the check reads) and ``attention`` (the
attention weights of fresh queries and keys with the answer's bias and the causal mask, through
the course's attention, and the bias's type, shape and dtype: as in the check, an upper triangle
of -inf passes this case and fails ``upper``). The reference is computed in float64 and rounded once to the dtype asked for, as in
the checks, within their tolerances (float32 1e-6 / 1e-6, float64 1e-12 / 1e-6).
"""
from __future__ import annotations

import numpy as np

from ...checks import alibi as C
from . import Probe, aspect, normal, register


def reference(n_heads, T, dtype=None):
    import torch

    return C.expected(n_heads, T, torch.float32 if dtype is None else dtype)


def run(fn, case):
    import torch

    from ...reference import causal_mask, scaled_dot_product_attention

    n_heads, T = int(case["n_heads"]), int(case["T"])
    dtype = getattr(torch, case["dtype"]) if case.get("dtype") else None
    bias = fn(n_heads, T) if dtype is None else fn(n_heads, T, dtype=dtype)
    if "slopes" in case["tags"]:
        return {"slopes": -bias[:, 1, 0]}  # (n_heads,): what the check reads, bias[h, 1, 0] = -m_h
    if "upper" in case["tags"]:
        rows, cols = torch.triu_indices(T, T)
        return {"entries on and above the diagonal": bias[:, rows, cols]}  # (n_heads, T (T + 1) / 2)
    if "attention" not in case["tags"]:
        return {"bias": bias}
    Q, K, V = (case[n].clone() for n in "QKV")
    weights = scaled_dot_product_attention(Q, K, V, causal_mask(T, Q.dtype) + bias)[1]  # (B, n_heads, T, T)
    kind = f"{type(bias).__name__} of shape {tuple(bias.shape)} and dtype {bias.dtype}"
    return {"weights": weights, "bias": kind}


def _case(tag, n_heads, T, dtype=None):
    label = f"alibi_bias({n_heads}, {T}" + (f", dtype=torch.{dtype})" if dtype else ")")
    return {"label": label, "tags": (tag,), "n_heads": int(n_heads), "T": int(T), "dtype": dtype or ""}


def cases(rng: np.random.Generator) -> list:
    out = [_case("worked", 4, int(rng.integers(4, 9)))]
    for n_heads, T, dtype in ((4, 1, None), (2, int(rng.integers(2, 9)), None), (3, 4, "float64"), (1, 3, "float32"),
                              (8, 1, "float64"), (int(rng.integers(5, 13)), int(rng.integers(2, 12)), None)):
        out.append(_case("shapes", n_heads, T, dtype))
    fresh = [int(v) for v in rng.choice([5, 7, 9, 10, 11, 12, 24], size=2, replace=False)]
    for n_heads, dtype in ((1, None), (2, None), (4, None), (8, None), (3, None), (6, None), (fresh[0], None),
                           (fresh[1], "float64"), (16, "float64"), (64, None)):
        out.append(_case("slopes", n_heads, 3, dtype))
    for n_heads, T, dtype in ((4, 6, None), (3, int(rng.integers(10, 20)), "float64"), (8, 10, "float32")):
        out.append(_case("upper", n_heads, T, dtype))
    for n_heads, T, dtype in ((4, 32, None), (3, int(rng.integers(5, 16)), "float64"), (2, 9, "float32"), (8, 128, None),
                              (int(rng.integers(9, 17)), int(rng.integers(16, 48)), "float64"), (1, 16, "float64"),
                              (5, 33, None)):
        out.append(_case("random", n_heads, T, dtype))
    for n_heads, T, dtype in ((4, 10, "float32"), (3, int(rng.integers(8, 20)), "float32"), (8, 12, "float64")):
        case = _case("attention", n_heads, T, dtype)
        case.update({n: normal(rng, (2, n_heads, T, 8), dtype) for n in "QKV"})
        out.append(case)
    return out


CELLS = {
    "test_worked_example": aspect("worked"),
    "test_shapes": aspect("shapes", mode="structure"),
    "test_slopes": aspect("slopes"),
    "test_upper_triangle": aspect("upper"),
    "test_against_definition": aspect("random"),
    "test_in_attention": aspect("attention"),
}

register(Probe("alibi_bias", cases, run, reference=reference, forbidden=C.FORBIDDEN,
               tolerance={"float32": (1e-6, 1e-6), "float64": (1e-12, 1e-6)}, cells=CELLS))
