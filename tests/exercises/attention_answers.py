"""attention: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes: unusual correct answers, which must pass everywhere, and wrong answers that no mistake
names (a built-in called, a wrong type, an input changed, K.T on batches), each with the test cells
it fails in the notebook (its visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from course import as_student_code
from firstprinciples import examples, reference

correct = as_student_code(reference.scaled_dot_product_attention)  # what a correct student writes


# ---------------------------------------------------------------- correct, written unusually
def einsum_logsumexp(Q, K, V, mask=None):
    # scores by einsum, weights as exp(scores - logsumexp(scores)): correct, rounded differently
    scores = torch.einsum("...qd,...kd->...qk", Q, K) / Q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores + mask
    weights = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    return weights @ V, weights


def quarter_scaled_both(Q, K, V, mask=None):
    # d_k^(-1/4) on each side of the product is 1/sqrt(d_k) on the scores
    s = Q.shape[-1] ** -0.25
    scores = (Q * s) @ (K * s).mT
    if mask is not None:
        scores = scores + mask
    weights = scores.softmax(-1)
    return weights @ V, weights


def online_softmax_over_keys(Q, K, V, mask=None):
    # one key at a time, with a running max and a running sum (as a streaming kernel would)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores + mask
    top = torch.full(scores.shape[:-1], float("-inf"), dtype=scores.dtype)
    total = torch.zeros(scores.shape[:-1], dtype=scores.dtype)
    for j in range(scores.shape[-1]):
        s = scores[..., j]
        new_top = torch.maximum(top, s)
        # (-inf - -inf is NaN: a masked key adds 0, and an unchanged max keeps the sum as it is)
        kept = torch.where(top == new_top, total, total * torch.exp(top - new_top))
        total = kept + torch.where(torch.isneginf(s), torch.zeros_like(s), torch.exp(s - new_top))
        top = new_top
    weights = torch.exp(scores - top.unsqueeze(-1)) / total.unsqueeze(-1)
    return weights @ V, weights


def broadcast_weighted_sum(Q, K, V, mask=None):
    # no matrix product at all: products broadcast over (query, key, feature), then summed
    scores = (Q.unsqueeze(-2) * K.unsqueeze(-3)).sum(-1) / math.sqrt(K.shape[-1])
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return (weights.unsqueeze(-1) * V.unsqueeze(-3)).sum(-2), weights


def flattened_baddbmm(Q, K, V, mask=None):
    # every leading dimension folded into one batch; the mask enters as baddbmm's input
    *lead, T_q, d_k = Q.shape
    T_k = K.shape[-2]
    q, k, v = Q.reshape(-1, T_q, d_k), K.reshape(-1, T_k, d_k), V.reshape(-1, T_k, V.shape[-1])
    bias = torch.zeros(1, 1, 1, dtype=Q.dtype) if mask is None else mask.expand(*lead, T_q, T_k).reshape(-1, T_q, T_k)
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=1 / math.sqrt(d_k))
    weights = torch.softmax(scores, dim=-1)
    return torch.bmm(weights, v).reshape(*lead, T_q, -1), weights.reshape(*lead, T_q, T_k)


CORRECT = {"reference": correct, "einsum and logsumexp": einsum_logsumexp,
           "Q and K scaled by d_k^-1/4": quarter_scaled_both, "online softmax over the keys": online_softmax_over_keys,
           "broadcast and sum": broadcast_weighted_sum, "flattened into baddbmm": flattened_baddbmm}


# ---------------------------------------------------------------- wrong, and no mistake names them
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


def inplace_scale(Q, K, V, mask=None):
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


WORKED, SHAPES, MASKS, RANDOM, GRADS = ("test_worked_example", "test_batched_shapes", "test_masks",
                                        "test_random_against_torch", "test_gradients_and_inputs")
ALL = {WORKED, SHAPES, MASKS, RANDOM, GRADS}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
WRONG = {
    "calls torch's attention": (calls_torch_builtin, ALL, ALL),
    "calls the reference": (calls_reference, ALL, ALL),
    "calls the built-in and hides it": (calls_builtin_but_hides_it, ALL, ALL),
    "modifies its inputs": (inplace_scale, ALL, ALL),
    "detached": (detached, {GRADS}, {GRADS}),
    "returns numpy": (via_numpy, ALL, ALL),
    "returns the output only": (output_only, ALL, ALL),
    # (the notebook's random case is float32: the cast changes nothing there; the re-check's has float64 too)
    "casts to float32": (casts_to_float32, ALL - {RANDOM}, ALL),
    # (the notebook's gradient case has T_q == T_k, so the transposed weights have the right shape there)
    "weights transposed": (weights_transposed, ALL - {GRADS}, ALL),
    "K.T on batched inputs": (transpose_with_T, {SHAPES, RANDOM, GRADS}, {SHAPES, MASKS, RANDOM, GRADS}),
    "Q @ K.T": (dot_T, {SHAPES, RANDOM, GRADS}, {SHAPES, MASKS, RANDOM, GRADS}),
    # (the notebook's gradient case has no mask; the re-check's have)
    "if mask:": (if_mask, {MASKS}, {MASKS, GRADS}),
    "returns (weights, output)": (returned_in_the_wrong_order, ALL, ALL),
    # (the re-check draws fresh inputs of the worked example's sizes: typed-in weights earn nothing there)
    "hard-coded worked example": (hard_coded_example, ALL - {WORKED}, ALL),
}
