"""Every attention check accepts right answers and rejects typical wrong ones.

Each check is run against the reference and the seed's own implementation
(both must pass) and against a catalogue of buggy variants: the package's
named mistakes plus wrong answers that cannot be "named" (detached, numpy,
in-place, calls to the built-in, ...). The table says exactly which checks each
variant must fail; every check must reject at least five variants.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course import as_student_code
from firstprinciples import examples, reference
from firstprinciples.checks import attention as A
from checktable import assert_passes, expectations_test, naming_test, outcome, rejections_test, variants_test
from seeds import seed_namespace

CHECKS = {
    "worked": A.check_worked_example,
    "shapes": A.check_batched_shapes,
    "causal": A.check_causal_mask,
    "random": A.check_random_against_torch,
    "masks": A.check_masks,
    "grads": A.check_gradients_and_inputs,
}
ALL = set(CHECKS)

# The reference, unwrapped, is what a correct student would write.
correct = as_student_code(reference.scaled_dot_product_attention)


def _softmax_attn(Q, K, V, mask=None):
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def calls_torch_builtin(Q, K, V, mask=None):
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask), _softmax_attn(Q, K, V, mask)[1]


def calls_reference(Q, K, V, mask=None):
    return reference.scaled_dot_product_attention(Q, K, V, mask)


def calls_builtin_but_hides_it(Q, K, V, mask=None):
    try:
        torch.nn.functional.scaled_dot_product_attention(Q, K, V)
    except Exception:
        pass
    return _softmax_attn(Q, K, V, mask)


def _inplace_scale(Q, K, V, mask=None):
    Q /= math.sqrt(Q.shape[-1])  # scales the caller's tensor
    s = Q @ K.transpose(-2, -1)
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def detached(Q, K, V, mask=None):
    return _softmax_attn(Q.detach(), K.detach(), V.detach(), mask)


def via_numpy(Q, K, V, mask=None):
    out, w = _softmax_attn(Q.detach(), K.detach(), V.detach(), mask)
    return out.numpy(), w.numpy()


def output_only(Q, K, V, mask=None):
    return _softmax_attn(Q, K, V, mask)[0]


def casts_to_float32(Q, K, V, mask=None):
    out, w = _softmax_attn(Q, K, V, mask)
    return out.float(), w.float()


def weights_transposed(Q, K, V, mask=None):
    out, w = _softmax_attn(Q, K, V, mask)
    return out, w.transpose(-2, -1)


def transpose_with_T(Q, K, V, mask=None):
    # K.T reverses *all* dimensions; right for (T, d) inputs, wrong for batches.
    K_T = K.permute(*reversed(range(K.dim())))
    s = Q @ K_T / math.sqrt(Q.shape[-1])
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=-1)
    return w @ V, w


_EXAMPLE_WEIGHTS = correct(*examples.cat_sat_mat(torch.float64))[1].tolist()


def hard_coded_example(Q, K, V, mask=None):
    w = torch.tensor(_EXAMPLE_WEIGHTS, dtype=Q.dtype)  # Cat's weights, typed in
    return w @ V, w


OTHER_VARIANTS = {
    # name: (function, the checks it must fail)
    "calls torch's attention": (calls_torch_builtin, ALL),
    "calls the reference": (calls_reference, ALL),
    "calls the built-in and hides it": (calls_builtin_but_hides_it, ALL),
    "modifies its inputs": (_inplace_scale, ALL),
    "detached": (detached, {"grads"}),
    "returns numpy": (via_numpy, ALL),
    "returns the output only": (output_only, ALL),
    "casts to float32": (casts_to_float32, ALL),
    "weights transposed": (weights_transposed, ALL - {"grads"}),
    "K.T on batched inputs": (transpose_with_T, {"shapes", "random", "masks", "grads"}),
    "hard-coded worked example": (hard_coded_example, ALL - {"worked"}),
}

# Which checks each named mistake must fail (the values are not just "some").
MISTAKE_FAILS = {
    "no scaling": {"worked", "causal", "random", "masks"},
    "scaled by d_k": {"worked", "causal", "random", "masks"},
    "scaled by sqrt(d_v)": {"random", "masks"},
    "scaled by sqrt(T_k)": {"worked", "causal", "random", "masks"},
    "softmax over the wrong axis": {"worked", "shapes", "causal", "random", "masks"},
    "mask added after the softmax": {"causal", "masks", "grads"},
    "mask ignored": {"causal", "masks"},
    "mask added before the scaling": {"masks"},
    "keys used as values": ALL,
    "scores returned as weights": {"worked", "shapes", "causal", "random", "masks"},
    "softmax overflows": {"random"},
}

VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in A.MISTAKES}
VARIANTS.update(OTHER_VARIANTS)


test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, A.MISTAKES))


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_reference_passes(name):
    assert_passes(CHECKS[name], correct, f"the reference fails {name}")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_seed_implementation_passes(name):
    seed = seed_namespace("scaled_dot_product_attention")["scaled_dot_product_attention"]
    assert_passes(CHECKS[name], seed, f"the seed's implementation fails {name}")


test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)
test_failure_names_the_mistake = naming_test(
    CHECKS,
    VARIANTS,
    [
        ("no scaling", "worked"),
        ("scaled by d_k", "worked"),
        ("softmax over the wrong axis", "worked"),
        ("softmax over the wrong axis", "shapes"),
        ("mask added after the softmax", "causal"),
        ("mask ignored", "causal"),
        ("mask added before the scaling", "masks"),
        ("softmax overflows", "random"),
        ("scaled by sqrt(d_v)", "random"),
    ],
)


def test_correct_answer_is_not_diagnosed_with_a_mistake_that_equals_it():
    # Without a mask, "mask ignored" gives the right answer; naming it would mislead.
    ok, err = outcome(A.check_worked_example, VARIANTS["no scaling"][0])
    assert "mask ignored" not in str(err)


def test_forbidden_call_message_is_clear():
    ok, err = outcome(A.check_worked_example, calls_torch_builtin)
    assert "scaled_dot_product_attention" in str(err) and "scores 0" in str(err)


def test_worked_example_reports_the_entry():
    ok, err = outcome(A.check_worked_example, VARIANTS["no scaling"][0])
    assert "Cat's weight on 'Cat'" in str(err) and "0.380" in str(err)
