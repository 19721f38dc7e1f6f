"""The checks' own gradient check (``assert_gradcheck``) decides as ``torch.autograd.gradcheck``
does, without importing what gradcheck imports (sympy, through torch.fx's symbolic shapes)."""
import subprocess
import sys

import pytest
import torch

from firstprinciples.checks._core import assert_gradcheck


class _ExpWrongBackward(torch.autograd.Function):
    """exp with the derivative of x**2 / 2: a hand-written backward that is wrong."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a.exp()

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return g * a


class _ExpRightBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        out = a.exp()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        return g * out


def _attention(q, k, v):
    w = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
    return w @ v, w


def _scaled_in_place(q, k, v):  # an in-place change of an intermediate: autograd handles it
    s = (q @ k.transpose(-2, -1)).clone()
    s.mul_(0.5)
    return torch.softmax(s, dim=-1) @ v


RIGHT = {
    "attention (output and weights)": _attention,
    "attention output only": lambda q, k, v: _attention(q, k, v)[0],
    "weights returned detached beside a differentiable output": lambda q, k, v: (
        _attention(q, k, v)[0], _attention(q, k, v)[1].detach()),
    "a hand-written backward that is right": lambda q, k, v: _ExpRightBackward.apply(q) @ v.transpose(-2, -1),
    "an in-place step on an intermediate": _scaled_in_place,
    "layer norm": lambda q, k, v: torch.nn.functional.layer_norm(q + k, q.shape[-1:]),
}
WRONG = {
    "detached keys": lambda q, k, v: torch.softmax(q @ k.detach().transpose(-2, -1), -1) @ v,
    "a round trip through Python numbers": lambda q, k, v: torch.tensor(
        (q @ k.transpose(-2, -1)).tolist(), dtype=q.dtype),
    "a round trip through numpy, then re-attached to v only": lambda q, k, v: torch.from_numpy(
        torch.softmax(q @ k.transpose(-2, -1), -1).detach().numpy()) @ v,
    "a hand-written backward that is wrong": lambda q, k, v: _ExpWrongBackward.apply(q) @ v.transpose(-2, -1),
    "gradient scaled by two": lambda q, k, v: q + (q - q.detach()) + k + v,
}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 3, 4, generator=g, dtype=torch.float64).requires_grad_(True) for _ in range(3))


def _torch_says(fn, inputs, fast):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.autograd.gradcheck(fn, inputs, raise_exception=False, fast_mode=fast)


@pytest.mark.parametrize("fast", [False, True], ids=["full", "fast"])
@pytest.mark.parametrize("name", sorted(RIGHT))
def test_a_right_gradient_passes_as_with_gradcheck(name, fast):
    inputs = _inputs()
    assert _torch_says(RIGHT[name], inputs, fast), "(the case itself is wrong)"
    assert_gradcheck(RIGHT[name], inputs, what="the output", fast=fast)


@pytest.mark.parametrize("fast", [False, True], ids=["full", "fast"])
@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_gradient_fails_as_with_gradcheck(name, fast):
    inputs = _inputs()
    assert not _torch_says(WRONG[name], inputs, fast), "(the case itself is right)"
    with pytest.raises(AssertionError, match="do not match what small changes of the inputs produce"):
        assert_gradcheck(WRONG[name], inputs, what="the output", fast=fast)


def test_a_function_that_raises_is_reported():
    def broken(q, k, v):
        raise RuntimeError("shapes do not fit")

    with pytest.raises(AssertionError, match="Gradients could not be checked: shapes do not fit"):
        assert_gradcheck(broken, _inputs(), what="the output")


def test_the_check_does_not_import_symbolic_shapes():
    """gradcheck would (0.3-0.5 s in each kernel that runs a gradient test); this one must not."""
    code = (
        "import sys, torch\n"
        "from firstprinciples.checks._core import assert_gradcheck\n"
        "x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)\n"
        "for fast in (False, True):\n"
        "    assert_gradcheck(lambda a: torch.softmax(a, -1), (x,), what='t', fast=fast)\n"
        "print('torch.fx.experimental.symbolic_shapes' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
