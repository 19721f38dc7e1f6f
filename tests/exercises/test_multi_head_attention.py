"""multi_head_attention: what the generic harness does not cover: the messages a student reads (in the
notebook and in the re-check), the seed pasted into the notebook, the tests that judge no values, the
module's adapter (seeds, structure, weights by name), the recaps that later notebooks run
(declared in their notebooks with ``exercises.recap``) and how the re-check judges their cells."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from course import as_answer
from exercises import multi_head_attention_answers as A
from firstprinciples import exercises
from firstprinciples.exercises import multi_head_attention as D
from firstprinciples.grading import declared

PIECES = {e.piece: e for e in exercises.pieces("multi_head_attention")}
MISTAKES = {m.label: m.fn for e in PIECES.values() for m in e.mistakes}


def failure(check, *args) -> Exception:
    with pytest.raises(Exception) as err:
        check(*args)
    return err.value


def message(grade_id: str, answer) -> str:
    return str(failure(declared.check_for("multi_head_attention"), grade_id, answer))


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the worked examples say which head (or token) is wrong, and what it should be
    ("test_split_heads", MISTAKES["reshaped straight to (B, n_heads, T, d_k)"],
     ["worked example", "split_heads(x, 3)[0, 0] (head 0) is [[0, 1], [2, 3]] but should be [[0, 1], [6, 7]]",
      "reshaped straight to (B, n_heads, T, d_k)"]),
    ("test_split_heads", MISTAKES["transpose forgotten"], ["should have shape (B, n_heads, T, d_k) = (1, 3, 2, 2)",
                                                           "(1, 2, 3, 2)", "transpose forgotten"]),
    ("test_merge_heads", MISTAKES["merged without transposing back"],
     ["merge_heads(heads)[0, 0] (token 0) is [0, 1, 6, 7, 2, 3] but should be [0, 1, 2, 3, 4, 5]",
      "merged without transposing back"]),
    ("test_merge_heads", A.merge_with_view, ["in merge_with_view", ".reshape", ".contiguous()"]),
    ("test_split_heads", A.split_list_of_heads, ["is a list, but should be a torch.Tensor"]),
    ("test_split_heads", A.split_in_place, ["modified its input x in place"]),
    # the module: its structure, said as the old checks said it
    ("test_mha_structure", A.ExtraTemperature, ["MultiHeadAttention(16, 4) has 1,025 parameters", "1,024",
                                                "temperature ()", "W_q.weight (16, 16)"]),
    ("test_mha_structure", A.WithBiases, ["W_q should have no bias: nn.Linear(d_model, d_model, bias=False)"]),
    ("test_mha_structure", A.SharedProjection, ["four different nn.Linear layers, not one shared layer"]),
    ("test_mha_structure", A.FusedQKV, ["should have an attribute W_q that is an nn.Linear", "it has none"]),
    ("test_mha_structure", A.not_a_module, ["should build an nn.Module", "built a function"]),
    ("test_mha_structure", A.NoSuperInit, ["in NoSuperInit.__init__", "self.W_q = nn.Linear",
                                           "must call `super().__init__()`"]),
    # the contract with the KV cache and the capstone (issue 42): the attribute, its value, who reads it
    ("test_mha_structure", MISTAKES["head count kept under another name"], [
        "MultiHeadAttention(16, 4) should have an attribute n_heads, the number of heads: here 4 "
        "(self.n_heads = n_heads); it has none", "the KV-cache and capstone exercises read mha.n_heads",
        "head count kept under another name", "self.n_heads"]),
    ("test_mha_structure", A.HeadCountAsH, ["should have an attribute n_heads", "here 4", "it has none",
                                            "KV-cache and capstone exercises read mha.n_heads"]),
    ("test_mha_structure", A.NoDk, ["should have an attribute d_k, the width of each head, d_model // n_heads: "
                                    "here 4 (self.d_k = d_model // n_heads); it has none",
                                    "the KV-cache and capstone exercises read mha.d_k"]),
    ("test_mha_structure", A.DkAsFloat, ["MultiHeadAttention(16, 4).d_k should be the integer 4",
                                         "yours is a float, 4.0", "KV-cache and capstone exercises read mha.d_k"]),
    ("test_mha_structure", A.HeadsAndWidthSwapped, ["MultiHeadAttention(12, 3).n_heads is 4 but should be 3",
                                                    "the number of heads", "read mha.n_heads"]),
    # the student's own line, the shapes on it and what to write instead
    ("test_mha_against_reference", A.DotTIn4D, [
        "raised RuntimeError in your code at", "in DotTIn4D.forward", "scores = Q @ K.T / math.sqrt(Q.shape[-1])",
        "Shapes on this line: Q (2, 2, 5, 4), K (2, 2, 5, 4)", "`K.T` reverses every dimension",
        "`K.transpose(-2, -1)`"]),
    ("test_mha_masks", A.IfMask, ["in IfMask.forward", "if mask:", "write `if mask is not None:`"]),
    ("test_mha_against_reference", A.ViewAfterTranspose, [
        "in ViewAfterTranspose.forward", "out = out.transpose(1, 2).view(B, T, d_model)", "use `.reshape(...)`"]),
    # what it returns
    ("test_mha_against_reference", A.WeightsFirst, ["wrong order: (weights, output) instead of (output, weights)",
                                                    "output (2, 5, 8)"]),
    ("test_mha_gradients_and_inputs", A.WeightsFirst, ["wrong order: (weights, output)"]),
    ("test_mha_against_reference", A.OutputOnly, ["expected a tuple (output, weights)"]),
    ("test_mha_against_reference", A.ReturnsNumpy, ["NumPy array", "torch.Tensor"]),
    ("test_mha_against_reference", A.CastsToFloat32, ["dtype float32", "float64"]),
    ("test_mha_against_reference", A.ModifiesInput, ["modified its input x in place"]),
    ("test_mha_against_reference", A.ModifiesItsWeights, ["changed its own parameter W_o.weight",
                                                          "must not modify the weights"]),
    ("test_mha_gradients_and_inputs", A.Detached, ["does not require grad", ".detach()"]),
    # the mistakes
    ("test_mha_masks", MISTAKES["mask ignored"], ["every weight above the diagonal", "must be exactly 0",
                                                  "mask ignored"]),
    ("test_mha_gradients_and_inputs", MISTAKES["W_o forgotten"], ["no gradient reaches W_o.weight"]),
    ("test_mha_against_reference", MISTAKES["weights averaged over heads"], ["shape (2, 5, 5)", "(2, 2, 5, 5)",
                                                                            "weights averaged over heads"]),
    ("test_mha_against_reference", MISTAKES["scaled by sqrt(d_model)"], ["scaled by sqrt(d_model)"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_the_wrong_order_is_not_blamed_on_the_gradients():
    text = message("test_mha_gradients_and_inputs", A.WeightsFirst)
    assert "no gradient reaches" not in text and "wrong order" in text, text


@pytest.mark.parametrize("answer", [A.CallsTorchMHA, A.CallsTorchAttention, A.CallsReferenceModule])
def test_forbidden_call_messages_are_clear(answer):
    from firstprinciples.guard import ForbiddenCall

    for grade_id in ("test_mha_structure", "test_mha_against_reference"):
        err = failure(declared.check_for("multi_head_attention"), grade_id, answer)
        assert isinstance(err, ForbiddenCall), err
        assert "scores 0" in str(err) and ("attention" in str(err) or "MultiHeadAttention" in str(err)), err


def test_the_re_check_says_which_attribute_the_later_exercises_miss():
    """On the secret cases too, the structure test names the missing attribute, who reads it and the
    declared mistake."""
    from exercises.harness import recheck_failures

    failed = recheck_failures(PIECES["MultiHeadAttention"], as_answer(MISTAKES["head count kept under another name"]),
                              seed=1)
    assert set(failed) == {"test_mha_structure"}, failed
    reason = failed["test_mha_structure"]
    for phrase in ("should have an attribute n_heads", "it has none", "KV-cache and capstone exercises read "
                   "mha.n_heads", "head count kept under another name"):
        assert phrase in reason, f"{phrase!r} not in:\n{reason}"


# ---------------------------------------------------------------- the module's adapter
@pytest.mark.parametrize("value, reported", [
    (4, 4), (np.int64(4), 4), (torch.tensor(4), 4), (True, 1),  # what reshape accepts as an integer
    (4.0, "a float, 4.0"), (torch.tensor(4.0), "a Tensor, tensor(4.)"), ("4", "a str, '4'"),
    (list(range(30)), "a list, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11..."),
])
def test_the_contract_s_attributes_are_reported_as_integers_or_as_what_they_are(value, reported):
    class Sized(torch.nn.Module):
        pass

    module = Sized()
    module.n_heads = value
    assert D.describe_integer(module, "n_heads") == reported
    assert D.describe_integer(module, "d_k") == "missing"


def test_building_does_not_touch_the_global_random_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    declared.check_for("multi_head_attention")("test_mha_against_reference", A.GoodMHA)
    assert torch.equal(torch.rand(3), expected)


def test_the_weights_are_loaded_by_name_wherever_the_module_keeps_them():
    """The case's W_q.weight ... W_o.weight reach a module whose layers sit in an nn.ModuleDict behind
    properties, and its parameters are listed under the names the exercise asks for."""
    case = declared.tensors(D.MHA_EXERCISE.cases("test_mha_against_reference")[0])
    for cls in (A.LayersInAModuleDict, A.HeadByHead):
        module = D.build(cls, 8, 2).double()
        D.load(module, {n: case[n] for n in D.PARAMS})
        for n in D.PARAMS:
            assert torch.equal(D.parameter(module, n), case[n]), (cls.__name__, n)
        listed = D.module_structure(module, D.PROJECTIONS)["parameter list"]
        assert listed == "W_k.weight (8, 8), W_o.weight (8, 8), W_q.weight (8, 8), W_v.weight (8, 8)", listed


def test_the_gradient_case_checks_the_weights_gradients_too():
    """The finite difference moves x and the four weights together: an answer whose gradient of one
    weight matrix is wrong (W_v's scaled by 2, the output left right) fails the gradient test."""
    class WrongGradOfWv(A.GoodMHA):
        def forward(self, x, mask=None):
            W = self.W_v.weight
            self.W_v.weight_used = 2 * W - W.detach()  # the value of W, twice its gradient
            Q, K = self.split(self.W_q(x)), self.split(self.W_k(x))
            V = self.split(x @ self.W_v.weight_used.T)
            out, w = self.attend(Q, K, V, mask)
            return self.W_o(self.merge(out)), w

    failed = message("test_mha_gradients_and_inputs", WrongGradOfWv)
    assert "do not match its own outputs" in failed, failed
    declared.check_for("multi_head_attention")("test_mha_against_reference", WrongGradOfWv)  # (its values are right)


class DoubledOutput(A.GoodMHA):
    """Honest gradients of wrong values."""

    def forward(self, x, mask=None):
        out, w = super().forward(x, mask)
        return 2 * out, w


class FlatWeights(A.GoodMHA):
    """The right structure with the wrong values: every head's scores scaled twice too little."""

    def attend(self, Q, K, V, mask):
        return A.GoodMHA.attend(self, Q * 2, K, V, mask)


@pytest.mark.parametrize("answer, kept", [(DoubledOutput, "test_mha_gradients_and_inputs"),
                                          (FlatWeights, "test_mha_structure")])
def test_the_tests_that_judge_no_values_keep_wrong_values(answer, kept):
    """test_mha_structure judges the layers, test_mha_gradients_and_inputs the gradients against the
    answer's own outputs (as their checks always did): wrong values keep them, in the kernel and in
    the re-check, and lose the test that compares values."""
    from exercises.harness import kernel_failures, recheck_failures

    exercise = PIECES["MultiHeadAttention"]
    failed = kernel_failures(exercise, answer)
    assert kept not in failed and "test_mha_against_reference" in failed, failed
    failed = recheck_failures(exercise, answer, seed=3)
    assert kept not in failed and "test_mha_against_reference" in failed, failed


# ---------------------------------------------------------------- the notebook, with the seed pasted in
def test_seed_pasted_into_the_notebook_gets_every_point(tmp_path):
    """The source notebook with the seed's attention function and MultiHeadAttention pasted into their
    answer cells, imports and all, passes every test."""
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


# ---------------------------------------------------------------- the later notebooks' recaps
def _cell(notebook, grade_id):
    return lambda answer: declared.check_for(notebook)(grade_id, answer)


# (the transformer block's recap cells, as the capstone's: both notebooks declare them)
RECAPS = {"split_heads": _cell("transformer_block", "recap_split_heads"),
          "merge_heads": _cell("capstone", "recap_merge_heads"),
          "MultiHeadAttention": _cell("capstone", "test_multi_head_attention")}


@pytest.mark.parametrize("piece, answer", [(p, fn) for p, table in A.CORRECT.items() if p in RECAPS
                                           for fn in table.values()])
def test_the_recaps_pass_correct_answers(piece, answer):
    RECAPS[piece](answer)


@pytest.mark.parametrize("piece, answer, phrases", [
    ("split_heads", MISTAKES["d_k and n_heads in the wrong order"], ["worked example", "split_heads(x, 3)[0, 0]",
                                                                    "d_k and n_heads in the wrong order"]),
    ("split_heads", A.split_calls_reference, ["split_heads", "scores 0"]),
    ("merge_heads", MISTAKES["heads interleaved"], ["merge_heads(heads)[0, 0] (token 0)", "heads interleaved"]),
    ("merge_heads", A.merge_with_view, [".contiguous()"]),
    ("MultiHeadAttention", MISTAKES["queries and keys swapped"], ["queries and keys swapped"]),
    ("MultiHeadAttention", A.WeightsFirst, ["wrong order: (weights, output)"]),
    ("MultiHeadAttention", A.CallsTorchMHA, ["multi_head_attention", "scores 0"]),
])
def test_the_recaps_fail_wrong_answers_and_say_why(piece, answer, phrases):
    text = str(failure(RECAPS[piece], answer))
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def _recheck_reasons(notebook: str, piece: str, answer, seed: int = 0) -> dict:
    """grade_id -> the re-check's reason (None: passed) for the cells of ``notebook`` that ``piece``'s
    probe judges, on ``answer`` alone (the notebook's other objects left out)."""
    import nbformat

    from course import SOLUTIONS
    from firstprinciples.grading import trusted, wire
    from firstprinciples.grading.runtime import report

    plan = trusted.make_plan(nbformat.read(SOLUTIONS / notebook, as_version=4), seed)
    check = next(c for c in plan.checks if c.name == piece)
    found = trusted.outcome(check, wire.loads(wire.dumps(report({piece: answer}, piece, check.cases))))
    cells = {plan.nb.cells[i].metadata["nbgrader"]["grade_id"] for i, names in plan.graded.items() if piece in names}
    return {gid: found.reason(check, check.probe.cells[gid]) for gid in cells}


@pytest.mark.parametrize("notebook, piece, cell, wrong", [
    ("transformer_block/transformer_block.ipynb", "split_heads", "recap_split_heads", "transpose forgotten"),
    ("transformer_block/transformer_block.ipynb", "merge_heads", "test_merge_heads", "heads interleaved"),
    ("transformer_block/transformer_block.ipynb", "MultiHeadAttention", "test_multi_head_attention", "W_o forgotten"),
    ("capstone/capstone.ipynb", "split_heads", "test_split_heads", "n_heads and d_k swapped"),
    ("capstone/capstone.ipynb", "merge_heads", "recap_merge_heads", "heads not flattened"),
    ("capstone/capstone.ipynb", "MultiHeadAttention", "test_multi_head_attention", "queries and keys swapped"),
])
def test_the_later_notebooks_recap_cells_are_re_checked_by_the_declaration(notebook, piece, cell, wrong):
    """Each recap cell of transformer_block and capstone is judged in the re-check by this declaration's
    probe (its ``elsewhere``, or its own test of the same grade_id): a correct answer passes it, a
    declared mistake fails it and is named."""
    reasons = _recheck_reasons(notebook, piece, next(iter(A.CORRECT[piece].values())))
    assert reasons == {cell: None}, reasons
    reasons = _recheck_reasons(notebook, piece, as_answer(MISTAKES[wrong]))  # (as a student who wrote it)
    assert set(reasons) == {cell} and wrong in (reasons[cell] or ""), reasons


def test_the_recap_of_the_multi_head_attention_cell_judges_the_weights_it_loads():
    """test_multi_head_attention in the later notebooks: the recap's visible case is this notebook's
    (seeded weights and input, against the reference), and the re-check judges the cell on every
    secret case of test_mha_against_reference."""
    assert D.MHA_RECAP.cases("test_multi_head_attention") == D.MHA_EXERCISE.cases("test_mha_against_reference")
    assert D.MHA_EXERCISE.elsewhere["test_multi_head_attention"].tags == D.MHA_EXERCISE.tests[
        "test_mha_against_reference"].tags
