"""modern_block: the answers the generic harness (test_declarations.py) runs besides the declaration's
own mistakes, per piece: unusual correct answers (RMSNorm through torch.rsqrt or a vector norm;
SwiGLU through one fused gate-and-up matrix or silu spelled out; grouped-query attention through
repeat_interleave, expand + reshape, or an einsum over groups without repeating; each module with
its layers registered in another order), which must pass everywhere, and wrong answers that no
mistake names (structure, calls to what the answer must not use, broken outputs), each with the
test cells it fails in the notebook (its visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from course import as_student_code
from firstprinciples import reference

PIECES = True

RMS_STRUCTURE, RMS_VALUES = "test_rmsnorm_structure", "test_rmsnorm_values"
SW_STRUCTURE, SW_VALUES = "test_swiglu_structure", "test_swiglu_values"
GQA_STRUCTURE, GQA_VALUES, GQA_MASKS = "test_gqa_structure", "test_gqa_values", "test_gqa_masks"
RMS_ALL = {RMS_STRUCTURE, RMS_VALUES}
SW_ALL = {SW_STRUCTURE, SW_VALUES}
GQA_ALL = {GQA_STRUCTURE, GQA_VALUES, GQA_MASKS}
GQA_NUMBERS = {GQA_VALUES, GQA_MASKS}


# ================================================================ RMSNorm
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


class RMSScalesItsWeight(GoodRMS):
    """Right outputs, but forward rescales self.weight in place (and back): the weight is touched."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(1.0)
            self.weight.add_(1e-3)
        return super().forward(x)


class RMSDetached(GoodRMS):
    def forward(self, x):
        return super().forward(x).detach()


class RMSFloat32(GoodRMS):
    def forward(self, x):
        return super().forward(x).float()


RMS_CORRECT = {"rsqrt": GoodRMS, "vector norm": NormRMS, "reference written out": as_student_code(reference.RMSNorm)}
RMS_WRONG = {
    "weight initialised to zeros": (RMSZeros, RMS_ALL, RMS_ALL),
    "no weight": (RMSNoWeight, RMS_ALL, RMS_ALL),
    "weight a buffer, not a parameter": (RMSBuffer, RMS_ALL, RMS_ALL),
    "an extra bias": (RMSWithBias, {RMS_STRUCTURE}, {RMS_STRUCTURE}),
    "one scalar weight": (RMSScalarWeight, RMS_ALL, RMS_ALL),
    "calls F.rms_norm": (RMSCallsTorch, RMS_ALL, RMS_ALL),
    "calls nn.RMSNorm": (RMSCallsTorchModule, RMS_ALL, RMS_ALL),
    "subclasses the reference": (RMSCallsReference, RMS_ALL, RMS_ALL),
    "modifies its input": (RMSInPlace, {RMS_VALUES}, {RMS_VALUES}),
    "changes its weight": (RMSScalesItsWeight, {RMS_VALUES}, {RMS_VALUES}),
    "detached": (RMSDetached, set(), {RMS_VALUES}),
    "casts to float32": (RMSFloat32, {RMS_VALUES}, {RMS_VALUES}),
}


# ================================================================ SwiGLU
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


class ReorderedSwiGLU(GoodSwiGLU):
    """The layers registered in another order (W2 first), with setattr in a loop."""

    def __init__(self, d_model, d_hidden):
        nn.Module.__init__(self)
        for name, (n_in, n_out) in (("W2", (d_hidden, d_model)), ("W3", (d_model, d_hidden)),
                                    ("W1", (d_model, d_hidden))):
            setattr(self, name, nn.Linear(n_in, n_out, bias=False))


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


class SwiGLUDetached(GoodSwiGLU):
    def forward(self, x):
        return super().forward(x).detach()


class SwiGLUNumpy(GoodSwiGLU):
    def forward(self, x):
        return super().forward(x).detach().numpy()


class SwiGLUConv(GoodSwiGLU):
    """W2 a 1x1 convolution: the same numbers, not an nn.Linear."""

    def __init__(self, d_model, d_hidden):
        super().__init__(d_model, d_hidden)
        self.W2 = nn.Conv1d(d_hidden, d_model, 1, bias=False)

    def forward(self, x):
        h = F.silu(self.W1(x)) * self.W3(x)
        return self.W2(h.unsqueeze(-1)).squeeze(-1) if h.dim() == 2 else F.linear(h, self.W2.weight[..., 0])


SW_CORRECT = {"silu spelled out": GoodSwiGLU, "fused gate and up": FusedSwiGLU,
              "layers registered in another order": ReorderedSwiGLU,
              "reference written out": as_student_code(reference.SwiGLU)}
SW_WRONG = {
    "Linear layers with biases": (SwiGLUBiases, SW_ALL, SW_ALL),
    "W1 and W3 one shared layer": (SwiGLUShared, SW_ALL, SW_ALL),
    "hidden width 4 d_model": (SwiGLUWrongWidth, SW_ALL, SW_ALL),
    "subclasses the reference": (SwiGLUCallsReference, SW_ALL, SW_ALL),
    "builds the course's FeedForward": (SwiGLUCallsFeedForward, SW_ALL, SW_ALL),
    "detached": (SwiGLUDetached, set(), {SW_VALUES}),
    "returns numpy": (SwiGLUNumpy, {SW_VALUES}, {SW_VALUES}),
    "W2 a convolution": (SwiGLUConv, SW_ALL, SW_ALL),
}


# ================================================================ GroupedQueryAttention
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

    def forward(self, x, mask=None):
        B, T, d = x.shape
        Q = self.heads(self.W_q(x), self.n_heads)
        K = self.share(self.heads(self.W_k(x), self.n_kv_heads))
        V = self.share(self.heads(self.W_v(x), self.n_kv_heads))
        s = Q @ K.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            s = s + mask
        w = torch.softmax(s, dim=-1)
        return self.W_o((w @ V).transpose(1, 2).reshape(B, T, d)), w


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


class ModuleDictGQA(GoodGQA):
    """The four layers also kept in an nn.ModuleDict registered first (the same layers, shared)."""

    def __init__(self, d_model, n_heads, n_kv_heads):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.d_k = n_heads, n_kv_heads, d_model // n_heads
        kv = n_kv_heads * self.d_k
        self.layers = nn.ModuleDict({"q": nn.Linear(d_model, d_model, bias=False), "k": nn.Linear(d_model, kv, bias=False),
                                     "v": nn.Linear(d_model, kv, bias=False), "o": nn.Linear(d_model, d_model, bias=False)})
        self.W_q, self.W_k, self.W_v, self.W_o = (self.layers[n] for n in "qkvo")


class NotRepeated(GoodGQA):  # a shape error unless n_kv_heads is 1 or n_heads
    def share(self, K):
        return K


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


class GQADetached(GoodGQA):
    def forward(self, x, mask=None):
        return tuple(t.detach() for t in super().forward(x, mask))


class GQANumpy(GoodGQA):
    def forward(self, x, mask=None):
        return tuple(t.detach().numpy() for t in super().forward(x, mask))


class GQAFloat32(GoodGQA):
    def forward(self, x, mask=None):
        return tuple(t.float() for t in super().forward(x, mask))


class GQAOutputOnly(GoodGQA):
    def forward(self, x, mask=None):
        return super().forward(x, mask)[0]


class GQASwapped(GoodGQA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return w, out


class GQAMaskInPlace(GoodGQA):
    """Adds the mask to the scores, then adds 1 to the mask in place (the caller's mask changed)."""

    def forward(self, x, mask=None):
        out = super().forward(x, mask)
        if mask is not None:
            mask.add_(1.0)
        return out


GQA_CORRECT = {"repeat_interleave": GoodGQA, "expand and reshape": ExpandGQA, "einsum over groups": GroupedEinsumGQA,
               "layers also in a ModuleDict": ModuleDictGQA,
               "reference written out": as_student_code(reference.GroupedQueryAttention)}
GQA_WRONG = {
    "key/value heads not repeated": (NotRepeated, GQA_NUMBERS, GQA_NUMBERS),
    "W_k and W_v sized d_model": (KFullWidth, GQA_ALL, GQA_ALL),
    "W_q with a bias": (WithBiases, GQA_ALL, GQA_ALL),
    "calls F.scaled_dot_product_attention": (CallsTorchAttention, GQA_ALL, GQA_ALL),
    "builds the course's MultiHeadAttention": (CallsReferenceMHA, GQA_ALL, GQA_ALL),
    "subclasses the reference": (CallsReference, GQA_ALL, GQA_ALL),
    "detached": (GQADetached, set(), {GQA_VALUES}),
    "returns numpy": (GQANumpy, GQA_NUMBERS, GQA_NUMBERS),
    "casts to float32": (GQAFloat32, GQA_NUMBERS, GQA_NUMBERS),
    "returns the output only": (GQAOutputOnly, GQA_NUMBERS, GQA_NUMBERS),
    "returns (weights, output)": (GQASwapped, GQA_NUMBERS, GQA_NUMBERS),
    "changes the mask in place": (GQAMaskInPlace, {GQA_MASKS}, {GQA_MASKS}),
}

CORRECT = {"RMSNorm": RMS_CORRECT, "SwiGLU": SW_CORRECT, "GroupedQueryAttention": GQA_CORRECT}
WRONG = {"RMSNorm": RMS_WRONG, "SwiGLU": SW_WRONG, "GroupedQueryAttention": GQA_WRONG}
