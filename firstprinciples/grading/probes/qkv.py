"""Probes for ``project_qkv`` and ``dot_product_scores``.

Also the helpers that the probes of the other plain functions (rnn, position,
encoder_decoder) share: ``runner`` (``call_runner`` plus a shape-agnostic
gradient mode) and ``grad_case``.

The gradient mode: the checks' gradient tests (``gradcheck`` of the answer
against finite differences of the answer itself) accept an answer with wrong
values, and even wrong output shapes, as long as its gradients are honest. So a
gradient case does not compare the outputs with the reference: it weights each
output by random numbers drawn for *its own* shape (``loss_seed``), back-
propagates that scalar, and reports the gradients (which must exist, with the
inputs' shapes and dtypes), the outputs' dtypes and types (as empty tensors),
the inputs after the call, and the central finite difference of the same
scalar along the case's directions (``honest_gradients``).
"""
from __future__ import annotations

import numpy as np

from ...checks import qkv as qkv_checks
from ...reference import dot_product_scores, project_qkv
from . import FD_STEP, Probe, aspect, call_runner, honest_gradients, normal, register, with_directions


# ---------------------------------------------------------------- shared helpers
def _fresh(value):
    import torch

    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _as_outputs(result, n):
    """The returned outputs as a tuple of ``n`` (None: the wrong structure)."""
    if n == 1:
        return (result,)
    if isinstance(result, (tuple, list)) and len(result) == n:
        return tuple(result)
    return None


def _structure(result, outputs) -> str:
    kind = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
    return f"it returned a {kind}, expected a tuple ({', '.join(outputs)})"


def _weighted(outs, seed):
    """sum_i <out_i, w_i> with w_i random numbers of out_i's own shape (seeded: the same in every process)."""
    import torch

    g = torch.Generator().manual_seed(int(seed))
    total = None
    for o in outs:
        w = torch.randn(tuple(o.shape), generator=g, dtype=torch.float64).to(o.dtype)
        term = (o * w).sum()
        total = term if total is None else total + term
    return total


def _call(fn, inputs, args, kwargs):
    return fn(*[inputs[n] for n in args], **{n: inputs[n] for n in kwargs if n in inputs})


def _loss_run(fn, case, args, kwargs, outputs, grad, loss_outputs):
    import torch

    inputs = {n: _fresh(case[n]) for n in (*args, *kwargs) if n in case}
    for n in grad:
        inputs[n].requires_grad_(True)
    result = _call(fn, inputs, args, kwargs)
    outs = _as_outputs(result, len(outputs))
    if outs is None:
        raise AssertionError(_structure(result, outputs))
    for name, o in zip(outputs, outs):
        if type(o) is not torch.Tensor:
            raise AssertionError(f"{name} is a {type(o).__name__}, not a torch.Tensor")
    used = outs[:loss_outputs]
    for name, o in zip(outputs, used):
        if not o.requires_grad:
            what = "the output" if name == "output" else f"the output {name}"
            raise AssertionError(f"{what} is not connected to the inputs' gradients")
    loss = _weighted(used, case["loss_seed"])
    grads = torch.autograd.grad(loss, [inputs[n] for n in grad], allow_unused=True)
    for n, g in zip(grad, grads):
        if g is None:
            raise AssertionError(f"no gradient reaches {n}: is {n} used in the computation?")
    res = {f"grad_{n}": g for n, g in zip(grad, grads)}
    res.update({f"{name} (its type and dtype)": o.detach().reshape(-1)[:0] for name, o in zip(outputs, outs)})
    if all(f"dir_{n}" in case for n in grad):
        def scalar(sign):
            moved = {n: _fresh(case[n]) for n in (*args, *kwargs) if n in case}
            for n in grad:
                moved[n] = moved[n] + sign * FD_STEP * case[f"dir_{n}"]
            with torch.no_grad():
                again = _as_outputs(_call(fn, moved, args, kwargs), len(outputs))
            if again is None:
                raise AssertionError("the outputs changed structure between calls")
            return _weighted(again[:loss_outputs], case["loss_seed"]).to(torch.float64)

        res["fd"] = (scalar(1.0) - scalar(-1.0)) / (2 * FD_STEP)
    res.update({f"{n} after the call": inputs[n].detach() for n in inputs if isinstance(inputs[n], torch.Tensor)})
    return res


def runner(args: tuple, kwargs: tuple = (), outputs: tuple = ("output",), grad: tuple = (), loss_outputs: int | None = None):
    """``call_runner(args, kwargs, outputs)`` for value cases; for a case holding ``loss_seed``,
    the shape-agnostic gradient mode (see the module docstring) on the first ``loss_outputs``
    outputs (all by default) with respect to the ``grad`` inputs."""
    plain = call_runner(args, kwargs, outputs)
    n_loss = len(outputs) if loss_outputs is None else loss_outputs

    def run(fn, case):
        if "loss_seed" in case:
            return _loss_run(fn, case, args, kwargs, outputs, grad, n_loss)
        res = plain(fn, case)
        if "returned" in res and len(outputs) > 1:
            raise AssertionError(_structure(res["returned"], outputs))
        return res

    return run


def grad_case(rng, case: dict, names) -> dict:
    """Mark ``case`` as a gradient case (float64 inputs: with finite-difference directions)."""
    case["loss_seed"] = int(rng.integers(0, 2**31 - 1))
    if all(case[n].dtype == np.float64 for n in names):
        with_directions(rng, case, names)
    return case


# ---------------------------------------------------------------- project_qkv
def _projection(rng, B, T, d_model, d_k, d_v, dtype):
    return {"x": normal(rng, (B, T, d_model), dtype),
            **{n: normal(rng, (d_model, d), dtype, d_model ** -0.5) for n, d in (("W_q", d_k), ("W_k", d_k), ("W_v", d_v))}}


def _project_label(dtype, B, T, d_model, d_k, d_v):
    return f"{dtype} x {(B, T, d_model)}, W_q and W_k {(d_model, d_k)}, W_v {(d_model, d_v)}"


def project_cases(rng: np.random.Generator) -> list:
    cases = []
    # the worked example's sizes (x (1, 3, 3), each W (3, 2)), fresh numbers
    for _ in range(2):
        cases.append({"label": _project_label("float64", 1, 3, 3, 2, 2), "tags": ("worked",),
                      **_projection(rng, 1, 3, 3, 2, 2, "float64")})
    # the shapes test's sizes: square, d_k != d_v, one token; both dtypes
    for dtype in ("float32", "float64"):
        for sizes in qkv_checks.PROJECT_SHAPES:
            cases.append({"label": _project_label(dtype, *sizes), "tags": ("shapes",), **_projection(rng, *sizes, dtype)})
    # random sizes (one square), both dtypes
    for dtype in ("float32", "float64"):
        d = int(rng.integers(2, 7))
        drawn = [(int(rng.integers(1, 4)), int(rng.integers(1, 8)), d, d, d)]
        for _ in range(3):
            drawn.append(tuple(int(v) for v in (rng.integers(1, 4), rng.integers(1, 8), *rng.integers(1, 10, size=3))))
        for sizes in drawn:
            cases.append({"label": _project_label(dtype, *sizes), "tags": ("random",), **_projection(rng, *sizes, dtype)})
    # gradients: square weights (as the check), float64
    for sizes in ((2, 2, 3, 3, 3), (1, 3, 2, 2, 2)):
        case = {"label": "the gradients for " + _project_label("float64", *sizes), "tags": ("grads",),
                **_projection(rng, *sizes, "float64")}
        cases.append(grad_case(rng, case, ("x", "W_q", "W_k", "W_v")))
    return cases


PROJECT_CELLS = {
    "test_project_worked_example": aspect("worked"),
    "test_project_shapes": aspect("shapes"),
    "test_project_random": aspect("random"),
    "test_project_gradients_and_inputs": aspect("grads", mode="structure", also=honest_gradients),
}


# ---------------------------------------------------------------- dot_product_scores
def _scores(rng, lead, T_q, T_k, d_k, dtype):
    return {"Q": normal(rng, (*lead, T_q, d_k), dtype), "K": normal(rng, (*lead, T_k, d_k), dtype)}


def _scores_label(dtype, lead, T_q, T_k, d_k):
    return f"{dtype} Q {(*lead, T_q, d_k)}, K {(*lead, T_k, d_k)}"


def scores_cases(rng: np.random.Generator) -> list:
    cases = []
    # the worked example's sizes (3 tokens, d_k = 2, no batch), fresh numbers
    for _ in range(2):
        cases.append({"label": _scores_label("float64", (), 3, 3, 2), "tags": ("worked",),
                      **_scores(rng, (), 3, 3, 2, "float64")})
    # the batched test's sizes (chosen so that the batching mistakes run), both dtypes
    for dtype in ("float32", "float64"):
        for lead, T_q, T_k, d_k in qkv_checks.SCORES_SHAPES:
            cases.append({"label": _scores_label(dtype, lead, T_q, T_k, d_k), "tags": ("batched",),
                          **_scores(rng, lead, T_q, T_k, d_k, dtype)})
    # random sizes, from no leading dimension to three
    for dtype in ("float32", "float64"):
        for n_lead in (0, 1, 2, 3):
            lead = tuple(int(v) for v in rng.integers(1, 4, size=n_lead))
            T_q, T_k, d_k = (int(v) for v in rng.integers(1, 8, size=3))
            cases.append({"label": _scores_label(dtype, lead, T_q, T_k, d_k), "tags": ("random",),
                          **_scores(rng, lead, T_q, T_k, d_k, dtype)})
    # gradients: every size equal (as the check, so that the batching mistakes run), float64
    for lead, T_q, T_k, d_k in (((3,), 3, 3, 3), ((2, 2), 2, 2, 2)):
        case = {"label": "the gradients for " + _scores_label("float64", lead, T_q, T_k, d_k), "tags": ("grads",),
                **_scores(rng, lead, T_q, T_k, d_k, "float64")}
        cases.append(grad_case(rng, case, ("Q", "K")))
    return cases


SCORES_CELLS = {
    "test_scores_worked_example": aspect("worked"),
    "test_scores_batched": aspect("batched"),
    "test_scores_random": aspect("random"),
    "test_scores_gradients_and_inputs": aspect("grads", mode="structure", also=honest_gradients),
}

register(
    Probe("project_qkv", project_cases,
          runner(("x", "W_q", "W_k", "W_v"), outputs=("Q", "K", "V"), grad=("x", "W_q", "W_k", "W_v")),
          reference=project_qkv, forbidden=qkv_checks.FORBIDDEN_PROJECT, cells=PROJECT_CELLS),
    Probe("dot_product_scores", scores_cases, runner(("Q", "K"), outputs=("scores",), grad=("Q", "K")),
          reference=dot_product_scores, forbidden=qkv_checks.FORBIDDEN_SCORES, cells=SCORES_CELLS),
)
