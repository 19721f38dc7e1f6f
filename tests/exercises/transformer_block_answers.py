"""transformer_block: the answers the generic harness (test_declarations.py) runs besides the
declaration's own mistakes, per piece: unusual correct answers, which must pass everywhere, and
wrong answers that no mistake names (a built-in or the course's pieces called, a wrong type, an
input changed, a wrong structure, dropout on in eval mode), each with the test cells it fails in
the notebook (its visible cases) and in the trusted re-check (the secret ones). The recaps of the
earlier pieces reuse multi_head_attention's answers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course import as_student_code
from exercises import multi_head_attention_answers as M
from firstprinciples import reference

PIECES = True


# ================================================================ the recaps of earlier pieces
RECAP_ATTENTION, RECAP_SPLIT, MERGE, RECAP_MHA = ("test_scaled_dot_product_attention", "recap_split_heads",
                                                  "test_merge_heads", "test_multi_head_attention")
ATTENTION_WRONG = M.ATTENTION_WRONG
SPLIT_WRONG = {
    "calls the reference": (M.split_calls_reference, {RECAP_SPLIT}, {RECAP_SPLIT}),
    "returns numpy": (M.split_numpy, {RECAP_SPLIT}, {RECAP_SPLIT}),
    "modifies its input": (M.split_in_place, {RECAP_SPLIT}, {RECAP_SPLIT}),
    "casts to float32": (M.split_float32, {RECAP_SPLIT}, {RECAP_SPLIT}),
    "hard-coded worked example": (M.split_hard_coded, {RECAP_SPLIT}, {RECAP_SPLIT}),
    "returns a list of heads": (M.split_list_of_heads, {RECAP_SPLIT}, {RECAP_SPLIT}),
}
MERGE_WRONG = {
    "calls the reference": (M.merge_calls_reference, {MERGE}, {MERGE}),
    ".view on a transposed tensor": (M.merge_with_view, {MERGE}, {MERGE}),
    # (the notebook's cases have no gradient; the re-check's have)
    "detached": (M.merge_detached, set(), {MERGE}),
    "returns numpy": (M.merge_numpy, {MERGE}, {MERGE}),
    "modifies its input": (M.merge_in_place, {MERGE}, {MERGE}),
    "casts to float32": (M.merge_float32, {MERGE}, {MERGE}),
}
MHA_WRONG = {
    "calls nn.MultiheadAttention": (M.CallsTorchMHA, {RECAP_MHA}, {RECAP_MHA}),
    "calls F.scaled_dot_product_attention": (M.CallsTorchAttention, {RECAP_MHA}, {RECAP_MHA}),
    "subclasses the reference module": (M.CallsReferenceModule, {RECAP_MHA}, {RECAP_MHA}),
    "returns numpy": (M.ReturnsNumpy, {RECAP_MHA}, {RECAP_MHA}),
    "modifies its input": (M.ModifiesInput, {RECAP_MHA}, {RECAP_MHA}),
    "returns (weights, output)": (M.WeightsFirst, {RECAP_MHA}, {RECAP_MHA}),
}


# ================================================================ FeedForward
FFN = "test_feed_forward"


class SequentialFFN(nn.Module):
    """The layers in an nn.Sequential under names of its own, the activation a module."""

    def __init__(self, d_model):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        return self.layers(x)


class BackwardsFFN(nn.Module):
    """The second layer made first (registered in the other order); GELU written with erf."""

    def __init__(self, d_model):
        super().__init__()
        self.out = nn.Linear(4 * d_model, d_model)
        self.hidden = nn.Linear(d_model, 4 * d_model)

    def forward(self, x):
        h = self.hidden(x)
        return self.out(0.5 * h * (1 + torch.erf(h / 2**0.5)))


class FunctionalFFN(nn.Module):
    """The layers hold the parameters, F.linear and F.gelu apply them."""

    def __init__(self, d_model):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.fc1.weight, self.fc1.bias)), self.fc2.weight, self.fc2.bias)


class FFNCallsReference(reference.FeedForward):
    pass


class FFNNoBias(SequentialFFN):
    def __init__(self, d_model):
        nn.Module.__init__(self)
        self.layers = nn.Sequential(nn.Linear(d_model, 4 * d_model, bias=False), nn.GELU(),
                                    nn.Linear(4 * d_model, d_model, bias=False))


class FFNDetached(SequentialFFN):
    def forward(self, x):
        return super().forward(x).detach()


class FFNNumpy(SequentialFFN):
    def forward(self, x):
        return super().forward(x).detach().numpy()


class FFNInPlace(SequentialFFN):
    def forward(self, x):
        x.mul_(2)
        return super().forward(x / 2)


class FFNFloat32(SequentialFFN):
    def forward(self, x):
        return super().forward(x).float()


class FFNExtraLayer(SequentialFFN):
    def __init__(self, d_model):
        super().__init__(d_model)
        self.norm = nn.LayerNorm(d_model)  # an unasked-for layer (its parameters count)


FFN_CORRECT = {"reference": as_student_code(reference.FeedForward), "nn.Sequential": SequentialFFN,
               "layers made backwards, GELU with erf": BackwardsFFN, "F.linear and F.gelu": FunctionalFFN}
FFN_WRONG = {
    "subclasses the reference": (FFNCallsReference, {FFN}, {FFN}),
    "no biases": (FFNNoBias, {FFN}, {FFN}),
    # (the notebook's cases have no gradient; the re-check's have)
    "detached": (FFNDetached, set(), {FFN}),
    "returns numpy": (FFNNumpy, {FFN}, {FFN}),
    "modifies its input": (FFNInPlace, {FFN}, {FFN}),
    "casts to float32": (FFNFloat32, {FFN}, {FFN}),
    "an extra LayerNorm": (FFNExtraLayer, {FFN}, {FFN}),
}


# ================================================================ TransformerBlock
STRUCTURE, VALUES, CAUSAL, DROPOUT, GRADS = ("test_block_structure", "test_block_against_reference",
                                             "test_block_causal", "test_block_dropout",
                                             "test_block_gradients_and_inputs")
ALL = {STRUCTURE, VALUES, CAUSAL, DROPOUT, GRADS}
RUNS = ALL - {STRUCTURE}


class GoodBlock(nn.Module):
    """An independent correct block (the answers' own attention and feed-forward network, nn.Dropout)."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = M.GoodMHA(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = SequentialFFN(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(self.ln2(x))), w


class NormsInALoop(GoodBlock):
    """The two LayerNorms made in a loop and set by name, dropout by F.dropout(training=self.training)."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        nn.Module.__init__(self)
        for name in ("ln2", "ln1"):
            setattr(self, name, nn.LayerNorm(d_model))
        self.ffn = BackwardsFFN(d_model)
        self.attn = M.HeadByHead(d_model, n_heads)
        self.p = dropout

    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + F.dropout(a, self.p, self.training)
        return x + F.dropout(self.ffn(self.ln2(x)), self.p, self.training), w


class FunctionalLayerNorm(GoodBlock):
    """The LayerNorm modules hold the parameters, F.layer_norm applies them; a dropout mask by hand."""

    def norm(self, ln, x):
        return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)

    def dropped(self, t):
        if not self.training or self.drop.p == 0:
            return t
        if self.drop.p == 1:
            return torch.zeros_like(t)
        keep = (torch.rand_like(t) >= self.drop.p).to(t.dtype)
        return t * keep / (1 - self.drop.p)

    def forward(self, x, mask=None):
        a, w = self.attn(self.norm(self.ln1, x), mask)
        x = x + self.dropped(a)
        return x + self.dropped(self.ffn(self.norm(self.ln2, x))), w


class CallsEncoderLayer(GoodBlock):
    def forward(self, x, mask=None):
        layer = nn.TransformerEncoderLayer(x.shape[-1], self.attn.n_heads, 4 * x.shape[-1], 0.0, activation="gelu",
                                           batch_first=True, norm_first=True).to(x.dtype)
        return layer(x, src_mask=mask), super().forward(x, mask)[1]


class CallsReferenceBlock(reference.TransformerBlock):
    pass


class CallsReferenceAttention(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.attn = reference.MultiHeadAttention(d_model, n_heads)


class SharedNorm(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ln2 = self.ln1


class FFNCalledMLP(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.mlp = self.ffn  # the feed-forward network under another name
        del self.ffn

    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.ln2(x))), w


class ExtraGate(GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.gate = nn.Parameter(torch.ones(()))  # an extra, unasked-for parameter (left at 1)

    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out * self.gate, w


class DropoutAlsoInEval(GoodBlock):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x = x + F.dropout(a, self.drop.p, True)  # training=True whatever the mode
        return x + F.dropout(self.ffn(self.ln2(x)), self.drop.p, True), w


class BlockDetached(GoodBlock):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out.detach(), w.detach()


class BlockNumpy(GoodBlock):
    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return out.detach().numpy(), w.detach().numpy()


class BlockInPlace(GoodBlock):
    def forward(self, x, mask=None):
        a, w = self.attn(self.ln1(x), mask)
        x += self.drop(a)  # changes the caller's x
        return x + self.drop(self.ffn(self.ln2(x))), w


class BlockOutputOnly(GoodBlock):
    def forward(self, x, mask=None):
        return super().forward(x, mask)[0]


BLOCK_CORRECT = {"reference": as_student_code(reference.TransformerBlock), "nn.Dropout": GoodBlock,
                 "norms in a loop, F.dropout": NormsInALoop, "F.layer_norm, dropout by hand": FunctionalLayerNorm}
BLOCK_WRONG = {
    "calls nn.TransformerEncoderLayer": (CallsEncoderLayer, ALL, ALL),
    "subclasses the reference": (CallsReferenceBlock, ALL, ALL),
    "the reference's attention": (CallsReferenceAttention, ALL, ALL),
    # (ln2's parameters are loaded last into the shared norm; and moving ln1's and ln2's along two
    # directions moves the one norm along one: its gradients do not match its outputs)
    "one LayerNorm shared": (SharedNorm, ALL, ALL),
    "the feed-forward network named mlp": (FFNCalledMLP, ALL, ALL),
    "an extra parameter": (ExtraGate, {STRUCTURE}, {STRUCTURE}),
    "dropout on in eval mode too": (DropoutAlsoInEval, RUNS, RUNS),
    "detached": (BlockDetached, {GRADS}, {GRADS}),
    "returns numpy": (BlockNumpy, RUNS, RUNS),
    # (the dropout test calls the block on copies of x)
    "modifies its input": (BlockInPlace, RUNS - {DROPOUT}, RUNS - {DROPOUT}),
    "returns the output only": (BlockOutputOnly, RUNS, RUNS),
}

CORRECT = {"scaled_dot_product_attention": M.ATTENTION_CORRECT, "split_heads": M.SPLIT_CORRECT,
           "merge_heads": M.MERGE_CORRECT, "MultiHeadAttention": M.MHA_CORRECT, "FeedForward": FFN_CORRECT,
           "TransformerBlock": BLOCK_CORRECT}
WRONG = {"scaled_dot_product_attention": ATTENTION_WRONG, "split_heads": SPLIT_WRONG, "merge_heads": MERGE_WRONG,
         "MultiHeadAttention": MHA_WRONG, "FeedForward": FFN_WRONG, "TransformerBlock": BLOCK_WRONG}
