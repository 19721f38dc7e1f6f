"""What is left of the probes of ``split_heads``, ``merge_heads`` and ``MultiHeadAttention``: helpers
that the probes of exercises not yet declared import. It registers no probe: the three pieces are
declared in ``firstprinciples.exercises.multi_head_attention``, whose probe the re-check makes from
the declaration (``probes.from_declaration``).

Who still uses what (each goes when its last user is declared):

- ``grading.probes.block``: ``build_module``, ``causal``, ``forward_and_gradients``,
  ``masked_weights_are_zero``, ``nothing``, ``returned_pair``, ``scalars_and_honest_gradients``,
  ``try_forward``;
- ``grading.probes.modern_block``: ``build_module``, ``causal``, ``masked_weights_are_zero``,
  ``returned_pair``, ``try_forward``;
- ``grading.probes.kv_cache``: ``returned_pair``.
"""
from __future__ import annotations

import numpy as np

from ...checks import multihead as mh_checks
from .. import wire
from . import arrays, aspect, honest_gradients, vector_jacobian

FD_STEP = 1e-6


def returned_pair(result, names=("output", "weights")):
    """The two outputs of a forward that must return a tuple ``(output, weights)``."""
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        what = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise AssertionError(f"it should return a tuple ({', '.join(names)}), but it returned a {what}")
    return tuple(result)


def first_output(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def finite_difference(forward, x, direction, grad_out):
    """Central difference of ``forward`` at ``x`` along ``direction``, weighted by ``grad_out`` (float64)."""
    import torch

    with torch.no_grad():
        plus = first_output(forward(x + FD_STEP * direction))
        minus = first_output(forward(x - FD_STEP * direction))
    return ((plus - minus) / (2 * FD_STEP) * grad_out).sum().to(torch.float64)


def scalars_and_honest_gradients(case, got, want):
    """For a gradient test (compared in "structure" mode): the plain numbers and flags of the
    results (such as the count of parameters that get no gradient, or whether the input is
    unchanged) equal the reference's, and the gradients agree with the answer's own outputs."""
    for key, w in want.items():
        if wire.is_array(w) or "items" in w:
            continue
        g = got.get(key, {})
        if wire.scalar(g) != wire.scalar(w):
            return f"{key} is {wire.scalar(g)!r}, expected {wire.scalar(w)!r}"
    return honest_gradients(case, got, want)


def masked_weights_are_zero(case, got, want):
    """Where the mask is -inf, the weights are exactly 0 (as the causal tests demand)."""
    if "mask" not in case or "weights" not in want:
        return None
    w = arrays(got).get("weights")
    if w is None:
        return None
    hidden = np.broadcast_to(np.isneginf(case["mask"].numpy()), w.shape)
    if np.any(w[hidden] != 0):
        return f"a weight on a masked (-inf) position is {float(np.abs(w[hidden]).max())!r}, not exactly 0"
    return None


# A test cell that only passes the class along (as a type, or as a part of what it grades,
# which another probe re-checks): no case stands for it.
nothing = aspect("(no case: the cell only uses this object as a part of another)")


def causal(T):
    return np.triu(np.full((T, T), -np.inf), k=1)


def build_module(cls, *args, **kwargs):
    """The answer's (or the reference's) module, built as the checks build it (seed 0, the
    caller's random state untouched). The probe's own watcher sees what the build calls."""
    return mh_checks.build(cls, *args, forbidden={}, **kwargs)


def try_forward(module, x):
    """One forward pass whose errors do not matter (a structure test): the watcher still
    records a forbidden call made inside it."""
    try:
        module(x)
    except Exception:
        pass


def forward_and_gradients(m, case, weight_layers):
    """Call ``m(x[, mask])``; for a case with ``grad_out`` also backpropagate it and report the
    gradient of x, the finite difference along ``dir_x``, and how many of ``weight_layers``'
    parameters get no gradient; otherwise the outputs (parameters frozen)."""
    import torch

    x = case["x"].clone()
    kwargs = {"mask": case["mask"]} if "mask" in case else {}
    if "grad_out" not in case:
        m.requires_grad_(False)
        out, w = returned_pair(m(x, **kwargs))
        return {"output": out, "weights": w, "x unchanged": bool(torch.equal(x, case["x"]))}
    leaf = x.clone().requires_grad_(True)
    out, _ = returned_pair(m(leaf, **kwargs))
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise AssertionError("the output is not connected to the gradients of x")
    params = [p for p in weight_layers(m)]
    grads = vector_jacobian(out, [leaf, *params], case["grad_out"].to(out.dtype))
    return {"output": out.detach(), "grad_x": grads[0],
            "parameters without a gradient": sum(g is None for g in grads[1:]),
            "x unchanged": bool(torch.equal(leaf.detach(), case["x"])),
            "fd": finite_difference(lambda t: m(t, **kwargs), case["x"].clone(), case["dir_x"], case["grad_out"])}
