"""Every causal-mask check accepts right answers and rejects typical wrong ones.

Each check is run against the reference, other correct constructions and the
mask line of the source's own code (read from the seed at test time): all must
pass. A catalogue of buggy variants (the package's named mistakes plus calls to
PyTorch's causal mask or the reference, wrong types and dtypes) must fail
exactly the checks listed; every check must reject at least five variants.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
from checktable import assert_passes, correct_answers_test, expectations_test, naming_test, outcome, rejections_test, variants_test
from seeds import SEED_DIRS
from torch.nn.modules import transformer as torch_transformer

from course import as_student_code
from firstprinciples import reference
from firstprinciples.checks import causal_mask as C

CHECKS = {
    "seed": C.check_seed_mask,
    "shapes": C.check_shapes_and_dtype,
    "values": C.check_values,
    "peek": C.check_no_peeking,
}
ALL = set(CHECKS)

# The reference, unwrapped, is what a correct student would write.
correct = as_student_code(reference.causal_mask)


def via_masked_fill(T):
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    return torch.zeros(T, T).masked_fill(future, float("-inf"))


def via_arange(T):
    i = torch.arange(T)
    return torch.where(i[None, :] > i[:, None], float("-inf"), 0.0).to(torch.float32)


def via_loops(T):
    return torch.tensor([[0.0 if s <= t else float("-inf") for s in range(T)] for t in range(T)])


CORRECT = {"reference": correct, "masked_fill": via_masked_fill, "arange": via_arange, "loops": via_loops}


def _seed_texts():
    for folder in SEED_DIRS:
        for f in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
            yield f.read_text(encoding="utf-8")


def _missing(what):
    msg = f"{what} was not found in the seeds ({', '.join(map(str, SEED_DIRS))})"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


def seed_mask_line():
    """The source's own mask code (one expression of seq_len), as a function of T."""
    for text in _seed_texts():
        m = re.search(r"^mask\s*=\s*(torch\.triu\(.*\))\s*$", text, flags=re.M)
        if m:
            expr = compile(m.group(1), "<seed mask>", "eval")
            return lambda T: eval(expr, {"torch": torch, "seq_len": T})
    _missing("the source's mask line")


def seed_table():
    """The source's printed 4 x 4 mask, row by row."""
    for text in _seed_texts():
        rows = re.findall(r"^tok\d\s*\[([^\]]*)\]", text, flags=re.M)
        if len(rows) == 4:
            return tuple(tuple(float(v) for v in row.split(",")) for row in rows)
    _missing("the source's 4 x 4 mask table")


def calls_reference(T):
    return reference.causal_mask(T)


def calls_torch_mask(T):
    return torch.nn.Transformer.generate_square_subsequent_mask(T)


def calls_torch_mask_by_alias(T):
    return torch_transformer._generate_square_subsequent_mask(T)


def calls_torch_mask_and_hides_it(T):
    torch.nn.Transformer.generate_square_subsequent_mask(T)  # result thrown away
    return correct(T)


def float64_mask(T):
    return correct(T).double()


def minus_1e4(T):
    return torch.triu(torch.full((T, T), -1e4), diagonal=1)


def lowest_float(T):
    return torch.triu(torch.full((T, T), torch.finfo(torch.float32).min), diagonal=1)


def via_numpy(T):
    return correct(T).numpy()


def as_list(T):
    return correct(T).tolist()


_SEED_4 = correct(4)


def hard_coded_four(T):
    return _SEED_4.clone()


OTHER_VARIANTS = {
    # name: (function, the checks it must fail)
    "calls the reference": (calls_reference, ALL),
    "calls nn.Transformer.generate_square_subsequent_mask": (calls_torch_mask, ALL),
    "calls torch's helper by an alias": (calls_torch_mask_by_alias, ALL),
    "calls torch's mask and throws it away": (calls_torch_mask_and_hides_it, ALL),
    "float64 mask": (float64_mask, ALL),  # float32 scores + float64 mask: float64 weights @ float32 V fails
    "-1e4 instead of -inf": (minus_1e4, {"seed", "values"}),
    "float32's lowest value instead of -inf": (lowest_float, {"seed", "values"}),
    "returns numpy": (via_numpy, ALL),
    "returns a list": (as_list, ALL),
    "always the 4 x 4 mask": (hard_coded_four, ALL - {"seed"}),
}

# Which checks each named mistake must fail.
MISTAKE_FAILS = {
    "diagonal masked": {"seed", "values", "peek"},
    "one future position visible": {"seed", "values", "peek"},
    "tril and triu swapped": {"seed", "values", "peek"},
    "boolean mask instead of float": ALL,
    "0/1 mask instead of 0/-inf (1 = hidden)": {"seed", "values", "peek"},
    "0/1 mask instead of 0/-inf (1 = visible)": {"seed", "values", "peek"},
    "large negative number instead of -inf": {"seed", "values"},
    "-inf multiplied by a 0/1 matrix": {"seed", "values", "peek"},
    "shape (T + 1, T + 1)": ALL,
    "extra leading dimension": {"seed", "shapes", "values"},
}

VARIANTS = {m.label: (m.fn, MISTAKE_FAILS[m.label]) for m in C.MISTAKES}
VARIANTS.update(OTHER_VARIANTS)


test_every_mistake_has_an_expectation = expectations_test((MISTAKE_FAILS, C.MISTAKES))


def test_the_checks_mask_is_the_sources_table():
    assert seed_table() == C.SEED_MASK_4
    assert torch.equal(correct(4), torch.tensor(seed_table()))


test_correct_answers_pass = correct_answers_test(CHECKS, CORRECT)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_seed_mask_line_passes(name):
    assert_passes(CHECKS[name], seed_mask_line(), f"the source's mask fails {name}")


test_variant_fails_exactly_the_expected_checks = variants_test(CHECKS, VARIANTS)
test_each_check_rejects_at_least_five_variants = rejections_test(CHECKS, VARIANTS)


@pytest.mark.parametrize("variant", sorted(v for v, (_, fails) in VARIANTS.items() if "peek" in fails))
def test_visible_part_of_the_peeking_check_catches_the_leaks(variant):
    ok, _ = outcome(lambda fn: C.check_no_peeking(fn, full=False), VARIANTS[variant][0])
    assert not ok


test_failure_names_the_mistake = naming_test(
    CHECKS,
    VARIANTS,
    [
        ("diagonal masked", "seed"),
        ("one future position visible", "seed"),
        ("one future position visible", "peek"),
        ("tril and triu swapped", "values"),
        ("tril and triu swapped", "peek"),
        ("0/1 mask instead of 0/-inf (1 = hidden)", "seed"),
        ("0/1 mask instead of 0/-inf (1 = visible)", "values"),
    ],
)


@pytest.mark.parametrize("fn", [C.MISTAKES[6].fn, minus_1e4, lowest_float])
def test_large_negative_number_is_rejected_with_the_reason(fn):
    ok, err = outcome(C.check_values, fn)
    assert "not -inf" in str(err) and "exactly 0" in str(err), str(err)


def test_boolean_mask_message():
    ok, err = outcome(C.check_shapes_and_dtype, VARIANTS["boolean mask instead of float"][0])
    assert "boolean" in str(err) and "float" in str(err), str(err)


def test_nan_message_explains_zero_times_inf():
    ok, err = outcome(C.check_values, VARIANTS["-inf multiplied by a 0/1 matrix"][0])
    assert "0 * -inf is NaN" in str(err), str(err)


def test_torch_mask_message_is_clear():
    ok, err = outcome(C.check_seed_mask, calls_torch_mask)
    assert "generate_square_subsequent_mask" in str(err) and "scores 0" in str(err), str(err)


def test_seed_check_prints_both_matrices():
    ok, err = outcome(C.check_seed_mask, VARIANTS["diagonal masked"][0])
    assert "Yours:" in str(err) and "The source's mask for 4 tokens" in str(err), str(err)


def test_profile_hook_is_restored():
    before = __import__("sys").getprofile()
    C.check_seed_mask(correct)
    outcome(C.check_seed_mask, calls_torch_mask)
    assert __import__("sys").getprofile() is before
