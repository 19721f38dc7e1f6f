"""positional_encoding: what the generic harness does not cover: the messages a student reads, the
tests that judge a property rather than values, the source's table and the tests' speed."""
from __future__ import annotations

import time

import pytest
import torch

from exercises import positional_encoding_answers as A
from firstprinciples import exercises, reference
from firstprinciples.exercises import positional_encoding as D
from firstprinciples.grading import declared
from firstprinciples.guard import ForbiddenCall

TABLE, ROPE = exercises.pieces("positional_encoding")
MISTAKES = {(m.fn.__name__): m.fn for m in (*TABLE.mistakes, *ROPE.mistakes)}
ROPE_MISTAKES = {m.label: m.fn for m in ROPE.mistakes}
TABLE_MISTAKES = {m.label: m.fn for m in TABLE.mistakes}
check = declared.check_for("positional_encoding")


def message(grade_id: str, answer) -> str:
    with pytest.raises(AssertionError) as err:
        check(grade_id, answer)
    return str(err.value)


@pytest.mark.parametrize("grade_id, answer, phrases", [
    # the table's worst entry explained with its formula
    ("test_sinusoidal_example", TABLE_MISTAKES["frequencies 10000^(-i/d_model)"], ["10000^(-2/4)", "pair i = 1",
                                                                                   "frequencies 10000^(-i/d_model)"]),
    ("test_sinusoidal_example", TABLE_MISTAKES["positions start at 1"], ["row 0 (position 0)", "[0.0, 1.0, 0.0, 1.0]",
                                                                         "positions start at 1"]),
    ("test_sinusoidal_tables", TABLE_MISTAKES["sin and cos in two halves"], ["for max_len=50, d_model=16",
                                                                             "sin and cos in two halves"]),
    # shapes and dtypes say what to change
    ("test_sinusoidal_example", A.table_with_batch_dim, ["(1, 6, 4)", "batch dimension"]),
    ("test_sinusoidal_example", A.table_arguments_swapped, ["(4, 6)", "Rows are positions"]),
    ("test_sinusoidal_example", A.table_float64, ["float32"]),
    ("test_sinusoidal_tables", A.table_numpy, ["NumPy array", "torch.Tensor"]),
    # RoPE's worked examples, token by token and pair by pair
    ("test_rope_example", ROPE_MISTAKES["rotation in the wrong direction"], ["sat's key", "1 radian",
                                                                             "rotation in the wrong direction"]),
    ("test_rope_example", ROPE_MISTAKES["frequencies base^(-i/d)"], ["x = [1, 0, 1, 0]", "pair i = 1",
                                                                     "frequencies base^(-i/d)"]),
    ("test_rope_base", ROPE_MISTAKES["base ignored"], ["base=100", "base ignored"]),
    ("test_rope_shapes", ROPE_MISTAKES["positions along the wrong axis"], ["positions along the wrong axis"]),
    # a float64 input right only to float32 precision gets a hint
    ("test_rope_example", A.rope_float32_angles, ["float32 precision", "dtype=x.dtype"]),
    ("test_rope_shapes", A.rope_float32_angles, ["float32 precision", "dtype=x.dtype"]),
    # the relative-position test says which property fails
    ("test_rope_relative_position", A.rope_angle_quadratic, ["depend only on m - n", "score(m="]),
    ("test_rope_relative_position", A.rope_added_not_rotated, ["position 0"]),
    ("test_rope_relative_position", A.rope_identity, ["positions 0 and 1"]),
    ("test_rope_relative_position", ROPE_MISTAKES["not a rotation (sign error)"], ["length of q",
                                                                                   "not a rotation (sign error)"]),
    # gradients, types, inputs
    ("test_rope_gradients_and_inputs", A.rope_detached, ["does not require grad", ".detach()"]),
    ("test_rope_shapes", A.rope_in_place, ["modified its input x in place"]),
    ("test_rope_example", A.rope_float32, ["dtype float32", "float64"]),
    ("test_rope_base", A.rope_no_base_argument, ["unexpected keyword argument 'base'", "apply_rope(x, base=10000.0)"]),
])
def test_the_message_says_what_is_wrong(grade_id, answer, phrases):
    text = message(grade_id, answer)
    for phrase in phrases:
        assert phrase in text, f"{phrase!r} not in:\n{text}"


def test_default_base_is_not_diagnosed_as_base_ignored():
    # with the default base, "base ignored" gives the right answer: naming it would mislead
    text = message("test_rope_example", ROPE_MISTAKES["rotation in the wrong direction"])
    assert "base ignored" not in text, text


def test_forbidden_call_messages_are_clear():
    for grade_id, answer, name in (("test_sinusoidal_example", A.table_calls_reference, "sinusoidal_encoding"),
                                   ("test_rope_example", A.rope_calls_reference, "apply_rope"),
                                   ("test_rope_example", A.rope_uses_reference_table, "sinusoidal_encoding")):
        with pytest.raises(ForbiddenCall) as err:
            check(grade_id, answer)
        assert f"firstprinciples.reference.{name}" in str(err.value) and "scores 0" in str(err.value)


def _doubled(fn):
    def answer(x, base=10000.0):
        return 2 * fn(x, base)

    return answer


@pytest.mark.parametrize("answer, cell", [
    # a rotation by other angles keeps RoPE's relative property, and loses the value tests
    (lambda x, base=10000.0: A.rope_complex(x, base=500.0), "test_rope_relative_position"),
    # wrong values with honest gradients keep the gradient test
    (_doubled(A.rope_complex), "test_rope_gradients_and_inputs"),
])
def test_a_test_of_a_property_compares_no_values(answer, cell):
    from exercises.harness import kernel_failures, recheck_failures

    for failed in (kernel_failures(ROPE, answer), recheck_failures(ROPE, answer, seed=3)):
        assert cell not in failed and "test_rope_shapes" in failed, failed


def test_the_recheck_names_the_mistake_without_showing_secret_values():
    from exercises.harness import recheck_failures

    failed = recheck_failures(ROPE, ROPE_MISTAKES["positions along the wrong axis"], seed=4)
    text = failed["test_rope_relative_position"]
    assert "positions along the wrong axis" in text and "Your results match a typical mistake" in text, text


def test_the_seeds_table_is_within_the_stated_tolerance():
    # the source computes in float32; at its default length (4096) the angles are off by up to
    # about 2.5e-4 rad, within the tolerance 1e-5 + 2e-7 max_len
    seed = A.seed_table_via_module()
    for max_len, d_model in D.TABLE_SIZES:
        got, want = seed(max_len, d_model), reference.sinusoidal_encoding(max_len, d_model, dtype=torch.float64)
        assert (got.double() - want).abs().max().item() <= D.table_atol(max_len)


def test_the_complex_formulation_agrees_with_the_reference():
    g = torch.Generator().manual_seed(0)
    for base in (10000.0, 100.0):
        x = torch.randn(2, 3, 7, 10, generator=g, dtype=torch.float64)
        torch.testing.assert_close(A.rope_complex(x, base), A.correct_rope(x, base), atol=1e-12, rtol=0)


def test_the_tests_are_fast():
    for exercise, fn in ((TABLE, A.correct_table), (ROPE, A.correct_rope)):
        for gid in exercise.tests:
            start = time.perf_counter()
            check(gid, fn)
            assert time.perf_counter() - start < 2.0, gid
