"""The reference implementations agree with PyTorch's own."""
import pytest
import torch
import torch.nn.functional as F

from firstprinciples import examples
from firstprinciples.reference import causal_mask, scaled_dot_product_attention

# Same dtype tolerances as the checks (see firstprinciples.exercises.TOLERANCE).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-8)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "lead, T_q, T_k, d_k, d_v",
    [((), 3, 3, 2, 2), ((4,), 5, 7, 8, 3), ((2, 4), 6, 6, 16, 16), ((2, 2, 2), 1, 9, 4, 5)],
)
@pytest.mark.parametrize("mask_kind", [None, "causal", "bias", "padding"])
def test_attention_matches_torch(dtype, lead, T_q, T_k, d_k, d_v, mask_kind):
    g = torch.Generator().manual_seed(hash((lead, T_q, T_k, d_k)) % 2**31)
    Q = torch.randn(*lead, T_q, d_k, generator=g, dtype=dtype)
    K = torch.randn(*lead, T_k, d_k, generator=g, dtype=dtype)
    V = torch.randn(*lead, T_k, d_v, generator=g, dtype=dtype)
    mask = None
    if mask_kind == "causal" and T_q == T_k:
        mask = causal_mask(T_q, dtype)
    elif mask_kind == "bias":
        mask = torch.randn(T_q, T_k, generator=g, dtype=dtype)
    elif mask_kind == "padding":
        mask = torch.zeros(1, T_k, dtype=dtype)  # the last key is padding for every query
        mask[..., -1] = float("-inf")
    out, w = scaled_dot_product_attention(Q, K, V, mask)
    assert out.shape == (*lead, T_q, d_v) and w.shape == (*lead, T_q, T_k)
    assert out.dtype == dtype and w.dtype == dtype
    torch.testing.assert_close(out, F.scaled_dot_product_attention(Q, K, V, attn_mask=mask), **TOL[dtype])
    torch.testing.assert_close(w.sum(-1), torch.ones(*lead, T_q, dtype=dtype), **TOL[dtype])


def test_worked_example_numbers():
    Q, K, V = examples.cat_sat_mat(torch.float64)
    raw = Q @ K.T
    torch.testing.assert_close(raw[0], torch.tensor(examples.RAW_SCORES, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close((raw / 2**0.5)[0], torch.tensor(examples.SCALED_SCORES, dtype=torch.float64), atol=5e-4, rtol=0)
    out, w = scaled_dot_product_attention(Q, K, V)
    # The source rounds each step to three decimals: its figures are within 1e-3.
    torch.testing.assert_close(w[0], torch.tensor(examples.WEIGHTS, dtype=torch.float64), atol=1e-3, rtol=0)
    torch.testing.assert_close(out[0], torch.tensor(examples.OUTPUT, dtype=torch.float64), atol=1e-3, rtol=0)


def test_causal_mask_matches_the_source_for_T_4():
    inf = float("-inf")
    expected = torch.tensor([[0, inf, inf, inf], [0, 0, inf, inf], [0, 0, 0, inf], [0, 0, 0, 0]])
    assert torch.equal(causal_mask(4), expected)
    assert causal_mask(4).dtype == torch.float32


def test_reference_gradients_match_torch():
    g = torch.Generator().manual_seed(3)
    leaves = [torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    mine = torch.autograd.grad(scaled_dot_product_attention(*leaves)[0].sum(), leaves)
    theirs = torch.autograd.grad(F.scaled_dot_product_attention(*leaves).sum(), leaves)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, **TOL[torch.float64])
