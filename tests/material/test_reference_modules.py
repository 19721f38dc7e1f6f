"""The reference implementations of the later chapters agree with PyTorch's own
modules and with the properties the chapters claim."""
import math

import pytest
import torch
from torch import nn

from firstprinciples import reference as R
from seeds import seed_namespace

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-8)}
DTYPES = [torch.float32, torch.float64]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_matches_torch_and_is_stable(dtype):
    x = torch.randn(3, 4, 5, generator=gen(), dtype=dtype)
    for dim in (0, 1, -1):
        torch.testing.assert_close(R.softmax(x, dim=dim), torch.softmax(x, dim=dim), **TOL[dtype])
    big = torch.tensor([[1000.0, 1001.0, -1000.0]], dtype=dtype)
    assert torch.isfinite(R.softmax(big)).all()
    torch.testing.assert_close(R.softmax(big), torch.softmax(big, -1), **TOL[dtype])
    masked = torch.tensor([[0.5, float("-inf"), 1.0]], dtype=dtype)
    assert R.softmax(masked)[0, 1].item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rnn_matches_torch(dtype):
    B, T, d_in, d_h = 3, 7, 4, 5
    rnn = nn.RNN(d_in, d_h, batch_first=True, nonlinearity="tanh").to(dtype)
    x = torch.randn(B, T, d_in, generator=gen(1), dtype=dtype)
    h0 = torch.randn(B, d_h, generator=gen(2), dtype=dtype)
    expected, _ = rnn(x, h0[None])
    W_xh, W_hh = rnn.weight_ih_l0.detach().T, rnn.weight_hh_l0.detach().T
    b = (rnn.bias_ih_l0 + rnn.bias_hh_l0).detach()
    torch.testing.assert_close(R.rnn_forward(x, h0, W_xh, W_hh, b), expected.detach(), **TOL[dtype])


def test_qkv_and_scores():
    x = torch.randn(2, 5, 8, generator=gen(3), dtype=torch.float64)
    W = [torch.randn(8, d, generator=gen(4 + d), dtype=torch.float64) for d in (4, 4, 6)]
    Q, K, V = R.project_qkv(x, *W)
    assert (Q.shape, K.shape, V.shape) == ((2, 5, 4), (2, 5, 4), (2, 5, 6))
    S = R.dot_product_scores(Q, K)
    torch.testing.assert_close(S, torch.einsum("btd,bsd->bts", Q, K), **TOL[torch.float64])


def test_split_and_merge_heads_are_inverse():
    x = torch.randn(2, 5, 12, generator=gen(5))
    h = R.split_heads(x, 3)
    assert h.shape == (2, 3, 5, 4)
    torch.testing.assert_close(h[:, 1], x[..., 4:8])  # head 1 is columns 4..7
    assert torch.equal(R.merge_heads(h), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True])
def test_multi_head_attention_matches_torch(dtype, masked):
    torch.manual_seed(0)
    d_model, H, B, T = 16, 4, 3, 6
    mine = R.MultiHeadAttention(d_model, H).to(dtype)
    theirs = nn.MultiheadAttention(d_model, H, bias=False, batch_first=True).to(dtype)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(torch.cat([mine.W_q.weight, mine.W_k.weight, mine.W_v.weight]))
        theirs.out_proj.weight.copy_(mine.W_o.weight)
    x = torch.randn(B, T, d_model, generator=gen(6), dtype=dtype)
    mask = R.causal_mask(T, dtype) if masked else None
    out, w = mine(x, mask)
    t_out, t_w = theirs(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, t_out, **TOL[dtype])
    torch.testing.assert_close(w, t_w, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_matches_torch_encoder_layer(dtype):
    torch.manual_seed(1)
    d_model, H = 32, 4
    mine = R.TransformerBlock(d_model, H, dropout=0.0).to(dtype).eval()
    theirs = nn.TransformerEncoderLayer(
        d_model, H, dim_feedforward=4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    ).to(dtype).eval()
    with torch.no_grad():
        a = mine.attn
        theirs.self_attn.in_proj_weight.copy_(torch.cat([a.W_q.weight, a.W_k.weight, a.W_v.weight]))
        theirs.self_attn.in_proj_bias.zero_()
        theirs.self_attn.out_proj.weight.copy_(a.W_o.weight)
        theirs.self_attn.out_proj.bias.zero_()
        theirs.linear1.load_state_dict(mine.ffn.net[0].state_dict())
        theirs.linear2.load_state_dict(mine.ffn.net[2].state_dict())
        theirs.norm1.load_state_dict(mine.ln1.state_dict())
        theirs.norm2.load_state_dict(mine.ln2.state_dict())
    x = torch.randn(2, 7, d_model, generator=gen(7), dtype=dtype)
    mask = R.causal_mask(7, dtype)
    torch.testing.assert_close(mine(x, mask)[0], theirs(x, src_mask=mask), **TOL[dtype])
    torch.testing.assert_close(mine(x)[0], theirs(x), **TOL[dtype])


def test_block_reproduces_the_seed_sanity_check():
    torch.manual_seed(0)
    block = R.TransformerBlock(128, 4)
    assert sum(p.numel() for p in block.parameters()) == 197_760
    x = torch.randn(2, 16, 128) + R.sinusoidal_encoding(16, 128)
    _, w = block(x, R.causal_mask(16))
    assert w.shape == (2, 4, 16, 16)
    assert (w[0, 0, 0, 1:] == 0).all() and torch.triu(w, diagonal=1).abs().max() == 0
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 16), atol=1e-5, rtol=0)


def test_sinusoidal_encoding_matches_the_seed_table():
    ns = seed_namespace("SinusoidalPE")
    table = ns["SinusoidalPE"](64, max_len=50).pe[0]
    torch.testing.assert_close(R.sinusoidal_encoding(50, 64), table, atol=1e-5, rtol=1e-5)
    enc = R.sinusoidal_encoding(10, 8)
    assert enc[0, 0] == 0 and enc[0, 1] == 1  # sin(0), cos(0)
    assert math.isclose(enc[3, 2].item(), math.sin(3 * 10000 ** (-2 / 8)), rel_tol=1e-6)


def test_rope_rotates_interleaved_pairs_and_keeps_relative_scores():
    x = torch.randn(2, 6, 8, generator=gen(8), dtype=torch.float64)
    r = R.apply_rope(x)
    # As complex numbers, pair i at position p is multiplied by exp(i * p * theta_i).
    z = torch.view_as_complex(x.reshape(2, 6, 4, 2).contiguous())
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    rot = torch.polar(torch.ones(6, 4, dtype=torch.float64), torch.arange(6.0, dtype=torch.float64)[:, None] * theta)
    torch.testing.assert_close(r, torch.view_as_real(z * rot).reshape(2, 6, 8), **TOL[torch.float64])
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1), **TOL[torch.float64])
    # q at position m, k at position n: the score depends only on m - n.
    q, k = torch.randn(8, generator=gen(9), dtype=torch.float64), torch.randn(8, generator=gen(10), dtype=torch.float64)
    Q = R.apply_rope(q.expand(12, 8).clone())
    K = R.apply_rope(k.expand(12, 8).clone())
    for offset in (0, 1, 3):
        scores = torch.stack([Q[m] @ K[m - offset] for m in range(offset, 12)])
        torch.testing.assert_close(scores, scores[0].expand_as(scores), **TOL[torch.float64])
