"""tiled_attention: the answers the generic harness (test_declarations.py) runs besides the declaration's
own mistakes: unusual correct answers, which must pass everywhere, and wrong answers that no mistake
names (a built-in called, a full matrix hidden from the measure, an input changed), each with the test
cells it fails in the notebook (its visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import math

import numpy as np
import torch

from course import as_student_code
from firstprinciples import reference

correct = as_student_code(reference.tiled_attention)  # what a correct student writes


def query_tiles(Q, K, V, block_size=64, causal=False):
    """Blocks of queries too, each over blocks of keys (FlashAttention's two loops)."""
    outs = []
    for q0 in range(0, Q.shape[-2], block_size):
        Q_b = Q[..., q0:q0 + block_size, :]
        m = torch.full(Q_b.shape[:-1] + (1,), float("-inf"), dtype=Q.dtype)
        l = torch.zeros_like(m)
        acc = torch.zeros(Q_b.shape[:-1] + (V.shape[-1],), dtype=Q.dtype)
        q_pos = torch.arange(q0, q0 + Q_b.shape[-2])[:, None]
        for k0 in range(0, K.shape[-2], block_size):
            if causal and k0 > q0 + Q_b.shape[-2] - 1:
                break  # every key of this block is in the future of every query of the tile
            s = Q_b @ K[..., k0:k0 + block_size, :].transpose(-2, -1) / math.sqrt(Q.shape[-1])
            if causal:
                k_pos = torch.arange(k0, k0 + s.shape[-1])[None, :]
                s = torch.where(k_pos <= q_pos, s, torch.tensor(float("-inf"), dtype=s.dtype))
            new = torch.maximum(m, s.amax(-1, keepdim=True))
            p = torch.exp(s - new)
            a = torch.exp(m - new)
            l = l * a + p.sum(-1, keepdim=True)
            acc = acc * a + p @ V[..., k0:k0 + block_size, :]
            m = new
        outs.append(acc / l)
    return torch.cat(outs, dim=-2)


def scaled_queries(Q, K, V, block_size=64, causal=False):
    Q = Q / math.sqrt(Q.shape[-1])
    m, l, acc = None, None, None
    for start in range(0, K.shape[-2], block_size):
        s = Q @ K[..., start:start + block_size, :].transpose(-2, -1)
        if causal:
            future = torch.arange(start, start + s.shape[-1]) > torch.arange(Q.shape[-2])[:, None]
            s = s.masked_fill(future, float("-inf"))
        bm = s.amax(-1, keepdim=True)
        if m is None:
            p = torch.exp(s - bm)
            m, l, acc = bm, p.sum(-1, keepdim=True), p @ V[..., start:start + block_size, :]
            continue
        new = torch.maximum(m, bm)
        p = torch.exp(s - new)
        l = l * torch.exp(m - new) + p.sum(-1, keepdim=True)
        acc = acc * torch.exp(m - new) + p @ V[..., start:start + block_size, :]
        m = new
    return acc / l


def log_sum_exp(Q, K, V, block_size=64, causal=False):
    """A running log of the normaliser, merged with torch.logaddexp, and a normalised output."""
    lse = torch.full(Q.shape[:-1] + (1,), float("-inf"), dtype=Q.dtype)
    out = torch.zeros(Q.shape[:-1] + (V.shape[-1],), dtype=Q.dtype)
    for start in range(0, K.shape[-2], block_size):
        s = Q @ K[..., start:start + block_size, :].transpose(-2, -1) / math.sqrt(Q.shape[-1])
        if causal:
            future = torch.arange(start, start + s.shape[-1]) > torch.arange(Q.shape[-2])[:, None]
            s = s.masked_fill(future, float("-inf"))
        block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        new = torch.logaddexp(lse, block_lse)
        block_out = torch.exp(s - block_lse).nan_to_num(0.0) @ V[..., start:start + block_size, :]
        out = out * torch.exp(lse - new) + block_out * torch.exp(block_lse - new).nan_to_num(0.0)
        lse = new
    return out


def last_block_first(Q, K, V, block_size=64, causal=False):
    """The blocks visited from the last to the first (a softmax does not care about the order), by
    torch.split, with scores from einsum and the running average of the values kept normalised."""
    scale = Q.shape[-1] ** -0.5
    starts = range(0, K.shape[-2], block_size)
    blocks = list(zip(starts, K.split(block_size, dim=-2), V.split(block_size, dim=-2)))
    top = Q.new_full((*Q.shape[:-1], 1), float("-inf"))  # the largest score so far
    total = Q.new_zeros((*Q.shape[:-1], 1))  # the weight so far, relative to top
    mean = Q.new_zeros((*Q.shape[:-1], V.shape[-1]))  # the weighted mean of the values so far
    for start, K_b, V_b in reversed(blocks):
        s = torch.einsum("...qd,...kd->...qk", Q, K_b) * scale
        if causal:  # (a block wholly in a query's future leaves that query's row as it is)
            seen = torch.arange(start, start + K_b.shape[-2]) <= torch.arange(Q.shape[-2]).unsqueeze(1)
            s = torch.where(seen, s, s.new_tensor(float("-inf")))
        new_top = torch.maximum(top, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)  # no key seen yet: 0
        p = (s - safe).exp()
        old = total * (top - safe).exp()
        total = old + p.sum(-1, keepdim=True)
        some = torch.where(total > 0, total, torch.ones_like(total))
        mean = mean * (old / some) + (p @ V_b) / some
        top = new_top
    return mean


def in_float64(Q, K, V, block_size=64, causal=False):
    """The reference's loop in float64 (each (T_q, block_size) block twice the bytes), cast back."""
    return correct(Q.double(), K.double(), V.double(), block_size, causal).to(Q.dtype)


def partials_merged_at_the_end(Q, K, V, block_size=64, causal=False):
    """Float64 throughout; each key block's max, sum and weighted values kept in a list and merged
    once at the end (many small tensors alive at once: the allocator's own reuse must not count as
    the answer's memory, ``recheck.allocate_plainly``)."""
    q, k, v = Q.double() / math.sqrt(Q.shape[-1]), K.double(), V.double()
    T_q, T_k = q.shape[-2], k.shape[-2]
    parts = []
    for s0 in range(0, T_k, block_size):
        s = q @ k[..., s0:s0 + block_size, :].transpose(-2, -1)
        if causal:
            keys = torch.arange(s0, s0 + s.shape[-1])
            s = s.masked_fill(keys[None, :] > torch.arange(T_q)[:, None] + (T_k - T_q), float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # (a row whose keys are all in the future)
        w = torch.exp(s - m)
        parts.append((m, w.sum(-1, keepdim=True), w @ v[..., s0:s0 + block_size, :]))
    top = torch.stack([p[0] for p in parts]).amax(0)
    total = sum(p[1] * torch.exp(p[0] - top) for p in parts)
    out = sum(p[2] * torch.exp(p[0] - top) for p in parts)
    return (out / total).to(Q.dtype)


CORRECT = {"reference": correct, "query tiles": query_tiles, "scaled queries": scaled_queries,
           "log-sum-exp": log_sum_exp, "last block first, a normalised mean": last_block_first,
           "computed in float64": in_float64, "partials merged at the end, float64": partials_merged_at_the_end}


def positions_within_the_block(Q, K, V, block_size=64, causal=False):
    """A student's tiled attention whose causal mask counts key positions from each block's start."""
    m, l, acc = None, None, None
    q_pos = torch.arange(Q.shape[-2])[:, None]
    for start in range(0, K.shape[-2], block_size):
        K_b, V_b = K[..., start:start + block_size, :], V[..., start:start + block_size, :]
        s = Q @ K_b.transpose(-2, -1) / math.sqrt(Q.shape[-1])
        if causal:
            s = s.masked_fill(torch.arange(K_b.shape[-2])[None, :] > q_pos, float("-inf"))
        bm = s.amax(-1, keepdim=True)
        new = bm if m is None else torch.maximum(m, bm)
        p = torch.exp(s - new)
        if m is None:
            l, acc = p.sum(-1, keepdim=True), p @ V_b
        else:
            l = l * torch.exp(m - new) + p.sum(-1, keepdim=True)
            acc = acc * torch.exp(m - new) + p @ V_b
        m = new
    return acc / l


def calls_softmax(Q, K, V, block_size=64, causal=False):
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if causal:
        s = s + torch.triu(torch.full(s.shape[-2:], float("-inf"), dtype=s.dtype), diagonal=1)
    return torch.softmax(s, dim=-1) @ V


def calls_torch_attention(Q, K, V, block_size=64, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal)


def calls_reference(Q, K, V, block_size=64, causal=False):
    return reference.tiled_attention(Q, K, V, block_size, causal)


def full_matrix_unwatched(Q, K, V, block_size=64, causal=False):
    """The whole (T_q, T_k) matrix, built where torch's dispatch modes cannot see it (the corpus's
    atk_tiled_full_matrix_unwatched): the notebook's measure misses it, the re-check's allocator does not."""
    with torch._C._DisableTorchDispatch():
        scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        w = torch.exp(scores - scores.amax(-1, keepdim=True))
        return (w / w.sum(-1, keepdim=True)) @ V


def full_matrix_in_numpy(Q, K, V, block_size=64, causal=False):
    """The whole (T_q, T_k) matrix, built in NumPy, where torch's allocator never sees it (the
    corpus's atk_tiled_full_matrix_in_numpy): the re-check's allocation tracer counts it."""
    q, k, v = (t.detach().numpy() for t in (Q, K, V))
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores + np.triu(np.full(scores.shape[-2:], -np.inf, dtype=q.dtype), 1)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return torch.from_numpy((w / w.sum(-1, keepdims=True)) @ v)


def scales_Q_in_place(Q, K, V, block_size=64, causal=False):
    Q /= math.sqrt(Q.shape[-1])  # changes the caller's tensor
    return correct(Q * math.sqrt(Q.shape[-1]), K, V, block_size, causal)


ALL = {"test_worked_example", "test_against_attention", "test_causal", "test_large_scores", "test_memory"}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
WRONG = {
    "calls torch.softmax": (calls_softmax, ALL, ALL),
    "calls torch's scaled_dot_product_attention": (calls_torch_attention, ALL, ALL),
    "calls the reference": (calls_reference, ALL, ALL),
    # (the notebook's large scores are not causal; the re-check's are too)
    "positions within the block (a student's)": (positions_within_the_block,
                                                 ALL - {"test_against_attention", "test_large_scores"},
                                                 ALL - {"test_against_attention"}),
    "the full matrix hidden from the measure": (full_matrix_unwatched, set(), {"test_memory"}),
    "the full matrix in NumPy": (full_matrix_in_numpy, set(), {"test_memory"}),
    "scales Q in place": (scales_Q_in_place, ALL, ALL),
    "returns numpy": (lambda Q, K, V, block_size=64, causal=False: correct(Q, K, V, block_size, causal).numpy(),
                      ALL, ALL),
    "casts to float32": (lambda Q, K, V, block_size=64, causal=False: correct(Q, K, V, block_size, causal).float(),
                         {"test_worked_example"}, ALL),  # (the re-check has float64 cases in every test)
}
