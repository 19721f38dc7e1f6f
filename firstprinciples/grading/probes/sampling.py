"""Probe for ``sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None)``.

A correct sampler may draw differently from the reference (``torch.multinomial``, an inverse
CDF on ``torch.rand``, Gumbel-max), so nothing is compared token by token with the reference:
``run`` reports what the answer drew and did, and ``judge`` (in the trusted grader) checks it
the way the notebook's tests do, with the same tolerance (``checks.sampling``):

- ``greedy``: exactly the argmax, and neither the generator nor torch's global random state moved;
- ``shapes``: int64 tokens of shape (...) in 0..V-1;
- ``generator``: the same seed gives the same tokens, another seed others, the global state is untouched;
- ``temperature``, ``top_k``, ``top_p``: 10,000 draws in one call; a token of probability 0 never
  drawn, every other count within Bernstein's bound (``DELTA`` = 1e-9 per token) of N p, p being
  the reference's probabilities in float64. The logits are the chapter's example, permuted (the
  same parameter combinations as the tests, so the same mistakes show), and fresh random ones
  without near-ties, with top-p thresholds at least 0.01 from every cumulative probability.

In every case the logits must be unchanged by the call.
"""
from __future__ import annotations

import numpy as np

from ...checks import sampling as S
from ...reference import sample_next_token
from .. import wire
from . import Probe, aspect, register

PARAMS = ("temperature", "top_k", "top_p")


def run(fn, case):
    import torch

    kwargs = {k: case[k] for k in PARAMS if k in case}
    logits = case["logits"]
    if "batch" in case:  # copies of the row, each in its own order (checks.sampling.permuted_batch)
        logits = S.permuted_batch(logits, tuple(case["batch"]), int(case["seed"]))[0]
    seed = int(case["seed"])
    gen = torch.Generator().manual_seed(seed)
    state, global_state = gen.get_state(), torch.random.get_rng_state()
    seen = logits.clone()
    tokens = fn(seen, generator=gen, **kwargs)
    out = {"tokens": tokens, "logits after the call": seen,
           "drew from the generator": not torch.equal(gen.get_state(), state),
           "left the global random state": torch.equal(torch.random.get_rng_state(), global_state)}
    if "generator" in case["tags"]:
        again = fn(logits.clone(), generator=torch.Generator().manual_seed(seed), **kwargs)
        other = fn(logits.clone(), generator=torch.Generator().manual_seed(seed + 1), **kwargs)
        same = isinstance(tokens, torch.Tensor) and isinstance(again, torch.Tensor) and tokens.shape == again.shape
        out["same seed, same tokens"] = bool(same and torch.equal(tokens, again))
        differs = not (isinstance(other, torch.Tensor) and same and other.shape == tokens.shape and torch.equal(other, tokens))
        out["another seed, other tokens"] = bool(differs)
    return out


def _scalar(got, key):
    return wire.scalar(got[key]) if key in got else None


def judge(case, got):
    import torch

    from ...reference import next_token_probabilities

    tags = set(case["tags"])
    logits = case["logits"]
    batch = tuple(case["batch"]) if "batch" in case else tuple(logits.shape[:-1])
    V = logits.shape[-1]
    enc = got.get("tokens")
    if not isinstance(enc, dict) or not wire.is_array(enc) or enc.get("type") != "torch.Tensor":
        return f"it returned {enc.get('type') if isinstance(enc, dict) else 'nothing'}, not a tensor of tokens"
    if enc.get("dtype") != "int64":
        return f"the tokens have dtype {enc.get('dtype')}, expected int64"
    if tuple(enc.get("shape", ())) != batch:
        return f"the tokens have shape {tuple(enc.get('shape', ()))}, expected {batch}"
    tokens = wire.array(enc).astype(np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= V):
        return f"a token is outside 0..{V - 1}"
    after = got.get("logits after the call")
    perms = None
    if "batch" in case:
        given, perms = S.permuted_batch(logits, batch, int(case["seed"]))
    else:
        given = logits
    if not isinstance(after, dict) or not wire.is_array(after) or not np.array_equal(wire.array(after), given.numpy()):
        return "it changes the logits in place"
    kwargs = {k: case[k] for k in PARAMS if k in case}
    if "greedy" in tags:
        if not np.array_equal(tokens, given.argmax(-1).numpy()):
            return "with temperature 0 the tokens are not the argmax of each row"
        if _scalar(got, "drew from the generator") or not _scalar(got, "left the global random state"):
            return "with temperature 0 it draws a random number"
        return None
    if "generator" in tags:
        if not _scalar(got, "left the global random state"):
            return "it changes torch's global random state (it does not draw from the generator it is given)"
        if not _scalar(got, "same seed, same tokens"):
            return "two generators with the same seed give different tokens"
        if not _scalar(got, "another seed, other tokens"):
            return "generators with different seeds give the same tokens"
        return None
    if tags & {"temperature", "top_k", "top_p"}:
        n = tokens.size
        drawn = tokens.reshape(-1) if perms is None else perms.numpy()[np.arange(n), tokens.reshape(-1)]
        counts = np.bincount(drawn, minlength=V)  # (V,): how often each word of the row was drawn
        p = next_token_probabilities(logits.to(torch.float64), **kwargs).numpy()
        for j, (c, q) in enumerate(zip(counts, p)):
            if q == 0 and c > 0:
                return f"token {j}, outside the tokens that are kept, was drawn {c} times (its probability is 0)"
            if q > 0 and abs(c - n * q) > S.allowed_deviation(n, float(q)):
                return (f"token {j} was drawn {c} times out of {n}, but its probability is {100 * q:.1f}% "
                        f"(a correct sampler is that far off with probability below {S.DELTA:g})")
    return None


def _case(label, tags, logits, seed, **extra):
    return {"label": label, "tags": (tags,), "logits": logits, "seed": int(seed), **extra}


def cases(rng: np.random.Generator) -> list:
    import torch

    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    seed = lambda: int(rng.integers(2**31))  # noqa: E731
    example = np.array(S.LOGITS)

    def permuted(dtype="float32"):
        return example[rng.permutation(len(example))].astype(dtype)

    def random_row(V, dtype="float32"):
        return S._random_row(g, V, torch.float64).numpy().astype(dtype)

    def stat(tag, label, row, params, shape=(S.N_DRAWS,)):
        what = ", ".join(f"{k}={v}" for k, v in params.items())
        return _case(f"{shape} draws from logits {np.round(row, 3).tolist()} with {what}", tag, row, seed(),
                     batch=tuple(shape), **params)

    out = []
    for shape, extra in (((6,), {}), ((4, 6), {}), ((2, 3, 6), {"top_k": 2}), ((5, 6), {"top_p": 0.5}),
                         ((3, 50), {}), ((2, 2, 2, 9), {"top_k": 3, "top_p": 0.8}), ((7, 1), {})):
        dtype = "float64" if shape == (3, 50) else "float32"
        out.append(_case(f"greedy decoding of logits of shape {shape}", "greedy",
                         rng.standard_normal(shape).astype(dtype), seed(), temperature=0.0, **extra))
    for shape, extra in (((6,), {}), ((3, 6), {}), ((2, 3, 6), {}), ((1, 1, 8), {}), ((4, 1), {}),
                         ((2, 5, 7), {"temperature": 0.7}), ((3, 2, 10), {"top_k": 4, "top_p": 0.6})):
        out.append(_case(f"logits of shape {shape}", "shapes", rng.standard_normal(shape).astype(
            "float64" if shape == (2, 5, 7) else "float32"), seed(), **extra))
    for shape, extra in (((1000,), {}), ((40, 25), {"temperature": 1.5}), ((1000,), {"top_k": 4, "top_p": 0.9})):
        out.append(_case(f"{shape} draws with {extra or 'the defaults'}, twice with one seed and once with another",
                         "generator", permuted(), seed(), batch=shape, **extra))
    for params in S.TEMPERATURE_CASES:
        out.append(stat("temperature", "", permuted(), dict(params)))
    out.append(stat("temperature", "", random_row(10), {"temperature": round(float(rng.uniform(0.4, 0.9)), 3)}))
    out.append(stat("temperature", "", random_row(10, "float64"), {"temperature": round(float(rng.uniform(1.2, 1.8)), 3)},
                    shape=(2, S.N_DRAWS // 2)))
    for params in S.TOP_K_CASES:
        out.append(stat("top_k", "", permuted("float64" if "temperature" in params else "float32"), dict(params)))
    out.append(stat("top_k", "", random_row(12), {"top_k": int(rng.integers(2, 10))}))
    out.append(stat("top_k", "", random_row(12, "float64"), {"temperature": 0.8, "top_k": int(rng.integers(2, 10))}))
    for params in S.TOP_P_CASES:
        out.append(stat("top_p", "", permuted(), dict(params)))
    out.append(stat("top_p", "", permuted("float64"), {"top_p": 1.0}))
    added = 0
    for extra in ({}, {"temperature": 0.7}, {"top_k": 6}, {"temperature": 1.3, "top_k": 8}, {}, {"top_k": 5}):
        if added == 3:
            break
        row = random_row(10, "float64" if added % 2 else "float32")
        top_p = S.safe_top_p(torch.from_numpy(row), extra, g)
        if top_p is not None:
            out.append(stat("top_p", "", row, {**extra, "top_p": top_p}))
            added += 1
    return out


CELLS = {
    "test_greedy": aspect("greedy"),
    "test_shapes": aspect("shapes"),
    "test_generator": aspect("generator"),
    "test_temperature": aspect("temperature"),
    "test_top_k": aspect("top_k"),
    "test_top_p": aspect("top_p"),
}

register(Probe("sample_next_token", cases, run, reference=sample_next_token, forbidden=S.FORBIDDEN, judge=judge,
               cells=CELLS))
