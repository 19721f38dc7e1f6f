"""Checks for the KV-cache exercise.

The student writes three pieces:

- ``KVCache``: ``KVCache()`` is empty; ``append(k, v)`` takes (B, H, T_new, d_k)
  keys and values, stores them after the ones already held and returns the full
  ``(K, V)``; the attributes ``K`` and ``V`` hold them (``None`` while empty) and
  ``len(cache)`` is the number of positions held.
- ``cached_attention_step(x_new, cache, mha)``: multi-head self-attention of the
  T_new newest tokens (B, T_new, d_model) over the cache, using the layers
  ``mha.W_q``, ``mha.W_k``, ``mha.W_v``, ``mha.W_o`` of a course
  ``MultiHeadAttention``; returns ``(output (B, T_new, d_model),
  weights (B, H, T_new, T_past + T_new))``.
- ``generate(mha, prompt, n_new)``: a toy autoregressive loop with a cache (the
  next input is the attention output at the last position); returns the prompt
  followed by the n_new generated vectors, (B, T_p + n_new, d_model).

Correctness is checked against full recomputation (``mha`` on the whole sequence
with a causal mask). Speed is checked by counting work, never by timing: forward
hooks count the rows that ``W_q``, ``W_k`` and ``W_v`` project at every step (one
per new token with a cache, the whole prefix without), and the returned weights
show the size of each step's score matrix.

The step checks hand the step the student's own ``KVCache`` (``step_cache``): the
class they are given, else the notebook's, found through the step's globals (the
test cells pass the step alone), so that a step may call helper methods of its own
cache; what the cache keeps by itself is not counted as state the step left in it.
When the student's class fails its own test (``check_kv_cache`` and
``check_kv_cache_gradients``), or there is none, they use the course's KVCache
instead, so that the step is graded on its own, and say so (printed, and in the
message of a failure).

Tolerances (``_core.TOLERANCES``): float32 1e-5 + 1e-4 |value|, float64 1e-10 + 1e-8 |value|.
Cached decoding does the same arithmetic as full recomputation, one query row
at a time instead of the whole matrix, so only the order of the d_k-term and
T-term sums may differ (a few 1e-7 relative in float32, a few 1e-16 in
float64); ``generate`` feeds each output back in for at most a dozen steps,
which keeps the accumulated difference below 1e-6 in float32. Every known
mistake moves the outputs by more than 1e-2.
"""
from __future__ import annotations

import contextlib
import dataclasses
import dis
import inspect
import io
import itertools
import math
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..guard import call_without
from ..reference import KVCache as _RefCache
from ..reference import MultiHeadAttention, causal_mask
from ..reference import cached_attention_step as _ref_step
from ..reference import generate as _ref_generate
from ._student import describe, wrap_checks
from ._core import Mistake, assert_matches, call_answer, close, fmt, tolerance

_TORCH_ATTENTION = ("scaled_dot_product_attention", "multi_head_attention")

CACHE_FORBIDDEN = dict(torch_patterns=_TORCH_ATTENTION, pieces=("KVCache",), what="the key/value cache")
STEP_FORBIDDEN = dict(
    torch_patterns=_TORCH_ATTENTION,
    pieces=("cached_attention_step", "generate", "MultiHeadAttention", "scaled_dot_product_attention"),
    what="cached attention (call mha.W_q, mha.W_k, mha.W_v and mha.W_o, not mha itself)",
)
# Calling mha itself in generate is allowed here: it is the uncached loop, and
# the work count below names that mistake instead of scoring it 0 silently.
GENERATE_FORBIDDEN = dict(
    torch_patterns=_TORCH_ATTENTION, pieces=("generate", "cached_attention_step"), what="the generation loop"
)


# ---------------------------------------------------------------- the toy model
def seeded_mha(d_model=8, n_heads=2, seed=0, dtype=torch.float32):
    """A course ``MultiHeadAttention`` with weights drawn from ``seed`` (global RNG untouched).

    W_q and W_k have entries of std 1/sqrt(d_model), W_v and W_o 1.3/sqrt(d_model):
    with these, vectors fed back by ``generate`` neither vanish nor blow up over
    a dozen steps (so comparisons stay meaningful), and the attention is not so
    sharp that float32 rounding gets amplified from one step to the next.
    """
    with torch.random.fork_rng(devices=[]):
        mha = MultiHeadAttention(d_model, n_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, std in (("W_q", 1.0), ("W_k", 1.0), ("W_v", 1.3), ("W_o", 1.3)):
            w = torch.randn(d_model, d_model, generator=g, dtype=torch.float64) * std / math.sqrt(d_model)
            getattr(mha, name).weight.copy_(w)
    return mha.to(dtype)


@contextlib.contextmanager
def counting_rows(mha):
    """Count the rows (token positions) that mha.W_q, W_k and W_v project.

    Yields a dict {"W_q": n, "W_k": n, "W_v": n}, updated at every call of the layers.
    """
    counts = {"W_q": 0, "W_k": 0, "W_v": 0}

    def hook(name):
        def record(module, inputs, output):
            counts[name] += inputs[0].shape[:-1].numel()

        return record

    handles = [getattr(mha, n).register_forward_hook(hook(n)) for n in counts]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


class MatmulWork(TorchDispatchMode):
    """Counts the multiply-adds of every matrix product run inside it, however the code spells it
    (a layer's call, ``F.linear``, ``@``, ``einsum``, ``x @ layer.weight.T``): what generation does
    with its cache is judged by the arithmetic it performs, not by hooks on the layers, which a
    product written with the layer's weight never triggers."""

    def __init__(self):
        super().__init__()
        self.work = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # (as ``memory.StorageSizes``: no torch._dynamo import at the first call)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm", "addmm", "baddbmm", "mv", "dot", "addmv", "addbmm"):
            a = args[1] if name.startswith("add") or name == "baddbmm" else args[0]
            if isinstance(out, torch.Tensor) and isinstance(a, torch.Tensor) and a.dim() >= 1:
                self.work += out.numel() * a.shape[-1] * (a.shape[0] if name == "addbmm" else 1)
        return out


def generation_work(B, T_p, n_new, d_model, cached: bool) -> int:
    """The multiply-adds of the reference's generation: with a cache, the prompt is projected once
    and each later step one new row (``n_new`` steps in all); without, every step runs ``mha`` on
    the whole prefix. Per step of ``rows`` new rows over ``L`` positions: the four projections
    (4 rows d_model^2), the scores and the weighted values (2 rows L d_model)."""
    work = 0
    for i in range(n_new):
        L = T_p + i
        rows = (T_p if i == 0 else 1) if cached else L
        work += 4 * rows * d_model * d_model + 2 * rows * L * d_model
    return B * work


def reprojects(work, B, T_p, n_new, d_model) -> bool:
    """Whether ``work`` (``MatmulWork``) is that of generation without a cache: above the geometric
    mean of the cached and the uncached reference (judged only where they differ by 2x or more;
    an extra step or per-head loops change the work by far less)."""
    cached, uncached = (generation_work(B, T_p, n_new, d_model, c) for c in (True, False))
    return uncached >= 2 * cached and work > math.sqrt(cached * uncached)


def full_recomputation(mha, x):
    """The uncached answer: mha on the whole sequence with a causal mask."""
    with torch.no_grad():
        return mha(x, causal_mask(x.shape[1], x.dtype))


# ---------------------------------------------------------------- KVCache mistakes
class _NotUpdated:
    """Concatenates into a local variable: only the first append is stored."""

    def __init__(self):
        self.K = self.V = None

    def append(self, k, v):
        if self.K is None:
            self.K, self.V = k, v
            return k, v
        K = torch.cat([self.K, k], dim=-2)
        V = torch.cat([self.V, v], dim=-2)
        return K, V

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


CACHE_MISTAKES = (
    Mistake("cache not updated",
            "store the concatenation back in self.K and self.V (self.K = torch.cat(...)); "
            "a local variable is forgotten as soon as append returns.", _NotUpdated),
    Mistake("overwritten instead of appended",
            "the cache must keep every earlier key and value: concatenate the new ones after them.", _Overwritten),
    Mistake("appended along the feature dim",
            "K and V are (B, H, T, d_k): new positions go along the time axis, dim=-2 (2), not dim=-1.",
            _cat_cache(-1)),
    Mistake("appended along the head dim",
            "K and V are (B, H, T, d_k): new positions go along the time axis, dim=-2 (2), not dim=1.",
            _cat_cache(1)),
    Mistake("new entries prepended",
            "put the new keys and values after the old ones: row t of the cache must be token t "
            "(the causal mask of a prompt relies on that order).", _cat_cache(-2, prepend=True)),
    Mistake("len counts appends",
            "len(cache) is the number of positions held (K.shape[-2]), not the number of append calls: "
            "a prompt appends several positions at once.", _LenCountsAppends),
)


# ---------------------------------------------------------------- KVCache checks
def _cache_run(cls, chunks, B, H, d_k, d_v, dtype, seed, guarded):
    """Append random chunks; return [(K, V, len)] after each append, plus the inputs."""
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(B, H, n, d_k, generator=g, dtype=dtype) for n in chunks]
    vs = [torch.randn(B, H, n, d_v, generator=g, dtype=dtype) for n in chunks]
    if guarded:
        cache = call_without(cls, (), **CACHE_FORBIDDEN)
    else:
        cache = cls()
    record = []
    for k, v in zip(ks, vs):
        if guarded:
            try:
                K, V = call_answer(cache.append, (k, v), names=("K", "V"), forbidden=CACHE_FORBIDDEN)
            except AssertionError:
                raise
            except Exception as err:
                held = sum(r[2] for r in record[-1:])
                raise AssertionError(
                    f"append {describe(err)}\n(appending keys of shape {tuple(k.shape)} to a "
                    f"cache that reported {held} positions). New positions go along the time axis, dim=-2."
                ) from None
            n = call_without(len, (cache,), **CACHE_FORBIDDEN)
        else:
            K, V = cache.append(k.clone(), v.clone())
            n = len(cache)
        record.append((K, V, n, getattr(cache, "K", None), getattr(cache, "V", None)))
    return cache, record, ks, vs


def _same_cache_record(a, b):
    return len(a) == len(b) and all(
        x[2] == y[2] and all(close(p, q, *tolerance(q.dtype)) for p, q in zip(x[:2], y[:2])) for x, y in zip(a, b)
    )


def _diagnose_cache(record, args):
    try:
        right = _cache_run(_RefCache, *args, guarded=False)[1]
    except Exception:  # pragma: no cover - the reference does not fail
        right = None
    found = []
    for m in CACHE_MISTAKES:
        try:
            res = _cache_run(m.fn, *args, guarded=False)[1]
        except Exception:
            continue
        if _same_cache_record(record, res) and not _same_cache_record(res, right):
            found.append(m)
    return found


def _with_named(check, found_fn):
    try:
        check()
    except AssertionError as err:
        found = found_fn()
        if found:
            lines = "\n".join(f"  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"{err}\nYour answer matches a typical mistake:\n{lines}") from None
        raise


def _check_cache_case(cls, chunks, B=2, H=2, d_k=4, d_v=4, dtype=torch.float64, seed=0):
    args = (chunks, B, H, d_k, d_v, dtype, seed)
    cache, record, ks, vs = _cache_run(cls, *args, guarded=True)
    label = f"(B={B}, H={H}, d_k={d_k}, d_v={d_v}, {str(dtype).replace('torch.', '')}, appending {list(chunks)} positions)"

    def check():
        held = 0
        for i, (K, V, n, K_attr, V_attr) in enumerate(record):
            held += chunks[i]
            where = f"after append number {i + 1} {label}"
            assert_matches("K", K, torch.cat(ks[: i + 1], dim=-2), context=where)
            assert_matches("V", V, torch.cat(vs[: i + 1], dim=-2), context=where)
            assert n == held, f"len(cache) is {n} {where}, but the cache holds {held} positions (K.shape[-2])."
            for name, attr, ret in (("K", K_attr, K), ("V", V_attr, V)):
                assert isinstance(attr, torch.Tensor) and close(attr, ret, *tolerance(dtype)), (
                    f"cache.{name} {where} should be the full {name} that append returned "
                    f"(the attributes K and V hold everything cached so far)."
                )

    _with_named(check, lambda: _diagnose_cache(record, args))
    return record


def check_kv_cache(KVCache, full=True, verbose=True):
    """Appending a prompt chunk, then one position at a time: returned K and V,
    the attributes K and V, len(cache), dtype, untouched inputs.

    ``full=False`` runs the visible case only (float64, B=2, H=2, d_k=4);
    ``verbose=False`` prints nothing.
    """
    cache = call_without(KVCache, (), **CACHE_FORBIDDEN)
    n = call_without(len, (cache,), **CACHE_FORBIDDEN)
    assert n == 0, f"A new cache should be empty: len(KVCache()) is {n}, expected 0."
    for attr in ("K", "V"):
        assert getattr(cache, attr, "missing") is None, (
            f"A new cache should have the attribute {attr} set to None (it is "
            f"{'missing' if not hasattr(cache, attr) else type(getattr(cache, attr)).__name__})."
        )
    for chunks in ((1, 1, 1), (3, 1, 2)):
        record = _check_cache_case(KVCache, chunks)
        if verbose:
            print(f"appending {list(chunks)} positions: K grew {' -> '.join(str(tuple(r[0].shape)) for r in record)}; "
                  f"len(cache) = {record[-1][2]}.")
    if not full:
        return
    for seed, (chunks, B, H, d_k, d_v) in enumerate(
        [((1,) * 6, 1, 1, 2, 2), ((2, 3, 1), 3, 4, 8, 5), ((5,), 2, 2, 4, 4), ((1, 4, 1, 2), 1, 3, 6, 6)], start=1
    ):
        for dtype in (torch.float32, torch.float64):
            _check_cache_case(KVCache, chunks, B, H, d_k, d_v, dtype, seed)


def check_kv_cache_gradients(KVCache):
    """Gradients flow from the returned K and V back to every appended k and v."""
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True) for n in (2, 1, 1)]
    vs = [torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True) for n in (2, 1, 1)]
    cache = call_without(KVCache, (), **CACHE_FORBIDDEN)
    for k, v in zip(ks, vs):
        K, V = call_answer(cache.append, (k, v), names=("K", "V"), forbidden=CACHE_FORBIDDEN)
    if tuple(K.shape) != (1, 2, 4, 3) or tuple(V.shape) != (1, 2, 4, 3):
        raise AssertionError(
            f"After appending 2, 1 and 1 positions of shape (1, 2, n, 3), K and V should be (1, 2, 4, 3); "
            f"got {tuple(K.shape)} and {tuple(V.shape)} (check_kv_cache says more)."
        )
    if not (K.requires_grad and V.requires_grad):
        raise AssertionError(
            "The K and V returned by append do not require grad although the appended keys and values do: "
            "the cache must keep them as they are (no .detach(), no torch.tensor(...) copies)."
        )
    weights = torch.arange(1, K.numel() + 1, dtype=torch.float64).reshape(K.shape)
    grads = torch.autograd.grad((K * weights).sum() + (V * weights).sum(), ks + vs, allow_unused=True)
    start = 0
    for i, k in enumerate(ks):
        n = k.shape[-2]
        want = weights[..., start : start + n, :]
        for name, gr in (("k", grads[i]), ("v", grads[len(ks) + i])):
            if gr is None or not close(gr, want, 1e-12, 0):
                raise AssertionError(
                    f"The gradient of the cache reaching the {name} of append number {i + 1} is wrong or missing: "
                    "each appended entry should pass its gradient straight through (torch.cat does)."
                )
        start += n


# ---------------------------------------------------------------- the cache handed to the step
@dataclasses.dataclass(frozen=True)
class StepCache:
    """The cache class that the step checks (and the step's trusted probe) hand to the step.

    ``cls``: the student's KVCache, or the course's; ``own``: the attributes the class
    keeps by itself besides K and V (those its methods set, and those a cache holds after
    a few appends), which the step may leave in the cache; ``note``: why the course's
    cache is used instead of the student's (None when it is not, or there is none).
    """

    cls: type
    own: frozenset = frozenset()
    note: str | None = None

    def new(self):
        return self.cls()

    def extra(self, cache) -> tuple:
        """What the step left in ``cache`` besides K, V and the cache's own state."""
        held = getattr(cache, "__dict__", None)
        return tuple(sorted(set(held if isinstance(held, dict) else ()) - {"K", "V"} - self.own))


COURSE_CACHE = StepCache(_RefCache)


def notebook_cache(step):
    """The class named ``KVCache`` where ``step`` was defined (a notebook's namespace), or None."""
    try:
        fn = inspect.unwrap(step)
    except Exception:  # a broken __wrapped__ chain
        fn = step
    g = getattr(fn, "__globals__", None)
    cls = g.get("KVCache") if isinstance(g, dict) else None
    return cls if isinstance(cls, type) else None


def cache_problem(KVCache):
    """None if ``KVCache`` passes its own test (check_kv_cache, all cases, and
    check_kv_cache_gradients), else the first line of what fails, quietly."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check_kv_cache(KVCache, verbose=False)
            check_kv_cache_gradients(KVCache)
    except Exception as err:  # any failure of the student's class: the step is graded without it
        first = (str(err).strip().splitlines() or [""])[0]
        what = first if isinstance(err, AssertionError) else f"{type(err).__name__}: {first}".rstrip(": ")
        return what[:300]
    return None


def _functions(cls):
    for klass in cls.__mro__:
        if klass is object:
            continue
        for value in vars(klass).values():
            for f in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                      getattr(value, "fset", None)):
                if callable(f):
                    try:
                        f = inspect.unwrap(f)
                    except Exception:
                        pass
                    if isinstance(getattr(f, "__code__", None), types.CodeType):
                        yield f.__code__


def _stored_attributes(code):
    names = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
            names.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_attributes(const)
    return names


def own_attributes(cls):
    """The attributes ``cls`` keeps by itself: those its methods assign, and those an
    instance holds after a few appends (K and V aside)."""
    names = set()
    for code in _functions(cls):
        names |= _stored_attributes(code)
    try:
        with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(io.StringIO()):
            cache = cls()
            seen = set(getattr(cache, "__dict__", {}))
            g = torch.Generator().manual_seed(0)
            for n in (2, 1, 1):
                cache.append(torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64),
                             torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64))
                len(cache)
                seen |= set(getattr(cache, "__dict__", {}))
        names |= seen
    except Exception:  # pragma: no cover - the class passed its test before this runs
        pass
    return frozenset(names - {"K", "V"})


def step_cache(step, KVCache=None) -> StepCache:
    """The cache for the checks of ``step``: the student's own KVCache (``KVCache``, or the
    notebook's found through the step's globals) when it passes its own test, else the
    course's, with a note saying why. Without a class of the student's (none given or
    found, or not a class): the course's, with no note."""
    cls = notebook_cache(step) if KVCache is None else KVCache
    if not isinstance(cls, type) or cls is _RefCache:  # no class of the student's: the course's, as before
        return COURSE_CACHE
    why = cache_problem(cls)
    if why is not None:
        note = (f"Your KVCache fails its own test ({why.rstrip('.')}), so this test gave your step the course's "
                "KVCache instead: your step is graded on its own, with the course's cache.append, len, K and V.")
        return StepCache(_RefCache, frozenset(), note)
    return StepCache(cls, own_attributes(cls))


# ---------------------------------------------------------------- step mistakes
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


def _step_not_updated(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    T_new, T_past = x_new.shape[1], len(cache)
    K = k if cache.K is None else torch.cat([cache.K, k], dim=-2)  # never stored
    V = v if cache.V is None else torch.cat([cache.V, v], dim=-2)
    mask = _offset_mask(T_new, T_past, x_new.dtype) if T_new > 1 else None
    out, w = _attend(q, K, V, mask)
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
    T_new = x_new.shape[1]
    K, V = cache.append(k, v)
    mask = _offset_mask(T_new, K.shape[-2] - T_new, x_new.dtype, offset=False)  # rows 0..T_new-1 of the big mask
    out, w = _attend(q, K, V, mask)
    return mha.W_o(_merge(out)), w


def _step_no_chunk_mask(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    K, V = cache.append(k, v)
    out, w = _attend(q, K, V)
    return mha.W_o(_merge(out)), w


def _step_stale_queries(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    T_new = x_new.shape[1]
    K, V = cache.append(k, v)
    if getattr(cache, "Q", None) is None:
        cache.Q = q
    else:
        cache.Q = torch.cat([cache.Q, q], dim=-2)
    q_used = cache.Q[..., :T_new, :]  # the oldest queries, not the newest
    mask = _offset_mask(T_new, K.shape[-2] - T_new, x_new.dtype) if T_new > 1 else None
    out, w = _attend(q_used, K, V, mask)
    return mha.W_o(_merge(out)), w


def _step_queries_cached(x_new, cache, mha):
    q, k, v = _project(x_new, mha)
    T_new = x_new.shape[1]
    K, V = cache.append(k, v)
    cache.Q = q if getattr(cache, "Q", None) is None else torch.cat([cache.Q, q], dim=-2)
    T = K.shape[-2]
    out, w = _attend(cache.Q, K, V, causal_mask(T, x_new.dtype))  # (T, T) scores every step
    return mha.W_o(_merge(out[..., -T_new:, :])), w[..., -T_new:, :]


def _step_recomputes(x_new, cache, mha):
    cache.x = x_new if getattr(cache, "x", None) is None else torch.cat([cache.x, x_new], dim=1)
    T_new, T = x_new.shape[1], cache.x.shape[1]
    q = _heads(mha.W_q(x_new), mha.n_heads)
    K = _heads(mha.W_k(cache.x), mha.n_heads)  # every key, again
    V = _heads(mha.W_v(cache.x), mha.n_heads)
    cache.K, cache.V = K, V
    mask = _offset_mask(T_new, T - T_new, x_new.dtype) if T_new > 1 else None
    out, w = _attend(q, K, V, mask)
    return mha.W_o(_merge(out)), w


def _heads_no_transpose(x, n_heads):
    B, T, d = x.shape
    return x.reshape(B, n_heads, T, d // n_heads)  # cuts the sequence, not each token, into heads


def _step_split_no_transpose(x_new, cache, mha):
    H = mha.n_heads
    q, k, v = (_heads_no_transpose(W(x_new), H) for W in (mha.W_q, mha.W_k, mha.W_v))
    T_new = x_new.shape[1]
    K, V = cache.append(k, v)
    mask = _offset_mask(T_new, K.shape[-2] - T_new, x_new.dtype) if T_new > 1 else None
    out, w = _attend(q, K, V, mask)
    return mha.W_o(_merge(out)), w


SPLIT_HINT = ("split x_new's projections as (B, T_new, n_heads, d_k), then .transpose(1, 2): reshaping straight to "
              "(B, n_heads, T_new, d_k) cuts the sequence of tokens into heads, not each token's features. With one "
              "new token the two agree, so the bug only shows when several tokens arrive at once.")

STEP_MISTAKES = (
    Mistake("cache not updated",
            "call cache.append(k, v) with the new keys and values and attend over the K, V it returns: "
            "what is not stored is missing at the next step.", _step_not_updated),
    Mistake("new token left out",
            "append first, then attend: a token attends to itself too (the diagonal of the causal mask is 0).",
            _step_self_left_out),
    Mistake("mask hides the cache",
            "new token i sits at position len(cache) + i (count the cached tokens before appending): "
            "mask only keys after that position, e.g. torch.triu(..., diagonal=T_past + 1). "
            "A single new token needs no mask at all.", _step_mask_hides_cache),
    Mistake("no mask within a chunk",
            "when several new tokens arrive at once (a prompt), each must not see the ones after it: "
            "mask keys j > T_past + i for new token i.", _step_no_chunk_mask),
    Mistake("stale queries",
            "queries are never cached: each step uses the queries of its own new tokens, computed from x_new.",
            _step_stale_queries),
    Mistake("queries cached",
            "only the newest token's query is needed; storing every query and scoring the whole (T, T) matrix "
            "again at every step throws the saving away. Keep Q out of the cache.", _step_queries_cached),
    Mistake("recomputing everything",
            "project only x_new: the keys and values of earlier tokens are already in the cache "
            "(they never change under a causal mask).", _step_recomputes),
    Mistake("heads split without the transpose", SPLIT_HINT, _step_split_no_transpose),
)


# ---------------------------------------------------------------- step checks
@dataclasses.dataclass
class _StepRun:
    outputs: list
    weights: list
    lens: list
    shapes: list
    rows: list
    extra: list


def _step_run(step, mha, x, chunks, guarded, cache_class=COURSE_CACHE):
    """Feed x (B, T, d_model) to ``step`` in ``chunks``, with a fresh cache of ``cache_class`` (a StepCache)."""
    cache = cache_class.new()
    run = _StepRun([], [], [], [], [], [])
    start = 0
    with counting_rows(mha) as counts:
        for n in chunks:
            x_new = x[:, start : start + n]
            before = dict(counts)
            if guarded:
                out, w = call_answer(step, (x_new, cache, mha), names=("output", "weights"), forbidden=STEP_FORBIDDEN,
                                     shapes=(tuple(x_new.shape), None))
            else:
                out, w = step(x_new.clone(), cache, mha)
            run.outputs.append(out)
            run.weights.append(w)
            run.lens.append(len(cache))
            run.shapes.append(None if cache.K is None else tuple(cache.K.shape))
            run.rows.append(tuple(counts[k] - before[k] for k in ("W_q", "W_k", "W_v")))
            run.extra.append(cache_class.extra(cache))
            start += n
    return run


def _same_step_run(a, b):
    if a is None or b is None or len(a.outputs) != len(b.outputs):
        return False
    # Extra state is compared by presence only: where a cached Q is kept does not matter.
    if (a.lens, a.shapes, a.rows, [bool(e) for e in a.extra]) != (b.lens, b.shapes, b.rows, [bool(e) for e in b.extra]):
        return False
    return all(close(p, q, *tolerance(q.dtype)) for p, q in zip(a.outputs + a.weights, b.outputs + b.weights))


def _diagnose_step(run, mha, x, chunks, cache_class=COURSE_CACHE):
    with torch.no_grad():
        try:
            right = _step_run(_ref_step, mha, x, chunks, guarded=False, cache_class=cache_class)
        except Exception:  # pragma: no cover - the student's cache passed its test
            right = None
        found = []
        for m in STEP_MISTAKES:
            try:
                res = _step_run(m.fn, mha, x, chunks, guarded=False, cache_class=cache_class)
            except Exception:
                continue
            if _same_step_run(run, res) and not _same_step_run(res, right):
                found.append(m)
    return found


def _case(B, T, d_model, n_heads, dtype, seed):
    mha = seeded_mha(d_model, n_heads, seed, dtype)
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(B, T, d_model, generator=g, dtype=dtype)
    return mha, x


@contextlib.contextmanager
def _with_note(note):
    """Re-raise a failure with ``note`` (why the course's cache was used) added to its message."""
    try:
        yield
    except AssertionError as err:
        if not note:
            raise
        raise type(err)(f"{err}\n({note})") from None
    except Exception as err:  # the step raised (say, calling a method the course's cache lacks)
        if not note:
            raise
        raise AssertionError(f"Your step {describe(err)}\n({note})") from None


def _check_steps(step, mha, x, chunks, *, cache_class=COURSE_CACHE, verbose=False):
    with _with_note(cache_class.note):
        return _check_steps_with(step, mha, x, chunks, cache_class, verbose)


def _check_steps_with(step, mha, x, chunks, cache_class, verbose):
    B, T, d_model = x.shape
    H, d_k = mha.n_heads, d_model // mha.n_heads
    run = _step_run(step, mha, x, chunks, guarded=True, cache_class=cache_class)
    full_out, full_w = full_recomputation(mha, x)
    dtype = str(x.dtype).replace("torch.", "")
    label = f"(B={B}, d_model={d_model}, n_heads={H}, {dtype}, new tokens per call {list(chunks)})"
    atol, rtol = tolerance(x.dtype)

    def check():
        start = 0
        for i, n in enumerate(chunks):
            end = start + n
            where = f"at call {i + 1} (tokens {start}..{end - 1}) {label}"
            out, w = run.outputs[i], run.weights[i]
            if tuple(out.shape) != (B, n, d_model):
                raise AssertionError(f"output {where} has shape {tuple(out.shape)}; expected {(B, n, d_model)}, "
                                     "one row per new token.")
            if tuple(w.shape) != (B, H, n, end):
                why = (
                    "the score matrix of a step has one row per new token, not one per token of the sequence"
                    if w.dim() == 4 and w.shape[-2] != n
                    else "every new query is scored against the cached keys and the new ones"
                )
                raise AssertionError(
                    f"weights {where} have shape {tuple(w.shape)}; expected {(B, H, n, end)}: "
                    f"the {n} new queries against all {end} keys held so far ({why})."
                )
            if run.lens[i] != end:
                raise AssertionError(
                    f"After call {i + 1} the cache holds {run.lens[i]} positions but should hold {end}: "
                    f"it must grow by exactly the {n} new token(s) at every call."
                )
            if run.shapes[i] != (B, H, end, d_k):
                raise AssertionError(
                    f"After call {i + 1} cache.K has shape {run.shapes[i]}; expected {(B, H, end, d_k)}: "
                    "append keys and values split into heads, (B, H, T_new, d_k)."
                )
            q_rows, k_rows, v_rows = run.rows[i]
            if (q_rows, k_rows, v_rows) == (0, 0, 0):
                raise AssertionError(
                    f"Call {i + 1} did not use the layers mha.W_q, mha.W_k, mha.W_v: call them on x_new "
                    "(for example mha.W_k(x_new)) so that the work can be counted."
                )
            if (q_rows, k_rows, v_rows) != (B * n, B * n, B * n):
                raise AssertionError(
                    f"Call {i + 1} {label} projected {q_rows // B} query, {k_rows // B} key and {v_rows // B} value "
                    f"rows per sequence; with a cache it needs {n} of each (the new tokens only). Projecting the "
                    f"whole prefix again ({end} rows) is recomputing everything, the cost the cache exists to avoid."
                )
            if run.extra[i]:
                raise AssertionError(
                    f"After call {i + 1} the cache carries extra attributes {list(run.extra[i])}: it should hold the "
                    "keys K and the values V (and what your KVCache keeps by itself) and nothing else. Queries "
                    "are never cached (only the newest token's query is ever used), and neither are the inputs "
                    "(re-projecting them would be "
                    "recomputing everything)."
                )
            assert_matches("weights", w, full_w[:, :, start:end, :end], context=where + ", against full recomputation")
            start = end
        got = torch.cat(run.outputs, dim=1)
        assert_matches("output", got, full_out, context=f"{label}, against full recomputation")

    try:
        check()
    except AssertionError as err:
        found = _diagnose_step(run, mha, x, chunks, cache_class)
        if found:
            lines = "\n".join(f"  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"{err}\nYour answer matches a typical mistake:\n{lines}") from None
        raise
    if verbose:
        diff = (torch.cat(run.outputs, dim=1).detach() - full_out).abs().max().item()
        rows = sum(r[1] for r in run.rows) // B
        uncached = sum(itertools.accumulate(chunks))  # every call re-projecting its whole prefix
        print(
            f"cached vs full recomputation {label}: max |difference| = {fmt(diff)} "
            f"(tolerance {atol:g} + {rtol:g}·|value|)."
        )
        print(
            f"keys projected per sequence: {rows} with your cache, {uncached} if every call re-ran the whole prefix."
        )
    return run


def _announce(cache_class):
    if cache_class.note:
        print(cache_class.note)
    return cache_class


def check_one_token_at_a_time(cached_attention_step, KVCache=None):
    """Six tokens fed one at a time (float64, B=2, d_model=8, 2 heads): shapes,
    cache growth, work done per step, and equality with full recomputation.

    The step gets a cache of your ``KVCache`` (default: the class of that name where the
    step is defined, your notebook), or the course's if yours fails its own test (``step_cache``)."""
    cache_class = _announce(step_cache(cached_attention_step, KVCache))
    mha, x = _case(2, 6, 8, 2, torch.float64, 0)
    _check_steps(cached_attention_step, mha, x, [1] * 6, cache_class=cache_class, verbose=True)
    with _with_note(cache_class.note):
        _check_split_of_two(cached_attention_step, mha, x[:, :2], cache_class)


def _check_split_of_two(step, mha, x2, cache_class):
    """The keys and values one call appends for two new tokens: each token's features cut into heads.

    One token at a time cannot tell a wrong split of x_new into heads from the right one
    (with T_new = 1, (B, 1, H, d_k) and (B, H, 1, d_k) hold the same numbers in the same
    order); two tokens in one call can. Only the cache is compared here, not the outputs
    (which also need a mask within the call: that is the next test's subject)."""
    cache = cache_class.new()
    call_answer(step, (x2.clone(), cache, mha), names=("output", "weights"), forbidden=STEP_FORBIDDEN,
                shapes=(tuple(x2.shape), None))
    H = mha.n_heads
    with torch.no_grad():
        want_K, want_V = _heads(mha.W_k(x2), H), _heads(mha.W_v(x2), H)
    where = "after one call with two new tokens, x_new of shape (2, 2, 8), 2 heads"
    for name, got, want in (("cache.K", cache.K, want_K), ("cache.V", cache.V, want_V)):
        try:
            assert_matches(name, got, want, context=where)
        except AssertionError as err:
            with torch.no_grad():
                wrong = _heads_no_transpose(mha.W_k(x2) if name == "cache.K" else mha.W_v(x2), H)
            if isinstance(got, torch.Tensor) and close(got, wrong, *tolerance(wrong.dtype)):
                raise AssertionError(
                    f"{err}\nYour answer matches a typical mistake:\n  - heads split without the transpose: {SPLIT_HINT}"
                ) from None
            raise


def check_prompt_then_tokens(cached_attention_step, KVCache=None, full=True):
    """A prompt of several tokens in one call (it needs a causal mask shifted by
    the cache length), then single tokens. ``full=False``: one float32 case;
    the full check covers several lengths, batch sizes, widths, both dtypes.
    The cache: as in ``check_one_token_at_a_time``.
    """
    cache_class = _announce(step_cache(cached_attention_step, KVCache))
    mha, x = _case(2, 7, 8, 2, torch.float32, 1)
    _check_steps(cached_attention_step, mha, x, [3, 1, 1, 2], cache_class=cache_class, verbose=not full)
    if not full:
        return
    cases = [
        # (B, d_model, n_heads, chunks)
        (1, 4, 1, [1]),
        (3, 8, 2, [4]),
        (1, 12, 3, [2, 1, 3, 1, 1]),
        (4, 16, 4, [1] * 9),
        (2, 8, 4, [5, 1, 1, 1]),
    ]
    for seed, (B, d_model, H, chunks) in enumerate(cases, start=2):
        for dtype in (torch.float32, torch.float64):
            mha, x = _case(B, sum(chunks), d_model, H, dtype, seed)
            _check_steps(cached_attention_step, mha, x, chunks, cache_class=cache_class)


def check_step_gradients(cached_attention_step, KVCache=None, full=True):
    """Gradients reach the inputs, through the cache to earlier tokens, and the
    weights W_q, W_k, W_v, W_o; the full check compares them with full recomputation (float64).
    The cache: as in ``check_one_token_at_a_time``."""
    cache_class = _announce(step_cache(cached_attention_step, KVCache))
    with _with_note(cache_class.note):
        _check_step_gradients(cached_attention_step, cache_class, full)


def _check_step_gradients(cached_attention_step, cache_class, full):
    mha, x0 = _case(2, 5, 8, 2, torch.float64, 21)
    x = x0.clone().requires_grad_(True)
    cache = cache_class.new()
    outs = []
    for t in range(5):
        out, _ = call_answer(cached_attention_step, (x[:, t : t + 1], cache, mha), names=("output", "weights"),
                             forbidden=STEP_FORBIDDEN)
        outs.append(out)
    if not outs[-1].requires_grad:
        raise AssertionError(
            "The output does not require grad although x and the weights do: gradients cannot flow back. "
            "Avoid .detach(), .numpy(), .item() and torch.no_grad() inside the step."
        )
    params = [mha.W_q.weight, mha.W_k.weight, mha.W_v.weight, mha.W_o.weight]
    loss = outs[-1].pow(2).sum()
    grads = torch.autograd.grad(loss, [x] + params, allow_unused=True)
    for name, gr in zip(("x", "W_q", "W_k", "W_v", "W_o"), grads):
        if gr is None:
            raise AssertionError(f"No gradient of the last output reaches {name}: is it used (and not detached)?")
    if grads[0][:, 0].abs().max().item() == 0:
        raise AssertionError(
            "The last token's output has no gradient with respect to the first token: the first token's key and "
            "value should reach the last step through the cache (is something detached or left out?)."
        )
    if not full:
        return
    x_full = x0.clone().requires_grad_(True)
    out_full, _ = mha(x_full, causal_mask(5, x0.dtype))
    want = torch.autograd.grad(out_full[:, -1:].pow(2).sum(), [x_full] + params)
    for name, gr, w in zip(("x", "W_q", "W_k", "W_v", "W_o"), grads, want):
        assert_matches(f"the gradient with respect to {name}", gr, w, context="of the last output, squared and summed")


# ---------------------------------------------------------------- generate
def _plain_step(x_new, cache, mha):
    """A correct cached step, not marked as the reference (the generate mistakes use it)."""
    q, k, v = _project(x_new, mha)
    T_new = x_new.shape[1]
    K, V = cache.append(k, v)
    mask = _offset_mask(T_new, K.shape[-2] - T_new, x_new.dtype) if T_new > 1 else None
    out, w = _attend(q, K, V, mask)
    return mha.W_o(_merge(out)), w


def _gen_new_cache_each_step(mha, prompt, n_new):
    seq, x_new = prompt, prompt
    for _ in range(n_new):
        out, _ = _plain_step(x_new, _RefCache(), mha)
        x_new = out[:, -1:]
        seq = torch.cat([seq, x_new], dim=1)
    return seq


def _gen_first_row(mha, prompt, n_new):
    cache, seq, x_new = _RefCache(), prompt, prompt
    for _ in range(n_new):
        out, _ = _plain_step(x_new, cache, mha)
        x_new = out[:, :1]
        seq = torch.cat([seq, x_new], dim=1)
    return seq


def _gen_whole_sequence_each_step(mha, prompt, n_new):
    cache, seq = _RefCache(), prompt
    for _ in range(n_new):
        out, _ = _plain_step(seq, cache, mha)
        seq = torch.cat([seq, out[:, -1:]], dim=1)
    return seq


def _gen_uncached(mha, prompt, n_new):
    return _ref_generate.__wrapped__(mha, prompt, n_new, use_cache=False)


GENERATE_MISTAKES = (
    Mistake("new cache every step",
            "create the KVCache once, before the loop: a fresh cache forgets every earlier token.",
            _gen_new_cache_each_step),
    Mistake("first position fed back",
            "the next input is the output at the last position, out[:, -1:], not out[:, :1].", _gen_first_row),
    Mistake("whole sequence fed at every step",
            "after the prompt, pass only the newest vector (B, 1, d_model): everything before it is in the cache.",
            _gen_whole_sequence_each_step),
    Mistake("recomputing everything",
            "use a KVCache and cached_attention_step: run the prompt through once, then one new vector per step.",
            _gen_uncached),
)


def _gen_run(fn, mha, prompt, n_new, guarded, rows=None):
    """(sequence, multiply-adds: ``MatmulWork``) of ``fn(mha, prompt, n_new)``; ``rows``: a dict
    that gets the rows the layers projected (for the student's printout: the work decides)."""
    counted = MatmulWork()
    with counting_rows(mha) as counts, counted:
        if guarded:
            (seq,) = call_answer(fn, (mha, prompt, n_new), names=("sequence",), forbidden=GENERATE_FORBIDDEN)
        else:
            seq = fn(mha, prompt.clone(), n_new)
    if rows is not None:
        rows.update(counts)
    return seq, counted.work


def _check_generate_case(generate, B, T_p, n_new, d_model, n_heads, dtype, seed, verbose=False):
    mha = seeded_mha(d_model, n_heads, seed, dtype)
    g = torch.Generator().manual_seed(2000 + seed)
    prompt = torch.randn(B, T_p, d_model, generator=g, dtype=dtype)
    rows = {}
    seq, work = _gen_run(generate, mha, prompt, n_new, guarded=True, rows=rows)
    with torch.no_grad():
        want = _ref_generate.__wrapped__(mha, prompt, n_new, use_cache=False)
    label = f"(B={B}, prompt of {T_p}, n_new={n_new}, d_model={d_model}, n_heads={n_heads}, {str(dtype).replace('torch.', '')})"
    cached_work, uncached_work = (generation_work(B, T_p, n_new, d_model, c) for c in (True, False))

    def check():
        if tuple(seq.shape) != (B, T_p + n_new, d_model):
            raise AssertionError(
                f"The sequence {label} has shape {tuple(seq.shape)}; expected {(B, T_p + n_new, d_model)}: "
                "the prompt followed by the n_new generated vectors."
            )
        assert_matches("the prompt part of the sequence", seq[:, :T_p], prompt, context=label)
        assert_matches("the generated vectors", seq[:, T_p:], want[:, T_p:], context=label + ", against generation without a cache")
        # One spare step (feeding the last vector too) is tolerated; re-projecting the prefix is not.
        if reprojects(work, B, T_p, n_new, d_model):
            raise AssertionError(
                f"Generation {label} did {work:,} multiply-adds in its matrix products; with a cache it needs "
                f"about {cached_work:,} (the prompt projected once, then one new row per step). Without a cache "
                f"it would be about {uncached_work:,}: yours re-projects the prefix."
            )

    try:
        check()
    except AssertionError as err:
        found = []
        with torch.no_grad():
            right = _gen_run(lambda m, p, n: _ref_generate.__wrapped__(m, p, n), mha, prompt, n_new, False)
            for m in GENERATE_MISTAKES:
                try:
                    res = _gen_run(m.fn, mha, prompt, n_new, False)
                except Exception:
                    continue
                same = reprojects(res[1], B, T_p, n_new, d_model) == reprojects(work, B, T_p, n_new, d_model) \
                    and close(seq, res[0], *tolerance(dtype))
                differs = (reprojects(res[1], B, T_p, n_new, d_model) != reprojects(right[1], B, T_p, n_new, d_model)
                           or not close(res[0], right[0], *tolerance(dtype)))
                if same and differs:
                    found.append(m)
        if found:
            lines = "\n".join(f"  - {m.label}: {m.hint}" for m in found)
            raise AssertionError(f"{err}\nYour answer matches a typical mistake:\n{lines}") from None
        raise
    if verbose:
        diff = (seq.detach() - want).abs().max().item()
        print(f"generate {label}: max |difference| from generation without a cache = {fmt(diff)}")
        print(f"keys projected per sequence: {rows['W_k'] // B} with your cache, "
              f"{sum(range(T_p, T_p + n_new))} without one.")
        print(f"multiply-adds in matrix products: {work:,} by yours, {cached_work:,} with a cache, "
              f"{uncached_work:,} without one.")


def check_generate(generate, full=True):
    """A prompt of 3 vectors extended by 4, against generation without a cache,
    with the work counted. The full check adds lengths, batch sizes, widths and float32."""
    _check_generate_case(generate, 2, 3, 4, 8, 2, torch.float64, 0, verbose=True)
    if not full:
        return
    for seed, (B, T_p, n_new, d_model, H) in enumerate(
        [(1, 1, 1, 4, 1), (1, 1, 8, 8, 2), (3, 5, 6, 12, 3), (2, 2, 10, 16, 4)], start=1
    ):
        for dtype in (torch.float32, torch.float64):
            _check_generate_case(generate, B, T_p, n_new, d_model, H, dtype, seed)


wrap_checks(globals())  # student-facing failures: the student's own line first, their frames only
