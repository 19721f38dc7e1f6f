"""modern_block: what the generic harness does not cover: the messages a student reads (in the
notebook and in the re-check), the class adapter (seeded builds, weights loaded by parameter name),
and the course's modules against PyTorch's, which the notebook says they agree with."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from exercises import modern_block_answers as A
from firstprinciples import exercises, reference
from firstprinciples.exercises import modern_block as D
from firstprinciples.grading import declared

PIECES = {e.piece: e for e in exercises.pieces("modern_block")}
MISTAKES = {(e.piece, m.label): m.fn for e in PIECES.values() for m in e.mistakes}


def failure(grade_id: str, answer) -> Exception:
    with pytest.raises(Exception) as err:
        declared.check_for("modern_block")(grade_id, answer)
    return err.value


def message(grade_id: str, answer) -> str:
    return str(failure(grade_id, answer))


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # (the messages of the old checks' tests, tests/test_checks_modern_block.py)
    ("test_rmsnorm_structure", A.RMSZeros, ["should start as ones", "RMSNorm(4)"]),
    ("test_rmsnorm_values", A.RMSCallsTorch, ["rms_norm", "scores 0"]),
    ("test_rmsnorm_values", MISTAKES["RMSNorm", "eps outside the sqrt"], ["worked example", "eps outside the sqrt"]),
    ("test_swiglu_structure", A.SwiGLUBiases, ["no bias"]),
    ("test_gqa_structure", A.KFullWidth, ["n_kv_heads * d_k", "W_k.weight has shape (16, 16)", "(8, 16)"]),
    ("test_gqa_values", A.NotRepeated, ["The size of tensor a", "repeat_interleave"]),
    ("test_gqa_structure", A.CallsTorchAttention, ["scores 0", "scaled_dot_product_attention"]),
    # structure, said in the student's words
    ("test_rmsnorm_structure", A.RMSBuffer, ["parameter named weight", "not an nn.Parameter"]),
    ("test_rmsnorm_structure", A.RMSNoWeight, ["parameter named weight", "it has none"]),
    ("test_rmsnorm_structure", A.RMSWithBias, ["should have d_model = 4", "other parameters: bias (4,)"]),
    ("test_rmsnorm_structure", A.RMSScalarWeight, ["shape (1,)", "should have shape (4,)"]),
    ("test_rmsnorm_values", A.RMSBuffer, ["parameter weight", "not an nn.Parameter"]),
    ("test_swiglu_structure", A.SwiGLUShared, ["W1, W3 and W2 should be 3 different nn.Linear layers"]),
    ("test_swiglu_values", A.SwiGLUShared, ["W3.weight is the same parameter as W1.weight"]),
    ("test_swiglu_structure", A.SwiGLUWrongWidth, ["W1.weight has shape (32, 8)", "should have shape (16, 8)"]),
    ("test_swiglu_structure", A.SwiGLUConv, ["W2 that is an nn.Linear", "yours is a Conv1d"]),
    ("test_swiglu_values", A.SwiGLUBiases, ["SwiGLU.W1 should have no bias"]),
    ("test_gqa_structure", A.WithBiases, ["W_q should have no bias"]),
    # values and what the call did
    ("test_rmsnorm_values", A.RMSInPlace, ["modified its input x in place"]),
    ("test_rmsnorm_values", A.RMSScalesItsWeight, ["changed its own parameter weight"]),
    ("test_rmsnorm_values", A.RMSFloat32, ["dtype float32", "float64"]),
    ("test_swiglu_values", A.SwiGLUNumpy, ["NumPy array", "torch.Tensor"]),
    ("test_swiglu_values", MISTAKES["SwiGLU", "gate and up projection swapped"],
     ["the output for x of shape (2, 5, 8), d_hidden=12, float64 is wrong", "gate and up projection swapped"]),
    ("test_gqa_values", A.GQASwapped, ["wrong order: (weights, output) instead of (output, weights)"]),
    ("test_gqa_values", A.GQAOutputOnly, ["expected a tuple (output, weights)"]),
    ("test_gqa_values", MISTAKES["GroupedQueryAttention", "query head h reads key/value head h % n_kv_heads"],
     ["the output for x of shape (2, 5, 16), n_heads=4, n_kv_heads=2, float64 is wrong", "repeat_interleave"]),
    ("test_gqa_masks", MISTAKES["GroupedQueryAttention", "mask ignored"],
     ["where the mask is -inf must be exactly 0", "causal mask", "mask ignored"]),
    ("test_gqa_masks", A.GQAMaskInPlace, ["modified its input mask in place"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_forbidden_calls_score_0_in_every_test_of_the_piece():
    from firstprinciples.guard import ForbiddenCall

    for grade_id, answer in (("test_rmsnorm_structure", A.RMSCallsTorchModule), ("test_rmsnorm_values", A.RMSCallsReference),
                             ("test_swiglu_structure", A.SwiGLUCallsFeedForward), ("test_gqa_masks", A.CallsReferenceMHA)):
        err = failure(grade_id, answer)
        assert isinstance(err, ForbiddenCall) and "scores 0" in str(err), (grade_id, err)


def test_a_mistake_right_on_the_module_as_built_is_named_where_it_differs():
    # With the weight as built (ones), forgetting the weight changes nothing: the seeded case names it.
    text = message("test_rmsnorm_values", MISTAKES["RMSNorm", "weight not applied"])
    assert "seeded weight" in text and "weight not applied" in text, text
    assert "worked example" not in text, text


@pytest.mark.parametrize("piece, mistake, grade_id, seed", [
    ("RMSNorm", "eps argument ignored", "test_rmsnorm_values", 0),
    ("SwiGLU", "silu after W2 too", "test_swiglu_values", 1),
    ("GroupedQueryAttention", "scaled by sqrt(d_model)", "test_gqa_masks", 2),
])
def test_the_recheck_names_the_mistakes_without_showing_its_inputs(piece, mistake, grade_id, seed):
    from exercises.harness import recheck_failures

    text = recheck_failures(PIECES[piece], MISTAKES[piece, mistake], seed)[grade_id]
    assert mistake in text and "Your results match a typical mistake" in text, text
    assert "should be" not in text, text


def test_the_recheck_judges_the_gradients_an_answer_hides_in_the_notebook():
    from exercises.harness import recheck_failures

    text = recheck_failures(PIECES["SwiGLU"], A.SwiGLUDetached, 0)["test_swiglu_values"]
    assert "with the gradients" in text and "no gradient reaches x" in text and ".detach()" in text, text


# ---------------------------------------------------------------- the adapter


def test_the_adapter_builds_under_its_own_seed_and_leaves_the_callers_alone():
    case = PIECES["GroupedQueryAttention"].cases("test_gqa_structure")[0]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    seen = []

    class Spy(A.GoodGQA):
        def __init__(self, *sizes):
            super().__init__(*sizes)
            seen.append(self.W_q.weight.detach().clone())

    D.gqa_adapter(Spy, declared.tensors(case))
    D.gqa_adapter(Spy, declared.tensors(case))
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(seen[0], seen[1])  # (the same weights in every process: the structure test's forward pass)


def test_the_weights_are_loaded_by_parameter_name_whatever_the_order_of_registration():
    (case,) = PIECES["SwiGLU"].cases("test_swiglu_values")
    mine = D.swiglu_adapter(A.ReorderedSwiGLU, declared.tensors(case))["output"]
    theirs = D.swiglu_adapter(reference.SwiGLU, declared.tensors(case))["output"]
    torch.testing.assert_close(mine, theirs, atol=1e-12, rtol=0)
    module = A.ReorderedSwiGLU(8, 12).double()
    D.load(module, case["weights"], "SwiGLU", {})
    assert np.array_equal(module.W3.weight.detach().numpy(), case["weights"]["W3.weight"])


def test_the_stored_results_are_small():
    """The kernel's expected results are data in the student bundle: a structure is names and
    numbers, the values cases a few small tensors."""
    from firstprinciples.exercises import expected

    path = expected.__file__.replace("expected.py", "expected/modern_block.json")
    import os

    assert os.path.getsize(path) < 100_000


# ---------------------------------------------------------------- the course's modules against PyTorch's


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
def test_reference_gqa_equals_torch_and_the_course_mha(n_kv):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(2)
    module = reference.GroupedQueryAttention(16, 4, n_kv).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / 4)
    x = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
    mask = reference.causal_mask(6, torch.float64)
    out, w = module(x, mask)

    def heads(t, n):
        return t.reshape(2, 6, n, 4).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads(module.W_q(x), 4), heads(module.W_k(x), n_kv), heads(module.W_v(x), n_kv),
                                       attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, module.W_o(o.transpose(1, 2).reshape(2, 6, 16)), atol=1e-12, rtol=0)
    if n_kv == 4:
        mha = reference.MultiHeadAttention(16, 4).double()
        mha.load_state_dict(module.state_dict())
        m_out, m_w = mha(x, mask)
        torch.testing.assert_close(out, m_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(w, m_w, atol=1e-12, rtol=0)


def test_parameter_counts():
    from firstprinciples.examples.modern_block import gqa_parameter_count

    assert sum(p.numel() for p in reference.GroupedQueryAttention(128, 8, 2).parameters()) == gqa_parameter_count(128, 8, 2)
    assert gqa_parameter_count(128, 8, 8) == 4 * 128**2
    assert sum(p.numel() for p in reference.SwiGLU(16, 40).parameters()) == 3 * 16 * 40
