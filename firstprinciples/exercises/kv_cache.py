"""KVCache, cached_attention_step(x_new, cache, mha) and generate(mha, prompt, n_new): the KV-cache
exercise's tests, declared once.

- ``KVCache``: ``KVCache()`` is empty (``K`` and ``V`` None, ``len`` 0); ``append(k, v)`` puts keys and
  values of shape (B, H, T_new, d_k) after the ones held (time is dim -2), stores the results in ``K``
  and ``V`` and returns them; ``len(cache)`` is the number of positions held.
- ``cached_attention_step``: multi-head self-attention of the T_new newest tokens x_new (B, T_new,
  d_model) over the cache, with the layers ``mha.W_q``, ``mha.W_k``, ``mha.W_v``, ``mha.W_o``;
  returns (output (B, T_new, d_model), weights (B, H, T_new, T_past + T_new)).
- ``generate``: the prompt followed by ``n_new`` vectors, each the attention output at the last
  position fed back in, computed with one cache.

Decisions stated once:

- The layers handed to the step and to ``generate`` are the adapter's (``Layers``): four bias-free
  ``nn.Linear`` with the case's weights, ``n_heads``, ``d_k``, ``d_model``. Calling the module itself
  raises (the step must use its layers; ``generate`` must not recompute everything with it).
- A cache is told from a recomputation by what it computes, never by counting calls or rows (an
  answer can multiply by ``layer.weight`` instead of calling the layer; issue 38). The step's cases
  tagged "drift" change W_k and W_v between calls, after the earlier tokens are cached: a cache keeps
  the keys and values computed before, an answer that projects earlier tokens again gets new ones.
  ``generate``'s drift cases do the same between generation steps: its layers' weights are on a clock
  (``Clocked``) that ticks when W_o is used (the end of a step), and W_k and W_v move by a fixed step
  when they are next used. An answer that keeps its own copy of the weights (``.clone()`` at the
  start) sees no drift and fails those cases; ``generate`` must run the prompt through one call, as
  the notebook asks (fed token by token, the prompt's later keys would be projected after a tick).
- The step gets the notebook's own ``KVCache`` (``needs``: from the namespace the re-check's runner
  passes, else the step's globals, the notebook's in the kernel) when that class passes a small test
  of its own (``_cache_problem``), so that a step may use helper methods of its cache; otherwise a
  correct cache of the adapter's (``GivenCache``), so that the step is graded on its own. What the
  step leaves in the cache besides ``K``, ``V`` and the class's own state (the attributes an instance
  holds after a few appends) is reported: queries and inputs are never cached.
- Values are compared with the defaults of ``grading.compare``: the cache does the same arithmetic
  as full recomputation grouped differently, so a correct answer differs by rounding (about 1e-16 in
  float64, 1e-7 in float32), while every named mistake moves the outputs by more than 1e-2.
  ``generate`` feeds each output back in, which grows rounding from step to step: float32 cases keep
  n_new <= 4 (the secret longer runs are float64).
- Later notebooks: the capstone runs this exercise's ``recap_kv_cache`` (``CACHE_RECAP``) and
  ``test_cached_attention_step`` (``STEP_RECAP``), declared in ``exercises/capstone.py``; its
  cached generation cells (``test_generate_cached``, ``test_generate_trained``) are judged here on
  the K and V that ``append`` returns (``elsewhere``).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

from . import Exercise, Mistake, Test, case
from .adapters import vector_jacobian

LAYERS = ("W_q", "W_k", "W_v", "W_o")


def _tensor(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else torch.as_tensor(np.array(value))


def _pair(result, what, names):
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result
    kind = type(result).__name__ + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
    raise AssertionError(f"{what} returned a {kind}, expected a pair ({', '.join(names)}).")


def _same(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and bool(torch.equal(a.detach(), b.detach())))


def _len(cache) -> int:
    """len(cache), or -1 where it raises (a value a correct cache never gives)."""
    try:
        return len(cache)
    except Exception:
        return -1


# ================================================================ the cache
# Correct pieces an adapter hands to an answer in place of the notebook's own (``firstprinciples.bundle``
# leaves them out of a student bundle, where this message is the test's reason instead)
STAND_INS = {"GivenCache": "your KVCache does not work yet (its own test says why), and this test needs it: "
                           "fix KVCache first, then run this cell again."}


class GivenCache:
    """The adapter's own correct cache: handed to a step whose notebook has no working KVCache of its
    own (and used by the declared mistakes). Not an answer: ``cache_adapter`` refuses it."""

    def __init__(self):
        self.K = None
        self.V = None

    def append(self, k, v):
        if self.K is None:
            self.K, self.V = k, v
        else:
            self.K, self.V = torch.cat([self.K, k], dim=-2), torch.cat([self.V, v], dim=-2)
        return self.K, self.V

    def __len__(self):
        return 0 if self.K is None else self.K.shape[-2]


def cache_adapter(cls, case):
    """Build ``cls()``, append the case's chunks ``ks``, ``vs`` one after the other and report what a
    new cache holds, what each append returns, ``len`` and the attributes K, V after it, and the
    chunks after the calls; a gradient case (``grad_K``, ``grad_V``: upstream gradients of the last
    K and V) reports the gradients reaching every appended chunk instead."""
    if isinstance(cls, type) and issubclass(cls, GivenCache):
        raise AssertionError("KVCache is the grader's own cache, not yours: write the class.")
    ks, vs = [_tensor(k) for k in case["ks"]], [_tensor(v) for v in case["vs"]]
    grads = "grad_K" in case
    for t in (ks + vs) if grads else ():
        t.requires_grad_(True)
    cache = cls()
    res = {}
    if not grads:
        res["len of a new cache"] = torch.tensor(_len(cache))
        res["K and V of a new cache are None"] = torch.tensor(
            getattr(cache, "K", "missing") is None and getattr(cache, "V", "missing") is None)
    for i, (k, v) in enumerate(zip(ks, vs), start=1):
        K, V = _pair(cache.append(k, v), "append", ("K", "V"))
        if not grads:
            res[f"K after append {i}"], res[f"V after append {i}"] = K, V
            res[f"len(cache) after append {i}"] = torch.tensor(_len(cache))
            res[f"cache.K and cache.V after append {i} are the K and V it returned"] = torch.tensor(
                _same(getattr(cache, "K", None), K) and _same(getattr(cache, "V", None), V))
    if grads:
        if not all(isinstance(t, torch.Tensor) and t.requires_grad for t in (K, V)):
            raise AssertionError("the K and V returned by append do not require grad although the appended keys "
                                 "and values do: the cache must keep them as they are (no .detach(), no "
                                 "torch.tensor(...) copies).")
        got = vector_jacobian([K, V], ks + vs, [case["grad_K"].to(K.dtype), case["grad_V"].to(V.dtype)])
        if any(g is None for g in got):
            raise AssertionError("no gradient reaches some appended keys or values: the cache must keep every "
                                 "appended entry in K and V.")
        n = len(ks)
        res["the gradient reaching the appended keys"] = torch.cat(got[:n], dim=-2)
        res["the gradient reaching the appended values"] = torch.cat(got[n:], dim=-2)
    # (compared as values, not as "after the call" entries: the capstone's cells, which use the cache
    # as a part of cached generation, judge only what append returns)
    res["the appended keys, afterwards"] = torch.cat([k.detach() for k in ks], dim=-2)
    res["the appended values, afterwards"] = torch.cat([v.detach() for v in vs], dim=-2)
    return res


# ---------------------------------------------------------------- typical mistakes: KVCache
class _NotUpdated:
    """Concatenates into a local variable: only the first append is stored."""

    def __init__(self):
        self.K = self.V = None

    def append(self, k, v):
        if self.K is None:
            self.K, self.V = k, v
            return k, v
        return torch.cat([self.K, k], dim=-2), torch.cat([self.V, v], dim=-2)

    def __len__(self):
        return 0 if self.K is None else self.K.shape[-2]


class _Overwritten(_NotUpdated):
    def append(self, k, v):
        self.K, self.V = k, v
        return k, v


def _cat_cache(dim, prepend=False):
    class _Cache(_NotUpdated):
        def append(self, k, v):
            if self.K is None:
                self.K, self.V = k, v
            elif prepend:
                self.K, self.V = torch.cat([k, self.K], dim=dim), torch.cat([v, self.V], dim=dim)
            else:
                self.K, self.V = torch.cat([self.K, k], dim=dim), torch.cat([self.V, v], dim=dim)
            return self.K, self.V

    return _Cache


class _LenCountsAppends(_cat_cache(-2)):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def append(self, k, v):
        self.calls += 1
        return super().append(k, v)

    def __len__(self):
        return self.calls


CACHE_ID = "test_kv_cache"
CACHE_MISTAKES = (
    Mistake("cache not updated", "store the concatenation back in self.K and self.V (self.K = torch.cat(...)); "
            "a local variable is forgotten as soon as append returns.", _NotUpdated, frozenset({CACHE_ID})),
    Mistake("overwritten instead of appended",
            "the cache must keep every earlier key and value: concatenate the new ones after them.", _Overwritten,
            frozenset({CACHE_ID})),
    Mistake("appended along the feature dim",
            "K and V are (B, H, T, d_k): new positions go along the time axis, dim=-2 (2), not dim=-1.",
            _cat_cache(-1), frozenset({CACHE_ID})),
    Mistake("appended along the head dim",
            "K and V are (B, H, T, d_k): new positions go along the time axis, dim=-2 (2), not dim=1.",
            _cat_cache(1), frozenset({CACHE_ID})),
    Mistake("new entries prepended", "put the new keys and values after the old ones: row t of the cache must be "
            "token t (the causal mask of a prompt relies on that order).", _cat_cache(-2, prepend=True),
            frozenset({CACHE_ID})),
    Mistake("len counts appends", "len(cache) is the number of positions held (K.shape[-2]), not the number of "
            "append calls: a prompt appends several positions at once.", _LenCountsAppends, frozenset({CACHE_ID})),
)


# ---------------------------------------------------------------- properties (plain data)
def new_cache_is_empty(case, out, want):
    """A new cache: len 0, K and V None."""
    n = out.get("len of a new cache")
    if n is not None and int(n) == -1:
        return "len() of a new cache raised an error: it should return 0 while K is None."
    if n is not None and int(n) != 0:
        return f"a new cache should be empty: len(KVCache()) is {int(n)}, expected 0."
    empty = out.get("K and V of a new cache are None")
    if empty is not None and not bool(empty):
        return "a new cache should have the attributes K and V set to None."
    return None


def inputs_left_alone(case, out, want):
    for what in ("keys", "values"):
        key = f"the appended {what}, afterwards"
        if key in out and (out[key].shape != want[key].shape or not np.array_equal(out[key], want[key])):
            return (f"append modified the {what} it was given in place: keep them as they are (the caller may "
                    "still use them).")
    return None


def len_counts_positions(case, out, want):
    """len(cache) after each append is the number of positions held."""
    held = 0
    for i, n in enumerate(case["chunks"], start=1):
        held += int(n)
        got = out.get(f"len(cache) after append {i}")
        if got is not None and int(got) != held:
            shown = "raised an error" if int(got) == -1 else f"is {int(got)}"
            return f"len(cache) {shown} after append {i}, but the cache holds {held} positions (K.shape[-2])."
    return None


def attributes_hold_everything(case, out, want):
    for i in range(1, len(case["chunks"]) + 1):
        same = out.get(f"cache.K and cache.V after append {i} are the K and V it returned")
        if same is not None and not bool(same):
            return (f"cache.K and cache.V after append {i} should be the full K and V that append returned (the "
                    "attributes K and V hold everything cached so far).")
    return None


def returned_keys_and_values(case, out, want):
    """For a cell where the cache is only a part of cached generation (the capstone's): the K and V
    that append returns have the reference's values (len and the rest aside)."""
    for key in want:
        if key.startswith(("K after", "V after")) and key in out:
            a, b = out[key].astype(np.float64), want[key].astype(np.float64)
            atol, rtol = (1e-10, 1e-8) if want[key].dtype == np.float64 else (1e-5, 1e-4)
            if a.shape != b.shape or not np.allclose(a, b, atol=atol, rtol=rtol):
                return f"{key} is not the keys or values appended so far, in order."
    return None


# ---------------------------------------------------------------- cases: KVCache
def _normal(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _cache_case(rng, tags, chunks, B, H, d_k, d_v, dtype):
    label = f"appending {list(chunks)} positions (B={B}, H={H}, d_k={d_k}, d_v={d_v}, {dtype})"
    return case(f"when {label}", tags, chunks=tuple(chunks),
                ks=tuple(_normal(rng, (B, H, n, d_k), dtype) for n in chunks),
                vs=tuple(_normal(rng, (B, H, n, d_v), dtype) for n in chunks))


def _cache_grad_case(rng, chunks=(2, 1, 1), B=1, H=2, d=3):
    c = _cache_case(rng, "grads", chunks, B, H, d, d, "float64")
    c["label"] = c["label"].replace("when", "for the gradients through the cache,", 1)
    T = sum(chunks)
    c["grad_K"], c["grad_V"] = (_normal(rng, (B, H, T, d), "float64") for _ in range(2))
    return c


def _cache_visible():
    g = np.random.default_rng(0)
    return (_cache_case(g, ("cache", "recap"), (1, 1, 1), 2, 2, 4, 4, "float64"),
            _cache_case(g, ("cache", "recap"), (3, 1, 2), 2, 2, 4, 4, "float64"),
            _cache_grad_case(g))


CACHE_SIZES = (((1,) * 6, 1, 1, 2, 2), ((2, 3, 1), 3, 4, 8, 5), ((5,), 2, 2, 4, 4), ((1, 4, 1, 2), 1, 3, 6, 6))


def cache_secret(rng):
    """The visible sizes with fresh numbers, more chunkings, batch sizes, head counts and widths in
    float32 and float64, and the gradients through a cache of random sizes."""
    cases = [_cache_case(rng, ("cache", "recap"), chunks, 2, 2, 4, 4, "float64") for chunks in ((1, 1, 1), (3, 1, 2))]
    for dtype in ("float32", "float64"):
        cases += [_cache_case(rng, "cache", *sizes, dtype) for sizes in CACHE_SIZES]
    chunks = tuple(int(n) for n in rng.integers(1, 4, size=3))
    cases += [_cache_grad_case(rng), _cache_grad_case(rng, chunks, 2, int(rng.integers(1, 4)), 4)]
    return cases


CACHE_TEST = Test(2, frozenset({"cache", "grads"}),
                  first=(new_cache_is_empty, inputs_left_alone, len_counts_positions, attributes_hold_everything))
# the capstone's cells: its 1-point recap (the visible sizes), and its cached generation, where one of
# these caches per block is a part (what append returns is judged there, nothing else)
CACHE_RECAP_ID = "recap_kv_cache"
CACHE_RECAP_TEST = Test(1, frozenset({"recap"}), first=CACHE_TEST.first)
CACHE_AS_A_PART = {gid: Test(points, frozenset({"cache"}), then=(returned_keys_and_values,), values=False)
                   for gid, points in (("test_generate_cached", 3), ("test_generate_trained", 2))}

CACHE = Exercise(
    name="kv_cache",
    piece="KVCache",
    call="KVCache",
    adapter=cache_adapter,
    reference="firstprinciples.reference:KVCache",
    visible=_cache_visible(),
    secret=cache_secret,
    tests={CACHE_ID: CACHE_TEST},
    forbidden=dict(torch_patterns=("scaled_dot_product_attention", "multi_head_attention"), pieces=("KVCache",),
                   what="the key/value cache"),
    mistakes=CACHE_MISTAKES,
    hints=(("Sizes of tensors must match", "K and V are (B, H, T, d_k): new positions go along the time axis, "
                                           "torch.cat([self.K, k], dim=-2)."),),
    elsewhere={CACHE_RECAP_ID: CACHE_RECAP_TEST, **CACHE_AS_A_PART},
)


# ================================================================ the layers handed to the step and to generate
class Layers(nn.Module):
    """A multi-head attention's four bias-free layers W_q, W_k, W_v, W_o (weights from the case, in
    nn.Linear's (out, in) layout), ``n_heads``, ``d_k`` and ``d_model``. Calling it raises ``called``."""

    def __init__(self, weights, n_heads, called):
        super().__init__()
        d = int(weights[0].shape[0])
        self.d_model, self.n_heads, self.d_k = d, int(n_heads), d // int(n_heads)
        for name, w in zip(LAYERS, weights):
            layer = nn.Linear(d, d, bias=False, device="meta")  # (meta: no initialisation, the global RNG untouched)
            layer.weight = nn.Parameter(w)
            setattr(self, name, layer)
        self._called = called

    def forward(self, *args, **kwargs):
        raise AssertionError(self._called)


def _layers(case, called):
    return Layers([_tensor(case[n]) for n in LAYERS], case["n_heads"], called)


class Clock:
    """Ticks when W_o is used (the end of a step); W_k and W_v then move by ``dW_k``, ``dW_v``, in place,
    the next time either of them is used (however often W_o was used in between)."""

    def __init__(self, W_k, W_v, dW_k, dW_v):
        self.W_k, self.W_v, self.dW_k, self.dW_v = W_k, W_v, dW_k, dW_v
        self.ticked = False

    def catch_up(self):
        if self.ticked:
            self.ticked = False
            with torch.no_grad():
                self.W_k.add_(self.dW_k)
                self.W_v.add_(self.dW_v)


# What reading a tensor's metadata returns: no value of the weight is used.
_METADATA = (int, bool, float, str, type(None), torch.Size, torch.dtype, torch.device)


def _flat(items):
    for a in items:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


class Clocked(torch.Tensor):
    """A layer's weight on ``generate``'s clock (``Clock``): every torch function that uses it (the
    layer's call, ``@``, ``.T``, ``einsum``, ``.numpy()``) first lets W_k and W_v catch up with the
    clock (for W_k and W_v), or afterwards makes it tick (for W_o, when values were read). Results are
    plain tensors."""

    @staticmethod
    def wrap(t, clock, role):
        c = t.as_subclass(Clocked)  # (the same storage: the clock's in-place steps show through)
        c.clock, c.role = clock, role
        return c

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        clocked = [a for a in _flat((*args, *kwargs.values())) if isinstance(a, Clocked)]
        with torch._C.DisableTorchFunctionSubclass():
            for c in clocked:
                if c.role != "W_o":
                    c.clock.catch_up()
            result = func(*args, **kwargs)
        if not isinstance(result, _METADATA):
            for c in clocked:
                if c.role == "W_o":
                    c.clock.ticked = True
        return result


def _clocked_layers(case, called):
    mha = _layers(case, called).requires_grad_(False)
    plain = {n: getattr(mha, n).weight.detach() for n in ("W_k", "W_v", "W_o")}
    clock = Clock(plain["W_k"], plain["W_v"], _tensor(case["dW_k"]), _tensor(case["dW_v"]))
    for name, w in plain.items():
        layer = getattr(mha, name)
        del layer.weight
        layer.weight = Clocked.wrap(w, clock, name)
    return mha


# ================================================================ cached_attention_step
_CACHES: dict = {}  # id(class) -> (class, its problem or None, its own attributes): the class held, no id reused


def _cache_problem(cls):
    """None if ``cls`` behaves as a KVCache on a few appends (float64, gradients kept), else what fails;
    and the attributes an instance holds after them besides K and V (the class's own state)."""
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True) for n in (2, 1, 1)]
    vs = [torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True) for n in (2, 1, 1)]
    before = [t.detach().clone() for t in ks + vs]
    own = set()
    try:
        cache = cls()
        if _len(cache) != 0 or getattr(cache, "K", "missing") is not None:
            return "a new cache is not empty", own
        for i in range(3):
            K, V = _pair(cache.append(ks[i], vs[i]), "append", ("K", "V"))
            want_K, want_V = torch.cat(ks[: i + 1], dim=-2), torch.cat(vs[: i + 1], dim=-2)
            if not (_same(K, want_K) and _same(V, want_V)):
                return f"append number {i + 1} does not return the keys and values appended so far", own
            if not (_same(getattr(cache, "K", None), K) and _same(getattr(cache, "V", None), V)):
                return f"cache.K and cache.V after append number {i + 1} are not what it returned", own
            if _len(cache) != K.shape[-2]:
                return f"len(cache) is {_len(cache)} after {K.shape[-2]} positions", own
            if not (K.requires_grad and V.requires_grad):
                return "the K and V it returns do not require grad", own
            own |= set(getattr(cache, "__dict__", {}))
    except Exception as err:  # any failure of the student's class: the step is graded without it
        return f"{type(err).__name__}: {str(err)[:200]}", own
    if not all(torch.equal(t.detach(), t0) for t, t0 in zip(ks + vs, before)):
        return "append modifies the keys or values it is given", own
    return None, own - {"K", "V"}


def step_cache(step, namespace=None):
    """(the cache class for ``step``, the class's own attributes): the notebook's KVCache (``namespace``,
    else the step's globals) when it passes ``_cache_problem``, else ``GivenCache`` (and a note printed)."""
    cls = namespace.get("KVCache") if isinstance(namespace, dict) else None
    if cls is None:
        fn = step
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        found = getattr(fn, "__globals__", None)
        cls = found.get("KVCache") if isinstance(found, dict) else None
    if not isinstance(cls, type) or issubclass(cls, GivenCache):
        return GivenCache, frozenset()
    held = _CACHES.get(id(cls))
    if held is None or held[0] is not cls:
        problem, own = _cache_problem(cls)
        held = _CACHES[id(cls)] = (cls, problem, frozenset(own))
    if held[1] is not None:
        print(f"(Your KVCache fails its own test ({held[1]}), so this test gives your step a correct cache instead: "
              "your step is graded on its own, with that cache's append, len, K and V.)")
        return GivenCache, frozenset()
    return cls, held[2]


STEP_CALLED = ("cached_attention_step must use the layers mha.W_q, mha.W_k, mha.W_v and mha.W_o, not call mha "
               "itself (that recomputes everything).")


def step_adapter(step, case, namespace=None):
    """Feed the case's x to ``step`` in ``chunks`` with one cache (``step_cache``) and the case's layers;
    report each call's output and weights, len(cache), the shape of cache.K and whether the step left
    anything else in the cache, and x after the calls. "dW_k": W_k and W_v move by dW_k, dW_v after
    every call. "cache_only": one call; cache.K and cache.V reported. "grad_out": the gradients of the
    last call's output with respect to x and the four weights."""
    cls, own = step_cache(step, namespace)
    mha = _layers(case, STEP_CALLED)
    cache = cls()
    x = _tensor(case["x"])
    grads = "grad_out" in case
    if grads:
        x.requires_grad_(True)
    else:
        mha.requires_grad_(False)
    res, start, used = {}, 0, []
    for i, n in enumerate(case["chunks"], start=1):
        x_new = x[:, start:start + n].clone()
        out, w = _pair(step(x_new, cache, mha), "cached_attention_step", ("output", "weights"))
        used.append(x_new)
        start += n
        if grads or case.get("cache_only"):
            continue
        where = f"call {i} (tokens {start - n}..{start - 1})"
        res[f"the output of {where}"], res[f"the weights of {where}"] = out, w
        res[f"len(cache) after call {i}"] = torch.tensor(_len(cache))
        K = getattr(cache, "K", None)
        res[f"the shape of cache.K after call {i}"] = torch.tensor(tuple(K.shape) if isinstance(K, torch.Tensor) else ())
        left = set(getattr(cache, "__dict__", {})) - {"K", "V"} - own
        res[f"nothing but K and V left in the cache after call {i}"] = torch.tensor(not left)
        if "dW_k" in case:
            with torch.no_grad():
                mha.W_k.weight.add_(_tensor(case["dW_k"]))
                mha.W_v.weight.add_(_tensor(case["dW_v"]))
    if case.get("cache_only"):
        res["cache.K"], res["cache.V"] = getattr(cache, "K", None), getattr(cache, "V", None)
    if grads:
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            raise AssertionError("the output does not require grad although x and the weights do: gradients cannot "
                                 "flow back. Avoid .detach(), .numpy(), .item() and torch.no_grad() inside the step.")
        leaves = [x] + [getattr(mha, n).weight for n in LAYERS]
        got = vector_jacobian(out, leaves, case["grad_out"].to(out.dtype))
        for name, g in zip(("x", *LAYERS), got):
            if g is None:
                raise AssertionError(f"no gradient of the last output reaches {name}: is it used (and not detached)?")
            res[f"grad_{name}"] = g
    res["x_new after the call"] = torch.cat([t.detach() for t in used], dim=1)
    return res


# ---------------------------------------------------------------- typical mistakes: the step
def _heads(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, T, n_heads, d // n_heads).transpose(1, 2)  # (B, H, T, d_k)


def _merge(x):
    B, H, T, d_k = x.shape
    return x.transpose(1, 2).reshape(B, T, H * d_k)


def _attend(q, K, V, mask=None):
    s = q @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s + mask
    w = torch.softmax(s, dim=-1)
    return w @ V, w


def _offset_mask(T_new, T_past, dtype, offset=True):
    full = torch.full((T_new, T_past + T_new), float("-inf"), dtype=dtype)
    return torch.triu(full, diagonal=(T_past if offset else 0) + 1)


def _project(x_new, mha):
    H = mha.n_heads
    return _heads(mha.W_q(x_new), H), _heads(mha.W_k(x_new), H), _heads(mha.W_v(x_new), H)


def _chunk_mask(x_new, K):
    T_new = x_new.shape[1]
    return _offset_mask(T_new, K.shape[-2] - T_new, x_new.dtype) if T_new > 1 else None


def _correct_step(x_new, cache, mha):
    """A correct step (the generate mistakes use it)."""
    q, k, v = _project(x_new, mha)
    K, V = cache.append(k, v)
    out, w = _attend(q, K, V, _chunk_mask(x_new, K))
    return mha.W_o(_merge(out)), w


def _step_not_updated(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    T_new, T_past = x_new.shape[1], len(cache)
    K = k if cache.K is None else torch.cat([cache.K, k], dim=-2)  # never stored
    V = v if cache.V is None else torch.cat([cache.V, v], dim=-2)
    out, w = _attend(q, K, V, _offset_mask(T_new, T_past, x_new.dtype) if T_new > 1 else None)
    return mha.W_o(_merge(out)), w


def _step_self_left_out(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    T_new = x_new.shape[1]
    K_old, V_old = cache.K, cache.V
    cache.append(k, v)
    if K_old is None:  # nothing cached yet: only the chunk itself to look at
        out, w = _attend(q, k, v, _offset_mask(T_new, 0, x_new.dtype) if T_new > 1 else None)
    else:  # the old cache only: every key there is in the past, so nothing to mask
        out, w = _attend(q, K_old, V_old)
    return mha.W_o(_merge(out)), w


def _step_mask_hides_cache(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    K, V = cache.append(k, v)
    T_new = x_new.shape[1]
    out, w = _attend(q, K, V, _offset_mask(T_new, K.shape[-2] - T_new, x_new.dtype, offset=False))
    return mha.W_o(_merge(out)), w


def _step_no_chunk_mask(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    K, V = cache.append(k, v)
    out, w = _attend(q, K, V)
    return mha.W_o(_merge(out)), w


def _step_stale_queries(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    K, V = cache.append(k, v)
    cache.Q = q if getattr(cache, "Q", None) is None else torch.cat([cache.Q, q], dim=-2)
    out, w = _attend(cache.Q[..., :x_new.shape[1], :], K, V, _chunk_mask(x_new, K))  # the oldest queries
    return mha.W_o(_merge(out)), w


def _step_queries_cached(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    T_new = x_new.shape[1]
    K, V = cache.append(k, v)
    cache.Q = q if getattr(cache, "Q", None) is None else torch.cat([cache.Q, q], dim=-2)
    T = K.shape[-2]
    out, w = _attend(cache.Q, K, V, _offset_mask(T, 0, x_new.dtype))  # (T, T) scores every step
    return mha.W_o(_merge(out[..., -T_new:, :])), w[..., -T_new:, :]


def _step_recomputes(x_new, cache, mha):
    cache.x = x_new if getattr(cache, "x", None) is None else torch.cat([cache.x, x_new], dim=1)
    q = _heads(mha.W_q(x_new), mha.n_heads)
    K = _heads(mha.W_k(cache.x), mha.n_heads)  # every key, again
    V = _heads(mha.W_v(cache.x), mha.n_heads)
    cache.K, cache.V = K, V
    out, w = _attend(q, K, V, _chunk_mask(x_new, K))
    return mha.W_o(_merge(out)), w


def _heads_no_transpose(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, n_heads, T, d // n_heads)  # cuts the sequence, not each token, into heads


def _step_split_no_transpose(x_new, cache, mha):
    H = mha.n_heads
    q, k, v = (_heads_no_transpose(W(x_new), H) for W in (mha.W_q, mha.W_k, mha.W_v))
    K, V = cache.append(k, v)
    out, w = _attend(q, K, V, _chunk_mask(x_new, K))
    return mha.W_o(_merge(out)), w


ONE, PROMPT, GRADS = "test_one_token_at_a_time", "test_prompt_then_tokens", "test_step_gradients"
STEP_ALL = frozenset({ONE, PROMPT, GRADS})
SPLIT_HINT = ("split x_new's projections as (B, T_new, n_heads, d_k), then .transpose(1, 2): reshaping straight to "
              "(B, n_heads, T_new, d_k) cuts the sequence of tokens into heads, not each token's features. With one "
              "new token the two agree, so the bug only shows when several tokens arrive at once.")
STEP_MISTAKES = (
    Mistake("cache not updated", "call cache.append(k, v) with the new keys and values and attend over the K, V it "
            "returns: what is not stored is missing at the next step.", _step_not_updated, STEP_ALL),
    Mistake("new token left out", "append first, then attend: a token attends to itself too (the diagonal of the "
            "causal mask is 0).", _step_self_left_out, STEP_ALL),
    Mistake("mask hides the cache", "new token i sits at position len(cache) + i (count the cached tokens before "
            "appending): mask only keys after that position, e.g. torch.triu(..., diagonal=T_past + 1). A single new "
            "token needs no mask at all.", _step_mask_hides_cache, STEP_ALL),
    Mistake("no mask within a chunk", "when several new tokens arrive at once (a prompt), each must not see the ones "
            "after it: mask keys j > T_past + i for new token i.", _step_no_chunk_mask, frozenset({PROMPT})),
    Mistake("stale queries", "queries are never cached: each step uses the queries of its own new tokens, computed "
            "from x_new.", _step_stale_queries, STEP_ALL),
    Mistake("queries cached", "only the newest token's query is needed; storing every query and scoring the whole "
            "(T, T) matrix again at every step throws the saving away. Keep Q out of the cache.", _step_queries_cached,
            frozenset({ONE, PROMPT})),
    Mistake("recomputing everything", "project only x_new: the keys and values of earlier tokens are already in the "
            "cache (they never change under a causal mask).", _step_recomputes, frozenset({ONE, PROMPT})),
    Mistake("heads split without the transpose", SPLIT_HINT, _step_split_no_transpose, frozenset({ONE, PROMPT})),
)


# ---------------------------------------------------------------- properties: the step
def _calls(case):
    start = 0
    for i, n in enumerate(case["chunks"], start=1):
        yield i, int(n), start, start + int(n)
        start += int(n)


def step_shapes(case, out, want):
    """Each call's output, weights and cache, by shape (the messages of the old checks)."""
    B, _, d = case["x"].shape
    H = int(case["n_heads"])
    for i, n, start, end in _calls(case):
        where = f"call {i} (tokens {start}..{end - 1})"
        o, w = out.get(f"the output of {where}"), out.get(f"the weights of {where}")
        if o is None or w is None:
            return None
        if o.shape != (B, n, d):
            return f"the output of {where} has shape {o.shape}; expected {(B, n, d)}, one row per new token."
        if w.shape != (B, H, n, end):
            why = ("the score matrix of a step has one row per new token, not one per token of the sequence"
                   if w.ndim == 4 and w.shape[-2] != n else "every new query is scored against the cached keys and "
                                                          "the new ones")
            return (f"the weights of {where} have shape {w.shape}; expected {(B, H, n, end)}: the {n} new queries "
                    f"against all {end} keys held so far ({why}).")
        held = int(out[f"len(cache) after call {i}"])
        if held != end:
            return (f"after call {i} the cache holds {held} positions but should hold {end}: it must grow by exactly "
                    f"the {n} new token(s) at every call.")
        shape = tuple(int(s) for s in out[f"the shape of cache.K after call {i}"])
        if shape != (B, H, end, d // H):
            return (f"after call {i} cache.K has shape {shape}; expected {(B, H, end, d // H)}: append keys and values "
                    "split into heads, (B, H, T_new, d_k).")
    return None


def nothing_else_cached(case, out, want):
    for i, *_ in _calls(case):
        clean = out.get(f"nothing but K and V left in the cache after call {i}")
        if clean is not None and not bool(clean):
            return (f"after call {i} the cache carries extra attributes: it should hold the keys K and the values V "
                    "(and what your KVCache keeps by itself) and nothing else. Queries are never cached (only the "
                    "newest token's query is ever used), and neither are the inputs (re-projecting them would be "
                    "recomputing everything).")
    return None


def reaches_earlier_tokens(case, out, want):
    g = out.get("grad_x")
    if g is not None and g.shape == want["grad_x"].shape and not np.abs(g[:, 0]).max() > 0:
        return ("the last token's output has no gradient with respect to the first token: the first token's key and "
                "value should reach the last step through the cache (is something detached or left out?).")
    return None


# ---------------------------------------------------------------- cases: the step
def _weights(rng, d, dtype):
    # W_q, W_k of std 1/sqrt(d), W_v, W_o of std 1.3/sqrt(d): vectors fed back by generate neither vanish nor
    # blow up over a dozen steps, and the attention is not so sharp that float32 rounding grows from step to step
    return {n: _normal(rng, (d, d), dtype, s / math.sqrt(d)) for n, s in zip(LAYERS, (1.0, 1.0, 1.3, 1.3))}


def _drift(rng, d, dtype):
    # moves W_k and W_v by about a third of their size at each step: every output changes by more than 1e-2
    return {n: _normal(rng, (d, d), dtype, 0.3 / math.sqrt(d)) for n in ("dW_k", "dW_v")}


DRIFT = ", with W_k and W_v changed after every call (a cache keeps the keys and values computed before)"


def _step_case(rng, tags, B, d, H, chunks, dtype, drift=False, what=""):
    label = f"for B={B}, d_model={d}, n_heads={H}, {dtype}, new tokens per call {list(chunks)}{DRIFT if drift else what}"
    c = case(label, tags, n_heads=H, chunks=tuple(chunks), x=_normal(rng, (B, sum(chunks), d), dtype),
             **_weights(rng, d, dtype))
    if drift:
        c.update(_drift(rng, d, dtype))
    return c


def _step_grad_case(rng, B=2, d=8, H=2, T=5):
    c = _step_case(rng, "grads", B, d, H, [1] * T, "float64", what=", the gradients of the last call's output")
    c["grad_out"] = _normal(rng, (B, 1, d), "float64")
    return c


def _cache_only(rng, B=2, d=8, H=2):
    c = _step_case(rng, "one_token", B, d, H, [2], "float64", what=", the keys and values cached (split into heads)")
    c["cache_only"] = True
    return c


def _step_visible():
    g = np.random.default_rng(1)
    return (_step_case(g, "one_token", 2, 8, 2, [1] * 6, "float64"),
            _step_case(g, "one_token", 2, 8, 2, [1] * 6, "float64", drift=True),
            _cache_only(g),
            _step_case(g, "prompt", 2, 8, 2, [3, 1, 1, 2], "float32"),
            _step_case(g, "prompt", 2, 8, 2, [3, 1, 1, 2], "float32", drift=True),
            _step_grad_case(g))


PROMPT_SIZES = ((1, 4, 1, [1]), (3, 8, 2, [4]), (1, 12, 3, [2, 1, 3, 1, 1]), (4, 16, 4, [1] * 9), (2, 8, 4, [5, 1, 1, 1]))


def step_secret(rng):
    """The visible sizes with fresh numbers, then more batch sizes, widths, head counts and chunkings in
    float32 and float64, with and without weights that change between calls; the gradients on two sizes."""
    cases = [_step_case(rng, "one_token", 2, 8, 2, [1] * 6, "float64", drift=drift) for drift in (False, True)]
    cases += [_step_case(rng, "one_token", 1, 4, 1, [1] * 3, "float32", drift=True), _cache_only(rng),
              _cache_only(rng, 3, 12, 3)]
    for drift in (False, True):
        cases.append(_step_case(rng, "prompt", 2, 8, 2, [3, 1, 1, 2], "float32", drift=drift))
        for i, (B, d, H, chunks) in enumerate(PROMPT_SIZES):
            dtype = ("float64", "float32")[(i + drift) % 2]
            cases.append(_step_case(rng, "prompt", B, d, H, chunks, dtype, drift=drift and len(chunks) > 1))
    cases += [_step_grad_case(rng), _step_grad_case(rng, 1, 12, 3, 4)]
    return cases


STEP_TESTS = {
    ONE: Test(3, frozenset({"one_token"}), first=(step_shapes, nothing_else_cached)),
    PROMPT: Test(3, frozenset({"prompt"}), first=(step_shapes, nothing_else_cached)),
    GRADS: Test(1, frozenset({"grads"}), first=(reaches_earlier_tokens,)),
}
STEP_RECAP_ID = "test_cached_attention_step"  # the capstone's 1-point recap: as test_one_token_at_a_time

STEP = Exercise(
    name="kv_cache",
    piece="cached_attention_step",
    call="cached_attention_step(x_new, cache, mha)",
    adapter=step_adapter,
    reference="firstprinciples.reference:cached_attention_step",
    names={f"grad_{n}": f"the gradient of the last output with respect to {n}" for n in ("x", *LAYERS)},
    visible=_step_visible(),
    secret=step_secret,
    tests=STEP_TESTS,
    forbidden=dict(torch_patterns=("scaled_dot_product_attention", "multi_head_attention"),
                   pieces=("cached_attention_step", "generate", "MultiHeadAttention", "scaled_dot_product_attention"),
                   what="cached attention (call mha.W_q, mha.W_k, mha.W_v and mha.W_o, not mha itself)"),
    mistakes=STEP_MISTAKES,
    hints=(("shape '[", "x_new is (B, T_new, d_model): split its projections as (B, T_new, n_heads, d_k), then "
                        ".transpose(1, 2)."),),
    elsewhere={STEP_RECAP_ID: Test(1, frozenset({"one_token"}), first=(step_shapes, nothing_else_cached))},
    needs=("KVCache",),
)


# ================================================================ generate
GENERATE_CALLED = ("generate called mha(...) itself: that recomputes every key and value at every step. Use one "
                   "KVCache and cached_attention_step: the prompt once, then one new vector per step.")


def generate_adapter(generate, case):
    """``generate`` on the case's layers and prompt: the sequence it returns and the prompt after the call.
    A drift case ("dW_k") puts the layers' weights on a clock (``Clocked``)."""
    mha = (_clocked_layers if "dW_k" in case else _layers)(case, GENERATE_CALLED).requires_grad_(False)
    prompt = _tensor(case["prompt"])
    seq = generate(mha, prompt, int(case["n_new"]))
    return {"the generated sequence": seq, "prompt after the call": prompt}


def sequence_shape(case, out, want):
    B, T_p, d = case["prompt"].shape
    n = int(case["n_new"])
    seq = out.get("the generated sequence")
    if seq is not None and seq.shape != (B, T_p + n, d):
        return (f"the sequence has shape {seq.shape}; expected {(B, T_p + n, d)}: the prompt followed by the n_new "
                "generated vectors.")
    return None


def _gen_new_cache_each_step(mha, prompt, n_new):
    seq, x_new = prompt, prompt
    for _ in range(n_new):
        out, _ = _correct_step(x_new, GivenCache(), mha)
        x_new = out[:, -1:]
        seq = torch.cat([seq, x_new], dim=1)
    return seq


def _gen_first_row(mha, prompt, n_new):
    cache, seq, x_new = GivenCache(), prompt, prompt
    for _ in range(n_new):
        out, _ = _correct_step(x_new, cache, mha)
        x_new = out[:, :1]
        seq = torch.cat([seq, x_new], dim=1)
    return seq


def _gen_whole_sequence_each_step(mha, prompt, n_new):
    cache, seq = GivenCache(), prompt
    for _ in range(n_new):
        out, _ = _correct_step(seq, cache, mha)
        seq = torch.cat([seq, out[:, -1:]], dim=1)
    return seq


def _gen_uncached(mha, prompt, n_new):
    """Every step projects the whole prefix again (with the layers) and attends with a causal mask."""
    seq = prompt
    for _ in range(n_new):
        T = seq.shape[1]
        q, k, v = _project(seq, mha)
        out, _ = _attend(q, k, v, _offset_mask(T, 0, seq.dtype))
        seq = torch.cat([seq, mha.W_o(_merge(out))[:, -1:]], dim=1)
    return seq


GENERATE_ID = "test_generate"
GENERATE_MISTAKES = (
    Mistake("new cache every step", "create the KVCache once, before the loop: a fresh cache forgets every earlier "
            "token.", _gen_new_cache_each_step, frozenset({GENERATE_ID})),
    Mistake("first position fed back", "the next input is the output at the last position, out[:, -1:], not "
            "out[:, :1].", _gen_first_row, frozenset({GENERATE_ID})),
    Mistake("whole sequence fed at every step", "after the prompt, pass only the newest vector (B, 1, d_model): "
            "everything before it is in the cache.", _gen_whole_sequence_each_step, frozenset({GENERATE_ID})),
    # right with fixed weights: only the drift cases tell it from a cache
    Mistake("recomputing everything", "use a KVCache and cached_attention_step: run the prompt through once, then "
            "one new vector per step; the keys and values of earlier tokens stay as they were computed.",
            _gen_uncached, frozenset({GENERATE_ID})),
)


def _generate_case(rng, B, T_p, n_new, d, H, dtype, drift=False):
    label = (f"for B={B}, a prompt of {T_p}, n_new={n_new}, d_model={d}, n_heads={H}, {dtype}"
             + (", with W_k and W_v changed after every step (a cache keeps the keys and values computed before)"
                if drift else ", against generation without a cache"))
    c = case(label, "generate", n_heads=H, n_new=n_new, prompt=_normal(rng, (B, T_p, d), dtype),
             **_weights(rng, d, dtype))
    if drift:
        c.update(_drift(rng, d, dtype))
    return c


def _generate_visible():
    g = np.random.default_rng(2)
    return tuple(_generate_case(g, 2, 3, 4, 8, 2, "float64", drift=drift) for drift in (False, True))


GENERATE_SIZES = ((1, 1, 1, 4, 1), (1, 1, 8, 8, 2), (3, 5, 6, 12, 3), (2, 2, 10, 16, 4))


def generate_secret(rng):
    """The visible sizes in float64 and float32 with fresh numbers, with and without drift; then three of
    four longer runs in float64 (in float32, rounding grows with each vector fed back: over 300 draws a
    correct answer exceeded the float32 tolerance in 8% of runs of 10 vectors, in none of 4)."""
    cases = [_generate_case(rng, 2, 3, 4, 8, 2, dtype, drift) for dtype in ("float64", "float32")
             for drift in (False, True)]
    for i in rng.permutation(len(GENERATE_SIZES))[:3]:
        cases += [_generate_case(rng, *GENERATE_SIZES[i], "float64", drift) for drift in (False, True)]
    return cases


GENERATE = Exercise(
    name="kv_cache",
    piece="generate",
    call="generate(mha, prompt, n_new)",
    adapter=generate_adapter,
    reference="firstprinciples.reference:generate",
    visible=_generate_visible(),
    secret=generate_secret,
    tests={GENERATE_ID: Test(2, frozenset({"generate"}), first=(sequence_shape,))},
    forbidden=dict(torch_patterns=("scaled_dot_product_attention", "multi_head_attention"),
                   pieces=("generate", "cached_attention_step"), what="the generation loop"),
    mistakes=GENERATE_MISTAKES,
)

PIECES = (CACHE, STEP, GENERATE)

# What the capstone's recaps are made from (exercises/capstone.py).
CACHE_RECAP = dataclasses.replace(CACHE, tests={CACHE_RECAP_ID: CACHE_RECAP_TEST}, elsewhere={})
STEP_RECAP = dataclasses.replace(STEP, tests={STEP_RECAP_ID: STEP.elsewhere[STEP_RECAP_ID]}, elsewhere={})
