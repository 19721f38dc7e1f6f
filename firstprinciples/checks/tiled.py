"""Checks for ``tiled_attention(Q, K, V, block_size=64, causal=False)``.

Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v) -> (..., T_q, d_v), equal to
softmax(Q K^T / sqrt(d_k)) V, computed over blocks of ``block_size`` keys.

Visible checks (the student runs them): the cat-sat-mat example one key at a time,
random shapes, the causal case, large scores and the memory test. Hidden checks
(``full=True``): more shapes, block sizes (1, one block for everything, the default 64),
float64, and comparisons with ``torch.nn.functional.scaled_dot_product_attention``.

Decisions stated once:

- **Values**: the tolerances of ``_core`` (float32 atol 1e-5, rtol 1e-4; float64 1e-10,
  1e-8). The online softmax adds the blocks in another order than one softmax does, which
  moves float32 results by about 1e-7 relative; every named mistake moves them by more than 1e-2.
- **Memory, measured**: the answer runs under a ``TorchDispatchMode`` that sees every tensor
  that every torch operation creates, and records the size of its storage (views share their
  base's storage and cost nothing). No storage may hold more elements than the largest of
  (..., T_q, block_size), the output and the inputs. The cases make the full (..., T_q, T_k)
  score matrix 8 times larger than that, so building it, even for a moment (a full causal mask,
  a softmax over all keys), fails.
- torch's softmax (any function whose name contains "softmax") and scaled_dot_product_attention,
  and the course's references, are forbidden: the answer scores 0 in every test if it calls them.
"""
from __future__ import annotations

import math

import torch

from .. import examples
from ..guard import call_without
from ..memory import StorageSizes
from ..reference import scaled_dot_product_attention as attention
from ._student import wrap_checks
from ._core import Mistake, assert_matches, diagnose, expect_tensor

FORBIDDEN = dict(
    torch_patterns=("softmax", "scaled_dot_product_attention"),
    pieces=("tiled_attention", "scaled_dot_product_attention", "softmax"),
    what="tiled attention",
)


# ---------------------------------------------------------------- measuring memory
def allowed_elements(Q, K, V, block_size):
    """The most elements one intermediate may hold: (..., T_q, block_size), the output or an input."""
    lead = math.prod(Q.shape[:-2])
    T_q = Q.shape[-2]
    return max(lead * T_q * min(block_size, K.shape[-2]), lead * T_q * V.shape[-1], Q.numel(), K.numel(), V.numel())


def measured_call(fn, Q, K, V, block_size, causal):
    """(output, StorageSizes) of fn on copies of the inputs, under the guard."""
    copies = [t.clone() for t in (Q, K, V)]
    sizes = StorageSizes()
    with sizes:
        out = call_without(fn, copies, {"block_size": block_size, "causal": causal}, **FORBIDDEN)
    for name, orig, seen in zip("QKV", (Q, K, V), copies):
        if not torch.equal(orig, seen):
            raise AssertionError(f"Your function changed its input {name} in place. Build new tensors instead "
                                 "(acc = acc * rescale, not acc *= rescale).")
    return expect_tensor("tiled_attention(...)", out), sizes


# ---------------------------------------------------------------- mistakes
def _blocks(fn):
    """A tiled attention built from a per-block update ``fn(state, scores, V_b) -> state``."""

    def attend(Q, K, V, block_size=64, causal=False, scale=None, step=None, drop_last=False, mask_shift=0,
               local_positions=False):
        T_q, T_k = Q.shape[-2], K.shape[-2]
        scale = 1 / math.sqrt(Q.shape[-1]) if scale is None else scale
        step = block_size if step is None else step
        state = None
        q_pos = torch.arange(T_q)[:, None]
        stop = T_k - T_k % step if drop_last else T_k
        for start in range(0, stop, step):
            K_b, V_b = K[..., start:start + step, :], V[..., start:start + step, :]
            s = Q @ K_b.transpose(-2, -1) * scale
            if causal:
                first = 0 if local_positions else start
                k_pos = torch.arange(first, first + K_b.shape[-2])[None, :]
                s = s.masked_fill(k_pos > q_pos + mask_shift, float("-inf"))
            state = fn(state, s, V_b)
        m, l, acc = state
        return acc / l

    return attend


def _online(rescale_acc=True, rescale_sum=True, use_max=True, first_max_only=False):
    def update(state, s, V_b):
        if state is None:
            m = s.amax(-1, keepdim=True) if use_max else torch.zeros_like(s[..., :1])
            p = torch.exp(s - m)
            return m, p.sum(-1, keepdim=True), p @ V_b
        m, l, acc = state
        new = torch.maximum(m, s.amax(-1, keepdim=True)) if use_max and not first_max_only else m
        p, alpha = torch.exp(s - new), torch.exp(m - new)
        return (new, (l * alpha if rescale_sum else l) + p.sum(-1, keepdim=True),
                (acc * alpha if rescale_acc else acc) + p @ V_b)

    return update


def _correct_blocks(**options):
    base = _blocks(_online())
    return lambda Q, K, V, block_size=64, causal=False: base(Q, K, V, block_size, causal, **options)


def _per_block_softmax(Q, K, V, block_size=64, causal=False):
    """Each block's own softmax, averaged: the blocks are never put on one scale."""
    outs = []
    attend = _blocks(_online())
    for start in range(0, K.shape[-2], block_size):
        outs.append(attend(Q, K[..., start:start + block_size, :], V[..., start:start + block_size, :], block_size))
    if causal:  # a causal version is not worth writing: this mistake is about the scale
        return attend(Q, K, V, block_size, causal) * 0.5
    return sum(outs) / len(outs)


def _full_scores(Q, K, V, block_size=64, causal=False):
    """Exact, but with the whole (..., T_q, T_k) matrix and a hand-written softmax."""
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if causal:
        s = s + torch.triu(torch.full(s.shape[-2:], float("-inf"), dtype=s.dtype), diagonal=1)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ V


def _full_causal_mask(Q, K, V, block_size=64, causal=False):
    """Tiled, but the causal mask is built for all T_q x T_k pairs first."""
    if not causal:
        return _correct_blocks()(Q, K, V, block_size)
    T = Q.shape[-2]
    mask = torch.triu(torch.full((T, T), float("-inf"), dtype=Q.dtype), diagonal=1)  # (T, T)
    attend = _blocks(lambda state, s, V_b: _online()(state, s, V_b))
    out, m, l, acc = None, None, None, None
    state = None
    for start in range(0, T, block_size):
        s = Q @ K[..., start:start + block_size, :].transpose(-2, -1) / math.sqrt(Q.shape[-1])
        state = _online()(state, s + mask[:, start:start + block_size], V[..., start:start + block_size, :])
    m, l, acc = state
    return acc / l


def _block_size_ignored(Q, K, V, block_size=64, causal=False):
    return _correct_blocks()(Q, K, V, 64, causal)


MISTAKES = (
    Mistake("the full score matrix",
            "the values are right, but the whole (..., T_q, T_k) score matrix is built: take the keys block_size "
            "at a time and keep only a running max, a running sum and the unnormalised output.", _full_scores),
    Mistake("the output not rescaled",
            "when the running max grows, multiply the unnormalised output by exp(old max - new max) too, "
            "as you do the running sum: both were computed against the old max.", _blocks(_online(rescale_acc=False))),
    Mistake("the running sum not rescaled",
            "when the running max grows, multiply the running sum by exp(old max - new max): its terms were "
            "computed against the old max.", _blocks(_online(rescale_sum=False))),
    Mistake("no 1/sqrt(d_k)",
            "divide every block of scores by sqrt(d_k), as in scaled dot-product attention.", _correct_blocks(scale=1.0)),
    Mistake("each block normalised on its own",
            "a softmax per block puts each block on its own scale: keep one running max and one running sum over "
            "all the blocks, and divide by the sum once, at the end.", _per_block_softmax),
    Mistake("no running max",
            "exp of a score above about 89 (float32) overflows: subtract a running max, and rescale what you "
            "have when it grows.", _blocks(_online(use_max=False))),
    Mistake("the max of the first block only",
            "a later block can hold larger scores than the first one: update the running max with every block "
            "(and rescale), or exp overflows.", _blocks(_online(first_max_only=True))),
    Mistake("the causal mask hides the diagonal",
            "query i sees keys 0..i, itself included: hide a key only when its position is greater than the query's.",
            _correct_blocks(mask_shift=-1)),
    Mistake("the causal mask shows one future key",
            "query i sees keys 0..i only: hide every key whose position is greater than i.", _correct_blocks(mask_shift=1)),
    Mistake("causal ignored",
            "with causal=True, hide (with -inf) each key whose position is after the query's, in every block.",
            lambda Q, K, V, block_size=64, causal=False: _correct_blocks()(Q, K, V, block_size, False)),
    Mistake("key positions counted within each block",
            "a key's position is its place in the whole sequence: the key at index j of the block that starts at "
            "`start` is at position start + j, and is hidden from query i when start + j > i.",
            _correct_blocks(local_positions=True)),
    Mistake("the last partial block dropped",
            "when T_k is not a multiple of block_size, the last block is shorter; range(0, T_k, block_size) "
            "with slicing includes it.", _correct_blocks(drop_last=True)),
    Mistake("the whole causal mask built first",
            "a (T, T) mask is as large as the score matrix: build each block's mask from the positions of its keys.",
            _full_causal_mask),
    Mistake("block_size ignored",
            "use the block_size argument: every intermediate must fit in (..., T_q, block_size).", _block_size_ignored),
)


# ---------------------------------------------------------------- comparing
def _label(Q, K, V, block_size, causal):
    dt = str(Q.dtype).replace("torch.", "")
    return (f"for {dt} Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}, block_size={block_size}"
            + (", causal=True" if causal else ""))


def _expected(Q, K, V, causal):
    mask = None
    if causal:
        T = Q.shape[-2]
        mask = torch.triu(torch.full((T, T), float("-inf"), dtype=Q.dtype), diagonal=1)
    return attention(Q, K, V, mask)[0]


def _compare(fn, Q, K, V, block_size, causal, *, against_torch=False, memory=False, label=""):
    label = label or _label(Q, K, V, block_size, causal)
    got, sizes = measured_call(fn, Q, K, V, block_size, causal)
    want = _expected(Q, K, V, causal)
    kwargs = {"block_size": block_size, "causal": causal}

    def check():
        assert_matches("tiled_attention(Q, K, V)", got, want, context=label)
        if against_torch:
            ref = torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=causal)
            assert_matches("tiled_attention(Q, K, V)", got, ref, context=label + " (against torch's attention)")

    try:
        check()
    except AssertionError as err:
        # (confirmed with another block size: one key at a time, a key's position within its block is
        # 0, never after a query's, exactly as if causal were ignored)
        other = {"block_size": block_size + 1 if block_size < K.shape[-2] else max(block_size - 1, 1), "causal": causal}
        found = diagnose((got,), (Q, K, V), MISTAKES, _correct_blocks(), kwargs, answer=fn, confirm=[((Q, K, V), other)])
        lines = "".join(f"\n  - {m.label}: {m.hint}" for m in found if m.label != "the full score matrix")
        hint = f"\nYour output matches a typical mistake:{lines}" if lines else ""
        if not bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all()) and not lines:
            hint = ("\nSome outputs are not finite: does exp overflow (no running max, or a stale one), or does a "
                    "row see no key at all (a causal mask that hides the diagonal)?")
        raise AssertionError(f"{err}{hint}") from None
    if memory:
        limit = allowed_elements(Q, K, V, block_size)
        if sizes.largest > limit:
            full = math.prod(Q.shape[:-2]) * Q.shape[-2] * K.shape[-2]
            raise AssertionError(
                f"Your answer is right {label}, but it holds a tensor of {sizes.largest:,} elements (shape "
                f"{sizes.shape}, made by aten.{sizes.op}); the most allowed is {limit:,}, the size of (..., T_q, "
                f"block_size), the output or an input. The full score matrix would have {full:,}. Take the keys "
                "block_size at a time, and build any mask for one block only.")
    return got


def _qkv(g, lead, T_q, T_k, d_k, d_v, dtype, scale=1.0):
    Q = torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype) * scale
    K = torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype) * scale
    V = torch.randn(*lead, T_k, d_v, generator=g, dtype=dtype)
    return Q, K, V


# ---------------------------------------------------------------- visible
def check_worked_example(fn):
    """Cat, sat and mat one key at a time (block_size=1) give the chapter's attention output: Cat's row
    is (1.026, 0.974); also with causal=True. The queries of sat and mat score the second key highest,
    so their running max grows on the way."""
    Q, K, V = examples.cat_sat_mat(torch.float64, all_queries=True)
    for causal in (False, True):
        got = _compare(fn, Q, K, V, 1, causal, label="for the cat-sat-mat example (float64, T = 3), block_size=1"
                       + (", causal=True" if causal else ""))
        if not causal:
            cat = [round(v, 3) for v in got[0].tolist()]
            assert cat == list(examples.OUTPUT), f"Cat's output should be {examples.OUTPUT}, got {cat}."


def check_against_attention(fn, full=True):
    """Random inputs against softmax(Q K^T / sqrt(d_k)) V: batch and head dimensions, T_q != T_k,
    d_v != d_k, T_k not a multiple of block_size. At grading also block_size 1, one block for everything,
    the default 64, a single key, float64, and torch's scaled_dot_product_attention."""
    g = torch.Generator().manual_seed(21)
    cases = [((2,), 10, 10, 4, 4, 4, torch.float32), ((2, 3), 7, 13, 8, 5, 5, torch.float32)]
    if full:
        cases += [((), 5, 9, 3, 2, 1, torch.float64), ((2,), 6, 11, 4, 6, 32, torch.float32),
                  ((1, 2), 150, 150, 8, 8, 64, torch.float32), ((3,), 4, 1, 4, 3, 4, torch.float64),
                  ((2, 2), 9, 20, 6, 4, 7, torch.float64)]
    for lead, T_q, T_k, d_k, d_v, block, dtype in cases:
        Q, K, V = _qkv(g, lead, T_q, T_k, d_k, d_v, dtype)
        _compare(fn, Q, K, V, block, False, against_torch=full)
    if full:  # the default block size
        Q, K, V = _qkv(g, (2,), 70, 130, 8, 8, torch.float32)
        got = call_without(fn, (Q.clone(), K.clone(), V.clone()), {}, **FORBIDDEN)
        assert_matches("tiled_attention(Q, K, V)", expect_tensor("tiled_attention(Q, K, V)", got), _expected(Q, K, V, False),
                       context=_label(Q, K, V, 64, False) + " (block_size left at its default)")


def check_causal(fn, full=True):
    """causal=True: query i sees keys 0..i, for T = 1, 9 and 16 with blocks of 4 (at grading also blocks
    of 1 and 5, one block for everything, float64 and torch's attention with is_causal=True)."""
    g = torch.Generator().manual_seed(22)
    cases = [((), 1, 2, 2, 4, torch.float32), ((2,), 9, 4, 3, 4, torch.float32), ((2, 2), 16, 8, 8, 4, torch.float32)]
    if full:
        cases += [((3,), 7, 4, 4, 1, torch.float64), ((2,), 12, 4, 6, 5, torch.float64),
                  ((1,), 10, 8, 8, 16, torch.float32), ((2, 3), 33, 8, 8, 8, torch.float32)]
    for lead, T, d_k, d_v, block, dtype in cases:
        Q, K, V = _qkv(g, lead, T, T, d_k, d_v, dtype)
        _compare(fn, Q, K, V, block, True, against_torch=full)


def check_large_scores(fn, full=True):
    """Scores in the hundreds, the largest in the last blocks: the running max must follow them, or exp
    overflows (float32 from about 89). At grading also float64 (scores near 1000) and causal=True."""
    g = torch.Generator().manual_seed(23)
    cases = [((2,), 6, 12, 4, 3, torch.float32, False, 8.0)]
    if full:
        cases += [((1, 2), 5, 17, 4, 4, torch.float64, False, 25.0), ((2,), 12, 12, 4, 5, torch.float32, True, 8.0)]
    for lead, T_q, T_k, d, block, dtype, causal, scale in cases:
        Q, K, V = _qkv(g, lead, T_q, T_k, d, d, dtype)
        Q = Q.abs() * scale  # positive queries
        growth = torch.linspace(0.2, 1.0, T_k, dtype=dtype)[:, None]  # later keys score higher
        K = (K.abs() * scale) * growth
        _compare(fn, Q, K, V, block, causal, label=_label(Q, K, V, block, causal) + ", scores up to "
                 f"{float((Q @ K.transpose(-2, -1)).max() / math.sqrt(d)):.0f}")


def check_memory(fn, full=True):
    """No tensor larger than (..., T_q, block_size), the output or the inputs is ever created (measured:
    every tensor every torch operation makes), and the output is right: T = 256 in blocks of 32, with and
    without causal=True. At grading also T_q != T_k and other block sizes."""
    g = torch.Generator().manual_seed(24)
    cases = [((2,), 256, 256, 16, 16, 32, False), ((2,), 256, 256, 16, 16, 32, True)]
    if full:
        cases += [((2, 2), 64, 300, 8, 8, 20, False), ((1,), 200, 200, 8, 12, 24, True),
                  ((3,), 160, 480, 4, 6, 60, False)]
    for lead, T_q, T_k, d_k, d_v, block, causal in cases:
        Q, K, V = _qkv(g, lead, T_q, T_k, d_k, d_v, torch.float32)
        _compare(fn, Q, K, V, block, causal, memory=True)


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
