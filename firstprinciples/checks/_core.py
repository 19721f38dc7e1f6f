"""Shared machinery of the checks: comparing tensors and naming mistakes.

Every check raises ``AssertionError`` with a message written for the student:
what is wrong (type, shape, dtype, which entry, by how much) and, when the
answer's output equals that of a known buggy variant, which mistake it is.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Mistake:
    """A typical wrong answer: ``fn`` has the exercise's signature."""

    label: str
    hint: str
    fn: Callable


# Tolerances, by dtype: (atol, rtol).
# float32 keeps about 7 significant digits; a correct answer may order its sums
# differently from the reference (a d_k-term dot product, a T-term softmax sum),
# which moves results by a few units of 1e-7 relative. 1e-5 / 1e-4 leaves room
# for any correct order, while every known mistake moves values by more than 1e-3.
# float64 keeps about 16 digits, so 1e-10 / 1e-8 is just as generous there.
TOLERANCES = {
    torch.float32: (1e-5, 1e-4),
    torch.float64: (1e-10, 1e-8),
}


def tolerance(dtype):
    return TOLERANCES.get(dtype, TOLERANCES[torch.float32])


def fmt(x):
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def exact(x):
    """A number printed exactly (the shortest text that reads back as the same float), for messages
    about values that must be exactly 0 or 1: 0.999999999 is not "1", and 1e-300 is not "0"."""
    return repr(float(x))


def expect_tensor(name, value):
    if not isinstance(value, torch.Tensor):
        raise AssertionError(
            f"{name} should be a torch.Tensor, but it is a {type(value).__name__}. "
            "Build it with torch operations (not numpy, not Python lists)."
        )
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        raise AssertionError(f"{name} should be a plain torch.Tensor, not a {type(value).__name__}.")
    return value


def unpack(result, names):
    """Check that a function returned a tuple of len(names) tensors."""
    if len(names) == 1:
        return (expect_tensor(names[0], result),)
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        raise AssertionError(
            f"Your function should return a tuple ({', '.join(names)}), "
            f"but it returned {type(result).__name__}"
            + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
            + "."
        )
    return tuple(expect_tensor(n, r) for n, r in zip(names, result))


def check_order(outputs, names, shapes):
    """Fail with a clear message when a returned tuple is in the wrong order.

    ``shapes``: the expected shape of each output, None where it is not known. The
    outputs are in the wrong order when some other order puts every known shape in its
    place and this one does not (``return weights, output`` instead of ``output, weights``).
    """
    import itertools

    got = [tuple(o.shape) for o in outputs]

    def fits(order):
        return all(want is None or tuple(want) == got[i] for i, want in zip(order, shapes))

    if len(outputs) < 2 or fits(range(len(outputs))):
        return
    for order in itertools.permutations(range(len(outputs))):
        if fits(order) and any(shapes[j] is not None for j in range(len(order)) if order[j] != j):
            returned = ", ".join(names[order.index(i)] for i in range(len(names)))
            want = ", ".join(f"{n} {tuple(sh)}" if sh is not None else n for n, sh in zip(names, shapes))
            raise AssertionError(
                f"Your answer returns its results in the wrong order: ({returned}) instead of "
                f"({', '.join(names)}). Return them in that order: {want}. "
                f"(Yours have shapes {', '.join(str(g) for g in got)}.)"
            )


def close(a, b, atol, rtol):
    """True when a and b have the same shape and agree (NaN/inf positions included)."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    return bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True))


def assert_matches(name, got, expected, *, atol=None, rtol=None, context="", check_dtype=True):
    """Compare one tensor with its expected value; explain the first difference."""
    expect_tensor(name, got)
    where = f" {context}" if context else ""
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{name}{where} has shape {tuple(got.shape)} but should have shape {tuple(expected.shape)}."
        )
    if check_dtype and got.dtype != expected.dtype:
        raise AssertionError(
            f"{name}{where} has dtype {got.dtype} but should keep the input's dtype {expected.dtype}."
        )
    if got.device != expected.device:
        raise AssertionError(f"{name}{where} is on {got.device} but the inputs are on {expected.device}.")
    d_atol, d_rtol = tolerance(expected.dtype)
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    g = got.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    bad_finite = ~torch.isfinite(g) & torch.isfinite(e)
    if bad_finite.any():
        idx = tuple(int(i) for i in bad_finite.nonzero()[0])
        raise AssertionError(
            f"{name}{where} has a non-finite entry: {name}{list(idx)} = {g[idx].item()} "
            f"where {fmt(e[idx].item())} was expected ({int(bad_finite.sum())} such entries). "
            "Look for overflow in exp() or for -inf reaching a place it should not."
        )
    if not torch.allclose(g, e, atol=atol, rtol=rtol, equal_nan=True):
        err = (g - e).abs().nan_to_num(nan=float("inf"))
        excess = err - (atol + rtol * e.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))
        idx = tuple(int(i) for i in torch.nonzero(excess == excess.max())[0])
        raise AssertionError(
            f"{name}{where} is wrong: {name}{list(idx)} = {fmt(g[idx].item())} but should be "
            f"{fmt(e[idx].item())} (off by {fmt(err[idx].item())}; tolerance atol={atol:g}, rtol={rtol:g}). "
            f"Largest difference over all entries: {fmt(err.max().item())}."
        )


def _outputs(fn, args, kwargs):
    try:
        with torch.no_grad():
            res = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **(kwargs or {}))
    except Exception:
        return None
    return res if isinstance(res, tuple) else (res,)


def _same(outputs, res):
    return (
        res is not None
        and len(res) == len(outputs)
        and all(close(o, r, *tolerance(r.dtype)) for o, r in zip(outputs, res))
    )


def diagnose(outputs, args, mistakes: Sequence[Mistake], reference, kwargs=None, *, answer=None, confirm=()):
    """Name the known mistakes whose outputs equal the student's ``outputs``.

    A mistake that gives the right answer on these inputs (say "mask ignored"
    when there is no mask) cannot be told apart here and is not named.
    ``confirm``: more inputs, ``(args, kwargs)``, on which ``answer`` (the student's function) must
    also give a named mistake's outputs: inputs on which mistakes that agree here differ (with
    tiled attention one key at a time, key positions counted within each block are never
    after a query's, as if causal were ignored; blocks of two tell them apart).
    """
    right = _outputs(reference, args, kwargs)
    found = [m for m in mistakes if _same(outputs, res := _outputs(m.fn, args, kwargs)) and not _same(res, right)]
    for more_args, more_kwargs in confirm if found else ():
        theirs = _outputs(answer, more_args, more_kwargs)
        found = [m for m in found if theirs is not None and _same(theirs, _outputs(m.fn, more_args, more_kwargs))]
    return found


def with_diagnosis(check, outputs, args, mistakes, reference, kwargs=None):
    """Run ``check()``; if it fails, append the mistakes the outputs match."""
    try:
        check()
    except AssertionError as err:
        found = diagnose(outputs, args, mistakes, reference, kwargs)
        if found:
            lines = "\n".join(f"  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"{err}\nYour output matches a typical mistake:\n{lines}") from None
        raise


def call_answer(fn, args, kwargs=None, *, names, forbidden, shapes=None):
    """Call the student's ``fn`` on copies of the inputs, under ``forbidden``.

    Fails if the answer calls a forbidden built-in, modifies an input in place,
    or does not return ``len(names)`` tensors, or (given ``shapes``, see
    ``check_order``) returns them in the wrong order. Returns the unpacked outputs.
    """
    from ..guard import call_without

    kwargs = kwargs or {}
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    kw_copies = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    result = call_without(fn, copies, kw_copies, **forbidden)
    labelled = list(zip(range(len(args)), args, copies)) + [(k, kwargs[k], kw_copies[k]) for k in kwargs]
    for key, orig, seen in labelled:
        if isinstance(orig, torch.Tensor) and not torch.equal(orig, seen):
            which = f"argument {key}" if isinstance(key, str) else f"argument number {key + 1}"
            raise AssertionError(
                f"Your function modified its input ({which}) in place. Build new tensors instead "
                "(for example `x = x / s` rather than `x /= s` or `x.div_(s)`)."
            )
    outputs = unpack(result, names)
    if shapes is not None:
        check_order(outputs, names, shapes)
    return outputs


def assert_gradcheck(fn, inputs, *, what, fast=False):
    """Fail unless autograd's gradients of ``fn(*inputs)`` equal finite differences.

    Each float64 input that requires grad is perturbed by 1e-6 and the central
    differences of the outputs are compared with autograd's Jacobian, entry by
    entry, as ``torch.autograd.gradcheck`` does and with its tolerances (atol 1e-5,
    rtol 1e-3): for a differentiable answer the two agree to about 1e-8, while a
    step that breaks autograd is off by order 1. ``fast=True`` compares along one
    random unit direction per input and per output instead (seeded here, as
    gradcheck's fast mode). The outputs compared are those that require grad (with
    none at all, every central difference must be zero). Written here rather than
    calling gradcheck, which hands autograd explicit output gradients and so
    imports sympy (through torch.fx's symbolic shapes: 0.3-0.5 s) in every kernel
    that runs this check. ``what`` names the gradients for the message, e.g. "your
    output with respect to x".
    """
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            ok = _gradients_match(fn, tuple(inputs), fast)
    except (RuntimeError, AssertionError) as err:
        raise AssertionError(f"Gradients could not be checked: {err}") from None
    if not ok:
        raise AssertionError(
            f"The gradients of {what} do not match what small changes of the inputs produce: some step "
            "breaks autograd (a detach, a round trip through numpy or Python numbers, or an in-place change)."
        )


GRADCHECK_EPS, GRADCHECK_ATOL, GRADCHECK_RTOL = 1e-6, 1e-5, 1e-3  # torch.autograd.gradcheck's defaults


def _tensors(out) -> list:
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]


def _gradients_match(fn, inputs: tuple, fast: bool) -> bool:
    """autograd's Jacobian of ``fn`` at ``inputs`` (``fast``: its products with random unit
    directions) against central differences, within torch.autograd.gradcheck's tolerances."""
    leaves = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not leaves:
        raise AssertionError("no input requires grad")
    outs = _tensors(fn(*inputs))
    wanted = [k for k, o in enumerate(outs) if o.requires_grad]

    def central(i: int, step: torch.Tensor) -> list:
        """(the outputs at inputs[i] + step - those at inputs[i] - step) / 2 eps."""
        with torch.no_grad():
            x = inputs[i].detach()
            plus = _tensors(fn(*inputs[:i], x + step, *inputs[i + 1:]))
            minus = _tensors(fn(*inputs[:i], x - step, *inputs[i + 1:]))
        if len(plus) != len(outs) or len(minus) != len(outs):
            raise AssertionError("the function returned a different number of tensors for nearby inputs")
        return [(p.double() - m.double()) / (2 * GRADCHECK_EPS) for p, m in zip(plus, minus)]

    def close(analytic: torch.Tensor, numeric: torch.Tensor) -> bool:
        return bool(torch.allclose(analytic, numeric, rtol=GRADCHECK_RTOL, atol=GRADCHECK_ATOL))

    def unit(like: torch.Tensor) -> torch.Tensor:
        v = torch.randn(like.shape, dtype=torch.float64)
        return v / v.norm() if v.norm() > 0 else v

    if not wanted:  # nothing differentiable: no change of an input may change an output
        return all(close(torch.zeros_like(n), n) for i in leaves
                   for n in central(i, (GRADCHECK_EPS * unit(inputs[i])).to(inputs[i].dtype)))
    xs = [inputs[i] for i in leaves]
    if fast:  # one backward pass per output k: the gradient of <out_k, v_k>, v_k a random unit vector
        directions = {i: unit(inputs[i]) for i in leaves}
        for k in wanted:
            v = unit(outs[k])
            grads = torch.autograd.grad((outs[k] * v.to(outs[k].dtype)).sum(), xs, retain_graph=True,
                                        allow_unused=True)
            for i, grad in zip(leaves, grads):
                u = directions[i]
                analytic = torch.zeros((), dtype=torch.float64) if grad is None else (grad.double() * u).sum()
                numeric = (central(i, (GRADCHECK_EPS * u).to(inputs[i].dtype))[k] * v).sum()
                if not close(analytic, numeric):
                    return False
        return True
    for i in leaves:  # the whole Jacobian: a column of central differences per input entry ...
        x = inputs[i]
        numeric = {k: torch.empty(x.numel(), outs[k].numel(), dtype=torch.float64) for k in wanted}
        for e in range(x.numel()):
            step = torch.zeros(x.numel(), dtype=x.dtype)
            step[e] = GRADCHECK_EPS
            diffs = central(i, step.reshape(x.shape))
            for k in wanted:
                numeric[k][e] = diffs[k].reshape(-1)
        for k in wanted:  # ... and a row of autograd's per output entry (a backward pass of a scalar)
            flat = outs[k].reshape(-1)
            analytic = torch.zeros_like(numeric[k])
            for j in range(flat.numel()):
                (grad,) = torch.autograd.grad(flat[j], [x], retain_graph=True, allow_unused=True)
                if grad is not None:
                    analytic[:, j] = grad.double().reshape(-1)
            if not close(analytic, numeric[k]):
                return False
    return True
