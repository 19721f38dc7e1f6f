"""Every KV-cache check accepts right answers and rejects typical wrong ones.

Three pieces, each with its own checks: ``KVCache``, ``cached_attention_step``
and ``generate``. Each check runs against independent correct answers (two
cache designs, two steps, one of them built on the seed's attention) and
against a catalogue of buggy variants (the package's named mistakes plus
answers that call the reference or torch's attention, detach, return numpy,
modify their inputs, change dtype, ...), each with the exact set of checks of
its piece that it must fail. Every check must reject at least five variants.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from firstprinciples import reference
from firstprinciples.checks import kv_cache as C
from checktable import (assert_fails_exactly, assert_passes, naming_by_piece_test, outcome, rejections_test,
                        variants_by_piece_test)
from seeds import seed_namespace


# ---------------------------------------------------------------- correct answers
class CatCache:
    """The usual design: K and V concatenated along the time axis."""

    def __init__(self):
        self.K = None
        self.V = None

    def append(self, k, v):
        if self.K is None:
            self.K, self.V = k, v
        else:
            self.K = torch.cat((self.K, k), dim=2)
            self.V = torch.cat((self.V, v), dim=2)
        return self.K, self.V

    def __len__(self):
        return 0 if self.K is None else self.K.shape[2]


class ChunkListCache:
    """Another design: a list of chunks, joined when K or V is read."""

    def __init__(self):
        self.k_chunks, self.v_chunks = [], []

    @property
    def K(self):
        return torch.cat(self.k_chunks, dim=-2) if self.k_chunks else None

    @property
    def V(self):
        return torch.cat(self.v_chunks, dim=-2) if self.v_chunks else None

    def append(self, k, v):
        self.k_chunks.append(k)
        self.v_chunks.append(v)
        return self.K, self.V

    def __len__(self):
        return sum(k.shape[-2] for k in self.k_chunks)


def _chunk_mask(T_new, T_past, dtype):
    i = torch.arange(T_new)[:, None] + T_past  # absolute position of each new query
    j = torch.arange(T_past + T_new)[None, :]
    return torch.zeros(T_new, T_past + T_new, dtype=dtype).masked_fill(j > i, float("-inf"))


def einsum_step(x_new, cache, mha):
    """A correct step written differently from the reference (einsum, explicit mask)."""
    B, T_new, d_model = x_new.shape
    H = mha.n_heads
    d_k = d_model // H
    T_past = len(cache)
    q = mha.W_q(x_new).view(B, T_new, H, d_k)
    k = mha.W_k(x_new).view(B, T_new, H, d_k).permute(0, 2, 1, 3)
    v = mha.W_v(x_new).view(B, T_new, H, d_k).permute(0, 2, 1, 3)
    K, V = cache.append(k, v)  # (B, H, T, d_k)
    scores = torch.einsum("bqhd,bhkd->bhqk", q, K) / math.sqrt(d_k)
    scores = scores + _chunk_mask(T_new, T_past, x_new.dtype)
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bhkd->bqhd", weights, V).reshape(B, T_new, d_model)
    return mha.W_o(out), weights


def seed_step(x_new, cache, mha):
    """A correct step built on the seed's own scaled_dot_product_attention."""
    attention = seed_namespace("scaled_dot_product_attention")["scaled_dot_product_attention"]
    B, T_new, d_model = x_new.shape
    H = mha.n_heads

    def split(t):
        return t.view(B, T_new, H, d_model // H).transpose(1, 2)

    T_past = len(cache)
    K, V = cache.append(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    mask = _chunk_mask(T_new, T_past, x_new.dtype) if T_new > 1 else None
    out, w = attention(split(mha.W_q(x_new)), K, V, mask)
    return mha.W_o(out.transpose(1, 2).reshape(B, T_new, d_model)), w


def make_generate(cache_cls=CatCache, step=einsum_step):
    def generate(mha, prompt, n_new):
        cache, seq, x_new = cache_cls(), prompt, prompt
        for _ in range(n_new):
            out, _ = step(x_new, cache, mha)
            x_new = out[:, -1:]
            seq = torch.cat([seq, x_new], dim=1)
        return seq

    return generate


correct_generate = make_generate()


def generate_with_spare_step(mha, prompt, n_new):
    """Also feeds the last generated vector (one wasted step): tolerated."""
    cache, seq, x_new = CatCache(), prompt, prompt
    for i in range(n_new + 1):
        out, _ = einsum_step(x_new, cache, mha)
        x_new = out[:, -1:]
        if i < n_new:
            seq = torch.cat([seq, x_new], dim=1)
    return seq


def generate_token_by_token_prompt(mha, prompt, n_new):
    """Feeds the prompt one vector at a time: the same work, so it passes."""
    cache = CatCache()
    for t in range(prompt.shape[1]):
        out, _ = einsum_step(prompt[:, t : t + 1], cache, mha)
    seq = prompt
    for i in range(n_new):
        x_new = out[:, -1:]
        seq = torch.cat([seq, x_new], dim=1)
        if i < n_new - 1:
            out, _ = einsum_step(x_new, cache, mha)
    return seq


# ---------------------------------------------------------------- wrong caches
class CallsReferenceCache(reference.KVCache):
    pass


class WrapsReferenceCache:
    def __init__(self):
        self.inner = reference.KVCache()

    @property
    def K(self):
        return self.inner.K

    @property
    def V(self):
        return self.inner.V

    def append(self, k, v):
        return self.inner.append(k, v)

    def __len__(self):
        return len(self.inner)


class DetachedCache(CatCache):
    def append(self, k, v):
        return super().append(k.detach(), v.detach())


class ZeroesInputsCache(CatCache):
    def append(self, k, v):
        K, V = super().append(k.clone(), v.clone())
        k.zero_()  # "frees" the caller's tensor
        v.zero_()
        return K, V


class NumpyCache(CatCache):
    def append(self, k, v):
        K, V = super().append(k, v)
        return K.detach().numpy(), V.detach().numpy()


class Float32Cache(CatCache):
    def append(self, k, v):
        return super().append(k.float(), v.float())


class SwappedCache(CatCache):
    def append(self, k, v):
        K, V = super().append(k, v)
        return V, K


class EmptyLenFailsCache(CatCache):
    def __len__(self):
        return self.K.shape[2]


# ---------------------------------------------------------------- wrong steps
def step_calls_reference(x_new, cache, mha):
    return reference.cached_attention_step(x_new, cache, mha)


def step_calls_mha(x_new, cache, mha):
    T_past = len(cache)
    B, T_new, d = x_new.shape
    H = mha.n_heads
    cache.append(mha.W_k(x_new).view(B, T_new, H, d // H).transpose(1, 2),
                 mha.W_v(x_new).view(B, T_new, H, d // H).transpose(1, 2))
    return mha(x_new, _chunk_mask(T_new, T_past, x_new.dtype)[:, T_past:])


def step_calls_torch(x_new, cache, mha):
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    q = split(mha.W_q(x_new))
    K, V = cache.append(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    mask = _chunk_mask(T_new, T_past, x_new.dtype)
    out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
    w = torch.softmax(q @ K.transpose(-2, -1) / math.sqrt(d // H) + mask, dim=-1)
    return mha.W_o(out.transpose(1, 2).reshape(B, T_new, d)), w


def step_calls_reference_attention(x_new, cache, mha):
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    q = split(mha.W_q(x_new))
    K, V = cache.append(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    out, w = reference.scaled_dot_product_attention(q, K, V, _chunk_mask(T_new, T_past, x_new.dtype))
    return mha.W_o(out.transpose(1, 2).reshape(B, T_new, d)), w


class _DetachingCache:
    """Wraps the cache handed to the step so that what the step appends is detached."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self):
        return len(self.cache)

    def append(self, k, v):
        return self.cache.append(k.detach(), v.detach())


def step_detached(x_new, cache, mha):
    return einsum_step(x_new, _DetachingCache(cache), mha)


def step_output_only(x_new, cache, mha):
    return einsum_step(x_new, cache, mha)[0]


def step_numpy(x_new, cache, mha):
    out, w = einsum_step(x_new, cache, mha)
    return out.detach().numpy(), w.detach().numpy()


def step_modifies_input(x_new, cache, mha):
    x_new *= 2.0  # scaled in place (and undone below, so the values are right)
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    q = split(mha.W_q(x_new) / 2)
    K, V = cache.append(split(mha.W_k(x_new) / 2), split(mha.W_v(x_new) / 2))
    out, w = C._attend(q, K, V, _chunk_mask(T_new, T_past, x_new.dtype))
    return mha.W_o(out.transpose(1, 2).reshape(B, T_new, d)), w


def step_float32(x_new, cache, mha):
    out, w = einsum_step(x_new, cache, mha)
    return out.float(), w.float()


def step_weights_averaged_over_heads(x_new, cache, mha):
    out, w = einsum_step(x_new, cache, mha)
    return out, w.mean(dim=1)


# ---------------------------------------------------------------- wrong generates
def generate_calls_reference(mha, prompt, n_new):
    return reference.generate(mha, prompt, n_new)


def generate_with_reference_step(mha, prompt, n_new):
    return make_generate(reference.KVCache, reference.cached_attention_step)(mha, prompt, n_new)


def generate_new_vectors_only(mha, prompt, n_new):
    return correct_generate(mha, prompt, n_new)[:, prompt.shape[1]:]


def generate_numpy(mha, prompt, n_new):
    return correct_generate(mha, prompt, n_new).detach().numpy()


def generate_modifies_prompt(mha, prompt, n_new):
    seq = correct_generate(mha, prompt.clone(), n_new)
    prompt.zero_()
    return seq


def generate_float32(mha, prompt, n_new):
    return correct_generate(mha.float(), prompt.float(), n_new)


def generate_uncached_by_the_weights(mha, prompt, n_new):
    """No cache: every step recomputes attention over the whole prefix, with the layers' weights
    multiplied by hand (so that no hook on the layers counts the projections)."""
    seq = prompt
    for _ in range(n_new):
        B, T, d = seq.shape
        H = mha.n_heads
        heads = [(seq @ layer.weight.T).view(B, T, H, d // H).transpose(1, 2)
                 for layer in (mha.W_q, mha.W_k, mha.W_v)]
        q, k, v = heads  # (B, H, T, d_k) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // H) + reference.causal_mask(T, seq.dtype)
        out = torch.softmax(scores, dim=-1) @ v
        out = out.transpose(1, 2).reshape(B, T, d) @ mha.W_o.weight.T
        seq = torch.cat([seq, out[:, -1:]], dim=1)
    return seq


def generate_with_step_mistake(mistake):
    def generate(mha, prompt, n_new):
        return make_generate(CatCache, mistake)(mha, prompt, n_new)

    return generate


# ---------------------------------------------------------------- the tables
PIECES = {
    "KVCache": {"cache": C.check_kv_cache, "cache_visible": functools.partial(C.check_kv_cache, full=False),
                "cache_grads": C.check_kv_cache_gradients},
    "cached_attention_step": {
        "one_token": C.check_one_token_at_a_time,
        "prompt": C.check_prompt_then_tokens,
        "step_grads": C.check_step_gradients,
    },
    "generate": {"generate": C.check_generate},
}
CHECKS = {name: check for checks in PIECES.values() for name, check in checks.items()}
PIECE_OF = {name: piece for piece, checks in PIECES.items() for name in checks}

CORRECT = {
    "KVCache": {"concatenating cache": CatCache, "list-of-chunks cache": ChunkListCache},
    "cached_attention_step": {"einsum step": einsum_step, "step on the seed's attention": seed_step},
    "generate": {
        "generate": correct_generate,
        "generate with the chunk cache": make_generate(ChunkListCache, seed_step),
        "generate with a spare step": generate_with_spare_step,
        "generate feeding the prompt token by token": generate_token_by_token_prompt,
    },
}

CACHE_VALUES = {"cache", "cache_visible"}  # the full check and its visible part (the capstone's recap)
CACHE_ALL = CACHE_VALUES | {"cache_grads"}
STEP_ALL = {"one_token", "prompt", "step_grads"}
MISTAKE_FAILS = {
    ("KVCache", "cache not updated"): CACHE_ALL,
    ("KVCache", "overwritten instead of appended"): CACHE_ALL,
    ("KVCache", "appended along the feature dim"): CACHE_ALL,
    ("KVCache", "appended along the head dim"): CACHE_ALL,
    ("KVCache", "new entries prepended"): CACHE_ALL,
    ("KVCache", "len counts appends"): CACHE_VALUES,
    ("cached_attention_step", "cache not updated"): STEP_ALL,
    ("cached_attention_step", "new token left out"): STEP_ALL,
    ("cached_attention_step", "mask hides the cache"): STEP_ALL,
    ("cached_attention_step", "no mask within a chunk"): {"prompt"},
    ("cached_attention_step", "stale queries"): STEP_ALL,
    ("cached_attention_step", "queries cached"): {"one_token", "prompt"},
    ("cached_attention_step", "recomputing everything"): {"one_token", "prompt"},
    ("cached_attention_step", "heads split without the transpose"): {"one_token", "prompt"},
    ("generate", "new cache every step"): {"generate"},
    ("generate", "first position fed back"): {"generate"},
    ("generate", "whole sequence fed at every step"): {"generate"},
    ("generate", "recomputing everything"): {"generate"},
}
MISTAKE_TABLES = {"KVCache": C.CACHE_MISTAKES, "cached_attention_step": C.STEP_MISTAKES, "generate": C.GENERATE_MISTAKES}

OTHER_VARIANTS = {
    # (piece, name): (answer, the checks of that piece it must fail)
    ("KVCache", "subclasses the reference"): (CallsReferenceCache, CACHE_ALL),
    ("KVCache", "wraps the reference"): (WrapsReferenceCache, CACHE_ALL),
    ("KVCache", "detached"): (DetachedCache, {"cache_grads"}),
    ("KVCache", "modifies its inputs"): (ZeroesInputsCache, CACHE_ALL),
    ("KVCache", "returns numpy"): (NumpyCache, CACHE_ALL),
    ("KVCache", "casts to float32"): (Float32Cache, CACHE_VALUES),
    ("KVCache", "K and V swapped"): (SwappedCache, CACHE_VALUES),
    ("KVCache", "len of an empty cache fails"): (EmptyLenFailsCache, CACHE_VALUES),
    ("cached_attention_step", "calls the reference"): (step_calls_reference, STEP_ALL),
    ("cached_attention_step", "calls mha itself"): (step_calls_mha, STEP_ALL),
    ("cached_attention_step", "calls torch's attention"): (step_calls_torch, STEP_ALL),
    ("cached_attention_step", "calls the reference attention"): (step_calls_reference_attention, STEP_ALL),
    ("cached_attention_step", "detached keys and values"): (step_detached, {"step_grads"}),
    ("cached_attention_step", "returns the output only"): (step_output_only, STEP_ALL),
    ("cached_attention_step", "returns numpy"): (step_numpy, STEP_ALL),
    ("cached_attention_step", "modifies its input"): (step_modifies_input, STEP_ALL),
    ("cached_attention_step", "casts to float32"): (step_float32, STEP_ALL),
    ("cached_attention_step", "weights averaged over heads"): (step_weights_averaged_over_heads, {"one_token", "prompt"}),
    ("generate", "calls the reference"): (generate_calls_reference, {"generate"}),
    ("generate", "no cache, the layers' weights multiplied by hand"): (generate_uncached_by_the_weights, {"generate"}),
    ("generate", "uses the reference step"): (generate_with_reference_step, {"generate"}),
    ("generate", "returns the new vectors only"): (generate_new_vectors_only, {"generate"}),
    ("generate", "returns numpy"): (generate_numpy, {"generate"}),
    ("generate", "modifies the prompt"): (generate_modifies_prompt, {"generate"}),
    ("generate", "casts to float32"): (generate_float32, {"generate"}),
    ("generate", "step with a stale query"): (generate_with_step_mistake(C._step_stale_queries), {"generate"}),
    ("generate", "step whose cache is not updated"): (generate_with_step_mistake(C._step_not_updated), {"generate"}),
    ("generate", "step splitting heads without the transpose"): (
        generate_with_step_mistake(C._step_split_no_transpose), {"generate"}),
}

VARIANTS = {
    (piece, m.label): (m.fn, MISTAKE_FAILS[(piece, m.label)]) for piece, table in MISTAKE_TABLES.items() for m in table
}
VARIANTS.update(OTHER_VARIANTS)


def test_every_mistake_has_an_expectation():
    assert set(MISTAKE_FAILS) == {(p, m.label) for p, t in MISTAKE_TABLES.items() for m in t}


CORRECT_CASES = [(piece, name, check) for piece, answers in CORRECT.items() for name in answers for check in PIECES[piece]]


@pytest.mark.parametrize("piece, answer, check", CORRECT_CASES, ids=[f"{a}-{c}" for _, a, c in CORRECT_CASES])
def test_correct_answers_pass(piece, answer, check):
    assert_passes(CHECKS[check], CORRECT[piece][answer], f"{answer} fails {check}")


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_reference_passes(check):
    piece = PIECE_OF[check]
    answer = {"KVCache": CatCache, "cached_attention_step": C._plain_step, "generate": correct_generate}[piece]
    assert_passes(CHECKS[check], answer, check)


test_variant_fails_exactly_the_expected_checks = variants_by_piece_test(PIECES, VARIANTS)
# The check names differ between pieces, so a check's rejections can be counted over all variants.
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)
test_failure_names_the_mistake = naming_by_piece_test(
    PIECES,
    VARIANTS,
    [
        ("KVCache", "cache not updated", "cache"),
        ("KVCache", "appended along the feature dim", "cache"),
        ("KVCache", "appended along the head dim", "cache"),
        ("KVCache", "new entries prepended", "cache"),
        ("KVCache", "len counts appends", "cache"),
        ("cached_attention_step", "cache not updated", "one_token"),
        ("cached_attention_step", "mask hides the cache", "one_token"),
        ("cached_attention_step", "mask hides the cache", "prompt"),
        ("cached_attention_step", "no mask within a chunk", "prompt"),
        ("cached_attention_step", "stale queries", "one_token"),
        ("cached_attention_step", "queries cached", "one_token"),
        ("cached_attention_step", "recomputing everything", "one_token"),
        ("cached_attention_step", "new token left out", "prompt"),
        ("cached_attention_step", "heads split without the transpose", "one_token"),
        ("cached_attention_step", "heads split without the transpose", "prompt"),
        ("generate", "new cache every step", "generate"),
        ("generate", "first position fed back", "generate"),
        ("generate", "recomputing everything", "generate"),
    ],
)


def test_recomputation_is_caught_by_counting_rows_not_by_time():
    # An answer that keeps its inputs somewhere else than the cache and re-projects them
    # still fails on the count of projected rows.
    store = {}

    def recompute_elsewhere(x_new, cache, mha):
        xs = store[id(cache)] = torch.cat([store[id(cache)], x_new], 1) if id(cache) in store else x_new
        B, T, d = xs.shape
        H = mha.n_heads
        K = mha.W_k(xs).view(B, T, H, d // H).transpose(1, 2)
        V = mha.W_v(xs).view(B, T, H, d // H).transpose(1, 2)
        cache.K, cache.V = K, V
        q = mha.W_q(x_new).view(B, x_new.shape[1], H, d // H).transpose(1, 2)
        out, w = C._attend(q, K, V, _chunk_mask(x_new.shape[1], T - x_new.shape[1], x_new.dtype))
        return mha.W_o(out.transpose(1, 2).reshape(B, x_new.shape[1], d)), w

    ok, err = outcome(C.check_one_token_at_a_time, recompute_elsewhere)
    assert not ok and "projected" in str(err) and "recomputing everything" in str(err), str(err)


def test_visible_checks_print_the_difference_and_the_work(capsys):
    C.check_one_token_at_a_time(einsum_step)
    C.check_generate(correct_generate, full=False)
    out = capsys.readouterr().out
    assert "max |difference|" in out and "tolerance 1e-10" in out
    assert "keys projected per sequence: 6 with your cache, 21" in out
    assert "6 with your cache, 18 without one" in out
    assert "multiply-adds in matrix products: 3,840 by yours, 3,840 with a cache, 11,968 without one." in out


def test_forbidden_call_message_is_clear():
    ok, err = outcome(C.check_one_token_at_a_time, step_calls_mha)
    assert "MultiHeadAttention" in str(err) and "scores 0" in str(err)


def test_checks_leave_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    C.check_one_token_at_a_time(einsum_step)
    C.check_generate(correct_generate, full=False)
    assert torch.equal(torch.rand(3), before)


# ---------------------------------------------------------------- the student's own cache, handed to the step
class HelperCache:
    """A correct cache of the student's own with helper methods the course's KVCache lacks:
    ``extend`` (which ``append`` is written on, keeping a count that only it sets) and
    ``keys_and_values``."""

    def __init__(self):
        self.K = None
        self.V = None

    def extend(self, k, v):
        self.K = k if self.K is None else torch.cat([self.K, k], dim=-2)
        self.V = v if self.V is None else torch.cat([self.V, v], dim=-2)
        self.extended = getattr(self, "extended", 0) + 1  # the cache's own state: set by extend only

    def keys_and_values(self):
        return self.K, self.V

    def append(self, k, v):
        self.extend(k, v)
        return self.keys_and_values()

    def __len__(self):
        return 0 if self.K is None else self.K.shape[-2]


def helper_step(x_new, cache, mha):
    """A correct step that uses the helpers of its own cache (and never calls append)."""
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    cache.extend(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    K, V = cache.keys_and_values()
    out, w = C._attend(split(mha.W_q(x_new)), K, V, _chunk_mask(T_new, T_past, x_new.dtype))
    return mha.W_o(out.transpose(1, 2).reshape(B, T_new, d)), w


# The same answer as a notebook holds it: the step and generate find KVCache in their globals.
HONEST_NOTEBOOK = '''
import math
import torch


class KVCache:
    def __init__(self):
        self.K = None
        self.V = None

    def extend(self, k, v):
        self.K = k if self.K is None else torch.cat([self.K, k], dim=-2)
        self.V = v if self.V is None else torch.cat([self.V, v], dim=-2)
        self.extended = getattr(self, "extended", 0) + 1

    def keys_and_values(self):
        return self.K, self.V

    def append(self, k, v):
        self.extend(k, v)
        return self.keys_and_values()

    def __len__(self):
        return 0 if self.K is None else self.K.shape[-2]


def cached_attention_step(x_new, cache, mha):
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    cache.extend(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    K, V = cache.keys_and_values()
    scores = split(mha.W_q(x_new)) @ K.transpose(-2, -1) / math.sqrt(d // H)
    if T_new > 1:
        scores = scores + torch.triu(torch.full((T_new, T_past + T_new), float("-inf"), dtype=x_new.dtype),
                                     diagonal=T_past + 1)
    weights = torch.softmax(scores, dim=-1)
    return mha.W_o((weights @ V).transpose(1, 2).reshape(B, T_new, d)), weights


def generate(mha, prompt, n_new):
    cache, seq, x_new = KVCache(), prompt, prompt
    for _ in range(n_new):
        out, _ = cached_attention_step(x_new, cache, mha)
        x_new = out[:, -1:]
        seq = torch.cat([seq, x_new], dim=1)
    return seq
'''

# A correct step written against the spec only (append, len), for a notebook whose own KVCache is broken.
PLAIN_STEP = '''
import math
import torch


def cached_attention_step(x_new, cache, mha):
    B, T_new, d = x_new.shape
    H = mha.n_heads
    T_past = len(cache)

    def split(t):
        return t.view(B, T_new, H, d // H).transpose(1, 2)

    K, V = cache.append(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
    scores = split(mha.W_q(x_new)) @ K.transpose(-2, -1) / math.sqrt(d // H)
    if T_new > 1:
        scores = scores + torch.triu(torch.full((T_new, T_past + T_new), float("-inf"), dtype=x_new.dtype),
                                     diagonal=T_past + 1)
    weights = torch.softmax(scores, dim=-1)
    return mha.W_o((weights @ V).transpose(1, 2).reshape(B, T_new, d)), weights
'''


def notebook(source=HONEST_NOTEBOOK, **names):
    """A kernel-like namespace: ``names``, then ``source`` run in it (its functions' globals are the namespace)."""
    ns = dict(names)
    exec(compile(source, "notebook", "exec"), ns)
    return ns


class UnansweredCache:
    """The exercise's KVCache before it is answered."""

    def __init__(self):
        raise NotImplementedError()


BROKEN_CACHES = {name: cls for (piece, name), (cls, _) in VARIANTS.items() if piece == "KVCache"}
BROKEN_CACHES["unanswered"] = UnansweredCache
STEP_CHECKS = {name: PIECES["cached_attention_step"][name] for name in STEP_ALL}


@pytest.mark.parametrize("check", sorted(STEP_ALL))
def test_a_step_using_helpers_of_its_own_cache_passes(check):
    """Task: an honest step that calls helper methods of the student's own KVCache scored 4/11, because
    the step checks handed it the course's cache. Given the class, or finding it in the notebook, they pass."""
    fn = STEP_CHECKS[check]
    assert not outcome(fn, helper_step)[0]  # with the course's cache (no KVCache where the step is defined)
    assert_passes(functools.partial(fn, KVCache=HelperCache), helper_step, f"{check} with the class given")
    assert_passes(fn, notebook()["cached_attention_step"], f"{check} with the notebook's KVCache")


def test_the_honest_notebook_scores_full_marks_in_the_kernel():
    """Every test cell of the KV-cache notebook, visible and hidden parts, passes the honest answer: 11/11."""
    import nbformat
    from course import SOLUTIONS

    nb = nbformat.read(SOLUTIONS / "kv_cache/kv_cache.ipynb", as_version=4)
    ns = notebook()
    ns["checks"] = C
    scored, total = 0, 0
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
            total += meta["points"]
            exec(compile(cell.source, meta["grade_id"], "exec"), ns)  # raises if the cell fails
            scored += meta["points"]
    assert (scored, total) == (11, 11)


@pytest.mark.parametrize("broken", sorted(BROKEN_CACHES))
def test_a_broken_cache_of_the_students_leaves_the_step_graded_on_its_own(broken, capsys):
    """When the notebook's own KVCache fails its test, the step checks use the course's cache (and say so):
    a correct step passes them, whatever is wrong with the cache."""
    ns = notebook(PLAIN_STEP, KVCache=BROKEN_CACHES[broken])
    for name, check in STEP_CHECKS.items():
        assert_passes(check, ns["cached_attention_step"], f"{name} with the broken cache '{broken}'")
    assert "Your KVCache fails its own test" in capsys.readouterr().out


def test_the_fallback_is_named_when_the_step_fails():
    """A step that needs the helpers of a broken cache of its own fails, and the message says which cache it had."""

    class BrokenHelperCache(HelperCache):
        def __len__(self):  # len counts nothing: the cache fails its own test
            return 0

    ok, err = outcome(functools.partial(C.check_one_token_at_a_time, KVCache=BrokenHelperCache), helper_step)
    assert not ok and "Your KVCache fails its own test" in str(err) and "len(cache)" in str(err), str(err)
    assert "course's KVCache" in str(err)


OWN_CACHES = {"concatenating cache": CatCache, "cache with helpers": HelperCache}
STEP_VARIANT_CASES = [(name, cache) for (piece, name) in sorted(VARIANTS) if piece == "cached_attention_step"
                      for cache in OWN_CACHES]


@pytest.mark.parametrize("variant, cache", STEP_VARIANT_CASES)
def test_step_variants_fail_exactly_as_before_with_an_own_cache(variant, cache):
    """With the student's own (correct) cache instead of the course's, every wrong step fails exactly the
    checks it fails with the course's: what the step leaves in the cache is still seen (queries, inputs),
    what the cache keeps by itself is not."""
    fn, must_fail = VARIANTS[("cached_attention_step", variant)]
    checks = {name: functools.partial(check, KVCache=OWN_CACHES[cache]) for name, check in STEP_CHECKS.items()}
    assert_fails_exactly(checks, fn, must_fail, f"{variant} with the {cache}")


def test_what_the_cache_keeps_by_itself_is_not_extra_state():
    own = C.step_cache(helper_step, HelperCache)
    assert own.cls is HelperCache and own.note is None and "extended" in own.own
    assert C.step_cache(helper_step) is C.COURSE_CACHE  # nothing named KVCache where helper_step is defined
    assert C.step_cache(reference.cached_attention_step) is C.COURSE_CACHE  # the reference's own module
    assert C.step_cache(helper_step, "not a class") is C.COURSE_CACHE
    fallback = C.step_cache(helper_step, DetachedCache)
    assert fallback.cls is reference.KVCache and "require grad" in fallback.note
