"""Every feed-forward and transformer-block check accepts right answers and rejects wrong ones.

Right answers: an independent implementation written here (F.gelu, F.dropout with
training=self.training, an einsum attention), and the seed's own ``FeedForward``
and ``TransformerBlock`` (with the seed's ``MultiHeadAttention`` and attention
function). Wrong answers: the package's named mistakes and others that cannot be
named (dropout misplaced, calls a built-in or the reference, detached, numpy,
in-place, ...). The tables say exactly which checks each variant must fail;
every check must reject at least five variants.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from firstprinciples import reference
from firstprinciples.checks import block as Bk
from checktable import (
    OUTPUT_BREAKS, assert_passes, expectations_test, naming_test_for, outcome, outputs_variant, rejections_test,
    variants_test,
)
from seeds import seed_namespace


@pytest.fixture(scope="module")
def seed():
    return seed_namespace("scaled_dot_product_attention", "MultiHeadAttention", "FeedForward", "TransformerBlock")


# ====================================================================== independent correct answers
class GoodMHA(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        def split(t):
            return t.unflatten(-1, (self.n_heads, -1)).permute(0, 2, 1, 3)  # (B, H, T, d_k)

        Q, K, V = split(self.W_q(x)), split(self.W_k(x)), split(self.W_v(x))
        s = torch.einsum("bhqd,bhkd->bhqk", Q, K) / math.sqrt(Q.shape[-1])
        if mask is not None:
            s = s + mask
        w = s.softmax(dim=-1)
        out = torch.einsum("bhqk,bhkd->bhqd", w, V).permute(0, 2, 1, 3).flatten(2)  # (B, T, d_model)
        return self.W_o(out), w


class GoodFFN(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class GoodBlock(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = GoodMHA(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = GoodFFN(d_model)
        self.p = dropout

    def drop(self, t):
        return F.dropout(t, self.p, self.training)

    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        x = x + self.drop(self.ffn(self.ln2(x)))
        return x, w


# ====================================================================== FeedForward
FFN_CHECKS = {
    "ffn_structure": Bk.check_ffn_structure,
    "ffn_values": Bk.check_ffn_values,
    "ffn_values_visible": functools.partial(Bk.check_ffn_values, full=False),
    "ffn_grads": Bk.check_ffn_gradients_and_inputs,
}
ALL_FFN = set(FFN_CHECKS)
FFN_VALUES = {"ffn_values", "ffn_values_visible"}


def ffn_variant(name, forward):
    return type(name, (GoodFFN,), {"forward": forward})


class FFNHiddenDModel(GoodFFN):
    def __init__(self, d_model):
        nn.Module.__init__(self)
        self.fc1 = nn.Linear(d_model, d_model)
        self.fc2 = nn.Linear(d_model, d_model)


class FFNNoBias(GoodFFN):
    def __init__(self, d_model):
        nn.Module.__init__(self)
        self.fc1 = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc2 = nn.Linear(4 * d_model, d_model, bias=False)


class FFNExtraScale(GoodFFN):
    def __init__(self, d_model):
        super().__init__(d_model)
        self.scale = nn.Parameter(torch.ones(d_model))


class FFNThreeLayers(GoodFFN):
    def __init__(self, d_model):
        super().__init__(d_model)
        self.fc_mid = nn.Linear(4 * d_model, 4 * d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc_mid(F.gelu(self.fc1(x)))))


class FFNCallsReference(reference.FeedForward):
    pass


class FFNWrapsReference(GoodFFN):
    def forward(self, x):
        ref = reference.FeedForward(x.shape[-1]).to(x.dtype)
        ref.load_state_dict({"net.0.weight": self.fc1.weight, "net.0.bias": self.fc1.bias,
                             "net.2.weight": self.fc2.weight, "net.2.bias": self.fc2.bias})
        return ref(x)


class FFNSequential(nn.Module):
    """A correct alternative: nn.Sequential with nn.GELU."""

    def __init__(self, d_model):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        return self.net(x)


FFN_MISTAKE_CLASSES = {
    "ReLU instead of GELU": (ffn_variant("FFNReLU", lambda self, x: self.fc2(torch.relu(self.fc1(x)))), FFN_VALUES),
    "tanh approximation of GELU": (
        ffn_variant("FFNTanh", lambda self, x: self.fc2(F.gelu(self.fc1(x), approximate="tanh"))), FFN_VALUES,
    ),
    "no activation": (ffn_variant("FFNLinear", lambda self, x: self.fc2(self.fc1(x))), FFN_VALUES),
    "activation after the second layer too": (
        ffn_variant("FFNGeluTwice", lambda self, x: F.gelu(self.fc2(F.gelu(self.fc1(x))))), FFN_VALUES,
    ),
}
FFN_VARIANTS = dict(FFN_MISTAKE_CLASSES)
FFN_VARIANTS.update({
    "hidden size d_model": (FFNHiddenDModel, ALL_FFN),
    "no biases": (FFNNoBias, ALL_FFN),
    "an extra, unused parameter": (FFNExtraScale, {"ffn_structure", "ffn_grads"}),
    "three linear layers": (FFNThreeLayers, ALL_FFN),
    "subclasses the reference": (FFNCallsReference, ALL_FFN),
    "calls the reference": (FFNWrapsReference, ALL_FFN),
    "detached": (ffn_variant("FFNDetached", lambda self, x: GoodFFN.forward(self, x).detach()), {"ffn_grads"}),
    "returns numpy": (ffn_variant("FFNNumpy", lambda self, x: GoodFFN.forward(self, x).detach().numpy()), FFN_VALUES | {"ffn_grads"}),
    "casts to float32": (ffn_variant("FFNFloat", lambda self, x: GoodFFN.forward(self, x).float()), FFN_VALUES | {"ffn_grads"}),
    "modifies its input": (
        ffn_variant("FFNInPlace", lambda self, x: self.fc2(F.gelu(self.fc1(x.add_(0.5) - 0.5)))),
        FFN_VALUES | {"ffn_grads"},
    ),
})


test_every_ffn_mistake_has_a_variant = expectations_test((FFN_MISTAKE_CLASSES, Bk.FFN_MISTAKES))


@pytest.mark.parametrize("name", sorted(FFN_CHECKS))
def test_ffn_checks_accept_correct_answers(name, seed):
    for answer in (GoodFFN, FFNSequential, seed["FeedForward"]):
        assert_passes(FFN_CHECKS[name], answer, f"a correct FeedForward ({answer.__name__}) fails {name}")


test_ffn_variant_fails_exactly_the_expected_checks = variants_test(FFN_CHECKS, FFN_VARIANTS)
test_each_ffn_check_rejects_at_least_five_variants = rejections_test(FFN_CHECKS, FFN_VARIANTS)
test_ffn_failure_names_the_mistake = naming_test_for(
    Bk.check_ffn_values, FFN_MISTAKE_CLASSES, sorted(FFN_MISTAKE_CLASSES)
)


def test_ffn_hidden_size_message():
    ok, err = outcome(Bk.check_ffn_structure, FFNHiddenDModel)
    assert "4 * d_model wide" in str(err), str(err)


def test_reference_ffn_function_equals_the_reference_module():
    g = torch.Generator().manual_seed(0)
    params = Bk.random_ffn_parameters(g, 8, torch.float64)
    module = reference.FeedForward(8).double()
    Bk.load_ffn(module, params)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(Bk.reference_ffn(x, *params), module(x), atol=1e-12, rtol=0)


# ====================================================================== TransformerBlock
BLOCK_CHECKS = {
    "structure": Bk.check_block_structure,
    "reference": Bk.check_block_against_reference,
    "reference_visible": functools.partial(Bk.check_block_against_reference, full=False),
    "causal": Bk.check_block_causal,
    "dropout": Bk.check_block_dropout,
    "grads": Bk.check_block_gradients_and_inputs,
    "grads_visible": functools.partial(Bk.check_block_gradients_and_inputs, full=False),
}
ALL = set(BLOCK_CHECKS)
VALUES = {"reference", "reference_visible", "causal", "dropout"}  # the dropout check compares eval outputs too


def block_forward(name, forward):
    return type(name, (GoodBlock,), {"forward": forward})


def _post_ln(self, x, mask=None):
    a, w = self.attn(x, mask)
    x = self.ln1(x + self.drop(a))
    return self.ln2(x + self.drop(self.ffn(x))), w


def _no_attn_residual(self, x, mask=None):
    x, w = self.attn(self.ln1(x), mask)
    return x + self.drop(self.ffn(self.ln2(x))), w


def _no_ffn_residual(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    x = x + self.drop(a)
    return self.drop(self.ffn(self.ln2(x))), w


def _ln1_twice(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    x = x + self.drop(a)
    return x + self.drop(self.ffn(self.ln1(x))), w


def _mask_not_passed(self, x, mask=None):
    return GoodBlock.forward(self, x)


def _parallel(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    return x + self.drop(a) + self.drop(self.ffn(self.ln2(x))), w


def _residual_from_normalised(self, x, mask=None):
    h = self.ln1(x)
    a, w = self.attn(h, mask)
    x = h + self.drop(a)
    h = self.ln2(x)
    return h + self.drop(self.ffn(h)), w


class ReLUFFN(GoodFFN):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ReLUBlock(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ffn = ReLUFFN(d_model)


class SharedLayerNorm(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ln2 = self.ln1


class NarrowFFN(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ffn = FFNHiddenDModel(d_model)


class ExtraFinalNorm(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, x, mask=None):
        x, w = super().forward(x, mask)
        return self.ln_f(x), w


def _dropout_in_eval(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    x = x + F.dropout(a, self.p)  # F.dropout's training defaults to True
    return x + F.dropout(self.ffn(self.ln2(x)), self.p), w


def _dropout_on_the_sum(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    x = self.drop(x + a)
    return self.drop(x + self.ffn(self.ln2(x))), w


def _no_dropout(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    x = x + a
    return x + self.ffn(self.ln2(x)), w


def _fixed_dropout(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    x = x + F.dropout(a, 0.1, self.training)  # ignores the dropout argument
    return x + F.dropout(self.ffn(self.ln2(x)), 0.1, self.training), w


def _scaled_not_dropped(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    scale = (1 - self.p) if self.training else 1.0  # the expected value of dropout, without its zeros
    x = x + a * scale
    return x + self.ffn(self.ln2(x)) * scale, w


def _dropout_not_rescaled(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    keep = lambda t: t * (torch.rand_like(t) >= self.p) if self.training else t  # noqa: E731
    x = x + keep(a)
    return x + keep(self.ffn(self.ln2(x))), w


def _own_inverted_dropout(self, x, mask=None):
    """A correct alternative: inverted dropout written by hand (a mask of its own draws)."""
    def drop(t):
        if not self.training or self.p == 0:
            return t
        if self.p >= 1:
            return torch.zeros_like(t)
        return t * (torch.rand_like(t) >= self.p).to(t.dtype) / (1 - self.p)

    a, w = self.attn(self.ln1(x), mask)
    x = x + drop(a)
    return x + drop(self.ffn(self.ln2(x))), w


def _attention_dropout_only(self, x, mask=None):
    a, w = self.attn(self.ln1(x), mask)
    x = x + self.drop(a)
    return x + self.ffn(self.ln2(x)), w


class SeedStyleDropoutModule(GoodBlock):
    """A correct alternative: nn.Dropout as a submodule (no parameters)."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.dropout_layer = nn.Dropout(dropout)

    def drop(self, t):
        return self.dropout_layer(t)


class CallsTorchEncoderLayer(GoodBlock):
    def forward(self, x, mask=None):
        d = x.shape[-1]
        layer = nn.TransformerEncoderLayer(d, self.attn.n_heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True).to(x.dtype)
        with torch.no_grad():
            a = self.attn
            layer.self_attn.in_proj_weight.copy_(torch.cat([a.W_q.weight, a.W_k.weight, a.W_v.weight]))
            layer.self_attn.in_proj_bias.zero_()
            layer.self_attn.out_proj.weight.copy_(a.W_o.weight)
            layer.self_attn.out_proj.bias.zero_()
            layer.linear1.load_state_dict(self.ffn.fc1.state_dict())
            layer.linear2.load_state_dict(self.ffn.fc2.state_dict())
            layer.norm1.load_state_dict(self.ln1.state_dict())
            layer.norm2.load_state_dict(self.ln2.state_dict())
        return layer(x, src_mask=mask), self.attn(self.ln1(x), mask)[1]


class TorchAttention(nn.Module):
    """nn.MultiheadAttention behind the W_q ... W_o interface."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x, mask=None):
        mha = nn.MultiheadAttention(x.shape[-1], self.n_heads, bias=False, batch_first=True).to(x.dtype)
        mha.in_proj_weight = nn.Parameter(torch.cat([self.W_q.weight, self.W_k.weight, self.W_v.weight]))
        mha.out_proj.weight = self.W_o.weight
        return mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)


class UsesTorchAttention(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.attn = TorchAttention(d_model, n_heads)


class UsesReferenceAttention(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.attn = reference.MultiHeadAttention(d_model, n_heads)


class SubclassesReference(reference.TransformerBlock):
    pass


Detached, ReturnsNumpy, CastsToFloat32 = (
    outputs_variant(GoodBlock, name, transform) for name, transform in OUTPUT_BREAKS.items()
)


class ModifiesInput(GoodBlock):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x += self.drop(a)  # in place: changes the caller's tensor
        return x + self.drop(self.ffn(self.ln2(x))), w


class OutputOnly(GoodBlock):
    def forward(self, x, mask=None):
        return super().forward(x, mask)[0]


BLOCK_MISTAKE_CLASSES = {
    "post-LN instead of pre-LN": (block_forward("PostLN", _post_ln), VALUES),
    "attention residual forgotten": (block_forward("NoAttnResidual", _no_attn_residual), VALUES),
    "feed-forward residual forgotten": (block_forward("NoFFNResidual", _no_ffn_residual), VALUES),
    "ReLU instead of GELU": (ReLUBlock, VALUES),
    # ln2 is never used, so no gradient reaches it: the gradient checks say so.
    "ln1 used before the feed-forward network too": (
        block_forward("LN1Twice", _ln1_twice), VALUES | {"grads", "grads_visible"},
    ),
    "ln2 used before attention too (one LayerNorm shared)": (SharedLayerNorm, {"structure"} | VALUES),
    "mask not passed to attention": (block_forward("MaskNotPassed", _mask_not_passed), {"reference", "causal"}),
    "feed-forward applied to the block's input": (block_forward("Parallel", _parallel), VALUES),
    "residual taken from the normalised input": (block_forward("ResidualFromLN", _residual_from_normalised), VALUES),
}
BLOCK_VARIANTS = dict(BLOCK_MISTAKE_CLASSES)
BLOCK_VARIANTS.update({
    "feed-forward hidden size d_model": (NarrowFFN, ALL),
    "an extra final LayerNorm": (ExtraFinalNorm, {"structure"} | VALUES),
    "dropout active in eval mode": (block_forward("DropoutInEval", _dropout_in_eval), ALL - {"structure"}),
    "dropout on the residual sum": (block_forward("DropoutOnSum", _dropout_on_the_sum), {"dropout"}),
    "no dropout": (block_forward("NoDropout", _no_dropout), {"dropout"}),
    "dropout argument ignored": (block_forward("FixedDropout", _fixed_dropout), {"dropout"}),
    "no dropout on the feed-forward branch": (block_forward("AttnDropoutOnly", _attention_dropout_only), {"dropout"}),
    "dropout as a scaling by 1 - p (no zeros)": (block_forward("ScaledNotDropped", _scaled_not_dropped), {"dropout"}),
    "dropout without the 1/(1-p) rescaling": (block_forward("NotRescaled", _dropout_not_rescaled), {"dropout"}),
    "calls nn.TransformerEncoderLayer": (CallsTorchEncoderLayer, ALL),
    "attn is nn.MultiheadAttention": (UsesTorchAttention, ALL),
    "attn is the reference MultiHeadAttention": (UsesReferenceAttention, ALL),
    "subclasses the reference block": (SubclassesReference, ALL),
    "detached": (Detached, {"grads", "grads_visible"}),
    "returns numpy": (ReturnsNumpy, ALL - {"structure"}),
    "casts to float32": (CastsToFloat32, ALL - {"structure", "causal"}),  # the causal check is float32
    "modifies its input": (ModifiesInput, ALL - {"structure"}),
    "returns the output only": (OutputOnly, ALL - {"structure"}),
})


test_every_block_mistake_has_a_variant = expectations_test((BLOCK_MISTAKE_CLASSES, Bk.BLOCK_MISTAKES))


@pytest.mark.parametrize("name", sorted(BLOCK_CHECKS))
def test_independent_block_passes(name):
    for answer in (GoodBlock, SeedStyleDropoutModule, block_forward("OwnInvertedDropout", _own_inverted_dropout)):
        assert_passes(BLOCK_CHECKS[name], answer, f"a correct TransformerBlock ({answer.__name__}) fails {name}")


@pytest.mark.parametrize("name", sorted(BLOCK_CHECKS))
def test_seed_block_passes(name, seed):
    assert_passes(BLOCK_CHECKS[name], seed["TransformerBlock"], f"the seed's TransformerBlock fails {name}")


test_block_variant_fails_exactly_the_expected_checks = variants_test(BLOCK_CHECKS, BLOCK_VARIANTS)
test_each_block_check_rejects_at_least_five_variants = rejections_test(BLOCK_CHECKS, BLOCK_VARIANTS)
test_block_failure_names_the_mistake = naming_test_for(
    Bk.check_block_against_reference, BLOCK_MISTAKE_CLASSES, sorted(BLOCK_MISTAKE_CLASSES)
)


def test_mistakes_match_their_classes():
    """Each named mistake's function computes what the class of the same name does (eval mode)."""
    g = torch.Generator().manual_seed(0)
    P = Bk.random_block_parameters(g, 8, torch.float64)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    mask = reference.causal_mask(5, torch.float64)
    for m in Bk.BLOCK_MISTAKES:
        module = BLOCK_MISTAKE_CLASSES[m.label][0](8, 2).double().eval()
        Bk.load_block(module, P)
        for got, want in zip(module(x, mask), m.fn(x, P, 2, mask)):
            torch.testing.assert_close(got, want, msg=m.label)


def test_reference_block_function_equals_the_reference_module_and_torch():
    g = torch.Generator().manual_seed(1)
    P = Bk.random_block_parameters(g, 16, torch.float64)
    x = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
    mask = reference.causal_mask(6, torch.float64)
    module = reference.TransformerBlock(16, 4).double().eval()
    Bk.load_block(module, P)
    for got, want in zip(Bk.reference_block(x, P, 4, mask), module(x, mask)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(Bk._torch_block(x, P, 4, mask), module(x, mask)[0], atol=1e-10, rtol=1e-8)


def test_seed_parameter_count():
    assert Bk.block_parameter_count(128) == Bk.SEED_PARAMETERS == 197_760
    assert sum(p.numel() for p in reference.TransformerBlock(128, 4).parameters()) == 197_760


def test_structure_messages():
    ok, err = outcome(Bk.check_block_structure, SharedLayerNorm)
    assert "same module" in str(err), str(err)
    ok, err = outcome(Bk.check_block_structure, ExtraFinalNorm)
    assert "198,016" in str(err) and "197,760" in str(err) and "ln_f" in str(err), str(err)


def test_dropout_messages():
    ok, err = outcome(Bk.check_block_dropout, BLOCK_VARIANTS["dropout on the residual sum"][0])
    assert "return its input unchanged" in str(err), str(err)
    ok, err = outcome(Bk.check_block_dropout, BLOCK_VARIANTS["no dropout"][0])
    assert "not applied" in str(err), str(err)
    ok, err = outcome(Bk.check_block_against_reference, BLOCK_VARIANTS["dropout active in eval mode"][0])
    assert "eval mode" in str(err), str(err)


def test_checks_leave_the_global_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    Bk.check_block_dropout(GoodBlock)
    Bk.check_block_gradients_and_inputs(GoodBlock, full=False)
    assert torch.equal(torch.rand(3), expected)


def test_forbidden_call_message_is_clear():
    ok, err = outcome(Bk.check_block_against_reference, CallsTorchEncoderLayer)
    assert "multi_head_attention" in str(err) and "scores 0" in str(err), str(err)


# ====================================================================== the notebook, with the seed pasted in
def test_seed_pasted_into_the_notebook_gets_every_point(tmp_path):
    """The source notebook (hidden tests included) with the seed's attention function,
    MultiHeadAttention, FeedForward and TransformerBlock pasted into their answer cells
    (imports and all) passes every test. The seed has no split_heads / merge_heads of
    its own (its MultiHeadAttention splits inline), so those cells keep the solution."""
    import nbformat
    from nbgrader.validator import Validator

    from course import SOLUTIONS, with_answer
    from seeds import seed_code

    nb = nbformat.read(SOLUTIONS / "transformer_block" / "transformer_block.ipynb", as_version=4)
    for name in ("scaled_dot_product_attention", "MultiHeadAttention", "FeedForward", "TransformerBlock"):
        nb = with_answer(nb, name, seed_code(name))
    path = tmp_path / "transformer_block.ipynb"
    nbformat.write(nb, path)
    results = Validator(ignore_checksums=True).validate(str(path))
    assert not results.get("failed"), "\n\n".join(f["raw_error"][-2000:] for f in results["failed"])
