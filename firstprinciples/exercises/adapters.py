"""Adapters: how a graded piece is called on a case, the only course code that runs beside it.

An adapter ``run(piece, case) -> {result name: value}`` calls the student's piece (or, in the
grader, the course's reference) on one case's inputs (torch tensors, fresh copies) and returns
named results: the outputs, the inputs' gradients for an upstream gradient ``grad_out``, and each
tensor input as it is after the call (an answer must leave its inputs alone). It imports torch
only: it runs in the student's kernel and in the re-check's runner, where nothing that decides a
verdict may be.
"""
from __future__ import annotations


def _fresh(value):
    import torch

    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def call_runner(args: tuple, kwargs: tuple = (), outputs: tuple = ("output",), grad: tuple = ()):
    """A ``run`` for a function: call it with the case's ``args`` (positional) and
    ``kwargs`` (by keyword, when present in the case) and report

    - each output (``outputs`` names the items of a returned tuple);
    - with ``grad`` (names of inputs) and when the case holds ``grad_out``
      (the upstream gradient of the first output): the gradient of each named input;
    - every tensor input after the call (an answer must not change its inputs);
    - when the case also holds ``dir_<name>`` for the ``grad`` inputs: ``fd``, the
      central finite difference of the first output along those directions,
      weighted by ``grad_out`` (for ``honest_gradients``; float64 cases).
    """
    import torch

    def run(fn, case):
        inputs = {n: _fresh(case[n]) for n in (*args, *kwargs) if n in case}
        backward = "grad_out" in case and grad
        if backward:
            for n in grad:
                inputs[n].requires_grad_(True)
        result = fn(*[inputs[n] for n in args], **{n: inputs[n] for n in kwargs if n in inputs})
        if len(outputs) == 1:
            res = {outputs[0]: result}
        elif isinstance(result, (tuple, list)) and len(result) == len(outputs):
            res = dict(zip(outputs, result))
        else:
            return {"returned": result}  # the wrong structure: reported as such
        if backward:
            first = res[outputs[0]]
            if not isinstance(first, torch.Tensor) or not first.requires_grad:
                raise AssertionError(
                    f"the output does not require grad although {', '.join(grad)} does: gradients cannot flow back. "
                    "Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside "
                    "the function.")
            leaves = [inputs[n] for n in grad]
            for leaf, g in zip(leaves, vector_jacobian(first, leaves, case["grad_out"].to(first.dtype))):
                if g is not None:  # accumulated, as first.backward(grad_out) does
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
            res.update({f"grad_{n}": inputs[n].grad for n in grad})
            if all(f"dir_{n}" in case for n in grad):
                res["fd"] = _finite_difference(fn, case, args, kwargs, outputs, grad)
        res.update({f"{n} after the call": inputs[n].detach() for n in inputs if isinstance(inputs[n], torch.Tensor)})
        return res

    return run


def vector_jacobian(outputs, inputs, upstream):
    """``torch.autograd.grad(outputs, inputs, upstream, allow_unused=True)``: the gradients of the
    inputs given the upstream gradient of each output (a tensor, or one per output), computed as
    those of sum(output * upstream), whose gradient with respect to each output is its upstream
    gradient exactly (times 1.0). The same numbers, without what autograd imports when it is
    handed explicit output gradients: sympy, through torch.fx's symbolic shapes (0.3-0.5 s in
    every runner and in the trusted side). A shape that does not match, or an output that does
    not require grad, raises as autograd would."""
    import torch

    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    upstream = list(upstream) if isinstance(upstream, (list, tuple)) else [upstream]
    for i, (out, up) in enumerate(zip(outputs, upstream)):
        if out.shape != up.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of {up.shape} and output[{i}] has a "
                               f"shape of {out.shape}.")
        if not out.requires_grad:
            raise RuntimeError(f"element {i} of tensors does not require grad and does not have a grad_fn")
    total = sum((out * up).sum() for out, up in zip(outputs, upstream))
    return torch.autograd.grad(total, list(inputs), allow_unused=True)


FD_STEP = 1e-6


def _finite_difference(fn, case, args, kwargs, outputs, grad):
    import torch

    def first(sign):
        inputs = {n: _fresh(case[n]) for n in (*args, *kwargs) if n in case}
        for n in grad:
            inputs[n] = inputs[n] + sign * FD_STEP * case[f"dir_{n}"]
        with torch.no_grad():
            result = fn(*[inputs[n] for n in args], **{n: inputs[n] for n in kwargs if n in inputs})
        return result if len(outputs) == 1 else result[0]

    plus, minus = first(1.0), first(-1.0)
    return ((plus - minus) / (2 * FD_STEP) * case["grad_out"]).sum().to(torch.float64)


# ---------------------------------------------------------------- the shape-agnostic gradient mode
# A gradient test judges an answer's gradients against its *own* outputs, whatever their values
# (and even their shapes): an answer with wrong values but honest gradients keeps that test and
# loses the ones that compare values. So a gradient case (one that holds ``loss_seed``) does not
# compare outputs with the reference: it weights each output by random numbers drawn for its own
# shape, back-propagates that scalar, and reports the gradients (which must exist, with the inputs'
# shapes and dtypes), each output's type and dtype (as an empty tensor), the inputs after the call
# and, for float64 inputs with directions ``dir_<name>``, the central finite difference ``fd`` of
# the same scalar along them (the grader compares it with the gradients: ``honest_gradients``).


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


def _loss_run(fn, case, args, kwargs, outputs, grad, loss_outputs, missing_as_none):
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
            raise AssertionError(
                f"{what} does not require grad although the inputs do: it is not connected to the inputs' "
                "gradients. Avoid .detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() "
                "inside the function.")
    loss = _weighted(used, case["loss_seed"])
    grads = torch.autograd.grad(loss, [inputs[n] for n in grad], allow_unused=True)
    for n, g in zip(grad, grads):
        if g is None and not missing_as_none:
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


def runner(args: tuple, kwargs: tuple = (), outputs: tuple = ("output",), grad: tuple = (),
           loss_outputs: int | None = None, missing_as_none: bool = False):
    """``call_runner(args, kwargs, outputs)`` for value cases; for a case holding ``loss_seed``,
    the shape-agnostic gradient mode (above) on the first ``loss_outputs`` outputs (all by
    default) with respect to the ``grad`` inputs. A wrong structure (not a tuple of ``outputs``)
    raises. An input that no gradient reaches raises, or with ``missing_as_none`` is reported as
    ``grad_<name>: None`` (for a declaration, whose property can then name the mistake)."""
    plain = call_runner(args, kwargs, outputs)
    n_loss = len(outputs) if loss_outputs is None else loss_outputs

    def run(fn, case):
        if "loss_seed" in case:
            return _loss_run(fn, case, args, kwargs, outputs, grad, n_loss, missing_as_none)
        res = plain(fn, case)
        if "returned" in res and len(outputs) > 1:
            raise AssertionError(_structure(res["returned"], outputs))
        return res

    return run


def grad_case(rng, case: dict, names) -> dict:
    """Mark ``case`` (NumPy inputs) as a gradient case: a ``loss_seed`` and, for float64 inputs,
    a random direction ``dir_<name>`` per gradient input (for the finite difference)."""
    import numpy as np

    case["loss_seed"] = int(rng.integers(0, 2**31 - 1))
    if all(case[n].dtype == np.float64 for n in names):
        for n in names:
            case[f"dir_{n}"] = rng.standard_normal(case[n].shape).astype(case[n].dtype)
    return case


def honest_gradients(case, out, want):
    """A declaration's property for the gradient mode, on plain data: every input named by a
    ``grad_<name>`` result is reached by a gradient, and the directional derivative from the
    gradients matches the central finite difference ``fd`` to 1e-6 relative (float64: the
    difference's truncation error is about 1e-12 and its rounding error about 1e-10 with a step
    of 1e-6). Wrong values with honest gradients pass."""
    missing = [k[5:] for k in want if k.startswith("grad_") and k not in out]
    if missing:
        return f"no gradient reaches {missing[0]}: is {missing[0]} used in the computation?"
    if "fd" not in out:
        return None
    analytic = sum(float((out[k].astype("float64") * case["dir_" + k[5:]]).sum()) for k in out if k.startswith("grad_"))
    fd = float(out["fd"])
    if analytic != analytic or abs(analytic - fd) > 1e-6 * (1 + abs(fd)):
        return (f"its gradients do not match its own outputs: along a random direction they give {analytic:.6g}, "
                f"finite differences of the outputs give {fd:.6g}. Gradients computed by hand, or a result "
                "built partly outside autograd, do this.")
    return None
