"""Probe for ``causal_mask(T) -> (T, T) float32 mask``.

Tags name the test cell each case stands for: ``seed`` (the chapter's T = 4, and
another small T so that a typed-in 4 x 4 matrix earns nothing), ``shapes`` (type,
dtype and shape only), ``values`` (exact 0 and -inf), ``peek`` (the mask used in
the course's attention on random tokens: the outputs and weights must be those of
the right mask, so a finite "large negative" mask passes there as in the check).

PyTorch's own causal mask is a Python function that the torch function mode
does not see; the runner watches for it with the check's profile hook and fails
the case when it is called.
"""
from __future__ import annotations

import numpy as np

from ...checks import causal_mask as mask_checks
from ...reference import causal_mask
from . import Probe, arrays, aspect, normal, register


def _mask(fn, T):
    with mask_checks._watch_torch_mask() as hits:
        mask = fn(T)
    if hits:
        raise AssertionError("it calls torch.nn.Transformer.generate_square_subsequent_mask, PyTorch's own causal mask")
    return mask


def run(fn, case):
    import torch

    from ...reference import scaled_dot_product_attention

    mask = _mask(fn, case["T"])
    if "x" not in case:
        return {"mask": mask}
    if type(mask) is not torch.Tensor:
        raise AssertionError(f"causal_mask({case['T']}) is a {type(mask).__name__}, not a torch.Tensor")
    x, W = case["x"], case["W"]
    output, weights = scaled_dot_product_attention(x @ W[0], x @ W[1], x @ W[2], mask)
    return {"output": output, "weights": weights}


def cases(rng: np.random.Generator) -> list:
    out = []
    other = int(rng.choice([2, 3, 5, 6, 7]))
    for T in (4, other):
        out.append({"label": f"causal_mask({T})", "tags": ("seed",), "T": T})
    for T in (1, 3, 7, *(int(t) for t in rng.integers(8, 41, size=2))):
        out.append({"label": f"causal_mask({T})", "tags": ("shapes",), "T": T})
    for T in (1, 2, 3, 5, 6, 9, 17, 32, int(rng.integers(10, 33))):
        out.append({"label": f"causal_mask({T})", "tags": ("values",), "T": T})
    for B, T, d, dtype in ((2, 5, 4, "float32"), (1, 1, 3, "float32"), (3, 8, 6, "float64"), (2, 12, 8, "float32"),
                           (1, int(rng.integers(9, 17)), 4, "float64")):
        out.append({"label": f"causal_mask({T}) added to the {dtype} attention scores of {B} sequences of {T} tokens",
                    "tags": ("peek",), "T": T, "x": normal(rng, (B, T, d), dtype),
                    "W": normal(rng, (3, d, d), dtype, d ** -0.5)})
    return out


def exactly(case, got, want):
    """Exactly 0 on and below the diagonal and exactly -inf above (as the test says)."""
    g, w = arrays(got)["mask"], arrays(want)["mask"]
    if not np.array_equal(g, w):
        i, j = (int(v) for v in np.argwhere(g != w)[0])
        return f"mask[{i}, {j}] is {float(g[i, j])!r}, expected exactly {float(w[i, j])!r}"
    return None


CELLS = {
    "test_seed_mask": aspect("seed", also=exactly),
    "test_shapes_and_dtype": aspect("shapes", mode="structure"),
    "test_values": aspect("values", also=exactly),
    "test_no_peeking": aspect("peek"),
}

register(Probe("causal_mask", cases, run, reference=causal_mask, forbidden=mask_checks.FORBIDDEN, cells=CELLS))
