"""Every multi-head check accepts right answers and rejects typical wrong ones.

Right answers: an independent implementation written here (einsum, unflatten /
flatten), and the seed's own ``MultiHeadAttention`` (with the seed's attention
function). Wrong answers: the package's named mistakes and others that cannot be
named (calls a built-in or the reference, biases, detached, numpy, in-place,
...). The tables say exactly which checks each variant must fail; every check
must reject at least five variants.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import multihead as M
from checktable import (
    OUTPUT_BREAKS,
    assert_names_the_mistake,
    assert_passes,
    assert_rejected_by_enough,
    messages_test,
    expectations_test,
    naming_test_for,
    outcome,
    outputs_variant,
    rejections_test,
    variants_test,
)
from seeds import seed_namespace


# ====================================================================== split_heads / merge_heads
def good_split(x, n_heads):
    return x.unflatten(-1, (n_heads, x.shape[-1] // n_heads)).permute(0, 2, 1, 3)  # (B, H, T, d_k)


def good_merge(x):
    return x.permute(0, 2, 1, 3).flatten(2)  # (B, T, H * d_k)


SPLIT_CHECKS = {
    "split": M.check_split_heads,
    "split_visible": functools.partial(M.check_split_heads, full=False),
}
MERGE_CHECKS = {
    "merge": M.check_merge_heads,
    "merge_visible": functools.partial(M.check_merge_heads, full=False),
}


def split_calls_reference(x, n_heads):
    return reference.split_heads(x, n_heads)


def split_detached(x, n_heads):
    return good_split(x.detach(), n_heads)


def split_numpy(x, n_heads):
    return good_split(x, n_heads).detach().numpy()


def split_in_place(x, n_heads):
    x.mul_(2)
    return good_split(x / 2, n_heads)


def split_float32(x, n_heads):
    return good_split(x, n_heads).float()


def split_hard_coded(x, n_heads):
    return torch.tensor([[[[0.0, 1.0], [6.0, 7.0]], [[2.0, 3.0], [8.0, 9.0]], [[4.0, 5.0], [10.0, 11.0]]]], dtype=x.dtype)


def split_list_of_heads(x, n_heads):
    return list(good_split(x, n_heads).unbind(1))


ALL_SPLIT = set(SPLIT_CHECKS)
SPLIT_MISTAKE_FAILS = {
    "transpose forgotten": ALL_SPLIT,
    "reshaped straight to (B, n_heads, T, d_k)": ALL_SPLIT,
    "d_k and n_heads in the wrong order": ALL_SPLIT,
    "n_heads and d_k swapped": ALL_SPLIT,
}
SPLIT_VARIANTS = {m.label: (m.fn, SPLIT_MISTAKE_FAILS[m.label]) for m in M.SPLIT_MISTAKES}
SPLIT_VARIANTS.update({
    "calls the reference": (split_calls_reference, ALL_SPLIT),
    "detached": (split_detached, {"split"}),
    "returns numpy": (split_numpy, ALL_SPLIT),
    "modifies its input": (split_in_place, ALL_SPLIT),
    "casts to float32": (split_float32, ALL_SPLIT),
    "hard-coded worked example": (split_hard_coded, ALL_SPLIT),
    "returns a list of heads": (split_list_of_heads, ALL_SPLIT),
})


def merge_calls_reference(x):
    return reference.merge_heads(x)


def merge_with_view(x):
    B, H, T, d_k = x.shape
    return x.transpose(1, 2).view(B, T, H * d_k)  # fails: a transposed tensor cannot be viewed


def merge_detached(x):
    return good_merge(x.detach())


def merge_numpy(x):
    return good_merge(x).detach().numpy()


def merge_in_place(x):
    x.add_(1)
    return good_merge(x - 1)


def merge_float32(x):
    return good_merge(x).float()


def merge_cat_of_heads(x):
    return torch.cat(list(x.unbind(1)), dim=-1)  # a correct alternative


ALL_MERGE = set(MERGE_CHECKS)
MERGE_MISTAKE_FAILS = {
    "merged without transposing back": ALL_MERGE,
    "heads interleaved": ALL_MERGE,
    "heads not flattened": ALL_MERGE,
    "heads added instead of concatenated": ALL_MERGE,
}
MERGE_VARIANTS = {m.label: (m.fn, MERGE_MISTAKE_FAILS[m.label]) for m in M.MERGE_MISTAKES}
MERGE_VARIANTS.update({
    "calls the reference": (merge_calls_reference, ALL_MERGE),
    ".view on a transposed tensor": (merge_with_view, ALL_MERGE),
    "detached": (merge_detached, {"merge"}),
    "returns numpy": (merge_numpy, ALL_MERGE),
    "modifies its input": (merge_in_place, ALL_MERGE),
    "casts to float32": (merge_float32, ALL_MERGE),
})


test_every_split_and_merge_mistake_has_an_expectation = expectations_test(
    (SPLIT_MISTAKE_FAILS, M.SPLIT_MISTAKES), (MERGE_MISTAKE_FAILS, M.MERGE_MISTAKES)
)


@pytest.mark.parametrize("name", sorted(SPLIT_CHECKS))
def test_split_checks_accept_correct_answers(name):
    for answer in (good_split, as_student_code(reference.split_heads)):
        assert_passes(SPLIT_CHECKS[name], answer, f"a correct split_heads fails {name}")


@pytest.mark.parametrize("name", sorted(MERGE_CHECKS))
def test_merge_checks_accept_correct_answers(name):
    for answer in (good_merge, merge_cat_of_heads, as_student_code(reference.merge_heads)):
        assert_passes(MERGE_CHECKS[name], answer, f"a correct merge_heads fails {name}")


test_split_variant_fails_exactly_the_expected_checks = variants_test(SPLIT_CHECKS, SPLIT_VARIANTS)
test_merge_variant_fails_exactly_the_expected_checks = variants_test(MERGE_CHECKS, MERGE_VARIANTS)


@pytest.mark.parametrize("checks, variants", [(SPLIT_CHECKS, SPLIT_VARIANTS), (MERGE_CHECKS, MERGE_VARIANTS)])
def test_each_split_and_merge_check_rejects_at_least_five_variants(checks, variants):
    for name in checks:
        assert_rejected_by_enough(name, variants)


test_split_failure_names_the_mistake = naming_test_for(
    M.check_split_heads, SPLIT_VARIANTS, [m.label for m in M.SPLIT_MISTAKES]
)
test_merge_failure_names_the_mistake = naming_test_for(
    M.check_merge_heads, MERGE_VARIANTS, [m.label for m in M.MERGE_MISTAKES]
)


def test_split_worked_example_message_points_at_the_entry():
    ok, err = outcome(M.check_split_heads, SPLIT_VARIANTS["reshaped straight to (B, n_heads, T, d_k)"][0])
    assert "split_heads(x, 3)[" in str(err) and "worked example" in str(err), str(err)


def test_merge_with_view_gets_the_contiguous_hint():
    ok, err = outcome(M.check_merge_heads, merge_with_view)
    assert ".reshape" in str(err) and ".contiguous()" in str(err), str(err)


# ====================================================================== MultiHeadAttention
class GoodMHA(nn.Module):
    """An independent correct answer; the variants below override one step each."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def split(self, t):
        return good_split(t, self.n_heads)

    def merge(self, t):
        return good_merge(t)

    def attend(self, Q, K, V, mask):
        s = torch.einsum("bhqd,bhkd->bhqk", Q, K) / math.sqrt(Q.shape[-1])
        if mask is not None:
            s = s + mask
        w = s.softmax(dim=-1)
        return torch.einsum("bhqk,bhkd->bhqd", w, V), w

    def project_out(self, t):
        return self.W_o(t)

    def forward(self, x, mask=None):
        Q, K, V = self.split(self.W_q(x)), self.split(self.W_k(x)), self.split(self.W_v(x))
        out, w = self.attend(Q, K, V, mask)
        return self.project_out(self.merge(out)), w


def variant(name, **methods):
    return type(name, (GoodMHA,), methods)


def _attend_scaled(scale_of):
    def attend(self, Q, K, V, mask):
        s = Q @ K.transpose(-2, -1) / scale_of(self, Q)
        if mask is not None:
            s = s + mask
        w = torch.softmax(s, dim=-1)
        return w @ V, w

    return attend


NoTransposeSplit = variant(
    "NoTransposeSplit",
    split=lambda self, t: t.view(t.shape[0], self.n_heads, t.shape[1], -1),
    merge=lambda self, t: t.reshape(t.shape[0], t.shape[2], -1),
)
WrongOrderSplit = variant(
    "WrongOrderSplit",
    split=lambda self, t: t.view(*t.shape[:2], -1, self.n_heads).permute(0, 3, 1, 2),
    merge=lambda self, t: t.permute(0, 2, 3, 1).reshape(t.shape[0], t.shape[2], -1),
)
MergeNoTranspose = variant("MergeNoTranspose", merge=lambda self, t: t.reshape(t.shape[0], t.shape[2], -1))
NoWo = variant("NoWo", project_out=lambda self, t: t)
SqrtDModel = variant("SqrtDModel", attend=_attend_scaled(lambda self, Q: math.sqrt(self.W_q.in_features)))
NoScaling = variant("NoScaling", attend=_attend_scaled(lambda self, Q: 1.0))


class MaskIgnored(GoodMHA):
    def forward(self, x, mask=None):
        return super().forward(x)


class WeightsAveraged(GoodMHA):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out, w.mean(dim=1)


class QKSwapped(GoodMHA):
    def forward(self, x, mask=None):
        Q, K, V = self.split(self.W_k(x)), self.split(self.W_q(x)), self.split(self.W_v(x))
        out, w = self.attend(Q, K, V, mask)
        return self.W_o(self.merge(out)), w


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
            average_attn_weights=False,
        )
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
    "CallsReferenceAttention", attend=lambda self, Q, K, V, mask: reference.scaled_dot_product_attention(Q, K, V, mask)
)


class WithBiases(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        for name in M.PROJECTIONS:
            setattr(self, name, nn.Linear(d_model, d_model))


class ExtraTemperature(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.temperature = nn.Parameter(torch.ones(()))  # an extra, unasked-for parameter


class SharedProjection(GoodMHA):
    def __init__(self, d_model, n_heads):
        super().__init__(d_model, n_heads)
        self.W_k = self.W_q


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


Detached, ReturnsNumpy, CastsToFloat32 = (
    outputs_variant(GoodMHA, name, transform) for name, transform in OUTPUT_BREAKS.items()
)


class ModifiesInput(GoodMHA):
    def forward(self, x, mask=None):
        x.mul_(1.5)
        return super().forward(x / 1.5, mask)


class OutputOnly(GoodMHA):
    def forward(self, x, mask=None):
        return super().forward(x, mask)[0]


MergeWithView = variant(
    "MergeWithView", merge=lambda self, t: t.transpose(1, 2).view(t.shape[0], t.shape[2], -1)
)


class StudentMHA(nn.Module):
    """Written out as a student writes it (one forward, the usual names), for the variants below."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)


class DotTIn4D(StudentMHA):
    def forward(self, x, mask=None):
        Q, K, V = (good_split(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        scores = Q @ K.T / math.sqrt(Q.shape[-1])  # K is (B, H, T, d_k): .T reverses all four
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        return self.W_o(good_merge(weights @ V)), weights


class IfMask(StudentMHA):
    def forward(self, x, mask=None):
        Q, K, V = (good_split(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
        if mask:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        return self.W_o(good_merge(weights @ V)), weights


_attention = as_student_code(reference.scaled_dot_product_attention)  # (the student's own, as a cell has it)


class WeightsFirst(StudentMHA):
    def forward(self, x, mask=None):
        Q, K, V = (good_split(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        out, weights = _attention(Q, K, V, mask)
        return weights, self.W_o(good_merge(out))


class ViewAfterTranspose(StudentMHA):
    def forward(self, x, mask=None):
        B, T, d_model = x.shape
        Q, K, V = (good_split(W(x), self.n_heads) for W in (self.W_q, self.W_k, self.W_v))
        out, weights = _attention(Q, K, V, mask)
        out = out.transpose(1, 2).view(B, T, d_model)
        return self.W_o(out), weights


class NoSuperInit(StudentMHA):
    def __init__(self, d_model, n_heads):
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)


def _mha_checks():
    return {
        "structure": M.check_mha_structure,
        "reference": M.check_mha_against_reference,
        "reference_visible": functools.partial(M.check_mha_against_reference, full=False),
        "causal": M.check_mha_causal,
        "masks": M.check_mha_masks,
        "grads": M.check_mha_gradients_and_inputs,
        "grads_visible": functools.partial(M.check_mha_gradients_and_inputs, full=False),
    }


MHA_CHECKS = _mha_checks()
ALL = set(MHA_CHECKS)
VALUES = {"reference", "reference_visible", "causal", "masks"}
MASKED = {"causal", "masks"}

MHA_MISTAKE_CLASSES = {
    "heads split without the transpose": (NoTransposeSplit, VALUES),
    "heads cut in the wrong order": (WrongOrderSplit, VALUES),
    "heads merged without transposing back": (MergeNoTranspose, VALUES),
    "W_o forgotten": (NoWo, VALUES | {"grads", "grads_visible"}),
    "scaled by sqrt(d_model)": (SqrtDModel, VALUES),
    "scores not scaled": (NoScaling, VALUES),
    "mask ignored": (MaskIgnored, MASKED),
    "weights averaged over heads": (WeightsAveraged, VALUES),
    "queries and keys swapped": (QKSwapped, VALUES),
}
MHA_VARIANTS = dict(MHA_MISTAKE_CLASSES)
MHA_VARIANTS.update({
    "calls nn.MultiheadAttention": (CallsTorchMHA, ALL),
    "calls F.multi_head_attention_forward": (CallsTorchFunctionalMHA, ALL),
    "calls F.scaled_dot_product_attention": (CallsTorchAttention, ALL),
    "subclasses the reference module": (CallsReferenceModule, ALL),
    "calls the reference split and merge": (CallsReferencePieces, ALL),
    "calls the reference attention": (CallsReferenceAttention, ALL),
    "Linear layers with biases": (WithBiases, {"structure"} | VALUES),
    "an extra parameter": (ExtraTemperature, {"structure"}),
    "one layer shared by W_q and W_k": (SharedProjection, {"structure"} | VALUES),
    "fused qkv layer, no W_q": (FusedQKV, ALL),
    "detached": (Detached, {"grads", "grads_visible"}),
    "returns numpy": (ReturnsNumpy, ALL - {"structure"}),
    "casts to float32": (CastsToFloat32, ALL - {"structure"}),
    "modifies its input": (ModifiesInput, ALL - {"structure"}),
    "returns the output only": (OutputOnly, ALL - {"structure"}),
    ".view after a transpose in merge": (MergeWithView, ALL - {"structure"}),
    "Q @ K.T on (B, H, T, d_k)": (DotTIn4D, ALL - {"structure"}),
    "if mask:": (IfMask, MASKED | {"grads"}),
    "returns (weights, output)": (WeightsFirst, ALL - {"structure"}),
    "view after transpose": (ViewAfterTranspose, ALL - {"structure"}),
    "no super().__init__()": (NoSuperInit, ALL),
})

# The student's bug, the check that must fail on it, and what its message must say.
test_mha_message_names_the_students_line = messages_test(MHA_CHECKS, MHA_VARIANTS, [
    ("Q @ K.T on (B, H, T, d_k)", "reference_visible", [
        "raised by your code at", "in DotTIn4D.forward", "scores = Q @ K.T / math.sqrt(Q.shape[-1])",
        "The size of tensor a", "Shapes on this line: Q (2, 2, 5, 4), K (2, 2, 5, 4)",
        "`K.T` reverses every dimension", "`K.transpose(-2, -1)`"]),
    ("if mask:", "causal", ["in IfMask.forward", "if mask:", "write `if mask is not None:`"]),
    ("returns (weights, output)", "reference_visible", [
        "wrong order: (weights, output) instead of (output, weights)", "output (2, 5, 8)"]),
    ("returns (weights, output)", "grads_visible", ["wrong order: (weights, output)"]),
    ("view after transpose", "reference_visible", [
        "in ViewAfterTranspose.forward", "out = out.transpose(1, 2).view(B, T, d_model)", "use `.reshape(...)`"]),
    ("no super().__init__()", "structure", ["in NoSuperInit.__init__", "self.W_q = nn.Linear",
                                            "must call `super().__init__()`"]),
])


def test_wrong_order_is_not_blamed_on_the_gradients():
    ok, err = outcome(MHA_CHECKS["grads_visible"], WeightsFirst)
    assert "No gradient reaches" not in str(err) and "wrong order" in str(err), str(err)


test_every_mha_mistake_has_a_variant = expectations_test((MHA_MISTAKE_CLASSES, M.MHA_MISTAKES))


@pytest.fixture(scope="module")
def seed_mha():
    return seed_namespace("scaled_dot_product_attention", "MultiHeadAttention")["MultiHeadAttention"]


@pytest.mark.parametrize("name", sorted(MHA_CHECKS))
def test_independent_answer_passes(name):
    assert_passes(MHA_CHECKS[name], GoodMHA, f"a correct MultiHeadAttention fails {name}")


@pytest.mark.parametrize("name", sorted(MHA_CHECKS))
def test_seed_implementation_passes(name, seed_mha):
    assert_passes(MHA_CHECKS[name], seed_mha, f"the seed's MultiHeadAttention fails {name}")


test_mha_variant_fails_exactly_the_expected_checks = variants_test(MHA_CHECKS, MHA_VARIANTS)
test_each_mha_check_rejects_at_least_five_variants = rejections_test(MHA_CHECKS, MHA_VARIANTS)


@pytest.mark.parametrize("label", sorted(MHA_MISTAKE_CLASSES))
def test_mha_failure_names_the_mistake(label):
    cls, fails = MHA_MISTAKE_CLASSES[label]
    check = "reference" if "reference" in fails else "causal"
    assert_names_the_mistake(MHA_CHECKS[check], cls, label)


def test_mistakes_match_their_classes():
    """Each named mistake's function computes what the class of the same name does."""
    g = torch.Generator().manual_seed(0)
    mats = M.random_weights(g, 8, torch.float64)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    mask = reference.causal_mask(5, torch.float64)
    for m in M.MHA_MISTAKES:
        module = MHA_MISTAKE_CLASSES[m.label][0](8, 2).double()
        M.load_mha_weights(module, mats)
        for got, want in zip(module(x, mask), m.fn(x, *mats, 2, mask)):
            torch.testing.assert_close(got, want, msg=m.label)


def test_reference_mha_function_equals_the_reference_module():
    g = torch.Generator().manual_seed(1)
    mats = M.random_weights(g, 12, torch.float64)
    x = torch.randn(3, 4, 12, generator=g, dtype=torch.float64)
    module = reference.MultiHeadAttention(12, 3).double()
    M.load_mha_weights(module, mats)
    for got, want in zip(M.reference_mha(x, *mats, 3), module(x)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_structure_message_gives_the_parameter_count():
    ok, err = outcome(M.check_mha_structure, ExtraTemperature)
    assert "1,025" in str(err) and "1,024" in str(err) and "temperature" in str(err), str(err)


def test_building_does_not_touch_the_global_random_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    M.check_mha_against_reference(GoodMHA, full=False)
    assert torch.equal(torch.rand(3), expected)


def test_forbidden_call_message_is_clear():
    ok, err = outcome(M.check_mha_against_reference, CallsTorchMHA)
    assert "multi_head_attention" in str(err) and "scores 0" in str(err), str(err)


# ====================================================================== the notebook, with the seed pasted in
def test_seed_pasted_into_the_notebook_gets_every_point(tmp_path):
    """The source notebook (hidden tests included) with the seed's attention function and
    MultiHeadAttention pasted into their answer cells, imports and all, passes every test."""
    import nbformat
    from nbgrader.validator import Validator

    from course import SOLUTIONS, with_answer
    from seeds import seed_code

    nb = nbformat.read(SOLUTIONS / "multi_head_attention" / "multi_head_attention.ipynb", as_version=4)
    for name in ("scaled_dot_product_attention", "MultiHeadAttention"):
        nb = with_answer(nb, name, seed_code(name))
    path = tmp_path / "multi_head_attention.ipynb"
    nbformat.write(nb, path)
    results = Validator(ignore_checksums=True).validate(str(path))
    assert not results.get("failed"), "\n\n".join(f["raw_error"][-2000:] for f in results["failed"])
