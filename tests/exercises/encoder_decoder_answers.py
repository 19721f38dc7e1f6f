"""encoder_decoder: the answers the generic harness (test_declarations.py) runs besides the declaration's
own mistakes, per piece: unusual correct answers (the seed's own attention among them), which must
pass everywhere, and wrong answers that no mistake names (a built-in or the course's code called, a
wrong type, an input changed, K.T on batches, ...), each with the test cells it fails in the notebook
(its visible cases) and in the trusted re-check (the secret ones).

The recap cell of the student's attention (test_scaled_dot_product_attention) is judged in the
re-check on the attention exercise's secret worked-example-sized cases, 2-D and without a mask: the
answers that go wrong only on batches or with a mask fail it in the notebook only."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from exercises import attention_answers as A
from firstprinciples import reference
from firstprinciples.examples.encoder_decoder import worked_example
from seeds import seed_namespace

PIECES = True


def _attend(Q, K, V, mask=None):
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=-1)
    return w @ V, w


# ================================================================ cross_attention, correct and written unusually
def plain(x, context, W_q, W_k, W_v, mask=None):
    return _attend(x @ W_q, context @ W_k, context @ W_v, mask)


def einsum_cross_attention(x, context, W_q, W_k, W_v, mask=None):
    Q = torch.einsum("btd,dk->btk", x, W_q)
    K = torch.einsum("bsc,ck->bsk", context, W_k)
    V = torch.einsum("bsc,cv->bsv", context, W_v)
    scores = torch.einsum("btk,bsk->bts", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bts,bsv->btv", weights, V), weights


def _seed_cross_attention():
    """Built on the seed's own scaled_dot_product_attention (read when a test runs it)."""
    attention = seed_namespace("scaled_dot_product_attention")["scaled_dot_product_attention"]

    def cross_attention(x, context, W_q, W_k, W_v, mask=None):
        return attention(x @ W_q, context @ W_k, context @ W_v, mask)

    return cross_attention


def _lazy(factory):
    """A correct answer built on first use (the seeds are read when a test runs it)."""
    made = []

    def answer(*args, **kwargs):
        if not made:
            made.append(factory())
        return made[0](*args, **kwargs)

    return answer


def values_projected_last(x, context, W_q, W_k, W_v, mask=None):
    # weights @ (context @ W_v) == (weights @ context) @ W_v: the same numbers, summed in another order
    _, weights = _attend(x @ W_q, context @ W_k, context, mask)
    return (weights @ context) @ W_v, weights


def scores_through_one_matrix(x, context, W_q, W_k, W_v, mask=None):
    # Q K^T = x (W_q W_k^T) context^T: the two projections folded into one (d_model, d_ctx) matrix
    scores = x @ (W_q @ W_k.transpose(0, 1)) @ context.transpose(-2, -1) / math.sqrt(W_q.shape[-1])
    if mask is not None:
        scores = scores + mask
    weights = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    return weights @ (context @ W_v), weights


def baddbmm_with_the_mask(x, context, W_q, W_k, W_v, mask=None):
    # the mask (or zeros) enters as baddbmm's input, the scaling as its alpha
    Q, K, V = x @ W_q, context @ W_k, context @ W_v
    B, T_q, T_k = Q.shape[0], Q.shape[1], K.shape[1]
    bias = torch.zeros(B, T_q, T_k, dtype=Q.dtype) if mask is None else mask.expand(B, T_q, T_k)
    weights = torch.softmax(torch.baddbmm(bias, Q, K.transpose(1, 2), alpha=Q.shape[-1] ** -0.5), dim=-1)
    return torch.bmm(weights, V), weights


def calls_the_notebooks_attention(x, context, W_q, W_k, W_v, mask=None):
    # as the notebook asks: the projections, then the student's own attention (here an unusual one)
    return A.online_softmax_over_keys(x @ W_q, context @ W_k, context @ W_v, mask)


# ================================================================ cross_attention, wrong and no mistake names it
def calls_reference(x, context, W_q, W_k, W_v, mask=None):
    return reference.cross_attention(x, context, W_q, W_k, W_v, mask)


def calls_reference_attention(x, context, W_q, W_k, W_v, mask=None):
    return reference.scaled_dot_product_attention(x @ W_q, context @ W_k, context @ W_v, mask)


def calls_torch_sdpa(x, context, W_q, W_k, W_v, mask=None):
    Q, K, V = x @ W_q, context @ W_k, context @ W_v
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask), plain(x, context, W_q, W_k, W_v, mask)[1]


def calls_torch_mha_and_hides_it(x, context, W_q, W_k, W_v, mask=None):
    try:
        m = torch.nn.MultiheadAttention(x.shape[-1], 1, batch_first=True, dtype=x.dtype)
        m(x, x, x)
    except Exception:
        pass
    return plain(x, context, W_q, W_k, W_v, mask)


def modifies_inputs(x, context, W_q, W_k, W_v, mask=None):
    W_q /= math.sqrt(W_q.shape[-1])  # scales the caller's weights
    scores = (x @ W_q) @ (context @ W_k).transpose(-2, -1)
    if mask is not None:
        scores = scores + mask
    w = torch.softmax(scores, dim=-1)
    return w @ (context @ W_v), w


def detached(x, context, W_q, W_k, W_v, mask=None):
    return plain(x.detach(), context.detach(), W_q.detach(), W_k.detach(), W_v.detach(), mask)


def via_numpy(x, context, W_q, W_k, W_v, mask=None):
    out, w = detached(x, context, W_q, W_k, W_v, mask)
    return out.numpy(), w.numpy()


def output_only(x, context, W_q, W_k, W_v, mask=None):
    return plain(x, context, W_q, W_k, W_v, mask)[0]


def casts_to_float32(x, context, W_q, W_k, W_v, mask=None):
    out, w = plain(x, context, W_q, W_k, W_v, mask)
    return out.float(), w.float()


def returned_in_the_wrong_order(x, context, W_q, W_k, W_v, mask=None):
    out, w = plain(x, context, W_q, W_k, W_v, mask)
    return w, out


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


def attention_without_scaling(x, context, W_q, W_k, W_v, mask=None):
    # the student's own attention forgot the 1/sqrt(d_k): the recap cell says so, and these values are wrong
    return A._softmax_attn(x @ W_q * math.sqrt(W_q.shape[-1]), context @ W_k, context @ W_v, mask)


def square_causal_mask(x, context, W_q, W_k, W_v, mask=None):
    # a decoder's (T_q, T_q) causal mask added to the (T_q, T_k) scores: raises unless T_q == T_k
    T_q = x.shape[-2]
    causal = torch.triu(torch.full((T_q, T_q), float("-inf"), dtype=x.dtype), diagonal=1)
    return _attend(x @ W_q, context @ W_k, context @ W_v, causal if mask is None else causal + mask)


def if_mask(x, context, W_q, W_k, W_v, mask=None):
    scores = (x @ W_q) @ (context @ W_k).transpose(-2, -1) / math.sqrt(W_q.shape[-1])
    if mask:
        scores = scores + mask
    w = torch.softmax(scores, dim=-1)
    return w @ (context @ W_v), w


def mask_clamped(x, context, W_q, W_k, W_v, mask=None):
    # -inf replaced by -50: the padded positions keep a weight of about 1e-22, within the tolerance
    # of the comparison, but not exactly zero
    return plain(x, context, W_q, W_k, W_v, None if mask is None else mask.clamp(min=-50.0))


_EXAMPLE = plain(*worked_example())


def hard_coded_example(x, context, W_q, W_k, W_v, mask=None):
    # the worked example's results, typed in, whatever the inputs
    return _EXAMPLE[0].to(x.dtype).clone(), _EXAMPLE[1].to(x.dtype).clone()


WORKED, SHAPES, ROLES, TORCH, PADDING, GRADS = ("test_worked_example", "test_shapes", "test_roles",
                                                "test_against_torch", "test_padding_mask",
                                                "test_gradients_and_inputs")
ALL = {WORKED, SHAPES, ROLES, TORCH, PADDING, GRADS}
VALUES = {WORKED, ROLES, TORCH, PADDING}  # the tests that compare values with the reference

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
CROSS_WRONG = {
    "calls the reference": (calls_reference, ALL, ALL),
    "calls the reference attention": (calls_reference_attention, ALL, ALL),
    "calls torch's attention": (calls_torch_sdpa, ALL, ALL),
    "calls nn.MultiheadAttention and hides it": (calls_torch_mha_and_hides_it, ALL, ALL),
    "modifies its inputs": (modifies_inputs, ALL, ALL),
    "detached": (detached, {GRADS}, {GRADS}),
    "returns numpy": (via_numpy, ALL, ALL),
    "returns the output only": (output_only, ALL, ALL),
    # (the notebook's test_against_torch case is float32: the cast changes nothing there)
    "casts to float32": (casts_to_float32, ALL - {TORCH}, ALL),
    "returns (weights, output)": (returned_in_the_wrong_order, ALL, ALL),
    "K.T on batched inputs": (transpose_with_T, ALL, ALL),
    # (every notebook case that compares values has d_model == d_k; the re-check's do not)
    "scaled by sqrt(d_model)": (scaled_by_d_model, set(), {TORCH, PADDING}),
    # (only the re-check's large scores overflow)
    "softmax overflows": (naive_softmax, set(), {TORCH}),
    "attention without the scaling": (attention_without_scaling, VALUES, VALUES),
    # (raises wherever T_q != T_k; test_roles has T_q == T_k, where it gives the causal mask's numbers)
    "a square causal mask": (square_causal_mask, ALL, ALL),
    # (the notebook's gradient case has no mask; some of the re-check's have)
    "if mask:": (if_mask, {PADDING}, {PADDING, GRADS}),
    "-inf clamped to -50": (mask_clamped, {PADDING}, {PADDING}),
    # (the re-check draws fresh inputs of the worked example's sizes: typed-in results earn nothing there)
    "hard-coded worked example": (hard_coded_example, ALL - {WORKED}, ALL),
}

# ================================================================ the recap of scaled_dot_product_attention
RECAP = {"test_scaled_dot_product_attention"}
RECAP_WRONG = {
    "calls torch's attention": (A.calls_torch_builtin, RECAP, RECAP),
    "calls the reference": (A.calls_reference, RECAP, RECAP),
    "modifies its inputs": (A.inplace_scale, RECAP, RECAP),
    "returns numpy": (A.via_numpy, RECAP, RECAP),
    "returns the output only": (A.output_only, RECAP, RECAP),
    "returns (weights, output)": (A.returned_in_the_wrong_order, RECAP, RECAP),
    "casts to float32": (A.casts_to_float32, RECAP, RECAP),
    # (the re-check's cases of this cell are 2-D and have no mask: these fail in the notebook only)
    "Q @ K.T": (A.dot_T, RECAP, set()),
    "if mask:": (A.if_mask, RECAP, set()),
}

CORRECT = {
    "scaled_dot_product_attention": dict(A.CORRECT),
    "cross_attention": {
        "plain": plain, "einsum": einsum_cross_attention, "seed attention": _lazy(_seed_cross_attention),
        "values projected last": values_projected_last, "W_q W_k^T folded, logsumexp": scores_through_one_matrix,
        "baddbmm with the mask": baddbmm_with_the_mask, "the notebook's own attention": calls_the_notebooks_attention,
    },
}
WRONG = {"scaled_dot_product_attention": RECAP_WRONG, "cross_attention": CROSS_WRONG}
