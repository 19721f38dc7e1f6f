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
from checktable import (
    assert_passes, correct_answers_test, expectations_test, messages_test, naming_test, outcome, rejections_test,
    variants_test,
)
from seeds import seed_namespace

CHECKS = {
    "worked": A.check_worked_example,
    "batched_worked": A.check_batched_worked_example,
    "shapes": A.check_batched_shapes,
    "causal": A.check_causal_mask,
    "random": A.check_random_against_torch,
    "masks": A.check_masks,
    "grads": A.check_gradients_and_inputs,
}
ALL = set(CHECKS)

# The reference, unwrapped, is what a correct student would write.
correct = as_student_code(reference.scaled_dot_product_attention)


def einsum_logsumexp(Q, K, V, mask=None):
    # scores by einsum, weights as exp(scores - logsumexp(scores)): correct, rounded differently
    scores = torch.einsum("...qd,...kd->...qk", Q, K) / Q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores + mask
    weights = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    return weights @ V, weights


CORRECT = {"reference": correct, "einsum and logsumexp": einsum_logsumexp}


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


def dot_T(Q, K, V, mask=None):
    scores = Q @ K.T / math.sqrt(Q.shape[-1])  # as a student writes it: right in 2-D only
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return weights @ V, weights


def if_mask(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return weights @ V, weights


def returned_in_the_wrong_order(Q, K, V, mask=None):
    out, w = _softmax_attn(Q, K, V, mask)
    return w, out


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
    "K.T on batched inputs": (transpose_with_T, {"batched_worked", "shapes", "random", "masks", "grads"}),
    "Q @ K.T": (dot_T, {"batched_worked", "shapes", "random", "masks", "grads"}),
    "if mask:": (if_mask, {"batched_worked", "causal", "masks", "grads"}),
    "returns (weights, output)": (returned_in_the_wrong_order, ALL),
    "hard-coded worked example": (hard_coded_example, ALL - {"worked"}),
}

# Which checks each named mistake must fail (the values are not just "some").
MISTAKE_FAILS = {
    "no scaling": {"worked", "batched_worked", "causal", "random", "masks"},
    "scaled by d_k": {"worked", "batched_worked", "causal", "random", "masks"},
    "scaled by sqrt(d_v)": {"random", "masks"},
    "scaled by sqrt(T_k)": {"worked", "batched_worked", "causal", "random", "masks"},
    "softmax over the wrong axis": {"worked", "batched_worked", "shapes", "causal", "random", "masks"},
    "mask added after the softmax": {"batched_worked", "causal", "masks", "grads"},
    "mask ignored": {"batched_worked", "causal", "masks"},
    "mask added before the scaling": {"masks"},
    "keys used as values": ALL,
    "scores returned as weights": {"worked", "batched_worked", "shapes", "causal", "random", "masks"},
    "softmax overflows": {"random"},
}

VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in A.MISTAKES}
VARIANTS.update(OTHER_VARIANTS)


test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, A.MISTAKES))


test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)


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


# The student's bug, the check that must fail on it, and what its message must say: the
# student's own line (these variants are defined in this file, so its name appears), the
# error, and the hint.
test_message_names_the_students_line = messages_test(CHECKS, VARIANTS, [
    ("Q @ K.T", "batched_worked", ["raised by your code at", "test_checks_attention.py", "in dot_T",
                                   "scores = Q @ K.T / math.sqrt(Q.shape[-1])", "Shapes on this line: Q (2, 2, 3, 2)",
                                   "`K.T` reverses every dimension", "`K.transpose(-2, -1)`"]),
    ("Q @ K.T", "shapes", ["in dot_T", "`K.T` reverses every dimension"]),
    ("if mask:", "batched_worked", ["in if_mask", "if mask:", "Boolean value of Tensor",
                                    "write `if mask is not None:`"]),
    ("if mask:", "causal", ["write `if mask is not None:`"]),
    ("returns (weights, output)", "worked", ["wrong order: (weights, output) instead of (output, weights)"]),
    ("returns (weights, output)", "grads", ["wrong order"]),
    ("no scaling", "batched_worked", ["no scaling", "entry [0, 0] is the worked example"]),
])


def test_failure_traceback_keeps_only_the_students_frames():
    ok, err = outcome(A.check_batched_worked_example, dot_T)
    files = []
    tb = err.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    # This test's own frame (the caller), the one hidden wrapper frame, then the student's line.
    assert [f for f in files if "firstprinciples" in f] == [files[1]] and files[1].endswith("_student.py"), files
    assert files[-1] == __file__ and "torch" not in "".join(files), files


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
