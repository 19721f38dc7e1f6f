"""What is left of the old checks of ``split_heads``, ``merge_heads`` and ``MultiHeadAttention``.

The exercise is declared in ``firstprinciples.exercises.multi_head_attention`` and its notebook calls
``check(grade_id, piece)``. This module keeps two things until the notebooks and exercises that use
them are declared too:

- the recaps that later notebooks run in their imports' name ``multihead_checks``
  (transformer_block: ``recap_split_heads``, ``test_merge_heads``, ``test_multi_head_attention``;
  capstone: ``test_split_heads``, ``recap_merge_heads``, ``test_multi_head_attention``):
  ``check_split_heads``, ``check_merge_heads`` and ``check_mha_against_reference``, which run the
  declaration's recap cases (``SPLIT_RECAP``, ``MERGE_RECAP``, ``MHA_RECAP``); the re-check judges
  those cells by the declaration's ``elsewhere``;
- the helpers that other old checks import: ``build`` (checks.block, checks.modern_block,
  checks.capstone), ``forbidden_in_forward`` and ``run_module`` (checks.block, checks.modern_block),
  ``linear_layer``, ``load_mha_weights`` and ``reference_mha`` (checks.block), and ``PROJECTIONS``
  (grading.probes.block, grading.probes.modern_block). Each goes when its last user is declared.
"""
from __future__ import annotations

import torch
from torch import nn

from ..exercises import multi_head_attention as declared
from ..grading.declared import run_test
from ..guard import ForbiddenCall, call_without
from ..reference import merge_heads as ref_merge_heads
from ..reference import scaled_dot_product_attention as ref_attention
from ..reference import split_heads as ref_split_heads
from ._core import call_answer
from ._student import wrap_checks

TORCH_PATTERNS = declared.TORCH_PATTERNS
FORBIDDEN_MHA = dict(torch_patterns=TORCH_PATTERNS, pieces=declared.PIECE_NAMES, what="multi-head attention")
PROJECTIONS = declared.PROJECTIONS


# ---------------------------------------------------------------- the later notebooks' recaps
def _recap(recap, exercise, piece, full):
    """Run the recap's visible cases on ``piece``; ``full=True``: every test of the exercise's own notebook."""
    if full:
        for grade_id in exercise.tests:
            run_test(exercise, grade_id, piece)
        return
    (grade_id,) = recap.tests
    run_test(recap, grade_id, piece)


def check_split_heads(fn, full=False):
    """The worked example (x = arange(12) as (1, 2, 6), 3 heads of width 2) and a random float32
    input of shape (2, 5, 12), against the reference."""
    _recap(declared.SPLIT_RECAP, declared.SPLIT_EXERCISE, fn, full)


def check_merge_heads(fn, full=False):
    """The worked example's three heads merged back into arange(12) as (1, 2, 6), and random float32
    heads of shape (2, 3, 5, 4), against the reference."""
    _recap(declared.MERGE_RECAP, declared.MERGE_EXERCISE, fn, full)


def check_mha_against_reference(cls, full=False):
    """Seeded weights and input (x of shape (2, 5, 8), 2 heads, float64, no mask) against the reference."""
    _recap(declared.MHA_RECAP, declared.MHA_EXERCISE, cls, full)


# ---------------------------------------------------------------- helpers of checks.block and checks.modern_block
def _call_with_hints(fn, args, kwargs=None, *, names, forbidden, shapes=None):
    """``call_answer`` (an error of the answer names its line, see ``_student``)."""
    return call_answer(fn, args, kwargs, names=names, forbidden=forbidden, shapes=shapes)


def reference_mha(x, W_q, W_k, W_v, W_o, n_heads, mask=None):
    """The reference module's computation, as a function of its weights."""
    Q, K, V = (ref_split_heads(x @ W.T, n_heads) for W in (W_q, W_k, W_v))  # (B, H, T, d_k)
    out, w = ref_attention(Q, K, V, mask)
    return ref_merge_heads(out) @ W_o.T, w


# ---------------------------------------------------------------- the module
def build(cls, *args, forbidden=FORBIDDEN_MHA, seed=0, **kwargs):
    """``cls(*args, **kwargs)`` under the guard and a fixed seed; the caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = call_without(lambda: cls(*args, **kwargs), (), **forbidden)
    if not isinstance(module, nn.Module):
        raise AssertionError(
            f"{getattr(cls, '__name__', cls)}{tuple(args)} should build an nn.Module (a class that subclasses nn.Module "
            f"and calls super().__init__()), but it built a {type(module).__name__}."
        )
    return module


def forbidden_in_forward(module, x, forbidden):
    """Run one forward pass under the guard: a structure check must also score 0 for an
    answer whose forward calls a forbidden built-in. Other errors are left to the value checks."""
    try:
        call_without(module, (x,), **forbidden)
    except ForbiddenCall:
        raise
    except Exception:
        pass


def linear_layer(module, name, owner="MultiHeadAttention"):
    layer = getattr(module, name, None)
    if not isinstance(layer, nn.Linear):
        raise AssertionError(
            f"{owner} should have an attribute {name} that is an nn.Linear "
            f"(self.{name} = nn.Linear(d_model, d_model, bias=False)); "
            + ("it has none." if layer is None else f"yours is a {type(layer).__name__}.")
        )
    return layer


def load_mha_weights(module, mats, owner="MultiHeadAttention"):
    """Copy the four matrices into W_q, W_k, W_v, W_o (whose dtype is already that of the matrices)."""
    with torch.no_grad():
        for name, W in zip(PROJECTIONS, mats):
            layer = linear_layer(module, name, owner)
            if tuple(layer.weight.shape) != tuple(W.shape):
                raise AssertionError(
                    f"{owner}.{name}.weight has shape {tuple(layer.weight.shape)} but should be {tuple(W.shape)} "
                    "(d_model x d_model)."
                )
            layer.weight.copy_(W)


def run_module(module, x, mask, forbidden, names=("output", "weights")):
    """Call the module on copies; fail if it changes its inputs or its own parameters, or
    returns (weights, output) instead of (output, weights): the output has x's shape."""
    before = {k: v.clone() for k, v in module.state_dict().items()}
    kwargs = {} if mask is None else {"mask": mask}
    shapes = (tuple(x.shape), None) if names == ("output", "weights") else None
    outputs = _call_with_hints(module, (x,), kwargs, names=names, forbidden=forbidden, shapes=shapes)
    for k, v in module.state_dict().items():
        if k in before and not torch.equal(before[k], v):
            raise AssertionError(f"Calling the module changed its own parameter {k}: forward must not modify weights.")
    return outputs


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
