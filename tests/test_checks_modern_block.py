"""Every check of the modern block accepts right answers and rejects typical wrong ones.

Three pieces, each with its table: correct answers written here in other ways than the reference
(RMSNorm through torch.rsqrt or a norm; SwiGLU through one fused gate-and-up matrix or F.silu spelled
out; grouped-query attention through repeat_interleave, expand + reshape, or an einsum over groups
without repeating), and wrong answers: the package's named mistakes, structure mistakes and calls to
what the answer must not use. Each variant fails exactly the checks its entry names; every check
rejects at least five. The references are validated against torch's own modules.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from checktable import (OUTPUT_BREAKS, correct_answers_test, expectations_test, messages_by_piece_test,
                        naming_by_piece_test, outputs_variant, rejections_by_piece_test, variants_by_piece_test)
from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import modern_block as C


# ====================================================================== RMSNorm
class GoodRMS(nn.Module):
    """torch.rsqrt of the mean square."""

    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def normalise(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self.weight * self.normalise(x)


class NormRMS(GoodRMS):
    """The RMS from a vector norm: ||x|| / sqrt(d)."""

    def normalise(self, x):
        ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True) ** 2 / x.shape[-1]
        return x / (ms + self.eps).sqrt()


def rms_variant(name, normalise):
    return type(name, (GoodRMS,), {"normalise": lambda self, x: normalise(x, self.eps)})


def _rms_mistake_class(m):
    """The class of a named mistake: its function with the weight and eps of the module."""
    if m.label == "eps argument ignored":
        return type("EpsFixed", (GoodRMS,), {"normalise": lambda self, x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                                          + 1e-6)})

    def forward(self, x):
        return m.fn(x, self.weight, self.eps)

    return type("Mistake", (GoodRMS,), {"forward": forward})


class RMSZeros(GoodRMS):
    def __init__(self, d_model, eps=1e-6):
        super().__init__(d_model, eps)
        self.weight = nn.Parameter(torch.zeros(d_model))


class RMSNoWeight(nn.Module):
    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RMSBuffer(GoodRMS):
    def __init__(self, d_model, eps=1e-6):
        nn.Module.__init__(self)
        self.eps = eps
        self.register_buffer("weight", torch.ones(d_model))


class RMSWithBias(GoodRMS):
    def __init__(self, d_model, eps=1e-6):
        super().__init__(d_model, eps)
        self.bias = nn.Parameter(torch.zeros(d_model))

    def forward(self, x):
        return super().forward(x) + self.bias


class RMSScalarWeight(GoodRMS):
    def __init__(self, d_model, eps=1e-6):
        super().__init__(d_model, eps)
        self.weight = nn.Parameter(torch.ones(1))


class RMSCallsTorch(GoodRMS):
    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class RMSCallsTorchModule(GoodRMS):
    def forward(self, x):
        norm = nn.RMSNorm(x.shape[-1], eps=self.eps).to(x.dtype)
        with torch.no_grad():
            norm.weight.copy_(self.weight)
        return norm(x)


class RMSCallsReference(reference.RMSNorm):
    pass


class RMSInPlace(GoodRMS):
    def forward(self, x):
        x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return x * self.weight


RMSDetached = type("RMSDetached", (GoodRMS,), {"forward": lambda self, x: GoodRMS.forward(self, x).detach()})
RMSFloat32 = type("RMSFloat32", (GoodRMS,), {"forward": lambda self, x: GoodRMS.forward(self, x).float()})

RMS_CHECKS = {
    "structure": C.check_rmsnorm_structure,
    "values": C.check_rmsnorm_values,
    "values_visible": functools.partial(C.check_rmsnorm_values, full=False),
}
RMS_ALL = set(RMS_CHECKS)
RMS_VALUES = {"values", "values_visible"}
RMS_MISTAKE_FAILS = {
    "mean subtracted (LayerNorm)": RMS_VALUES,
    "eps outside the sqrt": RMS_VALUES,
    "mean over the wrong dimension": RMS_VALUES,
    "sum instead of mean": RMS_VALUES,
    "no square root": RMS_VALUES,
    "weight not applied": RMS_VALUES,
    "weight added": RMS_VALUES,
    "divided by the standard deviation": RMS_VALUES,
    "eps argument ignored": RMS_VALUES,
}
RMS_CORRECT = {"rsqrt": GoodRMS, "vector norm": NormRMS, "reference written out": as_student_code(reference.RMSNorm)}
RMS_VARIANTS = {m.label: (_rms_mistake_class(m), RMS_MISTAKE_FAILS[m.label]) for m in C.RMS_MISTAKES}
RMS_VARIANTS.update({
    "weight initialised to zeros": (RMSZeros, RMS_ALL),
    "no weight": (RMSNoWeight, RMS_ALL),
    "weight a buffer, not a parameter": (RMSBuffer, RMS_ALL),
    "an extra bias": (RMSWithBias, {"structure"}),
    "one scalar weight": (RMSScalarWeight, RMS_ALL),
    "calls F.rms_norm": (RMSCallsTorch, RMS_ALL),
    "calls nn.RMSNorm": (RMSCallsTorchModule, RMS_ALL),
    "subclasses the reference": (RMSCallsReference, RMS_ALL),
    "modifies its input": (RMSInPlace, RMS_VALUES),
    "detached": (RMSDetached, {"values"}),
    "casts to float32": (RMSFloat32, RMS_VALUES),
})


# ====================================================================== SwiGLU
class GoodSwiGLU(nn.Module):
    """F.silu spelled out as z * sigmoid(z)."""

    def __init__(self, d_model, d_hidden):
        super().__init__()
        self.W1 = nn.Linear(d_model, d_hidden, bias=False)
        self.W3 = nn.Linear(d_model, d_hidden, bias=False)
        self.W2 = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x):
        gate = self.W1(x)
        return self.W2(gate * torch.sigmoid(gate) * self.W3(x))


class FusedSwiGLU(GoodSwiGLU):
    """One matrix product for the gate and the up projection, split afterwards."""

    def forward(self, x):
        both = x @ torch.cat([self.W1.weight, self.W3.weight]).T  # (..., 2 d_hidden)
        gate, up = both.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.W2.weight)


def _sw_mistake_class(m):
    def forward(self, x):
        return m.fn(x, self.W1.weight, self.W3.weight, self.W2.weight)

    return type("Mistake", (GoodSwiGLU,), {"forward": forward})


class SwiGLUBiases(GoodSwiGLU):
    def __init__(self, d_model, d_hidden):
        nn.Module.__init__(self)
        self.W1 = nn.Linear(d_model, d_hidden)
        self.W3 = nn.Linear(d_model, d_hidden)
        self.W2 = nn.Linear(d_hidden, d_model)


class SwiGLUShared(GoodSwiGLU):
    def __init__(self, d_model, d_hidden):
        super().__init__(d_model, d_hidden)
        self.W3 = self.W1


class SwiGLUWrongWidth(GoodSwiGLU):
    def __init__(self, d_model, d_hidden):
        super().__init__(d_model, 4 * d_model)


class SwiGLUCallsReference(reference.SwiGLU):
    pass


class SwiGLUCallsFeedForward(GoodSwiGLU):
    def forward(self, x):
        reference.FeedForward(x.shape[-1])
        return super().forward(x)


SwiGLUDetached = type("SwiGLUDetached", (GoodSwiGLU,), {"forward": lambda self, x: GoodSwiGLU.forward(self, x).detach()})
SwiGLUNumpy = type("SwiGLUNumpy", (GoodSwiGLU,), {"forward": lambda self, x: GoodSwiGLU.forward(self, x).detach().numpy()})

SW_CHECKS = {
    "structure": C.check_swiglu_structure,
    "values": C.check_swiglu_values,
    "values_visible": functools.partial(C.check_swiglu_values, full=False),
}
SW_ALL = set(SW_CHECKS)
SW_VALUES = {"values", "values_visible"}
SW_MISTAKE_FAILS = {m.label: SW_VALUES for m in C.SWIGLU_MISTAKES}
SW_CORRECT = {"silu spelled out": GoodSwiGLU, "fused gate and up": FusedSwiGLU,
              "reference written out": as_student_code(reference.SwiGLU)}
SW_VARIANTS = {m.label: (_sw_mistake_class(m), SW_VALUES) for m in C.SWIGLU_MISTAKES}
SW_VARIANTS.update({
    "Linear layers with biases": (SwiGLUBiases, SW_ALL),
    "W1 and W3 one shared layer": (SwiGLUShared, {"structure"} | SW_VALUES),
    "hidden width 4 d_model": (SwiGLUWrongWidth, SW_ALL),
    "subclasses the reference": (SwiGLUCallsReference, SW_ALL),
    "builds the course's FeedForward": (SwiGLUCallsFeedForward, SW_ALL),
    "detached": (SwiGLUDetached, {"values"}),
    "returns numpy": (SwiGLUNumpy, SW_VALUES),
})


# ====================================================================== GroupedQueryAttention
class GoodGQA(nn.Module):
    """repeat_interleave of the key/value heads; the variants below override one step each."""

    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.d_k = n_heads, n_kv_heads, d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
        self.W_v = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def heads(self, t, n):
        B, T, _ = t.shape
        return t.view(B, T, n, self.d_k).transpose(1, 2)  # (B, n, T, d_k)

    def share(self, K):
        return K.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, T, d_k)

    def scores(self, Q, K):
        return Q @ K.transpose(-2, -1) / math.sqrt(self.d_k)

    def normalise(self, s):
        return torch.softmax(s, dim=-1)

    def forward(self, x, mask=None):
        B, T, d = x.shape
        Q = self.heads(self.W_q(x), self.n_heads)
        K = self.share(self.heads(self.W_k(x), self.n_kv_heads))
        V = self.share(self.heads(self.W_v(x), self.n_kv_heads))
        s = self.scores(Q, K)
        if mask is not None:
            s = s + mask
        w = self.normalise(s)
        return self.project_out((w @ V).transpose(1, 2).reshape(B, T, d)), w

    def project_out(self, t):
        return self.W_o(t)


class ExpandGQA(GoodGQA):
    """expand + reshape instead of repeat_interleave."""

    def share(self, K):
        B, n, T, d_k = K.shape
        g = self.n_heads // n
        return K[:, :, None].expand(B, n, g, T, d_k).reshape(B, n * g, T, d_k)


class GroupedEinsumGQA(GoodGQA):
    """No copy of the keys: the query heads are grouped, (B, H_kv, group, T, d_k), and an einsum does the rest."""

    def forward(self, x, mask=None):
        B, T, d = x.shape
        n, g = self.n_kv_heads, self.n_heads // self.n_kv_heads
        Q = self.heads(self.W_q(x), self.n_heads).reshape(B, n, g, T, self.d_k)
        K, V = self.heads(self.W_k(x), n), self.heads(self.W_v(x), n)  # (B, n, T, d_k)
        s = torch.einsum("bngqd,bnkd->bngqk", Q, K) / math.sqrt(self.d_k)
        s = s.reshape(B, self.n_heads, T, T)
        if mask is not None:
            s = s + mask
        w = torch.softmax(s, dim=-1)
        out = torch.einsum("bngqk,bnkd->bngqd", w.reshape(B, n, g, T, T), V).reshape(B, self.n_heads, T, self.d_k)
        return self.W_o(out.transpose(1, 2).reshape(B, T, d)), w


class TiledHeads(GoodGQA):  # head h reads kv head h % n_kv_heads
    def share(self, K):
        return K.repeat(1, self.n_heads // self.n_kv_heads, 1, 1)


class NotRepeated(GoodGQA):  # a shape error unless n_kv_heads is 1 or n_heads
    def share(self, K):
        return K


class NoScaling(GoodGQA):
    def scores(self, Q, K):
        return Q @ K.transpose(-2, -1)


class SqrtDModel(GoodGQA):
    def scores(self, Q, K):
        return Q @ K.transpose(-2, -1) / math.sqrt(self.W_q.in_features)


class MaskIgnored(GoodGQA):
    def forward(self, x, mask=None):
        return super().forward(x)


class SoftmaxOverQueries(GoodGQA):
    def normalise(self, s):
        return torch.softmax(s, dim=-2)


class NoWo(GoodGQA):
    def project_out(self, t):
        return t


class WeightsAveraged(GoodGQA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out, w.mean(dim=1)


class KFullWidth(GoodGQA):
    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__(d_model, n_heads, n_heads)  # W_k, W_v sized d_model: plain multi-head attention
        self.n_kv_heads = n_heads


class WithBiases(GoodGQA):
    def __init__(self, d_model, n_heads, n_kv_heads):
        super().__init__(d_model, n_heads, n_kv_heads)
        self.W_q = nn.Linear(d_model, d_model)


class CallsTorchAttention(GoodGQA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        B, T, d = x.shape
        Q = self.heads(self.W_q(x), self.n_heads)
        K, V = self.heads(self.W_k(x), self.n_kv_heads), self.heads(self.W_v(x), self.n_kv_heads)
        o = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, enable_gqa=True)
        return self.W_o(o.transpose(1, 2).reshape(B, T, d)), w


class CallsReferenceMHA(GoodGQA):
    def forward(self, x, mask=None):
        reference.MultiHeadAttention(x.shape[-1], self.n_heads)
        return super().forward(x, mask)


class CallsReference(reference.GroupedQueryAttention):
    pass


GQADetached, GQANumpy, GQAFloat32 = (outputs_variant(GoodGQA, n, t) for n, t in OUTPUT_BREAKS.items())


class GQAOutputOnly(GoodGQA):
    def forward(self, x, mask=None):
        return super().forward(x, mask)[0]


GQA_CHECKS = {
    "structure": C.check_gqa_structure,
    "values": C.check_gqa_values,
    "values_visible": functools.partial(C.check_gqa_values, full=False),
    "masks": C.check_gqa_masks,
    "masks_visible": functools.partial(C.check_gqa_masks, full=False),
}
GQA_ALL = set(GQA_CHECKS)
GQA_VALUES = GQA_ALL - {"structure"}
GQA_MISTAKE_CLASSES = {
    "query head h reads key/value head h % n_kv_heads": (TiledHeads, GQA_VALUES),
    "scores not scaled": (NoScaling, GQA_VALUES),
    "scaled by sqrt(d_model)": (SqrtDModel, GQA_VALUES),
    "mask ignored": (MaskIgnored, {"masks", "masks_visible"}),
    "softmax over the wrong dimension": (SoftmaxOverQueries, GQA_VALUES),
    "W_o forgotten": (NoWo, GQA_VALUES),
    "weights averaged over heads": (WeightsAveraged, GQA_VALUES),
}
GQA_CORRECT = {"repeat_interleave": GoodGQA, "expand and reshape": ExpandGQA, "einsum over groups": GroupedEinsumGQA}
GQA_VARIANTS = dict(GQA_MISTAKE_CLASSES)
GQA_VARIANTS.update({
    "key/value heads not repeated": (NotRepeated, GQA_VALUES),
    "W_k and W_v sized d_model": (KFullWidth, GQA_ALL),
    "W_q with a bias": (WithBiases, GQA_ALL),
    "calls F.scaled_dot_product_attention": (CallsTorchAttention, GQA_ALL),
    "builds the course's MultiHeadAttention": (CallsReferenceMHA, GQA_ALL),
    "subclasses the reference": (CallsReference, GQA_ALL),
    "detached": (GQADetached, {"values"}),
    "returns numpy": (GQANumpy, GQA_VALUES),
    "casts to float32": (GQAFloat32, GQA_VALUES),
    "returns the output only": (GQAOutputOnly, GQA_VALUES),
})


# ====================================================================== the tables' tests
CHECKS_OF = {"RMSNorm": RMS_CHECKS, "SwiGLU": SW_CHECKS, "GroupedQueryAttention": GQA_CHECKS}
CORRECT = {"RMSNorm": RMS_CORRECT, "SwiGLU": SW_CORRECT, "GroupedQueryAttention": GQA_CORRECT}
VARIANTS = {**{("RMSNorm", k): v for k, v in RMS_VARIANTS.items()},
            **{("SwiGLU", k): v for k, v in SW_VARIANTS.items()},
            **{("GroupedQueryAttention", k): v for k, v in GQA_VARIANTS.items()}}

test_every_mistake_has_an_expectation = expectations_test(
    (RMS_MISTAKE_FAILS, C.RMS_MISTAKES), (SW_MISTAKE_FAILS, C.SWIGLU_MISTAKES), (GQA_MISTAKE_CLASSES, C.GQA_MISTAKES))
test_rmsnorm_correct_answers_pass = correct_answers_test(RMS_CHECKS, RMS_CORRECT)
test_swiglu_correct_answers_pass = correct_answers_test(SW_CHECKS, SW_CORRECT)
test_gqa_correct_answers_pass = correct_answers_test(GQA_CHECKS, GQA_CORRECT)
test_variant_fails_exactly_the_expected_checks = variants_by_piece_test(CHECKS_OF, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_by_piece_test(CHECKS_OF, VARIANTS)
test_failure_names_the_mistake = naming_by_piece_test(
    CHECKS_OF, VARIANTS,
    [("RMSNorm", m.label, "values_visible") for m in C.RMS_MISTAKES]
    + [("SwiGLU", m.label, "values_visible") for m in C.SWIGLU_MISTAKES]
    + [("GroupedQueryAttention", label, "masks_visible" if label == "mask ignored" else "values")
       for label in GQA_MISTAKE_CLASSES])
test_messages = messages_by_piece_test(CHECKS_OF, VARIANTS, [
    ("RMSNorm", "weight initialised to zeros", "structure", ["should start as ones"]),
    ("RMSNorm", "calls F.rms_norm", "values_visible", ["rms_norm", "scores 0"]),
    ("RMSNorm", "eps outside the sqrt", "values_visible", ["worked example", "eps outside the sqrt"]),
    ("SwiGLU", "Linear layers with biases", "structure", ["no bias"]),
    ("GroupedQueryAttention", "W_k and W_v sized d_model", "structure", ["n_kv_heads * d_k"]),
    ("GroupedQueryAttention", "key/value heads not repeated", "values_visible", ["The size of tensor a"]),
    ("GroupedQueryAttention", "calls F.scaled_dot_product_attention", "structure", ["scores 0"]),
])


def test_mistake_functions_match_their_classes():
    """Each named GQA mistake's function computes what the class of the same label does."""
    g = torch.Generator().manual_seed(0)
    mats = C.random_gqa_weights(g, 16, 4, 2, torch.float64)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    mask = reference.causal_mask(5, torch.float64)
    for m in C.GQA_MISTAKES:
        module = GQA_MISTAKE_CLASSES[m.label][0](16, 4, 2).double()
        C.load_gqa_weights(module, mats)
        for got, want in zip(module(x, mask), m.fn(x, *mats, 4, 2, mask)):
            torch.testing.assert_close(got, want, msg=m.label)


# ====================================================================== the references against torch
def test_reference_rmsnorm_equals_torch():
    g = torch.Generator().manual_seed(1)
    for eps in (1e-6, 0.3):
        ours = reference.RMSNorm(12, eps).double()
        theirs = nn.RMSNorm(12, eps=eps).double()
        with torch.no_grad():
            ours.weight.copy_(torch.randn(12, generator=g))
            theirs.weight.copy_(ours.weight)
        x = torch.randn(3, 4, 12, generator=g, dtype=torch.float64)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_reference_gqa_equals_torch_and_mha(n_kv):
    g = torch.Generator().manual_seed(2)
    mats = C.random_gqa_weights(g, 16, 4, n_kv, torch.float64)
    x = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
    mask = reference.causal_mask(6, torch.float64)
    module = reference.GroupedQueryAttention(16, 4, n_kv).double()
    C.load_gqa_weights(module, mats)
    out, w = module(x, mask)
    torch.testing.assert_close(out, C._torch_gqa(x, mats, 4, n_kv, mask), atol=1e-12, rtol=0)
    if n_kv == 4:
        m_out, m_w = C._course_mha(x, mats, 4, mask)
        torch.testing.assert_close(out, m_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(w, m_w, atol=1e-12, rtol=0)


def test_parameter_counts():
    assert sum(p.numel() for p in reference.GroupedQueryAttention(128, 8, 2).parameters()) == C.gqa_parameter_count(128, 8, 2)
    assert C.gqa_parameter_count(128, 8, 8) == 4 * 128**2
    assert sum(p.numel() for p in reference.SwiGLU(16, 40).parameters()) == 3 * 16 * 40
