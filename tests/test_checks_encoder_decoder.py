"""Every cross-attention check accepts right answers and rejects typical wrong ones.

Each check runs against independent correct answers (one written with einsum,
one built on the seed's own scaled_dot_product_attention) and against a
catalogue of buggy variants (the package's named mistakes plus answers that
call the reference or torch's attention, detach, return numpy, modify their
inputs, change dtype, ...), each with the exact set of checks it must fail.
Every check must reject at least five variants.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from firstprinciples import reference
from firstprinciples.checks import encoder_decoder as E
from checktable import correct_answers_test, expectations_test, naming_test, outcome, rejections_test, variants_test
from seeds import seed_namespace

CHECKS = {
    "worked": E.check_worked_example,
    "shapes": E.check_shapes,
    "roles": E.check_roles,
    "torch": E.check_against_torch,
    "padding": E.check_padding_mask,
    "grads": E.check_gradients_and_inputs,
}
ALL = set(CHECKS)


def einsum_cross_attention(x, context, W_q, W_k, W_v, mask=None):
    Q = torch.einsum("btd,dk->btk", x, W_q)
    K = torch.einsum("bsc,ck->bsk", context, W_k)
    V = torch.einsum("bsc,cv->bsv", context, W_v)
    scores = torch.einsum("btk,bsk->bts", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bts,bsv->btv", weights, V), weights


def seed_cross_attention(x, context, W_q, W_k, W_v, mask=None):
    attention = seed_namespace("scaled_dot_product_attention")["scaled_dot_product_attention"]
    return attention(x @ W_q, context @ W_k, context @ W_v, mask)


def _plain(x, context, W_q, W_k, W_v, mask=None):
    return E._attend(x @ W_q, context @ W_k, context @ W_v, mask)


def calls_reference(x, context, W_q, W_k, W_v, mask=None):
    return reference.cross_attention(x, context, W_q, W_k, W_v, mask)


def calls_reference_attention(x, context, W_q, W_k, W_v, mask=None):
    return reference.scaled_dot_product_attention(x @ W_q, context @ W_k, context @ W_v, mask)


def calls_torch_sdpa(x, context, W_q, W_k, W_v, mask=None):
    Q, K, V = x @ W_q, context @ W_k, context @ W_v
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask), _plain(x, context, W_q, W_k, W_v, mask)[1]


def calls_torch_mha_and_hides_it(x, context, W_q, W_k, W_v, mask=None):
    try:
        m = torch.nn.MultiheadAttention(x.shape[-1], 1, batch_first=True, dtype=x.dtype)
        m(x, x, x)
    except Exception:
        pass
    return _plain(x, context, W_q, W_k, W_v, mask)


def modifies_inputs(x, context, W_q, W_k, W_v, mask=None):
    W_q /= math.sqrt(W_q.shape[-1])  # scales the caller's weights
    scores = (x @ W_q) @ (context @ W_k).transpose(-2, -1)
    if mask is not None:
        scores = scores + mask
    w = torch.softmax(scores, dim=-1)
    return w @ (context @ W_v), w


def detached(x, context, W_q, W_k, W_v, mask=None):
    return _plain(x.detach(), context.detach(), W_q.detach(), W_k.detach(), W_v.detach(), mask)


def via_numpy(x, context, W_q, W_k, W_v, mask=None):
    out, w = detached(x, context, W_q, W_k, W_v, mask)
    return out.numpy(), w.numpy()


def output_only(x, context, W_q, W_k, W_v, mask=None):
    return _plain(x, context, W_q, W_k, W_v, mask)[0]


def casts_to_float32(x, context, W_q, W_k, W_v, mask=None):
    out, w = _plain(x, context, W_q, W_k, W_v, mask)
    return out.float(), w.float()


def transpose_with_T(x, context, W_q, W_k, W_v, mask=None):
    # K.T reverses all dimensions: wrong as soon as there is a batch dimension.
    K = context @ W_k
    scores = (x @ W_q) @ K.permute(*reversed(range(K.dim()))) / math.sqrt(W_q.shape[-1])
    if mask is not None:
        scores = scores + mask
    w = torch.softmax(scores, dim=-1)
    return w @ (context @ W_v), w


def scaled_by_d_model(x, context, W_q, W_k, W_v, mask=None):
    Q, K, V = x @ W_q, context @ W_k, context @ W_v
    scores = Q @ K.transpose(-2, -1) / math.sqrt(x.shape[-1])
    if mask is not None:
        scores = scores + mask
    w = torch.softmax(scores, dim=-1)
    return w @ V, w


def naive_softmax(x, context, W_q, W_k, W_v, mask=None):
    Q, K, V = x @ W_q, context @ W_k, context @ W_v
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores + mask
    e = torch.exp(scores)
    w = e / e.sum(-1, keepdim=True)
    return w @ V, w


OTHER_VARIANTS = {
    "calls the reference": (calls_reference, ALL),
    "calls the reference attention": (calls_reference_attention, ALL),
    "calls torch's attention": (calls_torch_sdpa, ALL),
    "calls nn.MultiheadAttention and hides it": (calls_torch_mha_and_hides_it, ALL),
    "modifies its inputs": (modifies_inputs, ALL),
    "detached": (detached, {"grads"}),
    "returns numpy": (via_numpy, ALL),
    "returns the output only": (output_only, ALL),
    "casts to float32": (casts_to_float32, ALL),
    "K.T on batched inputs": (transpose_with_T, ALL),
    "scaled by sqrt(d_model)": (scaled_by_d_model, {"torch"}),
    "softmax overflows": (naive_softmax, {"torch"}),
}

MISTAKE_FAILS = {
    "queries taken from the context (roles swapped)": ALL,
    "keys from x": ALL,
    "values from x": ALL,
    "causal mask applied to cross-attention": {"worked", "roles", "torch", "padding"},
    "mask ignored": {"padding"},
    "softmax over the queries": {"worked", "shapes", "roles", "torch", "padding"},
}

VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in E.MISTAKES}
VARIANTS.update(OTHER_VARIANTS)
CORRECT = {"einsum": einsum_cross_attention, "seed attention": seed_cross_attention, "plain": _plain}


test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, E.MISTAKES))
test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)
test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)
test_failure_names_the_mistake = naming_test(
    CHECKS,
    VARIANTS,
    [
        ("queries taken from the context (roles swapped)", "roles"),
        ("keys from x", "roles"),
        ("values from x", "roles"),
        ("causal mask applied to cross-attention", "worked"),
        ("causal mask applied to cross-attention", "roles"),
        ("mask ignored", "padding"),
        ("softmax over the queries", "worked"),
        ("softmax over the queries", "shapes"),
    ],
)


def test_shape_errors_are_explained_in_terms_of_the_roles():
    ok, err = outcome(E.check_worked_example, VARIANTS["keys from x"][0])
    assert not ok and "Queries come from x" in str(err) and "(1, 3, 4)" in str(err), str(err)


def test_worked_example_reproduces_the_attention_chapter():
    out, w = reference.cross_attention(*E.worked_example())
    torch.testing.assert_close(w[0, 0], torch.tensor([0.380, 0.354, 0.266], dtype=torch.float64), atol=1e-3, rtol=0)
    torch.testing.assert_close(out[0, 0], torch.tensor([1.026, 0.974], dtype=torch.float64), atol=1e-3, rtol=0)


def test_forbidden_call_message_is_clear():
    ok, err = outcome(E.check_worked_example, calls_torch_sdpa)
    assert "scaled_dot_product_attention" in str(err) and "scores 0" in str(err)
