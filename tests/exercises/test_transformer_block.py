"""transformer_block: what the generic harness does not cover: the messages a student reads (in the
notebook and in the re-check), dropout judged by its distribution (issue 38), the modules' adapters
(weights by name, the caller's random state), the seed pasted into the notebook, and the capstone's
recaps (declared in ``exercises/capstone.py``) and cells, judged by this declaration."""
from __future__ import annotations

import pytest
import torch

from exercises import transformer_block_answers as A
from firstprinciples import exercises, reference
from firstprinciples.exercises import transformer_block as D
from firstprinciples.grading import declared

PIECES = {e.piece: e for e in exercises.pieces("transformer_block")}
MISTAKES = {(e.piece, m.label): m.fn for e in PIECES.values() for m in e.mistakes}


def failure(check, *args) -> Exception:
    with pytest.raises(Exception) as err:
        check(*args)
    return err.value


def message(grade_id: str, answer) -> str:
    return str(failure(declared.check_for("transformer_block"), grade_id, answer))


class ExtraFinalNorm(A.GoodBlock):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.ln_f = torch.nn.LayerNorm(d_model)  # an unasked-for LayerNorm (its 2 * d_model parameters count)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the old checks' messages
    ("test_feed_forward", MISTAKES[("FeedForward", "hidden layer d_model wide")], ["4 * d_model wide"]),
    ("test_feed_forward", MISTAKES[("FeedForward", "tanh approximation of GELU")], ["tanh approximation of GELU"]),
    ("test_block_structure", A.SharedNorm, ["same module"]),
    ("test_block_structure", ExtraFinalNorm, ["198,016", "197,760", "ln_f"]),
    ("test_block_structure", A.FFNCalledMLP, ["should have an attribute ffn"]),
    ("test_block_dropout", MISTAKES[("TransformerBlock", "dropout applied to the residual sum")],
     ["return its input unchanged", "dropout applied to the residual sum"]),
    ("test_block_dropout", MISTAKES[("TransformerBlock", "dropout never applied")], ["not applied"]),
    ("test_block_against_reference", A.DropoutAlsoInEval, ["eval mode"]),
    ("test_block_against_reference", MISTAKES[("TransformerBlock", "post-LN instead of pre-LN")],
     ["post-LN instead of pre-LN"]),
    ("test_block_causal", MISTAKES[("TransformerBlock", "mask not passed to attention")],
     ["above the diagonal must be exactly 0", "pass the mask on to self.attn"]),
    ("test_block_gradients_and_inputs", A.BlockDetached, ["does not require grad"]),
    ("test_block_against_reference", A.BlockInPlace, ["modified its input x in place"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


@pytest.mark.parametrize("answer", [A.CallsEncoderLayer, A.CallsReferenceBlock])
def test_forbidden_call_messages_are_clear(answer):
    from firstprinciples.guard import ForbiddenCall

    err = failure(declared.check_for("transformer_block"), "test_block_against_reference", answer)
    assert isinstance(err, ForbiddenCall) and "scores 0" in str(err), err


# ---------------------------------------------------------------- dropout (issue 38)
@pytest.mark.parametrize("label, phrases", [
    ("dropout that only scales by (1 - p)", ["0 in 0.0% of the 4,096 entries", "0.5"]),
    ("survivors of dropout not scaled up", ["1 / (1 - p) = 2", "these other values: 1"]),
])
def test_dropout_is_judged_by_its_distribution(label, phrases):
    """A "dropout" that only scales by (1 - p), or zeroes without scaling the survivors up, loses
    test_block_dropout in the kernel and in the re-check (every seed); nn.Dropout keeps it."""
    from exercises.harness import kernel_failures, recheck_failures

    answer = MISTAKES[("TransformerBlock", label)]
    text = message("test_block_dropout", answer)
    for phrase in ["inverted dropout", label, *phrases]:
        assert phrase in text, f"{phrase!r} not in:\n{text}"
    exercise = PIECES["TransformerBlock"]
    assert set(kernel_failures(exercise, answer)) == {"test_block_dropout"}
    for seed in (3, 4):
        assert set(recheck_failures(exercise, answer, seed)) == {"test_block_dropout"}, seed


def test_the_dropout_slack_is_many_standard_deviations():
    """The false-failure probability stated in the declaration: 0.05 is over 6 standard deviations of
    the fraction of zeros among 4,096 entries, at every p the cases use."""
    n = 1
    for s in D.DROPOUT_SHAPE:
        n *= s
    for p in (D.DROPOUT_P, 0.25):
        assert D.DROPOUT_SLACK / (p * (1 - p) / n) ** 0.5 > 6, p


# ---------------------------------------------------------------- the modules' adapters
def test_building_does_not_touch_the_global_random_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    check = declared.check_for("transformer_block")
    for grade_id in ("test_block_dropout", "test_block_gradients_and_inputs"):
        check(grade_id, A.GoodBlock)
    assert torch.equal(torch.rand(3), expected)


def test_the_weights_are_loaded_by_name_wherever_the_module_keeps_them():
    """The case's parameters reach a block whose feed-forward layers are registered backwards under
    names of their own and whose attention makes its layers backwards; the parameter list uses the
    exercise's names, so that it is the reference's."""
    case = declared.tensors(D.BLOCK_EXERCISE.cases("test_block_against_reference")[0])
    module = D.build(A.NormsInALoop, 16, 4).double()
    D.load(module, {n: case[n] for n in D.BLOCK_PARAMS}, D.block_parameter)
    for n in D.BLOCK_PARAMS:
        assert torch.equal(D.block_parameter(module, n), case[n]), n
    ours = D.block_structure_data(module)["parameter list"]
    assert ours == D.block_structure_data(reference.TransformerBlock(16, 4))["parameter list"], ours


# ---------------------------------------------------------------- the notebook, with the seed pasted in
def test_seed_pasted_into_the_notebook_gets_every_point(tmp_path):
    """The source notebook with the seed's attention function, MultiHeadAttention, FeedForward and
    TransformerBlock pasted into their answer cells (imports and all) passes every test. The seed has
    no split_heads / merge_heads of its own, so those cells keep the solution."""
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


# ---------------------------------------------------------------- the capstone's recaps and cells
def _capstone_cell(grade_id):
    return lambda answer: declared.check_for("capstone")(grade_id, answer)


RECAPS = {"FeedForward": _capstone_cell("recap_feed_forward"), "TransformerBlock": _capstone_cell("test_transformer_block")}


@pytest.mark.parametrize("piece, answer", [(p, fn) for p, table in A.CORRECT.items() if p in RECAPS
                                           for fn in table.values()])
def test_the_recaps_pass_correct_answers(piece, answer):
    RECAPS[piece](answer)


@pytest.mark.parametrize("piece, answer, phrases", [
    ("FeedForward", MISTAKES[("FeedForward", "ReLU instead of GELU")], ["ReLU instead of GELU"]),
    ("TransformerBlock", MISTAKES[("TransformerBlock", "attention residual forgotten")],
     ["attention residual forgotten"]),
    ("TransformerBlock", A.CallsEncoderLayer, ["scores 0"]),
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


def test_the_capstone_cells_are_re_checked_by_the_declaration():
    """In the capstone, recap_feed_forward and test_transformer_block are judged by this declaration
    (a declared mistake fails them, graded as the student's own code); the cells that pass
    TransformerBlock along as a part of the model judge no case of it."""
    from course import as_answer

    nb = "capstone/capstone.ipynb"
    found = _recheck_reasons(nb, "FeedForward", as_answer(MISTAKES[("FeedForward", "no activation")]))
    assert found["recap_feed_forward"], found
    found = _recheck_reasons(nb, "TransformerBlock", as_answer(MISTAKES[("TransformerBlock", "post-LN instead of pre-LN")]))
    assert found["test_transformer_block"], found
    # (the capstone's model cells call check(...) on StudentGPT alone now: only its trained model's cells
    # still pass TransformerBlock along)
    assert all(found[gid] is None for gid in D.AS_A_PART if gid in found), found
    assert not any(_recheck_reasons(nb, "TransformerBlock", A.GoodBlock).values())
