"""Every tiled-attention check accepts right answers and rejects typical wrong ones.

Correct answers: the reference, one that also tiles the queries, one that scales Q before the
blocks, and one that keeps a running log-sum-exp instead of a max and a sum. Wrong answers: the
package's named mistakes plus calls to torch's softmax and attention and to the reference.
The reference itself is validated against torch's scaled_dot_product_attention.
"""
from __future__ import annotations

import math

import pytest
import torch
from checktable import (assert_names_the_mistake, correct_answers_test, expectations_test, messages_test, naming_test,
                        outcome, rejections_test, variants_test)

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import tiled as C

CHECKS = {"worked": C.check_worked_example, "random": C.check_against_attention, "causal": C.check_causal,
          "large": C.check_large_scores, "memory": C.check_memory}
ALL = set(CHECKS)

correct = as_student_code(reference.tiled_attention)


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


CORRECT = {"reference": correct, "query tiles": query_tiles, "scaled queries": scaled_queries, "log-sum-exp": log_sum_exp}


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


MISTAKE_FAILS = {
    "the full score matrix": {"memory"},
    "the output not rescaled": ALL,
    "the running sum not rescaled": ALL,
    "no 1/sqrt(d_k)": ALL,
    "each block normalised on its own": ALL,
    "no running max": {"large"},
    "the max of the first block only": {"large"},
    "the causal mask hides the diagonal": ALL - {"random"},
    "the causal mask shows one future key": ALL - {"random"},
    "causal ignored": ALL - {"random"},
    "key positions counted within each block": ALL - {"random"},
    "the last partial block dropped": ALL - {"worked"},
    "the whole causal mask built first": {"memory"},
    "block_size ignored": {"memory"},
}
VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in C.MISTAKES}
VARIANTS.update({
    "calls torch.softmax": (calls_softmax, ALL),
    "calls torch's scaled_dot_product_attention": (calls_torch_attention, ALL),
    "calls the reference": (calls_reference, ALL),
    "positions within the block (a student's)": (positions_within_the_block, ALL - {"random"}),
})

test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, C.MISTAKES))
test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)
test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)
test_failure_names_the_mistake = naming_test(CHECKS, VARIANTS, [
    ("the output not rescaled", "random"),
    ("the running sum not rescaled", "random"),
    ("no 1/sqrt(d_k)", "worked"),
    ("the causal mask shows one future key", "causal"),
    ("causal ignored", "causal"),
    ("the last partial block dropped", "random"),
])
test_messages = messages_test(CHECKS, VARIANTS, [
    # One key at a time, a key's position within its block is 0: the same outputs as with causal ignored,
    # told apart by the diagnosis on blocks of two.
    ("positions within the block (a student's)", "worked", ["key positions counted within each block"]),
    ("positions within the block (a student's)", "causal", ["key positions counted within each block"]),
    ("the full score matrix", "memory", ["131,072", "block_size"]),
    ("the whole causal mask built first", "memory", ["(256, 256)"]),
    ("no running max", "large", ["non-finite", "overflows"]),
    ("calls torch.softmax", "worked", ["scores 0"]),
])


@pytest.mark.parametrize("causal", [False, True])
def test_reference_agrees_with_torch(causal):
    g = torch.Generator().manual_seed(0)
    for lead, T, d, block in (((2, 3), 37, 8, 8), ((1,), 100, 16, 64), ((), 5, 4, 1)):
        Q, K, V = (torch.randn(*lead, T, d, generator=g, dtype=torch.float64) for _ in range(3))
        want = torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal)
        assert torch.allclose(reference.tiled_attention(Q, K, V, block, causal), want, atol=1e-12)


def test_reference_keeps_within_the_memory_bound():
    Q, K, V = (torch.randn(2, 512, 16) for _ in range(3))
    _, sizes = C.measured_call(correct, Q, K, V, 32, True)
    assert sizes.largest <= C.allowed_elements(Q, K, V, 32) < 2 * 512 * 512 / 8


MEASURE_IN_A_FRESH_PROCESS = """
import sys, torch
from firstprinciples.checks import tiled as C
from firstprinciples import reference
fn = reference.tiled_attention.__wrapped__
if sys.argv[1] == "compiled":
    fn = torch.compile(fn, backend="eager")
Q, K, V = (torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
out, sizes = C.measured_call(fn, Q, K, V, 16, True)
assert torch.allclose(out, reference.tiled_attention(Q, K, V, 16, True))
print(sizes.largest, C.allowed_elements(Q, K, V, 16), "torch._dynamo" in sys.modules)
"""


def test_measuring_memory_needs_no_compiler_and_a_compiled_answer_is_measured_alike():
    """The memory measure (a dispatch mode) does not import torch._dynamo (0.7-1 s in every
    kernel, re-check and service that measures a tiled attention: torch's wrapper of a mode, kept
    for torch.compile, imports it at the mode's first operation); an answer run through
    torch.compile is still measured, with the same largest intermediate."""
    import subprocess
    import sys

    got = {kind: subprocess.run([sys.executable, "-c", MEASURE_IN_A_FRESH_PROCESS, kind], capture_output=True,
                                text=True, timeout=300) for kind in ("plain", "compiled")}
    for kind, proc in got.items():
        assert proc.returncode == 0, (kind, proc.stderr[-2000:])
    plain, compiled = (got[k].stdout.split() for k in ("plain", "compiled"))
    assert plain[2] == "False", "measuring a plain answer imported torch._dynamo"
    assert plain[:2] == compiled[:2] and int(plain[0]) <= int(plain[1]), (plain, compiled)


@pytest.mark.parametrize("check", ["worked", "causal"])
def test_positions_within_the_block_are_not_called_causal_ignored(check):
    ok, err = outcome(CHECKS[check], positions_within_the_block)
    assert not ok and "causal ignored" not in str(err), str(err)


def test_causal_ignored_is_still_named_one_key_at_a_time():
    """The confirmation on other blocks keeps the mistake that is really there."""
    assert_names_the_mistake(CHECKS["worked"], VARIANTS["causal ignored"][0], "causal ignored")
