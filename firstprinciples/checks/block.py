"""What is left of the checks of ``FeedForward`` and ``TransformerBlock``, which are declared in
``firstprinciples.exercises.transformer_block``: the capstone's recaps and helpers that the old
checks of exercises not yet declared import. Each goes when its last user is declared.

- the capstone notebook (not declared yet) calls ``check_ffn_values(FeedForward, full=False)``
  (cell ``recap_feed_forward``) and ``check_block_against_reference(TransformerBlock, full=False)``
  (cell ``test_transformer_block``): they run the visible cases of the declaration's recaps
  (``FFN_RECAP``, ``BLOCK_RECAP``), which the re-check judges by the declaration's ``elsewhere``;
- ``checks.capstone`` imports ``TORCH_PATTERNS``, ``block_parameter_count``, ``load_block``,
  ``random_block_parameters`` and ``reference_block`` (the block as a function of its parameters
  P = (ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2));
- ``checks.modern_block`` imports ``_gradient_check``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..guard import call_without
from ..exercises import transformer_block as declared
from ..grading.declared import run_test
from ._student import wrap_checks
from ._core import assert_gradcheck, unpack
from .multihead import load_mha_weights, reference_mha

TORCH_PATTERNS = declared.TORCH_PATTERNS


def block_parameter_count(d_model):
    return 12 * d_model**2 + 9 * d_model


# ---------------------------------------------------------------- reference computations
def reference_ffn(x, W1, b1, W2, b2):
    """GELU(x W1^T + b1) W2^T + b2, the reference FeedForward as a function of its parameters."""
    return F.gelu(x @ W1.T + b1) @ W2.T + b2  # (..., d_model)


def _ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)  # eps 1e-5, as nn.LayerNorm


def reference_block(x, P, n_heads, mask=None):
    """The reference pre-LN block (eval mode) as a function of its parameters
    P = (ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2)."""
    ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2 = P
    a, w = reference_mha(_ln(x, ln1_w, ln1_b), W_q, W_k, W_v, W_o, n_heads, mask)
    x = x + a
    x = x + reference_ffn(_ln(x, ln2_w, ln2_b), W1, b1, W2, b2)
    return x, w


# ---------------------------------------------------------------- structure helpers
def ffn_linears(module, owner="FeedForward"):
    layers = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if len(layers) != 2:
        raise AssertionError(
            f"{owner} should contain exactly two nn.Linear layers (d_model -> 4 * d_model -> d_model); "
            f"it has {len(layers)}."
        )
    up, down = layers
    if up.out_features < up.in_features and down.out_features > down.in_features:
        up, down = down, up  # registered in the other order
    return up, down


def random_ffn_parameters(g, d_model, dtype):
    """W1 (4d, d), b1, W2 (d, 4d), b2: each layer's outputs have variance about 1 for unit inputs."""
    W1 = torch.randn(4 * d_model, d_model, generator=g, dtype=dtype) / math.sqrt(d_model)
    b1 = 0.5 * torch.randn(4 * d_model, generator=g, dtype=dtype)
    W2 = torch.randn(d_model, 4 * d_model, generator=g, dtype=dtype) / math.sqrt(4 * d_model)
    b2 = 0.5 * torch.randn(d_model, generator=g, dtype=dtype)
    return W1, b1, W2, b2


def load_ffn(module, params, owner="FeedForward"):
    W1, b1, W2, b2 = params
    l1, l2 = ffn_linears(module, owner)
    with torch.no_grad():
        for layer, W, b in ((l1, W1, b1), (l2, W2, b2)):
            if tuple(layer.weight.shape) != tuple(W.shape) or layer.bias is None:
                raise AssertionError(
                    f"{owner}'s Linear layers should be Linear(d_model, 4 * d_model) and Linear(4 * d_model, d_model), "
                    f"with biases; one has weight {tuple(layer.weight.shape)}"
                    + ("" if layer.bias is not None else " and no bias") + "."
                )
            layer.weight.copy_(W)
            layer.bias.copy_(b)


def random_block_parameters(g, d_model, dtype):
    """P = (ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, W1, b1, W2, b2), seeded.

    The LayerNorm scales and shifts are random (around 1 and 0) and differ between
    ln1 and ln2, so that a LayerNorm used in the wrong place changes the output.
    """
    def ln():
        return (1 + 0.3 * torch.randn(d_model, generator=g, dtype=dtype), 0.3 * torch.randn(d_model, generator=g, dtype=dtype))

    ln1 = ln()
    mha = tuple(torch.randn(d_model, d_model, generator=g, dtype=dtype) / math.sqrt(d_model) for _ in range(4))
    ln2 = ln()
    return (*ln1, *mha, *ln2, *random_ffn_parameters(g, d_model, dtype))


def _layer_norm(module, name):
    ln = getattr(module, name, None)
    if not isinstance(ln, nn.LayerNorm):
        raise AssertionError(
            f"TransformerBlock should have an attribute {name} that is an nn.LayerNorm(d_model); "
            + ("it has none." if ln is None else f"yours is a {type(ln).__name__}.")
        )
    return ln


def load_block(module, P):
    ln1_w, ln1_b, W_q, W_k, W_v, W_o, ln2_w, ln2_b, *ffn = P
    attn = getattr(module, "attn", None)
    if attn is None:
        raise AssertionError("TransformerBlock should have an attribute attn: your MultiHeadAttention(d_model, n_heads).")
    ffn_module = getattr(module, "ffn", None)
    if ffn_module is None:
        raise AssertionError("TransformerBlock should have an attribute ffn: your FeedForward(d_model).")
    with torch.no_grad():
        for name, w, b in (("ln1", ln1_w, ln1_b), ("ln2", ln2_w, ln2_b)):
            ln = _layer_norm(module, name)
            if ln.weight is None or tuple(ln.weight.shape) != tuple(w.shape):
                raise AssertionError(f"{name} should be nn.LayerNorm(d_model), with a scale and a shift of d_model entries.")
            ln.weight.copy_(w)
            ln.bias.copy_(b)
    load_mha_weights(attn, (W_q, W_k, W_v, W_o), owner="TransformerBlock.attn")
    load_ffn(ffn_module, ffn, owner="TransformerBlock.ffn")


def _gradient_check(module, x, kwargs, forbidden, names, what):
    """Output requires grad, every parameter and x receive a gradient, and autograd agrees with
    central differences with respect to x (float64 ``assert_gradcheck``)."""
    leaf = x.clone().requires_grad_(True)
    out = unpack(call_without(module, (leaf,), kwargs, **forbidden), names)[0]
    if not out.requires_grad:
        raise AssertionError(
            f"The output of {what} does not require grad although x does: gradients cannot flow back. Avoid "
            ".detach(), .numpy(), .item(), torch.tensor(...) of results and torch.no_grad() inside forward."
        )
    named = [("x", leaf)] + list(module.named_parameters())
    grads = torch.autograd.grad(out.sum(), [t for _, t in named], allow_unused=True)
    for (name, _), gr in zip(named, grads):
        if gr is None:
            raise AssertionError(f"No gradient reaches {name}: is it used in forward (and not detached)?")

    def output_only(inp):
        return unpack(call_without(module, (inp,), kwargs, **forbidden), names)[0]

    assert_gradcheck(output_only, (leaf,), what=f"the output of {what} with respect to x", fast=True)


# ---------------------------------------------------------------- the capstone's recaps
def _recap(recap, exercise, piece, full):
    """Run the recap's visible cases on ``piece``; ``full=True``: every test of the exercise's own notebook."""
    if full:
        for grade_id in exercise.tests:
            run_test(exercise, grade_id, piece)
        return
    (grade_id,) = recap.tests
    run_test(recap, grade_id, piece)


def check_ffn_values(cls, full=True):
    """A seeded float64 input of shape (2, 5, 8) and seeded parameters, against the reference."""
    _recap(declared.FFN_RECAP, declared.FFN_EXERCISE, cls, full)


def check_block_against_reference(cls, full=True):
    """Eval mode, seeded parameters and a float64 input of shape (2, 5, 16), 4 heads, no mask, against
    the reference."""
    _recap(declared.BLOCK_RECAP, declared.BLOCK_EXERCISE, cls, full)


__all__ = ["block_parameter_count", "check_block_against_reference", "check_ffn_values", "load_block",
           "random_block_parameters", "reference_block"]


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
