"""Probe for ``tiled_attention(Q, K, V, block_size=64, causal=False)``.

Tags name the test cell each case stands for: ``worked`` (fresh inputs of the cat-sat-mat
sizes, one key at a time, the first query's best key last), ``random`` (batch dimensions, T_q != T_k, a short last block,
block sizes 1 to 64), ``causal``, ``large`` (scores in the hundreds, largest in the last blocks)
and ``memory``. Outputs are compared with the reference within the dtype's tolerance. For
``memory`` the runner also watches every tensor that every torch operation creates
(``memory.StorageSizes``) and reports the largest one beyond the bound of the test
(``allowed_elements``), or "none": the reference's report is "none", so an answer that builds
the (T_q, T_k) matrix fails the case whatever its values. A dispatch mode can be switched off by
the answer (``torch._C._DisableTorchDispatch``), so the watch's profiler also records every
allocation at torch's allocator on those cases, and the grader fails one larger than the bound
(``memory``, ``Probe.memory``).
"""
from __future__ import annotations

import numpy as np

from ...checks import tiled as C
from ...memory import StorageSizes
from ...reference import tiled_attention
from . import Probe, aspect, normal, register


def run(fn, case):
    Q, K, V = (case[n].clone() for n in "QKV")
    block, causal = int(case["block_size"]), bool(case["causal"])
    if "memory" not in case["tags"]:
        return {"output": fn(Q, K, V, block_size=block, causal=causal)}
    sizes = StorageSizes()
    with sizes:
        out = fn(Q, K, V, block_size=block, causal=causal)
    limit = C.allowed_elements(case["Q"], case["K"], case["V"], block)
    over = "none" if sizes.largest <= limit else (
        f"a tensor of shape {sizes.shape} ({sizes.largest} elements, more than the {limit} allowed)")
    return {"output": out, "tensors larger than (..., T_q, block_size)": over}


def _case(rng, tag, lead, T_q, T_k, d_k, d_v, block, causal, dtype, scale=1.0):
    Q, K, V = (normal(rng, (*lead, T, d), dtype) for T, d in ((T_q, d_k), (T_k, d_k), (T_k, d_v)))
    if tag == "large":
        growth = np.linspace(0.2, 1.0, T_k, dtype=dtype)[:, None]
        Q, K = np.abs(Q) * scale, np.abs(K) * scale * growth
    label = (f"{dtype} Q {(*lead, T_q, d_k)}, K {(*lead, T_k, d_k)}, V {(*lead, T_k, d_v)}, block_size={block}"
             + (", causal=True" if causal else ""))
    return {"label": label, "tags": (tag,), "Q": Q, "K": K, "V": V, "block_size": block, "causal": causal}


def cases(rng: np.random.Generator) -> list:
    out = []
    for causal in (False, True):  # the example's sizes, one key at a time
        case = _case(rng, "worked", (), 3, 3, 2, 2, 1, causal, "float64")
        # the key that the first query scores highest goes last, so that its running max grows
        last = int(np.argmax(case["K"] @ case["Q"][0]))
        order = [i for i in range(3) if i != last] + [last]
        case["K"], case["V"] = case["K"][order], case["V"][order]
        out.append(case)
    short = int(rng.integers(9, 15))
    for lead, T_q, T_k, d_k, d_v, block, dtype in (((2,), 10, short, 4, 4, 4, "float32"),
                                                   ((2, 3), 7, 13, 8, 5, 5, "float32"),
                                                   ((), 5, 9, 3, 2, 1, "float64"), ((2,), 6, 11, 4, 6, 32, "float32"),
                                                   ((1, 2), 150, 150, 8, 8, 64, "float32"),
                                                   ((3,), 4, 1, 4, 3, 4, "float64"),
                                                   ((2, 2), 9, int(rng.integers(15, 25)), 6, 4, 7, "float64")):
        out.append(_case(rng, "random", lead, T_q, T_k, d_k, d_v, block, False, dtype))
    for lead, T, d_k, d_v, block, dtype in (((), 1, 2, 2, 4, "float32"), ((2,), 9, 4, 3, 4, "float32"),
                                            ((2, 2), 16, 8, 8, 4, "float32"), ((3,), 7, 4, 4, 1, "float64"),
                                            ((2,), int(rng.integers(10, 14)), 4, 6, 5, "float64"),
                                            ((1,), 10, 8, 8, 16, "float32"), ((2, 3), 33, 8, 8, 8, "float32")):
        out.append(_case(rng, "causal", lead, T, T, d_k, d_v, block, True, dtype))
    for lead, T_q, T_k, d, block, dtype, causal, scale in (((2,), 6, 12, 4, 3, "float32", False, 8.0),
                                                           ((1, 2), 5, 17, 4, 4, "float64", False, 25.0),
                                                           ((2,), 12, 12, 4, 5, "float32", True, 8.0)):
        out.append(_case(rng, "large", lead, T_q, T_k, d, d, block, causal, dtype, scale))
    for lead, T_q, T_k, d_k, d_v, block, causal in (((2,), 256, 256, 16, 16, 32, False), ((2,), 256, 256, 16, 16, 32, True),
                                                    ((2, 2), 64, 300, 8, 8, 20, False), ((1,), 200, 200, 8, 12, 24, True),
                                                    ((3,), 160, 480, 4, 6, 60, False)):
        out.append(_case(rng, "memory", lead, T_q, T_k, d_k, d_v, block, causal, "float32"))
    return out


CELLS = {
    "test_worked_example": aspect("worked"),
    "test_against_attention": aspect("random"),
    "test_causal": aspect("causal"),
    "test_large_scores": aspect("large"),
    "test_memory": aspect("memory"),
}

def memory(case) -> int:
    """The largest tensor a memory case may allocate, in bytes: what the test allows
    (``checks.tiled.allowed_elements``: a (..., T_q, block_size) block, the output or an input) in
    float64, the widest dtype an honest answer computes in."""
    return 8 * C.allowed_elements(case["Q"], case["K"], case["V"], int(case["block_size"]))


register(Probe("tiled_attention", cases, run, reference=tiled_attention, forbidden=C.FORBIDDEN, cells=CELLS,
               memory=memory))
