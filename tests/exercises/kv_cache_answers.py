"""kv_cache: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes, per piece: unusual correct answers (two cache designs, a step on einsum, one built on the
seed's attention, one that multiplies by the layers' weights, generation by hand), which must pass
everywhere, and wrong answers that no mistake names (the course's code or torch's attention called,
detached, NumPy, inputs changed, a cast, the red team's generation without a cache that multiplies by
``layer.weight``), each with the test cells it fails in the notebook and in the trusted re-check."""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from firstprinciples import reference
from firstprinciples.exercises import kv_cache as declared
from seeds import seed_namespace

PIECES = True


# ================================================================ KVCache
class CatCache:
    """The usual design: K and V concatenated along the time axis (written as dim=2)."""

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


class HelperCache:
    """A correct cache with helper methods: ``extend`` (which ``append`` is written on, keeping a count
    that only it sets) and ``keys_and_values``."""

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


class GraderCache(declared.GivenCache):
    """The declaration's own cache (the one the step gets when a notebook's is broken), borrowed."""


CACHE = {declared.CACHE_ID}
CACHE_WRONG = {
    "subclasses the reference": (CallsReferenceCache, CACHE, CACHE),
    "wraps the reference": (WrapsReferenceCache, CACHE, CACHE),
    "detached": (DetachedCache, CACHE, CACHE),
    "modifies its inputs": (ZeroesInputsCache, CACHE, CACHE),
    "returns numpy": (NumpyCache, CACHE, CACHE),
    "casts to float32": (Float32Cache, CACHE, CACHE),
    "K and V swapped": (SwappedCache, CACHE, CACHE),
    "len of an empty cache fails": (EmptyLenFailsCache, CACHE, CACHE),
    "borrows the grader's cache": (GraderCache, CACHE, CACHE),
}


# ================================================================ cached_attention_step
def _chunk_mask(T_new, T_past, dtype):
    i = torch.arange(T_new)[:, None] + T_past  # absolute position of each new query
    j = torch.arange(T_past + T_new)[None, :]
    return torch.zeros(T_new, T_past + T_new, dtype=dtype).masked_fill(j > i, float("-inf"))


def einsum_step(x_new, cache, mha):
    """A correct step written differently from the reference (einsum, an explicit mask every time)."""
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


def weights_by_hand_step(x_new, cache, mha):
    """A correct step that never calls a layer: x_new @ layer.weight.T for each projection."""
    B, T_new, d_model = x_new.shape
    H = mha.n_heads
    T_past = len(cache)
    q, k, v = ((x_new @ layer.weight.T).unflatten(-1, (H, -1)).transpose(1, 2)
               for layer in (mha.W_q, mha.W_k, mha.W_v))
    K, V = cache.append(k, v)
    scores = q @ K.mT * (d_model // H) ** -0.5
    if T_new > 1:
        scores = scores + _chunk_mask(T_new, T_past, x_new.dtype)
    weights = scores.softmax(dim=-1)
    return (weights @ V).transpose(1, 2).flatten(2) @ mha.W_o.weight.T, weights


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
    weights = torch.softmax(q @ K.mT / math.sqrt(d // H) + _chunk_mask(T_new, T_past, x_new.dtype), dim=-1)
    return mha.W_o((weights @ V).transpose(1, 2).reshape(B, T_new, d)), weights


def step_float32(x_new, cache, mha):
    out, w = einsum_step(x_new, cache, mha)
    return out.float(), w.float()


def step_weights_averaged_over_heads(x_new, cache, mha):
    out, w = einsum_step(x_new, cache, mha)
    return out, w.mean(dim=1)


_INPUTS = weakref.WeakKeyDictionary()  # cache -> the inputs seen so far, kept away from the cache


def step_recomputes_elsewhere(x_new, cache, mha):
    """Keeps its inputs outside the cache and projects the whole prefix at every call, multiplying by the
    layers' weights (no layer is called): nothing counts its work; the changing weights see it."""
    xs = _INPUTS[cache] = torch.cat([_INPUTS[cache], x_new], 1) if cache in _INPUTS else x_new
    B, T, d = xs.shape
    T_new, H = x_new.shape[1], mha.n_heads
    K, V = ((xs @ layer.weight.T).view(B, T, H, d // H).transpose(1, 2) for layer in (mha.W_k, mha.W_v))
    cache.K, cache.V = K, V
    q = (x_new @ mha.W_q.weight.T).view(B, T_new, H, d // H).transpose(1, 2)
    weights = torch.softmax(q @ K.mT / math.sqrt(d // H) + _chunk_mask(T_new, T - T_new, x_new.dtype), dim=-1)
    return (weights @ V).transpose(1, 2).reshape(B, T_new, d) @ mha.W_o.weight.T, weights


ONE, PROMPT, GRADS = declared.ONE, declared.PROMPT, declared.GRADS
STEP_ALL = {ONE, PROMPT, GRADS}
STEP_WRONG = {
    "calls the reference": (step_calls_reference, STEP_ALL, STEP_ALL),
    "calls mha itself": (step_calls_mha, STEP_ALL, STEP_ALL),
    "calls torch's attention": (step_calls_torch, STEP_ALL, STEP_ALL),
    "calls the reference attention": (step_calls_reference_attention, STEP_ALL, STEP_ALL),
    "detached keys and values": (step_detached, {GRADS}, {GRADS}),
    "returns the output only": (step_output_only, STEP_ALL, STEP_ALL),
    "returns numpy": (step_numpy, STEP_ALL, STEP_ALL),
    "modifies its input": (step_modifies_input, STEP_ALL, STEP_ALL),
    "casts to float32": (step_float32, {ONE, GRADS}, STEP_ALL),  # (the notebook's prompt cases are float32)
    "weights averaged over heads": (step_weights_averaged_over_heads, {ONE, PROMPT}, {ONE, PROMPT}),
    "re-projects its inputs kept elsewhere, by the weights": (step_recomputes_elsewhere, {ONE, PROMPT}, {ONE, PROMPT}),
}


# ================================================================ generate
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
    """Also feeds the last generated vector (one wasted step): right."""
    cache, seq, x_new = CatCache(), prompt, prompt
    for i in range(n_new + 1):
        out, _ = einsum_step(x_new, cache, mha)
        x_new = out[:, -1:]
        if i < n_new:
            seq = torch.cat([seq, x_new], dim=1)
    return seq


def generate_by_hand(mha, prompt, n_new):
    """Cached generation written out in one function, every product with a layer's weight by hand,
    the keys and values kept in two lists."""
    B, _, d = prompt.shape
    H = mha.n_heads
    keys, values, pieces, x_new = [], [], [prompt], prompt
    for _ in range(n_new):
        T_new = x_new.shape[1]
        q, k, v = ((x_new @ layer.weight.T).view(B, T_new, H, d // H).transpose(1, 2)
                   for layer in (mha.W_q, mha.W_k, mha.W_v))
        keys.append(k)
        values.append(v)
        K, V = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        scores = q @ K.transpose(-2, -1) / math.sqrt(d // H)
        scores = scores + _chunk_mask(T_new, K.shape[2] - T_new, x_new.dtype)
        out = (torch.softmax(scores, dim=-1) @ V).transpose(1, 2).reshape(B, T_new, d) @ mha.W_o.weight.T
        x_new = out[:, -1:]
        pieces.append(x_new)
    return torch.cat(pieces, dim=1)


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
    """The red team's answer (issue 38): no cache, every step recomputes attention over the whole prefix
    with the layers' weights multiplied by hand, so that no hook on the layers counts the projections."""
    seq = prompt
    for _ in range(n_new):
        B, T, d = seq.shape
        H = mha.n_heads
        q, k, v = ((seq @ layer.weight.T).view(B, T, H, d // H).transpose(1, 2)
                   for layer in (mha.W_q, mha.W_k, mha.W_v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // H) + _chunk_mask(T, 0, seq.dtype)
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, d) @ mha.W_o.weight.T
        seq = torch.cat([seq, out[:, -1:]], dim=1)
    return seq


def generate_calls_mha(mha, prompt, n_new):
    """Generation without a cache through the layer itself."""
    seq = prompt
    for _ in range(n_new):
        out, _ = mha(seq, _chunk_mask(seq.shape[1], 0, seq.dtype))
        seq = torch.cat([seq, out[:, -1:]], dim=1)
    return seq


def generate_token_by_token_prompt(mha, prompt, n_new):
    """Feeds the prompt one vector at a time (the notebook asks for one call): with weights that change
    after every step, the prompt's later keys are projected after some have changed."""
    cache = CatCache()
    for t in range(prompt.shape[1]):
        out, _ = einsum_step(prompt[:, t: t + 1], cache, mha)
    seq = prompt
    for i in range(n_new):
        x_new = out[:, -1:]
        seq = torch.cat([seq, x_new], dim=1)
        if i < n_new - 1:
            out, _ = einsum_step(x_new, cache, mha)
    return seq


def generate_with_copied_weights(mha, prompt, n_new):
    """Cached, but with a copy of the layers' weights taken before the loop: it never sees them change."""
    W = {name: getattr(mha, name).weight.detach().clone() for name in ("W_q", "W_k", "W_v", "W_o")}
    B, _, d = prompt.shape
    H = mha.n_heads
    cache, pieces, x_new = CatCache(), [prompt], prompt
    for _ in range(n_new):
        T_new = x_new.shape[1]
        q, k, v = ((x_new @ W[n].T).view(B, T_new, H, d // H).transpose(1, 2) for n in ("W_q", "W_k", "W_v"))
        K, V = cache.append(k, v)
        scores = q @ K.mT / math.sqrt(d // H) + _chunk_mask(T_new, K.shape[2] - T_new, x_new.dtype)
        x_new = ((torch.softmax(scores, dim=-1) @ V).transpose(1, 2).reshape(B, T_new, d) @ W["W_o"].T)[:, -1:]
        pieces.append(x_new)
    return torch.cat(pieces, dim=1)


def generate_with_step_mistake(mistake):
    def generate(mha, prompt, n_new):
        return make_generate(CatCache, mistake)(mha, prompt, n_new)

    return generate


GEN = {declared.GENERATE_ID}
GENERATE_WRONG = {
    "calls the reference": (generate_calls_reference, GEN, GEN),
    "no cache, the layers' weights multiplied by hand": (generate_uncached_by_the_weights, GEN, GEN),
    "no cache, mha called": (generate_calls_mha, GEN, GEN),
    "uses the reference step": (generate_with_reference_step, GEN, GEN),
    "returns the new vectors only": (generate_new_vectors_only, GEN, GEN),
    "returns numpy": (generate_numpy, GEN, GEN),
    "modifies the prompt": (generate_modifies_prompt, GEN, GEN),
    "casts to float32": (generate_float32, GEN, GEN),
    "prompt fed token by token": (generate_token_by_token_prompt, GEN, GEN),
    "a copy of the weights": (generate_with_copied_weights, GEN, GEN),
    "step with a stale query": (generate_with_step_mistake(declared._step_stale_queries), GEN, GEN),
    "step whose cache is not updated": (generate_with_step_mistake(declared._step_not_updated), GEN, GEN),
    "step splitting heads without the transpose": (
        generate_with_step_mistake(declared._step_split_no_transpose), GEN, GEN),
}

CORRECT = {
    "KVCache": {"concatenating cache": CatCache, "list-of-chunks cache": ChunkListCache,
                "cache with helpers": HelperCache},
    "cached_attention_step": {"einsum step": einsum_step, "step on the seed's attention": seed_step,
                              "step multiplying by the weights": weights_by_hand_step},
    "generate": {"generate": correct_generate, "generate with the chunk cache": make_generate(ChunkListCache, seed_step),
                 "generate with a spare step": generate_with_spare_step, "generate by hand": generate_by_hand},
}
WRONG = {"KVCache": CACHE_WRONG, "cached_attention_step": STEP_WRONG, "generate": GENERATE_WRONG}
