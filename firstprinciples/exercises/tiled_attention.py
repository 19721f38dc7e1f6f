"""tiled_attention(Q, K, V, block_size=64, causal=False): the exercise's tests, declared once.

Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v) -> (..., T_q, d_v), equal to
softmax(Q K^T / sqrt(d_k)) V, computed over blocks of ``block_size`` keys with an online softmax.

Decisions stated once:

- **Values**: ``grading.compare``'s default tolerances (float32 atol 1e-5, rtol 1e-4; float64 1e-10,
  1e-8). The online softmax adds the blocks in another order than one softmax does, which moves
  float32 results by about 1e-7 relative; every named mistake moves them by more than 1e-2. The
  expected values are the course's tiled reference, which ``tests/exercises/test_tiled_attention.py``
  shows equal to ``torch.nn.functional.scaled_dot_product_attention`` (with and without is_causal).
- **Memory, measured twice.** On the memory cases the adapter runs the answer under
  ``memory.StorageSizes``, a dispatch mode that sees every tensor every torch operation creates and
  records the size of its storage (views cost nothing), and reports the largest one when it holds more
  elements than the bound (``allowed_elements``: the largest of (..., T_q, block_size), the output and
  the inputs): the property ``within_the_memory_bound`` fails it with its shape. The cases make the
  full (..., T_q, T_k) score matrix 8 times larger than the bound, so building it, even for a moment
  (a full causal mask, a softmax over all keys), fails. An answer can switch dispatch modes off
  (``torch._C._DisableTorchDispatch``), so the re-check's watch also records every allocation at
  torch's allocator on the cases tagged "memory" and fails one larger than the bound in float64
  (``memory_bound``, the exercise's ``memory``); the reference's largest allocation is half of it.
- torch's softmax (any function whose name contains "softmax") and scaled_dot_product_attention,
  and the course's references, are forbidden: an answer that calls them scores 0 in every test.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import examples
from ..memory import StorageSizes  # (imported here, not in the adapter: an import inside a measured call is counted)
from . import Exercise, Mistake, Test, case

OVER = "the largest tensor created"  # the adapter's report on the memory cases: empty when within the bound
AFTER = " after the call"


# ---------------------------------------------------------------- memory
def allowed_elements(Q, K, V, block_size=64) -> int:
    """The most elements one intermediate may hold: (..., T_q, block_size), the output or an input
    (from the shapes only: torch tensors or NumPy arrays)."""
    lead = math.prod(Q.shape[:-2])
    T_q = Q.shape[-2]
    sizes = (math.prod(t.shape) for t in (Q, K, V))
    return max(lead * T_q * min(int(block_size), K.shape[-2]), lead * T_q * V.shape[-1], *sizes)


def memory_bound(case) -> int:
    """The largest tensor a memory case may allocate, in bytes, as the re-check's watch counts them
    at torch's allocator: ``allowed_elements`` in float64, the widest dtype an honest answer computes in."""
    return 8 * allowed_elements(case["Q"], case["K"], case["V"], case.get("block_size", 64))


# ---------------------------------------------------------------- the adapter
def adapter(fn, case):
    """The output on fresh copies of Q, K, V (block_size left at its default when the case has
    none) and the inputs after the call; on a case with ``measure``, also ``OVER``: the largest
    tensor any torch operation created, as [*its shape, its storage's elements], when it holds
    more than ``allowed_elements`` (an empty array when it does not)."""
    Q, K, V = (case[n].detach().clone() for n in "QKV")
    kwargs = {"causal": bool(case["causal"])}
    if "block_size" in case:
        kwargs["block_size"] = int(case["block_size"])
    res = {}
    if case.get("measure"):
        sizes = StorageSizes()
        with sizes:
            out = fn(Q, K, V, **kwargs)
        over = sizes.largest > allowed_elements(case["Q"], case["K"], case["V"], kwargs.get("block_size", 64))
        res[OVER] = torch.tensor([*sizes.shape, sizes.largest] if over else [], dtype=torch.int64)
    else:
        out = fn(Q, K, V, **kwargs)
    return {"output": out, **res, **{f"{n}{AFTER}": t.detach() for n, t in zip("QKV", (Q, K, V))}}


# ---------------------------------------------------------------- typical mistakes
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
    attend = _blocks(_online())
    if causal:  # a causal version is not worth writing: this mistake is about the scale
        return attend(Q, K, V, block_size, causal) * 0.5
    outs = [attend(Q, K[..., s:s + block_size, :], V[..., s:s + block_size, :], block_size)
            for s in range(0, K.shape[-2], block_size)]
    return sum(outs) / len(outs)


def _full_scores(Q, K, V, block_size=64, causal=False):
    """Exact, but with the whole (..., T_q, T_k) matrix and a hand-written softmax."""
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if causal:
        s = s + torch.triu(torch.full(s.shape[-2:], float("-inf"), dtype=s.dtype), diagonal=1)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ V


def _full_causal_mask(Q, K, V, block_size=64, causal=False):
    """Tiled, but the causal mask is built for all T x T pairs first."""
    if not causal:
        return _correct_blocks()(Q, K, V, block_size)
    T = Q.shape[-2]
    mask = torch.triu(torch.full((T, T), float("-inf"), dtype=Q.dtype), diagonal=1)  # (T, T)
    state = None
    for start in range(0, T, block_size):
        s = Q @ K[..., start:start + block_size, :].transpose(-2, -1) / math.sqrt(Q.shape[-1])
        state = _online()(state, s + mask[:, start:start + block_size], V[..., start:start + block_size, :])
    m, l, acc = state
    return acc / l


def _block_size_ignored(Q, K, V, block_size=64, causal=False):
    return _correct_blocks()(Q, K, V, 64, causal)


def _causal_ignored(Q, K, V, block_size=64, causal=False):
    return _correct_blocks()(Q, K, V, block_size, False)


WORKED, RANDOM, CAUSAL, LARGE, MEMORY = ("test_worked_example", "test_against_attention", "test_causal",
                                         "test_large_scores", "test_memory")
ALL = frozenset({WORKED, RANDOM, CAUSAL, LARGE, MEMORY})
CAUSAL_CELLS = frozenset({WORKED, CAUSAL, MEMORY})  # (the notebook's large scores are not causal: the re-check's are)
MISTAKES = (
    Mistake("the full score matrix",
            "the values are right, but the whole (..., T_q, T_k) score matrix is built: take the keys block_size "
            "at a time and keep only a running max, a running sum and the unnormalised output.",
            _full_scores, frozenset({MEMORY})),
    Mistake("the output not rescaled",
            "when the running max grows, multiply the unnormalised output by exp(old max - new max) too, "
            "as you do the running sum: both were computed against the old max.",
            _blocks(_online(rescale_acc=False)), ALL),
    Mistake("the running sum not rescaled",
            "when the running max grows, multiply the running sum by exp(old max - new max): its terms were "
            "computed against the old max.", _blocks(_online(rescale_sum=False)), ALL),
    Mistake("no 1/sqrt(d_k)", "divide every block of scores by sqrt(d_k), as in scaled dot-product attention.",
            _correct_blocks(scale=1.0), ALL),
    Mistake("each block normalised on its own",
            "a softmax per block puts each block on its own scale: keep one running max and one running sum over "
            "all the blocks, and divide by the sum once, at the end.", _per_block_softmax, ALL),
    Mistake("no running max",
            "exp of a score above about 89 (float32) overflows: subtract a running max, and rescale what you "
            "have when it grows.", _blocks(_online(use_max=False)), frozenset({LARGE})),
    Mistake("the max of the first block only",
            "a later block can hold larger scores than the first one: update the running max with every block "
            "(and rescale), or exp overflows.", _blocks(_online(first_max_only=True)), frozenset({LARGE})),
    Mistake("the causal mask hides the diagonal",
            "query i sees keys 0..i, itself included: hide a key only when its position is greater than the query's.",
            _correct_blocks(mask_shift=-1), CAUSAL_CELLS, frozenset({LARGE})),
    Mistake("the causal mask shows one future key",
            "query i sees keys 0..i only: hide every key whose position is greater than i.",
            _correct_blocks(mask_shift=1), CAUSAL_CELLS, frozenset({LARGE})),
    Mistake("causal ignored", "with causal=True, hide (with -inf) each key whose position is after the query's, "
                              "in every block.", _causal_ignored, CAUSAL_CELLS, frozenset({LARGE})),
    Mistake("key positions counted within each block",
            "a key's position is its place in the whole sequence: the key at index j of the block that starts at "
            "`start` is at position start + j, and is hidden from query i when start + j > i.",
            _correct_blocks(local_positions=True), CAUSAL_CELLS, frozenset({LARGE})),
    Mistake("the last partial block dropped",
            "when T_k is not a multiple of block_size, the last block is shorter; range(0, T_k, block_size) "
            "with slicing includes it.", _correct_blocks(drop_last=True), frozenset({WORKED, RANDOM, CAUSAL}),
            frozenset({LARGE, MEMORY})),
    Mistake("the whole causal mask built first",
            "a (T, T) mask is as large as the score matrix: build each block's mask from the positions of its keys.",
            _full_causal_mask, frozenset({MEMORY})),
    Mistake("block_size ignored",
            "use the block_size argument: every intermediate must fit in (..., T_q, block_size).",
            _block_size_ignored, frozenset({MEMORY})),
)


# ---------------------------------------------------------------- properties (plain data)
def cats_row(case, out, want):
    """Cat's row of the worked example is the chapter's printed output, (1.026, 0.974)."""
    if "printed" not in case["tags"]:
        return None
    got = out["output"]
    cat = [round(float(v), 3) for v in got[0]] if got.ndim == 2 and got.shape[0] else None
    if cat != list(examples.OUTPUT):
        return f"Cat's output should be {examples.OUTPUT}, got {cat}."
    return None


def within_the_memory_bound(case, out, want):
    """On a memory case, no tensor the answer created holds more than ``allowed_elements``."""
    over = out.get(OVER)
    if over is None or not over.size:
        return None
    *shape, largest = (int(v) for v in over)
    Q, K, V = case["Q"], case["K"], case["V"]
    limit = allowed_elements(Q, K, V, case.get("block_size", 64))
    full = math.prod(Q.shape[:-2]) * Q.shape[-2] * K.shape[-2]
    return (f"it holds a tensor of {largest:,} elements (shape {tuple(shape)}); the most allowed is {limit:,}, the "
            f"size of (..., T_q, block_size), the output or an input. The full score matrix would have {full:,}. "
            "Take the keys block_size at a time, and build any mask for one block only.")


# ---------------------------------------------------------------- the cases
def _label(Q, K, V, block_size, causal, extra=""):
    size = f"block_size={block_size}" if block_size is not None else "block_size left at its default (64)"
    return (f"for {Q.dtype} Q {Q.shape}, K {K.shape}, V {V.shape}, {size}" + (", causal=True" if causal else "")
            + extra)


def _case(tag, Q, K, V, block_size, causal, extra=""):
    inputs = {"Q": Q, "K": K, "V": V, "causal": causal}
    if block_size is not None:
        inputs["block_size"] = block_size
    if tag == "memory":
        inputs["measure"] = True
    return case(_label(Q, K, V, block_size, causal, extra), tag, **inputs)


def _torch_qkv(g, lead, T_q, T_k, d_k, d_v, dtype):
    """Q, K, V drawn from a seeded torch generator (the notebook's cases, as the old checks drew them)."""
    Q = torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype)
    K = torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype)
    V = torch.randn(*lead, T_k, d_v, generator=g, dtype=dtype)
    return Q.numpy(), K.numpy(), V.numpy()


def _large(Q, K, scale):
    """Positive queries and keys, later keys scoring higher (by up to 5 times): the running max must follow."""
    growth = np.linspace(0.2, 1.0, K.shape[-2], dtype=K.dtype)[:, None]
    return np.abs(Q) * np.asarray(scale, Q.dtype), np.abs(K) * np.asarray(scale, K.dtype) * growth


def _largest_score(Q, K):
    return f", scores up to {float((Q @ np.swapaxes(K, -1, -2)).max() / math.sqrt(Q.shape[-1])):.0f}"


def _visible() -> tuple:
    Q, K, V = (t.numpy() for t in examples.cat_sat_mat(torch.float64, all_queries=True))
    worked = "for the cat-sat-mat example (float64, T = 3), "
    cases = [
        case(worked + "block_size=1", ("worked", "printed"), Q=Q, K=K, V=V, block_size=1, causal=False),
        # (in blocks of two, key positions counted within each block differ from causal ignored;
        # one key at a time they give the same outputs)
        case(worked + "block_size=2, causal=True", "worked", Q=Q, K=K, V=V, block_size=2, causal=True),
        case(worked + "block_size=1, causal=True", "worked", Q=Q, K=K, V=V, block_size=1, causal=True),
    ]
    g = torch.Generator().manual_seed(21)
    for lead, T_q, T_k, d_k, d_v, block in (((2,), 10, 10, 4, 4, 4), ((2, 3), 7, 13, 8, 5, 5)):
        cases.append(_case("random", *_torch_qkv(g, lead, T_q, T_k, d_k, d_v, torch.float32), block, False))
    g = torch.Generator().manual_seed(22)
    for lead, T, d_k, d_v, block in (((), 1, 2, 2, 4), ((2,), 9, 4, 3, 4), ((2, 2), 16, 8, 8, 4)):
        cases.append(_case("causal", *_torch_qkv(g, lead, T, T, d_k, d_v, torch.float32), block, True))
    g = torch.Generator().manual_seed(23)
    Q, K, V = _torch_qkv(g, (2,), 6, 12, 4, 4, torch.float32)
    Q, K = _large(Q, K, 8.0)
    cases.append(_case("large", Q, K, V, 3, False, _largest_score(Q, K)))
    g = torch.Generator().manual_seed(24)
    for causal in (False, True):
        cases.append(_case("memory", *_torch_qkv(g, (2,), 256, 256, 16, 16, torch.float32), 32, causal))
    return tuple(cases)


def _normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _drawn(rng, lead, T_q, T_k, d_k, d_v, dtype):
    return tuple(_normal(rng, (*lead, T, d), dtype) for T, d in ((T_q, d_k), (T_k, d_k), (T_k, d_v)))


def secret(rng: np.random.Generator) -> list:
    """The re-check's cases, drawn in the grader: every visible situation, and more shapes, block sizes
    (1, one block for everything, the default 64), float64, a single key, T_q != T_k in the memory test."""
    r = lambda lo, hi: int(rng.integers(lo, hi))  # noqa: E731
    out = []
    for block, causal in ((1, False), (2, True), (1, True)):  # the example's sizes, fresh numbers (as _visible)
        Q, K, V = _drawn(rng, (), 3, 3, 2, 2, "float64")
        # the key that the first query scores highest goes last, so that its running max grows
        last = int(np.argmax(K @ Q[0]))
        order = [i for i in range(3) if i != last] + [last]
        out.append(_case("worked", Q, K[order], V[order], block, causal))
    for lead, T_q, T_k, d_k, d_v, block, dtype in (
            ((2,), 10, r(9, 15), 4, 4, 4, "float32"), ((2, 3), 7, 13, 8, 5, 5, "float32"),
            ((), 5, 9, 3, 2, 1, "float64"), ((2,), 6, 11, 4, 6, 32, "float32"),
            ((1, 2), 150, 150, 8, 8, 64, "float32"), ((3,), 4, 1, 4, 3, 4, "float64"),
            ((2, 2), 9, r(15, 25), 6, 4, 7, "float64"), ((2,), 70, 130, 8, 8, None, "float32"),
            ((r(1, 4),), r(2, 12), r(2, 40), r(1, 9), r(1, 9), r(1, 12), "float64")):
        out.append(_case("random", *_drawn(rng, lead, T_q, T_k, d_k, d_v, dtype), block, False))
    for lead, T, d_k, d_v, block, dtype in (
            ((), 1, 2, 2, 4, "float32"), ((2,), 9, 4, 3, 4, "float32"), ((2, 2), 16, 8, 8, 4, "float32"),
            ((3,), 7, 4, 4, 1, "float64"), ((2,), r(10, 14), 4, 6, 5, "float64"), ((1,), 10, 8, 8, 16, "float32"),
            ((2, 3), 33, 8, 8, 8, "float32"), ((2,), r(65, 90), 4, 4, None, "float64")):
        out.append(_case("causal", *_drawn(rng, lead, T, T, d_k, d_v, dtype), block, True))
    for lead, T_q, T_k, d, block, dtype, causal, scale in (
            ((2,), 6, 12, 4, 3, "float32", False, 8.0), ((1, 2), 5, 17, 4, 4, "float64", False, 25.0),
            ((2,), 12, 12, 4, 5, "float32", True, 8.0), ((3,), r(6, 16), r(12, 30), 4, r(3, 7), "float32", False, 6.0)):
        Q, K, V = _drawn(rng, lead, T_q, T_k, d, d, dtype)
        Q, K = _large(Q, K, scale)
        out.append(_case("large", Q, K, V, block, causal, ", large scores"))
    for lead, T_q, T_k, d_k, d_v, block, causal, dtype in (
            ((2,), 256, 256, 16, 16, 32, False, "float32"), ((2,), 256, 256, 16, 16, 32, True, "float32"),
            ((2, 2), 64, 300, 8, 8, 20, False, "float32"), ((1,), 200, 200, 8, 12, 24, True, "float32"),
            ((3,), 160, 480, 4, 6, 60, False, "float32"), ((2,), 160, 160, 8, 8, 20, True, "float64")):
        out.append(_case("memory", *_drawn(rng, lead, T_q, T_k, d_k, d_v, dtype), block, causal))
    # One case large enough to be seen from outside the runner's process: its whole (T_q, T_k) matrix
    # is 64 MB in float32 (32 MB in float16), a correct answer's (T_q, block_size) blocks 1 MB each (and
    # fewer blocks than a block has keys, so that a list of every block's (T_q, 1) partial results, a
    # correct if wasteful design, stays within the bound too). It runs first and unwatched, in a runner
    # that has done nothing else yet, and the grader reads how much memory the operating system gave
    # that process (``alone``: trusted.RESIDENT_ALLOWANCE). Unwatched, it can only fail test_memory:
    # every other case of the test is watched as usual.
    big = _case("memory", *_drawn(rng, (1,), 2048, 8192, 8, 1, "float32"), 128, False)  # (causal is for T_q == T_k)
    out.append({**big, "alone": True})
    return out


EXERCISE = Exercise(
    name="tiled_attention",
    piece="tiled_attention",
    call="tiled_attention(Q, K, V)",
    adapter=adapter,
    reference="firstprinciples.reference:tiled_attention",
    names={"output": "tiled_attention(Q, K, V)", OVER: "the largest tensor created beyond (..., T_q, block_size)"},
    visible=_visible(),
    secret=secret,
    tests={
        WORKED: Test(2, frozenset({"worked"}), then=(cats_row,)),
        RANDOM: Test(3, frozenset({"random"})),
        CAUSAL: Test(2, frozenset({"causal"})),
        LARGE: Test(1, frozenset({"large"})),
        MEMORY: Test(3, frozenset({"memory"}), first=(within_the_memory_bound,)),
    },
    forbidden=dict(torch_patterns=("softmax", "scaled_dot_product_attention"),
                   pieces=("tiled_attention", "scaled_dot_product_attention", "softmax"), what="tiled attention"),
    mistakes=MISTAKES,
    memory=memory_bound,
)
