"""The decoding references (KV cache, cached attention, generation, cross-attention)
agree with PyTorch's own attention and with full recomputation."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from firstprinciples import reference as R

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-8)}
DTYPES = [torch.float32, torch.float64]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def seeded_mha(d_model, n_heads, seed, dtype):
    torch.manual_seed(seed)
    return R.MultiHeadAttention(d_model, n_heads).to(dtype)


def torch_mha_like(mine):
    """nn.MultiheadAttention holding the same weights as the reference MultiHeadAttention."""
    theirs = nn.MultiheadAttention(mine.d_model, mine.n_heads, bias=False, batch_first=True, dtype=mine.W_q.weight.dtype)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([mine.W_q.weight, mine.W_k.weight, mine.W_v.weight]))
        theirs.out_proj.weight.copy_(mine.W_o.weight)
    return theirs


# ---------------------------------------------------------------- KVCache
def test_kv_cache_appends_along_time_and_keeps_the_graph():
    cache = R.KVCache()
    assert len(cache) == 0 and cache.K is None and cache.V is None
    ks = [torch.randn(2, 3, n, 4, generator=gen(n), requires_grad=True) for n in (3, 1, 2)]
    vs = [torch.randn(2, 3, n, 5, generator=gen(10 + n)) for n in (3, 1, 2)]
    for i, (k, v) in enumerate(zip(ks, vs)):
        K, V = cache.append(k, v)
        assert torch.equal(K, torch.cat(ks[: i + 1], dim=2)) and torch.equal(V, torch.cat(vs[: i + 1], dim=2))
        assert K is cache.K and V is cache.V
    assert len(cache) == 6 and cache.K.shape == (2, 3, 6, 4) and cache.V.shape == (2, 3, 6, 5)
    cache.K.sum().backward()
    assert all(torch.equal(k.grad, torch.ones_like(k)) for k in ks)


# ---------------------------------------------------------------- cached attention
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B, d_model, n_heads, chunks",
    [(1, 8, 2, [1] * 6), (2, 16, 4, [4, 1, 1, 1]), (3, 12, 3, [2, 3, 1, 2]), (2, 8, 1, [7])],
)
def test_cached_steps_equal_full_recomputation_and_torch(dtype, B, d_model, n_heads, chunks):
    mha = seeded_mha(d_model, n_heads, sum(chunks), dtype)
    T = sum(chunks)
    x = torch.randn(B, T, d_model, generator=gen(T), dtype=dtype)
    mask = R.causal_mask(T, dtype)
    with torch.no_grad():
        full_out, full_w = mha(x, mask)
        torch_out, torch_w = torch_mha_like(mha)(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
        cache, outs, start = R.KVCache(), [], 0
        for n in chunks:
            out, w = R.cached_attention_step(x[:, start : start + n], cache, mha)
            assert w.shape == (B, n_heads, n, start + n)  # one score row per new token
            assert len(cache) == start + n and cache.K.shape == (B, n_heads, start + n, d_model // n_heads)
            torch.testing.assert_close(w, full_w[:, :, start : start + n, : start + n], **TOL[dtype])
            torch.testing.assert_close(w, torch_w[:, :, start : start + n, : start + n], **TOL[dtype])
            outs.append(out)
            start += n
    cached = torch.cat(outs, dim=1)
    torch.testing.assert_close(cached, full_out, **TOL[dtype])
    torch.testing.assert_close(cached, torch_out, **TOL[dtype])


def test_cached_step_projects_only_the_new_tokens():
    mha = seeded_mha(8, 2, 0, torch.float64)
    rows = []
    mha.W_k.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[1]))
    x = torch.randn(1, 6, 8, generator=gen(1), dtype=torch.float64)
    cache = R.KVCache()
    R.cached_attention_step(x[:, :3], cache, mha)
    for t in range(3, 6):
        R.cached_attention_step(x[:, t : t + 1], cache, mha)
    assert rows == [3, 1, 1, 1]
    assert set(vars(cache)) == {"K", "V"}  # no queries in the cache


def test_gradients_through_the_cache_equal_those_of_full_recomputation():
    mha = seeded_mha(8, 2, 3, torch.float64)
    x = torch.randn(2, 5, 8, generator=gen(4), dtype=torch.float64, requires_grad=True)
    cache = R.KVCache()
    out = torch.cat([R.cached_attention_step(x[:, t : t + 1], cache, mha)[0] for t in range(5)], dim=1)
    g_cached = torch.autograd.grad(out.pow(2).sum(), [x, mha.W_q.weight, mha.W_k.weight])
    full, _ = mha(x, R.causal_mask(5, torch.float64))
    g_full = torch.autograd.grad(full.pow(2).sum(), [x, mha.W_q.weight, mha.W_k.weight])
    for a, b in zip(g_cached, g_full):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


@pytest.mark.parametrize("dtype", DTYPES)
def test_generate_with_and_without_cache_agree(dtype):
    mha = seeded_mha(16, 4, 5, dtype)
    prompt = torch.randn(3, 4, 16, generator=gen(6), dtype=dtype)
    rows = []
    mha.W_k.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[1]))
    with torch.no_grad():
        cached = R.generate(mha, prompt, 9)
        n_cached = sum(rows)
        uncached = R.generate(mha, prompt, 9, use_cache=False)
    assert cached.shape == (3, 13, 16) and torch.equal(cached[:, :4], prompt)
    torch.testing.assert_close(cached, uncached, **TOL[dtype])
    assert n_cached == 4 + 8 and sum(rows) - n_cached == sum(range(4, 13))
    assert torch.equal(R.generate(mha, prompt, 0), prompt)


def test_cached_decoding_through_transformer_blocks():
    torch.manual_seed(0)
    blocks = [R.TransformerBlock(32, 4, dropout=0.0).eval().double() for _ in range(2)]
    x = torch.randn(2, 9, 32, generator=gen(7), dtype=torch.float64)
    with torch.no_grad():
        full = x
        for b in blocks:
            full, _ = b(full, R.causal_mask(9, torch.float64))
        caches = [R.KVCache() for _ in blocks]
        outs = []
        for chunk in (x[:, :4], x[:, 4:5], x[:, 5:7], x[:, 7:8], x[:, 8:9]):
            h = chunk
            for b, c in zip(blocks, caches):
                h = h + R.cached_attention_step(b.ln1(h), c, b.attn)[0]
                h = h + b.ffn(b.ln2(h))
            outs.append(h)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, **TOL[torch.float64])


# ---------------------------------------------------------------- cross-attention
def _cross_case(seed, B, T_q, T_k, d_model, d_ctx, d_k, d_v, dtype):
    g = gen(seed)
    x = torch.randn(B, T_q, d_model, generator=g, dtype=dtype)
    context = torch.randn(B, T_k, d_ctx, generator=g, dtype=dtype)
    W_q = torch.randn(d_model, d_k, generator=g, dtype=dtype) / math.sqrt(d_model)
    W_k = torch.randn(d_ctx, d_k, generator=g, dtype=dtype) / math.sqrt(d_ctx)
    W_v = torch.randn(d_ctx, d_v, generator=g, dtype=dtype) / math.sqrt(d_ctx)
    return x, context, W_q, W_k, W_v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_ctx", [8, 5, 12])  # equal to d_model, narrower, wider
@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention_matches_torch_multihead_attention(dtype, d_ctx, padded):
    B, T_q, T_k, d = 3, 4, 7, 8
    x, context, W_q, W_k, W_v = _cross_case(d_ctx, B, T_q, T_k, d, d_ctx, d, d, dtype)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(d, 1, bias=False, kdim=d_ctx, vdim=d_ctx, batch_first=True, dtype=dtype)
    with torch.no_grad():
        if mha._qkv_same_embed_dim:
            mha.in_proj_weight.copy_(torch.cat([W_q.T, W_k.T, W_v.T]))
        else:
            mha.q_proj_weight.copy_(W_q.T)
            mha.k_proj_weight.copy_(W_k.T)
            mha.v_proj_weight.copy_(W_v.T)
        mha.out_proj.weight.copy_(torch.eye(d, dtype=dtype))
    key_padding = torch.zeros(B, T_k, dtype=torch.bool)
    if padded:
        key_padding[1, 5:] = True  # the second context has two padding positions
        key_padding[2, 6:] = True
    mask = torch.zeros(B, 1, T_k, dtype=dtype).masked_fill(key_padding[:, None, :], float("-inf"))
    out, w = R.cross_attention(x, context, W_q, W_k, W_v, mask if padded else None)
    t_out, t_w = mha(x, context, context, key_padding_mask=key_padding if padded else None, need_weights=True)
    assert out.shape == (B, T_q, d) and w.shape == (B, T_q, T_k)
    torch.testing.assert_close(out, t_out, **TOL[dtype])
    torch.testing.assert_close(w, t_w, **TOL[dtype])
    if padded:
        assert w[1, :, 5:].abs().max() == 0 and w[2, :, 6:].abs().max() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 2, 2, 2), (2, 3, 9, 6, 12, 4, 10), (4, 6, 2, 8, 3, 5, 7)])
def test_cross_attention_matches_torch_sdpa(dtype, shape):
    x, context, W_q, W_k, W_v = _cross_case(sum(shape), *shape, dtype)
    out, w = R.cross_attention(x, context, W_q, W_k, W_v)
    expected = F.scaled_dot_product_attention(x @ W_q, context @ W_k, context @ W_v)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1], dtype=dtype), **TOL[dtype])


def test_cross_attention_rows_are_independent_and_read_the_whole_context():
    x, context, W_q, W_k, W_v = _cross_case(9, 2, 5, 6, 8, 8, 8, 8, torch.float64)
    out, _ = R.cross_attention(x, context, W_q, W_k, W_v)
    x2 = x.clone()
    x2[:, 2] += 1.0
    moved = (R.cross_attention(x2, context, W_q, W_k, W_v)[0] - out).abs().amax(dim=(0, 2))
    assert moved[2] > 1e-3 and torch.cat([moved[:2], moved[3:]]).max() == 0
    c2 = context.clone()
    c2[:, -1] += 1.0
    assert (R.cross_attention(x, c2, W_q, W_k, W_v)[0] - out).abs().amax(dim=(0, 2)).min() > 1e-6
