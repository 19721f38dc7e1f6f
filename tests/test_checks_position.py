"""Every positional-encoding check accepts right answers and rejects typical wrong ones.

Two exercise functions, ``sinusoidal_encoding`` and ``apply_rope``. Each check
is run against correct answers (the reference, unwrapped; the source's own
``SinusoidalPE`` table, built through the module or pasted as the function's
body; other correct formulations) and against a catalogue of buggy variants:
the package's named mistakes plus wrong answers that cannot be "named". The
tables say exactly which checks each variant must fail; every check must
reject at least five variants.
"""
from __future__ import annotations

import math
import re
import textwrap

import pytest
import torch

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import position as P
from checktable import (
    assert_passes,
    correct_answers_test,
    expectations_test,
    naming_test,
    naming_test_for,
    outcome,
    rejections_test,
    variants_test,
)
from seeds import seed_code, seed_namespace

TABLE_CHECKS = {
    "example": P.check_sinusoidal_example,
    "tables": P.check_sinusoidal_tables,
}
ROPE_CHECKS = {
    "example": P.check_rope_example,
    "shapes": P.check_rope_shapes,
    "base": P.check_rope_base,
    "relative": P.check_rope_relative_position,
    "grads": P.check_rope_gradients_and_inputs,
}
ALL_TABLE = set(TABLE_CHECKS)
ALL_ROPE = set(ROPE_CHECKS)


# ================================================================ sinusoidal_encoding
correct_table = as_student_code(reference.sinusoidal_encoding)


def table_float32_exp_log(max_len, d_model):
    # A correct answer computed in float32 throughout, via exp and log.
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.empty(max_len, d_model)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


def table_by_stacking(max_len, d_model):
    # A correct answer without in-place writes: stack (sin, cos) and flatten.
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    angle = pos / 10000.0 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1).float()


def seed_table_via_module():
    """The source's SinusoidalPE module pasted in, its table returned."""
    SinusoidalPE = seed_namespace("SinusoidalPE")["SinusoidalPE"]

    def sinusoidal_encoding(max_len, d_model):
        return SinusoidalPE(d_model, max_len).pe[0]

    return sinusoidal_encoding


def seed_table_as_body():
    """The table-building lines of the source's SinusoidalPE.__init__, pasted as
    the body of ``sinusoidal_encoding`` (read from the seed at test time)."""
    code = seed_code("SinusoidalPE")
    imports = "\n".join(line for line in code.splitlines() if re.match(r"^(import|from) ", line))
    init = re.search(r"def __init__\(self[^)]*\):\n(.*?)(?=\n    def |\Z)", code, flags=re.S).group(1)
    body = [
        line for line in textwrap.dedent(init).splitlines()
        if line.strip() and "super()" not in line and "register_buffer" not in line
    ]
    assert any("pe[:, 0::2]" in line for line in body), body  # the construction was found
    src = imports + "\n\ndef sinusoidal_encoding(max_len, d_model):\n" + textwrap.indent("\n".join(body), "    ")
    src += "\n    return pe\n"
    ns: dict = {}
    exec(compile(src, "<seed table as body>", "exec"), ns)
    return ns["sinusoidal_encoding"]


def table_calls_reference(max_len, d_model):
    return reference.sinusoidal_encoding(max_len, d_model)


def table_from_reference_rope(max_len, d_model):
    # Rotating (0, 1) by the angle gives (-sin, cos): flip the sign of the even columns.
    x = torch.zeros(max_len, d_model, dtype=torch.float64)
    x[:, 1::2] = 1.0
    flip = torch.tensor([-1.0, 1.0], dtype=torch.float64).repeat(d_model // 2)
    return (reference.apply_rope(x) * flip).float()


def table_float64(max_len, d_model):
    return correct_table(max_len, d_model, dtype=torch.float64)


def table_with_batch_dim(max_len, d_model):
    return correct_table(max_len, d_model)[None]


def table_numpy(max_len, d_model):
    return correct_table(max_len, d_model).numpy()


def table_arguments_swapped(max_len, d_model):
    return correct_table(d_model, max_len)


_EXAMPLE_TABLE = correct_table(6, 4).tolist()


def table_hard_coded_example(max_len, d_model):
    return torch.tensor(_EXAMPLE_TABLE)


def table_base_1000(max_len, d_model):
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    angle = pos * 1000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1).float()


TABLE_OTHER = {
    "calls the reference": (table_calls_reference, ALL_TABLE),
    "built with the reference apply_rope": (table_from_reference_rope, ALL_TABLE),
    "returns float64": (table_float64, ALL_TABLE),
    "keeps a batch dimension": (table_with_batch_dim, ALL_TABLE),
    "returns numpy": (table_numpy, ALL_TABLE),
    "arguments swapped": (table_arguments_swapped, ALL_TABLE),
    "hard-coded worked example": (table_hard_coded_example, {"tables"}),
    "base 1000": (table_base_1000, ALL_TABLE),
}
TABLE_MISTAKE_FAILS = {
    "sin and cos swapped": ALL_TABLE,
    "frequencies 10000^(-i/d_model)": ALL_TABLE,
    "positions start at 1": ALL_TABLE,
    "frequencies 10000^(+2i/d_model)": ALL_TABLE,
    "cos columns use their own index": ALL_TABLE,
    "sin and cos in two halves": ALL_TABLE,
}
TABLE_VARIANTS = {m.label: (m.fn, TABLE_MISTAKE_FAILS[m.label]) for m in P.TABLE_MISTAKES}
TABLE_VARIANTS.update(TABLE_OTHER)

TABLE_CORRECT = {
    "reference": lambda: correct_table,
    "float32 exp/log": lambda: table_float32_exp_log,
    "stacked": lambda: table_by_stacking,
    "seed module": seed_table_via_module,
    "seed construction as body": seed_table_as_body,
}


# ================================================================ apply_rope
correct_rope = as_student_code(reference.apply_rope)


def rope_complex(x, base=10000.0):
    # A correct answer with complex numbers: pair i is x[2i] + j x[2i+1].
    T, d = x.shape[-2], x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    angle = torch.arange(T, dtype=x.dtype)[:, None] * theta  # (T, d/2)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).reshape(x.shape)


def rope_rotate_every_two(x, base=10000.0):
    # A correct answer in the "x * cos + rotate_every_two(x) * sin" form, with
    # cos and sin repeated over both members of a pair.
    T, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    angle = torch.outer(torch.arange(T, dtype=x.dtype), inv).repeat_interleave(2, dim=-1)  # (T, d)
    swapped = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
    return x * angle.cos() + swapped * angle.sin()


def rope_calls_reference(x, base=10000.0):
    return reference.apply_rope(x, base)


def rope_uses_reference_table(x, base=10000.0):
    T, d = x.shape[-2], x.shape[-1]
    table = reference.sinusoidal_encoding(T, d, dtype=x.dtype)  # sin, cos of pos * 10000^(-2i/d)
    s, c = table[:, 0::2], table[:, 1::2]
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * c - o * s, e * s + o * c), dim=-1).flatten(-2)


def rope_in_place(x, base=10000.0):
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    e, o = x[..., 0::2].clone(), x[..., 1::2].clone()
    x[..., 0::2] = e * angle.cos() - o * angle.sin()
    x[..., 1::2] = e * angle.sin() + o * angle.cos()
    return x


def rope_detached(x, base=10000.0):
    return correct_rope(x.detach(), base)


def rope_numpy(x, base=10000.0):
    return correct_rope(x.detach(), base).numpy()


def rope_float32(x, base=10000.0):
    return correct_rope(x, base).float()


def rope_returns_tuple(x, base=10000.0):
    return correct_rope(x, base), torch.arange(x.shape[-2])


def rope_identity(x, base=10000.0):
    return x.clone()


def rope_float32_angles(x, base=10000.0):
    # torch.arange(T) and an int tensor / d give float32 angles whatever x's dtype.
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T)[:, None] * base ** (-torch.arange(0, d, 2) / d)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()), -1).flatten(-2)


def rope_T_from_first_axis(x, base=10000.0):
    T, d = x.shape[0], x.shape[-1]  # right for (T, d), the batch size otherwise
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()), -1).flatten(-2)


def rope_added_not_rotated(x, base=10000.0):
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    return x + torch.stack((angle.sin(), angle.cos()), -1).flatten(-2)


def rope_angle_quadratic(x, base=10000.0):
    # Still a rotation that keeps position 0, but the angle grows like pos ** 2.
    T, d = x.shape[-2], x.shape[-1]
    pos = torch.arange(T, dtype=x.dtype)
    angle = (pos**2)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()), -1).flatten(-2)


def rope_no_base_argument(x):
    return correct_rope(x)


ROPE_OTHER = {
    "calls the reference": (rope_calls_reference, ALL_ROPE),
    "uses the reference sinusoidal table": (rope_uses_reference_table, ALL_ROPE),
    "modifies its input": (rope_in_place, ALL_ROPE),
    "detached": (rope_detached, {"grads"}),
    "returns numpy": (rope_numpy, ALL_ROPE),
    "casts to float32": (rope_float32, ALL_ROPE),
    "returns a tuple": (rope_returns_tuple, ALL_ROPE),
    "position ignored": (rope_identity, ALL_ROPE - {"grads"}),
    "angles in float32": (rope_float32_angles, {"example", "shapes", "base"}),
    "T = x.shape[0]": (rope_T_from_first_axis, ALL_ROPE - {"example"}),  # crashes on batches
    "added, not rotated": (rope_added_not_rotated, ALL_ROPE - {"grads"}),
    "no base argument": (rope_no_base_argument, {"base"}),
    "angle grows with pos ** 2": (rope_angle_quadratic, ALL_ROPE - {"grads"}),
}
ROPE_MISTAKE_FAILS = {
    "pairs taken as halves": {"example", "shapes", "base"},
    "rotated pairs not interleaved back": {"example", "shapes", "base", "relative"},
    "rotation in the wrong direction": {"example", "shapes", "base"},
    "base ignored": {"base"},
    "positions along the wrong axis": {"shapes", "base", "relative"},
    "frequencies base^(-i/d)": {"example", "shapes", "base"},
    "positions start at 1": {"example", "shapes", "base", "relative"},
    "not a rotation (sign error)": {"example", "shapes", "base", "relative"},
}
ROPE_VARIANTS = {m.label: (m.fn, ROPE_MISTAKE_FAILS[m.label]) for m in P.ROPE_MISTAKES}
ROPE_VARIANTS.update(ROPE_OTHER)

ROPE_CORRECT = {
    "reference": correct_rope,
    "complex numbers": rope_complex,
    "rotate every two": rope_rotate_every_two,
}


# ================================================================ tests
test_every_mistake_has_an_expectation = expectations_test(
    (TABLE_MISTAKE_FAILS, P.TABLE_MISTAKES), (ROPE_MISTAKE_FAILS, P.ROPE_MISTAKES)
)


@pytest.mark.parametrize("answer", sorted(TABLE_CORRECT))
@pytest.mark.parametrize("name", sorted(TABLE_CHECKS))
def test_correct_tables_pass(name, answer):
    assert_passes(TABLE_CHECKS[name], TABLE_CORRECT[answer](), f"{answer} fails {name}")


test_correct_rope_passes = correct_answers_test(ROPE_CHECKS, ROPE_CORRECT)


def test_visible_parts_pass_for_correct_answers():
    for answer in TABLE_CORRECT.values():
        P.check_sinusoidal_tables(answer(), full=False)
    for fn in ROPE_CORRECT.values():
        P.check_rope_shapes(fn, full=False)
        P.check_rope_relative_position(fn, full=False)


def test_seed_table_equals_the_reference():
    # The source computes in float32; at its default length (4096) the angles are
    # off by up to ~2.5e-4 rad, within the checks' stated tolerance 1e-5 + 2e-7 * max_len.
    seed = seed_table_via_module()
    for max_len, d_model in P.TABLE_SHAPES:
        got, want = seed(max_len, d_model), reference.sinusoidal_encoding(max_len, d_model, dtype=torch.float64)
        assert (got.double() - want).abs().max().item() <= 1e-5 + 2e-7 * max_len


test_table_variant_fails_exactly_the_expected_checks = variants_test(TABLE_CHECKS, TABLE_VARIANTS)
test_rope_variant_fails_exactly_the_expected_checks = variants_test(ROPE_CHECKS, ROPE_VARIANTS)
test_each_table_check_rejects_at_least_five_variants = rejections_test(TABLE_CHECKS, TABLE_VARIANTS)
test_each_rope_check_rejects_at_least_five_variants = rejections_test(ROPE_CHECKS, ROPE_VARIANTS)
test_table_example_names_the_mistake = naming_test_for(
    P.check_sinusoidal_example, TABLE_VARIANTS, sorted(TABLE_MISTAKE_FAILS)
)
test_rope_failure_names_the_mistake = naming_test(
    ROPE_CHECKS,
    ROPE_VARIANTS,
    [
        ("pairs taken as halves", "example"),
        ("rotated pairs not interleaved back", "example"),
        ("rotation in the wrong direction", "example"),
        ("frequencies base^(-i/d)", "example"),
        ("positions start at 1", "example"),
        ("not a rotation (sign error)", "example"),
        ("base ignored", "base"),
        ("positions along the wrong axis", "shapes"),
        ("positions along the wrong axis", "relative"),
        ("not a rotation (sign error)", "relative"),
    ],
)


def test_default_base_is_not_diagnosed_as_base_ignored():
    # With the default base, "base ignored" gives the right answer; naming it would mislead.
    ok, err = outcome(P.check_rope_example, ROPE_VARIANTS["rotation in the wrong direction"][0])
    assert not ok and "base ignored" not in str(err)


def test_float32_angles_get_a_precision_hint():
    ok, err = outcome(P.check_rope_example, rope_float32_angles)
    assert not ok and "float32 precision" in str(err) and "dtype=x.dtype" in str(err)


def test_forbidden_call_messages_are_clear():
    ok, err = outcome(P.check_sinusoidal_example, table_calls_reference)
    assert "firstprinciples.reference.sinusoidal_encoding" in str(err) and "scores 0" in str(err)
    ok, err = outcome(P.check_rope_example, rope_calls_reference)
    assert "firstprinciples.reference.apply_rope" in str(err) and "scores 0" in str(err)


def test_shape_messages_help():
    ok, err = outcome(P.check_sinusoidal_example, table_with_batch_dim)
    assert "(1, 6, 4)" in str(err) and "batch dimension" in str(err)
    ok, err = outcome(P.check_sinusoidal_example, table_float64)
    assert "float32" in str(err)


def test_table_message_gives_the_formula():
    ok, err = outcome(P.check_sinusoidal_example, TABLE_VARIANTS["frequencies 10000^(-i/d_model)"][0])
    assert "10000^(-2/4)" in str(err) and "pair i = 1" in str(err), str(err)


def test_relative_messages_say_which_property_fails():
    ok, err = outcome(P.check_rope_relative_position, rope_angle_quadratic)
    assert not ok and "depend only on m - n" in str(err) and "score(m=" in str(err), str(err)
    ok, err = outcome(P.check_rope_relative_position, rope_added_not_rotated)
    assert not ok and "position 0" in str(err), str(err)
    ok, err = outcome(P.check_rope_relative_position, rope_identity)
    assert not ok and "positions 0 and 1" in str(err), str(err)


def test_independent_complex_formulation_agrees_with_the_reference():
    g = torch.Generator().manual_seed(0)
    for base in (10000.0, 100.0):
        x = torch.randn(2, 3, 7, 10, generator=g, dtype=torch.float64)
        torch.testing.assert_close(P._rope_complex(x, base), correct_rope(x, base), atol=1e-12, rtol=0)


def test_checks_are_fast():
    import time

    for checks, fn in ((TABLE_CHECKS, correct_table), (ROPE_CHECKS, correct_rope)):
        for name, check in checks.items():
            start = time.perf_counter()
            check(fn)
            assert time.perf_counter() - start < 2.0, name
