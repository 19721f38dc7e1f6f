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
