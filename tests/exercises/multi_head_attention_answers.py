"""multi_head_attention: the answers the generic harness (test_declarations.py) runs besides the
declaration's own mistakes, per piece: unusual correct answers (the seed's own module among them),
which must pass everywhere, and wrong answers that no mistake names (a built-in or the course's
pieces called, a wrong type, an input changed, a wrong structure), each with the test cells it
fails in the notebook (its visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from course import as_student_code
from exercises import attention_answers as attention
from firstprinciples import reference
from seeds import seed_namespace

PIECES = True


def _lazy_class(factory):
    """A correct module class built on first use (the seeds are read when a test runs it)."""
    made = []

    def answer(*args, **kwargs):
        if not made:
            made.append(factory())
        return made[0](*args, **kwargs)

    return answer


# ================================================================ the recap of attention
RECAP = "test_scaled_dot_product_attention"
ATTENTION_CORRECT = {"reference": attention.correct, "einsum and logsumexp": attention.einsum_logsumexp,
                     "online softmax over the keys": attention.online_softmax_over_keys}
ATTENTION_WRONG = {
    "calls torch's attention": (attention.calls_torch_builtin, {RECAP}, {RECAP}),
    "returns (weights, output)": (attention.returned_in_the_wrong_order, {RECAP}, {RECAP}),
    "returns numpy": (attention.via_numpy, {RECAP}, {RECAP}),
}


# ================================================================ split_heads
SPLIT = "test_split_heads"


def split_unflatten(x, n_heads):
    return x.unflatten(-1, (n_heads, x.shape[-1] // n_heads)).permute(0, 2, 1, 3)  # (B, H, T, d_k)


def split_chunks_stacked(x, n_heads):
    return torch.stack(x.chunk(n_heads, dim=-1), dim=1)


def split_by_slices(x, n_heads):
    d_k = x.shape[-1] // n_heads
    return torch.stack([x[..., h * d_k:(h + 1) * d_k] for h in range(n_heads)], dim=1)


def split_calls_reference(x, n_heads):
    return reference.split_heads(x, n_heads)


def split_detached(x, n_heads):
    return split_unflatten(x.detach(), n_heads)


def split_numpy(x, n_heads):
    return split_unflatten(x, n_heads).detach().numpy()


def split_in_place(x, n_heads):
    x.mul_(2)
    return split_unflatten(x / 2, n_heads)


def split_float32(x, n_heads):
    return split_unflatten(x, n_heads).float()


def split_hard_coded(x, n_heads):
    heads = [[[[0.0, 1.0], [6.0, 7.0]], [[2.0, 3.0], [8.0, 9.0]], [[4.0, 5.0], [10.0, 11.0]]]]  # the worked example
    return torch.tensor(heads, dtype=x.dtype)


def split_list_of_heads(x, n_heads):
    return list(split_unflatten(x, n_heads).unbind(1))


SPLIT_CORRECT = {"reference": as_student_code(reference.split_heads), "unflatten and permute": split_unflatten,
                 "chunks stacked": split_chunks_stacked, "slices stacked": split_by_slices}
SPLIT_WRONG = {
    "calls the reference": (split_calls_reference, {SPLIT}, {SPLIT}),
    # (the notebook's cases have no gradient; the re-check's have)
    "detached": (split_detached, set(), {SPLIT}),
    "returns numpy": (split_numpy, {SPLIT}, {SPLIT}),
    "modifies its input": (split_in_place, {SPLIT}, {SPLIT}),
    "casts to float32": (split_float32, {SPLIT}, {SPLIT}),
    "hard-coded worked example": (split_hard_coded, {SPLIT}, {SPLIT}),
    "returns a list of heads": (split_list_of_heads, {SPLIT}, {SPLIT}),
}


# ================================================================ merge_heads
MERGE = "test_merge_heads"


def merge_flatten(x):
    return x.permute(0, 2, 1, 3).flatten(2)  # (B, T, H * d_k)


def merge_cat_of_heads(x):
    return torch.cat(list(x.unbind(1)), dim=-1)


def merge_einsum_into_zeros(x):
    # each head written into its slice of a new tensor, through a one-hot placement (no reshape)
    B, H, T, d_k = x.shape
    place = torch.eye(H * d_k, dtype=x.dtype).reshape(H, d_k, H * d_k)
    return torch.einsum("bhtk,hkd->btd", x, place)


def merge_calls_reference(x):
    return reference.merge_heads(x)


def merge_with_view(x):
    B, H, T, d_k = x.shape
    return x.transpose(1, 2).view(B, T, H * d_k)  # fails: a transposed tensor cannot be viewed


def merge_detached(x):
    return merge_flatten(x.detach())


def merge_numpy(x):
    return merge_flatten(x).detach().numpy()


def merge_in_place(x):
    x.add_(1)
    return merge_flatten(x - 1)


def merge_float32(x):
    return merge_flatten(x).float()


MERGE_CORRECT = {"reference": as_student_code(reference.merge_heads), "permute and flatten": merge_flatten,
                 "cat of heads": merge_cat_of_heads, "einsum into place": merge_einsum_into_zeros}
MERGE_WRONG = {
    "calls the reference": (merge_calls_reference, {MERGE}, {MERGE}),
    ".view on a transposed tensor": (merge_with_view, {MERGE}, {MERGE}),
    # (the notebook's cases have no gradient; the re-check's have)
    "detached": (merge_detached, set(), {MERGE}),
    "returns numpy": (merge_numpy, {MERGE}, {MERGE}),
    "modifies its input": (merge_in_place, {MERGE}, {MERGE}),
    "casts to float32": (merge_float32, {MERGE}, {MERGE}),
}


# ================================================================ MultiHeadAttention
STRUCTURE, VALUES, MASKS, GRADS = ("test_mha_structure", "test_mha_against_reference", "test_mha_masks",
                                   "test_mha_gradients_and_inputs")
ALL = {STRUCTURE, VALUES, MASKS, GRADS}
RUNS = ALL - {STRUCTURE}  # the tests that call forward and judge what it returns


class GoodMHA(nn.Module):
    """An independent correct answer (einsum, unflatten / flatten); the variants below override one step each."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def split(self, t):
        return split_unflatten(t, self.n_heads)

    def merge(self, t):
        return merge_flatten(t)

    def attend(self, Q, K, V, mask):
        s = torch.einsum("bhqd,bhkd->bhqk", Q, K) / math.sqrt(Q.shape[-1])
        if mask is not None:
            s = s + mask
        w = s.softmax(dim=-1)
        return torch.einsum("bhqk,bhkd->bhqd", w, V), w

    def forward(self, x, mask=None):
        Q, K, V = self.split(self.W_q(x)), self.split(self.W_k(x)), self.split(self.W_v(x))
        out, w = self.attend(Q, K, V, mask)
        return self.W_o(self.merge(out)), w


class HeadByHead(nn.Module):
    """Each head on its own slice of the projected features, in a loop; heads concatenated at the end.
    The layers are made in the order W_o, W_v, W_k, W_q (the parameters are listed by name)."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.W_o = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_q = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        q, k, v = self.W_q(x), self.W_k(x), self.W_v(x)
        outs, weights = [], []
        for h in range(self.n_heads):
            cut = slice(h * self.d_k, (h + 1) * self.d_k)
            s = q[..., cut] @ k[..., cut].transpose(-2, -1) / math.sqrt(self.d_k)  # (B, T, T)
            if mask is not None:
                m = mask if mask.dim() < 4 else mask[:, 0 if mask.shape[1] == 1 else h]  # (this head's part)
                s = s + m
            w = torch.softmax(s, dim=-1)
            outs.append(w @ v[..., cut])
            weights.append(w)
        return self.W_o(torch.cat(outs, dim=-1)), torch.stack(weights, dim=1)


class LayersInAModuleDict(nn.Module):
    """The four projections in one nn.ModuleDict; properties give them their names."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.proj = nn.ModuleDict({key: nn.Linear(d_model, d_model, bias=False) for key in "qkvo"})

    W_q = property(lambda self: self.proj["q"])
    W_k = property(lambda self: self.proj["k"])
    W_v = property(lambda self: self.proj["v"])
    W_o = property(lambda self: self.proj["o"])

    def forward(self, x, mask=None):
        Q, K, V = (split_unflatten(self.proj[key](x), self.n_heads) for key in "qkv")
        out, weights = attention.einsum_logsumexp(Q, K, V, mask)
        return self.proj["o"](merge_flatten(out)), weights


class HeadCountAsProperty(GoodMHA):
    """n_heads a read-only property over a private tuple; d_k computed in __init__ as int(d_model / n_heads)."""

    def __init__(self, d_model, n_heads):
        nn.Module.__init__(self)  # (GoodMHA's __init__ would assign n_heads, which has no setter here)
        self._sizes = (d_model, n_heads)
        self.d_k = int(d_model / n_heads)
        for name in ("W_q", "W_k", "W_v", "W_o"):
            setattr(self, name, nn.Linear(d_model, d_model, bias=False))

    @property
    def n_heads(self):
        return self._sizes[1]


class SizesSetInALoop(GoodMHA):
    """n_heads and d_k set with setattr from a dict; d_k a NumPy integer, which works wherever an int does."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.n_heads, self.d_k
        for name, value in {"n_heads": n_heads, "d_k": np.int64(d_model) // n_heads}.items():
            setattr(self, name, value)


class SizesOnTheClass(GoodMHA):
    """n_heads a class attribute set at init; d_k a 0-d integer tensor kept as a buffer."""

    n_heads = None

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.n_heads, self.d_k
        type(self).n_heads = n_heads
        self.register_buffer("d_k", torch.tensor(d_model // n_heads))


def _seed_mha():
    return seed_namespace("scaled_dot_product_attention", "MultiHeadAttention")["MultiHeadAttention"]


def variant(name, **methods):
    return type(name, (GoodMHA,), methods)


class CallsTorchMHA(GoodMHA):
    def forward(self, x, mask=None):
        mha = nn.MultiheadAttention(x.shape[-1], self.n_heads, bias=False, batch_first=True).to(x.dtype)
        with torch.no_grad():
            mha.in_proj_weight.copy_(torch.cat([self.W_q.weight, self.W_k.weight, self.W_v.weight]))
            mha.out_proj.weight.copy_(self.W_o.weight)
        return mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)


class CallsTorchFunctionalMHA(GoodMHA):
    def forward(self, x, mask=None):
        d = x.shape[-1]
        xt = x.transpose(0, 1)  # (T, B, d_model)
        out, w = F.multi_head_attention_forward(
            xt, xt, xt, d, self.n_heads, torch.cat([self.W_q.weight, self.W_k.weight, self.W_v.weight]), None,
            None, None, False, 0.0, self.W_o.weight, None, attn_mask=mask, need_weights=True,
            average_attn_weights=False)
        return out.transpose(0, 1), w


class CallsTorchAttention(GoodMHA):
    def attend(self, Q, K, V, mask):
        w = GoodMHA.attend(self, Q, K, V, mask)[1]
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask), w


class CallsReferenceModule(reference.MultiHeadAttention):
    pass


CallsReferencePieces = variant(
    "CallsReferencePieces",
    split=lambda self, t: reference.split_heads(t, self.n_heads),
    merge=lambda self, t: reference.merge_heads(t),
)
CallsReferenceAttention = variant(
    "CallsReferenceAttention", attend=lambda self, Q, K, V, mask: reference.scaled_dot_product_attention(Q, K, V, mask))


class WithBiases(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        for name in ("W_q", "W_k", "W_v", "W_o"):
            setattr(self, name, nn.Linear(d_model, d_model))


class ExtraTemperature(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.temperature = nn.Parameter(torch.ones(()))  # an extra, unasked-for parameter


class SharedProjection(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.W_k = self.W_q


class HeadCountAsH(GoodMHA):
    """The head count kept as self.h and no d_k at all (the declared mistake keeps d_k)."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.n_heads, self.d_k
        self.h = n_heads

    def split(self, t):
        return split_unflatten(t, self.h)


class NoDk(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        del self.d_k


class DkAsFloat(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.d_k = d_model / n_heads  # 4.0: view(B, T, H, d_k) refuses it


class HeadsAndWidthSwapped(GoodMHA):
    """n_heads and d_k hold each other's value (forward uses the right one, under another name)."""

    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.heads = n_heads
        self.n_heads, self.d_k = d_model // n_heads, n_heads

    def split(self, t):
        return split_unflatten(t, self.heads)


class FusedQKV(GoodMHA):
    def __init__(self, d_model, n_heads):
        nn.Module.__init__(self)
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        Q, K, V = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        out, w = self.attend(Q, K, V, mask)
        return self.W_o(self.merge(out)), w


class Detached(GoodMHA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out.detach(), w.detach()


class ReturnsNumpy(GoodMHA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out.detach().numpy(), w.detach().numpy()


class CastsToFloat32(GoodMHA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out.float(), w.float()


class ModifiesInput(GoodMHA):
    def forward(self, x, mask=None):
        x.mul_(1.5)
        return super().forward(x / 1.5, mask)


class ModifiesItsWeights(GoodMHA):
    def forward(self, x, mask=None):
        with torch.no_grad():
            self.W_o.weight.mul_(1.0 + 1e-3)  # "learns" a little at every call
        return super().forward(x, mask)


class OutputOnly(GoodMHA):
    def forward(self, x, mask=None):
        return super().forward(x, mask)[0]


MergeWithView = variant("MergeWithView", merge=lambda self, t: t.transpose(1, 2).view(t.shape[0], t.shape[2], -1))


class StudentMHA(nn.Module):
    """Written out as a student writes it (one forward, the usual names), for the variants below."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)


class DotTIn4D(StudentMHA):
    def forward(self, x, mask=None):
        Q, K, V = (split_unflatten(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        scores = Q @ K.T / math.sqrt(Q.shape[-1])  # K is (B, H, T, d_k): .T reverses all four
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        return self.W_o(merge_flatten(weights @ V)), weights


class IfMask(StudentMHA):
    def forward(self, x, mask=None):
        Q, K, V = (split_unflatten(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
        if mask:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        return self.W_o(merge_flatten(weights @ V)), weights


class WeightsFirst(StudentMHA):
    def forward(self, x, mask=None):
        Q, K, V = (split_unflatten(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        out, weights = attention.correct(Q, K, V, mask)
        return weights, self.W_o(merge_flatten(out))


class ViewAfterTranspose(StudentMHA):
    def forward(self, x, mask=None):
        B, T, d_model = x.shape
        Q, K, V = (split_unflatten(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        out, weights = attention.correct(Q, K, V, mask)
        out = out.transpose(1, 2).view(B, T, d_model)
        return self.W_o(out), weights


class NoSuperInit(StudentMHA):
    def __init__(self, d_model, n_heads):
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)


def not_a_module(d_model, n_heads):
    return lambda x, mask=None: (x, None)  # a function, not an nn.Module


MHA_CORRECT = {"reference": as_student_code(reference.MultiHeadAttention), "einsum, unflatten and flatten": GoodMHA,
               "head by head, layers made backwards": HeadByHead, "layers in an nn.ModuleDict": LayersInAModuleDict,
               "n_heads a property, d_k int(d_model / n_heads)": HeadCountAsProperty,
               "n_heads and d_k by setattr, d_k a NumPy integer": SizesSetInALoop,
               "n_heads a class attribute, d_k a 0-d tensor buffer": SizesOnTheClass,
               "the seed's": _lazy_class(_seed_mha)}
MHA_WRONG = {
    "calls nn.MultiheadAttention": (CallsTorchMHA, ALL, ALL),
    "calls F.multi_head_attention_forward": (CallsTorchFunctionalMHA, ALL, ALL),
    "calls F.scaled_dot_product_attention": (CallsTorchAttention, ALL, ALL),
    "subclasses the reference module": (CallsReferenceModule, ALL, ALL),
    "calls the reference split and merge": (CallsReferencePieces, ALL, ALL),
    "calls the reference attention": (CallsReferenceAttention, ALL, ALL),
    # (only the weights are loaded: the biases stay random, honest gradients flow through them)
    "Linear layers with biases": (WithBiases, {STRUCTURE, VALUES, MASKS}, {STRUCTURE, VALUES, MASKS}),
    "an extra parameter": (ExtraTemperature, {STRUCTURE}, {STRUCTURE}),
    # (the contract the KV cache and the capstone rely on; the values are right)
    "head count as self.h, no d_k": (HeadCountAsH, {STRUCTURE}, {STRUCTURE}),
    "no d_k": (NoDk, {STRUCTURE}, {STRUCTURE}),
    "d_k a float": (DkAsFloat, {STRUCTURE}, {STRUCTURE}),
    "n_heads and d_k swapped": (HeadsAndWidthSwapped, {STRUCTURE}, {STRUCTURE}),
    # (W_k's weights are loaded last into the shared layer: queries are keys; and moving W_q and W_k
    # along two directions moves the one layer along one: its gradients do not match its outputs)
    "one layer shared by W_q and W_k": (SharedProjection, ALL, ALL),
    "fused qkv layer, no W_q": (FusedQKV, ALL, ALL),
    "detached": (Detached, {GRADS}, {GRADS}),
    "returns numpy": (ReturnsNumpy, RUNS, RUNS),
    "casts to float32": (CastsToFloat32, RUNS, RUNS),
    "modifies its input": (ModifiesInput, RUNS, RUNS),
    "modifies its own weights": (ModifiesItsWeights, RUNS, RUNS),
    "returns the output only": (OutputOnly, RUNS, RUNS),
    ".view after a transpose in merge": (MergeWithView, RUNS, RUNS),
    "Q @ K.T on (B, H, T, d_k)": (DotTIn4D, RUNS, RUNS),
    # (the notebook's gradient case has no mask; the re-check's have)
    "if mask:": (IfMask, {MASKS}, {MASKS, GRADS}),
    "returns (weights, output)": (WeightsFirst, RUNS, RUNS),
    "view after transpose": (ViewAfterTranspose, RUNS, RUNS),
    "no super().__init__()": (NoSuperInit, ALL, ALL),
    "a function, not a module": (not_a_module, ALL, ALL),
}

CORRECT = {"scaled_dot_product_attention": ATTENTION_CORRECT, "split_heads": SPLIT_CORRECT,
           "merge_heads": MERGE_CORRECT, "MultiHeadAttention": MHA_CORRECT}
WRONG = {"scaled_dot_product_attention": ATTENTION_WRONG, "split_heads": SPLIT_WRONG, "merge_heads": MERGE_WRONG,
         "MultiHeadAttention": MHA_WRONG}
